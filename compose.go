package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/concurrent"
	"github.com/caddy-redis/ratelimit/internal/kind/quota"
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/layer"
	"github.com/caddy-redis/ratelimit/internal/lease"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
)

// The composition: which kinds of limit a handler reads from its config,
// and how its stack of a store and layers is built. This file is the one
// place where the handler meets the concrete kinds, stores and layers,
// which are packages under internal/ that know nothing of the handler;
// every other file speaks internal/limit's words.

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

// The token bucket (internal/kind/tokenbucket): the handler's own limit
// and its `limits`.

func newTokenBucket() (limit.Kind, error) { return tokenbucket.Kind{}, nil }

func checkTokenBucketValues(rate, burst, requested Param, own bool) error {
	return tokenbucket.CheckValues(rate, burst, requested, own)
}

// parseRate reads a replenish_rate as written (`10`, `100/1m`) into
// tokens per second, and rateParam writes it back as the parser keeps it.
func parseRate(v string) (float64, error) { return tokenbucket.ParseRate(v) }
func rateParam(rate float64) Param        { return tokenbucket.RateParam(rate) }

// The quota (internal/kind/quota): `quota`.

func newQuota(q Quota) (limit.Kind, error) {
	return quota.New(q.Per, q.TimeZone, q.MonthDay, q.WeekStarts)
}

func checkQuotaValues(count, requested Param) error { return quota.CheckValues(count, requested) }

// The concurrent limit (internal/kind/concurrent): `concurrent`.

func newConcurrent(hold, retryAfter, maxWait time.Duration) (limit.Kind, error) {
	return concurrent.New(hold, retryAfter).WithMaxWait(maxWait), nil
}

func checkPriority(priority string) error {
	_, err := concurrent.ParsePriority(priority)
	return err
}

func checkSlots(slots string) error {
	_, err := concurrent.ParseSlots(slots)
	return err
}

// The stores, by their value of `store`: the Redis store (the default)
// and the in-process store, which keeps the buckets in this Caddy
// process.
const (
	storeRedis  = "redis"
	storeMemory = "memory"
)

// checkStore judges store with what depends on it: a redis block, and
// on_error local.
func checkStore(store string, redis bool, onError string) error {
	switch {
	case store != storeRedis && store != storeMemory:
		return fmt.Errorf("store '%s': want 'redis' or 'memory'", store)
	case store == storeMemory && redis:
		return errors.New("store 'memory' keeps the buckets in this Caddy process, so the 'redis' block has nothing to do: remove it, or use store redis")
	case store == storeMemory && onError == onErrorLocal:
		return errors.New("on_error 'local' with store 'memory': the buckets are local already; use on_error allow or deny for a full store")
	}
	return nil
}

// stack is what Provision built to decide a handler's requests: the
// store and the layers over it (store, their top), and the parts they
// are made of, which Cleanup releases.
type stack struct {
	store     limit.Store
	memory    *memstore.Store    // with store memory: the buckets
	local     *memstore.Store    // with on_error local: the buckets while Redis fails
	limiter   *redisstore.Client // nil when no limit ever asks Redis
	clientKey string             // the Redis client's, for its release
	leases    *lease.Leases      // with lease
	// denied remembers refusals (the deny cache); nil without its layer.
	denied *layer.DenyCache
	// groups are, on Cluster, the limits by hash slot, when they span
	// several; useDenyCache says whether the deny layer is used: not when
	// a request's Cluster groups are taken one by one.
	groups       [][]*limit.Limit
	useDenyCache bool
}

// buildStack builds the handler's stack once its limits are set up
// (Provision): the store that keeps its buckets (none when every limit
// blocks: nothing ever asks it), then each layer its config asks for,
// over the stack so far, from the bottom up.
func (h *Handler) buildStack(redisConfig RedisConfig) (err error) {
	if h.Store == storeMemory {
		if h.memory, err = memstore.Acquire(storeMemory, redisConfig.KeyPrefix, h.Zone, h.MaxKeys); err != nil {
			return fmt.Errorf("setting up the in-memory store: %w", err)
		}
		h.store = h.withFallback(h.memory.For(storeReports{h}, true))
		return nil
	}
	if h.OnError == onErrorLocal {
		if h.local, err = memstore.Acquire(onErrorLocal, redisConfig.KeyPrefix, h.Zone, h.MaxKeys); err != nil {
			return fmt.Errorf("setting up the local buckets of on_error local: %w", err)
		}
	}
	if !h.asksRedis() { // hard blocks only: nothing ever asks Redis
		h.store = h.withFallback(noStore{})
		return nil
	}
	if h.limiter, h.clientKey, err = acquireClient(redisConfig); err != nil {
		return fmt.Errorf("setting up the Redis client: %w", err)
	}
	h.useDenyCache = true
	if h.limiter.IsCluster() {
		h.groups = redisstore.HashSlotGroups(h.limits)
		// Buckets of a later group can refuse after an earlier group took
		// its tokens, which are then given back: a denial seen meanwhile
		// says nothing about the time tokens come back, so none is cached.
		h.useDenyCache = len(h.groups) < 2
		if len(h.groups) < 2 {
			h.groups = nil
		}
	}
	holding, perRequest := false, false
	for _, l := range h.limits {
		holding = holding || l.Held != nil
		perRequest = perRequest || !l.Fixed || l.WaitText != ""
	}
	var s limit.Store = redisstore.NewStore(h.limiter, h.groups, holding, h.redisReport())
	if h.useDenyCache { // the deny cache, unless a request's Cluster groups are taken one by one
		h.denied = layer.NewDenyCache()
		s = layer.Deny(s, h.denied, perRequest)
	}
	h.limiter.Watch(h.redisReport()) // once what it reports to is set: the deny cache drops what resets name
	if h.metrics != nil {
		watchBreakers(h.Zone, h.limiter)
	}
	if h.Lease != nil { // lease: takes the place of the deny layer, whose refusals it asks itself
		if err := h.provisionLeases(redisConfig.KeyPrefix); err != nil {
			return err
		}
		s = h.leases.Layer(s)
	}
	h.store = h.withFallback(s) // on_error tops every stack: it decides what the stack below could not
	return nil
}

// release gives back what buildStack acquired.
func (h *Handler) releaseStack() error {
	if h.memory != nil {
		return h.memory.Release()
	}
	if h.local != nil {
		_ = h.local.Release()
	}
	if h.limiter == nil {
		return nil
	}
	if h.leases != nil {
		h.leases.Close() // gives back what they hold
	}
	h.limiter.Unwatch(h.redisReport())
	if h.metrics != nil {
		unwatchBreakers(h.Zone, h.limiter)
	}
	return redisstore.Release(h.clientKey)
}

// withFallback puts the on_error layer over the handler's store.
func (h *Handler) withFallback(below limit.Store) limit.Store {
	o := layer.OnErrorOptions{FailOpen: h.failOpen}
	if h.local != nil {
		o.Local = h.local.For(storeReports{h}, false)
	}
	return layer.OnError(below, o)
}

// provisionLeases sets lease up: the leases and their give-back loop.
// On a Cluster, a bucket's lease record must share its hash slot, which
// a key_prefix with unbalanced braces prevents.
func (h *Handler) provisionLeases(keyPrefix string) error {
	if h.limiter.IsCluster() {
		for _, l := range h.limits {
			if probe := l.KeyPrefix + "x" + l.KeySuffix; redisbatch.Slot(lease.RecordKey(probe)) != redisbatch.Slot(probe) {
				return fmt.Errorf("lease with key_prefix '%s': its braces keep a bucket's lease record out of the bucket's Redis Cluster hash slot; "+
					"use a key_prefix without braces, or with a hash tag such as '{rl}:'", keyPrefix)
			}
		}
	}
	h.leases = lease.New(lease.Options{MaxTokens: h.Lease.MaxTokens, Hold: time.Duration(h.Lease.Hold), Timeout: h.limiter.Timeout(),
		Client: h.limiter, Groups: h.groups, Report: h.redisReport()})
	go h.leases.GiveBackEvery()
	return nil
}

// checkLeaseHold judges lease's hold against the lease's bounds.
func checkLeaseHold(hold time.Duration) error {
	if hold < 0 || hold > lease.MaxHold {
		return fmt.Errorf("lease hold '%v': want a duration of at most %v (default %v)", hold, lease.MaxHold, lease.DefaultHold)
	}
	return nil
}

// acquireClient returns the shared Redis client for the configuration
// and the key that redisstore.Release takes. The TLS files are read on
// every call, so a config load after rotating them gets a new client.
func acquireClient(c RedisConfig) (*redisstore.Client, string, error) {
	files, err := c.TLS.readFiles()
	if err != nil {
		return nil, "", err
	}
	raw, err := json.Marshal(c)
	if err != nil {
		return nil, "", err
	}
	key := string(raw) + files.digest()
	l, err := redisstore.Acquire(key, func() (redisstore.Options, error) { return c.storeOptions(files) })
	if err != nil {
		return nil, "", err
	}
	return l, key, nil
}

// storeOptions are the Redis client's options of the configuration.
func (c RedisConfig) storeOptions(files tlsFiles) (redisstore.Options, error) {
	opts, err := c.options(files)
	if err != nil {
		return redisstore.Options{}, err
	}
	return redisstore.Options{Redis: opts, Timeout: time.Duration(c.Timeout),
		DialTimeout: time.Duration(c.DialTimeout), KeyPrefix: c.KeyPrefix}, nil
}
