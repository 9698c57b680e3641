// Package ratelimit is a Caddy HTTP handler that limits requests with a
// token bucket kept in Redis, shared by every Caddy instance that uses
// the same Redis.
package ratelimit

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler limits requests with a token bucket kept in Redis, with the
// semantics of Spring Cloud Gateway's RedisRateLimiter. A bucket holds at
// most `burst_capacity` tokens and refills continuously at
// `replenish_rate` tokens per second; each request takes
// `requested_tokens` or is denied with `status_code` (429). Every Caddy
// instance that uses the same Redis and `zone` shares the budget. One
// atomic Lua script checks and takes, using the Redis server's clock.
//
// Each client has its own bucket, chosen by `key` (default: the client
// IP). Denied requests get a `Retry-After` header, and every response
// whose bucket was consulted carries the headers that `headers` selects:
//
// Header | Meaning
// -------|--------
// `X-RateLimit-Remaining` | whole tokens left after this request; `-1` when Redis failed
// `X-RateLimit-Replenish-Rate` | tokens added per second
// `X-RateLimit-Burst-Capacity` | most tokens the bucket holds
// `X-RateLimit-Requested-Tokens` | tokens each request takes
// `RateLimit-Policy` | IETF draft-10: `"<zone>";q=<burst>;w=<seconds to fill>`
// `RateLimit` | IETF draft-10: `"<zone>";r=<remaining>;t=<seconds until a request fits>`
//
// On a site with `handle_errors` routes, denials are returned as errors
// that those routes can shape; elsewhere the status is written directly,
// which is cheaper. After the limiter ran, these placeholders are set:
//
// Placeholder | Description
// ------------|-------------
// `{http.rate_limit.zone}` | the zone
// `{http.rate_limit.result}` | `allowed`, `denied`, `empty_key`, `error_allowed`, `error_denied` or `shadow_denied`
// `{http.rate_limit.remaining}` | whole tokens left; `-1` when Redis failed
// `{http.rate_limit.limit}` | the burst capacity
// `{http.rate_limit.retry_after}` | on denial, seconds until a retry can succeed, as in `Retry-After`
// `{http.rate_limit.key}` | the client key as stored (escaped, or hashed when long), only with `log_key` (else empty)
//
// It counts its decisions in the `caddy_rate_limit_requests_total`
// metric (labels `zone` and `result`), times Redis in
// `caddy_rate_limit_redis_duration_seconds` and reports its circuit
// breaker in `caddy_rate_limit_breaker_open`.
type Handler struct {
	// Zone names the space of buckets: letters, digits, `-`, `_`, `.` and
	// `:`. Handlers with the same zone and key share a bucket, also across
	// Caddy instances. Default: a name derived from the key template, the
	// rate and the burst, so handlers that should count separately but
	// share those need zones of their own.
	Zone string `json:"zone,omitempty"`

	// Key is the template whose value picks the client's bucket, with any
	// placeholders, e.g. `{http.request.header.X-API-Key}` or
	// `{http.vars.client_ip}:{http.request.header.X-Tenant}`. When any
	// placeholder in it is empty, the key is empty (see `deny_empty_key`).
	// Default: `{http.vars.client_ip}`, which honours the server's
	// `trusted_proxies`.
	Key string `json:"key,omitempty"`

	// ReplenishRate is how many tokens a bucket gains per second,
	// continuously; fractions work (`0.5` is one token every two seconds).
	// Required unless `burst_capacity` is 0.
	ReplenishRate float64 `json:"replenish_rate,omitempty"`

	// BurstCapacity is the most tokens a bucket holds, and so the largest
	// burst an idle client may send. 0 denies every request. It may not be
	// below `replenish_rate`. Default: `replenish_rate` rounded up, a
	// smooth rate with no burst.
	BurstCapacity *int64 `json:"burst_capacity,omitempty"`

	// RequestedTokens is how many tokens each request takes. Default: 1.
	RequestedTokens int64 `json:"requested_tokens,omitempty"`

	// DenyEmptyKey denies requests whose key resolves to the empty string
	// with `empty_key_status`; when false they pass unlimited.
	// Default: true.
	DenyEmptyKey *bool `json:"deny_empty_key,omitempty"`

	// EmptyKeyStatus is the status of a request denied for an empty key.
	// Default: 403.
	EmptyKeyStatus int `json:"empty_key_status,omitempty"`

	// StatusCode is the status of a rate-limited request. Default: 429.
	StatusCode int `json:"status_code,omitempty"`

	// IncludeHeaders, when false, sends no rate-limit headers (as
	// `headers none`). `Retry-After` is sent on denials regardless.
	// Default: true.
	IncludeHeaders *bool `json:"include_headers,omitempty"`

	// Headers chooses the rate-limit response headers: `spring` (the
	// `X-RateLimit-*` set of Spring Cloud Gateway), `ietf` (`RateLimit` and
	// `RateLimit-Policy` of draft-ietf-httpapi-ratelimit-headers-10),
	// `both` or `none`. Default: `spring`.
	Headers string `json:"headers,omitempty"`

	// OnError says what happens when Redis fails (unreachable, an error
	// reply, or no answer within the timeout): `allow` lets the request
	// through, `deny` answers 503. Default: `allow`.
	OnError string `json:"on_error,omitempty"`

	// Shadow runs the limiter without ever denying: tokens are taken and
	// decisions counted as usual, but a request that would be denied
	// passes, counted as `shadow_denied` and logged at info level (at most
	// once per key every few seconds). No rate-limit headers are sent, so
	// clients see no change. For trying a limit out before enforcing it.
	Shadow bool `json:"shadow,omitempty"`

	// LogKey adds the client key to debug and shadow log lines and sets
	// `{http.rate_limit.key}`. Off by default: keys can be personal data.
	LogKey bool `json:"log_key,omitempty"`

	// DisableMetrics turns the Prometheus metrics of this handler off.
	DisableMetrics bool `json:"disable_metrics,omitempty"`

	// Redis says where the buckets live. Default: `127.0.0.1:6379`.
	Redis *RedisConfig `json:"redis,omitempty"`

	logger       *zap.Logger
	limiter      *limiter // nil for burst_capacity 0, which never asks Redis
	limiterKey   string
	template     keyTemplate
	bucketPrefix string // key_prefix, zone, key template: no value reaches another zone
	scriptArgs   []any  // rate, burst, requested, formatted once
	burst        int64
	denyEmpty    bool
	failOpen     bool
	headers      rateLimitHeaders
	errDenied    caddyhttp.HandlerError
	errEmptyKey  caddyhttp.HandlerError
	errBlocked   caddyhttp.HandlerError
	denied       *denyCache
	redisWarns   *logThrottle // Redis failures: a line per 10 s
	overloaded   *logThrottle // calls this instance could not send in time: the same
	shadowKeys   *keyThrottle // shadow denials: a line per key per 5 s ...
	shadowLines  *logThrottle // ... and at most ten a second
	metrics      *zoneMetrics
	zoneValue    any // the zone and the limit as placeholder values, boxed once
	limitValue   any
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision sets up the handler: defaults, the compiled key template and
// the shared Redis client.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	h.applyDefaults()
	h.denyEmpty = h.DenyEmptyKey == nil || *h.DenyEmptyKey
	h.failOpen = h.OnError == onErrorAllow

	var err error
	if h.template, err = parseKeyTemplate(h.Key); err != nil {
		return err
	}
	redisConfig := h.Redis.withPlaceholders()
	if err := redisConfig.validate(); err != nil {
		return err
	}
	h.bucketPrefix = bucketPrefix(redisConfig.KeyPrefix, h.Zone, h.Key)
	h.scriptArgs = []any{
		strconv.FormatFloat(h.ReplenishRate, 'f', -1, 64),
		strconv.FormatInt(h.burst, 10),
		strconv.FormatInt(h.RequestedTokens, 10),
	}
	style := h.Headers
	if h.IncludeHeaders != nil && !*h.IncludeHeaders || h.Shadow {
		style = headersNone
	}
	h.headers = newRateLimitHeaders(style, h.Zone, h.ReplenishRate, h.burst, h.RequestedTokens)
	h.zoneValue, h.limitValue = h.Zone, h.burst
	h.denied = newDenyCache()
	h.redisWarns = &logThrottle{every: 10 * time.Second}
	h.overloaded = &logThrottle{every: 10 * time.Second}
	h.shadowKeys = newKeyThrottle(shadowLogEvery)
	h.shadowLines = &logThrottle{every: time.Second, lines: 10}

	h.errDenied = prebuiltError(h.StatusCode, fmt.Errorf("zone %s: rate limit exceeded", h.Zone))
	h.errBlocked = prebuiltError(h.StatusCode, fmt.Errorf("zone %s: requests blocked (burst_capacity 0)", h.Zone))
	h.errEmptyKey = prebuiltError(h.EmptyKeyStatus, fmt.Errorf("zone %s: the rate limit key '%s' is empty", h.Zone, h.Key))
	if !h.DisableMetrics {
		if h.metrics, err = newZoneMetrics(ctx.GetMetricsRegistry(), h.Zone); err != nil {
			return fmt.Errorf("registering metrics: %w", err)
		}
	}

	if h.burst == 0 {
		return nil // a hard block never asks Redis
	}
	if h.limiter, h.limiterKey, err = acquireLimiter(redisConfig); err != nil {
		return fmt.Errorf("setting up the Redis client: %w", err)
	}
	h.limiter.watch(h)
	if h.metrics != nil {
		watchBreakers(h.Zone, h.limiter)
	}
	return nil
}

// applyDefaults fills in what the config left out.
func (h *Handler) applyDefaults() {
	if h.Key == "" {
		h.Key = "{http.vars.client_ip}"
	}
	if h.BurstCapacity == nil && h.ReplenishRate > 0 {
		burst := int64(math.Ceil(h.ReplenishRate))
		h.BurstCapacity = &burst
	}
	if h.BurstCapacity != nil {
		h.burst = *h.BurstCapacity
	}
	if h.RequestedTokens == 0 {
		h.RequestedTokens = 1
	}
	if h.StatusCode == 0 {
		h.StatusCode = http.StatusTooManyRequests
	}
	if h.EmptyKeyStatus == 0 {
		h.EmptyKeyStatus = http.StatusForbidden
	}
	if h.OnError == "" {
		h.OnError = onErrorAllow
	}
	if h.Headers == "" {
		h.Headers = headersSpring
	}
	if h.Zone == "" {
		h.Zone = derivedZone(h.Key, h.ReplenishRate, h.burst)
	}
}

// Validate refuses what no default can fix. Its checks are the parser's,
// whose messages name the subdirective and the value.
func (h *Handler) Validate() error {
	for _, err := range []error{
		checkZone(h.Zone),
		checkStatus("status_code", h.StatusCode),
		checkStatus("empty_key_status", h.EmptyKeyStatus),
		checkHeaders(h.Headers),
		checkOnError(h.OnError),
		checkLimit(h.ReplenishRate, h.BurstCapacity, h.RequestedTokens),
	} {
		if err != nil {
			return err
		}
	}
	return nil
}

// Cleanup releases the shared Redis client.
func (h *Handler) Cleanup() error {
	if h.limiter == nil {
		return nil
	}
	h.limiter.unwatch(h)
	if h.metrics != nil {
		unwatchBreakers(h.Zone, h.limiter)
	}
	return releaseLimiter(h.limiterKey)
}

// ServeHTTP takes tokens from the request's bucket or denies it.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	key := h.template.redisKey(repl, h.bucketPrefix)
	if key == "" {
		h.record(repl, decisionEmptyKey, "", 0, 0)
		if !h.denyEmpty {
			return next.ServeHTTP(w, r)
		}
		return reject(w, r, h.errEmptyKey)
	}
	if h.burst == 0 {
		h.headers.set(w.Header(), 0, -1)
		h.record(repl, decisionDenied, key, 0, 0)
		return reject(w, r, h.errBlocked)
	}

	res, err := h.check(r.Context(), key)
	if err != nil {
		if r.Context().Err() != nil {
			// The client went away; that says nothing about Redis.
			return caddyhttp.Error(499, r.Context().Err())
		}
		h.headers.set(w.Header(), -1, 0)
		if h.failOpen {
			h.record(repl, decisionErrorAllowed, key, -1, 0)
			return next.ServeHTTP(w, r)
		}
		h.record(repl, decisionErrorDenied, key, -1, 0)
		return reject(w, r, prebuiltError(http.StatusServiceUnavailable, err))
	}

	h.headers.set(w.Header(), res.Remaining, res.RetryAfter)
	switch {
	case res.Allowed:
		h.record(repl, decisionAllowed, key, res.Remaining, 0)
	case h.Shadow:
		h.record(repl, decisionShadowDenied, key, res.Remaining, res.RetryAfter)
		h.logShadowDenial(key, res)
	default:
		h.record(repl, decisionDenied, key, res.Remaining, res.RetryAfter)
		w.Header()["Retry-After"] = countValue(ceilSeconds(res.RetryAfter))
		return reject(w, r, h.errDenied)
	}
	return next.ServeHTTP(w, r)
}

// check answers from the deny cache when the bucket is known to be empty,
// else asks Redis within the timeout. Redis failures are logged,
// throttled; an open breaker was logged when it opened.
func (h *Handler) check(clientCtx context.Context, key string) (Result, error) {
	sent := time.Now()
	if until, ok := h.denied.get(key, sent); ok {
		return h.cachedDenial(until.Sub(sent)), nil
	}
	res, err := h.limiter.take(clientCtx, sent, key, h.scriptArgs)
	if h.metrics != nil && err != errBreakerOpen {
		h.metrics.redisDuration.Observe(time.Since(sent).Seconds())
	}
	switch err.(type) {
	case nil:
		if !res.Allowed {
			h.denied.put(key, sent, res.RetryAfter)
		}
	case overloadError:
		if clientCtx.Err() != nil {
			break // the client left; whatever happened is not worth a line
		}
		if ok, suppressed := h.overloaded.allow(); ok {
			h.logger.Warn("overloaded: this instance could not send requests to Redis in time; following on_error",
				zap.String("zone", h.Zone), zap.String("on_error", h.OnError), zap.Error(err), suppressedField(suppressed))
		}
	default:
		if err == errBreakerOpen || clientCtx.Err() != nil {
			break // logged when the breaker opened; a client that left says nothing about Redis
		}
		if ok, suppressed := h.redisWarns.allow(); ok {
			h.logger.Warn("Redis failed; following on_error", zap.String("zone", h.Zone),
				zap.String("on_error", h.OnError), zap.Error(err), suppressedField(suppressed))
		}
	}
	return res, err
}

// cachedDenial is what Redis would answer now for a bucket the deny cache
// holds, retryAfter before it fits the requested tokens: it has refilled
// since, so it holds requested − retryAfter × rate tokens.
func (h *Handler) cachedDenial(retryAfter time.Duration) Result {
	tokens := float64(h.RequestedTokens) - retryAfter.Seconds()*h.ReplenishRate
	return Result{Remaining: max(0, int64(math.Floor(tokens))), RetryAfter: retryAfter}
}

// breakerChanged logs a node's breaker opening or closing, for the
// limiter, which tells every handler that uses it.
func (h *Handler) breakerChanged(node string, open bool, failures int64) {
	if open {
		h.logger.Warn("circuit breaker opened: a Redis node failed repeatedly; requests for its keys skip Redis and follow on_error until it answers",
			zap.String("zone", h.Zone), zap.String("node", node), zap.Int64("consecutive_failures", failures))
	} else {
		h.logger.Info("circuit breaker closed: the Redis node answers again", zap.String("zone", h.Zone), zap.String("node", node))
	}
}

// reject ends a request with a denial. When the server has error routes
// (`handle_errors`) the denial goes to them as an error. Otherwise the
// status is written here, as Caddy's error path would write it, without
// that path's cost (several microseconds, mostly preparing an error log
// entry that is then not written): a flood must be cheap to refuse.
func reject(w http.ResponseWriter, r *http.Request, denial caddyhttp.HandlerError) error {
	if srv, _ := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); srv != nil &&
		(srv.Errors == nil || len(srv.Errors.Routes) == 0) {
		w.WriteHeader(denial.StatusCode)
		return nil
	}
	return caddyhttp.Error(denial.StatusCode, denial)
}

// prebuiltError is a denial made once: caddyhttp.Error fills in only the
// ID, without the stack walk it would do for the trace.
func prebuiltError(status int, err error) caddyhttp.HandlerError {
	return caddyhttp.HandlerError{Err: err, StatusCode: status, Trace: "rate_limit"}
}

// derivedZone names the buckets of a handler without a zone, the same on
// every instance with the same configuration.
func derivedZone(key string, rate float64, burst int64) string {
	sum := sha256.Sum256(fmt.Appendf(nil, "%s\x00%v\x00%d", key, rate, burst))
	return "auto-" + hex.EncodeToString(sum[:6])
}

// The checks below judge one value each (or the limit's three together).
// The Caddyfile parser calls them where the value is written, so the
// message gets the line; Validate calls them for JSON configs.

// Values of on_error.
const (
	onErrorAllow = "allow"
	onErrorDeny  = "deny"
)

const (
	wantStatus = "want an HTTP status from 200 to 599 (a 1xx status cannot end a request)"
	wantRate   = "want a positive number of tokens per second"
)

var zonePattern = regexp.MustCompile(`^[A-Za-z0-9_.:-]+$`)

func checkZone(zone string) error {
	if !zonePattern.MatchString(zone) {
		return fmt.Errorf("zone '%s': use only letters, digits, '-', '_', '.' and ':'", zone)
	}
	return nil
}

func checkStatus(subdirective string, code int) error {
	if code < 200 || code > 599 {
		return fmt.Errorf("%s '%d': %s", subdirective, code, wantStatus)
	}
	return nil
}

func checkOnError(v string) error {
	if v != onErrorAllow && v != onErrorDeny {
		return fmt.Errorf("on_error '%s': want 'allow' or 'deny'", v)
	}
	return nil
}

func checkHeaders(v string) error {
	switch v {
	case headersSpring, headersIETF, headersBoth, headersNone:
		return nil
	}
	return fmt.Errorf("headers '%s': want spring, ietf, both or none", v)
}

// checkLimit judges rate, burst and requested tokens together. An absent
// burst or requested count stands for its default.
func checkLimit(rate float64, burst *int64, requested int64) error {
	switch {
	case burst != nil && *burst < 0:
		return fmt.Errorf("burst_capacity '%d' must not be negative", *burst)
	case burst != nil && *burst == 0:
		return nil // blocks everything; rate and cost do not matter
	case rate == 0:
		return errors.New("replenish_rate is required (or burst_capacity 0 to block every request)")
	case !(rate > 0) || math.IsInf(rate, 0):
		return fmt.Errorf("replenish_rate '%v': %s", rate, wantRate)
	}
	b := int64(math.Ceil(rate))
	if burst != nil {
		b = *burst
	}
	if float64(b) < rate {
		return fmt.Errorf("burst_capacity '%d' is smaller than replenish_rate '%v': the bucket could never hold one second's refill, "+
			"so clients would be held below the configured rate; raise burst_capacity to at least %v",
			b, rate, math.Ceil(rate))
	}
	if b > maxExactTokens {
		return fmt.Errorf("burst_capacity '%d' is above 2^53, where the script's numbers stop being exact; lower it", b)
	}
	if fill := float64(b) / rate; fill > maxFillSeconds {
		return fmt.Errorf("replenish_rate '%v' is so small that an empty bucket of %d tokens would take %.3g days to fill "+
			"(more than a year, past what Retry-After can say); raise it to at least %v", rate, b, fill/86400, float64(b)/maxFillSeconds)
	}
	if requested == 0 {
		requested = 1
	}
	if requested < 1 {
		return fmt.Errorf("requested_tokens '%d' must be at least 1", requested)
	}
	if requested > b {
		return fmt.Errorf("requested_tokens '%d' is more than burst_capacity '%d': no request could ever be admitted", requested, b)
	}
	return nil
}

// Bounds of a limit: token counts stay exact in the script's doubles,
// and an empty bucket fills within a year.
const (
	maxExactTokens = 1 << 53
	maxFillSeconds = 365 * 86400
)

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
