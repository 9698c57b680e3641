package ratelimit

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisstore"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
)

func TestScriptBurstThenDeny(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestLimiter(t, srv.Addr, time.Second)
	args := limitArgs(1, 5, 1) // slow refill: nothing comes back during the test

	for i := int64(1); i <= 5; i++ {
		res := mustTake(t, b, "burst", args)
		if !res.Allowed || res.Remaining != 5-i {
			t.Fatalf("request %d: got %+v, want allowed with %d remaining", i, res, 5-i)
		}
		// The next request fits now, until the last token is gone.
		if next := res.RetryAfter; (i < 5 && next != 0) || (i == 5 && (next <= 500*time.Millisecond || next > time.Second)) {
			t.Fatalf("request %d: next fits in %v", i, next)
		}
	}
	res := mustTake(t, b, "burst", args)
	if res.Allowed || res.Remaining != 0 {
		t.Fatalf("request 6: got %+v, want denied with 0 remaining", res)
	}
	// One token at 1/s: at most a second away, and most of it still to go.
	if res.RetryAfter <= 500*time.Millisecond || res.RetryAfter > time.Second {
		t.Fatalf("retry after %v, want within (0.5s, 1s]", res.RetryAfter)
	}
}

func TestScriptRefillsByElapsedTime(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestLimiter(t, srv.Addr, time.Second)
	args := limitArgs(20, 20, 1)

	start := time.Now()
	for range 20 {
		mustTake(t, b, "refill", args)
	}
	time.Sleep(300 * time.Millisecond)
	admitted := 0
	for mustTake(t, b, "refill", args).Allowed {
		admitted++
	}
	elapsed := time.Since(start)
	// The bucket was emptied, then refilled at 20/s for at least 300 ms
	// and at most the whole elapsed time: between 6 and 20*elapsed.
	if upper := int(20 * elapsed.Seconds()); admitted < 6 || admitted > upper {
		t.Fatalf("admitted %d after %v, want between 6 and %d", admitted, elapsed, upper)
	}
}

func TestScriptRequestedTokens(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestLimiter(t, srv.Addr, time.Second)
	args := limitArgs(1, 10, 3)

	for _, want := range []int64{7, 4, 1} {
		res := mustTake(t, b, "cost", args)
		if !res.Allowed || res.Remaining != want {
			t.Fatalf("got %+v, want allowed with %d remaining", res, want)
		}
	}
	res := mustTake(t, b, "cost", args)
	// 1 token (and a sliver) left, 3 wanted: just under 2 s at 1/s.
	if res.Allowed || res.Remaining != 1 || res.RetryAfter <= 1500*time.Millisecond || res.RetryAfter > 2*time.Second {
		t.Fatalf("got %+v, want denied, 1 remaining, retry in (1.5s, 2s]", res)
	}
}

func TestScriptFractionalRate(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestLimiter(t, srv.Addr, time.Second)
	args := limitArgs(0.5, 1, 1) // one token every two seconds

	if res := mustTake(t, b, "half", args); !res.Allowed {
		t.Fatalf("first request denied: %+v", res)
	}
	res := mustTake(t, b, "half", args)
	if res.Allowed || res.RetryAfter <= 1500*time.Millisecond || res.RetryAfter > 2*time.Second {
		t.Fatalf("got %+v, want denied with retry in (1.5s, 2s]", res)
	}
}

func TestScriptExpiresKeyWhenBucketWouldBeFull(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	b := newTestLimiter(t, srv.Addr, time.Second)
	ctx := context.Background()

	// The key lives as long as its missing tokens take to refill, rounded
	// up to the millisecond, and at least a second; PTTL is read a moment
	// after the script set it, hence the window below the exact value.
	for _, c := range []struct {
		name                    string
		rate                    float64
		burst, requested, takes int64
		want                    time.Duration
	}{
		{"one of a day's thousand", 1000.0 / 86400, 1000, 1, 1, 86400 * time.Millisecond}, // 1 token at 1000/1d: 86.4 s
		{"drained slow", 10, 20, 1, 20, 2 * time.Second},
		{"drained by a costly request", 10, 20, 20, 1, 2 * time.Second},
		{"half drained", 10, 20, 1, 10, time.Second},
		{"floor", 100, 100, 1, 1, time.Second}, // 10 ms to refill, but never below a second
		{"fraction", 0.5, 1, 1, 1, 2 * time.Second},
	} {
		// Less what refilled while the takes ran, and what passed since.
		start := time.Now()
		for range c.takes {
			mustTake(t, b, c.name, limitArgs(c.rate, c.burst, c.requested))
		}
		ttl, err := rdb.PTTL(ctx, c.name).Result()
		if err != nil {
			t.Fatal(err)
		}
		if since := time.Since(start); ttl > c.want || ttl < c.want-since-time.Millisecond {
			t.Errorf("%s: TTL %v, want %v (less the %v since the first take)", c.name, ttl, c.want, since)
		}
	}
}

func TestScriptKeepsBoundUnderConcurrency(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestLimiter(t, srv.Addr, 2*time.Second)
	const rate, burst = 100.0, 50
	args := limitArgs(rate, burst, 1)

	var admitted, sent atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(time.Second)
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				res, err := takeOne(context.Background(), b, time.Now(), "shared", args)
				if err != nil {
					t.Error(err)
					return
				}
				sent.Add(1)
				if res.Allowed {
					admitted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	bound := burst + rate*elapsed.Seconds()
	t.Logf("%d of %d admitted in %v; bound %.1f", admitted.Load(), sent.Load(), elapsed, bound)
	if float64(admitted.Load()) > bound {
		t.Fatalf("admitted %d, more than burst + rate*T = %.1f", admitted.Load(), bound)
	}
	// At least the burst plus most of a second's refill got through.
	if admitted.Load() < burst+rate/2 {
		t.Fatalf("admitted only %d; the limiter starves clients", admitted.Load())
	}
}

func TestScriptReloadedAfterScriptFlush(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	b := newTestLimiter(t, srv.Addr, time.Second)
	args := limitArgs(1, 3, 1)

	mustTake(t, b, "flush", args)
	if err := rdb.ScriptFlush(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	res := mustTake(t, b, "flush", args) // NOSCRIPT, then the source again
	if !res.Allowed || res.Remaining != 1 {
		t.Fatalf("after SCRIPT FLUSH got %+v, want allowed with 1 remaining (state kept)", res)
	}
	exists, err := rdb.ScriptExists(context.Background(), scriptSHA).Result()
	if err != nil || !exists[0] {
		t.Fatalf("script not cached again after the reload: %v %v", exists, err)
	}
}

func TestBackendTimeoutBoundsWait(t *testing.T) {
	addr := redistest.StartBlackhole(t)
	b := newTestLimiter(t, addr, 50*time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := takeOne(ctx, b, time.Now(), "k", limitArgs(1, 1, 1))
	if !redisbatch.IsNetworkError(err) { // the caller's deadline or the pipeline's read timeout, whichever fired first
		t.Fatalf("err %v, want a timeout", err)
	}
	// A blackhole never answers: without the timeout the call would wait
	// for ever; the bound leaves room for a loaded machine.
	if waited := time.Since(start); waited > 2*time.Second {
		t.Fatalf("waited %v for a 50ms timeout", waited)
	}
}

func TestBatchingCoalescesConcurrentCalls(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	b := newTestLimiter(t, srv.Addr, 2*time.Second)
	args := limitArgs(1000, 1000, 1)
	readsBefore := infoStat(t, rdb, "total_reads_processed")

	const clients, each = 64, 200
	var wg sync.WaitGroup
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := "client-" + strconv.Itoa(i)
			for range each {
				if res, err := takeOne(context.Background(), b, time.Now(), key, args); err != nil || !res.Allowed {
					t.Errorf("%s: %+v %v", key, res, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	// Reads of the test's own client (INFO) are a handful; the rest are
	// the limiter's pipelines.
	perCall := float64(infoStat(t, rdb, "total_reads_processed")-readsBefore) / (clients * each)
	t.Logf("Redis reads per call at %d concurrent clients: %.3f", clients, perCall)
	if perCall > 0.5 {
		t.Fatalf("%.3f reads per call: concurrent calls were not pipelined", perCall)
	}
}

func TestBatchedCallGivingUpLeavesNeighboursAlone(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	b := newTestLimiter(t, srv.Addr, time.Second)
	args := limitArgs(1, 5, 1)

	// Stall Redis, and keep every pipeline in flight with a call of its
	// own, so that the calls below wait in the queue.
	go rdb.Do(context.Background(), "DEBUG", "SLEEP", "0.3")
	time.Sleep(50 * time.Millisecond)
	for i := range redisbatch.PipelinesInFlight {
		go takeOne(context.Background(), b, time.Now(), "blocker"+strconv.Itoa(i), args)
		time.Sleep(10 * time.Millisecond)
	}

	impatient, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, 10)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			if i == 0 {
				ctx = impatient
			}
			_, errs[i] = takeOne(ctx, b, time.Now(), "n"+strconv.Itoa(i), args)
		}()
	}
	wg.Wait()
	if errs[0] == nil {
		t.Fatal("the impatient call succeeded through a 300 ms stall")
	}
	for i, err := range errs[1:] {
		if err != nil {
			t.Errorf("neighbour %d failed with its impatient batch mate: %v", i+1, err)
		}
	}
	// The impatient call gave up before it was sent: its bucket is untouched.
	if n, err := rdb.Exists(context.Background(), "n0").Result(); err != nil || n != 0 {
		t.Fatalf("the abandoned call took tokens (exists=%d, %v)", n, err)
	}
}

func TestBackendTimeoutCoversSlowDial(t *testing.T) {
	// A TLS handshake with a server that accepts and never answers: the
	// dial alone may take dial_timeout (10 s), but the request's Redis
	// step must end with its timeout (50 ms), or a loaded machine's
	// moment later, far from the dial timeout.
	addr := redistest.StartBlackhole(t)
	cfg := (&RedisConfig{
		Addresses:   []string{addr},
		Timeout:     caddy.Duration(50 * time.Millisecond),
		DialTimeout: caddy.Duration(10 * time.Second),
		TLS:         &RedisTLS{InsecureSkipVerify: true},
	}).withPlaceholders()
	opts, err := cfg.storeOptions(tlsFiles{})
	if err != nil {
		t.Fatal(err)
	}
	b := redisstore.New(opts)
	t.Cleanup(func() { _ = b.Destruct() })

	for range 3 {
		start := time.Now()
		if _, err := takeOne(context.Background(), b, start, "k", limitArgs(1, 1, 1)); err == nil {
			t.Fatal("a silent server answered")
		}
		if waited := time.Since(start); waited > 2*time.Second {
			t.Fatalf("waited %v for a 50ms timeout while dialing (dial timeout 10s)", waited)
		}
	}
}

func TestBucketStoredInTheFutureRefillsFromNow(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 2 2 {\n\tzone clock\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\ttimeout 5s\n\t}\n}", srv.Addr))

	// An empty bucket stamped a minute ahead of Redis's clock, as after a
	// failover to a server whose clock is behind.
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	ahead := now.Add(time.Minute).UnixMicro()
	if err := rdb.Set(ctx, h.limits[0].KeyPrefix+"skewed", "0 "+strconv.FormatInt(ahead, 10), time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	status, header := serve(ctx, h, "skewed")
	if status != 429 {
		t.Fatalf("empty bucket: %d, want 429", status)
	}
	retry, err := strconv.Atoi(header.Get("Retry-After"))
	if err != nil || retry != 1 { // one token at 2 a second: half a second, rounded up
		t.Fatalf("Retry-After %q, want 1", header.Get("Retry-After"))
	}
	time.Sleep(time.Duration(retry) * time.Second)
	if status, remaining, _ := hit(h, "skewed"); status != 200 {
		t.Fatalf("after the Retry-After it gave: %d remaining %q, want 200 (the bucket refills from now, not from a minute ahead)", status, remaining)
	}
}
