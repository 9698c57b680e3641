package ratelimit

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// TestDeadClusterMasterLeavesOtherMastersLimited kills one of three
// masters (no replicas, so its slots stay down) and sends a steady mix of
// keys over all masters for more than five seconds: keys on the healthy
// masters stay limited exactly (never past burst + rate*T, never an
// error answer), keys on the dead one follow on_error within the timeout.
func TestDeadClusterMasterLeavesOtherMastersLimited(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	// By default a master refuses every key once any slot is uncovered;
	// operators who want the other masters to keep answering set this.
	for _, m := range c.Masters {
		if err := m.Client(t).ConfigSet(ctx, "cluster-require-full-coverage", "no").Err(); err != nil {
			t.Fatal(err)
		}
	}
	const rate, burst = 2.0, 3
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit %v %d {
	zone deadmaster
	key {http.request.header.X-Key}
	redis {
		address %s
		timeout %v
	}
}`, rate, burst, strings.Join(c.Addrs, " "), topologyTimeout))
	logs := observeLogs(h)

	// Ten keys per master, by where their buckets live.
	cc := c.Client(t)
	dead := c.Masters[0].Addr
	var healthyKeys, deadKeys []string
	for i := 0; len(healthyKeys) < 20 || len(deadKeys) < 10; i++ {
		key := "k" + strconv.Itoa(i)
		master, err := cc.MasterForKey(ctx, h.bucketPrefix+key)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case master.Options().Addr == dead && len(deadKeys) < 10:
			deadKeys = append(deadKeys, key)
		case master.Options().Addr != dead && len(healthyKeys) < 20:
			healthyKeys = append(healthyKeys, key)
		}
	}
	c.Masters[0].Kill(t)

	// 30 keys at about 300 requests a second in all, for six seconds:
	// far more failures on the dead master than the breaker's threshold.
	type tally struct {
		admitted    int
		first, last time.Time
	}
	var mu sync.Mutex
	tallies := map[string]*tally{}
	var wg sync.WaitGroup
	keys := append(append([]string(nil), healthyKeys...), deadKeys...)
	deadline := time.Now().Add(6 * time.Second)
	for w, key := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			onDeadMaster := w >= len(healthyKeys)
			for time.Now().Before(deadline) {
				sent := time.Now()
				status, remaining, took := hit(h, key)
				switch {
				case onDeadMaster && (status != 200 || remaining != "-1"):
					t.Errorf("key %s on the dead master: %d remaining %q, want on_error allow (200, -1)", key, status, remaining)
				case onDeadMaster && took > topologyTimeout+failoverSlack:
					t.Errorf("key %s on the dead master took %v, more than the timeout %v", key, took, topologyTimeout)
				case !onDeadMaster && (status != 200 && status != 429 || remaining == "-1" || remaining == ""):
					t.Errorf("key %s on a healthy master: %d remaining %q; its master answers, so it must be limited", key, status, remaining)
				case !onDeadMaster && status == 200:
					mu.Lock()
					tl := tallies[key]
					if tl == nil {
						tl = &tally{first: sent}
						tallies[key] = tl
					}
					tl.admitted++
					tl.last = time.Now()
					mu.Unlock()
				}
				if t.Failed() {
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	for _, key := range healthyKeys {
		tl := tallies[key]
		if tl == nil {
			t.Errorf("key %s on a healthy master: nothing admitted in six seconds", key)
			continue
		}
		// Admitted between the first request's start and the last answer.
		bound := burst + int(rate*tl.last.Sub(tl.first).Seconds())
		if tl.admitted > bound {
			t.Errorf("key %s on a healthy master: %d admitted over %v, bound %d", key, tl.admitted, tl.last.Sub(tl.first), bound)
		}
	}
	if countLogs(logs, "circuit breaker opened") == 0 {
		t.Error("the dead master's breaker never opened")
	}
	if open := h.limiter.openBreakers(); open != 1 {
		t.Errorf("%d node breakers open, want 1 (the dead master's)", open)
	}
}

// TestOverloadFollowsOnErrorWithoutOpeningBreaker: calls this instance
// could not send (a full queue, a deadline that passed in the queue)
// follow on_error and are logged as overload, but count against no Redis
// node's breaker.
func TestOverloadFollowsOnErrorWithoutOpeningBreaker(t *testing.T) {
	h := caddyfileHandler(t, "rate_limit 1 1 {\n\tkey {http.request.header.X-Key}\n\tredis 127.0.0.1:1\n}")
	logs := observeLogs(h)
	// A limiter with no worker and no room in its queue: every call is
	// refused at once, as when Redis is far behind.
	full := &limiter{timeout: 100 * time.Millisecond, node: "overloaded-node", queue: make(chan *call), stop: make(chan struct{})}
	full.timers[0] = newBatchTimer()
	shared := h.limiter
	h.limiter = full
	t.Cleanup(func() { h.limiter = shared }) // before the handler's own cleanup

	for range 2 * breakerThreshold {
		if status, remaining, _ := hit(h, "a"); status != 200 || remaining != "-1" {
			t.Fatalf("overloaded: %d remaining %q, want on_error allow (200, -1)", status, remaining)
		}
	}
	if n := countLogs(logs, "overloaded"); n != 1 {
		t.Errorf("%d overload lines, want 1 (throttled): %v", n, logs.All())
	}
	if n := countLogs(logs, "Redis failed"); n != 0 {
		t.Errorf("overload logged as a Redis failure %d times", n)
	}

	// A call whose deadline passed while it waited is answered unsent.
	c := &call{deadline: time.Now().Add(-time.Millisecond), clientCtx: context.Background(), done: make(chan struct{}, 1)}
	full.sendBatch(0, []*call{c})
	if c.err != errExpiredInQueue {
		t.Errorf("expired call: err %v, want %v", c.err, errExpiredInQueue)
	}
	if b := full.breakers.get(full.node); b.failures.Load() != 0 || b.isOpen() {
		t.Errorf("overload counted against the node: %d failures, open %v", b.failures.Load(), b.isOpen())
	}
}
