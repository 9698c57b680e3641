package ratelimit

import (
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"go.uber.org/zap"
)

// TestStallShorterThanTimeoutFailsOnlyCallsOutOfTime sends requests at a
// steady pace (one every 2 ms, whether or not earlier ones were answered,
// as clients do) through a proxy that adds 20 ms each way: a round trip
// of 40 ms and more, against a timeout of 250 ms. The proxy stalls once
// for 215 ms, shorter than the timeout. Requests queue up behind the
// stalled pipelines, and when the stall ends, the oldest of them have
// less time left than a round trip while the newest have nearly all of
// theirs. The oldest follow on_error as overload; the newest, sent in the
// same batch, are limited as usual. No breaker opens, and every request
// that followed on_error had used at least half its timeout: none failed
// early because a batch mate was short of time.
func TestStallShorterThanTimeoutFailsOnlyCallsOutOfTime(t *testing.T) {
	const (
		latency = 20 * time.Millisecond
		timeout = 250 * time.Millisecond
		stall   = 215 * time.Millisecond
		every   = 2 * time.Millisecond
		keys    = 64
	)
	srv := redistest.Start(t)
	proxy := startRedisProxy(t, srv.Addr)
	proxy.latency.Store(int64(latency))
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit 100000 1000000 {
	zone stall
	key {http.request.header.X-Key}
	redis %s {
		timeout %v
	}
}`, proxy.addr, timeout))
	// Connections open and the script loaded, through the proxy's latency.
	eventually(t, 5*time.Second, "limiting through the proxy", func() bool {
		_, remaining, _ := hit(h, "warm")
		return remaining != "-1"
	})
	logs := observeLogs(h, zap.DebugLevel)

	type result struct {
		onError bool
		took    time.Duration
		at      time.Duration // since the start
	}
	var (
		mu      sync.Mutex
		results []result
		wg      sync.WaitGroup
	)
	start := time.Now()
	tick := time.NewTicker(every)
	var stalled time.Duration
	for i := 0; time.Since(start) < 2*time.Second; i++ {
		<-tick.C
		if stalled == 0 && time.Since(start) > time.Second { // the round trip estimate has settled
			stalled = time.Since(start)
			proxy.stall(stall)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			at := time.Since(start)
			key := "k" + strconv.Itoa(i%keys)
			status, remaining, took := hit(h, key)
			if status != 200 || remaining == "" {
				t.Errorf("%s: %d remaining %q, want 200 (admitted, or on_error allow)", key, status, remaining)
				return
			}
			mu.Lock()
			results = append(results, result{remaining == "-1", took, at})
			mu.Unlock()
		}()
	}
	tick.Stop()
	wg.Wait()

	var onError, early, slow int
	var slowest time.Duration
	for _, r := range results {
		slowest = max(slowest, r.took)
		if r.took >= stall {
			slow++
		}
		if !r.onError {
			continue
		}
		onError++
		if r.took < timeout/2 {
			if early++; early <= 5 {
				t.Errorf("a request sent %v after the start (the stall began at %v) followed on_error after %v, with more than half its %v timeout left",
					r.at.Round(time.Millisecond), stalled.Round(time.Millisecond), r.took.Round(time.Millisecond), timeout)
			}
		}
	}
	t.Logf("%d requests, %d waited through the stall, %d followed on_error (%d early), slowest %v; %d 'Redis failed' lines",
		len(results), slow, onError, early, slowest.Round(time.Millisecond), countLogs(logs, "Redis failed"))
	if slow == 0 {
		t.Fatal("no request waited through the stall: the test stalled nothing")
	}
	if slowest > timeout+stallBound {
		t.Errorf("a request took %v, more than its timeout %v", slowest, timeout)
	}
	// A pipeline in flight when the stall began may still miss the
	// deadline of every call in it (those that had waited to be sent):
	// one failure of the node, far from the breaker's five in a row.
	if n := countLogs(logs, "circuit breaker opened"); n != 0 || standaloneBreakerOpen(h) {
		t.Errorf("the breaker opened (%d lines) for a stall shorter than the timeout", n)
	}
}
