package ratelimit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// Limit is one token bucket of a policy. A request is admitted only if
// every limit of its handler holds the tokens the request asks of it;
// then all are taken, else none. What a limit leaves out is the
// handler's.
type Limit struct {
	// Name names the limit in headers (`"<zone>.<name>"`), the
	// `{http.rate_limit.limit_name}` placeholder, the `limit` label of
	// the metrics and its Redis keys: letters, digits, `-` and `_`,
	// unique in the handler. Required.
	Name string `json:"name,omitempty"`

	// Key is the template that picks this limit's bucket, as the
	// handler's `key`. Default: the handler's.
	Key string `json:"key,omitempty"`

	// ReplenishRate, BurstCapacity and RequestedTokens are as the
	// handler's, and default to the handler's values.
	ReplenishRate   Param `json:"replenish_rate,omitempty"`
	BurstCapacity   Param `json:"burst_capacity,omitempty"`
	RequestedTokens Param `json:"requested_tokens,omitempty"`

	// IPv4Prefix and IPv6Prefix are as the handler's, and default to the
	// handler's values.
	IPv4Prefix *int `json:"ipv4_prefix,omitempty"`
	IPv6Prefix *int `json:"ipv6_prefix,omitempty"`

	// Charge, ChargeStatus and MaxDebt are as the handler's, and default
	// to the handler's values: a limit charges by the response when it or
	// its handler has `charge` or `charge_status`.
	Charge       *Charge `json:"charge,omitempty"`
	ChargeStatus []int   `json:"charge_status,omitempty"`
	MaxDebt      *int64  `json:"max_debt,omitempty"`
}

// Param is a limit's rate, burst or cost: a number fixed in the config,
// or text with placeholders that each request resolves (`{plan_rate}`),
// parsed then exactly as a fixed value. In JSON a number, or a string.
type Param string

// UnmarshalJSON takes a number as its text, or a string.
func (p *Param) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*p = Param(s)
		return nil
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("want a number or a string, got %s", b)
	}
	*p = Param(n)
	return nil
}

// MarshalJSON writes a plain number as a number, anything else as a
// string.
func (p Param) MarshalJSON() ([]byte, error) {
	if _, err := strconv.ParseFloat(string(p), 64); err == nil && json.Valid([]byte(p)) {
		return []byte(p), nil
	}
	return json.Marshal(string(p))
}

// perRequest says whether the value has placeholders to resolve per
// request.
func (p Param) perRequest() bool { return strings.Contains(string(p), "{") }

// unlimited is the rate (and burst) that exempts a request from a limit.
const unlimited = "unlimited"

var limitNamePattern = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

func checkLimitName(name string) error {
	if !limitNamePattern.MatchString(name) {
		return fmt.Errorf("limit name '%s': use only letters, digits, '-' and '_'", name)
	}
	return nil
}

// limitValues are one limit's rate, burst and cost, resolved.
type limitValues struct {
	rate      float64
	burst     int64
	requested int64
}

// paramError says which value of a limit was wrong: a request's
// requested_tokens usually comes from the client (400), the others from
// the config (500).
type paramError struct {
	param string
	msg   string
}

func (e *paramError) Error() string { return e.msg }

// badValue reports a value: "<param> '<value>' <reason>", where reason
// starts with a verb, or with ": " before a noun phrase. The value may
// come from a request: it is quoted cut short (logs.Cut).
func badValue(param, value, reason string) *paramError {
	sep := " "
	if strings.HasPrefix(reason, ":") {
		sep = ""
	}
	return &paramError{param, fmt.Sprintf("%s '%s'%s%s", param, logs.Cut(value), sep, reason)}
}

// limit is one limit of a handler, ready for requests.
type limit struct {
	index     int    // in the handler's limits
	name      string // "" for a handler without `limits`
	nameValue any    // the name as a placeholder value, boxed once
	ietfName  string // "<zone>", or "<zone>.<name>"
	keyText   string // the key template as configured
	template  keys.Template
	// A bucket's Redis key is keyPrefix + client key + keySuffix.
	keyPrefix, keySuffix string
	group                int // limits with one key template share a Cluster hash slot
	rate, burst, cost    Param
	// costTerms: requested_tokens as a weighted sum with placeholders
	// (internal/cost); nil for one value.
	costTerms []cost.Term
	// costOnly: a token bucket whose rate and burst are fixed and whose
	// requested_tokens is a weighted sum with placeholders: its values
	// and arguments are base's but for the cost, not parsed and
	// formatted again per request (5 allocs less per request of make
	// bench's llm@64: BenchmarkServeHTTPLLM/llm 23 -> 18).
	costOnly bool
	base     limitValues
	baseArgs [3]any
	// fixed: no placeholders, so the values (and arguments) are known.
	fixed      bool
	values     limitValues
	exempt     bool   // a fixed rate of `unlimited`
	args       [3]any // the values as script arguments, boxed once (BenchmarkServeHTTPAllowed 21 -> 16 allocs)
	burstValue any    // the burst as a placeholder value, boxed once

	// charge is how the response charges it (charge.go); nil when
	// requested_tokens is its cost. chargedKey is its own placeholder,
	// http.rate_limit.charged.<name>; empty for a handler without limits.
	charge     *cost.Rule
	chargedKey string

	// kind is its kind of limit (kind.go), whose values its values are
	// (what stands for the burst, say, is the kind's: burstName);
	// arithmetic, charged and remembered what it does of the optional
	// interfaces, nil for what it does not (setKind). held says a request
	// holds its bucket while served (heldKind); inFlight is then its
	// zone's series of the in_flight gauge, the requests of this instance
	// that hold it (nil without metrics).
	kind       kind
	arithmetic bucketArithmetic
	charged    chargedKind
	remembered rememberedKind
	held       heldKind
	inFlight   prometheus.Gauge
}

// bucket is one limit's bucket for one request, and Redis's answer.
type bucket struct {
	limit  *limit
	key    string
	values limitValues
	args   [3]any
	// remaining is the whole tokens left after the request; -1 when Redis
	// failed.
	remaining int64
	// retryAfter is how long until the bucket holds the requested tokens;
	// negative when never (burst 0).
	retryAfter time.Duration
	// unknown: a refusal a layer remembered (refusals) says nothing of
	// this bucket.
	unknown bool
	// kindRef and kindN are what the request knows of its bucket that is
	// its kind's own, set and read by the kind alone (begin, readReply,
	// its arithmetic in the process), such as a period and the period its
	// take counted in, or the generation of a count in the process. A
	// new kind keeps its own there too.
	kindRef any
	kindN   int64
}

// unset is a rate or cost as JSON means it: 0 stands for unset.
func unset(p Param) Param {
	if p == "0" {
		return ""
	}
	return p
}

func checkPrefixes(v4, v6 *int) error {
	if v4 != nil && (*v4 < 0 || *v4 > 32) {
		return fmt.Errorf("ipv4_prefix '%d': want a prefix length from 0 to 32", *v4)
	}
	if v6 != nil && (*v6 < 0 || *v6 > 128) {
		return fmt.Errorf("ipv6_prefix '%d': want a prefix length from 0 to 128", *v6)
	}
	return nil
}

// asksRedis says whether any limit may ever call Redis: not when every
// one is a fixed hard block (burst 0) or exemption.
func (h *Handler) asksRedis() bool {
	for _, l := range h.limits {
		if !l.fixed || !l.exempt && l.values.burst > 0 {
			return true
		}
	}
	return false
}

// resolveBuckets finds a request's bucket for each limit that applies to
// it: the Redis key from the key template, and the values, resolved from
// placeholders where the config has them. skipped is the decision when no
// limit applies: `exempt`, or `empty_key` (with deny_empty_key false).
func (h *Handler) resolveBuckets(r *http.Request, repl *caddy.Replacer, buckets []bucket) (_ []bucket, skipped decision, err error) {
	return h.resolveBucketsWith(r, repl, buckets, nil)
}

// resolveBucketsWith is resolveBuckets remembering the weights it
// resolves in memo (nil: none), for the rest of the request.
func (h *Handler) resolveBucketsWith(r *http.Request, repl *caddy.Replacer, buckets []bucket, memo *cost.Memo) (_ []bucket, skipped decision, err error) {
	return h.resolveLimits(h.limits, r, repl, buckets, memo)
}

// resolveLimits is resolveBucketsWith for some of the handler's limits,
// in its order.
func (h *Handler) resolveLimits(limits []*limit, r *http.Request, repl *caddy.Replacer, buckets []bucket, memo *cost.Memo) (_ []bucket, skipped decision, err error) {
	skipped = decisionEmptyKey
	rv := keys.RequestValues(r, repl) // one pass over the request's placeholders, for every limit
	var shared requestShared
	for _, l := range limits {
		values, args, exempt := l.values, l.args, l.exempt
		if !l.fixed {
			if values, exempt, err = l.resolve(repl, memo); err != nil {
				if l.name != "" {
					err = fmt.Errorf("limit %s: %w", l.name, err)
				}
				return nil, skipped, err
			}
			switch {
			case l.costOnly:
				args = l.baseArgs
				args[2] = strconv.FormatInt(values.requested, 10)
			case !exempt:
				args = l.kind.scriptArgs(values)
			}
		}
		if exempt {
			skipped = decisionExempt
			continue
		}
		key := l.template.Key(&rv, l.keyPrefix, l.keySuffix)
		if key == "" {
			if h.denyEmpty {
				return nil, skipped, errEmptyKey
			}
			continue
		}
		var b bucket
		b, shared = l.kind.begin(bucket{limit: l, key: key, values: values, args: args}, shared)
		buckets = append(buckets, b)
	}
	return buckets, skipped, nil
}

// requestShared is what a request's buckets share, whatever their kind,
// made by the first that needs it (kind.begin).
type requestShared struct {
	now time.Time // the clock when the request's periods were named (kind.begin)
	id  any       // the request's id, one for its buckets (kind.begin)
}

// clock is the request's time: read once, when a bucket first asks.
func (s *requestShared) clock() time.Time {
	if s.now.IsZero() {
		s.now = time.Now()
	}
	return s.now
}

// resolve resolves the limit's values from a request's placeholders. A
// value the config sets that resolves to nothing is an error, not the
// default: a fallback belongs in the config (`map`'s `default`).
func (l *limit) resolve(repl *caddy.Replacer, memo *cost.Memo) (limitValues, bool, error) {
	if l.costOnly {
		n, err := cost.Sum(l.costTerms, repl, memo)
		if err != nil {
			return limitValues{}, false, err
		}
		v := l.base
		v.requested = n
		return v, false, v.check()
	}
	var text [3]string
	for i, p := range [3]struct {
		name  string
		value Param
	}{{"replenish_rate", l.rate}, {l.kind.burstName(), l.burst}, {"requested_tokens", l.cost}} {
		if i == 2 && l.costTerms != nil {
			n, err := cost.Sum(l.costTerms, repl, memo)
			if err != nil {
				return limitValues{}, false, err
			}
			text[i] = strconv.FormatInt(n, 10)
			continue
		}
		text[i] = repl.ReplaceAll(string(p.value), "")
		if text[i] == "" && p.value != "" {
			return limitValues{}, false, badValue(p.name, string(p.value), "resolved to nothing for this request")
		}
	}
	return l.kind.resolveValues(text[0], text[1], text[2])
}

// blockedBucket is the index of a bucket that holds nothing (burst 0,
// which denies without asking Redis), or -1.
func blockedBucket(buckets []bucket) int {
	for i := range buckets {
		if buckets[i].values.burst == 0 {
			return i
		}
	}
	return -1
}

// describe picks the bucket that the `X-RateLimit-*` headers and the
// placeholders describe: on a denial the one that refused with the
// longest wait, else the one with the fewest requests left; the first
// such on ties.
func describe(buckets []bucket, allowed bool) int {
	if allowed {
		if k := firstHeld(buckets); k > 0 {
			buckets = buckets[:k] // admitted: the buckets taken, not those held while served
		}
	}
	pick := -1
	for i := range buckets {
		b := &buckets[i]
		switch {
		case b.unknown:
		case pick < 0:
			pick = i
		case !allowed && b.retryAfter > buckets[pick].retryAfter:
			pick = i
		case allowed && b.remaining/b.values.requested < buckets[pick].remaining/buckets[pick].values.requested:
			pick = i
		}
	}
	return max(pick, 0)
}

// retryAfter is how long until every bucket holds its requested tokens.
func retryAfter(buckets []bucket) time.Duration {
	var wait time.Duration
	for i := range buckets {
		if !buckets[i].unknown {
			wait = max(wait, buckets[i].retryAfter)
		}
	}
	return wait
}
