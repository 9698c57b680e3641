package ratelimit

import (
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// decision is what the limiter decided for a request; it labels the
// metrics and fills {http.rate_limit.result}.
type decision uint8

const (
	decisionAllowed      decision = iota // tokens taken
	decisionDenied                       // bucket empty (or burst_capacity 0)
	decisionEmptyKey                     // the key resolved to nothing
	decisionErrorAllowed                 // Redis failed, on_error allow
	decisionErrorDenied                  // Redis failed, on_error deny
	decisionShadowDenied                 // would be denied; shadow mode let it pass
	numDecisions
)

var decisionNames = [numDecisions]string{"allowed", "denied", "empty_key", "error_allowed", "error_denied", "shadow_denied"}

func (d decision) String() string { return decisionNames[d] }

// decisionValues are the decisions as placeholder values, boxed once.
var decisionValues = func() (v [numDecisions]any) {
	for d := range numDecisions {
		v[d] = d.String()
	}
	return v
}()

// record makes a decision visible: placeholders, the metric and a debug
// line. retry is set on denials.
func (h *Handler) record(repl *caddy.Replacer, d decision, key string, remaining int64, retry time.Duration) {
	repl.Set("http.rate_limit.zone", h.zoneValue)
	repl.Set("http.rate_limit.result", decisionValues[d])
	repl.Set("http.rate_limit.limit", h.limitValue)
	if d != decisionEmptyKey {
		repl.Set("http.rate_limit.remaining", remaining)
	}
	if (d == decisionDenied || d == decisionShadowDenied) && retry > 0 {
		repl.Set("http.rate_limit.retry_after", ceilSeconds(retry))
	}
	if h.LogKey && key != "" {
		repl.Set("http.rate_limit.key", h.clientKey(key))
	} else {
		repl.Set("http.rate_limit.key", "") // empty, not left as literal text
	}
	if h.metrics != nil {
		h.metrics.requests[d].Inc()
	}
	if ce := h.logger.Check(zap.DebugLevel, "rate limit decision"); ce != nil {
		fields := []zap.Field{zap.String("zone", h.Zone), zap.Stringer("result", d), zap.Int64("remaining", remaining)}
		if h.LogKey && key != "" { // an empty key has no prefix to cut
			fields = append(fields, zap.String("key", h.clientKey(key)))
		}
		ce.Write(fields...)
	}
}

// shadowLogEvery is how often one key's shadow denials are logged.
const shadowLogEvery = 5 * time.Second

// logShadowDenial logs at info level that shadow mode let a request pass
// that enforcement would deny, at most once per key per shadowLogEvery
// and ten times a second per handler.
func (h *Handler) logShadowDenial(key string, res Result) {
	if !h.shadowKeys.allow(key, time.Now()) {
		return
	}
	ok, suppressed := h.shadowLines.allow()
	if !ok {
		return
	}
	fields := []zap.Field{zap.String("zone", h.Zone), zap.Int64("remaining", res.Remaining),
		zap.Int64("retry_after", ceilSeconds(res.RetryAfter))}
	if h.LogKey {
		fields = append(fields, zap.String("key", h.clientKey(key)))
	}
	fields = append(fields, suppressedField(suppressed))
	h.logger.Info("shadow mode: request would be rate limited", fields...)
}

// clientKey is the resolved key without the Redis prefix.
func (h *Handler) clientKey(redisKey string) string { return redisKey[len(h.bucketPrefix):] }
