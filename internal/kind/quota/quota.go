// package quota is the quota, a kind of limit: a count of tokens per
// calendar period (per day, per month in a time zone), renewed at the
// boundary, decided with the token buckets in the same script call. A
// quota is a limit with a quota rule (Kind): this file holds its values,
// its script arguments, its facts and its admin view; memory.go its
// arithmetic in the process.
package quota

import (
	"fmt"
	"hash/fnv"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/calendar"
	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/limit"
)

// maxExactTokens bounds a count: token counts stay exact in the script's
// doubles.
const maxExactTokens = cost.MaxTokens

// KeySlack is how long a quota's key outlives its period: the
// period is picked by Redis time, so the key is of no use after its end.
const KeySlack = time.Second

// Kind is a limit's quota rule: its period, and the current period's
// script arguments.
type Kind struct {
	per     string
	period  *calendar.Period
	current atomic.Pointer[Period]
}

// Period is one period of a quota as requests use it: computed and
// boxed once per period (and quota), so requests do no time zone
// arithmetic and box nothing (see calendar.Period.Bounds).
type Period struct {
	bounds calendar.Bounds // [1] to [2] is the period, Caddy's clock
	args   [4]any          // the bounds as script arguments
	// settleKinds are settle.lua's first argument for a reservation
	// taken in the period before, this one or the next (by the shift the
	// take answered, bucket.quotaShift): "q" and that period's start, so
	// that a response that ends once its quota counts another period
	// settles nothing there.
	settleKinds [3]any
}

// New reads a quota's period (calendar.New's arguments); its error
// is calendar.New's.
func New(per, timeZone string, monthDay int, weekStarts string) (*Kind, error) {
	p, err := calendar.New(per, timeZone, monthDay, weekStarts)
	if err != nil {
		return nil, err
	}
	return &Kind{per: per, period: p}, nil
}

// at is the period of l's quota at now, from the cache while now is in it.
func (q *Kind) at(now time.Time, l *limit.Limit) *Period {
	us := now.UnixMicro()
	if p := q.current.Load(); p != nil && p.bounds[1] <= us && us < p.bounds[2] {
		return p
	}
	p := NewPeriod(q.period.Bounds(now))
	q.current.Store(p)
	return p
}

// NewPeriod is the period of the bounds given (Unix microseconds), its
// script arguments boxed.
func NewPeriod(bounds calendar.Bounds) *Period {
	p := &Period{bounds: bounds}
	for i, b := range p.bounds {
		p.args[i] = strconv.FormatInt(b, 10)
	}
	for i := range p.settleKinds {
		p.settleKinds[i] = "q" + strconv.FormatInt(p.bounds[i], 10)
	}
	return p
}

// clockError is a quota that Redis counted in no period: its clock
// read a time outside the period Caddy named by its own clock and the two
// beside it, so the two clocks differ by more than a period. The call
// took nothing; the request is decided as when Redis fails.
type clockError struct {
	redis, caddy int64 // the clocks' readings, Unix microseconds
	bounds       calendar.Bounds
}

func (e *clockError) Warning() string {
	return "Redis's clock is more than a quota's period away from Caddy's"
}

func (e *clockError) Error() string {
	format := func(us int64) string { return time.UnixMicro(us).UTC().Format("2006-01-02T15:04:05.000Z") }
	skew, way := time.Duration(e.redis-e.caddy)*time.Microsecond, "ahead of"
	if skew < 0 {
		skew, way = -skew, "behind"
	}
	return fmt.Sprintf("a quota counted in no period: Redis's clock read %s, %v %s Caddy's, outside the periods Caddy named "+
		"by its clock (%s to %s); synchronize the clocks of the Caddy and Redis hosts (NTP) to within a period",
		format(e.redis), skew.Round(time.Millisecond), way, format(e.bounds[0]), format(e.bounds[3]))
}

// quotaAt sets a quota bucket's period for a take in the process at now.
// The request named its period by the clock when it arrived, and the
// take may come periods later (in a fallback's buckets, after a Redis
// timeout longer than the period), when now lies outside it and its neighbours;
// the process has the calendar, so it names the period now is in.
func quotaAt(b *limit.Bucket, now time.Time) {
	if us := now.UnixMicro(); us < period(b).bounds[0] || us >= period(b).bounds[3] {
		b.KindRef = b.Limit.Kind.(*Kind).at(now, b.Limit)
	}
}

// Bounds are the period's bounds, Caddy's clock (Unix microseconds):
// it runs from [1] to [2], the one before from [0], the one after to [3].
func (p *Period) Bounds() calendar.Bounds { return p.bounds }

// window is the period's length in seconds (a calendar period's varies).
func (p *Period) window() int64 { return (p.bounds[2] - p.bounds[1]) / 1_000_000 }

// span is the period that holds us (Unix microseconds): the one before,
// this one or the next, as the script picks it by Redis time, and shift
// says which (-1, 0, 1).
func (p *Period) span(us int64) (start, end int64, shift int8) {
	switch b := &p.bounds; {
	case us < b[1]:
		return b[0], b[1], -1
	case us < b[2]:
		return b[1], b[2], 0
	default:
		return b[2], b[3], 1
	}
}

// end is the end of the period that a take counted in, shift periods
// from this one (Unix microseconds): when a quota that holds renews.
func (p *Period) end(shift int8) int64 { return p.bounds[2+shift] }

// resolveValues parses a quota's count and cost as written
// (placeholders replaced): the count in a limitValues' burst, no rate.
// An empty cost is 1. isUnlimited says the count is `unlimited`.
func resolveValues(count, requested string) (v limit.Values, isUnlimited bool, err error) {
	if count == limit.Unlimited {
		return v, true, nil
	}
	if v.Burst, err = strconv.ParseInt(count, 10, 64); err != nil {
		return v, false, limit.BadValue("count", count, "is not a whole number")
	}
	v.Requested = 1
	if requested != "" {
		if v.Requested, err = strconv.ParseInt(requested, 10, 64); err != nil {
			return v, false, limit.BadValue("requested_tokens", requested, "is not a whole number")
		}
	}
	return v, false, check(v)
}

// check judges a quota's count and cost together.
func check(v limit.Values) error {
	count, requested := strconv.FormatInt(v.Burst, 10), strconv.FormatInt(v.Requested, 10)
	switch {
	case v.Burst < 1:
		return limit.BadValue("count", count, "must be at least 1 (a quota of nothing would deny every request; use burst_capacity 0 for that)")
	case v.Burst > maxExactTokens:
		return limit.BadValue("count", count, "is above 2^53, where the script's numbers stop being exact; lower it")
	case v.Requested < 1:
		return limit.BadValue("requested_tokens", requested, "must be at least 1")
	case v.Requested > v.Burst:
		return limit.BadValue("requested_tokens", requested, fmt.Sprintf("is more than count '%d': no request could ever be admitted", v.Burst))
	}
	return nil
}

// CheckValues judges a quota's count and cost as configured: what
// is fixed, alone and together; placeholders are judged per request.
//
// A cost that is a weighted sum of numbers is judged as its sum.
func CheckValues(count, requested limit.Param) error {
	text, err := cost.Normalize(string(requested))
	if err != nil {
		return err
	}
	cost := limit.Param(text)
	fixedCount, fixedCost := !count.PerRequest() && count != limit.Unlimited, !cost.PerRequest()
	switch {
	case count == "":
		return fmt.Errorf("count is required: the most tokens per period, like 1000")
	case fixedCount && fixedCost:
		_, _, err := resolveValues(string(count), string(cost))
		return err
	case fixedCount:
		_, _, err := resolveValues(string(count), "")
		return err
	case fixedCost && cost != "":
		if n, err := strconv.ParseInt(string(cost), 10, 64); err != nil || n < 1 {
			return limit.BadValue("requested_tokens", string(cost), "is not a whole number of at least 1")
		}
	}
	return nil
}

// Args are a quota's values as the script takes them, before the
// period's bounds: "q", count, requested.
func Args(v limit.Values) [3]any {
	return [3]any{"q", strconv.FormatInt(v.Burst, 10), strconv.FormatInt(v.Requested, 10)}
}

// LimitInfo lists its count, period and cost.
func (q *Kind) LimitInfo(l *limit.Limit) limit.LimitInfo {
	li := l.Info()
	li.Count, li.Per, li.RequestedTokens = l.Burst, q.per, l.Cost
	if l.Fixed && !l.Exempt {
		li.Count = limit.Param(strconv.FormatInt(l.Values.Burst, 10))
		li.RequestedTokens = limit.Param(strconv.FormatInt(l.Values.Requested, 10))
	}
	return li
}

// BucketInfo shows what is left of its count, and its usage in its
// current period (quotaPart); its count is not a burst.
func (q *Kind) BucketInfo(b limit.Bucket, v limit.View) limit.BucketInfo {
	info := limit.TokenInfo(b, v)
	info.BurstCapacity = 0 // its count is in quota
	info.KindView = quotaPart{q.view(b, v, time.Now())}
	return info
}

// quotaPart is a quota's part of its bucket's admin view.
type quotaPart struct {
	Quota *quotaInfo `json:"quota"`
}

// quotaInfo is a client's quota in its current period: its count, what
// it used (past the count when responses cost more than they reserved)
// and what is left, when the period started and when it renews (RFC
// 3339, in the quota's time zone), and the seconds until then.
type quotaInfo struct {
	Per         string  `json:"per"`
	Count       int64   `json:"count"`
	Used        int64   `json:"used"`
	Remaining   int64   `json:"remaining"`
	PeriodStart string  `json:"period_start"`
	ResetsAt    string  `json:"resets_at"`
	ResetsIn    float64 `json:"resets_in"`
}

// view is a quota's admin view at now, from what it holds (view).
func (q *Kind) view(b limit.Bucket, view limit.View, now time.Time) *quotaInfo {
	start, end, _ := period(&b).span(now.UnixMicro())
	loc := q.period.Location()
	left := int64(math.Floor(view.Tokens))
	return &quotaInfo{
		Per: q.per, Count: b.Values.Burst, Used: b.Values.Burst - left, Remaining: max(0, left),
		PeriodStart: time.UnixMicro(start).In(loc).Format(time.RFC3339),
		ResetsAt:    time.UnixMicro(end).In(loc).Format(time.RFC3339),
		ResetsIn:    float64(end-now.UnixMicro()) / 1e6,
	}
}

// Jitter applies reset_jitter to a refused request's bucket: a quota
// that refuses until its boundary says to come back up to jitter later,
// so that its clients do not all return in the boundary's second (the
// herd the IETF draft warns of). It lengthens the quota's wait, which
// Retry-After, RateLimit's t and {http.rate_limit.retry_after} all say.
// Each client's share of the jitter follows from its key, the same on
// every instance and every refusal, so a client is told one time, and the
// clients of a quota spread evenly.
func (*Kind) Jitter(b limit.Bucket, jitter time.Duration) limit.Bucket {
	if period(&b) == nil || b.Unknown || b.RetryAfter <= 0 {
		return b
	}
	h := fnv.New64a()
	h.Write([]byte(b.Key))
	b.RetryAfter += time.Duration(h.Sum64() % uint64(jitter))
	return b
}

// The quota as a kind of limit (limit.Kind), with every optional
// interface.

var (
	_ limit.Kind       = (*Kind)(nil)
	_ limit.Arithmetic = (*Kind)(nil)
	_ limit.Charged    = (*Kind)(nil)
	_ limit.Remembered = (*Kind)(nil)
	_ limit.Jittered   = (*Kind)(nil)
)

func (*Kind) BurstName() string { return "count" }

func (*Kind) ResolveValues(_, count, requested string) (limit.Values, bool, error) {
	return resolveValues(count, requested)
}

func (*Kind) ScriptArgs(v limit.Values) [3]any { return Args(v) }

// Begin names the bucket's period by the request's clock.
func (q *Kind) Begin(b limit.Bucket, shared limit.Shared) (limit.Bucket, limit.Shared) {
	b.KindRef = q.at(shared.Clock(), b.Limit)
	return b, shared
}

// AppendArgs appends "q", count and cost, then the period's bounds.
func (*Kind) AppendArgs(args []any, b limit.Bucket) []any {
	return append(append(args, b.Args[:]...), period(&b).args[:]...)
}

// ReplyWords is 1: the period the take counted in, as a shift from the
// period Caddy named (-1, 0, 1).
func (*Kind) ReplyWords() int { return 1 }

// ReadReply reads the period the quota counted in. One that counted in
// none (Redis's clock outside its periods) is a clockError.
func (*Kind) ReadReply(b limit.Bucket, reply []int64, at int) (limit.Bucket, error) {
	switch shift := reply[at]; {
	case shift > 1: // Redis time, outside the periods
		return b, &clockError{redis: shift, caddy: time.Now().UnixMicro(), bounds: period(&b).bounds}
	case shift < -1:
		return b, fmt.Errorf("unexpected script reply %v", reply)
	default:
		b.KindN = int64(shift)
		return b, nil
	}
}

// Facts are its count as the burst, spread over its period as the
// replenish rate, and its period's length as the policy's window (which
// changes with the period: a month's days): it is back at the end of
// the period it counted in, or after its wait if later.
func (*Kind) Facts(b limit.Bucket) limit.Facts {
	window := period(&b).window()
	return limit.Facts{Rate: float64(b.Values.Burst) / float64(max(window, 1)), Burst: b.Values.Burst, Requested: b.Values.Requested,
		Window: window, Reset: b.RetryAfter, RenewsAt: period(&b).end(shift(&b))}
}

// Refused: the store's answer is the whole answer.
func (*Kind) Refused(b limit.Bucket) limit.Bucket { return b }

// DenialTTL is its wait: until its period ends (with reset_jitter's share).
func (*Kind) DenialTTL(b limit.Bucket) time.Duration { return b.RetryAfter }

// CachedRemaining is what it held when refused: it renews only at its
// boundary.
func (*Kind) CachedRemaining(_ limit.Bucket, remaining int64, _ time.Duration) int64 {
	return remaining
}

// period is a quota's bucket's period (kind state: bucket.kindRef),
// whose bounds follow its args in the script call; nil before begin.
func period(b *limit.Bucket) *Period {
	p, _ := b.KindRef.(*Period)
	return p
}

// shift is the period a quota's take counted in, as the store answered
// it (bucket.kindN): -1, 0 or 1 for the one before the bucket's period,
// that one or the one after (the store's clock picks it). Its settlement
// names it.
func shift(b *limit.Bucket) int8 { return int8(b.KindN) }
