package ratelimit

import (
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"go.uber.org/zap"
)

// storeMemory is store's value for the memory store (internal/memstore):
// the buckets in the Caddy process.
const storeMemory = "memory"

// storeReports is what a memory store reports to the handler that uses
// it (memstore.Reporter): the handler's warnings and metrics.
type storeReports struct{ h *Handler }

func (r storeReports) Full() { r.h.warnFull() }

func (r storeReports) Charged(l *limit.Limit, charged, forgiven float64) {
	r.h.countCharged(l, charged, forgiven)
}

func (r storeReports) Unsettled(buckets []limit.Bucket, items []limit.Settling, err error) {
	r.h.countSettleFailure(buckets, items, err)
}

// warnFull is throttled, as a store's warnings of a failed take are.
func (h *Handler) warnFull() {
	if ok, suppressed := h.fullWarns.Allow(); ok {
		h.logger.Warn("in-memory store full: a new client's request "+followsFallback, zap.String("zone", h.Zone),
			zap.Int64("max_keys", h.MaxKeys), h.fallbackField(), logs.Suppressed(suppressed))
	}
}
