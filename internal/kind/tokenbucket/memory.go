package tokenbucket

import (
	"math"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// The token bucket in the process (for a store or a layer that keeps
// buckets there): a limit.State holds its tokens at a time, and expires
// when it would be full again. Every step is script.lua's checkBucket
// and takeBucket, and settle.lua's: these are the oracle the scripts are
// tested against.

// Holds says whether the bucket has the requested tokens at t, or, when
// the request may wait for it, would have them within its max wait
// (Admits).
func (Kind) Holds(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket) (limit.Bucket, bool) {
	current, at := Current(state, ok, t, b.Values)
	tokens := Refill(current, at, b.Values)
	if !b.Waits() {
		return b, tokens >= float64(b.Values.Requested)
	}
	admits, _ := Admits(tokens, b.Values)
	return b, admits
}

// Take is the bucket's part of a take at t (AnswerWaiting).
func (Kind) Take(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket, allowed bool) (limit.Bucket, limit.State, bool) {
	v := b.Values
	if !b.Waits() {
		v.MaxWait = 0 // a bucket of a kind of limit that does not wait (Bucket.Waits)
	}
	after, store, remaining, wait, goWait := AnswerWaiting(state, ok, t, v, allowed)
	b.Remaining, b.RetryAfter, b.Wait = remaining, time.Duration(wait)*time.Microsecond, time.Duration(goWait)*time.Microsecond
	return b, after, store
}

// SettleArg is the bucket's first script argument: its rate.
func (Kind) SettleArg(b limit.Bucket) any { return b.Args[0] }

// SettleHeld refills the bucket, then takes or gives back the difference
// (SettleAt); a full bucket needs no entry.
func (Kind) SettleHeld(state limit.State, ok bool, t int64, b limit.Bucket, diff, cost, maxDebt int64) (limit.State, bool, float64, float64) {
	current, at := Current(state, ok, t, b.Values)
	after, forgiven := SettleAt(current, at, b.Values, diff, maxDebt)
	return after, ok || after.Tokens < float64(b.Values.Burst), float64(cost) - forgiven, forgiven
}

// Peek is what the bucket holds at t, refilled.
func (Kind) Peek(state limit.State, ok bool, _ time.Time, t int64, b limit.Bucket) limit.View {
	v := b.Values
	if !ok || state.Expires <= t {
		return limit.View{Tokens: float64(v.Burst)}
	}
	current, at := Current(state, true, t, v)
	_, _, _, wait := TakeAt(current, at, v, false)
	return limit.View{Tokens: Refill(current, at, v), Wait: time.Duration(wait) * time.Microsecond,
		ExpiresIn: time.Duration(state.Expires-t) * time.Microsecond}
}

// SettleAt is settle.lua for one bucket at t (microseconds): refill
// by the time elapsed, then take diff tokens (diff > 0), leaving the
// bucket no lower than -maxDebt and never raising it, or give -diff back,
// capped at the burst. forgiven is what the take could not take. Every
// step is the script's, in the same order, so both agree to the bit
// (charge_test.go checks it).
func SettleAt(state limit.State, t int64, v limit.Values, diff, maxDebt int64) (after limit.State, forgiven float64) {
	tokens := Refill(state, t, v)
	var left float64
	if diff < 0 {
		left = math.Min(float64(v.Burst), tokens-float64(diff))
	} else {
		left = tokens - float64(diff)
		if floor := math.Min(tokens, -float64(maxDebt)); left < floor {
			forgiven = floor - left
			left = floor
		}
	}
	ttl := math.Max(1000, math.Ceil((float64(v.Burst)-left)*1000/v.Rate)) // milliseconds, as the key's TTL
	return limit.State{Tokens: left, At: t, Expires: t + int64(ttl)*1000}, forgiven
}

// Answer is one bucket's part of a take at t, once the request is known
// to be allowed or not: the state to store, if store, and the answer.
// state is the bucket as held, if ok.
func Answer(state limit.State, ok bool, t int64, v limit.Values, allowed bool) (after limit.State, store bool, remaining, wait int64) {
	after, store, remaining, wait, _ = AnswerWaiting(state, ok, t, v, allowed)
	return after, store, remaining, wait
}

// AnswerWaiting is Answer with the request's wait for the bucket
// (TakeWaitingAt): v.MaxWait is the request's max wait, 0 for none.
func AnswerWaiting(state limit.State, ok bool, t int64, v limit.Values, allowed bool) (after limit.State, store bool, remaining, wait, goWait int64) {
	current, at := Current(state, ok, t, v)
	after, _, remaining, wait, goWait = TakeWaitingAt(current, at, v, allowed)
	if !allowed && ok {
		after = extendOnDenial(state, after, at, v)
	}
	return after, allowed || ok && after != state, remaining, wait, goWait
}

// Current is a bucket's state for a take at t, and the time of the
// take: an absent bucket (not ok), or one past its expiry, is full at t
// (as an absent or expired Redis key); a bucket taken from after t is
// taken from at that time (see take).
func Current(state limit.State, ok bool, t int64, v limit.Values) (limit.State, int64) {
	if !ok || state.Expires <= t {
		return limit.State{Tokens: float64(v.Burst), At: t}, t
	}
	return state, max(t, state.At)
}

// Refill is what a bucket holds at t: script.lua's arithmetic, which
// also counts from t when the stored time lies ahead.
func Refill(state limit.State, t int64, v limit.Values) float64 {
	return math.Min(float64(v.Burst), state.Tokens+float64(max(0, t-state.At))*v.Rate/1000000)
}

// TakeAt is script.lua for one bucket at time t (microseconds):
// refill by the time elapsed, take the requested tokens when take says
// so, and answer the remaining whole tokens and the microseconds until
// the bucket holds its requested tokens again. The state after holds
// when the bucket would be full again. Every step is the script's, in the
// same order, so that both agree to the bit (script_test.go checks it).
func TakeAt(state limit.State, t int64, v limit.Values, take bool) (after limit.State, took bool, remaining, wait int64) {
	after, took, remaining, wait, _ = TakeWaitingAt(state, t, v, take)
	return after, took, remaining, wait
}

// TakeWaitingAt is TakeAt for a request that may wait up to v.MaxWait
// (0: none, TakeAt's) for the bucket: one it cannot admit now, but
// could within its max wait (Admits), takes its tokens now all the same,
// below zero, and goWait is the microseconds until the request goes on,
// when the bucket is back to zero. A refused one takes nothing, and
// wait is then how long until a take would go on at once (the request
// fits within its max wait that much sooner). script.lua's waiting form
// ("w"), step for step.
//
// The bound stays exact, counted at the go-times (g = a + d, the time
// a of the take plus its wait d = -level/rate just after it, rounded up
// to the microsecond): over any interval [s, s+T], the requests whose
// go-times fall in it take at most burst + rate*T. Go-times follow the
// takes' order (a later take finds the level lower by its tokens less
// the refill in between, so its bucket is back to zero no sooner). Let
// i be the first of them, m the last; every take between them goes in
// the interval too. From just before i's take to just after m's, the
// level rose by at most rate*(a_m - a_i) (refill) and fell by the sum S
// of their tokens: S <= L(a_i-) - L(a_m+) + rate*(a_m - a_i). After m's
// take -L(a_m+) <= rate*(g_m - a_m) (m waits until its level is back to
// zero; one that went at once left it at zero or above). And either i
// went at once, L(a_i-) <= burst and g_i = a_i, or it waited, L(a_i-) =
// r_i - rate*(g_i - a_i) with r_i <= burst. Either way S <= burst +
// rate*(g_m - g_i) <= burst + rate*T (to the microsecond the wait is
// rounded up to). A take that went on later than its go-time could break
// it: each request must go on at its wait, not later than the next.
func TakeWaitingAt(state limit.State, t int64, v limit.Values, take bool) (after limit.State, took bool, remaining, wait, goWait int64) {
	tokens := Refill(state, t, v)
	requested := float64(v.Requested)
	if take {
		switch {
		case tokens >= requested:
			tokens -= requested
			took = true
		case v.MaxWait > 0:
			if admits, d := Admits(tokens, v); admits {
				tokens -= requested
				took, goWait = true, d
			}
		}
	}
	if tokens < requested {
		wait = int64(math.Ceil((requested - tokens) * 1000000 / v.Rate))
	}
	ttl := math.Max(1000, math.Ceil((float64(v.Burst)-tokens)*1000/v.Rate)) // milliseconds, as the key's TTL
	return limit.State{Tokens: tokens, At: t, Expires: t + int64(ttl)*1000}, took, max(0, int64(math.Floor(tokens))), wait, goWait
}

// Admits says whether a bucket holding tokens admits a request that may
// wait up to v.MaxWait: at once, or within its max wait; wait is the
// microseconds until the bucket, less the request's tokens, is back to
// zero (0 when it holds them), rounded up, as script.lua's untilHolds
// counts it: the request's wait if taken now, and the wait of a refusal.
func Admits(tokens float64, v limit.Values) (admits bool, wait int64) {
	after := tokens - float64(v.Requested)
	if after >= 0 {
		return true, 0
	}
	wait = int64(math.Ceil((0 - after) * 1000000 / v.Rate))
	return wait <= MaxWaitMicros(v.MaxWait), wait
}

// MaxWaitMicros is a max wait as the script counts it: whole
// microseconds, rounded down.
func MaxWaitMicros(d time.Duration) int64 { return int64(d / time.Microsecond) }

// extendOnDenial is what a denial at t leaves of a held bucket: its
// state, unchanged, unless the values now in force (a slower plan than
// the one it was taken at) need it to live longer to refill; then it
// expires as after (TakeAt's) says. script.lua's PEXPIRE, with its
// millisecond of slack for the rounding of expiries: at unchanged values
// a denial changes nothing.
func extendOnDenial(state, after limit.State, t int64, v limit.Values) limit.State {
	fill := math.Ceil((float64(v.Burst) - after.Tokens) * 1000 / v.Rate) // milliseconds, as the script's
	if state.Expires > t && float64(state.Expires-t)+1000 < fill*1000 {
		state.Expires = after.Expires
	}
	return state
}
