package redisbatch

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Batching: calls that arrive while a Redis call is in flight wait in
// the queue and go out together in one pipeline (one write, one read).
// A worker never waits for more calls, so an idle line adds no delay.
const (
	pipelinesInFlight = 2
	maxBatch          = 128
	queueLength       = 4096
)

// QueueLength is how many calls may wait to be sent; a call beyond them
// fails with ErrQueueFull.
const QueueLength = queueLength

// PipelinesInFlight is how many pipelines the batcher keeps in flight
// at most, one per worker.
const PipelinesInFlight = pipelinesInFlight

// Hooks is what the batcher asks of its owner, in a worker, never on a
// caller's path.
type Hooks interface {
	// FirstCalls appends to batch the calls queued apart that go ahead
	// of a batch's own (slot releases); more says some are left, for
	// which the batcher wakes a worker again (Wake).
	FirstCalls(now time.Time, batch []*Call) (_ []*Call, more bool)
	// LastCalls appends those that go after a batch's own (renewals).
	LastCalls(now time.Time, batch []*Call) (_ []*Call, more bool)
	// BreakerChanged says a node's breaker opened or closed.
	BreakerChanged(node string, open bool, failures int64)
	// BreakerDropped says a Cluster node whose breaker was open no
	// longer serves slots: its breaker is gone, and no longer open.
	BreakerDropped(node string)
}

// Config is what New needs.
type Config struct {
	Client redis.UniversalClient
	// Node names the one node when Client is not a Cluster's, for its
	// breaker and logs.
	Node    string
	Timeout time.Duration
	Hooks   Hooks
	// Settlements are calls that a call queued after them must find done
	// in Redis: the batcher keeps them ahead of later calls across its
	// two pipelines, and merges them per batch.
	Settlements *MergedKind
}

// Batcher is one Redis client's queue of script calls, its two workers
// and its node breakers.
type Batcher struct {
	client      redis.UniversalClient
	cluster     *redis.ClusterClient // the same client, when it is a Cluster's
	node        string
	timeout     time.Duration
	hooks       Hooks
	settlements *MergedKind

	queue   chan *Call
	wake    chan struct{}
	stop    chan struct{}
	workers sync.WaitGroup
	timers  [pipelinesInFlight]*batchTimer // one per worker
	order   batchOrder                     // keeps settlements ahead of the calls queued after them

	breakers nodeBreakers
	// rtt estimates how long a pipeline takes now.
	rtt roundTrips
	// outcomes is each worker's room for what a batch's nodes answered.
	outcomes [pipelinesInFlight][]nodeOutcome

	// closing guards closed: once set, no call enters the queue, so every
	// queued call is answered before the workers stop.
	closing sync.RWMutex
	closed  bool
	// lastCall is when the latest call was queued, in Unix nanoseconds.
	lastCall atomic.Int64
	// lastReload throttles cluster slot reloads after network errors.
	lastReload atomic.Int64
}

// New starts a batcher's workers (and, on a Cluster, the pruning of its
// breakers) until Close.
func New(c Config) *Batcher {
	b := newBatcher(c)
	for i := range pipelinesInFlight {
		b.workers.Add(1)
		go b.work(i)
	}
	if b.cluster != nil {
		go b.pruneBreakers()
	}
	return b
}

func newBatcher(c Config) *Batcher {
	b := &Batcher{
		client:      c.Client,
		node:        c.Node,
		timeout:     c.Timeout,
		hooks:       c.Hooks,
		settlements: c.Settlements,
		queue:       make(chan *Call, queueLength),
		wake:        make(chan struct{}, 1),
		stop:        make(chan struct{}),
	}
	b.cluster, _ = c.Client.(*redis.ClusterClient)
	for i := range b.timers {
		b.timers[i] = newBatchTimer()
	}
	return b
}

// Done is closed when the batcher closes.
func (b *Batcher) Done() <-chan struct{} { return b.stop }

// Send queues a call made with Command and its arguments, and waits for
// its answer, which comes within the timeout from now. It returns the
// answered call, for the caller to read and release; nil when the
// timeout ran out first (the worker releases it then).
func (b *Batcher) Send(clientCtx context.Context, now time.Time, c *Call) (*Call, error) {
	c.ClientCtx = clientCtx
	if err := b.Enqueue(c, now); err != nil {
		return c, err
	}
	if answered, sent := c.Wait(); !answered {
		if sent {
			return nil, ErrNoAnswer
		}
		return nil, ErrWaitedOut
	}
	return c, c.Err
}

// Enqueue queues a call that is ready but for its deadline, which the
// timeout from now sets; the caller waits on it (Call.Wait), or its Then
// takes the answer, unless this refuses it (the batcher closed, or its
// queue full).
func (b *Batcher) Enqueue(c *Call, now time.Time) error {
	c.Deadline = now.Add(b.timeout)
	b.lastCall.Store(now.UnixNano())
	b.closing.RLock()
	defer b.closing.RUnlock()
	if b.closed {
		return ErrClosed
	}
	select {
	case b.queue <- c:
		return nil
	default:
		return ErrQueueFull
	}
}

// WhileOpen runs queue, which queues calls apart (see Hooks), unless the
// batcher has closed, and wakes a worker for them; false when closed.
// Such calls count as calls for Idle, and every one queued before the
// batcher closed is taken by a worker (in FirstCalls or LastCalls).
func (b *Batcher) WhileOpen(queue func()) bool {
	b.lastCall.Store(time.Now().UnixNano())
	b.closing.RLock()
	defer b.closing.RUnlock()
	if b.closed {
		return false
	}
	queue()
	b.Wake()
	return true
}

// Wake wakes a worker for calls queued apart, unless one is woken
// already.
func (b *Batcher) Wake() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// Idle says whether no call waits in the queue and none came for d.
func (b *Batcher) Idle(d time.Duration) bool {
	return time.Since(time.Unix(0, b.lastCall.Load())) >= d && len(b.queue) == 0
}

// Close refuses calls from now on, answers every queued call, and stops
// the workers. It does not close the client.
func (b *Batcher) Close() {
	b.closing.Lock()
	b.closed = true
	b.closing.Unlock()
	close(b.stop)
	b.workers.Wait()
}

// work is one worker: it waits for a call, takes whatever else is
// already queued (never waiting for more), and sends them together.
func (b *Batcher) work(worker int) {
	defer b.workers.Done()
	batch := make([]*Call, 0, maxBatch+1)
	var first []*Call
	for {
		var ok bool
		if batch, first, ok = b.takeBatch(worker, batch[:0], first[:0]); !ok {
			return
		}
		if len(batch) > 0 {
			b.sendBatch(worker, batch)
		}
		b.order.landed(worker)
		clear(batch)
	}
}

// takeBatch waits for a call, or for calls queued apart, and takes the
// batch that it starts, in order with the other worker's batches
// (batchOrder); false once the batcher stops. first is room for the
// calls that go ahead of the batch's own.
func (b *Batcher) takeBatch(worker int, batch, first []*Call) (_, _ []*Call, ok bool) {
	o := &b.order
	o.mu.Lock()
	defer o.mu.Unlock()
	clear(o.settles[worker]) // its last batch has landed
	o.settles[worker] = o.settles[worker][:0]
	select {
	case c := <-b.queue:
		batch = append(batch, c)
	case <-b.wake: // calls queued apart
	case <-b.stop:
		// Nothing enters the queue, nor the calls apart, any more;
		// answer what is left.
		for {
			select {
			case c := <-b.queue:
				c.Err = ErrClosed
				c.Answer()
				continue
			default:
			}
			now := time.Now()
			left, _ := b.hooks.FirstCalls(now, batch[:0])
			left, _ = b.hooks.LastCalls(now, left)
			if len(left) == 0 {
				return batch, first, false
			}
			for _, c := range left {
				c.Err = ErrClosed
				c.Answer()
			}
			clear(left)
		}
	}
more:
	for len(batch) < maxBatch {
		select {
		case c := <-b.queue:
			batch = append(batch, c)
		default:
			break more
		}
	}
	// The first calls go first: a slot given back before a take of its
	// key in the same batch is free for it. The last calls go last.
	now := time.Now()
	var moreFirst, moreLast bool
	if first, moreFirst = b.hooks.FirstCalls(now, first); len(first) > 0 {
		batch = slices.Insert(batch, 0, first...)
		clear(first)
	}
	batch, moreLast = b.hooks.LastCalls(now, batch)
	if moreFirst || moreLast {
		b.Wake()
	}
	o.take(worker, batch, b.settlements)
	return batch, first, true
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
func (o *batchOrder) take(worker int, batch []*Call, settlements *MergedKind) {
	if settlements != nil {
		for _, c := range batch {
			if settlements.Is(c) {
				o.settles[worker] = append(o.settles[worker], c.Keys...)
			}
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
func anyKeyOf(batch []*Call, keys []string) bool {
	for _, c := range batch {
		for _, k := range c.Keys {
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
// their deadlines, and each caller waits until its own (Call.Wait): a
// call short of time does not cut its batch mates' time short. Then
// each node in the batch counts once for its breaker: a success if it
// answered, else one failure however many of its calls failed.
func (b *Batcher) sendBatch(worker int, batch []*Call) {
	last := time.Now().Add(b.sendMargin())
	var deadline time.Time
	live := batch[:0]
	for _, c := range batch {
		switch {
		case c.ClientCtx.Err() != nil:
			c.Err = c.ClientCtx.Err()
		case c.Deadline.Before(last): // also every call its caller gave up
			c.Err = ErrExpiredInQueue
		default:
			if c.Deadline.After(deadline) {
				deadline = c.Deadline
			}
			live = append(live, c)
			continue
		}
		c.Answer()
	}
	if len(live) == 0 {
		return
	}
	ctx := b.timers[worker].start(deadline)
	defer b.timers[worker].stop()

	resolved := true
	send := live[:0]
	for _, c := range live {
		c.breaker = b.nodeBreaker(ctx, c.Keys[0], &resolved)
		if !c.breaker.allow() {
			c.Err = ErrBreakerOpen
			c.Answer()
			continue
		}
		c.sent.Store(true)
		send = append(send, c)
	}
	if len(send) == 0 {
		return
	}

	if b.settlements != nil {
		send = b.merge(send, b.settlements)
	}
	sent := time.Now()
	cmds := b.pipeline(ctx, send, false)
	for _, cmd := range cmds {
		if cmd.Err() == nil { // answered: a round trip, not a deadline
			b.rtt.add(time.Since(sent))
			break
		}
	}
	// After a restart, failover or SCRIPT FLUSH the server has lost the
	// script: send the source for those that failed, which caches it again.
	var lost []*Call
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			lost = append(lost, send[i])
		}
	}
	if len(lost) > 0 {
		b.pipeline(ctx, lost, true)
	}

	// What each node did.
	nodes := b.outcomes[worker][:0]
	for _, c := range send {
		if c.Err != nil && c.ClientCtx.Err() != nil {
			continue // a client that left says nothing about Redis
		}
		i := 0
		for i < len(nodes) && nodes[i].breaker != c.breaker {
			i++
		}
		if i == len(nodes) {
			nodes = append(nodes, nodeOutcome{breaker: c.breaker})
		}
		if c.Err == nil {
			nodes[i].answered = true
		} else {
			nodes[i].err = c.Err
		}
	}
	for i := range nodes {
		n := &nodes[i]
		if n.answered && n.breaker.success() || !n.answered && n.breaker.failure() {
			b.breakerChanged(n.breaker)
		}
		if !n.answered {
			b.reloadSlotsAfter(n.err)
		}
		*n = nodeOutcome{}
	}
	b.outcomes[worker] = nodes[:0]
	for _, c := range send { // after the breakers: an answer closes the breaker before its caller goes on
		c.Answer()
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
func (b *Batcher) sendMargin() time.Duration {
	return max(b.timeout/10, min(b.rtt.estimate(), b.timeout/2))
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
func (b *Batcher) pipeline(ctx context.Context, batch []*Call, source bool) []*redis.IntSliceCmd {
	cmds := make([]*redis.IntSliceCmd, len(batch))
	for i, c := range batch {
		if source {
			eval := append([]any{"eval", c.Script.Source}, c.Args[2:]...)
			cmds[i] = redis.NewIntSliceCmd(ctx, eval...)
		} else {
			cmds[i] = redis.NewIntSliceCmd(ctx, c.Args...)
		}
	}
	if len(batch) == 1 { // alone: a pipeline of one costs 7 allocs, 144 B more (BenchmarkServeHTTPAllowed 23 -> 16)
		_ = b.client.Process(ctx, onceCmd{cmds[0]})
	} else {
		pipe := b.client.Pipeline()
		for _, cmd := range cmds {
			_ = pipe.Process(ctx, onceCmd{cmd})
		}
		_, _ = pipe.Exec(ctx) // each command carries its own error
	}
	for i, c := range batch {
		if c.Err = cmds[i].Err(); c.Err == nil {
			c.Reply = append(c.Reply, cmds[i].Val()...)
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
