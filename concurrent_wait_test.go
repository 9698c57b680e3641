package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
)

// Waiting for a concurrency slot (issue 40, item 3), end to end through
// handlers: `concurrent <name> <slots> { max_wait; priority }`.

// letQueue is the handler's count of its requests waiting now (which
// the stores count in while a request waits for a slot).
func letQueue(h *Handler) *atomic.Int64 { return h.waitingNow }

// waitHandler is a handler with a queueing concurrent limit gen of n
// slots; redis is its redis block (distinct blocks: distinct clients, as
// two instances), or "" for store memory.
func waitHandler(t *testing.T, redis string, n int) *Handler {
	t.Helper()
	store := "store memory"
	if redis != "" {
		store = "redis {\n" + redis + "\n}"
	}
	return caddyfileHandler(t, fmt.Sprintf(`rate_limit {
		zone waiting
		key {http.request.header.X-Key}
		concurrent gen %d {
			max_wait 10s
			priority {http.request.header.X-Priority}
		}
		%s
	}`, n, store))
}

// recorder is a next handler that records who reached it.
type recorder struct {
	mu    sync.Mutex
	order []string
}

func (rc *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	rc.mu.Lock()
	rc.order = append(rc.order, r.Header.Get("X-Name"))
	rc.mu.Unlock()
	w.WriteHeader(http.StatusOK)
	return nil
}

// sendNamed sends a request of key k named name with priority through h
// to next; its status comes on the channel.
func sendNamed(ctx context.Context, h *Handler, next interface {
	ServeHTTP(http.ResponseWriter, *http.Request) error
}, name string, priority int) <-chan int {
	done := make(chan int, 1)
	go func() {
		r, w := newRequest("192.0.2.1", "k")
		r.Header.Set("X-Name", name)
		r.Header.Set("X-Priority", fmt.Sprint(priority))
		r = r.WithContext(mergeCancel(r.Context(), ctx))
		err := h.ServeHTTP(w, r, nextFunc(next.ServeHTTP))
		done <- statusOf(err, w.Code)
	}()
	return done
}

// startHeldWaiting is startHeld for a waitHandler: its request has a
// priority.
func startHeldWaiting(t *testing.T, h *Handler, hd *holder) <-chan int {
	t.Helper()
	done := sendNamed(context.Background(), h, hd, "holder", 0)
	select {
	case <-hd.entered:
	case status := <-done:
		t.Fatalf("the held request was answered %d, want it admitted and held", status)
	case <-time.After(5 * time.Second):
		t.Fatal("the held request was not admitted within 5s")
	}
	return done
}

type nextFunc func(http.ResponseWriter, *http.Request) error

func (f nextFunc) ServeHTTP(w http.ResponseWriter, r *http.Request) error { return f(w, r) }

func TestConcurrentWaitServesByPriorityThenArrivalAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	a := waitHandler(t, "address "+srv.Addr+"\npool_size 10", 1)
	b := waitHandler(t, "address "+srv.Addr+"\npool_size 11", 1)
	if a.limiter == b.limiter {
		t.Fatal("the two handlers share a client: not two instances")
	}
	waitingA, waitingB := letQueue(a), letQueue(b)
	key := slotKey(t, a, "gen", "k")

	hd := newHolder()
	held := startHeldWaiting(t, a, hd)
	rec := new(recorder)
	var statuses []<-chan int
	for i, w := range []struct {
		name     string
		h        *Handler
		priority int
	}{{"w1", b, 0}, {"w2", a, 0}, {"w3", b, 5}, {"w4", a, 5}, {"w5", b, -1}} {
		statuses = append(statuses, sendNamed(context.Background(), w.h, rec, w.name, w.priority))
		eventually(t, 5*time.Second, fmt.Sprintf("%s queued", w.name), func() bool {
			n, _ := rdb.ZCard(context.Background(), key+"|q").Result()
			return n == int64(i+1)
		})
	}
	if n := waitingA.Load() + waitingB.Load(); n != 5 {
		t.Errorf("%d requests counted waiting, want 5", n)
	}
	close(hd.letGo)
	if s := <-held; s != 200 {
		t.Fatalf("the holder: %d", s)
	}
	for i, st := range statuses {
		if s := <-st; s != 200 {
			t.Errorf("waiter %d: %d, want 200", i+1, s)
		}
	}
	if got := fmt.Sprint(rec.order); got != "[w3 w4 w1 w2 w5]" {
		t.Errorf("served %s, want [w3 w4 w1 w2 w5]", got)
	}
	eventually(t, 2*time.Second, "every slot released", func() bool {
		n, _ := rdb.ZCard(context.Background(), key).Result()
		return n == 0
	})
}

func TestConcurrentWaitNeverMoreThanNInFlightAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	a := waitHandler(t, "address "+srv.Addr+"\npool_size 10", 2)
	b := waitHandler(t, "address "+srv.Addr+"\npool_size 11", 2)
	letQueue(a)
	letQueue(b)
	var inFlight, most atomic.Int64
	next := nextFunc(func(w http.ResponseWriter, r *http.Request) error {
		now := inFlight.Add(1)
		for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
		}
		time.Sleep(2 * time.Millisecond)
		inFlight.Add(-1)
		w.WriteHeader(http.StatusOK)
		return nil
	})
	const requests = 30
	var statuses []<-chan int
	for i := range requests {
		statuses = append(statuses, sendNamed(context.Background(), []*Handler{a, b}[i%2], next, fmt.Sprint(i), i%3))
	}
	ok := 0
	for _, st := range statuses {
		if <-st == 200 {
			ok++
		}
	}
	if ok != requests || most.Load() > 2 {
		t.Errorf("%d of %d served, at most %d in flight; want all, at most 2", ok, requests, most.Load())
	}
}

func TestConcurrentWaiterWhoseClientLeftTakesNoSlot(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	h := waitHandler(t, "address "+srv.Addr, 1)
	waiting := letQueue(h)
	key := slotKey(t, h, "gen", "k")
	hd := newHolder()
	held := startHeldWaiting(t, h, hd)
	ctx, cancel := context.WithCancel(context.Background())
	rec := new(recorder)
	left := sendNamed(ctx, h, rec, "leaver", 0)
	eventually(t, 5*time.Second, "the leaver queued", func() bool { return waiting.Load() == 1 })
	cancel()
	if s := <-left; s == 200 {
		t.Errorf("the request whose client left was served")
	}
	if n, _ := rdb.ZCard(context.Background(), key+"|q").Result(); n != 0 || waiting.Load() != 0 {
		t.Errorf("after it left: %d in the queue, %d counted waiting", n, waiting.Load())
	}
	if n, _ := rdb.ZCard(context.Background(), key).Result(); n != 1 {
		t.Errorf("%d slots held, want the holder's 1", n)
	}
	close(hd.letGo)
	<-held
	if len(rec.order) != 0 {
		t.Errorf("served %v", rec.order)
	}
}

func TestConcurrentWaitInMemoryServesByPriorityWithinTheBound(t *testing.T) {
	h := waitHandler(t, "", 1)
	letQueue(h)
	hd := newHolder()
	held := startHeldWaiting(t, h, hd)
	rec := new(recorder)
	var statuses []<-chan int
	for i, w := range []struct {
		name     string
		priority int
	}{{"w1", 0}, {"w2", 0}, {"w3", 5}, {"w4", 5}, {"w5", -1}} {
		statuses = append(statuses, sendNamed(context.Background(), h, rec, w.name, w.priority))
		eventually(t, 5*time.Second, fmt.Sprintf("%s queued", w.name), func() bool {
			return h.memory.Waiting(slotKey(t, h, "gen", "k")) == i+1
		})
	}
	close(hd.letGo)
	<-held
	for _, st := range statuses {
		if s := <-st; s != 200 {
			t.Errorf("a waiter: %d", s)
		}
	}
	if got := fmt.Sprint(rec.order); got != "[w3 w4 w1 w2 w5]" {
		t.Errorf("served %s, want [w3 w4 w1 w2 w5]", got)
	}
}

func TestConcurrentWaitConfigRefusesBadValues(t *testing.T) {
	for _, tc := range []struct{ block, want string }{
		{"max_wait -1s", "max_wait '-1s'"},
		{"max_wait 30", "max_wait '30'"},
		{"max_wait 0s", "max_wait '0s'"},
		{"max_wait 2h", "max_wait '2h0m0s'"},
		{"max_wait 1s\npriority high", "priority 'high' is not a whole number"},
		{"max_wait 1s\npriority 1.5", "priority '1.5' is not a whole number"},
		{"max_wait 1s\npriority 2000000", "priority '2000000' is not a whole number"},
		{"priority 3", "priority '3'"},
	} {
		_, err := parseTestCaddyfile(fmt.Sprintf("rate_limit {\nconcurrent gen 2 {\n%s\n}\n}", tc.block))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error naming %q", tc.block, err, tc.want)
		}
	}
	// In JSON too.
	for _, tc := range []struct{ json, want string }{
		{`{"name":"gen","slots":2,"max_wait":-1000000000}`, "max_wait '-1s'"},
		{`{"name":"gen","slots":2,"max_wait":"2h"}`, "max_wait '2h0m0s'"},
		{`{"name":"gen","slots":2,"max_wait":"1s","priority":"high"}`, "priority 'high'"},
	} {
		var c Concurrent
		if err := json.Unmarshal([]byte(tc.json), &c); err != nil {
			t.Fatalf("%s: %v", tc.json, err)
		}
		err := checkConcurrentValues(c)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error naming %q", tc.json, err, tc.want)
		}
	}
	// Good values pass, placeholders at run time.
	h, err := parseTestCaddyfile("rate_limit {\nconcurrent gen 2 {\nmax_wait 1h\npriority {http.request.header.X-P}\n}\n}")
	if err != nil || time.Duration(h.Concurrent[0].MaxWait) != time.Hour || h.Concurrent[0].Priority != "{http.request.header.X-P}" {
		t.Errorf("good values: %v, %+v", err, h.Concurrent)
	}
	_ = caddy.Duration(0)
}
