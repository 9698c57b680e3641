package ratelimit

import (
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// logThrottle lets at most `lines` log lines (at least one) through per
// interval and counts what it held back, so an outage or a flood logs a
// few lines, not one per request.
type logThrottle struct {
	every      time.Duration
	lines      int64
	window     atomic.Int64 // start of the current interval, Unix nanoseconds
	written    atomic.Int64 // lines let through in it
	suppressed atomic.Int64
}

// allow says whether a line may be written now and, if so, how many
// were held back since the last one written.
func (t *logThrottle) allow() (ok bool, suppressed int64) {
	now := time.Now().UnixNano()
	if w := t.window.Load(); now-w >= int64(t.every) && t.window.CompareAndSwap(w, now) {
		t.written.Store(0)
	}
	if t.written.Add(1) > max(t.lines, 1) {
		t.suppressed.Add(1)
		return false, 0
	}
	return true, t.suppressed.Swap(0)
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
