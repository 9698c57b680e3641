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
// The scan also sees where the answer ends for a client, when the body
// says so (Ended), and reads nothing after it: a JSON document's end, an
// event stream's `data: [DONE]` or its terminal event. JSON lines have no
// last line, so they end with the body.
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
	ended   bool   // the answer ended (Ended): nothing after it is read

	doc      jsonScanner // the JSON being read
	found    uint16      // paths with a value
	negative uint16      // paths whose last value was negative
	values   [MaxPaths]float64
	order    [MaxPaths]uint32 // when each value came: the later, the larger
	seq      uint32           // the numbers kept so far

	// Event streams and JSON lines: where in a line the scan is.
	line      lineState
	fieldName string // the field a line's name may be: "data", "event" (by its first byte), or ""
	field     int    // bytes of the field name matched against fieldName; -1: another field
	cr        bool   // the last byte was '\r' (a '\n' after it ends nothing more)
	dataLines int    // data lines in the current event
	// doneAt is the bytes of "[DONE]" that the event's first data line
	// starts with so far; -1 when it does not, or in another line.
	doneAt int
	// nameMatch is the endEvents (a bit each) that the event name being
	// read still matches, nameAt the bytes of it read; lastEvent says the
	// current event's name is one of them.
	nameMatch uint8
	nameAt    int
	lastEvent bool
}

// endEvents name the events that end an API's stream, which it sends
// last, after its usage: Anthropic's Messages API ends with
// message_stop, OpenAI's Responses API with one of the other three (the
// usage in its data). OpenAI's chat completions, and the servers that
// follow them, send `data: [DONE]` instead.
var endEvents = [...]string{"message_stop", "response.completed", "response.incomplete", "response.failed"}

// doneData is the data of the event that ends an OpenAI-style stream;
// a client such as openai-go stops at an event whose data starts so.
const doneData = "[DONE]"

type lineState uint8

const (
	lineStart      lineState = iota
	lineField                // an event stream's field name
	lineDataStart            // after "data:", where one space is skipped
	lineData                 // JSON: the value of a data line, or a JSON line
	lineEventStart           // after "event:", where one space is skipped
	lineEvent                // an event's name
	lineSkip                 // a line that carries no JSON
)

// Reset makes s a new scan of a body for paths, which reads at most
// maxBody bytes of it (0: all of it). Until Begin says otherwise, the
// body is one JSON document.
func (s *Body) Reset(paths *Paths, maxBody int64) {
	*s = Body{maxBody: maxBody, doneAt: -1}
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
// encoded body, after the answer's end, after Sum).
func (s *Body) Write(p []byte) (int, error) {
	n := len(p)
	if s.failed != "" || s.done || s.stopped || s.ended {
		return n, nil
	}
	if s.maxBody > 0 && int64(len(p)) > s.maxBody-s.read {
		p, s.stopped = p[:s.maxBody-s.read], true
	}
	s.read += int64(len(p))
	if s.mode == scanJSON {
		s.doc.feed(p)
		s.ended = s.doc.state == jDone
	} else {
		s.writeLines(p)
	}
	return n, nil
}

// Stopped says whether the body went past maxBody, where the scan
// stopped.
func (s *Body) Stopped() bool { return s.stopped }

// Ended says whether the bytes written so far hold the end of the answer,
// where a client stops reading: a JSON body's document is complete; an
// event stream sent an event whose first data line starts with `[DONE]`
// (as soon as those six bytes are read: openai-go stops at such an
// event), or an event named as an API's last (endEvents) is complete.
// The values are then final: nothing after the end is read. JSON lines
// have no last line, and end with the body; so does a body whose end the
// scan did not read (past maxBody, encoded).
func (s *Body) Ended() bool { return s.ended }

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

// writeLines scans an event stream or JSON lines, up to the answer's
// end: lines end at "\r\n", "\n" or "\r".
func (s *Body) writeLines(p []byte) {
	for i := 0; i < len(p) && !s.ended; {
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
			s.line, s.field, s.fieldName = lineField, 0, ""
			continue
		case lineField:
			switch {
			case c == ':':
				s.line = lineSkip
				switch {
				case s.field != len(s.fieldName):
				case s.fieldName == "data":
					s.line = lineDataStart
					s.startData()
				case s.fieldName == "event":
					s.line = lineEventStart
					s.nameMatch, s.nameAt = 1<<len(endEvents)-1, 0
				}
			case s.field == 0 && c == 'd':
				s.fieldName, s.field = "data", 1
			case s.field == 0 && c == 'e':
				s.fieldName, s.field = "event", 1
			case s.field > 0 && s.field < len(s.fieldName) && c == s.fieldName[s.field]:
				s.field++
			default:
				s.field = -1
			}
			i++
		case lineDataStart, lineEventStart:
			if s.line == lineDataStart {
				s.line = lineData
			} else {
				s.line = lineEvent
			}
			if c == ' ' {
				i++
			}
		case lineData, lineEvent, lineSkip:
			end := bytes.IndexAny(p[i:], "\r\n")
			if end < 0 {
				end = len(p) - i
			}
			switch s.line {
			case lineData:
				if s.doneAt >= 0 {
					s.matchDone(p[i : i+end])
				}
				s.doc.feed(p[i : i+end])
			case lineEvent:
				s.matchName(p[i : i+end])
			}
			i += end
		}
	}
}

// matchDone reads the next bytes of the event's first data line against
// "[DONE]": the answer ends once the line starts with it.
func (s *Body) matchDone(b []byte) {
	for _, c := range b[:min(len(b), len(doneData)-s.doneAt)] {
		if c != doneData[s.doneAt] {
			s.doneAt = -1
			return
		}
		s.doneAt++
	}
	s.ended = s.doneAt == len(doneData)
}

// matchName reads the next bytes of an event's name against endEvents.
func (s *Body) matchName(b []byte) {
	for _, c := range b {
		if s.nameMatch == 0 {
			return
		}
		for m := s.nameMatch; m != 0; m &= m - 1 {
			k := bits.TrailingZeros8(m)
			if name := endEvents[k]; s.nameAt >= len(name) || name[s.nameAt] != c {
				s.nameMatch &^= 1 << k
			}
		}
		s.nameAt++
	}
}

// isEndEvent says whether the event name read is one of endEvents.
func (s *Body) isEndEvent() bool {
	for m := s.nameMatch; m != 0; m &= m - 1 {
		if len(endEvents[bits.TrailingZeros8(m)]) == s.nameAt {
			return true
		}
	}
	return false
}

// startData starts a data line of the current event: the lines of an
// event's data are joined with "\n", as a client reads them.
func (s *Body) startData() {
	s.doneAt = -1
	if s.dataLines > 0 {
		s.doc.feed(newline)
	} else {
		s.doneAt = 0
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
	case s.line == lineField && s.fieldName == "data" && s.field == len("data"): // "data" alone: an empty data line
		s.startData()
	case s.line == lineEvent || s.line == lineEventStart:
		s.lastEvent = s.isEndEvent() // the last "event" line names the event
	}
	s.line, s.doneAt = lineStart, -1
}

// endDocument keeps the values of a complete event (with data) or JSON
// line, and starts the next; an event named as a stream's last ends the
// answer.
func (s *Body) endDocument() {
	if (s.mode == scanLines || s.dataLines > 0) && s.doc.end() {
		s.keep()
	}
	s.ended = s.ended || s.lastEvent
	s.doc.reset()
	s.dataLines, s.lastEvent = 0, false
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
