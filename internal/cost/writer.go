package cost

import (
	"errors"
	"io"
	"net/http"
	"strings"

	"github.com/caddy-redis/ratelimit/internal/scan"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Writer watches a response for its charging limits, as Caddy's
// own `encode` and `intercept` wrap the writer: it notes the status and,
// for `charge json`, hands the body to a scan (internal/scan) before it
// passes. Everything goes through untouched and at once: no buffering,
// every flush passed on; http.ResponseController reaches the writer
// beneath through Unwrap.
//
// It has the request settled as soon as every charging limit's cost is
// known (settleIfKnown), before the bytes that tell the client so pass:
// a client may send its next request as soon as it has the end of its
// answer, while the handler still runs (openai-go stops reading at
// `data: [DONE]`, and the upstream may keep the stream open after it).
type Writer struct {
	caddyhttp.ResponseWriterWrapper
	sources *Sources
	status  int        // the final status written; 0 until then
	body    *scan.Body // for charge json; nil otherwise
	// settler settles the request whose response this is (nil: nothing
	// is settled from here); settled says it was, once.
	settler Settler
	settled bool
	// costHeaders are the sources' headers as the response was written:
	// a handler around this one may remove them from the map later
	// (`header -X-Cost`, deferred to its own WriteHeader). declared says
	// which of them the Trailer header named then: their values at the
	// end are trailers.
	costHeaders [MaxHeaders]string
	hasHeader   [MaxHeaders]bool
	declared    [MaxHeaders]bool
}

// Settler settles the charges of the request whose response a Writer
// watches.
type Settler interface {
	// CostKnown says whether the cost of each of the request's charging
	// limits is known from a response's status on (answered: and from
	// the end of its answer in the body on): Rule.KnownAt of each.
	CostKnown(status int, answered bool) bool
	// Settle settles the request, whose response ended so: once.
	Settle(end End, cw *Writer)
}

// Reset makes cw a new writer watching w for what s reads, which scans
// with body when s has JSON paths, and has settler settle the request
// (nil: nothing is settled from here).
func (cw *Writer) Reset(w http.ResponseWriter, s *Sources, body *scan.Body, settler Settler) *Writer {
	*cw = Writer{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, sources: s, settler: settler}
	if s.paths.Len() > 0 {
		cw.body = body
		cw.body.Reset(&s.paths, s.MaxBody)
	}
	return cw
}

// WriteHeader notes the first final status (or 101, an upgrade) and, for
// a scan, how to read the body from its headers.
func (cw *Writer) WriteHeader(status int) {
	if cw.status == 0 && (status >= 200 || status == http.StatusSwitchingProtocols) {
		cw.begin(status)
	}
	cw.ResponseWriter.WriteHeader(status)
}

func (cw *Writer) begin(status int) {
	cw.status = status
	h := cw.Header()
	for i, name := range cw.sources.headers {
		if values := h[name]; len(values) > 0 {
			cw.costHeaders[i], cw.hasHeader[i] = values[0], true
		}
	}
	for _, v := range h["Trailer"] {
		for v != "" {
			var name string
			name, v, _ = strings.Cut(v, ",")
			for i, cost := range cw.sources.headers {
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
func (cw *Writer) Write(p []byte) (int, error) {
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
// handler has returned (Finish), since a trailer comes after
// the body, and a placeholder such as reverse_proxy's duration is set
// last. Settled here, the settlement reaches the store before the
// status or the bytes that end the answer pass, so ahead of the client's
// next request: a store in the process settles at once, and Redis's
// queue keeps a settlement ahead of every call queued after it
// (internal/redisbatch).
func (cw *Writer) settleIfKnown() {
	if cw.settled || cw.settler == nil {
		return
	}
	end := cw.end(nil, false)
	if end.Status == 0 {
		return // a 499 written: cut short, charged as the handler returns
	}
	if !cw.settler.CostKnown(end.Status, cw.body != nil && cw.body.Ended()) {
		return
	}
	cw.settled = true
	cw.settler.Settle(end, cw)
}

// Finish has the request settled, unless the writer did as the response
// passed (settleIfKnown), once its handler returned err; clientLeft says
// whether the client had left by then.
func (cw *Writer) Finish(err error, clientLeft bool) {
	if !cw.settled && cw.settler != nil {
		cw.settled = true
		cw.settler.Settle(cw.end(err, clientLeft), cw)
	}
}

// ScanStopped says whether the scan of the body stopped at
// Sources.MaxBody: a cost from the body is what came before.
func (cw *Writer) ScanStopped() bool { return cw.body != nil && cw.body.Stopped() }

// ReadFrom copies through Write when the body is scanned; otherwise the
// writer beneath may use sendfile.
func (cw *Writer) ReadFrom(r io.Reader) (int64, error) {
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
func (cw *Writer) Flush() { _ = cw.FlushError() }

func (cw *Writer) FlushError() error {
	return http.NewResponseController(cw.ResponseWriter).Flush() //nolint:bodyclose
}

// End is how a response ended, which decides what it is charged.
type End struct {
	// Status is what the response answered: the status written, else
	// that of the handler's error, else the 200 of an empty response. 0
	// when nothing answered: the client left first (reverse_proxy records
	// 499 then, and no upstream answers that), or the handler aborted.
	Status int
	// CutShort: the response did not end as its handler meant, for the
	// client left (the handler answered 499, or failed once it had left)
	// or the handler aborted it (reverse_proxy, when a stream broke off).
	CutShort bool
}

// ErrAborted stands for the error of a handler that panicked: its
// response was cut short.
var ErrAborted = errors.New("the response was aborted")

// statusClientClosed is the status Caddy records for a client that left
// before its answer (nginx's "client closed request").
const statusClientClosed = 499

// end is how the response ended, given the handler's error and whether
// the client had left by then.
func (cw *Writer) end(err error, clientLeft bool) End {
	end := End{Status: cw.status, CutShort: err == ErrAborted || err != nil && clientLeft}
	if end.Status == 0 && !end.CutShort {
		end.Status = http.StatusOK
		if err != nil {
			end.Status = http.StatusInternalServerError
			var he caddyhttp.HandlerError
			if errors.As(err, &he) && he.StatusCode != 0 {
				end.Status = he.StatusCode
			}
		}
	}
	if end.Status == statusClientClosed {
		end.Status, end.CutShort = 0, true
	}
	return end
}

// costHeader is the rule's cost: its trailer, known at the end of the
// response, else its header as the response was written (or as it is,
// when nothing was written). reverse_proxy puts a trailer in the header
// map once the body is copied: under http.TrailerPrefix, or under its
// name when the upstream declared it, after any header of that name.
func (cw *Writer) costHeader(r *Rule) (string, bool) {
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
