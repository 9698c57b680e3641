package ratelimit

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// The token bucket's arithmetic: the properties of the memory store's
// takeBucket (memstore.go; scriptTake in helpers_test.go gives it the
// script's shape), without any process; then script.lua itself, through
// a real redis-server, against it: the Go bucket and the Lua one must
// agree on every decision, remaining count and wait.

// bucketLimits are the limits the arithmetic is tried with: whole and
// fractional rates, including ones no decimal writes exactly (100/1m,
// 0.3), and costly requests.
var bucketLimits = []struct {
	name             string
	rate             float64
	burst, requested int64
}{
	{"10/s burst 20", 10, 20, 1},
	{"0.5/s burst 1", 0.5, 1, 1},
	{"100/1m burst 100 cost 25", 100.0 / 60, 100, 25},
	{"0.3/s burst 2 cost 2", 0.3, 2, 2},
	{"5000/1h burst 7 cost 2", 5000.0 / 3600, 7, 2},
	{"1000/s burst 1000 cost 3", 1000, 1000, 3},
}

const microsPerSecond = 1_000_000

// fillMicros is how long tokens take to refill, in microseconds.
func fillMicros(rate float64, tokens int64) int64 {
	return int64(math.Ceil(float64(tokens) * microsPerSecond / rate))
}

// arrivals is the sequence of requests both the properties and the
// script are tried with, for bucketLimits[i]: phases of arrivals at a
// fraction or a multiple of the rate, each long enough to empty the
// bucket and after an idle time that refills it; a tenth of the requests
// come about when the last wait ends, and some at once. It returns how
// many requests there are, and the gap in microseconds before each,
// given the wait the previous one was told.
func arrivals(i int) (n int, gap func(n int, lastWait int64) int64) {
	l := bucketLimits[i]
	rng := rand.New(rand.NewPCG(1, uint64(i)))
	fill, one := fillMicros(l.rate, l.burst), fillMicros(l.rate, l.requested)
	loads := []float64{0.5, 1, 1.5, 3, 20}
	phase := max(200, int(2*l.burst/l.requested))
	return phase * len(loads), func(n int, lastWait int64) int64 {
		switch r := rng.IntN(10); {
		case n%phase == 0:
			return rng.Int64N(3 * fill)
		case r == 0:
			return max(0, lastWait+rng.Int64N(5)-2)
		case r < 4:
			return 0
		default:
			return int64(rng.ExpFloat64() * float64(one) / loads[n/phase])
		}
	}
}

func TestScriptTakeExamples(t *testing.T) {
	const t0 = int64(1_700_000_000_000_000) // a Redis time, in microseconds
	type answer struct {
		allowed         bool
		remaining, wait int64
	}
	ask := func(b scriptBucket, now int64, rate float64, burst, requested int64) (scriptBucket, answer) {
		after, allowed, remaining, wait := scriptTake(b, now, rate, burst, requested)
		return after, answer{allowed, remaining, wait}
	}
	expect := func(what string, got, want answer) {
		t.Helper()
		if got != want {
			t.Errorf("%s: %+v, want %+v", what, got, want)
		}
	}

	// A new bucket is full; the last token taken, the next one is a
	// refill interval away.
	b, got := ask(scriptBucket{}, t0, 10, 3, 1)
	expect("new bucket", got, answer{true, 2, 0})
	b, _ = ask(b, t0, 10, 3, 1)
	b, got = ask(b, t0, 10, 3, 1)
	expect("last token", got, answer{true, 0, 100_000})
	// Refill is continuous: 35 ms at 10/s is 0.35 tokens, and the wait
	// for the rest is rounded up to the microsecond. A denial stores
	// nothing.
	denied, got := ask(b, t0+35_000, 10, 3, 1)
	expect("denied", got, answer{false, 0, 65_000})
	if denied != b {
		t.Errorf("a denial changed the bucket: %+v, was %+v", denied, b)
	}
	// After the wait, exactly: the token is there.
	_, got = ask(b, t0+100_000, 10, 3, 1)
	expect("after the wait", got, answer{true, 0, 100_000})
	// Remaining is rounded down: 2.5 tokens after 250 ms, one taken.
	_, got = ask(b, t0+250_000, 10, 3, 1)
	expect("2.5 tokens", got, answer{true, 1, 0})
	// Long idle caps at burst, exactly.
	full, got := ask(b, t0+1_000_000_000, 10, 3, 1)
	expect("long idle", got, answer{true, 2, 0})
	if full.tokens != 2 {
		t.Errorf("after a long idle and one take: %v tokens, want exactly 2", full.tokens)
	}
	// Fractional rate: one token every 2 s; a wait of one microsecond
	// just before it.
	b, got = ask(scriptBucket{}, t0, 0.5, 1, 1)
	expect("0.5/s first", got, answer{true, 0, 2_000_000})
	_, got = ask(b, t0+1_999_999, 0.5, 1, 1)
	expect("0.5/s a microsecond early", got, answer{false, 0, 1})
	_, got = ask(b, t0+2_000_000, 0.5, 1, 1)
	expect("0.5/s on time", got, answer{true, 0, 2_000_000})
	// Costly requests: 3 of 10, refilled at 1/s.
	b, got = ask(scriptBucket{}, t0, 1, 10, 3)
	expect("cost 3", got, answer{true, 7, 0})
	b, _ = ask(b, t0, 1, 10, 3)
	b, got = ask(b, t0, 1, 10, 3)
	expect("cost 3, third", got, answer{true, 1, 2_000_000})
	_, got = ask(b, t0+500_000, 1, 10, 3)
	expect("cost 3, 1.5 held", got, answer{false, 1, 1_500_000})
}

// TestScriptTakeProperties checks, over random arrivals, what the README
// promises of the bucket: over any window of length T it admits at most
// burst + rate*T tokens; a denial leaves the bucket as it was; remaining
// is the whole tokens left; an idle bucket refills to exactly burst; the
// wait is when the requested tokens are back, to the microsecond, give or
// take one: the script's float arithmetic (the division that gives the
// wait, the refill that later adds it back) can round either way across
// a whole microsecond, so a request may be admitted a microsecond before
// its wait ends, or denied when it ends and admitted a microsecond later.
func TestScriptTakeProperties(t *testing.T) {
	for i, l := range bucketLimits {
		t.Run(l.name, func(t *testing.T) {
			fill := fillMicros(l.rate, l.burst)
			type event struct {
				now     int64
				allowed bool
			}
			var (
				events                       []event
				b                            scriptBucket
				now                          = int64(1_700_000_000_000_000)
				lastWait                     int64
				denied, waitsShort, waitLong int
			)
			requests, gap := arrivals(i)
			for n := range requests {
				now += gap(n, lastWait)
				tokens := scriptRefill(b, now, l.rate, l.burst)
				if tokens < 0 || tokens > float64(l.burst) {
					t.Fatalf("the bucket holds %v tokens, outside [0, %d]", tokens, l.burst)
				}
				if b.present && now-b.at >= fill && tokens != float64(l.burst) {
					t.Fatalf("idle for the fill time, the bucket holds %v tokens, not %d", tokens, l.burst)
				}
				after, allowed, remaining, wait := scriptTake(b, now, l.rate, l.burst, l.requested)
				left := tokens
				if allowed {
					left -= float64(l.requested)
				} else if after != b {
					t.Fatalf("a denial changed the bucket from %+v to %+v", b, after)
				}
				if remaining != int64(math.Floor(left)) || remaining < 0 {
					t.Fatalf("remaining %d with %v tokens left", remaining, left)
				}
				if allowed != (tokens >= float64(l.requested)) {
					t.Fatalf("allowed %v with %v tokens for %d", allowed, tokens, l.requested)
				}
				if (wait == 0) != (left >= float64(l.requested)) {
					t.Fatalf("wait %d with %v tokens left, %d requested", wait, left, l.requested)
				}
				if wait > 0 {
					admitted := func(at int64) bool {
						_, ok, _, _ := scriptTake(after, at, l.rate, l.burst, l.requested)
						return ok
					}
					switch {
					case !admitted(now + wait + 1):
						t.Fatalf("denied a microsecond after the wait of %d µs (%v tokens left)", wait, left)
					case wait > 1 && admitted(now+wait-2):
						t.Fatalf("admitted two microseconds before the wait of %d µs (%v tokens left)", wait, left)
					case !admitted(now + wait):
						waitsShort++
					case admitted(now + wait - 1):
						waitLong++
					}
				}
				lastWait = wait
				if !allowed {
					denied++
				}
				events = append(events, event{now, allowed})
				b = after
			}
			t.Logf("%d of %d denied; waits a microsecond short: %d, long: %d", denied, len(events), waitsShort, waitLong)
			if denied < len(events)/10 || denied > len(events)*9/10 {
				t.Fatalf("%d of %d denied: the arrivals tried too little", denied, len(events))
			}
			// Every window [events[i].now, events[j].now].
			for i := range events {
				taken := int64(0)
				for j := i; j < len(events); j++ {
					if events[j].allowed {
						taken += l.requested
					}
					bound := float64(l.burst) + l.rate*float64(events[j].now-events[i].now)/microsPerSecond
					if float64(taken) > bound*(1+1e-12) {
						t.Fatalf("%d tokens admitted in %d µs, more than burst + rate*T = %v",
							taken, events[j].now-events[i].now, bound)
					}
				}
			}
		})
	}
}

// TestScriptAgreesWithMemoryStore feeds the sequences of the properties
// test (arrivals) to script.lua in a real redis-server, and checks that
// the memory store's bucket (scriptTake) gives the same decision,
// remaining and wait at every step, and that both store the same tokens.
//
// The script reads its clock from Redis (TIME), so each step is one
// MULTI (runScriptStep) that stores the bucket ("<tokens> <microseconds>")
// as long before Redis's time as the sequence says and runs the script
// between two TIME calls: the script's time is a few microseconds later
// than meant. An allowed take stores that time, so scriptTake is asked at
// exactly it; a denial stores nothing, so scriptTake must give the same
// answer at some microsecond between the two TIMEs (the wait pins it to
// about one).
func TestScriptAgreesWithMemoryStore(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	if sha, err := rdb.ScriptLoad(context.Background(), scriptSource).Result(); err != nil || sha != scriptSHA {
		t.Fatalf("SCRIPT LOAD: %q %v, want %s", sha, err, scriptSHA)
	}
	for i, l := range bucketLimits {
		t.Run(l.name, func(t *testing.T) {
			key := "oracle:" + strconv.Itoa(i)
			args := limitArgs(l.rate, l.burst, l.requested)
			var (
				b               scriptBucket // at: in the sequence's time
				now, lastWait   int64        // the sequence's time
				allowed, denied int
				requests, gap   = arrivals(i)
			)
			for n := range requests {
				now += gap(n, lastWait)
				stored, t0, reply, t1, after := runScriptStep(t, rdb, key, b, now-b.at, args[:])
				what := fmt.Sprintf("request %d: bucket %+v, reply %v", n, stored, reply)
				lastWait = reply[2]
				if reply[0] == 1 {
					allowed++
					if after.at < t0 || after.at > t1 {
						t.Fatalf("%s: the script's time %d is outside [%d, %d]", what, after.at, t0, t1)
					}
					want, ok, remaining, wait := scriptTake(stored, after.at, l.rate, l.burst, l.requested)
					if got := [3]int64{1, remaining, wait}; !ok || got != reply {
						t.Fatalf("%s: scriptTake at the script's time answers allowed %v, remaining %d, wait %d",
							what, ok, remaining, wait)
					}
					if after != want {
						t.Fatalf("%s: the script stored %+v, scriptTake %+v", what, after, want)
					}
					b = scriptBucket{tokens: after.tokens, at: now, present: true}
					continue
				}
				denied++
				if after != stored {
					t.Fatalf("%s: a denial changed the bucket to %+v", what, after)
				}
				if !agreesWithin(stored, t0, t1, l.rate, l.burst, l.requested, reply) {
					_, a0, r0, w0 := scriptTake(stored, t0, l.rate, l.burst, l.requested)
					_, a1, r1, w1 := scriptTake(stored, t1, l.rate, l.burst, l.requested)
					t.Fatalf("%s: scriptTake gives it at no time in [%d, %d]; at the ends: %v %d %d, %v %d %d",
						what, t0, t1, a0, r0, w0, a1, r1, w1)
				}
			}
			t.Logf("%d allowed, %d denied", allowed, denied)
			if denied < 50 || allowed < 50 {
				t.Fatalf("%d allowed and %d denied: the sequence tried too little", allowed, denied)
			}
		})
	}
}

// agreesWithin says whether scriptTake gives the reply of a denial at
// some microsecond in [t0, t1].
func agreesWithin(b scriptBucket, t0, t1 int64, rate float64, burst, requested int64, reply [3]int64) bool {
	for now := t0; now <= t1; now++ {
		_, ok, remaining, wait := scriptTake(b, now, rate, burst, requested)
		if !ok && remaining == reply[1] && wait == reply[2] {
			return true
		}
	}
	return false
}

// storeBucket stores ARGV[1] tokens at KEYS[1] as the script does,
// ARGV[2] microseconds before Redis's time.
const storeBucket = `
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. string.format('%d', now - tonumber(ARGV[2])), 'PX', 60000)
return 1`

// runScriptStep is one MULTI: it stores b's tokens at key, elapsed
// microseconds before Redis's time (an absent b deletes the key), then
// runs the script between two TIME calls. It returns the bucket as
// stored, the two times (microseconds), the script's reply, and the
// bucket afterwards.
func runScriptStep(t *testing.T, rdb *redis.Client, key string, b scriptBucket, elapsed int64, args []any) (
	stored scriptBucket, t0 int64, reply [3]int64, t1 int64, after scriptBucket) {
	t.Helper()
	ctx := context.Background()
	var (
		before, then   *redis.StringCmd
		clock0, clock1 *redis.TimeCmd
		take           *redis.Cmd
	)
	_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		if b.present {
			tokens := strconv.FormatFloat(b.tokens, 'g', 17, 64)
			p.Eval(ctx, storeBucket, []string{key}, tokens, elapsed)
		} else {
			p.Del(ctx, key)
		}
		before, clock0 = p.Get(ctx, key), p.Time(ctx)
		take = p.EvalSha(ctx, scriptSHA, []string{key}, args...)
		clock1, then = p.Time(ctx), p.Get(ctx, key)
		return nil
	})
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	v, err := take.Int64Slice()
	if err != nil || len(v) != 3 {
		t.Fatalf("script reply %v, %v", v, err)
	}
	if stored, err = parseBucket(before); err == nil {
		after, err = parseBucket(then)
	}
	if err != nil {
		t.Fatal(err)
	}
	return stored, clock0.Val().UnixMicro(), [3]int64(v), clock1.Val().UnixMicro(), after
}

// TestScriptAndMemoryStoreExpireAlikeAcrossPlanChanges: a bucket written
// at one plan's values is taken from at another's (or the same), in
// script.lua in a real redis-server and in the memory store's settle.
// Both give the same decision, and the key's expiry afterwards agrees
// with the memory bucket's to a few milliseconds (the TTL is whole
// milliseconds): a denial at a slower plan extends it to when the bucket
// is full at that plan, at unchanged values it writes nothing.
func TestScriptAndMemoryStoreExpireAlikeAcrossPlanChanges(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	if err := rdb.ScriptLoad(ctx, scriptSource).Err(); err != nil {
		t.Fatal(err)
	}
	plans := []limit.Values{{Rate: 100, Burst: 100, Requested: 1}, {Rate: 0.1, Burst: 20, Requested: 1}, {Rate: 10, Burst: 20, Requested: 1}, {Rate: 0.5, Burst: 1, Requested: 1}, {Rate: 5000.0 / 3600, Burst: 7, Requested: 2}, {Rate: 1000, Burst: 1000, Requested: 3}}
	rng := rand.New(rand.NewPCG(7, 8))
	var extended, kept, allowed int
	for n := range 600 {
		was, now := plans[rng.IntN(len(plans))], plans[rng.IntN(len(plans))]
		// A key written at was's values: tokens left, written elapsed ago,
		// expiring when the bucket would be full at was's values.
		// Half the cases near empty and lately written, to be denied.
		tokens := rng.Float64() * float64(was.Burst)
		if n%2 == 0 {
			tokens = rng.Float64() * float64(min(was.Burst, 3))
		}
		fill := int64(math.Max(1000, math.Ceil((float64(was.Burst)-tokens)*1000/was.Rate)))
		elapsed := rng.Int64N(fill - 5) // milliseconds; the key lives 5 ms more at least
		if n%2 == 0 {
			elapsed = rng.Int64N(20)
		}
		key, args := "expiry:"+strconv.Itoa(n), tokenbucket.Args(now)
		var stored *redis.StringCmd
		var clock0, clock1, clock2 *redis.TimeCmd
		var take *redis.Cmd
		var pttl *redis.DurationCmd
		_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
			p.Eval(ctx, storeBucketFor, []string{key}, strconv.FormatFloat(tokens, 'g', 17, 64), elapsed*1000, fill-elapsed)
			stored, clock0 = p.Get(ctx, key), p.Time(ctx)
			take = p.EvalSha(ctx, scriptSHA, []string{key}, args[:]...)
			clock1, pttl, clock2 = p.Time(ctx), p.PTTL(ctx, key), p.Time(ctx)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		b, err := parseBucket(stored)
		if err != nil {
			t.Fatal(err)
		}
		reply, err := take.Int64Slice()
		if err != nil || len(reply) != 3 {
			t.Fatalf("script reply %v, %v", reply, err)
		}
		t0, t1, t2 := clock0.Val().UnixMicro(), clock1.Val().UnixMicro(), clock2.Val().UnixMicro()
		// The key's expiry in Redis time: stored when written, fill-elapsed
		// ms from then (the store ran right before t0).
		state := limit.State{Tokens: b.tokens, At: b.at, Expires: b.at + fill*1000}
		what := fmt.Sprintf("case %d: %+v written at %+v, taken at %+v: reply %v", n, state, was, now, reply)
		// The script ran at some time in [t0, t1]: an admitted take stores
		// it; a denial pins it to about a microsecond by its wait. Every
		// time that gives the script's reply gives an expiry; on a loaded
		// machine [t0, t1] may span milliseconds, so the expiries span some.
		var store, ok bool
		expiresFrom, expiresTo := int64(math.MaxInt64), int64(math.MinInt64)
		for at := t0; at <= t1; at++ {
			current, from := tokenbucket.Current(state, true, at, now)
			admit := tokenbucket.Refill(current, from, now) >= float64(now.Requested)
			after, stored, remaining, wait := tokenbucket.Answer(state, true, at, now, admit)
			if [3]int64(reply) == [3]int64{boolInt(admit), remaining, wait} {
				ok, store = true, stored
				expiresFrom, expiresTo = min(expiresFrom, after.Expires), max(expiresTo, after.Expires)
			}
		}
		if !ok {
			t.Fatalf("%s: the memory store answers otherwise at every time in [%d, %d]", what, t0, t1)
		}
		// PTTL (whole milliseconds) counts from the transaction's clock,
		// which Redis 7 freezes when EXEC starts (before t0), or from when
		// it ran (before t2): the memory bucket's expiry less a time in
		// [t0, t2], to the millisecond.
		ms := pttl.Val().Microseconds()
		if ms < expiresFrom-t2-1000 || ms > expiresTo-t0+1000 {
			t.Fatalf("%s: the key expires in %d µs, the memory bucket in %d to %d µs (stored: %v)",
				what, ms, expiresFrom-t2, expiresTo-t0, store)
		}
		switch {
		case reply[0] == 1:
			allowed++
		case store:
			extended++
		default:
			kept++
		}
	}
	t.Logf("%d admitted, %d denials extended the expiry, %d left it", allowed, extended, kept)
	if allowed < 50 || extended < 50 || kept < 50 {
		t.Fatalf("%d admitted, %d extended, %d kept: the cases tried too little", allowed, extended, kept)
	}
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// storeBucketFor stores ARGV[1] tokens at KEYS[1] as the script does,
// ARGV[2] microseconds before Redis's time, expiring ARGV[3] milliseconds
// from now.
const storeBucketFor = `
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. string.format('%d', now - tonumber(ARGV[2])), 'PX', ARGV[3])
return 1`
