package ratelimit

import (
	"sync/atomic"
	"time"
)

// Circuit breaker settings: after breakerThreshold Redis failures in a
// row, requests skip Redis (and follow on_error at once) for
// breakerCooldown, after which one request probes Redis again.
const (
	breakerThreshold = 5
	breakerCooldown  = 500 * time.Millisecond
)

// breaker keeps a failing Redis from costing every request its timeout.
// The closed path is one atomic load. It only counts: whoever reports a
// success or a failure learns whether that closed or opened it, and
// logs it.
type breaker struct {
	failures atomic.Int64
	// openUntil is when the next probe may go, in Unix nanoseconds;
	// zero while closed.
	openUntil atomic.Int64
}

// allow says whether this request may call Redis. While open, the first
// request after each cooldown is let through as the probe.
func (b *breaker) allow() bool {
	until := b.openUntil.Load()
	if until == 0 {
		return true
	}
	now := time.Now().UnixNano()
	return now >= until && b.openUntil.CompareAndSwap(until, now+int64(breakerCooldown))
}

// success records an answer from Redis; closed says it closed the breaker.
func (b *breaker) success() (closed bool) {
	if b.failures.Load() != 0 {
		b.failures.Store(0)
	}
	return b.openUntil.Load() != 0 && b.openUntil.Swap(0) != 0
}

// failure records a Redis failure; opened says it opened the breaker,
// after failures in a row.
func (b *breaker) failure() (opened bool, failures int64) {
	n := b.failures.Add(1)
	if n < breakerThreshold || b.openUntil.Load() != 0 {
		return false, n
	}
	return b.openUntil.CompareAndSwap(0, time.Now().Add(breakerCooldown).UnixNano()), n
}

func (b *breaker) isOpen() bool { return b.openUntil.Load() != 0 }
