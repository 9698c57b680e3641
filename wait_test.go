package ratelimit

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
)

// waitHandlers are a handler of rate 2/s, burst 2 and a max wait of
// 1.2s on a key, with each store: in this process, and in Redis.
func waitHandlers(t *testing.T) map[string]*Handler {
	const body = "key {http.request.header.X-Key}\nmax_wait 1200ms"
	srv := redistest.Start(t)
	return map[string]*Handler{
		"memory": memoryHandler(t, "2 2", body),
		"redis":  caddyfileHandler(t, "rate_limit 2 2 {\n\tredis "+srv.Addr+"\n\t"+body+"\n}"),
	}
}

// wentOn serves a request of key through h and says when it reached the
// next handler (zero when it did not), its status and its
// {http.rate_limit.waited} and result.
func wentOn(ctx context.Context, h *Handler, key string) (at time.Time, status int, waited, result string) {
	r, w := newRequest("192.0.2.1", key)
	r = r.WithContext(mergeCancel(r.Context(), ctx))
	err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		at = time.Now()
		w.WriteHeader(http.StatusOK)
		return nil
	}))
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	waited, _ = repl.GetString("http.rate_limit.waited")
	result, _ = repl.GetString("http.rate_limit.result")
	return at, statusOf(err, w.Code), waited, result
}

// TestMaxWaitAdmitsWhatFitsWithinItAndRefusesTheRest: 7 requests at once
// on one key of rate 2/s, burst 2, max wait 1.2s: two go on at once, the
// next two wait 500ms and 1s for their tokens, and the last three, which
// would wait 1.5s and more, are refused at once. Counted at the moments
// they went on, no interval of length T held more than 2 + 2·T of them,
// but for how late the timers woke, which is measured and allowed for.
func TestMaxWaitAdmitsWhatFitsWithinItAndRefusesTheRest(t *testing.T) {
	for name, h := range waitHandlers(t) {
		t.Run(name, func(t *testing.T) {
			const n = 7
			var mu sync.Mutex
			var went []time.Time
			var statuses, results []string
			start := time.Now()
			var wg sync.WaitGroup
			for range n {
				wg.Go(func() {
					at, status, waited, result := wentOn(t.Context(), h, "k")
					mu.Lock()
					defer mu.Unlock()
					statuses = append(statuses, strconv.Itoa(status))
					results = append(results, result+"/"+waited)
					if !at.IsZero() {
						went = append(went, at)
					}
				})
			}
			wg.Wait()
			took := time.Since(start)
			slices.Sort(statuses)
			if want := []string{"200", "200", "200", "200", "429", "429", "429"}; !slices.Equal(statuses, want) {
				t.Fatalf("statuses %v (%v), want %v", statuses, results, want)
			}
			slices.SortFunc(went, func(a, b time.Time) int { return a.Compare(b) })
			t.Logf("went on after %v; results %v; all done in %v", mapSince(went, start), results, took)
			// The go-times are 500ms apart; a timer wakes no earlier than its
			// go-time, and late by as much as the machine makes it.
			late := went[len(went)-1].Sub(start) - time.Second
			for i := range went {
				for j := i; j < len(went); j++ {
					T := went[j].Sub(went[i])
					if most := 2 + 2*(T+max(late, 0)).Seconds(); float64(j-i+1) > most+1e-9 {
						t.Errorf("%d requests went on within %v: more than 2 + 2·(T + %v late)", j-i+1, T, late)
					}
				}
			}
			if last := went[len(went)-1].Sub(start); last < time.Second-10*time.Millisecond {
				t.Errorf("the fourth request went on %v after the first: before its tokens were there (1s)", last)
			}
			// The waits are what the tokens took to come, less the moments
			// between the requests' takes: at most 500ms and 1s.
			var waits []int
			for _, r := range results {
				if ms, ok := strings.CutPrefix(r, "waited/"); ok {
					n, _ := strconv.Atoi(ms)
					waits = append(waits, n)
				}
			}
			slices.Sort(waits)
			if len(waits) != 2 || waits[0] <= 400 || waits[0] > 500 || waits[1] <= 900 || waits[1] > 1000 {
				t.Errorf("waits %vms, want two: of at most 500ms and 1s (results %v)", waits, results)
			}
		})
	}
}

func mapSince(ts []time.Time, start time.Time) []time.Duration {
	d := make([]time.Duration, len(ts))
	for i, t := range ts {
		d[i] = t.Sub(start).Round(time.Millisecond)
	}
	return d
}

// TestRequestThatLeavesWhileWaitingGivesItsTokensBack: a request waiting
// for its tokens whose client leaves is not served, and its tokens go
// back: the next request waits no longer than it would have without it.
func TestRequestThatLeavesWhileWaitingGivesItsTokensBack(t *testing.T) {
	for name, h := range waitHandlers(t) {
		t.Run(name, func(t *testing.T) {
			for range 2 { // the burst
				if _, status, _, _ := wentOn(t.Context(), h, "leave"); status != 200 {
					t.Fatalf("burst request: %d", status)
				}
			}
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Millisecond)
			defer cancel()
			at, status, waited, result := wentOn(ctx, h, "leave")
			if !at.IsZero() || status != 499 || result != "left_waiting" {
				t.Fatalf("a request whose client left while it waited: served %v, %d, %s after waiting %s; want not served, 499, left_waiting",
					!at.IsZero(), status, result, waited)
			}
			// Its token is back: the next request waits at most 500ms, what a
			// token takes to come, not 1s.
			_, status, waited, _ = wentOn(t.Context(), h, "leave")
			if ms, _ := strconv.Atoi(waited); status != 200 || ms > 500 {
				t.Errorf("the request after it: %d, waited %sms; want at most 500ms (the leaver's token given back)", status, waited)
			}
		})
	}
}

// TestMaxWaitingRefusesBeyondIt: with max_waiting 1, a second request
// that would wait while one waits is refused at once.
func TestMaxWaitingRefusesBeyondIt(t *testing.T) {
	h := memoryHandler(t, "2 2", "key {http.request.header.X-Key}\nmax_wait 2s\nmax_waiting 1")
	wentOn(t.Context(), h, "q") // the burst
	wentOn(t.Context(), h, "q")
	done := make(chan string)
	go func() {
		_, status, _, result := wentOn(t.Context(), h, "q") // waits 500ms
		done <- fmt.Sprint(status, result)
	}()
	eventually(t, time.Second, "the first request waits", func() bool { return h.waiting.Load() == 1 })
	if _, status, _, result := wentOn(t.Context(), h, "q"); status != 429 || result != "denied" {
		t.Errorf("a request beyond max_waiting: %d %s, want 429 denied at once", status, result)
	}
	if got := <-done; got != "200waited" {
		t.Errorf("the waiting request: %s, want 200 waited", got)
	}
}

// TestMaxWaitBadValuesRefusedAtLoad: max_wait without a unit, negative,
// or more than an hour, and max_waiting 0, are refused naming them.
func TestMaxWaitBadValuesRefusedAtLoad(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{"max_wait 5", "max_wait '5' has no unit"},
		{"max_wait -1s", "max_wait '-1s' is negative"},
		{"max_wait 2h", "max_wait '2h' is more than 1h0m0s"},
		{"max_wait soon", "max_wait 'soon' is not a duration"},
		{"max_waiting 0", "max_waiting '0': want a whole number of requests, 1 or more"},
		{"limit a 1 1 {\n max_wait 3h\n}", "limit a: max_wait '3h' is more than 1h0m0s"},
	} {
		_, err := parseTestCaddyfile("rate_limit 1 1 {\n" + tc.body + "\n}")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error with %q", tc.body, err, tc.want)
		}
	}
}

// waitBoundSite waits up to 500ms for tokens on one key shared by every
// instance, and proxies to the test's upstream, telling it the wait.
const waitBoundSite = `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone waitbound
		key {http.request.header.X-Key}
		replenish_rate %v
		burst_capacity %d
		max_wait %v
		on_error deny
		redis {
			address %s
			timeout 5s
		}
	}
	reverse_proxy %s {
		header_up X-Waited {http.rate_limit.waited}
	}
}`

// TestWaitingKeepsTheBoundAcrossInstances: two Caddy instances sharing
// Redis, clients offering three times the rate on one key. Counted at
// the moments requests reach the upstream, no interval of length T holds
// more than burst + rate·T of them, but for how late they came after
// their go-time (timers and the proxy; measured, and allowed for); every
// admitted request waited at most max_wait; and the bucket admitted
// what it could within max_wait, nearly burst + rate·(D + max_wait) over
// the D the clients sent for: nothing that could have waited was
// refused in bulk.
func TestWaitingKeepsTheBoundAcrossInstances(t *testing.T) {
	const (
		rate     = 20.0
		burst    = 20
		maxWait  = 500 * time.Millisecond
		duration = 3 * time.Second
	)
	var mu sync.Mutex
	type arrival struct {
		at     time.Time
		waited time.Duration
		late   time.Duration // at most: from the send to the arrival, less the wait
	}
	var arrivals []arrival
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		ms, err := strconv.Atoi(r.Header.Get("X-Waited"))
		if err != nil {
			t.Errorf("X-Waited %q: %v", r.Header.Get("X-Waited"), err)
		}
		sentNs, _ := strconv.ParseInt(r.Header.Get("X-Sent"), 10, 64)
		waited := time.Duration(ms) * time.Millisecond
		mu.Lock()
		arrivals = append(arrivals, arrival{now, waited, now.Sub(time.Unix(0, sentNs)) - waited})
		mu.Unlock()
	}))
	t.Cleanup(upstream.Close)
	srv := redistest.Start(t)
	site := caddyproc.Caddyfile(fmt.Sprintf(waitBoundSite, rate, burst, maxWait, srv.Addr, upstream.URL))
	urls := []string{caddyproc.Start(t, site).URL, caddyproc.Start(t, site).URL}
	client := caddyClient(t)
	for _, u := range urls {
		mustGet(t, client, u, "warm")
	}
	mu.Lock()
	arrivals = arrivals[:0]
	mu.Unlock()

	// Three times the rate, each request on its own goroutine (a waiting
	// one holds its connection), round robin over the instances.
	var sent, refused, failed atomic.Int64
	var wg sync.WaitGroup
	interval := time.Second / time.Duration(3*rate)
	start := time.Now()
	for i := 0; time.Since(start) < duration; i++ {
		wg.Go(func() {
			sent.Add(1)
			req, _ := http.NewRequest(http.MethodGet, urls[i%len(urls)], nil)
			req.Header.Set("X-Key", "one")
			req.Header.Set("X-Sent", strconv.FormatInt(time.Now().UnixNano(), 10))
			resp, err := client.Do(req)
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			switch {
			case err != nil:
				failed.Add(1)
				t.Errorf("GET: %v", err)
			case resp.StatusCode == 429:
				refused.Add(1)
			case resp.StatusCode != 200:
				failed.Add(1)
				t.Errorf("GET: %d", resp.StatusCode)
			}
		})
		time.Sleep(interval)
	}
	elapsed := time.Since(start) // D: while the clients sent
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	slices.SortFunc(arrivals, func(a, b arrival) int { return a.at.Compare(b.at) })
	// How late a request came past its go-time is at most the time from
	// its send to its arrival, less its wait: the longest is the
	// allowance, in tokens rate × lateness.
	var late time.Duration
	for _, a := range arrivals {
		if a.waited > maxWait {
			t.Errorf("a request waited %v, more than max_wait %v", a.waited, maxWait)
		}
		late = max(late, a.late)
	}
	worst := 0.0
	for i := range arrivals {
		for j := i; j < len(arrivals); j++ {
			T := arrivals[j].at.Sub(arrivals[i].at)
			most := burst + rate*(T+late).Seconds()
			if n := float64(j - i + 1); n/most > worst {
				worst = n / most
			}
			if float64(j-i+1) > most+1e-9 {
				t.Errorf("%d requests reached the upstream within %v: more than burst + rate·(T + %v late) = %.1f", j-i+1, T, late, most)
				return
			}
		}
	}
	admitted := len(arrivals)
	could := burst + rate*(elapsed+maxWait).Seconds()
	t.Logf("%d sent in %v, %d admitted, %d refused, %d failed; latest arrival past its go-time at most %v; fullest interval %.3f of its bound; admitted %.3f of burst + rate·(D + max_wait) = %.1f",
		sent.Load(), elapsed.Round(time.Millisecond), admitted, refused.Load(), failed.Load(), late.Round(time.Millisecond), worst, float64(admitted)/could, could)
	if float64(admitted) > could+1e-9 {
		t.Errorf("admitted %d, more than burst + rate·(D + max_wait) = %.1f", admitted, could)
	}
	if float64(admitted) < 0.9*could {
		t.Errorf("admitted %d, less than 0.9 of burst + rate·(D + max_wait) = %.1f: requests that could have waited were refused", admitted, could)
	}
}

// TestRefusedWaitingRequestRetryAfterSaysWhenItWouldFit: rate 1/s,
// burst 1, max wait 2.5s; with one request gone and two waiting 1s and
// 2s, a fourth would wait 3s: refused at once, its Retry-After is when
// it would fit by waiting (3s - 2.5s, rounded up: 1), not when its
// tokens are there (3).
func TestRefusedWaitingRequestRetryAfterSaysWhenItWouldFit(t *testing.T) {
	h := memoryHandler(t, "1 1", "key {http.request.header.X-Key}\nmax_wait 2500ms")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if _, status, _, _ := wentOn(ctx, h, "r"); status != 200 {
		t.Fatalf("first request: %d", status)
	}
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { wentOn(ctx, h, "r") })
	}
	eventually(t, time.Second, "two requests wait", func() bool { return h.waiting.Load() == 2 })
	status, header := serve(t.Context(), h, "r")
	if status != 429 || header.Get("Retry-After") != "1" {
		t.Errorf("the fourth request: %d, Retry-After %q; want 429, 1", status, header.Get("Retry-After"))
	}
	cancel() // the waiting ones leave
	wg.Wait()
}

// TestSlotWaitIsReportedAsWaited: a request that waited in a concurrent
// limit's queue for a slot is admitted with the result waited, its wait
// in {http.rate_limit.waited} and in caddy_rate_limit_wait_seconds.
func TestSlotWaitIsReportedAsWaited(t *testing.T) {
	h := caddyfileHandler(t, `rate_limit {
		zone slotwaited
		key {http.request.header.X-Key}
		store memory
		concurrent gen 1 {
			max_wait 5s
		}
	}`)
	release := make(chan struct{})
	holding := make(chan struct{})
	go func() {
		r, w := newRequest("192.0.2.1", "k")
		_ = h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			close(holding)
			<-release
			return nil
		}))
	}()
	<-holding
	waits := func() uint64 {
		var m dto.Metric
		if err := collectors.waitSeconds.WithLabelValues("slotwaited").(prometheus.Histogram).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount()
	}
	before := waits()
	time.AfterFunc(100*time.Millisecond, func() { close(release) })
	_, status, waited, result := wentOn(t.Context(), h, "k")
	if ms, _ := strconv.Atoi(waited); status != 200 || result != "waited" || ms < 50 {
		t.Errorf("the request that waited for the slot: %d, %s, waited %sms; want 200, waited, about 100ms", status, result, waited)
	}
	if n := waits() - before; n != 1 {
		t.Errorf("caddy_rate_limit_wait_seconds counted %d waits, want 1", n)
	}
}

// BenchmarkWaitingRequest measures what a request waiting for its tokens
// holds in this process (its goroutine's stack and the heap it keeps),
// with b.N of them waiting at once, each on a key of its own whose token
// is 1,000 s away: the figure behind max_waiting's default. A request
// through Caddy holds its connection's buffers too (net/http: a 4 KiB
// reader and a 4 KiB writer). go test -run xxx -bench WaitingRequest
// -benchtime 10000x .
func BenchmarkWaitingRequest(b *testing.B) {
	h := memoryHandler(b, "0.001 1", "key {http.request.header.X-Key}\nmax_wait 1h\nmax_waiting 1000000")
	h.logger = zap.NewNop()                              // a debug line per wait, else
	zone := strconv.FormatInt(time.Now().UnixNano(), 36) // a run's keys of its own: the store outlives a run's handler
	for i := range b.N {                                 // each key's token: its next request waits 1,000 s
		wentOn(b.Context(), h, zone+strconv.Itoa(i))
	}
	ctx, cancel := context.WithCancel(b.Context())
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var wg sync.WaitGroup
	b.ResetTimer()
	for i := range b.N {
		wg.Go(func() { wentOn(ctx, h, zone+strconv.Itoa(i)) })
	}
	for h.waitingNow.Load() < int64(b.N) {
		time.Sleep(time.Millisecond)
	}
	b.StopTimer()
	runtime.GC()
	runtime.ReadMemStats(&after)
	held := float64(after.HeapInuse+after.StackInuse) - float64(before.HeapInuse+before.StackInuse)
	b.ReportMetric(held/float64(b.N), "bytes/waiting")
	cancel()
	wg.Wait()
}

// TestLeasingBucketWaitsInRedis: with lease and max_wait, requests that
// find the bucket short wait for their tokens instead of a 429, within
// the bound, each decided in Redis with one script call (a lease lends
// only tokens that are there: see takeWaiting): 25 requests one after
// another on a bucket of rate 10/s and burst 10 take at least 1.5s, none
// is refused, and they cost 25 script calls.
func TestLeasingBucketWaitsInRedis(t *testing.T) {
	srv := redistest.Start(t)
	h := leaseHandler(t, "leasewait", "replenish_rate 10\n\tburst_capacity 10\n\tmax_wait 3s\n\tlease 5", srv.Addr)
	rdb := srv.Client(t)
	before := redistest.ScriptCalls(t, rdb)
	start := time.Now()
	var results []string
	for range 25 {
		_, status, waited, result := wentOn(t.Context(), h, "k")
		if status != 200 {
			t.Fatalf("request %d: %d (%s), want 200: it could wait", len(results)+1, status, result)
		}
		results = append(results, result+"/"+waited)
	}
	took := time.Since(start)
	calls := redistest.ScriptCalls(t, rdb) - before
	t.Logf("25 requests in %v with %d script calls: %v", took.Round(time.Millisecond), calls, results)
	if took < 1500*time.Millisecond-10*time.Millisecond {
		t.Errorf("25 requests went on within %v: more than burst + rate·T allows (at least 1.5s)", took)
	}
	if calls != 25 {
		t.Errorf("%d script calls for 25 requests, want one each", calls)
	}
	if !slices.ContainsFunc(results, func(r string) bool { return strings.HasPrefix(r, "waited/") }) {
		t.Errorf("no request waited: %v", results)
	}
}

// TestRedisStoppedWhileRequestsWaitFollowsOnError: with Redis gone
// while requests wait, those waiting for their tokens (taken already)
// go on when their time comes, and one waiting in a slot queue follows
// on_error (deny: 503) once it can wait no longer; none is served twice,
// none more than the slots allow.
func TestRedisStoppedWhileRequestsWaitFollowsOnError(t *testing.T) {
	srv := redistest.Start(t)
	h := caddyfileHandler(t, `rate_limit {
		zone redisgone
		key {http.request.header.X-Key}
		on_error deny
		concurrent gen 1 {
			max_wait 2s
		}
		redis `+srv.Addr+`
	}`)
	var served atomic.Int64
	release := make(chan struct{})
	holding := make(chan struct{})
	go func() {
		r, w := newRequest("192.0.2.1", "k")
		_ = h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			served.Add(1)
			close(holding)
			<-release
			return nil
		}))
	}()
	<-holding
	done := make(chan int)
	go func() {
		r, w := newRequest("192.0.2.1", "k")
		err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			served.Add(1)
			return nil
		}))
		done <- statusOf(err, w.Code)
	}()
	eventually(t, 5*time.Second, "the second request waits for the slot", func() bool { return h.waitingNow.Load() == 1 })
	srv.Stop(t)
	close(release) // the holder ends; its release cannot reach Redis
	select {
	case status := <-done:
		if status != http.StatusServiceUnavailable {
			t.Errorf("the waiter with Redis gone: %d, want 503 (on_error deny)", status)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter with Redis gone never ended")
	}
	if n := served.Load(); n != 1 {
		t.Errorf("%d requests served, want 1: the holder alone", n)
	}
}
