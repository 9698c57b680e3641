package ratelimit

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/keys"
)

// kind is a kind of limit: the token bucket (tokenbucket.go), or another
// that registers its config (registerKind). A limit holds its
// kind (limit.kind), chosen once when the config is provisioned, and the
// rest of the package asks the kind what is particular to it instead of
// asking which kind it is. A kind is responsible for:
//
//   - its values, resolved from their text (policy.go), and its part of
//     a script call: its arguments and its words of the reply
//     (limiter.go);
//   - the facts of its buckets that the rate-limit headers say
//     (headers.go formats them: a kind formats no header);
//   - its admin view (admin.go), of what the admin API read of a bucket.
//
// What only some kinds do is an optional interface, found once when the
// config is provisioned (limit.setKind), as Caddy finds a module's
// caddy.Provisioner: the arithmetic on a bucket's state kept in the
// process (bucketArithmetic), how a charge settles in it (chargedKind),
// how long a layer may remember its refusal (rememberedKind), whether a
// request holds its bucket while the response is served, to give it back
// when the response ends (heldKind).
//
// What a request knows of a bucket of the kind stays in the request's
// bucket (policy.go): a kind holds what every request of its limit
// shares, never one request's. Its methods take the bucket by value, and
// those that change it return it: a pointer into the request's buckets
// passed to an interface method would move them to the heap, an
// allocation of 768 bytes per request (BenchmarkServeHTTPAllowed 10 ->
// 11 allocs).
type kind interface {
	// burstName is the name of the burst's value in the config, for
	// messages: the burst_capacity of a token bucket, another kind's own.
	burstName() string
	// resolveValues parses a limit's values as written (placeholders
	// replaced) and judges them; isUnlimited says the limit does not
	// apply.
	resolveValues(rate, burst, requested string) (v limitValues, isUnlimited bool, err error)
	// scriptArgs are the values as the script takes them, boxed once
	// for fixed values (limit.args).
	scriptArgs(v limitValues) [3]any
	// begin completes a request's new bucket with what is the request's
	// own (a calendar period, an id); shared is what the request's
	// buckets share, returned with what begin made of it.
	begin(b bucket, shared requestShared) (bucket, requestShared)
	// appendArgs appends the bucket's arguments of a script call (its
	// args, and what the kind adds).
	appendArgs(args []any, b bucket) []any
	// replyWords is how many words of a take's reply are the bucket's,
	// after every bucket's remaining and wait (and what each lent);
	// readReply reads them, from reply[at].
	replyWords() int
	readReply(b bucket, reply []int64, at int) (bucket, error)

	// refused completes the answer of a bucket of a refused request, as
	// a store answered it (a kind whose buckets come back by release,
	// not by time, gives the wait of its own).
	refused(b bucket) bucket

	// facts are what the rate-limit headers say of an answered bucket,
	// which headers.go formats.
	facts(b bucket) facts

	// limitInfo is the limit as the admin API lists it, with the
	// defaults filled in where its values are fixed.
	limitInfo(l *limit) limitInfo
	// bucketInfo is what the admin API shows of a client's bucket, of
	// what was read of it where its handler keeps it (store.peek).
	bucketInfo(b bucket, v bucketView) bucketInfo
}

// facts are what a kind says of an answered bucket for the rate-limit
// headers (headers.go formats them). The Spring set describes a bucket
// as a token bucket: rate, burst and requested; the IETF RateLimit-Policy
// item has the burst as its q, and window as w, or unit as qu; the
// RateLimit item has reset as t.
type facts struct {
	rate             float64 // tokens per second (a count per period: spread over it)
	burst, requested int64
	// window is the policy's w in seconds (the time an empty token
	// bucket takes to fill, a calendar period's length), when unit is "".
	window int64
	// unit is the policy's unit (qu) when it is not requests, and then
	// it has no window.
	unit string
	// reset is how long until the bucket is back (its wait), and
	// renewsAt when it is renewed whatever its wait (the end of a
	// calendar period, Unix microseconds; 0 for none): RateLimit's t is
	// the later.
	reset    time.Duration
	renewsAt int64
}

// bucketArithmetic is what a kind whose buckets a store keeps in the
// process as bucket states does (the token bucket, and kinds counted
// per calendar period): its arithmetic there, each step its script's. A
// kind without it keeps no bucket state (a kind held while served keeps
// counts of its own): a take in the process gives it only buckets of
// kinds with it.
type bucketArithmetic interface {
	// holds says whether a bucket held in the process (state, if ok)
	// has room for the request at now, t on the store's clock; asked of
	// every bucket of a take, before take.
	holds(state bucketState, ok bool, now time.Time, t int64, b bucket) (bucket, bool)
	// take is a bucket's part of a take in the process, once the request
	// is known to be allowed or not: the bucket with its answer, as the
	// script's, and the state to store, if store.
	take(state bucketState, ok bool, now time.Time, t int64, b bucket, allowed bool) (answered bucket, after bucketState, store bool)
	// peek is a bucket held in the process (state, if ok), as the admin
	// API shows it.
	peek(state bucketState, ok bool, now time.Time, t int64, b bucket) bucketView
}

// chargedKind is what a kind whose limits a response may charge does
// (limitConfig.charges): how a charge settles in it (charge.go).
type chargedKind interface {
	// settleArg is settle.lua's first argument for the bucket: its kind
	// as the script knows it.
	settleArg(b bucket) any
	// settleHeld settles a response's charge in a bucket held in the
	// process (state, if ok) at t on the store's clock: diff tokens more
	// than the request reserved (fewer when negative), cost in all, in
	// debt up to maxDebt. after is the state to store, if store; charged
	// and forgiven are what the metrics count.
	settleHeld(state bucketState, ok bool, t int64, b bucket, diff, cost, maxDebt int64) (after bucketState, store bool, charged, forgiven float64)
}

// rememberedKind is what a kind whose refusals a layer may remember for
// a while does (refusals); a layer remembers no refusal of another kind
// (whose buckets come back by release, not by time).
type rememberedKind interface {
	// denialTTL is how long a layer may remember the bucket's refusal:
	// 0 for one that it must not keep.
	denialTTL(b bucket) time.Duration
	// cachedRemaining is what a bucket whose refusal a layer remembered
	// holds now, remaining when Redis refused it, wait before the time
	// it holds the requested tokens again.
	cachedRemaining(b bucket, remaining int64, wait time.Duration) int64
}

// heldKind is a kind of limit whose bucket a request holds while its
// response is served, and gives back once it has ended: its store says
// what the request holds (store.hold), and the handler's holdStep gives
// it back. Such limits come last (kindConfig.order); a limit knows
// its held kind from when it is built (limit.held, setKind).
type heldKind interface {
	kind
	// holdFor is how long a request's hold lasts unless renewed, and the
	// same as a script argument (microseconds, boxed once).
	holdFor() (hold time.Duration, arg any)
}

// kindError is a kind's reason for a store's answer that decides
// nothing (say a period that Redis's clock does not fall in): the
// request is decided as when the store fails, and warning is the line the log gives
// it, throttled as Redis failures are.
type kindError interface {
	error
	warning() string
}

// completeRefusal completes the answers of a refused request's buckets
// (kind.refused).
func completeRefusal(buckets []bucket) {
	for i := range buckets {
		buckets[i] = buckets[i].kind().refused(buckets[i])
	}
}

// firstHeld is the index of a request's first bucket held while it is
// served (heldKind); they follow the others. len(buckets) when there is
// none.
func firstHeld(buckets []bucket) int {
	for i := range buckets {
		if buckets[i].heldWhileServed() {
			return i
		}
	}
	return len(buckets)
}

// heldWhileServed says whether a request holds the bucket while it is
// served (heldKind); a bucket of no limit is not held.
func (b *bucket) heldWhileServed() bool { return b.limit != nil && b.limit.held != nil }

// plain is the kind of a bucket of no limit (one a layer makes for
// calls of its own): the token bucket, whose package sets it.
var plain interface {
	kind
	bucketArithmetic
	chargedKind
	rememberedKind
}

// kind is the bucket's kind of limit: its limit's; a bucket of no limit
// (one a layer makes for calls of its own) is a token bucket.
func (b *bucket) kind() kind {
	if b.limit == nil {
		return plain
	}
	return b.limit.kind
}

// arithmetic, charged and remembered are what the bucket's kind does of
// the optional interfaces (limit.setKind); nil for what it does not.
func (b *bucket) arithmetic() bucketArithmetic {
	if b.limit == nil {
		return plain
	}
	return b.limit.arithmetic
}

func (b *bucket) charged() chargedKind {
	if b.limit == nil {
		return plain
	}
	return b.limit.charged
}

func (b *bucket) remembered() rememberedKind {
	if b.limit == nil {
		return plain
	}
	return b.limit.remembered
}

// setKind gives the limit its kind, and finds once what the kind does of
// the optional interfaces, so that no request asks.
func (l *limit) setKind(k kind) {
	l.kind = k
	l.arithmetic, _ = k.(bucketArithmetic)
	l.charged, _ = k.(chargedKind)
	l.remembered, _ = k.(rememberedKind)
	l.held, _ = k.(heldKind)
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
	// zoneText appends what of its limits names a handler without a
	// zone (derivedZone), if anything: it names their Redis keys, so it
	// never changes.
	zoneText func(h *Handler, text []byte) []byte
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
			rate: c.ReplenishRate, burst: c.BurstCapacity, cost: c.RequestedTokens,
		}
		l.setKind(k)
		if c.charges && l.charged == nil {
			return nil, fmt.Errorf("%s %s: its kind of limit settles no charge", c.what, c.Name)
		}
		key := or(c.Key, h.Key)
		l.keyText = key
		if l.template, err = keys.Parse(key); err != nil {
			return nil, err
		}
		l.template.IPv4Bits = *cmp.Or(c.IPv4Prefix, h.IPv4Prefix, new(32))
		l.template.IPv6Bits = *cmp.Or(c.IPv6Prefix, h.IPv6Prefix, new(64))
		prefix := keys.BucketPrefix(keyPrefix, h.Zone, key)
		group := fmt.Sprintf("%s/%d/%d", key, l.template.IPv4Bits, l.template.IPv6Bits)
		if c.own {
			l.keyPrefix = prefix
			group = "\x00own" // the own limit's key has no hash tag: a hash slot of its own
		} else {
			// Limits with one key template share a hash tag: their
			// buckets live in one Cluster hash slot, for one script call.
			l.ietfName = h.Zone + "." + c.Name
			l.keyPrefix = prefix[:len(keyPrefix)] + "{" + prefix[len(keyPrefix):]
			l.keySuffix = "}" + keys.Separator + c.Name + c.keySuffix
		}
		if _, ok := groups[group]; !ok {
			groups[group] = len(groups)
		}
		l.group = groups[group]
		if cost.IsWeighted(string(l.cost)) {
			terms, sum, fixed, err := cost.ParseTerms(string(l.cost))
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

// normalizeCost is a requested_tokens as the checks of a single value
// judge it: a weighted sum of numbers becomes its sum; one with
// placeholders stays as it is, for each request to resolve.
func normalizeCost(requested Param) (Param, error) {
	text, err := cost.Normalize(string(requested))
	return Param(text), err
}

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
