package scan

import (
	"bytes"
	"fmt"
	"math/bits"
	"net/http"
	"strings"
)

// How a body is read: one JSON document, an event stream, or JSON lines.
type scanMode uint8

const (
	scanJSON scanMode = iota
	scanEvents
	scanLines
)

// Body reads the values at its paths from a body as it streams by,
// holding nothing of it but the state of the JSON being read. A JSON
// body counts as far as it was read. An event stream counts the JSON of
// each event's `data:` lines, and JSON lines each line; an event or line
// counts once it is complete, whatever its size (only the JSON's state
// is held), and each path keeps the last value any of them gave.
// Reset's maxBody, when set, bounds the bytes read, and so the CPU a
// response spends here: the scan stops there, and its values are what
// it read.
//
// A Body is used as Reset, Begin, Write (any number of times), then Sum
// (as often as there are sums to read). It is one value, with no buffer
// behind it, so a caller may embed it or allocate it once per response;
// Reset makes it new.
type Body struct {
	mode    scanMode
	maxBody int64  // 0: no bound
	read    int64  // bytes of the body read
	stopped bool   // the body went past maxBody: the scan stopped there
	failed  string // why the body cannot give a cost at all
	done    bool   // finish ran

	doc      jsonScanner // the JSON being read
	found    uint16      // paths with a value
	negative uint16      // paths whose last value was negative
	values   [MaxPaths]float64
	order    [MaxPaths]uint32 // when each value came: the later, the larger
	seq      uint32           // the numbers kept so far

	// Event streams and JSON lines: where in a line the scan is.
	line      lineState
	field     int  // bytes of the field name matched against "data"; -1: another field
	cr        bool // the last byte was '\r' (a '\n' after it ends nothing more)
	dataLines int  // data lines in the current event
}

type lineState uint8

const (
	lineStart     lineState = iota
	lineField               // an event stream's field name
	lineDataStart           // after "data:", where one space is skipped
	lineData                // JSON: the value of a data line, or a JSON line
	lineSkip                // a line that carries no JSON
)

// Reset makes s a new scan of a body for paths, which reads at most
// maxBody bytes of it (0: all of it). Until Begin says otherwise, the
// body is one JSON document.
func (s *Body) Reset(paths *Paths, maxBody int64) {
	*s = Body{maxBody: maxBody}
	s.doc.paths = paths
	s.doc.reset()
}

// Begin chooses how to read the body from the response's headers: an
// event stream (text/event-stream), JSON lines (application/x-ndjson,
// application/jsonl, ...), else one JSON document. An encoded body
// (Content-Encoding) cannot be read: Sum says so.
func (s *Body) Begin(h http.Header) {
	if enc := h.Get("Content-Encoding"); enc != "" && !strings.EqualFold(enc, "identity") {
		s.failed = "the body is encoded (Content-Encoding: " + cutShort(enc) + ")"
		return
	}
	ct := strings.ToLower(h.Get("Content-Type"))
	ct, _, _ = strings.Cut(ct, ";")
	switch strings.TrimSpace(ct) {
	case "text/event-stream":
		s.mode = scanEvents
	case "application/x-ndjson", "application/ndjson", "application/jsonl", "application/x-jsonlines":
		s.mode = scanLines
	}
	s.doc.reset()
}

// Write scans the next bytes of the body, up to maxBody. It never fails:
// it takes all of p, whether it reads it or not (past maxBody, an
// encoded body, after Sum).
func (s *Body) Write(p []byte) (int, error) {
	n := len(p)
	if s.failed != "" || s.done || s.stopped {
		return n, nil
	}
	if s.maxBody > 0 && int64(len(p)) > s.maxBody-s.read {
		p, s.stopped = p[:s.maxBody-s.read], true
	}
	s.read += int64(len(p))
	if s.mode == scanJSON {
		s.doc.feed(p)
	} else {
		s.writeLines(p)
	}
	return n, nil
}

// Stopped says whether the body went past maxBody, where the scan
// stopped.
func (s *Body) Stopped() bool { return s.stopped }

// Sum ends the scan (a later Write reads nothing) and sums fields, each
// the bits of its paths: a field's value is the last number found at
// any of its paths, in the order the body gave them, and a field none
// of whose paths had a number counts 0. why says why there is no sum:
// the body could not be read, no field had a number, or a field's is
// negative.
func (s *Body) Sum(fields ...uint16) (sum float64, why string) {
	s.finish()
	var all uint16
	for _, f := range fields {
		all |= f
	}
	switch {
	case s.failed != "":
		return 0, s.failed
	case s.found&all == 0 && s.stopped:
		return 0, fmt.Sprintf("no number at %s before max_body (%d bytes), where the scan stops", s.doc.paths.Names(all), s.maxBody)
	case s.found&all == 0:
		return 0, "no number at " + s.doc.paths.Names(all) + " in the body"
	}
	for _, f := range fields {
		switch last := s.last(f); {
		case last < 0: // counts 0
		case s.negative>>last&1 == 1:
			return 0, "a number at " + s.doc.paths.text[last] + " is negative"
		default:
			sum += s.values[last]
		}
	}
	return sum, ""
}

// Field ends the scan as Sum does and reads one field alone: its value,
// and whether one of its paths had a number. It says nothing of why
// not, so asking costs no message: Sum judges the body and the fields
// first.
func (s *Body) Field(f uint16) (v float64, ok bool) {
	s.finish()
	if last := s.last(f); last >= 0 && s.failed == "" {
		return s.values[last], true
	}
	return 0, false
}

// last is the path of field f whose number came last, or -1.
func (s *Body) last(f uint16) int {
	last := -1
	for m := s.found & f; m != 0; m &= m - 1 {
		if p := bits.TrailingZeros16(m); last < 0 || s.order[p] > s.order[last] {
			last = p
		}
	}
	return last
}

// writeLines scans an event stream or JSON lines: lines end at "\r\n",
// "\n" or "\r".
func (s *Body) writeLines(p []byte) {
	for i := 0; i < len(p); {
		c := p[i]
		if s.cr {
			s.cr = false
			if c == '\n' {
				i++
				continue
			}
		}
		if c == '\r' || c == '\n' {
			s.cr = c == '\r'
			s.endLine()
			i++
			continue
		}
		switch s.line {
		case lineStart:
			if s.mode == scanLines {
				s.line = lineData
				continue
			}
			s.line, s.field = lineField, 0
			continue
		case lineField:
			switch {
			case c == ':':
				s.line = lineSkip
				if s.field == len("data") {
					s.line = lineDataStart
					s.startData()
				}
			case s.field >= 0 && s.field < len("data") && c == "data"[s.field]:
				s.field++
			default:
				s.field = -1
			}
			i++
		case lineDataStart:
			s.line = lineData
			if c == ' ' {
				i++
			}
		case lineData, lineSkip:
			end := bytes.IndexAny(p[i:], "\r\n")
			if end < 0 {
				end = len(p) - i
			}
			if s.line == lineData {
				s.doc.feed(p[i : i+end])
			}
			i += end
		}
	}
}

// startData starts a data line of the current event: the lines of an
// event's data are joined with "\n", as a client reads them.
func (s *Body) startData() {
	if s.dataLines > 0 {
		s.doc.feed(newline)
	}
	s.dataLines++
}

var newline = []byte{'\n'}

// endLine ends a line: in JSON lines, a document; in an event stream, a
// field, or with a blank line, an event.
func (s *Body) endLine() {
	switch {
	case s.mode == scanLines:
		if s.line == lineData {
			s.endDocument()
		}
	case s.line == lineStart: // a blank line: the event is complete
		s.endDocument()
	case s.line == lineField && s.field == len("data"): // "data" alone: an empty data line
		s.startData()
	}
	s.line = lineStart
}

// endDocument keeps the values of a complete event (with data) or JSON
// line, and starts the next.
func (s *Body) endDocument() {
	if (s.mode == scanLines || s.dataLines > 0) && s.doc.end() {
		s.keep()
	}
	s.doc.reset()
	s.dataLines = 0
}

// keep takes the document's values as the last seen at their paths.
func (s *Body) keep() {
	d := &s.doc
	for m := d.found; m != 0; m &= m - 1 {
		i := bits.TrailingZeros16(m)
		s.values[i], s.order[i] = d.values[i], s.seq+d.order[i]
	}
	s.seq += d.seq
	s.found |= d.found
	s.negative = s.negative&^d.found | d.negative
}

// finish ends the scan, once: a JSON body's values are what it gave,
// however far it got (a client may have left); a stream's are those of
// its complete events or lines. JSON Lines allows the last line without a
// newline (it carries Ollama's usage): it counts when its JSON is
// complete, and the scan did not stop in it. An event stream's last
// event without its blank line does not, as a client drops it.
func (s *Body) finish() {
	if s.done {
		return
	}
	s.done = true
	switch {
	case s.failed != "":
	case s.mode == scanJSON:
		s.doc.end()
		s.keep()
	case s.mode == scanLines && s.line == lineData && !s.stopped:
		s.endDocument()
	}
}
