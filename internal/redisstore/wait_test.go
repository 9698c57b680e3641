package redisstore_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Waiting instead of refusing (max_wait, issue 40): script.lua's waiting
// form in a real redis-server, against the token bucket's arithmetic in
// the process (tokenbucket.TakeWaitingAt), which the memory store and
// on_error local use.

// A bucket of no limit is the token bucket's (the handler sets it).
func init() { limit.Plain = tokenbucket.Kind{} }

// waitScript is a redis-server with script.lua loaded.
type waitScript struct {
	rdb *redis.Client
	sha string
}

func startWaitScript(t *testing.T) waitScript {
	t.Helper()
	source, err := os.ReadFile("script.lua")
	if err != nil {
		t.Fatal(err)
	}
	rdb := redistest.Start(t).Client(t)
	sha, err := rdb.ScriptLoad(context.Background(), string(source)).Result()
	if err != nil {
		t.Fatal(err)
	}
	return waitScript{rdb, sha}
}

// bucket is a request's bucket at key with values v.
func bucket(key string, v limit.Values) limit.Bucket {
	return limit.Bucket{Key: key, Values: v, Args: tokenbucket.Args(v)}
}

// takeResult is one call of the script: its reply, Redis's time just
// before and after it (the script ran in between), and what each key
// holds after it ("" for none).
type takeResult struct {
	reply  []int64
	t0, t1 int64
	stored []string
}

// take runs the script on buckets, as the store sends them (the kind's
// arguments), in a transaction with TIME around it and the keys read
// after it.
func (s waitScript) take(t testing.TB, buckets []limit.Bucket) takeResult {
	t.Helper()
	ctx := context.Background()
	var keys []string
	var args []any
	for i := range buckets {
		keys = append(keys, buckets[i].Key)
		args = buckets[i].Kind().AppendArgs(args, buckets[i])
	}
	var before, after *redis.TimeCmd
	var eval *redis.Cmd
	var gets []*redis.StringCmd
	_, err := s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		before = p.Time(ctx)
		eval = p.EvalSha(ctx, s.sha, keys, args...)
		after = p.Time(ctx)
		for _, k := range keys {
			gets = append(gets, p.Get(ctx, k))
		}
		return nil
	})
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	reply, err := eval.Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	r := takeResult{reply: reply, t0: before.Val().UnixMicro(), t1: after.Val().UnixMicro()}
	for _, g := range gets {
		r.stored = append(r.stored, g.Val())
	}
	return r
}

// storedState reads a bucket as script.lua stores it: "<tokens> <at>".
func storedState(t testing.TB, text string) (tokens float64, at int64) {
	t.Helper()
	f := strings.Fields(text)
	if len(f) != 2 {
		t.Fatalf("stored %q", text)
	}
	tokens, err1 := strconv.ParseFloat(f[0], 64)
	at, err2 := strconv.ParseInt(f[1], 10, 64)
	if err1 != nil || err2 != nil {
		t.Fatalf("stored %q", text)
	}
	return tokens, at
}

// model is the buckets in the process: each key's state, as the memory
// store keeps it.
type model map[string]limit.State

// answer is what the process answers to a take of buckets at t (Redis
// time, microseconds): the reply the script should give, with the
// states after; as the memory store decides (Holds of every bucket, then
// Take of each).
func (m model) answer(buckets []limit.Bucket, t int64) (reply []int64, after model) {
	after = model{}
	allowed := true
	for _, b := range buckets {
		state, ok := m[b.Key]
		_, holds := tokenbucket.Kind{}.Holds(state, ok, time.Time{}, t, b)
		allowed = allowed && holds
	}
	reply = []int64{0}
	if allowed {
		reply[0] = 1
	}
	var waits []int64
	anyWaits := false
	for _, b := range buckets {
		state, ok := m[b.Key]
		b, next, store := tokenbucket.Kind{}.Take(state, ok, time.Time{}, t, b, allowed)
		if store {
			after[b.Key] = next
		}
		reply = append(reply, b.Remaining, b.RetryAfter.Microseconds())
		waits = append(waits, b.Wait.Microseconds())
		anyWaits = anyWaits || b.Waits()
	}
	if anyWaits {
		reply = append(reply, waits...)
	}
	return reply, after
}

// step takes buckets in Redis and in the model, and fails unless both
// answer alike at the time the script ran: exactly, and the states they
// store to the bit. The script's time is the one it stored when it took;
// for a refusal, the times around the call, one of which must give its
// reply.
func (m model) step(t *testing.T, s waitScript, buckets []limit.Bucket) takeResult {
	t.Helper()
	r := s.take(t, buckets)
	what := fmt.Sprintf("take of %+v: reply %v", buckets, r.reply)
	if len(r.reply) > 0 && r.reply[0] == 1 {
		_, at := storedState(t, r.stored[0])
		want, after := m.answer(buckets, at)
		if !slices.Equal(r.reply, want) {
			t.Fatalf("%s at %d; the process answers %v", what, at, want)
		}
		for i, b := range buckets {
			tokens, stored := storedState(t, r.stored[i])
			if st := after[b.Key]; stored != at || tokens != st.Tokens || st.At != at {
				t.Fatalf("%s: %s stored %q, the process %+v", what, b.Key, r.stored[i], st)
			}
		}
		for k, st := range after {
			m[k] = st
		}
		return r
	}
	for at := r.t0; at <= r.t1; at++ {
		if want, after := m.answer(buckets, at); slices.Equal(r.reply, want) {
			for k, st := range after {
				m[k] = st
			}
			for i, b := range buckets { // a refusal writes no bucket
				if st, ok := m[b.Key]; ok && r.stored[i] != "" && !sameState(t, r.stored[i], st) {
					t.Fatalf("%s: %s holds %q after a refusal, the process %+v", what, b.Key, r.stored[i], st)
				}
			}
			return r
		}
	}
	want, _ := m.answer(buckets, r.t0)
	t.Fatalf("%s: the process answers otherwise at every time in [%d, %d] (at the first: %v)", what, r.t0, r.t1, want)
	return r
}

func sameState(t testing.TB, text string, st limit.State) bool {
	tokens, at := storedState(t, text)
	return tokens == st.Tokens && at == st.At
}

func TestWaitingScriptAgreesWithTheProcess(t *testing.T) {
	s := startWaitScript(t)
	rng := rand.New(rand.NewPCG(40, 1))
	// Each key keeps its rate and burst; requests ask their own cost and
	// max wait. Every key refills within a second even from the deepest
	// a wait takes it (its TTL is then at least that: both read it full
	// when it expires).
	plans := map[string]limit.Values{"a": {Rate: 1000, Burst: 20}, "b": {Rate: 200, Burst: 5}, "c": {Rate: 100.0 / 3, Burst: 10}}
	names := []string{"a", "b", "c"}
	waits := []time.Duration{0, 0, time.Millisecond, 5 * time.Millisecond, 20*time.Millisecond + 333*time.Microsecond, 100 * time.Millisecond}
	m := model{}
	var admitted, waited, refused, refusedWaiting int
	for n := range 2500 {
		if n%4 == 3 { // time to refill, now and then
			time.Sleep(time.Duration(rng.IntN(4000)) * time.Microsecond)
		}
		var buckets []limit.Bucket
		for _, i := range rng.Perm(3)[:1+rng.IntN(2)] {
			v := plans[names[i]]
			v.Requested = 1 + rng.Int64N(v.Burst)
			if rng.IntN(3) > 0 {
				v.Requested = 1 + rng.Int64N(min(v.Burst, 3))
			}
			v.MaxWait = waits[rng.IntN(len(waits))]
			buckets = append(buckets, bucket("wait:"+names[i], v))
		}
		r := m.step(t, s, buckets)
		waiting := slices.ContainsFunc(buckets, func(b limit.Bucket) bool { return b.Waits() })
		if want := 1 + 2*len(buckets); waiting {
			want += len(buckets)
		} else if len(r.reply) != want {
			t.Fatalf("a take that waits for no bucket got %v: not today's reply", r.reply)
		}
		switch {
		case r.reply[0] == 0 && waiting:
			refusedWaiting++
		case r.reply[0] == 0:
			refused++
		case waiting && slices.Max(r.reply[1+2*len(buckets):]) > 0:
			waited++
		default:
			admitted++
		}
	}
	t.Logf("%d admitted at once, %d waited, %d refused without a max wait, %d with one", admitted, waited, refused, refusedWaiting)
	if admitted < 100 || waited < 100 || refused < 100 || refusedWaiting < 100 {
		t.Fatal("the cases tried too little")
	}
}

func TestWaitingRefusalTakesNothing(t *testing.T) {
	s := startWaitScript(t)
	v := limit.Values{Rate: 10, Burst: 10, Requested: 10}
	if r := s.take(t, []limit.Bucket{bucket("empty", v)}); r.reply[0] != 1 {
		t.Fatalf("emptying the bucket: %v", r.reply)
	}
	// Short by 5 tokens at 10/s: 500 ms, longer than the max wait.
	v.Requested, v.MaxWait = 5, 200*time.Millisecond
	r := s.take(t, []limit.Bucket{bucket("empty", v)})
	empty, _ := storedState(t, r.stored[0])
	if r.reply[0] != 0 || r.reply[3] != 0 || empty != 0 {
		t.Fatalf("a request that would wait longer than its max wait: reply %v, the bucket holds %q", r.reply, r.stored[0])
	}
	// Its wait says when a take would go on at once: its max wait sooner,
	// it fits.
	if wait := time.Duration(r.reply[2]) * time.Microsecond; wait <= v.MaxWait || wait > 500*time.Millisecond {
		t.Fatalf("refused with a wait of %v, want in (200ms, 500ms]", wait)
	}
	b := []limit.Bucket{bucket("empty", v)}
	if _, err := redisstore.ReadTake(r.reply, b, false); err != nil {
		t.Fatal(err)
	}
	if fits := limit.FitsIn(b); fits != b[0].RetryAfter-v.MaxWait || fits <= 0 {
		t.Fatalf("fits in %v after a wait of %v", fits, b[0].RetryAfter)
	}
	// One token less short: it waits, taking its tokens now.
	v.Requested = 1
	r = s.take(t, []limit.Bucket{bucket("empty", v)})
	tokens, _ := storedState(t, r.stored[0])
	if r.reply[0] != 1 || r.reply[3] <= 0 || r.reply[3] > 100_000 || tokens >= 0 {
		t.Fatalf("a request that can wait: reply %v, the bucket holds %q", r.reply, r.stored[0])
	}
}

func TestWaitingAllOrNothing(t *testing.T) {
	s := startWaitScript(t)
	v := limit.Values{Rate: 10, Burst: 10, Requested: 10}
	s.take(t, []limit.Bucket{bucket("b", v)}) // b empty, a full
	v.Requested, v.MaxWait = 5, 200*time.Millisecond
	r := s.take(t, []limit.Bucket{bucket("a", v), bucket("b", v)})
	if r.reply[0] != 0 || r.stored[0] != "" || !slices.Equal(r.reply[5:], []int64{0, 0}) {
		t.Fatalf("b would wait too long: reply %v, a holds %q (want untouched)", r.reply, r.stored[0])
	}
	// With a max wait long enough for b, a goes at once and b waits: the
	// request waits as long as b, and both took.
	v.MaxWait = time.Second
	r = s.take(t, []limit.Bucket{bucket("a", v), bucket("b", v)})
	a, _ := storedState(t, r.stored[0])
	bt, _ := storedState(t, r.stored[1])
	buckets := []limit.Bucket{bucket("a", v), bucket("b", v)}
	allowed, err := redisstore.ReadTake(r.reply, buckets, false)
	if err != nil || !allowed || a != 5 || bt >= -4 || buckets[0].Wait != 0 || buckets[1].Wait < 400*time.Millisecond || limit.Wait(buckets) != buckets[1].Wait {
		t.Fatalf("both within their max wait: %v %v, reply %v, a %q, b %q, %+v", allowed, err, r.reply, r.stored[0], r.stored[1], buckets)
	}
	// A bucket of a limit whose kind does not wait (a quota's) ignores
	// a max wait: it sends and reads what it always has.
	q := limit.Bucket{Limit: &limit.Limit{}, Values: limit.Values{Rate: 1, Burst: 1, Requested: 1, MaxWait: time.Second}}
	if q.Waits() {
		t.Fatal("a bucket of a kind that does not wait waits")
	}
}

// TestWaitingBoundAtGoTimes offers a bucket three times its rate from
// concurrent clients, each request with its own max wait, and counts
// each admitted request's tokens at its go-time (when the script took
// them, in Redis time, plus its wait): no interval of length T takes more
// than burst + rate*T. Every admitted request waits at most its max wait,
// and every refused one would have had to wait longer.
func TestWaitingBoundAtGoTimes(t *testing.T) {
	s := startWaitScript(t)
	v := limit.Values{Rate: 200, Burst: 10}
	const clients = 12
	var mu sync.Mutex
	var goes []struct{ at, tokens int64 }
	var admitted, waited, refused int
	deadline := time.Now().Add(2 * time.Second)
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 40))
			for time.Now().Before(deadline) {
				// 12 clients of a request each 40 ms on average, 2 tokens:
				// 600 tokens a second, against 200; now and then a pause
				// long enough for the bucket to fill again.
				time.Sleep(time.Duration(rng.IntN(80_000)) * time.Microsecond)
				if rng.IntN(40) == 0 {
					time.Sleep(300 * time.Millisecond)
				}
				w := v
				w.Requested = 1 + rng.Int64N(3)
				w.MaxWait = []time.Duration{0, 10 * time.Millisecond, 50 * time.Millisecond, 200 * time.Millisecond}[rng.IntN(4)]
				r := s.take(t, []limit.Bucket{bucket("bound", w)})
				b := []limit.Bucket{bucket("bound", w)}
				allowed, err := redisstore.ReadTake(r.reply, b, false)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				switch {
				case !allowed:
					refused++
					if b[0].RetryAfter <= w.MaxWait {
						t.Errorf("refused with a wait of %v, within its max wait %v", b[0].RetryAfter, w.MaxWait)
					}
				case b[0].Wait > w.MaxWait:
					t.Errorf("admitted to wait %v, more than its max wait %v", b[0].Wait, w.MaxWait)
				default:
					if b[0].Wait > 0 {
						waited++
					} else {
						admitted++
					}
					_, at := storedState(t, r.stored[0])
					goes = append(goes, struct{ at, tokens int64 }{at + b[0].Wait.Microseconds(), w.Requested})
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	slices.SortFunc(goes, func(a, b struct{ at, tokens int64 }) int { return int(a.at - b.at) })
	fullest := 0.0
	for _, T := range []time.Duration{time.Microsecond, time.Millisecond, 10 * time.Millisecond, 100 * time.Millisecond, time.Second} {
		micros := T.Microseconds()
		// Waits are rounded up to the microsecond: rate * 1 µs of slack.
		bound := float64(v.Burst) + v.Rate*float64(micros+1)/1e6
		var sum int64
		j := 0
		for i := range goes { // the fullest intervals start at a go-time
			for j < len(goes) && goes[j].at <= goes[i].at+micros {
				sum += goes[j].tokens
				j++
			}
			if float64(sum) > bound {
				t.Fatalf("%d tokens go on in %v from %d µs: more than burst + rate*T = %.3f", sum, T, goes[i].at, bound)
			}
			fullest = max(fullest, float64(sum)/bound)
			sum -= goes[i].tokens
		}
	}
	t.Logf("%d admitted at once, %d waited, %d refused; the fullest interval took %.3f of burst + rate*T", admitted, waited, refused, fullest)
	if admitted < 10 || waited < 50 || refused < 50 {
		t.Fatal("the cases tried too little")
	}
}

// TestNoMaxWaitSendsTodaysArguments: a bucket without a max wait sends
// rate, burst and cost, as it always has; one with a max wait, the
// waiting form.
func TestNoMaxWaitSendsTodaysArguments(t *testing.T) {
	b := bucket("k", limit.Values{Rate: 2.5, Burst: 10, Requested: 3})
	if args := b.Kind().AppendArgs(nil, b); !slices.Equal(args, b.Args[:]) {
		t.Fatalf("args %v, want %v", args, b.Args)
	}
	b.Values.MaxWait = 1500 * time.Millisecond
	if args := b.Kind().AppendArgs(nil, b); !slices.Equal(args, []any{"w", "2.5", "10", "3", "1500000"}) {
		t.Fatalf("waiting args %v", args)
	}
	// A limit's fixed max wait is boxed once.
	l := &limit.Limit{}
	l.SetKind(tokenbucket.Kind{})
	l.SetWait(b.Values.MaxWait)
	b.Limit = l
	if args := b.Kind().AppendArgs(nil, b); args[4] != l.WaitArg {
		t.Fatalf("waiting args %v, want the limit's %v", args, l.WaitArg)
	}
	if allocs := testing.AllocsPerRun(100, func() { _ = b.Kind().AppendArgs(make([]any, 0, 8), b) }); allocs > 1 {
		t.Fatalf("%v allocs appending a fixed max wait's args (want the slice's only)", allocs)
	}
}
