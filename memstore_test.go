package ratelimit

// Tests of `store memory` (internal/memstore): the buckets in the Caddy
// process. Through a real Caddy (caddytest) for what a client and an
// operator see; through a provisioned Handler, with no process, for what
// a client sees of the store (the -short tier), read as the admin API
// reads it (the store's Peek). The store's insides (when it forgets a
// bucket, its count, the heap a bucket costs) are internal/memstore's
// tests'.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// ---- Helpers of the memory store's tests (onerror_local_test.go uses them too)

// heldView is what the memory store s shows of the bucket b, as the
// admin API reads it (the store's Peek): a token bucket's ExpiresIn is 0
// when s holds none.
func heldView(t *testing.T, h *Handler, s *memstore.Store, b limit.Bucket) limit.View {
	t.Helper()
	v, err := s.For(storeReports{h}, false).Peek(t.Context(), b)
	if err != nil {
		t.Fatalf("peek of %s: %v", b.Key, err)
	}
	return v
}

// clientView is heldView of client's bucket of h's limit i, with the
// limit's values.
func clientView(t *testing.T, h *Handler, s *memstore.Store, i int, client string) limit.View {
	t.Helper()
	l := h.limits[i]
	return heldView(t, h, s, limit.Bucket{Limit: l, Key: keyOf(h, i, client), Values: l.Values})
}

// keyOf is the key of client's bucket for h's limit i, as the handler
// builds it for a key template of one plain placeholder.
func keyOf(h *Handler, i int, client string) string {
	return h.limits[i].KeyPrefix + client + h.limits[i].KeySuffix
}

// serveHeaders sends one request through h with the given request
// headers; it returns the status and the response headers.
func serveHeaders(h *Handler, headers map[string]string) (int, http.Header) {
	r, w := newRequest("192.0.2.1", "")
	for k, v := range headers {
		r.Header.Set(k, v)
	}
	err := h.ServeHTTP(w, r, okHandler)
	return statusOf(err, w.Code), w.Header()
}

// decisionLines are the debug lines `rate limit decision` logged so far.
func decisionLines(logs *observer.ObservedLogs) []map[string]any {
	var out []map[string]any
	for _, e := range logs.FilterMessage("rate limit decision").All() {
		out = append(out, e.ContextMap())
	}
	return out
}

// lastResult is the result of the last decision logged.
func lastResult(t *testing.T, logs *observer.ObservedLogs) string {
	t.Helper()
	lines := decisionLines(logs)
	if len(lines) == 0 {
		t.Fatal("no decision logged")
	}
	return fmt.Sprint(lines[len(lines)-1]["result"])
}

// memoryHandler provisions a rate_limit directive whose block body is
// body, with store memory: no Redis, so no offline() (which would add a
// redis block, refused with store memory).
func memoryHandler(tb testing.TB, args, body string) *Handler {
	tb.Helper()
	return caddyfileHandler(tb, "rate_limit "+args+" {\n\tstore memory\n\t"+
		strings.ReplaceAll(strings.TrimSpace(body), "\n", "\n\t")+"\n}")
}

// ---- Through a real Caddy

func TestMemoryStoreThroughCaddyLimitsWithHeadersPlaceholdersMetricsAndLogsWithoutRedis(t *testing.T) {
	logPath := filepath.Join(t.TempDir(), "caddy.log")
	// No redis block, and none may be given: the handler needs no Redis.
	tester := loadCaddyfile(t, nil, globalsWithLog(logPath, "DEBUG")+`
http://localhost:9080 {
	handle /m {
		rate_limit 0.5 3 {
			zone mem1
			key {http.request.header.X-Key}
			headers both
			store memory
		}
		respond "{http.rate_limit.zone} {http.rate_limit.result} {http.rate_limit.remaining} {http.rate_limit.limit}"
	}
	handle_errors {
		respond "{http.rate_limit.zone} {http.rate_limit.result} {http.rate_limit.remaining} {http.rate_limit.limit} {http.rate_limit.retry_after}" {err.status_code}
	}
}`)
	if zoneAsksRedis("mem1") {
		t.Error("a handler of store memory has a Redis client")
	}
	if refs, ok := memstore.References(storeMemory, defaultKeyPrefix, "mem1"); !ok || refs != 1 {
		t.Errorf("the store of zone mem1 has %d references (present: %v), want 1", refs, ok)
	}
	before := scrapeMetrics(t)

	// Three tokens, then a denial with Retry-After: one token at 0.5/s is
	// 2 s away, less the milliseconds since the burst, rounded up.
	for i, rem := range []string{"2", "1", "0"} {
		resp, body := get(t, tester, "/m", "mia")
		if want := "mem1 allowed " + rem + " 3"; resp.StatusCode != 200 || body != want {
			t.Fatalf("request %d: %d %q, want 200 %q", i+1, resp.StatusCode, body, want)
		}
		wait := "0"
		if rem == "0" {
			wait = "2"
		}
		assertHeaders(t, resp, map[string]string{
			"X-RateLimit-Remaining":        rem,
			"X-RateLimit-Replenish-Rate":   "0.5",
			"X-RateLimit-Burst-Capacity":   "3",
			"X-RateLimit-Requested-Tokens": "1",
			"RateLimit-Policy":             `"mem1";q=3;w=6`,
			"RateLimit":                    `"mem1";r=` + rem + ";t=" + wait,
			"Retry-After":                  "",
		})
	}
	resp, body := get(t, tester, "/m", "mia")
	if resp.StatusCode != 429 || body != "mem1 denied 0 3 2" {
		t.Fatalf("after the burst: %d %q, want 429 %q", resp.StatusCode, body, "mem1 denied 0 3 2")
	}
	assertHeaders(t, resp, map[string]string{
		"Retry-After":           "2",
		"X-RateLimit-Remaining": "0",
		"RateLimit":             `"mem1";r=0;t=2`,
	})
	// Another client has a bucket of its own.
	if resp, body := get(t, tester, "/m", "noah"); resp.StatusCode != 200 || body != "mem1 allowed 2 3" {
		t.Fatalf("another client: %d %q, want 200 %q", resp.StatusCode, body, "mem1 allowed 2 3")
	}

	after := scrapeMetrics(t)
	assertDeltas(t, before, after, map[string]float64{
		requestsSeries("mem1", "allowed"):       4,
		requestsSeries("mem1", "denied"):        1,
		requestsSeries("mem1", "overflow"):      0,
		requestsSeries("mem1", "error_allowed"): 0,
	})
	// Nothing ever went to Redis: the Redis step was never timed.
	if got := after.samples[`caddy_rate_limit_redis_duration_seconds_count{zone="mem1"}`]; got != 0 {
		t.Errorf("Redis step timed %v times in zone mem1, want never", got)
	}
	if zoneAsksRedis("mem1") {
		t.Error("after the requests, a handler of store memory has a Redis client")
	}

	type line struct{ level, result, remaining string }
	var lines []line
	eventually(t, 3*time.Second, "five decision lines in the log", func() bool {
		lines = lines[:0]
		for _, l := range limiterLines(t, logPath) {
			if l["msg"] == "rate limit decision" && l["zone"] == "mem1" {
				lines = append(lines, line{fmt.Sprint(l["level"]), fmt.Sprint(l["result"]), fmt.Sprint(l["remaining"])})
			}
		}
		return len(lines) >= 5
	})
	want := []line{{"debug", "allowed", "2"}, {"debug", "allowed", "1"}, {"debug", "allowed", "0"},
		{"debug", "denied", "0"}, {"debug", "allowed", "2"}}
	if fmt.Sprint(lines) != fmt.Sprint(want) {
		t.Errorf("decision lines %v, want %v", lines, want)
	}
}

func TestMemoryStoreSharedByZoneAcrossHandlersAndReloadsNotAcrossZonesOrKeyTemplates(t *testing.T) {
	// The generation changes only the bodies, so that each load is a real
	// reload.
	config := func(generation int) string {
		limit := func(zone, key string) string {
			return fmt.Sprintf("rate_limit 0.01 4 {\n\t\t\tzone %s\n\t\t\tkey %s\n\t\t\tstore memory\n\t\t}", zone, key)
		}
		return caddyGlobals + fmt.Sprintf(`
http://localhost:9080 {
	handle /a {
		%[2]s
		respond "a %[1]d"
	}
	handle /b {
		%[2]s
		respond "b %[1]d"
	}
	handle /other-zone {
		%[3]s
		respond "z %[1]d"
	}
	handle /other-key {
		%[4]s
		respond "k %[1]d"
	}
}`, generation, limit("mshared", "{http.request.header.X-Key}"), limit("mshared2", "{http.request.header.X-Key}"),
			limit("mshared", "k-{http.request.header.X-Key}"))
	}
	tester := loadCaddyfile(t, nil, config(0))
	send := func(path string, wantStatus int, wantRemaining, wantBody string) {
		t.Helper()
		resp, body := get(t, tester, path, "kim")
		if resp.StatusCode != wantStatus || resp.Header.Get("X-RateLimit-Remaining") != wantRemaining ||
			(wantBody != "" && body != wantBody) {
			t.Fatalf("%s: %d remaining %q body %q, want %d remaining %q body %q", path, resp.StatusCode,
				resp.Header.Get("X-RateLimit-Remaining"), body, wantStatus, wantRemaining, wantBody)
		}
	}
	// /a and /b share zone and key template: one bucket. Another zone, or
	// another key template in the zone, is another bucket.
	send("/a", 200, "3", "a 0")
	send("/b", 200, "2", "b 0")
	send("/other-zone", 200, "3", "z 0")
	send("/other-key", 200, "3", "k 0")

	// A reload that changes the config keeps the buckets ...
	loadCaddyfile(t, tester, config(1))
	send("/a", 200, "1", "a 1")
	// ... and so does a forced reload of the same config.
	forceReload(t, config(1))
	send("/b", 200, "0", "b 1")
	send("/a", 429, "0", "")
	send("/other-zone", 200, "2", "z 1")
	send("/other-key", 200, "2", "k 1")

	// The old configs released their references: three handlers of the
	// running config use zone mshared, one mshared2.
	for zone, want := range map[string]int{"mshared": 3, "mshared2": 1} {
		if refs, ok := memstore.References(storeMemory, defaultKeyPrefix, zone); !ok || refs != want {
			t.Errorf("zone %s: %d references (present: %v), want %d", zone, refs, ok, want)
		}
	}
}

// ---- Through a provisioned handler (no process)

func TestMemoryStoreProvisionsNoRedisClient(t *testing.T) {
	h := memoryHandler(t, "10 10", "zone mnoredis")
	if h.limiter != nil || h.local != nil {
		t.Fatalf("store memory set up a Redis client (%v) or local buckets (%v)", h.limiter != nil, h.local != nil)
	}
	if h.memory == nil {
		t.Fatal("store memory has no store")
	}
	expectBurstThenDeny(t, h, "nora", 10)
}

func TestMemoryStoreMaxKeysSendsNewClientsToOnErrorWithoutDroppingLiveBuckets(t *testing.T) {
	t.Run("on_error allow", func(t *testing.T) {
		h := memoryHandler(t, "0.01 2", "zone mkeys-allow\nkey {http.request.header.X-Key}\nmax_keys 3")
		logs := observeLogs(h, zapcore.DebugLevel)
		for _, k := range []string{"ann", "ben", "cal"} {
			if status, rem, _ := hit(h, k); status != 200 || rem != "1" {
				t.Fatalf("%s: %d remaining %q, want 200 1", k, status, rem)
			}
		}
		// Full: new clients pass unlimited, counted as overflow, warned
		// about once.
		for i, k := range []string{"dan", "dan", "eve"} {
			if status, rem, _ := hit(h, k); status != 200 || rem != "-1" {
				t.Fatalf("new client %s (%d): %d remaining %q, want 200 -1", k, i+1, status, rem)
			}
			if r := lastResult(t, logs); r != "overflow" {
				t.Fatalf("new client %s (%d): result %s, want overflow", k, i+1, r)
			}
		}
		if n := countLogs(logs, "in-memory store full"); n != 1 {
			t.Errorf("%d warnings for three overflows within 10 s, want 1", n)
		}
		if w := logs.FilterMessageSnippet("in-memory store full").All(); len(w) > 0 {
			if ctx := w[0].ContextMap(); w[0].Level != zapcore.WarnLevel || ctx["max_keys"] != int64(3) || ctx["on_error"] != "allow" {
				t.Errorf("warning %v %v, want warn with max_keys 3 and on_error allow", w[0].Level, ctx)
			}
		}
		// The store holds the buckets of the 3 of max_keys, and none of
		// the new clients'.
		for _, k := range []string{"ann", "ben", "cal"} {
			if v := clientView(t, h, h.memory, 0, k); v.ExpiresIn == 0 {
				t.Fatalf("the store holds no bucket of %s, one of the 3 of max_keys", k)
			}
		}
		for _, k := range []string{"dan", "eve"} {
			if v := clientView(t, h, h.memory, 0, k); v.ExpiresIn != 0 {
				t.Fatalf("the store holds a bucket of %s, a new client past max_keys: %+v", k, v)
			}
		}
		// No live bucket was dropped for them: each of the three has
		// exactly one token left. (Once their buckets would be full again,
		// the sweep makes room for new clients: internal/memstore's
		// TestMemoryStoreMaxKeysMakesRoomOnlyOnceTheSweepForgetsFullBuckets.)
		for _, k := range []string{"ann", "ben", "cal"} {
			expectBurst(t, k, 1, func() (int, string) {
				status, rem, _ := hit(h, k)
				return status, rem
			})
		}
	})

	t.Run("on_error deny", func(t *testing.T) {
		h := memoryHandler(t, "0.01 2", "zone mkeys-deny\nkey {http.request.header.X-Key}\nmax_keys 1\non_error deny")
		logs := observeLogs(h, zapcore.DebugLevel)
		if status, rem, _ := hit(h, "ann"); status != 200 || rem != "1" {
			t.Fatalf("ann: %d remaining %q, want 200 1", status, rem)
		}
		status, header := serve(t.Context(), h, "ben")
		if status != 503 || header.Get("X-RateLimit-Remaining") != "-1" || header.Get("Retry-After") != "" {
			t.Fatalf("a new client at max_keys: %d remaining %q Retry-After %q, want 503 -1 without Retry-After",
				status, header.Get("X-RateLimit-Remaining"), header.Get("Retry-After"))
		}
		if r := lastResult(t, logs); r != "overflow" {
			t.Fatalf("result %s, want overflow", r)
		}
		expectBurstThenDeny(t, h, "ann", 1)
	})

	t.Run("concurrent new clients", func(t *testing.T) {
		// Many new clients at once, on every shard: the store never holds
		// more than max_keys buckets, and every client it admitted has its
		// bucket.
		const maxKeys, workers, perWorker = 50, 8, 40
		h := memoryHandler(t, "0.01 2", fmt.Sprintf("zone mkeys-race\nkey {http.request.header.X-Key}\nmax_keys %d", maxKeys))
		var mu sync.Mutex
		admitted := map[string]bool{}
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for i := range perWorker {
					k := fmt.Sprintf("c%d-%d", w, i)
					if status, rem, _ := hit(h, k); status == 200 && rem == "1" {
						mu.Lock()
						admitted[k] = true
						mu.Unlock()
					} else if status != 200 || rem != "-1" {
						t.Errorf("%s: %d remaining %q, want 200 with 1 or -1", k, status, rem)
					}
				}
			})
		}
		wg.Wait()
		// The store holds a bucket of each admitted client (the one token
		// it took), none of the others': as many as were admitted, and no
		// more than max_keys. (Its count agrees with its maps under
		// concurrent takes: internal/memstore's
		// TestMemoryStoreMaxKeysHoldsUnderConcurrentNewBuckets.)
		if len(admitted) > maxKeys {
			t.Errorf("%d clients admitted with a bucket of their own, want at most %d", len(admitted), maxKeys)
		}
		held := 0
		for w := range workers {
			for i := range perWorker {
				k := fmt.Sprintf("c%d-%d", w, i)
				v := clientView(t, h, h.memory, 0, k)
				if v.ExpiresIn != 0 {
					held++
				}
				if admitted[k] && (v.ExpiresIn == 0 || v.Tokens < 1 || v.Tokens >= 1.5) {
					t.Errorf("%s was admitted; its bucket: %+v, want it held with the one token it took", k, v)
				} else if !admitted[k] && v.ExpiresIn != 0 {
					t.Errorf("%s was not admitted, and the store holds its bucket: %+v", k, v)
				}
			}
		}
		if held > maxKeys || held != len(admitted) {
			t.Errorf("the store holds %d buckets for %d admitted clients, want as many, at most %d", held, len(admitted), maxKeys)
		}
		if len(admitted) == 0 {
			t.Error("no client admitted")
		}
	})
}

// TestMemoryStoreFullWarnsAlsoForAClientThatLeft: the store being full is
// worth its warning whoever met it; a client that left ends with 499,
// and still the warning says that new clients follow on_error.
func TestMemoryStoreFullWarnsAlsoForAClientThatLeft(t *testing.T) {
	h := memoryHandler(t, "0.01 2", "zone mkeys-left\nkey {http.request.header.X-Key}\nmax_keys 1")
	logs := observeLogs(h, zapcore.DebugLevel)
	if status, _, _ := hit(h, "ann"); status != 200 {
		t.Fatalf("ann: %d, want 200", status)
	}
	r, w := newRequest("192.0.2.1", "ben")
	ctx, cancel := context.WithCancel(r.Context())
	cancel()
	if status := statusOf(h.ServeHTTP(w, r.WithContext(ctx), okHandler), w.Code); status != 499 {
		t.Fatalf("ben, who left: %d, want 499", status)
	}
	if n := countLogs(logs, "in-memory store full"); n != 1 {
		t.Fatalf("%d warnings that the store is full, want 1", n)
	}
}

// flood sends perWorker requests from each of workers goroutines, each
// request on the next of keys, through send, which returns the status.
// It returns how many each key had admitted, and the time from before
// the first request to after the last.
func flood(t *testing.T, keys []string, workers, perWorker int, send func(key string) int) (map[string]int, time.Duration) {
	t.Helper()
	admitted := make([]map[string]int, workers)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		admitted[w] = map[string]int{}
		wg.Go(func() {
			for i := range perWorker {
				k := keys[(w+i)%len(keys)]
				switch status := send(k); status {
				case 200:
					admitted[w][k]++
				case 429:
				default:
					t.Errorf("%s: status %d, want 200 or 429", k, status)
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	total := map[string]int{}
	for _, m := range admitted {
		for k, n := range m {
			total[k] += n
		}
	}
	return total, elapsed
}

// checkBound asserts that each key admitted at least its burst (the
// flood asks for more) and at most burst + rate*T over the flood's T.
func checkBound(t *testing.T, admitted map[string]int, keys []string, rate float64, burst int, elapsed time.Duration) {
	t.Helper()
	bound := burst + int(rate*elapsed.Seconds())
	most := 0
	for _, k := range keys {
		n := admitted[k]
		most = max(most, n)
		if n > bound || n < burst {
			t.Errorf("key %s admitted %d over %v, want from burst %d to burst + rate*T = %d", k, n, elapsed, burst, bound)
		}
	}
	t.Logf("%d keys, %v: at most %d admitted per key, bound %d", len(keys), elapsed.Round(time.Millisecond), most, bound)
}

func TestMemoryStoreConcurrentRequestsKeepTheBound(t *testing.T) {
	const rate, burst, workers, perWorker = 20.0, 20, 8, 600
	flooded := func(t *testing.T, h *Handler) func(string) int {
		observeLogs(h, zapcore.ErrorLevel) // not a debug line per request, when Caddy's default logger is at debug
		return func(k string) int {
			status, _ := serve(t.Context(), h, k)
			return status
		}
	}
	limits := fmt.Sprintf("%v %d", rate, burst)
	h := memoryHandler(t, limits, "zone mconc\nkey {http.request.header.X-Key}")
	t.Run("one key", func(t *testing.T) {
		keys := []string{"one"}
		admitted, elapsed := flood(t, keys, workers, perWorker, flooded(t, h))
		checkBound(t, admitted, keys, rate, burst, elapsed)
	})
	many := make([]string, 16) // each asked for 300 tokens, many times what it may admit
	for i := range many {
		many[i] = fmt.Sprintf("many-%d", i)
	}
	t.Run("many keys", func(t *testing.T) {
		admitted, elapsed := flood(t, many, workers, perWorker, flooded(t, h))
		checkBound(t, admitted, many, rate, burst, elapsed)
	})
	// The local buckets of on_error local are the same store: while
	// Redis refuses every connection, they keep the bound too.
	t.Run("on_error local", func(t *testing.T) {
		local := localHandler(t, fmt.Sprintf("rate_limit %s {\n\tzone mconc-local\n\tkey {http.request.header.X-Key}\n\ton_error local\n}", limits))
		keys := append([]string{"one"}, many[:7]...)
		admitted, elapsed := flood(t, keys, workers, perWorker, flooded(t, local))
		checkBound(t, admitted, keys, rate, burst, elapsed)
	})
}

func TestMemoryStorePoliciesAllOrNothingPerRequestValuesAndUnlimited(t *testing.T) {
	t.Run("several limits, all or nothing", func(t *testing.T) {
		h := memoryHandler(t, "", `zone mpolicy
key {http.request.header.X-Key}
headers both
limit small 0.01 2
limit big 0.01 5
limit tenant 0.01 3 {
	key {http.request.header.X-Tenant}
}`)
		logs := observeLogs(h, zapcore.DebugLevel)
		send := func(client string) (int, http.Header) {
			return serveHeaders(h, map[string]string{"X-Key": client, "X-Tenant": "acme"})
		}
		for i, want := range []string{
			`"mpolicy.small";r=1;t=0, "mpolicy.big";r=4;t=0, "mpolicy.tenant";r=2;t=0`,
			`"mpolicy.small";r=0;t=100, "mpolicy.big";r=3;t=0, "mpolicy.tenant";r=1;t=0`,
		} {
			if status, header := send("ann"); status != 200 || header.Get("RateLimit") != want {
				t.Fatalf("ann %d: %d RateLimit %q, want 200 %q", i+1, status, header.Get("RateLimit"), want)
			}
		}
		// small refuses ann: big and tenant keep their tokens exactly.
		bigKey, tenantKey := keyOf(h, 1, "ann"), keyOf(h, 2, "acme")
		bigBucket := limit.Bucket{Limit: h.limits[1], Key: bigKey, Values: h.limits[1].Values}
		tenantBucket := limit.Bucket{Limit: h.limits[2], Key: tenantKey, Values: h.limits[2].Values}
		peeked := time.Now()
		big, tenant := heldView(t, h, h.memory, bigBucket), heldView(t, h, h.memory, tenantBucket)
		status, header := send("ann")
		if status != 429 || header.Get("X-RateLimit-Burst-Capacity") != "2" || header.Get("X-RateLimit-Remaining") != "0" ||
			header.Get("Retry-After") != "100" {
			t.Fatalf("ann 3: %d %v, want 429 described by small (burst 2, remaining 0, Retry-After 100)", status, header)
		}
		if rl := header.Get("RateLimit"); !strings.Contains(rl, `"mpolicy.big";r=3;t=0`) || !strings.Contains(rl, `"mpolicy.tenant";r=1;t=0`) {
			t.Errorf("ann 3: RateLimit %q; big and tenant should still hold 3 and 1", rl)
		}
		if l := decisionLines(logs); l[len(l)-1]["limit"] != "small" {
			t.Errorf("ann 3 refused by %v, want small", l[len(l)-1]["limit"])
		}
		// Read again, each holds what it held, and what refilled since
		// (0.01/s): a take would have left a token less.
		unchanged := func(name string, b limit.Bucket, was limit.View) {
			t.Helper()
			now := heldView(t, h, h.memory, b)
			if refilled := now.Tokens - was.Tokens; now.ExpiresIn == 0 || refilled < 0 || refilled > 0.01*time.Since(peeked).Seconds()+1e-6 {
				t.Errorf("a refused request changed %s's bucket: %+v, was %+v", name, now, was)
			}
		}
		unchanged("big", bigBucket, big)
		unchanged("tenant", tenantBucket, tenant)
		// The tenant's last token goes to bob; then the tenant refuses cat,
		// and cat's own buckets are not even created.
		if status, _ := send("bob"); status != 200 {
			t.Fatalf("bob: %d, want 200", status)
		}
		if status, header := send("cat"); status != 429 || header.Get("X-RateLimit-Burst-Capacity") != "3" {
			t.Fatalf("cat: %d burst %q, want 429 described by tenant (3)", status, header.Get("X-RateLimit-Burst-Capacity"))
		}
		for i := range 2 {
			if v := clientView(t, h, h.memory, i, "cat"); v.ExpiresIn != 0 {
				t.Errorf("a refused request stored cat's bucket of limit %s", h.limits[i].Name)
			}
		}
		// The store holds ann's and bob's small and big, and the tenant's.
		for _, held := range []struct {
			limit  int
			client string
		}{{0, "ann"}, {1, "ann"}, {0, "bob"}, {1, "bob"}, {2, "acme"}} {
			if clientView(t, h, h.memory, held.limit, held.client).ExpiresIn == 0 {
				t.Errorf("the store holds no bucket of %s's limit %s", held.client, h.limits[held.limit].Name)
			}
		}
	})

	t.Run("per-request rate, burst and cost", func(t *testing.T) {
		h := memoryHandler(t, "", `zone mplan
key {http.request.header.X-Key}
replenish_rate {http.request.header.X-Rate}
burst_capacity {http.request.header.X-Burst}
requested_tokens {http.request.header.X-Cost}`)
		logs := observeLogs(h, zapcore.DebugLevel)
		send := func(client, rate, cost string) (int, http.Header) {
			return serveHeaders(h, map[string]string{"X-Key": client, "X-Rate": rate, "X-Burst": "5", "X-Cost": cost})
		}
		for _, step := range []struct {
			rate, cost       string
			status           int
			remaining, retry string
			result           string
		}{
			{"0.01", "3", 200, "2", "", "allowed"},
			{"0.01", "3", 429, "2", "100", "denied"}, // one token short at 0.01/s
			{"0.01", "2", 200, "0", "", "allowed"},
			{"0.01", "6", 400, "", "", "invalid"},     // more than the burst: refused, nothing taken
			{"unlimited", "1", 200, "", "", "exempt"}, // no limit, no headers
		} {
			status, header := send("ann", step.rate, step.cost)
			if status != step.status || header.Get("X-RateLimit-Remaining") != step.remaining ||
				header.Get("Retry-After") != step.retry || lastResult(t, logs) != step.result {
				t.Fatalf("rate %s cost %s: %d remaining %q Retry-After %q result %s; want %d %q %q %s", step.rate, step.cost,
					status, header.Get("X-RateLimit-Remaining"), header.Get("Retry-After"), lastResult(t, logs),
					step.status, step.remaining, step.retry, step.result)
			}
			if step.status == 200 && step.result == "allowed" && header.Get("X-RateLimit-Requested-Tokens") != step.cost {
				t.Errorf("cost %s: X-RateLimit-Requested-Tokens %q", step.cost, header.Get("X-RateLimit-Requested-Tokens"))
			}
		}
		// An exempt client never gets a bucket.
		if status, _ := send("free", "unlimited", "1"); status != 200 {
			t.Fatalf("exempt client: %d", status)
		}
		v := limit.Values{Rate: 0.01, Burst: 5, Requested: 1} // ann's last plan
		peek := func(client string) limit.View {
			return heldView(t, h, h.memory, limit.Bucket{Limit: h.limits[0], Key: keyOf(h, 0, client), Values: v})
		}
		if peek("free").ExpiresIn != 0 || peek("ann").ExpiresIn == 0 {
			t.Error("an exempt request created a bucket")
		}
	})

	t.Run("fixed unlimited", func(t *testing.T) {
		h := memoryHandler(t, "", "zone mfree\nkey {http.request.header.X-Key}\nreplenish_rate unlimited")
		for range 3 {
			if status, header := serve(t.Context(), h, "x"); status != 200 || header.Get("X-RateLimit-Remaining") != "" {
				t.Fatalf("unlimited: %d with headers %v, want 200 without", status, header)
			}
		}
		if v := heldView(t, h, h.memory, limit.Bucket{Limit: h.limits[0], Key: keyOf(h, 0, "x"), Values: limit.Values{Rate: 1, Burst: 1, Requested: 1}}); v.ExpiresIn != 0 {
			t.Errorf("unlimited stored a bucket: %+v", v)
		}
	})
}

func TestStoreMemoryRefusedCombinationsInJSON(t *testing.T) {
	// store memory cannot go through offline(), which adds a redis block;
	// none of these sets up a Redis client (the memory store is set up
	// before Validate refuses), and the redis block points nowhere.
	for _, tc := range []struct {
		name string
		json string
		want []string
	}{
		{"store memory with a redis block", `{"replenish_rate": 1, "store": "memory", "redis": {"addresses": ["` + deadRedis + `"]}}`,
			[]string{"store 'memory'", "'redis' block"}},
		{"store memory with on_error local", `{"replenish_rate": 1, "store": "memory", "on_error": "local"}`,
			[]string{"on_error 'local' with store 'memory'"}},
		{"negative max_keys", `{"replenish_rate": 1, "store": "memory", "max_keys": -1}`,
			[]string{"max_keys '-1'", "1 or more"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := new(Handler)
			if err := json.Unmarshal([]byte(tc.json), h); err != nil {
				t.Fatalf("json: %v", err)
			}
			err := tryProvision(t, h)
			if err == nil {
				t.Fatalf("no error for %s", tc.json)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if h.limiter != nil {
				t.Error("a Redis client was set up")
			}
			_ = h.Cleanup() // Caddy cleans up a module that failed to validate
		})
	}
}
