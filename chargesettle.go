package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

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
	if h.metrics == nil {
		return
	}
	h.metrics.charged[l.Index].Add(charged)
	if forgiven > 0 {
		h.metrics.forgiven[l.Index].Add(forgiven)
	}
}

// settleCall is one settlement call on its way to Redis (a request's
// buckets, or on a Cluster those of one slot group) and what each of its
// buckets charged, read when Redis answers. Pooled, with its call: a
// settlement costs no goroutine and no allocation of its own.
type settleCall struct {
	h      *Handler
	items  []settlement
	inline [limit.MaxInline]settlement
}

var settleCalls = sync.Pool{New: func() any {
	s := new(settleCall)
	s.items = s.inline[:0]
	return s
}}

// settlement is one bucket's part of a settleCall.
type settlement struct {
	limit          *limit.Limit
	cost, reserved int64
	diff           int64
}

// settleInRedis queues the settlement of a request's buckets, one script
// call for all of them (one per slot group on a Cluster), before the
// request returns, so that it precedes the client's next request in the
// queue; what Redis answers is read by the batcher's worker (TakeAnswer),
// off the request path. A call is sent at most once: one lost to a
// failure is counted and logged, and the reservation stands.
func (h *Handler) settleInRedis(buckets []limit.Bucket, items []limit.Settling) {
	groups := 1
	if h.groups != nil {
		groups = len(h.groups)
	}
	now := time.Now()
	var inline [limit.MaxInline]limit.Settling
	for g := range groups {
		group := inline[:0]
		for _, it := range items {
			if h.groups == nil || buckets[it.Bucket].Limit.Group == g {
				group = append(group, it)
			}
		}
		if len(group) == 0 {
			continue
		}
		s := settleCalls.Get().(*settleCall)
		s.h = h
		c := redisbatch.NewCall()
		for _, it := range group {
			c.Keys = append(c.Keys, buckets[it.Bucket].Key)
		}
		c.Command(settleScript)
		for _, it := range group {
			b := &buckets[it.Bucket]
			c.Args = append(c.Args, b.Charged().SettleArg(*b), b.Args[1], diffArg(it.Diff), b.Limit.Charge.MaxDebtArg(b.Values.Burst, b.Values.Rate, b.Args[1]))
			s.items = append(s.items, settlement{limit: b.Limit, cost: it.Cost, reserved: b.Values.Requested, diff: it.Diff})
		}
		c.ClientCtx, c.Then = context.Background(), s // sent even when the client has left
		if err := h.limiter.batcher.Enqueue(c, now); err != nil {
			c.Err = err
			s.TakeAnswer(c)
		}
	}
}

// smallDiffs are the differences of -512 to 511 as script arguments,
// boxed once.
var smallDiffs = func() (v [1024]any) {
	for i := range v {
		v[i] = strconv.Itoa(i - 512)
	}
	return v
}()

func diffArg(diff int64) any {
	if diff >= -512 && diff < 512 {
		return smallDiffs[diff+512]
	}
	return strconv.FormatInt(diff, 10)
}

// TakeAnswer reads what Redis answered to a settlement call, in the
// batcher's worker: it counts what was charged and forgiven, and
// releases the call and itself.
func (s *settleCall) TakeAnswer(c *redisbatch.Call) {
	h := s.h
	err := c.Err
	if err == nil && len(c.Reply) != 2*len(s.items) {
		err = fmt.Errorf("unexpected settle reply %v", c.Reply)
	}
	if err != nil {
		h.countSettleFailure(nil, nil, err)
		for _, it := range s.items {
			h.countCharged(it.limit, float64(it.reserved), 0)
		}
	} else {
		gaveBack, unsettled := false, false
		for i, it := range s.items {
			if r := c.Reply[2*i]; r < 0 {
				// -2: a bucket whose reservation's period is no longer
				// counted, with nothing to settle; else its key holds
				// another type, or the write was refused.
				unsettled = unsettled || r != -2
				h.countCharged(it.limit, float64(it.reserved), 0)
				continue
			}
			forgiven := float64(c.Reply[2*i]) + float64(c.Reply[2*i+1])/1e6
			h.countCharged(it.limit, float64(it.cost)-forgiven, forgiven)
			gaveBack = gaveBack || it.diff < 0
		}
		if unsettled {
			h.countSettleFailure(nil, nil, errUnsettled)
		}
		if gaveBack {
			h.forgetRefilled(c.Keys)
		}
	}
	c.Release()
	clear(s.items)
	s.h, s.items = nil, s.items[:0]
	settleCalls.Put(s)
}

// settlements are merged per batch (redisbatch.MergedKind): settle.lua
// settles each bucket on its own (make bench, charge@64: scripts/req
// 2.00 -> 1.05, Redis µs per request 15.6 -> 13.6;
// BenchmarkServeHTTPCharged 15 -> 13 allocs). The batcher also keeps
// them ahead of the calls queued after them.
var settlements = &redisbatch.MergedKind{Name: "settle", Script: settleScript, Width: 2,
	Is: func(c *redisbatch.Call) bool { return c.Script == settleScript && c.Then != nil }}

// errUnsettled is a bucket that settle.lua could not settle.
var errUnsettled = errors.New("a bucket was not settled: its key holds another type, or Redis refused the write")

// countSettleFailure counts settlements lost, and logs (throttled) why:
// the reservations of their buckets stand. items, when given, are
// counted as charged their reservations.
func (h *Handler) countSettleFailure(buckets []limit.Bucket, items []limit.Settling, err error) {
	for _, it := range items {
		b := &buckets[it.Bucket]
		h.countCharged(b.Limit, float64(b.Values.Requested), 0)
	}
	if h.metrics != nil {
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
