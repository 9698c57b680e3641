package ratelimit

// Benchmarks of the handler against a real redis-server (redistest).
//
//	go test -run xxx -bench . -benchmem -count 3 .
//
// Every ServeHTTP benchmark serves requests prepared as Caddy's server
// prepares each one (a new replacer, vars and response header map),
// outside the timer, and times only ServeHTTP: what the handler writes
// into a request's replacer or header map costs what it would in Caddy.
// BenchmarkServeHTTPBypass times the next handler alone (next to
// nothing), so the figures are the limiter's own cost.
// BenchmarkPrepareRequest shows what the skipped preparation would cost,
// for scale.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/calendar"
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	leasepkg "github.com/caddy-redis/ratelimit/internal/lease"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// benchWriter is a ResponseWriter that keeps nothing but the header map
// and the status.
type benchWriter struct {
	h      http.Header
	status int
}

// freshHeader is a new response header map as a handler sees it in
// Caddy: net/http makes an empty one per request and Caddy's server
// sets Server before any handler runs. So the map's first allocation is
// not charged to the limiter, only what its own headers add.
func freshHeader() http.Header {
	return http.Header{"Server": caddyServerHeader}
}

var caddyServerHeader = []string{"Caddy"}

func (w *benchWriter) Header() http.Header         { return w.h }
func (w *benchWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *benchWriter) WriteHeader(status int)      { w.status = status }

// benchRequest is a GET from remoteIP with an X-Key header (if key is not
// empty), prepared as Caddy's server prepares it, with a writer that
// keeps nothing.
func benchRequest(remoteIP, key string) (*http.Request, *benchWriter) {
	w := &benchWriter{h: freshHeader()}
	return prepareRequest(remoteIP, key, w), w
}

// benchHandler provisions a handler keyed by the X-Key header against
// srv, after configure (if any) has had its say.
func benchHandler(b *testing.B, srv *redistest.Server, zone string, rate float64, burst int64, configure ...func(*Handler)) *Handler {
	b.Helper()
	h := &Handler{
		Zone:          zone,
		Key:           "{http.request.header.X-Key}",
		ReplenishRate: tokenbucket.RateParam(rate),
		BurstCapacity: Param(strconv.FormatInt(burst, 10)),
		Redis: &RedisConfig{
			Addresses: []string{srv.Addr},
			// A loaded test machine must not turn a slow reply into a
			// fail-open "allowed" that never reached Redis.
			Timeout: caddy.Duration(2_000_000_000),
		},
	}
	for _, c := range configure {
		c(h)
	}
	provision(b, h)
	// Without a loaded config, caddy.Context.Logger is a development
	// logger at debug level, which would log every decision; a running
	// Caddy's default logger is at info level, and so is this one.
	observeLogs(h, zap.InfoLevel)
	return h
}

// allowedHandler never runs dry: a billion tokens, a billion a second.
func allowedHandler(b *testing.B, srv *redistest.Server) *Handler {
	return benchHandler(b, srv, "bench-allowed", 1e9, 1_000_000_000)
}

// serveOne runs one fresh request and fails the benchmark on an
// unexpected outcome (an error where allowed, no error where denied).
func serveOne(b *testing.B, h *Handler, remoteIP, key string, wantStatus int) {
	r, w := benchRequest(remoteIP, key)
	w.status = http.StatusOK
	err := h.ServeHTTP(w, r, okHandler)
	if got := statusOf(err, w.status); got != wantStatus {
		b.Fatalf("status %d (err %v), want %d", got, err, wantStatus)
	}
}

// freshBatch is how many requests serveFresh prepares at a time, with the
// timer stopped.
const freshBatch = 512

// serveFresh times serve over b.N requests from remoteIP with X-Key key,
// each prepared fresh (outside the timer), and fails the benchmark on an
// unexpected status.
func serveFresh(b *testing.B, remoteIP, key string, wantStatus int, serve func(http.ResponseWriter, *http.Request) error) {
	serveFreshOn(b, &caddyhttp.Server{}, remoteIP, key, wantStatus, serve)
}

// serveFreshOn is serveFresh for requests to srv.
func serveFreshOn(b *testing.B, srv *caddyhttp.Server, remoteIP, key string, wantStatus int, serve func(http.ResponseWriter, *http.Request) error) {
	reqs := make([]*http.Request, freshBatch)
	ws := make([]*benchWriter, freshBatch)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		j := i % freshBatch
		if j == 0 {
			b.StopTimer()
			for k := range reqs {
				ws[k] = &benchWriter{h: freshHeader(), status: http.StatusOK}
				reqs[k] = prepareRequestOn(srv, remoteIP, key, ws[k])
			}
			b.StartTimer()
		}
		err := serve(ws[j], reqs[j])
		if got := statusOf(err, ws[j].status); got != wantStatus {
			b.Fatalf("status %d (err %v), want %d", got, err, wantStatus)
		}
		reqs[j], ws[j] = nil, nil
	}
}

// serveHandler is h.ServeHTTP with okHandler next, for serveFresh.
func serveHandler(h *Handler) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error { return h.ServeHTTP(w, r, okHandler) }
}

// BenchmarkServeHTTPBypass is the baseline: the next handler alone, on
// one request (serveFresh would prepare a billion).
func BenchmarkServeHTTPBypass(b *testing.B) {
	r, w := benchRequest("192.0.2.1", "client-1")
	b.ReportAllocs()
	for b.Loop() {
		if err := okHandler.ServeHTTP(w, r); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkServeHTTPAllowed is one client at a time (no batching): one
// Redis round trip per request.
func BenchmarkServeHTTPAllowed(b *testing.B) {
	srv := redistest.Start(b)
	h := allowedHandler(b, srv)
	serveOne(b, h, "192.0.2.1", "client-1", http.StatusOK) // loads the script
	serveFresh(b, "192.0.2.1", "client-1", http.StatusOK, serveHandler(h))
}

// BenchmarkServeHTTPQuota is BenchmarkServeHTTPAllowed with a monthly
// quota in Europe/Berlin beside the limit (make bench's quota@64): one
// script call over a bucket and a quota.
func BenchmarkServeHTTPQuota(b *testing.B) {
	srv := redistest.Start(b)
	h := benchHandler(b, srv, "bench-quota", 1e9, 1_000_000_000, func(h *Handler) {
		h.Limits = []Limit{{Name: "second"}}
		h.Quotas = []Quota{{Name: "month", Count: "1000000000000", Per: "month", TimeZone: "Europe/Berlin"}}
	})
	serveOne(b, h, "192.0.2.1", "client-1", http.StatusOK)
	serveFresh(b, "192.0.2.1", "client-1", http.StatusOK, serveHandler(h))
}

// BenchmarkServeHTTPQuotaMemory is BenchmarkServeHTTPQuota with store
// memory.
func BenchmarkServeHTTPQuotaMemory(b *testing.B) {
	h := provision(b, &Handler{
		Zone: "bench-quota-memory", Key: "{http.request.header.X-Key}", Store: storeMemory,
		Limits: []Limit{{Name: "second", ReplenishRate: "1000000000", BurstCapacity: "1000000000"}},
		Quotas: []Quota{{Name: "month", Count: "1000000000000", Per: "month", TimeZone: "Europe/Berlin"}},
	})
	observeLogs(h, zap.InfoLevel)
	serveFresh(b, "192.0.2.1", "client-1", http.StatusOK, serveHandler(h))
}

// BenchmarkServeHTTPMemory is BenchmarkServeHTTPAllowed with store memory:
// no Redis at all.
func BenchmarkServeHTTPMemory(b *testing.B) {
	h := provision(b, &Handler{
		Zone: "bench-memory", Key: "{http.request.header.X-Key}", Store: storeMemory,
		ReplenishRate: "1000000000", BurstCapacity: "1000000000",
	})
	observeLogs(h, zap.InfoLevel) // as in benchHandler
	serveFresh(b, "192.0.2.1", "client-1", http.StatusOK, serveHandler(h))
}

// BenchmarkServeHTTPConcurrent is BenchmarkServeHTTPAllowed with
// `concurrent gen 1000` on the same key: a slot taken with the tokens,
// and released before the request returns (issue 23).
func BenchmarkServeHTTPConcurrent(b *testing.B) {
	srv := redistest.Start(b)
	h := benchHandler(b, srv, "bench-concurrent", 1e9, 1_000_000_000, func(h *Handler) {
		h.Concurrent = []Concurrent{{Name: "gen", Slots: "1000"}}
	})
	serveOne(b, h, "192.0.2.1", "client-1", http.StatusOK)
	serveFresh(b, "192.0.2.1", "client-1", http.StatusOK, serveHandler(h))
}

// BenchmarkServeHTTPConcurrentParallel is BenchmarkServeHTTPConcurrent
// with many clients at once, beside the same without the concurrent
// limit: takes and releases go out in shared pipelines, as under load
// (make bench's concurrent@64), and cpu-ns/op is this process's share.
func BenchmarkServeHTTPConcurrentParallel(b *testing.B) {
	for _, slots := range []bool{false, true} {
		b.Run(fmt.Sprintf("slots=%v", slots), func(b *testing.B) {
			srv := redistest.Start(b)
			h := benchHandler(b, srv, "bench-concurrent", 1e9, 1_000_000_000, func(h *Handler) {
				if slots {
					h.Concurrent = []Concurrent{{Name: "gen", Slots: "1000"}}
				}
			})
			serveParallel(b, h, okHandler)
		})
	}
}

// BenchmarkServeHTTPLease is BenchmarkServeHTTPAllowed with `lease 32`:
// most requests are admitted from the lease, without Redis.
func BenchmarkServeHTTPLease(b *testing.B) {
	srv := redistest.Start(b)
	h := benchHandler(b, srv, "bench-lease", 1e9, 1_000_000_000, func(h *Handler) { h.Lease = &Lease{MaxTokens: 32} })
	serveOne(b, h, "192.0.2.1", "client-1", http.StatusOK)
	serveFresh(b, "192.0.2.1", "client-1", http.StatusOK, serveHandler(h))
}

// BenchmarkServeHTTPColdKeys is one client at a time, each request on
// the next of 10,000 keys (make bench's allowed-keys and lease-keys): a
// zone with lease, whose keys are all cold, against the same zone
// without. Both make one call of the plain script per request, and
// allocate alike: nothing is kept for a cold key.
func BenchmarkServeHTTPColdKeys(b *testing.B) {
	for _, lease := range []bool{false, true} {
		b.Run(fmt.Sprintf("lease=%v", lease), func(b *testing.B) {
			srv := redistest.Start(b)
			h := benchHandler(b, srv, "bench-cold", 1e9, 1_000_000_000, func(h *Handler) {
				if lease {
					h.Lease = &Lease{MaxTokens: 32}
				}
			})
			serveOne(b, h, "192.0.2.1", "warm", http.StatusOK) // loads the script
			const keys = 10_000
			reqs := make([]*http.Request, freshBatch)
			ws := make([]*benchWriter, freshBatch)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				j := i % freshBatch
				if j == 0 {
					b.StopTimer()
					for k := range reqs {
						ws[k] = &benchWriter{h: freshHeader(), status: http.StatusOK}
						reqs[k] = prepareRequestOn(&caddyhttp.Server{}, "192.0.2.1", "key-"+strconv.Itoa((i+k)%keys), ws[k])
					}
					b.StartTimer()
				}
				err := h.ServeHTTP(ws[j], reqs[j], okHandler)
				if got := statusOf(err, ws[j].status); got != http.StatusOK {
					b.Fatalf("status %d (err %v)", got, err)
				}
			}
			b.StopTimer()
			if records, _ := srv.Client(b).Keys(context.Background(), "*"+leasepkg.RecordSuffix+"*").Result(); lease && len(records) != 0 {
				b.Errorf("lease records after cold keys only: %v", records)
			}
		})
	}
}

// BenchmarkServeHTTPAllowedParallel is many clients at once, each with its
// own key, so the batcher pipelines. Sub-benchmarks set how many
// goroutines per GOMAXPROCS.
func BenchmarkServeHTTPAllowedParallel(b *testing.B) {
	for _, c := range []struct {
		name    string
		par     int
		metrics bool
	}{{"par=1", 1, true}, {"par=32", 32, true}, {"par=32,metrics=off", 32, false}} {
		b.Run(c.name, func(b *testing.B) {
			srv := redistest.Start(b)
			h := allowedHandler(b, srv)
			if !c.metrics {
				h.metrics = nil // as `metrics off` provisions it
			}
			var next atomic.Int64
			b.SetParallelism(c.par)
			b.ReportAllocs()
			cpu := processCPU()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				n := next.Add(1)
				ip, key := fmt.Sprintf("192.0.2.%d", n%250+1), "client-"+strconv.FormatInt(n, 10)
				for pb.Next() {
					r, w := benchRequest(ip, key) // timed: BenchmarkPrepareRequest's share
					if err := h.ServeHTTP(w, r, okHandler); err != nil {
						b.Errorf("goroutine %d: %v", n, err)
						return
					}
				}
			})
			b.StopTimer()
			// The CPU this process spent per request: the handler, go-redis
			// and the runtime, without the Redis server's share.
			b.ReportMetric(float64(processCPU()-cpu)/float64(b.N), "cpu-ns/op")
		})
	}
}

// processCPU is the user and system CPU time of this process so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// emptiedBucket is a handler and a request whose bucket is empty: burst 1,
// a token every 1000 s, the only token taken and one denial seen.
func emptiedBucket(b *testing.B) *Handler {
	srv := redistest.Start(b)
	h := benchHandler(b, srv, "bench-denied", 0.001, 1)
	serveOne(b, h, "192.0.2.1", "client-1", http.StatusOK)
	serveOne(b, h, "192.0.2.1", "client-1", http.StatusTooManyRequests)
	return h
}

// BenchmarkServeHTTPDenied is one client whose bucket is empty: burst 1,
// a token every 1000 s, and the first request takes the only token. After
// the first denial the handler's deny cache answers, without Redis.
func BenchmarkServeHTTPDenied(b *testing.B) {
	h := emptiedBucket(b)
	serveFresh(b, "192.0.2.1", "client-1", http.StatusTooManyRequests, serveHandler(h))
}

// BenchmarkServeHTTPDeniedRedis is BenchmarkServeHTTPDenied with the
// client's denial dropped from the deny cache before every request, so
// each denial is Redis's answer.
// BenchmarkServeHTTPDeniedErrorRoutes is BenchmarkServeHTTPDenied on a
// server with handle_errors routes: the denial is returned as an error,
// a prebuilt one (prebuiltError).
func BenchmarkServeHTTPDeniedErrorRoutes(b *testing.B) {
	h := emptiedBucket(b)
	srv := &caddyhttp.Server{Errors: &caddyhttp.HTTPErrorConfig{Routes: caddyhttp.RouteList{{}}}}
	serveFreshOn(b, srv, "192.0.2.1", "client-1", http.StatusTooManyRequests, serveHandler(h))
}

// BenchmarkCaddyServerDenied runs denied requests (from the deny cache)
// through the ServeHTTP of a real caddyhttp.Server loaded with
// caddy.Load (rate_limit, then static_response), without and with
// handle_errors routes: what reject saves in Caddy's own error path.
func BenchmarkCaddyServerDenied(b *testing.B) {
	for _, errorRoutes := range []bool{false, true} {
		name := "errors=none"
		if errorRoutes {
			name = "errors=routes"
		}
		b.Run(name, func(b *testing.B) {
			srv := redistest.Start(b)
			server := loadBenchServer(b, srv.Addr, errorRoutes)
			r, err := http.NewRequest(http.MethodGet, "http://example.com/", nil)
			if err != nil {
				b.Fatal(err)
			}
			r.RemoteAddr = "192.0.2.1:1234"
			r.Header.Set("X-Key", "client-1")
			w := &benchWriter{}
			serve := func(want int) {
				w.h, w.status = http.Header{}, http.StatusOK
				server.ServeHTTP(w, r)
				if w.status != want {
					b.Fatalf("status %d, want %d", w.status, want)
				}
			}
			serve(http.StatusOK)              // takes the only token
			serve(http.StatusTooManyRequests) // Redis denies; cached
			b.ReportAllocs()
			for b.Loop() {
				serve(http.StatusTooManyRequests)
			}
		})
	}
}

// loadBenchServer loads a config of one HTTP server on a free loopback
// port and returns that server, provisioned.
func loadBenchServer(b *testing.B, redisAddr string, errorRoutes bool) *caddyhttp.Server {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	server := map[string]any{
		"listen":          []string{"127.0.0.1:" + strconv.Itoa(port)},
		"automatic_https": map[string]any{"disable": true},
		"routes": []any{map[string]any{"handle": []any{
			map[string]any{
				"handler": "rate_limit", "zone": "bench-caddy", "key": "{http.request.header.X-Key}",
				"replenish_rate": 0.001, "burst_capacity": 1,
				"redis": map[string]any{"addresses": []string{redisAddr}, "timeout": "2s"},
			},
			map[string]any{"handler": "static_response", "body": "ok"},
		}}},
	}
	if errorRoutes {
		server["errors"] = map[string]any{"routes": []any{map[string]any{"handle": []any{
			map[string]any{"handler": "static_response", "status_code": "{http.error.status_code}"},
		}}}}
	}
	cfg, err := json.Marshal(map[string]any{
		"admin": map[string]any{"disabled": true, "config": map[string]any{"persist": false}},
		"apps":  map[string]any{"http": map[string]any{"servers": map[string]any{"bench": server}}},
	})
	if err != nil {
		b.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = caddy.Stop() })
	app, err := caddy.ActiveContext().App("http")
	if err != nil {
		b.Fatal(err)
	}
	return app.(*caddyhttp.App).Servers["bench"]
}

func BenchmarkServeHTTPDeniedRedis(b *testing.B) {
	h := emptiedBucket(b)
	key := h.limits[0].KeyPrefix + "client-1" + h.limits[0].KeySuffix
	serveFresh(b, "192.0.2.1", "client-1", http.StatusTooManyRequests, func(w http.ResponseWriter, r *http.Request) error {
		h.denied.Forget(key)
		return h.ServeHTTP(w, r, okHandler)
	})
}

// BenchmarkPrepareRequest is what Caddy's server (here: prepareRequest's
// steps) costs per request before any handler runs, for scale; the
// ServeHTTP benchmarks leave it out.
func BenchmarkPrepareRequest(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		r, _ := benchRequest("192.0.2.1", "client-1")
		_ = r
	}
}

// BenchmarkServeHTTPLeased is BenchmarkServeHTTPAllowedParallel's par=32
// with `lease 32` (most requests admitted from this instance's leases,
// renewed in the background) beside `store memory` (the in-process
// ceiling): cpu-ns/op includes the renewals' calls.
func BenchmarkServeHTTPLeased(b *testing.B) {
	for _, store := range []string{"lease", "memory"} {
		b.Run(store, func(b *testing.B) {
			h := &Handler{Zone: "bench-" + store, Key: "{http.request.header.X-Key}", ReplenishRate: "1e9", BurstCapacity: "1000000000"}
			if store == "memory" {
				h.Store = storeMemory
			} else {
				srv := redistest.Start(b)
				h.Lease = &Lease{MaxTokens: 32}
				h.Redis = &RedisConfig{Addresses: []string{srv.Addr}, Timeout: caddy.Duration(2 * time.Second)}
			}
			serveParallel(b, provision(b, h), okHandler)
		})
	}
}

// serveParallel serves requests through h from 32 goroutines per
// GOMAXPROCS, each a client with its own key, every request's headers
// fresh (outside the timer's share that matters: a map), and reports
// this process's CPU per request: the handler, go-redis, the runtime and
// whatever h's calls run in the background. Each request must pass.
func serveParallel(b *testing.B, h *Handler, next caddyhttp.Handler) {
	observeLogs(h, zap.InfoLevel)
	var clients atomic.Int64
	b.SetParallelism(32)
	b.ReportAllocs()
	cpu := processCPU()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		n := clients.Add(1)
		r, w := benchRequest(fmt.Sprintf("192.0.2.%d", n%250+1), "client-"+strconv.FormatInt(n, 10))
		for pb.Next() {
			w.h = freshHeader()
			if err := h.ServeHTTP(w, r, next); err != nil || w.status != http.StatusOK && w.status != 0 {
				b.Errorf("goroutine %d: %v %d", n, err, w.status)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric(float64(processCPU()-cpu)/float64(b.N), "cpu-ns/op")
}

// BenchmarkScriptsRedisCPU is what Redis spends per request on the
// scripts alone, as make bench's allowed@64 and concurrent@64 send them:
// batches of 16 takes over 64 keys and, with slots, at the head of each
// batch one release of the previous batch's slots; quota: a daily quota
// beside each bucket. redis-us/op is Redis's CPU per request (INFO cpu);
// -v logs its command statistics.
func BenchmarkScriptsRedisCPU(b *testing.B) {
	day, err := calendar.New("day", "", 0, "")
	if err != nil {
		b.Fatal(err)
	}
	for _, kind := range []string{"slots=false", "slots=true", "quota"} {
		slots := kind == "slots=true"
		b.Run(kind, func(b *testing.B) {
			srv := redistest.Start(b)
			ctx := context.Background()
			rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
			defer rdb.Close()
			for _, s := range []*redisbatch.Script{takeScript, concurrentScript} {
				if err := rdb.ScriptLoad(ctx, s.Source).Err(); err != nil {
					b.Fatal(err)
				}
			}
			const batch, keys = 16, 64
			var prev []any
			counter := 0
			cpu := func() float64 {
				info := rdb.Info(ctx, "cpu").Val()
				var total float64
				for _, line := range strings.Split(info, "\r\n") {
					if k, v, ok := strings.Cut(line, ":"); ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
						f, _ := strconv.ParseFloat(v, 64)
						total += f
					}
				}
				return total
			}
			rdb.ConfigResetStat(ctx)
			start := cpu()
			b.ResetTimer()
			for done := 0; done < b.N; done += batch {
				pipe := rdb.Pipeline()
				if prev != nil {
					pipe.EvalSha(ctx, concurrentScript.SHA(), prev[0].([]string), append([]any{"release"}, prev[1:]...)...)
				}
				var rel []any
				var relKeys []string
				for i := range batch {
					k := (done + i) % keys
					bucket := "rate_limit:b|" + strconv.Itoa(k)
					args := []any{"1000000000", "1000000000", "1"}
					ks := []string{bucket}
					if slots {
						counter++
						id := "0123456789abcdef:" + strconv.FormatInt(int64(counter), 36)
						ks = append(ks, "rate_limit:{b|"+strconv.Itoa(k)+"}|gen|slots")
						args = append(args, "c", "1000", id, "30000000")
						relKeys = append(relKeys, ks[1])
						rel = append(rel, id)
					}
					if kind == "quota" {
						bounds := day.Bounds(time.Now())
						ks = append(ks, "rate_limit:{b|"+strconv.Itoa(k)+"}|day")
						args = append(args, "q", "1000000000", "1", bounds[0], bounds[1], bounds[2], bounds[3])
					}
					pipe.EvalSha(ctx, takeScript.SHA(), ks, args...)
				}
				if _, err := pipe.Exec(ctx); err != nil {
					b.Fatal(err)
				}
				prev = nil
				if slots {
					prev = append([]any{relKeys}, rel...)
				}
			}
			b.StopTimer()
			b.ReportMetric((cpu()-start)*1e6/float64(b.N), "redis-us/op")
			if testing.Verbose() {
				for _, line := range strings.Split(rdb.Info(ctx, "commandstats").Val(), "\r\n") {
					if strings.HasPrefix(line, "cmdstat_") {
						b.Log(line)
					}
				}
			}
		})
	}
}
