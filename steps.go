package ratelimit

import "net/http"

// What the features of a handler do around a request's decision, beside
// the decision itself: read values before it (request_body), and, for an
// admitted request, register what must follow its response and do it
// once the response has ended (a charge settled, what a kind held
// while serving it given back).
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

// holding is what a request holds while it is served, where its store
// took it, for a kind's step to give back once the response has ended
// (kind.finishing).
type holding interface{ release() }

// addStep adds s to the handler's steps, once: the limits of a kind
// share theirs.
func (h *Handler) addStep(s step) {
	for _, have := range h.steps {
		if have == s {
			return
		}
	}
	h.steps = append(h.steps, s)
}
