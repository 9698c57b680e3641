package ratelimit

import (
	"errors"
	"hash/maphash"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// memoryStore keeps buckets in the Caddy process, for `store memory` and
// for `on_error local`: the token bucket of script.lua, in Go, with the
// same arithmetic (takeBucket), so it answers as Redis would. Buckets are
// sharded, each shard with its own lock: no lock is shared by all
// requests. A bucket is forgotten once it would be full again, as a Redis
// key expires, by a sweep in the background.
type memoryStore struct {
	shards  [memoryShards]memoryShard
	seed    maphash.Seed
	live    atomic.Int64 // buckets held, swept or not
	maxKeys atomic.Int64
	stop    chan struct{}
}

// memoryShards spreads the buckets so that requests on different keys
// rarely wait on one lock, and a shard's sweep holds its lock briefly:
// 4,000 buckets each at 1,000,000.
const memoryShards = 256

type memoryShard struct {
	mu      sync.Mutex
	buckets map[string]memoryBucket
	_       [40]byte // a cache line of its own
}

// memoryBucket is a bucket's state: the tokens it held at a time, and
// when it would be full again, in microseconds of the store's clock.
type memoryBucket struct {
	tokens      float64
	at, expires int64
}

// errMemoryFull refuses a request whose bucket would be new while the
// store holds max_keys live buckets: no live bucket is dropped to make
// room, which would hand its client a full bucket.
var errMemoryFull = errors.New("the in-memory store holds max_keys buckets; a new client's request follows on_error")

// clockStart makes the store's clock monotonic: microseconds since the
// process started, unmoved by changes of the wall clock.
var clockStart = time.Now()

func memoryNow(t time.Time) int64 { return int64(t.Sub(clockStart) / time.Microsecond) }

// memoryStores holds the stores in use by zone, so that handlers of one
// zone share buckets, also across config reloads.
var memoryStores = caddy.NewUsagePool()

// acquireMemoryStore returns the store named name and the key that
// releaseMemoryStore takes; maxKeys applies from now on.
func acquireMemoryStore(name string, maxKeys int64) (*memoryStore, error) {
	v, _, err := memoryStores.LoadOrNew(name, func() (caddy.Destructor, error) {
		return newMemoryStore(), nil
	})
	if err != nil {
		return nil, err
	}
	s := v.(*memoryStore)
	s.maxKeys.Store(maxKeys)
	return s, nil
}

func releaseMemoryStore(name string) error {
	_, err := memoryStores.Delete(name)
	return err
}

// memorySweepEvery is how often the sweep goes over every bucket.
const memorySweepEvery = 5 * time.Second

func newMemoryStore() *memoryStore {
	s := &memoryStore{seed: maphash.MakeSeed(), stop: make(chan struct{})}
	for i := range s.shards {
		s.shards[i].buckets = make(map[string]memoryBucket)
	}
	go s.sweepEvery(memorySweepEvery)
	return s
}

// Destruct stops the sweep; the buckets go with the store.
func (s *memoryStore) Destruct() error {
	close(s.stop)
	return nil
}

// take checks and takes every bucket's requested tokens, all or none,
// and fills in each bucket's answer, as the script does in Redis.
func (s *memoryStore) take(now time.Time, buckets []bucket) (bool, error) {
	t := memoryNow(now)
	var inline [maxInlineBuckets]int
	shards := s.lock(buckets, inline[:0])
	defer s.unlock(shards)

	allowed, fresh := true, 0
	for i := range buckets {
		b := &buckets[i]
		state, ok := s.shard(b.key).buckets[b.key]
		if !ok || state.expires <= t {
			fresh++
			state = memoryBucket{tokens: float64(b.values.burst), at: t}
		}
		tokens := refill(state, t, b.values)
		allowed = allowed && tokens >= float64(b.values.requested)
		b.remaining, b.retryAfter = int64(math.Floor(tokens)), 0 // the answer if denied is below
	}
	if allowed && fresh > 0 && s.live.Load()+int64(fresh) > s.maxKeys.Load() {
		s.sweepShards(shards, t) // what expired makes room first
		if s.live.Load()+int64(fresh) > s.maxKeys.Load() {
			return false, errMemoryFull
		}
	}
	for i := range buckets {
		b := &buckets[i]
		sh := s.shard(b.key)
		state, ok := sh.buckets[b.key]
		if !ok || state.expires <= t {
			state = memoryBucket{tokens: float64(b.values.burst), at: t}
		}
		after, _, remaining, wait := takeBucket(state, t, b.values, allowed)
		if allowed {
			if !ok {
				s.live.Add(1)
			}
			sh.buckets[b.key] = after
		}
		b.remaining, b.retryAfter = remaining, time.Duration(wait)*time.Microsecond
	}
	return allowed, nil
}

// refill is what a bucket holds at t: script.lua's arithmetic, which
// also counts from t when the stored time lies ahead.
func refill(state memoryBucket, t int64, v limitValues) float64 {
	return math.Min(float64(v.burst), state.tokens+float64(max(0, t-state.at))*v.rate/1000000)
}

// takeBucket is script.lua for one bucket at time t (microseconds):
// refill by the time elapsed, take the requested tokens when take says
// so, and answer the remaining whole tokens and the microseconds until
// the bucket holds its requested tokens again. The state after holds
// when the bucket would be full again. Every step is the script's, in the
// same order, so that both agree to the bit (TestScriptAgreesWithMemoryStore).
func takeBucket(state memoryBucket, t int64, v limitValues, take bool) (after memoryBucket, took bool, remaining, wait int64) {
	tokens := refill(state, t, v)
	requested := float64(v.requested)
	if take && tokens >= requested {
		tokens -= requested
		took = true
	}
	if tokens < requested {
		wait = int64(math.Ceil((requested - tokens) * 1000000 / v.rate))
	}
	ttl := math.Max(1000, math.Ceil((float64(v.burst)-tokens)*1000/v.rate)) // milliseconds, as the key's TTL
	return memoryBucket{tokens: tokens, at: t, expires: t + int64(ttl)*1000}, took, int64(math.Floor(tokens)), wait
}

// peek reads a bucket without changing it, for the admin API.
func (s *memoryStore) peek(now time.Time, key string, v limitValues) bucketView {
	t := memoryNow(now)
	sh := s.shard(key)
	sh.mu.Lock()
	state, ok := sh.buckets[key]
	sh.mu.Unlock()
	if !ok || state.expires <= t {
		return bucketView{tokens: float64(v.burst)}
	}
	_, _, _, wait := takeBucket(state, t, v, false)
	return bucketView{tokens: refill(state, t, v), wait: time.Duration(wait) * time.Microsecond,
		expiresIn: time.Duration(state.expires-t) * time.Microsecond}
}

// reset forgets buckets, which makes them full.
func (s *memoryStore) reset(keys []string) {
	for _, key := range keys {
		sh := s.shard(key)
		sh.mu.Lock()
		if _, ok := sh.buckets[key]; ok {
			delete(sh.buckets, key)
			s.live.Add(-1)
		}
		sh.mu.Unlock()
	}
}

func (s *memoryStore) shardIndex(key string) int {
	return int(maphash.String(s.seed, key) % memoryShards)
}

func (s *memoryStore) shard(key string) *memoryShard { return &s.shards[s.shardIndex(key)] }

// lock locks the shards of the buckets, each once and in order, so that
// requests over several shards never wait on each other in a circle.
func (s *memoryStore) lock(buckets []bucket, shards []int) []int {
	for i := range buckets {
		shards = append(shards, s.shardIndex(buckets[i].key))
	}
	slices.Sort(shards)
	shards = slices.Compact(shards)
	for _, i := range shards {
		s.shards[i].mu.Lock()
	}
	return shards
}

func (s *memoryStore) unlock(shards []int) {
	for _, i := range shards {
		s.shards[i].mu.Unlock()
	}
}

// sweepEvery forgets, every interval, the buckets that would be full by
// now, a shard at a time.
func (s *memoryStore) sweepEvery(interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-tick.C:
			s.sweep()
		}
	}
}

// sweep goes over every shard once, locking one at a time.
func (s *memoryStore) sweep() {
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		s.sweepShards([]int{i}, memoryNow(time.Now()))
		sh.mu.Unlock()
	}
}

// sweepShards forgets the expired buckets of shards the caller holds
// locked.
func (s *memoryStore) sweepShards(shards []int, t int64) {
	for _, i := range shards {
		for key, b := range s.shards[i].buckets {
			if b.expires <= t {
				delete(s.shards[i].buckets, key)
				s.live.Add(-1)
			}
		}
	}
}
