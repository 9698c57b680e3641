package layer

import (
	"context"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// denyCacheSize bounds the deny cache of one handler: at most this many
// buckets are remembered (about 100 bytes each). Past it, expired entries
// and then arbitrary ones make room; forgetting only costs a Redis call.
const denyCacheSize = 16384

// DenyCache remembers, per handler, buckets that were too short for a
// request and until when, so a flood from one key is answered without
// Redis. It is exact: tokens only come back with time, and the cache
// counts the wait Redis gave from before the call left, so no request
// with the same rate, burst and cost could be admitted sooner. This holds
// while every handler sharing the zone refills at the same rate and the
// bucket survives in Redis; see the root package's
// TestDenyCacheNeverDeniesWhatRedisWouldAdmit.
// When a layer above may bring tokens back at any time, a denial is
// cached for at most what it says (maxWait, keepAtMost).
type DenyCache struct {
	mu      sync.Mutex
	entries map[string]denial
	// maxWait, when set, is the longest a denial is cached: tokens a
	// layer above gives back may return sooner than by refill.
	maxWait time.Duration
	// forgotten is when a denial of a key of each share (by hash) was
	// last forgotten, and forgottenAll when all were: a denial of a call
	// sent before then may be of the bucket before what made it go (a
	// refund that landed while the call was in flight), and is not put.
	forgotten    [forgetShares]time.Time
	forgottenAll time.Time
	seed         maphash.Seed
	// held is len(entries), for holdsAny to read without the lock.
	held atomic.Int64
}

// forgetShares is how many shares of keys forgotten notes a time for:
// forgetting a key also keeps the denials of its share's other keys
// that were sent before from the cache, which costs each a Redis call.
const forgetShares = 64

// denial is until when a bucket cannot hold the tokens a request asks,
// for requests with these values: another rate, burst, cost or max wait
// asks Redis.
// Denials are answered from the cache until ask, at most until.
type denial struct {
	until, ask time.Time
	values     limit.Values
	remaining  int64 // as Redis answered it (limit.Remembered.CachedRemaining)
}

// NewDenyCache is an empty deny cache.
func NewDenyCache() *DenyCache {
	return &DenyCache{entries: make(map[string]denial), seed: maphash.MakeSeed()}
}

// answer denies a request at now when one of its buckets is known to be
// short, and then fills in what Redis would say of each such bucket now,
// as its kind says (a token bucket has refilled since). The other
// buckets are marked unknown.
func (c *DenyCache) answer(buckets []limit.Bucket, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	short := false
	for i := range buckets {
		d, ok := c.entries[buckets[i].Key]
		short = short || ok && d.values == buckets[i].Values && now.Before(d.ask)
	}
	if !short {
		return false
	}
	for i := range buckets {
		b := &buckets[i]
		d, ok := c.entries[b.Key]
		r := b.Remembered() // put remembers no other kind's refusal
		if !ok || r == nil || d.values != b.Values || !now.Before(d.ask) {
			b.Unknown = true
			continue
		}
		b.RetryAfter = d.until.Sub(now)
		b.Remaining = r.CachedRemaining(*b, d.remaining, b.RetryAfter)
	}
	return true
}

// put records Redis's denial of a request sent at sent: each bucket that
// was short stays so for its wait, unless it was forgotten since; it is
// answered from the cache for as long as its kind says it refuses
// (limit.Remembered.DenialTTL: a request that may wait for it fits its
// max wait sooner than its wait). The script rounds waits up to the
// microsecond, hence one taken off.
func (c *DenyCache) put(buckets []limit.Bucket, sent time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.forgottenAll.Before(sent) {
		return
	}
	for i := range buckets {
		b := &buckets[i]
		r := b.Remembered()
		if r == nil {
			continue
		}
		ttl := r.DenialTTL(*b)
		if ttl <= 0 {
			continue
		}
		if !c.forgotten[c.share(b.Key)].Before(sent) {
			continue
		}
		if len(c.entries) >= denyCacheSize {
			c.makeRoom(sent)
		}
		d := denial{until: sent.Add(max(ttl, b.RetryAfter) - time.Microsecond), values: b.Values, remaining: b.Remaining}
		d.ask = sent.Add(ttl - time.Microsecond)
		if c.maxWait > 0 && ttl > c.maxWait {
			d.ask = sent.Add(c.maxWait)
		}
		c.entries[b.Key] = d
	}
	c.held.Store(int64(len(c.entries)))
}

// holdsAny says whether the cache holds any denial, without the lock:
// when it holds none, a request need not be resolved to ask it.
func (c *DenyCache) holdsAny() bool { return c.held.Load() > 0 }

// Forget drops what the cache knows of the buckets at keys.
func (c *DenyCache) Forget(keys ...string) {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, key := range keys {
		delete(c.entries, key)
		c.forgotten[c.share(key)] = now
	}
	c.held.Store(int64(len(c.entries)))
}

// share is the share of forgotten that key falls in.
func (c *DenyCache) share(key string) int {
	return int(maphash.String(c.seed, key) % forgetShares)
}

// ForgetAll drops everything the cache knows; a new map rather than
// clear, which would hold the lock while it walks up to denyCacheSize
// entries.
func (c *DenyCache) ForgetAll() {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.entries = make(map[string]denial)
	c.forgottenAll = now
	c.held.Store(0)
}

// makeRoom drops the expired entries among a sample of 32, or, when none
// has expired, the first of them.
func (c *DenyCache) makeRoom(now time.Time) {
	var first string
	seen, dropped := 0, 0
	for k, d := range c.entries { // map order is random: a fair sample
		if seen == 0 {
			first = k
		}
		if !now.Before(d.ask) {
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

// denyLayer answers from the deny cache a request that one of its
// buckets is known to refuse, and asks the store below it otherwise,
// keeping what that store answered. It is the handler's refusals: a
// layer above that decides with calls of its own takes its place, and
// asks them itself (takeRefusals).
type denyLayer struct {
	limit.Store // below: asked what the cache cannot answer, and the rest
	cache       *DenyCache
	perRequest  bool // some limit's values come from the request
}

// Deny puts the deny cache's layer over below: it answers from cache
// what the cache knows to refuse, and keeps below's answers there.
// perRequest says that some limit's values come from the request, so an
// admission forgets the denials of its buckets.
func Deny(below limit.Store, cache *DenyCache, perRequest bool) limit.Store {
	return &denyLayer{Store: below, cache: cache, perRequest: perRequest}
}

func (d *denyLayer) RefusalsKept() (limit.Store, limit.Refusals) { return d.Store, d }

func (d *denyLayer) Answer(buckets []limit.Bucket, now time.Time) bool {
	return d.cache.answer(buckets, now)
}
func (d *denyLayer) Answered(buckets []limit.Bucket, sent time.Time, allowed bool) {
	d.cache.answered(buckets, sent, allowed, d.perRequest)
}

// MayRefuse and refuses make it the stack's refuser (refuserOf): it
// decides first, from what it remembers.
func (d *denyLayer) MayRefuse() bool { return d.cache.holdsAny() }
func (d *denyLayer) Refuses(now time.Time, buckets []limit.Bucket) bool {
	return d.cache.answer(buckets, now)
}

func (d *denyLayer) Forget(key string)        { d.cache.Forget(key) }
func (d *denyLayer) ForgetKeys(keys []string) { d.cache.Forget(keys...) }

// KeepAtMost sets maxWait.
func (d *denyLayer) KeepAtMost(wait time.Duration) { d.cache.maxWait = wait }

func (d *denyLayer) Take(ctx context.Context, r *limit.Call) (bool, error) {
	if d.cache.answer(r.Buckets, r.Sent) {
		return false, nil
	}
	allowed, err := d.Store.Take(ctx, r)
	if err == nil {
		d.cache.answered(r.Buckets, r.Sent, allowed, d.perRequest)
	}
	return allowed, err
}

// answered keeps what a store answered to a request sent at sent: its
// refusal, or, when perRequest, that it was admitted.
func (c *DenyCache) answered(buckets []limit.Bucket, sent time.Time, allowed, perRequest bool) {
	switch {
	case !allowed:
		c.put(buckets, sent)
	case perRequest:
		// Admitted with other values than a cached denial's, say after a
		// change of plan, the bucket refilled at another rate than that
		// denial counted on.
		var inline [limit.MaxInline]string
		keys := inline[:0]
		for i := range buckets {
			keys = append(keys, buckets[i].Key)
		}
		c.Forget(keys...)
	}
}
