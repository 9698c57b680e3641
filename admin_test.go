package ratelimit

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// The admin API (admin.go) against a real Caddy and its admin endpoint:
// caddytest's Caddy in this process (admin on caddytestAdmin) and, where
// a second instance is needed, a Caddy process (internal/caddyproc) with
// its own admin endpoint; the buckets in real Redis servers.

// adminBucket is one bucket of GET /rate_limit/zones/<zone>/buckets.
type adminBucket struct {
	Limit           string  `json:"limit"`
	Key             string  `json:"key"`
	StoredKey       string  `json:"stored_key"`
	Exempt          bool    `json:"exempt"`
	Blocked         bool    `json:"blocked"`
	Tokens          string  `json:"tokens"`
	ReplenishRate   float64 `json:"replenish_rate"`
	BurstCapacity   int64   `json:"burst_capacity"`
	RequestedTokens int64   `json:"requested_tokens"`
	RetryAfter      float64 `json:"retry_after"`
	ExpiresIn       float64 `json:"expires_in"`
	Lent            int64   `json:"lent"`
}

// tokens is the bucket's tokens as a number.
func (b adminBucket) tokens(t *testing.T) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(b.Tokens, 64)
	if err != nil {
		t.Fatalf("bucket %s: tokens %q: %v", b.StoredKey, b.Tokens, err)
	}
	return v
}

type adminBuckets struct {
	Zone    string        `json:"zone"`
	Buckets []adminBucket `json:"buckets"`
}

type adminReset struct {
	Zone  string   `json:"zone"`
	Reset []string `json:"reset"`
}

type adminLimit struct {
	Name            string `json:"name"`
	Key             string `json:"key"`
	ReplenishRate   any    `json:"replenish_rate"`
	BurstCapacity   any    `json:"burst_capacity"`
	RequestedTokens any    `json:"requested_tokens"`
	IPv4Prefix      int    `json:"ipv4_prefix"`
	IPv6Prefix      int    `json:"ipv6_prefix"`
}

type adminZone struct {
	Zone   string       `json:"zone"`
	Store  string       `json:"store"`
	Limits []adminLimit `json:"limits"`
}

var adminHTTP = &http.Client{Timeout: 10 * time.Second}

// adminCall sends method path (with its query) to the admin endpoint at
// base and returns the status, the Content-Type and the body.
func adminCall(t *testing.T, base, method, path string) (int, string, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := adminHTTP.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading the body: %v", method, path, err)
	}
	return resp.StatusCode, resp.Header.Get("Content-Type"), body
}

// adminJSON is adminCall expecting 200 with JSON, decoded strictly into v.
func adminJSON(t *testing.T, base, method, path string, v any) {
	t.Helper()
	status, ctype, body := adminCall(t, base, method, path)
	if status != http.StatusOK || ctype != "application/json" {
		t.Fatalf("%s %s: %d %q %s, want 200 with JSON", method, path, status, ctype, body)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s %s: decoding %s: %v", method, path, body, err)
	}
}

// bucketsPath is the buckets resource of a zone for the query.
func bucketsPath(zone string, query url.Values) string {
	return "/rate_limit/zones/" + zone + "/buckets?" + query.Encode()
}

// getAdminBuckets GETs a client's buckets of a zone.
func getAdminBuckets(t *testing.T, base, zone string, query url.Values) []adminBucket {
	t.Helper()
	var got adminBuckets
	adminJSON(t, base, http.MethodGet, bucketsPath(zone, query), &got)
	if got.Zone != zone {
		t.Fatalf("GET %s: zone %q", bucketsPath(zone, query), got.Zone)
	}
	return got.Buckets
}

// adminBucketOf is getAdminBuckets for a zone with one limit.
func adminBucketOf(t *testing.T, base, zone string, query url.Values) adminBucket {
	t.Helper()
	buckets := getAdminBuckets(t, base, zone, query)
	if len(buckets) != 1 {
		t.Fatalf("GET %s: %d buckets %+v, want 1", bucketsPath(zone, query), len(buckets), buckets)
	}
	return buckets[0]
}

// resetBuckets DELETEs a client's buckets of a zone and returns the keys
// reset.
func resetBuckets(t *testing.T, base, zone string, query url.Values) []string {
	t.Helper()
	var got adminReset
	adminJSON(t, base, http.MethodDelete, bucketsPath(zone, query), &got)
	if got.Zone != zone {
		t.Fatalf("DELETE %s: zone %q", bucketsPath(zone, query), got.Zone)
	}
	return got.Reset
}

// q builds a query from name, value pairs.
func q(pairs ...string) url.Values {
	v := url.Values{}
	for i := 0; i+1 < len(pairs); i += 2 {
		v.Add(pairs[i], pairs[i+1])
	}
	return v
}

// send sends GET url with the headers (name, value pairs) and returns the
// response with its body read.
func send(t *testing.T, client *http.Client, url string, headers ...string) (*http.Response, string) {
	t.Helper()
	resp, body, err := getHeaders(client, url, headers...)
	if err != nil {
		t.Fatalf("GET %s %v: %v", url, headers, err)
	}
	return resp, body
}

// expectAdmitted sends a request and expects 200 with the remaining
// count; it returns the body.
func expectAdmitted(t *testing.T, client *http.Client, url, remaining string, headers ...string) string {
	t.Helper()
	resp, body := send(t, client, url, headers...)
	if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != remaining {
		t.Fatalf("GET %s %v: %d remaining %q, want 200 with %s", url, headers, resp.StatusCode,
			resp.Header.Get("X-RateLimit-Remaining"), remaining)
	}
	return body
}

// expectDenied sends a request and expects 429; it returns Retry-After.
func expectDenied(t *testing.T, client *http.Client, url string, headers ...string) string {
	t.Helper()
	resp, _ := send(t, client, url, headers...)
	if resp.StatusCode != 429 || resp.Header.Get("X-RateLimit-Remaining") != "0" {
		t.Fatalf("GET %s %v: %d remaining %q, want 429 with 0", url, headers, resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
	}
	return resp.Header.Get("Retry-After")
}

// redisMicros is the Redis server's clock, in microseconds.
func redisMicros(t *testing.T, rdb redis.Cmdable) int64 {
	t.Helper()
	now, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now.UnixMicro()
}

// rawBucket is a bucket's state in Redis: its value as stored (""
// without a key) and its PTTL in milliseconds.
type rawBucket struct {
	value string
	pttl  time.Duration
}

func readRaw(t *testing.T, rdb redis.Cmdable, key string) rawBucket {
	t.Helper()
	ctx := context.Background()
	v, err := rdb.Get(ctx, key).Result()
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	pttl, err := rdb.PTTL(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return rawBucket{v, pttl}
}

// stateOf reads a bucket's state as the script stores it.
func stateOf(t *testing.T, rdb redis.Cmdable, key string) scriptBucket {
	t.Helper()
	st, err := parseBucket(rdb.Get(context.Background(), key))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// commandCalls counts the calls of each command Redis has served (INFO
// commandstats), commands called from scripts included.
func commandCalls(t *testing.T, rdb *redis.Client) map[string]int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int64{}
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
		if !ok {
			continue
		}
		n, _, _ := strings.Cut(rest, ",")
		calls[strings.TrimPrefix(name, "cmdstat_")], _ = strconv.ParseInt(n, 10, 64)
	}
	return calls
}

// commandsSince is what Redis served since before, by command, leaving
// out the commands the test itself sends to look (INFO, GET, PTTL, TIME,
// DBSIZE, EXISTS, KEYS) and those a new connection sends (HELLO, CLIENT
// SETINFO, ...). Commands called from scripts count: a script's SET is
// a SET.
func commandsSince(t *testing.T, rdb *redis.Client, before map[string]int64) map[string]int64 {
	t.Helper()
	delta := map[string]int64{}
	for name, n := range commandCalls(t, rdb) {
		switch name {
		case "info", "get", "pttl", "time", "dbsize", "exists", "keys", "hello", "ping", "command", "select":
			continue
		}
		if strings.HasPrefix(name, "client|") || name == "client" {
			continue // a new connection introduces itself
		}
		if name == "script|load" {
			continue // a new limiter loads its scripts in the background
		}
		if d := n - before[name]; d != 0 {
			delta[name] = d
		}
	}
	return delta
}

// checkArithmetic checks what GET answered of a bucket against its state
// in Redis before the read (st, read from the bucket's key), and the
// Redis clock just before (t0) and after (t1) the read: tokens now =
// min(burst, stored + elapsed*rate); retry_after the time the tokens
// missing for a request take; expires_in the key's TTL, set when the
// state was stored, less the time since, which is the time until the
// bucket is full again (at least 1 s after the store).
func checkArithmetic(t *testing.T, b adminBucket, st scriptBucket, t0, t1 int64) {
	t.Helper()
	rate, burst, requested := b.ReplenishRate, float64(b.BurstCapacity), float64(b.RequestedTokens)
	tokens := b.tokens(t)
	if !st.present {
		if tokens != burst || b.RetryAfter != 0 || b.ExpiresIn != 0 {
			t.Errorf("%s (no key, a full bucket): tokens %v retry_after %v expires_in %v, want %v, 0, 0",
				b.StoredKey, tokens, b.RetryAfter, b.ExpiresIn, burst)
		}
		return
	}
	lo := math.Min(burst, st.tokens+float64(t0-st.at)*rate/1e6)
	hi := math.Min(burst, st.tokens+float64(t1-st.at)*rate/1e6)
	if tokens < lo-1e-6 || tokens > hi+1e-6 { // reported to the millionth
		t.Errorf("%s: tokens %v, want min(burst, stored + elapsed*rate) = %.6f..%.6f (stored %v at %d, read between %d and %d)",
			b.StoredKey, tokens, lo, hi, st.tokens, st.at, t0, t1)
	}
	wantRetry := 0.0
	if tokens < requested {
		wantRetry = (requested - tokens) / rate
	}
	if math.Abs(b.RetryAfter-wantRetry) > 1e-6/rate+2e-6 {
		t.Errorf("%s: retry_after %v, want (requested - tokens)/rate = %v", b.StoredKey, b.RetryAfter, wantRetry)
	}
	ttl := math.Max(1000, math.Ceil((burst-st.tokens)*1000/rate)) / 1000 // as the script set it, in seconds
	expLo, expHi := ttl-float64(t1-st.at)/1e6-0.002, ttl-float64(t0-st.at)/1e6+0.002
	if b.ExpiresIn < expLo || b.ExpiresIn > expHi {
		t.Errorf("%s: expires_in %v, want the TTL set %vs less the time since, %.4f..%.4f", b.StoredKey, b.ExpiresIn, ttl, expLo, expHi)
	}
	if full := (burst - tokens) / rate; ttl > 1 && math.Abs(b.ExpiresIn-full) > 0.004 {
		t.Errorf("%s: expires_in %v, want about the time until full, (burst - tokens)/rate = %v", b.StoredKey, b.ExpiresIn, full)
	}
}

// holds says whether a bucket holds whole tokens, with at most the
// fraction a slow rate (0.01/s) refills during a test.
func (b adminBucket) holds(t *testing.T, whole float64) bool {
	t.Helper()
	tokens := b.tokens(t)
	return tokens >= whole && tokens < whole+0.01
}

// expectValues checks a bucket's limit values as GET shows them.
func expectValues(t *testing.T, b adminBucket, limitName string, rate float64, burst, requested int64) {
	t.Helper()
	if b.Limit != limitName || b.ReplenishRate != rate || b.BurstCapacity != burst || b.RequestedTokens != requested || b.Exempt {
		t.Errorf("bucket %+v: want limit %q, replenish_rate %v, burst_capacity %d, requested_tokens %d", b, limitName, rate, burst, requested)
	}
}

// inspectSite keys by a header; with log_key the body is the client key
// as {http.rate_limit.key} shows it.
const inspectSite = `
http://localhost:9080 {
	rate_limit 0.5 10 {
		zone inspect
		key {http.request.header.X-Key}
		log_key
		redis %s
	}
	respond "{http.rate_limit.key}"
}`

// TestAdminInspectBuckets reads a fresh, a partly used and an empty
// bucket, checks each against the token bucket's arithmetic and the key
// as log_key shows it, and checks that reading changes nothing.
func TestAdminInspectBuckets(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	tester := serveCaddyfile(t, inspectSite, srv.Addr)
	client := tester.Client

	t.Run("fresh", func(t *testing.T) {
		long := strings.Repeat("long-client-key/", 6) // over 64 bytes: hashed
		for _, value := range []string{"fresh", long} {
			before := commandCalls(t, rdb)
			b := adminBucketOf(t, caddytestAdmin, "inspect", q("header.X-Key", value))
			expectValues(t, b, "", 0.5, 10, 1)
			checkArithmetic(t, b, scriptBucket{}, 0, 0)
			if n := rdb.DBSize(ctx).Val(); n != 0 {
				t.Errorf("reading a fresh bucket: %d keys in Redis, want none", n)
			}
			if d := commandsSince(t, rdb, before); d["eval_ro"] != 1 || len(d) != 1 {
				t.Errorf("reading a fresh bucket: Redis served %v, want one eval_ro", d)
			}
			// The first request takes from that very bucket, under that key.
			body := expectAdmitted(t, client, caddytestSite, "9", "X-Key", value)
			if b.Key != body || !strings.HasSuffix(b.StoredKey, "|"+body) || !strings.HasPrefix(b.StoredKey, "rate_limit:inspect|") {
				t.Errorf("key %q stored_key %q; the request's {http.rate_limit.key} is %q", b.Key, b.StoredKey, body)
			}
			if value == long && !strings.HasPrefix(b.Key, "#") {
				t.Errorf("a long key shows as %q, want its hash (#...)", b.Key)
			}
			if keys := rdb.Keys(ctx, "*").Val(); !slices.Equal(keys, []string{b.StoredKey}) {
				t.Errorf("after one request Redis holds %q, want just %q", keys, b.StoredKey)
			}
			rdb.Del(ctx, b.StoredKey)
		}
	})

	// readUnchanged reads a bucket three times and checks that its state
	// in Redis did not change (value, and a TTL that only ran down), that
	// Redis served only the read-only script, and the arithmetic of the
	// first read.
	readUnchanged := func(t *testing.T, value string) adminBucket {
		t.Helper()
		first := adminBucketOf(t, caddytestAdmin, "inspect", q("header.X-Key", value)) // the key, to read it raw
		st := stateOf(t, rdb, first.StoredKey)
		rawAt := time.Now()
		raw := readRaw(t, rdb, first.StoredKey)
		before := commandCalls(t, rdb)
		t0 := redisMicros(t, rdb)
		b := adminBucketOf(t, caddytestAdmin, "inspect", q("header.X-Key", value))
		t1 := redisMicros(t, rdb)
		adminBucketOf(t, caddytestAdmin, "inspect", q("http.request.header.X-Key", value))
		adminBucketOf(t, caddytestAdmin, "inspect", q("header.x-key", value))
		after := readRaw(t, rdb, first.StoredKey)
		if after.value != raw.value || after.pttl > raw.pttl || after.pttl < raw.pttl-time.Since(rawAt)-time.Millisecond {
			t.Errorf("reading changed the bucket: %q PTTL %v before, %q PTTL %v after", raw.value, raw.pttl, after.value, after.pttl)
		}
		if d := commandsSince(t, rdb, before); d["eval_ro"] != 3 || len(d) != 1 {
			t.Errorf("three reads: Redis served %v, want 3 eval_ro and nothing else (no take, no write)", d)
		}
		checkArithmetic(t, b, st, t0, t1)
		return b
	}

	t.Run("partly used", func(t *testing.T) {
		const value = "part ly|used" // escaped in the key
		var body string
		for i := 9; i >= 6; i-- {
			body = expectAdmitted(t, client, caddytestSite, strconv.Itoa(i), "X-Key", value)
		}
		time.Sleep(300 * time.Millisecond) // a visible refill: 0.15 tokens
		b := readUnchanged(t, value)
		expectValues(t, b, "", 0.5, 10, 1)
		if b.Key != "part%20ly%7Cused" || b.Key != body || b.StoredKey != rdb.Keys(ctx, "rate_limit:inspect|*|"+body).Val()[0] {
			t.Errorf("key %q stored_key %q, want part%%20ly%%7Cused as {http.rate_limit.key} (%q) shows it, in the key Redis holds",
				b.Key, b.StoredKey, body)
		}
		tokens := b.tokens(t)
		if tokens < 6.15 || tokens > 6.5 || b.RetryAfter != 0 || b.ExpiresIn < 7 || b.ExpiresIn > 7.72 {
			t.Errorf("after 4 requests and 0.3 s: %+v, want about 6.15 tokens, retry_after 0, expires_in about 7.7", b)
		}
		// The next request takes from the tokens read, refilled since.
		expectAdmitted(t, client, caddytestSite, strconv.Itoa(int(tokens)-1), "X-Key", value)
		st := stateOf(t, rdb, b.StoredKey)
		if had := st.tokens + 1; had < tokens-1e-6 || had > tokens+0.25 {
			t.Errorf("the next request found %v tokens, the read said %v", had, tokens)
		}
	})

	t.Run("empty", func(t *testing.T) {
		const value = "empty"
		for i := 9; i >= 0; i-- {
			expectAdmitted(t, client, caddytestSite, strconv.Itoa(i), "X-Key", value)
		}
		retry := expectDenied(t, client, caddytestSite, "X-Key", value)
		b := readUnchanged(t, value)
		tokens := b.tokens(t)
		if tokens >= 1 || b.RetryAfter <= 0 || b.RetryAfter > 2 || b.ExpiresIn < 18 || b.ExpiresIn > 20 {
			t.Errorf("an empty bucket: %+v, want under 1 token, retry_after up to 2 s, expires_in about 20 s", b)
		}
		if ceil := strconv.Itoa(int(math.Ceil(b.RetryAfter))); ceil != retry {
			t.Errorf("retry_after %v, while the denial said Retry-After %s", b.RetryAfter, retry)
		}
		// Still empty for the next request, which the deny cache answers.
		calls := redistest.ScriptCalls(t, rdb)
		if again := expectDenied(t, client, caddytestSite, "X-Key", value); again != retry {
			t.Errorf("the next request: Retry-After %s, want %s", again, retry)
		}
		if n := redistest.ScriptCalls(t, rdb) - calls; n != 0 {
			t.Errorf("the denial after the read made %d script calls, want 0 (the deny cache)", n)
		}
	})
}

// resetReachedWithin bounds the time a reset takes to reach another
// instance's deny cache: a message on the reset channel, at once on an
// idle machine (a few ms), far less than the 100 s that the cached
// denials of resetSite's buckets would last without it. A machine loaded
// to 7 runnable threads a core took over 5 s once.
const resetReachedWithin = 20 * time.Second

// resetSite is served by two Caddy instances sharing one Redis: a long
// refill, so that only a reset admits a client whose burst is used.
const resetSite = `
%s {
	rate_limit 0.01 2 {
		zone reset
		key {http.request.header.X-Key}
		redis %s
	}
	respond "ok"
}`

// TestAdminResetReachesEveryInstance resets a client's empty bucket
// through one instance's admin API while another instance holds the
// client's denial in its deny cache (and would deny without asking
// Redis for the 100 s of its Retry-After): that instance admits the
// client's next request at once, well within that (resetReachedWithin,
// for a loaded machine). Both ways: caddytest's Caddy (in this process)
// and a Caddy process.
func TestAdminResetReachesEveryInstance(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	tester := serveCaddyfile(t, fmt.Sprintf(resetSite, "http://localhost:9080", "%s"), srv.Addr)
	proc := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(resetSite, "http://127.0.0.1:{{http_port}}", srv.Addr)))
	procAdmin := fmt.Sprintf("http://127.0.0.1:%d", proc.AdminPort)
	procClient := caddyClient(t)

	type instance struct {
		name   string
		admin  string
		url    string
		client *http.Client
	}
	inproc := instance{"caddytest", caddytestAdmin, caddytestSite, tester.Client}
	process := instance{"caddy process", procAdmin, proc.URL, procClient}

	for _, c := range []struct {
		key              string
		resetBy, admitBy instance
	}{
		{"one", inproc, process},
		{"two", process, inproc},
	} {
		t.Run("reset by "+c.resetBy.name, func(t *testing.T) {
			// The burst used on one instance, the denial cached on both.
			expectAdmitted(t, c.resetBy.client, c.resetBy.url, "1", "X-Key", c.key)
			expectAdmitted(t, c.admitBy.client, c.admitBy.url, "0", "X-Key", c.key)
			for _, in := range []instance{c.resetBy, c.admitBy} {
				expectDenied(t, in.client, in.url, "X-Key", c.key)
				calls := redistest.ScriptCalls(t, rdb)
				if retry := expectDenied(t, in.client, in.url, "X-Key", c.key); retry != "100" {
					t.Fatalf("%s: Retry-After %s, want 100", in.name, retry)
				}
				if n := redistest.ScriptCalls(t, rdb) - calls; n != 0 {
					t.Fatalf("%s denied again with %d script calls, want 0: the denial is not cached", in.name, n)
				}
			}

			reset := resetBuckets(t, c.resetBy.admin, "reset", q("header.X-Key", c.key))
			if len(reset) != 1 || !strings.HasSuffix(reset[0], "|"+c.key) {
				t.Fatalf("reset %q, want the client's key", reset)
			}
			start := time.Now()
			var took time.Duration
			for {
				resp, _ := send(t, c.admitBy.client, c.admitBy.url, "X-Key", c.key)
				if resp.StatusCode == 200 {
					took = time.Since(start)
					break
				}
				if resp.StatusCode != 429 || time.Since(start) > resetReachedWithin {
					t.Fatalf("%s after the reset through %s's admin API: %d after %v, want 200 within %v (the cached denial: 100 s)",
						c.admitBy.name, c.resetBy.name, resp.StatusCode, time.Since(start).Round(time.Millisecond), resetReachedWithin)
				}
				time.Sleep(10 * time.Millisecond)
			}
			t.Logf("%s admitted the client %v after the reset through %s's admin API", c.admitBy.name, took.Round(time.Microsecond), c.resetBy.name)
			// The bucket is full again: the admission took one token.
			expectAdmitted(t, c.resetBy.client, c.resetBy.url, "0", "X-Key", c.key)
			expectDenied(t, c.resetBy.client, c.resetBy.url, "X-Key", c.key)
		})
	}
}

// TestAdminShowsWhatALendingBucketCanGive: the admin API of a Caddy
// process shows a bucket that has lent (lease) as the scripts count it:
// with rate 10, burst 10 and 4 lent to another instance for a minute, 6
// tokens, however long it refilled, and 4 lent; the instance then admits
// exactly those 6 of 12 requests; with the whole burst lent, the bucket
// shows no token and the wait until the lease ends and a token refills. (Before, it showed the
// bucket refilled to 10, and no wait, while instances got 6.)
func TestAdminShowsWhatALendingBucketCanGive(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	proc := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(`http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone lending
		key {http.request.header.X-Key}
		replenish_rate 10
		burst_capacity 10
		lease 4 1s
		on_error deny
		redis %s
	}
	respond "ok"
}`, srv.Addr)))
	admin := fmt.Sprintf("http://127.0.0.1:%d", proc.AdminPort)
	client := caddyClient(t)
	key := keys.BucketPrefix(defaultKeyPrefix, "lending", "{http.request.header.X-Key}") + "c"

	// 2 tokens a second ago (12 by now without the lease), 4 lent to
	// another instance for a minute.
	now := redisMicros(t, rdb)
	setBucketAt(t, rdb, key, 2, now-1_000_000)
	setLeaseRecord(t, rdb, key, now, "other 4 1m 1")
	b := adminBucketOf(t, admin, "lending", q("header.X-Key", "c"))
	if b.tokens(t) != 6 || b.Lent != 4 || b.RetryAfter != 0 {
		t.Errorf("GET with 4 lent of burst 10: tokens %s, lent %d, retry_after %v; want 6 (10 less the 4 lent), 4, 0", b.Tokens, b.Lent, b.RetryAfter)
	}
	admitted := 0
	for range 12 {
		if status, _ := mustGet(t, client, proc.URL, "c"); status == 200 {
			admitted++
		}
	}
	if admitted != 6 {
		t.Errorf("12 requests after the admin API showed %s tokens: %d admitted; want 6", b.Tokens, admitted)
	}

	// The whole burst lent: no token until the lease ends, then a tenth
	// of a second for one to refill.
	now = redisMicros(t, rdb)
	setBucketAt(t, rdb, key, 0, now-1_000_000)
	setLeaseRecord(t, rdb, key, now, "other 10 1m 1")
	b = adminBucketOf(t, admin, "lending", q("header.X-Key", "c"))
	if wait := b.RetryAfter; b.tokens(t) != 0 || b.Lent != 10 || wait < 59 || wait > 60.1 {
		t.Errorf("GET with all 10 lent for a minute: tokens %s, lent %d, retry_after %v; want 0, 10, about 60.1 (the lease's end, then 0.1 s)", b.Tokens, b.Lent, wait)
	}
	if status, _ := mustGet(t, client, proc.URL, "c"); status != 429 {
		t.Errorf("a request with all 10 lent: %d, want 429", status)
	}
}

// TestAdminErrors sends every kind of wrong request: each gets its status
// with a JSON body {"error": "..."} that names what is wrong, and none
// makes Redis do anything, let alone write.
func TestAdminErrors(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	tester := serveCaddyfile(t, `
http://localhost:9080 {
	rate_limit 0.01 5 {
		zone errors
		key {http.request.header.X-Key}
		redis %s
	}
	respond "ok"
}`, srv.Addr)
	expectAdmitted(t, tester.Client, caddytestSite, "4", "X-Key", "held")
	held := adminBucketOf(t, caddytestAdmin, "errors", q("header.X-Key", "held")).StoredKey
	heldState := readRaw(t, rdb, held)

	bucketsOf := func(query string) string { return "/rate_limit/zones/errors/buckets" + query }
	for _, c := range []struct {
		method, path string
		status       int
		says         []string // in the error message
	}{
		{"GET", "/rate_limit/zones/nope/buckets?header.X-Key=held", 404, []string{"zone 'nope'"}},
		{"DELETE", "/rate_limit/zones/nope/buckets?header.X-Key=held", 404, []string{"zone 'nope'"}},
		{"GET", bucketsOf("?header.X-Nope=held"), 400, []string{"unknown placeholder 'http.request.header.X-Nope'", "http.request.header.X-Key"}},
		{"DELETE", bucketsOf("?header.X-Key=held&header.X-Nope=x"), 400, []string{"unknown placeholder 'http.request.header.X-Nope'"}},
		{"DELETE", bucketsOf("?header.X-Key=held&X-Key=held"), 400, []string{"unknown placeholder 'X-Key'"}},
		{"GET", bucketsOf(""), 400, []string{"missing placeholder", "http.request.header.X-Key"}},
		{"DELETE", bucketsOf(""), 400, []string{"missing placeholder", "http.request.header.X-Key"}},
		{"DELETE", bucketsOf("?header.X-Key="), 400, []string{"empty", "{http.request.header.X-Key}"}},
		{"POST", "/rate_limit/zones", 405, []string{"POST", "GET"}},
		{"PUT", "/rate_limit/zones", 405, []string{"PUT", "GET"}},
		{"DELETE", "/rate_limit/zones", 405, []string{"DELETE", "GET"}},
		{"POST", bucketsOf("?header.X-Key=held"), 405, []string{"POST", "GET and DELETE"}},
		{"PUT", bucketsOf("?header.X-Key=held"), 405, []string{"PUT", "GET and DELETE"}},
		{"PATCH", bucketsOf("?header.X-Key=held"), 405, []string{"PATCH", "GET and DELETE"}},
		{"GET", "/rate_limit/nope", 404, []string{"/rate_limit/nope"}},
		{"GET", "/rate_limit/", 404, []string{"/rate_limit/"}},
		{"GET", "/rate_limit/zones/errors", 404, []string{"/rate_limit/zones/errors"}},
		{"DELETE", "/rate_limit/zones/errors/buckets/held?header.X-Key=held", 404, []string{"/rate_limit/zones/errors/buckets/held"}},
		{"DELETE", "/rate_limit/zones/errors/keys?header.X-Key=held", 404, []string{"/rate_limit/zones/errors/keys"}},
	} {
		t.Run(c.method+" "+c.path, func(t *testing.T) {
			before := commandCalls(t, rdb)
			status, ctype, body := adminCall(t, caddytestAdmin, c.method, c.path)
			var answer map[string]any
			if err := json.Unmarshal(body, &answer); err != nil || ctype != "application/json" {
				t.Fatalf("%d %q %s: want a JSON body (%v)", status, ctype, body, err)
			}
			msg, _ := answer["error"].(string)
			if status != c.status || len(answer) != 1 || msg == "" {
				t.Fatalf("%d %s, want %d with {\"error\": ...}", status, body, c.status)
			}
			for _, s := range c.says {
				if !strings.Contains(msg, s) {
					t.Errorf("error %q does not say %q", msg, s)
				}
			}
			if d := commandsSince(t, rdb, before); len(d) != 0 {
				t.Errorf("Redis served %v for a refused request, want nothing", d)
			}
			if n := rdb.DBSize(ctx).Val(); n != 1 {
				t.Errorf("DBSIZE %d, want 1", n)
			}
			if now := readRaw(t, rdb, held); now.value != heldState.value || now.pttl > heldState.pttl {
				t.Errorf("the held bucket changed: %+v, was %+v", now, heldState)
			}
			t.Logf("%d %s", status, bytes.TrimSpace(body))
		})
	}

	// The same checks see a DELETE write.
	before := commandCalls(t, rdb)
	if reset := resetBuckets(t, caddytestAdmin, "errors", q("header.X-Key", "held")); !slices.Equal(reset, []string{held}) {
		t.Fatalf("reset %q, want [%s]", reset, held)
	}
	if d := commandsSince(t, rdb, before); d["del"] != 1 || d["publish"] != 1 || len(d) != 2 {
		t.Errorf("DELETE: Redis served %v, want one del and one publish", d)
	}
	if n := rdb.DBSize(ctx).Val(); n != 0 {
		t.Errorf("after DELETE: DBSIZE %d, want 0", n)
	}
}

// TestAdminRefusesAmbiguousQueries: a query that gives one placeholder
// twice, by two of its spellings or by one name repeated, says nothing
// certain about which client is meant, so a DELETE could reset another
// client's buckets: it is refused with 400 naming both spellings (or the
// repeated name), and Redis is not asked. A 405 says, in Allow, which
// methods the resource takes.
func TestAdminRefusesAmbiguousQueries(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	proc := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(`
http://127.0.0.1:{{http_port}} {
	rate_limit 0.01 5 {
		zone ambiguous
		key {client_ip}:{header.X-Key}
		redis %s
	}
	respond "ok"
}`, srv.Addr)))
	admin := fmt.Sprintf("http://127.0.0.1:%d", proc.AdminPort)
	expectAdmitted(t, caddyClient(t), proc.URL, "4", "X-Key", "a")
	held := adminBucketOf(t, admin, "ambiguous", q("client_ip", "127.0.0.1", "header.X-Key", "a")).StoredKey

	bucketsOf := func(query string) string { return "/rate_limit/zones/ambiguous/buckets?" + query }
	for _, c := range []struct{ method, path, allow string }{
		{http.MethodPost, "/rate_limit/zones", "GET"},
		{http.MethodPut, bucketsOf("client_ip=127.0.0.1&header.X-Key=a"), "GET, DELETE"},
	} {
		req, _ := http.NewRequest(c.method, admin+c.path, nil)
		resp, err := adminHTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 405 || resp.Header.Get("Allow") != c.allow {
			t.Errorf("%s %s: %d with Allow %q, want 405 with Allow %q", c.method, c.path, resp.StatusCode, resp.Header.Get("Allow"), c.allow)
		}
	}
	for _, c := range []struct {
		query string
		says  []string
	}{
		{"client_ip=127.0.0.1&http.vars.client_ip=192.0.2.1&header.X-Key=a", []string{"'client_ip'", "'http.vars.client_ip'", "http.vars.client_ip"}},
		{"client_ip=127.0.0.1&header.X-Key=a&header.x-key=b", []string{"'header.X-Key'", "'header.x-key'", "http.request.header.X-Key"}},
		{"client_ip=127.0.0.1&header.X-Key=a&http.request.header.X-Key=a", []string{"'header.X-Key'", "'http.request.header.X-Key'"}},
		{"client_ip=192.0.2.1&client_ip=127.0.0.1&header.X-Key=a", []string{"'client_ip' is given 2 times"}},
		{"client_ip=127.0.0.1&header.X-Key=a&header.X-Key=a", []string{"'header.X-Key' is given 2 times"}},
	} {
		for _, method := range []string{http.MethodGet, http.MethodDelete} {
			before := commandCalls(t, rdb)
			status, _, body := adminCall(t, admin, method, bucketsOf(c.query))
			var answer struct{ Error string }
			if err := json.Unmarshal(body, &answer); err != nil || status != 400 {
				t.Errorf("%s ?%s: %d %s, want 400 with an error", method, c.query, status, body)
				continue
			}
			for _, s := range c.says {
				if !strings.Contains(answer.Error, s) {
					t.Errorf("%s ?%s: error %q does not say %s", method, c.query, answer.Error, s)
				}
			}
			if d := commandsSince(t, rdb, before); len(d) != 0 {
				t.Errorf("%s ?%s: Redis served %v, want nothing", method, c.query, d)
			}
		}
	}
	if n, err := rdb.Exists(ctx, held).Result(); err != nil || n != 1 {
		t.Fatalf("the client's bucket %s is gone (%d, %v): an ambiguous DELETE reset it", held, n, err)
	}

}

// TestAdminReadsBucketsWithoutEvalRO: on a Redis without EVAL_RO (6.2,
// which managed services still run; here a 7 whose EVAL_RO is renamed
// away, which answers the same "unknown command"), the admin API reads
// buckets with EVAL of the same read-only script, and learns that once:
// the second read sends no EVAL_RO.
func TestAdminReadsBucketsWithoutEvalRO(t *testing.T) {
	srv := redistest.Start(t, "--rename-command", "EVAL_RO", "")
	rdb := srv.Client(t)
	proc := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(`
http://127.0.0.1:{{http_port}} {
	rate_limit 0.01 5 {
		zone noevalro
		key {header.X-Key}
		redis %s
	}
	respond "ok"
}`, srv.Addr)))
	admin := fmt.Sprintf("http://127.0.0.1:%d", proc.AdminPort)
	expectAdmitted(t, caddyClient(t), proc.URL, "4", "X-Key", "a")
	errorsOf := func() int64 { return errorStat(t, rdb, "ERR") }
	for i := range 2 {
		errsBefore, before := errorsOf(), commandCalls(t, rdb)
		b := adminBucketOf(t, admin, "noevalro", q("header.X-Key", "a"))
		if !b.holds(t, 4) || b.ExpiresIn <= 0 {
			t.Fatalf("read %d: %+v, want 4 tokens and an expiry", i+1, b)
		}
		refused, calls := errorsOf()-errsBefore, commandsSince(t, rdb, before)
		if calls["eval"] != 1 || i == 1 && refused != 0 || i == 0 && refused != 1 {
			t.Errorf("read %d: Redis served %v and refused %d unknown commands; want one eval, after one refused EVAL_RO on the first read only", i+1, calls, refused)
		}
	}
}

// errorStat reads the count of a Redis error prefix from INFO errorstats.
func errorStat(t *testing.T, rdb *redis.Client, prefix string) int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), "errorstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "errorstat_"+prefix+":count="); ok {
			n, err := strconv.ParseInt(rest, 10, 64)
			if err != nil {
				t.Fatalf("errorstats %q: %v", line, err)
			}
			return n
		}
	}
	return 0
}

// TestAdminCompositeKey names a client's bucket by two placeholders, with
// the Caddyfile's shorthands, the full names, and header names in any
// case.
func TestAdminCompositeKey(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	tester := serveCaddyfile(t, `
http://localhost:9080 {
	route /tenant {
		rate_limit 0.01 10 {
			zone tenants
			key {header.X-Tenant}:{header.X-User}
			log_key
			redis %[1]s
		}
		respond "{http.rate_limit.key}"
	}
	route /lower {
		rate_limit 0.01 10 {
			zone lower
			key {http.request.header.x-tenant}
			log_key
			redis %[1]s
		}
		respond "{http.rate_limit.key}"
	}
}`, srv.Addr)
	var zones []adminZone
	adminJSON(t, caddytestAdmin, http.MethodGet, "/rate_limit/zones", &zones)
	if len(zones) != 2 || zones[1].Zone != "tenants" || len(zones[1].Limits) != 1 ||
		zones[1].Limits[0].Key != "{http.request.header.X-Tenant}:{http.request.header.X-User}" {
		t.Errorf("zones %+v, want lower and tenants, keyed by {http.request.header.X-Tenant}:{http.request.header.X-User}", zones)
	}

	var body string
	for i := 9; i >= 7; i-- {
		body = expectAdmitted(t, tester.Client, caddytestSite+"/tenant", strconv.Itoa(i), "X-Tenant", "acme:eu", "X-User", "bob")
	}
	if body != "acme%3Aeu:bob" {
		t.Fatalf("{http.rate_limit.key} %q, want acme%%3Aeu:bob (the template's ':' escaped in values)", body)
	}
	stored := rdb.Keys(ctx, "*").Val()
	if len(stored) != 1 {
		t.Fatalf("Redis holds %q, want one bucket", stored)
	}
	for _, query := range []url.Values{
		q("header.X-Tenant", "acme:eu", "header.X-User", "bob"),
		q("http.request.header.X-Tenant", "acme:eu", "http.request.header.X-User", "bob"),
		q("header.x-tenant", "acme:eu", "http.request.header.x-user", "bob"),
		q("header.X-TENANT", "acme:eu", "header.X-USER", "bob"),
	} {
		b := adminBucketOf(t, caddytestAdmin, "tenants", query)
		if b.Key != body || b.StoredKey != stored[0] || !b.holds(t, 7) {
			t.Errorf("%s: key %q stored_key %q tokens %s, want %s in %s with 7 tokens", query.Encode(), b.Key, b.StoredKey, b.Tokens, body, stored[0])
		}
	}
	// Another user of the tenant has a bucket of its own.
	if b := adminBucketOf(t, caddytestAdmin, "tenants", q("header.X-Tenant", "acme:eu", "header.X-User", "alice")); b.Tokens != "10" || b.Key != "acme%3Aeu:alice" {
		t.Errorf("another user: %+v, want a full bucket acme%%3Aeu:alice", b)
	}
	status, _, msg := adminCall(t, caddytestAdmin, http.MethodGet, bucketsPath("tenants", q("header.X-Tenant", "acme:eu")))
	if status != 400 || !bytes.Contains(msg, []byte("http.request.header.X-User")) {
		t.Errorf("only one of the two placeholders: %d %s, want 400 naming http.request.header.X-User", status, msg)
	}

	// A template that writes the header's name in lower case.
	body = expectAdmitted(t, tester.Client, caddytestSite+"/lower", "9", "X-Tenant", "acme")
	for _, query := range []url.Values{q("header.X-Tenant", "acme"), q("http.request.header.x-tenant", "acme")} {
		b := adminBucketOf(t, caddytestAdmin, "lower", query)
		if b.Key != body || !b.holds(t, 9) {
			t.Errorf("zone lower, %s: %+v, want key %s with 9 tokens", query.Encode(), b, body)
		}
	}

	if reset := resetBuckets(t, caddytestAdmin, "tenants", q("header.X-User", "bob", "header.X-Tenant", "acme:eu")); !slices.Equal(reset, stored) {
		t.Errorf("reset %q, want %q", reset, stored)
	}
	expectAdmitted(t, tester.Client, caddytestSite+"/tenant", "9", "X-Tenant", "acme:eu", "X-User", "bob")
}

// TestAdminIPv6Prefix reads and resets a bucket keyed by the client's
// address: an IPv6 address in the query counts by its /64, as a
// request's does (clients sent as IPv6 through X-Forwarded-For from a
// trusted proxy).
func TestAdminIPv6Prefix(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	globals := strings.Replace(caddyGlobals, "grace_period 1ns", "grace_period 1ns\n\tservers {\n\t\ttrusted_proxies static private_ranges\n\t}", 1)
	tester := loadCaddyfile(t, nil, globals+fmt.Sprintf(`
http://localhost:9080 {
	rate_limit 0.01 10 {
		zone ip
		key {client_ip}
		log_key
		redis %s
	}
	respond "{http.rate_limit.key}"
}`, srv.Addr))

	var body string
	for i := 9; i >= 7; i-- {
		body = expectAdmitted(t, tester.Client, caddytestSite, strconv.Itoa(i), "X-Forwarded-For", "2001:db8::8")
	}
	if body != "2001:db8::/64" {
		t.Fatalf("{http.rate_limit.key} of 2001:db8::8: %q, want 2001:db8::/64", body)
	}
	stored := rdb.Keys(ctx, "*").Val()
	if len(stored) != 1 || !strings.HasSuffix(stored[0], "|2001:db8::/64") {
		t.Fatalf("Redis holds %q, want one key ending in 2001:db8::/64", stored)
	}
	for _, query := range []url.Values{
		q("client_ip", "2001:db8::7"),
		q("http.vars.client_ip", "2001:db8:0:0:ffff:ffff:ffff:ffff"),
		q("client_ip", "2001:0db8::8"),
	} {
		b := adminBucketOf(t, caddytestAdmin, "ip", query)
		if b.Key != "2001:db8::/64" || b.StoredKey != stored[0] || !b.holds(t, 7) {
			t.Errorf("%s: key %q stored_key %q tokens %s, want 2001:db8::/64 in %s with 7 tokens", query.Encode(), b.Key, b.StoredKey, b.Tokens, stored[0])
		}
	}
	if b := adminBucketOf(t, caddytestAdmin, "ip", q("client_ip", "2001:db8:0:1::8")); b.Key != "2001:db8:0:1::/64" || b.Tokens != "10" {
		t.Errorf("another /64: %+v, want a full bucket 2001:db8:0:1::/64", b)
	}
	// The address caddytest connects from: 127.0.0.1 (or ::1, counted
	// as ::/64).
	body = expectAdmitted(t, tester.Client, caddytestSite, "9")
	own := map[string]string{"127.0.0.1": "127.0.0.1", "::/64": "::1"}[body]
	if b := adminBucketOf(t, caddytestAdmin, "ip", q("client_ip", own)); b.Key != body || !b.holds(t, 9) {
		t.Errorf("client_ip %s: %+v (the request's key %q), want %s with 9 tokens", own, b, body, body)
	}

	if reset := resetBuckets(t, caddytestAdmin, "ip", q("client_ip", "2001:db8::abcd")); !slices.Equal(reset, stored) {
		t.Errorf("reset %q, want %q", reset, stored)
	}
	expectAdmitted(t, tester.Client, caddytestSite, "9", "X-Forwarded-For", "2001:db8::8")
}

// memorySite keeps its buckets in the Caddy process.
const memorySite = `
%s {
	rate_limit 0.5 10 {
		zone mem
		key {http.request.header.X-Key}
		store memory
		log_key
	}
	respond "{http.rate_limit.key}"
}`

// TestAdminMemoryStore reads and resets buckets of store memory: those
// of the process whose admin API is asked, and no other.
func TestAdminMemoryStore(t *testing.T) {
	tester := loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(memorySite, "http://localhost:9080"))
	client := tester.Client

	var zones []adminZone
	adminJSON(t, caddytestAdmin, http.MethodGet, "/rate_limit/zones", &zones)
	if len(zones) != 1 || zones[0].Zone != "mem" || zones[0].Store != "memory" {
		t.Errorf("zones %+v, want mem with store memory", zones)
	}
	if b := adminBucketOf(t, caddytestAdmin, "mem", q("header.X-Key", "k")); b.Tokens != "10" || b.RetryAfter != 0 || b.ExpiresIn != 0 {
		t.Errorf("a fresh bucket: %+v, want 10 tokens, retry_after 0, expires_in 0", b)
	}
	start := time.Now()
	var body string
	for i := 9; i >= 6; i-- {
		body = expectAdmitted(t, client, caddytestSite, strconv.Itoa(i), "X-Key", "k")
	}
	firstRead := time.Now()
	b := adminBucketOf(t, caddytestAdmin, "mem", q("header.X-Key", "k"))
	elapsed := time.Since(start)
	tokens := b.tokens(t)
	expectValues(t, b, "", 0.5, 10, 1)
	if b.Key != "k" || body != "k" || !strings.HasSuffix(b.StoredKey, "|k") {
		t.Errorf("key %q stored_key %q, want k (the request's {http.rate_limit.key} is %q)", b.Key, b.StoredKey, body)
	}
	if tokens < 6 || tokens > 6+elapsed.Seconds()*0.5+1e-6 || b.RetryAfter != 0 {
		t.Errorf("after 4 requests in %v: %+v, want 6 tokens refilled by at most %v", elapsed, b, elapsed.Seconds()*0.5)
	}
	if full := (10 - tokens) / 0.5; math.Abs(b.ExpiresIn-full) > 0.003 {
		t.Errorf("expires_in %v, want about the time until full, (burst - tokens)/rate = %v", b.ExpiresIn, full)
	}
	again := adminBucketOf(t, caddytestAdmin, "mem", q("header.X-Key", "k"))
	if t2, refill := again.tokens(t), time.Since(firstRead).Seconds()*0.5; t2 < tokens || t2 > tokens+refill+1e-6 || again.ExpiresIn > b.ExpiresIn {
		t.Errorf("read again: %+v after %+v, more than the %v refilled between the reads; reading changed the bucket", again, b, refill)
	}
	expectAdmitted(t, client, caddytestSite, "5", "X-Key", "k")
	for i := 4; i >= 0; i-- {
		expectAdmitted(t, client, caddytestSite, strconv.Itoa(i), "X-Key", "k")
	}
	retry := expectDenied(t, client, caddytestSite, "X-Key", "k")
	empty := adminBucketOf(t, caddytestAdmin, "mem", q("header.X-Key", "k"))
	if tk := empty.tokens(t); tk >= 1 || math.Abs(empty.RetryAfter-(1-tk)/0.5) > 3e-6 || strconv.Itoa(int(math.Ceil(empty.RetryAfter))) != retry {
		t.Errorf("an empty bucket: %+v, want under 1 token and retry_after (1 - tokens)/rate, as Retry-After %s", empty, retry)
	}

	// Another Caddy process, with the same zone, has buckets of its own.
	proc := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(memorySite, "http://127.0.0.1:{{http_port}}")))
	procAdmin := fmt.Sprintf("http://127.0.0.1:%d", proc.AdminPort)
	procClient := caddyClient(t)
	if b := adminBucketOf(t, procAdmin, "mem", q("header.X-Key", "k")); b.Tokens != "10" {
		t.Errorf("the other process's bucket: %+v, want a full one", b)
	}
	for i := 9; i >= 0; i-- {
		expectAdmitted(t, procClient, proc.URL, strconv.Itoa(i), "X-Key", "k")
	}
	expectDenied(t, procClient, proc.URL, "X-Key", "k")

	if reset := resetBuckets(t, caddytestAdmin, "mem", q("header.X-Key", "k")); !slices.Equal(reset, []string{b.StoredKey}) {
		t.Errorf("reset %q, want [%s]", reset, b.StoredKey)
	}
	if b := adminBucketOf(t, caddytestAdmin, "mem", q("header.X-Key", "k")); b.Tokens != "10" || b.ExpiresIn != 0 {
		t.Errorf("after the reset: %+v, want a full bucket", b)
	}
	expectAdmitted(t, client, caddytestSite, "9", "X-Key", "k")
	// The other process's bucket stayed empty.
	expectDenied(t, procClient, proc.URL, "X-Key", "k")
	if b := adminBucketOf(t, procAdmin, "mem", q("header.X-Key", "k")); b.tokens(t) >= 1 {
		t.Errorf("the other process's bucket after this one's reset: %+v, want it still empty", b)
	}
	resetBuckets(t, procAdmin, "mem", q("header.X-Key", "k"))
	expectAdmitted(t, procClient, proc.URL, "9", "X-Key", "k")
}

// policySite is the Policies example of the README, with a limit whose
// rate each request gives.
const policySite = `
http://localhost:9080 {
	rate_limit {
		zone api
		key  {http.request.header.X-API-Key}
		limit second 10 20
		limit hour   1000/1h 1000
		limit tenant 600/1m 600 {
			key {http.request.header.X-Tenant}
		}
		limit plan {
			replenish_rate {http.request.header.X-Plan-Rate}
			burst_capacity 50
		}
		log_key
		redis %s
	}
	respond "ok"
}`

// TestAdminPolicy reads every limit's bucket of a zone with several
// limits, and resets them all at once.
func TestAdminPolicy(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	tester := serveCaddyfile(t, policySite, srv.Addr)
	headers := []string{"X-API-Key", "abc", "X-Tenant", "acme", "X-Plan-Rate", "5"}
	for i := 19; i >= 15; i-- {
		expectAdmitted(t, tester.Client, caddytestSite, strconv.Itoa(i), headers...)
	}

	var zones []adminZone
	adminJSON(t, caddytestAdmin, http.MethodGet, "/rate_limit/zones", &zones)
	if len(zones) != 1 || zones[0].Zone != "api" || len(zones[0].Limits) != 4 {
		t.Fatalf("zones %+v, want api with 4 limits", zones)
	}
	for i, want := range []adminLimit{
		{"second", "{http.request.header.X-API-Key}", 10.0, 20.0, 1.0, 32, 64},
		{"hour", "{http.request.header.X-API-Key}", 1000.0 / 3600, 1000.0, 1.0, 32, 64},
		{"tenant", "{http.request.header.X-Tenant}", 10.0, 600.0, 1.0, 32, 64},
		{"plan", "{http.request.header.X-API-Key}", "{http.request.header.X-Plan-Rate}", 50.0, "", 32, 64},
	} {
		if got := zones[0].Limits[i]; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("limit %d: %+v, want %+v", i, got, want)
		}
	}

	all := q("header.X-API-Key", "abc", "header.X-Tenant", "acme", "header.X-Plan-Rate", "5")
	states := map[string]scriptBucket{}
	for _, key := range rdb.Keys(ctx, "*").Val() {
		states[key] = stateOf(t, rdb, key)
	}
	before := commandCalls(t, rdb)
	t0 := redisMicros(t, rdb)
	buckets := getAdminBuckets(t, caddytestAdmin, "api", all)
	t1 := redisMicros(t, rdb)
	if d := commandsSince(t, rdb, before); d["eval_ro"] != 4 || len(d) != 1 {
		t.Errorf("reading 4 buckets: Redis served %v, want 4 eval_ro", d)
	}
	if len(buckets) != 4 || len(states) != 4 {
		t.Fatalf("buckets %+v of keys %v, want 4", buckets, states)
	}
	for i, want := range []struct {
		limit     string
		rate      float64
		burst     int64
		key       string
		suffix    string
		remaining float64
	}{
		{"second", 10, 20, "abc", "|abc}|second", 15},
		{"hour", 1000.0 / 3600, 1000, "abc", "|abc}|hour", 995},
		{"tenant", 10, 600, "acme", "|acme}|tenant", 595},
		{"plan", 5, 50, "abc", "|abc}|plan", 45},
	} {
		b := buckets[i]
		expectValues(t, b, want.limit, want.rate, want.burst, 1)
		st, ok := states[b.StoredKey]
		if b.Key != want.key || !strings.HasPrefix(b.StoredKey, "rate_limit:{api|") || !strings.HasSuffix(b.StoredKey, want.suffix) || !ok {
			t.Errorf("limit %s: key %q stored_key %q, want %s in a key of Redis ending %s", want.limit, b.Key, b.StoredKey, want.key, want.suffix)
			continue
		}
		checkArithmetic(t, b, st, t0, t1)
		if tokens := b.tokens(t); tokens < want.remaining || tokens > want.remaining+want.rate {
			t.Errorf("limit %s: tokens %v, want %v and what a second at most refilled", want.limit, tokens, want.remaining)
		}
	}
	// second and hour share a key template, hence a Cluster hash tag.
	tag := func(key string) string { return key[strings.Index(key, "{"):strings.Index(key, "}")] }
	if tag(buckets[0].StoredKey) != tag(buckets[1].StoredKey) || tag(buckets[0].StoredKey) == tag(buckets[2].StoredKey) {
		t.Errorf("hash tags of %q", []string{buckets[0].StoredKey, buckets[1].StoredKey, buckets[2].StoredKey})
	}

	// Without a limit's placeholders, the other limits' buckets.
	if got := getAdminBuckets(t, caddytestAdmin, "api", q("header.X-API-Key", "abc")); len(got) != 2 || got[0].Limit != "second" || got[1].Limit != "hour" {
		t.Errorf("only X-API-Key: %+v, want the buckets of second and hour", got)
	}
	// A rate of `unlimited` exempts the client from the limit.
	exempt := getAdminBuckets(t, caddytestAdmin, "api", q("header.X-API-Key", "abc", "header.X-Plan-Rate", "unlimited"))
	if len(exempt) != 3 || exempt[2].Limit != "plan" || !exempt[2].Exempt || exempt[2].StoredKey != "" {
		t.Errorf("X-Plan-Rate unlimited: %+v, want second, hour and plan exempt", exempt)
	}
	// A rate out of range is refused as a request's would be.
	status, _, msg := adminCall(t, caddytestAdmin, http.MethodGet, bucketsPath("api", q("header.X-API-Key", "abc", "header.X-Plan-Rate", "lots")))
	if status != 400 || !bytes.Contains(msg, []byte("replenish_rate 'lots'")) {
		t.Errorf("X-Plan-Rate lots: %d %s, want 400 naming replenish_rate 'lots'", status, msg)
	}

	reset := resetBuckets(t, caddytestAdmin, "api", all)
	if len(reset) != 4 {
		t.Fatalf("reset %q, want the 4 buckets", reset)
	}
	for i, key := range reset {
		if key != buckets[i].StoredKey {
			t.Errorf("reset %q, want %s", reset[i], buckets[i].StoredKey)
		}
	}
	if n := rdb.DBSize(ctx).Val(); n != 0 {
		t.Errorf("after the reset: %d keys in Redis, want none", n)
	}
	expectAdmitted(t, tester.Client, caddytestSite, "19", headers...)
}

// clusterSite is served by caddytest's Caddy and a Caddy process, on one
// Redis Cluster: zone c with one limit (its denials cached), zone cp with
// two key templates (buckets on different masters).
const clusterSite = `
%s {
	route /c {
		rate_limit 0.01 2 {
			zone c
			key {http.request.header.X-Key}
			redis %s
		}
	}
	route /cp {
		rate_limit {
			zone cp
			limit user 0.01 2 {
				key {http.request.header.X-Key}
			}
			limit tenant 0.01 2 {
				key {http.request.header.X-Tenant}
			}
			redis %[2]s
		}
	}
	respond "ok"
}`

// TestAdminCluster reads and resets buckets on each master of a Redis
// Cluster, and the reset reaches another instance's deny cache.
func TestAdminCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	cc := c.Client(t)
	ctx := context.Background()
	addrs := strings.Join(c.Addrs, " ")
	tester := loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(clusterSite, "http://localhost:9080", addrs))
	proc := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(clusterSite, "http://127.0.0.1:{{http_port}}", addrs)))
	procClient := caddyClient(t)
	masters := map[string]*redis.Client{}
	for _, m := range c.Masters {
		masters[m.Addr] = m.Client(t)
	}
	scriptCallsAll := func() int64 {
		var n int64
		for _, m := range masters {
			n += redistest.ScriptCalls(t, m)
		}
		return n
	}

	// A client on each master: GET of a fresh bucket names its key and
	// writes nothing.
	master := func(key string) string {
		m, err := cc.MasterForKey(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return m.Options().Addr
	}
	byMaster := map[string]string{}
	for i := 0; len(byMaster) < len(c.Masters); i++ {
		value := "client" + strconv.Itoa(i)
		b := adminBucketOf(t, caddytestAdmin, "c", q("header.X-Key", value))
		if _, ok := byMaster[master(b.StoredKey)]; !ok {
			byMaster[master(b.StoredKey)] = value
		}
	}
	for addr, value := range byMaster {
		expectAdmitted(t, tester.Client, caddytestSite+"/c", "1", "X-Key", value)
		expectAdmitted(t, procClient, proc.URL+"/c", "0", "X-Key", value)
		expectDenied(t, tester.Client, caddytestSite+"/c", "X-Key", value)
		expectDenied(t, procClient, proc.URL+"/c", "X-Key", value)
		calls := scriptCallsAll()
		expectDenied(t, procClient, proc.URL+"/c", "X-Key", value)
		if n := scriptCallsAll() - calls; n != 0 {
			t.Fatalf("the Caddy process denied again with %d script calls, want 0 (its deny cache)", n)
		}
		b := adminBucketOf(t, caddytestAdmin, "c", q("header.X-Key", value))
		if tk := b.tokens(t); tk >= 1 || b.RetryAfter < 99 || master(b.StoredKey) != addr {
			t.Errorf("%s on %s: %+v, want an empty bucket", value, addr, b)
		}
		if n := masters[addr].Exists(ctx, b.StoredKey).Val(); n != 1 {
			t.Errorf("%s is not on %s", b.StoredKey, addr)
		}
		if reset := resetBuckets(t, caddytestAdmin, "c", q("header.X-Key", value)); !slices.Equal(reset, []string{b.StoredKey}) {
			t.Errorf("reset %q, want [%s]", reset, b.StoredKey)
		}
		if n := cc.Exists(ctx, b.StoredKey).Val(); n != 0 {
			t.Errorf("%s still exists after the reset", b.StoredKey)
		}
		start := time.Now()
		for {
			resp, _ := send(t, procClient, proc.URL+"/c", "X-Key", value)
			if resp.StatusCode == 200 {
				break
			}
			if resp.StatusCode != 429 || time.Since(start) > resetReachedWithin {
				t.Fatalf("the Caddy process after the reset of %s on %s: %d after %v, want 200 within %v (the cached denial: 100 s)",
					value, addr, resp.StatusCode, time.Since(start).Round(time.Millisecond), resetReachedWithin)
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Logf("%s on %s: the Caddy process admitted it %v after the reset", value, addr, time.Since(start).Round(time.Microsecond))
		expectAdmitted(t, tester.Client, caddytestSite+"/c", "0", "X-Key", value)
	}

	// Zone cp: a user and a tenant whose buckets live on different masters.
	user, tenant := "", ""
	for i := 0; user == "" || tenant == ""; i++ {
		bs := getAdminBuckets(t, caddytestAdmin, "cp", q("header.X-Key", "u"+strconv.Itoa(i), "header.X-Tenant", "t"+strconv.Itoa(i)))
		if len(bs) == 2 && master(bs[0].StoredKey) != master(bs[1].StoredKey) {
			user, tenant = "u"+strconv.Itoa(i), "t"+strconv.Itoa(i)
		}
	}
	expectAdmitted(t, procClient, proc.URL+"/cp", "1", "X-Key", user, "X-Tenant", tenant)
	query := q("header.X-Key", user, "header.X-Tenant", tenant)
	bs := getAdminBuckets(t, caddytestAdmin, "cp", query)
	for i, name := range []string{"user", "tenant"} {
		if bs[i].Limit != name || bs[i].tokens(t) < 1 || bs[i].tokens(t) > 1.01 || bs[i].ExpiresIn < 99 {
			t.Errorf("zone cp, limit %s: %+v, want 1 token", name, bs[i])
		}
	}
	reset := resetBuckets(t, caddytestAdmin, "cp", query)
	if len(reset) != 2 || reset[0] != bs[0].StoredKey || reset[1] != bs[1].StoredKey {
		t.Errorf("reset %q, want %s and %s", reset, bs[0].StoredKey, bs[1].StoredKey)
	}
	for _, key := range reset {
		if n := cc.Exists(ctx, key).Val(); n != 0 {
			t.Errorf("%s on %s still exists after the reset", key, master(key))
		}
	}
	expectAdmitted(t, procClient, proc.URL+"/cp", "1", "X-Key", user, "X-Tenant", tenant)
}

func TestAdminBlockedLimitShowsBlockedAndReadsNoBucket(t *testing.T) {
	srv := redistest.Start(t)
	loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(`
http://localhost:9080 {
	rate_limit {
		zone blockedzone
		key {http.request.header.X-Key}
		limit open 1 5
		limit shut {
			burst_capacity 0
		}
		redis %s
	}
	respond "ok"
}`, srv.Addr))
	buckets := getAdminBuckets(t, caddytestAdmin, "blockedzone", url.Values{"header.X-Key": {"k"}})
	if len(buckets) != 2 || buckets[0].Limit != "open" || buckets[0].Tokens != "5" || buckets[0].Blocked ||
		buckets[1].Limit != "shut" || !buckets[1].Blocked || buckets[1].Tokens != "" || buckets[1].StoredKey != "" {
		t.Fatalf("buckets %+v: want open full (5) and shut blocked, with no bucket", buckets)
	}
	var reset adminReset
	adminJSON(t, caddytestAdmin, http.MethodDelete, bucketsPath("blockedzone", url.Values{"header.X-Key": {"k"}}), &reset)
	if len(reset.Reset) != 1 || !strings.HasSuffix(reset.Reset[0], "|open") {
		t.Fatalf("reset %v: want only the open limit's key", reset.Reset)
	}
}
