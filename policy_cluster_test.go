package ratelimit

// Policies on Redis Cluster: limits with different key templates live in
// different hash slots, taken group by group with give-back; limits with
// one template share a slot and one script call.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zapcore"
)

// clusterScriptCalls counts the script calls all masters served.
func clusterScriptCalls(t *testing.T, clients []*redis.Client) int64 {
	t.Helper()
	var n int64
	for _, rdb := range clients {
		n += redistest.ScriptCalls(t, rdb)
	}
	return n
}

// masterClients are a client per master, in c.Masters' order.
func masterClients(t *testing.T, c *redistest.Cluster) []*redis.Client {
	t.Helper()
	clients := make([]*redis.Client, len(c.Masters))
	for i, m := range c.Masters {
		clients[i] = m.Client(t)
	}
	return clients
}

// masterOf is the client of the master that holds key.
func masterOf(t *testing.T, c *redistest.Cluster, cc *redis.ClusterClient, clients []*redis.Client, key string) *redis.Client {
	t.Helper()
	m, err := cc.MasterForKey(context.Background(), key)
	if err != nil {
		t.Fatalf("the master of %s: %v", key, err)
	}
	for i, s := range c.Masters {
		if s.Addr == m.Options().Addr {
			return clients[i]
		}
	}
	t.Fatalf("the master of %s is %s, not one of the cluster's", key, m.Options().Addr)
	return nil
}

// TestPolicyOnCluster runs the Cluster behaviours of policies on one
// Cluster of three masters (starting one takes about two seconds); each
// subtest has zones of its own.
func TestPolicyOnCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	cc := c.Client(t)
	clients := masterClients(t, c)
	t.Run("all or nothing under concurrency, with give-back", func(t *testing.T) {
		testClusterAllOrNothingWithGiveBack(t, c, cc, clients)
	})
	t.Run("a refusal by any of three slot groups takes nothing", func(t *testing.T) {
		testClusterRefusalByAnyLimitTakesNothing(t, c, cc)
	})
	t.Run("one key template is one slot and one script call", func(t *testing.T) {
		testClusterOneKeyTemplateOneSlotOneScriptCall(t, c, cc, clients)
	})
	t.Run("give-back happens even when the client left", func(t *testing.T) {
		testClusterGiveBackHappensEvenWhenTheClientLeft(t, c, cc, clients)
	})
}

// testClusterAllOrNothingWithGiveBack: on a Cluster, a policy
// whose limits have two key templates (client and tenant) is taken in two
// slot groups. Under concurrency no limit admits beyond its bound, and
// every token a client's buckets gave to a request the tenant then
// refused came back: the slow day buckets hold exactly their burst less
// what was admitted. Then, one request at a time: a refusal by a later
// group gives the earlier groups' buckets back what they gave, read from
// the masters that hold them, costing exactly three script calls (take,
// take refused, give back).
func testClusterAllOrNothingWithGiveBack(t *testing.T, c *redistest.Cluster, cc *redis.ClusterClient, clients []*redis.Client) {
	h := caddyfileHandler(t, fmt.Sprintf(allOrNothingDirective, "caon", strings.Join(c.Addrs, " ")))
	if len(h.groups) != 2 || h.useDenyCache {
		t.Fatalf("%d slot groups, deny cache %v; want 2 groups (client, tenant) and no deny cache", len(h.groups), h.useDenyCache)
	}
	runAllOrNothing(t, h, cc, cc)

	t.Run("a later group's refusal gives back", func(t *testing.T) {
		// The tenant holds 2 and refills one token in 100 s: two fresh
		// clients get through, then the tenant refuses.
		h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone cgive
	key {http.request.header.X-Key}
	limit second 5 5
	limit day 1000/1d 1000
	limit tenant 0.01 2 {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		timeout 2s
	}
}`, strings.Join(c.Addrs, " ")))
		// Clients whose buckets live on another master than the tenant's.
		tenant := "tg"
		tenantMaster := masterOf(t, c, cc, clients, limitKey(t, h, "tenant", tenant))
		var fresh []string
		for i := 0; len(fresh) < 6; i++ {
			key := "g" + strconv.Itoa(i)
			if masterOf(t, c, cc, clients, limitKey(t, h, "second", key)) != tenantMaster {
				fresh = append(fresh, key)
			}
		}
		for i, key := range fresh {
			before := clusterScriptCalls(t, clients)
			a := servePolicy(h, "X-Key", key, "X-Tenant", tenant)
			calls := clusterScriptCalls(t, clients) - before
			secondKey, dayKey := limitKey(t, h, "second", key), limitKey(t, h, "day", key)
			second := readBucket(t, masterOf(t, c, cc, clients, secondKey), secondKey)
			day := readBucket(t, masterOf(t, c, cc, clients, dayKey), dayKey)
			if i < 2 {
				if a.status != 200 || calls != 2 {
					t.Errorf("%s (fresh, the tenant holds %d): %v with %d script calls, want 200 with 2 (one per group)", key, 2-i, a, calls)
				}
				if second.tokens != 4 || day.tokens != 999 {
					t.Errorf("%s admitted: second holds %v, day %v; want 4 and 999", key, second.tokens, day.tokens)
				}
				continue
			}
			if a.status != 429 || a.limitName() != "tenant" {
				t.Fatalf("%s (fresh, the tenant drained): %v, want 429 by the tenant", key, a)
			}
			if calls != 3 {
				t.Errorf("%s refused by the tenant with %d script calls, want 3 (take, take refused, give back)", key, calls)
			}
			// The take wrote the buckets, the give-back filled them again:
			// present, and full.
			if !second.present || second.tokens != 5 || !day.present || day.tokens != 1000 {
				t.Errorf("%s refused by the tenant: second %+v, day %+v; want both given back, full (5 and 1000)", key, second, day)
			}
			if a.remaining() != "0" || a.header.Get("X-RateLimit-Burst-Capacity") != "2" {
				t.Errorf("%s refused by the tenant: X-RateLimit-Remaining %q, Burst-Capacity %q; want the tenant's 0 and 2",
					key, a.remaining(), a.header.Get("X-RateLimit-Burst-Capacity"))
			}
		}
	})
}

// testClusterRefusalByAnyLimitTakesNothing: with three key
// templates, three slot groups; whichever group refuses (the first
// directly, the second or third after the earlier ones took and gave
// back), the request's buckets end as if it never came.
func testClusterRefusalByAnyLimitTakesNothing(t *testing.T, c *redistest.Cluster, cc *redis.ClusterClient) {
	h := caddyfileHandler(t, fmt.Sprintf(refusalPolicy, "cuntouched", strings.Join(c.Addrs, " ")))
	if len(h.groups) != 3 {
		t.Fatalf("%d slot groups, want 3", len(h.groups))
	}
	logs := observeLogs(h, zapcore.WarnLevel)
	expectRefusalsTakeNothing(t, h, cc)
	for _, e := range logs.All() {
		t.Errorf("warning: %s %v", e.Message, e.ContextMap())
	}
}

// testClusterOneKeyTemplateOneSlotOneScriptCall: limits with the
// same key template but different names have their buckets in one hash
// slot, as `<key_prefix>{<zone>|<tag>|<client key>}|<name>`, and a
// request costs one script call; a limit with another template adds a
// slot group, and a call.
func testClusterOneKeyTemplateOneSlotOneScriptCall(t *testing.T, c *redistest.Cluster, cc *redis.ClusterClient, clients []*redis.Client) {
	ctx := context.Background()
	addrs := strings.Join(c.Addrs, " ")
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone oneslot
	key {http.request.header.X-Key}
	limit second 10 20
	limit minute 100/1m 100
	limit hour 1000/1h 1000
	redis %s
}`, addrs))
	if h.groups != nil || !h.useDenyCache {
		t.Fatalf("%d slot groups, deny cache %v; want one group (no group-by-group taking) and the deny cache", len(h.groups), h.useDenyCache)
	}
	tag := keys.BucketPrefix(defaultKeyPrefix, "oneslot", "{http.request.header.X-Key}")[len(defaultKeyPrefix+"oneslot|"):]
	for i := range 5 {
		client := "k" + strconv.Itoa(i)
		buckets := policyBuckets(t, h, "X-Key", client)
		var slots []int64
		for _, name := range []string{"second", "minute", "hour"} {
			want := defaultKeyPrefix + "{oneslot|" + tag + client + "}|" + name
			if buckets[name].Key != want {
				t.Fatalf("limit %s's key %q, want %q", name, buckets[name].Key, want)
			}
			slot, err := cc.ClusterKeySlot(ctx, want).Result()
			if err != nil {
				t.Fatal(err)
			}
			slots = append(slots, slot)
		}
		if slots[0] != slots[1] || slots[0] != slots[2] {
			t.Fatalf("client %s: the buckets are in slots %v, want one", client, slots)
		}
	}

	// Ten requests of five clients: ten calls, each taking three buckets.
	start := time.Now()
	before := clusterScriptCalls(t, clients)
	for i := range 10 {
		if a := servePolicy(h, "X-Key", "k"+strconv.Itoa(i%5)); a.status != 200 {
			t.Fatalf("request %d: %v", i, a)
		}
	}
	if calls := clusterScriptCalls(t, clients) - before; calls != 10 {
		t.Errorf("10 requests cost %d script calls, want 10", calls)
	}
	elapsed := time.Since(start).Seconds()
	for i := range 5 {
		client := "k" + strconv.Itoa(i)
		for name, l := range map[string]struct{ rate, burst float64 }{"second": {10, 20}, "minute": {100.0 / 60, 100}, "hour": {1000.0 / 3600, 1000}} {
			key := limitKey(t, h, name, client)
			b := readBucket(t, masterOf(t, c, cc, clients, key), key)
			if !b.present || b.tokens < l.burst-2 || b.tokens > l.burst-2+l.rate*elapsed {
				t.Errorf("client %s, limit %s: %+v, want %v tokens (two taken) plus at most %.3f refilled", client, name, b, l.burst-2, l.rate*elapsed)
			}
		}
	}

	// A limit with another template: two groups, two calls per request.
	two := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone twoslots
	key {http.request.header.X-Key}
	limit second 10 20
	limit hour 1000/1h 1000
	limit tenant 100 100 {
		key {http.request.header.X-Tenant}
	}
	redis %s
}`, addrs))
	if len(two.groups) != 2 {
		t.Fatalf("with a tenant limit: %d slot groups, want 2", len(two.groups))
	}
	before = clusterScriptCalls(t, clients)
	for i := range 5 {
		if a := servePolicy(two, "X-Key", "k"+strconv.Itoa(i), "X-Tenant", "t"); a.status != 200 {
			t.Fatalf("request %d: %v", i, a)
		}
	}
	if calls := clusterScriptCalls(t, clients) - before; calls != 10 {
		t.Errorf("5 requests over two slot groups cost %d script calls, want 10", calls)
	}
}

// testClusterGiveBackHappensEvenWhenTheClientLeft: the client of
// a request goes away while a later slot group's call is in flight (its
// master is busy); that group refuses, and the earlier group's tokens
// must still come back: the request was not admitted, so it may take
// nothing, whether or not its client waited for the answer.
func testClusterGiveBackHappensEvenWhenTheClientLeft(t *testing.T, c *redistest.Cluster, cc *redis.ClusterClient, clients []*redis.Client) {
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone leave
	key {http.request.header.X-Key}
	limit client 0.01 5
	limit tenant 0.01 1 {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		timeout 3s
	}
}`, strings.Join(c.Addrs, " ")))
	if len(h.groups) != 2 {
		t.Fatalf("%d slot groups, want 2", len(h.groups))
	}
	tenantMaster := masterOf(t, c, cc, clients, limitKey(t, h, "tenant", "t"))
	var keys []string // clients whose buckets live on another master
	for i := 0; len(keys) < 2; i++ {
		key := "c" + strconv.Itoa(i)
		if masterOf(t, c, cc, clients, limitKey(t, h, "client", key)) != tenantMaster {
			keys = append(keys, key)
		}
	}
	fullNow := func(key string) float64 {
		k := limitKey(t, h, "client", key)
		rdb := masterOf(t, c, cc, clients, k)
		return scriptRefill(readBucket(t, rdb, k), redisNow(t, rdb), 0.01, 5)
	}

	// The tenant's one token goes to another client.
	if a := servePolicy(h, "X-Key", "drain", "X-Tenant", "t"); a.status != 200 {
		t.Fatalf("draining the tenant: %v", a)
	}
	// A client that waits: refused by the tenant, its token given back.
	if a := servePolicy(h, "X-Key", keys[0], "X-Tenant", "t"); a.status != 429 || a.limitName() != "tenant" {
		t.Fatalf("%s: %v, want 429 by the tenant", keys[0], a)
	}
	if tokens := fullNow(keys[0]); tokens < 5-1e-6 {
		t.Fatalf("%s, refused by the tenant: its client bucket holds %.4f, want 5 (given back)", keys[0], tokens)
	}

	// A client that leaves while the tenant's master sleeps on its call.
	slept := make(chan error, 1)
	go func() { slept <- tenantMaster.Do(context.Background(), "debug", "sleep", "0.5").Err() }()
	time.Sleep(50 * time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(150*time.Millisecond, cancel)
	r, w := policyRequest("X-Key", keys[1], "X-Tenant", "t")
	r = r.WithContext(mergeCancel(r.Context(), ctx))
	err := h.ServeHTTP(w, r, okHandler)
	if err := <-slept; err != nil {
		t.Fatalf("DEBUG SLEEP: %v", err)
	}
	if ctx.Err() == nil {
		t.Fatalf("the request was answered (%d, %v) before its client left: the test did not test what it should", w.Code, err)
	}
	// Give the limiter a moment, should it give back later.
	time.Sleep(200 * time.Millisecond)
	if tokens := fullNow(keys[1]); tokens < 5-1e-6 {
		t.Errorf("%s left before the tenant refused: its client bucket holds %.4f tokens, want 5: "+
			"the tokens its refused request took were not given back", keys[1], tokens)
	}
}

// On a Cluster, a request refused by a later slot group gets back what an
// earlier group took: that group's bucket then holds its tokens again, so
// it neither sets Retry-After (its wait after the take) nor is the bucket
// the headers describe as refusing.
func TestClusterGivenBackGroupDoesNotSetRetryAfter(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	h := quotaHandler(t, `rate_limit {
	zone giveback_retry
	key {http.request.header.X-Key}
	headers both
	limit client 0.0166 1
	limit tenant 1 1 {
		key {http.request.header.X-Tenant}
	}
	redis %s {
		cluster
		timeout 2s
	}
}`, c.Masters[0].Addr)
	if len(h.groups) != 2 {
		t.Fatalf("%d slot groups, want 2", len(h.groups))
	}
	if a := servePolicy(h, "X-Key", "a", "X-Tenant", "t1"); a.status != 200 {
		t.Fatalf("first request: %d", a.status)
	}
	// Client b's bucket takes its one token (a minute to refill), then
	// tenant t1 refuses (a second to refill): b gets its token back.
	a := servePolicy(h, "X-Key", "b", "X-Tenant", "t1")
	if a.status != 429 {
		t.Fatalf("second request: %d, want 429 from the tenant", a.status)
	}
	if got := a.header.Get("Retry-After"); got != "1" {
		t.Errorf("Retry-After %q, want \"1\" (the tenant's wait; client b's token was given back)", got)
	}
}
