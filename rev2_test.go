package ratelimit

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap/zapcore"
)

// A charged quota's refund belongs to the period its reservation was
// taken in: a response that began in one period and ends in the next,
// costing less than it reserved, must not give the next period tokens it
// never took, or that period admits more than its count.
func TestQuotaRefundOfAResponseFromThePreviousPeriodDoesNotRaiseTheNextPeriod(t *testing.T) {
	srv := redistest.Start(t)
	for _, store := range []string{storeRedis, storeMemory} {
		t.Run(store, func(t *testing.T) {
			h := &Handler{Zone: "quota_cross_" + store, Key: "{http.request.header.X-Key}", Store: store,
				Quotas: []Quota{{Name: "q", Count: "5", Per: "2s", RequestedTokens: "5", Charge: &Charge{Header: "X-Cost"}}}}
			if store == storeRedis {
				h.Redis = &RedisConfig{Addresses: []string{srv.Addr}}
			}
			provision(t, h)
			observeLogs(h, zapcore.InfoLevel)
			letGo := make(chan struct{})
			entered := make(chan struct{}, 1)
			held := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				entered <- struct{}{}
				<-letGo
				w.Header().Set("X-Cost", "0") // cost nothing: all 5 reserved come back
				w.WriteHeader(http.StatusOK)
			})
			full := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-Cost", "5")
				w.WriteHeader(http.StatusOK)
			})
			send := func(next http.HandlerFunc) int {
				r, w := newRequest("192.0.2.1", "a")
				return statusOf(h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { next(w, r); return nil })), w.Code)
			}
			end := startOfPeriod(t, 2*time.Second)
			done := make(chan int, 1)
			go func() { done <- send(held) }() // period P: reserves the 5
			<-entered
			time.Sleep(time.Until(end) + 50*time.Millisecond) // period P+1
			if status := send(full); status != 200 {
				t.Fatalf("first request of the new period: %d, want 200", status)
			}
			close(letGo) // P's response ends in P+1, costing 0
			if status := <-done; status != 200 {
				t.Fatalf("held request: %d", status)
			}
			time.Sleep(200 * time.Millisecond) // the settlement lands
			if time.Now().After(end.Add(1500 * time.Millisecond)) {
				t.Skip("too slow to stay in one period")
			}
			if status := send(full); status != 429 {
				t.Fatalf("the new period already admitted its count of 5, yet another request got %d, want 429: "+
					"the previous period's refund was given to this one", status)
			}
		})
	}
}

// On a Cluster, a request refused by a later slot group gets back what an
// earlier group took: that group's bucket then holds its tokens again, so
// it neither sets Retry-After (its wait after the take) nor is the bucket
// the headers describe as refusing.
func TestClusterGivenBackGroupDoesNotSetRetryAfter(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	h := quotaHandler(t, `rate_limit {
	zone giveback_retry
	key {http.request.header.X-Key}
	headers both
	limit client 0.0166 1
	limit tenant 1 1 {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		cluster
		timeout 2s
	}
}`, c.Masters[0].Addr)
	if len(h.groups) != 2 {
		t.Fatalf("%d slot groups, want 2", len(h.groups))
	}
	if a := servePolicy(h, "X-Key", "a", "X-Tenant", "t1"); a.status != 200 {
		t.Fatalf("first request: %d", a.status)
	}
	// Client b's bucket takes its one token (a minute to refill), then
	// tenant t1 refuses (a second to refill): b gets its token back.
	a := servePolicy(h, "X-Key", "b", "X-Tenant", "t1")
	if a.status != 429 {
		t.Fatalf("second request: %d, want 429 from the tenant", a.status)
	}
	if got := a.header.Get("Retry-After"); got != "1" {
		t.Errorf("Retry-After %q, want \"1\" (the tenant's wait; client b's token was given back)", got)
	}
}

// A concurrent limit and a quota of one name would share metrics series,
// RateLimit-Policy names and admin entries: refused at load, as a
// concurrent limit named like a limit is, from the Caddyfile and JSON.
func TestConcurrentNamedLikeAQuotaRefusedAtLoad(t *testing.T) {
	for _, input := range []string{
		"rate_limit {\n\tquota gen 5 per day\n\tconcurrent gen 2\n}",
		"rate_limit {\n\tconcurrent gen 2\n\tquota gen 5 per day\n}",
	} {
		if _, err := parseTestCaddyfile(input); err == nil || !strings.Contains(err.Error(), "gen") {
			t.Errorf("%q: %v, want an error naming 'gen'", input, err)
		}
	}
	h := &Handler{Quotas: []Quota{{Name: "gen", Count: "5", Per: "day"}}, Concurrent: []Concurrent{{Name: "gen", Slots: "2"}}}
	if err := h.checkLimits(); err == nil || !strings.Contains(err.Error(), "gen") {
		t.Errorf("JSON: %v, want an error naming 'gen'", err)
	}
}
