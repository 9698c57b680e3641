package ratelimit

import (
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// emptyValue is the empty string as a placeholder value, boxed once.
var emptyValue any = ""

// record makes a decision visible: placeholders, the metric and a debug
// line. buckets[described] is the bucket the placeholders describe; none
// when no bucket was consulted (described < 0).
func (h *Handler) record(repl *caddy.Replacer, d limit.Decision, buckets []limit.Bucket, described int) {
	h.recordWaited(repl, d, buckets, described, 0)
}

// recordWaited is record for a request that waited (max_wait), in a slot
// queue and for its tokens, waited in all.
func (h *Handler) recordWaited(repl *caddy.Replacer, d limit.Decision, buckets []limit.Bucket, described int, waited time.Duration) {
	p := placeholders{h: h, repl: repl, seq: placeholderSeq.Add(1), decision: d, waitedMs: int32(waited / time.Millisecond)}
	var b *limit.Bucket
	if described >= 0 && described < len(buckets) {
		b = &buckets[described]
	}
	label := 0
	if b != nil {
		p.limit, p.burst, p.remaining = b.Limit, b.Values.Burst, b.Remaining
		p.refused = d == limit.DecisionDenied || d == limit.DecisionShadowDenied || d == limit.DecisionFallbackDenied
		if p.refused {
			p.retryAfter, label = ceilSeconds(limit.FitsIn(buckets)), b.Limit.Index+1
		}
		if h.LogKey {
			p.key = b.ClientKey()
		}
	}
	// A provider, not repl.Set: the request's replacer map then holds
	// nothing of ours (its first entry allocates it), and the values are
	// boxed only when read (BenchmarkServeHTTPMemory 6 -> 5 allocs, 592 ->
	// 392 B, about 0.18 µs less per request).
	repl.Map(p.replace)
	if h.metrics != nil {
		h.metrics.requests[d][label].Inc()
	}
	// Checked first: building the fields costs 1 alloc, 192 B per request.
	// The level first, then Check: Check's stack frame alone is 1,176
	// bytes (see warnFull for what a deeper stack costs).
	if h.logger.Core().Enabled(zapcore.DebugLevel) {
		h.logDecision(d, b)
	}
}

// logDecision writes the debug line of a decision; out of record, whose
// stack frame would otherwise hold the fields on every request (584 -> 184
// bytes; see warnFull).
func (h *Handler) logDecision(d limit.Decision, b *limit.Bucket) {
	ce := h.logger.Check(zap.DebugLevel, "rate limit decision")
	if ce == nil {
		return
	}
	fields := []zap.Field{zap.String("zone", h.Zone), zap.Stringer("result", d)}
	if b != nil {
		fields = append(fields, zap.Int64("remaining", b.Remaining))
		if b.Limit.Name != "" {
			fields = append(fields, zap.String("limit", b.Limit.Name))
		}
		if h.LogKey {
			fields = append(fields, zap.String("key", b.ClientKey()))
		}
	}
	ce.Write(fields...)
}

// placeholders are the values of one handler's {http.rate_limit.*}
// placeholders for one request, which its replacer asks for by name.
//
// Caddy asks a replacer's providers in the order they were added, and
// takes the first answer; but when several rate_limit handlers see one
// request, the placeholders are the last one's (and the earlier one's
// where the last has none, as retry_after when it admitted). So each
// answer is first asked of the handlers that came later: seq orders them.
type placeholders struct {
	h          *Handler
	repl       *caddy.Replacer
	seq        uint64
	limit      *limit.Limit // the bucket described; nil for none
	key        string       // with log_key
	burst      int64
	remaining  int64
	retryAfter int64 // seconds, on a refusal
	decision   limit.Decision
	refused    bool
	waitedMs   int32 // with max_wait: how long the request waited (in the word decision and refused leave: the same 80 bytes)
}

// placeholderSeq numbers the placeholders as they are made: of two for
// one request, the later has the higher number.
var placeholderSeq atomic.Uint64

const (
	placeholderPrefix = "http.rate_limit."
	// laterPrefix asks for a placeholder of the handlers after one:
	// "http.rate_limit.\x00<seq>\x00<name>". No config can spell it.
	laterPrefix = placeholderPrefix + "\x00"
)

// replace is the caddy.ReplacerFunc of the placeholders.
func (p placeholders) replace(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	if rest, ok := strings.CutPrefix(name, "\x00"); ok {
		seq, name, _ := strings.Cut(rest, "\x00")
		if n, err := strconv.ParseUint(seq, 10, 64); err != nil || p.seq <= n {
			return nil, false // asked of the handlers after n, and this one is not
		}
		return p.value(name)
	}
	return p.value(name)
}

// value is the placeholder's value: a later handler's, else this one's.
func (p placeholders) value(name string) (any, bool) {
	if v, ok := p.repl.Get(laterPrefix + strconv.FormatUint(p.seq, 10) + "\x00" + name); ok {
		return v, true
	}
	switch name {
	case "zone":
		return p.h.zoneValue, true
	case "result":
		return limit.DecisionValues[p.decision], true
	case "limit_name":
		if p.refused {
			return p.limit.NameValue, true
		}
		return emptyValue, true
	case "key":
		return p.key, true // empty without log_key (or a bucket), not left as literal text
	}
	if p.limit == nil {
		return nil, false
	}
	switch name {
	case "limit":
		if p.limit.Fixed {
			return p.limit.BurstValue, true
		}
		return p.burst, true
	case "remaining":
		return p.remaining, true
	case "waited":
		return int64(p.waitedMs), true
	case "retry_after":
		if p.refused && p.retryAfter > 0 {
			return p.retryAfter, true
		}
	}
	return nil, false
}

// shadowLogEvery is how often one key's shadow denials are logged.
const shadowLogEvery = 5 * time.Second

// logShadowDenial logs at info level that shadow mode let a request pass
// that enforcement would deny, at most once per key per shadowLogEvery
// and ten times a second per handler.
func (h *Handler) logShadowDenial(buckets []limit.Bucket, described int) {
	b := &buckets[described]
	if !h.shadowKeys.Allow(b.Key, time.Now()) {
		return
	}
	ok, suppressed := h.shadowLines.Allow()
	if !ok {
		return
	}
	fields := []zap.Field{zap.String("zone", h.Zone), zap.Int64("remaining", b.Remaining),
		zap.Int64("retry_after", ceilSeconds(limit.FitsIn(buckets)))}
	if b.Limit.Name != "" {
		fields = append(fields, zap.String("limit", b.Limit.Name))
	}
	if h.LogKey {
		fields = append(fields, zap.String("key", b.ClientKey()))
	}
	fields = append(fields, logs.Suppressed(suppressed))
	h.logger.Info("shadow mode: request would be rate limited", fields...)
}
