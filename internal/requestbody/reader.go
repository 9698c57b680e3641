// package requestbody reads the values at paths of a request's JSON body
// (the model an LLM request names, its max_tokens) and sets them as
// placeholders, before the rest of the request is handled: only as far
// into the body as the paths need, and the part read is replayed ahead of
// the rest (Replay), so that the next handler receives the body byte for
// byte, streamed as before. A path met twice, or met again as a key in
// another case, has no value (internal/scan finds them).
//
// It knows nothing of the handler that uses it: the handler names the
// paths and the placeholders, hands it each request, and hears through a
// Reporter why a body's values were left empty.
package requestbody

import (
	"io"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/caddy-redis/ratelimit/internal/scan"
	"github.com/caddyserver/caddy/v2"
)

// Why a request body's values could not be read: a Reporter's reason.
const (
	unreadEncoded  = "encoded"      // Content-Encoding
	unreadNotJSON  = "not_json"     // not JSON, or nested deeper than followed
	unreadTooLarge = "too_large"    // the body is larger than max_size
	unreadCutOff   = "cut_off"      // the client's body ended in an error
	unreadRepeated = "repeated"     // a path met twice
	unreadNested   = "nested"       // an object or an array at a path
	unreadUTF8     = "invalid_utf8" // a string that is not valid UTF-8
)

// Reasons are every reason a Reporter may be told, such as "too_large"
// or "repeated": a fixed set, fit for a metric's label.
var Reasons = []string{unreadEncoded, unreadNotJSON, unreadTooLarge, unreadCutOff, unreadRepeated, unreadNested, unreadUTF8}

// A Reporter hears why values of a request's body were left empty:
// reason is one of Reasons, detail says more, or is "".
type Reporter interface {
	Unread(reason, detail string)
}

// Options say what a Reader reads and which placeholders it sets.
type Options struct {
	// Paths are the JSON paths to read, as scan.Paths takes them (keys
	// separated by `.`), checked by the caller; a path given twice is
	// read once.
	Paths []string
	// MaxSize is the most bytes of a body read, and so the most memory a
	// request holds for it: a larger body has no values.
	MaxSize int
	// Prefix starts the placeholders of the values: the value at path p
	// is Prefix+p.
	Prefix string
	// SizeKey is the placeholder of the body's size in bytes.
	SizeKey string
	// Config is the text where the placeholders are written (the
	// configuration that uses them): each `{<Prefix><path>:<default>}`
	// in it is set per request, to the value at path or else to the
	// default. (Caddy's replacer has no defaults of its own at run time.)
	Config []byte
}

// Reader reads the values at its paths of request bodies. It is safe for
// concurrent use.
type Reader struct {
	paths    scan.Paths
	bits     []uint16 // each path's, in paths' order
	keys     []string // each path's placeholder
	defaults []placeholderDefault
	watched  []string // every placeholder it sets (Placeholders)
	prefix   string   // of keys
	sizeKey  string
	// interned are values met before, boxed once: a model's name, a
	// usual max_tokens (2 allocs less per value and request:
	// BenchmarkServeHTTPLLM/llm 32 -> 28). At most maxInterned values of
	// at most maxInternedLen bytes, whatever clients send; a new map on
	// each addition, so that requests read it without a lock.
	interned atomic.Pointer[map[string]any]
	internMu sync.Mutex
	maxSize  int
}

// NewReader returns the Reader that o describes.
func NewReader(o Options) *Reader {
	rr := &Reader{maxSize: o.MaxSize, prefix: o.Prefix, sizeKey: o.SizeKey}
	for _, p := range o.Paths {
		bit, _ := rr.paths.Add(p)
		if !containsBit(rr.bits, bit) {
			rr.bits = append(rr.bits, bit)
			rr.keys = append(rr.keys, o.Prefix+p)
		}
	}
	rr.findDefaults(o.Config)
	rr.watched = slices.Clone(rr.keys)
	for _, d := range rr.defaults {
		rr.watched = append(rr.watched, d.key)
	}
	rr.watched = append(rr.watched, rr.sizeKey)
	return rr
}

// Placeholders are the placeholders that Read sets: each path's value,
// each default that the config writes, the body's size. The caller must
// not change the slice.
func (rr *Reader) Placeholders() []string { return rr.watched }

// placeholderDefault is a `{<prefix><path>:<default>}` that the config
// writes: set per request, to the value at path, or else to the default.
type placeholderDefault struct {
	path  int    // in bits and keys
	key   string // the placeholder, default and all
	value any    // the default, boxed once
}

// findDefaults notes the placeholders with defaults that config writes.
func (rr *Reader) findDefaults(config []byte) {
	pattern := regexp.MustCompile(`\{` + regexp.QuoteMeta(rr.prefix) + `([^{}:]+):([^{}]*)\}`)
	for _, m := range pattern.FindAllSubmatch(config, -1) {
		key := string(m[0][1 : len(m[0])-1])
		i := slices.Index(rr.keys, rr.prefix+string(m[1]))
		if i < 0 || slices.ContainsFunc(rr.defaults, func(d placeholderDefault) bool { return d.key == key }) {
			continue // not a path it reads: as any unknown placeholder
		}
		rr.defaults = append(rr.defaults, placeholderDefault{path: i, key: key, value: string(m[2])})
	}
}

// setDefaults sets the placeholders with defaults, from the request's
// values (nil: none).
func (rr *Reader) setDefaults(repl *caddy.Replacer, values []any) {
	for _, d := range rr.defaults {
		if values != nil && values[d.path] != nil {
			repl.Set(d.key, values[d.path])
		} else {
			repl.Set(d.key, d.value)
		}
	}
}

// Bounds of the values a Reader interns.
const (
	maxInterned    = 256
	maxInternedLen = 64
)

// box is a value as a placeholder's: interned when met before.
func (rr *Reader) box(value []byte) any {
	if m := rr.interned.Load(); m != nil {
		if v, ok := (*m)[string(value)]; ok {
			return v
		}
	}
	v := any(string(value))
	if len(value) <= maxInternedLen {
		rr.intern(v)
	}
	return v
}

func (rr *Reader) intern(v any) {
	rr.internMu.Lock()
	defer rr.internMu.Unlock()
	old := rr.interned.Load()
	if old != nil && len(*old) >= maxInterned {
		return
	}
	m := make(map[string]any, 1)
	if old != nil {
		m = maps.Clone(*old)
	}
	m[v.(string)] = v
	rr.interned.Store(&m)
}

func containsBit(bits []uint16, bit uint16) bool {
	for _, b := range bits {
		if b == bit {
			return true
		}
	}
	return false
}

// Request bodies are read into pooled buffers of this size; one that
// needs more grows (to MaxSize at most) and is left to the GC.
const requestBufferSize = 16 << 10

var requestBuffers = sync.Pool{New: func() any { b := make([]byte, 0, requestBufferSize); return &b }}

// Read reads r's body as far as the paths need, sets their placeholders
// in r's replacer, and leaves in r.Body what was read ahead of the rest
// (also returned; nil when it read nothing), whose Done the caller calls
// once the handlers after it have returned. report hears why values were
// left empty. No lock is held: a slow client holds only its own request,
// within the server's read timeouts.
func (rr *Reader) Read(r *http.Request, report Reporter) *Replay {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if r.Body == nil || r.Body == http.NoBody {
		rr.setDefaults(repl, nil) // no body, no values; nothing to say
		repl.Set(rr.sizeKey, "0")
		return nil
	}
	if r.ContentLength >= 0 {
		repl.Set(rr.sizeKey, contentLength(r))
	}
	if enc := r.Header.Get("Content-Encoding"); enc != "" && !strings.EqualFold(enc, "identity") {
		report.Unread(unreadEncoded, "the body is encoded (Content-Encoding)")
		rr.setDefaults(repl, nil)
		return nil
	}
	bufp := requestBuffers.Get().(*[]byte)
	buf := (*bufp)[:0]
	var v scan.Values
	v.Reset(&rr.paths)
	var why string
	grown, ended := false, false
	most := rr.maxSize + 1 // a byte past MaxSize tells a larger body from one of MaxSize
	for over := false; !over; {
		if len(buf) == cap(buf) {
			bigger := make([]byte, len(buf), min(2*cap(buf), most)) // never past it
			buf, grown = bigger[:copy(bigger, buf)], true
		}
		n, err := r.Body.Read(buf[len(buf):min(cap(buf), most)])
		if n > 0 {
			if len(buf)+n > rr.maxSize {
				buf, why = buf[:len(buf)+n], unreadTooLarge
				break
			}
			over = v.Write(buf[len(buf) : len(buf)+n])
			buf = buf[:len(buf)+n]
		}
		switch {
		case over:
		case err == io.EOF:
			v.End()
			over, ended = true, true
		case err != nil:
			why = unreadCutOff
			over = true
		}
	}
	if why == "" {
		why = v.Why()
	}
	var inline [scan.MaxPaths]any
	values := inline[:len(rr.bits)]
	// A body past MaxSize may hold a second value of a path further on,
	// which the upstream would serve: no value is known then.
	if why != unreadCutOff && why != unreadNotJSON && why != unreadTooLarge {
		for i, bit := range rr.bits {
			value, bad := v.Value(bit, buf)
			if bad != "" {
				report.Unread(bad, "the value at "+rr.keys[i][len(rr.prefix):]+" is not a string, number or boolean")
				continue
			}
			if len(value) > 0 {
				values[i] = rr.box(value)
				repl.Set(rr.keys[i], values[i])
			}
		}
	}
	rr.setDefaults(repl, values)
	if why != "" {
		report.Unread(why, "")
	}
	if len(buf) == 0 {
		requestBuffers.Put(bufp) // the body was empty: nothing to replay
		if ended {
			repl.Set(rr.sizeKey, "0")
		}
		return nil
	}
	body := &Replay{rest: buf, body: r.Body, size: len(buf)}
	if ended && r.ContentLength < 0 {
		repl.Set(rr.sizeKey, body) // its size, as text only when asked (String)
	}
	if !grown {
		*bufp = buf[:0]
		body.pooled = bufp
	} else {
		requestBuffers.Put(bufp) // grown: the pooled one is free now
	}
	r.Body = body
	return body
}
