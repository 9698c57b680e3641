package ratelimit

// lease.lua against Redis, call by call, and the keys of lease records
// (internal/lease). The handler's use of them is in lease_test.go.

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/lease"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// leaseArg is one bucket of a lease.lua call.
type leaseArg struct {
	key              string
	rate             float64
	burst, requested int64
	held, want       int64
}

// leaseReply is what lease.lua answered, per bucket.
type leaseReply struct {
	allowed   bool
	remaining []int64
	wait      []time.Duration
	lent      []int64
}

// evalLease runs lease.lua as instance id with call number seq, leases
// living life, over the buckets.
func evalLease(t *testing.T, rdb *redis.Client, mode, id string, seq int64, life time.Duration, bs ...leaseArg) leaseReply {
	t.Helper()
	var keys []string
	args := []any{mode, id, seq, life.Microseconds()}
	for _, b := range bs {
		keys = append(keys, b.key, lease.RecordKey(b.key))
		args = append(args, strconv.FormatFloat(b.rate, 'f', -1, 64), b.burst, b.requested, b.held, b.want)
	}
	v, err := rdb.Eval(context.Background(), leaseSource, keys, args...).Int64Slice()
	if err != nil {
		t.Fatalf("lease.lua %s: %v", mode, err)
	}
	n := len(bs)
	if len(v) != 1+3*n {
		t.Fatalf("lease.lua %s: reply %v", mode, v)
	}
	r := leaseReply{allowed: v[0] == 1}
	for i := range n {
		r.remaining = append(r.remaining, v[1+2*i])
		r.wait = append(r.wait, time.Duration(v[2+2*i])*time.Microsecond)
		r.lent = append(r.lent, v[1+2*n+i])
	}
	return r
}

// leaseRecord is one instance's lease as a bucket's record holds it.
type leaseRecord struct {
	tokens, seq int64
	expiry      time.Time
}

// leaseRecords reads the lease record of the bucket at key, by instance.
func leaseRecords(t *testing.T, rdb *redis.Client, key string) map[string]leaseRecord {
	t.Helper()
	text, err := rdb.Get(context.Background(), lease.RecordKey(key)).Result()
	if err == redis.Nil {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	records := map[string]leaseRecord{}
	for _, entry := range strings.Split(text, ",") {
		var id string
		var tokens, expiry, seq int64
		if _, err := fmt.Sscanf(entry, "%s %d %d %d", &id, &tokens, &expiry, &seq); err != nil {
			t.Fatalf("lease record %q: %v", text, err)
		}
		records[id] = leaseRecord{tokens, seq, time.UnixMicro(expiry)}
	}
	return records
}

// setLeaseRecord stores a bucket's lease record: id tokens expiry seq,
// each expiry as an offset from Redis's now; and marks the bucket (if
// stored) with what they hold and the last expiry, as lease.lua leaves
// it. The record lives until its last lease expires, as lease.lua stores
// it: one whose leases all expired is gone already.
func setLeaseRecord(t *testing.T, rdb *redis.Client, key string, now int64, leases ...string) {
	t.Helper()
	ctx := context.Background()
	var entries []string
	var lent int64
	last := int64(math.MinInt64)
	for _, l := range leases {
		f := strings.Fields(l)
		in, err := time.ParseDuration(f[2])
		if len(f) != 4 || err != nil {
			t.Fatalf("lease %q: want <id> <tokens> <expiry from now> <seq>", l)
		}
		entries = append(entries, fmt.Sprintf("%s %s %d %s", f[0], f[1], now+in.Microseconds(), f[3]))
		lent += mustAtoi(t, f[1])
		last = max(last, now+in.Microseconds())
	}
	if last > now {
		if err := rdb.Set(ctx, lease.RecordKey(key), strings.Join(entries, ","), time.Duration(last-now)*time.Microsecond).Err(); err != nil {
			t.Fatal(err)
		}
	}
	b, err := parseBucket(rdb.Get(ctx, key))
	if err != nil {
		t.Fatal(err)
	}
	if b.present {
		if err := rdb.Set(ctx, key, fmt.Sprintf("%.17g %d %d %d", b.tokens, b.at, lent, last), time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// setBucketAt stores a bucket holding tokens at Redis time at (µs).
func setBucketAt(t *testing.T, rdb *redis.Client, key string, tokens float64, at int64) {
	t.Helper()
	if err := rdb.Set(context.Background(), key, fmt.Sprintf("%.17g %d", tokens, at), time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
}

// TestLeaseScriptCountsWhatItLends: lease.lua lends at most what the
// lease should hold less what it holds, and never more than half of what
// the request leaves; the bucket counts what it lent, per instance, and
// does not refill into it; a renewal's report frees what was used; a
// give-back returns what is unused and ends the lease.
func TestLeaseScriptCountsWhatItLends(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const life = time.Minute
	// a thousandth of a token a second: every count below is exact,
	// rounded down. The probe refills at a million a second: whatever
	// the bucket may hold, it holds by the time the probe runs.
	a := leaseArg{key: "rl:count", rate: 0.001, burst: 100, requested: 1}
	probe := leaseArg{key: a.key, rate: 1e6, burst: 100, requested: 1}
	held := func(what string) {
		t.Helper()
		if r := evalLease(t, rdb, "renew", "probe", time.Now().UnixNano(), life, probe); r.remaining[0] != mustAtoi(t, what) {
			t.Fatalf("refilled as fast as can be: %d; want %s", r.remaining[0], what)
		}
	}

	// The first take lends what the lease should hold: 8, from 99.
	first := a
	first.want = 8
	r := evalLease(t, rdb, "take", "i1", 1, life, first)
	if !r.allowed || r.remaining[0] != 91 || r.lent[0] != 8 || r.wait[0] != 0 {
		t.Fatalf("take, want 8: %+v; want allowed, 91 left, 8 lent", r)
	}
	// Another instance's take, wanting 80: half of what is left.
	other := a
	other.want = 80
	r = evalLease(t, rdb, "take", "i2", 1, life, other)
	if !r.allowed || r.lent[0] != 45 || r.remaining[0] != 45 {
		t.Fatalf("another instance wanting 80 of 90 left: %+v; want 45 lent, 45 left", r)
	}
	recs := leaseRecords(t, rdb, a.key)
	if len(recs) != 2 || recs["i1"].tokens != 8 || recs["i2"].tokens != 45 {
		t.Fatalf("records %+v; want i1 8, i2 45", recs)
	}
	// However fast it refills, with 53 lent the bucket holds 47.
	held("47")

	// i1 reports 3 unused of its 8: 5 were spent, the cap rises by 5. It
	// wants 8 again: 5 more.
	report := a
	report.held, report.want = 3, 8
	r = evalLease(t, rdb, "renew", "i1", 2, life, report)
	if r.lent[0] != 8 || r.remaining[0] != 42 {
		t.Fatalf("i1 reports 3, wants 8: %+v; want 8 counted (3 + 5), 47 - 5 = 42 left", r)
	}
	held("47") // 100 - 45 - 8

	// i2 gives back 40 of its 45: they return, and its lease ends.
	give := a
	give.held = 40
	r = evalLease(t, rdb, "give", "i2", 2, life, give)
	if r.remaining[0] != 87 || r.lent[0] != 0 {
		t.Fatalf("i2 gives back 40: %+v; want 87 left, none lent to i2", r)
	}
	if recs := leaseRecords(t, rdb, a.key); len(recs) != 1 || recs["i1"].tokens != 8 {
		t.Fatalf("records after i2's give-back %+v; want only i1's 8", recs)
	}
	// A give-back of more than the lease counts returns only that.
	give.held = 50
	r = evalLease(t, rdb, "give", "i1", 3, life, give)
	if r.remaining[0] != 95 || leaseRecords(t, rdb, a.key) != nil {
		t.Fatalf("i1 gives back 50 of its 8: %d left, records %v; want 95, none", r.remaining[0], leaseRecords(t, rdb, a.key))
	}
	if err := rdb.Get(context.Background(), lease.RecordKey(a.key)).Err(); err != redis.Nil {
		t.Errorf("the record key of a bucket that lends nothing: %v; want none", err)
	}
	held("100")
}

func mustAtoi(t *testing.T, s string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestLeaseScriptExpiredLeaseCountsAsSpentAtItsExpiry: a lease whose
// instance never gave it back stops counting at its expiry, and the
// bucket refills into it from then on, not from before.
func TestLeaseScriptExpiredLeaseCountsAsSpentAtItsExpiry(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := leaseArg{key: "rl:expired", rate: 100, burst: 100, requested: 1}
	// A second ago the bucket was empty, with 40 lent until 0.2 s ago:
	// it refilled to 60 in 0.6 s, stayed there until the lease expired,
	// then refilled 0.2 s more: 80. (Counting the lease as spent from
	// the start would make it 100.)
	now := redisNow(t, rdb)
	setBucketAt(t, rdb, a.key, 0, now-1_000_000)
	setLeaseRecord(t, rdb, a.key, now, "dead 40 -200ms 7")
	r := evalLease(t, rdb, "take", "i1", 1, time.Minute, a)
	took := float64(redisNow(t, rdb)-now) / 1e6 * a.rate // refilled while the test ran
	if got := float64(r.remaining[0]); got < 79-took-1 || got > 79+took {
		t.Errorf("remaining %v; want 79 (80 less the request)", got)
	}
	if leaseRecords(t, rdb, a.key) != nil {
		t.Errorf("the expired lease is still recorded: %v", leaseRecords(t, rdb, a.key))
	}

	// A reset bucket (the admin API's) is full: up to what is lent.
	b := leaseArg{key: "rl:reset", rate: 100, burst: 100, requested: 1}
	now = redisNow(t, rdb)
	setBucketAt(t, rdb, b.key, 10, now)
	setLeaseRecord(t, rdb, b.key, now, "other 30 1m 1")
	if r := evalLease(t, rdb, "reset", "admin", 1, time.Minute, b); r.remaining[0] != 70 || leaseRecords(t, rdb, b.key)["other"].tokens != 30 {
		t.Errorf("a bucket reset with 30 lent: %d; want 70, the lease untouched", r.remaining[0])
	}
	if r := evalLease(t, rdb, "take", "i1", 2, time.Minute, b); r.remaining[0] != 69 {
		t.Errorf("a reset bucket with 30 lent: %d left after one; want 69", r.remaining[0])
	}

	// A denial's wait counts the refill that the leases hold back: empty,
	// 10 lent of 10 for 0.5 s more, 10 tokens a second: 0.5 s until the
	// cap lets any token in, then 0.1 s for one.
	c := leaseArg{key: "rl:wait", rate: 10, burst: 10, requested: 1}
	now = redisNow(t, rdb)
	setBucketAt(t, rdb, c.key, 0, now)
	setLeaseRecord(t, rdb, c.key, now, "other 10 500ms 1")
	r = evalLease(t, rdb, "take", "i1", 3, time.Minute, c)
	// 0.6 s from when the lease was set, less the time the script ran after.
	elapsed := time.Duration(redisNow(t, rdb)-now) * time.Microsecond
	if r.allowed || r.wait[0] < 600*time.Millisecond-elapsed || r.wait[0] > 600*time.Millisecond {
		t.Errorf("empty, all lent for 0.5 s: %+v; want denied with a wait of 0.6 s less up to %v", r, elapsed)
	}
}

// TestLeaseScriptMarksTheBucketOnlyWhileItLends: a bucket that lends
// carries a mark (what is lent, until when), and its lease record; once
// its leases are back, neither. A call on a bucket without leases that
// lends nothing reads and writes the bucket alone, as script.lua does:
// one GET, one SET, nothing of the record.
func TestLeaseScriptMarksTheBucketOnlyWhileItLends(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	a := leaseArg{key: "rl:mark", rate: 0.001, burst: 100, requested: 1}
	if err := rdb.ScriptLoad(ctx, leaseSource).Err(); err != nil {
		t.Fatal(err)
	}
	calls := func(f func()) map[string]int64 {
		before := commandCalls(t, rdb)
		f()
		after := commandCalls(t, rdb)
		for k := range after {
			after[k] -= before[k]
		}
		return after
	}

	// Cold: nothing lent, nothing asked.
	c := calls(func() { evalLease(t, rdb, "take", "i1", 1, time.Minute, a) })
	if c["get"] != 1 || c["set"] != 1 || c["del"] != 0 || c["pexpire"] != 0 {
		t.Errorf("a take on a bucket without leases ran get %d, set %d, del %d; want one GET and one SET", c["get"], c["set"], c["del"])
	}
	if n, _ := rdb.Exists(ctx, lease.RecordKey(a.key)).Result(); n != 0 {
		t.Error("a bucket that never lent has a lease record")
	}
	if b, err := parseBucket(rdb.Get(ctx, a.key)); err != nil || b.lent != 0 || math.Floor(b.tokens) != 99 {
		t.Errorf("the cold bucket: %+v %v; want 99 tokens, no mark", b, err)
	}

	// Lending marks it: 10 lent until the lease's expiry, a minute on.
	lend := a
	lend.want = 10
	evalLease(t, rdb, "take", "i1", 2, time.Minute, lend)
	b, err := parseBucket(rdb.Get(ctx, a.key))
	now := redisNow(t, rdb)
	if err != nil || b.lent != 10 || b.until < now+50_000_000 || b.until > now+60_000_000 {
		t.Errorf("the bucket that lent 10 for a minute: %+v %v; want its mark: 10 lent for a minute", b, err)
	}
	if ttl := rdb.PTTL(ctx, lease.RecordKey(a.key)).Val(); ttl < 50*time.Second || ttl > time.Minute {
		t.Errorf("the lease record lives %v; want as long as its lease, a minute", ttl)
	}

	// Given back: no mark, no record.
	give := a
	give.held = 10
	evalLease(t, rdb, "give", "i1", 3, time.Minute, give)
	if b, err := parseBucket(rdb.Get(ctx, a.key)); err != nil || b.lent != 0 || math.Floor(b.tokens) != 98 {
		t.Errorf("after the give-back: %+v %v; want 98 tokens, no mark", b, err)
	}
	if n, _ := rdb.Exists(ctx, lease.RecordKey(a.key)).Result(); n != 0 {
		t.Error("the lease record outlived its last lease")
	}
	c = calls(func() { evalLease(t, rdb, "take", "i1", 4, time.Minute, a) })
	if c["get"] != 1 || c["set"] != 1 || c["del"] != 0 {
		t.Errorf("a take once the leases are back ran get %d, set %d, del %d; want one GET and one SET", c["get"], c["set"], c["del"])
	}
}

// TestScriptRefillsUnderAMark: script.lua, taking from a bucket that has
// lent (lease.lua's mark), refills it only up to the burst less what is
// lent until the last lease expires, keeps the mark, and waits for it;
// then refills to the burst and drops the mark. It reads and writes the
// bucket alone.
func TestScriptRefillsUnderAMark(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	l := newTestLimiter(t, srv.Addr, time.Second)
	key := "rl:marked"
	// Empty a second ago, 100 tokens a second up to 100, 40 lent for
	// 300 ms more: it refilled to 60, and stays there.
	now := redisNow(t, rdb)
	setBucketAt(t, rdb, key, 0, now-1_000_000)
	setLeaseRecord(t, rdb, key, now, "other 40 300ms 1")
	before := commandCalls(t, rdb)
	if res := mustTake(t, l, key, limitArgs(100, 100, 1)); res.Remaining != 59 {
		t.Errorf("40 lent of 100: %d left after one; want 59", res.Remaining)
	}
	after := commandCalls(t, rdb)
	if after["get"]-before["get"] != 1 || after["set"]-before["set"] != 1 {
		t.Errorf("script.lua on a marked bucket ran %d GET, %d SET; want one each", after["get"]-before["get"], after["set"]-before["set"])
	}
	b, err := parseBucket(rdb.Get(ctx, key))
	if err != nil || b.lent != 40 || b.until != now+300_000 {
		t.Errorf("after the take: %+v %v; want the mark kept", b, err)
	}
	// Asking more than the cap leaves: denied, with a wait past the
	// lease's end.
	res := mustTake(t, l, key, limitArgs(100, 100, 70))
	if res.Allowed || res.RetryAfter < 100*time.Millisecond {
		t.Errorf("70 of 59, the cap 60 for up to 300 ms: %+v; want denied, waiting past the lease's end", res)
	}
	// Past its end: up to the burst, the mark dropped.
	time.Sleep(time.Until(time.UnixMicro(now + 400_000)))
	if res := mustTake(t, l, key, limitArgs(100, 100, 1)); res.Remaining < 68 || res.Remaining > 99 {
		t.Errorf("after the lease's end: %d left; want above the cap of 60", res.Remaining)
	}
	if b, err := parseBucket(rdb.Get(ctx, key)); err != nil || b.lent != 0 {
		t.Errorf("after the lease's end: %+v %v; want no mark", b, err)
	}
}

// TestLeaseScriptBringsALendingBucketDownToALowerBurst: a call whose
// burst is lower than what the bucket and its leases hold (a plan moved
// by map, a reload) first brings the bucket down to the burst less what
// the other instances' leases hold (below zero when they hold more), and
// the caller's lease, which it reported, to what that leaves; a lease it
// did not report (an older call) stays counted against the burst. So the
// bucket and every lease together never hold more than the burst in
// force. (Before, the bucket kept its tokens above the cap, and the
// caller's lease too: a lease lent under burst 1000 went on lending from
// 979 tokens under burst 5.)
func TestLeaseScriptBringsALendingBucketDownToALowerBurst(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	held := func(key string) (bucket float64, lent int64) {
		t.Helper()
		b, err := parseBucket(rdb.Get(ctx, key))
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range leaseRecords(t, rdb, key) {
			lent += r.tokens
		}
		return b.tokens, lent
	}

	// Lent 20 under burst 1000, then asked with burst 5: the bucket comes
	// down to 5, the caller's lease to nothing; the request takes 1 and
	// 2 are lent (half of 4).
	high := leaseArg{key: "rl:lower", rate: leaseRate, burst: 1000, requested: 1, want: 20}
	if r := evalLease(t, rdb, "take", "i1", 1, time.Minute, high); !r.allowed || r.lent[0] != 20 || r.remaining[0] != 979 {
		t.Fatalf("the take under burst 1000: %+v; want 20 lent, 979 left", r)
	}
	low := leaseArg{key: high.key, rate: leaseRate, burst: 5, requested: 1, held: 20, want: 20}
	r := evalLease(t, rdb, "take", "i1", 2, time.Minute, low)
	bucket, lent := held(high.key)
	if !r.allowed || r.lent[0] != 2 || r.remaining[0] != 2 || math.Abs(bucket-2) > leaseSlack || lent != 2 {
		t.Errorf("the take under burst 5 with 979 in the bucket and 20 lent: %+v, bucket %.3f, lent %d; "+
			"want admitted, 2 lent and 2 left (5, the request's 1, half of 4 lent)", r, bucket, lent)
	}

	// Drained under the high burst, the caller's lease of 20 comes down to
	// 5, the burst: nothing is left to take for the request.
	now := redisNow(t, rdb)
	setBucketAt(t, rdb, "rl:drained", 0, now)
	setLeaseRecord(t, rdb, "rl:drained", now, "i1 20 1m 1")
	low.key = "rl:drained"
	r = evalLease(t, rdb, "take", "i1", 2, time.Minute, low)
	if bucket, lent := held(low.key); r.allowed || r.lent[0] != 5 || bucket > leaseSlack || lent != 5 {
		t.Errorf("burst 5 on an empty bucket whose caller holds 20: %+v, bucket %.3f, lent %d; want refused, its lease down to 5, the bucket 0", r, bucket, lent)
	}

	// Another instance holds 100, more than the whole burst: the bucket
	// goes below zero by what it holds past the burst (95), the caller's
	// lease to nothing, and the other lease stays counted, for its own
	// instance to report.
	now = redisNow(t, rdb)
	setBucketAt(t, rdb, "rl:others", 900, now)
	setLeaseRecord(t, rdb, "rl:others", now, "other 100 1m 1", "i1 20 1m 1")
	low.key = "rl:others"
	r = evalLease(t, rdb, "take", "i1", 2, time.Minute, low)
	records := leaseRecords(t, rdb, low.key)
	if bucket, _ := held(low.key); r.allowed || r.lent[0] != 0 || math.Abs(bucket-(-95)) > leaseSlack || len(records) != 1 || records["other"].tokens != 100 {
		t.Errorf("burst 5 with another instance holding 100: %+v, bucket %.3f, records %+v; want refused, nothing lent, the bucket at -95, the other lease kept",
			r, bucket, records)
	}

	// An older call reports nothing: its lease stays counted, and the
	// bucket comes down to the burst less all that is lent.
	now = redisNow(t, rdb)
	setBucketAt(t, rdb, "rl:stale", 900, now)
	setLeaseRecord(t, rdb, "rl:stale", now, "i1 20 1m 5")
	low.key = "rl:stale"
	r = evalLease(t, rdb, "take", "i1", 4, time.Minute, low)
	if bucket, lent := held(low.key); r.allowed || r.lent[0] != 20 || math.Abs(bucket-(-15)) > leaseSlack || lent != 20 {
		t.Errorf("an older call with burst 5, its lease of 20 counted: %+v, bucket %.3f, lent %d; want refused, the bucket at -15, the lease kept", r, bucket, lent)
	}
}

// TestScriptBringsAMarkedBucketDownToALowerBurst: script.lua, the plain
// script of instances without lease, takes from a marked bucket at most
// the burst in force less what the mark says is lent, however many
// tokens the bucket was stored with under a higher burst; once the
// mark's leases expired, at most the burst. (Before, it kept the stored
// tokens and took from them: 200 of 200 requests admitted under burst 5.)
func TestScriptBringsAMarkedBucketDownToALowerBurst(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	l := newTestLimiter(t, srv.Addr, time.Second)
	now := redisNow(t, rdb)
	setBucketAt(t, rdb, "rl:marked-high", 900, now)
	setLeaseRecord(t, rdb, "rl:marked-high", now, "other 2 300ms 1")
	if res := mustTake(t, l, "rl:marked-high", limitArgs(leaseRate, 5, 1)); !res.Allowed || res.Remaining != 2 {
		t.Errorf("burst 5 on a bucket stored at 900 with 2 lent: %+v; want admitted, 2 left (5 - 2 - 1)", res)
	}
	setBucketAt(t, rdb, "rl:marked-over", 900, now)
	setLeaseRecord(t, rdb, "rl:marked-over", now, "other 20 300ms 1")
	if res := mustTake(t, l, "rl:marked-over", limitArgs(leaseRate, 5, 1)); res.Allowed || res.Remaining != 0 || res.RetryAfter < time.Hour {
		t.Errorf("burst 5 on a bucket stored at 900 with 20 lent: %+v; want refused until the lease ends and 16 tokens refill at %v/s", res, leaseRate)
	}
	// Past the mark's end: at most the burst.
	time.Sleep(time.Until(time.UnixMicro(now + 400_000)))
	if res := mustTake(t, l, "rl:marked-over", limitArgs(leaseRate, 5, 1)); !res.Allowed || res.Remaining != 4 {
		t.Errorf("burst 5 on a bucket stored at 900 once its lease expired: %+v; want admitted, 4 left", res)
	}
}

// TestPeekAndScriptAgreeWithTheOracleUnderAMark: on buckets that have
// lent, stored above and below their burst less what is lent, with
// leases live or expired, and bursts higher and lower than the bucket
// was stored under, peek.lua (the admin API's read) shows the tokens
// that scriptRefill, the Go reference of script.lua's arithmetic, gives
// for the time of the read, and the wait script.lua answers a refused
// request in the same pipeline.
func TestPeekAndScriptAgreeWithTheOracleUnderAMark(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	for _, source := range []string{peekSource, scriptSource} {
		if err := rdb.ScriptLoad(ctx, source).Err(); err != nil {
			t.Fatal(err)
		}
	}
	peekSHA := redis.NewScript(peekSource).Hash()
	cases := 0
	for _, rate := range []float64{10, 0.5} {
		for _, burst := range []int64{5, 10, 1000} {
			for _, stored := range []float64{-3, 0, 2.5, 900} {
				for _, lent := range []int64{0, 2, 4, 20} {
					for _, until := range []time.Duration{-100 * time.Millisecond, 300 * time.Millisecond, time.Minute} {
						for _, ago := range []time.Duration{0, 500 * time.Millisecond} {
							requested := min(burst, 3)
							key := fmt.Sprintf("rl:agree%d", cases)
							cases++
							now := redisNow(t, rdb)
							b := scriptBucket{tokens: stored, at: now - ago.Microseconds(), present: true}
							state := fmt.Sprintf("%.17g %d", b.tokens, b.at)
							if lent > 0 {
								b.lent, b.until = lent, now+until.Microseconds()
								state += fmt.Sprintf(" %d %d", b.lent, b.until)
							}
							if err := rdb.Set(ctx, key, state, time.Minute).Err(); err != nil {
								t.Fatal(err)
							}
							args := limitArgs(rate, burst, requested)
							var clock0, clock1 *redis.TimeCmd
							var peek, take *redis.Cmd
							if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
								clock0 = p.Time(ctx)
								peek = p.EvalSha(ctx, peekSHA, []string{key}, args[:]...)
								take = p.EvalSha(ctx, scriptSHA, []string{key}, args[:]...)
								clock1 = p.Time(ctx)
								return nil
							}); err != nil {
								t.Fatal(err)
							}
							t0, t1 := clock0.Val().UnixMicro(), clock1.Val().UnixMicro()
							what := fmt.Sprintf("state %q, rate %v burst %d requested %d, read between %d and %d", state, rate, burst, requested, t0, t1)
							reply, err := peek.Slice()
							if err != nil || len(reply) != 4 {
								t.Fatalf("%s: peek %v %v", what, reply, err)
							}
							tokens, err := strconv.ParseFloat(reply[0].(string), 64)
							if err != nil {
								t.Fatal(err)
							}
							lo, hi := scriptRefill(b, t0, rate, burst), scriptRefill(b, t1, rate, burst)
							if tokens < lo-1e-9 || tokens > hi+1e-9 {
								t.Errorf("%s: peek shows %v tokens; the reference gives %v to %v", what, tokens, lo, hi)
							}
							wantLent := int64(0)
							if b.until > t1 {
								wantLent = lent
							}
							if got := reply[3].(int64); got != wantLent && b.until > t1 == (b.until > t0) {
								t.Errorf("%s: peek shows %d lent, want %d", what, got, wantLent)
							}
							took, err := take.Int64Slice()
							if err != nil || len(took) != 3 {
								t.Fatalf("%s: take %v %v", what, took, err)
							}
							peekWait := reply[1].(int64)
							if (took[0] == 1) != (tokens >= float64(requested)) && math.Floor(lo) == math.Floor(hi) {
								t.Errorf("%s: peek shows %v tokens, script.lua's take of %d allowed %d", what, tokens, requested, took[0])
							}
							// The same wait, less the time between the two reads.
							if took[0] == 0 && (peekWait < took[2] || peekWait > took[2]+(t1-t0)+1) {
								t.Errorf("%s: peek's wait %d µs, script.lua's %d µs", what, peekWait, took[2])
							}
						}
					}
				}
			}
		}
	}
	t.Logf("%d marked and unmarked buckets: peek.lua, script.lua and the reference agree", cases)
}

// TestLeaseScriptOrdersCalls: a call older than the last one Redis saw
// from the instance reports nothing and lends nothing (calls may overtake
// each other after a timeout); a lease Redis does not count holds nothing,
// whatever the instance says; a give-back of an expired lease returns
// nothing.
func TestLeaseScriptOrdersCalls(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := leaseArg{key: "rl:order", rate: 0.001, burst: 100, requested: 1, want: 10}
	if r := evalLease(t, rdb, "take", "i1", 5, time.Minute, a); r.lent[0] != 10 || r.remaining[0] != 89 {
		t.Fatalf("take: %+v", r)
	}
	// An older call: it still takes its request, but its report of 2
	// held and its wish for 10 more are ignored.
	stale := a
	stale.held, stale.want = 2, 20
	if r := evalLease(t, rdb, "take", "i1", 4, time.Minute, stale); !r.allowed || r.remaining[0] != 88 || r.lent[0] != 10 {
		t.Errorf("an older take: %+v; want allowed, 88 left, i1 still counted 10", r)
	}
	if r := evalLease(t, rdb, "give", "i1", 3, time.Minute, stale); r.remaining[0] != 88 || leaseRecords(t, rdb, a.key)["i1"].tokens != 10 {
		t.Errorf("an older give-back: %+v; want nothing returned, i1 still counted 10", r)
	}
	// A lease Redis lost (here: never had) holds nothing: i2 says it holds
	// 7, and is told it holds what it is lent now.
	lost := a
	lost.held, lost.want = 7, 7
	if r := evalLease(t, rdb, "renew", "i2", 1, time.Minute, lost); r.lent[0] != 7 || r.remaining[0] != 81 {
		t.Errorf("a lost lease of 7 renewed to 7: %+v; want 7 lent anew from 88: 81 left", r)
	}
	// A lease whose life ended is spent: its give-back returns nothing.
	short := leaseArg{key: "rl:short", rate: 0.001, burst: 100, requested: 1, want: 10}
	evalLease(t, rdb, "take", "i1", 6, 50*time.Millisecond, short)
	time.Sleep(100 * time.Millisecond)
	short.held = 10
	if r := evalLease(t, rdb, "give", "i1", 7, time.Minute, short); r.remaining[0] != 89 {
		t.Errorf("a give-back after the lease expired: %d left; want 89 (its 10 spent)", r.remaining[0])
	}
}

// TestLeaseScriptJudgesAGiveBackBucketByBucket: a give-back older than
// a later call on one of its buckets (a take of a lease picked for the
// give-back) leaves that bucket's lease as the later call made it, and
// still gives back the other buckets' leases.
func TestLeaseScriptJudgesAGiveBackBucketByBucket(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := leaseArg{key: "rl:give-a", rate: 0.001, burst: 100, requested: 1, want: 10}
	b := leaseArg{key: "rl:give-b", rate: 0.001, burst: 100, requested: 1, want: 10}
	evalLease(t, rdb, "take", "i1", 1, time.Minute, a)
	evalLease(t, rdb, "take", "i1", 2, time.Minute, b)
	// Both picked for a give-back (call 3); then a takes a new lease (call
	// 4), which reports nothing held, and lands first.
	if r := evalLease(t, rdb, "take", "i1", 4, time.Minute, a); r.lent[0] != 10 || r.remaining[0] != 78 {
		t.Fatalf("the new take on a: %+v; want 10 lent, 78 left (the old lease's 10 spent)", r)
	}
	ga, gb := a, b
	ga.held, gb.held, ga.want, gb.want = 10, 10, 0, 0
	r := evalLease(t, rdb, "give", "i1", 3, time.Minute, ga, gb)
	if r.remaining[0] != 78 || leaseRecords(t, rdb, a.key)["i1"].tokens != 10 {
		t.Errorf("the older give-back on a: %d left, i1 counted %v; want 78 left and the new lease's 10 counted",
			r.remaining[0], leaseRecords(t, rdb, a.key)["i1"])
	}
	if r.remaining[1] != 99 || leaseRecords(t, rdb, b.key) != nil {
		t.Errorf("the give-back on b: %d left, records %v; want its 10 back: 99, no lease", r.remaining[1], leaseRecords(t, rdb, b.key))
	}
}

// TestLeaseScriptLendsInLockstep: all of a call's buckets lend up to the
// same number of requests, the most the scarcest can reach with what its
// lease holds; a bucket whose lease holds enough lends nothing.
func TestLeaseScriptLendsInLockstep(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := leaseArg{key: "{p}a", rate: 0.001, burst: 100, requested: 1, want: 32}
	b := leaseArg{key: "{p}b", rate: 0.001, burst: 11, requested: 2, want: 32}
	// b leaves 9 after a request of 2, can lend 4 (half): 2 requests.
	r := evalLease(t, rdb, "take", "i1", 1, time.Minute, a, b)
	if !r.allowed || fmt.Sprint(r.lent) != "[2 4]" || fmt.Sprint(r.remaining) != "[97 5]" {
		t.Fatalf("take: %+v; want 2 and 4 lent (two requests), 97 and 5 left", r)
	}
	// a's lease holds 2, b's none: b can reach 1 request (2 of 5 / 2), so
	// a lends nothing more.
	a.held = 2
	r = evalLease(t, rdb, "renew", "i1", 2, time.Minute, a, b)
	if fmt.Sprint(r.lent) != "[2 2]" || fmt.Sprint(r.remaining) != "[97 3]" {
		t.Errorf("renew with a holding 2, b none: %+v; want 2 and 2 counted, 97 and 3 left", r)
	}
}

// TestLeaseScriptRefundStaysUnderTheCap: tokens given back to an earlier
// slot group (refund) fill the bucket up to its burst less what it lent,
// never past it.
func TestLeaseScriptRefundStaysUnderTheCap(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := leaseArg{key: "rl:refund", rate: 0.001, burst: 10, requested: 3}
	now := redisNow(t, rdb)
	setBucketAt(t, rdb, a.key, 5, now)
	setLeaseRecord(t, rdb, a.key, now, "other 4 1m 1")
	if r := evalLease(t, rdb, "refund", "i1", 1, time.Minute, a); r.remaining[0] != 6 || leaseRecords(t, rdb, a.key)["other"].tokens != 4 {
		t.Errorf("refund of 3 to 5 with 4 lent of 10: %d left; want 6 (10 - 4), the lease untouched", r.remaining[0])
	}
}

// TestLeaseScriptStateIsScriptLuas: a bucket lease.lua wrote reads as
// script.lua stores it, and the other way round, so instances with and
// without lease (during a rolling change) read each other's buckets.
func TestLeaseScriptStateIsScriptLuas(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := leaseArg{key: "rl:shared", rate: 0.001, burst: 100, requested: 1, want: 10}
	evalLease(t, rdb, "take", "i1", 1, time.Minute, a)
	b, err := parseBucket(rdb.Get(context.Background(), a.key))
	if err != nil || math.Abs(b.tokens-89) > 0.01 {
		t.Fatalf("the bucket lease.lua stored: %+v %v; want 89 tokens as script.lua stores them", b, err)
	}
	l := newTestLimiter(t, srv.Addr, time.Second)
	if res := mustTake(t, l, a.key, limitArgs(a.rate, a.burst, 1)); res.Remaining != 88 {
		t.Errorf("script.lua on lease.lua's bucket: %d left, want 88", res.Remaining)
	}
	if r := evalLease(t, rdb, "renew", "probe", 1, time.Minute, leaseArg{key: a.key, rate: a.rate, burst: a.burst, requested: 1}); r.remaining[0] != 88 {
		t.Errorf("lease.lua on script.lua's bucket: %d left, want 88", r.remaining[0])
	}
}

// TestLeaseScriptSettleStaysUnderTheCap: a charged response's settlement
// on a lending bucket (settle) gives tokens back up to the burst less
// what the bucket lent, never past it, and leaves the leases alone; a
// larger cost takes into debt down to minus max_debt, and what it could
// not take is answered as forgiven. settle.lua, which knows nothing of
// leases, would fill this bucket to its burst.
func TestLeaseScriptSettleStaysUnderTheCap(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := leaseArg{key: "rl:settle", rate: 0.001, burst: 10}
	now := redisNow(t, rdb)
	setBucketAt(t, rdb, a.key, 5, now)
	setLeaseRecord(t, rdb, a.key, now, "other 4 1m 1")
	give := a
	give.requested = -3 // the difference: the response cost 3 less than its reservation
	if r := evalLease(t, rdb, "settle", "i1", 1, time.Minute, give); r.remaining[0] != 6 || leaseRecords(t, rdb, a.key)["other"].tokens != 4 {
		t.Errorf("settling -3 on 5 with 4 lent of 10: %d left, lease %+v; want 6 (10 - 4), the lease untouched", r.remaining[0], leaseRecords(t, rdb, a.key))
	}
	take := a
	take.requested, take.held = 9, 2 // a cost 9 above the reservation, max_debt 2
	r := evalLease(t, rdb, "settle", "i1", 2, time.Minute, take)
	b, err := parseBucket(rdb.Get(context.Background(), a.key))
	if err != nil || math.Abs(b.tokens-(-2)) > 0.01 || r.remaining[0] != 0 || r.lent[0] != 1 {
		t.Errorf("settling +9 on 6 with max_debt 2: bucket %+v (%v), remaining %d, forgiven %d; want -2 tokens, 0, 1 forgiven", b, err, r.remaining[0], r.lent[0])
	}
	if got := leaseRecords(t, rdb, a.key); len(got) != 1 || got["other"].tokens != 4 {
		t.Errorf("the settlements changed the lease records: %+v", got)
	}
}
