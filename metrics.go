package ratelimit

import (
	"errors"
	"sync"

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
}{}

// zoneMetrics are one zone's series, looked up once at provision time so
// that a request only increments.
type zoneMetrics struct {
	requests      [numDecisions]prometheus.Counter
	redisDuration prometheus.Observer
}

func newZoneMetrics(registry prometheus.Registerer, zone string) (*zoneMetrics, error) {
	collectors.once.Do(func() {
		const ns, sub = "caddy", "rate_limit"
		collectors.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "requests_total",
			Help: "Requests the rate limiter decided, by zone and result.",
		}, []string{"zone", "result"})
		collectors.redisDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "redis_duration_seconds",
			Help:    "Time of the Redis step of one request, by zone.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"zone"})
		collectors.breakerOpen = &breakerCollector{
			desc: prometheus.NewDesc(prometheus.BuildFQName(ns, sub, "breaker_open"),
				"Circuit breakers open now among the Redis nodes (Cluster masters) that the zone's requests can meet.",
				[]string{"zone"}, nil),
			zones: make(map[string]map[*limiter]int),
		}
	})
	for _, c := range []prometheus.Collector{collectors.requests, collectors.redisDuration, collectors.breakerOpen} {
		if err := registry.Register(c); err != nil && !errors.As(err, &prometheus.AlreadyRegisteredError{}) {
			return nil, err
		}
	}
	m := &zoneMetrics{redisDuration: collectors.redisDuration.WithLabelValues(zone)}
	for d := range numDecisions {
		m.requests[d] = collectors.requests.WithLabelValues(zone, d.String())
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
	zones map[string]map[*limiter]int // zone -> limiter -> handlers using it
}

// watchBreakers counts a zone's handler that uses l; unwatchBreakers
// takes it back at cleanup.
func watchBreakers(zone string, l *limiter) {
	c := collectors.breakerOpen
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.zones[zone] == nil {
		c.zones[zone] = make(map[*limiter]int)
	}
	c.zones[zone][l]++
}

func unwatchBreakers(zone string, l *limiter) {
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

func (c *breakerCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *breakerCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for zone, limiters := range c.zones {
		var open int64
		for l := range limiters {
			open += l.openBreakers()
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(open), zone)
	}
}
