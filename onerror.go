package ratelimit

import (
	"context"
	"fmt"
	"time"

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
	store    // below: asked first
	h        *Handler
	local    store // on_error local: the buckets in the process while Redis fails
	failOpen bool  // on_error allow
}

// withFallback puts the on_error layer over the handler's store.
func (h *Handler) withFallback(below store) store {
	e := &onErrorLayer{store: below, h: h, failOpen: h.failOpen}
	if h.local != nil {
		e.local = h.local.storeFor(h, false)
	}
	return e
}

// on_error tops every stack: it decides what the stack below could not.
func init() {
	registerLayer(storeConfig{order: 100, build: func(h *Handler, below store) store { return h.withFallback(below) }})
}

func (e *onErrorLayer) take(ctx context.Context, r *call) (bool, error) {
	allowed, err := e.store.take(ctx, r)
	if err == nil || ctx.Err() != nil {
		return allowed, err
	}
	if e.local != nil {
		for i := range r.buckets {
			r.buckets[i].unknown = false // a Cluster group that failed left them so; every bucket answers here
		}
		r.sent = time.Now() // the local take is as at now, after Redis failed
		allowed, err := e.local.take(ctx, r)
		if err != nil { // full: as on_error allow
			r.fail(decisionFailedAllowed)
			return true, nil
		}
		r.admitted, r.refused, r.takenBy = decisionFallbackAllowed, decisionFallbackDenied, e.local
		return allowed, nil
	}
	switch {
	case err == errMemoryFull:
		r.fail(decisionOverflow)
	case e.failOpen:
		r.fail(decisionFailedAllowed)
	default:
		r.fail(decisionFailedDenied)
	}
	return e.failOpen, err
}

// refuserBelow is the refuser of the store below (refuserOf): on_error
// decides only what that store could not.
func (e *onErrorLayer) refuserBelow() refuser { return refuserOf(e.store) }

// settle and hold go where the request's buckets were taken: the
// local buckets when the layer took them (r.takenBy).
func (e *onErrorLayer) settle(r *call, items []settling) {
	if r.takenBy != nil {
		r.takenBy.settle(r, items)
		return
	}
	e.store.settle(r, items)
}

func (e *onErrorLayer) hold(r *call) holding {
	if r.takenBy != nil {
		return r.takenBy.hold(r)
	}
	return e.store.hold(r)
}

// reset resets the key in the local buckets too.
func (e *onErrorLayer) reset(ctx context.Context, b bucket) error {
	if e.local != nil {
		_ = e.local.reset(ctx, b) // in the process: it cannot fail
	}
	return e.store.reset(ctx, b)
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
