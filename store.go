package ratelimit

import (
	"context"
	"errors"
)

// store decides requests with the buckets it keeps: in Redis
// (redisstore.go) or in the process's memory. The deny cache
// (denycache.go), leases (leasecall.go) and the fallback while a store
// fails are layers: stores that wrap another and answer the same call.
// Provision builds a handler's stack once (buildStore); the request path calls its
// top and never asks what it holds.
type store interface {
	// take takes the request's tokens (and slots) from every one of its
	// buckets, or from none, as at r.sent, and fills in each bucket's
	// answer (remaining, wait). err is a failure to decide; a layer that
	// decides despite it (a fallback) says so in r.
	take(ctx context.Context, r *request) (allowed bool, err error)
	// settle settles the charges of a served request, items, where its
	// buckets were taken (charge.go).
	settle(r *request, items []settling)
	// hold holds the slots of an admitted request while its response is
	// served, where they were taken; the hold's release gives them back
	// (concurrent.go).
	hold(r *request) *slotHold
	// peek reads a bucket without changing it, and peekSlots a concurrent
	// limit's slots, for the admin API.
	peek(ctx context.Context, b bucket) (bucketView, error)
	peekSlots(ctx context.Context, b bucket) (slotView, error)
	// reset makes a bucket (or its slots) full again.
	reset(ctx context.Context, b bucket) error
}

// noStore is the store of a handler whose limits all block (burst 0):
// none is ever asked to take, and it keeps nothing.
type noStore struct{}

func (noStore) take(context.Context, *request) (bool, error)        { return false, errNoStore }
func (noStore) settle(*request, []settling)                         {}
func (noStore) hold(*request) *slotHold                             { return nil }
func (noStore) peek(context.Context, bucket) (bucketView, error)    { return bucketView{}, nil }
func (noStore) peekSlots(context.Context, bucket) (slotView, error) { return slotView{}, nil }
func (noStore) reset(context.Context, bucket) error                 { return nil }

var errNoStore = errors.New("no store: every limit blocks")

// buildStore builds the handler's stack of a store and its layers, once
// the store's parts are set up (Provision).
func (h *Handler) buildStore() {
	var s store
	switch {
	case h.memory != nil:
		s = h.memory.storeFor(h, true)
	case h.limiter == nil:
		s = noStore{} // hard blocks only: nothing ever asks a store
	default:
		redis := &redisStore{h: h, limiter: h.limiter, groups: h.groups, holding: h.holding}
		switch {
		case h.leases != nil:
			s = leaseLayer{redis}
		case h.useDenyCache:
			s = &denyLayer{store: redis, cache: h.denied, perRequest: h.perRequest}
		default:
			s = redis
		}
	}
	h.store = h.withFallback(s)
}
