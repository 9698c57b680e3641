package scan

import (
	"bytes"
	"encoding/json"
	"math/bits"
	"unicode/utf8"
)

// Values finds the values at its paths in one JSON document that its
// caller holds (a request body): strings, numbers and booleans, as text.
// It reads the document as the caller appends to it, to its end: a path
// met twice has no value, wherever the second one is (a client that
// writes a cheap model first and a dear one last must not be limited as
// the first and served the last, which is what a parser that keeps the
// last value serves). A key read as Go's encoding/json reads it (escapes
// decoded, an invalid byte as U+FFFD) that is a path's key only when
// both are folded as that package folds them to match a struct's fields
// (`MODEL` or `Model` for `model`; K, the Kelvin sign, for k; ſ, the
// long s, for s) is the path met again: a Go upstream reads it as the
// path, most other parsers as another key, so the path has no value
// even when that key is its only one. It holds no copy of the document,
// only where each value lies in it. A path whose value is an object or an
// array has no value either; neither has any path of a document it cannot
// follow (not JSON, nested deeper than it follows).
//
// A Values is used as Reset, Write (any number of times, each with the
// document's next bytes), End when the document ended before Write said
// it was complete, then Value for each path.
type Values struct {
	doc   jsonScanner
	ended bool // End ran: the document is all there is
}

// Reset makes v a new reading of a document for paths.
func (v *Values) Reset(paths *Paths) {
	*v = Values{}
	v.doc.paths, v.doc.capture = paths, true
	v.doc.reset()
}

// Write reads the next bytes of the document, and says whether reading
// is over: the document cannot be followed.
func (v *Values) Write(p []byte) (over bool) {
	v.doc.feed(p)
	v.doc.off += len(p)
	return v.doc.state == jStop
}

// End says that the document ended (the body did).
func (v *Values) End() {
	v.ended = true
	v.doc.end()
}

// Why says why no path has a value, or "": "not_json" for a document it
// cannot follow, or, after End, one that is not whole.
func (v *Values) Why() string {
	switch v.doc.state {
	case jStop:
		return "not_json"
	case jDone:
		return ""
	}
	if v.ended {
		return "not_json"
	}
	return ""
}

// Value is path's value (its bit, from Paths.Add) in doc, the document
// as written so far: a string's text unescaped, a number or a boolean as
// written, "" for null or no value. why says why a value there is none:
// "repeated", "nested" or "invalid_utf8"; "" when the path is not in the
// document (or Why has a reason).
func (v *Values) Value(bit uint16, doc []byte) (value []byte, why string) {
	d := &v.doc
	switch {
	case v.Why() != "":
		return nil, ""
	case d.repeated&bit != 0:
		return nil, "repeated"
	case d.nested&bit != 0:
		return nil, "nested"
	case d.found&bit == 0:
		return nil, ""
	}
	span := d.spans[bits.TrailingZeros16(bit)]
	if span[1] > len(doc) || span[0] >= span[1] {
		return nil, ""
	}
	raw := doc[span[0]:span[1]]
	if !utf8.Valid(raw) {
		return nil, "invalid_utf8"
	}
	switch {
	case raw[0] != '"':
		if string(raw) == "null" {
			return nil, ""
		}
		return raw, ""
	case bytes.IndexByte(raw, '\\') < 0:
		return raw[1 : len(raw)-1], ""
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil || !utf8.ValidString(s) {
		return nil, "invalid_utf8" // or a string JSON does not allow
	}
	return []byte(s), ""
}
