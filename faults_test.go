package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// stallBound is how long a request may take while Redis does not answer
// within the 100ms timeout: what tells a timeout that holds from one that
// does not (the request would then wait out the 2 s stall, or forever on
// a blackhole), with room for a bad moment of a loaded two-core machine
// under -race.
const stallBound = time.Second

// openBreaker sends requests to a Redis that does not answer until the
// breaker opens, then checks that requests skip Redis. Every request is
// admitted (on_error allow) with remaining -1.
func openBreaker(t *testing.T, h *Handler) {
	t.Helper()
	opened := false
	for i := 1; i <= 10 && !opened; i++ {
		status, remaining, took := hit(h, "stalled")
		if status != 200 || remaining != "-1" {
			t.Fatalf("request %d to a stalled Redis: %d remaining %q, want 200 with -1", i, status, remaining)
		}
		if took > stallBound {
			t.Errorf("request %d to a stalled Redis took %v, more than %v (timeout 100ms)", i, took, stallBound)
		}
		if opened = standaloneBreakerOpen(h); opened {
			t.Logf("breaker opened after %d failed requests", i)
		}
	}
	if !opened {
		t.Fatal("breaker still closed after 10 failed requests")
	}
	// The next probe is redisbatch.BreakerCooldown (500ms) away: these skip Redis,
	// but for one probe per cooldown that passes meanwhile (on a loaded
	// machine, 20 requests can take longer than one). The Redis step
	// counts the requests that asked Redis.
	asked, start := redisCalls(t, h), time.Now()
	for i := 1; i <= 20; i++ {
		status, remaining, _ := hit(h, "stalled")
		if status != 200 || remaining != "-1" {
			t.Fatalf("request %d with the breaker open: %d remaining %q, want 200 with -1", i, status, remaining)
		}
	}
	elapsed := time.Since(start)
	if n, probes := redisCalls(t, h)-asked, uint64(elapsed/redisbatch.BreakerCooldown)+1; n > probes {
		t.Errorf("%d of 20 requests with the breaker open asked Redis in %v, want at most %d (a probe per cooldown)", n, elapsed, probes)
	}
}

// stallDirective has the default timeout, which stallBound is made for.
const stallDirective = `rate_limit 0.01 2 {
	zone %s
	key {http.request.header.X-Key}
	redis %s {
		timeout 100ms
	}
}`

func TestRedisStallOpensAndClosesBreaker(t *testing.T) {
	srv := redistest.Start(t)
	h := caddyfileHandler(t, fmt.Sprintf(stallDirective, "stall", srv.Addr))
	logs := observeLogs(h, zap.DebugLevel)
	if status, remaining, _ := hit(h, "warm"); status != 200 || remaining != "1" {
		t.Fatalf("before the stall: %d remaining %q", status, remaining)
	}

	// DEBUG SLEEP blocks the server (not just a connection) for 2 s.
	sleeper := redis.NewClient(&redis.Options{Addr: srv.Addr, ReadTimeout: 10 * time.Second, MaxRetries: -1})
	defer sleeper.Close()
	slept := make(chan error, 1)
	go func() { slept <- sleeper.Do(context.Background(), "DEBUG", "SLEEP", "2").Err() }()
	probe := redis.NewClient(&redis.Options{Addr: srv.Addr, ReadTimeout: 30 * time.Millisecond, MaxRetries: -1, PoolSize: 1})
	defer probe.Close()
	eventually(t, time.Second, "Redis stalls", func() bool {
		return probe.Ping(context.Background()).Err() != nil
	})

	openBreaker(t, h)

	// Until the stall ends, every cooldown's probe fails and the breaker
	// stays open; requests keep following on_error without waiting long.
	for stalled := true; stalled; {
		select {
		case err := <-slept:
			if err != nil {
				t.Fatalf("DEBUG SLEEP: %v", err)
			}
			stalled = false
		case <-time.After(20 * time.Millisecond):
			status, remaining, took := hit(h, "stalled")
			if status != 200 || remaining != "-1" || took > stallBound {
				t.Fatalf("during the stall: %d remaining %q in %v, want 200 with -1 within %v", status, remaining, took, stallBound)
			}
		}
	}
	took := eventually(t, 5*time.Second, "limiting resumes after the stall", func() bool {
		status, remaining, _ := hit(h, "after")
		return status == 200 && remaining != "-1"
	})
	t.Logf("limiting resumed %v after the stall ended", took.Round(time.Millisecond))
	if standaloneBreakerOpen(h) {
		t.Fatal("breaker still open after Redis answered")
	}
	if n := countLogs(logs, "circuit breaker opened"); n != 1 {
		t.Errorf("logged 'circuit breaker opened' %d times, want once", n)
	}
	if n := countLogs(logs, "circuit breaker closed"); n != 1 {
		t.Errorf("logged 'circuit breaker closed' %d times, want once", n)
	}
}

func TestRedisBlackholeOpensBreaker(t *testing.T) {
	addr := redistest.StartBlackhole(t)
	h := caddyfileHandler(t, fmt.Sprintf(stallDirective, "blackhole", addr))
	logs := observeLogs(h, zap.DebugLevel)

	openBreaker(t, h)
	// After the cooldown one request probes, fails within the timeout,
	// and the breaker stays open.
	time.Sleep(redisbatch.BreakerCooldown + 50*time.Millisecond)
	if status, remaining, took := hit(h, "stalled"); status != 200 || remaining != "-1" || took > stallBound {
		t.Fatalf("probe: %d remaining %q in %v, want 200 with -1 within %v", status, remaining, took, stallBound)
	}
	if !standaloneBreakerOpen(h) {
		t.Fatal("breaker closed after a failed probe")
	}

	if n := countLogs(logs, "circuit breaker opened"); n != 1 {
		t.Errorf("logged 'circuit breaker opened' %d times, want once", n)
	}
	if n := countLogs(logs, "circuit breaker closed"); n != 0 {
		t.Errorf("logged 'circuit breaker closed' %d times, want never", n)
	}
	warned := logs.FilterMessageSnippet("following on_error").All()
	if len(warned) != 1 {
		t.Fatalf("logged 'Redis failed; following on_error' %d times, want once (throttled)", len(warned))
	}
	if err := fmt.Sprint(warned[0].ContextMap()["error"]); !strings.Contains(err, "timeout") && !strings.Contains(err, "deadline") {
		t.Errorf("the warning does not say Redis timed out: %q", err)
	}
}

func TestCanceledRequestsDoNotTripBreaker(t *testing.T) {
	addr := redistest.StartBlackhole(t)
	// A timeout far longer than the clients wait, so that they are gone
	// before it ends even on a loaded machine.
	const timeout = 2 * time.Second
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 0.01 2 {\n\tzone canceled\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\ttimeout %v\n\t}\n}", addr, timeout))
	logs := observeLogs(h, zap.DebugLevel)

	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(10*time.Millisecond, cancel) // mid-flight
			status, remaining, took := hitCtx(ctx, h, fmt.Sprint("gone-", i))
			if status != 499 {
				t.Errorf("canceled request %d: %d remaining %q, want 499 (client gone)", i, status, remaining)
			}
			if took > timeout+stallBound {
				t.Errorf("canceled request %d took %v, more than its %v timeout", i, took, timeout)
			}
		}()
	}
	wg.Wait()
	// Let abandoned calls finish in the batcher: they must not count either.
	time.Sleep(timeout + 100*time.Millisecond)
	// (That their calls count no failure toward it is the batcher's
	// TestCallsWhoseClientsLeftCountNoFailure.)
	if standaloneBreakerOpen(h) {
		t.Fatal("breaker open after canceled requests; a client going away is no Redis failure")
	}
	if n := logs.FilterLevelExact(zap.WarnLevel).Len(); n != 0 {
		t.Fatalf("%d warnings for canceled requests: %v", n, logs.All())
	}
}

const restartSite = `
http://127.0.0.1:{{http_port}} {
	rate_limit 0.01 3 {
		zone restarts
		key {http.request.header.X-Key}
		redis %s
	}
	respond "ok"
}`

func TestRedisRestartAndFlushesKeepLimiting(t *testing.T) {
	srv := redistest.Start(t)
	inst := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(restartSite, srv.Addr)))
	pid := inst.PID()
	client := caddyClient(t)
	rdb := srv.Client(t)
	ctx := context.Background()

	expectCaddyBurstThenDeny(t, client, inst.URL, "before", 3)
	if status, remaining := mustGet(t, client, inst.URL, "partial"); status != 200 || remaining != "2" {
		t.Fatalf("partial: %d remaining %q, want 200 with 2", status, remaining)
	}

	// Restart on the same port: the buckets and the script cache are gone.
	srv.Stop(t)
	for i := range 10 {
		if status, remaining := mustGet(t, client, inst.URL, "down"); status != 200 || remaining != "-1" {
			t.Fatalf("request %d while Redis is down: %d remaining %q, want 200 with -1", i, status, remaining)
		}
	}
	srv.Restart(t)
	probes := 0
	took := eventually(t, 10*time.Second, "limiting resumes after the restart", func() bool {
		probes++
		status, remaining := mustGet(t, client, inst.URL, fmt.Sprint("probe", probes))
		if status >= 500 {
			t.Fatalf("status %d after the restart", status)
		}
		return remaining != "-1"
	})
	t.Logf("limiting resumed %v after the restart", took.Round(time.Millisecond))
	expectCaddyBurstThenDeny(t, client, inst.URL, "down", 3)
	// An empty Redis: the bucket that had two tokens left is full again.
	expectCaddyBurstThenDeny(t, client, inst.URL, "partial", 3)

	// SCRIPT FLUSH: the script is sent again, invisibly, and the bucket is kept.
	if status, remaining := mustGet(t, client, inst.URL, "flush"); status != 200 || remaining != "2" {
		t.Fatalf("flush: %d remaining %q", status, remaining)
	}
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"1", "0"} {
		if status, remaining := mustGet(t, client, inst.URL, "flush"); status != 200 || remaining != want {
			t.Fatalf("after SCRIPT FLUSH: %d remaining %q, want 200 with %s", status, remaining, want)
		}
	}
	if status, remaining := mustGet(t, client, inst.URL, "flush"); status != 429 {
		t.Fatalf("after SCRIPT FLUSH and the burst: %d remaining %q, want 429", status, remaining)
	}

	// FLUSHALL empties the buckets: full again, then limited.
	if status, remaining := mustGet(t, client, inst.URL, "flushall"); status != 200 || remaining != "2" {
		t.Fatalf("flushall: %d remaining %q, want 200 with 2", status, remaining)
	}
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	expectCaddyBurstThenDeny(t, client, inst.URL, "flushall", 3)
	// A bucket denied before the flush stays denied from the deny cache
	// for the Retry-After its client was given (documented in denycache.go).
	status, remaining := mustGet(t, client, inst.URL, "flush")
	t.Logf("a key denied before FLUSHALL, right after it: %d remaining %s", status, remaining)

	if inst.PID() != pid {
		t.Fatalf("Caddy was restarted (pid %d, then %d)", pid, inst.PID())
	}
}

const refusedSite = `
http://127.0.0.1:{{http_port}} {
	handle /allow {
		rate_limit 1 5 {
			zone refused-allow
			key {http.request.header.X-Key}
			on_error allow
			redis %[1]s
		}
		respond "ok"
	}
	handle /deny {
		rate_limit 1 5 {
			zone refused-deny
			key {http.request.header.X-Key}
			on_error deny
			redis %[1]s
		}
		respond "ok"
	}
}`

// expectRefused asserts that Redis refusing the write is handled as a
// Redis failure, and that the logged warning names the reason.
func expectRefused(t *testing.T, redisAddr, reason string) {
	t.Helper()
	inst := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(refusedSite, redisAddr)))
	client := caddyClient(t)
	for range 3 {
		if status, remaining := mustGet(t, client, inst.URL+"/allow", "w"); status != 200 || remaining != "-1" {
			t.Fatalf("/allow: %d remaining %q, want 200 with -1", status, remaining)
		}
		if status, remaining := mustGet(t, client, inst.URL+"/deny", "w"); status != 503 || remaining != "-1" {
			t.Fatalf("/deny: %d remaining %q, want 503 with -1", status, remaining)
		}
	}
	var warnings int
	for _, line := range strings.Split(inst.LogTail(1000), "\n") {
		if strings.Contains(line, "Redis failed") {
			warnings++
			if !strings.Contains(line, reason) {
				t.Errorf("the warning does not mention %s:\n%s", reason, line)
			}
		}
	}
	if warnings != 2 { // one per handler: throttled
		t.Errorf("%d 'Redis failed' warnings, want 2 (one per handler)\n%s", warnings, inst.LogTail(40))
	}
}

func TestReadOnlyReplicaIsRedisFailure(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.Start(t, "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	expectRefused(t, replica.Addr, "READONLY")
}

func TestOutOfMemoryIsRedisFailure(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
	rdb := srv.Client(t)
	ctx := context.Background()
	// Writes are refused while used memory exceeds maxmemory. A 4 MB value
	// keeps it far above 1 MB; it goes in with the limit lifted, since its
	// own query buffer would otherwise trip it, and the limit comes back.
	for _, step := range [][]any{
		{"CONFIG", "SET", "maxmemory", "0"},
		{"SET", "ballast", strings.Repeat("x", 4<<20)},
		{"CONFIG", "SET", "maxmemory", "1mb"},
	} {
		if err := rdb.Do(ctx, step...).Err(); err != nil {
			t.Fatalf("%v: %v", step[:2], err)
		}
	}
	if err := rdb.Set(ctx, "more", "x", 0).Err(); err == nil || !strings.HasPrefix(err.Error(), "OOM") {
		t.Fatalf("Redis still takes writes (%v); the test needs it full", err)
	}
	expectRefused(t, srv.Addr, "OOM")
}

// standaloneBreakerOpen says whether the breaker of the one Redis node h
// uses is open, as the breaker_open gauge reads it.
func standaloneBreakerOpen(h *Handler) bool { return h.limiter.OpenBreakers() > 0 }

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
	start := time.Now()
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
	// A handful: the breaker's line, and a line per 10 s of each throttled
	// warning (Redis failed, overload), however long a loaded machine
	// takes for the requests.
	if most := 5 + 2*int(time.Since(start)/(10*time.Second)); len(loud) > most {
		t.Fatalf("%d lines at warn or above for 1000 requests during an outage in %v, want at most %d:\n%s",
			len(loud), time.Since(start).Round(time.Millisecond), most, strings.Join(loud, "\n"))
	}
	t.Logf("%d lines at warn or above: %v", len(loud), loud)
}

// TestOverloadFollowsOnErrorWithoutOpeningBreaker: calls this instance
// could not send (a full queue, a deadline that passed in the queue)
// follow on_error and are logged as overload, not as Redis failures, and
// count against no Redis node's breaker. A proxy holds back both
// workers' pipelines for half the timeout, and the queue behind them
// fills: the requests beyond it are refused at once, and those queued
// with too little time left once a worker is free are answered unsent;
// Redis answers everything it gets. (That overload counts no failure
// toward a breaker is also the batcher's
// TestOverloadedCallsCountAgainstNoBreaker.)
func TestOverloadFollowsOnErrorWithoutOpeningBreaker(t *testing.T) {
	srv := redistest.Start(t)
	proxy := startRedisProxy(t, srv.Addr)
	const timeout = 4 * time.Second
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 1 1 {\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\ttimeout %v\n\t}\n}", proxy.addr, timeout))
	expectBurstThenDeny(t, h, "warm-up", 1) // the script is loaded, a connection open
	logs := observeLogs(h, zap.DebugLevel)
	proxy.stalledUntil.Store(time.Now().Add(timeout / 2).UnixNano())
	// More than the queue and both workers' batches hold.
	n := redisbatch.QueueLength + 2*redisbatch.PipelinesInFlight*128
	var wg sync.WaitGroup
	var overloaded, wrong atomic.Int64
	for i := range n {
		wg.Go(func() {
			status, remaining, _ := hit(h, "k"+strconv.Itoa(i))
			switch {
			case status != 200:
				wrong.Add(1)
			case remaining == "-1":
				overloaded.Add(1)
			}
		})
	}
	wg.Wait()
	t.Logf("%d of %d requests overloaded", overloaded.Load(), n)
	if w := wrong.Load(); w != 0 {
		t.Errorf("%d of %d requests refused; want every one admitted, by Redis (each key's first) or by on_error allow", w, n)
	}
	if overloaded.Load() == 0 {
		t.Fatal("no request was overloaded")
	}
	if n := countLogs(logs, "overloaded"); n != 1 {
		t.Errorf("%d overload lines, want 1 (throttled): %v", n, logs.All())
	}
	if n := countLogs(logs, "Redis failed"); n != 0 {
		t.Errorf("overload logged as a Redis failure %d times", n)
	}
	if standaloneBreakerOpen(h) || countLogs(logs, "circuit breaker opened") != 0 {
		t.Errorf("the breaker opened: overload counted against the node")
	}
}
