package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// peekTokens is how many tokens the bucket at key holds now, as the
// script would compute them for the next request (scriptRefill of its
// stored state at Redis's time), and Redis's time.
func peekTokens(rdb *redis.Client, key string, rate float64, burst int64) (float64, time.Time, error) {
	ctx := context.Background()
	var clock *redis.TimeCmd
	var state *redis.StringCmd
	if _, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		clock, state = p.Time(ctx), p.Get(ctx, key)
		return nil
	}); err != nil && err != redis.Nil {
		return 0, time.Time{}, err
	}
	b, err := parseBucket(state)
	if err != nil {
		return 0, time.Time{}, err
	}
	now := clock.Val()
	return scriptRefill(b, now.UnixMicro(), rate, burst), now, nil
}

func TestDenyCacheNeverDeniesWhatRedisWouldAdmit(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const rate, burst, cost = 20.0, 20, 2
	h := provision(t, &Handler{
		Zone: "dc", Key: "{http.request.header.X-Key}", ReplenishRate: "20",
		BurstCapacity: "20", RequestedTokens: "2",
		Redis: &RedisConfig{Addresses: []string{srv.Addr}, Timeout: caddy.Duration(time.Second)},
	})

	// A flood on one key from 8 clients for 1.5 s. Whenever the cache
	// answers a denial, Redis is asked afterwards (read-only) how many
	// tokens the bucket holds, from which follows when it came to hold
	// `cost`; if that was before the request even started, the cache
	// denied what Redis would have admitted.
	var cacheDenials, violations, admitted atomic.Int64
	deadline := time.Now().Add(1500 * time.Millisecond)
	start := time.Now()
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				key := h.limits[0].KeyPrefix + "flood"
				bucket := limit.Bucket{Key: key, Values: h.limits[0].Values}
				started := time.Now()
				cached := cacheDenies(h, bucket, started)
				if status, _ := serve(context.Background(), h, "flood"); status == 200 {
					admitted.Add(1)
					continue
				}
				if !cached {
					continue // Redis itself denied
				}
				if !cacheDenies(h, bucket, time.Now()) {
					continue // expired between the two looks: Redis may have answered
				}
				cacheDenials.Add(1)
				tokens, now, err := peekTokens(rdb, key, rate, burst)
				if err != nil {
					t.Error(err)
					return
				}
				if tokens >= cost && tokens < burst {
					filled := now.Add(-time.Duration((tokens - cost) / rate * float64(time.Second)))
					if filled.Before(started) {
						violations.Add(1)
						t.Errorf("the cache denied a request started %v after the bucket held %d tokens", started.Sub(filled), cost)
					}
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	t.Logf("admitted %d, denied from the cache %d, in %v", admitted.Load(), cacheDenials.Load(), elapsed)
	if cacheDenials.Load() == 0 {
		t.Fatal("the cache never answered: the test proved nothing")
	}
	if bound := (burst + rate*elapsed.Seconds()) / cost; float64(admitted.Load()) > bound {
		t.Fatalf("admitted %d, above the bound %.1f", admitted.Load(), bound)
	}
	// Refill allows about rate*T/cost requests; the cache must not starve
	// the key below most of that.
	if floor := rate * elapsed.Seconds() / cost * 0.8; float64(admitted.Load()) < floor {
		t.Fatalf("admitted %d, below %.0f: the cache denies too long", admitted.Load(), floor)
	}
}

func TestDenyCacheAnswersFloodWithoutRedis(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := provision(t, &Handler{
		Zone: "flood", Key: "{http.request.header.X-Key}", ReplenishRate: "0.1", BurstCapacity: "1",
		Redis: &RedisConfig{Addresses: []string{srv.Addr}},
	})
	if status, _ := serve(context.Background(), h, "one"); status != 200 {
		t.Fatalf("first request: %d", status)
	}
	before := redistest.ScriptCalls(t, rdb)
	for i := range 1000 {
		status, header := serve(context.Background(), h, "one")
		retry := header.Get("Retry-After")
		if status != 429 || retry == "" || retry == "0" {
			t.Fatalf("request %d: %d, Retry-After %q; want 429 with a Retry-After", i, status, retry)
		}
	}
	// One Redis call learned the retry time (10 s); the rest were local.
	if calls := redistest.ScriptCalls(t, rdb) - before; calls != 1 {
		t.Fatalf("1000 denials cost %d script calls, want 1", calls)
	}
}

func TestDenyCacheReportsTheBucketAsItIsNow(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	// Each request costs the whole burst: after one, the bucket refills
	// for 2 s, and a denial is cached for that long.
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 2 4 4 {\n\tzone present\n\tkey {http.request.header.X-Key}\n\theaders both\n\tredis %s {\n\t\ttimeout 5s\n\t}\n}", srv.Addr))
	send := func() http.Header {
		_, header := serve(context.Background(), h, "k")
		return header
	}
	send()                                                      // takes all 4
	if got := send().Get("X-RateLimit-Remaining"); got != "0" { // denied by Redis, and cached
		t.Fatalf("first denial: remaining %q, want 0", got)
	}
	calls := redistest.ScriptCalls(t, rdb)
	time.Sleep(1100 * time.Millisecond) // 2.2 tokens back, 0.9 s to go
	hdr := send()
	if n := redistest.ScriptCalls(t, rdb) - calls; n != 0 {
		t.Fatalf("the cached denial asked Redis %d times", n)
	}
	if got := hdr.Get("X-RateLimit-Remaining"); got != "2" {
		t.Errorf("cached denial 1.1 s later: X-RateLimit-Remaining %q, want 2 (as Redis would say)", got)
	}
	if got := hdr.Get("RateLimit"); !strings.Contains(got, ";r=2;t=1") {
		t.Errorf("cached denial 1.1 s later: RateLimit %q, want r=2;t=1", got)
	}
}
