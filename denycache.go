package ratelimit

import (
	"sync"
	"time"
)

// denyCacheSize bounds the deny cache of one handler: at most this many
// buckets are remembered (about 100 bytes each). Past it, expired entries
// and then arbitrary ones make room; forgetting only costs a Redis call.
const denyCacheSize = 16384

// denyCache remembers, per handler, buckets that denied a request and
// until when, so a flood from one key is answered without Redis. It is
// exact: tokens only come back with time, and the cache counts the wait
// Redis gave from before the call left, so no request of the same cost
// could be admitted sooner. This holds while every handler sharing the zone has
// the same rate and burst and the bucket survives in Redis; see
// TestDenyCacheNeverDeniesWhatRedisWouldAdmit.
type denyCache struct {
	mu      sync.Mutex
	entries map[string]time.Time // until when each bucket denies
}

func newDenyCache() *denyCache {
	return &denyCache{entries: make(map[string]time.Time)}
}

// get returns until when key's bucket denies, if that is after now.
func (c *denyCache) get(key string, now time.Time) (time.Time, bool) {
	c.mu.Lock()
	until, ok := c.entries[key]
	c.mu.Unlock()
	if !ok || !now.Before(until) {
		return time.Time{}, false
	}
	return until, true
}

// put records Redis's denial of a call sent at sent, fitting again
// retryAfter later. The script rounds the wait up to the microsecond,
// hence one taken off.
func (c *denyCache) put(key string, sent time.Time, retryAfter time.Duration) {
	until := sent.Add(retryAfter - time.Microsecond)
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.entries) >= denyCacheSize {
		c.makeRoom(sent)
	}
	c.entries[key] = until
}

// makeRoom drops the expired entries among a sample of 32, or, when none
// has expired, the first of them.
func (c *denyCache) makeRoom(now time.Time) {
	var first string
	seen, dropped := 0, 0
	for k, until := range c.entries { // map order is random: a fair sample
		if seen == 0 {
			first = k
		}
		if !now.Before(until) {
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
