package ratelimit

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/lease"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// maxBytesPerBucket bounds what one bucket may cost Redis (used_memory
// growth per key, with its TTL and share of the hash tables).
const maxBytesPerBucket = 200

// TestRedisMemoryPerBucket creates many distinct buckets through the real
// script and measures Redis's used_memory growth per bucket. 100,000 keys
// by default; RATELIMIT_MEMORY_KEYS=1000000 for a larger run.
//
// Keys have the handler's form, `rate_limit:<zone>|<client key>`, with
// IPv4-like client keys. Each bucket is taken from twice: the first take
// stores a whole number of tokens; the second, some microseconds later,
// stores a refilled fraction printed with %.17g, the longest value a
// bucket holds in steady state. Both figures are logged; the bound is
// checked on the second.
func TestRedisMemoryPerBucket(t *testing.T) {
	n, rdb := memoryTestKeys(t), memoryTestRedis(t)
	ctx := context.Background()

	script := redis.NewScript(scriptSource)
	if err := script.Load(ctx, rdb).Err(); err != nil {
		t.Fatal(err)
	}
	// Rate 0.01/s with burst 100: the TTL (the 100 s one missing token
	// takes to refill) outlasts the test, so no bucket expires while it
	// is measured, and the refill between the two takes leaves a fraction
	// (98.0x tokens), not a bucket capped back to full. Keys as a handler
	// in zone "api" keyed by client address makes them.
	args := []any{"0.01", "100", "1"}
	prefix := keys.BucketPrefix(defaultKeyPrefix, "api", "{http.vars.client_ip}")

	before := settledUsedMemory(t, rdb)

	start := time.Now()
	takeAll(t, rdb, script.Hash(), prefix, n, args, 0)
	firstTake := time.Since(start)
	if got := rdb.DBSize(ctx).Val(); got != int64(n) {
		t.Fatalf("DBSIZE %d after creating %d buckets", got, n)
	}
	afterFirst := settledUsedMemory(t, rdb)
	sample := prefix + ipv4Key(n/2)
	firstVal := rdb.Get(ctx, sample).Val()

	takeAll(t, rdb, script.Hash(), prefix, n, args, 99)
	afterSecond := settledUsedMemory(t, rdb)
	secondVal := rdb.Get(ctx, sample).Val()
	if got := rdb.DBSize(ctx).Val(); got != int64(n) {
		t.Fatalf("DBSIZE %d after the second take, want %d", got, n)
	}
	usage, _ := rdb.MemoryUsage(ctx, sample).Result()

	perFirst := float64(afterFirst-before) / float64(n)
	perSecond := float64(afterSecond-before) / float64(n)
	t.Logf("%d buckets created in %v (%.0f scripts/s, pipelined)", n, firstTake.Round(time.Millisecond),
		float64(n)/firstTake.Seconds())
	t.Logf("used_memory: %d before, %d after the first take, %d after the second", before, afterFirst, afterSecond)
	t.Logf("bytes per bucket: %.1f with whole tokens (e.g. %q = %q), %.1f with refilled fractions (%q)",
		perFirst, sample, firstVal, perSecond, secondVal)
	t.Logf("MEMORY USAGE %s: %d bytes (the key's own allocations; the rest is hash-table slots and the TTL entry)",
		sample, usage)
	if perSecond > maxBytesPerBucket || perFirst > maxBytesPerBucket {
		t.Errorf("a bucket costs %.1f bytes of Redis memory (%.1f with whole tokens), over the bound of %d",
			perSecond, perFirst, maxBytesPerBucket)
	}
}

// maxBytesPerLeasingBucket bounds what a bucket costs Redis while it has
// lent: the bucket with its mark, and its lease record (a second key,
// one instance's lease in it), each with its TTL.
const maxBytesPerLeasingBucket = 500

// TestRedisMemoryPerLeasingBucket creates many buckets through lease.lua,
// each lending one instance a lease, and measures Redis's used_memory
// growth per bucket, beside as many plain buckets (script.lua) on the
// same server, emptied between; 100,000 keys by default,
// RATELIMIT_MEMORY_KEYS=1000000 for a larger run. A lease record lives
// as long as its lease and no longer: its TTL is checked, and on a
// short-lived lease, that it is gone once the lease expired, leaving the
// bucket without its mark.
func TestRedisMemoryPerLeasingBucket(t *testing.T) {
	n, rdb := memoryTestKeys(t), memoryTestRedis(t)
	ctx := context.Background()
	plain, leasing := redis.NewScript(scriptSource), redis.NewScript(leaseSource)
	for _, s := range []*redis.Script{plain, leasing} {
		if err := s.Load(ctx, rdb).Err(); err != nil {
			t.Fatal(err)
		}
	}
	prefix := keys.BucketPrefix(defaultKeyPrefix, "api", "{http.vars.client_ip}")

	// Plain: as TestRedisMemoryPerBucket, two takes (the second stores a
	// refilled fraction).
	before := settledUsedMemory(t, rdb)
	args := []any{"0.01", "100", "1"}
	takeAll(t, rdb, plain.Hash(), prefix, n, args, 0)
	takeAll(t, rdb, plain.Hash(), prefix, n, args, 99)
	perPlain := float64(settledUsedMemory(t, rdb)-before) / float64(n)
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	// Leasing: each bucket lends instance 0123456789abcdef a lease of 8
	// for 10 minutes (the test's span), then is taken from again, its
	// lease renewed: a fraction in the bucket, a lease in the record.
	before = settledUsedMemory(t, rdb)
	const id = "0123456789abcdef"
	life := (10 * time.Minute).Microseconds()
	leaseAll(t, rdb, leasing.Hash(), prefix, n, []any{"take", id, 1, life, "0.01", "100", "1", 0, 8}, 0)
	leaseAll(t, rdb, leasing.Hash(), prefix, n, []any{"take", id, 2, life, "0.01", "100", "1", 8, 8}, 99)
	afterLeasing := settledUsedMemory(t, rdb)
	if got := rdb.DBSize(ctx).Val(); got != int64(2*n) {
		t.Fatalf("DBSIZE %d after %d leasing buckets; want a bucket and a record each", got, 2*n)
	}
	perLeasing := float64(afterLeasing-before) / float64(n)
	sample := prefix + ipv4Key(n/2)
	record := lease.RecordKey(sample)
	t.Logf("bytes per bucket at %d keys: %.1f plain, %.1f leasing (bucket %q, record %q = %q): %.2f× a plain one",
		n, perPlain, perLeasing, rdb.Get(ctx, sample).Val(), record, rdb.Get(ctx, record).Val(), perLeasing/perPlain)
	if perLeasing > maxBytesPerLeasingBucket {
		t.Errorf("a leasing bucket costs %.1f bytes of Redis memory, over the bound of %d", perLeasing, maxBytesPerLeasingBucket)
	}
	if ttl := rdb.PTTL(ctx, record).Val(); ttl <= 0 || ttl > 10*time.Minute {
		t.Errorf("a lease record lives %v; want at most its lease's life, 10 minutes", ttl)
	}

	// A short lease: its record goes when it expires; the bucket, taken
	// from after, has no mark left.
	short := prefix + "short"
	keys := []string{short, lease.RecordKey(short)}
	if err := leasing.EvalSha(ctx, rdb, keys, "take", id, 3, 200_000, "0.01", "100", "1", 0, 8).Err(); err != nil {
		t.Fatal(err)
	}
	if ttl := rdb.PTTL(ctx, keys[1]).Val(); ttl <= 0 || ttl > 200*time.Millisecond {
		t.Errorf("a lease of 200 ms: its record lives %v; want at most 200 ms", ttl)
	}
	time.Sleep(300 * time.Millisecond)
	if n := rdb.Exists(ctx, keys[1]).Val(); n != 0 {
		t.Error("a lease record outlived its lease")
	}
	if err := plain.EvalSha(ctx, rdb, keys[:1], "0.01", "100", "1").Err(); err != nil {
		t.Fatal(err)
	}
	if v := rdb.Get(ctx, short).Val(); len(strings.Fields(v)) != 2 {
		t.Errorf("the bucket after its lease expired: %q; want it without a mark", v)
	}
}

// leaseAll runs lease.lua once for each of n buckets with args, as takeAll
// runs script.lua, and checks every reply lends.
func leaseAll(t *testing.T, rdb *redis.Client, sha, prefix string, n int, args []any, rotate int) {
	t.Helper()
	const batch = 1000
	ctx := context.Background()
	for lo := 0; lo < n; lo += batch {
		pipe := rdb.Pipeline()
		cmds := make([]*redis.Cmd, 0, batch)
		for i := lo; i < min(lo+batch, n); i++ {
			key := prefix + ipv4Key((i+rotate)%n)
			cmds = append(cmds, pipe.EvalSha(ctx, sha, []string{key, lease.RecordKey(key)}, args...))
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
		for _, c := range cmds {
			if v, err := c.Int64Slice(); err != nil || len(v) != 4 || v[0] != 1 || v[3] != 8 {
				t.Fatalf("lease.lua reply %v, %v: want an allowed take lending 8", v, err)
			}
		}
	}
}

// takeAll runs the script once for each of n buckets, pipelined 1000 to a
// batch on two connections, and checks every reply. rotate shifts which
// key a worker starts from, so the second pass does not retrace the first
// in the same order.
func takeAll(t *testing.T, rdb *redis.Client, sha, prefix string, n int, args []any, rotate int) {
	t.Helper()
	const batch, workers = 1000, 2
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for lo := w * batch; lo < n; lo += workers * batch {
				hi := min(lo+batch, n)
				pipe := rdb.Pipeline()
				cmds := make([]*redis.Cmd, 0, hi-lo)
				for i := lo; i < hi; i++ {
					key := prefix + ipv4Key((i+rotate)%n)
					cmds = append(cmds, pipe.EvalSha(ctx, sha, []string{key}, args...))
				}
				if _, err := pipe.Exec(ctx); err != nil {
					errs <- err
					return
				}
				for _, c := range cmds {
					v, err := c.Int64Slice()
					if err != nil || len(v) != 3 || v[0] != 1 {
						errs <- fmt.Errorf("script reply %v, %v: want an allowed take", v, err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// ipv4Key is the i-th IPv4-like client key, 10.x.y.z (distinct below 2^24).
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

// settledUsedMemory reads used_memory once it stops moving (incremental
// rehashing finishes in the background), waiting at most 5 s.
func settledUsedMemory(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	read := func() int64 { return infoStat(t, rdb, "used_memory") }
	last, stable := read(), 0
	for deadline := time.Now().Add(5 * time.Second); stable < 3 && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		v := read()
		if v == last {
			stable++
		} else {
			stable = 0
		}
		last = v
	}
	return last
}

// memoryTestKeys is how many buckets a memory test creates: 100,000, or
// RATELIMIT_MEMORY_KEYS.
func memoryTestKeys(t *testing.T) int {
	t.Helper()
	n := 100_000
	if s := os.Getenv("RATELIMIT_MEMORY_KEYS"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1000 {
			t.Fatalf("RATELIMIT_MEMORY_KEYS=%q: want a whole number of at least 1000", s)
		}
		n = v
	}
	return n
}

// memoryTestRedis is a client of a Redis server of the test's own, with
// room for the long pipelines of a memory test.
func memoryTestRedis(t *testing.T) *redis.Client {
	t.Helper()
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ReadTimeout: 30 * time.Second, PoolSize: 4})
	t.Cleanup(func() { rdb.Close() })
	return rdb
}
