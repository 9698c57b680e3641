package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// reloadSite keeps the zone and the limits; only the body changes
// between the two configurations. on_error deny, so a Redis failure
// during a reload shows up as a 503.
const reloadSite = `
http://127.0.0.1:{{http_port}} {
	rate_limit 0.01 2 {
		zone reload
		key {http.request.header.X-Key}
		on_error deny
		redis {
			address %s
			timeout 5s
			dial_timeout %s
		}
	}
	respond "%s"
}`

// droppedConnection says whether a request failed because the server
// closed or reset the connection (or refused it) before any response:
// not a timeout.
func droppedConnection(err error) bool {
	return err != nil && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNREFUSED))
}

// clientCount is how many clients Redis has, besides the one asking.
func clientCount(t *testing.T, rdb *redis.Client) int {
	t.Helper()
	list, err := rdb.ClientList(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(strings.TrimSpace(list), "\n") // lines minus our own
}

func TestReloadsUnderLoadKeepBucketsAndConnections(t *testing.T) {
	// With the same Redis settings every configuration shares one client;
	// with another dial_timeout each reload makes a new client, and the
	// old one must be closed, but only once the old configuration's
	// requests are done (see TestRequestAfterCleanupStillLimited).
	t.Run("same redis settings", func(t *testing.T) { reloadUnderLoad(t, "1s", "1s") })
	t.Run("redis settings change", func(t *testing.T) { reloadUnderLoad(t, "1s", "900ms") })
}

func reloadUnderLoad(t *testing.T, dialTimeoutOne, dialTimeoutTwo string) {
	srv := redistest.Start(t)
	configs := []string{
		caddyproc.Caddyfile(fmt.Sprintf(reloadSite, srv.Addr, dialTimeoutOne, "one")),
		caddyproc.Caddyfile(fmt.Sprintf(reloadSite, srv.Addr, dialTimeoutTwo, "two")),
	}
	inst := caddyproc.Start(t, configs[0])
	client := caddyClient(t)
	client.Timeout = 3 * time.Second // requests take milliseconds; a hang is a failure
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 1})
	t.Cleanup(func() { rdb.Close() })

	// A client that used its burst before the reloads.
	expectCaddyBurstThenDeny(t, client, inst.URL, "held", 2)

	// Clients send continuously, each request on a fresh key: every one
	// must be admitted with one of the two bodies. A connection that Caddy
	// drops without any response is tried again once, as browsers and
	// proxies do: on Linux a reload swaps SO_REUSEPORT listening sockets,
	// and connections still queued on the old one are reset, with or
	// without this module (a plain `respond` site loses them alike).
	var (
		stop                 = make(chan struct{})
		wg                   sync.WaitGroup
		sent, failed, resets atomic.Int64
		bodies               sync.Map
	)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("c%d-%d", g, i)
				status, remaining, body, err := caddyGet(client, inst.URL, key)
				sent.Add(1)
				if droppedConnection(err) {
					resets.Add(1)
					status, remaining, body, err = caddyGet(client, inst.URL, key)
					if remaining == "0" {
						remaining = "1" // the lost attempt may have taken its token
					}
				}
				if err != nil || status != 200 || remaining != "1" || (body != "one" && body != "two") {
					if failed.Add(1) <= 5 {
						t.Errorf("key %s: status %d remaining %q body %q err %v; want 200 with 1", key, status, remaining, body, err)
					}
					continue
				}
				bodies.Store(body, true)
			}
		}()
	}
	t.Cleanup(func() {
		select {
		case <-stop:
		default:
			close(stop)
			wg.Wait()
		}
	})

	time.Sleep(500 * time.Millisecond) // the pool reaches its working size
	before := clientCount(t, rdb)
	start := time.Now()
	for i := 1; i <= 20; i++ {
		inst.Reload(t, configs[i%2])
		time.Sleep(50 * time.Millisecond)
	}
	reloading := time.Since(start)
	// Old configurations finish their requests, then their clients close.
	var after int
	settled := eventually(t, 10*time.Second, "Redis clients back to their number before the reloads", func() bool {
		after = clientCount(t, rdb)
		return after <= before+2
	})
	close(stop)
	wg.Wait()

	t.Logf("20 reloads in %v under load: %d requests, %d failed, %d connections reset by the listener swap and retried; "+
		"Redis clients %d before, %d after (%v after the last reload)", reloading.Round(time.Millisecond),
		sent.Load(), failed.Load(), resets.Load(), before, after, settled.Round(time.Millisecond))
	if _, ok := bodies.Load("one"); !ok {
		t.Error("no response from the first configuration")
	}
	if _, ok := bodies.Load("two"); !ok {
		t.Error("no response from the reloaded configuration")
	}
	// The bucket outlived twenty configurations.
	if status, remaining := mustGet(t, client, inst.URL, "held"); status != 429 || remaining != "0" {
		t.Errorf("the client that used its burst before the reloads: %d remaining %q, want 429 with 0", status, remaining)
	}
}

// On a reload Caddy cleans up the old configuration's modules as soon as
// its servers begin their graceful shutdown: caddyhttp.App.Stop waits for
// the shutdown only when the process exits. So requests the old server
// is still finishing can reach the handler after its Cleanup; they must
// still be limited, not wait out the timeout on a stopped client (and
// follow on_error: remaining -1).
func TestRequestAfterCleanupStillLimited(t *testing.T) {
	srv := redistest.Start(t)
	// A key_prefix of its own: this handler's Redis client is not shared.
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit 0.01 2 {
	zone cleanup
	key {http.request.header.X-Key}
	redis %s {
		key_prefix cleanup-test:
	}
}`, srv.Addr))
	if status, remaining, _ := hit(h, "before"); status != 200 || remaining != "1" {
		t.Fatalf("before Cleanup: %d remaining %q, want 200 with 1", status, remaining)
	}
	if err := h.Cleanup(); err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		status    int
		remaining string
		took      time.Duration
	}
	done := make(chan outcome, 1)
	go func() {
		status, remaining, took := hit(h, "after")
		done <- outcome{status, remaining, took}
	}()
	select {
	case o := <-done:
		if o.status != 200 || o.remaining != "1" {
			t.Fatalf("a request of the old configuration after its Cleanup: %d remaining %q in %v, want 200 with 1 from Redis",
				o.status, o.remaining, o.took)
		}
	case <-time.After(2 * testRedisTimeout):
		t.Fatalf("a request of the old configuration after its Cleanup still waits after %v (timeout %v)", 2*testRedisTimeout, testRedisTimeout)
	}
}
