package ratelimit

import (
	"net/http"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// What the features of a handler do around a request's decision, beside
// the decision itself: read values before it (request_body), and, for an
// admitted request, register what must follow its response and do it
// once the response has ended (a charge settled, what the request held
// while served given back).
// Each feature contributes its steps when the handler is provisioned
// (h.before, h.steps); the request path (serve.go) runs them in order
// without asking which it has. A step keeps what it registered in the
// request (pooled), so running it allocates nothing of its own.

// A preStep runs before a request's buckets are resolved, and may set
// placeholders that its keys and values name.
type preStep interface {
	// before does the step, and returns what must end once the handlers
	// after this one have returned, or nil.
	before(r *http.Request) ender
}

// ender is what a preStep leaves to end once the handlers have returned.
type ender interface{ Done() }

// maxPreSteps is how many preSteps a handler may have: their enders are
// kept in the request's stack frame.
const maxPreSteps = 2

// endAll ends what a request's preSteps left.
func endAll(ends [maxPreSteps]ender) {
	for _, e := range ends {
		if e != nil {
			e.Done()
		}
	}
}

// A step registers what must follow the response of an admitted
// request, and does it once the response has ended.
type step interface {
	// register registers it in req, and says whether there is anything
	// to do after the response. It may wrap req.w, the writer that the
	// next handler writes the response to.
	register(req *request) bool
	// finish does what register registered, once the response ended
	// with err (errAborted when a later handler panicked); r's context
	// says whether the client left.
	finish(r *http.Request, req *request, err error)
}

// holdStep is the step of a handler with limits held while served
// (heldKind): an admitted request holds what its store answers
// (store.hold) while its response is served, counted in the in_flight
// gauge, and gives it back once the response has ended.
type holdStep struct{ h *Handler }

func (s holdStep) register(req *request) bool {
	if limit.FirstHeld(req.Buckets) < len(req.Buckets) {
		if hold := s.h.store.Hold(&req.Call); hold != nil {
			req.hold = hold
			countInFlight(req.Buckets, 1)
		}
	}
	return req.hold != nil
}

func (holdStep) finish(_ *http.Request, req *request, _ error) {
	if req.hold != nil {
		countInFlight(req.Buckets, -1)
		req.hold.Release()
	}
}

// addStep adds s to the handler's steps, once.
func (h *Handler) addStep(s step) {
	for _, have := range h.steps {
		if have == s {
			return
		}
	}
	h.steps = append(h.steps, s)
}

// countInFlight adds d to the in_flight gauge of each of the buckets
// held while served (limit.inFlight).
func countInFlight(buckets []limit.Bucket, d float64) {
	for i := limit.FirstHeld(buckets); i < len(buckets); i++ {
		if g := buckets[i].Limit.InFlight; g != nil {
			g.Add(d)
		}
	}
}
