// package memstore keeps buckets in the Caddy process, for `store memory`
// and for a layer that keeps them there while Redis fails. It decides
// through the kinds' optional interfaces of package limit (Arithmetic,
// Charged, Held), never through a kind of its own, so it answers as the
// scripts in Redis would.
package memstore

import (
	"hash/maphash"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddyserver/caddy/v2"
)

// Store keeps buckets in the Caddy process: each kind's arithmetic of its
// script, in Go (limit.Arithmetic), so it answers as Redis would. Buckets
// are sharded, each shard with its own lock: no lock is shared by all
// requests. A bucket is forgotten once it would be full again, as a Redis
// key expires, by a sweep in the background.
type Store struct {
	shards  [Shards]shard
	seed    maphash.Seed
	live    atomic.Int64 // buckets held, swept or not
	maxKeys atomic.Int64
	stop    chan struct{}
	name    string // in stores
	// Every key the store is given starts with one of these (the key
	// prefix and the zone are the store's, see Name), which it
	// does not hold: see storedKey.
	plainPrefix, namedPrefix string
	// inUse counts what requests hold of its keys while they are served
	// (limit.Held, Hold).
	inUse heldCounts
}

// Shards spreads the buckets so that requests on different keys
// rarely wait on one lock, and a shard's sweep holds its lock briefly:
// 4,000 buckets each at 1,000,000.
const Shards = 256

type shard struct {
	mu sync.Mutex
	// buckets by stored key. A take updates a bucket in place, without
	// writing the map, which would replace the stored key with the
	// request's, so needed a copy of the key per take
	// (BenchmarkServeHTTPMemory 4 -> 3 allocs; a bucket then costs 82 B of
	// heap instead of 79: TestMemoryStoreHeapPerBucket).
	buckets map[string]*limit.State
	_       [48]byte // a cache line of its own: 64 bytes in all
}

// ErrFull refuses a request whose bucket would be new while the
// store holds max_keys live buckets: no live bucket is dropped to make
// room, which would hand its client a full bucket.
var ErrFull = limit.ErrFull

// stores holds the stores in use by name, so that handlers of one
// zone share buckets, also across config reloads.
var stores = caddy.NewUsagePool()

// Name names the store of a kind (store memory's, or a layer's buckets
// kept while Redis fails) for the handlers whose keys start with
// keyPrefix and zone. Zones cannot contain keys.Separator, so no two
// (zone, key prefix) pairs share a name.
func Name(kind, keyPrefix, zone string) string {
	return kind + ":" + zone + keys.Separator + keyPrefix
}

// Acquire returns the store of kind for keys of keyPrefix and zone,
// shared with every handler that has the same; Release gives it back.
// maxKeys applies from now on.
func Acquire(kind, keyPrefix, zone string, maxKeys int64) (*Store, error) {
	name := Name(kind, keyPrefix, zone)
	v, _, err := stores.LoadOrNew(name, func() (caddy.Destructor, error) {
		return newStore(name, keyPrefix, zone), nil
	})
	if err != nil {
		return nil, err
	}
	s := v.(*Store)
	s.maxKeys.Store(maxKeys)
	return s, nil
}

// References is how many handlers hold the store of kind for keyPrefix
// and zone (Acquire), and whether it exists.
func References(kind, keyPrefix, zone string) (int, bool) {
	return stores.References(Name(kind, keyPrefix, zone))
}

// Release gives back what Acquire handed out; the last release stops
// the sweep, and the buckets go with the store.
func (s *Store) Release() error {
	_, err := stores.Delete(s.name)
	return err
}

// sweepEvery is how often the sweep goes over every bucket.
const sweepEvery = 5 * time.Second

func newStore(name, keyPrefix, zone string) *Store {
	s := &Store{seed: maphash.MakeSeed(), stop: make(chan struct{}), name: name,
		plainPrefix: keyPrefix + zone + keys.Separator, namedPrefix: keyPrefix + "{" + zone}
	for i := range s.shards {
		s.shards[i].buckets = make(map[string]*limit.State)
	}
	go s.sweepEvery(sweepEvery)
	return s
}

// Destruct stops the sweep; the buckets go with the store.
func (s *Store) Destruct() error {
	close(s.stop)
	return nil
}

// storedKey is the part of a bucket's key that the store holds: without
// the key prefix and the zone, which every key of the store starts with,
// so a bucket costs less memory. A plain limit's key, `<key_prefix><zone>|
// <tag>|<client key>`, is held from its template tag on, whose characters
// are base64's; a named limit's, `<key_prefix>{<zone>|<tag>|<client
// key>}|<name>`, from the `|` after the zone on. Each form only drops a
// constant prefix, and the two never meet (a tag never starts with `|`),
// so no two keys are held as one.
func (s *Store) storedKey(key string) string {
	if rest, ok := strings.CutPrefix(key, s.plainPrefix); ok {
		return rest
	}
	if rest, ok := strings.CutPrefix(key, s.namedPrefix); ok {
		return rest
	}
	return key // not a handler's key (it is, by construction of the store's name)
}

// decideTokens checks and takes every bucket's requested tokens, all or
// none, and fills in each bucket's answer, as the script does in Redis;
// it takes nothing when take is false and every bucket holds its tokens
// (allowed then says only that they do): a refusal is made as a take
// makes it.
//
// A bucket's time never moves back: the caller reads the clock before
// the shards are locked, so simultaneous requests can reach a bucket out
// of their clocks' order, and a take at a time before the bucket's last
// one is made at that last time. Counting from the earlier time, as the
// script does when its server's clock went back, would count the time
// in between twice, and admit more than burst + rate*T.
func (s *Store) decideTokens(now time.Time, buckets []limit.Bucket, take bool) (bool, error) {
	var inlineKeys [limit.MaxInline]string
	var inlineShards, inlineLocked [limit.MaxInline]int
	var inlineStates [limit.MaxInline]*limit.State
	keys, shards, states := inlineKeys[:0], inlineShards[:0], inlineStates[:0]
	for i := range buckets {
		key := s.storedKey(buckets[i].Key)
		keys, shards = append(keys, key), append(shards, s.shardIndex(key))
	}
	locked := s.lockShards(append(inlineLocked[:0], shards...))
	defer s.unlock(locked)

	t := limit.Micros(now)
	allowed, absent := true, 0
	for i := range buckets {
		b := &buckets[i]
		state := s.shards[shards[i]].buckets[keys[i]]
		if state == nil {
			absent++
		}
		states = append(states, state)
		st, ok := held(state)
		var holds bool
		*b, holds = b.Arithmetic().Holds(st, ok, now, t, *b) // asked of every bucket: a kind may set what the take needs here
		allowed = allowed && holds
	}
	if allowed && !take {
		return true, nil
	}
	if allowed && absent > 0 && !s.reserve(absent) {
		s.sweepShards(locked, t) // what expired makes room first
		absent = 0               // ... and may have been this request's own buckets
		for i := range keys {
			if states[i] = s.shards[shards[i]].buckets[keys[i]]; states[i] == nil {
				absent++
			}
		}
		if !s.reserve(absent) {
			return false, ErrFull
		}
	}
	for i := range buckets {
		b := &buckets[i]
		state, ok := held(states[i])
		var after limit.State
		var store bool
		if *b, after, store = b.Arithmetic().Take(state, ok, now, t, *b, allowed); store {
			s.put(shards[i], keys[i], states[i], after)
		}
	}
	return allowed, nil
}

// held is the state of a bucket the store holds (nil for none), and
// whether there is one.
func held(b *limit.State) (limit.State, bool) {
	if b == nil {
		return limit.State{}, false
	}
	return *b, true
}

// put stores a bucket's state: in place when the store holds it (held),
// else as a new entry under a copy of the stored key, so that the map
// never keeps the request's (larger) key alive. The caller holds the
// shard locked.
func (s *Store) put(shard int, key string, held *limit.State, state limit.State) {
	if held == nil {
		held = new(limit.State)
		s.shards[shard].buckets[strings.Clone(key)] = held
	}
	*held = state
}

// reserve counts n new buckets if they fit under max_keys. Takes on
// other shards reserve at the same time, so the store never holds more than
// max_keys (a reservation that does not fit is undone; meanwhile it may
// refuse a simultaneous one that would have fit).
func (s *Store) reserve(n int) bool {
	if n == 0 {
		return true
	}
	if s.live.Add(int64(n)) <= s.maxKeys.Load() {
		return true
	}
	s.live.Add(-int64(n))
	return false
}

// peek reads a bucket without changing it, for the admin API.
func (s *Store) peek(now time.Time, b limit.Bucket) limit.View {
	key := s.storedKey(b.Key)
	sh := s.shard(key)
	sh.mu.Lock()
	var state limit.State
	stored := sh.buckets[key]
	if stored != nil {
		state = *stored
	}
	sh.mu.Unlock()
	return b.Arithmetic().Peek(state, stored != nil, now, limit.Micros(now), b)
}

// Reset forgets buckets, which makes them full, and frees what
// requests hold of them.
func (s *Store) Reset(keys []string) {
	for _, key := range keys {
		key = s.storedKey(key)
		s.inUse.free(key)
		sh := s.shard(key)
		sh.mu.Lock()
		if _, ok := sh.buckets[key]; ok {
			delete(sh.buckets, key)
			s.live.Add(-1)
		}
		sh.mu.Unlock()
	}
}

// shardIndex is the shard of a stored key.
func (s *Store) shardIndex(key string) int {
	return int(maphash.String(s.seed, key) % Shards)
}

func (s *Store) shard(key string) *shard { return &s.shards[s.shardIndex(key)] }

// lock locks the shards of the stored keys (see lockShards).
func (s *Store) lock(keys []string, shards []int) []int {
	for _, key := range keys {
		shards = append(shards, s.shardIndex(key))
	}
	return s.lockShards(shards)
}

// lockShards locks the shards at the indexes, each once and in order, so
// that requests over several shards never wait on each other in a
// circle; it returns the indexes locked, for unlock.
func (s *Store) lockShards(indexes []int) []int {
	slices.Sort(indexes)
	indexes = slices.Compact(indexes)
	for _, i := range indexes {
		s.shards[i].mu.Lock()
	}
	return indexes
}

func (s *Store) unlock(indexes []int) {
	for _, i := range indexes {
		s.shards[i].mu.Unlock()
	}
}

// sweepEvery forgets, every interval, the buckets that would be full by
// now, a shard at a time.
func (s *Store) sweepEvery(interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-tick.C:
			s.Sweep()
		}
	}
}

// Sweep goes over every shard once, locking one at a time, and forgets
// the buckets that would be full by now.
func (s *Store) Sweep() {
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		s.sweepShards([]int{i}, limit.Micros(time.Now()))
		sh.mu.Unlock()
	}
}

// sweepShards forgets the expired buckets of shards the caller holds
// locked. Not inlined into take, where its map iterator would take room
// in the stack frame of every request (take's frame 800 -> 712 bytes; see
// the handler's warnFull for what a deep stack costs).
//
//go:noinline
func (s *Store) sweepShards(shards []int, t int64) {
	for _, i := range shards {
		for key, b := range s.shards[i].buckets {
			if b.Expires <= t {
				delete(s.shards[i].buckets, key)
				s.live.Add(-1)
			}
		}
	}
}
