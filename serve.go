package ratelimit

import (
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddy-redis/ratelimit/internal/scan"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// A request's path through the handler (ServeHTTP): limit resolves its
// buckets, decides it with the handler's store, and answers it; an
// admitted request is served, then finished.

// ServeHTTP takes tokens from the request's buckets or denies it. It
// reads as a request goes: limit resolves its buckets, decides it with
// the handler's store and answers it (headers, placeholders, metric,
// log); an admitted request is then served, and finished when the
// decision registered something for after its response.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if len(h.before) > 0 {
		// A refusal known before the values are read needs none of them
		// (a request body's is not read then: beforebody.go).
		if h.beforeBody != nil {
			if refused, err := h.refuseBeforeBody(w, r); refused {
				return err
			}
		}
		// Values first, placeholders that keys and values may name (a
		// request body's, requestbody.go).
		var ends [maxPreSteps]ender
		for i, s := range h.before {
			ends[i] = s.before(r)
		}
		defer endAll(ends)
	}
	req, pass, err := h.limit(w, r)
	switch {
	case !pass:
		return err
	case req == nil:
		return next.ServeHTTP(w, r)
	}
	return h.serveAndFinish(r, next, req)
}

// request is what a handler's stack knows of one request while deciding
// it: its buckets and how it was decided. It is pooled, not on the
// stack: the buckets go down the stack through an interface, which would
// move a stack array of them to the heap (768 bytes a request).
type request struct {
	limit.Call
	inline [limit.MaxInline]limit.Bucket
	// settling holds a charged request's settlements (charge.go), here
	// for the reason the buckets are.
	settling [limit.MaxInline]limit.Settling
	// weights are its weights with placeholders, resolved once for the
	// reservation, the check and the settlement (internal/cost).
	weights cost.Memo
	// repl is the request's replacer, for a settlement made while the
	// response passes (cost.Writer).
	repl *caddy.Replacer

	// What an admitted request's steps registered for after its
	// response (steps.go): w is the writer the next handler writes to
	// (one that watches the response for its charge, charge.go); hold what
	// its store holds until then (holdStep). registered says
	// some step has something to do then.
	w          http.ResponseWriter
	hold       limit.Holding
	charge     *cost.Writer
	registered bool
	// chargeWriter, chargeSettler and scanBody are charge's, here rather
	// than allocated per response: the request outlives the response it
	// watches (2 allocs and 1.2 KB less per request of make bench's
	// llm@64, 1 alloc for charge@64: BenchmarkServeHTTPLLM,
	// BenchmarkServeHTTPCharged).
	chargeWriter  cost.Writer
	chargeSettler chargeSettler
	scanBody      scan.Body
}

var requests = sync.Pool{New: func() any { return new(request) }}

// acquireRequest is a request from the pool, its buckets empty.
func acquireRequest() *request {
	r := requests.Get().(*request)
	r.Call.Reset(r.inline[:0])
	r.w, r.hold, r.charge, r.registered = nil, nil, nil, false
	r.weights.Reset()
	return r
}

// free puts r back in the pool. Nothing may keep r's buckets after: a
// goroutine or a call that outlives the request takes a copy.
func (r *request) free() {
	if cap(r.Buckets) > limit.MaxInline {
		r.Buckets = nil // not the pool's to keep
	}
	if cap(r.LayerMarks) > limit.MaxInline {
		r.LayerMarks = nil
	}
	r.w, r.repl = nil, nil // nor the response's writer, nor its replacer
	if r.charge != nil {
		r.chargeWriter = cost.Writer{} // the pool keeps no response writer, nor handler
		r.chargeSettler = chargeSettler{}
	}
	requests.Put(r)
}

// limit decides a request: pass says it goes on to the next handler,
// else it ends with err (nil when the denial was written here). req is
// the request when its decision registered something for after its
// response (serveAndFinish), else nil. Its stack frame is gone before
// the next handler runs: the handlers after this one run less deep,
// where Caddy's server is deep already, and requests do not grow their
// goroutine's stack again after each GC shrank it (runtime.newstack:
// 1.8% of Caddy's CPU under make bench's memory@64 load with the frames
// of this handler below the next ones, 1.3% without).
func (h *Handler) limit(w http.ResponseWriter, r *http.Request) (_ *request, pass bool, err error) {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	req := acquireRequest()
	req.repl = repl
	if req.Buckets, pass, err = h.resolve(w, r, repl, req); req.Buckets == nil {
		req.free()
		return nil, pass, err
	}
	waits := h.waits && h.mayWait(req) // wait.go
	req.MayQueue, req.Waiting = waits, h.waitingNow
	req.Sent = time.Now()
	allowed, err := h.store.Take(r.Context(), &req.Call)
	if waits && (err != nil || !allowed || req.Failed || limit.Wait(req.Buckets) == 0) {
		h.doneWaiting() // it does not wait
		waits = false
	}
	switch {
	case req.Failed:
		pass, err = h.answerFailed(w, r, repl, req, allowed, err)
	case err != nil:
		// The client went away; that says nothing about Redis.
		if req.Queued > 0 { // while it waited for a slot
			h.recordWaited(repl, limit.DecisionLeftWaiting, req.Buckets, 0, req.Queued)
		}
		pass, err = false, caddyhttp.Error(499, r.Context().Err())
	default:
		pass, err = h.answer(w, r, repl, req, allowed)
	}
	if waits {
		h.doneWaiting()
	}
	if pass && req.registered {
		return req, true, nil
	}
	req.free()
	return nil, pass, err
}

// resolve finds a request's buckets. None (nil) when the request is
// decided without asking a store: no limit applies (pass: it goes on),
// or it is refused (the denial written, or err).
func (h *Handler) resolve(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, req *request) (_ []limit.Bucket, pass bool, err error) {
	buckets, skipped, err := h.resolveBucketsWith(r, repl, req.Buckets, &req.weights)
	switch {
	case err == errEmptyKey:
		h.record(repl, limit.DecisionEmptyKey, nil, -1)
		return nil, false, reject(w, r, h.errEmptyKey)
	case err != nil:
		return nil, false, h.refuseInvalid(w, r, repl, err)
	case len(buckets) == 0:
		h.record(repl, skipped, nil, -1)
		return nil, true, nil
	}
	if h.chargeWeights {
		if err := h.checkChargeWeights(buckets, repl, &req.weights); err != nil { // charge.go
			return nil, false, h.refuseInvalid(w, r, repl, err)
		}
	}
	if blocked := limit.Blocked(buckets); blocked >= 0 {
		return nil, false, h.refuseBlocked(w, r, repl, buckets, blocked)
	}
	return buckets, true, nil
}

// refuseBlocked refuses a request one of whose buckets holds nothing
// (burst 0), without asking a store.
func (h *Handler) refuseBlocked(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, buckets []limit.Bucket, blocked int) error {
	buckets[blocked].Remaining, buckets[blocked].RetryAfter = 0, -1
	h.headers.set(w.Header(), buckets, blocked, false)
	h.record(repl, limit.DecisionDenied, buckets, blocked)
	return reject(w, r, h.errBlocked)
}

// answerFailed ends the decision on a request that a layer decided
// without its buckets' answers (req.failed): pass when the layer allowed
// it, else a denial that does not say the cause, err.
func (h *Handler) answerFailed(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, req *request, pass bool, err error) (bool, error) {
	buckets := req.Buckets
	buckets[0].Remaining = -1
	h.headers.set(w.Header(), buckets[:1], 0, false)
	h.record(repl, req.Failure, buckets, 0)
	switch {
	case pass:
		return true, nil
	case err == limit.ErrFull:
		return false, reject(w, r, prebuiltError(http.StatusServiceUnavailable, err))
	}
	// Not err: a Redis error names internal addresses ("dial tcp
	// 10.0.0.5:6379", "MOVED ..."), which {http.error.message} would hand
	// to clients.
	return false, reject(w, r, h.errRedis)
}

// answer ends the decision on a request whose buckets answered: the
// headers, then on to the next handler, or a denial with Retry-After (in
// shadow mode, on). An admitted request registers what must follow its
// response.
func (h *Handler) answer(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, req *request, allowed bool) (pass bool, err error) {
	buckets := req.Buckets
	if !allowed && h.ResetJitter > 0 {
		limit.JitterRefusal(buckets, time.Duration(h.ResetJitter)) // before anything says the wait
	}
	described := limit.Described(buckets, allowed)
	h.headers.set(w.Header(), buckets, described, !allowed && !h.Shadow)
	switch {
	case allowed:
		d, waited := req.Admitted, req.Queued
		if wait := h.waitOf(buckets); wait > 0 {
			waited += wait
			if !h.await(r, req, wait) { // wait.go
				h.recordWaited(repl, limit.DecisionLeftWaiting, buckets, described, waited)
				return false, errLeftWaiting
			}
		}
		if waited > 0 {
			h.observeWait(waited)
			if d == limit.DecisionAllowed {
				d = limit.DecisionWaited
			}
		}
		h.recordWaited(repl, d, buckets, described, waited)
	case h.Shadow:
		h.record(repl, limit.DecisionShadowDenied, buckets, described)
		h.logShadowDenial(buckets, described)
	default:
		h.record(repl, req.Refused, buckets, described)
		return false, reject(w, r, h.errDenied)
	}
	if allowed {
		h.register(w, req)
	}
	return true, nil
}

// register runs the handler's steps (steps.go) on an admitted request:
// each registers what must follow its response.
func (h *Handler) register(w http.ResponseWriter, req *request) {
	req.w = w
	for _, s := range h.steps {
		if s.register(req) {
			req.registered = true
		}
	}
}

// serveAndFinish serves an admitted request through next, then finishes
// it, however the response ended: also when a later handler panics
// (reverse_proxy aborts a response so when the client left mid-stream).
func (h *Handler) serveAndFinish(r *http.Request, next caddyhttp.Handler, req *request) error {
	served := false
	defer func() {
		if !served {
			h.finish(r, req, errAborted)
		}
	}()
	err := next.ServeHTTP(req.w, r)
	served = true
	h.finish(r, req, err)
	return err
}

// errAborted stands for the error of a handler that panicked.
var errAborted = cost.ErrAborted

// finish does what the request's steps registered for after its
// response, which ended with err, in their order (a charge is settled
// before what a kind held while serving it is given back).
func (h *Handler) finish(r *http.Request, req *request, err error) {
	for _, s := range h.steps {
		s.finish(r, req, err)
	}
	req.free()
}

// errEmptyKey marks a request whose key for some limit resolved to
// nothing, with deny_empty_key.
var errEmptyKey = errors.New("empty key")

// refuseInvalid answers a request whose limit values, resolved from its
// placeholders, are out of range, without taking any token: 400 for a
// cost or a value of the request's body that a charge json weight names
// (they come from the client), 500 for a rate, a burst or a weight (a
// configuration mistake). The warning is throttled.
func (h *Handler) refuseInvalid(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, err error) error {
	status := http.StatusInternalServerError
	var pe *limit.ParamError
	var ve *cost.ValueError
	if errors.As(err, &pe) && (pe.Param == "requested_tokens" || pe.Param == "max_wait" || pe.Param == "priority") || errors.As(err, &ve) && ve.FromRequest {
		status = http.StatusBadRequest
	}
	if ok, suppressed := h.paramWarns.Allow(); ok {
		h.logger.Warn("a limit's value from the request is out of range; refused without taking tokens",
			zap.String("zone", h.Zone), zap.Int("status", status), zap.Error(err), logs.Suppressed(suppressed))
	}
	h.record(repl, limit.DecisionInvalid, nil, -1)
	return reject(w, r, prebuiltError(status, err))
}

// reject ends a request with a denial. When the server has error routes
// (`handle_errors`) the denial goes to them as an error. Otherwise the
// status is written here, as Caddy's error path would write it, without
// that path's cost, mostly preparing an error log entry that is then not
// written: 27 allocs, 3.8 KB and about 13 µs per denial
// (BenchmarkCaddyServerDenied/errors=none 81 -> 54 allocs). A flood must
// be cheap to refuse.
func reject(w http.ResponseWriter, r *http.Request, denial caddyhttp.HandlerError) error {
	if srv, _ := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); srv != nil &&
		(srv.Errors == nil || len(srv.Errors.Routes) == 0) {
		w.WriteHeader(denial.StatusCode)
		return nil
	}
	return caddyhttp.Error(denial.StatusCode, denial)
}

// prebuiltError is a denial made once: caddyhttp.Error fills in only the
// ID, without the stack walk it would do for the trace (5 allocs, 256 B
// and about 2.7 µs per denial: BenchmarkServeHTTPDeniedErrorRoutes 13 -> 8).
func prebuiltError(status int, err error) caddyhttp.HandlerError {
	return caddyhttp.HandlerError{Err: err, StatusCode: status, Trace: "rate_limit"}
}
