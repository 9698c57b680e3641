package ratelimit

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Settling what responses cost (charge.go, settle.lua): the arithmetic of
// settleBucket without any process, then settle.lua in a real
// redis-server against it, and the take script on a bucket in debt.

func TestSettleBucketExamples(t *testing.T) {
	const t0 = int64(1_700_000_000_000_000)
	v := limitValues{rate: 10, burst: 100, requested: 20}
	at := func(tokens float64) memoryBucket { return memoryBucket{tokens: tokens, at: t0} }
	for _, tc := range []struct {
		name          string
		state         memoryBucket
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
		after, forgiven := settleBucket(tc.state, tc.t, v, tc.diff, tc.maxDebt)
		if after.tokens != tc.want || forgiven != tc.forgiven || after.at != tc.t {
			t.Errorf("%s: %v tokens at %d, %v forgiven; want %v at %d, %v forgiven",
				tc.name, after.tokens, after.at, forgiven, tc.want, tc.t, tc.forgiven)
		}
		// The bucket is kept until it would be full again, from debt too.
		fill := int64(math.Max(1000, math.Ceil((100-after.tokens)*1000/10))) * 1000
		if after.expires != tc.t+fill {
			t.Errorf("%s: expires %d µs after, want %d (full again)", tc.name, after.expires-tc.t, fill)
		}
	}

	// In debt, a request is refused until the refill covers its
	// reservation, and told exactly when.
	debt, _ := settleBucket(at(0), t0, v, 60, 100) // -60
	_, took, remaining, wait := takeBucket(debt, t0, v, true)
	if took || remaining != 0 || wait != 8_000_000 {
		t.Errorf("a request at -60 for 20 at 10/s: took %v, remaining %d, wait %d µs; want refused, 0, 8 s", took, remaining, wait)
	}
	if _, took, _, _ = takeBucket(debt, t0+wait-1, v, true); took {
		t.Errorf("admitted a microsecond before the wait")
	}
	if _, took, remaining, _ = takeBucket(debt, t0+wait, v, true); !took || remaining != 0 {
		t.Errorf("at the wait: took %v remaining %d, want admitted with 0", took, remaining)
	}
}

// storeSettleStep is runScriptStep for settle.lua: one MULTI that stores
// b's tokens at key, elapsed microseconds before Redis's time (an absent
// b deletes the key), and settles between two TIME calls. It returns the
// bucket as stored, the two times, the script's reply (the tokens
// forgiven), the bucket afterwards and its TTL.
func storeSettleStep(t *testing.T, rdb *redis.Client, key string, b scriptBucket, elapsed int64, args []any) (
	stored scriptBucket, t0, forgiven, t1 int64, after scriptBucket, ttl int64) {
	t.Helper()
	ctx := context.Background()
	var (
		before, then   *redis.StringCmd
		clock0, clock1 *redis.TimeCmd
		settle         *redis.Cmd
		pttl           *redis.DurationCmd
	)
	_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		if b.present {
			p.Eval(ctx, storeBucket, []string{key}, strconv.FormatFloat(b.tokens, 'g', 17, 64), elapsed)
		} else {
			p.Del(ctx, key)
		}
		before, clock0 = p.Get(ctx, key), p.Time(ctx)
		settle = p.EvalSha(ctx, settleScript.sha.(string), []string{key}, args...)
		clock1, then, pttl = p.Time(ctx), p.Get(ctx, key), p.PTTL(ctx, key)
		return nil
	})
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	v, err := settle.Int64Slice()
	if err != nil || len(v) != 1 {
		t.Fatalf("settle reply %v, %v", v, err)
	}
	if stored, err = parseBucket(before); err == nil {
		after, err = parseBucket(then)
	}
	if err != nil {
		t.Fatal(err)
	}
	return stored, clock0.Val().UnixMicro(), v[0], clock1.Val().UnixMicro(), after, pttl.Val().Milliseconds()
}

// TestSettleScriptAgreesWithMemoryStore: settle.lua in a real
// redis-server and settleBucket agree on the tokens stored, the tokens
// forgiven and the key's life, over random buckets (full, fractional, in
// debt, missing) and differences (give-backs past the burst, takes past
// -max_debt); and the take script on the bucket afterwards answers a
// remaining of 0 in debt and the exact wait.
func TestSettleScriptAgreesWithMemoryStore(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	for _, src := range []string{settleSource, scriptSource} {
		if err := rdb.ScriptLoad(ctx, src).Err(); err != nil {
			t.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(3, 21))
	debts, forgivenSeen, cappedSeen := 0, 0, 0
	for i, l := range bucketLimits {
		v := limitValues{l.rate, l.burst, l.requested}
		maxDebt := []int64{0, l.burst, 3 * l.burst}[i%3]
		for n := range 300 {
			key := fmt.Sprintf("settle:%d:%d", i, n)
			var b scriptBucket
			if rng.IntN(8) > 0 {
				b = scriptBucket{present: true, tokens: float64(l.burst) * (rng.Float64()*2.5 - 1.4)}
				if rng.IntN(3) == 0 {
					b.tokens = math.Round(b.tokens)
				}
			}
			elapsed := rng.Int64N(fillMicros(l.rate, l.burst) / 2)
			diff := rng.Int64N(3*l.burst) - l.burst
			_, debtArg := (&chargeRule{maxDebt: maxDebt, maxDebtArg: strconv.FormatInt(maxDebt, 10)}).maxDebtFor(v)
			args := []any{v.scriptArgs()[0], v.scriptArgs()[1], diffArg(diff), debtArg}
			stored, t0, forgiven, t1, after, ttl := storeSettleStep(t, rdb, key, b, elapsed, args)
			what := fmt.Sprintf("%s: bucket %+v, diff %d, max_debt %d", l.name, stored, diff, maxDebt)
			if after.at < t0 && after.present || after.at > t1 {
				t.Fatalf("%s: the script's time %d is outside [%d, %d]", what, after.at, t0, t1)
			}
			now := after.at
			if !after.present { // a full bucket without a key stays so: any time will do
				now = t0
			}
			want, wantForgiven := settleBucket(stored.state(now, l.burst), now, v, diff, maxDebt)
			if !after.present {
				if stored.present || want.tokens != float64(l.burst) {
					t.Fatalf("%s: no key after, settleBucket says %+v", what, want)
				}
				continue
			}
			if after.tokens != want.tokens || forgiven != int64(math.Floor(wantForgiven)) {
				t.Fatalf("%s: the script stored %v and forgave %d, settleBucket %v and %v", what, after.tokens, forgiven, want.tokens, wantForgiven)
			}
			if wantTTL := (want.expires - now) / 1000; ttl > wantTTL || ttl < wantTTL-5 {
				t.Fatalf("%s: TTL %d ms, want %d (until full again)", what, ttl, wantTTL)
			}
			if after.tokens < -float64(maxDebt) && after.tokens < stored.tokens {
				t.Fatalf("%s: the bucket went below -max_debt to %v", what, after.tokens)
			}
			if wantForgiven > 0 {
				forgivenSeen++
			}
			if diff < 0 && after.tokens == float64(l.burst) {
				cappedSeen++
			}
			if after.tokens < 0 {
				debts++
				// The take script in debt: refused, remaining 0 (not
				// negative), the wait until the reservation fits.
				take := limitArgs(l.rate, l.burst, l.requested)
				reply, err := rdb.EvalSha(ctx, scriptSHA, []string{key}, take[:]...).Int64Slice()
				if err != nil || len(reply) != 3 {
					t.Fatalf("%s: take in debt: %v %v", what, reply, err)
				}
				// The take runs a moment after the settlement: its wait is
				// shorter by that moment's refill.
				maxWait := int64(math.Ceil((float64(l.requested) - after.tokens) * 1e6 / l.rate))
				if reply[0] != 0 || reply[1] != 0 || reply[2] > maxWait || reply[2] < maxWait-50_000 {
					t.Fatalf("%s: take at %v tokens: %v; want refused, remaining 0, a wait of at most %d µs", what, after.tokens, reply, maxWait)
				}
			}
		}
	}
	t.Logf("%d settlements into debt, %d forgave, %d give-backs capped at the burst", debts, forgivenSeen, cappedSeen)
	if debts < 100 || forgivenSeen < 50 || cappedSeen < 50 {
		t.Fatalf("the random settlements tried too little")
	}
}
