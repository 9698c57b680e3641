package ratelimit

import (
	"fmt"

	"github.com/caddy-redis/ratelimit/internal/logs"
	"go.uber.org/zap"
)

// Values of on_error.
const (
	onErrorAllow = "allow"
	onErrorDeny  = "deny"
	onErrorLocal = "local"
)

func checkOnError(v string) error {
	if v != onErrorAllow && v != onErrorDeny && v != onErrorLocal {
		return fmt.Errorf("on_error '%s': want 'allow', 'deny' or 'local'", v)
	}
	return nil
}

// fallbackDefault fills in on_error when the config leaves it out.
func (h *Handler) fallbackDefault() {
	if h.OnError == "" {
		h.OnError = onErrorAllow
	}
}

// warnFailed logs, for a store that could not decide a request, what
// failed (words, err), and that the request follows on_error; the store
// throttles it (suppressed lines before it).
func (h *Handler) warnFailed(words string, err error, suppressed int64) {
	h.logger.Warn(words+"; following on_error", zap.String("zone", h.Zone),
		h.fallbackField(), zap.Error(err), logs.Suppressed(suppressed))
}

// What a store's requests do while it fails, as its warnings and errors
// say it, and the field of its warnings that names the fallback.
const (
	followFallback  = "follow on_error"
	followsFallback = "follows on_error"
)

func (h *Handler) fallbackField() zap.Field { return zap.String("on_error", h.OnError) }
