package tokenbucket

import (
	"math"
	"testing"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// Settling what a response cost in a bucket (settle.lua's arithmetic),
// and a take from a bucket in debt, without any process.

func TestSettleBucketExamples(t *testing.T) {
	const t0 = int64(1_700_000_000_000_000)
	v := limit.Values{Rate: 10, Burst: 100, Requested: 20}
	at := func(tokens float64) limit.State { return limit.State{Tokens: tokens, At: t0} }
	for _, tc := range []struct {
		name          string
		state         limit.State
		t             int64
		diff, maxDebt int64
		want          float64 // tokens after
		forgiven      float64
	}{
		{"a smaller cost gives back", at(50), t0, -15, 100, 65, 0},
		{"a give-back is capped at the burst", at(95), t0, -15, 100, 100, 0},
		{"... after refilling first", at(50), t0 + 4_000_000, -15, 100, 100, 0},
		{"a larger cost takes the rest", at(50), t0, 30, 100, 20, 0},
		{"... below zero", at(10), t0, 30, 100, -20, 0},
		{"... down to -max_debt, the rest forgiven", at(10), t0, 130, 100, -100, 20},
		{"max_debt 0: no debt", at(10), t0, 30, 0, 0, 20},
		{"a take never raises a bucket below -max_debt", at(-120), t0, 5, 100, -120, 5},
		{"refill counts from debt", at(-50), t0 + 2_000_000, 10, 100, -40, 0},
		{"a fractional bucket forgives a fraction", at(0.5), t0, 200, 100, -100, 99.5},
	} {
		after, forgiven := SettleAt(tc.state, tc.t, v, tc.diff, tc.maxDebt)
		if after.Tokens != tc.want || forgiven != tc.forgiven || after.At != tc.t {
			t.Errorf("%s: %v tokens at %d, %v forgiven; want %v at %d, %v forgiven",
				tc.name, after.Tokens, after.At, forgiven, tc.want, tc.t, tc.forgiven)
		}
		// The bucket is kept until it would be full again, from debt too.
		fill := int64(math.Max(1000, math.Ceil((100-after.Tokens)*1000/10))) * 1000
		if after.Expires != tc.t+fill {
			t.Errorf("%s: expires %d µs after, want %d (full again)", tc.name, after.Expires-tc.t, fill)
		}
	}

	// In debt, a request is refused until the refill covers its
	// reservation, and told exactly when.
	debt, _ := SettleAt(at(0), t0, v, 60, 100) // -60
	_, took, remaining, wait := TakeAt(debt, t0, v, true)
	if took || remaining != 0 || wait != 8_000_000 {
		t.Errorf("a request at -60 for 20 at 10/s: took %v, remaining %d, wait %d µs; want refused, 0, 8 s", took, remaining, wait)
	}
	if _, took, _, _ = TakeAt(debt, t0+wait-1, v, true); took {
		t.Errorf("admitted a microsecond before the wait")
	}
	if _, took, remaining, _ = TakeAt(debt, t0+wait, v, true); !took || remaining != 0 {
		t.Errorf("at the wait: took %v remaining %d, want admitted with 0", took, remaining)
	}
}
