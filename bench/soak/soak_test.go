// Package soak holds `make soak`: minutes of load against two Caddy
// instances that share one rate_limit zone in one Redis, while that Redis
// is stopped, restarted and flushed on a schedule; then it checks that the
// limit held and that nothing failed. TestSoak runs only when SOAK_DURATION
// is set (a Go duration such as 3m, or seconds):
//
//	SOAK_DURATION=3m go test -run TestSoak -v -timeout 1h ./bench/soak
//
// It starts a redis-server (internal/redistest) and two Caddy processes
// with the plugin (internal/caddyproc), waits until every instance
// answers with a live bucket (X-RateLimit-Remaining >= 0) and reads the
// limit from the X-RateLimit-* headers. Then 32 clients, each with its own
// keep-alive connections and one of 8 X-Key values, send GETs for the
// duration, alternating between the instances and pacing themselves to
// at most 100 a second each. Every request is recorded: send time, key,
// instance, status, latency and X-RateLimit-Remaining (-1: Redis failed).
// Meanwhile the faults, at fractions of the duration:
//
//	20%  stop Redis (SIGTERM to its PID) for 15 s (at most a quarter of
//	     the duration), then start it again on the same port
//	50%  SCRIPT FLUSH
//	70%  stop Redis again, then start it again
//
// The summary (summary_test.go) reports the outcomes of all requests; the
// bound check (for every key and every 5 s window, starting every second,
// that lies outside the outages and their first 2 s after the restart, the
// admitted requests may not exceed burst + rate × L, where L is the span
// from the first send to the last response of those requests: the window
// plus at most one request's latency, and a bucket may enter the window
// full); p50/p99 latency in and out of outages; how long each instance
// took to resume limiting after each restart; and what each Caddy logged
// (rate_limit WARN lines, which should be throttled to a handful, and the
// circuit breaker's opened/closed lines).
//
// The test fails when a window exceeded the bound, a 5xx or any other
// unexpected status (anything but 200 and 429) or a transport error
// occurred, no window could be checked, or a fault could not be applied;
// the logs are then kept in a directory it names.
package soak

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// soakSite is one rate_limit zone, keyed by the X-Key header: a burst of
// 100, then 50 requests a second per key. The test reads the rate and the
// burst back from the X-RateLimit-* headers, so they are set only here.
const soakSite = `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone soak
		key {http.request.header.X-Key}
		replenish_rate 50
		burst_capacity 100
		on_error allow
		redis %s {
			timeout 100ms
		}
	}
	respond "ok"
}
`

type config struct {
	duration  time.Duration
	clients   int
	keys      int
	clientRPS float64 // most requests per second per client
	targets   []string
	names     []string // one letter per target: A, B
	outage    time.Duration
	window    time.Duration // bound check: window length
	step      time.Duration // bound check: a window starts every step
	grace     time.Duration // bound check: skip windows this close after a restart
	timeout   time.Duration // HTTP request timeout
}

// durationFromEnv reads SOAK_DURATION: a Go duration, or seconds.
func durationFromEnv() (time.Duration, error) {
	v := os.Getenv("SOAK_DURATION")
	if _, err := strconv.Atoi(v); err == nil {
		v += "s"
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("SOAK_DURATION=%q: %v", os.Getenv("SOAK_DURATION"), err)
	}
	if d < 10*time.Second {
		return 0, fmt.Errorf("SOAK_DURATION=%v: at least 10s", d)
	}
	return d, nil
}

func TestSoak(t *testing.T) {
	if os.Getenv("SOAK_DURATION") == "" || testing.Short() {
		t.Skip("the soak runs only with SOAK_DURATION set (make soak)")
	}
	d, err := durationFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	// Starting Redis and Caddy, the probe and the summary take well under this.
	if deadline, ok := t.Deadline(); ok && time.Until(deadline) < d+2*time.Minute {
		t.Fatalf("SOAK_DURATION=%v does not fit in go test's -timeout (%v left); raise -timeout",
			d, time.Until(deadline).Round(time.Second))
	}
	cfg := config{
		duration: d, clients: 32, keys: 8, clientRPS: 100,
		outage: min(15*time.Second, d/4), window: 5 * time.Second, step: time.Second,
		grace: 2 * time.Second, timeout: 5 * time.Second,
	}

	srv := redistest.Start(t)
	site := caddyproc.Caddyfile(fmt.Sprintf(soakSite, srv.Addr))
	var caddyLogs []string
	for _, name := range []string{"A", "B"} {
		inst := caddyproc.Start(t, site)
		cfg.targets = append(cfg.targets, inst.URL)
		cfg.names = append(cfg.names, name)
		caddyLogs = append(caddyLogs, inst.LogFile)
	}
	t.Logf("redis-server pid %d on %s; Caddy A on %s, Caddy B on %s", srv.PID(), srv.Addr, cfg.targets[0], cfg.targets[1])

	lim, err := probe(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("limit: replenish_rate %v, burst_capacity %d, requested_tokens %d; %d clients over %d keys for %s",
		lim.rate, lim.burst, lim.requested, cfg.clients, cfg.keys, cfg.duration)

	loadCtx, cancelLoad := context.WithTimeout(context.Background(), cfg.duration)
	t0 := time.Now()
	perClient := make([]clientResult, cfg.clients)
	var clients sync.WaitGroup
	// Should a fault end the test early (t.Fatal), the load stops first.
	defer func() { cancelLoad(); clients.Wait() }()
	for i := range cfg.clients {
		clients.Go(func() { perClient[i] = runClient(loadCtx, cfg, i, t0) })
	}
	faults, faultErr := runFaults(t, loadCtx, cfg, srv, t0)
	if faultErr != nil {
		cancelLoad()
	}
	clients.Wait()
	end := time.Since(t0)

	var recs []record
	var transportSamples []string
	for _, cr := range perClient {
		recs = append(recs, cr.records...)
		if cr.firstErr != "" && len(transportSamples) < 3 {
			transportSamples = append(transportSamples, cr.firstErr)
		}
	}
	s := analyze(cfg, lim, recs, faults, end)
	s.transportSamples = transportSamples
	s.faultErr = faultErr
	for _, path := range caddyLogs {
		s.logs = append(s.logs, readCaddyLog(path))
	}
	s.print(os.Stdout)
	if s.failed() {
		t.Errorf("soak failed (summary above); logs kept in %s", keepLogs(t, append(caddyLogs, srv.LogFile)))
	}
}

// keepLogs copies the files into a new directory outside the test's
// temporary ones, which go with the test, and returns its path.
func keepLogs(t *testing.T, files []string) string {
	dir, err := os.MkdirTemp("", "soak-logs-")
	if err != nil {
		t.Logf("cannot keep the logs: %v", err)
		return "(none)"
	}
	names := []string{"caddy-A.log", "caddy-B.log", "redis.log"}
	for i, f := range files {
		data, err := os.ReadFile(f)
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, names[i]), data, 0o644)
		}
		if err != nil {
			t.Logf("cannot keep %s: %v", f, err)
		}
	}
	return dir
}

// --- faults ------------------------------------------------------------------

var schedule = []struct {
	frac float64
	kind string
}{{0.2, "outage"}, {0.5, "flush"}, {0.7, "outage"}}

// runFaults applies the schedule until ctx ends (the outage is at most a
// quarter of the duration, so the last one ends before the load does).
// A failed restart ends the test (redistest's t.Fatal); a failed SCRIPT
// FLUSH is returned.
func runFaults(t *testing.T, ctx context.Context, cfg config, srv *redistest.Server, t0 time.Time) ([]fault, error) {
	var done []fault
	for _, step := range schedule {
		if !sleepUntil(ctx, t0.Add(time.Duration(step.frac*float64(cfg.duration)))) {
			return done, nil
		}
		f := fault{kind: step.kind, at: time.Since(t0)}
		switch step.kind {
		case "outage":
			old := srv.PID()
			srv.Stop(t)
			f.dead = time.Since(t0)
			t.Logf("t=%5.1fs  stopped redis-server (pid %d)", f.at.Seconds(), old)
			if !sleepUntil(ctx, t0.Add(f.at+cfg.outage)) {
				return done, nil
			}
			srv.Restart(t) // waits until it answers PING
			f.back = time.Since(t0)
			t.Logf("t=%5.1fs  redis-server answers again (pid %d)", f.back.Seconds(), srv.PID())
		case "flush":
			flushCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
			err := srv.Client(t).ScriptFlush(flushCtx).Err()
			cancel()
			if err != nil {
				return done, fmt.Errorf("SCRIPT FLUSH: %w", err)
			}
			t.Logf("t=%5.1fs  SCRIPT FLUSH", f.at.Seconds())
		}
		done = append(done, f)
	}
	return done, nil
}

// sleepUntil sleeps until t; false if ctx ended first.
func sleepUntil(ctx context.Context, t time.Time) bool {
	timer := time.NewTimer(time.Until(t))
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-timer.C:
		return true
	}
}

// --- load --------------------------------------------------------------------

// probe waits until every instance answers with a live bucket (Redis
// reachable) and returns the limit from its headers, which must agree.
// It uses a key of its own, so the soak's buckets start full.
func probe(ctx context.Context, cfg config) (limits, error) {
	client := &http.Client{Timeout: time.Second}
	var first limits
	for i, target := range cfg.targets {
		var lim limits
		var last string
		for deadline := time.Now().Add(15 * time.Second); ; {
			if ctx.Err() != nil {
				return first, ctx.Err()
			}
			if time.Now().After(deadline) {
				return first, fmt.Errorf("instance %s (%s) did not answer with a live bucket within 15s; last: %s",
					cfg.names[i], target, last)
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, target+"/", nil)
			req.Header.Set("X-Key", "soak-probe")
			resp, err := client.Do(req)
			if err != nil {
				last = err.Error()
				time.Sleep(100 * time.Millisecond)
				continue
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			h := resp.Header
			last = fmt.Sprintf("status %d, X-RateLimit-Remaining %q", resp.StatusCode, h.Get("X-RateLimit-Remaining"))
			if resp.StatusCode != http.StatusOK || parseRemaining(h.Get("X-RateLimit-Remaining")) < 0 {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			lim.rate, err = strconv.ParseFloat(h.Get("X-RateLimit-Replenish-Rate"), 64)
			if err == nil {
				lim.burst, err = strconv.ParseInt(h.Get("X-RateLimit-Burst-Capacity"), 10, 64)
			}
			if err == nil {
				lim.requested, err = strconv.ParseInt(h.Get("X-RateLimit-Requested-Tokens"), 10, 64)
			}
			if err != nil || lim.rate <= 0 || lim.requested < 1 {
				return first, fmt.Errorf("instance %s: cannot read the limit from the X-RateLimit-* headers: %v", cfg.names[i], h)
			}
			break
		}
		if i == 0 {
			first = lim
		} else if lim != first {
			return first, fmt.Errorf("instances disagree on the limit: %+v vs %+v", first, lim)
		}
	}
	return first, nil
}

type clientResult struct {
	records  []record
	firstErr string
}

// runClient sends requests with one key until ctx ends, alternating between
// the instances, at most cfg.clientRPS a second. Each client has its own
// transport, so its own keep-alive connection to each instance. A request
// in flight when ctx ends is finished and recorded.
func runClient(ctx context.Context, cfg config, id int, t0 time.Time) clientResult {
	key := id % cfg.keys
	keyValue := fmt.Sprintf("soak-key-%d", key)
	transport := &http.Transport{MaxIdleConnsPerHost: 1, DisableCompression: true}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport, Timeout: cfg.timeout}
	var res clientResult
	if cfg.clientRPS > 0 {
		res.records = make([]record, 0, int(cfg.clientRPS*cfg.duration.Seconds())+16)
	}
	var interval time.Duration
	next := time.Now()
	if cfg.clientRPS > 0 {
		interval = time.Duration(float64(time.Second) / cfg.clientRPS)
		next = next.Add(rand.N(interval)) // spread the clients out
	}
	for n := id; ; n++ {
		if interval > 0 {
			if !sleepUntil(ctx, next) {
				break
			}
			// Paced, with no catch-up burst after a slow response.
			next = later(next.Add(interval), time.Now())
		}
		if ctx.Err() != nil {
			break
		}
		inst := n % len(cfg.targets)
		req, _ := http.NewRequest(http.MethodGet, cfg.targets[inst]+"/", nil)
		req.Header.Set("X-Key", keyValue)
		start := time.Now()
		r := record{sent: start.Sub(t0), key: uint8(key), instance: uint8(inst), remaining: remainingNone}
		resp, err := client.Do(req)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			r.status = int16(resp.StatusCode)
			r.remaining = parseRemaining(resp.Header.Get("X-RateLimit-Remaining"))
		}
		r.latency = time.Since(start)
		if err != nil {
			r.status = 0
			if res.firstErr == "" {
				res.firstErr = fmt.Sprintf("t=%.1fs instance %s: %v", r.sent.Seconds(), cfg.names[inst], err)
			}
		}
		res.records = append(res.records, r)
	}
	return res
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
