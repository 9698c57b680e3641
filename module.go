// package ratelimit is a Caddy HTTP handler that limits requests with a
// token bucket kept in Redis, shared by every Caddy instance that uses
// the same Redis.
package ratelimit

import (
	"fmt"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler limits requests with token buckets kept in Redis, with the
// semantics of Spring Cloud Gateway's RedisRateLimiter. A bucket holds at
// most `burst_capacity` tokens and refills continuously at
// `replenish_rate` tokens per second; each request takes
// `requested_tokens` or is denied with `status_code` (429). Every Caddy
// instance that uses the same Redis and `zone` shares the budget. One
// atomic Lua script checks and takes, using the Redis server's clock.
//
// Each client has its own bucket, chosen by `key` (default: the client
// IP). With `limits`, a request must fit in several buckets at once (10
// a second and 1,000 an hour, per client and per tenant): it is admitted
// only if every one holds its tokens, and then all are taken. Rates,
// bursts and costs may come from placeholders per request (plans, costly
// endpoints). With `concurrent`, at most a number of requests of a key
// are in flight at once, across instances: a request holds a slot until
// its response has ended. Denied requests get a `Retry-After` header, and every
// response whose buckets were consulted carries the headers that
// `headers` selects:
//
// Header | Meaning
// -------|--------
// `X-RateLimit-Remaining` | whole tokens left after this request; `-1` when Redis failed
// `X-RateLimit-Replenish-Rate` | tokens added per second
// `X-RateLimit-Burst-Capacity` | most tokens the bucket holds
// `X-RateLimit-Requested-Tokens` | tokens each request takes
// `RateLimit-Policy` | IETF draft-10: `"<zone>";q=<burst>;w=<seconds to fill>`, an item per limit (`"<zone>.<name>"`); a concurrent limit's is `"<zone>.<name>";q=<slots>;qu="concurrent-requests"`
// `RateLimit` | IETF draft-10: `"<zone>";r=<remaining>;t=<seconds until a request fits>`, an item per limit
//
// With several limits, the `X-RateLimit-*` set describes the limit that
// refused, or, when admitted, the one with the fewest requests left.
//
// On a site with `handle_errors` routes, denials are returned as errors
// that those routes can shape; elsewhere the status is written directly,
// which is cheaper. After the limiter ran, these placeholders are set:
//
// Placeholder | Description
// ------------|-------------
// `{http.rate_limit.zone}` | the zone
// `{http.rate_limit.result}` | `allowed`, `waited`, `denied`, `exempt`, `invalid`, `empty_key`, `error_allowed`, `error_denied`, `error_local_allowed`, `error_local_denied`, `overflow`, `shadow_denied` or `left_waiting`; once the response settles, `charge_missing` when its cost could not be read
// `{http.rate_limit.limit_name}` | the limit that refused (with `limits`); empty when admitted
// `{http.rate_limit.remaining}` | whole tokens left; `-1` when Redis failed
// `{http.rate_limit.waited}` | with `max_wait`: the milliseconds the request waited for its tokens
// `{http.rate_limit.limit}` | the burst capacity
// `{http.rate_limit.retry_after}` | on denial, seconds until a retry can succeed, as in `Retry-After`
// `{http.rate_limit.key}` | the client key as stored (escaped, or hashed when long), only with `log_key` (else empty)
// `{http.rate_limit.charged}` | with `charge` or `charge_status`, once the response settles (at the latest when it ends): the tokens it was charged (of the first limit that charges)
// `{http.rate_limit.charged.<limit>}` | the same, for each named limit that charges
// `{http.rate_limit.request.<path>}` | with `request_body`, before the keys are resolved: the value at that path of the request's JSON body
// `{http.rate_limit.request_size}` | with `request_body`, before the keys are resolved: the request body's size in bytes, its `Content-Length` or, without one, what `request_body` read to its end (a JSON body of at most `max_size`); `0` without a body; empty when neither says it
//
// It counts its decisions in the `caddy_rate_limit_requests_total`
// metric (labels `zone`, `result` and `limit`), times Redis in
// `caddy_rate_limit_redis_duration_seconds` and reports its circuit
// breaker in `caddy_rate_limit_breaker_open`. Limits that charge by the
// response count tokens in `caddy_rate_limit_charged_total` and
// `caddy_rate_limit_forgiven_total`, and settlements lost to Redis
// failures in `caddy_rate_limit_settle_failures_total`. Concurrent
// limits report the slots this instance holds in
// `caddy_rate_limit_in_flight`.
type Handler struct {
	// Zone names the space of buckets: letters, digits, `-`, `_`, `.` and
	// `:`. Handlers with the same zone and key template share buckets,
	// also across Caddy instances. Default: a name derived from the key
	// template(s), the rate(s) and the burst(s), so handlers that should
	// count separately but share those need zones of their own.
	Zone string `json:"zone,omitempty"`

	// Key is the template whose value picks the client's bucket, with any
	// placeholders, e.g. `{http.request.header.X-API-Key}` or
	// `{http.vars.client_ip}:{http.request.header.X-Tenant}`. When any
	// placeholder in it is empty, the key is empty (see `deny_empty_key`).
	// Addresses in it are cut to `ipv4_prefix` and `ipv6_prefix`.
	// Default: `{http.vars.client_ip}`, which honours the server's
	// `trusted_proxies`.
	Key string `json:"key,omitempty"`

	// ReplenishRate is how many tokens a bucket gains per second,
	// continuously: a number (fractions work: `0.5` is one token every two
	// seconds) or, in a string, a count per duration (`100/1m`), or
	// placeholders resolved per request (`{plan_rate}`) to either of those
	// or to `unlimited`, which exempts the request. Required unless
	// `burst_capacity` is 0.
	ReplenishRate Param `json:"replenish_rate,omitempty"`

	// BurstCapacity is the most tokens a bucket holds, and so the largest
	// burst an idle client may send: a whole number, or placeholders
	// resolved per request. 0 denies every request. It may not be below
	// `replenish_rate`. Default: `replenish_rate` rounded up, a smooth rate
	// with no burst.
	BurstCapacity Param `json:"burst_capacity,omitempty"`

	// RequestedTokens is how many tokens each request takes: a whole
	// number, or placeholders resolved per request (a cost from a header),
	// or a weighted sum of terms separated by spaces, each a product of
	// factors joined by `*` (each a number, 0 or more, fractions allowed,
	// or placeholders), summed in exact decimals and rounded up to whole
	// tokens, at least 1:
	// `{http.rate_limit.request.max_tokens:4096}*{http.rate_limit.request.n:1}*{out_price} 100`.
	// A factor from the client (a term's first, or one naming a
	// `{http.rate_limit.request.<path>}` value) out of range refuses the
	// request with 400; any other factor with placeholders (a weight)
	// out of range (negative, not a number, infinite) with 500. A
	// malformed term (an empty factor, a brace without its pair) is
	// refused at load. Default: 1.
	RequestedTokens Param `json:"requested_tokens,omitempty"`

	// MaxWait lets a request that its token buckets cannot admit now,
	// but could within this long, wait for its tokens instead of being
	// refused: they are taken at once for the moment they will be there
	// (the bucket goes below zero, never deeper than the wait allows),
	// and the request goes on then, holding nothing but a timer. The
	// bound stays exact: counted at the moments requests go on, a bucket
	// admits at most `burst_capacity + replenish_rate × T` over any T.
	// One that would have to wait longer is refused at once and takes
	// nothing; its `Retry-After` says when it would fit. A duration with
	// its unit (`500ms`, `30s`), at most 1h, or placeholders resolved per
	// request (a plan's wait from `map`: a paying plan waits, a free one
	// is refused first). A quota never waits. Default: 0, no wait.
	MaxWait Param `json:"max_wait,omitempty"`

	// MaxWaiting is the most requests this handler holds waiting at once
	// on this instance (`max_wait`); beyond it a request that would wait
	// is refused at once. Default: 1,000.
	MaxWaiting int `json:"max_waiting,omitempty"`

	// IPv4Prefix and IPv6Prefix cut every client address in a key
	// template (`{client_ip}`, `{http.vars.client_ip}`, `{remote_host}`,
	// `{http.request.remote.host}`) to its network, so that a client
	// cannot leave its limit by cycling addresses in it. IPv4-mapped IPv6
	// addresses count as IPv4. Defaults: 32 (one address) and 64 (the
	// customary size of one site's network).
	IPv4Prefix *int `json:"ipv4_prefix,omitempty"`
	IPv6Prefix *int `json:"ipv6_prefix,omitempty"`

	// Limits makes the handler a policy of several limits, decided
	// together: a request is admitted only if every limit holds the tokens
	// it asks, and then all are taken; if one refuses, none is taken. Each
	// limit has a name and may have its own key, rate, burst, cost and
	// prefixes; what it leaves out is the handler's. Without limits, the
	// handler is one limit of the fields above.
	Limits []Limit `json:"limits,omitempty"`

	// Quotas are fixed-period quotas decided with the limits, all or
	// nothing: at most a count of tokens per minute, hour, day, week,
	// month or year in a time zone, or per duration, renewed at the
	// boundary (see Quota). A handler with quotas and no `limits` has a
	// limit of its own only when it sets `replenish_rate` or
	// `burst_capacity`.
	Quotas []Quota `json:"quotas,omitempty"`

	// ResetJitter spreads the wait a quota's refusal tells (`Retry-After`,
	// `RateLimit`'s `t` and `{http.rate_limit.retry_after}` alike) over
	// this long past the quota's boundary, a share for each client (by its
	// key), so that the clients of a quota do not all come back in the
	// second it renews. Off (0) by default; only with quotas.
	ResetJitter caddy.Duration `json:"reset_jitter,omitempty"`

	// Concurrent are concurrency limits: at most a number of requests of
	// a key in flight at once, across instances, taken together with the
	// other limits (see Concurrent). A handler with concurrent limits and
	// neither `limits` nor a rate or burst of its own has only those.
	Concurrent []Concurrent `json:"concurrent,omitempty"`

	// Charge says where the real cost of a response comes from, for every
	// limit (a limit may have its own): a response header, numbers in a
	// JSON body or an event stream, or a placeholder (see Charge).
	// `requested_tokens` is then a reservation, taken before the request
	// as the check; once the real cost is known, and before the end of
	// the answer reaches the client (the end of a JSON body, an event
	// stream's `data: [DONE]` or last event; with a header, a placeholder
	// or JSON lines, when the response ends), the difference is settled:
	// a smaller cost gives tokens back (capped at the burst), a larger
	// one takes the rest, even below zero, down to `max_debt`.
	// Default: none; the cost is `requested_tokens`.
	Charge *Charge `json:"charge,omitempty"`

	// ChargeStatus lists the response statuses that are charged: codes
	// (`401`) or classes (`2` for 2xx, as Caddy's response matchers write
	// them). A response that answered any other status gets its whole
	// reservation back; one that the client left before its answer (Caddy
	// records 499) answered none, and keeps it. An upgrade (101) counts as
	// a 2xx. Without `charge`, a matching response is charged its
	// reservation. Default: every status is charged.
	ChargeStatus []int `json:"charge_status,omitempty"`

	// MaxDebt is how far below zero, in tokens, a response that costs
	// more than its reservation may take a bucket: the cost beyond it is
	// forgiven (and counted). While a bucket is in debt, or holds less
	// than a request's reservation, requests are refused until it
	// refills. Only with `charge` or `charge_status`. Default:
	// `burst_capacity`.
	MaxDebt *int64 `json:"max_debt,omitempty"`

	// MaxBody is the most bytes of a response body that `charge json`
	// reads (a JSON body, an event stream or JSON lines alike): a bound on
	// the CPU one response spends on the scan, which holds no body. Past
	// it, the scan stops and the cost is what the body reported before (a
	// warning says so), or the reservation when that is nothing; LLM APIs
	// report usage at the end, so set it above the largest answer.
	// Default: no bound, every body is read to its end.
	MaxBody int64 `json:"max_body,omitempty"`

	// RequestBody names values of the request's JSON body (an LLM
	// request's `model`, its `max_tokens`) that become placeholders
	// before keys and values are resolved (see RequestBody). Default:
	// none; the body is not read.
	RequestBody *RequestBody `json:"request_body,omitempty"`

	// DenyEmptyKey denies requests whose key resolves to the empty string
	// with `empty_key_status`; when false they pass that limit unlimited.
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
	// reply, no answer within the timeout, or its circuit breaker open):
	// `allow` lets the request through, `deny` answers 503, `local`
	// decides it with a bucket in this Caddy process, with the same
	// parameters (across N instances at most N times the rate), until
	// Redis answers again. With `store memory`, it says what happens to a
	// new client while the store is full (`allow` or `deny`).
	// Default: `allow`.
	OnError string `json:"on_error,omitempty"`

	// Store says where the buckets live: `redis` (shared by every Caddy
	// instance that uses the same Redis), or `memory`, in this Caddy
	// process only, with nothing else to run. Default: `redis`.
	Store string `json:"store,omitempty"`

	// Lease lets this instance admit most requests without waiting on
	// Redis, from tokens it takes ahead: see Lease. Off by default.
	Lease *Lease `json:"lease,omitempty"`

	// MaxKeys caps the buckets `store memory` holds at once (a bucket is
	// forgotten once it would be full again). At the cap, a new client's
	// request follows `on_error`; no live bucket is dropped to make room.
	// Default: 1,000,000.
	MaxKeys int64 `json:"max_keys,omitempty"`

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

	logger        *zap.Logger
	waits         bool           // some limit may make requests wait (max_wait, wait.go)
	waiting       *atomic.Int64  // requests that wait now or may, against max_waiting (with waits)
	waitingNow    *atomic.Int64  // requests that wait now, for caddy_rate_limit_waiting (with waits)
	stack                        // the store and layers that decide requests (compose.go)
	charging      *charging      // when a limit charges by the response (charge.go)
	request       *bodyValueStep // with request_body (requestbody.go)
	before        []preStep      // what runs before a request's buckets are resolved (steps.go)
	beforeBody    *beforeBody    // refusals known before request_body reads a body (beforebody.go)
	steps         []step         // what an admitted request registers for after its response (steps.go)
	chargeWeights bool           // some charge json weight has placeholders (charge.go)
	limits        []*limit.Limit
	denyEmpty     bool
	failOpen      bool
	headers       rateLimitHeaders
	errDenied     caddyhttp.HandlerError
	errEmptyKey   caddyhttp.HandlerError
	errBlocked    caddyhttp.HandlerError
	errRedis      caddyhttp.HandlerError // Redis failed, on_error deny: the cause goes to the log, not to clients
	redisWarns    *logs.Throttle         // Redis failures: a line per 10 s
	overloaded    *logs.Throttle         // calls this instance could not send in time: the same
	fullWarns     *logs.Throttle         // the in-memory store full: the same
	paramWarns    *logs.Throttle         // values out of range in requests: the same
	shadowKeys    *logs.KeyThrottle      // shadow denials: a line per key per 5 s ...
	shadowLines   *logs.Throttle         // ... and at most ten a second
	metrics       *zoneMetrics
	zoneValue     any // the zone as a placeholder value, boxed once (BenchmarkServeHTTPDenied 6 -> 5 allocs)
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision sets up the handler: defaults, the limits with their
// compiled key templates, and the shared Redis client.
func (h *Handler) Provision(ctx caddy.Context) (err error) {
	defer func() {
		if err == nil {
			h.setUpBeforeBody()
			registerZone(h) // for the admin API
		}
	}()
	h.logger = ctx.Logger()
	h.before, h.steps = nil, nil
	h.applyDefaults()
	h.denyEmpty = h.DenyEmptyKey == nil || *h.DenyEmptyKey
	h.failOpen = h.OnError == onErrorAllow

	if err := h.checkLimits(); err != nil { // Validate's check, first: its messages name the limit
		return err
	}
	if err := h.checkCharging(); err != nil {
		return err
	}
	redisConfig := h.Redis.withPlaceholders()
	if err := redisConfig.validate(); err != nil {
		return err
	}
	if h.limits, err = h.buildLimits(redisConfig.KeyPrefix); err != nil {
		return err
	}
	if err := h.setUpCharging(); err != nil {
		return err
	}
	h.assignWeightPlaces() // charge.go
	if err := h.setUpRequestBody(); err != nil {
		return err
	}
	if slices.ContainsFunc(h.limits, func(l *limit.Limit) bool { return l.Held != nil }) { // after the charge's step: a charge is settled before slots are given back
		h.addStep(holdStep{h})
	}
	style := h.Headers
	if h.IncludeHeaders != nil && !*h.IncludeHeaders || h.Shadow {
		style = headersNone
	}
	h.headers = newRateLimitHeaders(style, h.limits)
	h.zoneValue = h.Zone
	h.redisWarns = &logs.Throttle{Every: 10 * time.Second}
	h.fullWarns = &logs.Throttle{Every: 10 * time.Second}
	h.overloaded = &logs.Throttle{Every: 10 * time.Second}
	h.paramWarns = &logs.Throttle{Every: 10 * time.Second}
	h.shadowKeys = logs.NewKeyThrottle(shadowLogEvery)
	h.shadowLines = &logs.Throttle{Every: time.Second, Lines: 10}

	h.errDenied = prebuiltError(h.StatusCode, fmt.Errorf("zone %s: rate limit exceeded", h.Zone))
	h.errBlocked = prebuiltError(h.StatusCode, fmt.Errorf("zone %s: requests blocked (burst_capacity 0)", h.Zone))
	h.errEmptyKey = prebuiltError(h.EmptyKeyStatus, fmt.Errorf("zone %s: the rate limit key is empty", h.Zone))
	h.errRedis = prebuiltError(http.StatusServiceUnavailable, fmt.Errorf("zone %s: Redis failed (on_error deny); see the log", h.Zone))
	if !h.DisableMetrics {
		if h.metrics, err = newZoneMetrics(ctx.GetMetricsRegistry(), h.Zone, h.limits); err != nil {
			return fmt.Errorf("registering metrics: %w", err)
		}
		if h.request != nil {
			h.request.unread = unreadCounters(h.Zone)
		}
	}
	h.setUpWaiting() // wait.go: after the metrics

	return h.buildStack(redisConfig)
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
		checkStore(h.Store, h.Redis != nil, h.OnError),
		checkMaxKeys(h.MaxKeys),
		checkMaxWaiting(h.MaxWaiting),
		checkLease(h.Lease, h.Store),
		h.checkLimits(),
		h.checkCharging(),
		checkRequestBody(h.RequestBody),
	} {
		if err != nil {
			return err
		}
	}
	return nil
}

// Cleanup releases the shared Redis client or in-memory store.
func (h *Handler) Cleanup() error {
	unregisterZone(h)
	h.cleanUpWaiting()
	return h.releaseStack()
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
