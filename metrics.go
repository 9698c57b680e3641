package ratelimit

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/prometheus/client_golang/prometheus"
)

// The collectors are made once per process and registered on each
// config's registry, so counts survive reloads. Labels are bounded: the
// zone and the result, never the client key.
var collectors = struct {
	once          sync.Once
	requests      *prometheus.CounterVec
	redisDuration *prometheus.HistogramVec
	breakerOpen   *breakerCollector
	// Charging (charge.go): tokens charged and forgiven, settlements lost.
	charged, forgiven, settleFailures *prometheus.CounterVec
	// request_body (requestbody.go): values left empty, by reason.
	requestUnread *prometheus.CounterVec
	// max_wait (wait.go): how long requests waited, and how many wait now.
	waitSeconds *prometheus.HistogramVec
	waiting     *waitingCollector
}{}

// zoneMetrics are one zone's series, looked up once at provision time so
// that a request only increments (about 0.3 µs per request less:
// BenchmarkServeHTTPDenied, CPU time per request).
type zoneMetrics struct {
	// requests by decision, then by the limit that refused: index 0 for
	// none (an admitted request, or a handler without `limits`), i+1 for
	// the handler's limit i.
	requests      [limit.NumDecisions][]prometheus.Counter
	redisDuration prometheus.Observer
	// By limit index, for the limits that charge by the response.
	charged, forgiven []prometheus.Counter
	settleFailures    prometheus.Counter
	waitSeconds       prometheus.Observer
}

// metricParts are the collectors that parts of the package make of
// their own (compose.go), beside those above.
var metricParts []metricPart

// A metricPart is a part's collector, registered on each config's
// registry, and zone, which gives a zone's handler its series of it.
type metricPart struct {
	collector prometheus.Collector
	zone      func(zone string, limits []*limit.Limit)
}

func newZoneMetrics(registry prometheus.Registerer, zone string, limits []*limit.Limit) (*zoneMetrics, error) {
	collectors.once.Do(func() {
		const ns, sub = "caddy", "rate_limit"
		collectors.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "requests_total",
			Help: "Requests the rate limiter decided, by zone, result and the limit that refused.",
		}, []string{"zone", "result", "limit"})
		collectors.redisDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "redis_duration_seconds",
			Help:    "Time of the Redis step of one request, by zone.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"zone"})
		collectors.breakerOpen = &breakerCollector{
			desc: prometheus.NewDesc(prometheus.BuildFQName(ns, sub, "breaker_open"),
				"Circuit breakers open now among the Redis nodes (Cluster masters) that the zone's requests can meet.",
				[]string{"zone"}, nil),
			zones: make(map[string]map[breakers]int),
		}
		collectors.charged = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "charged_total",
			Help: "Tokens charged for responses by limits with charge or charge_status, once settled (a reservation that stands counts), by zone and limit.",
		}, []string{"zone", "limit"})
		collectors.forgiven = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "forgiven_total",
			Help: "Tokens of responses' costs not taken because the bucket reached -max_debt, by zone and limit.",
		}, []string{"zone", "limit"})
		collectors.settleFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "settle_failures_total",
			Help: "Settlements of responses' costs lost to a failure (their reservations stand; none is sent again), by zone.",
		}, []string{"zone"})
		collectors.requestUnread = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "request_body_unread_total",
			Help: "Requests whose request_body values were left empty, by zone and reason (encoded, not_json, too_large, cut_off, repeated, nested, invalid_utf8).",
		}, []string{"zone", "reason"})
		collectors.waitSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "wait_seconds",
			Help:    "How long requests admitted for a later moment (max_wait) waited before they went on, by zone.",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 3600},
		}, []string{"zone"})
		collectors.waiting = &waitingCollector{
			desc: prometheus.NewDesc(prometheus.BuildFQName(ns, sub, "waiting"),
				"Requests of this instance that wait now (max_wait): for tokens taken ahead, or in a queue for a concurrent limit's slot, by zone.",
				[]string{"zone"}, nil),
			zones: make(map[string]map[*atomic.Int64]int),
		}
	})
	all := []prometheus.Collector{collectors.requests, collectors.redisDuration, collectors.breakerOpen,
		collectors.charged, collectors.forgiven, collectors.settleFailures, collectors.requestUnread,
		collectors.waitSeconds, collectors.waiting}
	for _, p := range metricParts {
		all = append(all, p.collector)
	}
	for _, c := range all {
		if err := registry.Register(c); err != nil && !errors.As(err, &prometheus.AlreadyRegisteredError{}) {
			return nil, err
		}
	}
	m := &zoneMetrics{redisDuration: collectors.redisDuration.WithLabelValues(zone),
		waitSeconds: collectors.waitSeconds.WithLabelValues(zone)}
	m.charged, m.forgiven, m.settleFailures = chargeCounters(zone, limits)
	for _, p := range metricParts {
		p.zone(zone, limits)
	}
	for d := range limit.NumDecisions {
		m.requests[d] = []prometheus.Counter{collectors.requests.WithLabelValues(zone, d.String(), "")}
		if d != limit.DecisionDenied && d != limit.DecisionShadowDenied && d != limit.DecisionFallbackDenied {
			continue
		}
		for _, l := range limits {
			if l.Name == "" {
				m.requests[d] = append(m.requests[d], m.requests[d][0])
			} else {
				m.requests[d] = append(m.requests[d], collectors.requests.WithLabelValues(zone, d.String(), l.Name))
			}
		}
	}
	return m, nil
}

// breakerCollector reports caddy_rate_limit_breaker_open when scraped:
// per zone, the node breakers open in the limiters its handlers use. It
// is read at scrape time because the breakers belong to the shared
// limiters, which outlive configs.
type breakerCollector struct {
	desc  *prometheus.Desc
	mu    sync.Mutex
	zones map[string]map[breakers]int // zone -> Redis client -> handlers using it
}

// breakers are a shared Redis client's node breakers.
type breakers interface{ OpenBreakers() int64 }

// watchBreakers counts a zone's handler that uses l; unwatchBreakers
// takes it back at cleanup.
func watchBreakers(zone string, l breakers) {
	c := collectors.breakerOpen
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.zones[zone] == nil {
		c.zones[zone] = make(map[breakers]int)
	}
	c.zones[zone][l]++
}

func unwatchBreakers(zone string, l breakers) {
	c := collectors.breakerOpen
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.zones[zone] == nil {
		return
	}
	if c.zones[zone][l]--; c.zones[zone][l] <= 0 {
		delete(c.zones[zone], l)
	}
	if len(c.zones[zone]) == 0 {
		delete(c.zones, zone)
	}
}

// waitingCollector reports caddy_rate_limit_waiting when scraped: per
// zone, the requests its handlers count as waiting now (Handler's
// waitingNow, which the stores count in too).
type waitingCollector struct {
	desc  *prometheus.Desc
	mu    sync.Mutex
	zones map[string]map[*atomic.Int64]int // zone -> a handler's count -> handlers with it
}

func (c *waitingCollector) watch(zone string, n *atomic.Int64, add int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.zones[zone] == nil {
		c.zones[zone] = make(map[*atomic.Int64]int)
	}
	if c.zones[zone][n] += add; c.zones[zone][n] <= 0 {
		delete(c.zones[zone], n)
	}
	if len(c.zones[zone]) == 0 {
		delete(c.zones, zone)
	}
}

func (c *waitingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *waitingCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for zone, counts := range c.zones {
		var n int64
		for count := range counts {
			n += count.Load()
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), zone)
	}
}

func (c *breakerCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *breakerCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for zone, limiters := range c.zones {
		var open int64
		for l := range limiters {
			open += l.OpenBreakers()
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(open), zone)
	}
}
