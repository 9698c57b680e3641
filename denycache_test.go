package ratelimit

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// peekTokens is the script's arithmetic without the take: the tokens a
// bucket holds now, as Redis would compute them for the next request,
// and Redis's time in microseconds.
var peekTokens = redis.NewScript(`
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local tokens = burst
local state = redis.call('GET', KEYS[1])
if state then
  local stored, at = string.match(state, '^(%S+) (%d+)$')
  tokens = math.min(burst, tonumber(stored) + math.max(0, now - tonumber(at)) * rate / 1000000)
end
return {tostring(tokens), now}`)

func TestDenyCacheNeverDeniesWhatRedisWouldAdmit(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const rate, burst, cost = 20.0, 20, 2
	h := provision(t, &Handler{
		Zone: "dc", Key: "{http.request.header.X-Key}", ReplenishRate: rate,
		BurstCapacity: ptr(int64(burst)), RequestedTokens: cost,
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
				key := h.bucketPrefix + "flood"
				started := time.Now()
				_, cached := h.denied.get(key, started)
				r, w := newRequest("192.0.2.1", http.Header{"X-Key": {"flood"}})
				err := h.ServeHTTP(w, r, okHandler)
				status := statusOf(err, w)
				if status == 200 {
					admitted.Add(1)
					continue
				}
				if !cached {
					continue // Redis itself denied
				}
				if _, still := h.denied.get(key, time.Now()); !still {
					continue // expired between the two looks: Redis may have answered
				}
				cacheDenials.Add(1)
				peek, err := peekTokens.Run(context.Background(), rdb, []string{key}, rate, burst).Slice()
				if err != nil {
					t.Error(err)
					return
				}
				tokens, _ := strconv.ParseFloat(peek[0].(string), 64)
				now := time.UnixMicro(peek[1].(int64))
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
		Zone: "flood", Key: "{http.request.header.X-Key}", ReplenishRate: 0.1, BurstCapacity: ptr(int64(1)),
		Redis: &RedisConfig{Addresses: []string{srv.Addr}},
	})
	serve := func() (int, string) {
		r, w := newRequest("192.0.2.1", http.Header{"X-Key": {"one"}})
		err := h.ServeHTTP(w, r, okHandler)
		return statusOf(err, w), w.Header().Get("Retry-After")
	}
	if status, _ := serve(); status != 200 {
		t.Fatalf("first request: %d", status)
	}
	before := scriptCalls(t, rdb)
	for i := range 1000 {
		status, retry := serve()
		if status != 429 || retry == "" || retry == "0" {
			t.Fatalf("request %d: %d, Retry-After %q; want 429 with a Retry-After", i, status, retry)
		}
	}
	// One Redis call learned the retry time (10 s); the rest were local.
	if calls := scriptCalls(t, rdb) - before; calls != 1 {
		t.Fatalf("1000 denials cost %d script calls, want 1", calls)
	}
}

func TestDenyCacheBounded(t *testing.T) {
	c := newDenyCache()
	now := time.Now()
	for i := range 3 * denyCacheSize {
		c.put("k"+strconv.Itoa(i), now, time.Hour)
	}
	if n := len(c.entries); n > denyCacheSize {
		t.Fatalf("%d entries, bound %d", n, denyCacheSize)
	}
	if _, ok := c.get("k"+strconv.Itoa(3*denyCacheSize-1), now); !ok {
		t.Fatal("the newest entry was dropped")
	}

	// A full cache of expired entries makes room by dropping expired ones,
	// many at a time, not one per insertion.
	expired := newDenyCache()
	for i := range denyCacheSize {
		expired.put("e"+strconv.Itoa(i), now.Add(-time.Hour), time.Second)
	}
	expired.put("new", now, time.Hour)
	if n := len(expired.entries); n > denyCacheSize-16 {
		t.Fatalf("%d entries after one insertion into a full cache of expired ones", n)
	}
}

// scriptCalls counts EVALSHA and EVAL calls Redis has served.
func scriptCalls(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "cmdstat_evalsha:") && !strings.HasPrefix(line, "cmdstat_eval:") {
			continue
		}
		_, rest, _ := strings.Cut(line, "calls=")
		n, _, _ := strings.Cut(rest, ",")
		v, _ := strconv.ParseInt(n, 10, 64)
		total += v
	}
	return total
}
