package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddy-redis/ratelimit/internal/testproc"
	"go.uber.org/zap"
)

// TestServeHTTPWithoutRedis covers what a handler answers, and logs,
// without a reply from Redis: an empty key, a hard block, and a Redis that
// refuses connections (deadRedis), by on_error.
func TestServeHTTPWithoutRedis(t *testing.T) {
	keyed := "rate_limit 1 2 {\n\tkey {http.request.header.X-Key}\n\ton_error %s\n}"
	for _, tc := range []struct {
		name, directive, key string
		status               int
		headers              map[string]string
		result, warning      string
	}{
		{"empty key", fmt.Sprintf(keyed, "allow"), "", 403,
			map[string]string{"X-RateLimit-Remaining": "", "Retry-After": ""}, "empty_key", ""},
		{"burst_capacity 0", "rate_limit {\n\tburst_capacity 0\n}", "k", 429,
			map[string]string{"X-RateLimit-Remaining": "0", "X-RateLimit-Burst-Capacity": "0", "Retry-After": ""}, "denied", ""},
		{"Redis refuses, on_error allow", fmt.Sprintf(keyed, "allow"), "k", 200,
			map[string]string{"X-RateLimit-Remaining": "-1", "X-RateLimit-Burst-Capacity": "2", "Retry-After": ""},
			"error_allowed", "Redis failed; following on_error"},
		{"Redis refuses, on_error deny", fmt.Sprintf(keyed, "deny"), "k", 503,
			map[string]string{"X-RateLimit-Remaining": "-1", "Retry-After": ""}, "error_denied", "Redis failed; following on_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := parseTestCaddyfile(tc.directive)
			if err != nil {
				t.Fatal(err)
			}
			provision(t, offline(h))
			logs := observeLogs(h, zap.DebugLevel)
			status, header := serve(context.Background(), h, tc.key)
			if status != tc.status {
				t.Errorf("%d, want %d", status, tc.status)
			}
			for name, v := range tc.headers {
				if got := header.Get(name); got != v {
					t.Errorf("%s %q, want %q", name, got, v)
				}
			}
			decisions := logs.FilterMessage("rate limit decision").All()
			if len(decisions) != 1 || decisions[0].ContextMap()["result"] != tc.result {
				t.Errorf("decision lines %v, want one with result %s", decisions, tc.result)
			}
			warnings := logs.FilterLevelExact(zap.WarnLevel).All()
			switch {
			case tc.warning == "" && len(warnings) != 0:
				t.Errorf("warnings %v, want none", warnings)
			case tc.warning != "" && (len(warnings) != 1 || warnings[0].Message != tc.warning || warnings[0].ContextMap()["error"] == nil):
				t.Errorf("warnings %v, want one %q with the error", warnings, tc.warning)
			}
		})
	}
}

const keyedSite = `
http://localhost:9080 {
	rate_limit {
		zone test
		key {http.request.header.X-Key}
		replenish_rate 0.2
		burst_capacity 3
		redis %s
	}
	respond "ok"
}`

func TestBurstThen429WithHeaders(t *testing.T) {
	srv := redistest.Start(t)
	tester := serveCaddyfile(t, keyedSite, srv.Addr)

	for i, remaining := range []string{"2", "1", "0"} {
		resp, body := get(t, tester, "/", "alice")
		if resp.StatusCode != 200 || body != "ok" {
			t.Fatalf("request %d: %d %q, want 200 ok", i+1, resp.StatusCode, body)
		}
		assertHeaders(t, resp, map[string]string{
			"X-RateLimit-Remaining":        remaining,
			"X-RateLimit-Replenish-Rate":   "0.2",
			"X-RateLimit-Burst-Capacity":   "3",
			"X-RateLimit-Requested-Tokens": "1",
			"Retry-After":                  "",
		})
	}
	resp, _ := get(t, tester, "/", "alice")
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("4th request: %d, want 429", resp.StatusCode)
	}
	// One token at 0.2/s is 5 s away, less what elapsed since the burst.
	assertHeaders(t, resp, map[string]string{"X-RateLimit-Remaining": "0", "Retry-After": "5"})

	// Another key has its own bucket.
	if resp, _ := get(t, tester, "/", "bob"); resp.StatusCode != 200 {
		t.Fatalf("bob: %d, want 200", resp.StatusCode)
	}
}

func TestHandleErrorsShapes429(t *testing.T) {
	srv := redistest.Start(t)
	tester := serveCaddyfile(t, `
http://localhost:9080 {
	rate_limit 1 1 {
		key {http.request.header.X-Key}
		redis %s
	}
	respond "ok"
	handle_errors 429 {
		respond "slow down: {err.status_code}" 429
	}
}`, srv.Addr)

	get(t, tester, "/", "carol")
	resp, body := get(t, tester, "/", "carol")
	if resp.StatusCode != 429 || body != "slow down: 429" {
		t.Fatalf("got %d %q, want 429 from handle_errors", resp.StatusCode, body)
	}
	assertHeaders(t, resp, map[string]string{"Retry-After": "1", "X-RateLimit-Remaining": "0"})
}

func TestEmptyKeyDenied403(t *testing.T) {
	srv := redistest.Start(t)
	tester := serveCaddyfile(t, keyedSite, srv.Addr)

	resp, _ := get(t, tester, "/", "")
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("no X-Key: %d, want 403", resp.StatusCode)
	}
	assertHeaders(t, resp, map[string]string{"X-RateLimit-Remaining": "", "Retry-After": ""})
}

func TestEmptyKeyPassesWhenAllowed(t *testing.T) {
	srv := redistest.Start(t)
	tester := serveCaddyfile(t, `
http://localhost:9080 {
	rate_limit 1 1 {
		key {http.request.header.X-Key}:{client_ip}
		deny_empty_key false
		redis %s
	}
	respond "ok"
}`, srv.Addr)

	for range 3 { // more than the burst: unlimited
		if resp, _ := get(t, tester, "/", ""); resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "" {
			t.Fatalf("no X-Key: %d, remaining %q; want 200 without bucket headers", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
		}
	}
}

func TestBurstZeroBlocksWithoutRedis(t *testing.T) {
	srv := redistest.Start(t)
	tester := serveCaddyfile(t, `
http://localhost:9080 {
	rate_limit {
		burst_capacity 0
		redis %s
	}
	respond "ok"
}`, srv.Addr)

	resp, _ := get(t, tester, "/", "")
	if resp.StatusCode != 429 {
		t.Fatalf("got %d, want 429", resp.StatusCode)
	}
	assertHeaders(t, resp, map[string]string{"X-RateLimit-Remaining": "0", "X-RateLimit-Burst-Capacity": "0", "Retry-After": ""})
	if calls := redistest.ScriptCalls(t, srv.Client(t)); calls != 0 {
		t.Fatalf("a hard block called Redis: %d script calls", calls)
	}
}

func TestZonesShareAndSeparateBuckets(t *testing.T) {
	srv := redistest.Start(t)
	// Two sites, as two Caddy instances would be: /a and /b share zone
	// "shared"; /c has the same parameters but a zone of its own.
	tester := serveCaddyfile(t, strings.ReplaceAll(`
http://localhost:9080 {
	handle /a {
		rate_limit 0.1 2 {
			zone shared
			key {http.request.header.X-Key}
			redis ADDR
		}
		respond "a"
	}
	handle /b {
		rate_limit 0.1 2 {
			zone shared
			key {http.request.header.X-Key}
			redis ADDR
		}
		respond "b"
	}
	handle /c {
		rate_limit 0.1 2 {
			zone other
			key {http.request.header.X-Key}
			redis ADDR
		}
		respond "c"
	}
}`, "ADDR", "%[1]s"), srv.Addr)

	for _, path := range []string{"/a", "/b"} {
		if resp, _ := get(t, tester, path, "dave"); resp.StatusCode != 200 {
			t.Fatalf("%s: %d, want 200", path, resp.StatusCode)
		}
	}
	if resp, _ := get(t, tester, "/a", "dave"); resp.StatusCode != 429 {
		t.Fatalf("/a after the shared burst: %d, want 429", resp.StatusCode)
	}
	if resp, _ := get(t, tester, "/c", "dave"); resp.StatusCode != 200 {
		t.Fatalf("/c in its own zone: %d, want 200", resp.StatusCode)
	}
}

func TestRedisStoppedFailsOpen(t *testing.T) {
	srv := redistest.Start(t)
	tester := serveCaddyfile(t, keyedSite, srv.Addr)

	if resp, _ := get(t, tester, "/", "erin"); resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "2" {
		t.Fatalf("before: %d remaining %q", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
	}
	srv.Stop(t)
	for range 10 { // past the breaker threshold: still served
		resp, body := get(t, tester, "/", "erin")
		if resp.StatusCode != 200 || body != "ok" {
			t.Fatalf("Redis down: %d %q, want 200 ok", resp.StatusCode, body)
		}
		assertHeaders(t, resp, map[string]string{"X-RateLimit-Remaining": "-1"})
	}
	srv.Restart(t)
	// The breaker probes again within its cooldown; limiting resumes
	// (the restarted Redis kept nothing, so the bucket starts full).
	eventually(t, 3*time.Second, "limiting resumes after the restart", func() bool {
		resp, _ := get(t, tester, "/", "erin")
		return resp.Header.Get("X-RateLimit-Remaining") == "2"
	})
}

func TestRedisStoppedDeniesWithOnErrorDeny(t *testing.T) {
	srv := redistest.Start(t)
	tester := serveCaddyfile(t, `
http://localhost:9080 {
	rate_limit 1 5 {
		key {http.request.header.X-Key}
		on_error deny
		redis %s
	}
	respond "ok"
}`, srv.Addr)

	if resp, _ := get(t, tester, "/", "frank"); resp.StatusCode != 200 {
		t.Fatalf("before: %d", resp.StatusCode)
	}
	srv.Stop(t)
	resp, _ := get(t, tester, "/", "frank")
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("Redis down with on_error deny: %d, want 503", resp.StatusCode)
	}
	assertHeaders(t, resp, map[string]string{"X-RateLimit-Remaining": "-1"})
}

func TestScriptFlushMidwayKeepsLimiting(t *testing.T) {
	srv := redistest.Start(t)
	tester := serveCaddyfile(t, keyedSite, srv.Addr)

	get(t, tester, "/", "gina")
	if err := srv.Client(t).ScriptFlush(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"1", "0"} {
		resp, _ := get(t, tester, "/", "gina")
		if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != want {
			t.Fatalf("after SCRIPT FLUSH: %d remaining %q, want 200 with %s", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), want)
		}
	}
	if resp, _ := get(t, tester, "/", "gina"); resp.StatusCode != 429 {
		t.Fatalf("after the burst: %d, want 429", resp.StatusCode)
	}
}

func TestCaddyStartsAndReloadsWhileRedisDown(t *testing.T) {
	srv := redistest.Start(t)
	srv.Stop(t) // a port where nothing listens
	for _, body := range []string{"ok", "reloaded"} {
		tester := serveCaddyfile(t, strings.Replace(keyedSite, `respond "ok"`, `respond "`+body+`"`, 1), srv.Addr)
		resp, got := get(t, tester, "/", "hank")
		if resp.StatusCode != 200 || got != body || resp.Header.Get("X-RateLimit-Remaining") != "-1" {
			t.Fatalf("got %d %q remaining %q, want 200 %q with -1", resp.StatusCode, got, resp.Header.Get("X-RateLimit-Remaining"), body)
		}
	}
}

func TestJSONConfigThroughAdminLoad(t *testing.T) {
	srv := redistest.Start(t)
	tester := loadConfig(t, nil, fmt.Sprintf(`{
	"admin": {"listen": "localhost:2999"},
	"apps": {"http": {"http_port": 9080, "grace_period": 1, "servers": {"srv0": {
		"listen": [":9080"],
		"routes": [{"handle": [
			{"handler": "rate_limit", "zone": "json", "key": "{http.request.header.X-Key}",
			 "replenish_rate": 1, "burst_capacity": 2, "redis": {"addresses": ["%s"]}},
			{"handler": "static_response", "body": "ok"}
		]}]
	}}}}
}`, srv.Addr), "json")
	for _, want := range []int{200, 200, 429} {
		if resp, _ := get(t, tester, "/", "ivy"); resp.StatusCode != want {
			t.Fatalf("got %d, want %d", resp.StatusCode, want)
		}
	}
}

func TestSameZoneDifferentKeyTemplatesKeepBucketsApart(t *testing.T) {
	srv := redistest.Start(t)
	// Route A keys on a header the client sets, route B on the address:
	// a client that sends its victim's address in the header must not
	// drain the victim's bucket on B.
	tester := loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(`
http://localhost:9080 {
	handle /a {
		rate_limit 0.01 2 {
			zone shared
			key {http.request.header.X-Key}
			redis %[1]s
		}
		respond "a"
	}
	handle /b {
		rate_limit 0.01 2 {
			zone shared
			redis %[1]s
		}
		respond "b"
	}
}`, srv.Addr))
	for i, want := range []int{200, 200, 429} {
		if resp, _ := get(t, tester, "/a", "127.0.0.1"); resp.StatusCode != want {
			t.Fatalf("/a with the victim's address in the header, request %d: %d, want %d", i+1, resp.StatusCode, want)
		}
	}
	for i, want := range []string{"1", "0"} {
		if resp, _ := get(t, tester, "/b", ""); resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != want {
			t.Fatalf("/b from 127.0.0.1, request %d: %d remaining %q, want 200 with %s (its own bucket, full)",
				i+1, resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), want)
		}
	}
}

// TestRedisErrorKeptOutOfErrorMessage: with on_error deny, a request
// while Redis fails gets 503; {http.error.message} (here the body,
// through handle_errors) says that Redis failed, not how: the cause names
// internal addresses. The warning in Caddy's log names it.
func TestRedisErrorKeptOutOfErrorMessage(t *testing.T) {
	proc := caddyproc.Start(t, loggingCaddyfile("DEBUG", fmt.Sprintf(`
http://127.0.0.1:{{http_port}} {
	rate_limit 10 20 {
		zone down
		key {header.X-Key}
		on_error deny
		redis %s {
			timeout 200ms
		}
	}
	respond "ok"
	handle_errors {
		respond "{err.message}" {err.status_code}
	}
}`, deadRedis)))
	resp, body := send(t, caddyClient(t), proc.URL, "X-Key", "k")
	if resp.StatusCode != 503 {
		t.Fatalf("Redis down, on_error deny: %d %q, want 503", resp.StatusCode, body)
	}
	if strings.Contains(body, deadRedis) || strings.Contains(body, "dial") || !strings.Contains(body, "Redis failed") {
		t.Errorf("{http.error.message} %q: want it to say Redis failed, without the address or the cause", body)
	}
	eventually(t, 5*time.Second, "the warning naming the cause", func() bool {
		return strings.Contains(grepLines(testproc.ReadFrom(proc.LogFile, 0), "Redis failed; following on_error"), deadRedis)
	})
}
