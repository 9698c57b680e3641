package memstore

import (
	"context"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// Reporter is what a store tells the handler that uses it: the handler
// logs and counts it, as it does for its other stores.
type Reporter interface {
	// Full says that a take was refused because the store holds max_keys
	// buckets (ErrFull); asked only of a handler's own store (For).
	Full()
	// Charged counts what a settlement charged a limit and forgave, in
	// tokens.
	Charged(l *limit.Limit, charged, forgiven float64)
	// Unsettled counts the settlements of items lost, and why (err).
	Unsettled(buckets []limit.Bucket, items []limit.Settling, err error)
}

// For is s as a handler's store: where it takes, settles, holds, peeks
// and resets its buckets, reporting to r. warnsFull says it is the
// handler's own store (store memory), which reports when it is full; a
// layer's buckets do not.
func (s *Store) For(r Reporter, warnsFull bool) limit.Store {
	return handlerStore{r: r, s: s, warnsFull: warnsFull}
}

// handlerStore is a memory store as a handler's store (store memory), or
// as the buckets a layer takes in the process while the handler's store
// fails; handlers of the same zone share the memory store.
type handlerStore struct {
	r         Reporter
	s         *Store
	warnsFull bool
}

func (p handlerStore) Take(ctx context.Context, r *limit.Call) (bool, error) {
	var allowed bool
	var err error
	if r.MayQueue && queueIndex(r.Buckets) >= 0 {
		allowed, err = p.s.takeQueueing(ctx, r) // may wait for a slot (slotwait.go)
	} else {
		allowed, err = p.s.Take(r.Sent, r.Buckets)
	}
	if err == ErrFull && p.warnsFull {
		p.r.Full() // also when the client left: the store is full all the same
	}
	return allowed, err
}

// MayRefuse and Refuses make it its stack's refuser (limit.RefuserOf):
// its buckets are in the process, where a refusal costs no call.
func (p handlerStore) MayRefuse() bool { return true }
func (p handlerStore) Refuses(now time.Time, buckets []limit.Bucket) bool {
	return p.s.refuses(now, buckets)
}

func (p handlerStore) Settle(r *limit.Call, items []limit.Settling) {
	p.s.settle(p.r, r.Buckets, items)
}

// Hold is the slots that an admitted request took in the process.
func (p handlerStore) Hold(r *limit.Call) limit.Holding {
	return p.s.Hold(r.Buckets)
}

// Peek reads a bucket held while served as what requests hold of it
// (peekHeld).
func (p handlerStore) Peek(_ context.Context, b limit.Bucket) (limit.View, error) {
	if b.HeldWhileServed() {
		return p.s.peekHeld(b.Key), nil
	}
	return p.s.peek(time.Now(), b), nil
}
func (p handlerStore) Reset(_ context.Context, b limit.Bucket) error {
	p.s.Reset([]string{b.Key})
	return nil
}

// settle settles in the store, at once: no I/O. A bucket that is gone
// (swept) is full, as an expired key; one that a take would bring back
// while the store is full cannot be, and its settlement is lost.
func (s *Store) settle(r Reporter, buckets []limit.Bucket, items []limit.Settling) {
	var inlineKeys [limit.MaxInline]string
	var inlineShards [limit.MaxInline]int
	keys := inlineKeys[:0]
	for _, it := range items {
		keys = append(keys, s.storedKey(buckets[it.Bucket].Key))
	}
	shards := s.lock(keys, inlineShards[:0])
	defer s.unlock(shards)
	t := limit.Micros(time.Now())
	for i, it := range items {
		b := &buckets[it.Bucket]
		shard := s.shardIndex(keys[i])
		stored := s.shards[shard].buckets[keys[i]]
		state, ok := held(stored)
		after, store, charged, forgiven := b.Charged().SettleHeld(state, ok, t, *b, it.Diff, it.Cost, b.Limit.Charge.MaxDebt(b.Values.Burst, b.Values.Rate))
		switch {
		case !store:
		case !ok && !s.reserve(1):
			r.Unsettled(buckets, items[i:i+1], ErrFull)
			continue
		default:
			s.put(shard, keys[i], stored, after)
		}
		r.Charged(b.Limit, charged, forgiven)
	}
}
