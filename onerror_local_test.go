package ratelimit

// Tests of `on_error local`: while Redis fails, a bucket in the Caddy
// process decides (a memory store, internal/memstore, per zone); once
// Redis answers, Redis decides again. Without a process against a Redis
// that refuses every connection (offline), and through a real Caddy
// while a real redis-server is stopped and started again.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap/zapcore"
)

// localHandler provisions a rate_limit directive against deadRedis.
func localHandler(t *testing.T, directive string) *Handler {
	t.Helper()
	h, err := parseTestCaddyfile(directive)
	if err != nil {
		t.Fatalf("parsing %q: %v", directive, err)
	}
	return provision(t, offline(h))
}

func TestOnErrorLocalDecidesWithInProcessBucketsWhileRedisFails(t *testing.T) {
	const directive = "rate_limit 0.1 3 {\n\tzone lshort\n\tkey {http.request.header.X-Key}\n\ton_error local\n}"
	h := localHandler(t, directive)
	if h.local == nil || h.limiter == nil || h.memory != nil {
		t.Fatalf("on_error local: local buckets %v, Redis client %v, store memory %v; want the first two",
			h.local != nil, h.limiter != nil, h.memory != nil)
	}
	logs := observeLogs(h, zapcore.DebugLevel)
	send := func(key string, wantStatus int, wantRemaining, wantRetry, wantResult string) {
		t.Helper()
		status, header := serve(t.Context(), h, key)
		if status != wantStatus || header.Get("X-RateLimit-Remaining") != wantRemaining ||
			header.Get("Retry-After") != wantRetry || lastResult(t, logs) != wantResult {
			t.Fatalf("%s: %d remaining %q Retry-After %q result %s; want %d %q %q %s", key, status,
				header.Get("X-RateLimit-Remaining"), header.Get("Retry-After"), lastResult(t, logs),
				wantStatus, wantRemaining, wantRetry, wantResult)
		}
	}
	// Redis refuses every connection: the first five requests fail there
	// and open its breaker, the later ones skip it; all are decided by
	// the local bucket. Drained, it refuses with the wait for one token
	// at 0.1/s.
	for _, rem := range []string{"2", "1", "0"} {
		send("lena", 200, rem, "", "error_local_allowed")
	}
	for range 4 {
		send("lena", 429, "0", "10", "error_local_denied")
	}
	if h.limiter.OpenBreakers() != 1 {
		t.Error("seven failures in a row, and the breaker is not open")
	}
	send("milo", 200, "2", "", "error_local_allowed")
	if n := countLogs(logs, "Redis failed"); n != 1 {
		t.Errorf("%d warnings about Redis, want 1 (throttled)", n)
	}

	// The local buckets belong to the zone: another handler of it meets
	// them.
	other := localHandler(t, directive)
	observeLogs(other, zapcore.WarnLevel)
	if other.local != h.local {
		t.Fatal("two handlers of one zone have local buckets of their own")
	}
	if status, header := serve(t.Context(), other, "lena"); status != 429 || header.Get("Retry-After") != "10" {
		t.Fatalf("lena through the zone's other handler: %d Retry-After %q, want 429 10", status, header.Get("Retry-After"))
	}
	for _, client := range []string{"lena", "milo"} {
		if v := clientView(t, h, h.local, 0, client); v.ExpiresIn == 0 {
			t.Errorf("the local buckets hold no bucket of %s, want lena's and milo's", client)
		}
	}
	if refs, ok := memstore.References(onErrorLocal, defaultKeyPrefix, "lshort"); !ok || refs != 2 {
		t.Errorf("the zone's local buckets have %d references (present: %v), want 2", refs, ok)
	}
}

func TestOnErrorLocalAtMaxKeysLetsANewClientPass(t *testing.T) {
	h := localHandler(t, "rate_limit 0.1 3 {\n\tzone lfull\n\tkey {http.request.header.X-Key}\n\ton_error local\n\tmax_keys 1\n}")
	logs := observeLogs(h, zapcore.DebugLevel)
	if status, rem, _ := hit(h, "lena"); status != 200 || rem != "2" || lastResult(t, logs) != "error_local_allowed" {
		t.Fatalf("lena: %d remaining %q result %s, want 200 2 error_local_allowed", status, rem, lastResult(t, logs))
	}
	if status, rem, _ := hit(h, "milo"); status != 200 || rem != "-1" || lastResult(t, logs) != "error_allowed" {
		t.Fatalf("a new client with the local buckets full: %d remaining %q result %s, want 200 -1 error_allowed",
			status, rem, lastResult(t, logs))
	}
}

func TestOnErrorLocalDescribesEveryBucketAfterAPartialRedisAnswer(t *testing.T) {
	// On Redis Cluster, limits with different key templates are taken
	// group by group; when a group fails, the later groups' buckets are
	// marked unknown. The local decision knows every bucket: the one that
	// refuses must be described, and its wait must be Retry-After.
	h := localHandler(t, `rate_limit {
	zone lparts
	on_error local
	limit small 0.01 1 {
		key {http.request.header.X-Key}
	}
	limit big 0.01 5 {
		key {http.request.header.X-Tenant}
	}
}`)
	observeLogs(h, zapcore.WarnLevel)
	send := func(unknown bool) (int, map[string]string) {
		r, w := newRequest("192.0.2.1", "kai")
		r.Header.Set("X-Tenant", "acme")
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		buckets, _, err := h.resolveBuckets(r, repl, nil)
		if err != nil || len(buckets) != 2 {
			t.Fatalf("buckets %d, %v", len(buckets), err)
		}
		buckets[0].Unknown = unknown // as takeGroups leaves a later group's bucket
		req := acquireRequest()
		req.Buckets = append(req.Buckets, buckets...)
		layer := h.withFallback(failedStore{err: errors.New("Redis is down")})
		allowed, err := layer.Take(context.Background(), &req.Call)
		if err != nil || req.Failed || req.TakenBy == nil {
			t.Fatalf("on_error local: err %v, failed %v, taken by %v", err, req.Failed, req.TakenBy)
		}
		pass, err := h.answer(w, r, repl, req, allowed)
		req.free()
		if pass {
			err = okHandler.ServeHTTP(w, r)
		}
		hdr := map[string]string{}
		for _, k := range []string{"Retry-After", "X-RateLimit-Burst-Capacity", "X-RateLimit-Remaining"} {
			hdr[k] = w.Header().Get(k)
		}
		return statusOf(err, w.Code), hdr
	}
	if status, _ := send(false); status != 200 {
		t.Fatalf("first request: %d, want 200", status)
	}
	status, hdr := send(true)
	if want := map[string]string{"Retry-After": "100", "X-RateLimit-Burst-Capacity": "1", "X-RateLimit-Remaining": "0"}; status != 429 ||
		fmt.Sprint(hdr) != fmt.Sprint(want) {
		t.Fatalf("refused by small: %d %v, want 429 %v", status, hdr, want)
	}
}

func TestOnErrorLocalThroughCaddyLimitsWhileRedisIsDownAndRedisDecidesOnceBack(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	tester := loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(`
http://localhost:9080 {
	rate_limit 0.1 3 {
		zone loc
		key {http.request.header.X-Key}
		on_error local
		redis {
			address %s
			timeout 200ms
		}
	}
	respond "{http.rate_limit.result} {http.rate_limit.remaining}"
	handle_errors {
		respond "{http.rate_limit.result} {http.rate_limit.remaining} {http.rate_limit.retry_after}" {err.status_code}
	}
}`, srv.Addr))
	send := func(key string, wantStatus int, wantBody, wantRetry string) {
		t.Helper()
		resp, body := get(t, tester, "/", key)
		if resp.StatusCode != wantStatus || body != wantBody || resp.Header.Get("Retry-After") != wantRetry {
			t.Fatalf("%s: %d %q Retry-After %q; want %d %q %q", key, resp.StatusCode, body,
				resp.Header.Get("Retry-After"), wantStatus, wantBody, wantRetry)
		}
	}
	before := scrapeMetrics(t)

	// Redis decides: drained spends its whole burst (and asks no more, so
	// no denial is cached), under one token.
	for _, rem := range []string{"2", "1", "0"} {
		send("drained", 200, "allowed "+rem, "")
	}
	send("under", 200, "allowed 2", "")
	// The buckets outlive the restart below: redistest saves nothing by
	// itself, but loads what SAVE wrote.
	if err := rdb.Save(context.Background()).Err(); err != nil {
		t.Fatalf("SAVE: %v", err)
	}

	srv.Stop(t)
	// Redis down: each instance limits on its own, from full local
	// buckets (what clients spent in Redis is not known locally). A
	// client over its local limit is refused with the local wait for one
	// token at 0.1/s; one under it passes. The first five requests fail
	// at Redis and open its breaker; the later ones skip Redis.
	send("under", 200, "error_local_allowed 2", "")
	send("drained", 200, "error_local_allowed 2", "")
	for _, rem := range []string{"2", "1", "0"} {
		send("over", 200, "error_local_allowed "+rem, "")
	}
	for range 3 {
		send("over", 429, "error_local_denied 0 10", "10")
	}
	outage := scrapeMetrics(t)
	assertDeltas(t, before, outage, map[string]float64{
		requestsSeries("loc", "allowed"):             4,
		requestsSeries("loc", "error_local_allowed"): 5,
		requestsSeries("loc", "error_local_denied"):  3,
		requestsSeries("loc", "error_allowed"):       0,
		requestsSeries("loc", "error_denied"):        0,
	})
	if got := outage.samples[`caddy_rate_limit_breaker_open{zone="loc"}`]; got != 1 {
		t.Errorf("breaker_open %v after eight failures in a row, want 1", got)
	}

	// Redis back: within a second (the breaker's cooldown, then one
	// probe), Redis decides again. over, refused locally, has a full
	// bucket in Redis.
	srv.Restart(t)
	var body string
	took := eventually(t, time.Second, "Redis decides again", func() bool {
		_, body = get(t, tester, "/", "over")
		return strings.HasPrefix(body, "allowed")
	})
	t.Logf("Redis decided again %v after it answered PING", took.Round(time.Millisecond))
	if body != "allowed 2" {
		t.Fatalf("over, once Redis is back: %q, want %q (a full Redis bucket)", body, "allowed 2")
	}
	// drained, admitted locally during the outage, is refused by Redis,
	// which kept its empty bucket; under has what it left in Redis.
	resp, body := get(t, tester, "/", "drained")
	retry, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != 429 || err != nil || retry < 1 || retry > 10 || body != fmt.Sprintf("denied 0 %d", retry) {
		t.Fatalf("drained, once Redis is back: %d %q Retry-After %q; want 429 \"denied 0 <1..10>\" (Redis's)",
			resp.StatusCode, body, resp.Header.Get("Retry-After"))
	}
	send("under", 200, "allowed 1", "")
	assertDeltas(t, outage, scrapeMetrics(t), map[string]float64{
		requestsSeries("loc", "allowed"): 2,
		requestsSeries("loc", "denied"):  1,
	})
}

// failedStore is a store whose every take fails with err: what a layer
// above Redis sees while Redis fails.
type failedStore struct {
	noStore
	err error
}

func (s failedStore) Take(context.Context, *limit.Call) (bool, error) { return false, s.err }
