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
