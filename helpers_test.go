package ratelimit

// The helpers shared by the package's tests, in one place. A helper that
// serves the tests of one file only (metrics scrapes, failover traffic,
// the benchmarks' writer) stays beside them.
//
// Two tiers: `go test -short` runs what needs no process (the parser,
// key templates, headers, the deny cache, the bucket's arithmetic, and
// handlers provisioned against deadRedis); everything else starts
// redis-server (internal/redistest) or a Caddy (caddytest through
// loadConfig, or internal/caddyproc), and those entry points skip the
// test under -short (testproc.SkipShort). No test calls testing.Short()
// itself.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisstore"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/testproc"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// ---- The Redis timeout of the tests

// testRedisTimeout is the Redis timeout of every handler that the tests
// provision, load into caddytest or run in a Caddy process, whose config
// sets none. On a loaded two-core machine under -race a round trip can
// take longer than the 100 ms default, and its request then follows
// on_error, where a test asserts what Redis decided. A test of what
// happens when Redis is slow sets its own timeout.
const testRedisTimeout = 5 * time.Second

func init() {
	caddyproc.Rewrite = withTestRedisTimeout
	caddytest.Default.AdminPort = caddytestPorts.admin
}

// withTestRedisTimeout gives each `redis` directive of a Caddyfile that
// sets no timeout testRedisTimeout: `redis <addr>` gets a block, and a
// block without a `timeout` line gets one.
func withTestRedisTimeout(caddyfile string) string {
	lines := strings.Split(caddyfile, "\n")
	out := make([]string, 0, len(lines))
	timeout := "timeout " + testRedisTimeout.String()
	for i, line := range lines {
		fields := strings.Fields(line)
		if len(fields) == 0 || fields[0] != "redis" {
			out = append(out, line)
			continue
		}
		indent := line[:len(line)-len(strings.TrimLeft(line, " \t"))]
		if fields[len(fields)-1] != "{" {
			out = append(out, strings.TrimRight(line, " \t")+" {", indent+"\t"+timeout, indent+"}")
			continue
		}
		out = append(out, line)
		set := false
		for depth, j := 1, i+1; j < len(lines) && depth > 0; j++ {
			f := strings.Fields(lines[j])
			switch {
			case len(f) == 0:
			case f[0] == "}":
				depth--
			case f[len(f)-1] == "{":
				depth++
			case depth == 1 && f[0] == "timeout":
				set = true
			}
		}
		if !set {
			out = append(out, indent+"\t"+timeout)
		}
	}
	return strings.Join(out, "\n")
}

// ---- Handlers

// parseTestCaddyfile unmarshals one rate_limit directive into a Handler.
func parseTestCaddyfile(input string) (*Handler, error) {
	h := new(Handler)
	err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(input))
	return h, err
}

// tryProvision provisions and validates h as Caddy would and returns the
// error. A provisioned handler is cleaned up after the test; an error of
// its Cleanup fails the test. A Redis config without a timeout gets
// testRedisTimeout.
func tryProvision(tb testing.TB, h *Handler) error {
	tb.Helper()
	if h.Redis != nil && h.Redis.Timeout == 0 {
		h.Redis.Timeout = caddy.Duration(testRedisTimeout)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	tb.Cleanup(cancel)
	if err := h.Provision(ctx); err != nil {
		return err
	}
	tb.Cleanup(func() {
		if err := h.Cleanup(); err != nil {
			tb.Errorf("cleanup: %v", err)
		}
	})
	return h.Validate()
}

// provision is tryProvision failing the test on an error.
func provision(tb testing.TB, h *Handler) *Handler {
	tb.Helper()
	if err := tryProvision(tb, h); err != nil {
		tb.Fatalf("provisioning: %v", err)
	}
	return h
}

// caddyfileHandler parses a rate_limit directive and provisions it.
func caddyfileHandler(tb testing.TB, directive string) *Handler {
	tb.Helper()
	h, err := parseTestCaddyfile(directive)
	if err != nil {
		tb.Fatalf("parsing %q: %v", directive, err)
	}
	return provision(tb, h)
}

// deadRedis is an address nothing listens on: a handler provisioned
// against it loads its script in the background (limiter.loadScript) and
// is refused at once, so it talks to no Redis, and certainly not to one
// on the default 127.0.0.1:6379 that tests must never write to.
const deadRedis = "127.0.0.1:1"

// offline points h's Redis at deadRedis, for the -short tier: a missing
// address list (the default, 127.0.0.1:6379) becomes deadRedis, and each
// address that parses has its host and port replaced, keeping how many
// there are and a URL's scheme, user, password and database. Addresses
// that do not parse are kept, so provisioning refuses them as before.
func offline(h *Handler) *Handler {
	r := RedisConfig{}
	if h.Redis != nil {
		r = *h.Redis
	}
	r.Addresses = nil
	for _, a := range h.Redis.withPlaceholders().Addresses {
		if _, err := parseAddress(a); err != nil {
			r.Addresses = append(r.Addresses, a)
		} else if u, err := url.Parse(a); err == nil && strings.Contains(a, "://") {
			u.Host = deadRedis
			r.Addresses = append(r.Addresses, u.String())
		} else {
			r.Addresses = append(r.Addresses, deadRedis)
		}
	}
	h.Redis = &r
	return h
}

func ptr[T any](v T) *T { return &v }

// ---- Requests through a Handler

// okHandler is the next handler: it answers 200.
var okHandler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
})

// prepareRequest is a GET from remoteIP with the X-Key header (none when
// key is empty), writing to w, prepared as Caddy's server prepares it (a
// zero Server, so that {http.vars.client_ip} resolves).
func prepareRequest(remoteIP, key string, w http.ResponseWriter) *http.Request {
	return prepareRequestOn(&caddyhttp.Server{}, remoteIP, key, w)
}

// prepareRequestOn is prepareRequest for a request to srv.
func prepareRequestOn(srv *caddyhttp.Server, remoteIP, key string, w http.ResponseWriter) *http.Request {
	r, err := http.NewRequest(http.MethodGet, "http://example.com/", nil)
	if err != nil {
		panic(err)
	}
	r.RemoteAddr = net.JoinHostPort(remoteIP, "1234")
	if key != "" {
		r.Header.Set("X-Key", key)
	}
	return caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, srv)
}

// newRequest is prepareRequest writing to a recorder.
func newRequest(remoteIP, key string) (*http.Request, *httptest.ResponseRecorder) {
	w := httptest.NewRecorder()
	return prepareRequest(remoteIP, key, w), w
}

// statusOf is the status the handler chain yields: the error's status
// for a denial, else what was written.
func statusOf(err error, written int) int {
	if err == nil {
		return written
	}
	if he, ok := err.(caddyhttp.HandlerError); ok {
		return he.StatusCode
	}
	return 500
}

// serve sends one request with the X-Key header through h, whose next
// handler answers 200, for a client whose context is ctx: canceling ctx
// is the client going away. It returns the status the client would get
// and the response headers.
func serve(ctx context.Context, h *Handler, key string) (int, http.Header) {
	r, w := newRequest("192.0.2.1", key)
	r = r.WithContext(mergeCancel(r.Context(), ctx))
	err := h.ServeHTTP(w, r, okHandler)
	return statusOf(err, w.Code), w.Header()
}

// hit is serve for a client that stays: the status, the
// X-RateLimit-Remaining header and how long the handler took.
func hit(h *Handler, key string) (status int, remaining string, took time.Duration) {
	return hitCtx(context.Background(), h, key)
}

// hitCtx is hit for a client whose context is ctx.
func hitCtx(ctx context.Context, h *Handler, key string) (status int, remaining string, took time.Duration) {
	start := time.Now()
	status, header := serve(ctx, h, key)
	return status, header.Get("X-RateLimit-Remaining"), time.Since(start)
}

// mergeCancel is base (with Caddy's request values) canceled when ctx is.
func mergeCancel(base, ctx context.Context) context.Context {
	if ctx.Done() == nil {
		return base
	}
	merged, cancel := context.WithCancelCause(base)
	context.AfterFunc(ctx, func() { cancel(context.Cause(ctx)) })
	return merged
}

// expectBurst asserts that send, on key with a full bucket, is admitted
// burst times (remaining counting down) and then denied. send returns a
// status and the X-RateLimit-Remaining header.
func expectBurst(t *testing.T, key string, burst int, send func() (int, string)) {
	t.Helper()
	for i := 1; i <= burst; i++ {
		status, remaining := send()
		if want := fmt.Sprint(burst - i); status != 200 || remaining != want {
			t.Fatalf("%s request %d: %d remaining %q, want 200 with %s", key, i, status, remaining, want)
		}
	}
	if status, remaining := send(); status != 429 || remaining != "0" {
		t.Fatalf("%s after the burst: %d remaining %q, want 429 with 0", key, status, remaining)
	}
}

// expectBurstThenDeny is expectBurst through h.
func expectBurstThenDeny(t *testing.T, h *Handler, key string, burst int) {
	t.Helper()
	expectBurst(t, key, burst, func() (int, string) {
		status, remaining, _ := hit(h, key)
		return status, remaining
	})
}

// ---- Logs

// observeLogs makes h log to an observer from level up, and returns what
// it logs (decisions, warnings, breaker changes). It is the one way tests
// reach the handler's logger (h.logger); call it after provisioning,
// before the first request.
func observeLogs(h *Handler, level zapcore.Level) *observer.ObservedLogs {
	core, logs := observer.New(level)
	h.logger = zap.New(core)
	return logs
}

// countLogs counts entries whose message contains msg.
func countLogs(logs *observer.ObservedLogs, msg string) int {
	return logs.FilterMessageSnippet(msg).Len()
}

// ---- Waiting

// eventually polls cond every 20ms until it holds, failing the test
// after timeout; it returns how long that took.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > timeout {
			t.Fatalf("%s: not within %v", what, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

// ---- Redis (the tests that use these start a redis-server first)

// newTestLimiter is a limiter of its own (not from the shared pool) to
// the Redis at addr.
func newTestLimiter(tb testing.TB, addr string, timeout time.Duration) *redisstore.Client {
	tb.Helper()
	cfg := (&RedisConfig{Addresses: []string{addr}, Timeout: caddy.Duration(timeout)}).withPlaceholders()
	opts, err := cfg.storeOptions(tlsFiles{})
	if err != nil {
		tb.Fatal(err)
	}
	b := redisstore.New(opts)
	tb.Cleanup(func() { _ = b.Destruct() })
	return b
}

// zoneAsksRedis says whether a handler of zone, of the configs loaded
// in this process, has a Redis client.
func zoneAsksRedis(zone string) bool {
	loadedZones.Lock()
	defer loadedZones.Unlock()
	return slices.ContainsFunc(loadedZones.byZone[zone], func(h *Handler) bool { return h.limiter != nil })
}

// redisStores are the handlers' Redis stores as holdSlots made them, one
// per handler, as its stack has one.
var redisStores sync.Map // *Handler -> *redisstore.Store

// holdSlots is what h's Redis store holds of an admitted request's
// buckets while it is served (Store.Hold); nil when nothing.
func holdSlots(h *Handler, buckets []limit.Bucket) limit.Holding {
	s, _ := redisStores.LoadOrStore(h, redisstore.NewStore(h.limiter, h.groups, true, h.redisReport()))
	return s.(*redisstore.Store).Hold(&limit.Call{Buckets: buckets})
}

// limitArgs are the script's arguments, formatted as Provision formats
// them.
func limitArgs(rate float64, burst, requested int64) [3]any {
	return tokenbucket.Args(limit.Values{Rate: rate, Burst: burst, Requested: requested})
}

// takeResult is what one bucket answered.
type takeResult struct {
	Allowed    bool
	Remaining  int64
	RetryAfter time.Duration
}

// takeOne asks l to take from the one bucket at key.
func takeOne(ctx context.Context, l *redisstore.Client, now time.Time, key string, args [3]any) (takeResult, error) {
	b := []limit.Bucket{{Key: key, Args: args}}
	allowed, err := l.Take(ctx, now, b)
	return takeResult{allowed, b[0].Remaining, b[0].RetryAfter}, err
}

func mustTake(t *testing.T, l *redisstore.Client, key string, args [3]any) takeResult {
	t.Helper()
	res, err := takeOne(context.Background(), l, time.Now(), key, args)
	if err != nil {
		t.Fatalf("take %s: %v", key, err)
	}
	return res
}

// newTestCall is a check-and-take call on one bucket, as the limiter
// queues it, due by deadline.
func newTestCall(key string, args [3]any, deadline time.Time) *redisbatch.Call {
	c := redisbatch.NewCall()
	c.Keys = append(c.Keys[:0], key)
	c.Deadline, c.ClientCtx = deadline, context.Background()
	c.Command(takeScript)
	c.Args = append(c.Args, args[:]...)
	return c
}

// infoStat reads one integer field of INFO.
func infoStat(t *testing.T, rdb *redis.Client, field string) int64 {
	t.Helper()
	info, err := rdb.Info(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("INFO %s %q: %v", field, v, err)
			}
			return n
		}
	}
	t.Fatalf("INFO has no %s", field)
	return 0
}

// ---- A proxy in front of Redis

// redisProxy forwards TCP connections to a Redis server and misbehaves on
// demand, as a network can: it adds latency, stalls, blackholes the
// connections open so far, or cuts them.
type redisProxy struct {
	addr   string
	target string
	ln     net.Listener
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	// cutting: pass on what a client sends, let Redis run it, and then
	// close the connection instead of passing the reply back; the client
	// cannot know whether its commands ran, as after a reset connection.
	cutting atomic.Bool
	// refusing: close connections before passing anything on, new ones
	// and open ones at their next write: nothing reaches Redis, as from
	// a host that died.
	refusing atomic.Bool
	// latency delays every chunk, each way, in nanoseconds.
	latency atomic.Int64
	// stalledUntil holds back every chunk due before it (Unix nanoseconds).
	stalledUntil atomic.Int64
	// generation counts blackholeOpen calls: a connection opened in an
	// earlier one passes nothing on, either way, and stays open.
	generation atomic.Int64
	// delaying holds back, toward Redis, what a client sends that
	// contains its pattern (delayMatching); delayHeld counts such chunks
	// received, delayPassed those passed on after their delay.
	delaying    atomic.Pointer[proxyDelay]
	delayHeld   atomic.Int64
	delayPassed atomic.Int64
}

// proxyDelay is a pattern and how long a chunk that contains it waits.
type proxyDelay struct {
	pattern []byte
	d       time.Duration
}

func startRedisProxy(t *testing.T, target string) *redisProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &redisProxy{addr: ln.Addr().String(), target: target, ln: ln, conns: make(map[net.Conn]struct{})}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				p.serve(client)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		for c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

// stall holds back everything due in the next d, as a network that
// stops for d and then delivers what it held.
func (p *redisProxy) stall(d time.Duration) { p.stalledUntil.Store(time.Now().Add(d).UnixNano()) }

// blackholeOpen makes the connections open now go silent for good,
// without closing them: what is sent on them is swallowed, as by a dead
// peer whose TCP never says so. New connections work.
func (p *redisProxy) blackholeOpen() { p.generation.Add(1) }

// delayMatching holds back for d each chunk a client sends toward Redis
// that contains pattern, and what follows it on its connection, as a
// TCP retransmission holds a packet: the client times out meanwhile and
// goes on on other connections, and the chunk still reaches Redis, even
// after the client closed its connection. An empty pattern stops it.
func (p *redisProxy) delayMatching(pattern string, d time.Duration) {
	if pattern == "" {
		p.delaying.Store(nil)
		return
	}
	p.delaying.Store(&proxyDelay{pattern: []byte(pattern), d: d})
}

// track keeps c to close at cleanup; false once the proxy is closing.
func (p *redisProxy) track(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.conns[c] = struct{}{}
}

// await waits until a chunk read at arrived is due: after the latency,
// and not within a stall.
func (p *redisProxy) await(arrived time.Time) {
	time.Sleep(time.Until(arrived.Add(time.Duration(p.latency.Load()))))
	for {
		until := time.Unix(0, p.stalledUntil.Load())
		if !time.Now().Before(until) {
			return
		}
		time.Sleep(time.Until(until))
	}
}

func (p *redisProxy) serve(client net.Conn) {
	defer client.Close()
	if p.refusing.Load() {
		return
	}
	gen := p.generation.Load()
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer server.Close()
	p.track(client)
	p.track(server)
	silent := func() bool { return p.generation.Load() != gen }
	go func() { // replies: passed back unless cutting
		buf := make([]byte, 64<<10)
		for {
			n, err := server.Read(buf)
			if n > 0 {
				p.await(time.Now())
				if !p.cutting.Load() && !silent() {
					if _, werr := client.Write(buf[:n]); werr != nil {
						return
					}
				}
			}
			if err != nil {
				client.Close()
				return
			}
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := client.Read(buf)
		if p.refusing.Load() {
			return
		}
		if n > 0 && !silent() {
			arrived, held := time.Now(), false
			if delay := p.delaying.Load(); delay != nil && bytes.Contains(buf[:n], delay.pattern) {
				arrived, held = arrived.Add(delay.d), true
				p.delayHeld.Add(1)
			}
			p.await(arrived)
			if _, werr := server.Write(buf[:n]); werr != nil {
				return
			}
			if held {
				p.delayPassed.Add(1)
			}
			if p.cutting.Load() {
				p.drainThenCut(client, server, buf)
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// drainThenCut forwards whatever else the client sends until it falls
// silent (the rest of a pipeline), gives Redis a moment to run it all,
// and returns, which closes both connections.
func (p *redisProxy) drainThenCut(client, server net.Conn, buf []byte) {
	for {
		_ = client.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
		n, err := client.Read(buf)
		if n > 0 {
			_, _ = server.Write(buf[:n])
		}
		if err != nil { // silent for 30 ms, or gone
			break
		}
	}
	time.Sleep(50 * time.Millisecond)
}

// ---- Caddy in this process (caddytest)

// caddytest runs one Caddy in the test process. With caddytest's fixed
// ports (admin 2999, HTTP 9080, HTTPS 9443), two test binaries on one
// machine (two builds, or a build and someone's tests) would share it:
// caddytest loads its configs into whatever answers on the admin port,
// another binary's Caddy included, and Caddy listens with SO_REUSEPORT,
// so both binaries' Caddys bind 9080 and each gets some of the other's
// requests. So this binary's Caddy has ports of its own: the tests write
// the fixed ones, which caddytestConfig replaces in every config loaded;
// caddytestAdmin and caddytestSite name the real ones.
var caddytestPorts = func() (p struct{ admin, http, https int }) {
	ports, err := testproc.FreePorts(3)
	if err != nil {
		panic(err)
	}
	p.admin, p.http, p.https = ports[0], ports[1], ports[2]
	return p
}()

var (
	// caddytestAdmin is the admin endpoint of caddytest's Caddy.
	caddytestAdmin = fmt.Sprintf("http://localhost:%d", caddytestPorts.admin)
	// caddytestSite is the site of caddytest's Caddy.
	caddytestSite = fmt.Sprintf("http://localhost:%d", caddytestPorts.http)
)

// caddyGlobals is the start of every Caddyfile served by caddytest.
const caddyGlobals = `{
	skip_install_trust
	admin localhost:2999
	http_port 9080
	https_port 9443
	grace_period 1ns
}
`

// caddytestConfig is a config for caddytest's Caddy: its fixed ports
// replaced by this binary's (caddytestPorts), and its rate_limit
// handlers given testRedisTimeout where they set no timeout.
func caddytestConfig(config, adapter string) string {
	admin, plain, tls := strconv.Itoa(caddytestPorts.admin), strconv.Itoa(caddytestPorts.http), strconv.Itoa(caddytestPorts.https)
	config = strings.NewReplacer(
		":2999", ":"+admin,
		":9080", ":"+plain, "http_port 9080", "http_port "+plain, `"http_port": 9080`, `"http_port": `+plain,
		":9443", ":"+tls, "https_port 9443", "https_port "+tls, `"https_port": 9443`, `"https_port": `+tls,
	).Replace(config)
	if adapter == "json" {
		return withTestRedisTimeoutJSON(config)
	}
	return withTestRedisTimeout(config)
}

// withTestRedisTimeoutJSON is withTestRedisTimeout for a JSON config:
// each rate_limit handler's redis object without a timeout gets one.
// Text that is not JSON is returned as it is, for Caddy to refuse.
func withTestRedisTimeoutJSON(config string) string {
	var v any
	if err := json.Unmarshal([]byte(config), &v); err != nil {
		return config
	}
	var walk func(any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if redis, ok := v["redis"].(map[string]any); ok && v["handler"] == "rate_limit" && redis["timeout"] == nil {
				redis["timeout"] = testRedisTimeout.String()
			}
			for _, e := range v {
				walk(e)
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		}
	}
	walk(v)
	out, err := json.Marshal(v)
	if err != nil {
		return config
	}
	return string(out)
}

// caddytestListeners are the sockets caddytest's Caddy listens on now,
// to wait for their end after a config load (see testproc.ListenersOn).
func caddytestListeners() testproc.Listeners {
	l, _ := testproc.ListenersOn(caddytestPorts.http, caddytestPorts.https)
	return l
}

// awaitOldListenersClosed waits after a config load until the sockets
// of the config before (old) have closed: a request sent then meets the
// new config only, never the old one nor a socket closing under it.
func awaitOldListenersClosed(t *testing.T, old testproc.Listeners) {
	t.Helper()
	if err := old.AwaitClosed(10*time.Second, caddytestPorts.http, caddytestPorts.https); err != nil {
		t.Fatalf("caddytest: %v", err)
	}
}

// loadConfig (re)loads a whole config, with the "caddyfile" or "json"
// adapter, into the in-process Caddy that caddytest runs (caddytestConfig
// of it), starting it when tester is nil: the one way tests get it,
// which skips the test under -short. Every load replaces the config
// before, the previous test's too: loadConfig returns once that config
// stopped listening.
func loadConfig(t *testing.T, tester *caddytest.Tester, config, adapter string) *caddytest.Tester {
	t.Helper()
	if tester == nil {
		testproc.SkipShort(t, "Caddy (caddytest)")
		tester = caddytest.NewTester(t)
	}
	old := caddytestListeners()
	tester.InitServer(caddytestConfig(config, adapter), adapter)
	if t.Failed() {
		t.FailNow()
	}
	awaitOldListenersClosed(t, old)
	return tester
}

// loadCaddyfile is loadConfig with a whole Caddyfile.
func loadCaddyfile(t *testing.T, tester *caddytest.Tester, config string) *caddytest.Tester {
	t.Helper()
	return loadConfig(t, tester, config, "caddyfile")
}

// serveCaddyfile starts caddytest's Caddy with caddyGlobals and the site
// block, whose %s is the Redis address.
func serveCaddyfile(t *testing.T, site, redisAddr string) *caddytest.Tester {
	t.Helper()
	return loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(site, redisAddr))
}

// getKey sends GET url with the X-Key header (none when key is empty)
// and reads the body.
func getKey(client *http.Client, url, key string) (*http.Response, string, error) {
	if key == "" {
		return getHeaders(client, url)
	}
	return getHeaders(client, url, "X-Key", key)
}

// getHeaders sends a GET with the headers (name, value, ...) and returns
// the response with its body read.
func getHeaders(client *http.Client, url string, headers ...string) (*http.Response, string, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return nil, "", err
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp, string(body), err
}

// get sends a GET for path to caddytest's Caddy with an optional X-Key
// header and returns the response with its body read.
func get(t *testing.T, tester *caddytest.Tester, path, key string) (*http.Response, string) {
	t.Helper()
	resp, body, err := getKey(tester.Client, caddytestSite+path, key)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return resp, body
}

func assertHeaders(t *testing.T, resp *http.Response, want map[string]string) {
	t.Helper()
	for k, v := range want {
		if got := resp.Header.Get(k); got != v {
			t.Errorf("%s: got %q, want %q (status %d)", k, got, v, resp.StatusCode)
		}
	}
}

// ---- Caddy processes (internal/caddyproc)

// loggingCaddyfile is caddyproc.Caddyfile with Caddy's log from level
// up, as JSON lines on stderr (the instance's LogFile): all that Caddy
// and the handler print.
func loggingCaddyfile(level, sites string) string {
	return strings.Replace(caddyproc.Caddyfile(sites), "grace_period 2s\n}",
		"grace_period 2s\n\tlog {\n\t\tlevel "+level+"\n\t\tformat json\n\t}\n}", 1)
}

// longestLine is the longest line of text, and its length.
func longestLine(text string) (string, int) {
	var longest string
	for _, line := range strings.Split(text, "\n") {
		if len(line) > len(longest) {
			longest = line
		}
	}
	return longest, len(longest)
}

// caddyClient talks to caddyproc instances; its own transport, so idle
// connections of one test do not meet the next.
func caddyClient(t testing.TB) *http.Client {
	tr := &http.Transport{MaxIdleConns: 256, MaxIdleConnsPerHost: 128, IdleConnTimeout: 30 * time.Second}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// caddyGet sends GET url with the X-Key header; it returns the status,
// the X-RateLimit-Remaining header and the body.
func caddyGet(client *http.Client, url, key string) (status int, remaining, body string, err error) {
	resp, body, err := getKey(client, url, key)
	if resp == nil {
		return 0, "", "", err
	}
	return resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), body, err
}

// mustGet is caddyGet failing the test on a transport error.
func mustGet(t *testing.T, client *http.Client, url, key string) (int, string) {
	t.Helper()
	status, remaining, _, err := caddyGet(client, url, key)
	if err != nil {
		t.Fatalf("GET %s (key %s): %v", url, key, err)
	}
	return status, remaining
}

// expectCaddyBurstThenDeny is expectBurst through a Caddy.
func expectCaddyBurstThenDeny(t *testing.T, client *http.Client, url, key string, burst int) {
	t.Helper()
	expectBurst(t, key, burst, func() (int, string) { return mustGet(t, client, url, key) })
}

// ---- The token bucket's reference

// scriptBucket is a bucket's state as script.lua stores it, "<tokens>
// <microseconds>": the tokens it held at that Redis time. The zero
// value is an absent bucket (new, or expired), which is full.
type scriptBucket struct {
	tokens  float64
	at      int64 // Redis time, microseconds
	present bool
	// lent and until: the mark of a bucket that has lent (lease.lua), what
	// its leases held and when the last expires (Redis time, µs); 0 without.
	lent, until int64
}

// scriptRefill is the tokens b holds at now (microseconds), as the
// memory store's refill (memstore.go) computes them; for a bucket with
// lease.lua's mark, as script.lua (and peek.lua) do: up to the burst less
// what is lent until the mark's end, and never above that cap at now
// (the burst may have gone down since the bucket was stored).
func scriptRefill(b scriptBucket, now int64, rate float64, burst int64) float64 {
	if !b.present || b.lent == 0 {
		return tokenbucket.Refill(b.state(now, burst), now, limit.Values{Rate: rate, Burst: burst, Requested: 1})
	}
	t, from := b.tokens, min(b.at, now)
	if b.until > from {
		to := min(b.until, now)
		if limit := float64(burst - b.lent); t < limit {
			t = min(limit, t+float64(to-from)*rate/1e6)
		}
		from = to
	}
	if t < float64(burst) {
		t = min(float64(burst), t+float64(now-from)*rate/1e6)
	}
	if b.until > now {
		return min(t, float64(burst-b.lent))
	}
	return min(t, float64(burst))
}

// scriptTake is the memory store's arithmetic (tokenbucket.TakeAt), the token
// bucket of script.lua in Go, for a bucket as the script stores it: at
// now it refills b, then takes requested tokens if b holds them. It
// returns the bucket afterwards (a denial leaves it as it was), whether
// the tokens were taken, the whole tokens left (rounded down) and the
// microseconds until the bucket holds requested tokens again (rounded
// up; 0 when it holds them now).
func scriptTake(b scriptBucket, now int64, rate float64, burst, requested int64) (after scriptBucket, allowed bool, remaining, wait int64) {
	state, took, remaining, wait := tokenbucket.TakeAt(b.state(now, burst), now, limit.Values{Rate: rate, Burst: burst, Requested: requested}, true)
	if !took {
		return b, false, remaining, wait
	}
	return scriptBucket{tokens: state.Tokens, at: now, present: true}, true, remaining, wait
}

// state is b as the memory store holds it: an absent bucket is full.
func (b scriptBucket) state(now, burst int64) limit.State {
	if !b.present {
		return limit.State{Tokens: float64(burst), At: now}
	}
	return limit.State{Tokens: b.tokens, At: b.at}
}

// parseBucket reads a bucket's state from the reply to GET its key: the
// script's format, or none (redis.Nil) for an absent bucket.
func parseBucket(state *redis.StringCmd) (scriptBucket, error) {
	v, err := state.Result()
	if err == redis.Nil {
		return scriptBucket{}, nil
	}
	if err != nil {
		return scriptBucket{}, err
	}
	f := strings.Fields(v)
	b := scriptBucket{present: true}
	if len(f) == 2 || len(f) == 4 {
		if b.tokens, err = strconv.ParseFloat(f[0], 64); err == nil {
			b.at, err = strconv.ParseInt(f[1], 10, 64)
		}
	}
	if len(f) == 4 && err == nil {
		if b.lent, err = strconv.ParseInt(f[2], 10, 64); err == nil {
			b.until, err = strconv.ParseInt(f[3], 10, 64)
		}
	}
	if len(f) != 2 && len(f) != 4 || err != nil {
		return scriptBucket{}, fmt.Errorf("bucket state %q: want \"<tokens> <microseconds>\" or, lent, \"<tokens> <microseconds> <lent> <until>\"", v)
	}
	return b, nil
}

// forceReload loads a Caddyfile into the running Caddy even when it is
// unchanged, as `caddy reload --force` does.
func forceReload(t *testing.T, caddyfile string) {
	t.Helper()
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddytestConfig(caddyfile, "caddyfile")), nil)
	if err != nil {
		t.Fatalf("adapting: %v", err)
	}
	old := caddytestListeners()
	req, _ := http.NewRequest(http.MethodPost, caddytestAdmin+"/load", bytes.NewReader(cfg))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Cache-Control", "must-revalidate")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("reload: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("reload: status %d", resp.StatusCode)
	}
	awaitOldListenersClosed(t, old)
}

// readmeExample is the first Caddyfile block of the README's section
// titled title (a "## " or "### " heading), as written.
func readmeExample(t *testing.T, title string) string {
	t.Helper()
	raw, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(raw), "\n## "+title+"\n")
	if !ok {
		_, section, ok = strings.Cut(string(raw), "\n### "+title+"\n")
	}
	if !ok {
		t.Fatalf("README.md has no %q section", title)
	}
	_, block, ok := strings.Cut(section, "```caddyfile\n")
	if !ok {
		t.Fatalf("the %q section has no caddyfile block", title)
	}
	block, _, _ = strings.Cut(block, "```")
	return block
}

// decide decides buckets with h's stack of store and layers, as the
// request path does, and leaves their answers in buckets.
func decide(ctx context.Context, h *Handler, buckets []limit.Bucket) (bool, error) {
	r := acquireRequest()
	defer r.free()
	r.Buckets = append(r.Buckets, buckets...)
	r.Sent = time.Now()
	allowed, err := h.store.Take(ctx, &r.Call)
	copy(buckets, r.Buckets)
	return allowed, err
}

// resolveBuckets is resolveBucketsWith without a weight memo: a
// request's buckets, as the tests look at them.
func (h *Handler) resolveBuckets(r *http.Request, repl *caddy.Replacer, buckets []limit.Bucket) (_ []limit.Bucket, skipped limit.Decision, err error) {
	return h.resolveBucketsWith(r, repl, buckets, nil)
}
