package lease

import (
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
)

// Which keys are hot: a key seen twice within a hold gets a lease; the
// others go to Redis as without lease (Leases.acquire). Each shard keeps
// its sightings in a fixed table, with no allocation. How much a hot
// key's lease is lent follows its rate (grant). A key's lease record
// shares its hash slot (RecordKey).

// The sightings of a shard: 64 shards × 32 sets × 4 ways, 8192 keys in
// 64 KiB per leasing handler. A key pushed out before its second request
// is seen once more (it costs a plain call, no more); four ways keep hot
// keys from pushing each other out.
const (
	leaseSightedSets = 32
	leaseSightedWays = 4
)

// RecordSuffix follows a bucket's key in the key of its lease
// record. No bucket key ends so: values escape '|', and limit names have
// none.
const RecordSuffix = "|lease"

// RecordKey is the key of what the bucket at key has lent: in the
// same Redis Cluster hash slot, so that one script reads both. A key with
// a hash tag keeps it; one without gets a tag that hashes to its hash slot.
func RecordKey(key string) string {
	if _, tagged := redisbatch.HashTag(key); tagged {
		return key + RecordSuffix
	}
	return key + RecordSuffix + "{" + hashSlotTags()[redisbatch.Slot(key)] + "}"
}

// hashSlotTags are, for each Cluster hash slot, the shortest string of
// letters and digits that hashes to it (found once, in a few ms).
var hashSlotTags = sync.OnceValue(func() *[redisbatch.Slots]string {
	const alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
	tags := new([redisbatch.Slots]string)
	missing := redisbatch.Slots
	for _, length := range []int{1, 2, 3, 4} {
		var digits [4]int
		buf := make([]byte, length)
		for {
			for i := range length {
				buf[i] = alphabet[digits[i]]
			}
			if hashSlot := redisbatch.CRC16(string(buf)) % redisbatch.Slots; tags[hashSlot] == "" {
				tags[hashSlot] = string(buf)
				if missing--; missing == 0 {
					return tags
				}
			}
			i := 0
			for ; i < length; i++ {
				if digits[i]++; digits[i] < len(alphabet) {
					break
				}
				digits[i] = 0
			}
			if i == length {
				break
			}
		}
	}
	panic(fmt.Sprintf("no tag for %d hash slots", missing)) // 62^4 strings cover every hash slot
})

// sight records that the key of hash, in shard sh (locked), was seen at
// now without a lease, and answers whether it is hot: seen before within
// a hold, at since.
func (ls *Leases) sight(sh *leaseShard, hash uint64, now time.Time) (hot bool, since time.Time) {
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
func (ls *Leases) unsight(sh *leaseShard, hash uint64) {
	set := &sh.sighted[hash/leaseShards%leaseSightedSets]
	fp := hash>>32 | 1
	for i, e := range set {
		if e>>32 == fp {
			set[i] = 0
		}
	}
}

// grant is what a call at now should lend l: what the key's requests use
// within one hold at its rate, in whole requests (on top of what l
// holds, up to max_tokens in all); nothing for a key seen once (whose
// rate is unknown) and nothing once the leases are closed. The rate is
// measured over windows of at least half a hold (a shorter one, between
// calls close together, holds too few requests to tell), weighed against
// the rate before by how long the window was, in holds: a burst a moment
// ago still counts, and a key idle for a few holds is known by its
// latest requests. Within a window, a rate is raised at once to what the
// requests seen so far make over half a hold.
func (ls *Leases) grant(l *lease, now time.Time, requested int64) int64 {
	window := now.Sub(l.since).Seconds()
	switch {
	case l.since.IsZero():
		l.seen, l.since = 0, now
	case !l.rated:
		l.rate, l.rated = float64(l.seen)/max(window, 1e-6), true
		l.seen, l.since = 0, now
	case window < ls.hold.Seconds()/2:
		l.rate = max(l.rate, float64(l.seen)/(ls.hold.Seconds()/2))
	default:
		keep := math.Exp(-window / ls.hold.Seconds())
		l.rate = l.rate*keep + float64(l.seen)/window*(1-keep)
		l.seen, l.since = 0, now
	}
	if !l.rated || ls.closed.Load() {
		return 0
	}
	requests := l.rate * ls.hold.Seconds()
	return min(ls.max, int64(min(requests, float64(ls.max)))*requested)
}
