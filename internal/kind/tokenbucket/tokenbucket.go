// package tokenbucket is the token bucket, the kind of limit of `limit`
// and of a handler's own rate: its values (rate, burst, cost), their
// judgment, its script arguments, its facts and its admin view. Its
// arithmetic is script.lua's checkBucket and takeBucket, and
// memory.go's in the process.
package tokenbucket

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddyserver/caddy/v2"
)

// Bounds of a limit: token counts stay exact in the script's doubles,
// and an empty bucket fills within a year.
const (
	maxExactTokens = cost.MaxTokens
	maxFillSeconds = cost.MaxFillSeconds
)

// RateParam is a fixed rate as JSON writes a number, so that `100/1m`
// adapts to the same JSON as it always has.
func RateParam(f float64) limit.Param {
	b, _ := json.Marshal(f)
	return limit.Param(b)
}

// ParseRate reads tokens per second: a number (`10`, `0.5`) or a count
// per duration (`100/1m`, `5000/1h`).
func ParseRate(s string) (float64, error) {
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
		if v.Rate, err = ParseRate(rate); err != nil {
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
	return v, false, Check(v)
}

// CheckValues judges a limit's rate, burst and cost: each fixed one
// alone, and, when together is set, the fixed ones together (all three;
// or rate and burst, or burst and cost, when the third is a placeholder).
// What has placeholders is judged per request. A cost that is a weighted
// sum of numbers is judged as its sum.
func CheckValues(rate, burst, requested limit.Param, together bool) error {
	text, err := cost.Normalize(string(requested))
	if err != nil {
		return err
	}
	cost := limit.Param(text)
	if together && !rate.PerRequest() && !burst.PerRequest() && !cost.PerRequest() {
		_, _, err := resolveValues(string(rate), string(burst), string(cost))
		return err
	}
	v := limit.Values{Requested: 1}
	fixedRate := !rate.PerRequest() && rate != "" && rate != limit.Unlimited
	fixedBurst := !burst.PerRequest() && burst != "" && burst != limit.Unlimited
	fixedCost := !cost.PerRequest() && cost != ""
	if fixedRate {
		if v.Rate, err = ParseRate(string(rate)); err != nil {
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
		return Check(v) // with the cost too, if it is fixed
	case fixedCost && v.Requested > v.Burst:
		return limit.BadValue("requested_tokens", string(cost), fmt.Sprintf("is more than burst_capacity '%d': no request could ever be admitted", v.Burst))
	}
	return nil
}

// Kind is the token bucket as a kind of limit (limit.Kind), with every
// optional interface.
type Kind struct{}

var (
	_ limit.Kind       = Kind{}
	_ limit.Arithmetic = Kind{}
	_ limit.Charged    = Kind{}
	_ limit.Remembered = Kind{}
	_ limit.Rechecked  = Kind{}
	_ limit.Waiter     = Kind{}
)

func (Kind) BurstName() string { return "burst_capacity" }

func (Kind) ResolveValues(rate, burst, requested string) (limit.Values, bool, error) {
	return resolveValues(rate, burst, requested)
}

func (Kind) ScriptArgs(v limit.Values) [3]any { return Args(v) }

// Recheck judges values resolved once but for their cost (limit.Rechecked).
func (Kind) Recheck(v limit.Values) error { return Check(v) }

// Begin adds nothing: a token bucket is the same for every request.
func (Kind) Begin(b limit.Bucket, shared limit.Shared) (limit.Bucket, limit.Shared) {
	return b, shared
}

// AppendArgs appends rate, burst and cost; for a request that may wait
// for the bucket (Bucket.Waits), the waiting form: "w", rate, burst,
// cost and the max wait in microseconds (script.lua). A request that
// does not wait sends what it always has.
func (Kind) AppendArgs(args []any, b limit.Bucket) []any {
	if !b.Waits() {
		return append(args, b.Args[:]...)
	}
	return append(append(append(args, waitingArg), b.Args[:]...), waitArg(b))
}

// waitingArg leads a bucket's arguments in the waiting form, boxed once.
var waitingArg any = "w"

// WaitArg is a max wait as the script takes it: microseconds, rounded
// down (MaxWaitMicros).
func (Kind) WaitArg(d time.Duration) any { return strconv.FormatInt(MaxWaitMicros(d), 10) }

// waitArg is the bucket's max wait as a script argument: its limit's,
// boxed once, when the bucket's is that one (Limit.SetWait); else boxed
// now.
func waitArg(b limit.Bucket) any {
	if l := b.Limit; l != nil && l.WaitArg != nil && l.Wait == b.Values.MaxWait {
		return l.WaitArg
	}
	return Kind{}.WaitArg(b.Values.MaxWait)
}

// ReplyWords is 0: a token bucket's answer is its remaining and wait.
func (Kind) ReplyWords() int { return 0 }

func (Kind) ReadReply(b limit.Bucket, _ []int64, _ int) (limit.Bucket, error) { return b, nil }

// LimitInfo lists the rate, burst and cost.
func (Kind) LimitInfo(l *limit.Limit) limit.LimitInfo {
	li := l.Info()
	li.ReplenishRate, li.BurstCapacity, li.RequestedTokens = l.Rate, l.Burst, l.Cost
	if l.Fixed && !l.Exempt { // with the defaults filled in
		li.ReplenishRate = RateParam(l.Values.Rate)
		li.BurstCapacity = limit.Param(strconv.FormatInt(l.Values.Burst, 10))
		li.RequestedTokens = limit.Param(strconv.FormatInt(l.Values.Requested, 10))
	}
	return li
}

// BucketInfo shows the tokens the bucket holds.
func (Kind) BucketInfo(b limit.Bucket, v limit.View) limit.BucketInfo { return limit.TokenInfo(b, v) }

// Facts are the bucket's rate, burst and cost; its policy's window is
// the seconds an empty bucket takes to fill, and it is back after its
// wait: it refills by time.
func (Kind) Facts(b limit.Bucket) limit.Facts {
	v := b.Values
	fill := int64(0)
	if v.Rate > 0 {
		fill = int64(math.Ceil(float64(v.Burst) / v.Rate))
	}
	return limit.Facts{Rate: v.Rate, Burst: v.Burst, Requested: v.Requested, Window: fill, Reset: b.RetryAfter}
}

// Refused: the store's answer is the whole answer.
func (Kind) Refused(b limit.Bucket) limit.Bucket { return b }

// DenialTTL is the bucket's wait: it refills by time. A request that may
// wait for it is refused only until it would fit within its max wait:
// the wait less the max wait (0: not remembered when it fits so soon).
func (Kind) DenialTTL(b limit.Bucket) time.Duration {
	if b.Waits() {
		return max(0, b.RetryAfter-b.Values.MaxWait)
	}
	return b.RetryAfter
}

// CachedRemaining is what the bucket refilled since its refusal: it
// holds requested - wait*rate tokens.
func (Kind) CachedRemaining(b limit.Bucket, _ int64, wait time.Duration) int64 {
	tokens := float64(b.Values.Requested) - wait.Seconds()*b.Values.Rate
	return max(0, int64(math.Floor(tokens)))
}

// Check judges a limit's values together; its messages name each value
// and say what would fix it.
//
// The values are formatted only for a message: a limit whose values come
// from the request is judged on each one (3 allocs less per request of
// make bench's llm@64: BenchmarkServeHTTPLLM/llm).
func Check(v limit.Values) error {
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

// Args are the values as the script takes them.
func Args(v limit.Values) [3]any {
	return [3]any{
		strconv.FormatFloat(v.Rate, 'f', -1, 64),
		strconv.FormatInt(v.Burst, 10),
		strconv.FormatInt(v.Requested, 10),
	}
}
