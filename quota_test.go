package ratelimit

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/calendar"
	"github.com/caddy-redis/ratelimit/internal/kind/quota"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap/zapcore"
)

// startOfPeriod waits until just after a boundary of `per <every>` (a
// multiple of it from the epoch), so that a test's requests all fall in
// one period that has most of its length left. It returns the period's
// end.
func startOfPeriod(t *testing.T, every time.Duration) time.Time {
	t.Helper()
	now := time.Now()
	end := now.Truncate(every).Add(every)
	if end.Sub(now) < every*3/4 {
		time.Sleep(time.Until(end) + 20*time.Millisecond)
		end = end.Add(every)
	}
	return end
}

// quotaHandler provisions a rate_limit directive whose %s is the Redis
// address.
func quotaHandler(t *testing.T, directive, addr string) *Handler {
	t.Helper()
	h := caddyfileHandler(t, fmt.Sprintf(directive, addr))
	observeLogs(h, zapcore.InfoLevel) // no line per decision
	return h
}

func TestQuotaAdmitsExactlyCountPerPeriodThenDeniesWithRetryAfterToTheBoundary(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_exact
	key {http.request.header.X-Key}
	headers both
	quota burst5 5 per 2s
	redis %s
}`, srv.Addr)
	end := startOfPeriod(t, 2*time.Second)
	for i := range 5 {
		if status, hdr := serve(context.Background(), h, "a"); status != 200 {
			t.Fatalf("request %d: %d, want 200 (%v)", i+1, status, hdr)
		} else if got, want := hdr.Get("X-Ratelimit-Remaining"), strconv.Itoa(4-i); got != want {
			t.Fatalf("request %d: X-RateLimit-Remaining %q, want %q", i+1, got, want)
		}
	}
	status, hdr := serve(context.Background(), h, "a")
	if status != 429 {
		t.Fatalf("request 6: %d, want 429", status)
	}
	wantRetry := int64((time.Until(end) + time.Second - 1) / time.Second)
	if got := hdr.Get("Retry-After"); got != strconv.FormatInt(wantRetry, 10) {
		t.Errorf("Retry-After %q, want %d (the seconds to the boundary)", got, wantRetry)
	}
	if got := hdr.Get("Ratelimit-Policy"); got != `"quota_exact.burst5";q=5;w=2` {
		t.Errorf("RateLimit-Policy %q", got)
	}
	if got, want := hdr.Get("Ratelimit"), fmt.Sprintf(`"quota_exact.burst5";r=0;t=%d`, wantRetry); got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
	// Another client has its own quota.
	if status, _ := serve(context.Background(), h, "b"); status != 200 {
		t.Errorf("another client: %d, want 200", status)
	}
	// The next period renews it.
	time.Sleep(time.Until(end) + 20*time.Millisecond)
	for i := range 5 {
		if status, _ := serve(context.Background(), h, "a"); status != 200 {
			t.Fatalf("next period, request %d: %d, want 200", i+1, status)
		}
	}
	if status, _ := serve(context.Background(), h, "a"); status != 429 {
		t.Fatalf("next period, request 6: %d, want 429", status)
	}
}

func TestQuotaAdmitsExactlyCountConcurrentlyAndAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	// Two handlers of one zone with Redis clients of their own (their
	// timeouts differ), as two Caddy instances have.
	const directive = `rate_limit {
	zone quota_concurrent
	key {http.request.header.X-Key}
	quota q 40 per 2s
	redis %s {
		timeout %s
	}
}`
	instances := []*Handler{quotaHandler(t, fmt.Sprintf(directive, "%s", "2s"), srv.Addr), quotaHandler(t, fmt.Sprintf(directive, "%s", "3s"), srv.Addr)}
	if instances[0].limiter == instances[1].limiter {
		t.Fatal("the two handlers share a Redis client")
	}
	startOfPeriod(t, 2*time.Second)
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for range 10 {
				if status, _ := serve(context.Background(), instances[g%2], "c"); status == 200 {
					admitted.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if got := admitted.Load(); got != 40 {
		t.Errorf("admitted %d of 80 in one period, want exactly 40", got)
	}
}

func TestQuotaAndRateLimitAreAllOrNothing(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_aon
	key {http.request.header.X-Key}
	limit slow 0.01 3
	quota daily 5 per day
	redis %s
}`, srv.Addr)
	rdb := srv.Client(t)
	quotaKey := limitKey(t, h, "daily", "a")
	// The rate limit refuses the 4th: the quota must not count it.
	for range 3 {
		if status, _ := serve(context.Background(), h, "a"); status != 200 {
			t.Fatalf("%d, want 200", status)
		}
	}
	for range 3 {
		if status, _ := serve(context.Background(), h, "a"); status != 429 {
			t.Fatalf("%d, want 429", status)
		}
	}
	if used := quotaUsedIn(t, rdb.Get(context.Background(), quotaKey).Val()); used != 3 {
		t.Fatalf("quota used %d after 3 admitted and 3 refused by the rate limit, want 3", used)
	}
	// The quota refuses: the rate limit must not lose a token.
	h2 := quotaHandler(t, `rate_limit {
	zone quota_aon2
	key {http.request.header.X-Key}
	limit slow 0.01 10
	quota daily 2 per day
	redis %s
}`, srv.Addr)
	for range 2 {
		if status, _ := serve(context.Background(), h2, "b"); status != 200 {
			t.Fatalf("%d, want 200", status)
		}
	}
	bucketKey := limitKey(t, h2, "slow", "b")
	before, _ := strconv.ParseFloat(strings.Fields(rdb.Get(context.Background(), bucketKey).Val())[0], 64)
	for range 3 {
		if status, _ := serve(context.Background(), h2, "b"); status != 429 {
			t.Fatalf("%d, want 429", status)
		}
	}
	after, _ := strconv.ParseFloat(strings.Fields(rdb.Get(context.Background(), bucketKey).Val())[0], 64)
	if after != before {
		t.Errorf("the rate limit's bucket went from %v to %v tokens over requests the quota refused, want unchanged", before, after)
	}
}

// quotaUsedIn is the tokens used that a quota's stored state says.
func quotaUsedIn(t *testing.T, state string) int64 {
	t.Helper()
	fields := strings.Fields(state)
	if len(fields) != 2 {
		t.Fatalf("quota state %q, want '<used> <start>'", state)
	}
	n, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil {
		t.Fatalf("quota state %q: %v", state, err)
	}
	return n
}

func TestQuotaKeyExpiresShortlyAfterItsPeriod(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_expiry
	key {http.request.header.X-Key}
	quota q 5 per 2s
	redis %s
}`, srv.Addr)
	rdb := srv.Client(t)
	end := startOfPeriod(t, 2*time.Second)
	if status, _ := serve(context.Background(), h, "a"); status != 200 {
		t.Fatalf("%d, want 200", status)
	}
	key := limitKey(t, h, "q", "a")
	before := time.Now()
	ttl := rdb.PTTL(context.Background(), key).Val()
	after := time.Now()
	// The period's end and a second, from when PTTL ran (milliseconds).
	if lo, hi := end.Sub(after)+quota.KeySlack-time.Millisecond, end.Sub(before)+quota.KeySlack+time.Millisecond; ttl <= 0 || ttl < lo || ttl > hi {
		t.Errorf("TTL %v, want %v to %v (the period's end and a second)", ttl, lo, hi)
	}
}

func TestQuotaLoadErrorsNameTheValue(t *testing.T) {
	for _, c := range []struct {
		name, block string
		json        Quota
		want        string
	}{
		{"unknown zone", "quota m 100 per month {\n\ttime_zone Mars/Olympus\n}",
			Quota{Name: "m", Count: "100", Per: "month", TimeZone: "Mars/Olympus"}, "time_zone 'Mars/Olympus' is not in the IANA time zone database"},
		{"month_day 0", "quota m 100 per month {\n\tmonth_day 0\n}",
			Quota{Name: "m", Count: "100", Per: "month", MonthDay: -1}, "month_day '"},
		{"month_day 29", "quota m 100 per month {\n\tmonth_day 29\n}",
			Quota{Name: "m", Count: "100", Per: "month", MonthDay: 29}, "month_day '29': want the day of the month a period starts on, 1 to 28"},
		{"period below a second", "quota m 100 per 500ms",
			Quota{Name: "m", Count: "100", Per: "500ms"}, "per '500ms' is shorter than a second"},
		{"period not a period", "quota m 100 per fortnight",
			Quota{Name: "m", Count: "100", Per: "fortnight"}, "per 'fortnight': want minute, hour, day, week, month, year, or a duration"},
		{"count 0", "quota m 0 per day",
			Quota{Name: "m", Count: "0", Per: "day"}, "count '0' must be at least 1"},
		{"count negative", "quota m -5 per day",
			Quota{Name: "m", Count: "-5", Per: "day"}, "count '-5' must be at least 1"},
		{"count not a number", "quota m lots per day",
			Quota{Name: "m", Count: "lots", Per: "day"}, "count 'lots' is not a whole number"},
		{"cost above count", "quota m 5 per day {\n\trequested_tokens 6\n}",
			Quota{Name: "m", Count: "5", Per: "day", RequestedTokens: "6"}, "requested_tokens '6' is more than count '5'"},
		{"time_zone with a duration", "quota m 5 per 6h {\n\ttime_zone Europe/Berlin\n}",
			Quota{Name: "m", Count: "5", Per: "6h", TimeZone: "Europe/Berlin"}, "time_zone 'Europe/Berlin' with per '6h'"},
		{"week_starts", "quota m 5 per week {\n\tweek_starts friday\n}",
			Quota{Name: "m", Count: "5", Per: "week", WeekStarts: "friday"}, "week_starts 'friday': want monday (the default) or sunday"},
		{"name taken by a limit", "quota second 5 per day",
			Quota{Name: "second", Count: "5", Per: "day"}, "quota 'second': the name is given twice"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseTestCaddyfile("rate_limit {\n\tlimit second 10 20\n\t" + strings.ReplaceAll(c.block, "\n", "\n\t") + "\n}")
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Caddyfile: error %v, want one containing %q", err, c.want)
			}
			if c.json.MonthDay < 0 { // JSON's 0 is the default
				return
			}
			h := offline(&Handler{Limits: []Limit{{Name: "second", ReplenishRate: "10", BurstCapacity: "20"}}, Quotas: []Quota{c.json}})
			if err := tryProvision(t, h); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("JSON: error %v, want one containing %q", err, c.want)
			}
		})
	}
}

func TestQuotaCaddyfileRefusesWhatAQuotaDoesNotTake(t *testing.T) {
	for _, c := range []struct{ input, want string }{
		{"rate_limit {\n\tquota m 5 per day {\n\t\treplenish_rate 10\n\t}\n}", "unrecognized quota m subdirective 'replenish_rate'"},
		{"rate_limit {\n\tquota m 5 per day {\n\t\tburst_capacity 10\n\t}\n}", "unrecognized quota m subdirective 'burst_capacity'"},
		{"rate_limit {\n\tquota m 5 day\n}", "quota: want <name> <count> per <period>"},
		{"rate_limit {\n\tquota m 5 per day\n\tquota m 6 per month\n}", "quota 'm' is given twice"},
		{"rate_limit {\n\tquota m 5 per day {\n\t\ttime_zone UTC\n\t\ttime_zone UTC\n\t}\n}", "quota m: subdirective 'time_zone' is given twice"},
		{"rate_limit {\n\tquota m 5 per day {\n\t\tmonth_day 3\n\t}\n}", "month_day '3' with per 'day'"},
	} {
		if _, err := parseTestCaddyfile(c.input); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %v, want one containing %q", c.input, err, c.want)
		}
	}
}

func TestQuotaWithLeaseRefusedAtLoad(t *testing.T) {
	h := offline(&Handler{ReplenishRate: "10", Quotas: []Quota{{Name: "m", Count: "5", Per: "day"}}, Lease: &Lease{MaxTokens: 4}})
	if err := tryProvision(t, h); err == nil || !strings.Contains(err.Error(), "lease with quotas") {
		t.Errorf("error %v, want one refusing lease with quotas", err)
	}
}

func TestQuotaOnlyHandlerHasNoLimitOfItsOwn(t *testing.T) {
	h := provision(t, offline(&Handler{Quotas: []Quota{{Name: "m", Count: "5", Per: "day"}}}))
	isQuota := func(l *limit.Limit) bool { _, ok := l.Kind.(*quota.Kind); return ok }
	if len(h.limits) != 1 || !isQuota(h.limits[0]) {
		t.Fatalf("limits %v, want the quota alone", h.limits)
	}
	h = provision(t, offline(&Handler{ReplenishRate: "10", Quotas: []Quota{{Name: "m", Count: "5", Per: "day"}}}))
	if len(h.limits) != 2 || isQuota(h.limits[0]) || !isQuota(h.limits[1]) {
		t.Fatalf("limits %v, want the handler's own limit and the quota", h.limits)
	}
}

// expectQuotaPeriod sends count requests for key, all admitted, then one
// refused with Retry-After the seconds to end.
func expectQuotaPeriod(t *testing.T, h *Handler, key string, count int, end time.Time) {
	t.Helper()
	for i := range count {
		if status, hdr := serve(context.Background(), h, key); status != 200 {
			t.Fatalf("request %d: %d, want 200 (%v)", i+1, status, hdr)
		}
	}
	// The seconds to the boundary, rounded up, as the handler read its
	// clock: somewhere between before and after the request (a loaded
	// machine may cross a second between the two).
	ceil := func(d time.Duration) int64 { return int64((d + time.Second - 1) / time.Second) }
	most := ceil(time.Until(end))
	status, hdr := serve(context.Background(), h, key)
	least := ceil(time.Until(end))
	got, err := strconv.ParseInt(hdr.Get("Retry-After"), 10, 64)
	if status != 429 || err != nil || got < least || got > most {
		t.Fatalf("request %d: %d Retry-After %q, want 429 with %d to %d (the seconds to the boundary)", count+1, status, hdr.Get("Retry-After"), least, most)
	}
}

func TestQuotaStoreMemoryAdmitsCountPerPeriodAndRenews(t *testing.T) {
	h := provision(t, &Handler{Zone: "quota_mem", Key: "{http.request.header.X-Key}", Store: storeMemory, Headers: headersBoth,
		Limits: []Limit{{Name: "second", ReplenishRate: "100", BurstCapacity: "100"}},
		Quotas: []Quota{{Name: "q", Count: "3", Per: "2s"}}})
	observeLogs(h, zapcore.InfoLevel)
	end := startOfPeriod(t, 2*time.Second)
	expectQuotaPeriod(t, h, "a", 3, end)
	// The refusals took nothing from the limit: 100 - 3 admitted.
	if _, hdr := serve(context.Background(), h, "a"); hdr.Get("Ratelimit") == "" || !strings.Contains(hdr.Get("Ratelimit"), `"quota_mem.second";r=97`) {
		t.Errorf("RateLimit %q, want the limit at 97 (refusals by the quota take nothing from it)", hdr.Get("Ratelimit"))
	}
	time.Sleep(time.Until(end) + 20*time.Millisecond)
	expectQuotaPeriod(t, h, "a", 3, end.Add(2*time.Second))
}

func TestQuotaOnErrorLocalDecidesWhileRedisFails(t *testing.T) {
	h := localHandler(t, "rate_limit {\n\tzone quota_local\n\tkey {http.request.header.X-Key}\n\tquota q 3 per 2s\n\ton_error local\n}")
	observeLogs(h, zapcore.ErrorLevel)
	end := startOfPeriod(t, 2*time.Second)
	expectQuotaPeriod(t, h, "a", 3, end)
	// The local buckets hold the quota's, which the period's 3 used up.
	if v := heldView(t, h, h.local, policyBuckets(t, h, "X-Key", "a")["q"]); v.ExpiresIn == 0 || v.Tokens != 0 {
		t.Errorf("the local buckets show the quota as %+v, want it held, with nothing left of its 3", v)
	}
}

func TestQuotaChargedByTheResponseCountsTheCost(t *testing.T) {
	costly := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("X-Cost", "4")
		w.WriteHeader(http.StatusOK)
		return nil
	})
	srv := redistest.Start(t)
	for _, store := range []string{storeRedis, storeMemory} {
		t.Run(store, func(t *testing.T) {
			h := &Handler{Zone: "quota_charge_" + store, Key: "{http.request.header.X-Key}", Store: store,
				Quotas: []Quota{{Name: "q", Count: "10", Per: "day", Charge: &Charge{Header: "X-Cost"}}}}
			if store == storeRedis {
				h.Redis = &RedisConfig{Addresses: []string{srv.Addr}}
			}
			provision(t, h)
			observeLogs(h, zapcore.InfoLevel)
			send := func(want int) {
				t.Helper()
				r, w := newRequest("192.0.2.1", "a")
				if status := statusOf(h.ServeHTTP(w, r, costly), w.Code); status != want {
					t.Fatalf("%d, want %d", status, want)
				}
			}
			// Each response costs 4 against a reservation of 1: after three
			// the quota used 12 of 10 (a response may cross it), and refuses.
			for i := range 3 {
				send(200)
				want := float64(4 * (i + 1))
				eventually(t, 2*time.Second, fmt.Sprintf("used %v", want), func() bool {
					view, err := h.store.Peek(context.Background(), policyBuckets(t, h, "X-Key", "a")["q"])
					return err == nil && 10-view.Tokens == want
				})
			}
			send(429)
		})
	}
}

// adminQuotaBucket is a quota's entry of GET /rate_limit/zones/<zone>/buckets.
type adminQuotaBucket struct {
	adminBucket
	Quota *struct {
		Per         string  `json:"per"`
		Count       int64   `json:"count"`
		Used        int64   `json:"used"`
		Remaining   int64   `json:"remaining"`
		PeriodStart string  `json:"period_start"`
		ResetsAt    string  `json:"resets_at"`
		ResetsIn    float64 `json:"resets_in"`
	} `json:"quota"`
}

// quotaPlanSite has a daily quota in America/New_York whose count is the
// client's plan, from map, beside a rate limit.
const quotaPlanSite = `
http://localhost:9080 {
	map {http.request.header.X-Plan} {plan_daily} {
		pro 5
		default 2
	}
	rate_limit {
		zone quota_plan
		key {http.request.header.X-Key}
		headers both
		limit second 100 100
		quota day {plan_daily} per day {
			time_zone America/New_York
		}
		redis %s
	}
	respond "ok"
}`

func TestQuotaThroughCaddyPlanFromMapAdminViewAndReset(t *testing.T) {
	srv := redistest.Start(t)
	tester := loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(quotaPlanSite, srv.Addr))
	client := tester.Client
	ny, _ := time.LoadLocation("America/New_York")
	now := time.Now().In(ny)
	midnight := time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, ny)

	// The default plan: 2 a day; pro: 5.
	expectAdmitted(t, client, caddytestSite, "1", "X-Key", "free")
	expectAdmitted(t, client, caddytestSite, "0", "X-Key", "free")
	resp, _ := send(t, client, caddytestSite, "X-Key", "free")
	retry, _ := strconv.ParseInt(resp.Header.Get("Retry-After"), 10, 64)
	if want := int64(time.Until(midnight).Seconds()); resp.StatusCode != 429 || retry < want || retry > want+2 {
		t.Fatalf("third request of the free plan: %d Retry-After %d, want 429 with about %d (the seconds to midnight in New York)",
			resp.StatusCode, retry, want)
	}
	if got, want := resp.Header.Get("Ratelimit-Policy"), fmt.Sprintf(`"quota_plan.second";q=100;w=1, "quota_plan.day";q=2;w=%d`,
		midnight.Unix()-time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, ny).Unix()); got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	for i := 4; i >= 0; i-- {
		expectAdmitted(t, client, caddytestSite, strconv.Itoa(i), "X-Key", "paying", "X-Plan", "pro")
	}
	expectDenied(t, client, caddytestSite, "X-Key", "paying", "X-Plan", "pro")

	// The admin API: the quota's usage, what is left and when it renews.
	var got adminBucketsOfQuota
	adminJSON(t, caddytestAdmin, http.MethodGet, bucketsPath("quota_plan", q("header.X-Key", "free", "plan_daily", "2")), &got)
	if len(got.Buckets) != 2 || got.Buckets[1].Quota == nil {
		t.Fatalf("buckets %+v, want the limit's and the quota's", got.Buckets)
	}
	qb := got.Buckets[1]
	if qb.Limit != "day" || qb.Quota.Per != "day" || qb.Quota.Count != 2 || qb.Quota.Used != 2 || qb.Quota.Remaining != 0 ||
		qb.Quota.ResetsAt != midnight.Format(time.RFC3339) || math.Abs(qb.Quota.ResetsIn-time.Until(midnight).Seconds()) > 2 || qb.Tokens != "0" {
		t.Errorf("the quota as the admin API shows it: %+v %+v, want day, 2 used of 2, renewing at %s", qb.adminBucket, *qb.Quota, midnight.Format(time.RFC3339))
	}
	// The zone lists the quota with its count and period.
	var zones []struct {
		Zone   string `json:"zone"`
		Store  string `json:"store"`
		Limits []struct {
			adminLimit
			Count Param  `json:"count"`
			Per   string `json:"per"`
		} `json:"limits"`
	}
	// The zones of the config before this one are listed until it is
	// cleaned up, which a loaded machine may delay.
	eventually(t, 10*time.Second, "one zone listed", func() bool {
		adminJSON(t, caddytestAdmin, http.MethodGet, "/rate_limit/zones", &zones)
		return len(zones) == 1
	})
	if len(zones) != 1 || len(zones[0].Limits) != 2 || zones[0].Limits[1].Name != "day" || zones[0].Limits[1].Count != "{plan_daily}" || zones[0].Limits[1].Per != "day" {
		t.Errorf("zones %+v, want quota_plan with the limit and the quota day of {plan_daily} per day", zones)
	}
	// DELETE renews it now.
	if reset := resetBuckets(t, caddytestAdmin, "quota_plan", q("header.X-Key", "free", "plan_daily", "2")); len(reset) != 2 {
		t.Errorf("reset %q, want the limit's key and the quota's", reset)
	}
	expectAdmitted(t, client, caddytestSite, "1", "X-Key", "free")
}

type adminBucketsOfQuota struct {
	Zone    string             `json:"zone"`
	Buckets []adminQuotaBucket `json:"buckets"`
}

func TestQuotaResetJitterSpreadsRetryAfterPerClient(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_jitter
	key {http.request.header.X-Key}
	quota q 1 per 2s
	reset_jitter 1h
	redis %s
}`, srv.Addr)
	end := startOfPeriod(t, 2*time.Second)
	seen := map[int64]bool{}
	for i := range 8 {
		key := fmt.Sprintf("client-%d", i)
		serve(context.Background(), h, key)
		status, hdr := serve(context.Background(), h, key)
		retry, _ := strconv.ParseInt(hdr.Get("Retry-After"), 10, 64)
		toBoundary := int64((time.Until(end) + time.Second - 1) / time.Second)
		if status != 429 || retry < toBoundary || retry > toBoundary+3600 {
			t.Fatalf("%s: %d Retry-After %d, want 429 with %d to %d s (the boundary, then up to an hour)", key, status, retry, toBoundary, toBoundary+3600)
		}
		_, again := serve(context.Background(), h, key)
		if r2, _ := strconv.ParseInt(again.Get("Retry-After"), 10, 64); r2 < retry-1 || r2 > retry {
			t.Errorf("%s: Retry-After %d, then %d: want one time per client", key, retry, r2)
		}
		seen[retry/60] = true
	}
	if len(seen) < 4 {
		t.Errorf("8 clients were told %d distinct minutes to come back, want them spread over the hour", len(seen))
	}
	if _, err := parseTestCaddyfile("rate_limit 10 20 {\n\treset_jitter 1m\n}"); err == nil || !strings.Contains(err.Error(), "reset_jitter '1m0s'") {
		t.Errorf("reset_jitter without quotas: %v, want it refused", err)
	}
}

func TestQuotaShadowModeLetsARefusalPassAndTakesNothing(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_shadow
	key {http.request.header.X-Key}
	quota q 2 per day
	shadow
	redis %s
}`, srv.Addr)
	for i, want := range []string{"allowed", "allowed", "shadow_denied", "shadow_denied"} {
		a := servePolicy(h, "X-Key", "a")
		if a.status != 200 || a.result() != want || want == "shadow_denied" && a.limitName() != "q" {
			t.Fatalf("request %d: %v result %s limit %s, want 200 %s q", i+1, a, a.result(), a.limitName(), want)
		}
	}
	if used := quotaUsedIn(t, srv.Client(t).Get(context.Background(), limitKey(t, h, "q", "a")).Val()); used != 2 {
		t.Errorf("used %d after 2 admitted and 2 shadow refusals, want 2", used)
	}
}

func TestQuotaMetricsCountItsDecisionsUnderItsName(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_metrics
	key {http.request.header.X-Key}
	limit second 100 100
	quota q 1 per day
	redis %s
}`, srv.Addr)
	denied := collectors.requests.WithLabelValues("quota_metrics", "denied", "q")
	before := counterValue(t, denied)
	servePolicy(h, "X-Key", "a")
	if a := servePolicy(h, "X-Key", "a"); a.status != 429 {
		t.Fatalf("second request: %v, want 429", a)
	}
	if got := counterValue(t, denied) - before; got != 1 {
		t.Errorf("caddy_rate_limit_requests_total{zone=quota_metrics,result=denied,limit=q} rose by %v, want 1", got)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// readmeQuotaExample is the Caddyfile block of the README's Quotas
// section, as written: a map and a rate_limit directive.
func readmeQuotaExample(t *testing.T) string {
	t.Helper()
	block := readmeExample(t, "Quotas")
	if !strings.Contains(block, "\nrate_limit /api/* {") || !strings.HasSuffix(block, "}\n") {
		t.Fatalf("the Quotas example is not a map and a rate_limit directive:\n%s", block)
	}
	return block
}

// TestQuotaReadmeExampleRunsAsWritten: the README's monthly plan beside
// its rate limit, with only `headers ietf` and a `redis` line added,
// lists the limit and both quotas in RateLimit-Policy, the month as long
// as this month is in Berlin and the day's count from the plan.
func TestQuotaReadmeExampleRunsAsWritten(t *testing.T) {
	srv := redistest.Start(t)
	example := strings.TrimSuffix(readmeQuotaExample(t), "}\n") + "\theaders ietf\n\tredis %[1]s\n}\n"
	tester := serveCaddyfile(t, "\nhttp://localhost:9080 {\n"+example+"respond \"ok\"\n}\n", srv.Addr)
	berlin, _ := time.LoadLocation("Europe/Berlin")
	now := time.Now().In(berlin)
	month := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, berlin).Sub(time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, berlin))
	utc := time.Now().UTC()
	day := time.Date(utc.Year(), utc.Month(), utc.Day()+1, 0, 0, 0, 0, time.UTC).Sub(time.Date(utc.Year(), utc.Month(), utc.Day(), 0, 0, 0, 0, time.UTC))
	for _, c := range []struct{ plan, daily string }{{"", "1000"}, {"pro", "100000"}} {
		resp, _, err := getHeaders(tester.Client, caddytestSite+"/api/x", "X-API-Key", "k-"+c.plan, "X-Plan", c.plan)
		if err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf(`"api.second";q=20;w=2, "api.month";q=1000000;w=%d, "api.day";q=%s;w=%d`, int64(month.Seconds()), c.daily, int64(day.Seconds()))
		if got := resp.Header.Get("Ratelimit-Policy"); resp.StatusCode != 200 || got != want {
			t.Errorf("plan %q: %d RateLimit-Policy %q, want 200 with %q", c.plan, resp.StatusCode, got, want)
		}
		if got := resp.Header.Get("Ratelimit"); !strings.Contains(got, `"api.month";r=999999;t=`) || !strings.Contains(got, `"api.day";r=`+strconv.FormatInt(mustAtoi(t, c.daily)-1, 10)+";t=") {
			t.Errorf("plan %q: RateLimit %q, want the month at 999999 and the day at its count less one", c.plan, got)
		}
	}
	if resp, _, _ := getHeaders(tester.Client, caddytestSite+"/other"); resp.StatusCode != 200 || resp.Header.Get("Ratelimit") != "" {
		t.Errorf("/other: %d, RateLimit %q; want 200, not limited", resp.StatusCode, resp.Header.Get("Ratelimit"))
	}
}

// testQuotaLimit is an hourly quota's limit, the kind of the buckets a
// test gives periods of its own (whose bounds hold the test's takes).
func testQuotaLimit(t *testing.T) *limit.Limit {
	q, err := quota.New("hour", "", 0, "")
	if err != nil {
		t.Fatal(err)
	}
	l := &limit.Limit{}
	l.SetKind(q)
	return l
}

// TestQuotaScriptPicksThePeriodByRedisTime: Caddy's clock may be off
// from Redis's; the script counts in the period that holds Redis time,
// among the three Caddy passed, and refuses until that period's end.
func TestQuotaScriptPicksThePeriodByRedisTime(t *testing.T) {
	srv := redistest.Start(t)
	l := newTestLimiter(t, srv.Addr, 2*time.Second)
	rdb := srv.Client(t)
	redisNow := redisMicros(t, rdb)
	const minute = int64(60_000_000)
	values := limit.Values{Burst: 2, Requested: 1}
	ql := testQuotaLimit(t)
	for _, c := range []struct {
		name   string
		bounds calendar.Bounds // Redis time is about 30 s into the period at index start
		start  int
	}{
		{"Caddy behind: Redis in the next period", calendar.Bounds{-2, -1, 0, 1}, 2},
		{"in step", calendar.Bounds{-1, 0, 1, 2}, 1},
		{"Caddy ahead: Redis in the previous period", calendar.Bounds{0, 1, 2, 3}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			var bounds calendar.Bounds
			for i, k := range c.bounds {
				bounds[i] = redisNow - minute/2 + k*minute
			}
			key := "quota-pick-" + strconv.Itoa(c.start)
			take := func() (bool, limit.Bucket) {
				b := []limit.Bucket{{Limit: ql, Key: key, Values: values, Args: quota.Args(values), KindRef: quota.NewPeriod(bounds)}}
				allowed, err := l.Take(context.Background(), time.Now(), b)
				if err != nil {
					t.Fatal(err)
				}
				return allowed, b[0]
			}
			take()
			take()
			allowed, b := take()
			start, end := bounds[c.start], bounds[c.start+1]
			if allowed || b.Remaining != 0 {
				t.Fatalf("third take of 2: allowed %v remaining %d, want refused with 0", allowed, b.Remaining)
			}
			if wait := b.RetryAfter.Microseconds(); wait > end-redisNow || wait < end-redisMicros(t, rdb) {
				t.Errorf("wait %d µs, want the time to the end of the period Redis time is in (%d µs)", wait, end-redisNow)
			}
			state := rdb.Get(context.Background(), key).Val()
			if state != fmt.Sprintf("2 %d", start) {
				t.Errorf("state %q, want 2 used in the period starting %d", state, start)
			}
		})
	}
}

// TestQuotaScriptAgreesWithMemoryStore: random takes against a quota in
// Redis and in the memory store, with the same bounds, answer the same.
func TestQuotaScriptAgreesWithMemoryStore(t *testing.T) {
	srv := redistest.Start(t)
	l := newTestLimiter(t, srv.Addr, 2*time.Second)
	mem, err := memstore.Acquire("quota-agree", "", "", 100)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mem.Release() })
	redisNow := redisMicros(t, srv.Client(t))
	const hour = int64(3_600_000_000)
	bounds := calendar.Bounds{redisNow - 2*hour, redisNow - hour, redisNow + hour, redisNow + 2*hour}
	p := quota.NewPeriod(bounds)
	ql := testQuotaLimit(t)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 200 {
		v := limit.Values{Burst: 20, Requested: 1 + rng.Int64N(4)}
		key := "agree-" + strconv.Itoa(rng.IntN(3))
		rb := []limit.Bucket{{Limit: ql, Key: key, Values: v, Args: quota.Args(v), KindRef: p}}
		mb := []limit.Bucket{{Limit: ql, Key: key, Values: v, Args: quota.Args(v), KindRef: p}}
		ra, err := l.Take(context.Background(), time.Now(), rb)
		if err != nil {
			t.Fatal(err)
		}
		ma, err := mem.Take(time.Now(), mb)
		if err != nil {
			t.Fatal(err)
		}
		if ra != ma || rb[0].Remaining != mb[0].Remaining || (rb[0].RetryAfter == 0) != (mb[0].RetryAfter == 0) ||
			(rb[0].RetryAfter-mb[0].RetryAfter).Abs() > time.Second {
			t.Fatalf("take %d (%s, %d): Redis %v %d %v, memory %v %d %v", i, key, v.Requested,
				ra, rb[0].Remaining, rb[0].RetryAfter, ma, mb[0].Remaining, mb[0].RetryAfter)
		}
	}
}

// TestQuotaOnClusterGivesBackWhenALaterSlotGroupRefuses: on a Cluster, a
// quota shares the slot of the limits with its key template; when a limit
// of another template (a later slot group) refuses, the quota gets back
// what the request took from it.
func TestQuotaOnClusterGivesBackWhenALaterSlotGroupRefuses(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	cc := c.Client(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_cluster
	key {http.request.header.X-Key}
	limit second 100 100
	limit tenant 0.01 2 {
		key {http.request.header.X-Tenant}
	}
	quota q 5 per day
	redis %s {
		cluster
		timeout 2s
	}
}`, c.Masters[0].Addr)
	if len(h.groups) != 2 {
		t.Fatalf("%d slot groups, want 2 (the client's limit and quota; the tenant's limit)", len(h.groups))
	}
	quotaKey := limitKey(t, h, "q", "a")
	used := func() int64 { return quotaUsedIn(t, cc.Get(context.Background(), quotaKey).Val()) }
	expect := func(want int, tenant string) {
		t.Helper()
		if a := servePolicy(h, "X-Key", "a", "X-Tenant", tenant); a.status != want {
			t.Fatalf("tenant %s: %v, want %d", tenant, a, want)
		}
	}
	expect(200, "t1")
	expect(200, "t1")
	for range 3 {
		expect(429, "t1") // the tenant refuses, after the client's group took
	}
	if got := used(); got != 2 {
		t.Fatalf("quota used %d after 2 admitted and 3 refused by the tenant, want 2 (given back)", got)
	}
	expect(200, "t2")
	expect(200, "t2")
	expect(200, "t3")
	expect(429, "t4") // the quota refuses: nothing taken from tenant t4, whose group comes later
	if got := used(); got != 5 {
		t.Errorf("quota used %d, want 5", got)
	}
	if n := cc.Exists(context.Background(), limitKey(t, h, "tenant", "t4")).Val(); n != 0 {
		t.Errorf("tenant t4's bucket was written by a request the quota refused")
	}
}

// TestQuotaOfTenYearsRefusesWithItsWait: the longest period a quota may
// have is a wait the limiter reads as an answer, not as a broken reply.
func TestQuotaOfTenYearsRefusesWithItsWait(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_decade
	key {http.request.header.X-Key}
	quota q 1 per 3650d
	on_error allow
	redis %s
}`, srv.Addr)
	serve(context.Background(), h, "a")
	status, hdr := serve(context.Background(), h, "a")
	retry, _ := strconv.ParseInt(hdr.Get("Retry-After"), 10, 64)
	if status != 429 || retry <= 0 || retry > 3650*86400 {
		t.Errorf("%d Retry-After %q, want 429 with up to ten years", status, hdr.Get("Retry-After"))
	}
}

func TestQuotaCountFromRequestUnlimitedExemptsAndInvalidRefuses(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_count_header
	key {http.request.header.X-Key}
	quota q {http.request.header.X-Count} per day
	redis %s
}`, srv.Addr)
	for _, c := range []struct {
		count, result string
		status        int
	}{
		{"unlimited", "exempt", 200},
		{"unlimited", "exempt", 200},
		{"abc", "invalid", 500},
		{"0", "invalid", 500},
		{"1", "allowed", 200},
		{"1", "denied", 429},
		{"2", "allowed", 200}, // a larger plan has room for one more
		{"2", "denied", 429},
	} {
		if a := servePolicy(h, "X-Key", "a", "X-Count", c.count); a.status != c.status || a.result() != c.result {
			t.Fatalf("count %s: %v result %s, want %d %s", c.count, a, a.result(), c.status, c.result)
		}
	}
}

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

// chargedQuotaHandler is `quota tokens 1000 per 2s` reserving 100 and
// charged by X-Cost, in zone, with store memory when addr is empty, else
// Redis at addr with the timeout and onError.
func chargedQuotaHandler(t *testing.T, zone, addr string, timeout time.Duration, onError string) *Handler {
	t.Helper()
	h := &Handler{Zone: zone, Key: "{http.request.header.X-Key}", OnError: onError,
		Quotas: []Quota{{Name: "tokens", Count: "1000", Per: "2s", RequestedTokens: "100", Charge: &Charge{Header: "X-Cost"}}}}
	if addr == "" {
		h.Store = storeMemory
	} else {
		h.Redis = &RedisConfig{Addresses: []string{addr}, Timeout: caddy.Duration(timeout)}
	}
	provision(t, h)
	observeLogs(h, zapcore.ErrorLevel)
	return h
}

// costing is a next handler whose response costs cost (X-Cost).
func costing(cost string) caddyhttp.Handler {
	return caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("X-Cost", cost)
		w.WriteHeader(http.StatusOK)
		return nil
	})
}

// sendCosting sends one request of client key a through h to next.
func sendCosting(h *Handler, next caddyhttp.Handler) int {
	r, w := newRequest("192.0.2.1", "a")
	return statusOf(h.ServeHTTP(w, r, next), w.Code)
}

// TestQuotaChargeSettlesInThePeriodItsReservationWasTakenIn: Caddy
// names the period by its clock when the request arrives; a call that
// reaches the store after the boundary takes its reservation in the next
// period, and the response's cost must be settled there, and counted as
// charged only as it landed. The case: `quota tokens 1000 per 2s`,
// a reservation of 100, a response costing 600, the call held 150 ms
// across the boundary.
func TestQuotaChargeSettlesInThePeriodItsReservationWasTakenIn(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	// crossing sends, in a period's last moments by Caddy's clock, a
	// request whose take lands in the next period; hold makes that happen
	// and is called just before it is sent, with the time left to the
	// boundary. It returns the boundary. A try that starts too late for
	// the request to leave in the old period is made again a period on.
	crossing := func(t *testing.T, h *Handler, before time.Duration, hold func()) time.Time {
		t.Helper()
		for range 3 {
			end := startOfPeriod(t, 2*time.Second)
			time.Sleep(time.Until(end.Add(-before)))
			if left := time.Until(end); left < 15*time.Millisecond || left > before {
				continue
			}
			hold()
			if status := sendCosting(h, costing("600")); status != 200 {
				t.Fatalf("the request across the boundary: %d, want 200", status)
			}
			return end
		}
		t.Skip("too slow to send a request in the last moments of a period")
		return time.Time{}
	}
	charged := func(zone string) prometheus.Counter { return collectors.charged.WithLabelValues(zone, "tokens") }

	t.Run("redis", func(t *testing.T) {
		proxy := startRedisProxy(t, srv.Addr)
		h := chargedQuotaHandler(t, "quota_cross_redis", proxy.addr, 2*time.Second, onErrorDeny)
		if status := servePolicy(h, "X-Key", "warm"); status.status != 200 {
			t.Fatalf("warming up: %v", status)
		}
		before := counterValue(t, charged("quota_cross_redis"))
		end := crossing(t, h, 75*time.Millisecond, func() { proxy.stall(150 * time.Millisecond) })
		key := limitKey(t, h, "tokens", "a")
		want := fmt.Sprintf("600 %d", end.UnixMicro())
		var state string
		eventually(t, 2*time.Second, "the settlement", func() bool {
			state = rdb.Get(context.Background(), key).Val()
			return state == want
		})
		if state != want {
			t.Fatalf("quota state %q after a response costing 600, want %q: 600 used in the period the reservation was taken in", state, want)
		}
		// The worker counts the answer after Redis wrote the state.
		for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			got := counterValue(t, charged("quota_cross_redis")) - before
			if got == 600 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("caddy_rate_limit_charged_total rose by %v, want 600", got)
			}
		}
	})

	t.Run("on_error local", func(t *testing.T) {
		proxy := startRedisProxy(t, srv.Addr)
		h := chargedQuotaHandler(t, "quota_cross_local", proxy.addr, 200*time.Millisecond, onErrorLocal)
		if status := servePolicy(h, "X-Key", "warm"); status.status != 200 {
			t.Fatalf("warming up: %v", status)
		}
		before := counterValue(t, charged("quota_cross_local"))
		// Redis does not answer within the timeout: the local buckets
		// decide, after the boundary.
		end := crossing(t, h, 100*time.Millisecond, func() { proxy.stall(time.Second) })
		// The local buckets, read now (in the period starting at end), show
		// what the quota used in it (its count less what they show).
		v := heldView(t, h, h.local, policyBuckets(t, h, "X-Key", "a")["tokens"])
		inPeriod := time.Since(end) < 2*time.Second
		if used := 1000 - v.Tokens; inPeriod && used != 600 {
			t.Errorf("local quota used %v in the period starting %d, want 600 in it (where the reservation was taken)", used, end.UnixMicro())
		}
		if got := counterValue(t, charged("quota_cross_local")) - before; got != 600 {
			t.Errorf("caddy_rate_limit_charged_total rose by %v, want 600", got)
		}
		if !inPeriod {
			t.Skip("too slow to read the local quota in the period after the boundary")
		}
	})

	t.Run("memory", func(t *testing.T) {
		h := chargedQuotaHandler(t, "quota_cross_memory", "", 0, "")
		before := counterValue(t, charged("quota_cross_memory"))
		// The request's period is Caddy's now; its take comes in the next
		// one (a take reads the clock again, after the period was named).
		buckets := []limit.Bucket{policyBuckets(t, h, "X-Key", "a")["tokens"]}
		next := time.UnixMicro(buckets[0].KindRef.(*quota.Period).Bounds()[2]).Add(10 * time.Millisecond)
		if allowed, err := h.memory.Take(next, buckets); err != nil || !allowed {
			t.Fatalf("take: %v %v, want admitted", allowed, err)
		}
		h.memory.For(storeReports{h}, true).Settle(&limit.Call{Buckets: buckets}, []limit.Settling{{Bucket: 0, Cost: 600, Diff: 500}})
		// A take of 100 more in that period leaves what the quota used in
		// it: 1000 - 600 - 100.
		probe := []limit.Bucket{policyBuckets(t, h, "X-Key", "a")["tokens"]}
		if allowed, err := h.memory.Take(next, probe); err != nil || !allowed || probe[0].Remaining != 300 {
			t.Errorf("a take of 100 in the period starting %d: %v %v, %d left; want 300 left, 600 used in it (where the reservation was taken)",
				buckets[0].KindRef.(*quota.Period).Bounds()[2], allowed, err, probe[0].Remaining)
		}
		if got := counterValue(t, charged("quota_cross_memory")) - before; got != 600 {
			t.Errorf("caddy_rate_limit_charged_total rose by %v, want 600", got)
		}
	})
}

// TestQuotaSettlementAfterItsPeriodEndedIsCountedAsItsReservation: a
// response that ends once its quota counts a later period than its
// reservation's settles nothing (the new period owes it nothing), so what
// it charged is its reservation, not its cost: settle.lua says so rather
// than answering as if it had settled, and the memory store counts it.
func TestQuotaSettlementAfterItsPeriodEndedIsCountedAsItsReservation(t *testing.T) {
	srv := redistest.Start(t)
	for _, store := range []string{storeRedis, storeMemory} {
		t.Run(store, func(t *testing.T) {
			zone := "quota_late_" + store
			addr := srv.Addr
			if store == storeMemory {
				addr = ""
			}
			h := chargedQuotaHandler(t, zone, addr, 2*time.Second, onErrorDeny)
			charged := collectors.charged.WithLabelValues(zone, "tokens")
			letGo, entered := make(chan struct{}), make(chan struct{})
			held := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				close(entered)
				<-letGo
				return costing("600").ServeHTTP(w, r)
			})
			end := startOfPeriod(t, 2*time.Second)
			done := make(chan int, 1)
			go func() { done <- sendCosting(h, held) }() // reserves 100 in this period
			<-entered
			time.Sleep(time.Until(end) + 50*time.Millisecond) // the next period
			if status := sendCosting(h, costing("100")); status != 200 {
				t.Fatalf("a request of the next period: %d, want 200", status)
			} // its cost is its reservation: counted at once, and the quota counts this period now
			before := counterValue(t, charged)
			close(letGo)
			if status := <-done; status != 200 {
				t.Fatalf("held request: %d, want 200", status)
			}
			var got float64
			eventually(t, 2*time.Second, "the settlement's count", func() bool {
				got = counterValue(t, charged) - before
				return got != 0
			})
			time.Sleep(100 * time.Millisecond) // anything more it would count
			if got = counterValue(t, charged) - before; got != 100 {
				t.Errorf("caddy_rate_limit_charged_total rose by %v for a response whose period had ended, want 100 (its reservation: nothing more landed)", got)
			}
		})
	}
}

// TestQuotaScriptCountsInNoPeriodWhenRedisTimeIsOutsideThoseGiven: Caddy
// passes its period and the two beside it; when Redis's clock is beyond
// them (Caddy's more than a period behind or ahead), the script counts in
// none of them and takes nothing, and the request follows on_error with a
// warning that says so. The case: `quota 5 per minute` with
// Caddy's clock 3 minutes behind admitted 15 of 40 requests.
func TestQuotaScriptCountsInNoPeriodWhenRedisTimeIsOutsideThoseGiven(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_skew
	key {http.request.header.X-Key}
	limit second 100 100
	quota q 5 per minute
	on_error deny
	redis %s {
		timeout 2s
	}
}`, srv.Addr)
	logs := observeLogs(h, zapcore.WarnLevel)
	const minute = int64(60_000_000)
	for _, skew := range []int64{-3, 3} { // Caddy's clock 3 minutes behind Redis's, then ahead
		t.Run(fmt.Sprintf("Caddy %+d minutes", skew), func(t *testing.T) {
			client := fmt.Sprintf("skew%d", skew)
			caddyNow := redisMicros(t, rdb) + skew*minute
			start := caddyNow - caddyNow%minute
			skewed := quota.NewPeriod(calendar.Bounds{start - minute, start, start + minute, start + 2*minute})
			admitted, told := 0, 0
			var other error
			for range 40 {
				buckets := policyBuckets(t, h, "X-Key", client)
				b := []limit.Bucket{buckets["second"], buckets["q"]}
				b[1].KindRef = skewed
				allowed, err := decide(context.Background(), h, b)
				switch {
				case err == nil && allowed:
					admitted++
				case err != nil && strings.Contains(err.Error(), "clock"):
					told++
				case err != nil:
					other = err
				}
			}
			if admitted != 0 || told != 40 {
				t.Errorf("of 40 requests, %d admitted and %d answered that Redis's clock is outside the quota's periods (other error: %v); "+
					"want none admitted, all 40 answered so (they follow on_error)", admitted, told, other)
			}
			for _, key := range []string{limitKey(t, h, "second", client), limitKey(t, h, "q", client)} {
				if state := rdb.Get(context.Background(), key).Val(); state != "" {
					t.Errorf("%s holds %q: a call that counted in no period took something", key, state)
				}
			}
		})
	}
	warned := false
	for _, e := range logs.All() {
		warned = warned || strings.Contains(e.ContextMap()["error"].(string), "clock")
	}
	if !warned {
		t.Errorf("no warning says the clocks differ: %v", logs.All())
	}
}

// TestQuotaInProcessTakeLongAfterItsPeriodCountsInThePeriodItIsIn: the
// memory store (store memory, on_error local) reads its clock again for
// a take, which may come periods after the request named its period (a
// local decision after a Redis timeout longer than the period): it counts
// in the period its clock is in, never in one its clock has left.
func TestQuotaInProcessTakeLongAfterItsPeriodCountsInThePeriodItIsIn(t *testing.T) {
	h := provision(t, &Handler{Zone: "quota_late_take", Key: "{http.request.header.X-Key}", Store: storeMemory,
		Quotas: []Quota{{Name: "q", Count: "2", Per: "2s"}}})
	b := policyBuckets(t, h, "X-Key", "a")["q"]
	later := time.UnixMicro(b.KindRef.(*quota.Period).Bounds()[3]).Add(5 * time.Second) // two periods past the last one the request named
	start := later.Truncate(2 * time.Second)
	// What a take leaves is the count less what the quota used in the
	// period its clock is in: 1, then 0, then a refusal. Had a take
	// counted in a period its clock has left, the next would find nothing
	// used.
	for i := range 3 {
		buckets := []limit.Bucket{b}
		allowed, err := h.memory.Take(later, buckets)
		if err != nil || allowed != (i < 2) {
			t.Fatalf("take %d: %v %v, want admitted twice, then refused", i+1, allowed, err)
		}
		if left := buckets[0].Remaining; i < 2 && left != int64(1-i) {
			t.Errorf("take %d leaves %d, want %d: the quota used %d in the period starting %d", i+1, left, 1-i, i+1, start.UnixMicro())
		}
		if wait := buckets[0].RetryAfter; i == 2 && (wait <= 0 || wait > start.Add(2*time.Second).Sub(later)) {
			t.Errorf("a refusal waits %v, want the time to the end of the period its clock is in (%v)", wait, start.Add(2*time.Second).Sub(later))
		}
	}
	// The period after it starts with nothing used: the 2 counted in the
	// one starting at start.
	buckets := []limit.Bucket{b}
	if allowed, err := h.memory.Take(start.Add(2*time.Second), buckets); err != nil || !allowed || buckets[0].Remaining != 1 {
		t.Errorf("a take in the next period: %v %v, %d left; want admitted with 1 left (the 2 used in the period starting %d)",
			allowed, err, buckets[0].Remaining, start.UnixMicro())
	}
}

// TestQuotaResetJitterAppliesToRetryAfterRateLimitAndPlaceholderAlike:
// with reset_jitter, a quota's refusal tells a client one time to come
// back, jittered, in Retry-After, in RateLimit's t and in
// {http.rate_limit.retry_after} alike (the README: on a denial t equals
// Retry-After), whether Redis or the deny cache refused it.
func TestQuotaResetJitterAppliesToRetryAfterRateLimitAndPlaceholderAlike(t *testing.T) {
	srv := redistest.Start(t)
	h := quotaHandler(t, `rate_limit {
	zone quota_jitter_all
	key {http.request.header.X-Key}
	headers ietf
	quota q 1 per 2s
	reset_jitter 1h
	redis %s {
		timeout 2s
	}
}`, srv.Addr)
	rdb := srv.Client(t)
	end := startOfPeriod(t, 2*time.Second)
	jittered := false
	for i := range 4 {
		key := fmt.Sprintf("client-%d", i)
		servePolicy(h, "X-Key", key)
		for _, from := range []string{"Redis", "the deny cache"} {
			calls := redistest.ScriptCalls(t, rdb)
			a := servePolicy(h, "X-Key", key)
			if asked := redistest.ScriptCalls(t, rdb) > calls; asked != (from == "Redis") {
				t.Fatalf("%s: Redis asked %v, want the refusal from %s", key, asked, from)
			}
			toBoundary := int64((time.Until(end) + time.Second - 1) / time.Second)
			retry, _ := strconv.ParseInt(a.header.Get("Retry-After"), 10, 64)
			_, tValue, _ := strings.Cut(a.header.Get("Ratelimit"), ";t=")
			placeholder := a.placeholder("http.rate_limit.retry_after")
			if time.Now().After(end) {
				t.Skip("too slow to stay in one period")
			}
			if a.status != 429 || retry < toBoundary || retry > toBoundary+3600 {
				t.Fatalf("%s, refused by %s: %v Retry-After %d, want 429 with %d to %d s", key, from, a, retry, toBoundary, toBoundary+3600)
			}
			if want := strconv.FormatInt(retry, 10); tValue != want || placeholder != want {
				t.Errorf("%s, refused by %s: Retry-After %d, RateLimit %q (t=%s), {http.rate_limit.retry_after} %q; want all three %d",
					key, from, retry, a.header.Get("Ratelimit"), tValue, placeholder, retry)
			}
			jittered = jittered || retry > toBoundary+1
		}
	}
	if !jittered {
		t.Errorf("no client of 4 was told to come back past the boundary: reset_jitter 1h applied to none")
	}
}

// A lease with quotas is refused before any quota's own mistake, as
// before the checks of several parts moved to checks.go.
func TestLeaseWithQuotasIsReportedBeforeAQuotasOwnMistake(t *testing.T) {
	for name, q := range map[string]Quota{
		"no per":   {Name: "q", Count: "3"},
		"bad name": {Name: "bad name", Count: "3", Per: "day"},
	} {
		h := &Handler{Lease: &Lease{MaxTokens: 10}, Quotas: []Quota{q}}
		if err := h.checkLimits(); err == nil || !strings.HasPrefix(err.Error(), "lease with quotas:") {
			t.Errorf("%s: %v, want lease with quotas first", name, err)
		}
	}
}
