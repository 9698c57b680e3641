package quota

import (
	"math"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// The memory store's quota: a limit.State holds the tokens used (in
// tokens) in the period that starts at `at` (Unix microseconds, not the
// store's clock), and expires, on the store's clock, shortly after the
// period ends. Every step is the script's.

// quotaUsed is what a held quota used in the period starting at start:
// nothing when it is absent, expired, or counts another period.
func quotaUsed(state limit.State, ok bool, t, start int64) float64 {
	if !ok || state.Expires <= t || state.At != start {
		return 0
	}
	return state.Tokens
}

// takeQuota is the script's quota at Unix time wall (t on the store's
// clock), in the period from start to end: take the requested tokens when
// take says so and they fit, and answer what is left and the
// microseconds until the period ends when they do not fit.
func takeQuota(used float64, start, end, wall, t int64, v limit.Values, take bool) (after limit.State, took bool, remaining, wait int64) {
	requested, count := float64(v.Requested), float64(v.Burst)
	if take && used+requested <= count {
		used += requested
		took = true
	}
	if used+requested > count {
		wait = end - wall
	}
	expires := t + max(0, end-wall) + int64(KeySlack/time.Microsecond)
	return limit.State{Tokens: used, At: start, Expires: expires}, took, max(0, int64(math.Floor(count-used))), wait
}

// settleQuotaUse is settle.lua's quota: take diff more (up to count +
// maxDebt, beyond which it is forgiven, never lowering what was used) or
// give -diff back (down to nothing), in the period the quota counts.
func settleQuotaUse(state limit.State, v limit.Values, diff, maxDebt int64) (after limit.State, forgiven float64) {
	used := state.Tokens
	left := math.Max(0, used+float64(diff))
	if ceiling := math.Max(used, float64(v.Burst+maxDebt)); left > ceiling {
		forgiven, left = left-ceiling, ceiling
	}
	state.Tokens = left
	return state, forgiven
}

// Take is a quota's part of a memory store take at now (t on the
// store's clock), once the request is known to be allowed or not (see
// tokenbucket.Answer for buckets); it notes in b the period it counted in, as the
// script answers it. A denial stores nothing.
func (*Kind) Take(state limit.State, ok bool, now time.Time, t int64, b limit.Bucket, allowed bool) (limit.Bucket, limit.State, bool) {
	wall := now.UnixMicro()
	start, end, shift := period(&b).span(wall)
	b.KindN = int64(shift)
	after, _, remaining, wait := takeQuota(quotaUsed(state, ok, t, start), start, end, wall, t, b.Values, allowed)
	b.Remaining, b.RetryAfter = remaining, time.Duration(wait)*time.Microsecond
	return b, after, allowed
}

// Holds says whether a held quota has room for the request at now, in
// the period now is in (quotaAt).
func (*Kind) Holds(state limit.State, ok bool, now time.Time, t int64, b limit.Bucket) (limit.Bucket, bool) {
	quotaAt(&b, now)
	start, _, _ := period(&b).span(now.UnixMicro())
	return b, quotaUsed(state, ok, t, start)+float64(b.Values.Requested) <= float64(b.Values.Burst)
}

// Peek is a held quota as the admin API shows it: tokens is what is
// left of the count.
func (*Kind) Peek(state limit.State, ok bool, now time.Time, t int64, b limit.Bucket) limit.View {
	wall := now.UnixMicro()
	start, end, _ := period(&b).span(wall)
	used := quotaUsed(state, ok, t, start)
	_, _, _, wait := takeQuota(used, start, end, wall, t, b.Values, false)
	view := limit.View{Tokens: float64(b.Values.Burst) - used, Wait: time.Duration(wait) * time.Microsecond}
	if ok && state.Expires > t {
		view.ExpiresIn = time.Duration(state.Expires-t) * time.Microsecond
	}
	return view
}

// SettleArg is "q" and the start of the period the reservation was taken
// in: settled only in that period.
func (*Kind) SettleArg(b limit.Bucket) any { return period(&b).settleKinds[shift(&b)+1] }

// SettleHeld settles in the period the reservation was taken in
// (settleQuotaUse). When its period is over, or it was reset, or it
// counts another period than the reservation's, nothing settles, and the
// reservation is what it charged.
func (*Kind) SettleHeld(state limit.State, ok bool, t int64, b limit.Bucket, diff, cost, maxDebt int64) (limit.State, bool, float64, float64) {
	if !ok || state.Expires <= t || state.At != period(&b).bounds[shift(&b)+1] {
		return state, false, float64(b.Values.Requested), 0
	}
	after, forgiven := settleQuotaUse(state, b.Values, diff, maxDebt)
	return after, true, float64(cost) - forgiven, forgiven
}
