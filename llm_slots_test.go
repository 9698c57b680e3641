package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// slotUpstream holds each request it gets until the test releases one,
// and records who came, in order, and the most in flight at once.
type slotUpstream struct {
	*httptest.Server
	arrived  chan string // X-Who of each request, as it arrives
	release  chan struct{}
	inFlight atomic.Int64
	most     atomic.Int64
}

func startSlotUpstream(t *testing.T) *slotUpstream {
	u := &slotUpstream{arrived: make(chan string, 64), release: make(chan struct{})}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := u.inFlight.Add(1)
		for m := u.most.Load(); n > m && !u.most.CompareAndSwap(m, n); m = u.most.Load() {
		}
		defer u.inFlight.Add(-1)
		u.arrived <- r.Header.Get("X-Who")
		select {
		case <-u.release:
		case <-r.Context().Done():
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[]}`)
	}))
	t.Cleanup(func() { close(u.release); u.Close() })
	return u
}

// TestLLMGenerationSlotsReadmeExampleRunsAsWritten runs the README's
// generation slots on two Caddy instances sharing Redis: 4 requests hold
// the model's 4 slots; a free key's request queues on one instance, then
// a paying key's on the other; the slot given back goes to the paying
// key, the next to the free one; never more than 4 in flight.
func TestLLMGenerationSlotsReadmeExampleRunsAsWritten(t *testing.T) {
	block := readmeExample(t, "Generation slots, shared and waited for")
	if !strings.HasPrefix(block, "llm.example.com {") || !strings.Contains(block, "reverse_proxy localhost:8000\n") {
		t.Fatalf("the README's generation slots are not the site expected:\n%s", block)
	}
	srv := redistest.Start(t)
	up := startSlotUpstream(t)
	site := strings.Replace(block, "llm.example.com {", "http://127.0.0.1:{{http_port}} {", 1)
	site = strings.Replace(site, "reverse_proxy localhost:8000", "reverse_proxy "+strings.TrimPrefix(up.URL, "http://"), 1)
	site = strings.Replace(site, "\t\tzone llm-slots\n", "\t\tzone llm-slots\n\t\tredis "+srv.Addr+"\n", 1)
	caddyfile := caddyproc.Caddyfile(site)
	urls := []string{caddyproc.Start(t, caddyfile).URL, caddyproc.Start(t, caddyfile).URL}
	client := caddyClient(t)
	rdb := srv.Client(t)

	type answer struct {
		who    string
		status int
	}
	answers := make(chan answer, 16)
	send := func(url, who, key string) {
		req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[]}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("X-Who", who)
		resp, err := client.Do(req)
		if err != nil {
			t.Errorf("%s: %v", who, err)
			answers <- answer{who, 0}
			return
		}
		resp.Body.Close()
		answers <- answer{who, resp.StatusCode}
	}
	queued := func() int64 { // waiters in the model's queue, in Redis
		keys, _ := rdb.Keys(context.Background(), "*|q").Result()
		var n int64
		for _, k := range keys {
			n += rdb.ZCard(context.Background(), k).Val()
		}
		return n
	}

	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() { send(urls[i%2], fmt.Sprint("holder-", i), "sk-other") })
	}
	for range 4 {
		select {
		case <-up.arrived:
		case <-time.After(10 * time.Second):
			t.Fatal("the 4 slots were not taken")
		}
	}
	wg.Go(func() { send(urls[0], "free", "sk-free") })
	eventually(t, 10*time.Second, "the free key's request queues", func() bool { return queued() == 1 })
	wg.Go(func() { send(urls[1], "paid", "sk-paid") })
	eventually(t, 10*time.Second, "the paying key's request queues", func() bool { return queued() == 2 })

	var order []string
	for range 2 {
		up.release <- struct{}{} // a holder ends: its slot goes to the head of the queue
		select {
		case who := <-up.arrived:
			order = append(order, who)
		case <-time.After(10 * time.Second):
			t.Fatalf("no waiter got the slot given back (so far %v)", order)
		}
	}
	if strings.Join(order, " ") != "paid free" {
		t.Errorf("waiters served %v, want the paying key first, then the free one", order)
	}
	for range 4 {
		up.release <- struct{}{}
	}
	wg.Wait()
	close(answers)
	for a := range answers {
		if a.status != 200 {
			t.Errorf("%s: %d, want 200", a.who, a.status)
		}
	}
	if most := up.most.Load(); most > 4 {
		t.Errorf("%d requests in flight at once, more than the 4 slots", most)
	}
}

// killedWaiterSite: one slot per key, held 2s, waited for up to 30s.
const killedWaiterSite = `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone killed-waiter
		key {http.request.header.X-Key}
		concurrent gen 1 {
			hold 2s
			max_wait 30s
		}
		redis %s
	}
	reverse_proxy %s
}`

// TestSlotWaiterOfAKilledInstanceLeavesTheQueueWithinAHold: a waiter
// queued on an instance that is then killed stands at the head of the
// queue; the slot given back meanwhile goes to it or its entry expires,
// and within a hold or two the live instance's waiter behind it gets the
// slot: a dead instance's waiters do not block the queue.
func TestSlotWaiterOfAKilledInstanceLeavesTheQueueWithinAHold(t *testing.T) {
	const hold = 2 * time.Second
	srv := redistest.Start(t)
	up := startSlotUpstream(t)
	caddyfile := caddyproc.Caddyfile(fmt.Sprintf(killedWaiterSite, srv.Addr, strings.TrimPrefix(up.URL, "http://")))
	doomed, live := caddyproc.Start(t, caddyfile), caddyproc.Start(t, caddyfile)
	client := caddyClient(t)
	rdb := srv.Client(t)
	get := func(url, who string) {
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		req.Header.Set("X-Key", "k")
		req.Header.Set("X-Who", who)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
		}
	}
	queued := func() int64 {
		keys, _ := rdb.Keys(context.Background(), "*|q").Result()
		var n int64
		for _, k := range keys {
			n += rdb.ZCard(context.Background(), k).Val()
		}
		return n
	}
	go get(live.URL, "holder")
	if who := <-up.arrived; who != "holder" {
		t.Fatalf("%s came first", who)
	}
	go get(doomed.URL, "dead")
	eventually(t, 10*time.Second, "the doomed instance's request queues", func() bool { return queued() == 1 })
	go get(live.URL, "alive")
	eventually(t, 10*time.Second, "the live instance's request queues", func() bool { return queued() == 2 })
	if !doomed.Kill() {
		t.Fatal("could not kill the doomed instance")
	}
	start := time.Now()
	up.release <- struct{}{} // the holder ends
	select {
	case who := <-up.arrived:
		if who != "alive" {
			t.Fatalf("%s got the slot, want the live instance's waiter", who)
		}
		t.Logf("the live waiter got the slot %v after the holder ended", time.Since(start).Round(time.Millisecond))
	case <-time.After(3 * hold):
		t.Fatalf("the live waiter got no slot within %v of the holder's end: the dead waiter blocks the queue", 3*hold)
	}
	if most := up.most.Load(); most > 1 {
		t.Errorf("%d requests in flight at once, more than the 1 slot", most)
	}
}
