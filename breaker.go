package ratelimit

import (
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Circuit breaker settings: after breakerThreshold Redis failures in a
// row, requests skip Redis (and follow on_error at once) for
// breakerCooldown, after which one request probes Redis again.
const (
	breakerThreshold = 5
	breakerCooldown  = 500 * time.Millisecond
)

// breaker keeps a failing Redis from costing every request its timeout.
// The closed path is one atomic load.
type breaker struct {
	logger   *zap.Logger
	failures atomic.Int64
	// openUntil is when the next probe may go, in Unix nanoseconds;
	// zero while closed.
	openUntil atomic.Int64
	onChange  func(open bool)
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

func (b *breaker) success() {
	if b.failures.Load() != 0 {
		b.failures.Store(0)
	}
	if b.openUntil.Load() != 0 && b.openUntil.Swap(0) != 0 {
		b.logger.Info("circuit breaker closed: Redis answers again")
		b.changed(false)
	}
}

func (b *breaker) failure() {
	n := b.failures.Add(1)
	if n < breakerThreshold || b.openUntil.Load() != 0 {
		return
	}
	if b.openUntil.CompareAndSwap(0, time.Now().Add(breakerCooldown).UnixNano()) {
		b.logger.Warn("circuit breaker opened: Redis failed repeatedly; requests skip Redis and follow on_error until it answers",
			zap.Int64("consecutive_failures", n))
		b.changed(true)
	}
}

func (b *breaker) isOpen() bool { return b.openUntil.Load() != 0 }

func (b *breaker) changed(open bool) {
	if b.onChange != nil {
		b.onChange(open)
	}
}

// throttledLog writes at most `lines` lines (at least one) per interval
// and counts what it held back, so an outage or a flood logs a few lines,
// not one per request.
type throttledLog struct {
	logger     *zap.Logger
	every      time.Duration
	lines      int64
	window     atomic.Int64 // start of the current interval, Unix nanoseconds
	written    atomic.Int64 // lines written in it
	suppressed atomic.Int64
}

func (t *throttledLog) log(level zapcore.Level, msg string, fields ...zap.Field) {
	now := time.Now().UnixNano()
	if w := t.window.Load(); now-w >= int64(t.every) && t.window.CompareAndSwap(w, now) {
		t.written.Store(0)
	}
	if t.written.Add(1) > max(t.lines, 1) {
		t.suppressed.Add(1)
		return
	}
	if n := t.suppressed.Swap(0); n > 0 {
		fields = append(fields, zap.Int64("suppressed", n))
	}
	t.logger.Log(level, msg, fields...)
}
