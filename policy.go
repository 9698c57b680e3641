package ratelimit

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
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
// come from a request: it is quoted cut short (cutValue).
func badValue(param, value, reason string) *paramError {
	sep := " "
	if strings.HasPrefix(reason, ":") {
		sep = ""
	}
	return &paramError{param, fmt.Sprintf("%s '%s'%s%s", param, cutValue(value), sep, reason)}
}

// limit is one limit of a handler, ready for requests.
type limit struct {
	index     int    // in the handler's limits
	name      string // "" for a handler without `limits`
	nameValue any    // the name as a placeholder value, boxed once
	ietfName  string // "<zone>", or "<zone>.<name>"
	keyText   string // the key template as configured
	template  keyTemplate
	// A bucket's Redis key is keyPrefix + client key + keySuffix.
	keyPrefix, keySuffix string
	group                int // limits with one key template share a Cluster hash slot
	rate, burst, cost    Param
	// costTerms: requested_tokens as a weighted sum with placeholders
	// (weights.go); nil for one value.
	costTerms []costTerm
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
	// requested_tokens is its cost.
	charge *chargeRule

	// kind is its kind of limit (kind.go), whose values its values are
	// (what stands for the burst, say, is the kind's: burstName).
	kind kind
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
	// unknown: a denial from the deny cache says nothing of this bucket.
	unknown bool
	// fromLease is, when the request's tokens came from this instance's
	// lease, the lease's reports at that time (see lease.reports); 0
	// otherwise. A charged response settles there first (charge.go).
	fromLease int64
	// With lease (leasecall.go): the bucket's lease, what it held unused
	// and the most it should hold when its call left, and what Redis
	// counts as lent to it after the call.
	lease              *lease
	held, want, leased int64
	// kindRef and kindN are what the request knows of its bucket that is
	// its kind's own, set and read by the kind alone (begin, readReply,
	// its arithmetic in the process), such as a period and the period its
	// take counted in, or the generation of a count in the process. A
	// new kind keeps its own there too.
	kindRef any
	kindN   int64
}

// limitConfig is one limit of a handler as its kind reads it from the
// config (kindConfigs): its fields, with the handler's filled in where
// the kind takes them.
type limitConfig struct {
	Limit
	// what names the limit in messages (its subdirective, "limit", with
	// its name); "" for the handler's own limit.
	what string
	// own says it is the handler's own limit, of no `limits`: its key
	// has no hash tag and no name, and its RateLimit items only the zone.
	own bool
	// keySuffix follows the name in its keys, to set them apart from
	// another kind's of the same name.
	keySuffix string
	// charges says the response may charge it (Charge, ChargeStatus,
	// MaxDebt); checkDebt judges a max_debt against its values.
	charges   bool
	checkDebt func(maxDebt int64) error
	// newKind makes its kind when the handler is provisioned; an error
	// names the limit.
	newKind func() (kind, error)
}

// A kindConfig is how a kind of limit reads its limits from a handler's
// config, and judges them: each kind registers its own (registerKind).
type kindConfig struct {
	// order is where its limits come among a handler's, and so among a
	// request's buckets.
	order int
	// configs reads the handler's limits of the kind.
	configs func(h *Handler) []limitConfig
	// check judges them as configured, before provisioning: the parser
	// calls it at the end of the directive, Validate for JSON. names
	// holds the names of the limits judged before, which the kinds share.
	check func(h *Handler, names map[string]bool) error
}

// kindConfigs are the kinds of limit, in the order their limits come.
var kindConfigs []kindConfig

// registerKind adds a kind of limit's config (from its file's init).
func registerKind(k kindConfig) {
	kindConfigs = append(kindConfigs, k)
	slices.SortStableFunc(kindConfigs, func(a, b kindConfig) int { return cmp.Compare(a.order, b.order) })
}

// limitConfigs are the handler's limits as configured, of every kind, in
// the order of its limits.
func (h *Handler) limitConfigs() []limitConfig {
	var configs []limitConfig
	for _, k := range kindConfigs {
		configs = append(configs, k.configs(h)...)
	}
	return configs
}

// hasOwnLimit says whether the handler's own fields make a limit: when
// it has no `limits`, and, with limits of other kinds, a rate or burst
// of its own.
func (h *Handler) hasOwnLimit() bool {
	switch {
	case len(h.Limits) > 0:
		return false
	case unset(h.ReplenishRate) != "" || h.BurstCapacity != "":
		return true
	}
	for _, k := range kindConfigs {
		if k.order > 0 && len(k.configs(h)) > 0 {
			return false
		}
	}
	return true
}

// buildLimits makes the handler's limits from its config.
func (h *Handler) buildLimits(keyPrefix string) ([]*limit, error) {
	configs := h.limitConfigs()
	groups := map[string]int{}
	limits := make([]*limit, len(configs))
	for i, c := range configs {
		k, err := c.newKind()
		if err != nil {
			return nil, err
		}
		l := &limit{
			index: i, name: c.Name, nameValue: c.Name, ietfName: h.Zone,
			rate: c.ReplenishRate, burst: c.BurstCapacity, cost: c.RequestedTokens, kind: k,
		}
		key := or(c.Key, h.Key)
		l.keyText = key
		if l.template, err = parseKeyTemplate(key); err != nil {
			return nil, err
		}
		l.template.ipv4Bits = *cmp.Or(c.IPv4Prefix, h.IPv4Prefix, new(32))
		l.template.ipv6Bits = *cmp.Or(c.IPv6Prefix, h.IPv6Prefix, new(64))
		prefix := bucketPrefix(keyPrefix, h.Zone, key)
		group := fmt.Sprintf("%s/%d/%d", key, l.template.ipv4Bits, l.template.ipv6Bits)
		if c.own {
			l.keyPrefix = prefix
			group = "\x00own" // the own limit's key has no hash tag: a slot of its own
		} else {
			// Limits with one key template share a hash tag: their
			// buckets live in one Cluster slot, for one script call.
			l.ietfName = h.Zone + "." + c.Name
			l.keyPrefix = prefix[:len(keyPrefix)] + "{" + prefix[len(keyPrefix):]
			l.keySuffix = "}" + keySeparator + c.Name + c.keySuffix
		}
		if _, ok := groups[group]; !ok {
			groups[group] = len(groups)
		}
		l.group = groups[group]
		if isWeighted(string(l.cost)) {
			terms, sum, fixed, err := parseCostTerms(string(l.cost))
			switch {
			case err != nil:
				return nil, err
			case fixed:
				l.cost = Param(strconv.FormatInt(sum, 10))
			default:
				l.costTerms = terms
			}
		}
		l.fixed = !l.rate.perRequest() && !l.burst.perRequest() && !l.cost.perRequest()
		if l.fixed {
			if l.values, l.exempt, err = l.kind.resolveValues(string(l.rate), string(l.burst), string(l.cost)); err != nil {
				return nil, err
			}
			l.args, l.burstValue = l.kind.scriptArgs(l.values), l.values.burst
		}
		if _, bucket := l.kind.(tokenBucket); bucket && !l.fixed && l.costTerms != nil && !l.rate.perRequest() && !l.burst.perRequest() {
			// As resolve would find them, with a cost of 1 for now; a
			// rate or burst out of range is left to resolve to refuse.
			if base, exempt, err := l.kind.resolveValues(string(l.rate), string(l.burst), ""); err == nil && !exempt && base.burst > 0 {
				l.costOnly, l.base, l.baseArgs = true, base, l.kind.scriptArgs(base)
			}
		}
		limits[i] = l
	}
	return limits, nil
}

// or is the first of its values that is set.
func or[T ~string](values ...T) T { return cmp.Or(values...) }

// checkLimits judges the limits as configured, before provisioning: the
// parser calls it at the end of the directive, Validate for JSON.
func (h *Handler) checkLimits() error {
	if err := checkPrefixes(h.IPv4Prefix, h.IPv6Prefix); err != nil {
		return err
	}
	seen := map[string]bool{} // the kinds' limits share their names
	for _, k := range kindConfigs {
		if err := k.check(h, seen); err != nil {
			return err
		}
	}
	return nil
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
func (h *Handler) resolveBucketsWith(r *http.Request, repl *caddy.Replacer, buckets []bucket, memo *weightMemo) (_ []bucket, skipped decision, err error) {
	skipped = decisionEmptyKey
	rv := requestValues{r: r, repl: repl} // one pass over the request's placeholders, for every limit
	var shared requestShared
	for _, l := range h.limits {
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
		key := l.template.key(&rv, l.keyPrefix, l.keySuffix)
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
	now  time.Time // the clock when the request's periods were named (kind.begin)
	slot any       // the request's slot id (kind.begin)
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
func (l *limit) resolve(repl *caddy.Replacer, memo *weightMemo) (limitValues, bool, error) {
	if l.costOnly {
		n, err := resolveTerms(l.costTerms, repl, memo) // weights.go
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
			n, err := resolveTerms(l.costTerms, repl, memo) // weights.go
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
			buckets = buckets[:k] // admitted: the buckets taken, not those held while served (slots)
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
