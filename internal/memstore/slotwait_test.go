package memstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/concurrent"
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/memstore"
)

// Waiting for a concurrency slot in the process (issue 40): store
// memory's and on_error local's queues.

type quietReport struct{}

func (quietReport) Full()                                             {}
func (quietReport) Charged(*limit.Limit, float64, float64)            {}
func (quietReport) Unsettled([]limit.Bucket, []limit.Settling, error) {}

// memStore is a memory store of its own, as a handler's.
func memStore(t *testing.T, zone string) (*memstore.Store, limit.Store) {
	t.Helper()
	s, err := memstore.Acquire("memory", "t:", zone, 1000)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Release() })
	return s, s.For(quietReport{}, true)
}

func slotLimit(name string, n int64, maxWait time.Duration) *limit.Limit {
	k := concurrent.New(30*time.Second, time.Second).WithMaxWait(maxWait)
	l := &limit.Limit{Name: name, Burst: limit.Param(fmt.Sprint(n)), KeyPrefix: "t:{", KeySuffix: "}|" + name + "|slots", Fixed: true}
	l.SetKind(k)
	l.Values, _, _ = k.ResolveValues("", fmt.Sprint(n), "")
	l.Args = k.ScriptArgs(l.Values)
	return l
}

func slotBucket(l *limit.Limit, client string, priority int64) limit.Bucket {
	b := limit.Bucket{Limit: l, Key: l.KeyPrefix + client + l.KeySuffix, Values: l.Values, Args: l.Args}
	b.Values.Priority = priority
	b, _ = l.Kind.Begin(b, limit.Shared{})
	return b
}

func ask(ctx context.Context, s limit.Store, buckets []limit.Bucket, waiting *atomic.Int64) (*limit.Call, bool, error) {
	r := &limit.Call{}
	r.Reset(buckets)
	r.Sent, r.MayQueue, r.Waiting = time.Now(), true, waiting
	allowed, err := s.Take(ctx, r)
	return r, allowed, err
}

func awaitWaiting(t *testing.T, s *memstore.Store, key string, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.Waiting(key) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d waiting at %s, want %d", s.Waiting(key), key, n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestMemorySlotWaitersServedByPriorityThenArrival(t *testing.T) {
	ms, s := memStore(t, "order")
	l := slotLimit("gen", 1, 20*time.Second)
	key := l.KeyPrefix + "k" + l.KeySuffix
	holder, ok, err := ask(context.Background(), s, []limit.Bucket{slotBucket(l, "k", 0)}, nil)
	if !ok || err != nil {
		t.Fatalf("the first request: %v, %v", ok, err)
	}
	holding := s.Hold(holder)
	type grant struct {
		name string
		call *limit.Call
	}
	grants := make(chan grant, 5)
	var waiting atomic.Int64
	var wg sync.WaitGroup
	for i, w := range []struct {
		name     string
		priority int64
	}{{"w1", 0}, {"w2", 0}, {"w3", 5}, {"w4", 5}, {"w5", -1}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, ok, err := ask(context.Background(), s, []limit.Bucket{slotBucket(l, "k", w.priority)}, &waiting)
			if !ok || err != nil {
				t.Errorf("%s: %v, %v", w.name, ok, err)
				return
			}
			grants <- grant{w.name, r}
		}()
		awaitWaiting(t, ms, key, i+1)
	}
	if waiting.Load() != 5 {
		t.Errorf("%d counted waiting, want 5", waiting.Load())
	}
	holding.Release()
	var order []string
	for range 5 {
		g := <-grants
		if n := ms.InUse(key); n != 1 {
			t.Errorf("%d slots held at %s's grant, want 1", n, g.name)
		}
		order = append(order, g.name)
		s.Hold(g.call).Release()
	}
	wg.Wait()
	if got := fmt.Sprint(order); got != "[w3 w4 w1 w2 w5]" {
		t.Errorf("served %s, want [w3 w4 w1 w2 w5]", got)
	}
	if ms.InUse(key) != 0 || waiting.Load() != 0 {
		t.Errorf("at the end: %d held, %d waiting", ms.InUse(key), waiting.Load())
	}
}

func TestMemorySlotWaitersNeverMoreThanNInFlight(t *testing.T) {
	_, s := memStore(t, "bound")
	const n, requests = 3, 60
	l := slotLimit("gen", n, 30*time.Second)
	var inFlight, most, served atomic.Int64
	var wg sync.WaitGroup
	for i := range requests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, ok, err := ask(context.Background(), s, []limit.Bucket{slotBucket(l, "k", int64(i%3))}, nil)
			if !ok || err != nil {
				t.Errorf("request %d: %v, %v", i, ok, err)
				return
			}
			now := inFlight.Add(1)
			for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
			}
			time.Sleep(time.Duration(i%3) * time.Millisecond)
			inFlight.Add(-1)
			served.Add(1)
			s.Hold(r).Release()
		}()
	}
	wg.Wait()
	if served.Load() != requests || most.Load() > n {
		t.Errorf("%d served, at most %d in flight; want %d, at most %d", served.Load(), most.Load(), requests, n)
	}
}

func TestMemorySlotWaiterThatLeavesTakesNoSlotAndGetsItsTokensBack(t *testing.T) {
	ms, s := memStore(t, "leave")
	tb := &limit.Limit{Name: "rate", KeyPrefix: "t:{", KeySuffix: "}|rate", Fixed: true}
	tb.SetKind(tokenbucket.Kind{})
	tb.Values = limit.Values{Rate: 0.001, Burst: 10, Requested: 4}
	tb.Args = tokenbucket.Args(tb.Values)
	l := slotLimit("gen", 1, 100*time.Millisecond)
	key := l.KeyPrefix + "k" + l.KeySuffix
	request := func() []limit.Bucket {
		return []limit.Bucket{{Limit: tb, Key: tb.KeyPrefix + "k" + tb.KeySuffix, Values: tb.Values, Args: tb.Args}, slotBucket(l, "k", 0)}
	}
	holder, ok, err := ask(context.Background(), s, request()[1:], nil)
	if !ok || err != nil {
		t.Fatalf("the first request: %v, %v", ok, err)
	}
	holding := s.Hold(holder)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, _, err := ask(ctx, s, request(), nil)
		done <- err
	}()
	awaitWaiting(t, ms, key, 1)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("the waiter whose client left: %v", err)
	}
	if ms.Waiting(key) != 0 || ms.InUse(key) != 1 {
		t.Errorf("after it left: %d waiting, %d held; want 0 and the holder's 1", ms.Waiting(key), ms.InUse(key))
	}
	// Out of its max wait: refused, the limit's Retry-After.
	start := time.Now()
	r, ok, err := ask(context.Background(), s, request(), nil)
	if ok || err != nil || time.Since(start) < 100*time.Millisecond || r.Buckets[1].RetryAfter != time.Second {
		t.Errorf("out of its max wait: %v, %v after %v, Retry-After %v", ok, err, time.Since(start), r.Buckets[1].RetryAfter)
	}
	// Both gave their tokens back: a request now takes 4 of 10.
	holding.Release()
	r, ok, err = ask(context.Background(), s, request(), nil)
	if !ok || err != nil || r.Buckets[0].Remaining != 6 {
		t.Errorf("after the waiters left: %v, %v, %d tokens left; want 6", ok, err, r.Buckets[0].Remaining)
	}
	s.Hold(r).Release()
}
