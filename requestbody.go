package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/caddy-redis/ratelimit/internal/requestbody"
	"github.com/caddy-redis/ratelimit/internal/scan"
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
// internal/requestbody reads and replays; here are the config, its
// parser and checks, and the handler's step with its metric and log.

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

// counter is the one method of a Prometheus counter used here.
type counter interface{ Inc() }

// unreadCounters are a zone's caddy_rate_limit_request_body_unread_total
// series, by reason.
func unreadCounters(zone string) map[string]counter {
	m := make(map[string]counter, len(requestbody.Reasons))
	for _, reason := range requestbody.Reasons {
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
	maxSize := defaultRequestMaxSize
	if rb.MaxSize > 0 {
		maxSize = int(min(rb.MaxSize, 1<<40))
	}
	config, err := json.Marshal(h)
	if err != nil {
		return fmt.Errorf("reading the config for request_body's defaults: %w", err)
	}
	step := &bodyValueStep{h: h, reader: requestbody.NewReader(requestbody.Options{
		Paths:   rb.JSON,
		MaxSize: maxSize,
		Prefix:  requestPlaceholderPrefix,
		SizeKey: requestSizeKey,
		Config:  config,
	})}
	h.request = step
	h.before = append(h.before, step)
	return nil
}

// bodyValueStep is request_body's step (steps.go): the body's values
// are read before the buckets are resolved.
type bodyValueStep struct {
	h      *Handler
	reader *requestbody.Reader
	unread map[string]counter // by reason; nil without metrics
}

func (s *bodyValueStep) before(r *http.Request) ender {
	if body := s.reader.Read(r, s); body != nil {
		return body // left in r.Body, to replay once the handlers have returned
	}
	return nil
}

// Unread counts, and logs at debug level, why a request's values were
// not read.
func (s *bodyValueStep) Unread(reason, detail string) {
	if c := s.unread[reason]; c != nil {
		c.Inc()
	}
	if ce := s.h.logger.Check(zap.DebugLevel, "values of the request body left empty"); ce != nil {
		fields := []zap.Field{zap.String("zone", s.h.Zone), zap.String("reason", reason)}
		if detail != "" {
			fields = append(fields, zap.String("detail", detail))
		}
		ce.Write(fields...)
	}
}
