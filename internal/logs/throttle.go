// package logs keeps the handler's log lines few and safe to write: the
// throttles that let a flood log a few lines, not one per request, and
// what a message may quote of an address or of a client's value.
package logs

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// Throttle lets at most Lines log lines (at least one) through per
// interval of Every and counts what it held back, so an outage or a
// flood logs a few lines, not one per request. A mutex, not atomics: starting an interval and
// counting its first line must be one step, or calls that meet the new
// interval together each count from zero and pass.
type Throttle struct {
	Every      time.Duration // the interval
	Lines      int64         // lines let through per interval; 0 is one
	mu         sync.Mutex
	window     time.Time // start of the current interval
	written    int64     // lines let through in it
	suppressed int64
}

// Allow says whether a line may be written now and, if so, how many
// were held back since the last one written.
func (t *Throttle) Allow() (ok bool, suppressed int64) {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	if now.Sub(t.window) >= t.Every {
		t.window, t.written = now, 0
	}
	if t.written++; t.written > max(t.Lines, 1) {
		t.suppressed++
		return false, 0
	}
	suppressed, t.suppressed = t.suppressed, 0
	return true, suppressed
}

// Suppressed is the field that reports the lines a throttle held back,
// if any.
func Suppressed(n int64) zap.Field {
	if n == 0 {
		return zap.Skip()
	}
	return zap.Int64("suppressed", n)
}

// keyThrottleSize bounds the keys a KeyThrottle remembers; past it, the
// table starts afresh (at worst a key is logged once more).
const keyThrottleSize = 16384

// KeyThrottle lets one event per key through per interval: shadow mode
// logs a client's would-be denials once every few seconds, not per
// request.
type KeyThrottle struct {
	every time.Duration
	mu    sync.Mutex
	last  map[string]time.Time
}

// NewKeyThrottle returns a KeyThrottle that lets one event per key
// through every interval.
func NewKeyThrottle(every time.Duration) *KeyThrottle {
	return &KeyThrottle{every: every, last: make(map[string]time.Time)}
}

// Allow says whether key's event may pass at now, and if so starts its
// interval.
func (t *KeyThrottle) Allow(key string, now time.Time) bool {
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
