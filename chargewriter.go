package ratelimit

import (
	"errors"
	"io"
	"net/http"
	"strings"

	"github.com/caddy-redis/ratelimit/internal/scan"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// chargeWriter watches a response for its charging limits, as Caddy's
// own `encode` and `intercept` wrap the writer: it notes the status and,
// for `charge json`, hands the body to a scan (internal/scan) before it
// passes. Everything goes through untouched and at once: no buffering,
// every flush passed on; http.ResponseController reaches the writer
// beneath through Unwrap.
//
// It settles the request as soon as every charging limit's cost is
// known (settleIfKnown), before the bytes that tell the client so pass:
// a client may send its next request as soon as it has the end of its
// answer, while the handler still runs (openai-go stops reading at
// `data: [DONE]`, and the upstream may keep the stream open after it).
type chargeWriter struct {
	caddyhttp.ResponseWriterWrapper
	charging *charging
	status   int        // the final status written; 0 until then
	body     *scan.Body // for charge json; nil otherwise
	// h and req are the handler and the request whose response this is,
	// to settle it from here; settled says it was, once.
	h       *Handler
	req     *request
	settled bool
	// costHeaders are the charging.headers as the response was written:
	// a handler around this one may remove them from the map later
	// (`header -X-Cost`, deferred to its own WriteHeader). declared says
	// which of them the Trailer header named then: their values at the
	// end are trailers.
	costHeaders [maxCostHeaders]string
	hasHeader   [maxCostHeaders]bool
	declared    [maxCostHeaders]bool
}

// newChargeWriter is a writer that watches w and settles nothing itself
// (the tests' writer).
func newChargeWriter(w http.ResponseWriter, c *charging) *chargeWriter {
	return new(chargeWriter).reset(w, c, new(scan.Body), nil, nil)
}

// reset makes cw a new writer watching w for req's charges in h, which
// scans with body when c has JSON paths.
func (cw *chargeWriter) reset(w http.ResponseWriter, c *charging, body *scan.Body, h *Handler, req *request) *chargeWriter {
	*cw = chargeWriter{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, charging: c, h: h, req: req}
	if c.paths.Len() > 0 {
		cw.body = body
		cw.body.Reset(&c.paths, c.maxBody)
	}
	return cw
}

// WriteHeader notes the first final status (or 101, an upgrade) and, for
// a scan, how to read the body from its headers.
func (cw *chargeWriter) WriteHeader(status int) {
	if cw.status == 0 && (status >= 200 || status == http.StatusSwitchingProtocols) {
		cw.begin(status)
	}
	cw.ResponseWriter.WriteHeader(status)
}

func (cw *chargeWriter) begin(status int) {
	cw.status = status
	h := cw.Header()
	for i, name := range cw.charging.headers {
		if values := h[name]; len(values) > 0 {
			cw.costHeaders[i], cw.hasHeader[i] = values[0], true
		}
	}
	for _, v := range h["Trailer"] {
		for v != "" {
			var name string
			name, v, _ = strings.Cut(v, ",")
			for i, cost := range cw.charging.headers {
				cw.declared[i] = cw.declared[i] || strings.EqualFold(cost, strings.TrimSpace(name))
			}
		}
	}
	if cw.body != nil {
		cw.body.Begin(cw.Header())
	}
	cw.settleIfKnown()
}

// Write scans p, settles when p holds the end of the answer, and then
// passes p on.
func (cw *chargeWriter) Write(p []byte) (int, error) {
	if cw.status == 0 {
		cw.begin(http.StatusOK) // as the writer beneath does implicitly
	}
	if cw.body != nil && !cw.settled && !cw.body.Ended() {
		_, _ = cw.body.Write(p) // never fails
		if cw.body.Ended() {
			cw.settleIfKnown()
		}
	}
	return cw.ResponseWriter.Write(p)
}

// settleIfKnown settles the request once, at the first moment when the
// cost of each of its charging limits is known: a status not charged
// costs nothing, and charge_status alone the reservation, from the
// status on; charge json once the body holds the end of the answer
// (scan.Body.Ended); charge header and charge placeholder only once the
// handler has returned (chargeStep.finish), since a trailer comes after
// the body, and a placeholder such as reverse_proxy's duration is set
// last. Settled here, the settlement reaches the store before the
// status or the bytes that end the answer pass, so ahead of the client's
// next request: a store in the process settles at once, and Redis's
// queue keeps a settlement ahead of every call queued after it
// (internal/redisbatch).
func (cw *chargeWriter) settleIfKnown() {
	if cw.settled || cw.req == nil {
		return
	}
	end := cw.end(nil, false)
	if end.status == 0 {
		return // a 499 written: cut short, charged as the handler returns
	}
	answered := cw.body != nil && cw.body.Ended()
	for i := range cw.req.buckets {
		if rule := cw.req.buckets[i].limit.charge; rule != nil && !rule.knownAt(end.status, answered) {
			return
		}
	}
	cw.settled = true
	cw.h.settleResponse(end, cw, cw.req.repl, cw.req)
}

// ReadFrom copies through Write when the body is scanned; otherwise the
// writer beneath may use sendfile.
func (cw *chargeWriter) ReadFrom(r io.Reader) (int64, error) {
	if cw.body == nil {
		if cw.status == 0 {
			cw.begin(http.StatusOK)
		}
		return cw.ResponseWriterWrapper.ReadFrom(r)
	}
	return io.Copy(writerOnly{cw}, r)
}

// writerOnly hides ReadFrom, so io.Copy writes.
type writerOnly struct{ io.Writer }

// Flush and FlushError flush the writer beneath: nothing is held here.
func (cw *chargeWriter) Flush() { _ = cw.FlushError() }

func (cw *chargeWriter) FlushError() error {
	return http.NewResponseController(cw.ResponseWriter).Flush() //nolint:bodyclose
}

// responseEnd is how a response ended, which decides what it is charged.
type responseEnd struct {
	// status is what the response answered: the status written, else
	// that of the handler's error, else the 200 of an empty response. 0
	// when nothing answered: the client left first (reverse_proxy records
	// 499 then, and no upstream answers that), or the handler aborted.
	status int
	// cutShort: the response did not end as its handler meant, for the
	// client left (the handler answered 499, or failed once it had left)
	// or the handler aborted it (reverse_proxy, when a stream broke off).
	cutShort bool
}

// statusClientClosed is the status Caddy records for a client that left
// before its answer (nginx's "client closed request").
const statusClientClosed = 499

// end is how the response ended, given the handler's error and whether
// the client had left by then.
func (cw *chargeWriter) end(err error, clientLeft bool) responseEnd {
	end := responseEnd{status: cw.status, cutShort: err == errAborted || err != nil && clientLeft}
	if end.status == 0 && !end.cutShort {
		end.status = http.StatusOK
		if err != nil {
			end.status = http.StatusInternalServerError
			var he caddyhttp.HandlerError
			if errors.As(err, &he) && he.StatusCode != 0 {
				end.status = he.StatusCode
			}
		}
	}
	if end.status == statusClientClosed {
		end.status, end.cutShort = 0, true
	}
	return end
}

// costHeader is the rule's cost: its trailer, known at the end of the
// response, else its header as the response was written (or as it is,
// when nothing was written). reverse_proxy puts a trailer in the header
// map once the body is copied: under http.TrailerPrefix, or under its
// name when the upstream declared it, after any header of that name.
func (cw *chargeWriter) costHeader(r *chargeRule) (string, bool) {
	h := cw.Header()
	if values := h[r.trailer]; len(values) > 0 {
		return values[len(values)-1], true
	}
	if cw.status == 0 {
		if values := h[r.header]; len(values) > 0 {
			return values[0], true
		}
		return "", false
	}
	if values := h[r.header]; cw.declared[r.headerIndex] && len(values) > 0 {
		return values[len(values)-1], true
	}
	return cw.costHeaders[r.headerIndex], cw.hasHeader[r.headerIndex]
}
