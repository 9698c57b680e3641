package redisstore

// The slots an admitted request holds in Redis while it is served: its
// hold, renewed until the response ends, then released (concurrent.go
// has the limit itself; slotqueue.go sends the renewals and releases).

import (
	"context"
	_ "embed"
	"sync"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"go.uber.org/zap"
)

// slotHold is the slots one request holds, from admission until its
// response has ended; it renews those in Redis every third of the
// shortest hold.
type slotHold struct {
	store  *Store  // whose request holds them
	id     *string // the slot id, as the script took it (the kind's Begin): a word less than an any
	keys   []string
	limits []*limit.Limit
	// slots are, in Redis, each limit's slots n for this request as
	// script argument when one resolves them per request (plans); nil
	// when every limit's n is fixed, in its args (slotN).
	slots []any
	every time.Duration
	// Room for the slices of a request with one concurrent limit, the
	// usual, so that its hold is one allocation of 160 bytes (room for
	// maxInlineBuckets made it 112 bytes more:
	// BenchmarkServeHTTPConcurrentParallel 1436 -> 1330 B/op).
	inlineKeys   [1]string
	inlineLimits [1]*limit.Limit

	mu       sync.Mutex
	released bool

	// Where the client's renewals keep it while it holds slots in Redis
	// (slotRenewals), under their lock: renewing counts its keys whose
	// renewal is queued or on its way, and a release meanwhile waits for
	// them (releaseAfter). renewedAt is when the last take or renewal
	// of its slots was sent, on the monotonic clock of clockStart (a
	// time.Time would take two more words): once released, renewedAt
	// plus a slot's hold is when that slot has expired by itself, which
	// ends the retries of its release (slotRenewals.answerReleases).
	// due: the last renewal failed, or found a slot gone, so the next
	// tick renews again. gone: a renewal found a slot gone, so the next
	// asks for it back (concurrent.lua). lost: a call that takes a slot
	// (a take, or a renewal that asks for one back) had its answer lost,
	// and may still land: the release is sent again until it frees the
	// slot. The flags and renewing (int16: a hold has one key per
	// concurrent limit) fit in the mutex's word's padding: the hold stays
	// one allocation of 160 bytes.
	releaseAfter bool
	due          bool
	gone         bool
	lost         bool
	// queues: some of its limits queue (limit.Bucket.Queues): its release
	// hands the slot to the head of the queue (concurrent.lua's
	// "releaseq").
	queues     bool
	renewing   int16
	prev, next *slotHold
	renewedAt  time.Duration
}

// slotN is the slots n of held slot i, as script argument.
func (s *slotHold) slotN(i int) any {
	if s.slots != nil {
		return s.slots[i]
	}
	return s.limits[i].Args[1]
}

// takeHolding takes a request's buckets in Redis, some of them slots
// held while served: a refusal while a release of one of their slots is
// on its way waits for it, then asks once more; a take whose reply was
// lost gives back the slots it may have taken (releaseLostTake).
//
// A request that may queue for a slot does not wait for the releases:
// a release of a slot of a limit that queues hands it to the head of
// the queue, in which the request waits.
func (s *Store) takeHolding(ctx context.Context, r *limit.Call) (bool, error) {
	sent, buckets := r.Sent, r.Buckets
	slots := s.client.slots()
	returning := slots.returning(buckets) && !(r.MayQueue && queueIndex(buckets) >= 0)
	allowed, err := s.takeAll(ctx, r, sent, buckets)
	if returning && err == nil && !allowed && slots.awaitReturns(s.client, buckets, sent.Add(s.client.timeout/2)) {
		allowed, err = s.takeAll(ctx, r, sent, buckets) // what its key held was on its way back
	}
	if err != nil {
		s.releaseLostTake(buckets, err)
	}
	return allowed, err
}

// Hold is the slots that an admitted request took in Redis, renewed
// there until its response has ended.
func (s *Store) Hold(r *limit.Call) limit.Holding {
	if hold := s.holdSlots(r.Buckets); hold != nil {
		return hold
	}
	return nil
}

// holdSlots records the slots in Redis a request was admitted with, and
// starts their renewal; nil when it holds none.
func (s *Store) holdSlots(buckets []limit.Bucket) *slotHold {
	return s.holdSlotsExcept(buckets, -1)
}

// holdSlotsExcept is holdSlots but for the slot of buckets[except] (a
// waiting request's other slots: waitForSlot).
func (s *Store) holdSlotsExcept(buckets []limit.Bucket, except int) *slotHold {
	k := limit.FirstHeld(buckets)
	if k == len(buckets) || k == except && k == len(buckets)-1 {
		return nil
	}
	hold := &slotHold{store: s}
	hold.keys, hold.limits = hold.inlineKeys[:0], hold.inlineLimits[:0]
	perRequest := false
	for i := k; i < len(buckets); i++ {
		if i == except {
			continue
		}
		b := &buckets[i]
		hold.id = b.Args[2].(*string)
		hold.keys = append(hold.keys, b.Key)
		hold.limits = append(hold.limits, b.Limit)
		perRequest = perRequest || !b.Limit.Fixed
		hold.queues = hold.queues || b.Queues()
		if every := holdOf(b.Limit) / 3; hold.every == 0 || every < hold.every {
			hold.every = every
		}
	}
	if perRequest {
		for i := k; i < len(buckets); i++ {
			if i != except {
				hold.slots = append(hold.slots, buckets[i].Args[1])
			}
		}
	}
	s.client.slots().renewals.add(hold)
	return hold
}

// Release gives the slots back, once.
func (s *slotHold) Release() {
	s.mu.Lock()
	if s.released {
		s.mu.Unlock()
		return
	}
	s.released = true
	s.mu.Unlock()
	// Pending from now, so that a refused request of these keys waits for
	// it (awaitReturns); queued once no renewal of the slots is on its
	// way, and before the hold stops keeping the client open (Destruct).
	l := s.store.client
	p := l.slots()
	p.releases.add(s.keys, 1)
	if p.renewals.leave(s) {
		l.queueRelease(s)
		p.renewals.left()
	}
}

// slotRenewals are the slot holds of a client's requests in flight, in
// a ring, renewed by one ticker for all of them (renewSlots), where a
// timer for each cost every request an allocation and two changes of
// the runtime's timer heap (make bench, concurrent@64: 0.817 -> 0.845 of
// allowed@64; BenchmarkServeHTTPConcurrentParallel 13 -> 12 allocs).
type slotRenewals struct {
	start sync.Once
	mu    sync.Mutex
	ring  slotHold // the ring's head, no hold
	// held counts the holds whose release is not queued yet: in the ring,
	// or waiting for their renewal's answer. The client lives while
	// there are any, or retries (Destruct).
	held int
	// retries are the releases sent again at the next tick
	// (answerReleases), or sooner for a refused request of their key
	// (retryNow).
	retries []slotRetry
}

// RenewTick is how often the renewals look for holds due: a hold renews
// on the last tick before a third of its own has passed since its last
// renewal (or take), so every third of it at the latest, and at most a
// sixth of the shortest hold early: a slot always has two thirds of its
// hold left, less a round trip. A renewal that failed is due again at
// the next tick.
//
// The shortest hold is a concurrent limit's least, a second (its check
// refuses less).
const RenewTick = time.Second / 6

// add puts a hold that took its slots now in the ring, and starts the
// ticker with the first.
func (r *slotRenewals) add(s *slotHold) {
	r.startTicker(s.store.client)
	now := time.Since(limit.ClockStart)
	r.mu.Lock()
	defer r.mu.Unlock()
	s.renewedAt = now
	s.prev, s.next = r.ring.prev, &r.ring
	r.ring.prev.next = s
	r.ring.prev = s
	r.held++
}

// startTicker starts the renewals' ticker, once.
func (r *slotRenewals) startTicker(l *Client) {
	r.start.Do(func() {
		r.ring.prev, r.ring.next = &r.ring, &r.ring
		go r.renewSlots(l)
	})
}

// holding says whether any request holds slots, or has its release
// still to queue, or to send again.
func (r *slotRenewals) holding() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.held > 0 || len(r.retries) > 0
}

// leave takes a released hold out of the ring. It says false when a
// renewal of its slots is queued or on its way: its answer then queues
// the release (renewed). Sent meanwhile, the release could land first,
// and a renewal that asked for a gone slot back take it again.
func (r *slotRenewals) leave(s *slotHold) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if s.next != nil {
		s.prev.next, s.next.prev = s.next, s.prev
		s.prev, s.next = nil, nil
	}
	if s.renewing > 0 {
		s.releaseAfter = true
		return false
	}
	return true
}

// forget takes a hold out of the ring without releasing its slots: a
// waiting request's other slots, which its hold holds from its grant on
// (waitForSlot).
func (r *slotRenewals) forget(s *slotHold) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if s.next != nil {
		s.prev.next, s.next.prev = s.next, s.prev
		s.prev, s.next = nil, nil
	}
	r.held--
}

// left counts a hold whose release is queued.
func (r *slotRenewals) left() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.held--
}

// renewed takes the answer to the renewal of holds' slots (a hold once
// per key; reply per key, or err): a failed one is due again at the next
// tick, as is one that found a slot gone (it then asks for it back); a
// hold released meanwhile has its release queued now.
func (r *slotRenewals) renewed(l *Client, holds []*slotHold, reply []int64, err error) {
	var release []*slotHold
	r.mu.Lock()
	for i, s := range holds {
		switch {
		case err != nil:
			s.due = true
		case i < len(reply) && reply[i] == 3: // gone: the next renewal asks for it back
			s.gone, s.due = true, true
		case i < len(reply) && reply[i] == 0: // gone, and every slot taken: asked again at its next renewal
			s.gone = true
		}
		if s.renewing--; s.renewing == 0 && s.releaseAfter {
			release = append(release, s)
		}
	}
	r.mu.Unlock()
	for _, s := range release {
		l.queueRelease(s)
		r.left()
	}
}

// renewSlots queues, every RenewTick until the client stops, the
// releases to send again (answerReleases) whose slots have not expired
// yet, and the renewal of each hold whose last renewal (or take) will be
// a third of its hold ago before the next tick, or that is due again,
// unless one is on its way already; and wakes a worker: the workers send
// them spread over their batches (slotQueue.calls).
func (r *slotRenewals) renewSlots(l *Client) {
	ticker := time.NewTicker(RenewTick)
	defer ticker.Stop()
	var due, restore []*slotHold
	var retries []slotRetry
	for {
		select {
		case <-l.batcher.Done():
			return
		case tick := <-ticker.C:
			now := tick.Sub(limit.ClockStart)
			r.mu.Lock()
			for _, x := range r.retries {
				if now < x.until {
					retries = append(retries, x)
				} else if x.pending { // expired by now
					l.slots().releases.add(x.key[:], -1)
				}
			}
			clear(r.retries)
			r.retries = r.retries[:0]
			for s := r.ring.next; s != &r.ring; s = s.next {
				if s.renewing == 0 && (s.due || now-s.renewedAt+RenewTick > s.every) {
					s.renewedAt, s.renewing, s.due = now, int16(len(s.keys)), false
					if s.gone {
						// Asks for its slots back: a take, which may land
						// after the release if its answer is lost.
						s.gone, s.lost = false, true
						restore = append(restore, s)
					} else {
						due = append(due, s)
					}
				}
			}
			r.mu.Unlock()
			if len(retries) > 0 {
				l.queueRetries(retries)
				clear(retries)
				retries = retries[:0]
			}
			if len(due) > 0 || len(restore) > 0 {
				l.slots().renewQueue.addRenewals(due, false)
				l.slots().renewQueue.addRenewals(restore, true)
				l.batcher.Wake()
			}
			clear(due)
			clear(restore)
			due, restore = due[:0], restore[:0]
		}
	}
}

// slotsFailed warns, throttled, of a renewal or release that Redis
// failed (one refused by an open breaker was told when it opened).
func (s *Store) slotsFailed(op any, err error) {
	if err == redisbatch.ErrBreakerOpen {
		return
	}
	s.report.Warn("Redis failed while renewing or releasing concurrency slots; a renewal is sent again at the next tick, a release until its slot would have expired",
		err, zap.Any("op", op))
}

// slotGone tells, at debug level, of a slot gone at its renewal (expired,
// freed by the admin API, or lost with Redis's data): the renewal that
// asked for it back brought it back (reply 2), or found every slot taken
// (0); a renewal that did not ask (3) leaves that to the next one.
func (s *Store) slotGone(reply int64) {
	var msg string
	switch reply {
	case 2:
		msg = "a concurrency slot was gone at its renewal; it is back"
	case 3:
		msg = "a concurrency slot was gone at its renewal; the next renewal, at the next tick, asks for it back"
	default:
		msg = "a concurrency slot was gone at its renewal and every slot of its limit is taken; its request runs on uncounted, and its next renewal asks again"
	}
	s.report.Debug(msg)
}

// peekHeld reads what requests hold of a bucket held while served: the
// slots of a concurrent limit's set in Redis, without changing them.
func (l *Client) peekHeld(ctx context.Context, key string) (limit.View, error) {
	reply, err := l.client.Eval(ctx, peekSlotsSource, []string{key}).Int64Slice()
	if err != nil {
		return limit.View{}, err
	}
	v := limit.View{InUse: int64(len(reply))}
	for _, us := range reply {
		v.Expiries = append(v.Expiries, time.Duration(us)*time.Microsecond)
	}
	return v, nil
}

// peekSlotsSource reads the live slots of one set: the microseconds until
// each expires, by Redis time, soonest first. It writes nothing.
//
//go:embed peekslots.lua
var peekSlotsSource string

// holdOf is how long a request's hold on a limit held while served
// lasts unless renewed; holdArgOf the same as a script argument.
func holdOf(l *limit.Limit) time.Duration { d, _ := l.Held.HoldFor(); return d }
func holdArgOf(l *limit.Limit) any        { _, arg := l.Held.HoldFor(); return arg }

// Script arguments of concurrent.lua, boxed once.
var (
	renewArg   any = "renew"
	releaseArg any = "release"
	// releaseQueuedArg releases slots of limits that queue: each goes to
	// the head of its queue.
	releaseQueuedArg any = "releaseq"
)

// releaseOp is the release op of the hold's slots.
func (s *slotHold) releaseOp() any {
	if s.queues {
		return releaseQueuedArg
	}
	return releaseArg
}
