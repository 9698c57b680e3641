package ratelimit

import (
	"context"
	"fmt"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"go.uber.org/zap"
)

// Values of on_error.
const (
	onErrorAllow = "allow"
	onErrorDeny  = "deny"
	onErrorLocal = "local"
)

func checkOnError(v string) error {
	if v != onErrorAllow && v != onErrorDeny && v != onErrorLocal {
		return fmt.Errorf("on_error '%s': want 'allow', 'deny' or 'local'", v)
	}
	return nil
}

// fallbackDefault fills in on_error when the config leaves it out.
func (h *Handler) fallbackDefault() {
	if h.OnError == "" {
		h.OnError = onErrorAllow
	}
}

// onErrorLayer decides, as on_error says, a request that the store below
// it could not: allow or deny it without its buckets, or (local) take
// its buckets in the process's memory while Redis fails. A request whose
// client left is not decided: it ends with 499. A request decided
// without its buckets is marked failed, and keeps err, the cause.
type onErrorLayer struct {
	limit.Store // below: asked first
	h           *Handler
	local       limit.Store // on_error local: the buckets in the process while Redis fails
	failOpen    bool        // on_error allow
}

// withFallback puts the on_error layer over the handler's store.
func (h *Handler) withFallback(below limit.Store) limit.Store {
	e := &onErrorLayer{Store: below, h: h, failOpen: h.failOpen}
	if h.local != nil {
		e.local = h.local.For(storeReports{h}, false)
	}
	return e
}

// on_error tops every stack: it decides what the stack below could not.
func init() {
	registerLayer(storeConfig{order: 100, build: func(h *Handler, below limit.Store) limit.Store { return h.withFallback(below) }})
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
	case err == errMemoryFull:
		r.Fail(limit.DecisionOverflow)
	case e.failOpen:
		r.Fail(limit.DecisionFailedAllowed)
	default:
		r.Fail(limit.DecisionFailedDenied)
	}
	return e.failOpen, err
}

// refuserBelow is the refuser of the store below (refuserOf): on_error
// decides only what that store could not.
func (e *onErrorLayer) RefuserBelow() limit.Refuser { return limit.RefuserOf(e.Store) }

// settle and hold go where the request's buckets were taken: the
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

// reset resets the key in the local buckets too.
func (e *onErrorLayer) Reset(ctx context.Context, b limit.Bucket) error {
	if e.local != nil {
		_ = e.local.Reset(ctx, b) // in the process: it cannot fail
	}
	return e.Store.Reset(ctx, b)
}

// warnFailed logs, for a store that could not decide a request, what
// failed (words, err), and that the request follows on_error; the store
// throttles it (suppressed lines before it).
func (h *Handler) warnFailed(words string, err error, suppressed int64) {
	h.logger.Warn(words+"; following on_error", zap.String("zone", h.Zone),
		h.fallbackField(), zap.Error(err), logs.Suppressed(suppressed))
}

// What a store's requests do while it fails, as its warnings and errors
// say it, and the field of its warnings that names the fallback.
const (
	followFallback  = "follow on_error"
	followsFallback = "follows on_error"
)

func (h *Handler) fallbackField() zap.Field { return zap.String("on_error", h.OnError) }
