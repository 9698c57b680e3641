package ratelimit

import (
	"fmt"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// What a served response cost each charging limit, and its settlement:
// in the process, or as a call to settle.lua that the batch worker
// answers (charge.go makes the limits' charge rules, internal/cost reads
// a response's cost).

// resultChargeMissing is {http.rate_limit.result} once a response's cost
// could not be read, boxed once.
var resultChargeMissing any = "charge_missing"

// settleResponse charges each charging bucket of a served request what
// its response cost, sets the placeholders, and settles the differences
// from the reservations: in the process at once, or in Redis after the
// response (off the request path: nothing waits for it).
func (h *Handler) settleResponse(end cost.End, cw *cost.Writer, repl *caddy.Replacer, req *request) {
	buckets := req.Buckets
	items := req.settling[:0]
	for i := range buckets {
		b := &buckets[i]
		rule := b.Limit.Charge
		if rule == nil {
			continue
		}
		reserved := b.Values.Requested
		charged, why := rule.Cost(end, cw, repl, &req.weights, reserved)
		switch {
		case why != "":
			h.warnChargeMissing(b.Limit, why)
			repl.Set("http.rate_limit.result", resultChargeMissing)
		case rule.ReadsJSON() && cw.ScanStopped():
			h.warnScanStopped(b.Limit)
		}
		if b.Limit == h.charging.first {
			repl.Set("http.rate_limit.charged", charged)
		}
		if b.Limit.ChargedKey != "" {
			repl.Set(b.Limit.ChargedKey, charged)
		}
		items = append(items, limit.Settling{Bucket: i, Cost: charged, Diff: charged - reserved})
	}
	unsettled := items[:0]
	for _, it := range items {
		if it.Diff == 0 {
			h.countCharged(buckets[it.Bucket].Limit, float64(it.Cost), 0)
		} else {
			unsettled = append(unsettled, it)
		}
	}
	if len(unsettled) > 0 {
		h.store.Settle(&req.Call, unsettled)
	}
}

// warnChargeMissing logs, throttled, that a response's cost could not be
// read.
func (h *Handler) warnChargeMissing(l *limit.Limit, why string) {
	if ok, suppressed := h.charging.warns.Allow(); ok {
		fields := []zap.Field{zap.String("zone", h.Zone), zap.String("reason", why), logs.Suppressed(suppressed)}
		if l.Name != "" {
			fields = append(fields, zap.String("limit", l.Name))
		}
		h.logger.Warn("the cost of a response could not be read; it is charged its reservation", fields...)
	}
}

// warnScanStopped logs, throttled with warnChargeMissing, that a
// response's cost was read from the part of its body before max_body.
func (h *Handler) warnScanStopped(l *limit.Limit) {
	if ok, suppressed := h.charging.warns.Allow(); ok {
		fields := []zap.Field{zap.String("zone", h.Zone), logs.Suppressed(suppressed),
			zap.String("reason", fmt.Sprintf("the body is larger than max_body (%d bytes), the most of a response the scan reads", h.charging.MaxBody))}
		if l.Name != "" {
			fields = append(fields, zap.String("limit", l.Name))
		}
		h.logger.Warn("a response is charged what the first max_body bytes of its body report; what came after was not read", fields...)
	}
}

// countCharged counts what a limit charged and forgave, in tokens.
func (h *Handler) countCharged(l *limit.Limit, charged, forgiven float64) {
	if h.metrics == nil || h.metrics.charged[l.Index] == nil { // a limit that does not charge (its tokens given back: wait.go)
		return
	}
	h.metrics.charged[l.Index].Add(charged)
	if forgiven > 0 {
		h.metrics.forgiven[l.Index].Add(forgiven)
	}
}

// countSettleFailure counts settlements lost, and logs (throttled) why:
// the reservations of their buckets stand. items, when given, are
// counted as charged their reservations.
func (h *Handler) countSettleFailure(buckets []limit.Bucket, items []limit.Settling, err error) {
	for _, it := range items {
		b := &buckets[it.Bucket]
		h.countCharged(b.Limit, float64(b.Values.Requested), 0)
	}
	if h.metrics != nil && h.metrics.settleFailures != nil {
		h.metrics.settleFailures.Inc()
	}
	if err == redisbatch.ErrBreakerOpen {
		return // logged when the breaker opened
	}
	if ok, suppressed := h.redisWarns.Allow(); ok {
		h.logger.Warn("settling a response's cost failed; its reservation stands, and the settlement is not sent again",
			zap.String("zone", h.Zone), zap.Error(err), logs.Suppressed(suppressed))
	}
}

// chargeCounters are a zone's charging series, by limit index (nil for a
// limit that does not charge).
func chargeCounters(zone string, limits []*limit.Limit) (charged, forgiven []prometheus.Counter, failures prometheus.Counter) {
	charged, forgiven = make([]prometheus.Counter, len(limits)), make([]prometheus.Counter, len(limits))
	charges := false
	for i, l := range limits {
		if l.Charge != nil {
			charged[i] = collectors.charged.WithLabelValues(zone, l.Name)
			forgiven[i] = collectors.forgiven.WithLabelValues(zone, l.Name)
			charges = true
		}
	}
	if charges {
		failures = collectors.settleFailures.WithLabelValues(zone)
	}
	return charged, forgiven, failures
}
