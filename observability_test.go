package ratelimit

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// Tests of what the limiter makes observable: Prometheus metrics on the
// admin endpoint, placeholders, the IETF headers, shadow mode and logs,
// all against a real redis-server and the in-process Caddy of caddytest.

// globalsWithLog is caddyGlobals plus a global log block: Caddy's own
// (default) log goes to logPath as JSON lines, from level up.
func globalsWithLog(logPath, level string) string {
	return strings.TrimSuffix(caddyGlobals, "}\n") + fmt.Sprintf(`	log {
		output file %s {
			roll_disabled
		}
		format json
		level %s
	}
}
`, logPath, level)
}

// metricsScrape is one scrape of the admin /metrics endpoint: the text
// and each sample by its series, as the text format writes it, e.g.
// `caddy_rate_limit_requests_total{result="allowed",zone="m1"}`.
type metricsScrape struct {
	text    string
	samples map[string]float64
}

func scrapeMetrics(t *testing.T) metricsScrape {
	t.Helper()
	return scrapeMetricsAt(t, caddytestAdmin)
}

// scrapeMetricsAt scrapes the admin endpoint at base (a caddyproc
// instance's).
func scrapeMetricsAt(t *testing.T, base string) metricsScrape {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatalf("scraping /metrics: %v", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading /metrics: %v", err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: status %d\n%s", resp.StatusCode, body)
	}
	s := metricsScrape{text: string(body), samples: map[string]float64{}}
	for _, line := range strings.Split(s.text, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if i < 0 || err != nil {
			t.Fatalf("/metrics: unparsable line %q", line)
		}
		s.samples[line[:i]] = v
	}
	return s
}

// requestsSeries names the requests counter of a zone and result.
func requestsSeries(zone, result string) string {
	return limitSeries(zone, result, "")
}

// limitSeries is requestsSeries for the named limit that refused.
func limitSeries(zone, result, limit string) string {
	return fmt.Sprintf(`caddy_rate_limit_requests_total{limit=%q,result=%q,zone=%q}`, limit, result, zone)
}

// assertDeltas checks that each series grew from before to after by
// exactly the wanted amount (counters are process-global: they survive
// reloads and -count repetitions, so only differences are asserted).
func assertDeltas(t *testing.T, before, after metricsScrape, want map[string]float64) {
	t.Helper()
	for series, d := range want {
		got, ok := after.samples[series]
		if !ok {
			t.Errorf("no series %s in /metrics", series)
			continue
		}
		if got-before.samples[series] != d {
			t.Errorf("%s: went from %v to %v, want +%v", series, before.samples[series], got, d)
		}
	}
}

// rateLimitHeaderNames lists the response's rate-limit headers of either
// set: X-RateLimit-* and RateLimit, RateLimit-Policy.
func rateLimitHeaderNames(resp *http.Response) []string {
	var names []string
	for name := range resp.Header {
		l := strings.ToLower(name)
		if strings.HasPrefix(l, "x-ratelimit") || strings.HasPrefix(l, "ratelimit") {
			names = append(names, name)
		}
	}
	return names
}

func springHeaderNames(resp *http.Response) []string {
	var names []string
	for _, n := range rateLimitHeaderNames(resp) {
		if strings.HasPrefix(strings.ToLower(n), "x-") {
			names = append(names, n)
		}
	}
	return names
}

// logLines reads a JSON-lines log file; a missing file is no lines.
func logLines(t *testing.T, path string) []map[string]any {
	t.Helper()
	raw, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var lines []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if len(bytes.TrimSpace(sc.Bytes())) == 0 {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("%s: not a JSON line: %q: %v", path, sc.Text(), err)
		}
		lines = append(lines, m)
	}
	return lines
}

// limiterLines are the lines of the rate_limit handler's logger.
func limiterLines(t *testing.T, path string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range logLines(t, path) {
		if l["logger"] == "http.handlers.rate_limit" {
			out = append(out, l)
		}
	}
	return out
}

func TestMetricsCountDecisionsRedisCallsAndBreakerPerZoneAcrossReloads(t *testing.T) {
	srv := redistest.Start(t)
	// /on counts in zone m1; /off has metrics off, in a zone no handler
	// with metrics ever uses, so none of its series may appear. The
	// generation only changes the body, so that each reload is a real
	// one (an identical config is not reloaded).
	config := func(generation int) string {
		return caddyGlobals + fmt.Sprintf(`
http://localhost:9080 {
	handle /on {
		rate_limit 0.1 3 {
			zone m1
			key {http.request.header.X-Key}
			redis %[1]s
		}
		respond "on %[2]d"
	}
	handle /off {
		rate_limit 0.1 3 {
			zone m1off
			key {http.request.header.X-Key}
			metrics off
			redis %[1]s
		}
		respond "off"
	}
}`, srv.Addr, generation)
	}
	const clientKey = "metrics-client-key-7f3a9c"
	allowed, denied := requestsSeries("m1", "allowed"), requestsSeries("m1", "denied")
	emptyKey, errorAllowed := requestsSeries("m1", "empty_key"), requestsSeries("m1", "error_allowed")
	const redisCalls = `caddy_rate_limit_redis_duration_seconds_count{zone="m1"}`
	const breakerOpen = `caddy_rate_limit_breaker_open{zone="m1"}`

	tester := loadCaddyfile(t, nil, config(0))
	before := scrapeMetrics(t)

	for i, want := range []int{200, 200, 200, 429, 429} {
		if resp, _ := get(t, tester, "/on", clientKey); resp.StatusCode != want {
			t.Fatalf("/on request %d: %d, want %d", i+1, resp.StatusCode, want)
		}
	}
	if resp, _ := get(t, tester, "/on", ""); resp.StatusCode != http.StatusForbidden {
		t.Fatalf("/on without a key: %d, want 403", resp.StatusCode)
	}
	for i, want := range []int{200, 200, 200, 429} {
		if resp, _ := get(t, tester, "/off", clientKey); resp.StatusCode != want {
			t.Fatalf("/off request %d: %d, want %d", i+1, resp.StatusCode, want)
		}
	}

	mid := scrapeMetrics(t)
	assertDeltas(t, before, mid, map[string]float64{
		allowed:                               3,
		denied:                                2,
		emptyKey:                              1,
		errorAllowed:                          0,
		requestsSeries("m1", "error_denied"):  0,
		requestsSeries("m1", "shadow_denied"): 0,
		// Three takes and the first denial asked Redis. The second
		// denial came within the first one's Retry-After, so the deny
		// cache answered it without Redis; the empty key never asks.
		redisCalls: 4,
	})
	if got := mid.samples[breakerOpen]; got != 0 {
		t.Errorf("%s = %v while Redis answers, want 0", breakerOpen, got)
	}
	if strings.Contains(mid.text, `zone="m1off"`) {
		t.Errorf("metrics off, yet /metrics has series of zone m1off:\n%s", grepLines(mid.text, "m1off"))
	}
	if strings.Contains(mid.text, clientKey) {
		t.Errorf("a client key is in /metrics:\n%s", grepLines(mid.text, clientKey))
	}
	assertNoLabelValue(t, mid.text, clientKey)

	// Redis down: every request still passes (on_error allow), each an
	// error_allowed. The first five fail at Redis and open the breaker;
	// later ones skip Redis, unless its 500 ms cooldown passed and one
	// probed (and failed) again.
	srv.Stop(t)
	const down = 7
	for i := range down {
		if resp, body := get(t, tester, "/on", "metrics-other-key"); resp.StatusCode != 200 || body != "on 0" {
			t.Fatalf("Redis down, request %d: %d %q, want 200 \"on 0\"", i+1, resp.StatusCode, body)
		}
	}
	outage := scrapeMetrics(t)
	assertDeltas(t, mid, outage, map[string]float64{allowed: 0, denied: 0, errorAllowed: down})
	if got := outage.samples[breakerOpen]; got != 1 {
		t.Errorf("%s = %v after %d failures in a row, want 1", breakerOpen, got, down)
	}
	if calls := outage.samples[redisCalls] - mid.samples[redisCalls]; calls < redisbatch.BreakerThreshold || calls > down {
		t.Errorf("Redis calls during the outage: %v, want %d (breaker threshold) to %d", calls, redisbatch.BreakerThreshold, down)
	}

	// Two reloads with Redis back: the scrape still works (the
	// collectors are registered on each new config's registry), counts
	// carry on from where they were, and the node's breaker, which
	// belongs to the shared client and so outlives the reload, closes on
	// the first answer: the first request after its cooldown probes.
	srv.Restart(t)
	time.Sleep(redisbatch.BreakerCooldown)
	last := outage
	for generation := 1; generation <= 2; generation++ {
		loadCaddyfile(t, tester, config(generation))
		reloaded := scrapeMetrics(t)
		assertDeltas(t, last, reloaded, map[string]float64{allowed: 0, denied: 0, emptyKey: 0, errorAllowed: 0})
		key := fmt.Sprintf("metrics-reload-key-%d", generation)
		if resp, body := get(t, tester, "/on", key); resp.StatusCode != 200 || body != fmt.Sprintf("on %d", generation) {
			t.Fatalf("reload %d: %d %q", generation, resp.StatusCode, body)
		}
		after := scrapeMetrics(t)
		assertDeltas(t, reloaded, after, map[string]float64{allowed: 1, redisCalls: 1})
		if got := after.samples[breakerOpen]; got != 0 {
			t.Errorf("reload %d: %s = %v after Redis answered, want 0", generation, breakerOpen, got)
		}
		if strings.Contains(after.text, `zone="m1off"`) {
			t.Errorf("reload %d: series of zone m1off appeared", generation)
		}
		last = after
	}
	if total := last.samples[allowed] - before.samples[allowed]; total != 5 {
		t.Errorf("allowed over the whole test: +%v, want +5 (3 before the outage, 1 after each reload)", total)
	}
}

// assertNoLabelValue checks every label value of the rate-limit series.
func assertNoLabelValue(t *testing.T, text, value string) {
	t.Helper()
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, "caddy_rate_limit_") {
			continue
		}
		open, end := strings.IndexByte(line, '{'), strings.LastIndexByte(line, '}')
		if open < 0 || end < open {
			continue
		}
		for _, pair := range strings.Split(line[open+1:end], ",") {
			if _, v, _ := strings.Cut(pair, "="); strings.Trim(v, `"`) == value {
				t.Errorf("label value %q in %s", value, line)
			}
		}
	}
}

func grepLines(text, substr string) string {
	var out []string
	for _, line := range strings.Split(text, "\n") {
		if strings.Contains(line, substr) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}

func TestPlaceholdersInHandleErrorsRespondAndAccessLog(t *testing.T) {
	srv := redistest.Start(t)
	accessLog := filepath.Join(t.TempDir(), "access.log")
	// log_append sorts before rate_limit, so it wraps it; without `<` it
	// reads its value after the rest of the chain (rate_limit included)
	// returned, also when that returned the 429. With `<` it reads it
	// before rate_limit ran: nothing yet.
	tester := loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(`
http://localhost:9080 {
	log {
		output file %[2]s {
			roll_disabled
		}
		format json
	}
	log_append rate_limit_result {http.rate_limit.result}
	log_append <rate_limit_result_early {http.rate_limit.result}
	handle /plain {
		rate_limit 0.5 2 {
			zone ph
			key {http.request.header.X-Key}
			redis %[1]s
		}
		respond "{http.rate_limit.result} {http.rate_limit.remaining} [{http.rate_limit.key}]"
	}
	handle /logkey {
		rate_limit 0.5 2 {
			zone phkey
			key {http.request.header.X-Key}
			log_key
			redis %[1]s
		}
		respond "{http.rate_limit.zone} {http.rate_limit.limit} [{http.rate_limit.key}]"
	}
	handle_errors {
		respond "{http.rate_limit.zone} {http.rate_limit.result} {http.rate_limit.remaining} {http.rate_limit.limit} {http.rate_limit.retry_after}" {err.status_code}
	}
}`, srv.Addr, accessLog))

	// Without log_key the key placeholder is empty, not the key.
	for i, want := range []string{"allowed 1 []", "allowed 0 []"} {
		if resp, body := get(t, tester, "/plain", "alice"); resp.StatusCode != 200 || body != want {
			t.Fatalf("/plain request %d: %d %q, want 200 %q", i+1, resp.StatusCode, body, want)
		}
	}
	// One token at 0.5/s is 2 s away, less the few ms since the burst.
	resp, body := get(t, tester, "/plain", "alice")
	if resp.StatusCode != 429 || body != "ph denied 0 2 2" {
		t.Fatalf("/plain denied: %d %q, want 429 %q", resp.StatusCode, body, "ph denied 0 2 2")
	}
	if ra := resp.Header.Get("Retry-After"); !strings.HasSuffix(body, " "+ra) {
		t.Errorf("{http.rate_limit.retry_after} in %q is not Retry-After %q", body, ra)
	}
	// With log_key it is the client's key, without the Redis prefix.
	if resp, body := get(t, tester, "/logkey", "bob"); resp.StatusCode != 200 || body != "phkey 2 [bob]" {
		t.Fatalf("/logkey: %d %q, want 200 %q", resp.StatusCode, body, "phkey 2 [bob]")
	}

	type entry struct {
		uri    string
		status float64
		result any
		early  any
	}
	var entries []entry
	// The access log is written once the request is done, which may be
	// just after the client has read the response.
	eventually(t, 3*time.Second, "the access log has the four requests", func() bool {
		entries = entries[:0]
		for _, l := range logLines(t, accessLog) {
			req, _ := l["request"].(map[string]any)
			status, _ := l["status"].(float64)
			entries = append(entries, entry{uri: fmt.Sprint(req["uri"]), status: status,
				result: l["rate_limit_result"], early: l["rate_limit_result_early"]})
		}
		return len(entries) >= 4
	})
	want := []struct {
		uri    string
		status float64
		result string
	}{{"/plain", 200, "allowed"}, {"/plain", 200, "allowed"}, {"/plain", 429, "denied"}, {"/logkey", 200, "allowed"}}
	if len(entries) != len(want) {
		t.Fatalf("access log has %d entries, want %d: %+v", len(entries), len(want), entries)
	}
	for i, w := range want {
		e := entries[i]
		if e.uri != w.uri || e.status != w.status || e.result != w.result {
			t.Errorf("access log entry %d: uri %s status %v rate_limit_result %v; want %s %v %q",
				i+1, e.uri, e.status, e.result, w.uri, w.status, w.result)
		}
		if e.early != nil {
			t.Errorf("access log entry %d: rate_limit_result_early %v; an early log_append runs before rate_limit, want null", i+1, e.early)
		}
	}
}

func TestIETFHeadersExactAndHeaderStyles(t *testing.T) {
	srv := redistest.Start(t)
	site := func(path, zone, option string) string {
		return fmt.Sprintf(`
	handle %s {
		rate_limit 0.5 3 {
			zone %s
			key {http.request.header.X-Key}
			%s
			redis ADDR
		}
		respond "ok"
	}`, path, zone, option)
	}
	config := "\nhttp://localhost:9080 {" +
		site("/ietf", "z", "headers ietf") +
		site("/both", "zb", "headers both") +
		site("/none", "zn", "headers none") +
		site("/off", "zo", "include_headers false") + "\n}"
	tester := serveCaddyfile(t, strings.ReplaceAll(config, "ADDR", "%[1]s"), srv.Addr)

	t.Run("ietf", func(t *testing.T) {
		// w: a bucket of 3 refills at 0.5/s in ceil(3/0.5) = 6 s. t is 0
		// while a token is left, then the wait for the next token: 1 at
		// 0.5/s, 2 s less a few ms, rounded up.
		for i, rl := range []string{`"z";r=2;t=0`, `"z";r=1;t=0`, `"z";r=0;t=2`} {
			resp, _ := get(t, tester, "/ietf", "ivan")
			if resp.StatusCode != 200 {
				t.Fatalf("request %d: %d, want 200", i+1, resp.StatusCode)
			}
			assertHeaders(t, resp, map[string]string{"RateLimit-Policy": `"z";q=3;w=6`, "RateLimit": rl, "Retry-After": ""})
			if n := springHeaderNames(resp); len(n) != 0 {
				t.Errorf("request %d: headers ietf sent %v", i+1, n)
			}
		}
		// The first denial asks Redis, the second is answered by the deny
		// cache: in both t is exactly Retry-After.
		for i := range 2 {
			resp, _ := get(t, tester, "/ietf", "ivan")
			if resp.StatusCode != 429 {
				t.Fatalf("denial %d: %d, want 429", i+1, resp.StatusCode)
			}
			ra := resp.Header.Get("Retry-After")
			if n, err := strconv.Atoi(ra); err != nil || n < 1 || n > 2 {
				t.Fatalf("denial %d: Retry-After %q, want 1 or 2", i+1, ra)
			}
			assertHeaders(t, resp, map[string]string{"RateLimit-Policy": `"z";q=3;w=6`, "RateLimit": `"z";r=0;t=` + ra})
			if n := springHeaderNames(resp); len(n) != 0 {
				t.Errorf("denial %d: headers ietf sent %v", i+1, n)
			}
		}
		resp, _ := get(t, tester, "/ietf", "")
		if resp.StatusCode != 403 {
			t.Fatalf("empty key: %d, want 403", resp.StatusCode)
		}
		if n := rateLimitHeaderNames(resp); len(n) != 0 || resp.Header.Get("Retry-After") != "" {
			t.Errorf("empty key 403 has rate-limit headers %v, Retry-After %q", n, resp.Header.Get("Retry-After"))
		}
	})

	t.Run("both", func(t *testing.T) {
		resp, _ := get(t, tester, "/both", "judy")
		if resp.StatusCode != 200 {
			t.Fatalf("%d, want 200", resp.StatusCode)
		}
		assertHeaders(t, resp, map[string]string{
			"X-RateLimit-Remaining":        "2",
			"X-RateLimit-Replenish-Rate":   "0.5",
			"X-RateLimit-Burst-Capacity":   "3",
			"X-RateLimit-Requested-Tokens": "1",
			"RateLimit-Policy":             `"zb";q=3;w=6`,
			"RateLimit":                    `"zb";r=2;t=0`,
		})
		get(t, tester, "/both", "judy")
		get(t, tester, "/both", "judy")
		resp, _ = get(t, tester, "/both", "judy")
		ra := resp.Header.Get("Retry-After")
		if resp.StatusCode != 429 || ra == "" {
			t.Fatalf("4th: %d Retry-After %q, want 429 with Retry-After", resp.StatusCode, ra)
		}
		assertHeaders(t, resp, map[string]string{"X-RateLimit-Remaining": "0", "RateLimit": `"zb";r=0;t=` + ra})
		resp, _ = get(t, tester, "/both", "")
		if n := rateLimitHeaderNames(resp); resp.StatusCode != 403 || len(n) != 0 {
			t.Errorf("empty key: %d with rate-limit headers %v, want 403 without", resp.StatusCode, n)
		}
	})

	for _, path := range []string{"/none", "/off"} {
		t.Run(path[1:], func(t *testing.T) {
			for i, want := range []int{200, 200, 200, 429} {
				resp, _ := get(t, tester, path, "kim")
				if resp.StatusCode != want {
					t.Fatalf("request %d: %d, want %d", i+1, resp.StatusCode, want)
				}
				if n := rateLimitHeaderNames(resp); len(n) != 0 {
					t.Errorf("request %d: rate-limit headers %v, want none", i+1, n)
				}
				if ra := resp.Header.Get("Retry-After"); (want == 429) != (ra != "") {
					t.Errorf("request %d (%d): Retry-After %q; want it on the 429 only", i+1, want, ra)
				}
			}
		})
	}

	// Without an answer from Redis there is no bucket to describe: the
	// IETF fields are left out, the Spring set says -1.
	t.Run("redis_down", func(t *testing.T) {
		srv.Stop(t)
		resp, _ := get(t, tester, "/ietf", "liam")
		if n := rateLimitHeaderNames(resp); resp.StatusCode != 200 || len(n) != 0 {
			t.Errorf("/ietf: %d with rate-limit headers %v, want 200 without", resp.StatusCode, n)
		}
		resp, _ = get(t, tester, "/both", "liam")
		if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "-1" ||
			resp.Header.Get("RateLimit") != "" || resp.Header.Get("RateLimit-Policy") != "" {
			t.Errorf("/both: %d, X-RateLimit-Remaining %q, RateLimit %q, RateLimit-Policy %q; want 200, -1 and no IETF fields",
				resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), resp.Header.Get("RateLimit"), resp.Header.Get("RateLimit-Policy"))
		}
	})
}

func TestShadowNeverDeniesHidesHeadersCountsAndLogsOncePerKey(t *testing.T) {
	srv := redistest.Start(t)
	caddyLog := filepath.Join(t.TempDir(), "caddy.log")
	tester := loadCaddyfile(t, nil, globalsWithLog(caddyLog, "INFO")+fmt.Sprintf(`
http://localhost:9080 {
	rate_limit 0.1 2 {
		zone sh1
		key {http.request.header.X-Key}
		shadow
		redis %s
	}
	respond "{http.rate_limit.result}"
}`, srv.Addr))

	before := scrapeMetrics(t)
	start := time.Now()
	send := func(key string, results ...string) {
		t.Helper()
		for i, want := range results {
			resp, body := get(t, tester, "/", key)
			if resp.StatusCode != 200 || body != want {
				t.Fatalf("%s request %d: %d %q, want 200 %q", key, i+1, resp.StatusCode, body, want)
			}
			if n := rateLimitHeaderNames(resp); len(n) != 0 || resp.Header.Get("Retry-After") != "" {
				t.Errorf("%s request %d: rate-limit headers %v, Retry-After %q; shadow mode sends none",
					key, i+1, n, resp.Header.Get("Retry-After"))
			}
		}
	}
	send("lena", "allowed", "allowed", "shadow_denied", "shadow_denied", "shadow_denied")
	assertDeltas(t, before, scrapeMetrics(t), map[string]float64{
		requestsSeries("sh1", "allowed"):       2,
		requestsSeries("sh1", "shadow_denied"): 3,
		requestsSeries("sh1", "denied"):        0,
	})
	// Five shadow denials of lena in all, one of mona: one line per key.
	send("lena", "shadow_denied", "shadow_denied")
	send("mona", "allowed", "allowed", "shadow_denied")
	elapsed := time.Since(start)

	var shadowLines []map[string]any
	for _, l := range limiterLines(t, caddyLog) {
		switch l["level"] {
		case "info":
			if l["msg"] == "shadow mode: request would be rate limited" {
				shadowLines = append(shadowLines, l)
				continue
			}
		case "debug":
			t.Errorf("a debug line in an INFO log: %v", l)
		}
		t.Errorf("unexpected line from the limiter: %v", l)
	}
	if elapsed >= shadowLogEvery {
		t.Logf("the requests took %v, more than the %v between shadow lines of a key", elapsed, shadowLogEvery)
	} else if len(shadowLines) != 2 {
		t.Errorf("%d shadow lines, want 2 (one per key within %v): %v", len(shadowLines), shadowLogEvery, shadowLines)
	}
	for _, l := range shadowLines {
		if l["zone"] != "sh1" || l["remaining"] != 0.0 {
			t.Errorf("shadow line: zone %v remaining %v, want sh1 0: %v", l["zone"], l["remaining"], l)
		}
		if ra, _ := l["retry_after"].(float64); ra < 1 || ra > 10 {
			t.Errorf("shadow line: retry_after %v, want 1 to 10 s: %v", l["retry_after"], l)
		}
		if _, has := l["key"]; has {
			t.Errorf("shadow line has the key without log_key: %v", l)
		}
	}
}

func TestDebugLogOneDecisionLinePerRequestKeyOnlyWithLogKey(t *testing.T) {
	srv := redistest.Start(t)
	caddyLog := filepath.Join(t.TempDir(), "caddy.log")
	tester := loadCaddyfile(t, nil, globalsWithLog(caddyLog, "DEBUG")+fmt.Sprintf(`
http://localhost:9080 {
	handle /plain {
		rate_limit 0.1 2 {
			zone lg
			key {http.request.header.X-Key}
			redis %[1]s
		}
		respond "ok"
	}
	handle /logkey {
		rate_limit 0.1 2 {
			zone lgk
			key {http.request.header.X-Key}
			log_key
			redis %[1]s
		}
		respond "ok"
	}
}`, srv.Addr))

	type decision struct {
		zone, result string
		remaining    float64
	}
	// Two takes, a denial from Redis, one from the deny cache, an empty
	// key; then with log_key a take and an empty key.
	requests := []struct {
		path, key string
		status    int
		want      decision
	}{
		{"/plain", "nora", 200, decision{"lg", "allowed", 1}},
		{"/plain", "nora", 200, decision{"lg", "allowed", 0}},
		{"/plain", "nora", 429, decision{"lg", "denied", 0}},
		{"/plain", "nora", 429, decision{"lg", "denied", 0}},
		{"/plain", "", 403, decision{"lg", "empty_key", -1}}, // no bucket: no remaining
		{"/logkey", "oscar", 200, decision{"lgk", "allowed", 1}},
		{"/logkey", "", 403, decision{"lgk", "empty_key", -1}},
	}
	for i, r := range requests {
		if resp, _ := get(t, tester, r.path, r.key); resp.StatusCode != r.status {
			t.Fatalf("request %d (%s %q): %d, want %d", i+1, r.path, r.key, resp.StatusCode, r.status)
		}
	}

	var decisions []map[string]any
	for _, l := range limiterLines(t, caddyLog) {
		if l["level"] != "debug" {
			t.Errorf("a %v line from the limiter during normal traffic: %v", l["level"], l)
			continue
		}
		if l["msg"] == "rate limit decision" {
			decisions = append(decisions, l)
		}
	}
	if len(decisions) != len(requests) {
		t.Fatalf("%d decision lines, want %d (one per request): %v", len(decisions), len(requests), decisions)
	}
	for i, r := range requests {
		l := decisions[i]
		got := decision{fmt.Sprint(l["zone"]), fmt.Sprint(l["result"]), -1}
		if rem, ok := l["remaining"].(float64); ok {
			got.remaining = rem
		}
		if got != r.want {
			t.Errorf("decision %d: %+v, want %+v: %v", i+1, got, r.want, l)
		}
		key, hasKey := l["key"]
		switch {
		case r.path == "/plain" && hasKey:
			t.Errorf("decision %d: key %v logged without log_key", i+1, key)
		case r.path == "/logkey" && r.key != "" && key != r.key:
			t.Errorf("decision %d: key %v, want %q with log_key", i+1, key, r.key)
		case r.path == "/logkey" && r.key == "" && hasKey && key != "":
			t.Errorf("decision %d: key %v for an empty key", i+1, key)
		}
	}
}
