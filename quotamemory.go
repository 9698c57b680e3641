package ratelimit

import (
	"math"
	"time"
)

// The memory store's quota: a bucketState holds the tokens used (in
// tokens) in the period that starts at `at` (Unix microseconds, not the
// store's clock), and expires, on the store's clock, shortly after the
// period ends. Every step is the script's.

// quotaUsed is what a held quota used in the period starting at start:
// nothing when it is absent, expired, or counts another period.
func quotaUsed(state bucketState, ok bool, t, start int64) float64 {
	if !ok || state.expires <= t || state.at != start {
		return 0
	}
	return state.tokens
}

// takeQuota is the script's quota at Unix time wall (t on the store's
// clock), in the period from start to end: take the requested tokens when
// take says so and they fit, and answer what is left and the
// microseconds until the period ends when they do not fit.
func takeQuota(used float64, start, end, wall, t int64, v limitValues, take bool) (after bucketState, took bool, remaining, wait int64) {
	requested, count := float64(v.requested), float64(v.burst)
	if take && used+requested <= count {
		used += requested
		took = true
	}
	if used+requested > count {
		wait = end - wall
	}
	expires := t + max(0, end-wall) + int64(quotaKeySlack/time.Microsecond)
	return bucketState{tokens: used, at: start, expires: expires}, took, max(0, int64(math.Floor(count-used))), wait
}

// take is a quota's part of a memory store take at now (t on the
// store's clock), once the request is known to be allowed or not (see
// settle for buckets); it notes in b the period it counted in, as the
// script answers it. A denial stores nothing.
func (*quota) take(state bucketState, ok bool, now time.Time, t int64, b bucket, allowed bool) (bucket, bucketState, bool) {
	wall := now.UnixMicro()
	start, end, shift := period(&b).span(wall)
	b.kindN = int64(shift)
	after, _, remaining, wait := takeQuota(quotaUsed(state, ok, t, start), start, end, wall, t, b.values, allowed)
	b.remaining, b.retryAfter = remaining, time.Duration(wait)*time.Microsecond
	return b, after, allowed
}

// holds says whether a held quota has room for the request at now, in
// the period now is in (quotaAt).
func (*quota) holds(state bucketState, ok bool, now time.Time, t int64, b bucket) (bucket, bool) {
	quotaAt(&b, now)
	start, _, _ := period(&b).span(now.UnixMicro())
	return b, quotaUsed(state, ok, t, start)+float64(b.values.requested) <= float64(b.values.burst)
}

// peek is a held quota as the admin API shows it: tokens is what is
// left of the count.
func (*quota) peek(state bucketState, ok bool, now time.Time, t int64, b bucket) bucketView {
	wall := now.UnixMicro()
	start, end, _ := period(&b).span(wall)
	used := quotaUsed(state, ok, t, start)
	_, _, _, wait := takeQuota(used, start, end, wall, t, b.values, false)
	view := bucketView{tokens: float64(b.values.burst) - used, wait: time.Duration(wait) * time.Microsecond}
	if ok && state.expires > t {
		view.expiresIn = time.Duration(state.expires-t) * time.Microsecond
	}
	return view
}

// settleQuotaUse is settle.lua's quota: take diff more (up to count +
// maxDebt, beyond which it is forgiven, never lowering what was used) or
// give -diff back (down to nothing), in the period the quota counts.
func settleQuotaUse(state bucketState, v limitValues, diff, maxDebt int64) (after bucketState, forgiven float64) {
	used := state.tokens
	left := math.Max(0, used+float64(diff))
	if ceiling := math.Max(used, float64(v.burst+maxDebt)); left > ceiling {
		forgiven, left = left-ceiling, ceiling
	}
	state.tokens = left
	return state, forgiven
}

// settleArg is "q" and the start of the period the reservation was taken
// in: settled only in that period.
func (*quota) settleArg(b bucket) any { return period(&b).settleKinds[shift(&b)+1] }

// settleHeld settles in the period the reservation was taken in
// (settleQuotaUse). When its period is over, or it was reset, or it
// counts another period than the reservation's, nothing settles, and the
// reservation is what it charged.
func (*quota) settleHeld(state bucketState, ok bool, t int64, b bucket, diff, cost, maxDebt int64) (bucketState, bool, float64, float64) {
	if !ok || state.expires <= t || state.at != period(&b).bounds[shift(&b)+1] {
		return state, false, float64(b.values.requested), 0
	}
	after, forgiven := settleQuotaUse(state, b.values, diff, maxDebt)
	return after, true, float64(cost) - forgiven, forgiven
}
