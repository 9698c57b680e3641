package ratelimit

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// sharedBudgetSite limits every instance's requests on one key with the
// same zone. on_error deny with a long timeout: a Redis failure is a
// 503, never an admission that would blur the count.
const sharedBudgetSite = `
http://127.0.0.1:{{http_port}} {
	rate_limit %v %d {
		zone shared
		key {http.request.header.X-Key}
		on_error deny
		redis {
			address %s
			timeout 5s
		}
	}
	respond "ok"
}`

// expectSharedBudget starts three Caddy processes on the same Redis and
// sends from 64 clients, round robin over them, on one key for about
// four seconds: together they admit at most burst + rate*T, and not much
// less.
func expectSharedBudget(t *testing.T, redisAddrs ...string) {
	const (
		rate      = 200.0
		burst     = 200
		instances = 3
		clients   = 64
		duration  = 4 * time.Second
	)
	site := caddyproc.Caddyfile(fmt.Sprintf(sharedBudgetSite, rate, burst, strings.Join(redisAddrs, " ")))
	var urls []string
	for range instances {
		urls = append(urls, caddyproc.Start(t, site).URL)
	}
	client := caddyClient(t)
	// Warm the connections (and Redis clients) up on another key.
	for _, u := range urls {
		for range 4 {
			mustGet(t, client, u, "warm")
		}
	}

	var (
		next, admitted, denied, failed atomic.Int64
		lastResponse                   atomic.Int64
		wg                             sync.WaitGroup
	)
	start := time.Now()
	stop := start.Add(duration)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				url := urls[next.Add(1)%instances]
				status, remaining, _, err := caddyGet(client, url, "one")
				now := int64(time.Since(start))
				for {
					last := lastResponse.Load()
					if now <= last || lastResponse.CompareAndSwap(last, now) {
						break
					}
				}
				switch {
				case err != nil:
					if failed.Add(1) <= 5 {
						t.Errorf("GET %s: %v", url, err)
					}
				case status == 200 && remaining != "-1":
					admitted.Add(1)
				case status == 429:
					denied.Add(1)
				default:
					if failed.Add(1) <= 5 {
						t.Errorf("GET %s: %d remaining %q, want 200 or 429", url, status, remaining)
					}
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Duration(lastResponse.Load())
	bound := burst + rate*elapsed.Seconds()
	sent := admitted.Load() + denied.Load() + failed.Load()
	ratio := float64(admitted.Load()) / bound
	t.Logf("%d instances, %d clients: %d requests in %v (%.0f/s), %d admitted, %d denied, %d failed; "+
		"bound burst + rate*T = %.1f; admitted/bound = %.3f",
		instances, clients, sent, elapsed.Round(time.Millisecond), float64(sent)/elapsed.Seconds(),
		admitted.Load(), denied.Load(), failed.Load(), bound, ratio)
	if float64(admitted.Load()) > bound {
		t.Errorf("admitted %d, more than burst + rate*T = %.1f: the instances do not share one budget", admitted.Load(), bound)
	}
	if ratio < 0.9 {
		t.Errorf("admitted %d, less than 0.9 of burst + rate*T = %.1f: clients are starved", admitted.Load(), bound)
	}
}

func TestInstancesShareOneBudget(t *testing.T) {
	t.Run("single Redis", func(t *testing.T) {
		srv := redistest.Start(t)
		expectSharedBudget(t, srv.Addr)
	})
	t.Run("cluster", func(t *testing.T) {
		c := redistest.StartCluster(t, 3, 0)
		var masters []string
		for _, m := range c.Masters {
			masters = append(masters, m.Addr)
		}
		expectSharedBudget(t, masters...)
	})
}
