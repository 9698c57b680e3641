package scan

import (
	"bytes"
	"math/bits"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// jsonScanner reads JSON a chunk at a time and notes the numbers at the
// scan paths. It holds the path to where it is as, per depth, the paths
// that may still lie ahead (a bit each), and the last value each path
// had. It does not check everything JSON requires, only enough to know
// where it is; a document it cannot follow stops it.
type jsonScanner struct {
	paths  *Paths
	state  jsonState
	depth  int
	arrays uint64              // bit d-1: the container at depth d is an array
	ahead  [MaxKeys + 1]uint16 // per depth: the paths inside that container
	index  [MaxKeys + 1]int    // per depth, in an array: the element's index
	value  uint16              // the paths the value being read is on, or inside
	key    int                 // bytes of the key read so far
	esc    int8                // in a string: 0, 1 after '\', 2..5 in \uXXXX
	hex    rune                // the \uXXXX being read
	num    [32]byte            // a number at a path
	numLen int                 // -1: too long to be a cost
	found  uint16              // paths that had a number
	values [MaxPaths]float64   // their last numbers
	order  [MaxPaths]uint32    // when each came: seq then
	seq    uint32              // the numbers at paths so far
	// negative: paths whose last number was negative.
	negative uint16

	// capture (Values): where the value of each path lies in the
	// document, whatever its type, instead of numbers.
	capture  bool
	off      int              // the document's offset of the bytes fed now
	at       uint16           // the paths the value being read is at
	start    int              // where that value began
	spans    [MaxPaths][2]int // each path's value: [start, end)
	repeated uint16           // paths met twice
	nested   uint16           // paths whose value is an object or an array

	// Capture also reads each key as Go's encoding/json does (escapes,
	// surrogate pairs, an invalid byte as U+FFFD) and matches it folded
	// as well (foldKey): a key that is a path's only folded is that path
	// given again for a Go upstream, which reads it so.
	folded  uint16              // the paths whose key the key read so far matches folded
	fkey    int                 // bytes of the folded key read so far
	variant uint16              // of value: the paths it is on through a key that matched only folded
	varies  [MaxKeys + 1]uint16 // per depth: of ahead, those so
	utf     [utf8.UTFMax]byte   // a key's raw bytes of a character not complete yet
	utfLen  int                 // how many
	surr    rune                // a high surrogate (\uD800 to \uDBFF) waiting for its low one; 0: none
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
	d.at, d.repeated, d.nested, d.off = 0, 0, 0, 0
	d.variant = 0
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
			if d.capture {
				d.mark(c, i)
			}
			d.beginValue(c)
		case jObjectFirst, jKey:
			switch {
			case isSpace(c):
			case c == '"':
				d.state, d.key, d.esc = jKeyString, 0, 0
				d.value = 0
				if d.depth <= MaxKeys {
					d.value = d.ahead[d.depth]
				}
				if d.capture {
					d.folded, d.fkey, d.utfLen, d.surr = d.value, 0, 0, 0
				}
			case c == '}' && d.state == jObjectFirst:
				d.close(c)
			default:
				d.state = jStop
			}
		case jKeyString:
			if d.value|d.folded == 0 && d.esc == 0 {
				// No path's key can be this one: on to its end, or to an
				// escape, which may hide a quote.
				for i < len(p) && p[i] != '"' && p[i] != '\\' {
					i++
				}
				if i == len(p) {
					break
				}
				c = p[i]
			}
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
					if d.depth <= MaxKeys {
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
			// Two IndexByte (vectorised) rather than one IndexAny, which
			// goes a byte at a time: the 2 KiB body of make bench's llm@64
			// is mostly one long string (BenchmarkValuesLLMBody). quote is
			// the next '"' at or after i (len(p): none), found again only
			// once passed, so that a string of many escapes stays linear.
			for quote := -1; i < len(p); i++ {
				if d.esc == 1 {
					d.esc = 0
					continue
				}
				if quote < i {
					quote = len(p)
					if j := bytes.IndexByte(p[i:], '"'); j >= 0 {
						quote = i + j
					}
				}
				if k := bytes.IndexByte(p[i:quote], '\\'); k >= 0 {
					i += k
					d.esc = 1
					continue
				}
				if quote == len(p) {
					i = len(p)
					break
				}
				i = quote
				if d.at != 0 {
					d.captured(i + 1)
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
			if d.at != 0 {
				d.captured(i)
			}
			d.endNumber()
			i-- // c comes after the number
		case jLiteral:
			if c >= 'a' && c <= 'z' {
				continue
			}
			if d.at != 0 {
				d.captured(i)
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
		if d.depth <= MaxKeys {
			d.ahead[d.depth] = d.value & d.paths.longer[k]
			d.varies[d.depth] = d.variant & d.ahead[d.depth]
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
		if d.depth > MaxKeys || d.value&d.paths.exact[d.depth] == 0 {
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
	if k > MaxKeys {
		d.variant = 0
		return 0
	}
	var on uint16
	for m := d.ahead[k]; m != 0; m &= m - 1 {
		p := bits.TrailingZeros16(m)
		if d.paths.index[p][k-1] == d.index[k] {
			on |= 1 << p
		}
	}
	d.variant = d.varies[k] & on
	return on
}

// keyByte reads a byte of a key: the paths whose key at this depth it
// still matches stay in d.value (and, capturing, those it matches folded
// in d.folded). Escapes are decoded, so that a key matches however it is
// written.
func (d *jsonScanner) keyByte(c byte) {
	switch {
	case d.esc == 1:
		d.esc = 0
		if c == 'u' {
			d.esc, d.hex = 2, 0
			return
		}
		switch c {
		case 'b':
			c = '\b'
		case 'f':
			c = '\f'
		case 'n':
			c = '\n'
		case 'r':
			c = '\r'
		case 't':
			c = '\t'
		} // else '"', '\\', '/': itself
		d.keyRune(rune(c))
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
			d.keyEscaped(d.hex)
		}
	case c == '\\':
		d.esc = 1
		d.flushRaw()
	case c == '"':
		d.flushRaw()
		d.flushSurrogate()
		d.endKey()
	case !d.capture:
		d.match(c)
	default:
		d.keyRaw(c)
	}
}

// endKey ends a key: the paths whose key is exactly it (and, capturing,
// those whose key it is folded, which are variants from now on).
func (d *jsonScanner) endKey() {
	var on uint16
	for m := d.value; m != 0; m &= m - 1 {
		p := bits.TrailingZeros16(m)
		if len(d.paths.keys[p][d.depth-1]) == d.key {
			on |= 1 << p
		}
	}
	if d.capture && d.depth <= MaxKeys {
		var folded uint16
		for m := d.folded; m != 0; m &= m - 1 {
			p := bits.TrailingZeros16(m)
			if len(d.paths.folded[p][d.depth-1]) == d.fkey {
				folded |= 1 << p
			}
		}
		d.variant = (folded&^on | d.varies[d.depth]) & (folded | on)
		on |= folded
	}
	d.value, d.state = on, jColon
}

// keyRune reads a character of a key that an escape wrote: capturing,
// as Go reads it, else as its UTF-8.
func (d *jsonScanner) keyRune(r rune) {
	if d.capture {
		d.flushSurrogate()
		d.keyChar(r)
		return
	}
	var buf [utf8.UTFMax]byte
	for _, b := range buf[:utf8.EncodeRune(buf[:], r)] {
		d.match(b)
	}
}

// keyEscaped reads a \uXXXX of a key. Capturing, a surrogate pair is one
// character, and a surrogate outside a pair U+FFFD, as Go reads them.
func (d *jsonScanner) keyEscaped(r rune) {
	switch {
	case !d.capture:
		d.keyRune(r)
	case d.surr != 0 && r >= 0xdc00 && r < 0xe000:
		r, d.surr = utf16.DecodeRune(d.surr, r), 0
		d.keyChar(r)
	case r >= 0xd800 && r < 0xdc00:
		d.flushSurrogate()
		d.surr = r
	case r >= 0xdc00 && r < 0xe000:
		d.keyRune(utf8.RuneError) // a low surrogate alone
	default:
		d.keyRune(r)
	}
}

// flushSurrogate reads a high surrogate that no low one followed: U+FFFD.
func (d *jsonScanner) flushSurrogate() {
	if d.surr != 0 {
		d.surr = 0
		d.keyChar(utf8.RuneError)
	}
}

// keyRaw reads a raw byte of a key while capturing: the characters it
// completes, as utf8.DecodeRune reads them (an invalid byte is U+FFFD).
func (d *jsonScanner) keyRaw(c byte) {
	if d.folded == 0 {
		return // no path's key can match any more
	}
	d.flushSurrogate()
	if c < utf8.RuneSelf && d.utfLen == 0 {
		d.keyChar(rune(c))
		return
	}
	d.utf[d.utfLen] = c
	d.utfLen++
	for d.utfLen > 0 && utf8.FullRune(d.utf[:d.utfLen]) {
		r, size := utf8.DecodeRune(d.utf[:d.utfLen])
		d.keyChar(r)
		d.utfLen = copy(d.utf[:], d.utf[size:d.utfLen])
	}
}

// flushRaw reads the raw bytes of a character that the key did not
// complete: each U+FFFD.
func (d *jsonScanner) flushRaw() {
	for ; d.utfLen > 0; d.utfLen-- {
		d.keyChar(utf8.RuneError)
	}
}

// keyChar matches the next character of a key, as Go reads it, with each
// path's key, as it is and folded.
func (d *jsonScanner) keyChar(r rune) {
	if d.folded == 0 {
		return
	}
	if r < utf8.RuneSelf {
		d.match(byte(r))
		d.matchFolded(byte(foldRune(r)))
		return
	}
	var buf [utf8.UTFMax]byte
	for _, b := range buf[:utf8.EncodeRune(buf[:], r)] {
		d.match(b)
	}
	for _, b := range buf[:utf8.EncodeRune(buf[:], foldRune(r))] {
		d.matchFolded(b)
	}
}

// matchFolded compares the next byte of the folded key with each path's
// folded key.
func (d *jsonScanner) matchFolded(b byte) {
	for m := d.folded; m != 0; m &= m - 1 {
		p := bits.TrailingZeros16(m)
		if key := d.paths.folded[p][d.depth-1]; d.fkey >= len(key) || key[d.fkey] != b {
			d.folded &^= 1 << p
		}
	}
	d.fkey++
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

// mark notes where a value begins, at p[i] (c) of the bytes fed now,
// and the paths it is at. A path met before is repeated; an object or an
// array at a path is nested: neither has a value then.
func (d *jsonScanner) mark(c byte, i int) {
	d.at = 0
	if d.depth > MaxKeys {
		return
	}
	on := d.value & d.paths.exact[d.depth]
	if on == 0 {
		return
	}
	// A variant is the path given again (for a Go upstream), met: no
	// value then, wherever the path is met.
	if v := on & d.variant; v != 0 {
		d.repeated |= v
		d.found |= v
		if on &^= v; on == 0 {
			return
		}
	}
	d.repeated |= on & d.found
	if c == '{' || c == '[' {
		d.nested |= on
		d.found |= on // met, without a value
		return
	}
	d.at, d.start = on, d.off+i
}

// captured ends the value begun at d.start before p[i] of the bytes fed
// now: its span, for the paths it is at.
func (d *jsonScanner) captured(i int) {
	for m := d.at; m != 0; m &= m - 1 {
		p := bits.TrailingZeros16(m)
		d.spans[p] = [2]int{d.start, d.off + i}
	}
	d.found |= d.at
	d.at = 0
}
