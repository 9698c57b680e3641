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
	decisionAllowed           decision = iota // tokens taken
	decisionDenied                            // a bucket short (or burst_capacity 0)
	decisionExempt                            // the rate resolved to `unlimited`
	decisionInvalid                           // a value from the request out of range
	decisionEmptyKey                          // the key resolved to nothing
	decisionErrorAllowed                      // Redis failed, on_error allow
	decisionErrorDenied                       // Redis failed, on_error deny
	decisionShadowDenied                      // would be denied; shadow mode let it pass
	decisionOverflow                          // store memory full: a new client follows on_error
	decisionErrorLocalAllowed                 // Redis failed, on_error local admitted it
	decisionErrorLocalDenied                  // Redis failed, on_error local refused it
	numDecisions
)

var decisionNames = [numDecisions]string{"allowed", "denied", "exempt", "invalid", "empty_key", "error_allowed",
	"error_denied", "shadow_denied", "overflow", "error_local_allowed", "error_local_denied"}

func (d decision) String() string { return decisionNames[d] }

// decisionValues are the decisions as placeholder values, boxed once (1
// alloc per request: BenchmarkServeHTTPAllowed 17 -> 16).
var decisionValues = func() (v [numDecisions]any) {
	for d := range numDecisions {
		v[d] = d.String()
	}
	return v
}()

// emptyValue is the empty string as a placeholder value, boxed once.
var emptyValue any = ""

// record makes a decision visible: placeholders, the metric and a debug
// line. buckets[described] is the bucket the placeholders describe; none
// when no bucket was consulted (described < 0).
func (h *Handler) record(repl *caddy.Replacer, d decision, buckets []bucket, described int) {
	var b *bucket
	if described >= 0 && described < len(buckets) {
		b = &buckets[described]
	}
	refused := b != nil && (d == decisionDenied || d == decisionShadowDenied || d == decisionErrorLocalDenied)
	repl.Set("http.rate_limit.zone", h.zoneValue)
	repl.Set("http.rate_limit.result", decisionValues[d])
	limitName, label := emptyValue, 0
	if refused {
		limitName, label = b.limit.nameValue, b.limit.index+1
	}
	repl.Set("http.rate_limit.limit_name", limitName)
	if b != nil {
		if b.limit.fixed {
			repl.Set("http.rate_limit.limit", b.limit.burstValue)
		} else {
			repl.Set("http.rate_limit.limit", b.values.burst)
		}
		repl.Set("http.rate_limit.remaining", b.remaining)
	}
	if refused {
		if retry := retryAfter(buckets); retry > 0 {
			repl.Set("http.rate_limit.retry_after", ceilSeconds(retry))
		}
	}
	if h.LogKey && b != nil {
		repl.Set("http.rate_limit.key", b.clientKey())
	} else {
		repl.Set("http.rate_limit.key", emptyValue) // empty, not left as literal text
	}
	if h.metrics != nil {
		h.metrics.requests[d][label].Inc()
	}
	// Checked first: building the fields costs 1 alloc, 192 B per request.
	if ce := h.logger.Check(zap.DebugLevel, "rate limit decision"); ce != nil {
		fields := []zap.Field{zap.String("zone", h.Zone), zap.Stringer("result", d)}
		if b != nil {
			fields = append(fields, zap.Int64("remaining", b.remaining))
			if b.limit.name != "" {
				fields = append(fields, zap.String("limit", b.limit.name))
			}
			if h.LogKey {
				fields = append(fields, zap.String("key", b.clientKey()))
			}
		}
		ce.Write(fields...)
	}
}

// shadowLogEvery is how often one key's shadow denials are logged.
const shadowLogEvery = 5 * time.Second

// logShadowDenial logs at info level that shadow mode let a request pass
// that enforcement would deny, at most once per key per shadowLogEvery
// and ten times a second per handler.
func (h *Handler) logShadowDenial(buckets []bucket, described int) {
	b := &buckets[described]
	if !h.shadowKeys.allow(b.key, time.Now()) {
		return
	}
	ok, suppressed := h.shadowLines.allow()
	if !ok {
		return
	}
	fields := []zap.Field{zap.String("zone", h.Zone), zap.Int64("remaining", b.remaining),
		zap.Int64("retry_after", ceilSeconds(retryAfter(buckets)))}
	if b.limit.name != "" {
		fields = append(fields, zap.String("limit", b.limit.name))
	}
	if h.LogKey {
		fields = append(fields, zap.String("key", b.clientKey()))
	}
	fields = append(fields, suppressedField(suppressed))
	h.logger.Info("shadow mode: request would be rate limited", fields...)
}

// clientKey is the bucket's Redis key without what the limit puts around
// the client key: as logs and {http.rate_limit.key} show it.
func (b *bucket) clientKey() string {
	return b.key[len(b.limit.keyPrefix) : len(b.key)-len(b.limit.keySuffix)]
}
