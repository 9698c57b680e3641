package ratelimit

import (
	"context"
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
}

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
