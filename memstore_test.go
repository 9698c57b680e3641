package ratelimit

// Tests of `store memory` (internal/memstore): the buckets in the Caddy
// process. Through a real Caddy (caddytest) for what a client and an
// operator see; through a provisioned Handler, with no process, for the
// store's own behaviour (the -short tier); and a measurement of what a
// bucket costs the heap, behind -short like TestRedisMemoryPerBucket.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
	"github.com/caddy-redis/ratelimit/internal/testproc"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// ---- Helpers of the memory store's tests (onerror_local_test.go uses them too)

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

// storedBucket is the state s holds for the bucket whose key is key.
func storedBucket(s *memstore.Store, key string) (limit.State, bool) { return s.Lookup(key) }

// sweepAt is sweep at store time t (microseconds, limit.Micros): every
// shard once, each locked while it is swept.
func sweepAt(s *memstore.Store, t int64) { s.SweepAt(t) }

// storeTime is the wall time of store time t, for take.
func storeTime(t int64) time.Time { return limit.ClockStart.Add(time.Duration(t) * time.Microsecond) }

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

func TestMemoryStoreForgetsABucketOnceItWouldBeFullAgain(t *testing.T) {
	// Two handlers of one zone (one store), with key templates of their
	// own: fay takes 1 of 10 tokens at 10/s, full again after 0.1 s and
	// kept for the 1 s minimum, as the Redis key's TTL; sam takes 5 of 10
	// at 1/s, full again after 5 s.
	fast := memoryHandler(t, "10 10", "zone mforget\nkey {http.request.header.X-Key}")
	slow := memoryHandler(t, "1 10", "zone mforget\nkey _{http.request.header.X-Key}")
	s := fast.memory
	if slow.memory != s {
		t.Fatal("two handlers of one zone have stores of their own")
	}
	if status, rem, _ := hit(fast, "fay"); status != 200 || rem != "9" {
		t.Fatalf("fay: %d remaining %q, want 200 9", status, rem)
	}
	if n := storedBuckets(t, s); n != 1 {
		t.Fatalf("after one request the store holds %d buckets, want 1", n)
	}
	for range 5 {
		hit(slow, "sam")
	}
	fayKey, samKey := keyOf(fast, 0, "fay"), keyOf(slow, 0, "_sam")
	fay, ok1 := storedBucket(s, fayKey)
	sam, ok2 := storedBucket(s, samKey)
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
	var b = []limit.Bucket{{Key: fayKey, Values: fast.limits[0].Values}}
	if allowed, err := s.Take(storeTime(fay.Expires), b); !allowed || err != nil || b[0].Remaining != 9 {
		t.Fatalf("take on fay's expired bucket: %v %v remaining %d, want allowed with 9", allowed, err, b[0].Remaining)
	}
	if n := storedBuckets(t, s); n != 2 {
		t.Fatalf("after a take on an expired bucket the store holds %d, want 2", n)
	}
	fay, _ = storedBucket(s, fayKey)

	sweepAt(s, fay.Expires-1)
	if n := storedBuckets(t, s); n != 2 {
		t.Fatalf("a sweep just before fay's bucket is full left %d buckets, want 2", n)
	}
	sweepAt(s, fay.Expires)
	if _, ok := storedBucket(s, fayKey); ok {
		t.Error("fay's bucket, full again, was not forgotten")
	}
	if _, ok := storedBucket(s, samKey); !ok || storedBuckets(t, s) != 1 {
		t.Fatal("sam's bucket, not full yet, was forgotten")
	}
	sweepAt(s, sam.Expires)
	if n := storedBuckets(t, s); n != 0 {
		t.Fatalf("once both are full again the store holds %d buckets, want 0", n)
	}
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
		if n := storedBuckets(t, h.memory); n != 3 {
			t.Fatalf("the store holds %d buckets, want the 3 of max_keys", n)
		}
		// No live bucket was dropped for them: each of the three has
		// exactly one token left.
		for _, k := range []string{"ann", "ben", "cal"} {
			expectBurst(t, k, 1, func() (int, string) {
				status, rem, _ := hit(h, k)
				return status, rem
			})
		}
		// Once their buckets would be full again (2 tokens at 0.01/s:
		// 200 s), the sweep forgets them, and new clients fit.
		var last int64
		for _, k := range []string{"ann", "ben", "cal"} {
			b, _ := storedBucket(h.memory, keyOf(h, 0, k))
			last = max(last, b.Expires)
		}
		sweepAt(h.memory, last)
		for _, k := range []string{"dan", "eve", "fin"} {
			if status, rem, _ := hit(h, k); status != 200 || rem != "1" {
				t.Fatalf("after the sweep, %s: %d remaining %q, want 200 1", k, status, rem)
			}
		}
		if status, rem, _ := hit(h, "gus"); status != 200 || rem != "-1" || lastResult(t, logs) != "overflow" {
			t.Fatalf("a fourth new client: %d remaining %q result %s, want 200 -1 overflow", status, rem, lastResult(t, logs))
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
		var admitted []string
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for i := range perWorker {
					k := fmt.Sprintf("c%d-%d", w, i)
					if status, rem, _ := hit(h, k); status == 200 && rem == "1" {
						mu.Lock()
						admitted = append(admitted, k)
						mu.Unlock()
					} else if status != 200 || rem != "-1" {
						t.Errorf("%s: %d remaining %q, want 200 with 1 or -1", k, status, rem)
					}
				}
			})
		}
		wg.Wait()
		if n := storedBuckets(t, h.memory); n > maxKeys || n != len(admitted) {
			t.Errorf("the store holds %d buckets for %d admitted clients, want as many, at most %d", n, len(admitted), maxKeys)
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
		big, _ := storedBucket(h.memory, bigKey)
		tenant, _ := storedBucket(h.memory, tenantKey)
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
		if b, _ := storedBucket(h.memory, bigKey); b != big {
			t.Errorf("a refused request changed big's bucket: %+v, was %+v", b, big)
		}
		if b, _ := storedBucket(h.memory, tenantKey); b != tenant {
			t.Errorf("a refused request changed tenant's bucket: %+v, was %+v", b, tenant)
		}
		// The tenant's last token goes to bob; then the tenant refuses cat,
		// and cat's own buckets are not even created.
		if status, _ := send("bob"); status != 200 {
			t.Fatalf("bob: %d, want 200", status)
		}
		if status, header := send("cat"); status != 429 || header.Get("X-RateLimit-Burst-Capacity") != "3" {
			t.Fatalf("cat: %d burst %q, want 429 described by tenant (3)", status, header.Get("X-RateLimit-Burst-Capacity"))
		}
		for i := range 2 {
			if _, ok := storedBucket(h.memory, keyOf(h, i, "cat")); ok {
				t.Errorf("a refused request stored cat's bucket of limit %s", h.limits[i].Name)
			}
		}
		if n := storedBuckets(t, h.memory); n != 5 { // ann's and bob's small and big, and the tenant's
			t.Errorf("the store holds %d buckets, want 5", n)
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
		if _, ok := storedBucket(h.memory, keyOf(h, 0, "free")); ok || storedBuckets(t, h.memory) != 1 {
			t.Error("an exempt request created a bucket")
		}
	})

	t.Run("fixed unlimited", func(t *testing.T) {
		h := memoryHandler(t, "", "zone mfree\nreplenish_rate unlimited")
		for range 3 {
			if status, header := serve(t.Context(), h, "x"); status != 200 || header.Get("X-RateLimit-Remaining") != "" {
				t.Fatalf("unlimited: %d with headers %v, want 200 without", status, header)
			}
		}
		if n := storedBuckets(t, h.memory); n != 0 {
			t.Errorf("unlimited stored %d buckets", n)
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

// ---- Measurement

// maxHeapBytesPerBucket is the target for what one bucket of the
// memory store costs the Go heap, its key included.
const maxHeapBytesPerBucket = 128

// TestMemoryStoreHeapPerBucket inserts many buckets (100,000, or
// RATELIMIT_MEMORY_KEYS) into a memory store through take, with keys as
// a handler keyed by {client_ip} builds them (its key template, from a
// request's address), and measures the heap per live bucket, then the
// time of a full sweep when nothing has expired and when everything has.
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
	h := memoryHandler(t, "0.01 100", fmt.Sprintf("zone api\nkey {http.vars.client_ip}\nmax_keys %d", n))
	s, l := h.memory, h.limits[0]
	repl := caddy.NewReplacer()
	key := func(i int) string {
		repl.Set("http.vars.client_ip", ipv4Key(i))
		return l.Template.ReplacerKey(repl, l.KeyPrefix, l.KeySuffix)
	}
	if k, want := key(1), l.KeyPrefix+"10.0.0.1"; k != want {
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
			b[0] = limit.Bucket{Key: key(i), Values: l.Values}
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
	sweepAt(s, limit.Micros(now)+10_001_000_000) // an empty bucket is full again in 10,000 s
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

func TestMemoryStoreTakesOutOfClockOrderKeepTheBound(t *testing.T) {
	// A request reads the clock before it locks its shards, so concurrent
	// requests can reach a bucket out of their clocks' order. Over [t0,
	// t0+2s] a bucket of burst 10 at 1/s admits at most 12.
	h := memoryHandler(t, "1 10", "zone morder\nkey {http.request.header.X-Key}")
	s, v, key := h.memory, h.limits[0].Values, keyOf(h, 0, "olga")
	t0 := limit.Micros(time.Now())
	admitted, lastAt := 0, int64(0)
	take := func(at int64) {
		t.Helper()
		b := []limit.Bucket{{Key: key, Values: v}}
		allowed, err := s.Take(storeTime(at), b)
		if err != nil {
			t.Fatal(err)
		}
		if allowed {
			admitted++
		}
		state, _ := storedBucket(s, key)
		if state.At < lastAt {
			t.Errorf("the bucket's time went back from %d to %d", lastAt, state.At)
		}
		lastAt = state.At
	}
	for range 10 {
		take(t0)
	}
	// 2 s later, two tokens are back. A request whose clock read t0+2s
	// takes first; then one that read t0+1s and waited for the lock; then
	// two more at t0+2s.
	for _, at := range []int64{t0 + 2_000_000, t0 + 1_000_000, t0 + 2_000_000, t0 + 2_000_000} {
		take(at)
	}
	if admitted != 12 {
		t.Errorf("%d admitted over 2 s, want burst + rate*T = 12", admitted)
	}
}
