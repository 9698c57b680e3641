package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
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

// call is one script call's trip through the batcher, pooled. Its caller
// waits for the answer until the call's own deadline and then puts the
// call back; a caller that gives up at its deadline leaves the call to
// the worker, which puts it back once done with it. Its slices keep
// their room from use to use.
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
	// state says who owns the call once it is queued: callPending until
	// the worker answers it or its caller gives it up.
	state atomic.Int32
	sent  atomic.Bool // the worker sent it to Redis
	timer *time.Timer // the caller's deadline, kept from use to use
	// then, when set, takes the answer instead of done, in the worker:
	// for a call nobody waits on (a settlement, charge.go).
	then answerTaker
}

const (
	callPending int32 = iota
	callAnswered
	callAbandoned
)

// answerTaker takes a call's answer in the worker that got it, quickly,
// and releases the call.
type answerTaker interface{ takeAnswer(*call) }

var calls = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// release clears a call, keeping its room, and puts it back.
func (c *call) release() {
	clear(c.args)
	c.args, c.keys, c.reply = c.args[:0], c.keys[:0], c.reply[:0]
	c.script, c.clientCtx, c.breaker, c.err, c.then = nil, nil, nil, nil, nil
	c.state.Store(callPending)
	c.sent.Store(false)
	calls.Put(c)
}

// answer hands the call back to its caller, or puts it back when the
// caller has given it up. The worker must not touch it afterwards.
func (c *call) answer() {
	if c.then != nil {
		c.then.takeAnswer(c)
		return
	}
	if c.state.CompareAndSwap(callPending, callAnswered) {
		c.done <- struct{}{}
		return
	}
	c.release()
}

// wait waits for the call's answer until its deadline. A call still
// unanswered then is given up: its batch mates may be answered later, but
// its own time is over; sent says whether it had gone to Redis. The
// worker puts a call given up back.
func (c *call) wait() (answered, sent bool) {
	d := time.Until(c.deadline)
	if c.timer == nil {
		c.timer = time.NewTimer(d)
	} else {
		c.timer.Reset(d)
	}
	select {
	case <-c.done:
		if !c.timer.Stop() {
			select { // a timer channel of Go before 1.23 may hold the expiry
			case <-c.timer.C:
			default:
			}
		}
		return true, true
	case <-c.timer.C:
		sent = c.sent.Load() // before giving it up, after which it is the worker's
		if c.state.CompareAndSwap(callPending, callAbandoned) {
			return false, sent
		}
		<-c.done // answered just now
		return true, true
	}
}

// overloadError fails calls that this instance could not send in time.
// They follow on_error like a Redis failure, but no breaker counts them:
// Redis may well be fine.
type overloadError string

func (e overloadError) Error() string { return string(e) }

var (
	errQueueFull      = overloadError("too many requests waiting for Redis")
	errWaitedOut      = overloadError("the timeout ran out while the call waited to be sent to Redis")
	errExpiredInQueue = overloadError("too little of the timeout was left, after waiting to be sent, for a round trip to Redis")
)

// errBreakerOpen fails calls to a node whose breaker is open.
var errBreakerOpen = errors.New("circuit breaker open: this Redis node failed repeatedly")

// errNoAnswer fails a call that was sent and not answered within its
// timeout.
var errNoAnswer = fmt.Errorf("no answer from Redis within the timeout: %w", context.DeadlineExceeded)

// work is one worker: it waits for a call, takes whatever else is
// already queued (never waiting for more), and sends them together.
func (l *limiter) work(worker int) {
	defer l.workers.Done()
	batch := make([]*call, 0, maxBatch+1)
	var released []*call
	for {
		var ok bool
		if batch, released, ok = l.takeBatch(worker, batch[:0], released[:0]); !ok {
			return
		}
		if len(batch) > 0 {
			l.sendBatch(worker, batch)
		}
		l.order.landed(worker)
		clear(batch)
	}
}

// takeBatch waits for a call, or for releases or renewals queued, and
// takes the batch that it starts, in order with the other worker's
// batches (batchOrder); false once the limiter stops. released is room
// for the calls of queued releases.
func (l *limiter) takeBatch(worker int, batch, released []*call) (_, _ []*call, ok bool) {
	o := &l.order
	o.mu.Lock()
	defer o.mu.Unlock()
	clear(o.settles[worker]) // its last batch has landed
	o.settles[worker] = o.settles[worker][:0]
	select {
	case c := <-l.queue:
		batch = append(batch, c)
	case <-l.wake: // releases or renewals queued (concurrent.go)
	case <-l.stop:
		// Nothing enters the queue, nor the releases' queue, any more;
		// answer what is left.
		for {
			select {
			case c := <-l.queue:
				c.err = errLimiterClosed
				c.answer()
				continue
			default:
			}
			now := time.Now()
			left, _ := l.releaseQueue.calls(l, releaseArg, now, batch[:0])
			left, _ = l.renewQueue.calls(l, renewArg, now, left)
			if len(left) == 0 {
				return batch, released, false
			}
			for _, c := range left {
				c.err = errLimiterClosed
				c.answer()
			}
			clear(left)
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
	// Queued releases go first: a slot given back before a take of its
	// key in the same batch is free for it. Queued renewals go last;
	// each at most maxSlotsPerCall slots a batch.
	now := time.Now()
	var moreReleased, moreRenewed bool
	if released, moreReleased = l.releaseQueue.calls(l, releaseArg, now, released); len(released) > 0 {
		batch = slices.Insert(batch, 0, released...)
		clear(released)
	}
	batch, moreRenewed = l.renewQueue.calls(l, renewArg, now, batch)
	if moreReleased || moreRenewed {
		l.wakeWorker()
	}
	o.take(worker, batch)
	return batch, released, true
}

// batchOrder keeps settlements ahead of the calls queued after them
// across the two workers. A settlement is queued before its response
// ends, so the client's next request is queued after it, and must see
// it in Redis; but the workers' pipelines go on two connections, and a
// later one may reach Redis first. So a worker takes its batch from the
// queue holding mu: each batch is then queued wholly after the other
// worker's last. A batch that holds a call of a bucket that the other
// worker's batch in flight settles waits until that batch is answered.
// Batches without such a call go at once, as before.
type batchOrder struct {
	mu sync.Mutex
	// settles are the keys that each worker's last batch settles (read
	// and written under mu); flying is held by a worker while that batch
	// is in flight.
	settles [pipelinesInFlight][]string
	flying  [pipelinesInFlight]sync.Mutex
	holding [pipelinesInFlight]bool // by the worker itself
}

// take notes the settlements of the worker's new batch, and waits for
// the other worker's batch in flight when it settles a bucket of this
// one. Called under mu.
func (o *batchOrder) take(worker int, batch []*call) {
	for _, c := range batch {
		if settlements.is(c) {
			o.settles[worker] = append(o.settles[worker], c.keys...)
		}
	}
	if len(o.settles[worker]) > 0 {
		o.flying[worker].Lock()
		o.holding[worker] = true
	}
	for other, settled := range o.settles {
		if other != worker && len(settled) > 0 && anyKeyOf(batch, settled) {
			o.flying[other].Lock() // until that batch has landed
			o.flying[other].Unlock()
		}
	}
}

// landed says that the worker's batch is answered.
func (o *batchOrder) landed(worker int) {
	if o.holding[worker] {
		o.holding[worker] = false
		o.flying[worker].Unlock()
	}
}

// anyKeyOf says whether a call of batch has one of keys.
func anyKeyOf(batch []*call, keys []string) bool {
	for _, c := range batch {
		for _, k := range c.keys {
			if slices.Contains(keys, k) {
				return true
			}
		}
	}
	return false
}

// sendBatch sends one batch and answers every call with its own result
// or error. Calls that must not go are answered first: those whose
// client left (they must not take tokens), those with less of their
// timeout left than a round trip takes now (this instance's overload,
// not a Redis failure: sent, they would only take tokens for callers
// gone by the time the answer comes), and those whose node's breaker is
// open. The rest go in one pipeline that may take until the latest of
// their deadlines, and each caller waits until its own (call.wait): a
// call short of time does not cut its batch mates' time short. Then
// each node in the batch counts once for its breaker: a success if it
// answered, else one failure however many of its calls failed.
func (l *limiter) sendBatch(worker int, batch []*call) {
	last := time.Now().Add(l.sendMargin())
	var deadline time.Time
	live := batch[:0]
	for _, c := range batch {
		switch {
		case c.clientCtx.Err() != nil:
			c.err = c.clientCtx.Err()
		case c.deadline.Before(last): // also every call its caller gave up
			c.err = errExpiredInQueue
		default:
			if c.deadline.After(deadline) {
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
		c.sent.Store(true)
		send = append(send, c)
	}
	if len(send) == 0 {
		return
	}

	send = l.merge(send, settlements) // charge.go
	sent := time.Now()
	cmds := l.pipeline(ctx, send, false)
	for _, cmd := range cmds {
		if cmd.Err() == nil { // answered: a round trip, not a deadline
			l.rtt.add(time.Since(sent))
			break
		}
	}
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

	// What each node did.
	nodes := l.outcomes[worker][:0]
	for _, c := range send {
		if c.err != nil && c.clientCtx.Err() != nil {
			continue // a client that left says nothing about Redis
		}
		i := 0
		for i < len(nodes) && nodes[i].breaker != c.breaker {
			i++
		}
		if i == len(nodes) {
			nodes = append(nodes, nodeOutcome{breaker: c.breaker})
		}
		if c.err == nil {
			nodes[i].answered = true
		} else {
			nodes[i].err = c.err
		}
	}
	for i := range nodes {
		n := &nodes[i]
		if n.answered && n.breaker.success() || !n.answered && n.breaker.failure() {
			l.breakerChanged(n.breaker)
		}
		if !n.answered {
			l.reloadSlotsAfter(n.err)
		}
		*n = nodeOutcome{}
	}
	l.outcomes[worker] = nodes[:0]
	for _, c := range send { // after the breakers: an answer closes the breaker before its caller goes on
		c.answer()
	}
}

// nodeOutcome is what one node did for a batch: answered at least one of
// its calls, or failed them all (err is one of the failures).
type nodeOutcome struct {
	breaker  *breaker
	answered bool
	err      error
}

// sendMargin is the least time a call must have left to be sent: what a
// round trip takes now, at least a tenth of the timeout, and at most half
// of it, so that calls with half their time left always go, and keep the
// estimate current when Redis slows down.
func (l *limiter) sendMargin() time.Duration {
	return max(l.timeout/10, min(l.rtt.estimate(), l.timeout/2))
}

// roundTrips estimates how long a pipeline takes, from sending to the
// last answer, as TCP estimates its round trips (RFC 6298): a moving
// mean and mean deviation of recent ones. Both workers update it without
// a lock; an update lost to the other worker's changes little.
type roundTrips struct {
	mean, dev atomic.Int64 // nanoseconds
}

func (r *roundTrips) add(d time.Duration) {
	sample, mean, dev := int64(d), r.mean.Load(), r.dev.Load()
	if mean == 0 {
		r.mean.Store(sample)
		r.dev.Store(sample / 2)
		return
	}
	diff := sample - mean
	r.mean.Store(mean + diff/8)
	r.dev.Store(dev + (max(diff, -diff)-dev)/4)
}

// estimate is the time within which a pipeline is answered but rarely
// later: the mean plus four deviations, as TCP's retransmission timeout.
func (r *roundTrips) estimate() time.Duration {
	return time.Duration(r.mean.Load() + 4*r.dev.Load())
}

// onceCmd is a script call that go-redis must not send again: its
// Cluster client otherwise re-sends after errors where the script may
// have run already (EOF, a reset connection, a read timeout), and each
// run takes tokens. MOVED and ASK are still followed (the script did not
// run there), and a call whose connection never opened may be dialed
// again. Every script the batcher sends answers an array of integers,
// which an IntSliceCmd reads as they come, where a Cmd boxes each one
// into a []any (BenchmarkServeHTTPAllowed 12 -> 10 allocs). An error
// reply (a key of another type) fails its own call only; a reply of
// another shape, which none of our scripts gives, would also fail the
// calls after it in the pipeline, and go-redis drops that connection
// (TestScriptReplyOfAnotherShapeFailsItsCall).
type onceCmd struct{ *redis.IntSliceCmd }

func (onceCmd) NoRetry() bool { return true }

// pipeline sends the calls in one pipeline (or alone when there is one),
// by SHA or, with source, with the script's source, and stores each
// call's own reply or error.
func (l *limiter) pipeline(ctx context.Context, batch []*call, source bool) []*redis.IntSliceCmd {
	cmds := make([]*redis.IntSliceCmd, len(batch))
	for i, c := range batch {
		if source {
			eval := append([]any{"eval", c.script.source}, c.args[2:]...)
			cmds[i] = redis.NewIntSliceCmd(ctx, eval...)
		} else {
			cmds[i] = redis.NewIntSliceCmd(ctx, c.args...)
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
		if c.err = cmds[i].Err(); c.err == nil {
			c.reply = append(c.reply, cmds[i].Val()...)
		}
	}
	return cmds
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

// mergedKind is a kind of call that the batcher joins into one script
// call per batch, on one Redis server (not a Cluster, where the keys of
// one call must share a slot): its script answers each key on its own,
// so one call does for all of them what one call each would, at less
// cost to Redis and this instance. Each call gets its part of the
// answer; the node's breaker counts them as one call.
type mergedKind struct {
	name   string // in the error of a reply too short for its parts
	script *luaScript
	lead   []any // the script's own arguments, before the keys' ones
	width  int   // values of the reply per key
	is     func(c *call) bool
}

// merge joins the calls of kind in send into one where the first of them
// stands, without changing what any call sees: a call of kind joins only
// when no call between the first and it has one of its keys (it then
// runs before those calls, which it does not touch); else it starts
// another merged call where it stands. Their parts keep their order.
func (l *limiter) merge(send []*call, kind *mergedKind) []*call {
	if l.cluster != nil {
		return send
	}
	out := send[:0] // never longer than what has been read of send
	first := -1     // where the open merged call stands in out
	var open *mergedCall
	for _, c := range send {
		switch {
		case !kind.is(c):
			out = append(out, c)
			continue
		case first >= 0 && !anyKeyOf(out[first+1:], c.keys):
			if open == nil {
				open = mergedCalls.Get().(*mergedCall)
				open.parts = append(open.parts, out[first])
			}
			open.parts = append(open.parts, c)
			continue
		}
		if open != nil {
			out[first], open = open.call(kind), nil
		}
		first = len(out)
		out = append(out, c)
	}
	if open != nil {
		out[first] = open.call(kind)
	}
	return out
}

// call is the one call that sends the parts.
func (m *mergedCall) call(kind *mergedKind) *call {
	m.kind = kind
	c := calls.Get().(*call)
	for _, p := range m.parts {
		c.keys = append(c.keys, p.keys...)
	}
	c.command(kind.script)
	c.args = append(c.args, kind.lead...)
	for _, p := range m.parts {
		c.args = append(c.args, p.args[3+len(p.keys)+len(kind.lead):]...) // after evalsha, sha, count, keys and lead
	}
	first := m.parts[0]
	c.clientCtx, c.breaker, c.deadline, c.then = first.clientCtx, first.breaker, first.deadline, m
	return c
}

// mergedCall is the calls that one merged call sends (pooled).
type mergedCall struct {
	kind  *mergedKind
	parts []*call
}

var mergedCalls = sync.Pool{New: func() any { return new(mergedCall) }}

// takeAnswer hands each call its part of the merged call's answer.
func (m *mergedCall) takeAnswer(c *call) {
	off := 0
	for _, p := range m.parts {
		n := m.kind.width * len(p.keys)
		switch p.err = c.err; {
		case c.err != nil:
		case off+n > len(c.reply):
			p.err = fmt.Errorf("unexpected %s reply %v", m.kind.name, c.reply)
		default:
			p.reply = append(p.reply[:0], c.reply[off:off+n]...)
		}
		off += n
		p.answer()
	}
	c.release()
	clear(m.parts)
	m.kind, m.parts = nil, m.parts[:0]
	mergedCalls.Put(m)
}
