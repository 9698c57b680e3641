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
