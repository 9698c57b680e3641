package ratelimit

// The slots an admitted request holds in Redis while it is served: its
// hold, renewed until the response ends, then released (concurrent.go
// has the limit itself; slotqueue.go sends the renewals and releases).

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"go.uber.org/zap"
)

// slotHold is the slots one request holds, from admission until its
// response has ended; it renews those in Redis every third of the
// shortest hold.
type slotHold struct {
	h      *Handler
	in     keeper  // where the slots are held: in Redis (the limiter), or in the process
	id     *string // the slot id, as the script took it (newSlotID): a word less than an any
	keys   []string
	limits []*limit
	// slots are, in Redis, each limit's slots n for this request as
	// script argument when one resolves them per request (plans); nil
	// when every limit's n is fixed, in its args (slotN).
	slots []any
	gens  []uint64 // in-process: each slot's generation
	every time.Duration
	// Room for the slices of a request with one concurrent limit, the
	// usual, so that its hold is one allocation of 208 bytes (320 with
	// room for maxInlineBuckets: BenchmarkServeHTTPConcurrentParallel
	// 1436 -> 1330 B/op).
	inlineKeys   [1]string
	inlineLimits [1]*limit
	inlineGens   [1]uint64

	mu       sync.Mutex
	released bool

	// Where the limiter's renewals keep it while it holds slots in Redis
	// (slotRenewals), under their lock: renewing counts its keys whose
	// renewal is queued or on its way, and a release meanwhile waits for
	// them (releaseAfter). renewedAt is on the monotonic clock of
	// clockStart: a time.Time would take two more words. Once released,
	// renewedAt plus three times every (the shortest hold) is when its
	// slots expire by themselves, which ends the retries of a failed
	// release (slotRenewals.retry).
	releaseAfter bool
	renewing     int32
	prev, next   *slotHold
	renewedAt    time.Duration
}

// slotN is the slots n of held slot i, as script argument.
func (s *slotHold) slotN(i int) any {
	if s.slots != nil {
		return s.slots[i]
	}
	return s.limits[i].args[1]
}

// holdSlots records the slots a request was admitted with, where in
// keeps them (store.keeper), starts their renewal in Redis and counts
// them in the in_flight gauge; nil where nothing keeps them.
func (h *Handler) holdSlots(buckets []bucket, in keeper) *slotHold {
	if in == nil {
		return nil
	}
	_, inRedis := in.(*limiter)
	k := firstHeld(buckets)
	hold := &slotHold{h: h, in: in}
	hold.keys, hold.limits, hold.gens = hold.inlineKeys[:0], hold.inlineLimits[:0], hold.inlineGens[:0]
	perRequest := false
	for i := k; i < len(buckets); i++ {
		b := &buckets[i]
		hold.id = b.args[2].(*string)
		hold.keys = append(hold.keys, b.key)
		hold.limits = append(hold.limits, b.limit)
		perRequest = perRequest || !b.limit.fixed
		if !inRedis {
			hold.gens = append(hold.gens, uint64(b.kindN))
		}
		if every := b.limit.slotRule().hold / 3; hold.every == 0 || every < hold.every {
			hold.every = every
		}
		if g := b.limit.slotRule().inFlight; g != nil {
			g.Inc()
		}
	}
	if inRedis && perRequest {
		for i := k; i < len(buckets); i++ {
			hold.slots = append(hold.slots, buckets[i].args[1])
		}
	}
	if inRedis {
		h.limiter.slots().renewals.add(hold)
	}
	return hold
}

// release gives the slots back, once.
func (s *slotHold) release() {
	s.mu.Lock()
	if s.released {
		s.mu.Unlock()
		return
	}
	s.released = true
	s.mu.Unlock()
	h := s.h
	for _, l := range s.limits {
		if g := l.slotRule().inFlight; g != nil {
			g.Dec()
		}
	}
	if m := s.inMemory(); m != nil {
		for i, key := range s.keys {
			m.releaseSlot(key, s.gens[i])
		}
		return
	}
	// Pending from now, so that a refused request of these keys waits for
	// it (awaitReturns); queued once no renewal of the slots is on its
	// way, and before the hold stops keeping the limiter open (Destruct).
	l := h.limiter
	p := l.slots()
	p.releases.add(s.keys, 1)
	if p.renewals.leave(s) {
		l.queueRelease(s)
		p.renewals.left()
	}
}

// groupEnd is the end of the Cluster slot group of held slots that
// starts at start (the slots of one group are consecutive).
func (s *slotHold) groupEnd(start int) int {
	end := start + 1
	for end < len(s.keys) && s.limits[end].group == s.limits[start].group {
		end++
	}
	return end
}

// call is concurrent.lua's release of the held slots start to end, of
// one Cluster slot group.
func (s *slotHold) call(start, end int) *redisbatch.Call {
	c := redisbatch.NewCall()
	c.Keys = append(c.Keys, s.keys[start:end]...)
	c.Command(concurrentScript)
	c.Args = append(c.Args, releaseArg)
	for range s.keys[start:end] {
		c.Args = append(c.Args, s.id)
	}
	return c
}

// slotRenewals are the slot holds of a limiter's requests in flight, in
// a ring, renewed by one ticker for all of them (renewSlots), where a
// timer for each cost every request an allocation and two changes of
// the runtime's timer heap (make bench, concurrent@64: 0.817 -> 0.845 of
// allowed@64; BenchmarkServeHTTPConcurrentParallel 13 -> 12 allocs).
type slotRenewals struct {
	start sync.Once
	mu    sync.Mutex
	ring  slotHold // the ring's head, no hold
	// held counts the holds whose release is not queued yet: in the ring,
	// or waiting for their renewal's answer. The limiter lives while
	// there are any, or retries (Destruct).
	held int
	// retries are the slots whose release failed, queued again at the
	// next tick (retry).
	retries []slotRetry
}

// slotRetry is the release of one slot of hold, in key[0] (an array, so
// that key[:] is a []string without an allocation).
type slotRetry struct {
	key  [1]string
	hold *slotHold
}

// renewTick is how often the renewals look for holds due: a hold renews
// on the last tick before a third of its own has passed since its last
// renewal (or take), so every third of it at the latest, and at most a
// sixth of the shortest hold early: a slot always has two thirds of its
// hold left, less a round trip. A renewal that failed is due again at
// the next tick.
const renewTick = minSlotHold / 6

// add puts a hold that took its slots now in the ring, and starts the
// ticker with the first.
func (r *slotRenewals) add(s *slotHold) {
	r.startTicker(s.h.limiter)
	now := time.Since(clockStart)
	r.mu.Lock()
	defer r.mu.Unlock()
	s.renewedAt = now
	s.prev, s.next = r.ring.prev, &r.ring
	r.ring.prev.next = s
	r.ring.prev = s
	r.held++
}

// startTicker starts the renewals' ticker, once.
func (r *slotRenewals) startTicker(l *limiter) {
	r.start.Do(func() {
		r.ring.prev, r.ring.next = &r.ring, &r.ring
		go r.renewSlots(l)
	})
}

// holding says whether any request holds slots, or has its release
// still to queue, or to try again.
func (r *slotRenewals) holding() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.held > 0 || len(r.retries) > 0
}

// retry keeps the failed releases of keys (of holds, one per key) for
// the next tick to queue again. A release is idempotent, and one lost to
// a moment of slowness (its deadline passed in a latency spike, a new
// connection's handshake timed out) would otherwise leave its slot taken
// for the rest of its hold: a whole hold for a take whose reply was
// lost. Its slot expires by itself when its hold ends, so each is tried,
// once a tick, only until then; a breaker open answers them without a
// round trip meanwhile.
func (r *slotRenewals) retry(l *limiter, keys []string, holds []*slotHold) {
	now := time.Since(clockStart)
	r.mu.Lock()
	n := len(r.retries)
	for i, s := range holds {
		if now < s.renewedAt+3*s.every {
			r.retries = append(r.retries, slotRetry{key: [1]string{keys[i]}, hold: s})
		}
	}
	kept := len(r.retries) > n
	r.mu.Unlock()
	if kept {
		r.startTicker(l)
	}
}

// leave takes a released hold out of the ring. It says false when a
// renewal of its slots is queued or on its way: its answer then queues
// the release (renewed). Sent meanwhile, the release could land first,
// and the renewal bring the slot back.
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

// left counts a hold whose release is queued.
func (r *slotRenewals) left() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.held--
}

// renewed takes the answer to the renewal of holds' slots (a hold once
// per key): a failed one is due again at the next tick, and a hold
// released meanwhile has its release queued now.
func (r *slotRenewals) renewed(l *limiter, holds []*slotHold, failed bool) {
	var release []*slotHold
	now := time.Since(clockStart)
	r.mu.Lock()
	for _, s := range holds {
		if failed {
			s.renewedAt = now - s.every // due
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

// renewSlots queues, every renewTick until the limiter stops, the
// renewal of each hold whose last renewal (or take) will be a third of
// its hold ago before the next tick, unless one is on its way already,
// and wakes a worker: the workers send them spread over their batches
// (slotQueue.calls).
func (r *slotRenewals) renewSlots(l *limiter) {
	ticker := time.NewTicker(renewTick)
	defer ticker.Stop()
	var due []*slotHold
	var retries []slotRetry
	for {
		select {
		case <-l.batcher.Done():
			return
		case tick := <-ticker.C:
			now := tick.Sub(clockStart)
			r.mu.Lock()
			for _, x := range r.retries {
				if now < x.hold.renewedAt+3*x.hold.every { // else expired by now
					retries = append(retries, x)
				}
			}
			clear(r.retries)
			r.retries = r.retries[:0]
			for s := r.ring.next; s != &r.ring; s = s.next {
				if s.renewing == 0 && now-s.renewedAt+renewTick > s.every {
					s.renewedAt, s.renewing = now, int32(len(s.keys))
					due = append(due, s)
				}
			}
			r.mu.Unlock()
			if len(retries) > 0 {
				l.queueRetries(retries)
				clear(retries)
				retries = retries[:0]
			}
			if len(due) > 0 {
				l.slots().renewQueue.add(renewArg, due...)
				l.batcher.Wake()
			}
			clear(due)
			due = due[:0]
		}
	}
}

// send releases the held slots through the batcher, one call per
// Cluster hash slot group, and waits for the answer, within the timeout,
// so that the slot is free in Redis before the request's answer: its
// client may ask again at once. A call is sent at most once; a release
// lost to a failure expires with its hold.
func (s *slotHold) send() {
	h := s.h
	for start := 0; start < len(s.keys); {
		end := s.groupEnd(start)
		c := s.call(start, end)
		// Sent even when the client has left.
		c, err := h.limiter.batcher.Send(context.Background(), time.Now(), c)
		if err != nil {
			h.slotsFailed(releaseArg, err)
		}
		if c != nil {
			c.Release()
		}
		start = end
	}
}

// slotsFailed warns, throttled, of a renewal or release that Redis
// failed (one refused by an open breaker was told when it opened).
func (h *Handler) slotsFailed(op any, err error) {
	if err == redisbatch.ErrBreakerOpen {
		return
	}
	if ok, suppressed := h.redisWarns.allow(); ok {
		h.logger.Warn("Redis failed while renewing or releasing concurrency slots; a slot not released expires with its hold",
			zap.String("zone", h.Zone), zap.Any("op", op), zap.Error(err), suppressedField(suppressed))
	}
}

// slotGone tells, at debug level, of a slot gone at its renewal (expired,
// freed by the admin API, or lost with Redis's data): the renewal brought
// it back (reply 2), or found every slot taken (0).
func (h *Handler) slotGone(reply int64) {
	msg := "a concurrency slot was gone at its renewal and every slot of its limit is taken; its request runs on uncounted, and its next renewal tries again"
	if reply == 2 {
		msg = "a concurrency slot was gone at its renewal; it is back"
	}
	if ce := h.logger.Check(zap.DebugLevel, msg); ce != nil {
		ce.Write(zap.String("zone", h.Zone))
	}
}

// releaseTaken gives back the slots of buckets a request took in an
// earlier Cluster group, when a later group refused, and returns the
// token buckets among them, for giveBack.
func (h *Handler) releaseTaken(taken []bucket) []bucket {
	k := firstHeld(taken)
	if k == len(taken) {
		return taken
	}
	tokens := taken[:0:0]
	hold := &slotHold{h: h}
	for i := range taken {
		b := &taken[i]
		if !b.kind().heldWhileServed() {
			tokens = append(tokens, *b)
			continue
		}
		hold.id = b.args[2].(*string)
		hold.keys = append(hold.keys, b.key)
		hold.limits = append(hold.limits, b.limit)
	}
	hold.released = true
	hold.send()
	return tokens
}

// releaseLostTake releases the slots of a request whose take failed with
// err after it may have run in Redis: its reply was cut, or came after
// the timeout. The request is decided without a slot, so nothing
// else would release them, and they would stay taken for their hold. A
// release is idempotent: one of slots the take never got frees nothing.
// Not sent for a take that never left (this instance's overload, an
// open breaker, a closed limiter, a client that left first, a connection
// that could not be opened).
func (h *Handler) releaseLostTake(buckets []bucket, err error) {
	var overload redisbatch.OverloadError
	var dial *net.OpError
	if errors.As(err, &overload) || err == redisbatch.ErrBreakerOpen || err == redisbatch.ErrClosed || errors.Is(err, context.Canceled) ||
		errors.As(err, &dial) && dial.Op == "dial" {
		return
	}
	// Taken now, if at all: its slots expire a shortest hold from now,
	// until when a failed release is tried again (slotRenewals.retry).
	hold := &slotHold{h: h, released: true, renewedAt: time.Since(clockStart)}
	for i := firstHeld(buckets); i < len(buckets); i++ {
		b := &buckets[i]
		hold.id = b.args[2].(*string)
		hold.keys = append(hold.keys, b.key)
		hold.limits = append(hold.limits, b.limit)
		if every := b.limit.slotRule().hold / 3; hold.every == 0 || every < hold.every {
			hold.every = every
		}
	}
	if len(hold.keys) > 0 {
		h.limiter.slots().releases.add(hold.keys, 1)
		h.limiter.queueRelease(hold)
	}
}
