package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/concurrent"
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Waiting for a concurrency slot (issue 40): slot queues in a real
// redis-server, shared by two clients of one process, each standing for
// an instance (a channel of its own).

// quietReport is a store's reporter that keeps nothing.
type quietReport struct{}

func (quietReport) Answered(time.Duration)                 {}
func (quietReport) Failed(error)                           {}
func (quietReport) Overloaded(error)                       {}
func (quietReport) KindFailed(limit.KindError)             {}
func (quietReport) Warn(string, error, ...zap.Field)       {}
func (quietReport) Debug(string)                           {}
func (quietReport) Charged(*limit.Limit, float64, float64) {}
func (quietReport) SettleFailed(error)                     {}
func (quietReport) Refilled([]string)                      {}
func (quietReport) ForgetDenials([]string)                 {}

var _ redisstore.Reporter = quietReport{}

// instance is one client and its store over a Redis.
type instance struct {
	client *redisstore.Client
	store  *redisstore.Store
}

// newInstance is a client of its own over srv, with its grant channel
// subscribed.
func newInstance(t *testing.T, srv *redistest.Server) instance {
	t.Helper()
	c := redisstore.New(redisstore.Options{Redis: &redis.UniversalOptions{Addrs: []string{srv.Addr}},
		Timeout: 2 * time.Second, DialTimeout: 2 * time.Second, KeyPrefix: "t:"})
	t.Cleanup(func() { _ = c.Destruct() })
	rdb := srv.Client(t)
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, err := rdb.PubSubNumSub(context.Background(), c.GrantChannel()).Result()
		if err == nil && n[c.GrantChannel()] > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the grant channel %s is not subscribed: %v", c.GrantChannel(), err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return instance{client: c, store: redisstore.NewStore(c, nil, true, quietReport{})}
}

// queueLimit is a concurrent limit of n slots whose requests wait up to
// maxWait, with its slots held for hold.
func queueLimit(name string, n int64, hold, maxWait time.Duration) *limit.Limit {
	k := concurrent.New(hold, time.Second).WithMaxWait(maxWait)
	l := &limit.Limit{Name: name, Burst: limit.Param(fmt.Sprint(n)), KeyPrefix: "t:{", KeySuffix: "}|" + name + "|slots", Fixed: true}
	l.SetKind(k)
	l.Values, _, _ = k.ResolveValues("", fmt.Sprint(n), "")
	l.Args = k.ScriptArgs(l.Values)
	return l
}

// slotBucket is a request's bucket of l for client with priority.
func slotBucket(l *limit.Limit, client string, priority int64) limit.Bucket {
	b := limit.Bucket{Limit: l, Key: l.KeyPrefix + client + l.KeySuffix, Values: l.Values, Args: l.Args}
	b.Values.Priority = priority
	b, _ = l.Kind.Begin(b, limit.Shared{})
	return b
}

// ask takes buckets through a store, as the handler would with
// mayQueue, counting its waiting requests in waiting.
func ask(ctx context.Context, s *redisstore.Store, buckets []limit.Bucket, mayQueue bool, waiting *atomic.Int64) (*limit.Call, bool, error) {
	r := &limit.Call{}
	r.Reset(buckets)
	r.Sent, r.MayQueue, r.Waiting = time.Now(), mayQueue, waiting
	allowed, err := s.Take(ctx, r)
	return r, allowed, err
}

// queueLen is how many wait in the queue of the slots at key.
func queueLen(t *testing.T, rdb *redis.Client, key string) int64 {
	n, err := rdb.ZCard(context.Background(), key+"|q").Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// awaitQueue waits until n wait in the queue at key.
func awaitQueue(t *testing.T, rdb *redis.Client, key string, n int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for queueLen(t, rdb, key) != n {
		if time.Now().After(deadline) {
			t.Fatalf("queue at %s: %d waiting, want %d", key, queueLen(t, rdb, key), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// granted is a waiter's grant: who, when, and the request's hold.
type granted struct {
	name string
	at   time.Time
	call *limit.Call
	s    *redisstore.Store
}

func TestSlotWaitersServedByPriorityThenArrivalAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a, b := newInstance(t, srv), newInstance(t, srv)
	l := queueLimit("gen", 1, 30*time.Second, 20*time.Second)
	key := l.KeyPrefix + "k" + l.KeySuffix

	holder, ok, err := ask(context.Background(), a.store, []limit.Bucket{slotBucket(l, "k", 0)}, true, nil)
	if err != nil || !ok {
		t.Fatalf("the first request: %v, %v", ok, err)
	}
	holding := a.store.Hold(holder)

	// Arrival order, alternating instances; by priority then arrival
	// they go w3, w4, w1, w2, w5.
	waiters := []struct {
		name     string
		inst     instance
		priority int64
	}{{"w1", b, 0}, {"w2", a, 0}, {"w3", b, 5}, {"w4", a, 5}, {"w5", b, -1}}
	var waiting atomic.Int64
	grants := make(chan granted, len(waiters))
	var wg sync.WaitGroup
	for i, w := range waiters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, ok, err := ask(context.Background(), w.inst.store, []limit.Bucket{slotBucket(l, "k", w.priority)}, true, &waiting)
			if err != nil || !ok {
				t.Errorf("%s: %v, %v", w.name, ok, err)
				return
			}
			grants <- granted{name: w.name, at: time.Now(), call: r, s: w.inst.store}
		}()
		awaitQueue(t, rdb, key, int64(i+1))
	}
	if n := waiting.Load(); n != int64(len(waiters)) {
		t.Errorf("%d requests counted waiting, want %d", n, len(waiters))
	}

	var order []string
	released := time.Now()
	holding.Release()
	for range waiters {
		g := <-grants
		t.Logf("%s granted %v after the previous slot was given back", g.name, g.at.Sub(released))
		if inUse, _ := rdb.ZCard(context.Background(), key).Result(); inUse != 1 {
			t.Errorf("%d slots held after %s's grant, want 1", inUse, g.name)
		}
		order = append(order, g.name)
		released = time.Now()
		g.s.Hold(g.call).Release()
	}
	wg.Wait()
	if got, want := fmt.Sprint(order), "[w3 w4 w1 w2 w5]"; got != want {
		t.Errorf("served %s, want %s", got, want)
	}
	if n := waiting.Load(); n != 0 {
		t.Errorf("%d requests counted waiting at the end", n)
	}
}

func TestSlotWaiterThatLeavesTakesNoSlot(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a, b := newInstance(t, srv), newInstance(t, srv)
	// A token bucket with the slot: its tokens are taken at the enqueue,
	// and given back when the waiter leaves.
	tb := &limit.Limit{Name: "rate", KeyPrefix: "t:{", KeySuffix: "}|rate", Fixed: true}
	tb.SetKind(tokenbucket.Kind{})
	tb.Values = limit.Values{Rate: 0.001, Burst: 10, Requested: 4}
	tb.Args = tokenbucket.Args(tb.Values)
	l := queueLimit("gen", 1, 30*time.Second, 20*time.Second)
	key := l.KeyPrefix + "k" + l.KeySuffix
	request := func(priority int64) []limit.Bucket {
		s := slotBucket(l, "k", priority)
		return []limit.Bucket{{Limit: tb, Key: tb.KeyPrefix + "k" + tb.KeySuffix, Values: tb.Values, Args: tb.Args}, s}
	}
	holder, ok, err := ask(context.Background(), a.store, request(0)[1:], true, nil)
	if err != nil || !ok {
		t.Fatalf("the first request: %v, %v", ok, err)
	}

	// The leaver waits first, then one behind it.
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error, 1)
	go func() {
		r, ok, err := ask(ctx, b.store, request(0), true, nil)
		if ok {
			b.store.Hold(r).Release()
		}
		left <- err
	}()
	awaitQueue(t, rdb, key, 1)
	tokens, _ := rdb.Get(context.Background(), tb.KeyPrefix+"k"+tb.KeySuffix).Result()
	t.Logf("the token bucket while it waits: %q", tokens)
	next := make(chan granted, 1)
	go func() {
		r, ok, err := ask(context.Background(), a.store, request(0), true, nil)
		if err != nil || !ok {
			t.Errorf("the next waiter: %v, %v", ok, err)
			close(next)
			return
		}
		next <- granted{name: "next", at: time.Now(), call: r, s: a.store}
	}()
	awaitQueue(t, rdb, key, 2)
	cancel()
	if err := <-left; !errors.Is(err, context.Canceled) {
		t.Fatalf("the waiter whose client left: %v, want context.Canceled", err)
	}
	awaitQueue(t, rdb, key, 1)
	if inUse, _ := rdb.ZCard(context.Background(), key).Result(); inUse != 1 {
		t.Errorf("%d slots held once the waiter left, want the holder's 1", inUse)
	}
	released := time.Now()
	a.store.Hold(holder).Release()
	g, ok := <-next
	if !ok {
		return
	}
	t.Logf("the next waiter granted %v after the slot was given back", g.at.Sub(released))
	// The leaver's 4 tokens came back: the holder took none, the next 4.
	state, _ := rdb.Get(context.Background(), tb.KeyPrefix+"k"+tb.KeySuffix).Result()
	var left2 float64
	var at int64
	fmt.Sscanf(state, "%g %d", &left2, &at)
	if left2 < 6 || left2 > 6.1 {
		t.Errorf("the token bucket holds %q, want 6 tokens: the leaver's given back", state)
	}
	g.s.Hold(g.call).Release()
}

// concurrentScript runs concurrent.lua.
func concurrentScript(t *testing.T, rdb *redis.Client, keys []string, args ...any) []int64 {
	t.Helper()
	source, err := os.ReadFile("concurrent.lua")
	if err != nil {
		t.Fatal(err)
	}
	reply, err := rdb.Eval(context.Background(), string(source), keys, args...).Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	return reply
}

// enqueueRaw queues a waiter of a channel no one listens to (an
// instance that died, or one that never hears its grant), with script.lua
// as an instance would, and returns its member and id.
func enqueueRaw(t *testing.T, rdb *redis.Client, key string, n int, hold time.Duration, id, channel string, priority int) string {
	t.Helper()
	source, err := os.ReadFile("script.lua")
	if err != nil {
		t.Fatal(err)
	}
	us := fmt.Sprint(hold.Microseconds())
	reply, err := rdb.Eval(context.Background(), string(source), []string{key}, "cq", fmt.Sprint(n), id, us, fmt.Sprint(priority), channel).Int64Slice()
	if err != nil || len(reply) != 3 || reply[0] != 2 {
		t.Fatalf("raw enqueue: %v, %v", reply, err)
	}
	return fmt.Sprintf("%016d %d %s %s %s", reply[2], n, us, id, channel)
}

func TestSlotGrantedToAWaiterThatJustLeftGoesToTheNext(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := newInstance(t, srv)
	l := queueLimit("gen", 1, 30*time.Second, 20*time.Second)
	key := l.KeyPrefix + "k" + l.KeySuffix
	holder, ok, err := ask(context.Background(), a.store, []limit.Bucket{slotBucket(l, "k", 0)}, true, nil)
	if err != nil || !ok {
		t.Fatalf("the first request: %v, %v", ok, err)
	}
	// A waiter at the head that will not hear its grant before it leaves.
	member := enqueueRaw(t, rdb, key, 1, 30*time.Second, "deaf:1", "t:slots:nobody", 0)
	next := make(chan granted, 1)
	go func() {
		r, ok, err := ask(context.Background(), a.store, []limit.Bucket{slotBucket(l, "k", 0)}, true, nil)
		if err != nil || !ok {
			t.Errorf("the next waiter: %v, %v", ok, err)
			close(next)
			return
		}
		next <- granted{name: "next", at: time.Now(), call: r, s: a.store}
	}()
	awaitQueue(t, rdb, key, 2)
	a.store.Hold(holder).Release()
	awaitQueue(t, rdb, key, 1) // granted to the deaf head
	if s, err := rdb.ZScore(context.Background(), key, "deaf:1").Result(); err != nil || s == 0 {
		t.Fatalf("the head holds no slot: %v, %v", s, err)
	}
	select {
	case <-next:
		t.Fatal("the second waiter was granted while the head held the slot")
	case <-time.After(50 * time.Millisecond):
	}
	// It leaves: the slot granted meanwhile goes back, to the next.
	left := time.Now()
	if reply := concurrentScript(t, rdb, []string{key}, "leave", member, "deaf:1"); len(reply) != 1 || reply[0] != 2 {
		t.Fatalf("leave: %v, want [2] (a granted slot given back)", reply)
	}
	g, ok := <-next
	if !ok {
		return
	}
	t.Logf("the next waiter granted %v after the head left", g.at.Sub(left))
	if n, _ := rdb.ZCard(context.Background(), key).Result(); n != 1 {
		t.Errorf("%d slots held, want 1", n)
	}
	g.s.Hold(g.call).Release()
}

func TestSlotWaitersOfADeadInstanceLeaveWithinAHold(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := newInstance(t, srv)
	const hold = time.Second
	l := queueLimit("gen", 1, hold, 20*time.Second)
	key := l.KeyPrefix + "k" + l.KeySuffix
	holder, ok, err := ask(context.Background(), a.store, []limit.Bucket{slotBucket(l, "k", 0)}, true, nil)
	if err != nil || !ok {
		t.Fatalf("the first request: %v, %v", ok, err)
	}
	holding := a.store.Hold(holder) // renewed while it is held
	// A dead instance's waiters, ahead of a live one: never renewed.
	enqueueRaw(t, rdb, key, 1, hold, "dead:1", "t:slots:dead", 9)
	enqueueRaw(t, rdb, key, 1, hold, "dead:2", "t:slots:dead", 9)
	next := make(chan granted, 1)
	go func() {
		r, ok, err := ask(context.Background(), a.store, []limit.Bucket{slotBucket(l, "k", 0)}, true, nil)
		if err != nil || !ok {
			t.Errorf("the live waiter: %v, %v", ok, err)
			close(next)
			return
		}
		next <- granted{name: "live", at: time.Now(), call: r, s: a.store}
	}()
	awaitQueue(t, rdb, key, 3)
	time.Sleep(2 * hold) // the dead expire; the live one renews its entry, the holder its slot
	select {
	case <-next:
		t.Fatal("the live waiter was granted a slot still held")
	default:
	}
	// Expired a hold after they came, the dead were dropped by the next
	// call that looked at the queue: the live waiter's renewal.
	if n := queueLen(t, rdb, key); n != 1 {
		t.Errorf("%d in the queue two holds on, want the live waiter alone", n)
	}
	released := time.Now()
	holding.Release()
	g, ok := <-next
	if !ok {
		return
	}
	t.Logf("the live waiter granted %v after the slot was given back, past two dead ones", g.at.Sub(released))
	for _, id := range []string{"dead:1", "dead:2"} {
		if _, err := rdb.ZScore(context.Background(), key, id).Result(); err != redis.Nil {
			t.Errorf("the dead waiter %s got a slot", id)
		}
	}
	if n := queueLen(t, rdb, key); n != 0 {
		t.Errorf("%d left in the queue", n)
	}
	g.s.Hold(g.call).Release()
}

func TestSlotWaitersNeverMoreThanNInFlight(t *testing.T) {
	srv := redistest.Start(t)
	a, b := newInstance(t, srv), newInstance(t, srv)
	const n, requests = 3, 40
	l := queueLimit("gen", n, 30*time.Second, 30*time.Second)
	var inFlight, most, served atomic.Int64
	var waiting atomic.Int64
	var wg sync.WaitGroup
	for i := range requests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			inst := []instance{a, b}[i%2]
			r, ok, err := ask(context.Background(), inst.store, []limit.Bucket{slotBucket(l, "k", int64(i%3))}, true, &waiting)
			if err != nil || !ok {
				t.Errorf("request %d: %v, %v", i, ok, err)
				return
			}
			now := inFlight.Add(1)
			for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
			}
			time.Sleep(time.Duration(1+i%4) * time.Millisecond)
			inFlight.Add(-1) // before the release is sent: counted as it leaves
			served.Add(1)
			inst.store.Hold(r).Release()
		}()
	}
	wg.Wait()
	if served.Load() != requests || most.Load() > n {
		t.Errorf("%d served, at most %d in flight; want %d, at most %d", served.Load(), most.Load(), requests, n)
	}
	t.Logf("%d served, at most %d in flight of %d slots", served.Load(), most.Load(), n)
	if waiting.Load() != 0 {
		t.Errorf("%d counted waiting at the end", waiting.Load())
	}
}

func TestSlotRequestThatMayNotQueueOrOutwaitsItsMaxWaitIsRefused(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := newInstance(t, srv)
	l := queueLimit("gen", 1, 30*time.Second, 100*time.Millisecond)
	key := l.KeyPrefix + "k" + l.KeySuffix
	holder, ok, err := ask(context.Background(), a.store, []limit.Bucket{slotBucket(l, "k", 0)}, true, nil)
	if err != nil || !ok {
		t.Fatalf("the first request: %v, %v", ok, err)
	}
	start := time.Now()
	r, ok, err := ask(context.Background(), a.store, []limit.Bucket{slotBucket(l, "k", 0)}, false, nil)
	if ok || err != nil || queueLen(t, rdb, key) != 0 {
		t.Errorf("may not queue: %v, %v, queue %d; want refused at once, no queue", ok, err, queueLen(t, rdb, key))
	}
	if d := time.Since(start); d > 50*time.Millisecond {
		t.Logf("refusal took %v", d)
	}
	start = time.Now()
	r, ok, err = ask(context.Background(), a.store, []limit.Bucket{slotBucket(l, "k", 0)}, true, nil)
	waited := time.Since(start)
	if ok || err != nil {
		t.Fatalf("outwaited: %v, %v; want refused", ok, err)
	}
	if waited < 100*time.Millisecond {
		t.Errorf("refused after %v, before its max wait", waited)
	}
	if r.Buckets[0].RetryAfter != time.Second {
		t.Errorf("Retry-After %v, want the limit's 1s", r.Buckets[0].RetryAfter)
	}
	if n := queueLen(t, rdb, key); n != 0 {
		t.Errorf("%d left in the queue", n)
	}
	if n, _ := rdb.ZCard(context.Background(), key).Result(); n != 1 {
		t.Errorf("%d slots held, want the holder's 1", n)
	}
	a.store.Hold(holder).Release()
}
