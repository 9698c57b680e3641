package ratelimit

// Leases (lease.go): what one script call leases, admission from a lease
// without Redis, give-back when the hold ends, at Cleanup and reload,
// drops on a Redis failure, the estimate in the headers, and the bound
// across instances, standalone and on Cluster. The parser's and
// Validate's refusals are rows of the tables in caddyfile_test.go; the
// forms that load are here.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// ---- Helpers of the lease tests

// leaseRate refills a bucket by 0.001 token a second: within a test's
// few seconds a bucket's arithmetic is exact to 0.01.
const (
	leaseRate  = 0.001
	leaseSlack = 0.01
)

// leaseDirective limits X-Key in zone with the body's subdirectives (the
// limit and its lease) on the Redis at addr. on_error deny: a Redis
// failure is a 503, never an admission that would blur a count.
func leaseDirective(zone, body, addr string) string {
	return fmt.Sprintf(`rate_limit {
	zone %s
	key {http.request.header.X-Key}
	on_error deny
	%s
	redis %s {
		timeout 2s
	}
}`, zone, body, addr)
}

// leaseHandler provisions leaseDirective; the test cleans it up.
func leaseHandler(t *testing.T, zone, body, addr string) *Handler {
	t.Helper()
	return caddyfileHandler(t, leaseDirective(zone, body, addr))
}

// leaseHeld is what h's lease on the bucket at key holds (0: none).
func leaseHeld(h *Handler, key string) int64 {
	s := &h.leases.shards[h.leases.shardIndex(key)]
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byKey[key].tokens
}

// leasesHeld is what all of h's leases hold, and how many there are.
func leasesHeld(h *Handler) (tokens int64, n int) {
	for i := range h.leases.shards {
		s := &h.leases.shards[i]
		s.mu.Lock()
		for _, l := range s.byKey {
			tokens += l.tokens
			n++
		}
		s.mu.Unlock()
	}
	return tokens, n
}

// setBucket stores a bucket holding tokens now, as the script stores it.
func setBucket(t *testing.T, rdb redis.Cmdable, key string, tokens float64) {
	t.Helper()
	state := fmt.Sprintf("%.17g %d", tokens, redisNow(t, rdb))
	if err := rdb.Set(context.Background(), key, state, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
}

// tokensNow is what the bucket at key holds now, by Redis's clock (an
// absent bucket is full), and that time.
func tokensNow(t *testing.T, rdb *redis.Client, key string, rate float64, burst int64) (float64, time.Time) {
	t.Helper()
	tokens, now, err := peekTokens(rdb, key, rate, burst)
	if err != nil {
		t.Fatalf("reading bucket %s: %v", key, err)
	}
	return tokens, now
}

// expectTokens asserts that the bucket at key (rate leaseRate) holds
// want tokens now, within leaseSlack.
func expectTokens(t *testing.T, rdb *redis.Client, key string, burst int64, want float64, why string) {
	t.Helper()
	if got, _ := tokensNow(t, rdb, key, leaseRate, burst); got < want-leaseSlack || got > want+leaseSlack {
		t.Errorf("%s: bucket %s holds %.4f tokens, want %v", why, key, got, want)
	}
}

// scriptsLoaded waits until each Redis holds both scripts, which a new
// limiter loads in the background: before that a request's EVALSHA may
// meet NOSCRIPT, which counts as a script call too, before the EVAL
// that loads it.
func scriptsLoaded(t *testing.T, rdbs ...*redis.Client) {
	t.Helper()
	eventually(t, 5*time.Second, "the scripts loaded", func() bool {
		for _, rdb := range rdbs {
			loaded, err := rdb.ScriptExists(context.Background(), scriptSHA, giveBackScript.sha.(string)).Result()
			if err != nil || !loaded[0] || !loaded[1] {
				return false
			}
		}
		return true
	})
}

// callsOf counts the script calls a function costs.
func callsOf(t *testing.T, rdb *redis.Client, f func()) int64 {
	t.Helper()
	before := scriptCalls(t, rdb)
	f()
	return scriptCalls(t, rdb) - before
}

// loadResult is what leaseLoad's requests got.
type loadResult struct {
	admitted, denied, failed int64
	first, elapsed           time.Duration // to the first answer, to the last
}

// leaseLoad sends requests from workers goroutines for about d. send(w)
// sends one for worker w and says its status and X-RateLimit-Remaining;
// an admission is 200 with a remaining other than -1, a refusal 429, and
// anything else fails the test.
func leaseLoad(t *testing.T, workers int, d time.Duration, send func(w int) (int, string, error)) loadResult {
	t.Helper()
	var (
		admitted, denied, failed atomic.Int64
		first, last              atomic.Int64
		wg                       sync.WaitGroup
	)
	start := time.Now()
	stop := start.Add(d)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				status, remaining, err := send(w)
				at := int64(time.Since(start))
				first.CompareAndSwap(0, at)
				for {
					l := last.Load()
					if at <= l || last.CompareAndSwap(l, at) {
						break
					}
				}
				switch {
				case err == nil && status == 200 && remaining != "-1":
					admitted.Add(1)
				case err == nil && status == 429:
					denied.Add(1)
				default:
					if failed.Add(1) <= 5 {
						t.Errorf("worker %d: status %d remaining %q err %v; want 200 or 429", w, status, remaining, err)
					}
				}
			}
		}()
	}
	wg.Wait()
	return loadResult{admitted.Load(), denied.Load(), failed.Load(), time.Duration(first.Load()), time.Duration(last.Load())}
}

// expectBoundAndAccounted checks one bucket after load, once every lease
// on it has ended and been given back: the requests it admitted are at
// most burst + rate*T over the load's time T; and, by Redis's clock from
// t0 (before the first request) to now, admitted + what it holds now is
// at most burst + rate*(now - t0), since no token is made, and at least
// that less the refill lost while the full bucket waited for the first
// request (startup, up to 0.5 s here) and a token of rounding: none went
// missing in a lease.
func expectBoundAndAccounted(t *testing.T, name string, rdb *redis.Client, key string, rate float64, burst int64,
	admitted int64, r loadResult, t0 time.Time) {
	t.Helper()
	bound := float64(burst) + rate*r.elapsed.Seconds()
	tokens, now := tokensNow(t, rdb, key, rate, burst)
	budget := float64(burst) + rate*now.Sub(t0).Seconds()
	accounted := float64(admitted) + tokens
	slack := rate*r.first.Seconds() + 1
	t.Logf("%s: %d admitted in %v, bound burst + rate*T = %.1f (admitted/bound %.3f); then the bucket holds %.2f: "+
		"admitted + held = %.2f of the %.2f refilled since the start (slack %.2f)",
		name, admitted, r.elapsed.Round(time.Millisecond), bound, float64(admitted)/bound, tokens, accounted, budget, slack)
	if float64(admitted) > bound {
		t.Errorf("%s: %d admitted, more than burst + rate*T = %.1f", name, admitted, bound)
	}
	if tokens > float64(burst) {
		t.Errorf("%s: the bucket holds %.2f, more than its burst %d", name, tokens, burst)
	}
	if accounted > budget+1e-6 {
		t.Errorf("%s: admitted %d + held %.2f = %.2f, more than burst + rate*T = %.2f: tokens were made", name, admitted, tokens, accounted, budget)
	}
	if accounted < budget-slack {
		t.Errorf("%s: admitted %d + held %.2f = %.2f, %.2f short of burst + rate*T = %.2f: leased tokens went missing",
			name, admitted, tokens, accounted, budget-accounted, budget)
	}
}

// ---- Configuration (no process)

// TestLeaseConfigLoads: `lease <max_tokens> [<hold>]` and its JSON load,
// with hold's default and bounds; a hold of a nanosecond is useless but
// valid, and must not bring the process down.
func TestLeaseConfigLoads(t *testing.T) {
	for _, tc := range []struct {
		name, caddyfile, json string
		max                   int64
		hold                  time.Duration
	}{
		{"default hold", "rate_limit 10 20 {\n\tlease 32\n}", "", 32, 100 * time.Millisecond},
		{"hold", "rate_limit 10 20 {\n\tlease 32 250ms\n}", "", 32, 250 * time.Millisecond},
		{"the bounds", "rate_limit 10 20 {\n\tlease 1 1s\n}", "", 1, time.Second},
		{"a nanosecond", "rate_limit 10 20 {\n\tlease 8 1ns\n}", "", 8, time.Nanosecond},
		{"JSON", "", `{"replenish_rate": 10, "burst_capacity": 20, "lease": {"max_tokens": 32, "hold": "100ms"}}`, 32, 100 * time.Millisecond},
		{"JSON default hold", "", `{"replenish_rate": 10, "burst_capacity": 20, "lease": {"max_tokens": 5}}`, 5, 100 * time.Millisecond},
		{"JSON hold in nanoseconds", "", `{"replenish_rate": 10, "burst_capacity": 20, "lease": {"max_tokens": 5, "hold": 1}}`, 5, time.Nanosecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := new(Handler)
			if tc.caddyfile != "" {
				var err error
				if h, err = parseTestCaddyfile(tc.caddyfile); err != nil {
					t.Fatalf("parsing: %v", err)
				}
			} else if err := caddy.StrictUnmarshalJSON([]byte(tc.json), h); err != nil {
				t.Fatalf("loading: %v", err)
			}
			if err := tryProvision(t, offline(h)); err != nil {
				t.Fatalf("refused: %v", err)
			}
			if h.leases == nil || h.leases.max != tc.max || h.leases.hold != tc.hold {
				t.Fatalf("leases %+v, want max %d hold %v", h.leases, tc.max, tc.hold)
			}
			// The give-back loop runs a few rounds: no panic, and Cleanup
			// (registered by tryProvision) stops it.
			time.Sleep(5 * time.Millisecond)
		})
	}
	// The Caddyfile's JSON is what the JSON tests load.
	h, err := parseTestCaddyfile("rate_limit 10 20 {\n\tlease 32 100ms\n}")
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(h.Lease)
	var back Lease
	if err := json.Unmarshal(raw, &back); err != nil || back != (Lease{MaxTokens: 32, Hold: caddy.Duration(100 * time.Millisecond)}) {
		t.Errorf("lease as JSON %s read back as %+v (%v)", raw, back, err)
	}
}

// TestLeaseWithStoreMemoryRefusedAtLoad: a lease needs a Redis to lease
// from. The Caddyfile refuses it where it is written, whichever comes
// first; JSON at Validate. Both name the lease and the store.
func TestLeaseWithStoreMemoryRefusedAtLoad(t *testing.T) {
	for _, input := range []string{
		"rate_limit 1 1 {\n\tstore memory\n\tlease 32\n}",
		"rate_limit 1 1 {\n\tlease 32\n\tstore memory\n}",
	} {
		_, err := parseTestCaddyfile(input)
		if err == nil || !strings.Contains(err.Error(), "lease with store 'memory'") || !strings.Contains(err.Error(), "Testfile:") {
			t.Errorf("%q: %v; want refused at its line, naming lease and store 'memory'", input, err)
		}
	}
	h := new(Handler)
	if err := caddy.StrictUnmarshalJSON([]byte(`{"replenish_rate": 1, "store": "memory", "lease": {"max_tokens": 32}}`), h); err != nil {
		t.Fatal(err)
	}
	if err := tryProvision(t, h); err == nil || !strings.Contains(err.Error(), "lease with store 'memory'") {
		t.Errorf("JSON lease with store memory: %v; want refused naming lease and store 'memory'", err)
	}
}

// TestLeaseTable drives the lease table alone, on a clock of its own:
// admission within the hold only (its end excluded), with the values it
// was leased with and enough tokens; all of a request's buckets or none;
// the estimate of remaining; what ends goes back, with what it holds;
// a drop gives nothing back; and a lease taken with other values keeps
// the unused tokens of the one before for give-back.
func TestLeaseTable(t *testing.T) {
	const hold = 100 * time.Millisecond
	ls := newLeases(&Lease{MaxTokens: 10, Hold: caddy.Duration(hold)})
	v := limitValues{rate: 1, burst: 100, requested: 1}
	t0 := time.Unix(1_000_000, 0)
	ask := func(values limitValues, keys ...string) []bucket {
		var bs []bucket
		for _, k := range keys {
			bs = append(bs, bucket{key: k, values: values})
		}
		return bs
	}
	held := func(key string) int64 {
		s := &ls.shards[ls.shardIndex(key)]
		return s.byKey[key].tokens
	}

	granted := []bucket{{key: "a", values: v, leased: 10, remaining: 50}}
	ls.grant(t0, granted)
	if granted[0].remaining != 60 {
		t.Errorf("remaining of the request that leased: %d, want Redis's 50 + the lease's 10", granted[0].remaining)
	}
	b := ask(v, "a")
	if !ls.admit(t0.Add(hold/2), b) || b[0].remaining != 59 || b[0].retryAfter != 0 {
		t.Fatalf("within the hold: admitted with remaining %d; want admitted with 50 + 9", b[0].remaining)
	}
	if ls.admit(t0, ask(limitValues{rate: 1, burst: 100, requested: 2}, "a")) {
		t.Error("admitted a request with other values than the lease's")
	}
	if ls.admit(t0.Add(hold), ask(v, "a")) || ls.admit(t0.Add(time.Hour), ask(v, "a")) {
		t.Error("admitted from a lease at or past the end of its hold")
	}
	if back := ls.take(t0.Add(hold-time.Nanosecond), false); len(back) != 0 {
		t.Errorf("gave back %v before the hold ended", back)
	}
	back := ls.take(t0.Add(hold), false)
	if len(back) != 1 || back[0].key != "a" || back[0].args != [3]any{"1", "100", "9"} {
		t.Fatalf("at the end of the hold gave back %+v; want bucket a with its rate, burst and 9 tokens", back)
	}
	if held("a") != 0 || ls.admit(t0, ask(v, "a")) {
		t.Error("the lease given back still admits")
	}

	// Several buckets: all hold a lease, or none is taken from.
	ls.grant(t0, []bucket{{key: "a", values: v, leased: 5}, {key: "b", values: v}})
	if ls.admit(t0, ask(v, "a", "b")) || held("a") != 5 {
		t.Fatalf("admitted with no lease on b, or took from a anyway (a holds %d)", held("a"))
	}
	ls.grant(t0, []bucket{{key: "b", values: v, leased: 1}})
	if !ls.admit(t0, ask(v, "a", "b")) || held("a") != 4 || held("b") != 0 {
		t.Fatalf("a and b leased: a holds %d, b %d; want admitted, 4 and 0", held("a"), held("b"))
	}
	if ls.admit(t0, ask(v, "a", "b")) || held("a") != 4 {
		t.Fatalf("b's lease spent: a holds %d; want refused, a untouched at 4", held("a"))
	}

	// A lease that holds fewer tokens than a request asks does not admit it.
	three := limitValues{rate: 1, burst: 100, requested: 3}
	ls.grant(t0, []bucket{{key: "c", values: three, leased: 4}})
	if !ls.admit(t0, ask(three, "c")) || ls.admit(t0, ask(three, "c")) || held("c") != 1 {
		t.Errorf("a lease of 4 for requests of 3: c holds %d; want one admitted, then refused with 1 left", held("c"))
	}

	// A drop forgets everything.
	ls.drop()
	if back := ls.take(t0, true); len(back) != 0 {
		t.Errorf("after a drop, %+v left to give back", back)
	}

	// A lease with other values (a plan or a cost from the request) takes
	// over the bucket's lease: the tokens of the one before still go back.
	ls.grant(t0, []bucket{{key: "d", values: v, leased: 5}})
	ls.grant(t0, []bucket{{key: "d", values: three, leased: 3}})
	var total int64
	for _, b := range ls.take(t0.Add(time.Hour), false) {
		var n int64
		fmt.Sscan(b.args[2].(string), &n)
		total += n
	}
	if total != 8 {
		t.Errorf("leases of 5 then 3 on one bucket with other values: %d tokens given back, want 8", total)
	}

	// Once Cleanup closed the leases, a call that leased meanwhile keeps
	// nothing: what it leased is handed back to be given back.
	ls.closed.Store(true)
	e := []bucket{{key: "e", values: v, leased: 7, remaining: 20}}
	if back := ls.grant(t0, e); len(back) != 1 || back[0].key != "e" || back[0].args[2] != "7" || held("e") != 0 || e[0].remaining != 20 {
		t.Errorf("a grant after close: handed back %+v, e holds %d, remaining %d; want e's 7 handed back, nothing kept, remaining Redis's 20",
			back, held("e"), e[0].remaining)
	}
}

// ---- Against Redis, one instance

// TestLeaseTakesExtraTokensInTheSameCall: a request that goes to Redis
// also takes up to max_tokens for the lease, never more than half of what
// the request leaves; a bucket that holds only the request's tokens
// lends nothing, a short one denies and lends nothing. The stored bucket
// says what was taken, the lease table what was leased, and the header
// counts both.
func TestLeaseTakesExtraTokensInTheSameCall(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	for _, tc := range []struct {
		cost    int
		before  float64 // -1: no key, a full bucket of 100
		leased  int64
		after   float64
		allowed bool
	}{
		{1, -1, 32, 67, true}, // 100 - 1 - 32
		{1, 66, 32, 33, true},
		{1, 50, 24, 25, true}, // floor(49 / 2)
		{1, 10, 4, 5, true},   // floor(9 / 2)
		{1, 3, 1, 1, true},
		{1, 2, 0, 1, true},
		{1, 1, 0, 0, true},
		{1, 0.5, 0, 0.5, false},
		{3, 10, 3, 4, true}, // floor(7 / 2)
		{3, 4, 0, 1, true},
		{3, 2.5, 0, 2.5, false},
	} {
		t.Run(fmt.Sprintf("cost %d of %v", tc.cost, tc.before), func(t *testing.T) {
			h := leaseHandler(t, fmt.Sprintf("fill%d", tc.cost), fmt.Sprintf(
				"replenish_rate %v\n\tburst_capacity 100\n\trequested_tokens %d\n\tlease 32 1s", leaseRate, tc.cost), srv.Addr)
			scriptsLoaded(t, rdb)
			client := fmt.Sprint("c", tc.before)
			key := limitKey(t, h, "", client)
			if tc.before >= 0 {
				setBucket(t, rdb, key, tc.before)
			}
			var status int
			var remaining string
			if n := callsOf(t, rdb, func() { status, remaining, _ = hit(h, client) }); n != 1 {
				t.Errorf("%d script calls, want 1", n)
			}
			if (status == 200) != tc.allowed {
				t.Fatalf("status %d, want allowed %v", status, tc.allowed)
			}
			expectTokens(t, rdb, key, 100, tc.after, "after the request")
			if got := leaseHeld(h, key); got != tc.leased {
				t.Errorf("leased %d, want %d", got, tc.leased)
			}
			if want := fmt.Sprint(int64(tc.after) + tc.leased); tc.allowed && remaining != want {
				t.Errorf("X-RateLimit-Remaining %q, want %s (Redis's %v + the lease's %d)", remaining, want, tc.after, tc.leased)
			}
		})
	}
}

// TestLeaseDrainsTheBucketExactlyAndCountsDown: a bucket of 100 with
// lease 32, one client on one instance: Redis lends 32, 32, 16, 8, 3, 1,
// then nothing, as the bucket runs low; the requests between are
// admitted without Redis; exactly 100 are admitted, with
// X-RateLimit-Remaining 99 down to 0 as without a lease; the 101st is
// denied by Redis, the 102nd by the deny cache.
func TestLeaseDrainsTheBucketExactlyAndCountsDown(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := leaseHandler(t, "drain", fmt.Sprintf("replenish_rate %v\n\tburst_capacity 100\n\tlease 32 1s", leaseRate), srv.Addr)
	scriptsLoaded(t, rdb)
	key := limitKey(t, h, "", "d")
	var toRedis []int
	var lent []int64
	for i := 1; i <= 102; i++ {
		var status int
		var remaining string
		var header http.Header
		n := callsOf(t, rdb, func() {
			status, header = serve(context.Background(), h, "d")
			remaining = header.Get("X-RateLimit-Remaining")
		})
		if n > 1 {
			t.Fatalf("request %d: %d script calls", i, n)
		}
		if n == 1 {
			toRedis = append(toRedis, i)
			if status == 200 {
				lent = append(lent, leaseHeld(h, key))
			}
		}
		switch {
		case i <= 100 && (status != 200 || remaining != fmt.Sprint(100-i)):
			t.Fatalf("request %d: %d remaining %q, want 200 with %d", i, status, remaining, 100-i)
		case i > 100 && (status != 429 || remaining != "0" || header.Get("Retry-After") == ""):
			t.Fatalf("request %d: %d remaining %q Retry-After %q, want 429 with 0 and a Retry-After", i, status, remaining, header.Get("Retry-After"))
		}
	}
	if want := []int{1, 34, 67, 84, 93, 97, 99, 100, 101}; fmt.Sprint(toRedis) != fmt.Sprint(want) {
		t.Errorf("requests that asked Redis: %v, want %v", toRedis, want)
	}
	if want := []int64{32, 32, 16, 8, 3, 1, 0, 0}; fmt.Sprint(lent) != fmt.Sprint(want) {
		t.Errorf("leases: %v, want %v", lent, want)
	}
	expectTokens(t, rdb, key, 100, 0, "after 100 admitted")
}

// TestLeaseAdmitsWithoutRedisWhileItHolds: lease 10 makes 11 requests
// one script call; with several limits a request is admitted locally
// only while every limit's lease holds its tokens, and a policy whose
// second limit is too low to lend goes to Redis every time.
func TestLeaseAdmitsWithoutRedisWhileItHolds(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)

	t.Run("one limit", func(t *testing.T) {
		h := leaseHandler(t, "local", fmt.Sprintf("replenish_rate %v\n\tburst_capacity 100\n\tlease 10 1s", leaseRate), srv.Addr)
		scriptsLoaded(t, rdb)
		if n := callsOf(t, rdb, func() {
			for i := range 11 {
				if status, remaining, _ := hit(h, "l"); status != 200 || remaining != fmt.Sprint(99-i) {
					t.Fatalf("request %d: %d remaining %q, want 200 with %d", i+1, status, remaining, 99-i)
				}
			}
		}); n != 1 {
			t.Errorf("11 requests with lease 10: %d script calls, want 1", n)
		}
		if n := callsOf(t, rdb, func() { hit(h, "l") }); n != 1 {
			t.Errorf("the 12th request: %d script calls, want 1 (the lease is spent)", n)
		}
	})

	t.Run("every limit must hold a lease", func(t *testing.T) {
		h := leaseHandler(t, "localpol", fmt.Sprintf("lease 32 1s\n\tlimit a %v 100\n\tlimit b %v 20", leaseRate, leaseRate), srv.Addr)
		scriptsLoaded(t, rdb)
		a, b := limitKey(t, h, "a", "p"), limitKey(t, h, "b", "p")
		// The first call: a leaves 99 and could lend 32, b leaves 19 and
		// can lend 9; both lend for 9 requests (in lockstep: a lease
		// admits only when every limit's does), which admit 9 more.
		if n := callsOf(t, rdb, func() {
			for i := range 10 {
				if ans := servePolicy(h, "X-Key", "p"); ans.status != 200 || ans.result() != "allowed" {
					t.Fatalf("request %d: %v", i+1, ans)
				}
			}
		}); n != 1 {
			t.Errorf("10 requests: %d script calls, want 1", n)
		}
		if la, lb := leaseHeld(h, a), leaseHeld(h, b); la != 0 || lb != 0 {
			t.Errorf("after 10 requests a's lease holds %d, b's %d; want both spent", la, lb)
		}
		// Both leases are spent: the 11th asks Redis, and b, low now,
		// lends for 4 requests, so a lends for 4 too.
		if n := callsOf(t, rdb, func() { servePolicy(h, "X-Key", "p") }); n != 1 {
			t.Errorf("the 11th request, the leases spent: %d script calls, want 1", n)
		}
		expectTokens(t, rdb, a, 100, 85, "a after the second call (90 - 1, lending 4)")
		expectTokens(t, rdb, b, 100, 5, "b after the second call (10 - 1, lending 4)")
	})

	t.Run("a limit too low to lend", func(t *testing.T) {
		// b holds 2: its requests leave 1 and 0, and lend nothing.
		h := leaseHandler(t, "localnone", fmt.Sprintf("lease 32 1s\n\tlimit a %v 100\n\tlimit b %v 2", leaseRate, leaseRate), srv.Addr)
		scriptsLoaded(t, rdb)
		b := limitKey(t, h, "b", "q")
		for i := 1; i <= 3; i++ {
			var ans policyAnswer
			if n := callsOf(t, rdb, func() { ans = servePolicy(h, "X-Key", "q") }); n != 1 {
				t.Errorf("request %d: %d script calls, want 1 (b lends nothing)", i, n)
			}
			if i < 3 && ans.status != 200 || i == 3 && (ans.status != 429 || ans.limitName() != "b") {
				t.Errorf("request %d: %v, want 200, then 429 by b", i, ans)
			}
		}
		if leaseHeld(h, b) != 0 {
			t.Errorf("b leased %d", leaseHeld(h, b))
		}
		if n := callsOf(t, rdb, func() { servePolicy(h, "X-Key", "q") }); n != 0 {
			t.Errorf("the 4th request: %d script calls, want 0 (the deny cache)", n)
		}
	})
}

// TestLeaseOfOneLimitDoesNotStarveAPolicy: with several limits, a lease
// is only of use when every limit lends. Here limit b always holds just
// the request's token and a half (as a slowly refilling per-second limit
// does under steady traffic), so it lends nothing and every request goes
// to Redis; limit a, of 100, must still admit the client's first 100
// requests: one instance may not take a's last tokens into a lease that
// cannot admit anything and then have Redis refuse the client on a.
// (Before buckets lent in lockstep, a lent 32, 32, 16, 8, 3, 1 while b
// lent nothing, and the 9th request got 429 by a, with 92 of a's tokens
// in a lease no request could use.)
func TestLeaseOfOneLimitDoesNotStarveAPolicy(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := leaseHandler(t, "starve", fmt.Sprintf("lease 32 1s\n\tlimit a %v 100\n\tlimit b %v 2", leaseRate, leaseRate), srv.Addr)
	a, b := limitKey(t, h, "a", "s"), limitKey(t, h, "b", "s")
	for i := 1; i <= 12; i++ {
		setBucket(t, rdb, b, 1.5) // b admits one more request, and lends nothing
		if ans := servePolicy(h, "X-Key", "s"); ans.status != 200 {
			stored, _ := tokensNow(t, rdb, a, leaseRate, 100)
			t.Fatalf("request %d of a's 100: %v; a's bucket holds %.2f while this instance's lease on it holds %d tokens it cannot use",
				i, ans, stored, leaseHeld(h, a))
		}
	}
}

// TestLeaseGivesBackWhenTheHoldEnds: when the hold ends the unused tokens
// go back, exactly, capped at the burst; then, and for a lease past its
// hold, the next request asks Redis.
func TestLeaseGivesBackWhenTheHoldEnds(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const hold = 200 * time.Millisecond
	h := leaseHandler(t, "giveback", fmt.Sprintf("replenish_rate %v\n\tburst_capacity 100\n\tlease 32 %v", leaseRate, hold), srv.Addr)
	scriptsLoaded(t, rdb)

	t.Run("exactly the unused tokens", func(t *testing.T) {
		key := limitKey(t, h, "", "g")
		if n := callsOf(t, rdb, func() {
			for range 6 {
				if status, _, _ := hit(h, "g"); status != 200 {
					t.Fatalf("status %d", status)
				}
			}
		}); n != 1 {
			t.Fatalf("6 requests with lease 32: %d script calls, want 1", n)
		}
		expectTokens(t, rdb, key, 100, 67, "while the lease holds")
		took := eventually(t, 2*time.Second, "the lease given back", func() bool {
			tokens, _ := tokensNow(t, rdb, key, leaseRate, 100)
			return tokens > 67+leaseSlack
		})
		// The 27 unused tokens, no more: 100 less the 6 admitted.
		expectTokens(t, rdb, key, 100, 94, fmt.Sprintf("given back %v after the lease", took.Round(time.Millisecond)))
		if tokens, n := leasesHeld(h); n != 0 {
			t.Errorf("%d leases (%d tokens) left after the hold", n, tokens)
		}
		var remaining string
		if n := callsOf(t, rdb, func() { _, remaining, _ = hit(h, "g") }); n != 1 || remaining != "93" {
			t.Errorf("the next request: %d script calls, remaining %q; want 1 call, 93", n, remaining)
		}
	})

	t.Run("capped at the burst", func(t *testing.T) {
		key := limitKey(t, h, "", "cap")
		hit(h, "cap")
		if leaseHeld(h, key) != 32 {
			t.Fatalf("leased %d, want 32", leaseHeld(h, key))
		}
		setBucket(t, rdb, key, 90) // as if other instances' tokens came back meanwhile
		eventually(t, 2*time.Second, "the lease given back", func() bool {
			tokens, _ := tokensNow(t, rdb, key, leaseRate, 100)
			return tokens > 90+leaseSlack
		})
		expectTokens(t, rdb, key, 100, 100, "90 given back 32")
	})

	t.Run("nothing admitted past the hold", func(t *testing.T) {
		key := limitKey(t, h, "", "past")
		hit(h, "past")
		time.Sleep(hold + 20*time.Millisecond)
		// A give-back of the old lease may come in the same moment: a
		// script call too. From the lease, the request would leave 31 in
		// it; from Redis it leases 32 anew, on top of the old lease's 32
		// when that was not collected yet.
		if n := callsOf(t, rdb, func() { hit(h, "past") }); n < 1 {
			t.Errorf("a request past the hold: %d script calls, want it to ask Redis", n)
		}
		if held := leaseHeld(h, key); held != 32 && held != 64 {
			t.Errorf("a request past the hold: the lease holds %d; want 32 (or 64), not 31 from the old lease", held)
		}
	})
}

// TestLeaseDenialsComeFromRedis: a lease lends whole requests' worth,
// and one that is spent admits nothing: Redis decides, and a denial is
// Redis's (with its remaining and Retry-After), then the deny cache's.
func TestLeaseDenialsComeFromRedis(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := leaseHandler(t, "deny", fmt.Sprintf("replenish_rate %v\n\tburst_capacity 100\n\trequested_tokens 3\n\tlease 10 1s", leaseRate), srv.Addr)
	scriptsLoaded(t, rdb)
	key := limitKey(t, h, "", "x")

	// 97 left, 9 leased (three requests' worth of at most 10): three
	// requests from the lease, then Redis: 88 - 3 = 85, 9 more leased.
	var got []string
	n := callsOf(t, rdb, func() {
		for range 5 {
			status, remaining, _ := hit(h, "x")
			got = append(got, fmt.Sprint(status, " ", remaining))
		}
	})
	if want := "[200 97 200 94 200 91 200 88 200 85]"; fmt.Sprint(got) != want || n != 2 {
		t.Errorf("5 requests of 3 with lease 10: %v in %d script calls; want %s in 2", got, n, want)
	}
	if leaseHeld(h, key) != 9 {
		t.Errorf("the lease holds %d, want 9", leaseHeld(h, key))
	}

	// The bucket runs short while the lease is spent: Redis denies.
	setBucket(t, rdb, key, 2)
	for range 3 {
		hit(h, "x") // 9 -> 6 -> 3 -> 0
	}
	var status int
	var header http.Header
	if n := callsOf(t, rdb, func() { status, header = serve(context.Background(), h, "x") }); n != 1 || status != 429 {
		t.Errorf("the lease spent, the bucket 2 of 3: %d in %d script calls; want 429 from Redis", status, n)
	}
	if header.Get("X-RateLimit-Remaining") != "2" || header.Get("Retry-After") == "" {
		t.Errorf("denial: remaining %q, Retry-After %q; want Redis's 2 and a Retry-After", header.Get("X-RateLimit-Remaining"), header.Get("Retry-After"))
	}
	if n := callsOf(t, rdb, func() { status, _ = serve(context.Background(), h, "x") }); n != 0 || status != 429 {
		t.Errorf("again: %d in %d script calls; want 429 from the deny cache", status, n)
	}
	if leaseHeld(h, key) != 0 {
		t.Errorf("the lease holds %d after the denials, want 0", leaseHeld(h, key))
	}
}

// TestLeaseRemainingIsAnEstimate: a lease-admitted request's
// X-RateLimit-Remaining is Redis's answer at the lease's last call plus
// what the lease holds, so another instance's requests since are not in
// it until this instance asks Redis again.
func TestLeaseRemainingIsAnEstimate(t *testing.T) {
	srv := redistest.Start(t)
	limit := fmt.Sprintf("replenish_rate %v\n\tburst_capacity 100", leaseRate)
	leasing := leaseHandler(t, "estimate", limit+"\n\tlease 32 1s", srv.Addr)
	other := leaseHandler(t, "estimate", limit, srv.Addr) // another instance, without a lease
	var got []string
	add := func(h *Handler, n int) {
		for range n {
			_, remaining, _ := hit(h, "e")
			got = append(got, remaining)
		}
	}
	add(leasing, 1) // Redis: 67, and 32 leased
	add(other, 3)   // 66, 65, 64
	add(leasing, 2) // the estimate: 67 + 31, 67 + 30
	add(leasing, 30)
	add(leasing, 1) // Redis again: 64 - 1 = 63, lending 31: 32 + 31
	want := []string{"99", "66", "65", "64", "98", "97"}
	for i := 30; i > 0; i-- {
		want = append(want, fmt.Sprint(66+i))
	}
	want = append(want, "63")
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("X-RateLimit-Remaining:\n%v\nwant\n%v", got, want)
	}
}

// TestLeaseCleanupGivesBack: Cleanup gives back what the leases hold, at
// once; a request the old configuration still serves afterwards is
// limited by Redis and leases nothing that would stay out of the bucket.
func TestLeaseCleanupGivesBack(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h, err := parseTestCaddyfile(leaseDirective("cleanup", fmt.Sprintf("replenish_rate %v\n\tburst_capacity 100\n\tlease 32 200ms", leaseRate), srv.Addr))
	if err != nil {
		t.Fatal(err)
	}
	// Provisioned without tryProvision: this test runs Cleanup itself.
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	key := limitKey(t, h, "", "c")
	for range 4 {
		hit(h, "c")
	}
	if leaseHeld(h, key) != 29 {
		t.Fatalf("leased %d, want 32 - 3", leaseHeld(h, key))
	}
	if err := h.Cleanup(); err != nil {
		t.Fatal(err)
	}
	expectTokens(t, rdb, key, 100, 96, "right after Cleanup")

	if status, remaining, _ := hit(h, "c"); status != 200 || remaining != "95" {
		t.Errorf("a request after Cleanup: %d remaining %q, want 200 with 95", status, remaining)
	}
	time.Sleep(300 * time.Millisecond) // past the hold: anything leased would be due back
	expectTokens(t, rdb, key, 100, 95, "a request after Cleanup")
	if tokens, n := leasesHeld(h); n != 0 {
		t.Errorf("after Cleanup a request leased %d tokens (%d leases), which nothing gives back", tokens, n)
	}
}

// TestLeaseReloadGivesBack: a config reload of a real Caddy gives back
// what the old configuration's leases hold, and the new configuration
// asks Redis for its own.
func TestLeaseReloadGivesBack(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	config := caddyGlobals + fmt.Sprintf(`
http://localhost:9080 {
	rate_limit {
		zone leasereload
		key {http.request.header.X-Key}
		replenish_rate %v
		burst_capacity 100
		lease 32 1s
		redis %s
	}
	respond "ok"
}`, leaseRate, srv.Addr)
	tester := loadCaddyfile(t, nil, config)
	scriptsLoaded(t, rdb)
	key := bucketPrefix(defaultKeyPrefix, "leasereload", "{http.request.header.X-Key}") + "r"
	start := time.Now()
	if n := callsOf(t, rdb, func() {
		for i := range 4 {
			if resp, _ := get(t, tester, "/", "r"); resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != fmt.Sprint(99-i) {
				t.Fatalf("request %d: %d remaining %q", i+1, resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
			}
		}
	}); n != 1 {
		t.Fatalf("4 requests with lease 32: %d script calls, want 1", n)
	}
	expectTokens(t, rdb, key, 100, 67, "before the reload")
	forceReload(t, config)
	if held := time.Since(start); held >= time.Second {
		t.Fatalf("the reload came %v after the lease, past its 1s hold: cannot tell a reload's give-back from the hold's", held)
	}
	expectTokens(t, rdb, key, 100, 96, "right after the reload (the 28 unused tokens back)")
	var resp *http.Response
	if n := callsOf(t, rdb, func() { resp, _ = get(t, tester, "/", "r") }); n != 1 || resp.Header.Get("X-RateLimit-Remaining") != "95" {
		t.Errorf("the new configuration's first request: %d script calls, remaining %q; want 1 and 95", n, resp.Header.Get("X-RateLimit-Remaining"))
	}
}

// TestLeaseDroppedWhenRedisFails: after a Redis failure no request is
// admitted from a lease taken before it: they follow on_error; once
// Redis is back, the next request asks it and leases anew.
func TestLeaseDroppedWhenRedisFails(t *testing.T) {
	srv := redistest.Start(t)
	h := leaseHandler(t, "drop", fmt.Sprintf("replenish_rate %v\n\tburst_capacity 100\n\tlease 32 1s", leaseRate), srv.Addr)
	key := limitKey(t, h, "", "a")
	for range 3 {
		hit(h, "a")
	}
	if leaseHeld(h, key) != 30 {
		t.Fatalf("leased %d, want 30", leaseHeld(h, key))
	}
	srv.Stop(t)
	if status, remaining, _ := hit(h, "b"); status != 503 || remaining != "-1" {
		t.Fatalf("another key, Redis down: %d remaining %q, want 503 with -1 (on_error deny)", status, remaining)
	}
	if tokens, n := leasesHeld(h); n != 0 {
		t.Errorf("after the failure %d leases hold %d tokens; want all dropped", n, tokens)
	}
	if status, remaining, _ := hit(h, "a"); status != 503 || remaining != "-1" {
		t.Errorf("the leased key after the failure: %d remaining %q, want 503 with -1 (on_error, not the old lease)", status, remaining)
	}
	srv.Restart(t)
	rdb := srv.Client(t)
	eventually(t, 3*time.Second, "Redis answers again", func() bool {
		status, remaining, _ := hit(h, "a")
		if status != 200 && status != 503 {
			t.Fatalf("status %d", status)
		}
		return status == 200 && remaining == "99"
	})
	if n := scriptCalls(t, rdb); n < 1 {
		t.Errorf("the restarted Redis served %d script calls", n)
	}
	// The restarted Redis kept nothing: a fresh lease of 32, not the old 30 on top.
	expectTokens(t, rdb, key, 100, 67, "after Redis came back")
	if leaseHeld(h, key) != 32 {
		t.Errorf("leased %d after Redis came back, want a fresh 32", leaseHeld(h, key))
	}
}

// ---- The bound across instances

// TestLeaseBoundAcrossInstances: instances with leases hammer one key
// together; they admit at most burst + rate*T, and once their holds
// ended every unused token is back in the bucket. In process: two
// handlers provisioned apart (a lease table each) on one Redis. Then two
// real Caddy instances: caddytest's, in this process, and a caddyproc.
func TestLeaseBoundAcrossInstances(t *testing.T) {
	const (
		rate  = 100.0
		burst = 100
	)
	srv := redistest.Start(t)
	rdb := srv.Client(t)

	t.Run("two handlers", func(t *testing.T) {
		body := fmt.Sprintf("replenish_rate %v\n\tburst_capacity %d\n\tlease 16 100ms", rate, burst)
		hs := []*Handler{leaseHandler(t, "leasebound", body, srv.Addr), leaseHandler(t, "leasebound", body, srv.Addr)}
		key := limitKey(t, hs[0], "", "hot")
		t0 := time.Unix(0, redisNow(t, rdb)*1000)
		r := leaseLoad(t, 16, 2*time.Second, func(w int) (int, string, error) {
			status, remaining, _ := hit(hs[w%2], "hot")
			return status, remaining, nil
		})
		eventually(t, 2*time.Second, "every lease given back", func() bool {
			_, n0 := leasesHeld(hs[0])
			_, n1 := leasesHeld(hs[1])
			return n0+n1 == 0
		})
		time.Sleep(200 * time.Millisecond) // the last give-back's call
		expectBoundAndAccounted(t, "two handlers", rdb, key, rate, burst, r.admitted, r, t0)
	})

	t.Run("two Caddy instances", func(t *testing.T) {
		site := `
	rate_limit {
		zone leaseshared
		key {http.request.header.X-Key}
		replenish_rate %v
		burst_capacity %d
		lease 16 100ms
		on_error deny
		redis %s {
			timeout 1s
		}
	}
	respond "ok"
}`
		loadCaddyfile(t, nil, caddyGlobals+"http://localhost:9080 {"+fmt.Sprintf(site, rate, burst, srv.Addr))
		inst := caddyproc.Start(t, caddyproc.Caddyfile("http://127.0.0.1:{{http_port}} {"+fmt.Sprintf(site, rate, burst, srv.Addr)))
		urls := []string{"http://localhost:9080/", inst.URL}
		client := caddyClient(t)
		for _, u := range urls { // warm the connections up on another key
			mustGet(t, client, u, "warm")
		}
		key := bucketPrefix(defaultKeyPrefix, "leaseshared", "{http.request.header.X-Key}") + "hot"
		t0 := time.Unix(0, redisNow(t, rdb)*1000)
		r := leaseLoad(t, 32, 3*time.Second, func(w int) (int, string, error) {
			status, remaining, _, err := caddyGet(client, urls[w%2], "hot")
			return status, remaining, err
		})
		time.Sleep(500 * time.Millisecond) // the holds end, a tick gives back
		expectBoundAndAccounted(t, "two Caddy instances", rdb, key, rate, burst, r.admitted, r, t0)
	})
}

// TestLeaseOnCluster: a policy of a client limit and a tenant limit (two
// key templates, two slot groups) with leases on Redis Cluster. Under
// load from two handlers every bucket keeps its bound and gets its
// unused tokens back; and when the tenant refuses, the client's bucket
// gets back what the request took and what it leased, read from its
// master.
func TestLeaseOnCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	cc := c.Client(t)
	clients := masterClients(t, c)
	addrs := strings.Join(c.Addrs, " ")

	t.Run("the bound per bucket", func(t *testing.T) {
		const (
			clientRate, clientBurst = 40.0, 40
			tenantRate, tenantBurst = 100.0, 100
		)
		directive := fmt.Sprintf(`rate_limit {
	zone cleasebound
	key {http.request.header.X-Key}
	on_error deny
	lease 8 100ms
	limit client %v %d
	limit tenant %v %d {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		timeout 2s
	}
}`, clientRate, clientBurst, tenantRate, tenantBurst, addrs)
		hs := []*Handler{caddyfileHandler(t, directive), caddyfileHandler(t, directive)}
		if len(hs[0].groups) != 2 {
			t.Fatalf("%d slot groups, want 2", len(hs[0].groups))
		}
		const nClients = 4
		var perClient [nClients]atomic.Int64
		tenantKey := limitKey(t, hs[0], "tenant", "t")
		t0 := time.Unix(0, redisNow(t, masterOf(t, c, cc, clients, tenantKey))*1000)
		r := leaseLoad(t, 16, 2*time.Second, func(w int) (int, string, error) {
			ans := servePolicy(hs[w%2], "X-Key", fmt.Sprint("k", w%nClients), "X-Tenant", "t")
			if ans.status == 200 && ans.remaining() != "-1" {
				perClient[w%nClients].Add(1)
			}
			return ans.status, ans.remaining(), nil
		})
		eventually(t, 2*time.Second, "every lease given back", func() bool {
			_, n0 := leasesHeld(hs[0])
			_, n1 := leasesHeld(hs[1])
			return n0+n1 == 0
		})
		time.Sleep(200 * time.Millisecond) // the last give-back's call
		expectBoundAndAccounted(t, "tenant", masterOf(t, c, cc, clients, tenantKey), tenantKey, tenantRate, tenantBurst, r.admitted, r, t0)
		for i := range nClients {
			key := limitKey(t, hs[0], "client", fmt.Sprint("k", i))
			rdb := masterOf(t, c, cc, clients, key)
			tokens, now := tokensNow(t, rdb, key, clientRate, clientBurst)
			budget := float64(clientBurst) + clientRate*now.Sub(t0).Seconds()
			admitted := perClient[i].Load()
			bound := float64(clientBurst) + clientRate*r.elapsed.Seconds()
			t.Logf("client k%d: %d admitted (bound %.1f), holds %.2f: admitted + held %.2f of %.2f", i, admitted, bound, tokens,
				float64(admitted)+tokens, budget)
			if float64(admitted) > bound || float64(admitted)+tokens > budget+1e-6 || tokens > clientBurst {
				t.Errorf("client k%d: %d admitted (bound %.1f), holds %.2f: admitted + held %.2f, budget %.2f",
					i, admitted, bound, tokens, float64(admitted)+tokens, budget)
			}
		}
	})

	t.Run("a refusal gives back the lease too", func(t *testing.T) {
		h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone cleasegive
	key {http.request.header.X-Key}
	lease 32 1s
	limit client %v 100
	limit tenant %v 2 {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		timeout 2s
	}
}`, leaseRate, leaseRate, addrs))
		scriptsLoaded(t, clients...)
		clientKey := limitKey(t, h, "client", "g")
		rdb := masterOf(t, c, cc, clients, clientKey)
		// 1: the client leaves 99 and lends 32 (its slot group is a call
		// of its own), the tenant leaves 1.
		// 2: the tenant lent nothing, so Redis: the client leaves 66 and,
		// its lease holding 32 already, lends nothing more (a lease that
		// the policy cannot use does not grow); the tenant leaves 0.
		for i := 1; i <= 2; i++ {
			if ans := servePolicy(h, "X-Key", "g", "X-Tenant", "t"); ans.status != 200 {
				t.Fatalf("request %d: %v", i, ans)
			}
		}
		expectTokens(t, rdb, clientKey, 100, 66, "the client's bucket after two requests")
		// 3: the client leaves 65, then the tenant refuses: the 1 goes
		// back.
		total := clusterScriptCalls(t, clients)
		ans := servePolicy(h, "X-Key", "g", "X-Tenant", "t")
		if got := clusterScriptCalls(t, clients) - total; ans.status != 429 || ans.limitName() != "tenant" || got != 3 {
			t.Errorf("request 3: %v in %d script calls; want 429 by the tenant in 3 (take, take refused, give back)", ans, got)
		}
		expectTokens(t, rdb, clientKey, 100, 66, "the client's bucket after the tenant refused")
		// Once the hold ends, the client's lease goes back too.
		eventually(t, 3*time.Second, "the lease given back", func() bool {
			tokens, _ := tokensNow(t, rdb, clientKey, leaseRate, 100)
			return tokens > 66+leaseSlack
		})
		expectTokens(t, rdb, clientKey, 100, 98, "the client's bucket after the hold")
	})
}

// TestLeaseExpiredIsNotCarriedIntoANewHold: a lease whose hold ended but
// that the give-back loop has not taken yet counts as empty for the next
// request (which asks Redis for max_tokens), so what Redis lends then
// must not be added to it: the old tokens go back with the next
// give-back, and a lease never holds more than max_tokens. (Without the
// loop running, as here, a client asking once per hold grew its lease by
// max_tokens each time, valid for a fresh hold.)
func TestLeaseExpiredIsNotCarriedIntoANewHold(t *testing.T) {
	ls := newLeases(&Lease{MaxTokens: 32, Hold: caddy.Duration(100 * time.Millisecond)})
	values := limitValues{rate: 1000, burst: 2000, requested: 1}
	now := time.Now()
	for cycle := range 10 {
		buckets := []bucket{{key: "k", values: values}}
		if ls.admit(now, buckets) {
			t.Fatalf("cycle %d: admitted from a lease whose hold ended", cycle)
		}
		if got := buckets[0].leaseMax; got != "32" {
			t.Fatalf("cycle %d: asks Redis to lend %v, want 32 (the expired lease counts as empty)", cycle, got)
		}
		buckets[0].leased, buckets[0].remaining = 32, 1000 // what Redis lent
		if back := ls.grant(now, buckets); len(back) != 0 {
			t.Fatalf("cycle %d: %d buckets to give back at once, want none", cycle, len(back))
		}
		if held := ls.shards[ls.shardIndex("k")].byKey["k"].tokens; held != 32 {
			t.Fatalf("cycle %d: the lease holds %d, want 32 (max_tokens)", cycle, held)
		}
		now = now.Add(101 * time.Millisecond)
	}
	// The nine leases that expired unused go back with the next take.
	var given int64
	for _, b := range ls.take(now, false) {
		n, err := strconv.ParseInt(b.args[2].(string), 10, 64)
		if err != nil || b.key != "k" {
			t.Fatalf("give-back %q of %v", b.key, b.args)
		}
		given += n
	}
	if given != 10*32 {
		t.Errorf("given back %d tokens, want %d (ten leases of 32, all unused)", given, 10*32)
	}
}

// TestLeaseBoundOverAnIntervalStartingWithALeaseOut: the bound the
// README gives with leases. One request leases 8 of a bucket of 20; the
// bucket in Redis refills to 20 while the lease is out; a burst that
// follows is admitted the lease and the full bucket: no more than
// burst_capacity + replenish_rate × T + max_tokens over the burst's T.
func TestLeaseBoundOverAnIntervalStartingWithALeaseOut(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := leaseHandler(t, "looser", "replenish_rate 20\n\tburst_capacity 20\n\tlease 8 1s", srv.Addr)
	scriptsLoaded(t, rdb)
	key := limitKey(t, h, "", "b")
	if status, _, _ := hit(h, "b"); status != 200 {
		t.Fatalf("first request: %d", status)
	}
	if got := leaseHeld(h, key); got != 8 {
		t.Fatalf("leased %d, want 8 (min(8, half of the 19 left))", got)
	}
	time.Sleep(700 * time.Millisecond) // 11 refill to 20 in 550 ms; the lease holds for 1s
	start := time.Now()
	admitted := 0
	for range 40 {
		if status, _, _ := hit(h, "b"); status == 200 {
			admitted++
		}
	}
	elapsed := time.Since(start).Seconds()
	if bound := 20 + 20*elapsed + 8; float64(admitted) > bound {
		t.Errorf("admitted %d in %.3fs, above burst + rate × T + max_tokens = %.1f", admitted, elapsed, bound)
	}
	t.Logf("admitted %d in %.3fs: burst + rate × T = %.1f, plus the lease's 8", admitted, elapsed, 20+20*elapsed)
}
