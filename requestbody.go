package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
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
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

// Values from the request's JSON body, as placeholders: the model an LLM
// request names, its max_tokens. They are read before the keys are
// resolved, so keys, values and Caddy's `map` may use them, and so may
// the handlers after this one. Only the paths a handler names are read,
// only on handlers that name some, and only as far into the body as they
// need: the part read is kept and replayed ahead of the rest, so the
// next handler receives the body byte for byte, streamed as before.

// RequestBody names values of the request's JSON body that the handler
// sets as placeholders before it resolves its keys and values: the
// value at each path is `{http.rate_limit.request.<path>}`, such as
// `{http.rate_limit.request.model}`. A string is its text, a number or
// a boolean as written; null, an object, an array, a path met twice, a
// string that is not valid UTF-8 and a path not in the body leave it
// empty (unset). The body is read to its end, so that a path met twice
// anywhere has no value: a client that names a cheap model first and a
// dear one last must not be limited as the first and served the last. A
// key that is a path's in another case (`MODEL`, or `max_toKens` with
// the Kelvin sign, as Go's encoding/json folds keys to match a struct's
// fields) counts as the path met again, even alone: a Go upstream reads
// it as the path, most others as another key. A
// body that is not JSON, is encoded (`Content-Encoding`), is cut off by
// the client, or is larger than `max_size` leaves every placeholder
// empty; the
// request goes on, and `deny_empty_key`, a placeholder's default
// (`{http.rate_limit.request.max_tokens:1000}`, which this handler
// answers where its own config writes it) and the values' checks
// decide it, as for a missing header. A debug line and the
// `caddy_rate_limit_request_body_unread_total` metric (labels `zone` and
// `reason`) say why.
//
// It also sets `{http.rate_limit.request_size}`, the body's size in
// bytes, for a reservation by the prompt's size that does not depend on
// a header HTTP does not require: the request's Content-Length when it
// has one, else the bytes read to the body's end (a JSON body of at most
// `max_size`), `0` without a body; empty for a body without
// Content-Length that was not read to its end (larger than `max_size`,
// not JSON, encoded, or cut off).
//
// A request that a limit naming no value of the body refuses, when the
// handler knows the refusal without asking its store (a hard block, a
// refusal it remembers from Redis, buckets it keeps in the process), is
// refused before its body is read: a client that sent `Expect: 100-continue` gets no
// `100 Continue`. Nothing else bounds how long a body takes but Caddy's
// server timeouts (`read_body_idle`, by default a minute without a byte).
type RequestBody struct {
	// JSON lists the paths to read, as `charge json` writes them: keys
	// separated by `.`, an array element by its index (`messages.0.role`).
	// At most 16 paths, of at most 8 keys each. Required.
	JSON []string `json:"json,omitempty"`

	// MaxSize is the most bytes of a request body read to find the
	// paths, and so the most memory a request holds for it: a larger
	// body leaves every path empty (its rest could name a path again), so
	// set it above the largest body the limits must read, such as a
	// request with images. Default: 1 MiB (1048576 bytes).
	MaxSize int64 `json:"max_size,omitempty"`
}

// unmarshalRequestBody parses request_body; the dispenser is on it:
//
//	request_body {
//		json     <path>...
//		max_size <size>
//	}
func (h *Handler) unmarshalRequestBody(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	rb := new(RequestBody)
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] {
			return d.Errf("request_body subdirective '%s' is given twice", sub)
		}
		seen[sub] = true
		switch sub {
		case "json":
			if rb.JSON = d.RemainingArgs(); len(rb.JSON) == 0 {
				return d.Errf("request_body json: want one or more paths, such as model max_tokens")
			}
		case "max_size":
			if err := oneValue(d, "request_body", func(v string) error {
				n, err := parseSize(v)
				if err != nil {
					return fmt.Errorf("request_body max_size '%s': want a size such as 1MiB, 64KiB or 65536 (bytes)", v)
				}
				rb.MaxSize = n
				return nil
			}); err != nil {
				return err
			}
		default:
			return d.Errf("unrecognized request_body subdirective '%s' (it takes json and max_size)", sub)
		}
	}
	h.RequestBody = rb
	if err := checkRequestBody(rb); err != nil {
		return d.WrapErr(err)
	}
	return nil
}

// defaultRequestMaxSize is max_size when the config leaves it out.
const defaultRequestMaxSize = 1 << 20

// requestPlaceholderPrefix starts the placeholders of the request's
// values.
const requestPlaceholderPrefix = "http.rate_limit.request."

// requestSizeKey is the placeholder of the request body's size in bytes.
const requestSizeKey = "http.rate_limit.request_size"

// Why a request body's values could not be read: the metric's `reason`.
const (
	unreadEncoded  = "encoded"      // Content-Encoding
	unreadNotJSON  = "not_json"     // not JSON, or nested deeper than followed
	unreadTooLarge = "too_large"    // the body is larger than max_size
	unreadCutOff   = "cut_off"      // the client's body ended in an error
	unreadRepeated = "repeated"     // a path met twice
	unreadNested   = "nested"       // an object or an array at a path
	unreadUTF8     = "invalid_utf8" // a string that is not valid UTF-8
)

var unreadReasons = []string{unreadEncoded, unreadNotJSON, unreadTooLarge, unreadCutOff, unreadRepeated, unreadNested, unreadUTF8}

// checkRequestBody judges request_body: paths as `charge json` takes
// them, and a size.
func checkRequestBody(rb *RequestBody) error {
	if rb == nil {
		return nil
	}
	if len(rb.JSON) == 0 {
		return errors.New("request_body: want json <path>..., the paths whose values become {http.rate_limit.request.<path>}")
	}
	var paths scan.Paths
	for _, p := range rb.JSON {
		if _, err := paths.Add(p); err != nil {
			if errors.Is(err, scan.ErrTooManyPaths) {
				return fmt.Errorf("request_body json: more than %d paths; read fewer", scan.MaxPaths)
			}
			return fmt.Errorf("request_body json '%s': %w", p, err)
		}
	}
	if rb.MaxSize < 0 {
		return fmt.Errorf("request_body max_size '%d': want a size in bytes, 1 or more (default %d)", rb.MaxSize, defaultRequestMaxSize)
	}
	return nil
}

// requestReader reads a handler's request_body paths.
type requestReader struct {
	paths    scan.Paths
	bits     []uint16 // each path's, in paths' order
	keys     []string // each path's placeholder
	defaults []placeholderDefault
	// interned are values met before, boxed once: a model's name, a
	// usual max_tokens (2 allocs less per value and request:
	// BenchmarkServeHTTPLLM/llm 32 -> 28). At most maxInterned values of
	// at most maxInternedLen bytes, whatever clients send; a new map on
	// each addition, so that requests read it without a lock.
	interned atomic.Pointer[map[string]any]
	internMu sync.Mutex
	maxSize  int
	unread   map[string]counter // by reason; nil without metrics
}

// placeholderDefault is a `{http.rate_limit.request.<path>:<default>}`
// that the handler's config writes: set per request, to the value at
// path, or else to the default. (Caddy's replacer has no defaults of its
// own at run time.)
type placeholderDefault struct {
	path  int    // in bits and keys
	key   string // the placeholder, default and all
	value any    // the default, boxed once
}

// defaultPattern finds the placeholders with a default of the config.
var defaultPattern = regexp.MustCompile(`\{http\.rate_limit\.request\.([^{}:]+):([^{}]*)\}`)

// findDefaults notes the request placeholders with defaults that config
// (the handler's, as JSON) writes.
func (rr *requestReader) findDefaults(config []byte) {
	for _, m := range defaultPattern.FindAllSubmatch(config, -1) {
		key := string(m[0][1 : len(m[0])-1])
		i := slices.Index(rr.keys, requestPlaceholderPrefix+string(m[1]))
		if i < 0 || slices.ContainsFunc(rr.defaults, func(d placeholderDefault) bool { return d.key == key }) {
			continue // not a path it reads: as any unknown placeholder
		}
		rr.defaults = append(rr.defaults, placeholderDefault{path: i, key: key, value: string(m[2])})
	}
}

// setDefaults sets the placeholders with defaults, from the request's
// values (nil: none).
func (rr *requestReader) setDefaults(repl *caddy.Replacer, values []any) {
	for _, d := range rr.defaults {
		if values != nil && values[d.path] != nil {
			repl.Set(d.key, values[d.path])
		} else {
			repl.Set(d.key, d.value)
		}
	}
}

// Bounds of the values a handler interns.
const (
	maxInterned    = 256
	maxInternedLen = 64
)

// box is a value as a placeholder's: interned when met before.
func (rr *requestReader) box(value []byte) any {
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

func (rr *requestReader) intern(v any) {
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

// counter is the one method of a Prometheus counter used here.
type counter interface{ Inc() }

// unreadCounters are a zone's caddy_rate_limit_request_body_unread_total
// series, by reason.
func unreadCounters(zone string) map[string]counter {
	m := make(map[string]counter, len(unreadReasons))
	for _, reason := range unreadReasons {
		m[reason] = collectors.requestUnread.WithLabelValues(zone, reason)
	}
	return m
}

// setUpRequestBody compiles request_body, when the config has one.
func (h *Handler) setUpRequestBody() error {
	rb := h.RequestBody
	if rb == nil {
		return nil
	}
	if err := checkRequestBody(rb); err != nil {
		return err
	}
	rr := &requestReader{maxSize: defaultRequestMaxSize}
	if rb.MaxSize > 0 {
		rr.maxSize = int(min(rb.MaxSize, 1<<40))
	}
	for _, p := range rb.JSON {
		bit, _ := rr.paths.Add(p)
		if !containsBit(rr.bits, bit) {
			rr.bits = append(rr.bits, bit)
			rr.keys = append(rr.keys, requestPlaceholderPrefix+p)
		}
	}
	config, err := json.Marshal(h)
	if err != nil {
		return fmt.Errorf("reading the config for request_body's defaults: %w", err)
	}
	rr.findDefaults(config)
	h.request = rr
	h.before = append(h.before, requestBodyStep{h})
	return nil
}

// requestBodyStep is request_body's step (steps.go): the body's values
// are read before the buckets are resolved.
type requestBodyStep struct{ h *Handler }

func (s requestBodyStep) before(r *http.Request) ender {
	if body := s.h.readRequestBody(r); body != nil {
		return body
	}
	return nil
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
// needs more grows (to max_size at most) and is left to the GC.
const requestBufferSize = 16 << 10

var requestBuffers = sync.Pool{New: func() any { b := make([]byte, 0, requestBufferSize); return &b }}

// readRequestBody reads the request's body as far as its paths need,
// sets their placeholders, and leaves in r.Body what was read ahead of
// the rest (also returned; nil when it read nothing). No lock is held:
// a slow client holds only its own request, within the server's read
// timeouts.
func (h *Handler) readRequestBody(r *http.Request) *replayBody {
	rr := h.request
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if r.Body == nil || r.Body == http.NoBody {
		rr.setDefaults(repl, nil) // no body, no values; nothing to say
		repl.Set(requestSizeKey, "0")
		return nil
	}
	if r.ContentLength >= 0 {
		repl.Set(requestSizeKey, contentLength(r))
	}
	if enc := r.Header.Get("Content-Encoding"); enc != "" && !strings.EqualFold(enc, "identity") {
		h.requestUnread(unreadEncoded, "the body is encoded (Content-Encoding)")
		rr.setDefaults(repl, nil)
		return nil
	}
	bufp := requestBuffers.Get().(*[]byte)
	buf := (*bufp)[:0]
	var v scan.Values
	v.Reset(&rr.paths)
	var why string
	grown, ended := false, false
	most := rr.maxSize + 1 // a byte past max_size tells a larger body from one of max_size
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
	// A body past max_size may hold a second value of a path further on,
	// which the upstream would serve: no value is known then.
	if why != unreadCutOff && why != unreadNotJSON && why != unreadTooLarge {
		for i, bit := range rr.bits {
			value, bad := v.Value(bit, buf)
			if bad != "" {
				h.requestUnread(bad, "the value at "+rr.keys[i][len(requestPlaceholderPrefix):]+" is not a string, number or boolean")
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
		h.requestUnread(why, "")
	}
	if len(buf) == 0 {
		requestBuffers.Put(bufp) // the body was empty: nothing to replay
		if ended {
			repl.Set(requestSizeKey, "0")
		}
		return nil
	}
	body := &replayBody{rest: buf, body: r.Body, size: len(buf)}
	if ended && r.ContentLength < 0 {
		repl.Set(requestSizeKey, body) // its size, as text only when asked (String)
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

// requestUnread counts, and logs at debug level, why a request's values
// were not read.
func (h *Handler) requestUnread(reason, detail string) {
	if c := h.request.unread[reason]; c != nil {
		c.Inc()
	}
	if ce := h.logger.Check(zap.DebugLevel, "values of the request body left empty"); ce != nil {
		fields := []zap.Field{zap.String("zone", h.Zone), zap.String("reason", reason)}
		if detail != "" {
			fields = append(fields, zap.String("detail", detail))
		}
		ce.Write(fields...)
	}
}
