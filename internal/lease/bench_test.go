package lease_test

// What the leases cost alone: a cold key's sighting, a hot key's
// admission, a renewal's call (make bench measures them within Caddy).

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/lease"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// BenchmarkLeaseCall is one renewal's call to Redis (lease.lua) alone:
// what a lease costs per renewal, beside the requests it admits.
func BenchmarkLeaseCall(b *testing.B) {
	srv := redistest.Start(b)
	client := redisstore.New(redisstore.Options{Redis: &redis.UniversalOptions{Addrs: []string{srv.Addr}}, Timeout: 2 * time.Second})
	b.Cleanup(func() { _ = client.Destruct() })
	ls := lease.New(lease.Options{MaxTokens: 32, Timeout: 2 * time.Second, Client: client})
	go ls.GiveBackEvery() // as the handler runs it; Close waits for it
	defer ls.Close()
	values := limit.Values{Rate: 1e9, Burst: 1_000_000_000, Requested: 1} // a handler's replenish_rate 1e9, burst_capacity 1000000000
	renew := ls.Renewal(limit.Bucket{Key: "rate_limit:bench-leasecall|k", Values: values, Args: tokenbucket.Args(values)})
	b.ReportAllocs()
	for b.Loop() {
		if err := renew(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLeaseAcquireCold is what a leasing zone adds to a cold key's
// request in Caddy before its plain call: the lease table's lock, the
// key's hash and its sighting (10,000 keys in turn, none hot).
func BenchmarkLeaseAcquireCold(b *testing.B) {
	ls := lease.New(lease.Options{MaxTokens: 32, Timeout: time.Second})
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = "rate_limit:bench-lease|127.0.0.1:key-" + strconv.Itoa(i)
	}
	buckets, marks := make([]limit.Bucket, 1), make([]int64, 1)
	now := time.Now()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		buckets[0] = limit.Bucket{Key: keys[i%len(keys)]}
		now = now.Add(20 * time.Microsecond) // each key seen every 200 ms, two holds
		if o := ls.AcquireOnce(now, buckets, marks); o != lease.Cold {
			b.Fatalf("outcome %v; want cold", o)
		}
		i++
	}
}

// BenchmarkAdmitHot is the least a hot key's admission costs in Caddy,
// with nothing else running: lease, from a lease that holds plenty (the
// lease table's lock, the key's hash, the lease's fields), beside
// memory, store memory's take of the same bucket. make bench's lease@64
// and memory@64 differ by what lies beyond this: renewals, give-backs,
// the Redis client.
func BenchmarkAdmitHot(b *testing.B) {
	const key = "rate_limit:bench|127.0.0.1:conn-7"
	values := limit.Values{Rate: 1e9, Burst: 1_000_000_000, Requested: 1}
	buckets := []limit.Bucket{{Key: key, Values: values}}
	b.Run("lease", func(b *testing.B) {
		marks := make([]int64, len(buckets))
		ls := lease.New(lease.Options{MaxTokens: 32, Timeout: time.Second})
		now := time.Now()
		ls.Plant(key, values, 1<<62, now.Add(time.Hour))
		b.ReportAllocs()
		for b.Loop() {
			if o := ls.AcquireOnce(now, buckets, marks); o != lease.Admitted {
				b.Fatalf("outcome %v; want admitted", o)
			}
		}
	})
	b.Run("memory", func(b *testing.B) {
		s, err := memstore.Acquire("bench", "rate_limit:", "bench", 1000)
		if err != nil {
			b.Fatal(err)
		}
		defer s.Release()
		now := time.Now()
		b.ReportAllocs()
		for b.Loop() {
			if ok, err := s.Take(now, buckets); !ok || err != nil {
				b.Fatalf("take: %v %v", ok, err)
			}
		}
	})
}
