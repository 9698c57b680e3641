package tokenbucket

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// Waiting instead of refusing (max_wait), in the process: the arithmetic
// that the script's waiting form is tested against (internal/redisstore's
// wait_test.go).

// todaysTakeAt is TakeAt as it was before requests could wait: what a
// request without a max wait must still get, to the bit.
func todaysTakeAt(state limit.State, t int64, v limit.Values, take bool) (after limit.State, took bool, remaining, wait int64) {
	tokens := Refill(state, t, v)
	requested := float64(v.Requested)
	if take && tokens >= requested {
		tokens -= requested
		took = true
	}
	if tokens < requested {
		wait = int64(math.Ceil((requested - tokens) * 1000000 / v.Rate))
	}
	ttl := math.Max(1000, math.Ceil((float64(v.Burst)-tokens)*1000/v.Rate))
	return limit.State{Tokens: tokens, At: t, Expires: t + int64(ttl)*1000}, took, max(0, int64(math.Floor(tokens))), wait
}

func TestMaxWaitZeroTakesAsToday(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 100_000 {
		v := limit.Values{Rate: []float64{0.1, 1, 7.5, 100, 5000.0 / 3600}[rng.IntN(5)], Burst: 1 + rng.Int64N(50)}
		v.Requested = 1 + rng.Int64N(v.Burst)
		state := limit.State{Tokens: rng.Float64()*float64(v.Burst+20) - 20, At: 1_000_000}
		at, take := state.At+rng.Int64N(5_000_000), rng.IntN(2) == 0
		after, took, remaining, wait, goWait := TakeWaitingAt(state, at, v, take)
		a2, t2, r2, w2 := todaysTakeAt(state, at, v, take)
		if after != a2 || took != t2 || remaining != r2 || wait != w2 || goWait != 0 {
			t.Fatalf("%+v at %+v, take %v: %+v %v %d %d wait %d; today %+v %v %d %d", state, v, take, after, took, remaining, wait, goWait, a2, t2, r2, w2)
		}
		b := limit.Bucket{Values: v}
		if b.Waits() {
			t.Fatal("a bucket without a max wait waits")
		}
	}
}

func TestWaitingTakeGoesBelowZeroWithinMaxWait(t *testing.T) {
	const t0 = int64(1_000_000_000)
	v := limit.Values{Rate: 10, Burst: 10, Requested: 2, MaxWait: 500 * time.Millisecond}
	empty := limit.State{Tokens: 0.5, At: t0, Expires: t0 + 10_000_000}
	for _, tc := range []struct {
		name                  string
		state                 limit.State
		took                  bool
		tokens                float64
		remaining, wait, goAt int64
	}{
		{"holds them: goes at once", limit.State{Tokens: 3, At: t0}, true, 1, 1, 100_000, 0},
		{"short by 1.5 tokens: waits 150 ms", empty, true, -1.5, 0, 350_000, 150_000},
		{"short by exactly the max wait: waits it", limit.State{Tokens: -3, At: t0}, true, -5, 0, 700_000, 500_000},
		{"a microsecond past the max wait: refused, takes nothing", limit.State{Tokens: -3.00001, At: t0}, false, -3.00001, 0, 500_001, 0},
	} {
		after, took, remaining, wait, goWait := TakeWaitingAt(tc.state, t0, v, true)
		if took != tc.took || after.Tokens != tc.tokens || remaining != tc.remaining || wait != tc.wait || goWait != tc.goAt {
			t.Errorf("%s: took %v, %v tokens, remaining %d, wait %d µs, goes in %d µs; want %v, %v, %d, %d, %d",
				tc.name, took, after.Tokens, remaining, wait, goWait, tc.took, tc.tokens, tc.remaining, tc.wait, tc.goAt)
		}
	}
	// A refusal's wait less the max wait is when the request fits: then
	// it is admitted, waiting exactly its max wait; a microsecond before,
	// refused.
	state := limit.State{Tokens: -4, At: t0}
	_, _, _, wait, _ := TakeWaitingAt(state, t0, v, true)
	fits := t0 + wait - MaxWaitMicros(v.MaxWait)
	if _, took, _, _, _ := TakeWaitingAt(state, fits-1, v, true); took {
		t.Errorf("admitted a microsecond before it fits")
	}
	if _, took, _, _, goWait := TakeWaitingAt(state, fits, v, true); !took || goWait != MaxWaitMicros(v.MaxWait) {
		t.Errorf("when it fits: took %v, goes in %d µs; want admitted after the max wait", took, goWait)
	}
	// The kind: Holds and Take agree, and the answer carries the wait.
	b := limit.Bucket{Values: v}
	if _, holds := (Kind{}).Holds(empty, true, time.Time{}, t0, b); !holds {
		t.Fatal("Holds refuses a request that could wait")
	}
	b, after, store := Kind{}.Take(empty, true, time.Time{}, t0, b, true)
	if !store || after.Tokens != -1.5 || b.Wait != 150*time.Millisecond || b.RetryAfter != 350*time.Millisecond || b.Remaining != 0 {
		t.Fatalf("Take: %+v, stored %v %+v", b, store, after)
	}
	// Remembered only until it fits: its wait less its max wait.
	if ttl := (Kind{}).DenialTTL(limit.Bucket{Values: v, RetryAfter: 800 * time.Millisecond}); ttl != 300*time.Millisecond {
		t.Fatalf("DenialTTL %v, want 300ms", ttl)
	}
	if ttl := (Kind{}).DenialTTL(limit.Bucket{Values: v, RetryAfter: 400 * time.Millisecond}); ttl != 0 {
		t.Fatalf("DenialTTL %v of a refusal that fits now, want 0", ttl)
	}
}

// goTime is an admitted take: its tokens, and when it goes on.
type goTime struct{ at, tokens int64 }

// checkBoundAtGoTimes fails when the go-times of some interval of length
// T take more than burst + rate*T tokens; the go-times are rounded up to
// the microsecond, hence rate * 1 µs of slack.
func checkBoundAtGoTimes(t testing.TB, goes []goTime, v limit.Values, windows []time.Duration) (fullest float64) {
	t.Helper()
	slices.SortFunc(goes, func(a, b goTime) int { return int(a.at - b.at) })
	for _, T := range windows {
		micros := T.Microseconds()
		bound := float64(v.Burst) + v.Rate*float64(micros+1)/1e6
		var sum int64
		j := 0
		for i := range goes { // windows starting at each go-time: the fullest ones
			for j < len(goes) && goes[j].at <= goes[i].at+micros {
				sum += goes[j].tokens
				j++
			}
			if float64(sum) > bound {
				t.Fatalf("%d tokens go on in [%d, %d] µs, more than burst + rate*T = %.3f", sum, goes[i].at, goes[i].at+micros, bound)
			}
			fullest = max(fullest, float64(sum)/bound)
			sum -= goes[i].tokens
		}
	}
	return fullest
}

func TestWaitingArithmeticBoundAtGoTimes(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	v := limit.Values{Rate: 50, Burst: 10}
	var state limit.State
	ok := false
	var goes []goTime
	now := int64(1_000_000)
	for range 20_000 { // three times the rate, in bursts
		now += rng.Int64N(2 * 1_000_000 / 150)
		v.Requested = 1 + rng.Int64N(3)
		v.MaxWait = time.Duration(rng.Int64N(400)) * time.Millisecond
		current, at := Current(state, ok, now, v)
		after, took, _, _, goWait := TakeWaitingAt(current, at, v, true)
		if !took {
			continue
		}
		state, ok = after, true
		if after.Tokens < -v.Rate*v.MaxWait.Seconds() {
			t.Fatalf("the bucket went to %v, deeper than its max wait %v allows", after.Tokens, v.MaxWait)
		}
		if goWait > MaxWaitMicros(v.MaxWait) {
			t.Fatalf("waits %d µs, more than its max wait %v", goWait, v.MaxWait)
		}
		goes = append(goes, goTime{at + goWait, v.Requested})
	}
	if len(goes) < 1000 {
		t.Fatalf("only %d admitted: the case tried too little", len(goes))
	}
	fullest := checkBoundAtGoTimes(t, goes, v, []time.Duration{time.Millisecond, 100 * time.Millisecond, time.Second, 10 * time.Second})
	t.Logf("%d admitted; the fullest interval took %.3f of burst + rate*T", len(goes), fullest)
}
