package ratelimit

import (
	"context"
	"hash/maphash"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// Lease lets an instance admit most requests without waiting on Redis:
// when a request goes to Redis, the same script call also takes up to
// `max_tokens` extra tokens for this instance (never more than half of
// what the request leaves), and this instance's next requests on that
// bucket are admitted from them until `hold` ends; then what is unused
// goes back to the bucket. Tokens admitted anywhere are never more than
// tokens taken from Redis, and a bucket given back unused tokens is never
// fuller than it would have been; but the bucket refills while leased
// tokens are out, so over an interval that starts while leases are out a
// client may be admitted what they hold (at most max_tokens per instance)
// on top of burst_capacity + replenish_rate × T.
type Lease struct {
	// MaxTokens is the most tokens one call may lease from a bucket.
	MaxTokens int64 `json:"max_tokens,omitempty"`

	// Hold is how long leased tokens may admit requests before the unused
	// ones go back. At most 1s. Default: 100ms.
	Hold caddy.Duration `json:"hold,omitempty"`
}

// Bounds of a lease's hold.
const (
	defaultLeaseHold = 100 * time.Millisecond
	maxLeaseHold     = time.Second
)

// leases holds what this handler's instance leased, by bucket, sharded
// like the memory store.
type leases struct {
	hold   time.Duration
	max    int64
	maxes  []any // each allowance up to max as the script's argument, boxed once
	seed   maphash.Seed
	shards [leaseShards]leaseShard
	closed atomic.Bool // set by close: nothing more is leased or kept
	stop   chan struct{}
	done   chan struct{}
}

const leaseShards = 64

type leaseShard struct {
	mu    sync.Mutex
	byKey map[string]lease
	// superseded holds the unused tokens of leases that a lease with
	// other values replaced, for the next give-back.
	superseded []bucket
	padded     [16]byte // a cache line of its own
}

// lease is one bucket's leased tokens.
type lease struct {
	tokens    int64       // unused
	remaining int64       // what Redis said the bucket held, leases taken out, at the last call
	values    limitValues // the values it was leased with: other values ask Redis
	until     time.Time   // when the hold ends
}

func newLeases(c *Lease) *leases {
	hold := time.Duration(c.Hold)
	if hold == 0 {
		hold = defaultLeaseHold
	}
	ls := &leases{hold: hold, max: c.MaxTokens, seed: maphash.MakeSeed(),
		stop: make(chan struct{}), done: make(chan struct{})}
	for n := range min(c.MaxTokens, maxBoxedAllowance) + 1 {
		ls.maxes = append(ls.maxes, strconv.FormatInt(n, 10))
	}
	for i := range ls.shards {
		ls.shards[i].byKey = make(map[string]lease)
	}
	return ls
}

func (ls *leases) shardIndex(key string) int {
	return int(maphash.String(ls.seed, key) % leaseShards)
}

// lock locks the shards of the buckets (see lockShards).
func (ls *leases) lock(buckets []bucket, shards []int) []int {
	for i := range buckets {
		shards = append(shards, ls.shardIndex(buckets[i].key))
	}
	return lockShards(ls.shards[:], shards)
}

func (ls *leases) unlock(shards []int) { unlockShards(ls.shards[:], shards) }

func (sh *leaseShard) mutex() *sync.Mutex { return &sh.mu }

// maxBoxedAllowance bounds the allowances boxed ahead; a larger lease
// boxes one per call.
const maxBoxedAllowance = 1024

// allowance is the most a bucket may lend with a call, given what its
// lease holds: max_tokens, less what is held, so that a lease that a
// policy cannot use (another limit's lease is short) does not grow.
func (ls *leases) allowance(held int64) any {
	n := max(0, ls.max-held)
	if n < int64(len(ls.maxes)) {
		return ls.maxes[n]
	}
	return strconv.FormatInt(n, 10)
}

// admit admits a request from the leases when every one of its buckets
// holds a lease, within its hold, with the request's values and its
// requested tokens; then it takes them from each. A bucket's remaining
// is then an estimate: what Redis said at the last call, plus what the
// lease still holds. Otherwise it sets each bucket's leaseMax for the
// call to Redis.
func (ls *leases) admit(now time.Time, buckets []bucket) bool {
	var inline [maxInlineBuckets]int
	shards := ls.lock(buckets, inline[:0])
	defer ls.unlock(shards)
	admit := true
	for i := range buckets {
		b := &buckets[i]
		l, ok := ls.shards[ls.shardIndex(b.key)].byKey[b.key]
		if !ok || !now.Before(l.until) || l.values != b.values {
			l.tokens = 0 // a lease that does not count
		}
		b.leaseMax = ls.allowance(l.tokens)
		admit = admit && l.tokens >= b.values.requested
	}
	if !admit {
		return false
	}
	for i := range buckets {
		b := &buckets[i]
		shard := &ls.shards[ls.shardIndex(b.key)]
		l := shard.byKey[b.key]
		l.tokens -= b.values.requested
		shard.byKey[b.key] = l
		b.remaining, b.retryAfter = l.remaining+l.tokens, 0
	}
	return true
}

// grant keeps what an admitted request's call leased, for its buckets'
// next requests, and counts it in the request's remaining. Tokens still
// unused from an earlier lease within its hold stay, under the new hold;
// those of a lease whose hold ended go back. Once the leases
// are closed nothing is kept: what the call leased is returned as
// buckets to give back.
func (ls *leases) grant(now time.Time, buckets []bucket) (back []bucket) {
	var inline [maxInlineBuckets]int
	shards := ls.lock(buckets, inline[:0])
	defer ls.unlock(shards)
	closed := ls.closed.Load() // under the locks: close's last take comes after
	for i := range buckets {
		b := &buckets[i]
		if b.leased == 0 {
			// Nothing new: a lease still held counts in remaining, and
			// what Redis said is its new base.
			shard := &ls.shards[ls.shardIndex(b.key)]
			if l, ok := shard.byKey[b.key]; ok && !closed && now.Before(l.until) && l.values == b.values {
				l.remaining = b.remaining
				shard.byKey[b.key] = l
				b.remaining += l.tokens
			}
			continue
		}
		if closed {
			back = append(back, giveBackBucket(b.key, b.values, b.leased))
			continue
		}
		shard := &ls.shards[ls.shardIndex(b.key)]
		l := shard.byKey[b.key]
		if l.values != b.values || !now.Before(l.until) {
			// Leased with other values, or its hold ended (admit counted it
			// as empty, so this call lent a whole max_tokens): given back
			// with the next take, never carried into the new hold.
			if l.tokens > 0 {
				shard.superseded = append(shard.superseded, giveBackBucket(b.key, l.values, l.tokens))
			}
			l.tokens = 0
		}
		l = lease{tokens: l.tokens + b.leased, remaining: b.remaining, values: b.values, until: now.Add(ls.hold)}
		shard.byKey[b.key] = l
		b.remaining += l.tokens
	}
	return back
}

// giveBackBucket is the bucket at key, with values, to be given tokens
// back.
func giveBackBucket(key string, values limitValues, tokens int64) bucket {
	args := values.scriptArgs()
	args[2] = strconv.FormatInt(tokens, 10) // the tokens to give back
	return bucket{key: key, values: values, args: args}
}

// take removes the leases whose hold ended by now (all of them, with
// everything), and returns their unused tokens, and those of superseded
// leases, as buckets to give back.
func (ls *leases) take(now time.Time, everything bool) []bucket {
	var back []bucket
	for i := range ls.shards {
		shard := &ls.shards[i]
		shard.mu.Lock()
		for key, l := range shard.byKey {
			if !everything && now.Before(l.until) {
				continue
			}
			delete(shard.byKey, key)
			if l.tokens > 0 {
				back = append(back, giveBackBucket(key, l.values, l.tokens))
			}
		}
		back = append(back, shard.superseded...)
		clear(shard.superseded)
		shard.superseded = shard.superseded[:0]
		shard.mu.Unlock()
	}
	return back
}

// drop forgets every lease without giving anything back: after Redis
// failed, the tokens are lost, which only ever holds clients below their
// limit.
func (ls *leases) drop() { ls.take(time.Now(), true) }

// giveBackEvery gives back, every half hold, the unused tokens of the
// leases whose hold ended, through l (in its next pipeline), until stop.
func (ls *leases) giveBackEvery(l *limiter) {
	defer close(ls.done)
	tick := time.NewTicker(max(ls.hold/2, time.Millisecond)) // a hold of 1ns is valid; a ticker of 0 panics
	defer tick.Stop()
	for {
		select {
		case <-ls.stop:
			ls.giveBack(l, ls.take(time.Now(), true))
			return
		case now := <-tick.C:
			ls.giveBack(l, ls.take(now, false))
		}
	}
}

// giveBack returns leased tokens to their buckets: all in one call, or a
// bucket per call on a Cluster, where they may live on different
// masters. What fails is dropped.
func (ls *leases) giveBack(l *limiter, back []bucket) {
	if l.cluster == nil && len(back) > 0 {
		_ = l.giveBack(context.Background(), time.Now(), back)
		return
	}
	for i := range back {
		_ = l.giveBack(context.Background(), time.Now(), back[i:i+1])
	}
}

// close gives back what the leases hold and stops. From then on nothing
// is leased (see Handler.check) or kept (see grant): no loop would give
// it back.
func (ls *leases) close() {
	ls.closed.Store(true)
	close(ls.stop)
	<-ls.done
}
