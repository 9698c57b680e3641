package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisstore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// ---- In-process handlers on a real Redis

// holder is a next handler whose requests stay in flight until let go:
// entered receives once each has been admitted.
type holder struct {
	entered chan struct{}
	letGo   chan struct{}
}

func newHolder() *holder {
	return &holder{entered: make(chan struct{}, 100), letGo: make(chan struct{})}
}

func (hd *holder) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	hd.entered <- struct{}{}
	select {
	case <-hd.letGo:
	case <-r.Context().Done():
		return r.Context().Err()
	}
	w.WriteHeader(http.StatusOK)
	return nil
}

// startHeld sends a request through h to hd and waits until it is
// admitted; done receives its status once it ended.
func startHeld(t *testing.T, ctx context.Context, h *Handler, hd *holder, key string) <-chan int {
	t.Helper()
	done := make(chan int, 1)
	go func() {
		r, w := newRequest("192.0.2.1", key)
		r = r.WithContext(mergeCancel(r.Context(), ctx))
		err := h.ServeHTTP(w, r, hd)
		done <- statusOf(err, w.Code)
	}()
	select {
	case <-hd.entered:
	case status := <-done:
		t.Fatalf("the held request was answered %d, want it admitted and held", status)
	case <-time.After(5 * time.Second):
		t.Fatal("the held request was not admitted within 5s")
	}
	return done
}

// concurrentHandler provisions a rate_limit directive against srv, with
// `redis <addr>` appended to its block.
func concurrentHandler(t *testing.T, srv *redistest.Server, block string) *Handler {
	t.Helper()
	return caddyfileHandler(t, fmt.Sprintf("rate_limit {\n%s\nredis %s\n}", block, srv.Addr))
}

// slotKey is the Redis key of the concurrent limit name for key, as h
// builds it.
func slotKey(t *testing.T, h *Handler, name, key string) string {
	t.Helper()
	for _, l := range h.limits {
		if l.Held != nil && l.Name == name {
			r, _ := newRequest("192.0.2.1", key)
			rv := keys.RequestValues(r, r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer))
			return l.Template.Key(&rv, l.KeyPrefix, l.KeySuffix)
		}
	}
	t.Fatalf("no concurrent limit %s", name)
	return ""
}

func TestConcurrentRefusesWhenSlotsTakenAndFreesOnRelease(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		headers both
		concurrent gen 2 {
			retry_after 7
		}`)
	hd := newHolder()
	ctx := context.Background()
	first, second := startHeld(t, ctx, h, hd, "k"), startHeld(t, ctx, h, hd, "k")

	r, w := newRequest("192.0.2.1", "k")
	status := statusOf(h.ServeHTTP(w, r, okHandler), w.Code)
	if status != 429 {
		t.Fatalf("third request with both slots taken: %d, want 429", status)
	}
	if got := w.Header().Get("Retry-After"); got != "7" {
		t.Errorf("Retry-After %q, want retry_after 7", got)
	}
	if got, want := w.Header().Get("RateLimit-Policy"), `"`+h.Zone+`.gen";q=2;qu="concurrent-requests"`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got := w.Header().Get("RateLimit"); !strings.Contains(got, ";r=0;t=7") {
		t.Errorf("RateLimit %q, want r=0 (no free slot) and t=7", got)
	}
	// Another key has slots of its own.
	if status, _ := serve(ctx, h, "other"); status != 200 {
		t.Errorf("another key: %d, want 200", status)
	}
	close(hd.letGo)
	if s1, s2 := <-first, <-second; s1 != 200 || s2 != 200 {
		t.Fatalf("held requests answered %d, %d; want 200", s1, s2)
	}
	// Released as the responses ended (the releases travel on their own,
	// in the next pipeline): no wait for a hold, and no cached denial
	// stands in the way.
	rdb := srv.Client(t)
	eventually(t, 2*time.Second, "both slots released in Redis", func() bool {
		n, _ := rdb.ZCard(context.Background(), slotKey(t, h, "gen", "k")).Result()
		return n == 0
	})
	status, header := serve(ctx, h, "k")
	if status != 200 {
		t.Fatalf("after the releases: %d, want 200 (a full concurrent limit must not be cached as a denial)", status)
	}
	if got := header.Get("RateLimit"); !strings.Contains(got, ";r=1;t=0") {
		t.Errorf("RateLimit %q, want r=1 free slot while this one ran", got)
	}
	eventually(t, 2*time.Second, "every slot released in Redis", func() bool {
		n, _ := rdb.ZCard(context.Background(), slotKey(t, h, "gen", "k")).Result()
		return n == 0
	})
}

func TestConcurrentSlotOutlivesHoldWhileItsRequestRuns(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 1s
		}`)
	hd := newHolder()
	done := startHeld(t, context.Background(), h, hd, "k")
	// Three holds long: renewed every third of one, the slot is never
	// handed out to another request.
	deadline := time.Now().Add(3 * time.Second)
	tries := 0
	for time.Now().Before(deadline) {
		if status, _ := serve(context.Background(), h, "k"); status != 429 {
			t.Fatalf("after %v of a 1s hold, another request got %d: the running request's slot was handed out twice",
				time.Since(deadline.Add(-3*time.Second)).Round(time.Millisecond), status)
		}
		tries++
		time.Sleep(50 * time.Millisecond)
	}
	close(hd.letGo)
	if status := <-done; status != 200 {
		t.Fatalf("the long request: %d, want 200", status)
	}
	if status, _ := serve(context.Background(), h, "k"); status != 200 {
		t.Fatalf("after the long request ended: %d, want 200", status)
	}
	t.Logf("%d requests over three holds, all refused while the slot was held", tries)
}

// A request renews its slot every third of its hold at the latest (the
// README), so that the slot never has less than two thirds of a hold
// left: with hold 3s, more than 2s less the slack of a round trip on a
// loaded machine. The renewal ticker renewed a hold on the first tick
// after a third of it, up to a sixth of a hold late: half a hold left.
func TestConcurrentSlotRenewedEveryThirdOfItsHoldAtTheLatest(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	const hold, slack = 3 * time.Second, 300 * time.Millisecond
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 3s
		}`)
	key := slotKey(t, h, "gen", "k")
	hd := newHolder()
	done := startHeld(t, ctx, h, hd, "k")
	least := hold
	for start := time.Now(); time.Since(start) < 2*hold; time.Sleep(5 * time.Millisecond) {
		left, err := rdb.Eval(ctx, peekSlotsSource, []string{key}).Int64Slice()
		if err != nil || len(left) != 1 {
			t.Fatalf("the held slot: %v, %v", left, err)
		}
		least = min(least, time.Duration(left[0])*time.Microsecond)
	}
	close(hd.letGo)
	if status := <-done; status != 200 {
		t.Fatalf("the long request: %d, want 200", status)
	}
	t.Logf("least time left to the slot over two holds: %v", least)
	if least < hold*2/3-slack {
		t.Fatalf("the slot had only %v of its %v hold left: not renewed every third of the hold", least, hold)
	}
}

// A renewal of a slot that is gone (expired, freed by the admin API, or
// lost with Redis's data) brings it back when asked (with n), while its
// limit has a free slot, and only then: never more than n are held. A
// renewal not asked to (0, the usual) only extends a live slot.
func TestConcurrentRenewalBringsBackAGoneSlotOnlyIntoAFreeOne(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	const key = "{t}|gen|slots"
	take := func(id string) []any {
		v, err := rdb.Eval(ctx, scriptSource, []string{key}, "c", "1", id, "1000000").Slice()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	renew := func(id, n string) int64 {
		v, err := rdb.Eval(ctx, concurrentSource, []string{key}, "renew", id, "1000000", n).Int64Slice()
		if err != nil {
			t.Fatal(err)
		}
		return v[0]
	}
	members := func() []string {
		m, _ := rdb.ZRange(ctx, key, 0, -1).Result()
		return m
	}
	if v := take("a"); v[0] != int64(1) {
		t.Fatalf("first take %v, want admitted", v)
	}
	if v := take("b"); v[0] != int64(0) {
		t.Fatalf("second take with the slot held %v, want refused", v)
	}
	time.Sleep(1100 * time.Millisecond) // a's slot expires
	if v := take("b"); v[0] != int64(1) {
		t.Fatalf("take after a's slot expired %v, want admitted", v)
	}
	if got := renew("a", "0"); got != 3 {
		t.Errorf("renewal of the expired slot a, not asked to bring it back, answered %d, want 3", got)
	}
	if got := renew("a", "1"); got != 0 {
		t.Errorf("renewal of the expired slot a with b holding the only one answered %d, want 0 (not brought back)", got)
	}
	if m := members(); len(m) != 1 || m[0] != "b" {
		t.Errorf("slots %v after renewing the expired a with 1 slot, want only b", m)
	}
	// With 2 slots, one is free: a comes back; c, a third, does not.
	if got := renew("a", "2"); got != 2 {
		t.Errorf("renewal of the gone slot a with a free one answered %d, want 2 (brought back)", got)
	}
	if got := renew("c", "2"); got != 0 {
		t.Errorf("renewal of a gone slot c with both held answered %d, want 0", got)
	}
	if m := members(); len(m) != 2 || m[0] == "c" || m[1] == "c" {
		t.Errorf("slots %v, want a and b", m)
	}
	if ttl := rdb.PTTL(ctx, key).Val(); ttl <= 0 || ttl > time.Second {
		t.Errorf("the set's TTL %v, want its latest slot's, within the 1s hold", ttl)
	}
	// b's renewal works; its release frees the slot; a second release is
	// a no-op.
	if got := renew("b", "2"); got != 1 {
		t.Errorf("renewal of b answered %d, want 1", got)
	}
	if got := renew("b", "0"); got != 1 {
		t.Errorf("renewal of the live b, not asked to bring it back, answered %d, want 1", got)
	}
	for i, want := range []int64{1, 0} {
		if v, _ := rdb.Eval(ctx, concurrentSource, []string{key}, "release", "b").Slice(); v[0] != want {
			t.Errorf("release %d of b answered %v, want %d", i+1, v, want)
		}
	}
	// A renewal that arrives after the release (its answer was lost)
	// does not bring the slot back.
	if got := renew("b", "0"); got != 3 {
		t.Errorf("renewal of b after its release answered %d, want 3 (gone, not brought back)", got)
	}
	if m := members(); len(m) != 1 || m[0] != "a" {
		t.Errorf("slots %v after a renewal of the released b, want only a", m)
	}
	// After FLUSHALL, the renewal makes the set anew, with its expiry.
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if got := renew("a", "2"); got != 2 {
		t.Errorf("renewal of a after FLUSHALL answered %d, want 2 (brought back)", got)
	}
	if ttl := rdb.PTTL(ctx, key).Val(); ttl <= 0 || ttl > time.Second {
		t.Errorf("the set's TTL %v after FLUSHALL and a renewal, want within the 1s hold", ttl)
	}
}

// After FLUSHALL (or a restart without persistence, or a failover to a
// replica that had not seen the slots), the requests still running
// count again at their next renewal: a second request is refused once
// the first one's renewal has brought its slot back.
func TestConcurrentRunningRequestCountsAgainAfterFlushall(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 1s
		}`)
	key := slotKey(t, h, "gen", "k")
	hd := newHolder()
	done := startHeld(t, ctx, h, hd, "k")
	defer func() { close(hd.letGo); <-done }()
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	// Renewed every third of its hold: back within a third and a tick.
	eventually(t, 3*time.Second, "the running request's slot back in Redis", func() bool { return rdb.ZCard(ctx, key).Val() == 1 })
	if status, _ := serve(ctx, h, "k"); status != 429 {
		t.Fatalf("a second request with the first running: %d, want 429", status)
	}
}

func TestConcurrentClientThatLeavesFreesItsSlotAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 30s
		}`)
	hd := newHolder()
	ctx, cancel := context.WithCancel(context.Background())
	done := startHeld(t, ctx, h, hd, "k")
	cancel()
	<-done
	left := time.Now()
	// At once: a release, then a request's round trip, well within the
	// 30s hold (a loaded machine may take seconds for both).
	eventually(t, 10*time.Second, "the slot free after the client left", func() bool {
		status, _ := serve(context.Background(), h, "k")
		return status == 200
	})
	t.Logf("slot free %v after the client left (hold 30s)", time.Since(left).Round(time.Millisecond))
}

func TestConcurrentPanicInLaterHandlerFreesTheSlot(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 30s
		}`)
	panicking := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { panic(http.ErrAbortHandler) })
	func() {
		defer func() {
			if recover() == nil {
				t.Error("the later handler's panic did not come through")
			}
		}()
		r, w := newRequest("192.0.2.1", "k")
		_ = h.ServeHTTP(w, r, panicking)
	}()
	eventually(t, time.Second, "the slot free after the panic", func() bool {
		status, _ := serve(context.Background(), h, "k")
		return status == 200
	})
}

func TestConcurrentWithTokenLimitIsAllOrNothing(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		limit requests 0.001 3
		concurrent gen 1`)
	hd := newHolder()
	done := startHeld(t, ctx, h, hd, "k") // 1 token, the slot

	// Refused by the slot: it takes no token.
	for range 3 {
		if status, _ := serve(ctx, h, "k"); status != 429 {
			t.Fatalf("with the slot held: %d, want 429", status)
		}
	}
	close(hd.letGo)
	<-done
	status, header := serve(ctx, h, "k") // the second token
	if status != 200 || header.Get("X-RateLimit-Remaining") != "1" {
		t.Fatalf("after the release: %d with %s tokens left, want 200 with 1: a request the slot refused took tokens",
			status, header.Get("X-RateLimit-Remaining"))
	}
	if status, _ := serve(ctx, h, "k"); status != 200 { // the third
		t.Fatalf("third token: %d, want 200", status)
	}
	// Refused by the tokens: it takes no slot.
	slots := slotKey(t, h, "gen", "k")
	eventually(t, time.Second, "slots released", func() bool { return rdb.ZCard(ctx, slots).Val() == 0 })
	for range 3 {
		if status, _ := serve(ctx, h, "k"); status != 429 {
			t.Fatalf("with no token left: %d, want 429", status)
		}
		if n := rdb.ZCard(ctx, slots).Val(); n != 0 {
			t.Fatalf("a request the token limit refused holds %d slot(s), want 0", n)
		}
	}
}

func TestConcurrentStoreMemoryAndOnErrorLocal(t *testing.T) {
	for _, tc := range []struct{ name, block string }{
		{"store memory", "store memory"},
		{"on_error local", "on_error local\nredis " + deadRedis},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
				key {http.request.header.X-Key}
				limit requests 1000 1000
				concurrent gen 2
				metrics on
				%s
			}`, tc.block))
			hd := newHolder()
			ctx := context.Background()
			a, b := startHeld(t, ctx, h, hd, "k"), startHeld(t, ctx, h, hd, "k")
			if got := gaugeValue(t, h.limits[1].InFlight); got != 2 {
				t.Errorf("in_flight %v with two held, want 2", got)
			}
			if status, _ := serve(ctx, h, "k"); status != 429 {
				t.Fatalf("third in flight: %d, want 429", status)
			}
			close(hd.letGo)
			<-a
			<-b
			if got := gaugeValue(t, h.limits[1].InFlight); got != 0 {
				t.Errorf("in_flight %v after both ended, want 0", got)
			}
			if status, _ := serve(ctx, h, "k"); status != 200 {
				t.Fatalf("after the releases: %d, want 200", status)
			}
		})
	}
}

func TestConcurrentAdminShowsSlotsAndDeleteFreesThem(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `zone adminslots
		key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 10s
		}`)
	hd := newHolder()
	done := startHeld(t, context.Background(), h, hd, "k")
	defer func() { close(hd.letGo); <-done }()

	admin := func(method string) map[string]any {
		r := httptest.NewRequest(method, "/rate_limit/zones/adminslots/buckets?header.X-Key=k", nil)
		w := httptest.NewRecorder()
		if err := serveAdmin(w, r); err != nil {
			t.Fatalf("%s: %v", method, err)
		}
		var v map[string]any
		if err := json.Unmarshal(w.Body.Bytes(), &v); err != nil {
			t.Fatalf("%s: %v in %s", method, err, w.Body)
		}
		return v
	}
	got := admin(http.MethodGet)
	b := got["buckets"].([]any)[0].(map[string]any)
	if b["in_use"] != 1.0 || b["slots"] != 1.0 {
		t.Fatalf("admin GET %v, want slots 1, in_use 1", got)
	}
	if exp := b["slot_expires_in"].([]any); len(exp) != 1 || exp[0].(float64) <= 0 || exp[0].(float64) > 10 {
		t.Errorf("slot_expires_in %v, want one expiry within the 10s hold", exp)
	}
	if status, _ := serve(context.Background(), h, "k"); status != 429 {
		t.Fatalf("with the slot held: %d, want 429", status)
	}
	admin(http.MethodDelete)
	if status, _ := serve(context.Background(), h, "k"); status != 200 {
		t.Fatalf("after DELETE: %d, want 200 (the slot freed)", status)
	}
}

// gaugeValue reads a gauge.
func gaugeValue(t *testing.T, g interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

// ---- Real Caddy processes

// concurrentSite proxies to the test's upstream, with concurrent 4 on
// one key across instances.
const concurrentSite = `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone conc
		key {http.request.header.X-Key}
		on_error deny
		concurrent gen %d {
			hold %s
		}
		redis {
			address %s
			timeout 5s
		}
	}
	reverse_proxy %s
}`

// countingUpstream answers after a delay and records the most requests
// it held at once.
type countingUpstream struct {
	now, most atomic.Int64
	delay     time.Duration
	release   chan struct{} // while hold is set, requests wait for it instead
	hold      atomic.Bool
}

func (u *countingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := u.now.Add(1)
	defer u.now.Add(-1)
	for {
		most := u.most.Load()
		if n <= most || u.most.CompareAndSwap(most, n) {
			break
		}
	}
	if u.hold.Load() {
		select {
		case <-u.release:
		case <-r.Context().Done():
		}
	} else {
		time.Sleep(u.delay)
	}
	_, _ = w.Write([]byte("ok"))
}

func TestConcurrentBurstAcrossInstancesNeverHoldsMoreThanSlots(t *testing.T) {
	srv := redistest.Start(t)
	up := &countingUpstream{delay: 150 * time.Millisecond}
	upstream := httptest.NewServer(up)
	defer upstream.Close()
	site := caddyproc.Caddyfile(fmt.Sprintf(concurrentSite, 4, "2s", srv.Addr, strings.TrimPrefix(upstream.URL, "http://")))
	var urls []string
	for range 3 {
		urls = append(urls, caddyproc.Start(t, site).URL)
	}
	client := caddyClient(t)
	for _, u := range urls {
		mustGet(t, client, u, "warm")
	}
	up.most.Store(0)

	var ok, refused, other atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			status, _, _, err := caddyGet(client, urls[i%3], "one")
			switch {
			case err != nil:
				other.Add(1)
				t.Errorf("request %d: %v", i, err)
			case status == 200:
				ok.Add(1)
			case status == 429:
				refused.Add(1)
			default:
				other.Add(1)
				t.Errorf("request %d: %d, want 200 or 429", i, status)
			}
		}()
	}
	close(start)
	wg.Wait()
	t.Logf("100 concurrent requests over 3 instances, concurrent 4: %d answered 200, %d 429, %d other; upstream held at most %d at once",
		ok.Load(), refused.Load(), other.Load(), up.most.Load())
	if most := up.most.Load(); most > 4 {
		t.Errorf("the upstream held %d requests at once, more than concurrent 4", most)
	}
	if ok.Load()+refused.Load() != 100 {
		t.Errorf("%d of 100 answered 200 or 429", ok.Load()+refused.Load())
	}
	if ok.Load() < 4 {
		t.Errorf("only %d admitted, want at least the 4 slots' worth", ok.Load())
	}
}

func TestConcurrentSlotsOfKilledInstanceFreeWithinHoldNotBefore(t *testing.T) {
	srv := redistest.Start(t)
	up := &countingUpstream{release: make(chan struct{})}
	up.hold.Store(true)
	upstream := httptest.NewServer(up)
	defer upstream.Close()
	defer close(up.release)
	// Long enough that a loaded machine's late renewal or slow request
	// (slack) cannot pass for a slot freed too soon or too late.
	const hold, slack = 3 * time.Second, 500 * time.Millisecond
	site := caddyproc.Caddyfile(fmt.Sprintf(concurrentSite, 2, hold, srv.Addr, strings.TrimPrefix(upstream.URL, "http://")))
	doomed, survivor := caddyproc.Start(t, site), caddyproc.Start(t, site)
	client := caddyClient(t)
	for range 2 {
		go func() { _, _, _, _ = caddyGet(client, doomed.URL, "one") }()
	}
	eventually(t, 5*time.Second, "two requests held upstream", func() bool { return up.now.Load() == 2 })
	time.Sleep(hold) // their slots renewed at least once
	if !doomed.Kill() {
		t.Fatal("the instance did not die of SIGKILL")
	}
	killed := time.Now()
	up.hold.Store(false) // from now on the upstream answers at once
	// Renewed every hold/3, so each slot has at least 2/3 of a hold left
	// at the kill: refused until then.
	for time.Since(killed) < hold*2/3-slack {
		if status, _ := mustGet(t, client, survivor.URL, "one"); status != 429 {
			t.Fatalf("%v after the kill: %d, want 429 (the dead instance's slots live out their hold)", time.Since(killed), status)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var freed time.Duration
	for {
		status, _ := mustGet(t, client, survivor.URL, "one")
		if status == 200 {
			freed = time.Since(killed)
			break
		}
		if time.Since(killed) > hold+slack {
			t.Fatalf("the dead instance's slots still held %v after the kill, more than the %v hold", time.Since(killed), hold)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("slots of the killed instance free %v after SIGKILL (hold %v)", freed.Round(time.Millisecond), hold)
}

// readmeConcurrencyExample is the Caddyfile of the README's Concurrency
// section.
func readmeConcurrencyExample(t *testing.T) string {
	t.Helper()
	block := readmeExample(t, "Concurrency")
	if !strings.HasPrefix(block, "llm.example.com {") || !strings.Contains(block, "reverse_proxy localhost:8000\n") {
		t.Fatalf("the example is not the site expected:\n%s", block)
	}
	return block
}

// TestConcurrentReadmeExampleRunsAsWritten: the README's Caddyfile, with
// its site address, its upstream and a redis line replaced, holds at
// most 4 generations of one API key in flight, refuses the rest with
// Retry-After 1, and lets another key have its own 4.
func TestConcurrentReadmeExampleRunsAsWritten(t *testing.T) {
	srv := redistest.Start(t)
	up := &countingUpstream{release: make(chan struct{})}
	up.hold.Store(true)
	upstream := httptest.NewServer(up)
	defer upstream.Close()
	site := strings.Replace(readmeConcurrencyExample(t), "llm.example.com {", "http://127.0.0.1:{{http_port}} {", 1)
	site = strings.Replace(site, "reverse_proxy localhost:8000", "reverse_proxy "+strings.TrimPrefix(upstream.URL, "http://"), 1)
	site = strings.Replace(site, "\t\tlimit requests", "\t\tredis "+srv.Addr+"\n\t\tlimit requests", 1)
	inst := caddyproc.Start(t, caddyproc.Caddyfile(site))
	client := caddyClient(t)
	get := func(key string) *http.Response {
		req, _ := http.NewRequest(http.MethodGet, inst.URL+"/v1/chat/completions", nil)
		req.Header.Set("Authorization", key)
		resp, err := client.Do(req)
		if err != nil {
			t.Errorf("GET: %v", err)
			return nil
		}
		resp.Body.Close()
		return resp
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() { defer wg.Done(); get("Bearer sk-1") }()
	}
	eventually(t, 5*time.Second, "4 generations upstream", func() bool { return up.now.Load() == 4 })
	resp := get("Bearer sk-1")
	if resp == nil || resp.StatusCode != 429 || resp.Header.Get("Retry-After") != "1" {
		t.Fatalf("a fifth generation: %v, want 429 with Retry-After 1", resp)
	}
	wg.Add(1)
	go func() { defer wg.Done(); get("Bearer sk-2") }()
	eventually(t, 5*time.Second, "another key's generation upstream", func() bool { return up.now.Load() == 5 })
	close(up.release)
	wg.Wait()
	if resp := get("Bearer sk-1"); resp == nil || resp.StatusCode != 200 {
		t.Fatalf("after the generations ended: %v, want 200", resp)
	}
}

func TestConcurrentShadowModeNeverRefusesAndHoldsNoSlotItWouldRefuse(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		shadow
		concurrent gen 1`)
	hd := newHolder()
	done := startHeld(t, context.Background(), h, hd, "k")
	second := startHeld(t, context.Background(), h, hd, "k") // would be refused: passes
	rdb := srv.Client(t)
	if n := rdb.ZCard(context.Background(), slotKey(t, h, "gen", "k")).Val(); n != 1 {
		t.Errorf("%d slots held with one admitted and one shadow-denied request, want 1", n)
	}
	close(hd.letGo)
	if s1, s2 := <-done, <-second; s1 != 200 || s2 != 200 {
		t.Fatalf("statuses %d, %d; want 200 in shadow mode", s1, s2)
	}
	eventually(t, time.Second, "the slot released", func() bool {
		return rdb.ZCard(context.Background(), slotKey(t, h, "gen", "k")).Val() == 0
	})
}

func TestConcurrentChargedResponseReleasesItsSlotAfterSettling(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		limit requests 1000 1000 {
			charge_status 2xx
		}
		concurrent gen 1`)
	hd := newHolder()
	done := startHeld(t, context.Background(), h, hd, "k")
	if status, _ := serve(context.Background(), h, "k"); status != 429 {
		t.Fatalf("with the slot held on the charged path: %d, want 429", status)
	}
	close(hd.letGo)
	if status := <-done; status != 200 {
		t.Fatalf("the charged request: %d", status)
	}
	if status, _ := serve(context.Background(), h, "k"); status != 200 {
		t.Fatalf("after the charged response ended: %d, want 200 (the slot released)", status)
	}
}

// On a Cluster, a concurrent limit's slots live in the hash slot of its
// key template's group; when a later group refuses, the slots an earlier
// group took are released, as tokens are given back.
func TestConcurrentOnClusterAllOrNothingAcrossGroups(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	addrs := strings.Join(c.Addrs, " ")
	ctx := context.Background()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs})
	defer cc.Close()

	t.Run("the handler's own rate and a concurrent limit", func(t *testing.T) {
		h := caddyfileHandler(t, fmt.Sprintf(`rate_limit 0.001 3 {
	zone cown
	key {http.request.header.X-Key}
	concurrent gen 1
	redis %s {
		timeout 2s
	}
}`, addrs))
		hd := newHolder()
		done := startHeld(t, ctx, h, hd, "k")
		for range 3 {
			if status, _ := serve(ctx, h, "k"); status != 429 {
				t.Fatalf("with the slot held: %d, want 429", status)
			}
		}
		close(hd.letGo)
		<-done
		status, header := serve(ctx, h, "k")
		if status != 200 || header.Get("X-RateLimit-Remaining") != "1" {
			t.Fatalf("after the release: %d with %s tokens left, want 200 with 1 (refused requests' tokens given back)",
				status, header.Get("X-RateLimit-Remaining"))
		}
	})

	t.Run("a later group refuses: the slot goes back", func(t *testing.T) {
		h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone cgroups
	key {http.request.header.X-Key}
	limit a 1000 1000
	limit tenant 0.001 1 {
		key {http.request.method}
	}
	concurrent gen 5
	redis %s {
		timeout 2s
	}
}`, addrs))
		if status, _ := serve(ctx, h, "k"); status != 200 {
			t.Fatalf("first request: %d, want 200", status)
		}
		slots := slotKey(t, h, "gen", "k")
		for range 3 {
			if status, _ := serve(ctx, h, "k"); status != 429 {
				t.Fatalf("with the tenant's token spent: %d, want 429", status)
			}
			if n := cc.ZCard(ctx, slots).Val(); n != 0 {
				t.Fatalf("%d slot(s) held after the tenant group refused, want 0", n)
			}
		}
	})
}

// Slots from a placeholder, per request (plans): here the key itself
// says how many, so "2" has two and "unlimited" is exempt.
func TestConcurrentSlotsFromPlaceholderPerRequest(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen {http.request.header.X-Key}`)
	hd := newHolder()
	ctx := context.Background()
	a, b := startHeld(t, ctx, h, hd, "2"), startHeld(t, ctx, h, hd, "2")
	if status, _ := serve(ctx, h, "2"); status != 429 {
		t.Fatalf("a third with 2 slots: %d, want 429", status)
	}
	var exempt []<-chan int
	for range 3 {
		exempt = append(exempt, startHeld(t, ctx, h, hd, "unlimited"))
	}
	if status, _ := serve(ctx, h, "x"); status != 500 {
		t.Errorf("slots 'x' from the request: %d, want 500 (a config mistake, no slot taken)", status)
	}
	close(hd.letGo)
	for _, done := range append(exempt, a, b) {
		if status := <-done; status != 200 {
			t.Errorf("held request: %d, want 200", status)
		}
	}
}

// Releases that meet in one batch go out as one script call
// (slotQueue.calls); each frees its own slot.
func TestConcurrentReleasesMergedInABatchFreeEachSlot(t *testing.T) {
	srv := redistest.Start(t)
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen 1`)
	hd := newHolder()
	ctx := context.Background()
	var done []<-chan int
	for i := range 40 {
		done = append(done, startHeld(t, ctx, h, hd, fmt.Sprint("k", i)))
	}
	close(hd.letGo) // 40 releases at once
	for _, d := range done {
		if status := <-d; status != 200 {
			t.Fatalf("held request: %d", status)
		}
	}
	rdb := srv.Client(t)
	eventually(t, 2*time.Second, "every slot free", func() bool {
		for i := range 40 {
			if rdb.ZCard(ctx, slotKey(t, h, "gen", fmt.Sprint("k", i))).Val() != 0 {
				return false
			}
		}
		return true
	})
	for i := range 40 {
		if status, _ := serve(ctx, h, fmt.Sprint("k", i)); status != 200 {
			t.Fatalf("key k%d after the releases: %d, want 200", i, status)
		}
	}
}

// TestConcurrentAndQuotaAreAllOrNothing: a quota and a concurrent limit
// decided in one script call: a request the full slot refuses uses none
// of the quota, and one the used-up quota refuses takes no slot.
func TestConcurrentAndQuotaAreAllOrNothing(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		quota day 3 per day
		concurrent gen 1`)
	quotaKey, slots := limitKey(t, h, "day", "k"), slotKey(t, h, "gen", "k")
	used := func() string {
		state, err := rdb.Get(ctx, quotaKey).Result()
		if err != nil {
			t.Fatalf("reading the quota: %v", err)
		}
		return strings.Fields(state)[0]
	}
	hd := newHolder()
	done := startHeld(t, ctx, h, hd, "k") // 1 of the quota, the slot
	for range 3 {
		if status, _ := serve(ctx, h, "k"); status != 429 {
			t.Fatalf("with the slot held: %d, want 429", status)
		}
	}
	if u := used(); u != "1" {
		t.Fatalf("the quota used %s after the slot refused 3 requests, want 1: a refused request used it", u)
	}
	close(hd.letGo)
	<-done
	eventually(t, time.Second, "the slot released", func() bool { return rdb.ZCard(ctx, slots).Val() == 0 })
	for i := range 2 {
		if status, _ := serve(ctx, h, "k"); status != 200 {
			t.Fatalf("request %d of the quota's 3: %d, want 200", i+2, status)
		}
	}
	eventually(t, time.Second, "the slots released", func() bool { return rdb.ZCard(ctx, slots).Val() == 0 })
	for range 3 {
		status, header := serve(ctx, h, "k")
		if status != 429 || header.Get("Retry-After") == "1" {
			t.Fatalf("with the quota used up: %d, Retry-After %q; want 429 until the day's end", status, header.Get("Retry-After"))
		}
		if n := rdb.ZCard(ctx, slots).Val(); n != 0 {
			t.Fatalf("a request the quota refused holds %d slot(s), want 0", n)
		}
	}
	if u := used(); u != "3" {
		t.Errorf("the quota used %s, want 3", u)
	}
}

// A config unloaded while its requests still run keeps its limiter until
// no call has come for redisstore.LingerIdle: a release is such a call, so the
// release of a request that ends later than redisstore.LingerIdle after the last
// take, but within redisstore.LingerIdle of another release, still reaches Redis
// (the release queue did not count as calls: the limiter closed under
// the second release, whose slot stayed taken for its whole hold).
func TestConcurrentReleasesKeepAnUnloadedLimiterOpenForRequestsStillEnding(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	first, second := newHolder(), newHolder()
	var firstDone, secondDone <-chan int
	var firstKey, secondKey string
	var admitted time.Time
	t.Run("old config", func(t *testing.T) {
		h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
			concurrent gen 1`)
		firstKey, secondKey = slotKey(t, h, "gen", "a"), slotKey(t, h, "gen", "b")
		firstDone = startHeld(t, ctx, h, first, "a")
		secondDone = startHeld(t, ctx, h, second, "b")
		admitted = time.Now()
	}) // unloaded here; its two requests go on
	time.Sleep(time.Until(admitted.Add(redisstore.LingerIdle * 7 / 10)))
	close(first.letGo)
	<-firstDone
	time.Sleep(time.Until(admitted.Add(redisstore.LingerIdle * 14 / 10)))
	close(second.letGo)
	<-secondDone
	eventually(t, time.Second, "the first request's slot released", func() bool { return rdb.Exists(ctx, firstKey).Val() == 0 })
	eventually(t, time.Second, "the second request's slot released, 0.7s after the first release", func() bool {
		return rdb.Exists(ctx, secondKey).Val() == 0
	})
}

func TestConcurrentBurstOfLongRequestsRenewsEverySlot(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen 10000 {
			hold 1s
		}`)
	logs := observeLogs(h, zapcore.WarnLevel)
	l := h.limits[len(h.limits)-1]
	key := slotKey(t, h, "gen", "k")
	// More slots than the batcher's queue holds calls, taken within one
	// tick of the renewals: all of them are due on the same tick. Taken
	// with a first hold of 3 s, not the limit's 1 s: the holds below start
	// their renewals once the pipeline is done, which a loaded machine may
	// make much later than the first slots were taken; each renewal then
	// gives a slot the limit's hold.
	const n = redisbatch.QueueLength + 1000
	ids := make([]string, n)
	pipe := rdb.Pipeline()
	for i := range ids {
		ids[i] = fmt.Sprintf("burst:%d", i)
		pipe.Eval(ctx, scriptSource, []string{key}, "c", "10000", ids[i], "3000000")
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	holds := make([]limit.Holding, n)
	for i := range ids {
		buckets := []limit.Bucket{{Limit: l, Key: key, Args: [3]any{"c", "10000", &ids[i]}}}
		holds[i] = holdSlots(h, buckets)
	}
	time.Sleep(3300 * time.Millisecond) // past the first hold: every slot was renewed, or it expired
	left, err := rdb.Eval(ctx, peekSlotsSource, []string{key}).Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	// Every slot kept is the promise, not that no renewal call failed: a
	// slot whose renewal failed on a loaded machine (a warning) is renewed
	// again before its hold ends.
	if len(left) != n {
		t.Errorf("%d of %d slots live past their first hold, want all renewed", len(left), n)
	}
	// A renewal that failed (its pipeline later than the timeout, on a
	// loaded machine) was tried again at the next tick: what counts is
	// that every slot was kept.
	if got := countLogs(logs, "Redis failed while renewing"); got > 0 {
		t.Logf("%d renewal failures logged (each retried at the next tick)", got)
	}
	for _, hold := range holds {
		hold.Release()
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		left, err = rdb.Eval(ctx, peekSlotsSource, []string{key}).Int64Slice()
		if err == nil && len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d slots still held 5s after every request released its own (%v)", len(left), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Releases lost to Redis (gone) are told by each zone whose requests
// they are, once: a warning each, throttled, the retries of each release
// until its slot would have expired (hold 1s) included. (That they are
// then pending no more is internal/redisstore's
// TestReleasesLostToRedisAreNotLeftPending.)
func TestConcurrentReleasesLostToRedisAreToldByEachZone(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	zones := []*Handler{
		concurrentHandler(t, srv, "zone lost-a\nkey {http.request.header.X-Key}\nconcurrent gen 10 {\nhold 1s\n}"),
		concurrentHandler(t, srv, "zone lost-b\nkey {http.request.header.X-Key}\nconcurrent gen 10 {\nhold 1s\n}"),
	}
	l := zones[0].limiter
	if zones[1].limiter != l {
		t.Fatal("two zones on the same redis settings do not share a limiter")
	}
	var logs []*observer.ObservedLogs
	var held []<-chan int
	hd := newHolder()
	for _, h := range zones {
		logs = append(logs, observeLogs(h, zapcore.WarnLevel))
		for _, key := range []string{"k1", "k2", "k3"} {
			held = append(held, startHeld(t, ctx, h, hd, key))
		}
	}
	srv.Kill(t) // the releases of all six fail, in one call or a few
	close(hd.letGo)
	for _, done := range held {
		<-done
	}
	eventually(t, 5*time.Second, "each zone told of its lost releases", func() bool {
		for i := range zones {
			if countLogs(logs[i], "releasing concurrency slots") == 0 {
				return false
			}
		}
		return true
	})
	// Each failed release is sent again until its slot would have expired
	// (hold 1s): past that, every retry has failed too.
	time.Sleep(1500 * time.Millisecond)
	for i, h := range zones {
		if n := countLogs(logs[i], "releasing concurrency slots"); n != 1 {
			t.Errorf("zone %s: %d warnings of its lost releases, want 1", h.Zone, n)
		}
	}
}

// requestBuckets are the buckets h resolves for a request of key.
func requestBuckets(t *testing.T, h *Handler, key string) []limit.Bucket {
	t.Helper()
	r, _ := newRequest("192.0.2.1", key)
	buckets, _, err := h.resolveBuckets(r, r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer), nil)
	if err != nil || len(buckets) == 0 {
		t.Fatalf("buckets of %s: %v, %v", key, buckets, err)
	}
	return buckets
}

// With store memory, a request admitted before an admin DELETE of its
// key's slots frees nothing when it ends, even when the DELETE and
// another request's take came between its own take and the start of its
// hold: its release belongs to the count it was taken from.
func TestConcurrentMemoryReleaseFromBeforeAResetFreesNoSlotTakenAfterIt(t *testing.T) {
	h := caddyfileHandler(t, `rate_limit {
		store memory
		key {http.request.header.X-Key}
		concurrent gen 1
	}`)
	s := h.memory
	take := func() []limit.Bucket {
		t.Helper()
		buckets := requestBuckets(t, h, "k")
		if allowed, err := s.Take(time.Now(), buckets); !allowed || err != nil {
			t.Fatalf("take: %v, %v; want admitted", allowed, err)
		}
		return buckets
	}
	first := take()
	key := first[len(first)-1].Key
	s.Reset([]string{key}) // DELETE, between the first take and its hold
	second := take()
	firstHold := s.Hold(first)
	secondHold := s.Hold(second)
	defer secondHold.Release()
	firstHold.Release()
	if n := s.InUse(key); n != 1 {
		t.Fatalf("%d slot(s) in use after the request admitted before the reset ended, want 1: its release freed the slot of the request admitted after",
			n)
	}
	if allowed, _ := s.Take(time.Now(), requestBuckets(t, h, "k")); allowed {
		t.Fatal("a third request admitted while the second holds the only slot")
	}
}

// A take whose reply is lost may have taken its slot in Redis: the reply
// was cut, or came after the timeout. The request follows on_error
// (allow: it is served without a slot), and the slot it may hold is
// released at once, not left taken for its hold.
func TestConcurrentSlotOfATakeWhoseReplyIsLostIsReleased(t *testing.T) {
	for _, tc := range []struct {
		name string
		// lose makes the next take's reply lost; the take has run, if
		// at all, once ran returns.
		lose func(t *testing.T, rdb *redis.Client, p *redisProxy) (ran func())
	}{
		{"the reply cut", func(t *testing.T, _ *redis.Client, p *redisProxy) func() {
			p.cutting.Store(true)
			return func() { p.cutting.Store(false) }
		}},
		{"the reply after the timeout", func(t *testing.T, _ *redis.Client, p *redisProxy) func() {
			const latency = 500 * time.Millisecond // each way, against a timeout of 300ms
			p.latency.Store(int64(latency))
			sent := time.Now()
			return func() {
				time.Sleep(time.Until(sent.Add(latency + 100*time.Millisecond)))
				p.latency.Store(0)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.Start(t)
			rdb := srv.Client(t)
			ctx := context.Background()
			proxy := startRedisProxy(t, srv.Addr)
			h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
				key {http.request.header.X-Key}
				on_error allow
				concurrent gen 1 {
					hold 30s
				}
				redis %s {
					timeout 300ms
				}
			}`, proxy.addr))
			key := slotKey(t, h, "gen", "k")
			// Connections open, the script loaded: the take and its
			// release then need no new connection, whose handshake would
			// meet the lost replies.
			var wg sync.WaitGroup
			for i := range 20 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if status, _ := serve(ctx, h, fmt.Sprint("warm", i)); status != 200 {
						t.Errorf("warming: %d", status)
					}
				}()
			}
			wg.Wait()
			eventually(t, 2*time.Second, "the first requests' slots released", func() bool {
				return rdb.DBSize(ctx).Val() == 0
			})
			// The proxy loses the reply of the next call; on a loaded
			// machine that call may be another than the take (a late
			// release of the warming), so the take is tried again, up to
			// three times, until its own reply was lost.
			// The take failed when on_error answered it: Remaining -1.
			// (Not its warning: warnings are throttled, and a failed
			// release in the same window suppresses the take's.)
			for attempt := 1; ; attempt++ {
				ran := tc.lose(t, rdb, proxy)
				status, header := serve(ctx, h, "k")
				if status != 200 {
					t.Fatalf("with the reply lost: %d, want 200 (on_error allow)", status)
				}
				ran()
				if header.Get("X-RateLimit-Remaining") == "-1" {
					break
				}
				if attempt == 3 {
					t.Fatalf("the take answered by Redis %d times (X-RateLimit-Remaining %q), want its reply lost", attempt, header.Get("X-RateLimit-Remaining"))
				}
				eventually(t, 5*time.Second, "the slot of a take that was answered released", func() bool {
					return rdb.DBSize(ctx).Val() == 0
				})
			}
			took := eventually(t, 5*time.Second, "the lost take's slot free (hold 30s)", func() bool {
				return rdb.ZCard(ctx, key).Val() == 0 && rdb.Exists(ctx, key).Val() == 0
			})
			if status, _ := serve(ctx, h, "k"); status != 200 {
				t.Fatalf("the next request: %d, want 200", status)
			}
			t.Logf("the lost take's slot free after %v", took.Round(time.Millisecond))
		})
	}
}

// A config unloaded while its requests run, replaced by one with other
// redis settings (so another limiter): the old limiter lives while its
// requests hold slots, renewing them, and their releases reach Redis.
// (It closed redisstore.LingerIdle after its last call: the renewals stopped, the
// slot expired under the running request and the new config admitted a
// second one, beyond concurrent 1.)
func TestConcurrentSlotsOfAnUnloadedConfigLiveUntilTheirRequestsEnd(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	// Renewed every third of a hold, more than redisstore.LingerIdle apart: the
	// renewals alone do not keep a closing limiter open.
	const hold = 4 * time.Second
	config := func(timeout string) string {
		return fmt.Sprintf(`rate_limit {
			zone reloaded
			key {http.request.header.X-Key}
			concurrent gen 1 {
				hold 4s
			}
			redis %s {
				timeout %s
			}
		}`, srv.Addr, timeout)
	}
	hd := newHolder()
	var done <-chan int
	var old *redisstore.Client
	t.Run("old config", func(t *testing.T) {
		h := caddyfileHandler(t, config("500ms"))
		old = h.limiter
		done = startHeld(t, ctx, h, hd, "k")
	}) // unloaded here; its request goes on
	h := caddyfileHandler(t, config("400ms"))
	if h.limiter == old {
		t.Fatal("the new config shares the old one's limiter")
	}
	key := slotKey(t, h, "gen", "k")
	for start := time.Now(); time.Since(start) < hold+time.Second; time.Sleep(50 * time.Millisecond) {
		if status, _ := serve(ctx, h, "k"); status != 429 {
			t.Fatalf("%v after the reload, the new config admitted a request while the old config's holds the only slot: %d, want 429",
				time.Since(start).Round(time.Millisecond), status)
		}
	}
	close(hd.letGo)
	if status := <-done; status != 200 {
		t.Fatalf("the old config's request: %d, want 200", status)
	}
	// Renewed every third of its hold, the slot had more than two
	// seconds left: gone sooner, it was released.
	eventually(t, time.Second, "the old config's slot released", func() bool { return rdb.Exists(ctx, key).Val() == 0 })
	if status, _ := serve(ctx, h, "k"); status != 200 {
		t.Fatalf("after the old config's request ended: %d, want 200", status)
	}
}

// A request that ends while its slot's renewal is on its way: the
// renewal, which may bring a gone slot back, never does so after the
// release, so the slot stays free. Requests end one after another around
// the renewals' tick, in numbers.
func TestConcurrentSlotReleasedDuringItsRenewalStaysFree(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	const n = 2000
	h := concurrentHandler(t, srv, `key {http.request.header.X-Key}
		concurrent gen 2000 {
			hold 3s
		}`)
	l := h.limits[len(h.limits)-1]
	key := slotKey(t, h, "gen", "k")
	ids := make([]string, n)
	pipe := rdb.Pipeline()
	for i := range ids {
		ids[i] = fmt.Sprintf("ending:%d", i)
		pipe.Eval(ctx, scriptSource, []string{key}, "c", "2000", ids[i], "3000000")
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	holds := make([]limit.Holding, n)
	for i := range ids {
		buckets := []limit.Bucket{{Limit: l, Key: key, Args: [3]any{"c", "2000", &ids[i]}}}
		holds[i] = holdSlots(h, buckets)
	}
	// Due a third of a hold after they were taken; they end from a tick
	// before that to a tick after.
	time.Sleep(time.Second - 2*redisstore.RenewTick)
	for i, hold := range holds {
		hold.Release()
		if i%10 == 9 {
			time.Sleep(4 * redisstore.RenewTick * 10 / n)
		}
	}
	eventually(t, 5*time.Second, "every release landed", func() bool { return rdb.ZCard(ctx, key).Val() == 0 })
	time.Sleep(2 * redisstore.RenewTick) // a renewal still on its way lands
	if left := rdb.ZCard(ctx, key).Val(); left != 0 {
		t.Fatalf("%d of %d slots held after every request released its own: renewals brought them back", left, n)
	}
}

// A renewal that fails (Redis unreachable for a moment) is tried again at
// the next tick of the renewals, not a third of a hold later: the slot
// had two thirds of its hold left when it failed, and a second failure
// in a row would have cost it.
func TestConcurrentFailedRenewalIsRetriedAtTheNextTick(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	proxy := startRedisProxy(t, srv.Addr)
	const hold = 6 * time.Second
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
		key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 6s
		}
		redis %s {
			timeout 300ms
		}
	}`, proxy.addr))
	logs := observeLogs(h, zapcore.WarnLevel)
	key := slotKey(t, h, "gen", "k")
	left := func() time.Duration {
		v, err := rdb.Eval(ctx, peekSlotsSource, []string{key}).Int64Slice()
		if err != nil || len(v) != 1 {
			t.Fatalf("the held slot: %v, %v", v, err)
		}
		return time.Duration(v[0]) * time.Microsecond
	}
	hd := newHolder()
	taken := time.Now()
	done := startHeld(t, ctx, h, hd, "k")
	defer func() { close(hd.letGo); <-done }()
	time.Sleep(time.Until(taken.Add(hold/3 - hold/12))) // a little before the first renewal
	proxy.refusing.Store(true)
	eventually(t, 3*time.Second, "a renewal failed", func() bool { return countLogs(logs, "Redis failed while renewing") > 0 })
	proxy.refusing.Store(false)
	before := left()
	// A third of a hold later would be 2s.
	took := eventually(t, time.Second, "the slot renewed after Redis came back", func() bool { return left() > before+hold/6 })
	t.Logf("renewed %v after Redis came back (renewal ticks every %v; %v of the hold left before)",
		took.Round(time.Millisecond), redisstore.RenewTick, before.Round(time.Millisecond))
}

// Many slots renew on one Redis server without taking the deadline of
// the admissions that share their pipelines: on a slow link (20 ms for
// every 64 KiB read), renewals of 20,000 slots (4.6 MB) sent in one go
// held the link about 1.4 s, longer than the timeout, and admissions with
// them fell to on_error, as did the renewals; 512 of them take 40 ms. The
// timeout (1 s) leaves a loaded machine room and that one-go send none.
func TestConcurrentRenewalsOfManySlotsNeverTakeAnAdmissionsDeadline(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	proxy := startRedisProxy(t, srv.Addr)
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
		key {http.request.header.X-Key}
		concurrent gen 20000 {
			hold 3s
		}
		redis %s {
			timeout 1s
		}
	}`, proxy.addr))
	logs := observeLogs(h, zapcore.WarnLevel)
	l := h.limits[len(h.limits)-1]
	const n = 20000
	client := strings.Repeat("c", 100) // a long key, as an API key is
	key := slotKey(t, h, "gen", client)
	ids := make([]string, n)
	pipe := rdb.Pipeline()
	for i := range ids {
		ids[i] = fmt.Sprintf("%0100d", i)
		pipe.Eval(ctx, scriptSource, []string{key}, "c", "20000", ids[i], "3000000")
		if pipe.Len() == 1000 || i == n-1 { // in parts, within the client's write timeout on a loaded machine
			if _, err := pipe.Exec(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	holds := make([]limit.Holding, n)
	for i := range ids {
		buckets := []limit.Bucket{{Limit: l, Key: key, Args: [3]any{"c", "20000", &ids[i]}}}
		holds[i] = holdSlots(h, buckets)
	}
	proxy.latency.Store(int64(20 * time.Millisecond))
	// Admissions of other clients, 8 at a time, for two holds.
	var admitted atomic.Int64
	stop := make(chan struct{})
	var served sync.WaitGroup
	for c := range 8 {
		served.Add(1)
		go func() {
			defer served.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if status, _ := serve(ctx, h, fmt.Sprint("other", c, ":", i%50)); status == 200 {
					admitted.Add(1)
				}
			}
		}()
	}
	time.Sleep(6200 * time.Millisecond)
	close(stop)
	served.Wait()
	proxy.latency.Store(0)
	live, err := rdb.Eval(ctx, peekSlotsSource, []string{key}).Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d admissions of other clients meanwhile; %d of %d slots live", admitted.Load(), len(live), n)
	if len(live) != n {
		t.Errorf("%d of %d slots live past their first hold, want all renewed", len(live), n)
	}
	if got := countLogs(logs, "following on_error"); got > 0 {
		t.Errorf("%d admissions fell to on_error while the renewals ran, want none", got)
	}
	for _, hold := range holds {
		hold.Release()
	}
	eventually(t, 5*time.Second, "every slot released", func() bool { return rdb.Exists(ctx, key).Val() == 0 })
}

// On a Redis Cluster, many long requests of many clients at once: their
// renewals and releases go in calls per hash slot through the batcher's
// pipelines, where a call per request on the same tick overflowed its
// queue ("too many requests waiting for Redis"): slots were lost while
// their requests ran, and others stayed taken after they ended.
func TestConcurrentBurstOfLongRequestsOnClusterRenewsAndReleasesEverySlot(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	cc := c.Client(t)
	ctx := context.Background()
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	key {http.request.header.X-Key}
	concurrent gen 4 {
		hold 3s
	}
	redis %s {
		timeout 1s
	}
}`, strings.Join(c.Addrs, " ")))
	logs := observeLogs(h, zapcore.WarnLevel)
	l := h.limits[len(h.limits)-1]
	const n = redisbatch.QueueLength + 2000
	keys, ids := make([]string, n), make([]string, n)
	pipe := cc.Pipeline()
	for i := range n {
		keys[i], ids[i] = slotKey(t, h, "gen", fmt.Sprint("client", i/2)), fmt.Sprint("burst:", i) // two requests a client
		pipe.Eval(ctx, scriptSource, []string{keys[i]}, "c", "4", ids[i], "3000000")
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	for _, key := range keys[:20] {
		if want := cc.ClusterKeySlot(ctx, key).Val(); int64(redisbatch.Slot(key)) != want {
			t.Fatalf("redisbatch.Slot(%q) = %d, the Cluster says %d", key, redisbatch.Slot(key), want)
		}
	}
	holds := make([]limit.Holding, n)
	for i := range n {
		buckets := []limit.Bucket{{Limit: l, Key: keys[i], Args: [3]any{"c", "4", &ids[i]}}}
		holds[i] = holdSlots(h, buckets)
	}
	live := func() int {
		pipe := cc.Pipeline()
		cmds := make([]*redis.Cmd, 0, n/2)
		for i := 0; i < n; i += 2 {
			cmds = append(cmds, pipe.Eval(ctx, peekSlotsSource, []string{keys[i]}))
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
		total := 0
		for _, cmd := range cmds {
			v, _ := cmd.Int64Slice()
			total += len(v)
		}
		return total
	}
	time.Sleep(3300 * time.Millisecond) // a hold and more: every slot renewed, or it expired
	if got := live(); got != n {
		t.Errorf("%d of %d slots live a hold after their requests took them, want all renewed", got, n)
	}
	for _, hold := range holds {
		hold.Release()
	}
	// Renewed every second, a slot not released lives on for two.
	eventually(t, 1500*time.Millisecond, "every slot released", func() bool { return live() == 0 })
	if got := countLogs(logs, "Redis failed while renewing"); got > 0 {
		t.Logf("%d renewal or release failures logged", got)
	}
}

// A take that never reached Redis (its connection was refused) took no
// slot: no release follows it, only the take's own warning.
func TestConcurrentTakeRefusedAConnectionSendsNoRelease(t *testing.T) {
	h := caddyfileHandler(t, `rate_limit {
		key {http.request.header.X-Key}
		on_error allow
		concurrent gen 1
		redis `+deadRedis+`
	}`)
	logs := observeLogs(h, zapcore.WarnLevel)
	h.redisWarns.Every = 0 // every failure told
	if status, _ := serve(context.Background(), h, "k"); status != 200 {
		t.Fatalf("with Redis refusing connections: %d, want 200 (on_error allow)", status)
	}
	time.Sleep(100 * time.Millisecond) // a release queued would have failed by now
	if n := countLogs(logs, "releasing concurrency slots"); n != 0 {
		t.Errorf("%d warnings of a failed release after a take that never reached Redis, want 0", n)
	}
	if n := countLogs(logs, "following on_error"); n != 1 {
		t.Errorf("%d warnings of the failed take, want 1", n)
	}
}

// A release whose call fails, here sent on a connection gone silent so
// that it never reaches Redis, is tried again at the renewals' next tick
// (on a new connection): the slot is free well before its hold of 30s.
// (A release was sent once; after a failure the slot waited out its
// hold.)
func TestConcurrentSlotWhoseReleaseFailsIsReleasedByARetry(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	proxy := startRedisProxy(t, srv.Addr)
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
		key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 30s
		}
		redis %s {
			timeout 300ms
		}
	}`, proxy.addr))
	logs := observeLogs(h, zapcore.WarnLevel)
	key := slotKey(t, h, "gen", "k")
	hd := newHolder()
	done := startHeld(t, ctx, h, hd, "k")
	if n := rdb.ZCard(ctx, key).Val(); n != 1 {
		t.Fatalf("%d slots held, want 1", n)
	}
	proxy.blackholeOpen() // the release goes out on a connection that swallows it
	close(hd.letGo)
	if status := <-done; status != 200 {
		t.Fatalf("the held request: %d, want 200", status)
	}
	eventually(t, 5*time.Second, "the release's failure told", func() bool {
		return countLogs(logs, "releasing concurrency slots") > 0
	})
	took := eventually(t, 5*time.Second, "the slot free after its release failed (hold 30s)", func() bool {
		return rdb.Exists(ctx, key).Val() == 0
	})
	if status, _ := serve(ctx, h, "k"); status != 200 {
		t.Fatalf("the next request: %d, want 200", status)
	}
	// That the retried release is then pending no more is
	// internal/redisstore's TestReleaseRetriedAfterAFailureIsNotLeftPending.
	t.Logf("the slot free %v after its release failed", took.Round(time.Millisecond))
}

// A take held on its way past its timeout (a TCP retransmission: Linux
// waits at least 200 ms before it resends): the request follows
// on_error, and the release of the slot that the take may have taken,
// sent at once on another connection, lands first and frees nothing;
// then the take lands and takes the slot. That release is sent again at
// each tick of the renewals until it frees the slot: the slot is free a
// tick or two after the take landed, not a hold (10 s) later. (It was
// sent once: the slot stayed taken for its hold, with nothing in flight,
// and every request of the client was refused.)
func TestConcurrentTakeThatLandsAfterItsReleaseLeavesNoSlotTaken(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	proxy := startRedisProxy(t, srv.Addr)
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
		key {http.request.header.X-Key}
		on_error allow
		concurrent gen 1 {
			hold 10s
		}
		redis %s {
			timeout 200ms
		}
	}`, proxy.addr))
	key := slotKey(t, h, "gen", "k")
	if status, _ := serve(ctx, h, "warm"); status != 200 { // the script loaded
		t.Fatalf("warming: %d", status)
	}
	eventually(t, 2*time.Second, "the warming request's slot released", func() bool {
		return rdb.DBSize(ctx).Val() == 0
	})
	proxy.delayMatching(takeScript.SHA(), 600*time.Millisecond)
	status, header := serve(ctx, h, "k")
	if status != 200 || header.Get("X-RateLimit-Remaining") != "-1" {
		t.Fatalf("the held take: %d, X-RateLimit-Remaining %q, want 200 and -1 (on_error allow)", status, header.Get("X-RateLimit-Remaining"))
	}
	eventually(t, 3*time.Second, "the held take passed on to Redis", func() bool { return proxy.delayPassed.Load() == 1 })
	proxy.delayMatching("", 0)
	took := eventually(t, time.Second, "the late take's slot free (hold 10s)", func() bool { return rdb.Exists(ctx, key).Val() == 0 })
	for i := range 5 {
		if status, _ := serve(ctx, h, "k"); status != 200 {
			t.Fatalf("request %d after the late take's slot was freed: %d, want 200", i+1, status)
		}
	}
	t.Logf("the late take's slot free %v after it reached Redis", took.Round(time.Millisecond))
}

// A renewal held on its way past its timeout: the request has ended
// meanwhile, and its release, sent once the renewal failed, lands first
// on another connection; then the renewal lands. A renewal only extends
// a live slot, so it does not bring the released one back. (It did,
// into the free slot, for a whole hold: every request of the client
// refused with nothing in flight.)
func TestConcurrentRenewalThatLandsAfterTheReleaseNeverBringsTheSlotBack(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	proxy := startRedisProxy(t, srv.Addr)
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
		key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 3s
		}
		redis %s {
			timeout 200ms
		}
	}`, proxy.addr))
	key := slotKey(t, h, "gen", "k")
	if status, _ := serve(ctx, h, "warm"); status != 200 { // the scripts loaded
		t.Fatalf("warming: %d", status)
	}
	proxy.delayMatching("$5\r\nrenew\r\n", 800*time.Millisecond) // the argument, as RESP sends it
	hd := newHolder()
	done := startHeld(t, ctx, h, hd, "k")
	// The first renewal comes a third of the hold after the take.
	eventually(t, 3*time.Second, "the renewal held on its way", func() bool { return proxy.delayHeld.Load() > 0 })
	close(hd.letGo)
	if status := <-done; status != 200 {
		t.Fatalf("the held request: %d, want 200", status)
	}
	eventually(t, 3*time.Second, "the held renewal passed on to Redis", func() bool { return proxy.delayPassed.Load() > 0 })
	proxy.delayMatching("", 0)
	for start := time.Now(); time.Since(start) < time.Second; time.Sleep(50 * time.Millisecond) {
		if n := rdb.ZCard(ctx, key).Val(); n != 0 {
			t.Fatalf("%v after the late renewal reached Redis, %d slot(s) held with nothing in flight, want 0", time.Since(start).Round(time.Millisecond), n)
		}
		if status, _ := serve(ctx, h, "k"); status != 200 {
			t.Fatalf("%v after the late renewal reached Redis, a request was refused: %d, want 200", time.Since(start).Round(time.Millisecond), status)
		}
	}
}

// After a partition of 2 s, during which requests of several clients
// ended and their releases failed, each client's next requests (one
// after another) never find its own finished request's slot still taken: the releases that
// wait to be sent again count as on their way, and a refusal sends them
// at once, waits for them and asks again. (A refusal did not wait for
// them: each client's requests were refused until the next tick sent
// them.)
func TestConcurrentClientFindsNoOwnSlotTakenAfterAPartition(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	proxy := startRedisProxy(t, srv.Addr)
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
		key {http.request.header.X-Key}
		on_error allow
		concurrent gen 1 {
			hold 30s
		}
		redis %s {
			timeout 200ms
		}
	}`, proxy.addr))
	const clients = 4
	hd := newHolder()
	var done []<-chan int
	for i := range clients {
		done = append(done, startHeld(t, ctx, h, hd, fmt.Sprint("client", i)))
	}
	proxy.refusing.Store(true)
	close(hd.letGo)
	for _, d := range done {
		if status := <-d; status != 200 {
			t.Fatalf("a held request: %d, want 200", status)
		}
	}
	time.Sleep(2 * time.Second)
	for i := range clients {
		if n := rdb.ZCard(ctx, slotKey(t, h, "gen", fmt.Sprint("client", i))).Val(); n != 1 {
			t.Fatalf("client %d: %d slots held after the partition, want 1 (its release failed)", i, n)
		}
	}
	proxy.refusing.Store(false)
	// Each client sends its requests one after another until Redis has
	// admitted 20 of them (those sent while the breaker is still open
	// follow on_error).
	const want = 20
	var refused, admitted atomic.Int64
	var wg sync.WaitGroup
	ended := time.Now()
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; n < want && time.Since(ended) < 10*time.Second; {
				status, header := serve(ctx, h, fmt.Sprint("client", i))
				switch {
				case status == 429:
					refused.Add(1)
				case header.Get("X-RateLimit-Remaining") != "-1":
					admitted.Add(1)
					n++
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("in the %v after the partition: %d requests admitted by Redis, %d refused",
		time.Since(ended).Round(time.Millisecond), admitted.Load(), refused.Load())
	if refused.Load() > 0 {
		t.Errorf("%d requests refused with nothing of their clients in flight, want 0", refused.Load())
	}
	if admitted.Load() < clients*want {
		t.Errorf("%d requests admitted by Redis within 10s after the partition, want %d", admitted.Load(), clients*want)
	}
}

// On a Cluster, a request whose concurrent limit's group took its slot
// and whose later group refused gives the slot back at once; a give-back
// that fails (here Redis refuses the script on the slot's master for a
// moment) is sent again at the next tick, as a served request's release
// is, not left taken for its hold (10 s).
func TestConcurrentOnClusterSlotGivenBackAfterARefusalIsReleasedByARetry(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	cc := c.Client(t)
	clients := masterClients(t, c)
	ctx := context.Background()
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone cgiveback
	key {http.request.header.X-Key}
	limit a 1000 1000
	limit tenant 0.001 1 {
		key {http.request.method}
	}
	concurrent gen 5 {
		hold 10s
	}
	redis %s {
		timeout 3s
	}
}`, strings.Join(c.Addrs, " ")))
	tenantKey := ""
	for _, l := range h.limits {
		if l.Name == "tenant" {
			r, _ := newRequest("192.0.2.1", "k")
			rv := keys.RequestValues(r, r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer))
			tenantKey = l.Template.Key(&rv, l.KeyPrefix, l.KeySuffix)
		}
	}
	tenantMaster := masterOf(t, c, cc, clients, tenantKey)
	client, slots := "", ""
	var slotMaster *redis.Client
	for i := 0; slotMaster == nil || slotMaster == tenantMaster; i++ {
		client = fmt.Sprint("k", i)
		slots = slotKey(t, h, "gen", client)
		slotMaster = masterOf(t, c, cc, clients, slots)
	}
	if status, _ := serve(ctx, h, client); status != 200 { // takes the tenant's only token
		t.Fatalf("first request: %d, want 200", status)
	}
	eventually(t, 2*time.Second, "the first request's slot released", func() bool { return slotMaster.ZCard(ctx, slots).Val() == 0 })

	// The tenant's group answers late; meanwhile the slot's group has
	// taken the slot, and its master then refuses scripts.
	if err := tenantMaster.Do(ctx, "CLIENT", "PAUSE", "1500", "WRITE").Err(); err != nil {
		t.Fatal(err)
	}
	answered := make(chan int, 1)
	go func() {
		status, _ := serve(ctx, h, client)
		answered <- status
	}()
	eventually(t, time.Second, "the slot taken", func() bool { return slotMaster.ZCard(ctx, slots).Val() == 1 })
	if err := slotMaster.Do(ctx, "ACL", "SETUSER", "default", "-eval", "-evalsha").Err(); err != nil {
		t.Fatal(err)
	}
	if status := <-answered; status != 429 {
		t.Fatalf("with the tenant's token spent: %d, want 429", status)
	}
	if n := slotMaster.ZCard(ctx, slots).Val(); n != 1 {
		t.Fatalf("%d slots held after the give-back failed, want 1", n)
	}
	if err := slotMaster.Do(ctx, "ACL", "SETUSER", "default", "+eval", "+evalsha").Err(); err != nil {
		t.Fatal(err)
	}
	took := eventually(t, 3*time.Second, "the slot free after its give-back failed (hold 10s)", func() bool {
		return slotMaster.ZCard(ctx, slots).Val() == 0
	})
	// That the retried release is then pending no more is
	// internal/redisstore's TestReleaseRetriedAfterAFailureIsNotLeftPending.
	t.Logf("the slot free %v after Redis took scripts again", took.Round(time.Millisecond))
}
