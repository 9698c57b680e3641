package redisstore

import (
	"hash/maphash"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redisresets"
)

// What the tests of the handler, which run the store through Caddy,
// read and set of the client's insides.

// PendingReleases is how many slot releases are on their way to Redis,
// or failed and wait to be sent again, of every key.
func (l *Client) PendingReleases() int64 { return l.slots().releases.total() }

// AddPendingReleases counts n more releases pending of each key (fewer
// when n is negative), as a release on its way would.
func (l *Client) AddPendingReleases(keys []string, n int32) { l.slots().releases.add(keys, n) }

// PendingShard is the shard of the pending releases' count that key's
// releases are counted in (keys of one shard share its count).
func PendingShard(key string) uint64 {
	var p pendingReleases
	return maphash.String(pendingSeed, key) % uint64(len(p.shards))
}

// Resets is the client's reset channel.
func (l *Client) Resets() *redisresets.Channel { return l.resets }

// NewOver is a client over batcher alone, with no Redis client: for a
// batcher that sends nothing (redisbatch.NewStalled).
func NewOver(batcher *redisbatch.Batcher, timeout time.Duration) *Client {
	return &Client{batcher: batcher, timeout: timeout}
}

// ClientsInUse counts the shared clients in use (Acquire).
func ClientsInUse() int {
	n := 0
	clients.Range(func(_, _ any) bool { n++; return true })
	return n
}
