package ratelimit

import (
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"go.uber.org/zap"
)

// What the stores report to the handler that uses them: warnings,
// metrics, breakers, denials to forget. The stores (internal/redisstore,
// internal/memstore) call these through their Reporter interfaces.

// redisReport is the handler as the Redis store and its client tell it
// what to log and count (redisstore.Reporter and Watcher): a type of its
// own, so that those methods are not the module's.
type redisReport Handler

func (h *Handler) redisReport() *redisReport { return (*redisReport)(h) }

func (r *redisReport) Answered(took time.Duration) {
	if h := (*Handler)(r); h.metrics != nil {
		h.metrics.redisDuration.Observe(took.Seconds())
	}
}

func (r *redisReport) Failed(err error)               { (*Handler)(r).warnRedisFailed(err) }
func (r *redisReport) Overloaded(err error)           { (*Handler)(r).warnOverloaded(err) }
func (r *redisReport) KindFailed(err limit.KindError) { (*Handler)(r).warnKind(err) }

// Warn logs a Redis failure outside a take, throttled with the others.
func (r *redisReport) Warn(msg string, err error, fields ...zap.Field) {
	h := (*Handler)(r)
	if ok, suppressed := h.redisWarns.Allow(); ok {
		all := append(append([]zap.Field{zap.String("zone", h.Zone)}, fields...), zap.Error(err), logs.Suppressed(suppressed))
		h.logger.Warn(msg, all...)
	}
}

func (r *redisReport) Debug(msg string) {
	h := (*Handler)(r)
	if ce := h.logger.Check(zap.DebugLevel, msg); ce != nil {
		ce.Write(zap.String("zone", h.Zone))
	}
}

func (r *redisReport) Charged(l *limit.Limit, charged, forgiven float64) {
	(*Handler)(r).countCharged(l, charged, forgiven)
}

func (r *redisReport) SettleFailed(err error)      { (*Handler)(r).countSettleFailure(nil, nil, err) }
func (r *redisReport) Refilled(keys []string)      { (*Handler)(r).forgetRefilled(keys) }
func (r *redisReport) ForgetDenials(keys []string) { (*Handler)(r).forgetDenials(keys) }
func (r *redisReport) ForgetAllDenials()           { (*Handler)(r).forgetAllDenials() }
func (r *redisReport) BreakerDropped(node string)  { (*Handler)(r).breakerDropped(node) }
func (r *redisReport) BreakerChanged(node string, open bool, failures int64) {
	(*Handler)(r).breakerChanged(node, open, failures)
}

// The warnings of a store's take, throttled, each in a function of its
// own: their fields would otherwise take room in the take's stack frame
// on every request (1240 -> 312 bytes; a deeper stack made requests grow their
// goroutine's stack again after each GC shrank it: runtime.newstack took
// 1.6 to 1.8% of Caddy's CPU under make bench's memory@64 load).

// Each says what failed; the line is the fallback's (warnFailed), which
// decides the request instead.

func (h *Handler) warnOverloaded(err error) {
	if ok, suppressed := h.overloaded.Allow(); ok {
		h.warnFailed("overloaded: this instance could not send requests to Redis in time", err, suppressed)
	}
}

func (h *Handler) warnKind(err limit.KindError) {
	if ok, suppressed := h.redisWarns.Allow(); ok {
		h.warnFailed(err.Warning(), err, suppressed)
	}
}

func (h *Handler) warnRedisFailed(err error) {
	if ok, suppressed := h.redisWarns.Allow(); ok {
		h.warnFailed("Redis failed", err, suppressed)
	}
}

// breakerChanged logs a node's breaker opening or closing, for the
// Redis client, which tells every handler that uses it.
func (h *Handler) breakerChanged(node string, open bool, failures int64) {
	if open {
		h.logger.Warn("circuit breaker opened: a Redis node failed repeatedly; requests for its keys skip Redis and "+followFallback+" until it answers",
			zap.String("zone", h.Zone), zap.String("node", node), zap.Int64("consecutive_failures", failures))
	} else {
		h.logger.Info("circuit breaker closed: the Redis node answers again", zap.String("zone", h.Zone), zap.String("node", node))
	}
}

// breakerDropped logs that an open breaker was dropped, since no request
// meets it any more: its node serves no slots now, or the slot map it
// stood for is known again.
func (h *Handler) breakerDropped(node string) {
	msg := "circuit breaker closed: the Redis node serves no slots any more; its keys are served by other nodes"
	if node == redisbatch.UnknownSlots {
		msg = "circuit breaker closed: the Cluster's slot map is known again; requests go to its masters"
	}
	h.logger.Info(msg, zap.String("zone", h.Zone), zap.String("node", node))
}

// storeReports is what a memory store reports to the handler that uses
// it (memstore.Reporter): the handler's warnings and metrics.
type storeReports struct{ h *Handler }

func (r storeReports) Full() { r.h.warnFull() }

func (r storeReports) Charged(l *limit.Limit, charged, forgiven float64) {
	r.h.countCharged(l, charged, forgiven)
}

func (r storeReports) Unsettled(buckets []limit.Bucket, items []limit.Settling, err error) {
	r.h.countSettleFailure(buckets, items, err)
}

// warnFull is throttled, as a store's warnings of a failed take are.
func (h *Handler) warnFull() {
	if ok, suppressed := h.fullWarns.Allow(); ok {
		h.logger.Warn("in-memory store full: a new client's request "+followsFallback, zap.String("zone", h.Zone),
			zap.Int64("max_keys", h.MaxKeys), h.fallbackField(), logs.Suppressed(suppressed))
	}
}
