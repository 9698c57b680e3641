package ratelimit

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// logThrottle lets at most `lines` log lines (at least one) through per
// interval and counts what it held back, so an outage or a flood logs a
// few lines, not one per request. A mutex, not atomics: starting an
// interval and counting its first line must be one step, or calls that
// meet the new interval together each count from zero and pass.
type logThrottle struct {
	every      time.Duration
	lines      int64
	mu         sync.Mutex
	window     time.Time // start of the current interval
	written    int64     // lines let through in it
	suppressed int64
}

// allow says whether a line may be written now and, if so, how many
// were held back since the last one written.
func (t *logThrottle) allow() (ok bool, suppressed int64) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	if now.Sub(t.window) >= t.every {
		t.window, t.written = now, 0
	}
	if t.written++; t.written > max(t.lines, 1) {
		t.suppressed++
		return false, 0
	}
	suppressed, t.suppressed = t.suppressed, 0
	return true, suppressed
}

// suppressedField reports the lines a throttle held back, if any.
func suppressedField(n int64) zap.Field {
	if n == 0 {
		return zap.Skip()
	}
	return zap.Int64("suppressed", n)
}

// keyThrottleSize bounds the keys a keyThrottle remembers; past it, the
// table starts afresh (at worst a key is logged once more).
const keyThrottleSize = 16384

// keyThrottle lets one event per key through per interval: shadow mode
// logs a client's would-be denials once every few seconds, not per
// request.
type keyThrottle struct {
	every time.Duration
	mu    sync.Mutex
	last  map[string]time.Time
}

func newKeyThrottle(every time.Duration) *keyThrottle {
	return &keyThrottle{every: every, last: make(map[string]time.Time)}
}

// allow says whether key's event may pass at now, and if so starts its
// interval.
func (t *keyThrottle) allow(key string, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if at, ok := t.last[key]; ok && now.Sub(at) < t.every {
		return false
	}
	if len(t.last) >= keyThrottleSize {
		clear(t.last)
	}
	t.last[key] = now
	return true
}
