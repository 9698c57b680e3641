package redisstore

// The client's insides, for the package's tests (releases_test.go): the
// count of slot releases on their way to Redis, or failed and waiting to
// be sent again, which a refused request of their key waits for
// (pendingReleases).

// PendingReleases is how many slot releases are pending, of every key.
func (l *Client) PendingReleases() int64 { return l.slots().releases.total() }

// AddPendingReleases counts n more releases pending of each key (fewer
// when n is negative), as a release on its way would.
func (l *Client) AddPendingReleases(keys []string, n int32) { l.slots().releases.add(keys, n) }

// shardsOf finds the shard of a key's count (pendingReleases.of); it
// counts nothing.
var shardsOf pendingReleases

// SamePendingShard says whether the releases of keys a and b are counted
// in one shard of the pending releases' count (by hash: keys of one
// shard share its count).
func SamePendingShard(a, b string) bool { return shardsOf.of(a) == shardsOf.of(b) }
