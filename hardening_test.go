package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
)

func TestBucketStoredInTheFutureRefillsFromNow(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 2 2 {\n\tzone clock\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\ttimeout 1s\n\t}\n}", srv.Addr))

	// An empty bucket stamped a minute ahead of Redis's clock, as after a
	// failover to a server whose clock is behind.
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	ahead := now.Add(time.Minute).UnixMicro()
	if err := rdb.Set(ctx, h.bucketPrefix+"skewed", "0 "+strconv.FormatInt(ahead, 10), time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	r, w := newRequest("192.0.2.1", http.Header{"X-Key": {"skewed"}})
	if status := statusOf(h.ServeHTTP(w, r, okHandler), w); status != 429 {
		t.Fatalf("empty bucket: %d, want 429", status)
	}
	retry, err := strconv.Atoi(w.Header().Get("Retry-After"))
	if err != nil || retry != 1 { // one token at 2 a second: half a second, rounded up
		t.Fatalf("Retry-After %q, want 1", w.Header().Get("Retry-After"))
	}
	time.Sleep(time.Duration(retry) * time.Second)
	if status, remaining, _ := hit(h, "skewed"); status != 200 {
		t.Fatalf("after the Retry-After it gave: %d remaining %q, want 200 (the bucket refills from now, not from a minute ahead)", status, remaining)
	}
}

func TestRedisPasswordWithBracesTakenLiterally(t *testing.T) {
	srv := redistest.Start(t)
	if err := srv.Client(t).ConfigSet(context.Background(), "requirepass", "ab{cd}efx").Err(); err != nil {
		t.Fatal(err)
	}
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 0.01 2 {\n\tzone braces\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\tpassword \"ab{cd}ef{env.NOT_SET_ANYWHERE}x\"\n\t\ttimeout 1s\n\t}\n}", srv.Addr))
	if got := h.Redis.withPlaceholders().Password; got != "ab{cd}efx" {
		// A known placeholder ({env.*}) is replaced, unknown braces stay.
		t.Fatalf("password resolved to %q, want %q", got, "ab{cd}efx")
	}
	expectBurstThenDeny(t, h, "k", 2)
}

func TestRedisSettingsReplaceOnlyKnownPlaceholders(t *testing.T) {
	t.Setenv("RL_TEST_SECRET", "s3cret")
	c := (&RedisConfig{
		Addresses: []string{"{env.RL_TEST_ADDR_UNSET}127.0.0.1:6380"},
		Password:  "{env.RL_TEST_SECRET}{literal}",
		Username:  "user{1}",
		KeyPrefix: "{app}:",
	}).withPlaceholders()
	for _, f := range []struct{ name, got, want string }{
		{"address", c.Addresses[0], "127.0.0.1:6380"},
		{"password", c.Password, "s3cret{literal}"},
		{"username", c.Username, "user{1}"},
		{"key_prefix", c.KeyPrefix, "{app}:"},
	} {
		if f.got != f.want {
			t.Errorf("%s: %q, want %q", f.name, f.got, f.want)
		}
	}
}

func TestOutageWithOnErrorDenyLogsAHandfulOfLines(t *testing.T) {
	srv := redistest.Start(t)
	logPath := filepath.Join(t.TempDir(), "caddy.log")
	tester := loadCaddyfile(t, nil, globalsWithLog(logPath, "INFO")+fmt.Sprintf(`
http://localhost:9080 {
	rate_limit 10 10 {
		zone outage-log
		key {http.request.header.X-Key}
		on_error deny
		redis %s
	}
	respond "ok"
}`, srv.Addr))
	startup := len(logLines(t, logPath))
	srv.Stop(t)
	for i := range 1000 {
		if resp, _ := get(t, tester, "/", "k"+strconv.Itoa(i%10)); resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("request %d during the outage: %d, want 503", i, resp.StatusCode)
		}
	}
	var loud []string
	for _, line := range logLines(t, logPath)[startup:] {
		if lvl, _ := line["level"].(string); lvl == "warn" || lvl == "error" {
			loud = append(loud, fmt.Sprint(line["logger"], ": ", line["msg"]))
		}
	}
	if len(loud) > 5 {
		t.Fatalf("%d lines at warn or above for 1000 requests during an outage, want a handful:\n%s", len(loud), strings.Join(loud, "\n"))
	}
	t.Logf("%d lines at warn or above: %v", len(loud), loud)
}

func TestLimitsThatCannotWorkRefusedAtLoad(t *testing.T) {
	for _, c := range []struct {
		name, caddyfile, json string
		want                  []string
	}{
		{"rate filling in more than a year", "rate_limit 1e-10 1000", `{"redis": {"addresses": ["127.0.0.1:1"]}, "replenish_rate": 1e-10, "burst_capacity": 1000}`,
			[]string{"replenish_rate '1e-10'", "more than a year", "at least"}},
		{"rate of 1e-300", "rate_limit 1e-300 1", `{"redis": {"addresses": ["127.0.0.1:1"]}, "replenish_rate": 1e-300, "burst_capacity": 1}`,
			[]string{"replenish_rate '1e-300'", "more than a year"}},
		{"burst above 2^53", "rate_limit 1e15 9007199254740993", `{"redis": {"addresses": ["127.0.0.1:1"]}, "replenish_rate": 1e15, "burst_capacity": 9007199254740993}`,
			[]string{"burst_capacity '9007199254740993'", "2^53"}},
		{"requested above burst above 2^53", "rate_limit 1 2 9007199254740993", `{"redis": {"addresses": ["127.0.0.1:1"]}, "replenish_rate": 1, "burst_capacity": 2, "requested_tokens": 9007199254740993}`,
			[]string{"requested_tokens '9007199254740993' is more than burst_capacity '2'"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseTestCaddyfile(c.caddyfile)
			if err == nil {
				t.Fatalf("Caddyfile %q accepted", c.caddyfile)
			}
			h := new(Handler)
			if jerr := json.Unmarshal([]byte(c.json), h); jerr != nil {
				t.Fatal(jerr)
			}
			jsonErr := provisionTestHandler(t, h)
			if jsonErr == nil {
				t.Fatalf("JSON %s accepted", c.json)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) || !strings.Contains(jsonErr.Error(), w) {
					t.Errorf("errors %q (Caddyfile) and %q (JSON) must both contain %q", err, jsonErr, w)
				}
			}
		})
	}
	// requested_tokens 0 written out is a mistake; absent, or 0 in JSON,
	// is the default.
	if _, err := parseTestCaddyfile("rate_limit 1 2 0"); err == nil || !strings.Contains(err.Error(), "requested_tokens '0' must be at least 1") {
		t.Errorf("inline requested_tokens 0: %v", err)
	}
	if _, err := parseTestCaddyfile("rate_limit 1 2 {\n\trequested_tokens 0\n}"); err == nil || !strings.Contains(err.Error(), "Testfile:2") {
		t.Errorf("requested_tokens 0: %v, want refused at line 2", err)
	}
	if err := provisionTestHandler(t, &Handler{ReplenishRate: 1, BurstCapacity: ptr(int64(2)), Redis: &RedisConfig{Addresses: []string{"127.0.0.1:1"}}}); err != nil {
		t.Errorf("JSON without requested_tokens: %v", err)
	}
	// The bounds themselves are accepted.
	for _, ok := range []string{"rate_limit 1000/8760h 1000", "rate_limit 1e9 9007199254740992"} {
		if _, err := parseTestCaddyfile(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
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

func TestDenyCacheReportsTheBucketAsItIsNow(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	// Each request costs the whole burst: after one, the bucket refills
	// for 2 s, and a denial is cached for that long.
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 2 4 4 {\n\tzone present\n\tkey {http.request.header.X-Key}\n\theaders both\n\tredis %s {\n\t\ttimeout 1s\n\t}\n}", srv.Addr))
	serve := func() http.Header {
		r, w := newRequest("192.0.2.1", http.Header{"X-Key": {"k"}})
		_ = h.ServeHTTP(w, r, okHandler)
		return w.Header()
	}
	serve()                                                      // takes all 4
	if got := serve().Get("X-RateLimit-Remaining"); got != "0" { // denied by Redis, and cached
		t.Fatalf("first denial: remaining %q, want 0", got)
	}
	calls := scriptCalls(t, rdb)
	time.Sleep(1100 * time.Millisecond) // 2.2 tokens back, 0.9 s to go
	hdr := serve()
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
