package ratelimit

import (
	"context"
	"errors"
	"sync"
	"time"
)

// store decides requests with the buckets it keeps: Redis (redisstore.go)
// or the process's memory (memstore.go, store memory). The deny cache
// (denycache.go), leases (leasecall.go) and on_error (onerror.go) are
// layers: stores that wrap another and answer the same call. Provision
// builds a handler's stack once (buildStore); the request path calls its
// top and never asks what it holds.
type store interface {
	// take takes the request's tokens (and slots) from every one of its
	// buckets, or from none, as at r.sent, and fills in each bucket's
	// answer (remaining, wait). err is a failure to decide; a layer that
	// decides despite it (on_error) says so in r.
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
	// reset makes the bucket (or slots) at key full again.
	reset(ctx context.Context, key string) error
}

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
func (p inProcess) hold(r *request) *slotHold           { return p.h.holdSlots(r.buckets, p.s) }
func (p inProcess) peek(_ context.Context, b bucket) (bucketView, error) {
	return p.s.peek(time.Now(), b), nil
}
func (p inProcess) peekSlots(_ context.Context, b bucket) (slotView, error) {
	return slotView{inUse: p.s.slotsInUse(b.key)}, nil
}
func (p inProcess) reset(_ context.Context, key string) error {
	p.s.reset([]string{key})
	p.s.resetSlots([]string{key})
	return nil
}

// noStore is the store of a handler whose limits all block (burst 0):
// none is ever asked to take, and it keeps nothing.
type noStore struct{}

func (noStore) take(context.Context, *request) (bool, error)        { return false, errNoStore }
func (noStore) settle(*request, []settling)                         {}
func (noStore) hold(*request) *slotHold                             { return nil }
func (noStore) peek(context.Context, bucket) (bucketView, error)    { return bucketView{}, nil }
func (noStore) peekSlots(context.Context, bucket) (slotView, error) { return slotView{}, nil }
func (noStore) reset(context.Context, string) error                 { return nil }

var errNoStore = errors.New("no store: every limit blocks")

// request is what a handler's stack knows of one request while deciding
// it: its buckets and how it was decided. It is pooled, not on the
// stack: the buckets go down the stack through an interface, which would
// move a stack array of them to the heap (768 bytes a request).
type request struct {
	buckets []bucket
	inline  [maxInlineBuckets]bucket
	// sent is when the request's decision started: its take is as at
	// then, and its call's timeout runs from then.
	sent time.Time
	// admitted and refused name the decision for the metrics and
	// {http.rate_limit.result}: allowed and denied, unless on_error local
	// decided.
	admitted, refused decision
	// failed says that on_error decided without any bucket's answer
	// (allow, deny, or local with its store full), as failure.
	failed  bool
	failure decision
	// local says the request's buckets were taken from on_error local's
	// store: its slots are held there, its charges settle there.
	local bool
	// settling holds a charged request's settlements (charge.go), here
	// for the reason the buckets are.
	settling [maxInlineBuckets]settling
}

var requests = sync.Pool{New: func() any { return new(request) }}

// acquireRequest is a request from the pool, its buckets empty.
func acquireRequest() *request {
	r := requests.Get().(*request)
	r.buckets = r.inline[:0]
	r.admitted, r.refused, r.failed, r.local = decisionAllowed, decisionDenied, false, false
	return r
}

// free puts r back in the pool. Nothing may keep r's buckets after: a
// goroutine or a call that outlives the request takes a copy.
func (r *request) free() {
	if cap(r.buckets) > maxInlineBuckets {
		r.buckets = nil // not the pool's to keep
	}
	requests.Put(r)
}

// fail records that on_error decided the request without its buckets.
func (r *request) fail(d decision) { r.failed, r.failure = true, d }
