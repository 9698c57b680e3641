package lease

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
)

// The lease table alone, on a clock of its own, and where a bucket's
// lease record lives.

// TestLeaseTable drives the lease table alone, on a clock of its own: a
// miss leads a call, registered as the bucket's one flight, which other
// misses wait for; what lands is Redis's count less what was admitted
// meanwhile, for a hold from when the call left; admission within the
// hold only, with the lease's values, all of a request's buckets or
// none; a renewal starts at half of what the last call lent, one at a
// time; a failed call changes nothing; give-backs come when the hold
// ends, never while a call is in flight; once closed, what lands goes
// back.
func TestLeaseTable(t *testing.T) {
	const hold = 100 * time.Millisecond
	ls := New(Options{MaxTokens: 10, Hold: hold, Timeout: time.Second})
	v := limit.Values{Rate: 1, Burst: 100, Requested: 1}
	t0 := time.Unix(1_000_000, 0)
	ask := func(values limit.Values, keys ...string) []limit.Bucket {
		var bs []limit.Bucket
		for _, k := range keys {
			bs = append(bs, limit.Bucket{Key: k, Values: values})
		}
		return bs
	}
	held := func(key string) int64 {
		if l := ls.get(key); l != nil {
			return l.tokens
		}
		return 0
	}
	// acq is acquire for a request trying for the first time (first), or
	// again.
	acq := func(now time.Time, bs []limit.Bucket, first, lead bool) (Outcome, *leaseFlight) {
		counted := !first
		return ls.acquire(now, bs, make([]int64, len(bs)), &counted, lead)
	}
	answer := func(f *leaseFlight, bs []limit.Bucket, leased, remaining int64) {
		t.Helper()
		for i := range bs {
			f.states[i].leased, bs[i].Remaining = leased, remaining
		}
		if back := ls.land(f, bs, f.states, f.sent, nil); back.len() != 0 {
			t.Fatalf("landing gave back %+v", back)
		}
		ls.finish(f, bs, nil)
	}

	// A key seen once, or again a hold later, is cold: nothing is made
	// for it, its request goes to Redis as without lease.
	for _, at := range []time.Time{t0.Add(-hold - 10*time.Millisecond), t0.Add(-10 * time.Millisecond)} {
		if o, f := acq(at, ask(v, "a"), true, false); o != Cold || f != nil || ls.get("a") != nil {
			t.Fatalf("a key not seen within a hold: %v %v, entry %v; want it cold, nothing made", o, f, ls.get("a"))
		}
	}
	// Seen again within a hold, it is hot: a miss. Leading, the request's
	// call is the flight, asking for what its rate (one request in 10 ms)
	// makes in a hold: 10.
	a := ask(v, "a")
	if o, f := acq(t0, a, true, false); o != Miss || f != nil {
		t.Fatalf("a hot key without a lease: %v %v; want a miss", o, f)
	}
	o, f := acq(t0, a, false, true)
	if o != Miss || f == nil || f.states[0].lease == nil || f.states[0].held != 0 || f.states[0].want != 10 {
		t.Fatalf("leading: %v %v %+v; want a flight, asking for 10", o, f, f.states[0])
	}
	if o, f2 := acq(t0, ask(v, "a"), true, false); o != Wait || f2 != f {
		t.Fatalf("another miss during the call: %v; want it to wait for the flight", o)
	}
	answer(f, a, 0, 99)
	select {
	case <-f.done:
	default:
		t.Fatal("the flight landed, but its waiters were not told")
	}

	// 10 requests in 10 ms since: the next call wants 10 (100 ms' worth,
	// at most max_tokens). Redis lends 10.
	for range 9 {
		acq(t0, ask(v, "a"), true, false)
	}
	t1 := t0.Add(10 * time.Millisecond)
	a = ask(v, "a")
	acq(t1, a, true, false)
	_, f = acq(t1, a, false, true)
	if f.states[0].want != 10 {
		t.Errorf("after 10 requests in 10ms: wants %d, want 10", f.states[0].want)
	}
	answer(f, a, 10, 88)
	if a[0].Remaining != 98 || held("a") != 10 {
		t.Errorf("landed: remaining %d, held %d; want 88 + 10, 10", a[0].Remaining, held("a"))
	}

	// Admitted within the hold (its end excluded), with its values only.
	b := ask(v, "a")
	if o, _ := acq(t1.Add(hold/2), b, true, false); o != Admitted || b[0].Remaining != 97 || held("a") != 9 {
		t.Fatalf("within the hold: %v remaining %d; want admitted with 88 + 9", o, b[0].Remaining)
	}
	if o, _ := acq(t1, ask(limit.Values{Rate: 1, Burst: 100, Requested: 2}, "a"), true, false); o != Miss {
		t.Error("admitted a request with other values than the lease's")
	}
	if o, _ := acq(t1.Add(hold), ask(v, "a"), true, false); o != Miss {
		t.Error("admitted from a lease at the end of its hold")
	}

	// At half of the 10 lent, the admission starts a renewal: it reports
	// the 5 left. Requests meanwhile are admitted from them.
	for range 3 {
		acq(t1, ask(v, "a"), true, false)
	}
	o, renewal := acq(t1, ask(v, "a"), true, false)
	if o != Admitted || renewal == nil || len(renewal.buckets) != 1 || renewal.states[0].held != 5 {
		t.Fatalf("at 5 of 10: %v, renewal %+v; want admitted, and a renewal reporting 5", o, renewal)
	}
	if o, again := acq(t1, ask(v, "a"), true, false); o != Admitted || again != nil {
		t.Errorf("at 4, a renewal in flight: %v %v; want admitted, no second renewal", o, again)
	}
	// Redis counts 5 + 5 lent; 1 was admitted since the renewal left.
	t2 := t1.Add(20 * time.Millisecond)
	renewal.sent = t2
	answer(renewal, renewal.buckets, 10, 78)
	if held("a") != 9 {
		t.Errorf("the renewal landed: %d held; want 10 - 1", held("a"))
	}
	// A failed call changes nothing: the lease is used until its hold ends.
	for range 6 {
		if _, f := acq(t2, ask(v, "a"), true, false); f != nil {
			t.Fatalf("a renewal at %d, above half of the 5 lent", held("a"))
		}
	}
	_, failed := acq(t2, ask(v, "a"), true, false)
	if failed == nil {
		t.Fatal("no renewal at 2 of 5 lent")
	}
	ls.land(failed, failed.buckets, failed.states, t2, redisbatch.ErrBreakerOpen)
	ls.finish(failed, failed.buckets, redisbatch.ErrBreakerOpen)
	if held("a") != 2 || ls.get("a").until != t2.Add(hold) {
		t.Errorf("after a failed renewal: %d held until %v; want 2 until %v", held("a"), ls.get("a").until, t2.Add(hold))
	}

	// Several buckets: all hold a lease, or none is taken from.
	c := ask(v, "a", "c")
	if o, _ := acq(t2, c, true, false); o != Miss || held("a") != 2 {
		t.Fatalf("no lease on c: %v, a holds %d; want a miss, a untouched", o, held("a"))
	}

	// Nothing goes back within the hold, or while a call is in flight.
	if back, _ := ls.take(t2.Add(hold-time.Nanosecond), false); back.len() != 0 {
		t.Errorf("gave back %+v before the hold ended", back)
	}
	inFlight := ask(v, "a")
	_, inFlightF := acq(t2.Add(hold), inFlight, false, true)
	if back, _ := ls.take(t2.Add(hold), false); back.len() != 0 {
		t.Errorf("gave back %+v while a call was in flight", back)
	}
	ls.land(inFlightF, inFlight, inFlightF.states, t2.Add(hold), redisbatch.ErrBreakerOpen)
	ls.finish(inFlightF, inFlight, redisbatch.ErrBreakerOpen)
	back, _ := ls.take(t2.Add(hold), false)
	if back.len() != 1 || back.buckets[0].Key != "a" || back.states[0].held != 2 || ls.get("a").counted {
		t.Fatalf("at the end of the hold gave back %+v; want bucket a, its 2", back)
	}
	// Kept for the lease's next call to report (its hold is over: none is
	// admitted from them).
	if o, _ := acq(t2.Add(hold), ask(v, "a"), true, false); o != Miss || held("a") != 2 {
		t.Errorf("after the give-back was picked: %v, a holds %d; want a miss, the 2 kept", o, held("a"))
	}
	kept := ls.get("a") != nil
	if back, _ := ls.take(t2.Add(2*hold), false); !kept || back.buckets != nil || ls.get("a") != nil {
		t.Error("a lease given back is forgotten at once, or never")
	}

	// Once closed, a call in flight lands for a give-back: nothing is kept.
	e := ask(v, "e")
	acq(t2, e, true, true)
	_, fe := acq(t2, e, false, true)
	ls.closed.Store(true)
	fe.states[0].leased = 7
	if back := ls.land(fe, e, fe.states, t2, nil); back.len() != 1 || back.states[0].held != 7 || held("e") != 0 {
		t.Errorf("a call landing after close: %+v, e holds %d; want e's 7 back, nothing kept", back, held("e"))
	}
}

// TestLeaseRenewsSoonerWhenCallsAreSlow: a renewal starts at half of
// what the last call lent, or sooner when the key's requests would spend
// what is left in four round trips; and a quarter hold before the hold
// ends, or two round trips when that is longer. A slow call raises the
// round trip at once, fast ones lower it by halves.
func TestLeaseRenewsSoonerWhenCallsAreSlow(t *testing.T) {
	ls := New(Options{MaxTokens: 32, Hold: 100 * time.Millisecond, Timeout: time.Second})
	v := limit.Values{Rate: 1, Burst: 1000, Requested: 1}
	t0 := time.Unix(1_000_000, 0)
	l := &lease{rate: 100, rated: true}
	for _, tc := range []struct {
		rtt  time.Duration
		want int64
		by   time.Duration // before the hold ends
	}{
		{time.Millisecond, 5, 25 * time.Millisecond},       // half of the 10 lent; a quarter hold
		{25 * time.Millisecond, 10, 50 * time.Millisecond}, // 100 a second: 10 in four round trips of 25ms
		{time.Millisecond, 6, 26 * time.Millisecond},       // 13ms: 5.2 in four
		{time.Millisecond, 5, 25 * time.Millisecond},       // 7ms: 2.8 in four, under half of the 10
	} {
		b := []limit.Bucket{{Key: "k", Values: v}}
		states := []leaseState{{lease: l, leased: 10}}
		f := &leaseFlight{done: make(chan struct{}), sent: t0}
		l.flight = f
		ls.land(f, b, states, t0.Add(tc.rtt), nil)
		if l.renewAt != tc.want || l.until.Sub(l.renewBy) != tc.by {
			t.Errorf("10 lent, 100 requests a second, a call of %v (round trip now %v): renews at %d left and %v before the hold ends, want %d and %v",
				tc.rtt, l.rtt, l.renewAt, l.until.Sub(l.renewBy), tc.want, tc.by)
		}
	}
}

// TestLeaseGrantsTheKeysRate: a call asks for what the key's requests on
// this instance use within a hold at its rate, in whole requests, at
// most max_tokens; nothing for a key seen once. The rate is measured over
// windows of at least half a hold, weighed against the rate before by
// the window's length in holds; within a window it is raised at once to
// what the requests so far make over half a hold.
func TestLeaseGrantsTheKeysRate(t *testing.T) {
	ls := New(Options{MaxTokens: 32, Hold: 100 * time.Millisecond, Timeout: time.Second})
	t0 := time.Unix(1_000_000, 0)
	for _, tc := range []struct {
		rate      float64 // before; 0: unknown
		seen      int64
		window    time.Duration
		requested int64
		want      int64
	}{
		{0, 0, 0, 1, 0}, // seen once
		{0, 1, time.Second, 1, 0},
		{0, 1, 100 * time.Millisecond, 1, 1},
		{0, 5, 100 * time.Millisecond, 1, 5},
		{0, 5, 50 * time.Millisecond, 1, 10},
		{0, 5, 50 * time.Millisecond, 3, 30},
		{0, 5, 10 * time.Millisecond, 3, 32},
		{0, 1000, time.Millisecond, 1, 32},
		{100, 0, 10 * time.Millisecond, 1, 10}, // too short a window to tell: the rate stands
		{100, 3, 10 * time.Millisecond, 1, 10}, // 3 in half a hold is less
		{100, 8, 10 * time.Millisecond, 1, 16}, // 8 in half a hold is more: raised at once
		{100, 0, 50 * time.Millisecond, 1, 6},  // 100 × e^-0.5: a moment ago still counts
		{100, 1, time.Second, 1, 0},            // idle ten holds: about 1 a second
		{100, 6, 100 * time.Millisecond, 1, 7}, // 100 × e^-1 + 60 × (1 - e^-1)
	} {
		l := &lease{seen: tc.seen, rate: tc.rate, rated: tc.rate > 0}
		if tc.window > 0 {
			l.since = t0.Add(-tc.window)
		}
		if got := ls.grant(l, t0, tc.requested); got != tc.want {
			t.Errorf("rate %v, then %d requests of %d in %v: wants %d, want %d", tc.rate, tc.seen, tc.requested, tc.window, got, tc.want)
		}
		if restarted := l.seen == 0 && l.since.Equal(t0); restarted != (tc.window == 0 || tc.rate == 0 || tc.window >= 50*time.Millisecond) {
			t.Errorf("window %v: restarted %v (%d seen since %v)", tc.window, restarted, l.seen, l.since)
		}
	}
}

// TestLeaseRecordKeySharesTheBucketsSlot: a lease record lives in its
// bucket's Redis Cluster hash slot, tagged or not (the slot function
// is Redis's: redisbatch's TestSlotIsRedisClusters).
func TestLeaseRecordKeySharesTheBucketsSlot(t *testing.T) {
	for i := range 20000 {
		key := fmt.Sprintf("rate_limit:zone|tag|client%d", i)
		if i%2 == 1 {
			key = fmt.Sprintf("rate_limit:{zone|tag|client%d}|second", i)
		}
		record := RecordKey(key)
		if redisbatch.Slot(record) != redisbatch.Slot(key) || !strings.HasPrefix(record, key+RecordSuffix) {
			t.Fatalf("record %q of %q: slot %d, want %d", record, key, redisbatch.Slot(record), redisbatch.Slot(key))
		}
	}
	for slot, tag := range hashSlotTags() {
		if redisbatch.Slot(tag) != slot || len(tag) > 3 {
			t.Fatalf("tag %q for slot %d: its slot is %d", tag, slot, redisbatch.Slot(tag))
		}
	}
}
