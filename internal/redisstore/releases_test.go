package redisstore_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/concurrent"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The releases of concurrency slots as the client counts them pending
// (export_test.go), over real Redis processes: a release is pending from
// the end of its request until it is answered, or its slot has expired
// by itself, and no longer; a refusal of its key waits for it, and for
// no other key's.

// reports is a store's Reporter that keeps its warnings.
type reports struct {
	mu       sync.Mutex
	warnings []string
}

func (r *reports) Warn(msg string, _ error, _ ...zap.Field) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.warnings = append(r.warnings, msg)
}

// warned counts the warnings whose message contains msg.
func (r *reports) warned(msg string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, w := range r.warnings {
		if strings.Contains(w, msg) {
			n++
		}
	}
	return n
}

func (*reports) Answered(time.Duration)                 {}
func (*reports) Failed(error)                           {}
func (*reports) Overloaded(error)                       {}
func (*reports) KindFailed(limit.KindError)             {}
func (*reports) Debug(string)                           {}
func (*reports) Charged(*limit.Limit, float64, float64) {}
func (*reports) SettleFailed(error)                     {}
func (*reports) Refilled([]string)                      {}
func (*reports) ForgetDenials([]string)                 {}

// releaseFailed is the start of the warning of a failed release.
const releaseFailed = "Redis failed while renewing or releasing concurrency slots"

// newClient is a client of its own to the Redis at addr, closed once
// the test ends.
func newClient(t *testing.T, addr string, timeout time.Duration) *redisstore.Client {
	t.Helper()
	c := openClient(addr, timeout)
	t.Cleanup(func() { _ = c.Destruct() })
	return c
}

// openClient is a client of its own to the Redis at addr, for the caller
// to close (Destruct, once).
func openClient(addr string, timeout time.Duration) *redisstore.Client {
	return redisstore.New(redisstore.Options{
		Redis:   &redis.UniversalOptions{Addrs: []string{addr}},
		Timeout: timeout, DialTimeout: timeout, KeyPrefix: "rate_limit:",
	})
}

// slotLimit is a concurrent limit of slots, each held for hold unless
// renewed.
func slotLimit(slots int64, hold time.Duration) *limit.Limit {
	k := concurrent.New(hold, time.Second)
	l := &limit.Limit{Name: "gen", Fixed: true, Values: limit.Values{Burst: slots, Requested: 1}}
	l.SetKind(k)
	l.Args = k.ScriptArgs(l.Values)
	return l
}

// request is a new request's bucket of l at key, with a slot id of its
// own.
func request(l *limit.Limit, key string) []limit.Bucket {
	b, _ := l.Kind.Begin(limit.Bucket{Limit: l, Key: key, Values: l.Values, Args: l.Args}, limit.Shared{})
	return []limit.Bucket{b}
}

// take takes a request's buckets through s, as the handler does.
func take(t *testing.T, s *redisstore.Store, buckets []limit.Bucket) bool {
	t.Helper()
	allowed, err := s.Take(context.Background(), &limit.Call{Sent: time.Now(), Buckets: buckets})
	if err != nil {
		t.Fatalf("take of %s: %v", buckets[0].Key, err)
	}
	return allowed
}

// hold takes a request's slot and holds it, as an admitted request does
// while it is served.
func hold(t *testing.T, s *redisstore.Store, l *limit.Limit, key string) limit.Holding {
	t.Helper()
	buckets := request(l, key)
	if !take(t, s, buckets) {
		t.Fatalf("the take of %s refused, want admitted", key)
	}
	return s.Hold(&limit.Call{Buckets: buckets})
}

// eventually polls cond every 20ms until it holds, failing the test
// after timeout.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for start := time.Now(); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Since(start) > timeout {
			t.Fatalf("%s: not within %v", what, timeout)
		}
	}
}

// A release that meets a closed client is answered (a warning; the slot
// expires with its hold), and counts as pending no more, rather than
// waiting in a queue that no worker reads any more. (A client closes
// only once no request of it holds a slot, so what meets it is the
// release of a lost take, whose answer came after the client closed:
// here a hold made after it closed stands for that.)
func TestReleaseAfterTheClientClosedIsNotLeftPending(t *testing.T) {
	srv := redistest.Start(t)
	c := openClient(srv.Addr, time.Second)
	r := &reports{}
	s := redisstore.NewStore(c, nil, true, r)
	_ = c.Destruct() // unloaded: it closes once idle
	eventually(t, 5*time.Second, "the unloaded client closed", func() bool {
		select {
		case <-c.Batcher().Done():
			return true
		default:
			return false
		}
	})
	s.Hold(&limit.Call{Buckets: request(slotLimit(1, 30*time.Second), "rate_limit:k")}).Release()
	if n := c.PendingReleases(); n != 0 {
		t.Fatalf("%d releases pending after the release met a closed client, want 0", n)
	}
	if n := r.warned(releaseFailed); n != 1 {
		t.Errorf("%d warnings of the lost release, want 1", n)
	}
}

// Releases that fail, Redis gone, are each sent again until their slot
// would have expired by itself (hold 1s), pending meanwhile, and then
// are pending no more: the releases of two stores (two zones) sharing
// the client, several keys each.
func TestReleasesLostToRedisAreNotLeftPending(t *testing.T) {
	srv := redistest.Start(t)
	c := newClient(t, srv.Addr, time.Second)
	l := slotLimit(10, time.Second)
	var holds []limit.Holding
	for zone := range 2 {
		s := redisstore.NewStore(c, nil, true, &reports{})
		for _, key := range []string{"k1", "k2", "k3"} {
			holds = append(holds, hold(t, s, l, fmt.Sprintf("rate_limit:z%d:%s", zone, key)))
		}
	}
	srv.Kill(t) // the releases of all six fail, in one call or a few
	for _, h := range holds {
		h.Release()
	}
	eventually(t, 5*time.Second, "every pending release answered or its slot expired", func() bool { return c.PendingReleases() == 0 })
}

// A release that failed (Redis refused the script) is sent again at the
// renewals' next tick, pending meanwhile; once it frees the slot it is
// pending no more.
func TestReleaseRetriedAfterAFailureIsNotLeftPending(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	c := newClient(t, srv.Addr, time.Second)
	r := &reports{}
	s := redisstore.NewStore(c, nil, true, r)
	const key = "rate_limit:k"
	h := hold(t, s, slotLimit(1, 30*time.Second), key)
	if err := rdb.Do(ctx, "ACL", "SETUSER", "default", "-eval", "-evalsha").Err(); err != nil {
		t.Fatal(err)
	}
	h.Release()
	eventually(t, 5*time.Second, "the release's failure told", func() bool { return r.warned(releaseFailed) > 0 })
	if n := c.PendingReleases(); n != 1 {
		t.Errorf("%d releases pending after the release failed, want 1 until it is answered", n)
	}
	if err := rdb.Do(ctx, "ACL", "SETUSER", "default", "+eval", "+evalsha").Err(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, "the slot free after its release failed (hold 30s)", func() bool { return rdb.Exists(ctx, key).Val() == 0 })
	eventually(t, time.Second, "no release counted pending", func() bool { return c.PendingReleases() == 0 })
}

// A request refused by a full concurrent limit waits for, and asks again
// after, the releases of its own key only: a release of another key on
// its way is none of its business, even one that shares its count of
// pending releases (1,024 counts by hash).
func TestRefusalWaitsForNoReleaseOfAnotherKey(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	c := newClient(t, srv.Addr, 2*time.Second)
	s := redisstore.NewStore(c, nil, true, &reports{})
	l := slotLimit(1, 30*time.Second)
	const victim = "rate_limit:victim"
	other := ""
	for i := 0; other == ""; i++ {
		if key := fmt.Sprint("rate_limit:other", i); redisstore.SamePendingShard(key, victim) {
			other = key
		}
	}
	h := hold(t, s, l, victim)
	defer h.Release()

	c.AddPendingReleases([]string{other}, 1) // the other key's release, on its way for 200 ms
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		time.Sleep(200 * time.Millisecond)
		c.AddPendingReleases([]string{other}, -1)
	}()
	defer func() { <-answered }()
	calls := redistest.ScriptCalls(t, rdb)
	start := time.Now()
	if take(t, s, request(l, victim)) {
		t.Fatal("with the victim's slot held: admitted, want refused")
	}
	took := time.Since(start)
	if n := redistest.ScriptCalls(t, rdb) - calls; n != 1 {
		t.Errorf("the refusal took %d script calls (in %v), want 1: it waited for another key's release and asked again",
			n, took.Round(time.Microsecond))
	}
}
