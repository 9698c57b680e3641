package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
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
				started := time.Now()
				_, cached := cachedUntil(h.denied, key, started)
				if status, _ := serve(context.Background(), h, "flood"); status == 200 {
					admitted.Add(1)
					continue
				}
				if !cached {
					continue // Redis itself denied
				}
				if _, still := cachedUntil(h.denied, key, time.Now()); !still {
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
	before := scriptCalls(t, rdb)
	for i := range 1000 {
		status, header := serve(context.Background(), h, "one")
		retry := header.Get("Retry-After")
		if status != 429 || retry == "" || retry == "0" {
			t.Fatalf("request %d: %d, Retry-After %q; want 429 with a Retry-After", i, status, retry)
		}
	}
	// One Redis call learned the retry time (10 s); the rest were local.
	if calls := scriptCalls(t, rdb) - before; calls != 1 {
		t.Fatalf("1000 denials cost %d script calls, want 1", calls)
	}
}

func TestDenyCacheRemembersUntilTheRetry(t *testing.T) {
	c := newDenyCache()
	sent := time.Unix(1_700_000_000, 0)
	putDenial(c, "k", sent, 1500*time.Millisecond)
	// The script rounds its wait up to the microsecond: the bucket may
	// hold the tokens up to a microsecond sooner.
	until := sent.Add(1500*time.Millisecond - time.Microsecond)
	if got, ok := cachedUntil(c, "k", until.Add(-time.Nanosecond)); !ok || !got.Equal(until) {
		t.Fatalf("just before the retry: %v %v, want the denial until %v", got, ok, until)
	}
	if got, ok := cachedUntil(c, "k", until); ok {
		t.Fatalf("at the retry: still denied (until %v)", got)
	}
	if _, ok := cachedUntil(c, "other", sent); ok {
		t.Fatal("a key never denied is denied")
	}
}

func TestDenyCacheBounded(t *testing.T) {
	c := newDenyCache()
	now := time.Now()
	for i := range 3 * denyCacheSize {
		putDenial(c, "k"+strconv.Itoa(i), now, time.Hour)
	}
	if n := len(c.entries); n > denyCacheSize {
		t.Fatalf("%d entries, bound %d", n, denyCacheSize)
	}
	if _, ok := cachedUntil(c, "k"+strconv.Itoa(3*denyCacheSize-1), now); !ok {
		t.Fatal("the newest entry was dropped")
	}

	// A full cache of expired entries makes room by dropping expired ones,
	// many at a time, not one per insertion.
	expired := newDenyCache()
	for i := range denyCacheSize {
		putDenial(expired, "e"+strconv.Itoa(i), now.Add(-time.Hour), time.Second)
	}
	putDenial(expired, "new", now, time.Hour)
	if n := len(expired.entries); n > denyCacheSize-16 {
		t.Fatalf("%d entries after one insertion into a full cache of expired ones", n)
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
	calls := scriptCalls(t, rdb)
	time.Sleep(1100 * time.Millisecond) // 2.2 tokens back, 0.9 s to go
	hdr := send()
	if n := scriptCalls(t, rdb) - calls; n != 0 {
		t.Fatalf("the cached denial asked Redis %d times", n)
	}
	if got := hdr.Get("X-RateLimit-Remaining"); got != "2" {
		t.Errorf("cached denial 1.1 s later: X-RateLimit-Remaining %q, want 2 (as Redis would say)", got)
	}
	if got := hdr.Get("RateLimit"); !strings.Contains(got, ";r=2;t=1") {
		t.Errorf("cached denial 1.1 s later: RateLimit %q, want r=2;t=1", got)
	}
}

// testValues are the values of the deny cache's unit tests.
var testValues = limit.Values{Rate: 1, Burst: 10, Requested: 1}

// putDenial records a denial of the one bucket at key (with testValues)
// sent at sent, short for wait.
func putDenial(c *denyCache, key string, sent time.Time, wait time.Duration) {
	c.put([]limit.Bucket{{Key: key, Values: testValues, RetryAfter: wait}}, sent)
}

// cachedUntil is until when c denies a request on the one bucket at key
// (with testValues), if it does at now.
func cachedUntil(c *denyCache, key string, now time.Time) (time.Time, bool) {
	c.mu.Lock()
	d, ok := c.entries[key]
	c.mu.Unlock()
	b := []limit.Bucket{{Key: key, Values: d.values}}
	if !ok || !c.answer(b, now) {
		return time.Time{}, false
	}
	return d.until, true
}

// TestDenyCacheKeepsNoDenialSentBeforeItsBucketWasForgotten: a refund
// that lands while a request's call is in flight drops the bucket's
// cached denial; the denial Redis then gives that call, which may be of
// the bucket before the refund, is not cached (it was, with the whole
// wait: the next request refused from the cache while the bucket held
// its tokens again). A denial of a call sent after the refund is cached.
func TestDenyCacheKeepsNoDenialSentBeforeItsBucketWasForgotten(t *testing.T) {
	c := newDenyCache()
	sent := time.Now()
	c.forget("k") // the refund's answer, while the call is in flight
	putDenial(c, "k", sent, 5000*time.Second)
	if until, ok := cachedUntil(c, "k", time.Now()); ok {
		t.Fatalf("a denial sent before its bucket's refund landed is cached until %v", until)
	}
	putDenial(c, "k", time.Now(), 5000*time.Second)
	if _, ok := cachedUntil(c, "k", time.Now()); !ok {
		t.Fatal("a denial sent after the refund landed is not cached")
	}
	sent = time.Now()
	c.forgetAll() // resets may have been missed
	putDenial(c, "k", sent, 5000*time.Second)
	if until, ok := cachedUntil(c, "k", time.Now()); ok {
		t.Fatalf("a denial sent before every denial was forgotten is cached until %v", until)
	}
}
