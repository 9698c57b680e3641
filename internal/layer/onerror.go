package layer

import (
	"context"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// OnErrorOptions say how the fallback decides a request that the store
// below it could not.
type OnErrorOptions struct {
	// Local, when set, takes the request's buckets in the process's
	// memory while the store below fails (on_error local); nil decides
	// without them.
	Local limit.Store
	// FailOpen admits a request decided without its buckets (on_error
	// allow); else it is refused.
	FailOpen bool
}

// onErrorLayer decides, as on_error says, a request that the store below
// it could not: allow or deny it without its buckets, or (local) take
// its buckets in the process's memory while Redis fails. A request whose
// client left is not decided: it ends with 499. A request decided
// without its buckets is marked failed, and keeps err, the cause.
type onErrorLayer struct {
	limit.Store             // below: asked first
	local       limit.Store // on_error local: the buckets in the process while Redis fails
	failOpen    bool        // on_error allow
}

// OnError puts the fallback over below: it decides, as o says, what
// below could not.
func OnError(below limit.Store, o OnErrorOptions) limit.Store {
	return &onErrorLayer{Store: below, local: o.Local, failOpen: o.FailOpen}
}

func (e *onErrorLayer) Take(ctx context.Context, r *limit.Call) (bool, error) {
	allowed, err := e.Store.Take(ctx, r)
	if err == nil || ctx.Err() != nil {
		return allowed, err
	}
	if e.local != nil {
		for i := range r.Buckets {
			r.Buckets[i].Unknown = false // a Cluster group that failed left them so; every bucket answers here
		}
		r.Sent = time.Now() // the local take is as at now, after Redis failed
		allowed, err := e.local.Take(ctx, r)
		if err != nil { // full: as on_error allow
			r.Fail(limit.DecisionFailedAllowed)
			return true, nil
		}
		r.Admitted, r.Refused, r.TakenBy = limit.DecisionFallbackAllowed, limit.DecisionFallbackDenied, e.local
		return allowed, nil
	}
	switch {
	case err == limit.ErrFull: // a store in the process with no room for a new bucket
		r.Fail(limit.DecisionOverflow)
	case e.failOpen:
		r.Fail(limit.DecisionFailedAllowed)
	default:
		r.Fail(limit.DecisionFailedDenied)
	}
	return e.failOpen, err
}

// RefuserBelow is the refuser of the store below (refuserOf): on_error
// decides only what that store could not.
func (e *onErrorLayer) RefuserBelow() limit.Refuser { return limit.RefuserOf(e.Store) }

// Settle and hold go where the request's buckets were taken: the
// local buckets when the layer took them (r.takenBy).
func (e *onErrorLayer) Settle(r *limit.Call, items []limit.Settling) {
	if r.TakenBy != nil {
		r.TakenBy.Settle(r, items)
		return
	}
	e.Store.Settle(r, items)
}

func (e *onErrorLayer) Hold(r *limit.Call) limit.Holding {
	if r.TakenBy != nil {
		return r.TakenBy.Hold(r)
	}
	return e.Store.Hold(r)
}

// Reset resets the key in the local buckets too.
func (e *onErrorLayer) Reset(ctx context.Context, b limit.Bucket) error {
	if e.local != nil {
		_ = e.local.Reset(ctx, b) // in the process: it cannot fail
	}
	return e.Store.Reset(ctx, b)
}
