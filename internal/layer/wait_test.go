package layer_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/layer"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
)

// A bucket of no limit is the token bucket's (the handler sets it).
func init() { limit.Plain = tokenbucket.Kind{} }

// noReports is a memory store's handler that reports nothing.
type noReports struct{}

func (noReports) Full()                                             {}
func (noReports) Charged(*limit.Limit, float64, float64)            {}
func (noReports) Unsettled([]limit.Bucket, []limit.Settling, error) {}

func memoryStore(t *testing.T, zone string) limit.Store {
	s, err := memstore.Acquire("wait-test", "p:", zone, 1000)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Release() })
	return s.For(noReports{}, false)
}

// TestDenyCacheNeverRefusesWhatCouldWait: two memory stores are taken
// alike, one under the deny cache; requests with max waits of their own
// are answered alike by both. A denial is kept only until the request
// would fit within its max wait, so the cache never refuses one that the
// store would have admitted to wait, and it does answer some.
func TestDenyCacheNeverRefusesWhatCouldWait(t *testing.T) {
	cached := layer.Deny(memoryStore(t, "cached"), layer.NewDenyCache(), true) // values per request: an admission forgets the denials
	_, kept := limit.TakeRefusals(cached)
	bare := memoryStore(t, "bare")
	rng := rand.New(rand.NewPCG(40, 2))
	now := time.Now()
	ctx := context.Background()
	var fromCache, waited, refused int
	for range 20_000 {
		now = now.Add(time.Duration(rng.IntN(40_000)) * time.Microsecond)
		v := limit.Values{Rate: 20, Burst: 5, Requested: 1 + rng.Int64N(2)}
		v.MaxWait = []time.Duration{0, 100 * time.Millisecond, 300 * time.Millisecond, 300*time.Millisecond + 7*time.Microsecond}[rng.IntN(4)]
		b := limit.Bucket{Key: "p:k", Values: v, Args: tokenbucket.Args(v)}
		probe := []limit.Bucket{b}
		if kept.Answer(probe, now) {
			fromCache++
		}
		var c1, c2 limit.Call
		c1.Reset([]limit.Bucket{b})
		c2.Reset([]limit.Bucket{b})
		c1.Sent, c2.Sent = now, now
		a1, err1 := cached.Take(ctx, &c1)
		a2, err2 := bare.Take(ctx, &c2)
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
		if a1 != a2 || c1.Buckets[0].Wait != c2.Buckets[0].Wait {
			t.Fatalf("%+v at %v: under the cache %v waiting %v, the store %v waiting %v (%+v)",
				v, now, a1, c1.Buckets[0].Wait, a2, c2.Buckets[0].Wait, c2.Buckets[0])
		}
		switch {
		case !a1:
			refused++
		case c1.Buckets[0].Wait > 0:
			waited++
		}
		// The cache's wait is the store's, to the microseconds the store's
		// clock and its rounding take.
		if d := c2.Buckets[0].RetryAfter - c1.Buckets[0].RetryAfter; !a1 && (d < 0 || d > 2*time.Microsecond) {
			t.Fatalf("the cache's wait %v, the store's %v", c1.Buckets[0].RetryAfter, c2.Buckets[0].RetryAfter)
		}
	}
	t.Logf("%d waited, %d refused, %d of them from the cache", waited, refused, fromCache)
	if fromCache < 100 || waited < 1000 {
		t.Fatal("the cases tried too little")
	}
}
