package ratelimit

// Tests of policies (several named limits in one handler), plans and
// costs per request, against real redis-server processes and the
// in-process Caddy of caddytest. The Cluster side is in
// policy_cluster_test.go.

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/layer"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddy-redis/ratelimit/internal/testproc"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zapcore"
)

// ---- Helpers of the policy tests

// policyRequest is a GET from 192.0.2.1 with the given headers (name,
// value, name, value, ...), prepared as Caddy's server prepares it.
func policyRequest(headers ...string) (*http.Request, *httptest.ResponseRecorder) {
	r, err := http.NewRequest(http.MethodGet, "http://example.com/", nil)
	if err != nil {
		panic(err)
	}
	r.RemoteAddr = "192.0.2.1:1234"
	for i := 0; i+1 < len(headers); i += 2 {
		r.Header.Set(headers[i], headers[i+1])
	}
	w := httptest.NewRecorder()
	return caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, &caddyhttp.Server{}), w
}

// policyAnswer is what one request through a handler got.
type policyAnswer struct {
	status int
	header http.Header
	repl   *caddy.Replacer
}

// placeholder is the value of a placeholder after the handler ran.
func (a policyAnswer) placeholder(name string) string {
	v, _ := a.repl.GetString(name)
	return v
}

func (a policyAnswer) result() string    { return a.placeholder("http.rate_limit.result") }
func (a policyAnswer) limitName() string { return a.placeholder("http.rate_limit.limit_name") }
func (a policyAnswer) remaining() string { return a.header.Get("X-RateLimit-Remaining") }

func (a policyAnswer) String() string {
	return fmt.Sprintf("%d result %q limit %q remaining %q", a.status, a.result(), a.limitName(), a.remaining())
}

// servePolicy sends one request with the headers through h, whose next
// handler answers 200.
func servePolicy(h *Handler, headers ...string) policyAnswer {
	r, w := policyRequest(headers...)
	err := h.ServeHTTP(w, r, okHandler)
	return policyAnswer{statusOf(err, w.Code), w.Header(), r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)}
}

// policyBuckets resolves the buckets a request with the headers meets,
// as ServeHTTP does: their Redis keys and values, by limit.
func policyBuckets(t *testing.T, h *Handler, headers ...string) map[string]limit.Bucket {
	t.Helper()
	r, _ := policyRequest(headers...)
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	buckets, _, err := h.resolveBuckets(r, repl, nil)
	if err != nil {
		t.Fatalf("resolving the buckets of %q: %v", headers, err)
	}
	byName := map[string]limit.Bucket{}
	for _, b := range buckets {
		byName[b.Limit.Name] = b
	}
	return byName
}

// limitKey is the Redis key of the named limit's bucket for a client key
// that needs no escaping.
func limitKey(t *testing.T, h *Handler, name, client string) string {
	t.Helper()
	for _, l := range h.limits {
		if l.Name == name {
			return l.KeyPrefix + client + l.KeySuffix
		}
	}
	t.Fatalf("no limit %q", name)
	return ""
}

// readBucket reads a bucket's stored state.
func readBucket(t *testing.T, rdb redis.Cmdable, key string) scriptBucket {
	t.Helper()
	b, err := parseBucket(rdb.Get(context.Background(), key))
	if err != nil {
		t.Fatalf("reading bucket %s: %v", key, err)
	}
	return b
}

// expectStoredTokens asserts that the bucket at key holds, as stored,
// from lo to hi tokens.
func expectStoredTokens(t *testing.T, rdb redis.Cmdable, key string, lo, hi float64, why string) {
	t.Helper()
	b := readBucket(t, rdb, key)
	if !b.present {
		t.Errorf("%s: bucket %s is absent, want %.4f to %.4f tokens", why, key, lo, hi)
		return
	}
	if b.tokens < lo-1e-6 || b.tokens > hi+1e-6 {
		t.Errorf("%s: bucket %s holds %.6f tokens, want %.6f to %.6f", why, key, b.tokens, lo, hi)
	}
}

// cacheDenies says whether h's deny cache, at now, holds a denial of the
// bucket with these values: a request on it is answered without Redis.
func cacheDenies(h *Handler, b limit.Bucket, now time.Time) bool {
	_, kept := limit.TakeRefusals(layer.Deny(nil, h.denied, false))
	return kept.Answer([]limit.Bucket{b}, now)
}

// couldAdmitAt says whether the bucket, read from Redis now, held the
// tokens v asks at the local time started: it holds `tokens` at Redis's
// now, and since started it gained at most rate × elapsed (tokens only
// come back with time; takes only lower them), so at started it held at
// least tokens - rate × elapsed.
func couldAdmitAt(rdb *redis.Client, key string, v limit.Values, started time.Time) (bool, string, error) {
	tokens, now, err := peekTokens(rdb, key, v.Rate, v.Burst)
	if err != nil {
		return false, "", err
	}
	atStart := tokens - v.Rate*now.Sub(started).Seconds()
	return atStart >= float64(v.Requested), fmt.Sprintf("holds %.4f tokens %v after the request started, so at least %.4f then; it asks %d",
		tokens, now.Sub(started).Round(time.Microsecond), atStart, v.Requested), nil
}

// ---- All or nothing, standalone

// TestPolicyAllOrNothingUnderConcurrency: many clients of two tenants at
// once through a policy of four limits with two key templates. No limit's
// bucket admits beyond its bound, and a refusal (by the per-second or the
// tenant limit) takes nothing from any bucket: the slow per-day buckets,
// which never refuse, hold exactly their burst less what was admitted.
// allOrNothingDirective is a policy (zone, then the Redis addresses) of
// two limits per client key and two per tenant.
const allOrNothingDirective = `rate_limit {
	zone %s
	key {http.request.header.X-Key}
	on_error deny
	limit second 5 5
	limit day 1000/1d 1000
	limit tenant 10 10 {
		key {http.request.header.X-Tenant}
	}
	limit tenantday 1000/1d 1000 {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		timeout 2s
	}
}`

func TestPolicyAllOrNothingUnderConcurrency(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := caddyfileHandler(t, fmt.Sprintf(allOrNothingDirective, "aon", srv.Addr))
	runAllOrNothing(t, h, rdb, rdb)
}

// allOrNothingClients: three clients of tenant t0, whose limit (10 a
// second) holds them below their own (5 a second each), so the tenant
// refuses while they hold tokens; and one client of t1, whose own limit
// refuses while the tenant holds tokens.
var allOrNothingClients = []struct{ key, tenant string }{
	{"c0", "t0"}, {"c1", "t0"}, {"c2", "t0"}, {"c3", "t1"},
}

// runAllOrNothing floods h (the policy of TestPolicyAllOrNothingUnderConcurrency)
// from 12 goroutines for a second and checks the bounds and the day buckets;
// keysOf reads the client buckets, tenantsOf the tenant buckets.
func runAllOrNothing(t *testing.T, h *Handler, keysOf, tenantsOf redis.Cmdable) {
	t.Helper()
	const (
		secondRate, secondBurst = 5.0, 5
		tenantRate, tenantBurst = 10.0, 10
		dayRate, dayBurst       = 1000.0 / 86400, 1000
	)
	admitted := make([]atomic.Int64, len(allOrNothingClients))
	var refusedBy sync.Map // limit name -> *atomic.Int64
	var failures atomic.Int64
	start := time.Now()
	deadline := start.Add(time.Second)
	var wg sync.WaitGroup
	for g := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(deadline); i++ {
				idx := (g + i) % len(allOrNothingClients)
				c := allOrNothingClients[idx]
				a := servePolicy(h, "X-Key", c.key, "X-Tenant", c.tenant)
				switch {
				case a.status == 200 && a.result() == "allowed":
					admitted[idx].Add(1)
				case a.status == 429 && a.result() == "denied":
					n, _ := refusedBy.LoadOrStore(a.limitName(), new(atomic.Int64))
					n.(*atomic.Int64).Add(1)
				default:
					if failures.Add(1) <= 3 {
						t.Errorf("%s/%s: %v; want 200 allowed or 429 denied", c.key, c.tenant, a)
					}
				}
				time.Sleep(time.Millisecond)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if t.Failed() {
		t.FailNow()
	}

	refused := map[string]int64{}
	refusedBy.Range(func(k, v any) bool { refused[k.(string)] = v.(*atomic.Int64).Load(); return true })
	t.Logf("in %v: admitted %v, refused by limit %v", elapsed.Round(time.Millisecond), admittedCounts(admitted), refused)
	for _, name := range []string{"second", "tenant"} {
		if refused[name] == 0 {
			t.Errorf("limit %s never refused: the run did not test what it should", name)
		}
	}
	for _, name := range []string{"day", "tenantday"} {
		if refused[name] != 0 {
			t.Errorf("limit %s refused %d times; it holds 1000", name, refused[name])
		}
	}

	// Bounds: burst + rate × T per bucket, counting admitted requests by
	// the buckets they touched.
	perTenant := map[string]int64{}
	for i, c := range allOrNothingClients {
		n := admitted[i].Load()
		perTenant[c.tenant] += n
		if bound := secondBurst + secondRate*elapsed.Seconds(); float64(n) > bound {
			t.Errorf("client %s: limit second admitted %d in %v, above its bound %.2f", c.key, n, elapsed, bound)
		}
		// The day bucket never refused and never filled up again: it holds
		// its burst less what was admitted, plus at most rate × T. A token
		// missing means a refused request took from it.
		expectStoredTokens(t, keysOf, limitKey(t, h, "day", c.key), dayBurst-float64(n), dayBurst-float64(n)+dayRate*elapsed.Seconds(),
			fmt.Sprintf("client %s (%d admitted), limit day", c.key, n))
	}
	for tenant, n := range perTenant {
		if bound := tenantBurst + tenantRate*elapsed.Seconds(); float64(n) > bound {
			t.Errorf("tenant %s: limit tenant admitted %d in %v, above its bound %.2f", tenant, n, elapsed, bound)
		}
		expectStoredTokens(t, tenantsOf, limitKey(t, h, "tenantday", tenant), dayBurst-float64(n), dayBurst-float64(n)+dayRate*elapsed.Seconds(),
			fmt.Sprintf("tenant %s (%d admitted), limit tenantday", tenant, n))
	}
}

func admittedCounts(admitted []atomic.Int64) map[string]int64 {
	m := map[string]int64{}
	for i := range admitted {
		m[allOrNothingClients[i].key] = admitted[i].Load()
	}
	return m
}

// TestPolicyRefusalByAnyLimitTakesNothing: a request that one limit of a
// policy refuses, be it the first, a middle or the last, leaves every
// bucket of the request as it would be had the request never come.
func TestPolicyRefusalByAnyLimitTakesNothing(t *testing.T) {
	srv := redistest.Start(t)
	h := caddyfileHandler(t, fmt.Sprintf(refusalPolicy, "untouched", srv.Addr))
	expectRefusalsTakeNothing(t, h, srv.Client(t))
}

// refusalPolicy has three limits with keys of their own, so that each
// can be drained alone; they refill one token in 100 s, so nothing
// refills during a test. %[1]s is the zone, %[2]s the Redis address(es).
const refusalPolicy = `rate_limit {
	zone %[1]s
	key {http.request.header.X-Key}
	headers both
	limit first 0.01 3
	limit middle 0.01 5 {
		key {http.request.header.X-Tenant}
	}
	limit last 0.01 4 2 {
		key {http.request.header.X-Region}
	}
	redis %[2]s {
		timeout 2s
	}
}`

// expectRefusalsTakeNothing drains each limit of refusalPolicy in turn
// and sends a request it refuses while the other two hold tokens: every
// bucket of that request must hold, at one Redis time, the tokens it
// would have held without the request.
func expectRefusalsTakeNothing(t *testing.T, h *Handler, rdb redis.Cmdable) {
	t.Helper()
	must := func(want int, headers ...string) policyAnswer {
		t.Helper()
		a := servePolicy(h, headers...)
		if a.status != want {
			t.Fatalf("%q: %v, want %d", headers, a, want)
		}
		return a
	}
	// Buckets with tokens left for the probes: key x (first 3 -> 2),
	// tenant tp (middle 5 -> 4), region rp (last 4 -> 2).
	must(200, "X-Key", "x", "X-Tenant", "tp", "X-Region", "rp")
	for _, tc := range []struct {
		refuser string
		drain   [][]string
		probe   []string
	}{
		{"first", [][]string{
			{"X-Key", "a", "X-Tenant", "t1", "X-Region", "r1"},
			{"X-Key", "a", "X-Tenant", "t2", "X-Region", "r2"},
			{"X-Key", "a", "X-Tenant", "t3", "X-Region", "r3"},
		}, []string{"X-Key", "a", "X-Tenant", "tp", "X-Region", "rp"}},
		{"middle", [][]string{
			{"X-Key", "m1", "X-Tenant", "tm", "X-Region", "q1"},
			{"X-Key", "m2", "X-Tenant", "tm", "X-Region", "q2"},
			{"X-Key", "m3", "X-Tenant", "tm", "X-Region", "q3"},
			{"X-Key", "m4", "X-Tenant", "tm", "X-Region", "q4"},
			{"X-Key", "m5", "X-Tenant", "tm", "X-Region", "q5"},
		}, []string{"X-Key", "x", "X-Tenant", "tm", "X-Region", "rp"}},
		{"last", [][]string{
			{"X-Key", "l1", "X-Tenant", "u1", "X-Region", "rl"},
			{"X-Key", "l2", "X-Tenant", "u2", "X-Region", "rl"},
		}, []string{"X-Key", "x", "X-Tenant", "tp", "X-Region", "rl"}},
	} {
		for _, d := range tc.drain {
			must(200, d...)
		}
		buckets := policyBuckets(t, h, tc.probe...)
		before := snapshotBuckets(t, rdb, buckets)
		a := must(429, tc.probe...)
		if a.limitName() != tc.refuser || a.result() != "denied" {
			t.Errorf("probe %q: %v, want denied by %s", tc.probe, a, tc.refuser)
		}
		after := snapshotBuckets(t, rdb, buckets)
		now := redisNow(t, rdb)
		for name, b := range buckets {
			v := b.Values
			was := scriptRefill(before[name], now, v.Rate, v.Burst)
			is := scriptRefill(after[name], now, v.Rate, v.Burst)
			if math.Abs(was-is) > 1e-6 || before[name].present != after[name].present {
				t.Errorf("refused by %s: limit %s's bucket went from %+v to %+v: %.6f tokens now, want %.6f as if the request never came",
					tc.refuser, name, before[name], after[name], is, was)
			}
		}
	}
}

// snapshotBuckets reads each bucket's stored state.
func snapshotBuckets(t *testing.T, rdb redis.Cmdable, buckets map[string]limit.Bucket) map[string]scriptBucket {
	t.Helper()
	s := map[string]scriptBucket{}
	for name, b := range buckets {
		s[name] = readBucket(t, rdb, b.Key)
	}
	return s
}

// redisNow is Redis's time in microseconds.
func redisNow(t *testing.T, rdb redis.Cmdable) int64 {
	t.Helper()
	now, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now.UnixMicro()
}

// ---- The deny cache with several limits and values per request

// floodCheckingCache sends requests from 8 goroutines for a second, each
// with headers from pick(goroutine, i). Whenever h's deny cache answers a
// denial (a bucket of the request was cached with the request's values
// both before and after it), Redis, read afterwards, must confirm that
// the bucket could not have admitted the request when it started. It
// returns the admitted requests and the cache's denials by limit name.
func floodCheckingCache(t *testing.T, h *Handler, rdb *redis.Client, pick func(g, i int) []string) (admitted int64, cached map[string]int64) {
	t.Helper()
	var mu sync.Mutex
	cached = map[string]int64{}
	var admittedN, failures atomic.Int64
	deadline := time.Now().Add(time.Second)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(deadline); i++ {
				headers := pick(g, i)
				buckets := policyBuckets(t, h, headers...)
				started := time.Now()
				before := map[string]bool{}
				for name, b := range buckets {
					before[name] = cacheDenies(h, b, started)
				}
				a := servePolicy(h, headers...)
				if a.status == 200 {
					admittedN.Add(1)
					continue
				}
				if a.status != 429 {
					if failures.Add(1) <= 3 {
						t.Errorf("%q: %v, want 200 or 429", headers, a)
					}
					continue
				}
				for name, b := range buckets {
					if !before[name] || !cacheDenies(h, b, time.Now()) {
						continue // not cached, or expired meanwhile: Redis may have answered
					}
					mu.Lock()
					cached[name]++
					mu.Unlock()
					could, why, err := couldAdmitAt(rdb, b.Key, b.Values, started)
					if err != nil {
						t.Error(err)
						return
					}
					if could && failures.Add(1) <= 5 {
						t.Errorf("%q: the deny cache refused by limit %q (values %+v) what Redis would have admitted: the bucket %s",
							headers, name, b.Values, why)
					}
				}
			}
		}()
	}
	wg.Wait()
	return admittedN.Load(), cached
}

// TestDenyCacheNeverDeniesWhatRedisWouldAdmitWithSeveralLimits: a flood
// through a policy of a per-client limit (cost 2) and a per-tenant limit,
// two clients of one tenant and one of another: whenever the deny cache
// answers, for either limit, Redis confirms the bucket was short.
func TestDenyCacheNeverDeniesWhatRedisWouldAdmitWithSeveralLimits(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone dcpolicy
	key {http.request.header.X-Key}
	limit client 20 20 2
	limit tenant 15 15 {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		timeout 5s
	}
}`, srv.Addr))
	clients := [][]string{
		{"X-Key", "c0", "X-Tenant", "t0"},
		{"X-Key", "c1", "X-Tenant", "t0"},
		{"X-Key", "c2", "X-Tenant", "t1"},
	}
	admitted, cached := floodCheckingCache(t, h, rdb, func(g, i int) []string { return clients[(g+i)%len(clients)] })
	t.Logf("admitted %d; denials from the cache by limit: %v", admitted, cached)
	for _, name := range []string{"client", "tenant"} {
		if cached[name] == 0 {
			t.Errorf("the cache never answered for limit %s: the test proved nothing of it", name)
		}
	}
}

// TestDenyCacheNeverDeniesWhatRedisWouldAdmitWithPlansFromHeaders: the
// rate, burst and cost come from request headers, and one key sees
// several bursts and costs (at its one rate): the cache holds a denial
// only for requests with the same values, and whenever it answers, Redis
// confirms the bucket was short for those values.
func TestDenyCacheNeverDeniesWhatRedisWouldAdmitWithPlansFromHeaders(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone dcplans
	key {http.request.header.X-Key}
	replenish_rate   {http.request.header.X-Plan-Rate}
	burst_capacity   {http.request.header.X-Plan-Burst}
	requested_tokens {http.request.header.X-Cost}
	redis %s {
		timeout 5s
	}
}`, srv.Addr))
	plans := [][]string{
		{"X-Key", "p1", "X-Plan-Rate", "20", "X-Plan-Burst", "20", "X-Cost", "2"},
		{"X-Key", "p1", "X-Plan-Rate", "20", "X-Plan-Burst", "40", "X-Cost", "3"},
		{"X-Key", "p1", "X-Plan-Rate", "20", "X-Plan-Burst", "20", "X-Cost", "1"},
		{"X-Key", "p2", "X-Plan-Rate", "600/1m", "X-Plan-Burst", "10", "X-Cost", "2"},
		{"X-Key", "p2", "X-Plan-Rate", "600/1m", "X-Plan-Burst", "10", "X-Cost", "1"},
	}
	admitted, cached := floodCheckingCache(t, h, rdb, func(g, i int) []string { return plans[(g*3+i)%len(plans)] })
	t.Logf("admitted %d; denials from the cache: %v", admitted, cached)
	if cached[""] == 0 {
		t.Error("the cache never answered: the test proved nothing")
	}
}

// ---- Plans: one key, values per request

// plansDirective is a handler (zone, then the Redis address) whose rate
// and burst come from the request's X-Plan-Rate and X-Plan-Burst.
const plansDirective = `rate_limit {
	zone %s
	key {http.request.header.X-Key}
	replenish_rate {http.request.header.X-Plan-Rate}
	burst_capacity {http.request.header.X-Plan-Burst}
	redis %s {
		timeout 5s
	}
}`

// TestPolicyPlanSwitchKeepsTheBucketCapsAtTheNewBurstRefillsAtTheNewRate:
// the rate and burst come from the request; a client that changes plan
// between requests keeps its one bucket (its key holds neither), its
// tokens are capped at the new burst, and it refills at the new rate.
func TestPolicyPlanSwitchKeepsTheBucketCapsAtTheNewBurstRefillsAtTheNewRate(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := caddyfileHandler(t, fmt.Sprintf(plansDirective, "plans", srv.Addr))
	// big and small refill one token in 10 s: nothing refills between the
	// steps below. fast refills 10 a second.
	big := []string{"X-Key", "k", "X-Plan-Rate", "0.1", "X-Plan-Burst", "10"}
	small := []string{"X-Key", "k", "X-Plan-Rate", "0.1", "X-Plan-Burst", "4"}
	fast := []string{"X-Key", "k", "X-Plan-Rate", "10", "X-Plan-Burst", "10"}
	key := policyBuckets(t, h, big...)[""].Key
	for _, plan := range [][]string{small, fast} {
		if k := policyBuckets(t, h, plan...)[""].Key; k != key {
			t.Fatalf("plan %q has bucket %s, plan %q %s: want one", plan, k, big, key)
		}
	}
	step := func(what string, plan []string, wantStatus int, wantRemaining, wantBurst string) policyAnswer {
		t.Helper()
		a := servePolicy(h, plan...)
		if a.status != wantStatus || a.remaining() != wantRemaining || a.header.Get("X-RateLimit-Burst-Capacity") != wantBurst {
			t.Fatalf("%s: %v, X-RateLimit-Burst-Capacity %q; want %d with %s remaining of %s",
				what, a, a.header.Get("X-RateLimit-Burst-Capacity"), wantStatus, wantRemaining, wantBurst)
		}
		return a
	}
	first := time.Now()
	step("big plan, first request", big, 200, "9", "10")
	// 9 tokens, capped at the small plan's 4, less 1 (a fresh bucket of
	// the small plan would say 3 as well; the next steps tell them apart).
	step("small plan: capped at its burst", small, 200, "3", "4")
	// Back on the big plan: the same bucket, 3 left (not a fresh 10, not
	// the 8 an uncapped bucket would hold).
	step("big plan again: the same bucket, still capped", big, 200, "2", "10")
	step("big plan", big, 200, "1", "10")
	drainSent := time.Now()
	step("big plan: drained", big, 200, "0", "10")
	drainDone := time.Now()
	if n, err := rdb.DBSize(context.Background()).Result(); err != nil || n != 1 {
		t.Fatalf("Redis holds %d keys (%v), want the one bucket", n, err)
	}

	// 300 ms later the big plan would have refilled 0.03 tokens (it would
	// refuse); the fast plan refills 10 a second: about 3.
	time.Sleep(300 * time.Millisecond)
	fastSent := time.Now()
	a := servePolicy(h, fast...)
	fastDone := time.Now()
	// After the drain the bucket held what the big plan refilled since
	// the first request (0.1 a second), then it gained 10 a second for
	// between fastSent-drainDone and fastDone-drainSent.
	lo := int64(math.Floor(10*fastSent.Sub(drainDone).Seconds() - 1))
	hi := int64(math.Floor(0.1*drainDone.Sub(first).Seconds() + 10*fastDone.Sub(drainSent).Seconds() - 1))
	if a.status != 200 {
		t.Fatalf("fast plan after 300 ms: %v; it refilled at least %.1f tokens at its rate", a, 10*fastSent.Sub(drainDone).Seconds())
	}
	if n, err := strconv.ParseInt(a.remaining(), 10, 64); err != nil || n < lo || n > hi || a.header.Get("X-RateLimit-Replenish-Rate") != "10" {
		t.Fatalf("fast plan after 300 ms: remaining %q, rate %q; want %d to %d at rate 10",
			a.remaining(), a.header.Get("X-RateLimit-Replenish-Rate"), lo, hi)
	}
}

// TestPolicyMoveToASlowerPlanRefillsAtItsRate: a client drains its
// bucket on a fast plan (100/s, burst 100), whose writes give the key
// about a second to live, then moves to a slow one (0.1/s, burst 20) and
// is refused. From then on the bucket refills at 0.1/s: once the fast
// plan's second has passed, it still holds about what it held (another
// instance, without this one's cached denial, refuses the client or
// admits it with nothing left), where an expired key would read as a
// full bucket and admit it with 19 left. In Redis and in store memory.
func TestPolicyMoveToASlowerPlanRefillsAtItsRate(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	fast := []string{"X-Key", "k", "X-Plan-Rate", "100", "X-Plan-Burst", "100"}
	slow := []string{"X-Key", "k", "X-Plan-Rate", "0.1", "X-Plan-Burst", "20"}
	for _, store := range []string{storeRedis, storeMemory} {
		t.Run(store, func(t *testing.T) {
			directive := fmt.Sprintf(plansDirective, "slower-"+store, srv.Addr)
			if store == storeMemory {
				directive = strings.Replace(directive, "redis "+srv.Addr+" {\n\t\ttimeout 5s\n\t}", "store memory", 1)
			}
			h := caddyfileHandler(t, directive)
			other := caddyfileHandler(t, directive) // the same buckets, a deny cache of its own
			drained := false
			for i := 0; i < 2000 && !drained; i++ {
				drained = servePolicy(h, fast...).status == 429
			}
			if !drained {
				t.Fatal("2000 requests on the fast plan did not drain the bucket")
			}
			drainedAt := time.Now()
			if a := servePolicy(h, slow...); a.status != 429 {
				t.Fatalf("slow plan right after the drain: %v, want 429", a)
			}
			key := policyBuckets(t, h, slow...)[""].Key
			if store == storeRedis {
				// A full bucket of the slow plan is 200 s of refill away.
				if pttl := rdb.PTTL(context.Background(), key).Val(); pttl < 150*time.Second {
					t.Errorf("after the slow plan's denial the key expires in %v, want about 200 s (the slow plan's refill)", pttl)
				}
			}
			time.Sleep(time.Until(drainedAt.Add(1500 * time.Millisecond)))
			a := servePolicy(other, slow...)
			if a.status != 429 && a.remaining() != "0" {
				t.Fatalf("slow plan 1.5 s after the drain, on another instance: %v; want 429, or 200 with 0 left "+
					"(the bucket refilled at most 0.15 tokens since)", a)
			}
		})
	}
}

// TestDenyCacheForgetsADenialOnceAnotherPlanIsAdmittedOnTheBucket: a
// client denied on a slow plan, then admitted on a fast one, has a bucket
// that the fast plan refilled; back on the slow plan, its request must be
// decided on what the bucket holds now (as Redis would), not refused from
// the deny cache's entry of the slow plan's denial, which no longer says
// when the bucket holds a token.
func TestDenyCacheForgetsADenialOnceAnotherPlanIsAdmittedOnTheBucket(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := caddyfileHandler(t, fmt.Sprintf(plansDirective, "planscache", srv.Addr))
	slow := []string{"X-Key", "k", "X-Plan-Rate", "0.1", "X-Plan-Burst", "10"}
	fast := []string{"X-Key", "k", "X-Plan-Rate", "10", "X-Plan-Burst", "10"}
	for i := range 10 {
		if a := servePolicy(h, slow...); a.status != 200 {
			t.Fatalf("slow plan, request %d: %v", i+1, a)
		}
	}
	// Denied by Redis: the slow plan's next token is 10 s away, and the
	// deny cache keeps that.
	if a := servePolicy(h, slow...); a.status != 429 {
		t.Fatalf("slow plan after its burst: %v, want 429", a)
	}
	time.Sleep(300 * time.Millisecond)
	if a := servePolicy(h, fast...); a.status != 200 {
		t.Fatalf("fast plan 300 ms later: %v, want 200 (about 3 tokens at 10 a second)", a)
	}
	b := policyBuckets(t, h, slow...)[""]
	tokens, _, err := peekTokens(rdb, b.Key, b.Values.Rate, b.Values.Burst)
	if err != nil {
		t.Fatal(err)
	}
	if tokens < 1 {
		t.Fatalf("the bucket holds %.3f tokens after the fast plan's request; the test needs at least 1", tokens)
	}
	if a := servePolicy(h, slow...); a.status != 200 {
		t.Errorf("slow plan again, the bucket holding %.3f tokens: %v (Retry-After %s); want 200, as Redis would answer",
			tokens, a, a.header.Get("Retry-After"))
	}
}

// ---- Costs from the request

// TestPolicyCostFromHeaderTakesThatManyAndOnlyFromItsClient: the per-
// client limit's cost comes from X-Cost: a request takes that many
// tokens, a cost above the burst is refused with 400 before Redis
// (nothing taken, no script call), and one client's large cost drains
// only its own bucket (the shared tenant limit costs 1).
func TestPolicyCostFromHeaderTakesThatManyAndOnlyFromItsClient(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone cost
	key {http.request.header.X-Key}
	limit client 0.1 10 {http.request.header.X-Cost}
	limit tenant 0.1 100 {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		timeout 5s
	}
}`, srv.Addr))
	send := func(key, cost string) policyAnswer {
		return servePolicy(h, "X-Key", key, "X-Tenant", "shared", "X-Cost", cost)
	}
	for i, step := range []struct {
		cost      string
		status    int
		remaining string
	}{
		{"3", 200, "7"},
		{"4", 200, "3"},
		{"4", 429, "3"}, // 3 left: too few for 4, and none taken
		{"3", 200, "0"}, // another cost: Redis is asked, and takes the 3
	} {
		a := send("a", step.cost)
		if a.status != step.status || a.remaining() != step.remaining || a.header.Get("X-RateLimit-Requested-Tokens") != step.cost {
			t.Fatalf("step %d, cost %s: %v, Requested-Tokens %q; want %d with %s remaining", i+1, step.cost, a,
				a.header.Get("X-RateLimit-Requested-Tokens"), step.status, step.remaining)
		}
		if step.status == 429 && (a.limitName() != "client" || a.header.Get("Retry-After") != "10") {
			t.Fatalf("step %d: refused by %q, Retry-After %q; want client's, 10 (one token at 0.1 a second)", i+1, a.limitName(), a.header.Get("Retry-After"))
		}
	}
	tenantKey := limitKey(t, h, "tenant", "shared")
	expectStoredTokens(t, rdb, tenantKey, 97, 97.5, "the tenant after three admitted requests of cost 1")

	// Above the burst: 400 before Redis, for a fresh client and for a.
	calls := redistest.ScriptCalls(t, rdb)
	stateA, _ := rdb.Get(ctx, limitKey(t, h, "client", "a")).Result()
	for _, key := range []string{"b", "a"} {
		a := send(key, "11")
		if a.status != 400 || a.result() != "invalid" {
			t.Errorf("client %s, cost 11 over the burst of 10: %v; want 400 invalid", key, a)
		}
	}
	if n := redistest.ScriptCalls(t, rdb) - calls; n != 0 {
		t.Errorf("costs above the burst cost %d script calls, want none", n)
	}
	if n, _ := rdb.Exists(ctx, limitKey(t, h, "client", "b")).Result(); n != 0 {
		t.Error("a refused cost created client b's bucket")
	}
	if now, _ := rdb.Get(ctx, limitKey(t, h, "client", "a")).Result(); now != stateA {
		t.Errorf("a refused cost changed client a's bucket from %q to %q", stateA, now)
	}
	expectStoredTokens(t, rdb, tenantKey, 97, 97.5, "the tenant after costs above the burst")

	// A large cost drains its client's bucket only.
	if a := send("c", "10"); a.status != 200 || a.remaining() != "0" {
		t.Fatalf("client c, cost 10: %v, want 200 with 0 remaining", a)
	}
	if a := send("d", "1"); a.status != 200 || a.remaining() != "9" {
		t.Fatalf("client d after c's cost 10: %v, want 200 with 9 remaining (its own full bucket)", a)
	}
	expectStoredTokens(t, rdb, tenantKey, 95, 95.5, "the tenant (0.1 a second) after c's cost 10 and d's 1: one token each")
}

// ---- Values out of range

// TestPolicyInvalidValuesFromRequestRefusedWithoutTakingTokens: a cost
// out of range answers 400, a rate or burst out of range 500, with
// result `invalid`; no limit's bucket changes and Redis is not asked;
// the warning names the value and what is wrong, once however many such
// requests come.
func TestPolicyInvalidValuesFromRequestRefusedWithoutTakingTokens(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone invalid
	key {http.request.header.X-Key}
	limit fixed 10 20
	limit plan {http.request.header.X-Rate} {http.request.header.X-Burst} {http.request.header.X-Cost}
	redis %s {
		timeout 5s
	}
}`, srv.Addr))
	valid := map[string]string{"X-Rate": "10", "X-Burst": "20", "X-Cost": "1"}
	with := func(name, value string, omit bool) []string {
		headers := []string{"X-Key", "v"}
		for _, n := range []string{"X-Rate", "X-Burst", "X-Cost"} {
			switch {
			case n != name:
				headers = append(headers, n, valid[n])
			case !omit:
				headers = append(headers, n, value)
			}
		}
		return headers
	}
	if a := servePolicy(h, with("", "", false)...); a.status != 200 {
		t.Fatalf("valid values: %v", a)
	}
	keys := []string{limitKey(t, h, "fixed", "v"), limitKey(t, h, "plan", "v")}
	state := func() string {
		vals, err := rdb.MGet(ctx, keys...).Result()
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint(vals)
	}
	before, calls := state(), redistest.ScriptCalls(t, rdb)

	for _, tc := range []struct {
		header, value string
		omit          bool
		status        int
		want          string // in the warning's error
	}{
		{"X-Cost", "abc", false, 400, "requested_tokens 'abc' is not a whole number"},
		{"X-Cost", "0", false, 400, "requested_tokens '0' must be at least 1"},
		{"X-Cost", "-2", false, 400, "requested_tokens '-2' must be at least 1"},
		{"X-Cost", "1.5", false, 400, "requested_tokens '1.5' is not a whole number"},
		{"X-Cost", "21", false, 400, "requested_tokens '21' is more than burst_capacity '20'"},
		{"X-Cost", "", false, 400, "requested_tokens '{http.request.header.X-Cost}' resolved to nothing"},
		{"X-Cost", "", true, 400, "requested_tokens '{http.request.header.X-Cost}' resolved to nothing"},
		{"X-Rate", "fast", false, 500, "replenish_rate 'fast'"},
		{"X-Rate", "0", false, 500, "replenish_rate '0'"},
		{"X-Rate", "", true, 500, "replenish_rate '{http.request.header.X-Rate}' resolved to nothing"},
		{"X-Burst", "x", false, 500, "burst_capacity 'x' is not a whole number"},
		{"X-Burst", "5", false, 500, "burst_capacity '5' is smaller than replenish_rate '10'"},
	} {
		name := fmt.Sprintf("%s %q", tc.header, tc.value)
		if tc.omit {
			name = tc.header + " missing"
		}
		h.paramWarns = &logs.Throttle{Every: 10 * time.Second} // a fresh throttle: each case's own line
		observed := observeLogs(h, zapcore.WarnLevel)
		a := servePolicy(h, with(tc.header, tc.value, tc.omit)...)
		if a.status != tc.status || a.result() != "invalid" {
			t.Errorf("%s: %v; want %d invalid", name, a, tc.status)
		}
		entries := observed.FilterMessageSnippet("out of range").All()
		if len(entries) != 1 {
			t.Errorf("%s: %d warnings, want 1", name, len(entries))
			continue
		}
		fields := entries[0].ContextMap()
		if msg := fmt.Sprint(fields["error"]); !strings.Contains(msg, "limit plan: "+tc.want) {
			t.Errorf("%s: warning's error %q, want it to say %q", name, msg, "limit plan: "+tc.want)
		}
		if fields["status"] != int64(tc.status) {
			t.Errorf("%s: warning's status %v, want %d", name, fields["status"], tc.status)
		}
	}
	if n := redistest.ScriptCalls(t, rdb) - calls; n != 0 {
		t.Errorf("invalid values cost %d script calls, want none", n)
	}
	if after := state(); after != before {
		t.Errorf("invalid values changed the buckets from %s to %s", before, after)
	}

	// Throttled: a flood of bad values, one line.
	h.paramWarns = &logs.Throttle{Every: 10 * time.Second}
	observed := observeLogs(h, zapcore.WarnLevel)
	for i := range 50 {
		a := servePolicy(h, with("X-Cost", strconv.Itoa(100+i), false)...)
		if a.status != 400 {
			t.Fatalf("flood request %d: %v, want 400", i, a)
		}
	}
	if n := observed.Len(); n != 1 {
		t.Errorf("50 requests with bad costs logged %d warnings, want 1 (throttled)", n)
	}
}

// TestLongCostHeaderIsCutInLogsAndErrorMessage: a client sends 16 KiB
// as its cost. It is refused with 400, and what Caddy prints of it (the
// warning, and {http.error.message} through handle_errors) quotes 64
// bytes of it and says how long it was: no line of Caddy's log is longer
// than a few KiB. (At debug level, Caddy's own error log writes the
// request's headers whole, as its access log does.)
func TestLongCostHeaderIsCutInLogsAndErrorMessage(t *testing.T) {
	srv := redistest.Start(t)
	proc := caddyproc.Start(t, loggingCaddyfile("INFO", fmt.Sprintf(`
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone cut
		key {header.X-Key}
		replenish_rate 10
		burst_capacity 20
		requested_tokens {header.X-Cost}
		redis %s
	}
	respond "ok"
	handle_errors {
		respond "{err.message}" {err.status_code}
	}
}`, srv.Addr)))
	cost := strings.Repeat("9", 16*1024-1) + "x"
	resp, body := send(t, caddyClient(t), proc.URL, "X-Key", "k", "X-Cost", cost)
	if resp.StatusCode != 400 {
		t.Fatalf("a 16 KiB cost: %d %.200s, want 400", resp.StatusCode, body)
	}
	if len(body) > 300 || !strings.Contains(body, strings.Repeat("9", 64)+"…(16384 bytes in all)") {
		t.Errorf("{http.error.message} is %d bytes: %.400s; want it short, quoting 64 bytes and the length", len(body), body)
	}
	var warning string
	eventually(t, 5*time.Second, "the warning in Caddy's log", func() bool {
		log := testproc.ReadFrom(proc.LogFile, 0)
		warning = grepLines(log, "out of range")
		return warning != ""
	})
	if !strings.Contains(warning, "16384 bytes") {
		t.Errorf("the warning does not state the value's length: %.500s", warning)
	}
	if line, n := longestLine(testproc.ReadFrom(proc.LogFile, 0)); n > 4096 {
		t.Errorf("Caddy's log has a line of %d bytes: %.300s...", n, line)
	}
}

// ---- Through a real Caddy

// getWith sends GET path to caddytest's Caddy with the headers (name,
// value, ...) and returns the response with its body read.
func getWith(t *testing.T, client *http.Client, path string, headers ...string) (*http.Response, string) {
	t.Helper()
	resp, body, err := getHeaders(client, caddytestSite+path, headers...)
	if err != nil {
		t.Fatalf("GET %s %q: %v", path, headers, err)
	}
	return resp, body
}

// namedKey is the Redis key of a named limit's bucket with the default
// key_prefix: `rate_limit:{<zone>|<tag>|<client key>}|<name>`.
func namedKey(zone, template, client, name string) string {
	prefix := keys.BucketPrefix(defaultKeyPrefix, zone, template)
	return defaultKeyPrefix + "{" + prefix[len(defaultKeyPrefix):] + client + "}" + keys.Separator + name
}

// ---- Exempt

// TestPolicyUnlimitedRateExemptsWithoutRedis: a plan (Caddy's `map`)
// whose rate is `unlimited` admits without a Redis call, with result
// `exempt` in the placeholder and the metric; in a policy, only that
// limit is skipped: the others are taken as usual, and the exempt limit
// gets no bucket.
func TestPolicyUnlimitedRateExemptsWithoutRedis(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	tester := serveCaddyfile(t, `
http://localhost:9080 {
	map {http.request.header.X-Plan} {plan_rate} {plan_burst} {
		pro      100       200
		internal unlimited unlimited
		default  1         2
	}
	handle /one {
		rate_limit {
			zone exone
			key {http.request.header.X-Key}
			replenish_rate {plan_rate}
			burst_capacity {plan_burst}
			redis %[1]s
		}
		respond "{http.rate_limit.result}"
	}
	handle /policy {
		rate_limit {
			zone expolicy
			key {http.request.header.X-Key}
			limit plan {plan_rate} {plan_burst}
			limit global 0.1 100
			redis %[1]s
		}
		respond "{http.rate_limit.result}"
	}
}`, srv.Addr)
	before, calls := scrapeMetrics(t), redistest.ScriptCalls(t, rdb)
	for i := range 5 {
		resp, body := getWith(t, tester.Client, "/one", "X-Key", "staff", "X-Plan", "internal")
		if resp.StatusCode != 200 || body != "exempt" {
			t.Fatalf("internal plan, request %d: %d %q, want 200 exempt", i+1, resp.StatusCode, body)
		}
		if n := rateLimitHeaderNames(resp); len(n) != 0 {
			t.Errorf("internal plan, request %d: rate-limit headers %v; no bucket was consulted", i+1, n)
		}
	}
	if n := redistest.ScriptCalls(t, rdb) - calls; n != 0 {
		t.Errorf("5 exempt requests cost %d script calls, want none", n)
	}
	if n, _ := rdb.DBSize(ctx).Result(); n != 0 {
		t.Errorf("exempt requests left %d keys in Redis", n)
	}
	// The default plan is limited: burst 2, then refused.
	for i, want := range []string{"allowed", "allowed"} {
		if resp, body := getWith(t, tester.Client, "/one", "X-Key", "staff"); resp.StatusCode != 200 || body != want {
			t.Fatalf("default plan, request %d: %d %q, want 200 %s", i+1, resp.StatusCode, body, want)
		}
	}
	if resp, _ := getWith(t, tester.Client, "/one", "X-Key", "staff"); resp.StatusCode != 429 {
		t.Fatalf("default plan, third request: %d, want 429", resp.StatusCode)
	}
	// The same key on the internal plan is still exempt.
	if resp, body := getWith(t, tester.Client, "/one", "X-Key", "staff", "X-Plan", "internal"); resp.StatusCode != 200 || body != "exempt" {
		t.Fatalf("internal plan after the default plan's denial: %d %q, want 200 exempt", resp.StatusCode, body)
	}
	assertDeltas(t, before, scrapeMetrics(t), map[string]float64{
		requestsSeries("exone", "exempt"):  6,
		requestsSeries("exone", "allowed"): 2,
		requestsSeries("exone", "denied"):  1,
	})

	// In a policy, the plan limit is skipped, the global one taken.
	before, calls = scrapeMetrics(t), redistest.ScriptCalls(t, rdb)
	for i := range 3 {
		resp, body := getWith(t, tester.Client, "/policy", "X-Key", "staff", "X-Plan", "internal")
		if resp.StatusCode != 200 || body != "allowed" || resp.Header.Get("X-RateLimit-Remaining") != strconv.Itoa(99-i) {
			t.Fatalf("policy, internal plan, request %d: %d %q remaining %q; want 200 allowed with %d (the global limit)",
				i+1, resp.StatusCode, body, resp.Header.Get("X-RateLimit-Remaining"), 99-i)
		}
	}
	if n := redistest.ScriptCalls(t, rdb) - calls; n != 3 {
		t.Errorf("3 requests with one limit exempt cost %d script calls, want 3", n)
	}
	if n, _ := rdb.Exists(ctx, namedKey("expolicy", "{http.request.header.X-Key}", "staff", "plan")).Result(); n != 0 {
		t.Error("the exempt plan limit has a bucket in Redis")
	}
	expectStoredTokens(t, rdb, namedKey("expolicy", "{http.request.header.X-Key}", "staff", "global"), 97, 97.5, "the global limit (0.1 a second) after 3 requests")
	assertDeltas(t, before, scrapeMetrics(t), map[string]float64{
		requestsSeries("expolicy", "allowed"): 3,
		requestsSeries("expolicy", "exempt"):  0,
	})
}

// ---- Headers, placeholders and metrics of a policy

// TestPolicyHeadersPlaceholdersAndMetricsThroughCaddy: with several
// limits, RateLimit-Policy lists each, RateLimit gives each one's r and t,
// the X-RateLimit-* set describes the refusing limit on a denial and the
// one with the fewest requests left (remaining / cost, ties to the first)
// when admitted; Retry-After is the longest wait;
// {http.rate_limit.limit_name} names the refusing limit (empty when
// admitted) and the requests metric counts it under `limit`.
func TestPolicyHeadersPlaceholdersAndMetricsThroughCaddy(t *testing.T) {
	srv := redistest.Start(t)
	route := func(path, zone, limits string) string {
		return fmt.Sprintf(`
	handle %s {
		rate_limit {
			zone %s
			key {http.request.header.X-Key}
			headers both
%s
			redis %%[1]s
		}
		respond "{http.rate_limit.result} [{http.rate_limit.limit_name}] {http.rate_limit.remaining} {http.rate_limit.limit}"
	}`, path, zone, limits)
	}
	tester := serveCaddyfile(t, `
http://localhost:9080 {
	handle_errors {
		respond "{http.rate_limit.result} [{http.rate_limit.limit_name}] {http.rate_limit.retry_after}" {err.status_code}
	}`+
		route("/api", "api", "\t\t\tlimit second 10 20\n\t\t\tlimit hour 1000/1h 1000")+
		route("/wait", "wait", "\t\t\tlimit fast 1 2\n\t\t\tlimit slow 0.1 2")+
		route("/fewest", "fewest", "\t\t\tlimit big 1 10 5\n\t\t\tlimit small 1 4")+
		route("/tie", "tie", "\t\t\tlimit x 1 10 2\n\t\t\tlimit y 2 5")+`
}`, srv.Addr)
	spring := func(remaining, rate, burst, requested string) map[string]string {
		return map[string]string{"X-RateLimit-Remaining": remaining, "X-RateLimit-Replenish-Rate": rate,
			"X-RateLimit-Burst-Capacity": burst, "X-RateLimit-Requested-Tokens": requested}
	}
	expect := func(what string, resp *http.Response, body string, status int, wantBody string, headers ...map[string]string) {
		t.Helper()
		if resp.StatusCode != status || body != wantBody {
			t.Errorf("%s: %d %q, want %d %q", what, resp.StatusCode, body, status, wantBody)
		}
		for _, h := range headers {
			assertHeaders(t, resp, h)
		}
	}
	before := scrapeMetrics(t)

	// /api, the README's limits: admitted, the X set describes second (19
	// requests left, against hour's 999).
	const apiPolicy = `"api.second";q=20;w=2, "api.hour";q=1000;w=3600`
	start := time.Now()
	resp, body := getWith(t, tester.Client, "/api", "X-Key", "ann")
	expect("/api first", resp, body, 200, "allowed [] 19 20", spring("19", "10", "20", "1"), map[string]string{
		"RateLimit-Policy": apiPolicy,
		"RateLimit":        `"api.second";r=19;t=0, "api.hour";r=999;t=0`,
		"Retry-After":      "",
	})
	// Until second refuses: at least its 20, at most 20 + 10 a second.
	admitted := 1
	for ; admitted < 60; admitted++ {
		if resp, body = getWith(t, tester.Client, "/api", "X-Key", "ann"); resp.StatusCode != 200 {
			break
		}
	}
	elapsed := time.Since(start)
	if bound := 20 + 10*elapsed.Seconds(); admitted < 20 || float64(admitted) > bound {
		t.Fatalf("/api: %d admitted before the first denial in %v; want 20 to %.1f", admitted, elapsed, bound)
	}
	expect("/api denied by second", resp, body, 429, "denied [second] 1", spring("0", "10", "20", "1"), map[string]string{
		"Retry-After":      "1",
		"RateLimit-Policy": apiPolicy,
		"RateLimit":        fmt.Sprintf(`"api.second";r=0;t=1, "api.hour";r=%d;t=0`, 1000-admitted),
	})

	// /wait: both limits drained; the slow one's wait (10 s) is the
	// longest, so it is the one named, described and waited for.
	for range 2 {
		getWith(t, tester.Client, "/wait", "X-Key", "wes")
	}
	resp, body = getWith(t, tester.Client, "/wait", "X-Key", "wes")
	expect("/wait denied", resp, body, 429, "denied [slow] 10", spring("0", "0.1", "2", "1"), map[string]string{
		"Retry-After":      "10",
		"RateLimit-Policy": `"wait.fast";q=2;w=2, "wait.slow";q=2;w=20`,
		"RateLimit":        `"wait.fast";r=0;t=1, "wait.slow";r=0;t=10`,
	})

	// /fewest: big keeps 5 tokens (one request of 5), small 3 (three
	// requests): big has the fewest requests left, though more tokens.
	resp, body = getWith(t, tester.Client, "/fewest", "X-Key", "fay")
	expect("/fewest", resp, body, 200, "allowed [] 5 10", spring("5", "1", "10", "5"), map[string]string{
		"RateLimit-Policy": `"fewest.big";q=10;w=10, "fewest.small";q=4;w=4`,
		"RateLimit":        `"fewest.big";r=5;t=0, "fewest.small";r=3;t=0`,
	})
	// /tie: x keeps 8 (four requests of 2), y 4 (four of 1): a tie, the
	// first limit (x) is described.
	resp, body = getWith(t, tester.Client, "/tie", "X-Key", "tim")
	expect("/tie", resp, body, 200, "allowed [] 8 10", spring("8", "1", "10", "2"), map[string]string{
		"RateLimit": `"tie.x";r=8;t=0, "tie.y";r=4;t=0`,
	})

	assertDeltas(t, before, scrapeMetrics(t), map[string]float64{
		limitSeries("api", "allowed", ""):        float64(admitted),
		limitSeries("api", "denied", "second"):   1,
		limitSeries("api", "denied", "hour"):     0,
		limitSeries("wait", "allowed", ""):       2,
		limitSeries("wait", "denied", "slow"):    1,
		limitSeries("wait", "denied", "fast"):    0,
		limitSeries("fewest", "allowed", ""):     1,
		limitSeries("tie", "allowed", ""):        1,
		limitSeries("fewest", "denied", "big"):   0,
		limitSeries("fewest", "denied", "small"): 0,
	})
}

// TestPolicyRateLimitPolicyListsEveryLimitOnACachedDenial: a denial the
// deny cache answers knows only the refusing bucket's state, so RateLimit
// has that limit's item; but the policy is the configuration's, and
// RateLimit-Policy lists every limit, as on the denial Redis answered.
func TestPolicyRateLimitPolicyListsEveryLimitOnACachedDenial(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone api
	key {http.request.header.X-Key}
	headers ietf
	limit second 0.1 2
	limit hour 1000/1h 1000
	redis %s
}`, srv.Addr))
	const policy = `"api.second";q=2;w=20, "api.hour";q=1000;w=3600`
	for i := range 2 {
		if a := servePolicy(h, "X-Key", "k"); a.status != 200 || a.header.Get("RateLimit-Policy") != policy {
			t.Fatalf("request %d: %v, RateLimit-Policy %q; want 200 with %s", i+1, a, a.header.Get("RateLimit-Policy"), policy)
		}
	}
	first := servePolicy(h, "X-Key", "k") // Redis answers, and the cache keeps it
	calls := redistest.ScriptCalls(t, rdb)
	cached := servePolicy(h, "X-Key", "k")
	if n := redistest.ScriptCalls(t, rdb) - calls; n != 0 {
		t.Fatalf("the second denial asked Redis (%d calls): the deny cache did not answer", n)
	}
	for what, a := range map[string]policyAnswer{"denial by Redis": first, "denial by the deny cache": cached} {
		if a.status != 429 || a.limitName() != "second" {
			t.Errorf("%s: %v, want 429 by second", what, a)
		}
		if got := a.header.Get("RateLimit-Policy"); got != policy {
			t.Errorf("%s: RateLimit-Policy %q, want every limit: %s", what, got, policy)
		}
		if got, want := a.header.Get("RateLimit"), `"api.second";r=0;t=`+a.header.Get("Retry-After"); !strings.HasPrefix(got, want) {
			t.Errorf("%s: RateLimit %q, want it to start with %s", what, got, want)
		}
	}
}

// ---- The README's example

// readmePolicyExample is the first Caddyfile block of the README's
// Policies section, as written.
func readmePolicyExample(t *testing.T) string {
	t.Helper()
	block := readmeExample(t, "Policies")
	if !strings.HasPrefix(block, "rate_limit /api/* {") || !strings.HasSuffix(block, "}\n") {
		t.Fatalf("the Policies example is not a rate_limit directive:\n%s", block)
	}
	return block
}

// TestPolicyReadmeExampleRunsAsWritten: the README's first policy (second,
// hour and tenant limits keyed by X-API-Key and X-Tenant), pasted into a
// site with only a `redis` line added, limits as the README says: 20 at
// once per API key, then 10 a second; a refusal takes nothing from the
// hour bucket; the tenant's 600 are shared by all its API keys, and
// another tenant is not affected; other paths are not limited.
func TestPolicyReadmeExampleRunsAsWritten(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	example := readmePolicyExample(t)
	directive := strings.TrimSuffix(example, "}\n") + "\tredis %[1]s\n}\n"
	serveCaddyfile(t, "\nhttp://localhost:9080 {\n"+directive+"respond \"ok\"\n}\n", srv.Addr)
	client := caddyClient(t) // keeps a connection per goroutine below
	get := func(path string, headers ...string) (*http.Response, string) {
		return getWith(t, client, path, headers...)
	}

	if resp, body := get("/other"); resp.StatusCode != 200 || body != "ok" || len(rateLimitHeaderNames(resp)) != 0 {
		t.Fatalf("/other: %d %q, headers %v; want 200 ok, not limited", resp.StatusCode, body, rateLimitHeaderNames(resp))
	}
	if resp, _ := get("/api/x", "X-Tenant", "acme"); resp.StatusCode != 403 {
		t.Errorf("no X-API-Key: %d, want 403", resp.StatusCode)
	}
	if resp, _ := get("/api/x", "X-API-Key", "k1"); resp.StatusCode != 403 {
		t.Errorf("no X-Tenant: %d, want 403", resp.StatusCode)
	}

	// 20 at once, then second refuses (burst 20, rate 10: its headers).
	tenantStart := time.Now()
	resp, _ := get("/api/x", "X-API-Key", "k1", "X-Tenant", "acme")
	assertHeaders(t, resp, map[string]string{"X-RateLimit-Remaining": "19", "X-RateLimit-Burst-Capacity": "20"})
	n := 1
	for ; n < 60; n++ {
		if resp, _ = get("/api/x", "X-API-Key", "k1", "X-Tenant", "acme"); resp.StatusCode != 200 {
			break
		}
	}
	elapsed := time.Since(tenantStart)
	if bound := 20 + 10*elapsed.Seconds(); n < 20 || float64(n) > bound {
		t.Fatalf("k1: %d admitted before the first denial in %v, want 20 to %.1f", n, elapsed, bound)
	}
	if resp.StatusCode != 429 || resp.Header.Get("X-RateLimit-Burst-Capacity") != "20" || resp.Header.Get("X-RateLimit-Replenish-Rate") != "10" {
		t.Fatalf("k1 after %d: %d, Burst-Capacity %q, Replenish-Rate %q; want 429 by the second limit (20, 10)",
			n, resp.StatusCode, resp.Header.Get("X-RateLimit-Burst-Capacity"), resp.Header.Get("X-RateLimit-Replenish-Rate"))
	}
	// The refusal took nothing from k1's hour bucket: 1000 less what was
	// admitted, plus at most its refill (1000/h).
	hourKey := namedKey("api", "{http.request.header.X-API-Key}", "k1", "hour")
	expectStoredTokens(t, rdb, hourKey, 1000-float64(n), 1000-float64(n)+1000.0/3600*time.Since(tenantStart).Seconds(), "k1's hour bucket")

	// The tenant's 600 (refilling 10 a second) are shared by its API
	// keys: 8 clients of acme, 15 requests per key (below second's burst),
	// until the tenant refuses.
	var admitted atomic.Int64
	admitted.Store(int64(n))
	var tenantRefused atomic.Bool
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !tenantRefused.Load() && i < 2000; i++ {
				key := fmt.Sprintf("g%d-%d", g, i/15)
				resp, _ := getWith(t, client, "/api/x", "X-API-Key", key, "X-Tenant", "acme")
				switch {
				case resp.StatusCode == 200:
					admitted.Add(1)
				case resp.StatusCode == 429 && resp.Header.Get("X-RateLimit-Burst-Capacity") == "600":
					tenantRefused.Store(true)
				default:
					t.Errorf("%s of acme: %d, Burst-Capacity %q; want 200 or 429 by the tenant (600)",
						key, resp.StatusCode, resp.Header.Get("X-RateLimit-Burst-Capacity"))
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed = time.Since(tenantStart)
	if !tenantRefused.Load() {
		t.Fatalf("acme was never refused after %d requests", admitted.Load())
	}
	if bound := 600 + 10*elapsed.Seconds(); admitted.Load() < 600 || float64(admitted.Load()) > bound {
		t.Errorf("tenant acme admitted %d in %v before refusing, want 600 to %.1f", admitted.Load(), elapsed, bound)
	}
	t.Logf("tenant acme: %d admitted in %v", admitted.Load(), elapsed.Round(time.Millisecond))
	// Another tenant, with an API key acme used: admitted.
	if resp, _ := get("/api/x", "X-API-Key", "g0-0", "X-Tenant", "globex"); resp.StatusCode != 200 {
		t.Errorf("another tenant: %d, want 200", resp.StatusCode)
	}
}
