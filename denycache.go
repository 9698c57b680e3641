package ratelimit

import (
	"sync"
	"time"
)

// denyCacheSize bounds the deny cache of one handler: at most this many
// buckets are remembered (about 100 bytes each). Past it, expired entries
// and then arbitrary ones make room; forgetting only costs a Redis call.
const denyCacheSize = 16384

// denyCache remembers, per instance, buckets that denied a request and
// until when they must keep denying, so a flood from one key is answered
// without Redis.
//
// Why it never denies a request Redis would admit: Redis answered that
// the bucket holds fewer than `requested_tokens` until RetryAfter past its
// own clock at the moment the script ran, which is after `sent` (taken
// before the call left). Tokens come back only with time; other instances
// can only take them. So no request of the same cost can be admitted
// before sent+RetryAfter. RetryAfter is rounded up to the microsecond,
// hence the microsecond taken off. The cache lives in one handler, so it
// is keyed by bucket and cost, and a config reload starts a fresh one.
// Two conditions: every handler sharing the zone refills at the same
// rate and burst (the README asks for it; a faster writer would store
// more tokens), and the bucket survives in Redis (FLUSHALL or a restart
// without persistence would admit sooner). Where either fails, the cache
// denies no longer than the Retry-After that client was already given.
type denyCache struct {
	mu      sync.Mutex
	entries map[string]deniedUntil
}

type deniedUntil struct {
	until     time.Time
	remaining int64
}

func newDenyCache() *denyCache {
	return &denyCache{entries: make(map[string]deniedUntil)}
}

// get returns the denial in force for key at now, if any.
func (c *denyCache) get(key string, now time.Time) (deniedUntil, bool) {
	c.mu.Lock()
	d, ok := c.entries[key]
	c.mu.Unlock()
	if !ok || !now.Before(d.until) {
		return deniedUntil{}, false
	}
	return d, true
}

// put records Redis's denial of a call sent at sent.
func (c *denyCache) put(key string, sent time.Time, res Result) {
	until := sent.Add(res.RetryAfter - time.Microsecond)
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.entries) >= denyCacheSize {
		c.makeRoom(sent)
	}
	c.entries[key] = deniedUntil{until: until, remaining: res.Remaining}
}

// makeRoom drops the expired entries among a sample of 32, or, when none
// has expired, the first of them.
func (c *denyCache) makeRoom(now time.Time) {
	var first string
	seen, dropped := 0, 0
	for k, d := range c.entries { // map order is random: a fair sample
		if seen == 0 {
			first = k
		}
		if !now.Before(d.until) {
			delete(c.entries, k)
			dropped++
		}
		if seen++; seen == 32 {
			break
		}
	}
	if dropped == 0 {
		delete(c.entries, first)
	}
}
