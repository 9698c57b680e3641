package lease_test

// The leases' own mechanics, read in the lease table (export_test.go),
// over a real Redis: sizing to a key's rate, and the parts of the
// root's lease tests (lease_test.go, same names) that read what a lease
// holds, where the root reads what Redis counts.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// TestLeaseSizedToTheKeysRate: a key seen less than once per hold on an
// instance is lent nothing, so it costs one script call per request (as
// without lease), none given back; a key at about 5 requests per hold is
// lent about 5 at a time, its lease holding at most that and half the
// grant before (7), not max_tokens (32). (Before, each request of the
// first took a lease of 32 and gave it back, two calls per request.)
// Requests 20 ms apart put up to 3 in a window of half a hold, which
// reads as 6 per hold, granted on top of what the lease still holds: the
// test allows twice the rate (10), which a loaded machine's uneven timing
// reaches, and is still far from 32. (Moved from the root.)
func TestLeaseSizedToTheKeysRate(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := newInstance(t, srv.Addr, "sized", limit.Values{Rate: 1000, Burst: 1000, Requested: 1}, 32, 100*time.Millisecond)
	h.hit(t, "warm-the-script") // the first call loads the script: NOSCRIPT, then EVAL
	rare := h.key("rare")
	if n := callsOf(t, rdb, func() {
		for i := range 4 {
			if !h.hit(t, "rare") || h.ls.Held(rare) != 0 {
				t.Fatalf("rare request %d: lease %d; want admitted and no lease", i+1, h.ls.Held(rare))
			}
			time.Sleep(300 * time.Millisecond)
		}
	}); n != 4 {
		t.Errorf("4 requests 300ms apart, hold 100ms: %d script calls, want 4 (nothing lent, nothing given back)", n)
	}

	steady := h.key("steady")
	var most int64
	for range 40 {
		if !h.hit(t, "steady") {
			t.Fatal("refused")
		}
		most = max(most, h.ls.Held(steady))
		time.Sleep(20 * time.Millisecond) // 50 a second: 5 per hold of 100ms
	}
	t.Logf("a key at 50 requests a second, hold 100ms: the lease held at most %d", most)
	if most < 1 || most > 10 {
		t.Errorf("a key at 50 requests a second, hold 100ms, lease 32: the lease held at most %d; want 1 to 10 (twice 5, not 32)", most)
	}
}

// TestLeaseGivesBackWhenTheHoldEnds (what the lease holds meanwhile):
// while the lease holds its unused tokens, the bucket holds exactly what
// was neither admitted nor left in the lease; when the hold ends the
// unused tokens go back, exactly; then the next request asks Redis.
func TestLeaseGivesBackWhenTheHoldEnds(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := newInstance(t, srv.Addr, "giveback", limit.Values{Rate: leaseRate, Burst: 100, Requested: 1}, 32, time.Second)
	key := h.key("g")
	admitted := h.warm(t, "g")
	for range 4 {
		if !h.hit(t, "g") {
			t.Fatal("refused")
		}
		admitted++
	}
	// Whatever a renewal changed meanwhile: the bucket holds what was
	// neither admitted nor left in the lease.
	h.settled(t)
	unused := h.ls.Held(key)
	expectTokens(t, rdb, key, 100, float64(100-admitted)-float64(unused), fmt.Sprintf("while the lease holds %d", unused))
	took := eventually(t, 3*time.Second, "the lease given back", func() bool { return recordedTokens(t, rdb, key) == nil })
	expectTokens(t, rdb, key, 100, float64(100-admitted), fmt.Sprintf("given back %v after the lease", took.Round(time.Millisecond)))
	var remaining int64
	if n := callsOf(t, rdb, func() { _, remaining, _ = h.take("g") }); n != 1 || remaining != int64(100-admitted-1) {
		t.Errorf("the next request: %d script calls, remaining %d; want 1 call, %d", n, remaining, 100-admitted-1)
	}
}

// TestLeaseDenialsComeFromRedis (what the lease holds): leases lend
// whole requests' worth (9 of lease 10 for requests of 3); a spent lease
// holds nothing and admits nothing: Redis decides, with its remaining.
func TestLeaseDenialsComeFromRedis(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := newInstance(t, srv.Addr, "deny", limit.Values{Rate: leaseRate, Burst: 100, Requested: 3}, 10, time.Second)
	key := h.key("x")
	h.warm(t, "x")
	if held := h.ls.Held(key); held != 9 {
		t.Fatalf("lease 10 for requests of 3: holds %d, want 9", held)
	}
	// The bucket runs short: renewals lend nothing (half of 2 is not a
	// request's worth), the lease is spent, and Redis denies.
	setBucket(t, rdb, key, 2)
	for range 3 {
		if !h.hit(t, "x") {
			t.Fatal("refused from the lease")
		}
	}
	h.settled(t)
	if held := h.ls.Held(key); held != 0 {
		t.Fatalf("the lease holds %d, want it spent", held)
	}
	var allowed bool
	var remaining int64
	var err error
	if n := callsOf(t, rdb, func() { allowed, remaining, err = h.take("x") }); n != 1 || allowed || err != nil || remaining != 2 {
		t.Errorf("the lease spent, the bucket 2 of 3: admitted %v (%v), remaining %d, in %d script calls; want refused by Redis with its 2", allowed, err, remaining, n)
	}
}

// TestLeaseOneFailingBucketLeavesOtherLeases (what the lease holds): a
// Redis error on one client's bucket (a list, which the script cannot
// read) fails that request only: another client's lease stays, and
// admits its next request from what it holds, without Redis.
func TestLeaseOneFailingBucketLeavesOtherLeases(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := newInstance(t, srv.Addr, "onefails", limit.Values{Rate: leaseRate, Burst: 100, Requested: 1}, 32, time.Second)
	good, bad := h.key("good"), h.key("bad")
	h.warm(t, "good")
	held := h.ls.Held(good)
	if err := rdb.LPush(context.Background(), bad, "not a bucket").Err(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.take("bad"); err == nil {
		t.Fatal("the failing bucket: no error")
	}
	if n := callsOf(t, rdb, func() {
		if !h.hit(t, "good") {
			t.Error("the other client after the failure: refused")
		}
	}); n != 0 || h.ls.Held(good) != held-1 {
		t.Errorf("the other client after the failure: %d script calls, lease %d; want it admitted from its lease of %d", n, h.ls.Held(good), held)
	}
}
