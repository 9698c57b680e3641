package limit

import (
	"strconv"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// LimitInfo is what every kind of limit lists of itself: its name, key
// and prefixes (the kind adds its values, kind.limitInfo).
func (l *Limit) Info() LimitInfo {
	return LimitInfo{Name: l.Name, Key: l.KeyText, IPv4Prefix: l.Template.IPv4Bits, IPv6Prefix: l.Template.IPv6Bits}
}

// SetKind gives the limit its kind, and finds once what the kind does of
// the optional interfaces, so that no request asks.
func (l *Limit) SetKind(k Kind) {
	l.Kind = k
	l.Arithmetic, _ = k.(Arithmetic)
	l.Charged, _ = k.(Charged)
	l.Remembered, _ = k.(Remembered)
	l.Held, _ = k.(Held)
	l.Jittered, _ = k.(Jittered)
	l.Rechecked, _ = k.(Rechecked)
	l.Waiter, _ = k.(Waiter)
	l.Queuer, _ = k.(Queuer)
}

// Limit is one limit of a handler, ready for requests.
type Limit struct {
	Index     int    // in the handler's limits
	Name      string // "" for a handler without `limits`
	NameValue any    // the name as a placeholder value, boxed once
	IETFName  string // "<zone>", or "<zone>.<name>"
	KeyText   string // the key template as configured
	Template  keys.Template
	// A bucket's Redis key is keyPrefix + client key + keySuffix.
	KeyPrefix, KeySuffix string
	Group                int // limits with one key template share a Cluster hash slot
	Rate, Burst, Cost    Param
	// CostTerms: requested_tokens as a weighted sum with placeholders
	// (internal/cost); nil for one value.
	CostTerms []cost.Term
	// CostOnly: a limit of a kind that rechecks its values (Rechecked)
	// whose rate and burst are fixed and whose requested_tokens is a
	// weighted sum with placeholders: its values and arguments are base's
	// but for the cost, not parsed and formatted again per request (5
	// allocs less per request of make bench's llm@64:
	// BenchmarkServeHTTPLLM/llm 23 -> 18).
	CostOnly bool
	Base     Values
	BaseArgs [3]any
	// Fixed: no placeholders, so the values (and arguments) are known.
	Fixed      bool
	Values     Values
	Exempt     bool   // a fixed rate of `unlimited`
	Args       [3]any // the values as script arguments, boxed once (BenchmarkServeHTTPAllowed 21 -> 16 allocs)
	BurstValue any    // the burst as a placeholder value, boxed once

	// Charge is how the response charges it (charge.go); nil when
	// requested_tokens is its cost. chargedKey is its own placeholder,
	// http.rate_limit.charged.<name>; empty for a handler without limits.
	Charge     *cost.Rule
	ChargedKey string

	// Kind is its kind of limit (kind.go), whose values its values are
	// (what stands for the burst, say, is the kind's: burstName);
	// arithmetic, charged, remembered and jittered what it does of the
	// optional interfaces, nil for what it does not (setKind). held says
	// a request holds its bucket while served (heldKind); inFlight is then its
	// zone's series of the in_flight gauge, the requests of this instance
	// that hold it (nil without metrics).
	Kind       Kind
	Arithmetic Arithmetic
	Charged    Charged
	Remembered Remembered
	Held       Held
	Jittered   Jittered
	Rechecked  Rechecked
	Waiter     Waiter
	Queuer     Queuer
	InFlight   prometheus.Gauge

	// Wait is the limit's max wait when it is fixed (Values.MaxWait of
	// each of its buckets), and WaitArg the same as its kind's script
	// argument, boxed once (SetWait); nil when the limit has none, or when
	// each request resolves its own (then boxed per request).
	Wait    time.Duration
	WaitArg any
	// WaitText is the max wait with placeholders that each request
	// resolves (ResolveWait); "" when it is fixed.
	WaitText Param
}

// ResolveWait is the limit's max wait for a request whose replacer is
// repl: its fixed one, or WaitText resolved and parsed.
func (l *Limit) ResolveWait(repl *caddy.Replacer) (time.Duration, error) {
	if l.WaitText == "" {
		return l.Wait, nil
	}
	text := repl.ReplaceAll(string(l.WaitText), "")
	if text == "" {
		return 0, BadValue("max_wait", string(l.WaitText), "resolved to nothing for this request")
	}
	return ParseMaxWait(text)
}

// SetWait gives the limit a fixed max wait d (after SetKind): its
// buckets' script argument is then boxed once. The caller still puts d in
// each bucket's Values.MaxWait (Values, when the limit is fixed).
func (l *Limit) SetWait(d time.Duration) {
	l.Wait, l.WaitArg = d, nil
	if d > 0 && l.Waiter != nil {
		l.WaitArg = l.Waiter.WaitArg(d)
	}
}

// Resolve resolves the limit's values from a request's placeholders. A
// value the config sets that resolves to nothing is an error, not the
// default: a fallback belongs in the config (`map`'s `default`).
func (l *Limit) Resolve(repl *caddy.Replacer, memo *cost.Memo) (Values, bool, error) {
	if l.CostOnly {
		n, err := cost.Sum(l.CostTerms, repl, memo)
		if err != nil {
			return Values{}, false, err
		}
		v := l.Base
		v.Requested = n
		return v, false, l.Rechecked.Recheck(v)
	}
	var text [3]string
	for i, p := range [3]struct {
		name  string
		value Param
	}{{"replenish_rate", l.Rate}, {l.Kind.BurstName(), l.Burst}, {"requested_tokens", l.Cost}} {
		if i == 2 && l.CostTerms != nil {
			n, err := cost.Sum(l.CostTerms, repl, memo)
			if err != nil {
				return Values{}, false, err
			}
			text[i] = strconv.FormatInt(n, 10)
			continue
		}
		text[i] = repl.ReplaceAll(string(p.value), "")
		if text[i] == "" && p.value != "" {
			name := p.name
			if n, ok := l.Kind.(interface{ RateName() string }); ok && i == 0 {
				name = n.RateName() // a kind whose rate's place another value takes (the concurrent limit's priority)
			}
			return Values{}, false, BadValue(name, string(p.value), "resolved to nothing for this request")
		}
	}
	return l.Kind.ResolveValues(text[0], text[1], text[2])
}
