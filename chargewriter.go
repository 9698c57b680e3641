package ratelimit

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// chargeWriter watches a response for its charging limits, as Caddy's
// own `encode` and `intercept` wrap the writer: it notes the status and,
// for `charge json`, scans the body as it passes. Everything goes
// through untouched and at once: no buffering, every flush passed on;
// http.ResponseController reaches the writer beneath through Unwrap.
type chargeWriter struct {
	caddyhttp.ResponseWriterWrapper
	charging *charging
	status   int          // the final status written; 0 until then
	scan     *bodyScanner // for charge json; nil otherwise
	// costHeaders are the charging.headers as the response was written:
	// a handler around this one may remove them from the map later
	// (`header -X-Cost`, deferred to its own WriteHeader). declared says
	// which of them the Trailer header named then: their values at the
	// end are trailers.
	costHeaders [maxCostHeaders]string
	hasHeader   [maxCostHeaders]bool
	declared    [maxCostHeaders]bool
}

func newChargeWriter(w http.ResponseWriter, c *charging) *chargeWriter {
	cw := &chargeWriter{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, charging: c}
	if c.paths.n > 0 {
		cw.scan = &bodyScanner{maxBody: c.maxBody}
		cw.scan.doc.paths = &c.paths
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
	if cw.scan != nil {
		cw.scan.begin(cw.Header())
	}
}

// Write passes p on and scans what was written.
func (cw *chargeWriter) Write(p []byte) (int, error) {
	if cw.status == 0 {
		cw.begin(http.StatusOK) // as the writer beneath does implicitly
	}
	n, err := cw.ResponseWriter.Write(p)
	if cw.scan != nil {
		cw.scan.write(p[:n])
	}
	return n, err
}

// ReadFrom copies through Write when the body is scanned; otherwise the
// writer beneath may use sendfile.
func (cw *chargeWriter) ReadFrom(r io.Reader) (int64, error) {
	if cw.scan == nil {
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

// scanned is the cost the body gave for fields (each the bits of its
// paths): a field's value is the last number found at any of its paths,
// and the fields are summed; or why there is none.
func (cw *chargeWriter) scanned(fields ...uint16) (float64, string) {
	s := cw.scan
	s.finish()
	var all uint16
	for _, f := range fields {
		all |= f
	}
	switch {
	case s.failed != "":
		return 0, s.failed
	case s.found&all == 0 && s.stopped:
		return 0, fmt.Sprintf("no number at %s before max_body (%d bytes), where the scan stops", s.doc.paths.names(all), s.maxBody)
	case s.found&all == 0:
		return 0, "no number at " + s.doc.paths.names(all) + " in the body"
	}
	var sum float64
	for _, f := range fields {
		last := -1
		for m := s.found & f; m != 0; m &= m - 1 {
			if p := bits.TrailingZeros16(m); last < 0 || s.order[p] > s.order[last] {
				last = p
			}
		}
		switch {
		case last < 0: // counts 0
		case s.negative>>last&1 == 1:
			return 0, "a number at " + s.doc.paths.text[last] + " is negative"
		default:
			sum += s.values[last]
		}
	}
	return sum, ""
}

// scanPaths are the JSON paths a handler's limits read: at most
// maxScanPaths, a bit each, of at most maxPathKeys keys.
type scanPaths struct {
	n      int
	text   [maxScanPaths]string
	keys   [maxScanPaths][]string
	index  [maxScanPaths][maxPathKeys]int // each key as an array index, or -1
	exact  [maxPathKeys + 1]uint16        // paths of exactly k keys
	longer [maxPathKeys + 1]uint16        // paths of more than k keys
}

// add adds a path (once) and returns its bit.
func (ps *scanPaths) add(path string) (uint16, error) {
	for i := range ps.n {
		if ps.text[i] == path {
			return 1 << i, nil
		}
	}
	if err := checkJSONPath(path); err != nil {
		return 0, err
	}
	if ps.n == maxScanPaths {
		return 0, fmt.Errorf("charge json: more than %d paths in one handler; sum fewer", maxScanPaths)
	}
	i := ps.n
	ps.n++
	ps.text[i], ps.keys[i] = path, strings.Split(path, ".")
	for k, key := range ps.keys[i] {
		ps.index[i][k] = -1
		if n, err := strconv.Atoi(key); err == nil && n >= 0 && strconv.Itoa(n) == key {
			ps.index[i][k] = n
		}
	}
	bit := uint16(1) << i
	ps.exact[len(ps.keys[i])] |= bit
	for k := range len(ps.keys[i]) {
		ps.longer[k] |= bit
	}
	return bit, nil
}

// names lists the paths in mask, for messages.
func (ps *scanPaths) names(mask uint16) string {
	var names []string
	for m := mask; m != 0; m &= m - 1 {
		names = append(names, ps.text[bits.TrailingZeros16(m)])
	}
	return strings.Join(names, ", ")
}

// How a body is read: one JSON document, an event stream, or JSON lines.
type scanMode uint8

const (
	scanJSON scanMode = iota
	scanEvents
	scanLines
)

// bodyScanner reads the values at the scan paths from a body as it
// streams by, holding nothing of it but the state of the JSON being read.
// A JSON body counts as far as it was read. An event stream counts the
// JSON of each event's `data:` lines, and JSON lines each line; an event
// or line counts once it is complete, whatever its size (only the JSON's
// state is held), and each path keeps the last value any of them gave.
// maxBody, when set, bounds the bytes read, and so the CPU a response
// spends here: the scan stops there, and its values are what it read.
type bodyScanner struct {
	mode    scanMode
	maxBody int64  // 0: no bound
	read    int64  // bytes of the body read
	stopped bool   // the body went past maxBody: the scan stopped there
	failed  string // why the body cannot give a cost at all
	done    bool   // finish ran

	doc      jsonScanner // the JSON being read
	found    uint16      // paths with a value
	negative uint16      // paths whose last value was negative
	values   [maxScanPaths]float64
	order    [maxScanPaths]uint32 // when each value came: the later, the larger
	seq      uint32               // the numbers kept so far

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

// begin chooses how to read the body from the response's headers.
func (s *bodyScanner) begin(h http.Header) {
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

// write scans the next bytes of the body, up to maxBody.
func (s *bodyScanner) write(p []byte) {
	if s.failed != "" || s.done || s.stopped {
		return
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
}

// writeLines scans an event stream or JSON lines: lines end at "\r\n",
// "\n" or "\r".
func (s *bodyScanner) writeLines(p []byte) {
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
func (s *bodyScanner) startData() {
	if s.dataLines > 0 {
		s.doc.feed(newline)
	}
	s.dataLines++
}

var newline = []byte{'\n'}

// endLine ends a line: in JSON lines, a document; in an event stream, a
// field, or with a blank line, an event.
func (s *bodyScanner) endLine() {
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
func (s *bodyScanner) endDocument() {
	if (s.mode == scanLines || s.dataLines > 0) && s.doc.end() {
		s.keep()
	}
	s.doc.reset()
	s.dataLines = 0
}

// keep takes the document's values as the last seen at their paths.
func (s *bodyScanner) keep() {
	d := &s.doc
	for m := d.found; m != 0; m &= m - 1 {
		i := bits.TrailingZeros16(m)
		s.values[i], s.order[i] = d.values[i], s.seq+d.order[i]
	}
	s.seq += d.seq
	s.found |= d.found
	s.negative = s.negative&^d.found | d.negative
}

// finish ends the scan: a JSON body's values are what it gave, however
// far it got (a client may have left); a stream's are those of its
// complete events or lines. JSON Lines allows the last line without a
// newline (it carries Ollama's usage): it counts when its JSON is
// complete, and the scan did not stop in it. An event stream's last
// event without its blank line does not, as a client drops it.
func (s *bodyScanner) finish() {
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

// jsonScanner reads JSON a chunk at a time and notes the numbers at the
// scan paths. It holds the path to where it is as, per depth, the paths
// that may still lie ahead (a bit each), and the last value each path
// had. It does not check everything JSON requires, only enough to know
// where it is; a document it cannot follow stops it.
type jsonScanner struct {
	paths  *scanPaths
	state  jsonState
	depth  int
	arrays uint64                  // bit d-1: the container at depth d is an array
	ahead  [maxPathKeys + 1]uint16 // per depth: the paths inside that container
	index  [maxPathKeys + 1]int    // per depth, in an array: the element's index
	value  uint16                  // the paths the value being read is on, or inside
	key    int                     // bytes of the key read so far
	esc    int8                    // in a string: 0, 1 after '\', 2..5 in \uXXXX
	hex    rune                    // the \uXXXX being read
	num    [32]byte                // a number at a path
	numLen int                     // -1: too long to be a cost
	found  uint16                  // paths that had a number
	values [maxScanPaths]float64   // their last numbers
	order  [maxScanPaths]uint32    // when each came: seq then
	seq    uint32                  // the numbers at paths so far
	// negative: paths whose last number was negative.
	negative uint16
}

type jsonState uint8

const (
	jValue       jsonState = iota // before a value
	jArrayFirst                   // after '[': a value or ']'
	jObjectFirst                  // after '{': a key or '}'
	jKey                          // after ',' in an object: a key
	jKeyString                    // in a key
	jColon                        // after a key: ':'
	jAfter                        // after a value: ',' or a closing bracket
	jString                       // in a string value
	jNumber                       // in a number
	jLiteral                      // in true, false or null
	jDone                         // the document is complete: only space may follow
	jStop                         // a document it cannot follow
)

// maxDepth is the deepest nesting followed (arrays has a bit per depth).
const maxDepth = 64

func (d *jsonScanner) reset() {
	d.state, d.depth, d.arrays, d.found, d.negative, d.seq = jValue, 0, 0, 0, 0, 0
	d.value = 1<<d.paths.n - 1
}

// end ends the document (a number at its end is complete now) and says
// whether it was whole.
func (d *jsonScanner) end() bool {
	if d.depth == 0 && (d.state == jNumber || d.state == jLiteral) {
		d.endValue()
	}
	return d.state == jDone
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// feed reads the next bytes of the document.
func (d *jsonScanner) feed(p []byte) {
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch d.state {
		case jValue, jArrayFirst:
			if isSpace(c) {
				continue
			}
			if d.state == jArrayFirst {
				if c == ']' {
					d.close(c)
					continue
				}
				d.value = d.element()
			}
			d.beginValue(c)
		case jObjectFirst, jKey:
			switch {
			case isSpace(c):
			case c == '"':
				d.state, d.key, d.esc = jKeyString, 0, 0
				d.value = 0
				if d.depth <= maxPathKeys {
					d.value = d.ahead[d.depth]
				}
			case c == '}' && d.state == jObjectFirst:
				d.close(c)
			default:
				d.state = jStop
			}
		case jKeyString:
			d.keyByte(c)
		case jColon:
			switch {
			case isSpace(c):
			case c == ':':
				d.state = jValue
			default:
				d.state = jStop
			}
		case jAfter:
			switch {
			case isSpace(c):
			case c == ',':
				if d.arrays>>(d.depth-1)&1 == 1 {
					if d.depth <= maxPathKeys {
						d.index[d.depth]++
					}
					d.state, d.value = jValue, d.element()
				} else {
					d.state = jKey
				}
			case c == '}' || c == ']':
				d.close(c)
			default:
				d.state = jStop
			}
		case jString:
			// Skip to the closing quote; an escape hides the byte after it.
			for ; i < len(p); i++ {
				if d.esc == 1 {
					d.esc = 0
					continue
				}
				j := bytes.IndexAny(p[i:], `"\`)
				if j < 0 {
					i = len(p)
					break
				}
				i += j
				if p[i] == '\\' {
					d.esc = 1
					continue
				}
				d.endValue()
				break
			}
		case jNumber:
			if c >= '0' && c <= '9' || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E' {
				if d.numLen >= 0 {
					if d.numLen < len(d.num) {
						d.num[d.numLen] = c
						d.numLen++
					} else {
						d.numLen = -1
					}
				}
				continue
			}
			d.endNumber()
			i-- // c comes after the number
		case jLiteral:
			if c >= 'a' && c <= 'z' {
				continue
			}
			d.endValue()
			i--
		case jDone:
			if !isSpace(c) {
				d.state = jStop
			}
		case jStop:
			return
		}
	}
}

// beginValue starts the value whose first byte is c, on the paths in
// d.value.
func (d *jsonScanner) beginValue(c byte) {
	switch {
	case c == '{' || c == '[':
		if d.depth == maxDepth {
			d.state = jStop
			return
		}
		k := d.depth
		d.depth++
		if d.depth <= maxPathKeys {
			d.ahead[d.depth] = d.value & d.paths.longer[k]
			d.index[d.depth] = 0
		}
		if c == '[' {
			d.arrays |= 1 << k
			d.state = jArrayFirst
		} else {
			d.arrays &^= 1 << k
			d.state = jObjectFirst
		}
	case c == '"':
		d.state, d.esc = jString, 0
	case c == '-' || c >= '0' && c <= '9':
		d.state, d.numLen = jNumber, 0
		if d.depth > maxPathKeys || d.value&d.paths.exact[d.depth] == 0 {
			d.numLen = -1 // on no path
		} else {
			d.num[0], d.numLen = c, 1
		}
	case c >= 'a' && c <= 'z':
		d.state = jLiteral
	default:
		d.state = jStop
	}
}

// element is the paths the current array element is on, or inside.
func (d *jsonScanner) element() uint16 {
	k := d.depth
	if k > maxPathKeys {
		return 0
	}
	var on uint16
	for m := d.ahead[k]; m != 0; m &= m - 1 {
		p := bits.TrailingZeros16(m)
		if d.paths.index[p][k-1] == d.index[k] {
			on |= 1 << p
		}
	}
	return on
}

// keyByte reads a byte of a key: the paths whose key at this depth it
// still matches stay in d.value. Escapes are decoded, so that a key
// matches however it is written.
func (d *jsonScanner) keyByte(c byte) {
	switch {
	case d.esc == 1:
		d.esc = 0
		switch c {
		case 'u':
			d.esc, d.hex = 2, 0
		case 'b':
			d.match('\b')
		case 'f':
			d.match('\f')
		case 'n':
			d.match('\n')
		case 'r':
			d.match('\r')
		case 't':
			d.match('\t')
		default: // '"', '\\', '/'
			d.match(c)
		}
	case d.esc >= 2:
		v := rune(-1)
		switch {
		case c >= '0' && c <= '9':
			v = rune(c - '0')
		case c >= 'a' && c <= 'f':
			v = rune(c-'a') + 10
		case c >= 'A' && c <= 'F':
			v = rune(c-'A') + 10
		}
		if v < 0 {
			d.state = jStop
			return
		}
		d.hex = d.hex<<4 | v
		if d.esc++; d.esc == 6 {
			d.esc = 0
			var buf [utf8.UTFMax]byte
			for _, b := range buf[:utf8.EncodeRune(buf[:], d.hex)] {
				d.match(b)
			}
		}
	case c == '\\':
		d.esc = 1
	case c == '"':
		// The key is complete: the paths whose key is exactly it.
		var on uint16
		for m := d.value; m != 0; m &= m - 1 {
			p := bits.TrailingZeros16(m)
			if len(d.paths.keys[p][d.depth-1]) == d.key {
				on |= 1 << p
			}
		}
		d.value, d.state = on, jColon
	default:
		d.match(c)
	}
}

// match compares the next byte of the key with each path's key.
func (d *jsonScanner) match(b byte) {
	for m := d.value; m != 0; m &= m - 1 {
		p := bits.TrailingZeros16(m)
		if key := d.paths.keys[p][d.depth-1]; d.key >= len(key) || key[d.key] != b {
			d.value &^= 1 << p
		}
	}
	d.key++
}

// endNumber ends a number: on a path, it is that path's last value.
func (d *jsonScanner) endNumber() {
	if d.numLen > 0 {
		if v, err := strconv.ParseFloat(string(d.num[:d.numLen]), 64); err == nil {
			d.seq++
			for m := d.value & d.paths.exact[d.depth]; m != 0; m &= m - 1 {
				p := bits.TrailingZeros16(m)
				d.values[p], d.order[p] = v, d.seq
				d.found |= 1 << p
				if v < 0 {
					d.negative |= 1 << p
				} else {
					d.negative &^= 1 << p
				}
			}
		}
	}
	d.endValue()
}

// endValue ends a value: the document, or on to what follows it.
func (d *jsonScanner) endValue() {
	if d.depth == 0 {
		d.state = jDone
	} else {
		d.state = jAfter
	}
}

// close closes the container at the current depth with c, which must
// match it.
func (d *jsonScanner) close(c byte) {
	if d.depth == 0 || (d.arrays>>(d.depth-1)&1 == 1) != (c == ']') {
		d.state = jStop
		return
	}
	d.depth--
	d.endValue()
}
