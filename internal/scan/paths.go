// package scan reads numbers out of a response body as it streams by:
// the values at named JSON paths (usage.total_tokens) of one JSON
// document, of each event of an event stream (SSE), or of each JSON
// line, with the last value of each path kept. It holds nothing of the
// body but the state of the JSON being read, so a body of any size costs
// the same memory, and a Body is a plain value its caller may embed.
//
// It knows nothing of Caddy's handler: the root package's charge writer
// hands it the response's headers and bytes, and asks it the sum once
// the response ended. Apart from the handler, it is tested byte by byte
// without a server, and the compiler keeps it from reaching back. Its
// messages (a bad path, no number in the body) are the ones the
// handler's configuration checks and warnings give, so they name the
// Caddyfile's `charge json` and `max_body`.
package scan

import (
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Bounds of what a scan holds: the paths of one Paths (a bit each of a
// uint16), and the keys of a path.
const (
	MaxPaths = 16
	MaxKeys  = 8
)

// ErrTooManyPaths is Add's error for a path past MaxPaths.
var ErrTooManyPaths = fmt.Errorf("more than %d paths", MaxPaths)

// Paths are the JSON paths a scan reads, such as usage.total_tokens or
// choices.0.index: at most MaxPaths, a bit each, of at most MaxKeys keys
// separated by '.'; a key of digits is also an array index. The zero
// value is empty; Add adds to it. A Body reads it and never changes it,
// so one Paths serves every scan of a handler.
type Paths struct {
	n      int
	text   [MaxPaths]string
	keys   [MaxPaths][]string
	folded [MaxPaths][]string     // each key as Go's encoding/json folds it (foldKey)
	index  [MaxPaths][MaxKeys]int // each key as an array index, or -1
	exact  [MaxKeys + 1]uint16    // paths of exactly k keys
	longer [MaxKeys + 1]uint16    // paths of more than k keys
}

// CheckPath judges a path: at most MaxKeys keys, none empty. Its error
// says why, without the path.
func CheckPath(path string) error {
	keys := strings.Split(path, ".")
	if len(keys) > MaxKeys {
		return fmt.Errorf("more than %d keys; a shorter path must do", MaxKeys)
	}
	for _, k := range keys {
		if k == "" {
			return errors.New("want keys separated by '.', such as usage.total_tokens")
		}
	}
	return nil
}

// Add adds a path (once) and returns its bit. The error is CheckPath's,
// or ErrTooManyPaths.
func (ps *Paths) Add(path string) (uint16, error) {
	for i := range ps.n {
		if ps.text[i] == path {
			return 1 << i, nil
		}
	}
	if err := CheckPath(path); err != nil {
		return 0, err
	}
	if ps.n == MaxPaths {
		return 0, ErrTooManyPaths
	}
	i := ps.n
	ps.n++
	ps.text[i], ps.keys[i] = path, strings.Split(path, ".")
	ps.folded[i] = make([]string, len(ps.keys[i]))
	for k, key := range ps.keys[i] {
		ps.folded[i][k] = foldKey(key)
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

// foldKey is key as Go's encoding/json folds an object's keys to match
// them with a struct's fields, which it does when no field's name is the
// key exactly (encoding/json's foldName): ASCII letters in upper case,
// any other character the smallest of those Unicode's simple folding
// makes equal to it (so K, the Kelvin sign, is K, and ſ, the long s, is
// S), and an invalid byte U+FFFD.
func foldKey(key string) string {
	var b []byte
	for _, r := range key { // an invalid byte is utf8.RuneError, as in foldName
		b = utf8.AppendRune(b, foldRune(r))
	}
	return string(b)
}

// foldRune is the character that r folds to (foldKey).
func foldRune(r rune) rune {
	if r < utf8.RuneSelf {
		if 'a' <= r && r <= 'z' {
			r -= 'a' - 'A'
		}
		return r
	}
	for {
		next := unicode.SimpleFold(r)
		if next <= r {
			return next
		}
		r = next
	}
}

// Len is the number of paths.
func (ps *Paths) Len() int { return ps.n }

// Names lists the paths in mask, for messages.
func (ps *Paths) Names(mask uint16) string {
	var names []string
	for m := mask; m != 0; m &= m - 1 {
		names = append(names, ps.text[bits.TrailingZeros16(m)])
	}
	return strings.Join(names, ", ")
}

// quoteShow is the most bytes of a response's value a message quotes, as
// the handler's own messages do.
const quoteShow = 64

// cutShort cuts a value from a response to what a message quotes.
func cutShort(s string) string {
	if len(s) <= quoteShow {
		return s
	}
	return s[:quoteShow] + "..."
}
