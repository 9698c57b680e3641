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
	breakerOpen   *prometheus.GaugeVec
}{}

// zoneMetrics are one zone's series, looked up once at provision time so
// that a request only increments.
type zoneMetrics struct {
	requests      [numDecisions]prometheus.Counter
	redisDuration prometheus.Observer
	breakerOpen   prometheus.Gauge
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
		collectors.breakerOpen = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "breaker_open",
			Help: "1 while the zone's circuit breaker skips Redis, else 0.",
		}, []string{"zone"})
	})
	for _, c := range []prometheus.Collector{collectors.requests, collectors.redisDuration, collectors.breakerOpen} {
		if err := registry.Register(c); err != nil && !errors.As(err, &prometheus.AlreadyRegisteredError{}) {
			return nil, err
		}
	}
	m := &zoneMetrics{
		redisDuration: collectors.redisDuration.WithLabelValues(zone),
		breakerOpen:   collectors.breakerOpen.WithLabelValues(zone),
	}
	for d := range numDecisions {
		m.requests[d] = collectors.requests.WithLabelValues(zone, d.String())
	}
	m.breakerOpen.Set(0)
	return m, nil
}
