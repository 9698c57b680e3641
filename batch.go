package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Batching: requests that arrive while a Redis call is in flight wait in
// the queue and go out together in one pipeline (one write, one read).
// A worker never waits for more calls, so an idle line adds no delay.
const (
	pipelinesInFlight = 2
	maxBatch          = 128
	queueLength       = 4096
)

// call is one script call's trip through the batcher, pooled: the caller
// always gets its answer (by the deadline at the latest) and then puts
// the call back. Its slices keep their room from use to use.
type call struct {
	// args are the command: EVALSHA, the script's SHA, the number of
	// keys, &keys[i] for each key, then each bucket's arguments.
	args      []any
	keys      []string // boxed as &keys[i], which costs no allocation
	script    *luaScript
	deadline  time.Time
	clientCtx context.Context // only asked whether the client left, so the call need not be sent
	breaker   *breaker        // of the node that serves the keys
	reply     []int64
	err       error
	done      chan struct{} // one answer per use
	// then, when set, takes the answer instead of done, in the worker:
	// for a call nobody waits on (a settlement, charge.go).
	then answerTaker
}

// answerTaker takes a call's answer in the worker that got it, quickly,
// and releases the call.
type answerTaker interface{ takeAnswer(*call) }

var calls = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// answer hands the call its answer (or error).
func (c *call) answer() {
	if c.then != nil {
		c.then.takeAnswer(c)
		return
	}
	c.done <- struct{}{}
}

// release clears a call, keeping its room, and puts it back.
func (c *call) release() {
	clear(c.args)
	c.args, c.keys, c.reply = c.args[:0], c.keys[:0], c.reply[:0]
	c.script, c.clientCtx, c.breaker, c.err, c.then = nil, nil, nil, nil, nil
	calls.Put(c)
}

// overloadError fails calls that this instance could not send in time.
// They follow on_error like a Redis failure, but no breaker counts them:
// Redis may well be fine.
type overloadError string

func (e overloadError) Error() string { return string(e) }

var (
	errQueueFull      = overloadError("too many requests waiting for Redis")
	errExpiredInQueue = overloadError("the timeout ran out before the call could be sent to Redis")
)

// errBreakerOpen fails calls to a node whose breaker is open.
var errBreakerOpen = errors.New("circuit breaker open: this Redis node failed repeatedly")

// work is one worker: it waits for a call, takes whatever else is
// already queued (never waiting for more), and sends them together.
func (l *limiter) work(worker int) {
	defer l.workers.Done()
	batch := make([]*call, 0, maxBatch)
	for {
		select {
		case c := <-l.queue:
			batch = append(batch[:0], c)
		case <-l.stop:
			// Nothing enters the queue any more; answer what is left.
			for {
				select {
				case c := <-l.queue:
					c.err = errLimiterClosed
					c.answer()
				default:
					return
				}
			}
		}
	more:
		for len(batch) < maxBatch {
			select {
			case c := <-l.queue:
				batch = append(batch, c)
			default:
				break more
			}
		}
		l.sendBatch(worker, batch)
		clear(batch)
	}
}

// sendBatch sends one batch and delivers every call's own result or
// error. Calls that must not go are answered first: those whose time
// (nearly) ran out in the queue or whose client left (they must not take
// tokens), and those whose node's breaker is open. The rest go in one
// pipeline that ends at their earliest deadline, so no caller waits past
// its own; each answer or failure then counts for its node's breaker.
func (l *limiter) sendBatch(worker int, batch []*call) {
	last := time.Now().Add(l.timeout / 10)
	var deadline time.Time
	live := batch[:0]
	for _, c := range batch {
		switch {
		case c.clientCtx.Err() != nil:
			c.err = c.clientCtx.Err()
		case c.deadline.Before(last):
			c.err = errExpiredInQueue
		default:
			if deadline.IsZero() || c.deadline.Before(deadline) {
				deadline = c.deadline
			}
			live = append(live, c)
			continue
		}
		c.answer()
	}
	if len(live) == 0 {
		return
	}
	ctx := l.timers[worker].start(deadline)
	defer l.timers[worker].stop()

	resolved := true
	send := live[:0]
	for _, c := range live {
		c.breaker = l.nodeBreaker(ctx, c.keys[0], &resolved)
		if !c.breaker.allow() {
			c.err = errBreakerOpen
			c.answer()
			continue
		}
		send = append(send, c)
	}
	if len(send) == 0 {
		return
	}

	send = l.mergeSettlements(send) // charge.go
	cmds := l.pipeline(ctx, send, false)
	// After a restart, failover or SCRIPT FLUSH the server has lost the
	// script: send the source for those that failed, which caches it again.
	var lost []*call
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			lost = append(lost, send[i])
		}
	}
	if len(lost) > 0 {
		l.pipeline(ctx, lost, true)
	}

	for _, c := range send {
		if c.err == nil {
			if c.breaker.success() {
				l.breakerChanged(c.breaker, false, 0)
			}
		} else if c.clientCtx.Err() == nil { // a client that left says nothing about Redis
			if opened, failures := c.breaker.failure(); opened {
				l.breakerChanged(c.breaker, true, failures)
			}
			l.reloadSlotsAfter(c.err)
		}
		c.answer()
	}
}

// onceCmd is a script call that go-redis must not send again: its
// Cluster client otherwise re-sends after errors where the script may
// have run already (EOF, a reset connection, a read timeout), and each
// run takes tokens. MOVED and ASK are still followed (the script did not
// run there), and a call whose connection never opened may be dialed
// again.
type onceCmd struct{ *redis.Cmd }

func (onceCmd) NoRetry() bool { return true }

// pipeline sends the calls in one pipeline (or alone when there is one),
// by SHA or, with source, with the script's source, and stores each
// call's own reply or error.
func (l *limiter) pipeline(ctx context.Context, batch []*call, source bool) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(batch))
	for i, c := range batch {
		if source {
			eval := append([]any{"eval", c.script.source}, c.args[2:]...)
			cmds[i] = redis.NewCmd(ctx, eval...)
		} else {
			cmds[i] = redis.NewCmd(ctx, c.args...)
		}
	}
	if len(batch) == 1 { // alone: a pipeline of one costs 7 allocs, 144 B more (BenchmarkServeHTTPAllowed 23 -> 16)
		_ = l.client.Process(ctx, onceCmd{cmds[0]})
	} else {
		pipe := l.client.Pipeline()
		for _, cmd := range cmds {
			_ = pipe.Process(ctx, onceCmd{cmd})
		}
		_, _ = pipe.Exec(ctx) // each command carries its own error
	}
	for i, c := range batch {
		c.reply, c.err = readReply(cmds[i], c.reply)
	}
	return cmds
}

// readReply reads a script's reply, an array of integers, into dst.
func readReply(cmd *redis.Cmd, dst []int64) ([]int64, error) {
	if err := cmd.Err(); err != nil {
		return dst, err
	}
	v, ok := cmd.Val().([]any)
	if !ok {
		return dst, fmt.Errorf("unexpected script reply %v", cmd.Val())
	}
	for _, x := range v {
		n, ok := x.(int64)
		if !ok {
			return dst, fmt.Errorf("unexpected script reply %v", v)
		}
		dst = append(dst, n)
	}
	return dst, nil
}

// batchTimer gives the batches of one worker a context that ends at the
// batch's deadline, as context.WithDeadline would, but reuses one timer
// and, until a batch times out, one Done channel: a batch then costs one
// allocation instead of five (BenchmarkServeHTTPAllowed 20 -> 16 allocs,
// 1192 -> 840 B). go-redis needs both the deadline (for socket
// deadlines) and Done (to stop waiting for a new connection).
type batchTimer struct {
	timer    *time.Timer
	mu       sync.Mutex
	done     chan struct{} // closed when a batch times out, then replaced
	deadline time.Time     // of the batch in flight; zero between batches
}

func newBatchTimer() *batchTimer {
	t := &batchTimer{done: make(chan struct{})}
	t.timer = time.AfterFunc(time.Hour, t.fire)
	t.timer.Stop()
	return t
}

// fire closes Done if the batch in flight is past its deadline; a late
// firing meant for an earlier batch finds a later deadline and does nothing.
func (t *batchTimer) fire() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.deadline.IsZero() && !time.Now().Before(t.deadline) {
		close(t.done)
		t.done = make(chan struct{})
		t.deadline = time.Time{}
	}
}

func (t *batchTimer) start(deadline time.Time) context.Context {
	t.mu.Lock()
	t.deadline = deadline
	done := t.done
	t.mu.Unlock()
	t.timer.Reset(time.Until(deadline))
	return batchContext{deadline: deadline, done: done}
}

func (t *batchTimer) stop() {
	t.timer.Stop()
	t.mu.Lock()
	t.deadline = time.Time{}
	t.mu.Unlock()
}

// batchContext is the context of one batch; see batchTimer.
type batchContext struct {
	deadline time.Time
	done     <-chan struct{}
}

func (c batchContext) Deadline() (time.Time, bool) { return c.deadline, true }
func (c batchContext) Done() <-chan struct{}       { return c.done }
func (c batchContext) Value(any) any               { return nil }

func (c batchContext) Err() error {
	select {
	case <-c.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}
