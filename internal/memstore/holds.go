package memstore

// A concurrent limit's slots in the process, for store memory and the
// buckets a layer keeps there (the limit itself is its kind's).

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// In-process slots, for the memory store: a count per key,
// with a generation that an admin reset renews, so that the releases of
// requests admitted before the reset do not free slots taken after it.
// They are what a memory store's requests hold while served (Store.inUse).

type heldCounts struct {
	mu      sync.Mutex
	entries map[string]*slotEntry
	gen     uint64
	// queues are the requests waiting for a slot, by stored key
	// (slotwait.go); seq counts their arrivals.
	queues map[string]*slotQueue
	seq    uint64
}

type slotEntry struct {
	used int64
	gen  uint64
}

// Take takes a request's buckets as at now, all or nothing, and fills in
// each bucket's answer: its token buckets from s and its slots from s's
// slot counts, which stay locked while the tokens are taken. Each slot's bucket gets the generation of the count
// it was taken from (KindN), for its release (hold): read later,
// it could be a count that an admin reset and another take made
// meanwhile.
func (s *Store) Take(now time.Time, buckets []limit.Bucket) (bool, error) {
	return s.decide(now, buckets, true)
}

// refuses says whether Take would refuse the request now, and refuses it
// as that does (each bucket with its answer), without taking anything
// when it would not: for a request of which these are only some buckets,
// whose others are not known yet (a refusal before the request's body is
// read). A refusal of some of a request's buckets is the whole request's.
func (s *Store) refuses(now time.Time, buckets []limit.Bucket) bool {
	allowed, err := s.decide(now, buckets, false)
	return err == nil && !allowed
}

// decide is Take, which takes nothing when take is false and the request
// would be admitted (decideTokens).
func (s *Store) decide(now time.Time, buckets []limit.Bucket, take bool) (bool, error) {
	allowed, _, err := s.decideQueueing(now, buckets, take, false)
	return allowed, err
}

// decideQueueing is decide, which with mayQueue queues a request (take)
// whose one full concurrent limit queues (limit.Bucket.Queues) and whose
// other buckets admit it: those are taken, and w is its place in the
// queue (allowed false until it is granted: waitForSlot). Without take,
// such a request is not refused: whether it may queue is its take's
// to say.
func (s *Store) decideQueueing(now time.Time, buckets []limit.Bucket, take, mayQueue bool) (allowed bool, w *slotWaiter, err error) {
	k := limit.FirstHeld(buckets)
	if k == len(buckets) {
		allowed, err = s.decideTokens(now, buckets, take)
		return allowed, nil, err
	}
	sc := &s.inUse
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if sc.entries == nil {
		sc.entries = make(map[string]*slotEntry)
	}
	free := true
	queueAt, full := -1, 0
	for i := k; i < len(buckets); i++ {
		b := &buckets[i]
		used := int64(0)
		if e := sc.entries[s.storedKey(b.Key)]; e != nil {
			used = e.used
		}
		b.Remaining, b.RetryAfter = max(0, b.Values.Burst-used), 0
		if used >= b.Values.Burst {
			free = false
			full++
			if queueAt < 0 && b.Queues() && (mayQueue || !take) {
				queueAt = i
			}
		}
	}
	if full == 1 && queueAt >= 0 {
		allowed, w, err = s.queue(now, buckets, k, queueAt, take)
		return allowed, w, err
	}
	if !free {
		for i := range k {
			buckets[i].Unknown = true // not asked: the slots refused first
		}
		limit.CompleteRefusal(buckets)
		return false, nil, nil
	}
	allowed = true
	if k > 0 {
		if allowed, err = s.decideTokens(now, buckets[:k], take); err != nil || !allowed {
			return allowed, nil, err
		}
	}
	if !take {
		return true, nil, nil
	}
	s.takeSlots(buckets, k, -1)
	return true, nil, nil
}

// takeSlots takes a slot of each of buckets[k:] but buckets[except],
// under the counts' lock, each bucket with the generation of its count.
func (s *Store) takeSlots(buckets []limit.Bucket, k, except int) {
	sc := &s.inUse
	for i := k; i < len(buckets); i++ {
		if i == except {
			continue
		}
		b := &buckets[i]
		e := sc.take(s.storedKey(b.Key))
		b.Remaining--
		b.KindN = int64(e.gen)
	}
}

// take counts a slot taken of the stored key, under the lock.
func (c *heldCounts) take(key string) *slotEntry {
	e := c.entries[key]
	if e == nil {
		c.gen++
		e = &slotEntry{gen: c.gen}
		c.entries[key] = e
	}
	e.used++
	return e
}

// releaseSlot gives back a slot taken in generation gen; a request
// waiting for one gets it (pump).
func (s *Store) releaseSlot(key string, gen uint64) {
	key = s.storedKey(key)
	s.inUse.mu.Lock()
	defer s.inUse.mu.Unlock()
	s.inUse.release(key, gen)
}

// release gives back a slot of the stored key, taken in generation gen,
// under the lock, and hands what is free to the waiters.
func (c *heldCounts) release(key string, gen uint64) {
	if e := c.entries[key]; e != nil && e.gen == gen {
		if e.used--; e.used <= 0 {
			delete(c.entries, key)
		}
	}
	c.pump(key)
}

// InUse is how many slots of a key are held.
func (s *Store) InUse(key string) int64 {
	s.inUse.mu.Lock()
	defer s.inUse.mu.Unlock()
	if e := s.inUse.entries[s.storedKey(key)]; e != nil {
		return e.used
	}
	return 0
}

// free frees every slot of a stored key (Store.Reset).
func (c *heldCounts) free(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.entries, key)
	c.pump(key)
}

// Hold is the slots that an admitted request took in the process, to
// give back once its response has ended; nil when it holds none.
func (s *Store) Hold(buckets []limit.Bucket) limit.Holding {
	if hold := s.holdSlots(buckets); hold != nil {
		return hold
	}
	return nil
}

// peekHeld reads what requests hold of a bucket held while served: the
// slots of a concurrent limit's key in use.
func (s *Store) peekHeld(key string) limit.View {
	return limit.View{InUse: s.InUse(key)}
}

// hold is the slots one request holds in a memory store, from
// admission until its response has ended, each of the generation of the
// count it was taken from (Store.holdSlots).
type hold struct {
	s        *Store
	keys     []string
	gens     []uint64
	released atomic.Bool
	// Room for a request with one concurrent limit, the usual: the hold
	// is one allocation.
	inlineKeys [1]string
	inlineGens [1]uint64
}

// holdSlots records the slots a request was admitted with; nil when it
// holds none.
func (s *Store) holdSlots(buckets []limit.Bucket) *hold {
	k := limit.FirstHeld(buckets)
	if k == len(buckets) {
		return nil
	}
	h := &hold{s: s}
	h.keys, h.gens = h.inlineKeys[:0], h.inlineGens[:0]
	for i := k; i < len(buckets); i++ {
		h.keys = append(h.keys, buckets[i].Key)
		h.gens = append(h.gens, uint64(buckets[i].KindN))
	}
	return h
}

// Release gives the slots back, once.
func (m *hold) Release() {
	if m.released.Swap(true) {
		return
	}
	for i, key := range m.keys {
		m.s.releaseSlot(key, m.gens[i])
	}
}
