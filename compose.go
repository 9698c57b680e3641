package ratelimit

import (
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/layer"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
)

// The composition: which kinds of limit a handler reads from its config,
// and how its stack of a store and layers is built. Each list is here,
// in its order, and nowhere else; the kinds, stores and layers are
// packages under internal/ that know nothing of the handler.

func init() {
	// A bucket of no limit (one a layer makes for calls of its own) is a
	// token bucket.
	limit.Plain = tokenbucket.Kind{}

	// The kinds, in the order their limits come among a handler's, and so
	// among a request's buckets: those held while served come last.
	kindConfigs = []kindConfig{
		{configs: bucketConfigs, check: checkBuckets},                                                 // limit, and the handler's own
		{configs: quotaConfigs, check: (*Handler).checkQuotas},                                        // quota
		{configs: concurrentConfigs, check: (*Handler).checkConcurrent, zoneText: concurrentZoneText}, // concurrent
	}
	// Collectors of a kind's own, beside the handler's.
	metricParts = []metricPart{{collector: inFlightGauge, zone: inFlightSeries}}
}

// kindConfigs are the kinds of limit, in the order their limits come.
var kindConfigs []kindConfig

// buildStore builds the handler's stack once its parts are set up
// (Provision): the store that keeps its buckets (none when every limit
// blocks: nothing ever asks it), then each layer its config asks for,
// over the stack so far, from the bottom up.
func (h *Handler) buildStore() {
	var s limit.Store = noStore{}
	switch {
	case h.memory != nil: // store memory
		s = h.memory.For(storeReports{h}, true)
	case h.limiter != nil: // Redis
		s = redisstore.NewStore(h.limiter, h.groups, h.holding, h.redisReport())
	}
	if h.useDenyCache && h.limiter != nil { // the deny cache, unless a request's Cluster groups are taken one by one (useDenyCache)
		s = layer.Deny(s, h.denied, h.perRequest)
	}
	if h.leases != nil { // lease: takes the place of the deny layer, whose refusals it asks itself
		s = h.leases.Layer(s)
	}
	h.store = h.withFallback(s) // on_error tops every stack: it decides what the stack below could not
}
