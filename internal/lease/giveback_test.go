package lease_test

// The give-back loop's pick and a new take of the same bucket crossing:
// the give-back, picked before the take and landing after it, neither
// erases the new lease nor loses the old one's tokens. Moved from the
// root's lease_test.go: each drives the loop's pick itself.

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/boundtest"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// TestLeaseGiveBackLandingAfterANewerTakeKeepsItsLease: the give-back
// loop picks the leases whose hold ended, then sends their give-backs a
// chunk at a time, a round trip each; a request of a picked key in
// between takes a new lease. The give-back, landing after that take,
// leaves the new lease counted in Redis, so the bucket never refills
// into it: two instances draining it right after admit at most burst +
// rate × T. (Before, the give-back went with a later sequence number
// than the take, passed as fresh, and set what Redis counted as lent to
// the instance to 0 while the instance spent its new lease.)
func TestLeaseGiveBackLandingAfterANewerTakeKeepsItsLease(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	const rate, burst = 100.0, 100
	values := limit.Values{Rate: rate, Burst: burst, Requested: 1}
	h := newInstance(t, srv.Addr, "givebackorder", values, 32, time.Second)
	other := newInstance(t, srv.Addr, "givebackorder", values, 32, time.Second)
	key := h.key("k")
	var log boundtest.AdmissionLog
	for range h.warm(t, "k") {
		log.Add(log.Now())
	}
	// The loop's pick at the end of the hold, made now: the loop itself
	// picks the lease half a hold after its end at the latest, so the
	// test's give-back leaves when the test says.
	until := h.ls.Until(key)
	picked, giveBack := h.ls.PickGiveBacks(until)
	if picked != 1 {
		t.Fatalf("picked %d leases to give back, want the one on %s", picked, key)
	}
	start := log.Now()
	if !h.hit(t, "k") {
		t.Fatal("the request after the pick was refused")
	}
	log.Add(start)
	lent := h.ls.Held(key)
	if lent == 0 {
		t.Fatal("the request after the pick was lent nothing: no lease for the give-back to erase")
	}
	giveBack()
	if counted := recordedTokens(t, rdb, key)[h.ls.ID()]; counted < lent {
		t.Errorf("after the give-back Redis counts %d tokens lent to the instance, which holds %d", counted, lent)
	}
	// The bucket refills meanwhile, up to what Redis counts as lent; then
	// both instances drain it, the first from its lease too, within the
	// new lease's hold.
	time.Sleep(400 * time.Millisecond)
	var wg sync.WaitGroup
	stop := time.Now().Add(150 * time.Millisecond)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				start := log.Now()
				if []*instance{h, other}[w%2].hit(t, "k") {
					log.Add(start)
				}
			}
		}()
	}
	wg.Wait()
	windows, tightest := log.Check(t, burst, rate)
	t.Logf("%d lent to the new lease; %d admitted in all; %d windows checked, the tightest %.1f over its bound", lent, log.Len(), windows, tightest)
}

// TestLeaseGiveBackPickedBeforeANewTakeLosesNoToken: a lease picked for a
// give-back, then a new take of its bucket before the give-back lands:
// the tokens the old lease left unused are neither spent nor lost. The
// bucket, what the instance's lease holds and what was admitted make
// the burst (the refill is a thousandth of a token a second), and once
// the lease went back, the bucket holds all but what was admitted.
// (Before, the take reported the picked lease as holding nothing, so
// Redis counted its tokens as used, and the give-back, older than the
// take, returned none of them: 32 of 100 lost.)
func TestLeaseGiveBackPickedBeforeANewTakeLosesNoToken(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := newInstance(t, srv.Addr, "givebackloss", limit.Values{Rate: leaseRate, Burst: 100, Requested: 1}, 32, time.Second)
	key := h.key("k")
	admitted := h.warm(t, "k")
	until := h.ls.Until(key)
	_, giveBack := h.ls.PickGiveBacks(until) // the give-back loop's pick, ahead of time
	if !h.hit(t, "k") {
		t.Fatal("the request after the pick was refused")
	}
	admitted++
	giveBack()
	h.settled(t)
	unused := h.ls.Held(key)
	expectTokens(t, rdb, key, 100, float64(100-admitted)-float64(unused),
		fmt.Sprintf("after the give-back, %d admitted, the lease holding %d", admitted, unused))
	eventually(t, 3*time.Second, "the lease given back", func() bool { return recordedTokens(t, rdb, key) == nil })
	expectTokens(t, rdb, key, 100, float64(100-admitted), fmt.Sprintf("once the lease went back, %d admitted", admitted))
}

// TestLeaseColdKeysCostThePlainScript (the lease table's part; the
// root's test of the same name holds Redis's): keys seen less than once
// per hold leave nothing in the lease table; a key that turns hot gets
// its lease, and once it cools, it leaves the table, and its requests
// make no entry again.
func TestLeaseColdKeysCostThePlainScript(t *testing.T) {
	srv := redistest.Start(t)
	const hold = 50 * time.Millisecond
	h := newInstance(t, srv.Addr, "cold", limit.Values{Rate: 1000, Burst: 1000, Requested: 1}, 32, hold)
	const keys = 300
	for i := range keys {
		if !h.hit(t, fmt.Sprintf("cold-%d", i)) {
			t.Fatalf("cold key %d refused", i)
		}
	}
	if n := h.ls.Entries(); n != 0 {
		t.Errorf("%d cold keys left %d entries in the lease table; want none", keys, n)
	}
	h.warm(t, "hot")
	eventually(t, 2*time.Second, "the cooled key forgotten", func() bool {
		h.hit(t, "hot")
		time.Sleep(2 * hold)
		return h.ls.Entries() == 0
	})
	for range 3 {
		h.hit(t, "hot")
		if n := h.ls.Entries(); n != 0 {
			t.Fatalf("a request every two holds made %d entries in the lease table; want none", n)
		}
		time.Sleep(2 * hold)
	}
}
