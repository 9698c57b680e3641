package ratelimit

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// expectAtMostOneTake reads the buckets of keys straight from the
// servers: each holds burst-1 tokens (its one request ran) or does not
// exist (it never reached Redis). It returns how many ran.
func expectAtMostOneTake(t *testing.T, servers []*redistest.Server, h *Handler, keys []string, burst int64) int {
	t.Helper()
	ran := 0
	for _, key := range keys {
		var state string
		for _, s := range servers {
			v, err := s.Client(t).Get(context.Background(), h.limits[0].KeyPrefix+key).Result()
			if err == nil {
				state = v
				break
			}
		}
		if state == "" {
			continue
		}
		tokens, err := strconv.ParseFloat(strings.Fields(state)[0], 64)
		if err != nil {
			t.Fatalf("bucket %s holds %q", key, state)
		}
		// A request that ran once took one token; refill at 0.001/s in
		// the test's seconds adds less than 0.1.
		if tokens < float64(burst-1) || tokens > float64(burst-1)+0.1 {
			t.Errorf("bucket %s holds %v tokens after one request: %d takes, want exactly one", key, tokens, int64(float64(burst)-tokens+0.5))
		}
		ran++
	}
	return ran
}

// cutRequests sends a request through the handler (a call alone), then
// 40 at once, each on its own key, which the batcher sends in pipelines
// of several calls (those that arrive while a pipeline is in flight go
// together), through proxies that cut every connection after
// forwarding. Each must fail, to follow on_error.
func cutRequests(t *testing.T, h *Handler, proxies []*redisProxy) []string {
	t.Helper()
	for _, p := range proxies {
		p.cutting.Store(true)
	}
	defer func() {
		for _, p := range proxies {
			p.cutting.Store(false)
		}
	}()
	keys := []string{"alone"}
	if status, remaining, _ := hit(h, "alone"); status != 200 || remaining != "-1" {
		t.Errorf("request alone through a cut connection: %d remaining %q, want on_error allow", status, remaining)
	}
	var wg sync.WaitGroup
	for i := range 40 {
		key := "batched-" + strconv.Itoa(i)
		keys = append(keys, key)
		wg.Go(func() {
			if status, remaining, _ := hit(h, key); status != 200 || remaining != "-1" {
				t.Errorf("request %s through a cut connection: %d remaining %q, want on_error allow", key, status, remaining)
			}
		})
	}
	wg.Wait()
	return keys
}

const atMostOnceDirective = `rate_limit 0.001 5 {
	zone once
	key {http.request.header.X-Key}
	redis {
		address %s
		timeout 1s
	}
}`

func TestScriptCallRunsAtMostOnceStandalone(t *testing.T) {
	srv := redistest.Start(t)
	proxy := startRedisProxy(t, srv.Addr)
	h := caddyfileHandler(t, fmt.Sprintf(atMostOnceDirective, proxy.addr))
	expectBurstThenDeny(t, h, "warm-up", 5) // the script is loaded, connections open

	keys := cutRequests(t, h, []*redisProxy{proxy})
	ran := expectAtMostOneTake(t, []*redistest.Server{srv}, h, keys, 5)
	t.Logf("%d of %d requests reached Redis before their connection was cut", ran, len(keys))
	if ran == 0 {
		t.Fatal("no request reached Redis: the proxy cut too early to test anything")
	}
}

func TestScriptCallRunsAtMostOnceCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	// Each master announces its proxy's port, so the cluster client
	// reaches every master through a proxy of the test's.
	var proxies []*redisProxy
	var seeds []string
	for _, m := range c.Masters {
		p := startRedisProxy(t, m.Addr)
		proxies = append(proxies, p)
		seeds = append(seeds, p.addr)
		_, port, _ := net.SplitHostPort(p.addr)
		if err := m.Client(t).ConfigSet(ctx, "cluster-announce-port", port).Err(); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "every master announces its proxy's port", func() bool {
		for _, m := range c.Masters {
			slots, err := m.Client(t).ClusterSlots(ctx).Result()
			if err != nil {
				return false
			}
			for _, s := range slots {
				for _, n := range s.Nodes {
					if !slices.Contains(seeds, n.Addr) {
						return false
					}
				}
			}
		}
		return true
	})
	h := caddyfileHandler(t, fmt.Sprintf(atMostOnceDirective, strings.Join(seeds, " ")))
	for i := range 30 { // keys on every master: the script is loaded on each
		expectBurstThenDeny(t, h, "warm-up-"+strconv.Itoa(i), 5)
	}

	keys := cutRequests(t, h, proxies)
	ran := expectAtMostOneTake(t, c.Masters, h, keys, 5)
	t.Logf("%d of %d requests reached Redis before their connection was cut", ran, len(keys))
	if ran == 0 {
		t.Fatal("no request reached Redis: the proxy cut too early to test anything")
	}
}
