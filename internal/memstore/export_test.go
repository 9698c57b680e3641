package memstore

import "github.com/caddy-redis/ratelimit/internal/limit"

// What this package's tests read of a store's insides, and do to it
// (go-redis's pattern: test-only API lives in the package's tests).

// Lookup is the state the store holds for the bucket whose key is key.
func (s *Store) Lookup(key string) (limit.State, bool) {
	stored := s.storedKey(key)
	sh := s.shard(stored)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	b, ok := sh.buckets[stored]
	if !ok {
		return limit.State{}, false
	}
	return *b, true
}

// Count is how many buckets the store counts as live, swept or not, and
// how many its shards' maps hold: the two agree.
func (s *Store) Count() (live int64, held int) {
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		held += len(sh.buckets)
		sh.mu.Unlock()
	}
	return s.live.Load(), held
}

// SweepAt is Sweep at store time t (microseconds, limit.Micros): every
// shard once, each locked while it is swept.
func (s *Store) SweepAt(t int64) {
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		s.sweepShards([]int{i}, t)
		sh.mu.Unlock()
	}
}

// StoredKey is the part of key that the store holds.
func (s *Store) StoredKey(key string) string { return s.storedKey(key) }
