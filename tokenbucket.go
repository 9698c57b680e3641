package ratelimit

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddyserver/caddy/v2"
)

// The token bucket, the kind of limit of `limit` and of a handler's own
// rate: its values (rate, burst, cost), their judgment and its script
// arguments. Its arithmetic is script.lua's checkBucket and takeBucket,
// and this file's in the process.

// Bounds of a limit: token counts stay exact in the script's doubles,
// and an empty bucket fills within a year.
const (
	maxExactTokens = cost.MaxTokens
	maxFillSeconds = cost.MaxFillSeconds
)

// parseRate reads tokens per second: a number (`10`, `0.5`) or a count
// per duration (`100/1m`, `5000/1h`).
func parseRate(s string) (float64, error) {
	count, per, found := strings.Cut(s, "/")
	n, err := strconv.ParseFloat(count, 64)
	if err != nil || !(n > 0) || n > 1e15 {
		return 0, fmt.Errorf("%s, or <count>/<duration> like 100/1m", wantRate)
	}
	if !found {
		return n, nil
	}
	d, err := caddy.ParseDuration(per)
	if err != nil || d <= 0 {
		return 0, errors.New("the duration after '/' must be positive, like 1s, 1m or 1h")
	}
	return n / d.Seconds(), nil
}

const wantRate = "want a positive number of tokens per second"

// resolveValues parses a limit's values as written (placeholders already
// replaced) and judges them together. An empty burst or cost stands for
// its default. unlimited says the rate is `unlimited`: the limit does not
// apply.
func resolveValues(rate, burst, requested string) (v limit.Values, isUnlimited bool, err error) {
	if rate == limit.Unlimited {
		return v, true, nil
	}
	if rate == "" && burst != "0" {
		return v, false, &limit.ParamError{Param: "replenish_rate", Msg: "replenish_rate is required (or burst_capacity 0 to block every request)"}
	}
	if rate != "" {
		if v.Rate, err = parseRate(rate); err != nil {
			return v, false, limit.BadValue("replenish_rate", rate, ": "+err.Error())
		}
	}
	v.Burst = int64(math.Ceil(v.Rate))
	if burst != "" {
		if v.Burst, err = strconv.ParseInt(burst, 10, 64); err != nil {
			return v, false, limit.BadValue("burst_capacity", burst, "is not a whole number")
		}
	}
	v.Requested = 1
	if requested != "" {
		if v.Requested, err = strconv.ParseInt(requested, 10, 64); err != nil {
			return v, false, limit.BadValue("requested_tokens", requested, "is not a whole number")
		}
	}
	return v, false, checkBucket(v)
}

// checkValues judges a limit's rate, burst and cost: each fixed one
// alone, and, when together is set, the fixed ones together (all three;
// or rate and burst, or burst and cost, when the third is a placeholder).
// What has placeholders is judged per request.
func checkValues(rate, burst, cost Param, together bool) error {
	rate, cost = unset(rate), unset(cost)
	cost, err := normalizeCost(cost) // a weighted sum (kind.go)
	if err != nil {
		return err
	}
	if together && !rate.PerRequest() && !burst.PerRequest() && !cost.PerRequest() {
		_, _, err := resolveValues(string(rate), string(burst), string(cost))
		return err
	}
	v := limit.Values{Requested: 1}
	fixedRate := !rate.PerRequest() && rate != "" && rate != limit.Unlimited
	fixedBurst := !burst.PerRequest() && burst != "" && burst != limit.Unlimited
	fixedCost := !cost.PerRequest() && cost != ""
	if fixedRate {
		if v.Rate, err = parseRate(string(rate)); err != nil {
			return limit.BadValue("replenish_rate", string(rate), ": "+err.Error())
		}
	}
	if fixedBurst {
		if v.Burst, err = strconv.ParseInt(string(burst), 10, 64); err != nil || v.Burst < 0 || v.Burst > maxExactTokens {
			return limit.BadValue("burst_capacity", string(burst), "is not a whole number from 0 to 2^53")
		}
	}
	if fixedCost {
		if v.Requested, err = strconv.ParseInt(string(cost), 10, 64); err != nil || v.Requested < 1 {
			return limit.BadValue("requested_tokens", string(cost), "is not a whole number of at least 1")
		}
	}
	switch {
	case !together || !fixedBurst || v.Burst == 0:
	case fixedRate:
		return checkBucket(v) // with the cost too, if it is fixed
	case fixedCost && v.Requested > v.Burst:
		return limit.BadValue("requested_tokens", string(cost), fmt.Sprintf("is more than burst_capacity '%d': no request could ever be admitted", v.Burst))
	}
	return nil
}

// tokenBucket is the token bucket as a kind of limit (kind.go), with
// every optional interface.
type tokenBucket struct{}

var (
	_ limit.Kind       = tokenBucket{}
	_ limit.Arithmetic = tokenBucket{}
	_ limit.Charged    = tokenBucket{}
	_ limit.Remembered = tokenBucket{}
)

func (tokenBucket) BurstName() string { return "burst_capacity" }

func (tokenBucket) ResolveValues(rate, burst, requested string) (limit.Values, bool, error) {
	return resolveValues(rate, burst, requested)
}

func (tokenBucket) ScriptArgs(v limit.Values) [3]any { return bucketArgs(v) }

// begin adds nothing: a token bucket is the same for every request.
func (tokenBucket) Begin(b limit.Bucket, shared limit.Shared) (limit.Bucket, limit.Shared) {
	return b, shared
}

// appendArgs appends rate, burst and cost.
func (tokenBucket) AppendArgs(args []any, b limit.Bucket) []any { return append(args, b.Args[:]...) }

// replyWords is 0: a token bucket's answer is its remaining and wait.
func (tokenBucket) ReplyWords() int                                                  { return 0 }
func (tokenBucket) ReadReply(b limit.Bucket, _ []int64, _ int) (limit.Bucket, error) { return b, nil }

// limitInfo lists the rate, burst and cost.
func (tokenBucket) LimitInfo(l *limit.Limit) limit.LimitInfo {
	li := l.Info()
	li.ReplenishRate, li.BurstCapacity, li.RequestedTokens = l.Rate, l.Burst, l.Cost
	if l.Fixed && !l.Exempt { // with the defaults filled in
		li.ReplenishRate = floatParam(l.Values.Rate)
		li.BurstCapacity = Param(strconv.FormatInt(l.Values.Burst, 10))
		li.RequestedTokens = Param(strconv.FormatInt(l.Values.Requested, 10))
	}
	return li
}

// bucketInfo shows the tokens the bucket holds.
func (tokenBucket) BucketInfo(b limit.Bucket, v limit.View) limit.BucketInfo { return tokenInfo(b, v) }

// facts are the bucket's rate, burst and cost; its policy's window is
// the seconds an empty bucket takes to fill, and it is back after its
// wait: it refills by time.
func (tokenBucket) Facts(b limit.Bucket) limit.Facts {
	v := b.Values
	fill := int64(0)
	if v.Rate > 0 {
		fill = int64(math.Ceil(float64(v.Burst) / v.Rate))
	}
	return limit.Facts{Rate: v.Rate, Burst: v.Burst, Requested: v.Requested, Window: fill, Reset: b.RetryAfter}
}

// refused: the store's answer is the whole answer.
func (tokenBucket) Refused(b limit.Bucket) limit.Bucket { return b }

// denialTTL is the bucket's wait: it refills by time.
func (tokenBucket) DenialTTL(b limit.Bucket) time.Duration { return b.RetryAfter }

// cachedRemaining is what the bucket refilled since its refusal: it
// holds requested - wait*rate tokens.
func (tokenBucket) CachedRemaining(b limit.Bucket, _ int64, wait time.Duration) int64 {
	tokens := float64(b.Values.Requested) - wait.Seconds()*b.Values.Rate
	return max(0, int64(math.Floor(tokens)))
}

// The token bucket in the process (for a store or a layer that keeps
// buckets there): a bucketState holds its tokens at a time, and expires when it would be
// full again. Every step is script.lua's checkBucket and takeBucket.

// holds says whether the bucket has the requested tokens at t.
func (tokenBucket) Holds(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket) (limit.Bucket, bool) {
	current, at := currentState(state, ok, t, b.Values)
	return b, refill(current, at, b.Values) >= float64(b.Values.Requested)
}

// take is the bucket's part of a take at t (settle).
func (tokenBucket) Take(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket, allowed bool) (limit.Bucket, limit.State, bool) {
	after, store, remaining, wait := settle(state, ok, t, b.Values, allowed)
	b.Remaining, b.RetryAfter = remaining, time.Duration(wait)*time.Microsecond
	return b, after, store
}

// settleArg is the bucket's first script argument: its rate.
func (tokenBucket) SettleArg(b limit.Bucket) any { return b.Args[0] }

// settleHeld refills the bucket, then takes or gives back the difference
// (settleBucket); a full bucket needs no entry.
func (tokenBucket) SettleHeld(state limit.State, ok bool, t int64, b limit.Bucket, diff, cost, maxDebt int64) (limit.State, bool, float64, float64) {
	current, at := currentState(state, ok, t, b.Values)
	after, forgiven := settleBucket(current, at, b.Values, diff, maxDebt)
	return after, ok || after.Tokens < float64(b.Values.Burst), float64(cost) - forgiven, forgiven
}

// peek is what the bucket holds at t, refilled.
func (tokenBucket) Peek(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket) limit.View {
	v := b.Values
	if !ok || state.Expires <= t {
		return limit.View{Tokens: float64(v.Burst)}
	}
	current, at := currentState(state, true, t, v)
	_, _, _, wait := takeBucket(current, at, v, false)
	return limit.View{Tokens: refill(current, at, v), Wait: time.Duration(wait) * time.Microsecond,
		ExpiresIn: time.Duration(state.Expires-t) * time.Microsecond}
}

// settle is one bucket's part of a take at t, once the request is known
// to be allowed or not: the state to store, if store, and the answer.
// state is the bucket as held, if ok.
func settle(state limit.State, ok bool, t int64, v limit.Values, allowed bool) (after limit.State, store bool, remaining, wait int64) {
	current, at := currentState(state, ok, t, v)
	after, _, remaining, wait = takeBucket(current, at, v, allowed)
	if !allowed && ok {
		after = extendOnDenial(state, after, at, v)
	}
	return after, allowed || ok && after != state, remaining, wait
}

// currentState is a bucket's state for a take at t, and the time of the
// take: an absent bucket (not ok), or one past its expiry, is full at t
// (as an absent or expired Redis key); a bucket taken from after t is
// taken from at that time (see take).
func currentState(state limit.State, ok bool, t int64, v limit.Values) (limit.State, int64) {
	if !ok || state.Expires <= t {
		return limit.State{Tokens: float64(v.Burst), At: t}, t
	}
	return state, max(t, state.At)
}

// refill is what a bucket holds at t: script.lua's arithmetic, which
// also counts from t when the stored time lies ahead.
func refill(state limit.State, t int64, v limit.Values) float64 {
	return math.Min(float64(v.Burst), state.Tokens+float64(max(0, t-state.At))*v.Rate/1000000)
}

// takeBucket is script.lua for one bucket at time t (microseconds):
// refill by the time elapsed, take the requested tokens when take says
// so, and answer the remaining whole tokens and the microseconds until
// the bucket holds its requested tokens again. The state after holds
// when the bucket would be full again. Every step is the script's, in the
// same order, so that both agree to the bit (script_test.go checks it).
func takeBucket(state limit.State, t int64, v limit.Values, take bool) (after limit.State, took bool, remaining, wait int64) {
	tokens := refill(state, t, v)
	requested := float64(v.Requested)
	if take && tokens >= requested {
		tokens -= requested
		took = true
	}
	if tokens < requested {
		wait = int64(math.Ceil((requested - tokens) * 1000000 / v.Rate))
	}
	ttl := math.Max(1000, math.Ceil((float64(v.Burst)-tokens)*1000/v.Rate)) // milliseconds, as the key's TTL
	return limit.State{Tokens: tokens, At: t, Expires: t + int64(ttl)*1000}, took, max(0, int64(math.Floor(tokens))), wait
}

// extendOnDenial is what a denial at t leaves of a held bucket: its
// state, unchanged, unless the values now in force (a slower plan than
// the one it was taken at) need it to live longer to refill; then it
// expires as after (takeBucket's) says. script.lua's PEXPIRE, with its
// millisecond of slack for the rounding of expiries: at unchanged values
// a denial changes nothing.
func extendOnDenial(state, after limit.State, t int64, v limit.Values) limit.State {
	fill := math.Ceil((float64(v.Burst) - after.Tokens) * 1000 / v.Rate) // milliseconds, as the script's
	if state.Expires > t && float64(state.Expires-t)+1000 < fill*1000 {
		state.Expires = after.Expires
	}
	return state
}

func init() {
	limit.Plain = tokenBucket{}
	registerKind(kindConfig{order: 0, configs: bucketConfigs, check: checkBuckets})
}

// bucketConfigs are the handler's token buckets as configured: its
// `limits`, or its own limit.
func bucketConfigs(h *Handler) []limitConfig {
	limits, what := h.Limits, "limit"
	if h.hasOwnLimit() {
		limits, what = []Limit{{}}, ""
	}
	configs := make([]limitConfig, 0, len(limits))
	for _, c := range limits {
		c.ReplenishRate, c.BurstCapacity = or(unset(c.ReplenishRate), unset(h.ReplenishRate)), or(c.BurstCapacity, h.BurstCapacity)
		c.RequestedTokens = or(unset(c.RequestedTokens), unset(h.RequestedTokens))
		rate := c.ReplenishRate
		configs = append(configs, limitConfig{
			Limit: c, what: what, own: what == "", charges: true,
			checkDebt: func(maxDebt int64) error { return checkDebtRefill(maxDebt, rate) },
			newKind:   func() (limit.Kind, error) { return tokenBucket{}, nil },
		})
	}
	return configs
}

// checkDebtRefill judges a max_debt against the rate that pays it back:
// within a year.
func checkDebtRefill(maxDebt int64, rate Param) error {
	if r, err := parseRate(string(rate)); err == nil && float64(maxDebt)/r > maxFillSeconds {
		return fmt.Errorf("max_debt '%d': a debt that large takes more than a year to pay back at replenish_rate '%v'; lower it to at most %d",
			maxDebt, r, int64(r*maxFillSeconds))
	}
	return nil
}

// checkBuckets judges the handler's own limit and its `limits`.
func checkBuckets(h *Handler, names map[string]bool) error {
	if err := checkValues(h.ReplenishRate, h.BurstCapacity, h.RequestedTokens, h.hasOwnLimit()); err != nil {
		return err
	}
	for _, l := range h.Limits {
		if err := checkLimitName(l.Name); err != nil {
			return err
		}
		if names[l.Name] {
			return fmt.Errorf("limit '%s' is given twice: limit names must be unique in a handler", l.Name)
		}
		names[l.Name] = true
		err := checkPrefixes(l.IPv4Prefix, l.IPv6Prefix)
		if err == nil && l.Key != "" {
			_, err = keys.Parse(l.Key)
		}
		if err == nil {
			err = checkValues(or(unset(l.ReplenishRate), unset(h.ReplenishRate)), or(l.BurstCapacity, h.BurstCapacity),
				or(unset(l.RequestedTokens), unset(h.RequestedTokens)), true)
		}
		if err != nil {
			return fmt.Errorf("limit %s: %w", l.Name, err)
		}
	}
	return nil
}

// check judges a limit's values together; its messages name each value
// and say what would fix it.
//
// The values are formatted only for a message: a limit whose values come
// from the request is judged on each one (3 allocs less per request of
// make bench's llm@64: BenchmarkServeHTTPLLM/llm).
func checkBucket(v limit.Values) error {
	rate := func() string { return strconv.FormatFloat(v.Rate, 'g', -1, 64) }
	burst := func() string { return strconv.FormatInt(v.Burst, 10) }
	requested := func() string { return strconv.FormatInt(v.Requested, 10) }
	switch {
	case v.Burst < 0:
		return limit.BadValue("burst_capacity", burst(), "must not be negative")
	case v.Burst == 0:
		return nil // blocks everything; rate and cost do not matter
	case !(v.Rate > 0) || math.IsInf(v.Rate, 0):
		return limit.BadValue("replenish_rate", rate(), ": "+wantRate)
	case float64(v.Burst) < v.Rate:
		return limit.BadValue("burst_capacity", burst(), fmt.Sprintf("is smaller than replenish_rate '%s': the bucket could never hold one second's refill, "+
			"so clients would be held below the configured rate; raise burst_capacity to at least %v", rate(), math.Ceil(v.Rate)))
	case v.Burst > maxExactTokens:
		return limit.BadValue("burst_capacity", burst(), "is above 2^53, where the script's numbers stop being exact; lower it")
	case float64(v.Burst)/v.Rate > maxFillSeconds:
		return limit.BadValue("replenish_rate", rate(), fmt.Sprintf("is so small that an empty bucket of %d tokens would take %.3g days to fill "+
			"(more than a year, past what Retry-After can say); raise it to at least %v", v.Burst, float64(v.Burst)/v.Rate/86400, float64(v.Burst)/maxFillSeconds))
	case v.Requested < 1:
		return limit.BadValue("requested_tokens", requested(), "must be at least 1")
	case v.Requested > v.Burst:
		return limit.BadValue("requested_tokens", requested(), fmt.Sprintf("is more than burst_capacity '%d': no request could ever be admitted", v.Burst))
	}
	return nil
}

// bucketArgs are the values as the script takes them.
func bucketArgs(v limit.Values) [3]any {
	return [3]any{
		strconv.FormatFloat(v.Rate, 'f', -1, 64),
		strconv.FormatInt(v.Burst, 10),
		strconv.FormatInt(v.Requested, 10),
	}
}
