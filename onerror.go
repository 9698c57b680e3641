package ratelimit

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// onErrorLayer decides, as on_error says, a request that the store below
// it could not: allow or deny it without its buckets, or (local) take
// its buckets in the process's memory while Redis fails. A request whose
// client left is not decided: it ends with 499. A request decided
// without its buckets is marked failed, and keeps err, the cause.
type onErrorLayer struct {
	store    // below: asked first
	h        *Handler
	local    *memoryStore // on_error local: the buckets while Redis fails
	failOpen bool         // on_error allow
}

func (e *onErrorLayer) take(ctx context.Context, r *request) (bool, error) {
	allowed, err := e.store.take(ctx, r)
	if err == errMemoryFull {
		e.h.warnFull() // also when the client left: the store is full all the same
	}
	if err == nil || ctx.Err() != nil {
		return allowed, err
	}
	if e.local != nil {
		for i := range r.buckets {
			r.buckets[i].unknown = false // a Cluster group that failed left them so; every bucket answers here
		}
		allowed, err := e.local.takeInProcess(time.Now(), r.buckets)
		if err != nil { // full: as on_error allow
			r.fail(decisionErrorAllowed)
			return true, nil
		}
		r.admitted, r.refused, r.local = decisionErrorLocalAllowed, decisionErrorLocalDenied, true
		return allowed, nil
	}
	switch {
	case err == errMemoryFull:
		r.fail(decisionOverflow)
	case e.failOpen:
		r.fail(decisionErrorAllowed)
	default:
		r.fail(decisionErrorDenied)
	}
	return e.failOpen, err
}

// settle and keeper go where the request's buckets were taken.
func (e *onErrorLayer) settle(r *request, items []settling) {
	if r.local {
		e.h.settleInProcess(e.local, r.buckets, items)
		return
	}
	e.store.settle(r, items)
}

func (e *onErrorLayer) keeper(r *request) keeper {
	if r != nil && r.local {
		return e.local
	}
	return e.store.keeper(r)
}

// reset resets the key in the local buckets too.
func (e *onErrorLayer) reset(ctx context.Context, b bucket) error {
	if e.local != nil {
		e.local.reset([]string{b.key})
	}
	return e.store.reset(ctx, b)
}

// warnFull: see the warnings of redisstore.go.
func (h *Handler) warnFull() {
	if ok, suppressed := h.fullWarns.allow(); ok {
		h.logger.Warn("in-memory store full: a new client's request follows on_error", zap.String("zone", h.Zone),
			zap.Int64("max_keys", h.MaxKeys), zap.String("on_error", h.OnError), suppressedField(suppressed))
	}
}
