package ratelimit

import (
	"context"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"go.uber.org/zap"
)

// redisStore keeps a handler's buckets in Redis, through the limiter its
// redis setting shares: one script call a request, or on a Cluster whose
// hash slots the request's buckets span, one per group of them
// (takeGroups).
type redisStore struct {
	h       *Handler
	limiter *limiter
	groups  [][]*limit.Limit // on Cluster, limits by hash slot, when they span several
	holding bool             // some limit is held while a request is served (heldKind)
}

// A handler with a Redis client (Provision makes one unless the
// buckets are in the process, or every limit blocks) keeps its buckets
// in Redis.
func init() {
	registerStore(storeConfig{order: 1, build: func(h *Handler, below limit.Store) limit.Store {
		if h.limiter == nil {
			return below
		}
		return &redisStore{h: h, limiter: h.limiter, groups: h.groups, holding: h.holding}
	}})
}

// take takes a request's buckets in Redis; with buckets held while
// served, as what requests hold of them needs (takeHolding).
func (s *redisStore) Take(ctx context.Context, r *limit.Call) (allowed bool, err error) {
	if s.holding {
		allowed, err = s.takeHolding(ctx, r.Sent, r.Buckets)
	} else {
		allowed, err = s.takeAll(ctx, r.Sent, r.Buckets)
	}
	s.h.answeredByRedis(ctx, r, allowed, err)
	return allowed, err
}

// takeAll takes a request's buckets in Redis: in one call, or on a
// Cluster whose hash slots they span, a call per slot group.
func (s *redisStore) takeAll(ctx context.Context, sent time.Time, buckets []limit.Bucket) (bool, error) {
	if s.groups == nil {
		return s.limiter.take(ctx, sent, buckets)
	}
	return s.h.takeGroups(ctx, sent, buckets)
}

// answeredByRedis completes what Redis answered to a request's take
// (sent at r.sent): the metric of its time, the refused buckets' waits
// (kind.refused), and a line for a failure, throttled (an open breaker
// was logged when it opened).
func (h *Handler) answeredByRedis(ctx context.Context, r *limit.Call, allowed bool, err error) {
	if h.metrics != nil && err != redisbatch.ErrBreakerOpen {
		h.metrics.redisDuration.Observe(time.Since(r.Sent).Seconds())
	}
	switch e := err.(type) {
	case nil:
		if !allowed {
			limit.CompleteRefusal(r.Buckets)
		}
	case redisbatch.OverloadError:
		if ctx.Err() != nil {
			break // the client left; whatever happened is not worth a line
		}
		h.warnOverloaded(err)
	case limit.KindError:
		h.warnKind(e)
	default:
		if err == redisbatch.ErrBreakerOpen || ctx.Err() != nil {
			break // a client that left says nothing about Redis
		}
		h.warnRedisFailed(err)
	}
}

func (s *redisStore) Settle(r *limit.Call, items []limit.Settling) {
	s.h.settleInRedis(r.Buckets, items)
}

// peek reads a bucket held while served as what requests hold of it
// (peekHeld).
func (s *redisStore) Peek(ctx context.Context, b limit.Bucket) (limit.View, error) {
	if b.HeldWhileServed() {
		return s.limiter.peekHeld(ctx, b.Key)
	}
	views, err := s.limiter.peek(ctx, []limit.Bucket{b})
	if err != nil {
		return limit.View{}, err
	}
	return views[0], nil
}

// reset forgets this instance's cached denials of the key at once;
// other instances forget theirs when the reset's message reaches them.
func (s *redisStore) Reset(ctx context.Context, b limit.Bucket) error {
	s.h.forgetDenials([]string{b.Key})
	return s.limiter.reset(ctx, []string{b.Key})
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
// limiter, which tells every handler that uses it.
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
