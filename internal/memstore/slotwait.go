package memstore

// Waiting for a slot in the process (issue 40), for store memory and
// on_error local: as in Redis (internal/redisstore's slotwait.go), a
// request whose one full concurrent limit queues (limit.Bucket.Queues)
// takes its other buckets and enters the key's queue, ordered by
// priority then arrival; a slot given back goes to the head at once
// (pump, under the counts' lock); a waiter whose client leaves, or whose
// max wait runs out, leaves the queue (a slot granted meanwhile goes
// back, to the next), gets its tokens back, and is refused (or answered
// its client's error). Nothing here expires: a waiter in the process
// leaves with its request.

import (
	"context"
	"slices"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// slotQueue is one key's waiters, in the order they are served.
type slotQueue struct {
	waiters []*slotWaiter
}

// slotWaiter is a request waiting for a slot of a key.
type slotWaiter struct {
	key      string // stored
	at       int    // its bucket's index in the request's
	priority int64
	seq      uint64
	n        int64         // its limit's slots
	signal   chan struct{} // granted: once, buffered
	// Under the counts' lock: done once granted (gen is then its slot's
	// generation) or gone.
	done bool
	gen  uint64
}

// queueIndex is the index of the first bucket that may queue for its
// slot, or -1.
func queueIndex(buckets []limit.Bucket) int {
	for i := limit.FirstHeld(buckets); i < len(buckets); i++ {
		if buckets[i].Queues() {
			return i
		}
	}
	return -1
}

// queue decides a request whose only full slot is buckets[q] (its
// concurrent limits from k), under the counts' lock: refused when its
// token buckets refuse it; else, with take, they and its other slots are
// taken and it enters q's queue (w); without, it is not refused.
func (s *Store) queue(now time.Time, buckets []limit.Bucket, k, q int, take bool) (bool, *slotWaiter, error) {
	if k > 0 {
		if allowed, err := s.decideTokens(now, buckets[:k], take); err != nil || !allowed {
			return allowed, nil, err
		}
	}
	if !take {
		return true, nil, nil
	}
	s.takeSlots(buckets, k, q)
	c := &s.inUse
	b := &buckets[q]
	c.seq++
	w := &slotWaiter{key: s.storedKey(b.Key), at: q, priority: b.Values.Priority, seq: c.seq, n: b.Values.Burst,
		signal: make(chan struct{}, 1)}
	if c.queues == nil {
		c.queues = make(map[string]*slotQueue)
	}
	sq := c.queues[w.key]
	if sq == nil {
		sq = new(slotQueue)
		c.queues[w.key] = sq
	}
	i, _ := slices.BinarySearchFunc(sq.waiters, w, func(a, b *slotWaiter) int {
		switch {
		case a.priority != b.priority && a.priority > b.priority:
			return -1
		case a.priority != b.priority:
			return 1
		case a.seq < b.seq:
			return -1
		case a.seq > b.seq:
			return 1
		}
		return 0
	})
	sq.waiters = slices.Insert(sq.waiters, i, w)
	return false, w, nil
}

// pump grants the free slots of the stored key to the heads of its
// queue, under the lock.
func (c *heldCounts) pump(key string) {
	sq := c.queues[key]
	if sq == nil {
		return
	}
	for len(sq.waiters) > 0 {
		head := sq.waiters[0]
		if e := c.entries[key]; e != nil && e.used >= head.n {
			break
		}
		sq.waiters[0] = nil
		sq.waiters = sq.waiters[1:]
		head.gen, head.done = c.take(key).gen, true
		head.signal <- struct{}{}
	}
	if len(sq.waiters) == 0 {
		delete(c.queues, key)
	}
}

// leave takes a waiter out of its queue; one granted meanwhile gives its
// slot back (to the next), and says so.
func (c *heldCounts) leave(w *slotWaiter) (gaveBack bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if w.done {
		c.release(w.key, w.gen)
		return true
	}
	w.done = true
	if sq := c.queues[w.key]; sq != nil {
		if i := slices.Index(sq.waiters, w); i >= 0 {
			sq.waiters = slices.Delete(sq.waiters, i, i+1)
		}
		if len(sq.waiters) == 0 {
			delete(c.queues, w.key)
		}
	}
	return false
}

// Waiting is how many requests wait for a slot of the stored key's
// limit.
func (s *Store) Waiting(key string) int {
	s.inUse.mu.Lock()
	defer s.inUse.mu.Unlock()
	if sq := s.inUse.queues[s.storedKey(key)]; sq != nil {
		return len(sq.waiters)
	}
	return 0
}

// takeQueueing takes a request that may queue for a slot: queued, it
// waits for it.
func (s *Store) takeQueueing(ctx context.Context, r *limit.Call) (bool, error) {
	buckets := r.Buckets
	allowed, w, err := s.decideQueueing(r.Sent, buckets, true, true)
	if w == nil {
		return allowed, err
	}
	if r.Waiting != nil {
		r.Waiting.Add(1)
		defer r.Waiting.Add(-1)
	}
	start := time.Now()
	b := &buckets[w.at]
	timer := time.NewTimer(b.Values.MaxWait)
	defer timer.Stop()
	granted := false
	select {
	case <-w.signal:
		granted = true
	case <-ctx.Done():
	case <-timer.C:
	}
	waited := time.Since(start)
	r.Queued = waited
	if granted {
		b.KindN, b.Remaining = int64(w.gen), 0
		for i := range buckets {
			buckets[i].Wait = max(0, buckets[i].Wait-waited)
		}
		return true, nil
	}
	s.inUse.leave(w)
	// Its other slots and its tokens go back.
	k := limit.FirstHeld(buckets)
	for i := k; i < len(buckets); i++ {
		if i != w.at {
			s.releaseSlot(buckets[i].Key, uint64(buckets[i].KindN))
			buckets[i].Remaining++
		}
	}
	s.giveBack(buckets[:k])
	for i := range k {
		bi := &buckets[i]
		if bi.Wait > 0 {
			bi.RetryAfter, bi.Wait = bi.Wait, 0
		} else {
			bi.Remaining += bi.Values.Requested
			bi.RetryAfter = 0
		}
	}
	*b = b.Kind().Refused(*b)
	if ctx.Err() != nil {
		return false, ctx.Err()
	}
	return false, nil
}

// giveBack gives token buckets their requested tokens back, as a
// settlement of none of them: capped at the burst, never fuller than
// had they not been taken.
func (s *Store) giveBack(buckets []limit.Bucket) {
	t := limit.Micros(time.Now())
	for i := range buckets {
		b := &buckets[i]
		charged := b.Charged()
		if charged == nil {
			continue
		}
		key := s.storedKey(b.Key)
		shard := s.shardIndex(key)
		sh := &s.shards[shard]
		sh.mu.Lock()
		stored := sh.buckets[key]
		if state, ok := held(stored); ok {
			if after, store, _, _ := charged.SettleHeld(state, ok, t, *b, -b.Values.Requested, 0, 0); store {
				s.put(shard, key, stored, after)
			}
		}
		sh.mu.Unlock()
	}
}
