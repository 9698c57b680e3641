package ratelimit

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisstore"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
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
	if n := countLogs(logs, "circuit breaker opened"); n != 0 || standaloneBreaker(h).isOpen() {
		t.Errorf("the breaker opened (%d lines) for a stall shorter than the timeout", n)
	}
}

// TestFailedBatchCountsOnceTowardBreaker sends one batch of ten calls to a
// Redis that never answers: the node failed once, not ten times, so its
// breaker (which opens after 5 failures in a row) stays closed.
func TestFailedBatchCountsOnceTowardBreaker(t *testing.T) {
	addr := redistest.StartBlackhole(t)
	l := newTestLimiter(t, addr, 100*time.Millisecond)
	deadline := time.Now().Add(100 * time.Millisecond)
	batch := make([]*redisbatch.Call, 2*redisbatch.BreakerThreshold)
	for i := range batch {
		batch[i] = newTestCall("k"+strconv.Itoa(i), limitArgs(1, 5, 1), deadline)
	}
	l.Batcher().SendBatch(batch) // as worker 0, idle: nothing else is queued
	for i, c := range batch {
		if c.Err == nil {
			t.Fatalf("call %d to a Redis that never answers: reply %v, want an error", i, c.Reply)
		}
	}
	b := nodeBreakerOf(l)
	if n := b.failures; n != 1 || b.isOpen() {
		t.Fatalf("one failed batch of %d calls: %d failures counted, breaker open %v; want 1 failure, closed",
			len(batch), n, b.isOpen())
	}
}

// TestScriptReplyOfAnotherShapeFailsItsCall: the batcher reads replies as
// arrays of integers. An error reply (a key of another type) fails its
// own call only. A reply of another shape (a string, a nested array, a
// string among the integers: no script of ours answers so) fails its
// call and never reads as a decision; go-redis then fails the calls
// after it in that pipeline and drops the connection, so the next batch
// reads its own replies, in step.
func TestScriptReplyOfAnotherShapeFailsItsCall(t *testing.T) {
	srv := redistest.Start(t)
	l := newTestLimiter(t, srv.Addr, 2*time.Second)
	deadline := time.Now().Add(2 * time.Second)
	newCall := func(key, body string) *redisbatch.Call {
		c := newTestCall(key, limitArgs(1, 10, 1), deadline)
		if body != "" {
			c.Script = redisbatch.NewScript(body)
		}
		return c
	}
	expectAdmitted := func(what string, c *redisbatch.Call) {
		t.Helper()
		if c.Err != nil {
			t.Fatalf("%s: %v", what, c.Err)
		}
		b := []limit.Bucket{{}}
		if allowed, err := redisstore.ReadTake(c.Reply, b, false); err != nil || !allowed || b[0].Remaining != 9 {
			t.Fatalf("%s: read %v as %v (%+v), %v; want admitted with 9 left", what, c.Reply, allowed, b, err)
		}
	}
	// ("with the sources": nothing is cached in this server.)
	failing, good := newCall("shape:error", "return redis.error_reply('WRONGTYPE boom')"), newCall("shape:good0", "")
	l.Batcher().Pipeline(context.Background(), []*redisbatch.Call{failing, good}, true)
	if failing.Err == nil {
		t.Errorf("an error reply answered %v without an error", failing.Reply)
	}
	expectAdmitted("the call batched after an error reply", good)

	for i, body := range []string{"return 'OK'", "return {1, {2}, 3}", "return {1, 'x', 0}"} {
		bad, after := newCall(fmt.Sprint("shape:bad", i), body), newCall(fmt.Sprint("shape:after", i), "")
		l.Batcher().Pipeline(context.Background(), []*redisbatch.Call{bad, after}, true)
		if bad.Err == nil {
			t.Errorf("script %q: answered %v without an error", body, bad.Reply)
		}
		if after.Err == nil {
			expectAdmitted("the call batched after "+body, after)
		}
		next := newCall(fmt.Sprint("shape:next", i), "")
		l.Batcher().Pipeline(context.Background(), []*redisbatch.Call{next}, true)
		expectAdmitted("the next batch after "+body, next)
	}
}
