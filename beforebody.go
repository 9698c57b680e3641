package ratelimit

import (
	"net/http"
	"strings"
	"time"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddyserver/caddy/v2"
)

// Refusals known before a request's body is read. request_body reads the
// body before the keys are resolved, and reading it is what sends a
// client that asked `Expect: 100-continue` its `100 Continue`: a client
// whose bucket is empty would send its body, however large or slow, to
// be refused after it. When a limit whose key and values name no value
// of the body refuses the request whatever the body says, and this
// instance knows it without a call (a hard block, or the refuser of the
// handler's store: a refusal remembered, buckets kept in the process),
// the request is refused first, as the store would refuse it, and its
// body is never read.

// beforeBody is what a handler with request_body asks before it reads a
// request's body.
type beforeBody struct {
	// limits are the handler's limits whose key and values name no
	// placeholder of the body, in the handler's order.
	limits []*limit.Limit
	// track: some of them name a placeholder that a provider may make
	// from the body's (a `map` whose input is the model), so the body's
	// placeholders are watched while they resolve (bodyWatch).
	track bool
	// blocks: some of them may hold nothing (burst 0), which refuses
	// without a store.
	blocks bool
	// refuser is the store's, when what decides first knows refusals
	// without a call (refuserOf).
	refuser limit.Refuser
}

// setUpBeforeBody finds what h can refuse before the body, once its store
// is built; nil when nothing.
func (h *Handler) setUpBeforeBody() {
	h.beforeBody = nil
	if h.request == nil || h.Shadow {
		return // no body read, or no refusal
	}
	bb := &beforeBody{}
	for _, l := range h.limits {
		if l.Fixed && l.Exempt || namesBodyValue(l.KeyText, string(l.Rate), string(l.Burst), string(l.Cost)) {
			continue
		}
		bb.limits = append(bb.limits, l)
		bb.track = bb.track || !readsRequestOnly(l.KeyText, string(l.Rate), string(l.Burst), string(l.Cost))
		bb.blocks = bb.blocks || l.Burst.PerRequest() || l.Fixed && l.Values.Burst == 0 || string(l.Burst) == "0"
	}
	bb.refuser = limit.RefuserOf(h.store)
	if len(bb.limits) == 0 || bb.refuser == nil && !bb.blocks {
		return
	}
	h.beforeBody = bb
}

// namesBodyValue says whether any of the texts names a placeholder that
// request_body sets.
func namesBodyValue(texts ...string) bool {
	for _, t := range texts {
		if strings.Contains(t, "{"+requestPlaceholderPrefix) || strings.Contains(t, "{"+requestSizeKey) {
			return true
		}
	}
	return false
}

// readsRequestOnly says whether every placeholder of the texts is one
// that the request itself answers, before any provider a handler adds
// (keys.Values' sources): a header, the client's address.
func readsRequestOnly(texts ...string) bool {
	for _, t := range texts {
		for rest := t; ; {
			open := strings.IndexByte(rest, '{')
			if open < 0 {
				break
			}
			end := strings.IndexByte(rest[open:], '}')
			if end < 0 {
				return false
			}
			switch name := rest[open+1 : open+end]; {
			case strings.HasPrefix(name, "http.request.header."), keys.HoldsAddress(name):
			default:
				return false
			}
			rest = rest[open+end+1:]
		}
	}
	return true
}

// refuseBeforeBody refuses a request before its body is read, when a
// limit that does not depend on the body refuses it and this instance
// knows so: refused then, with err as the refusal's. Otherwise it
// changes nothing, and the request goes on. The refusal is the one the
// store would give those buckets (a hard block's, or its refuser's). The
// request's other buckets are not known (their keys need the body): the
// answer leaves them out, as a remembered refusal leaves out the buckets
// it knows nothing of.
func (h *Handler) refuseBeforeBody(w http.ResponseWriter, r *http.Request) (refused bool, err error) {
	bb := h.beforeBody
	switch {
	case r.Body == nil || r.Body == http.NoBody:
		return false, nil // no body to spare
	case !bb.blocks && !bb.refuser.MayRefuse():
		return false, nil // nothing known to refuse: not worth resolving keys
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	req := acquireRequest()
	defer req.free()
	var buckets []limit.Bucket
	if !bb.track {
		buckets, _, err = h.resolveLimits(bb.limits, r, repl, req.Buckets, nil)
	} else {
		buckets, err = h.resolveWatched(bb.limits, r, repl, req.Buckets)
	}
	if err != nil || len(buckets) == 0 {
		return false, nil // as the request goes on, decided with all its limits
	}
	req.Buckets = buckets
	if blocked := limit.Blocked(buckets); blocked >= 0 {
		closeUnread(w, r)
		return true, h.refuseBlocked(w, r, repl, buckets, blocked)
	}
	req.Sent = time.Now()
	if bb.refuser == nil || !bb.refuser.Refuses(req.Sent, buckets) {
		return false, nil
	}
	closeUnread(w, r)
	_, err = h.answer(w, r, repl, req, false)
	return true, err
}

// closeUnread ends an HTTP/1 connection after the answer to a request
// whose body is not read. Without it, net/http reads up to 256 KiB of
// what is left of the body before it answers, to keep the connection
// (Caddy wraps the body, so that net/http sees neither a client that
// expects 100 Continue, and will not send its body, nor the body's
// size): such a client, or one stalled mid-body, would have no answer
// until Caddy's read_body_idle timeout. HTTP/2 and HTTP/3 end the stream
// alone (there, Connection: close would end the client's other streams).
func closeUnread(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 {
		w.Header()["Connection"] = []string{"close"}
	}
}

// resolveWatched resolves the limits' buckets while the body's
// placeholders are watched, leaving out a limit one of whose values came
// from them.
func (h *Handler) resolveWatched(limits []*limit.Limit, r *http.Request, repl *caddy.Replacer, buckets []limit.Bucket) ([]limit.Bucket, error) {
	watch := new(bodyWatch) // a replacer's value: on the heap whatever it is
	watch.start(h.request.reader.Placeholders(), repl)
	defer watch.stop(repl)
	for i := range limits {
		watch.read = false
		more, _, err := h.resolveLimits(limits[i:i+1], r, repl, buckets, nil)
		switch {
		case watch.read: // the body decides it
		case err != nil:
			return nil, err
		default:
			buckets = more
		}
	}
	return buckets, nil
}

// bodyWatch stands in for the placeholders of a request's body while its
// body is not read: a placeholder whose value comes from one of them,
// through a provider such as `map` (a plan by the model), says so, and
// resolves to nothing. stop puts back what they were.
type bodyWatch struct {
	read  bool // a placeholder of the body was read
	saved []savedPlaceholder
	keep  [maxWatched]savedPlaceholder
}

type savedPlaceholder struct {
	key   string
	value any
	set   bool
}

// maxWatched is how many placeholders are watched without allocating:
// paths, defaults and the size.
const maxWatched = 24

// start watches the placeholders keys: those request_body sets.
func (bw *bodyWatch) start(keys []string, repl *caddy.Replacer) {
	bw.saved = bw.keep[:0]
	for _, key := range keys {
		bw.watch(key, repl)
	}
}

// watch puts the watch in the place of the placeholder key.
func (bw *bodyWatch) watch(key string, repl *caddy.Replacer) {
	v, set := repl.Get(key)
	bw.saved = append(bw.saved, savedPlaceholder{key, v, set})
	repl.Set(key, bw)
}

// stop puts back what the placeholders were.
func (bw *bodyWatch) stop(repl *caddy.Replacer) {
	for _, s := range bw.saved {
		if s.set {
			repl.Set(s.key, s.value)
		} else {
			repl.Delete(s.key)
		}
	}
}

// String is a watched placeholder's value: nothing, and the watch notes
// that it was read.
func (bw *bodyWatch) String() string {
	bw.read = true
	return ""
}
