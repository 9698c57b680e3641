// Package lease lets an instance admit most requests of a bucket in
// Redis without waiting on Redis, from tokens the bucket lent it ahead
// (a lease): a strategy over the Redis store (internal/redisstore), as
// a layer over it (Leases.Layer). The bucket counts in Redis what it lent
// to each instance (lease.lua), and does not refill into lent tokens, so
// the bound stays exact on any number of instances. Only a hot key gets
// a lease (hot.go); a lease is sized to the key's rate on this instance,
// renewed in the background, and given back when its hold ends
// (call.go).
package lease

import (
	"crypto/rand"
	"encoding/hex"
	"hash/maphash"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
)

// Bounds of a lease's hold: DefaultHold when none is given, MaxHold the
// longest.
const (
	DefaultHold = 100 * time.Millisecond
	MaxHold     = time.Second
)

// Leases holds a handler's leases, by bucket, sharded like the memory
// store. The calls to Redis are in call.go.
type Leases struct {
	hold time.Duration
	// life is how long Redis counts a lease after a call: the hold, then
	// time for the give-back, sent within half a hold, to arrive within
	// the Redis timeout. Redis never counts a lease as spent while this
	// instance may still admit from it.
	life time.Duration
	max  int64
	// id names this instance in the buckets' lease records; seq orders
	// its calls, so that Redis ignores a report older than one it has.
	// idArg and lifeArg are the id and life as lease.lua's arguments,
	// boxed once (with seq an int64: BenchmarkLeaseCall 13-14 -> 9-10 allocs).
	id             string
	seq            atomic.Int64
	idArg, lifeArg any
	seed           maphash.Seed
	shards         [leaseShards]leaseShard
	closed         atomic.Bool // set by Close: nothing more is lent; what lands goes back
	stop           chan struct{}
	done           chan struct{}
	// refused are the refusals kept below the lease layer, which it asks
	// and tells itself (set when the stack is built; limit.NoRefusals for none).
	refused limit.Refusals
	// client is the Redis client the calls go through; groups are the
	// limits by Cluster hash slot, when they span several (nil
	// otherwise); report is told what Redis answered and failed.
	client *redisstore.Client
	groups [][]*limit.Limit
	report redisstore.Reporter
}

const leaseShards = 64

type leaseShard struct {
	mu    sync.Mutex
	byKey map[string]*lease
	// sighted are the keys of the shard without a lease seen lately:
	// leaseSightedSets sets of leaseSightedWays, each a key's fingerprint
	// (its hash's top 32 bits, never 0) and the µs it was last seen
	// (Unix, its low 32 bits), the oldest of a set replaced first. A key
	// seen twice within a hold is hot and gets a lease; any other goes to
	// Redis as without lease, with nothing made for it.
	sighted *[leaseSightedSets][leaseSightedWays]uint64
	padded  [32]byte // a cache line of its own
}

// lease is this instance's lease on one bucket, and what sizes it.
type lease struct {
	record string       // the key of the bucket's lease record (RecordKey)
	values limit.Values // of the last call: a request with other values asks Redis
	tokens int64        // unused; each admits requests until the hold ends
	// renewAt is when a renewal starts: when the lease falls to half of
	// what the last call lent, or sooner, to what the key's requests
	// spend in four round trips (a renewal must land before the lease
	// runs dry, and on a busy instance round trips vary a lot). rtt is
	// the round trip of its calls: it rises with a slow call at once and
	// falls by halves.
	renewAt int64
	rtt     time.Duration
	// renewBy is when a renewal starts, however much the lease holds: a
	// quarter hold, or two round trips, before the hold ends.
	renewBy   time.Time
	until     time.Time // the end of the hold
	counted   bool      // Redis counts a lease of this instance on the bucket
	remaining int64     // what Redis said the bucket held at the last call
	// flight is the call in flight for the bucket, at most one; spent is
	// what was admitted from tokens since it left.
	flight *leaseFlight
	spent  int64
	// reports counts the calls sent for the lease (from 1): each reports
	// what it holds unused, and tokens admitted before it left are no
	// longer counted in Redis as lent.
	reports int64
	// calm is when a renewal may start again after one failed: while the
	// breaker is open, not one per admission.
	calm time.Time
	// seen counts the requests since the last call left, at since; rate
	// is the key's rate on this instance (requests per second, averaged
	// over about a hold; rated once known), which sizes the next lease.
	seen  int64
	since time.Time
	rate  float64
	rated bool
}

// leaseState is what the lease layer knows of one bucket of a call, in
// a slice parallel to the call's buckets (states[i] is buckets[i]'s):
// the bucket's lease, what it held unused and the most it should hold
// when the call left, and what Redis counts as lent to it after the
// call. It is the layer's alone, kept beside the buckets rather than in
// each, so that a bucket carries nothing of a layer.
type leaseState struct {
	lease              *lease
	held, want, leased int64
}

// leaseFlight is a lease call in flight. Requests whose leases are empty
// wait for it, then try their leases again; they share its error.
type leaseFlight struct {
	done chan struct{} // closed once it landed
	err  error         // set before done closes: a failure of Redis, not of the leader's client
	sent time.Time
	// buckets are a renewal's own copies of its request's buckets (a
	// request's call uses the request's).
	buckets []limit.Bucket
	// states are the lease states of the flight's buckets (register), in
	// their order: in inline for up to limit.MaxInline, within the
	// flight's one allocation.
	states []leaseState
	inline [limit.MaxInline]leaseState
}

// Options are what a handler's leases are made of.
type Options struct {
	// MaxTokens is the most tokens one lease holds; Hold how long it
	// admits requests after a call (0: DefaultHold).
	MaxTokens int64
	Hold      time.Duration
	// Timeout is the Redis timeout, within which a give-back arrives.
	Timeout time.Duration
	// Client is the Redis client the calls go through; Groups the limits
	// by Cluster hash slot, when they span several (nil otherwise); Report
	// is told what Redis answered and failed, and what settlements charged.
	Client *redisstore.Client
	Groups [][]*limit.Limit
	Report redisstore.Reporter
}

// New makes a handler's leases; GiveBackEvery then gives back what
// they hold until Close.
func New(o Options) *Leases {
	hold := o.Hold
	if hold == 0 {
		hold = DefaultHold
	}
	var id [8]byte
	_, _ = rand.Read(id[:]) // never fails (crypto/rand)
	ls := &Leases{hold: hold, life: 2*hold + o.Timeout, max: o.MaxTokens, id: hex.EncodeToString(id[:]),
		seed: maphash.MakeSeed(), stop: make(chan struct{}), done: make(chan struct{}), refused: limit.NoRefusals{},
		client: o.Client, groups: o.Groups, report: o.Report}
	ls.idArg, ls.lifeArg = ls.id, strconv.FormatInt(ls.life.Microseconds(), 10)
	for i := range ls.shards {
		ls.shards[i].byKey = make(map[string]*lease)
		ls.shards[i].sighted = new([leaseSightedSets][leaseSightedWays]uint64)
	}
	return ls
}

func (ls *Leases) shardIndex(key string) int {
	return int(maphash.String(ls.seed, key) % leaseShards)
}

func (ls *Leases) get(key string) *lease { return ls.shards[ls.shardIndex(key)].byKey[key] }

// lock locks the shards of the buckets (see lockShards).
func (ls *Leases) lock(buckets []limit.Bucket, shards []int) []int {
	for i := range buckets {
		shards = append(shards, ls.shardIndex(buckets[i].Key))
	}
	return lockShards(ls.shards[:], shards)
}

func (ls *Leases) unlock(shards []int) { unlockShards(ls.shards[:], shards) }

func (sh *leaseShard) mutex() *sync.Mutex { return &sh.mu }

// Outcome is what acquire decided for a request.
type Outcome int

const (
	Admitted Outcome = iota // from the leases
	Wait                    // for the flight in progress
	Miss                    // ask Redis (when leading, through the flight acquire made)
	Cold                    // no bucket has a lease, none is hot: ask Redis as without lease
)

// acquire admits a request from its buckets' leases when each holds one
// within its hold, with the request's values and its requested tokens;
// the request's remaining is then an estimate: what Redis said at the
// last call, plus what the lease still holds. When a lease falls to half
// of what its last call lent, or its hold is nearly over, acquire also
// starts a renewal of the request's leases, and returns its flight to
// send. Otherwise, when a call is in flight for a bucket whose lease
// falls short, the request waits for it. Otherwise it misses; leading, it
// then gets the flight that its own call to Redis is, registered on every
// bucket. A request none of whose buckets has a lease, or is hot (seen
// before within a hold: see sight), is cold: it goes to Redis as without
// lease, and nothing is made for it. On its first try (counted unset,
// then set), a request counts into the rates of its buckets' leases
// (those that exist) and is sighted on the others.
//
// marks are the request's, one per bucket (limit.Call.LayerMarks): an
// admitted request's are its leases' reports then (see lease.reports),
// by which a charged response settles in the lease it came from
// (settleLeased); the others' are left as they are, 0.
func (ls *Leases) acquire(now time.Time, buckets []limit.Bucket, marks []int64, counted *bool, lead bool) (Outcome, *leaseFlight) {
	// Each key is hashed once and its lease looked up once: the shards to
	// lock, the sighting and the admission share them, where they took
	// three hashes and two lookups (BenchmarkAdmitHot/lease, 8 runs of
	// each build interleaved on a loaded machine: median 568 -> 348 ns).
	var inlineHashes [limit.MaxInline]uint64
	var inlineShards [limit.MaxInline]int
	var inlineLeases [limit.MaxInline]*lease
	hashes, shards, leases := inlineHashes[:0], inlineShards[:0], inlineLeases[:0]
	for i := range buckets {
		hash := maphash.String(ls.seed, buckets[i].Key)
		hashes, shards = append(hashes, hash), append(shards, int(hash%leaseShards))
	}
	shards = lockShards(ls.shards[:], shards)
	defer ls.unlock(shards)
	first := !*counted
	*counted = true
	admit, found := true, false
	var wait *leaseFlight
	for i := range buckets {
		b := &buckets[i]
		hash := hashes[i]
		sh := &ls.shards[hash%leaseShards]
		l := sh.byKey[b.Key]
		leases = append(leases, l) // nil until hot; admit needs every one
		if l == nil && first {
			// A key without a lease: hot when seen before within a hold,
			// and its lease is made, its rate counted from then.
			if hot, since := ls.sight(sh, hash, now); hot {
				l = &lease{record: RecordKey(b.Key), values: b.Values, since: since}
				sh.byKey[b.Key], leases[i] = l, l
			}
		}
		if l == nil {
			admit = false
			continue
		}
		if found = true; first {
			l.seen++
		}
		// !counted: picked for a give-back, which may hand back the tokens
		// it keeps (see take), though a request sent before the hold
		// ended comes here now.
		if !l.counted || !now.Before(l.until) || l.values != b.Values || l.tokens < b.Values.Requested {
			admit = false
			if l.flight != nil {
				wait = l.flight
			}
		}
	}
	switch {
	case !found && !lead:
		return Cold, nil
	case admit:
		renew := false
		for i := range buckets {
			b, l := &buckets[i], leases[i]
			l.tokens -= b.Values.Requested
			if l.flight != nil {
				l.spent += b.Values.Requested
			}
			marks[i] = l.reports
			b.Remaining, b.RetryAfter = l.remaining+l.tokens, 0
			renew = renew || now.After(l.calm) && (l.tokens <= l.renewAt || !now.Before(l.renewBy))
		}
		if !renew || ls.closed.Load() || ls.inFlight(buckets) != nil {
			return Admitted, nil
		}
		f := &leaseFlight{done: make(chan struct{}), sent: now, buckets: make([]limit.Bucket, len(buckets))}
		copy(f.buckets, buckets)
		ls.register(now, f, f.buckets)
		return Admitted, f
	case wait != nil:
		return Wait, wait
	case !lead:
		return Miss, nil
	}
	if f := ls.inFlight(buckets); f != nil { // another request leads: wait for it
		return Wait, f
	}
	f := &leaseFlight{done: make(chan struct{}), sent: now}
	ls.register(now, f, buckets)
	return Miss, f
}

// inFlight is a flight in progress for one of the buckets, or nil. The
// caller holds their shards locked.
func (ls *Leases) inFlight(buckets []limit.Bucket) *leaseFlight {
	for i := range buckets {
		if l := ls.get(buckets[i].Key); l != nil && l.flight != nil {
			return l.flight
		}
	}
	return nil
}

// register makes f the flight of each bucket's lease (made if missing),
// and sets in f's states what its call reports and asks: the tokens the
// lease holds unused, and the most it should hold after the call. The
// caller holds the buckets' shards locked.
func (ls *Leases) register(now time.Time, f *leaseFlight, buckets []limit.Bucket) {
	if len(buckets) <= limit.MaxInline {
		f.states = f.inline[:len(buckets)]
	} else {
		f.states = make([]leaseState, len(buckets))
	}
	for i := range buckets {
		b := &buckets[i]
		l := ls.get(b.Key)
		if l == nil {
			l = &lease{record: RecordKey(b.Key), values: b.Values}
			ls.shards[ls.shardIndex(b.Key)].byKey[b.Key] = l
		}
		l.flight, l.spent = f, 0
		l.reports++
		f.states[i] = leaseState{lease: l, held: l.tokens, want: min(ls.max, l.tokens+ls.grant(l, now, b.Values.Requested))}
	}
}

// land records what a call answered at now for the buckets, which the
// flight covers, with their states: each state's leased is what Redis
// counts as lent to this instance now, and what was admitted from the
// lease since the call left is spent out of it. The hold starts anew
// from when the call left. A failed call (err) changes no lease: Redis
// counts each as long as this instance may admit from it, so it is used
// until its hold ends. Buckets whose call was not answered are passed
// with err set too. Once the leases are closed, what they hold is
// returned, for a give-back. A lease whose measured rate asked for
// nothing, and that holds nothing, is forgotten: its key is cold again.
func (ls *Leases) land(f *leaseFlight, buckets []limit.Bucket, states []leaseState, now time.Time, err error) (back leaseReturns) {
	var inline [limit.MaxInline]int
	shards := ls.lock(buckets, inline[:0])
	defer ls.unlock(shards)
	closed := ls.closed.Load() // under the locks: close's last give-back comes after
	for i := range buckets {
		b, st := &buckets[i], &states[i]
		l := st.lease
		if l == nil || l.flight != f {
			continue
		}
		if err != nil {
			l.calm = now.Add(ls.hold / 8)
		} else {
			l.tokens = max(0, st.leased-l.spent)
			rtt := now.Sub(f.sent)
			l.rtt = max(rtt, (l.rtt+rtt)/2)
			l.renewAt = max(max(0, st.leased-st.held)/2, int64(math.Ceil(4*l.rate*l.rtt.Seconds()))*b.Values.Requested)
			l.counted = st.leased > 0
			l.until = f.sent.Add(ls.hold)
			l.renewBy = l.until.Add(-max(ls.hold/4, 2*l.rtt))
			l.remaining, l.values = b.Remaining, b.Values
			b.Remaining += l.tokens
		}
		l.spent = 0
		if closed && l.counted {
			back.add(ls.giveBackBucket(b.Key, l, false))
		}
		if err == nil && st.leased == 0 && st.want == 0 && l.rated {
			// Cooled: its rate asked for nothing and nothing is lent. Its
			// requests go to Redis as without lease until it is hot again.
			hash := maphash.String(ls.seed, b.Key)
			sh := &ls.shards[hash%leaseShards]
			if sh.byKey[b.Key] == l {
				delete(sh.byKey, b.Key)
				ls.unsight(sh, hash)
			}
		}
	}
	return back
}

// finish ends a flight over the buckets it registered: they may fly
// again, and the requests that waited for it try their leases again (or
// share its error).
func (ls *Leases) finish(f *leaseFlight, buckets []limit.Bucket, err error) {
	var inline [limit.MaxInline]int
	shards := ls.lock(buckets, inline[:0])
	for i := range f.states {
		if l := f.states[i].lease; l != nil && l.flight == f {
			l.flight = nil
		}
	}
	ls.unlock(shards)
	f.err = err
	close(f.done)
}

// giveBackBucket is the bucket at key, to which lease l gives back what
// it holds, and its state for that call. Redis stops counting l; so does
// this instance. l keeps its tokens until its next call when keep is set
// (see take), else they go at once. The caller holds the bucket's shard
// locked.
func (ls *Leases) giveBackBucket(key string, l *lease, keep bool) (limit.Bucket, leaseState) {
	b, st := limit.Bucket{Key: key, Values: l.values, Args: limit.Plain.ScriptArgs(l.values)}, leaseState{lease: l, held: l.tokens}
	l.counted = false
	if !keep {
		l.tokens = 0
	}
	return b, st
}

// take returns the leases to give back by now: those whose hold ended
// (all of them, with everything) and that have no call in flight, and
// the sequence number their give-back carries. The history of a lease a
// hold past its end is forgotten too, and with everything every lease.
//
// The number is taken before any lease is picked: a request may take a
// new lease on a picked bucket before the give-back, sent in chunks,
// reaches Redis. That take comes later, so Redis judges the give-back
// older and leaves the new lease counted, where a give-back numbered
// when it left would erase its count while this instance spends it. A
// lease picked keeps its tokens (its hold is over: it admits from none)
// and that take reports them: Redis, which counts them until the
// give-back lands, carries them into the new lease, where dropping them
// here would have the take report them used and lose them. Picked with
// everything (at close), a lease may be within its hold, and drops them.
func (ls *Leases) take(now time.Time, everything bool) (back leaseReturns, seq int64) {
	seq = ls.seq.Add(1)
	for i := range ls.shards {
		shard := &ls.shards[i]
		shard.mu.Lock()
		for key, l := range shard.byKey {
			if l.flight != nil || !everything && now.Before(l.until) {
				continue
			}
			if l.counted {
				back.add(ls.giveBackBucket(key, l, !everything))
			}
			if everything || !now.Before(l.until.Add(ls.hold)) {
				delete(shard.byKey, key)
			}
		}
		shard.mu.Unlock()
	}
	return back, seq
}
