package memstore_test

// The store's own behaviour, read from its insides (export_test.go): when
// it forgets a bucket, how max_keys and the sweep meet, the order of its
// takes in time, and what a bucket costs the heap. Buckets are token
// buckets (limit.Plain, as the handler sets it), with keys as a handler
// builds them (keys.BucketPrefix); what a client sees of the same is the
// root package's tests'.

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
	"github.com/caddy-redis/ratelimit/internal/testproc"
)

// A bucket of no limit is a token bucket (limit.Plain), which the
// handler sets.
func init() { limit.Plain = tokenbucket.Kind{} }

// keyPrefix is the handler's default key_prefix.
const keyPrefix = "rate_limit:"

// acquire is the store memory store of zone, as a handler of it acquires
// it, with maxKeys (0: as many as an int64 counts); the test releases it.
func acquire(tb testing.TB, zone string, maxKeys int64) *memstore.Store {
	tb.Helper()
	if maxKeys == 0 {
		maxKeys = 1 << 62
	}
	s, err := memstore.Acquire("memory", keyPrefix, zone, maxKeys)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = s.Release() })
	return s
}

// keyOf is the key of client's bucket in zone, for a handler whose key
// template is template (a plain limit's key).
func keyOf(zone, template, client string) string {
	return keys.BucketPrefix(keyPrefix, zone, template) + client
}

// storedBuckets is how many buckets s holds, swept or not, counted in
// its shards' maps; the store's own count must agree.
func storedBuckets(tb testing.TB, s *memstore.Store) int {
	tb.Helper()
	live, n := s.Count()
	if live != int64(n) {
		tb.Errorf("the store counts %d live buckets; its maps hold %d", live, n)
	}
	return n
}

// storeTime is the wall time of store time t, for Take.
func storeTime(t int64) time.Time { return limit.ClockStart.Add(time.Duration(t) * time.Microsecond) }

// take takes requested tokens of the bucket at key with values v at now:
// whether it was admitted, and what it has left.
func take(tb testing.TB, s *memstore.Store, now time.Time, key string, v limit.Values) (bool, int64) {
	tb.Helper()
	b := []limit.Bucket{{Key: key, Values: v}}
	allowed, err := s.Take(now, b)
	if err != nil {
		tb.Fatalf("take of %s: %v", key, err)
	}
	return allowed, b[0].Remaining
}

func TestMemoryStoreForgetsABucketOnceItWouldBeFullAgain(t *testing.T) {
	// Two handlers of one zone (one store), with key templates of their
	// own: fay takes 1 of 10 tokens at 10/s, full again after 0.1 s and
	// kept for the 1 s minimum, as the Redis key's TTL; sam takes 5 of 10
	// at 1/s, full again after 5 s.
	const zone = "mforget"
	s := acquire(t, zone, 0)
	if other := acquire(t, zone, 0); other != s {
		t.Fatal("two handlers of one zone have stores of their own")
	}
	fast, slow := limit.Values{Rate: 10, Burst: 10, Requested: 1}, limit.Values{Rate: 1, Burst: 10, Requested: 1}
	fayKey, samKey := keyOf(zone, "{http.request.header.X-Key}", "fay"), keyOf(zone, "_{http.request.header.X-Key}", "_sam")
	if allowed, rem := take(t, s, time.Now(), fayKey, fast); !allowed || rem != 9 {
		t.Fatalf("fay: admitted %v remaining %d, want admitted with 9", allowed, rem)
	}
	if n := storedBuckets(t, s); n != 1 {
		t.Fatalf("after one request the store holds %d buckets, want 1", n)
	}
	for range 5 {
		take(t, s, time.Now(), samKey, slow)
	}
	fay, ok1 := s.Lookup(fayKey)
	sam, ok2 := s.Lookup(samKey)
	if !ok1 || !ok2 {
		t.Fatalf("buckets present: fay %v, sam %v", ok1, ok2)
	}
	if got := fay.Expires - fay.At; got != 1_000_000 {
		t.Errorf("fay's bucket expires %d µs after its last take, want 1 s", got)
	}
	// (less the refill during the five requests, in whole milliseconds)
	if got := sam.Expires - sam.At; got > 5_000_000 || got < 4_900_000 {
		t.Errorf("sam's bucket expires %d µs after its last take, want 5 s", got)
	}

	// Now (the sweep in the background does this every 5 s): nothing is
	// full yet.
	s.Sweep()
	if n := storedBuckets(t, s); n != 2 {
		t.Fatalf("a sweep now left %d buckets, want both", n)
	}
	// A request on a bucket past its expiry, not yet swept, finds it full
	// (as an expired Redis key) and takes no second place in the count.
	if allowed, rem := take(t, s, storeTime(fay.Expires), fayKey, fast); !allowed || rem != 9 {
		t.Fatalf("take on fay's expired bucket: %v remaining %d, want allowed with 9", allowed, rem)
	}
	if n := storedBuckets(t, s); n != 2 {
		t.Fatalf("after a take on an expired bucket the store holds %d, want 2", n)
	}
	fay, _ = s.Lookup(fayKey)

	s.SweepAt(fay.Expires - 1)
	if n := storedBuckets(t, s); n != 2 {
		t.Fatalf("a sweep just before fay's bucket is full left %d buckets, want 2", n)
	}
	s.SweepAt(fay.Expires)
	if _, ok := s.Lookup(fayKey); ok {
		t.Error("fay's bucket, full again, was not forgotten")
	}
	if _, ok := s.Lookup(samKey); !ok || storedBuckets(t, s) != 1 {
		t.Fatal("sam's bucket, not full yet, was forgotten")
	}
	s.SweepAt(sam.Expires)
	if n := storedBuckets(t, s); n != 0 {
		t.Fatalf("once both are full again the store holds %d buckets, want 0", n)
	}
}

// TestMemoryStoreMaxKeysMakesRoomOnlyOnceTheSweepForgetsFullBuckets: at
// max_keys a new bucket is refused (ErrFull, which sends its client to
// on_error: the root's TestMemoryStoreMaxKeysSendsNewClientsToOnErrorWithoutDroppingLiveBuckets),
// no live one dropped for it; once the held buckets would be full again
// (2 tokens at 0.01/s: 200 s), the sweep forgets them, and new clients
// fit, up to max_keys again.
func TestMemoryStoreMaxKeysMakesRoomOnlyOnceTheSweepForgetsFullBuckets(t *testing.T) {
	const zone, template = "mkeys-sweep", "{http.request.header.X-Key}"
	s := acquire(t, zone, 3)
	v := limit.Values{Rate: 0.01, Burst: 2, Requested: 1}
	key := func(client string) string { return keyOf(zone, template, client) }
	for _, k := range []string{"ann", "ben", "cal"} {
		if allowed, rem := take(t, s, time.Now(), key(k), v); !allowed || rem != 1 {
			t.Fatalf("%s: admitted %v remaining %d, want admitted with 1", k, allowed, rem)
		}
	}
	full := func(client string) {
		t.Helper()
		b := []limit.Bucket{{Key: key(client), Values: v}}
		if _, err := s.Take(time.Now(), b); err != memstore.ErrFull {
			t.Fatalf("new client %s at max_keys: %v, want ErrFull", client, err)
		}
	}
	full("dan")
	if n := storedBuckets(t, s); n != 3 {
		t.Fatalf("the store holds %d buckets, want the 3 of max_keys", n)
	}
	first, last := int64(1<<62), int64(0)
	for _, k := range []string{"ann", "ben", "cal"} {
		b, ok := s.Lookup(key(k))
		if !ok || b.Tokens != 1 {
			t.Fatalf("%s's bucket: %+v (held: %v), want it with 1 token: no live bucket is dropped", k, b, ok)
		}
		first, last = min(first, b.Expires), max(last, b.Expires)
	}
	s.SweepAt(first - 1) // none full again yet: no room
	full("dan")
	s.SweepAt(last)
	if n := storedBuckets(t, s); n != 0 {
		t.Fatalf("after a sweep once every bucket is full again the store holds %d, want 0", n)
	}
	for _, k := range []string{"dan", "eve", "fin"} {
		if allowed, rem := take(t, s, time.Now(), key(k), v); !allowed || rem != 1 {
			t.Fatalf("after the sweep, %s: admitted %v remaining %d, want admitted with 1", k, allowed, rem)
		}
	}
	full("gus")
}

// TestMemoryStoreMaxKeysHoldsUnderConcurrentNewBuckets: many new buckets
// at once, on every shard: the store never holds more than max_keys, it
// holds a bucket for every take it admitted, and its count of live
// buckets agrees with its maps.
func TestMemoryStoreMaxKeysHoldsUnderConcurrentNewBuckets(t *testing.T) {
	const zone, maxKeys, workers, perWorker = "mkeys-race", 50, 8, 40
	s := acquire(t, zone, maxKeys)
	v := limit.Values{Rate: 0.01, Burst: 2, Requested: 1}
	var mu sync.Mutex
	var admitted []string
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				key := keyOf(zone, "{http.request.header.X-Key}", fmt.Sprintf("c%d-%d", w, i))
				b := []limit.Bucket{{Key: key, Values: v}}
				switch allowed, err := s.Take(time.Now(), b); {
				case allowed && err == nil && b[0].Remaining == 1:
					mu.Lock()
					admitted = append(admitted, key)
					mu.Unlock()
				case err != memstore.ErrFull:
					t.Errorf("%s: admitted %v remaining %d, %v; want admitted with 1 or ErrFull", key, allowed, b[0].Remaining, err)
				}
			}
		})
	}
	wg.Wait()
	if n := storedBuckets(t, s); n > maxKeys || n != len(admitted) {
		t.Errorf("the store holds %d buckets for %d admitted takes, want as many, at most %d", n, len(admitted), maxKeys)
	}
	for _, key := range admitted {
		if _, ok := s.Lookup(key); !ok {
			t.Errorf("%s was admitted, and the store holds no bucket of it", key)
		}
	}
	if len(admitted) == 0 {
		t.Error("no take admitted")
	}
}

func TestMemoryStoreTakesOutOfClockOrderKeepTheBound(t *testing.T) {
	// A request reads the clock before it locks its shards, so concurrent
	// requests can reach a bucket out of their clocks' order. Over [t0,
	// t0+2s] a bucket of burst 10 at 1/s admits at most 12.
	s := acquire(t, "morder", 0)
	v, key := limit.Values{Rate: 1, Burst: 10, Requested: 1}, keyOf("morder", "{http.request.header.X-Key}", "olga")
	t0 := limit.Micros(time.Now())
	admitted, lastAt := 0, int64(0)
	at := func(at int64) {
		t.Helper()
		if allowed, _ := take(t, s, storeTime(at), key, v); allowed {
			admitted++
		}
		state, _ := s.Lookup(key)
		if state.At < lastAt {
			t.Errorf("the bucket's time went back from %d to %d", lastAt, state.At)
		}
		lastAt = state.At
	}
	for range 10 {
		at(t0)
	}
	// 2 s later, two tokens are back. A request whose clock read t0+2s
	// takes first; then one that read t0+1s and waited for the lock; then
	// two more at t0+2s.
	for _, t := range []int64{t0 + 2_000_000, t0 + 1_000_000, t0 + 2_000_000, t0 + 2_000_000} {
		at(t)
	}
	if admitted != 12 {
		t.Errorf("%d admitted over 2 s, want burst + rate*T = 12", admitted)
	}
}

// maxHeapBytesPerBucket is the target for what one bucket of the
// memory store costs the Go heap, its key included.
const maxHeapBytesPerBucket = 128

// ipv4Key is the i-th IPv4 address of 10.0.0.0/8, as {client_ip} gives
// it.
func ipv4Key(i int) string {
	b := make([]byte, 0, 15)
	b = append(b, "10."...)
	b = strconv.AppendInt(b, int64(i>>16&255), 10)
	b = append(b, '.')
	b = strconv.AppendInt(b, int64(i>>8&255), 10)
	b = append(b, '.')
	b = strconv.AppendInt(b, int64(i&255), 10)
	return string(b)
}

// TestMemoryStoreHeapPerBucket inserts many buckets (100,000, or
// RATELIMIT_MEMORY_KEYS) into a memory store through take, with keys as
// a handler keyed by {client_ip} builds them (its bucket prefix and a
// request's address, a new string per request), and measures the heap
// per live bucket, then the time of a full sweep when nothing has
// expired and when everything has.
func TestMemoryStoreHeapPerBucket(t *testing.T) {
	testproc.SkipShort(t, "a few seconds and some 100 MB of heap")
	n := 100_000
	if s := os.Getenv("RATELIMIT_MEMORY_KEYS"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1000 {
			t.Fatalf("RATELIMIT_MEMORY_KEYS=%q: want a whole number of at least 1000", s)
		}
		n = v
	}
	// Rate 0.01/s with burst 100: each bucket, after its two takes, is
	// full again 200 s later, so none expires while it is measured; the
	// store is sized so that n fits.
	s := acquire(t, "api", int64(n))
	v := limit.Values{Rate: 0.01, Burst: 100, Requested: 1}
	prefix := keys.BucketPrefix(keyPrefix, "api", "{http.vars.client_ip}")
	key := func(i int) string { return prefix + ipv4Key(i) }
	if k, want := key(1), prefix+"10.0.0.1"; k != want {
		t.Fatalf("key %q, want %q", k, want)
	}

	// Two passes: the first creates each bucket, the second, with keys
	// built anew as the next request of each client builds them, updates
	// it. The bound is checked after the second: what a bucket costs in
	// steady state, whatever key buffer its last request had.
	var before, afterFirst, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	now := time.Now()
	b := make([]limit.Bucket, 1)
	var inserted time.Duration
	for pass := range 2 {
		start := time.Now()
		for i := range n {
			b[0] = limit.Bucket{Key: key(i), Values: v}
			if allowed, err := s.Take(now.Add(time.Duration(pass)*time.Millisecond), b); !allowed || err != nil {
				t.Fatalf("pass %d, bucket %d: allowed %v, %v", pass+1, i, allowed, err)
			}
		}
		if pass == 0 {
			inserted = time.Since(start)
			runtime.GC()
			runtime.ReadMemStats(&afterFirst)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if got := storedBuckets(t, s); got != n {
		t.Fatalf("the store holds %d buckets, want %d", got, n)
	}
	perFirst := float64(int64(afterFirst.HeapAlloc)-int64(before.HeapAlloc)) / float64(n)
	perBucket := float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / float64(n)

	start := time.Now()
	s.Sweep()
	sweepNone := time.Since(start)
	if got := storedBuckets(t, s); got != n {
		t.Fatalf("a sweep before any bucket is full forgot %d", n-got)
	}
	start = time.Now()
	s.SweepAt(limit.Micros(now) + 10_001_000_000) // an empty bucket is full again in 10,000 s
	sweepAll := time.Since(start)
	if got := storedBuckets(t, s); got != 0 {
		t.Fatalf("a sweep after every bucket is full left %d", got)
	}
	var swept runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&swept)
	runtime.KeepAlive(s)

	t.Logf("%d buckets inserted through take in %v (%.0f ns each)", n, inserted.Round(time.Millisecond),
		float64(inserted.Nanoseconds())/float64(n))
	t.Logf("heap: %d bytes before, %d with the buckets, %d after they were swept (maps keep their tables)",
		before.HeapAlloc, after.HeapAlloc, swept.HeapAlloc)
	t.Logf("heap per live bucket: %.1f bytes once created, %.1f once updated (key %q, %d bytes; stored as %d)",
		perFirst, perBucket, key(n/2), len(key(n/2)), len(s.StoredKey(key(n/2))))
	t.Logf("full sweep of %d buckets: %v when none is full again, %v when all are (%d shards, one lock at a time)",
		n, sweepNone.Round(time.Microsecond), sweepAll.Round(time.Microsecond), memstore.Shards)
	if perBucket > maxHeapBytesPerBucket || perFirst > maxHeapBytesPerBucket {
		t.Errorf("a bucket costs %.1f bytes of heap (%.1f once created), over the target of %d", perBucket, perFirst, maxHeapBytesPerBucket)
	}
}
