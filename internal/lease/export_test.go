package lease

import (
	"context"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// What this package's tests and benchmarks do to the leases beside
// requests (go-redis's pattern: test-only API lives in the package's
// tests).

// Plant gives the bucket at key a lease counted in Redis, with values,
// holding tokens until then.
func (ls *Leases) Plant(key string, values limit.Values, tokens int64, until time.Time) {
	ls.shards[ls.shardIndex(key)].byKey[key] = &lease{values: values, counted: true, tokens: tokens, until: until, renewBy: until}
}

// AcquireOnce is a request's first try at its buckets' leases, which
// leads no call (acquire).
func (ls *Leases) AcquireOnce(now time.Time, buckets []limit.Bucket, marks []int64) Outcome {
	counted := false
	o, _ := ls.acquire(now, buckets, marks, &counted, false)
	return o
}

// Renewal is the call that renews a lease on bucket b, made once: each
// call of it sends lease.lua's renewal alone.
func (ls *Leases) Renewal(b limit.Bucket) func(context.Context) error {
	buckets := []limit.Bucket{b}
	states := []leaseState{{lease: &lease{record: RecordKey(b.Key), values: b.Values}}}
	return func(ctx context.Context) error {
		_, err := ls.call(ctx, time.Now(), leaseModeRenew, ls.seq.Add(1), buckets, states)
		return err
	}
}

// Held is what the lease on the bucket at key holds (0: none).
func (ls *Leases) Held(key string) int64 {
	sh := &ls.shards[ls.shardIndex(key)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if l := sh.byKey[key]; l != nil {
		return l.tokens
	}
	return 0
}

// Until is when the hold of the lease on the bucket at key ends (zero:
// no lease).
func (ls *Leases) Until(key string) time.Time {
	sh := &ls.shards[ls.shardIndex(key)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if l := sh.byKey[key]; l != nil {
		return l.until
	}
	return time.Time{}
}

// ID names this instance in the buckets' lease records.
func (ls *Leases) ID() string { return ls.id }

// Flying says whether a call of the leases is in flight.
func (ls *Leases) Flying() (flying bool) {
	for i := range ls.shards {
		sh := &ls.shards[i]
		sh.mu.Lock()
		for _, l := range sh.byKey {
			flying = flying || l.flight != nil
		}
		sh.mu.Unlock()
	}
	return flying
}

// Entries is how many buckets the leases know (a lease each).
func (ls *Leases) Entries() (n int) {
	for i := range ls.shards {
		sh := &ls.shards[i]
		sh.mu.Lock()
		n += len(sh.byKey)
		sh.mu.Unlock()
	}
	return n
}

// PickGiveBacks picks the leases whose hold ended by now, as the
// give-back loop does, and returns how many it picked and the give-back
// of them, to send when the caller says.
func (ls *Leases) PickGiveBacks(now time.Time) (n int, giveBack func()) {
	back, seq := ls.take(now, false)
	return back.len(), func() { ls.giveBackLeases(back, seq) }
}
