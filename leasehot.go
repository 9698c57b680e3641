package ratelimit

import (
	"math"
	"time"
)

// Which keys are hot: a key seen twice within a hold gets a lease; the
// others go to Redis as without lease (leases.acquire). Each shard keeps
// its sightings in a fixed table, with no allocation.

// The sightings of a shard: 64 shards × 32 sets × 4 ways, 8192 keys in
// 64 KiB per leasing handler. A key pushed out before its second request
// is seen once more (it costs a plain call, no more); four ways keep hot
// keys from pushing each other out.
const (
	leaseSightedSets = 32
	leaseSightedWays = 4
)

// sight records that the key of hash, in shard sh (locked), was seen at
// now without a lease, and answers whether it is hot: seen before within
// a hold, at since.
func (ls *leases) sight(sh *leaseShard, hash uint64, now time.Time) (hot bool, since time.Time) {
	set := &sh.sighted[hash/leaseShards%leaseSightedSets]
	fp := hash>>32 | 1
	us := uint32(now.UnixMicro())
	oldest, age := 0, uint32(0)
	for i, e := range set {
		d := us - uint32(e) // wraps every 71 minutes: at worst a key seen then is hot once
		if e>>32 == fp {
			set[i] = fp<<32 | uint64(us)
			if int64(d) < ls.hold.Microseconds() {
				return true, now.Add(-time.Duration(d) * time.Microsecond)
			}
			return false, time.Time{}
		}
		if e == 0 {
			d = math.MaxUint32
		}
		if d >= age {
			oldest, age = i, d
		}
	}
	set[oldest] = fp<<32 | uint64(us)
	return false, time.Time{}
}

// unsight forgets the sighting of the key of hash in shard sh (locked):
// it is seen anew, twice within a hold, before it is hot again.
func (ls *leases) unsight(sh *leaseShard, hash uint64) {
	set := &sh.sighted[hash/leaseShards%leaseSightedSets]
	fp := hash>>32 | 1
	for i, e := range set {
		if e>>32 == fp {
			set[i] = 0
		}
	}
}
