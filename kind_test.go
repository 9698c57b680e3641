package ratelimit

// The seam of kind.go: a kind of limit defined only in this file, a
// fixed window, runs end to end through `store memory` (ServeHTTP, the
// headers, the placeholders, the admin API) without a line of it in the
// production files.

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// fixedWindow is a kind of limit (kind.go) known only to this test: at
// most count tokens (the limit's burst) per window, a window starting
// with the first take after the last window ended, on the memory store's
// clock. A bucketState holds the tokens used in the window (tokens), its
// start (at) and its end (expires); past its end the bucket is gone, and
// the next take starts a new window.
//
// It runs only through the in-process store. The methods that serve a
// Redis script call (scriptArgs, appendArgs, replyWords, readReply)
// return zero values or an error. Of the optional interfaces it has the
// arithmetic in the process (bucketArithmetic); not chargedKind (the
// test's limit charges nothing) nor rememberedKind (only a layer over a
// Redis store remembers refusals).
type fixedWindow struct {
	window time.Duration
}

var (
	_ limit.Kind       = fixedWindow{}
	_ limit.Arithmetic = fixedWindow{}
)

func (fixedWindow) BurstName() string { return "count" }

// ResolveValues reads the count from the burst and the cost; the rate,
// which the Caddyfile requires of a token bucket, means nothing here.
func (fixedWindow) ResolveValues(_, count, requested string) (v limit.Values, isUnlimited bool, err error) {
	if count == limit.Unlimited {
		return v, true, nil
	}
	if v.Burst, err = strconv.ParseInt(count, 10, 64); err != nil || v.Burst < 0 {
		return v, false, limit.BadValue("count", count, "is not a whole number of at least 0")
	}
	v.Requested = 1
	if requested != "" {
		if v.Requested, err = strconv.ParseInt(requested, 10, 64); err != nil || v.Requested < 1 {
			return v, false, limit.BadValue("requested_tokens", requested, "is not a whole number of at least 1")
		}
	}
	if v.Burst > 0 && v.Requested > v.Burst {
		return v, false, limit.BadValue("requested_tokens", requested, "is more than the count: no request could ever be admitted")
	}
	return v, false, nil
}

// The Redis side: none. (Provision and every request ask scriptArgs too,
// but only a script call reads the arguments.)

func (fixedWindow) ScriptArgs(limit.Values) [3]any              { return [3]any{} }
func (fixedWindow) AppendArgs(args []any, _ limit.Bucket) []any { return args }
func (fixedWindow) ReplyWords() int                             { return 0 }
func (fixedWindow) ReadReply(b limit.Bucket, _ []int64, _ int) (limit.Bucket, error) {
	return b, fmt.Errorf("the fixed window of kind_test.go has no script")
}

func (fixedWindow) Begin(b limit.Bucket, shared limit.Shared) (limit.Bucket, limit.Shared) {
	return b, shared
}

// Its headers: the count, spread over the window as the replenish rate;
// its RateLimit-Policy item has the window's seconds as w. RateLimit's t
// is its wait, as a token bucket's: the end of the window once it has no
// room, else 0.
func (w fixedWindow) Facts(b limit.Bucket) limit.Facts {
	return limit.Facts{Rate: float64(b.Values.Burst) / w.window.Seconds(), Burst: b.Values.Burst, Requested: b.Values.Requested,
		Window: int64(math.Ceil(w.window.Seconds())), Reset: b.RetryAfter}
}

func (fixedWindow) Refused(b limit.Bucket) limit.Bucket { return b }

// Its arithmetic in the memory store.

// current is the bucket's window that holds t: the tokens used in it,
// its start and its end. An absent bucket, or one past its end, starts a
// window at t.
func (w fixedWindow) current(state limit.State, ok bool, t int64) (used float64, start, end int64) {
	if !ok || state.Expires <= t {
		return 0, t, t + w.window.Microseconds()
	}
	return state.Tokens, state.At, state.Expires
}

func (w fixedWindow) Holds(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket) (limit.Bucket, bool) {
	used, _, _ := w.current(state, ok, t)
	return b, used+float64(b.Values.Requested) <= float64(b.Values.Burst)
}

// Take counts the request's tokens in the window if it is allowed; the
// bucket waits until the window's end when the window has no room for
// another request. A denial stores nothing.
func (w fixedWindow) Take(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket, allowed bool) (limit.Bucket, limit.State, bool) {
	used, start, end := w.current(state, ok, t)
	if allowed {
		used += float64(b.Values.Requested)
	}
	b.Remaining, b.RetryAfter = max(0, b.Values.Burst-int64(used)), 0
	if used+float64(b.Values.Requested) > float64(b.Values.Burst) {
		b.RetryAfter = time.Duration(end-t) * time.Microsecond
	}
	return b, limit.State{Tokens: used, At: start, Expires: end}, allowed
}

// Peek is what is left of the count in the window, and the time until
// the window ends; a bucket with no window now is full.
func (w fixedWindow) Peek(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket) limit.View {
	used, _, end := w.current(state, ok, t)
	view := limit.View{Tokens: float64(b.Values.Burst) - used}
	if ok && state.Expires > t {
		view.ExpiresIn = time.Duration(end-t) * time.Microsecond
	}
	if used+float64(b.Values.Requested) > float64(b.Values.Burst) {
		view.Wait = view.ExpiresIn
	}
	return view
}

// Its admin view: the count and the window, as a quota lists its count
// and period; a bucket as the token bucket's view shows it, with no
// replenish rate.

func (w fixedWindow) LimitInfo(l *limit.Limit) limit.LimitInfo {
	li := l.Info()
	li.Count, li.Per = l.Burst, w.window.String()
	return li
}

func (fixedWindow) BucketInfo(b limit.Bucket, v limit.View) limit.BucketInfo {
	return limit.TokenInfo(b, v)
}

// withKindConfig adds k, a kind's way to read its limits from a
// handler's config, to kindConfigs for the test, after the built-in
// kinds, as a new kind's line in compose.go would.
func withKindConfig(t *testing.T, k kindConfig) {
	saved := kindConfigs
	t.Cleanup(func() { kindConfigs = saved })
	kindConfigs = append(kindConfigs[:len(kindConfigs):len(kindConfigs)], k)
}

// adminGet is the admin API's answer to GET path, in this process.
func adminGet(t *testing.T, path string, v any) {
	t.Helper()
	w := httptest.NewRecorder()
	if err := serveAdmin(w, httptest.NewRequest(http.MethodGet, path, nil)); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	if err := json.Unmarshal(w.Body.Bytes(), v); err != nil {
		t.Fatalf("GET %s: %v in %s", path, err, w.Body)
	}
}

// TestKindDefinedInATestRunsEndToEndThroughMemoryStore gives a handler
// of store memory the fixed window above, 3 requests per second, and
// asserts that ServeHTTP, the headers, the placeholders and the admin
// API answer as the kind says: 3 admitted, then a 429 until the window
// ends, then admitted in a new window. A token bucket of the same
// Caddyfile (rate 1, burst 3) would answer otherwise: a replenish rate of
// 1, w=3, a fraction of a token refilled, one token after a second.
func TestKindDefinedInATestRunsEndToEndThroughMemoryStore(t *testing.T) {
	const zone, count = "fixedwindow", 3
	window := time.Second
	// The handler of zone fixedwindow, and of it alone, has the fixed
	// window as its own limit (no `limits`, no rate or burst of its own),
	// read from its config as a built-in kind's limits are.
	withKindConfig(t, kindConfig{
		configs: func(h *Handler) []limitConfig {
			if h.Zone != zone {
				return nil
			}
			return []limitConfig{{Limit: Limit{BurstCapacity: Param(strconv.Itoa(count))}, own: true,
				newKind: func() (limit.Kind, error) { return fixedWindow{window: window}, nil }}}
		},
		check: func(*Handler, map[string]bool) error { return nil },
	})
	h := provision(t, &Handler{Zone: zone, Key: "{http.request.header.X-Key}", Store: storeMemory, Headers: "both"})

	var zones []struct {
		Zone   string
		Limits []limit.LimitInfo
	}
	adminGet(t, "/rate_limit/zones", &zones)
	listed := false
	for _, z := range zones {
		if z.Zone == zone {
			listed = true
			if len(z.Limits) != 1 || z.Limits[0].Count != "3" || z.Limits[0].Per != "1s" || z.Limits[0].ReplenishRate != "" {
				t.Errorf("zone %s lists %+v, want one limit of count 3 per 1s, no replenish rate", zone, z.Limits)
			}
		}
	}
	if !listed {
		t.Errorf("the admin API lists no zone %s: %+v", zone, zones)
	}

	headers := func(remaining, reset string) map[string]string {
		return map[string]string{
			"X-RateLimit-Remaining":        remaining,
			"X-RateLimit-Replenish-Rate":   "3", // the count over the window's seconds
			"X-RateLimit-Burst-Capacity":   "3",
			"X-RateLimit-Requested-Tokens": "1",
			"RateLimit":                    `"` + zone + `";r=` + remaining + ";t=" + reset,
			"RateLimit-Policy":             `"` + zone + `";q=3;w=1`,
		}
	}
	bucketOf := func(key string) (b limit.BucketInfo) {
		t.Helper()
		var got struct{ Buckets []limit.BucketInfo }
		adminGet(t, "/rate_limit/zones/"+zone+"/buckets?header.X-Key="+key, &got)
		if len(got.Buckets) != 1 {
			t.Fatalf("admin buckets of %s: %+v, want 1", key, got.Buckets)
		}
		return got.Buckets[0]
	}

	// The burst and its denial must fall in one window: on a machine so
	// slow that a second passed meanwhile, a new key tries again.
	var key string
	var answers []policyAnswer
	var exhausted limit.BucketInfo
	var firstDone time.Time
	for attempt := 1; ; attempt++ {
		key = "k" + strconv.Itoa(attempt)
		start := time.Now()
		answers = answers[:0]
		for range count + 1 {
			answers = append(answers, servePolicy(h, "X-Key", key))
			if len(answers) == 1 {
				firstDone = time.Now() // the window started before this
			}
		}
		exhausted = bucketOf(key)
		if time.Since(start) < window {
			break
		}
		if attempt == 3 {
			t.Fatalf("three bursts of %d requests each took longer than the window of %v", count+1, window)
		}
		t.Logf("attempt %d: the burst took longer than the window of %v; again with a new key", attempt, window)
	}
	for i, a := range answers[:count] {
		remaining := strconv.Itoa(count - 1 - i)
		if a.status != 200 || a.result() != "allowed" || a.placeholder("http.rate_limit.limit") != "3" {
			t.Fatalf("request %d: %v limit %q, want 200 allowed of 3", i+1, a, a.placeholder("http.rate_limit.limit"))
		}
		reset := "0"
		if remaining == "0" { // the window has no room for another: until its end
			reset = "1"
		}
		assertAnswerHeaders(t, fmt.Sprintf("request %d", i+1), a, headers(remaining, reset))
	}
	// denied until the window ends, at most a second away: Retry-After 1.
	denied := answers[count]
	if denied.status != 429 || denied.result() != "denied" || denied.placeholder("http.rate_limit.retry_after") != "1" {
		t.Fatalf("request %d: %v retry_after %q, want 429 denied, retry after 1", count+1, denied, denied.placeholder("http.rate_limit.retry_after"))
	}
	want := headers("0", "1")
	want["Retry-After"] = "1"
	assertAnswerHeaders(t, "the denial", denied, want)
	if b := exhausted; b.Tokens != "0" || b.BurstCapacity != 3 || b.RequestedTokens != 1 || b.ReplenishRate != 0 ||
		!(b.RetryAfter > 0 && b.RetryAfter <= 1) || b.ExpiresIn != b.RetryAfter {
		t.Errorf("admin, the window used up: %+v, want 0 tokens of 3, retry_after = expires_in, the window's end within 1 s", b)
	}

	// The window started before the first answer: a second after it, a
	// new one holds the count again.
	time.Sleep(time.Until(firstDone.Add(window)))
	again := servePolicy(h, "X-Key", key)
	if again.status != 200 || again.result() != "allowed" {
		t.Fatalf("after the window: %v, want 200 allowed", again)
	}
	assertAnswerHeaders(t, "after the window", again, headers("2", "0"))
	if b := bucketOf(key); b.Tokens != "2" || b.RetryAfter != 0 || !(b.ExpiresIn > 0 && b.ExpiresIn <= 1) {
		t.Errorf("admin, a request into a new window: %+v, want 2 tokens, retry_after 0, expires_in within 1 s", b)
	}
	if b := bucketOf("other"); b.Tokens != "3" || b.ExpiresIn != 0 {
		t.Errorf("admin, a client without a window: %+v, want 3 tokens, expires_in 0", b)
	}
}

// assertAnswerHeaders asserts the response headers of an answer.
func assertAnswerHeaders(t *testing.T, what string, a policyAnswer, want map[string]string) {
	t.Helper()
	for k, v := range want {
		if got := a.header.Get(k); got != v {
			t.Errorf("%s: %s %q, want %q", what, k, got, v)
		}
	}
}
