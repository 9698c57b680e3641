package redisstore

import (
	"time"

	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddy-redis/ratelimit/internal/redisresets"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// The reset channel (internal/redisresets): each client subscribes to
// <key_prefix>reset, on which the admin API of any instance sharing the
// Redis publishes the keys of the buckets it reset (Client.Reset), and
// drops its handlers' cached denials of them.

// resetsLogger is the handlers' logger, taken when a line is written:
// the client outlives the config whose logs it would otherwise keep.
func resetsLogger() *zap.Logger { return caddy.Log().Named("http.handlers.rate_limit") }

// resetReceiver is what the client does with what its reset channel
// brings: its watchers drop their cached denials, and what was ignored
// is logged, throttled (both warnings share one throttle).
type resetReceiver struct {
	l     *Client
	warns logs.Throttle
}

func newResetReceiver(l *Client) *resetReceiver {
	return &resetReceiver{l: l, warns: logs.Throttle{Every: 10 * time.Second}}
}

// Reset drops the cached denials of the keys. No lock is held across the
// message: the watchers are copied first, and each key is dropped on its
// own.
func (r *resetReceiver) Reset(keys []string) {
	for _, w := range r.l.watcherList() {
		w.ForgetDenials(keys)
	}
}

func (r *resetReceiver) Missed() {
	for _, w := range r.l.watcherList() {
		w.ForgetAllDenials()
	}
}

func (r *resetReceiver) TooLarge(bytes, droppedTotal int64) {
	if ok, suppressed := r.warns.Allow(); ok {
		resetsLogger().Warn("ignored a message on the reset channel: larger than a reset of one client's buckets",
			zap.String("channel", r.l.resets.Name()), zap.Int64("bytes", bytes),
			zap.Int("max_bytes", redisresets.MaxMessage), zap.Int64("ignored_total", droppedTotal),
			logs.Suppressed(suppressed))
	}
}

func (r *resetReceiver) Foreign(keys int) {
	if ok, suppressed := r.warns.Allow(); ok {
		resetsLogger().Warn("ignored keys on the reset channel without this instance's key_prefix",
			zap.String("channel", r.l.resets.Name()), zap.Int("keys", keys), zap.String("key_prefix", r.l.keyPrefix),
			logs.Suppressed(suppressed))
	}
}
