package redisstore

import (
	"context"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"go.uber.org/zap"
)

// Store keeps a handler's buckets in Redis, through the client its
// Redis settings share: one script call a request, or on a Cluster whose
// hash slots the request's buckets span, one per group of them
// (takeGroups).
type Store struct {
	client  *Client
	groups  [][]*limit.Limit // on Cluster, limits by hash slot, when they span several
	holding bool             // some limit is held while a request is served (limit.Held)
	report  Reporter
}

// NewStore is a handler's store over client: groups are its limits by
// Cluster hash slot when they span several (HashSlotGroups; nil
// otherwise), holding says that some limit is held while a request is
// served, and report is told what the handler logs and counts.
func NewStore(client *Client, groups [][]*limit.Limit, holding bool, report Reporter) *Store {
	return &Store{client: client, groups: groups, holding: holding, report: report}
}

// Reporter is what a store tells its handler: the failures of takes
// (Failed, Overloaded, KindFailed) and how long they took (Answered);
// other Redis failures (Warn, throttled with Failed's lines) and details
// (Debug); what settlements charged and forgave (Charged), and those lost
// (SettleFailed); buckets that hold tokens again sooner than their wait
// said (Refilled), or that the admin API reset (ForgetDenials).
type Reporter interface {
	Answered(took time.Duration)
	Failed(err error)
	Overloaded(err error)
	KindFailed(err limit.KindError)
	Warn(msg string, err error, fields ...zap.Field)
	Debug(msg string)
	Charged(l *limit.Limit, charged, forgiven float64)
	SettleFailed(err error)
	Refilled(keys []string)
	ForgetDenials(keys []string)
}

// Take takes a request's buckets in Redis; with buckets held while
// served, as what requests hold of them needs (takeHolding).
func (s *Store) Take(ctx context.Context, r *limit.Call) (allowed bool, err error) {
	if s.holding {
		allowed, err = s.takeHolding(ctx, r)
	} else {
		allowed, err = s.takeAll(ctx, r, r.Sent, r.Buckets)
	}
	Answered(ctx, r, allowed, err, s.report)
	return allowed, err
}

// takeAll takes a request's buckets in Redis: in one call, or on a
// Cluster whose hash slots they span, a call per slot group.
func (s *Store) takeAll(ctx context.Context, r *limit.Call, sent time.Time, buckets []limit.Bucket) (bool, error) {
	if s.groups == nil {
		return s.take(ctx, r, sent, buckets)
	}
	return s.takeGroups(ctx, r, sent, buckets)
}

// take takes buckets (a request's, or on a Cluster one slot group of
// them) in one call: one that may queue for a slot (queueIndex) waits
// for it in the call's place (takeQueueing).
func (s *Store) take(ctx context.Context, r *limit.Call, sent time.Time, buckets []limit.Bucket) (bool, error) {
	if s.holding && r.MayQueue {
		if q := queueIndex(buckets); q >= 0 {
			return s.takeQueueing(ctx, r, sent, buckets, q)
		}
	}
	return s.client.Take(ctx, sent, buckets)
}

// Answered completes what Redis answered to a request's take (sent at
// r.Sent), for the store and for a strategy that takes with calls of its
// own: the time it took, the refused buckets' waits (kind.Refused), and
// a line for a failure, throttled (an open breaker was logged when it
// opened).
func Answered(ctx context.Context, r *limit.Call, allowed bool, err error, report Reporter) {
	if err != redisbatch.ErrBreakerOpen {
		report.Answered(time.Since(r.Sent))
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
		report.Overloaded(err)
	case limit.KindError:
		report.KindFailed(e)
	default:
		if err == redisbatch.ErrBreakerOpen || ctx.Err() != nil {
			break // a client that left says nothing about Redis
		}
		report.Failed(err)
	}
}

// Settle settles the charges of a served request in Redis
// (settleInRedis).
func (s *Store) Settle(r *limit.Call, items []limit.Settling) {
	s.settleInRedis(r.Buckets, items)
}

// Peek reads a bucket; one held while served as what requests hold of
// it (peekHeld).
func (s *Store) Peek(ctx context.Context, b limit.Bucket) (limit.View, error) {
	if b.HeldWhileServed() {
		return s.client.peekHeld(ctx, b.Key)
	}
	views, err := s.client.peek(ctx, []limit.Bucket{b})
	if err != nil {
		return limit.View{}, err
	}
	return views[0], nil
}

// Reset forgets this instance's cached denials of the key at once;
// other instances forget theirs when the reset's message reaches them.
func (s *Store) Reset(ctx context.Context, b limit.Bucket) error {
	s.report.ForgetDenials([]string{b.Key})
	return s.client.Reset(ctx, []string{b.Key})
}
