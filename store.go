package ratelimit

import (
	"context"
	"errors"
	"time"
)

// store decides requests with the buckets it keeps: Redis (redisstore.go)
// or the process's memory (memstore.go, store memory). The deny cache
// (denycache.go), leases (leasecall.go) and on_error (onerror.go) are
// layers: stores that wrap another and answer the same call. Provision
// builds a handler's stack once (buildStore); the request path calls its
// top and never asks what it holds.
type store interface {
	// take takes what the request asks of every one of its buckets, or
	// of none, as at r.sent, and fills in each bucket's
	// answer (remaining, wait). err is a failure to decide; a layer that
	// decides despite it (on_error) says so in r.
	take(ctx context.Context, r *request) (allowed bool, err error)
	// settle settles the charges of a served request, items, where its
	// buckets were taken (charge.go).
	settle(r *request, items []settling)
	// keeper is where the store keeps buckets: an admitted request's (r),
	// where they were taken; with r nil, those the admin API reads. A
	// kind keeps there what is its own beside its buckets
	// (kind.finishing, kind.bucketInfo).
	keeper(r *request) keeper
	// peek reads a bucket without changing it, for the admin API.
	peek(ctx context.Context, b bucket) (bucketView, error)
	// reset makes a bucket full again, and frees what requests hold of
	// it while they are served (kind.heldWhileServed).
	reset(ctx context.Context, b bucket) error
}

// A keeper keeps buckets: the limiter of a Redis, or the process's
// memory (store.keeper).
type keeper interface{ keepsBuckets() }

func (*limiter) keepsBuckets() {}

// inProcess is store memory: a handler's buckets in the process's memory
// (memstore.go), which handlers of the same zone share.
type inProcess struct {
	h *Handler
	s *memoryStore
}

func (p inProcess) take(_ context.Context, r *request) (bool, error) {
	return p.s.takeInProcess(r.sent, r.buckets)
}
func (p inProcess) settle(r *request, items []settling) { p.h.settleInProcess(p.s, r.buckets, items) }
func (p inProcess) keeper(*request) keeper              { return p.s }
func (p inProcess) peek(_ context.Context, b bucket) (bucketView, error) {
	return p.s.peek(time.Now(), b), nil
}
func (p inProcess) reset(_ context.Context, b bucket) error {
	p.s.reset([]string{b.key})
	return nil
}

// noStore is the store of a handler whose limits all block (burst 0):
// none is ever asked to take, and it keeps nothing.
type noStore struct{}

func (noStore) take(context.Context, *request) (bool, error)     { return false, errNoStore }
func (noStore) settle(*request, []settling)                      {}
func (noStore) keeper(*request) keeper                           { return nil }
func (noStore) peek(context.Context, bucket) (bucketView, error) { return bucketView{}, nil }
func (noStore) reset(context.Context, bucket) error              { return nil }

var errNoStore = errors.New("no store: every limit blocks")

// buildStore builds the handler's stack of a store and its layers, once
// the store's parts are set up (Provision).
func (h *Handler) buildStore() {
	var s store
	switch {
	case h.memory != nil:
		s = inProcess{h: h, s: h.memory}
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
	h.store = &onErrorLayer{store: s, h: h, local: h.local, failOpen: h.failOpen}
}
