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

// The command words as interface values, boxed once rather than per call.
var (
	evalSHA           any = "evalsha"
	scriptSHAValue    any = scriptSHA
	scriptSourceValue any = scriptSource
)

// call is one request's trip through the batcher, pooled: the caller
// always gets its answer (by the deadline at the latest) and then puts
// the call back.
type call struct {
	cmd       [7]any // EVALSHA, sha, 1, &key, rate, burst, requested
	key       string // boxed as &key, which costs no allocation
	deadline  time.Time
	clientCtx context.Context // only asked whether the client left, so the call need not be sent
	result    Result
	err       error
	done      chan struct{} // one answer per use
}

var calls = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// errQueueFull fails a request at once when Redis is far behind.
var errQueueFull = errors.New("too many requests waiting for Redis")

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
					c.done <- struct{}{}
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
		// Calls whose time (nearly) ran out in the queue, or whose client
		// left, are answered without being sent: they must not take
		// tokens, nor cut short the batch, which ends at its earliest
		// deadline.
		last := time.Now().Add(l.timeout / 10)
		live := batch[:0]
		for _, c := range batch {
			switch {
			case c.deadline.Before(last):
				c.err = context.DeadlineExceeded
			case c.clientCtx.Err() != nil:
				c.err = c.clientCtx.Err()
			default:
				live = append(live, c)
				continue
			}
			c.done <- struct{}{}
		}
		if len(live) > 0 {
			l.sendBatch(worker, live)
		}
		clear(batch)
	}
}

// sendBatch sends one batch, sends the script's source for the calls
// that found it missing, and delivers every call's own result or error.
// The batch ends at the earliest deadline among its calls, so no caller
// waits past its own.
func (l *limiter) sendBatch(worker int, batch []*call) {
	deadline := batch[0].deadline
	for _, c := range batch[1:] {
		if c.deadline.Before(deadline) {
			deadline = c.deadline
		}
	}
	ctx := l.timers[worker].start(deadline)
	defer l.timers[worker].stop()

	cmds := l.pipeline(ctx, batch, false)
	// After a restart, failover or SCRIPT FLUSH the server has lost the
	// script: send the source for those that failed, which caches it again.
	var lost []*call
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			lost = append(lost, batch[i])
		}
	}
	if len(lost) > 0 {
		l.pipeline(ctx, lost, true)
	}

	for _, c := range batch {
		if c.err != nil {
			l.reloadSlotsAfter(c.err)
		}
		c.done <- struct{}{}
	}
}

// pipeline sends the calls in one pipeline (or alone when there is one),
// by SHA or, with source, with the script's source, and stores each
// call's own result or error.
func (l *limiter) pipeline(ctx context.Context, batch []*call, source bool) []*redis.Cmd {
	args := func(c *call) []any {
		if !source {
			return c.cmd[:]
		}
		eval := c.cmd
		eval[0], eval[1] = "eval", scriptSourceValue
		return eval[:]
	}
	cmds := make([]*redis.Cmd, len(batch))
	if len(batch) == 1 {
		cmds[0] = l.client.Do(ctx, args(batch[0])...)
	} else {
		pipe := l.client.Pipeline()
		for i, c := range batch {
			cmds[i] = pipe.Do(ctx, args(c)...)
		}
		_, _ = pipe.Exec(ctx) // each command carries its own error
	}
	for i, c := range batch {
		c.result, c.err = parseReply(cmds[i])
	}
	return cmds
}

// parseReply reads the script's reply: {allowed, remaining, microseconds
// until the requested tokens fit}.
func parseReply(cmd *redis.Cmd) (Result, error) {
	if err := cmd.Err(); err != nil {
		return Result{}, err
	}
	v, ok := cmd.Val().([]any)
	if !ok || len(v) != 3 {
		return Result{}, fmt.Errorf("unexpected script reply %v", cmd.Val())
	}
	allowed, _ := v[0].(int64)
	remaining, _ := v[1].(int64)
	retry, _ := v[2].(int64)
	return Result{
		Allowed:    allowed == 1,
		Remaining:  remaining,
		RetryAfter: time.Duration(retry) * time.Microsecond,
	}, nil
}

// batchTimer gives the batches of one worker a context that ends at the
// batch's deadline, as context.WithDeadline would, but reuses one timer
// and, until a batch times out, one Done channel: a batch of one request
// then costs one allocation instead of five. go-redis needs both the
// deadline (for socket deadlines) and Done (to stop waiting for a new
// connection).
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
