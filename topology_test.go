package ratelimit

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// topologyTimeout is the redis timeout of the failover tests; requests
// must be answered within it plus failoverSlack while a master is gone.
// Both leave room for a loaded two-core machine under -race: a master
// that answers must be answered in time, and a request must not wait
// much past its timeout, never for the failover.
const (
	topologyTimeout = time.Second
	failoverSlack   = time.Second
)

// failoverTraffic sends requests on keys (round robin) from the start
// until stop, asserting that none yields a server error or takes longer
// than the timeout allows; it counts the requests that followed on_error.
type failoverTraffic struct {
	stop      chan struct{}
	done      chan struct{}
	sent      atomic.Int64
	failOpen  atomic.Int64
	slowest   atomic.Int64
	errorSeen atomic.Int64
}

func startFailoverTraffic(t *testing.T, h *Handler, keys []string) *failoverTraffic {
	ft := &failoverTraffic{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(ft.done)
		for i := 0; ; i++ {
			select {
			case <-ft.stop:
				return
			default:
			}
			key := keys[i%len(keys)]
			status, remaining, took := hit(h, key)
			ft.sent.Add(1)
			if took > time.Duration(ft.slowest.Load()) {
				ft.slowest.Store(int64(took))
			}
			switch {
			case status == 200 && remaining == "-1":
				ft.failOpen.Add(1)
			case (status == 200 || status == 429) && remaining != "" && remaining != "-1":
			default:
				if ft.errorSeen.Add(1) <= 5 {
					t.Errorf("during failover, key %s: %d remaining %q; want 200 or 429, -1 only with 200", key, status, remaining)
				}
			}
			if took > topologyTimeout+failoverSlack {
				if ft.errorSeen.Add(1) <= 5 {
					t.Errorf("during failover, key %s took %v, more than the timeout %v + %v", key, took, topologyTimeout, failoverSlack)
				}
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	t.Cleanup(ft.end)
	return ft
}

func (ft *failoverTraffic) end() {
	select {
	case <-ft.stop:
	default:
		close(ft.stop)
	}
	<-ft.done
}

func (ft *failoverTraffic) report(t *testing.T) {
	ft.end()
	t.Logf("during failover: %d requests, %d followed on_error, slowest %v",
		ft.sent.Load(), ft.failOpen.Load(), time.Duration(ft.slowest.Load()).Round(time.Millisecond))
	if ft.failOpen.Load() == 0 {
		t.Error("no request followed on_error while the master was down: was the failover seen at all?")
	}
}

// bucketValues lists the client keys whose buckets the server holds.
func bucketValues(t *testing.T, srv *redistest.Server, h *Handler) []string {
	t.Helper()
	prefix := h.limits[0].KeyPrefix
	keys, err := srv.Client(t).Keys(context.Background(), prefix+"*").Result()
	if err != nil {
		t.Fatalf("KEYS on %s: %v", srv.Addr, err)
	}
	for i, k := range keys {
		keys[i] = strings.TrimPrefix(k, prefix)
	}
	return keys
}

func TestClusterSpreadsBucketsAndRidesOutFailover(t *testing.T) {
	c := redistest.StartCluster(t, 3, 1)
	directive := fmt.Sprintf(`rate_limit 0.01 2 {
	zone cluster
	key {http.request.header.X-Key}
	redis {
		address %s
		timeout %v
	}
}`, strings.Join(c.Addrs, " "), topologyTimeout)
	h := caddyfileHandler(t, directive)

	// Every key admits exactly its burst, then is denied; Redis errors
	// never reach a client. Denied buckets are then answered from the deny
	// cache, without Redis, so the failover below uses "p" keys, which
	// took one token of two and still ask Redis.
	const keys, partial, workers = 3000, 300, 8
	start := time.Now()
	var wg sync.WaitGroup
	var wrong atomic.Int64
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := w; k < keys; k += workers {
				key := "k" + strconv.Itoa(k)
				for i, want := range []struct {
					status    int
					remaining string
				}{{200, "1"}, {200, "0"}, {429, "0"}} {
					status, remaining, _ := hit(h, key)
					if (status != want.status || remaining != want.remaining) && wrong.Add(1) <= 5 {
						t.Errorf("key %s request %d: %d remaining %q, want %d with %s",
							key, i+1, status, remaining, want.status, want.remaining)
					}
				}
			}
		}()
	}
	for k := range partial {
		if status, remaining, _ := hit(h, "p"+strconv.Itoa(k)); status != 200 || remaining != "1" {
			t.Errorf("key p%d: %d remaining %q, want 200 with 1", k, status, remaining)
		}
	}
	wg.Wait()
	t.Logf("%d keys x 3 requests and %d x 1 in %v", keys, partial, time.Since(start).Round(time.Millisecond))
	if t.Failed() {
		t.FailNow()
	}
	total := int64(0)
	for _, m := range c.Masters {
		n, err := m.Client(t).DBSize(context.Background()).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			t.Errorf("master %s holds no bucket", m.Addr)
		}
		total += n
	}
	if total != keys+partial {
		t.Errorf("the masters hold %d buckets, want %d", total, keys+partial)
	}

	// Kill the master of slots 0-5460; its replica takes over.
	var dead, deadPartial, alivePartial []string
	for _, v := range bucketValues(t, c.Masters[0], h) {
		if strings.HasPrefix(v, "p") {
			deadPartial = append(deadPartial, v)
		} else {
			dead = append(dead, v)
		}
	}
	for _, v := range bucketValues(t, c.Masters[1], h) {
		if strings.HasPrefix(v, "p") {
			alivePartial = append(alivePartial, v)
		}
	}
	if len(dead) < 20 || len(deadPartial) < 25 || len(alivePartial) == 0 {
		t.Fatalf("buckets on the master to kill: %d, %d partial; partial ones on another: %d",
			len(dead), len(deadPartial), len(alivePartial))
	}
	// Replication is asynchronous: wait until the replica has the buckets.
	if n, err := c.Masters[0].Client(t).Wait(context.Background(), 1, 5*time.Second).Result(); err != nil || n != 1 {
		t.Fatalf("WAIT for the replica of %s: %d %v", c.Masters[0].Addr, n, err)
	}
	logs := observeLogs(h, zap.DebugLevel)
	c.Masters[0].Kill(t)
	killed := time.Now()
	traffic := startFailoverTraffic(t, h, []string{deadPartial[0], alivePartial[0], deadPartial[1], deadPartial[2]})
	c.WaitHealthy(t, 30*time.Second)
	healthy := time.Since(killed)
	resumed := eventually(t, 5*time.Second, "limiting resumes on the promoted replica", func() bool {
		for _, key := range deadPartial[5:25] {
			if _, remaining, _ := hit(h, key); remaining == "" || remaining == "-1" {
				return false
			}
		}
		return true
	})
	traffic.report(t)
	t.Logf("cluster healthy %v after the kill; limiting resumed %v later; the breaker opened %d and closed %d times",
		healthy.Round(time.Millisecond), resumed.Round(time.Millisecond),
		countLogs(logs, "circuit breaker opened"), countLogs(logs, "circuit breaker closed"))

	// The promoted replica kept the buckets it had replicated: keys of
	// the dead master's slots are still denied, by Redis (a second handler
	// has a deny cache of its own; it shares the Redis client).
	h2 := caddyfileHandler(t, directive)
	for _, key := range dead[:20] {
		if status, remaining, _ := hit(h2, key); status != 429 || remaining != "0" {
			t.Errorf("key %s of the failed-over slots: %d remaining %q, want 429 with 0", key, status, remaining)
		}
	}
	// And new keys are limited wherever they land, the new master included.
	for i := range 30 {
		expectBurstThenDeny(t, h, fmt.Sprint("fresh", i), 2)
	}
	if n := len(bucketValues(t, c.Replicas[0], h)); n < len(dead)+len(deadPartial) {
		t.Errorf("the promoted replica holds %d buckets, fewer than the %d its master had", n, len(dead)+len(deadPartial))
	}
	found := false
	for _, v := range bucketValues(t, c.Replicas[0], h) {
		found = found || strings.HasPrefix(v, "fresh")
	}
	if !found {
		t.Error("no new bucket landed on the promoted replica")
	}
}

func TestSentinelFollowsFailover(t *testing.T) {
	st := redistest.StartSentinel(t)
	directive := fmt.Sprintf(`rate_limit 0.01 2 {
	zone sentinel
	key {http.request.header.X-Key}
	redis {
		address %s
		master_name %s
		timeout %v
	}
}`, strings.Join(st.SentinelAddrs, " "), st.MasterName, topologyTimeout)
	h := caddyfileHandler(t, directive)
	ctx := context.Background()
	expectBurstThenDeny(t, h, "before", 2)
	// "partial" took one token of two: it still asks Redis ("before" is
	// answered from the deny cache now).
	if status, remaining, _ := hit(h, "partial"); status != 200 || remaining != "1" {
		t.Fatalf("partial: %d remaining %q, want 200 with 1", status, remaining)
	}
	// Replication is asynchronous: wait until the replica has the buckets.
	if n, err := st.Master.Client(t).Wait(ctx, 1, 5*time.Second).Result(); err != nil || n != 1 {
		info, _ := st.Replica.Client(t).Info(ctx, "replication").Result()
		t.Fatalf("WAIT for the replica: %d %v\n%s\n%s", n, err, info, st.Replica.LogTail(20))
	}
	oldMaster := st.CurrentMaster(t)
	if oldMaster != st.Master.Addr {
		t.Fatalf("sentinels name %s as master, not %s", oldMaster, st.Master.Addr)
	}
	cached, err := st.Replica.Client(t).ScriptExists(ctx, scriptSHA).Result()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("script cached on the replica before the failover: %v", cached[0])

	st.Master.Kill(t)
	killed := time.Now()
	traffic := startFailoverTraffic(t, h, []string{"partial", "other"})
	newMaster := st.WaitFailover(t, oldMaster, 30*time.Second)
	failedOver := time.Since(killed)
	probes := 0
	resumed := eventually(t, 5*time.Second, "limiting follows the new master", func() bool {
		probes++
		_, remaining, _ := hit(h, fmt.Sprint("probe", probes))
		return remaining != "" && remaining != "-1"
	})
	traffic.report(t)
	t.Logf("sentinels switched to %s %v after the kill; limiting resumed %v later",
		newMaster, failedOver.Round(time.Millisecond), resumed.Round(time.Millisecond))

	// No NOSCRIPT reaches anyone: the new master got the script on the
	// first call, and limiting works there, with the buckets the replica
	// had (a second handler: its deny cache is empty).
	for i := range 10 {
		expectBurstThenDeny(t, h, fmt.Sprint("after", i), 2)
	}
	h2 := caddyfileHandler(t, directive)
	if status, remaining, _ := hit(h2, "before"); status != 429 || remaining != "0" {
		t.Errorf("before, on the new master: %d remaining %q, want 429 with 0 (replicated)", status, remaining)
	}
	if newMaster != st.Replica.Addr {
		t.Fatalf("new master %s is not the replica %s", newMaster, st.Replica.Addr)
	}
	exists, err := st.Replica.Client(t).ScriptExists(ctx, scriptSHA).Result()
	if err != nil || !exists[0] {
		t.Fatalf("script not cached on the new master: %v %v", exists, err)
	}
	if n := len(bucketValues(t, st.Replica, h)); n < 10 {
		t.Fatalf("the new master holds %d buckets; the limiter did not follow it", n)
	}
}

// tlsDirective is a rate_limit with the Redis address and the lines of
// its tls block. The timeout is long: a first request pays the TCP and
// TLS handshakes and the script upload, which can take more than the
// default 100ms on a loaded machine under -race.
func tlsDirective(zone, addr string, tlsLines ...string) string {
	return fmt.Sprintf(`rate_limit 0.01 2 {
	zone %s
	key {http.request.header.X-Key}
	redis %s {
		timeout 5s
		tls {
			%s
		}
	}
}`, zone, addr, strings.Join(tlsLines, "\n\t\t\t"))
}

// expectTLSFailure asserts that requests follow on_error (allow) and that
// the warning says the TLS handshake failed because of certificates. In
// TLS 1.3 a client that sent no certificate finishes its handshake before
// the server judges it: the server's alert ("certificate required") can
// lose the race with the reset of the connection it closes, and then the
// client only sees the reset (clientCertMissing).
func expectTLSFailure(t *testing.T, h *Handler, clientCertMissing bool) {
	t.Helper()
	logs := observeLogs(h, zap.DebugLevel)
	for range 3 {
		if status, remaining, _ := hit(h, "k"); status != 200 || remaining != "-1" {
			t.Fatalf("%d remaining %q, want 200 with -1 (on_error allow)", status, remaining)
		}
	}
	warned := logs.FilterMessageSnippet("following on_error").All()
	if len(warned) == 0 {
		t.Fatal("no warning logged")
	}
	err := fmt.Sprint(warned[0].ContextMap()["error"])
	if !strings.Contains(err, "certificate") && !(clientCertMissing && strings.Contains(err, "reset by peer")) {
		t.Fatalf("the warning does not say why: %q", err)
	}
}

func TestTLSRedis(t *testing.T) {
	ts := redistest.StartTLS(t, false)
	mtls := redistest.StartTLS(t, true)

	t.Run("ca", func(t *testing.T) {
		h := caddyfileHandler(t, tlsDirective("tls-ca", ts.Addr, "ca "+ts.CAFile))
		expectBurstThenDeny(t, h, "k", 2)
	})
	t.Run("rediss URL", func(t *testing.T) {
		h := caddyfileHandler(t, tlsDirective("tls-url", "rediss://"+ts.Addr, "ca "+ts.CAFile))
		expectBurstThenDeny(t, h, "k", 2)
	})
	t.Run("client certificate", func(t *testing.T) {
		h := caddyfileHandler(t, tlsDirective("tls-mutual", mtls.Addr,
			"ca "+mtls.CAFile, "cert "+mtls.ClientCertFile, "key "+mtls.ClientKeyFile))
		expectBurstThenDeny(t, h, "k", 2)
	})
	t.Run("wrong CA", func(t *testing.T) {
		h := caddyfileHandler(t, tlsDirective("tls-wrong-ca", ts.Addr, "ca "+ts.OtherCAFile))
		expectTLSFailure(t, h, false)
	})
	t.Run("no client certificate", func(t *testing.T) {
		h := caddyfileHandler(t, tlsDirective("tls-no-cert", mtls.Addr, "ca "+mtls.CAFile))
		expectTLSFailure(t, h, true)
	})
}

func TestRotatedRedisCertificatesTakeEffectOnReload(t *testing.T) {
	mtls := redistest.StartTLS(t, true) // demands client certificates
	// caddytest rewrites paths ending in .crt and .key in a config; links
	// named otherwise lead to the same files.
	dir := t.TempDir()
	var files []string
	for i, target := range []string{mtls.CAFile, mtls.ClientCertFile, mtls.ClientKeyFile} {
		link := filepath.Join(dir, fmt.Sprintf("file%d.pem", i))
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
		files = append(files, link)
	}
	config := caddyGlobals + fmt.Sprintf(`
http://localhost:9080 {
	rate_limit 0.01 3 {
		zone rotation
		key {http.request.header.X-Key}
		redis %s {
			timeout 5s
			tls {
				ca   %s
				cert %s
				key  %s
			}
		}
	}
	respond "ok"
}`, mtls.Addr, files[0], files[1], files[2])
	tester := loadCaddyfile(t, nil, config)
	if resp, _ := get(t, tester, "/", "before"); resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "2" {
		t.Fatalf("before the rotation: %d remaining %q, want 200 with 2", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
	}

	// A new CA and new pairs in the same files; Redis restarts on them,
	// and the client that read the old files can no longer connect.
	mtls.Rotate(t)
	if resp, _ := get(t, tester, "/", "rotated"); resp.Header.Get("X-RateLimit-Remaining") != "-1" {
		t.Fatalf("after the rotation, before the reload: remaining %q, want -1 (the old certificates fail)",
			resp.Header.Get("X-RateLimit-Remaining"))
	}

	forceReload(t, config)
	for i, want := range []string{"2", "1", "0"} {
		resp, _ := get(t, tester, "/", "reloaded")
		if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != want {
			t.Fatalf("after the reload, request %d: %d remaining %q, want 200 with %s (limited through the new certificates)",
				i+1, resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), want)
		}
	}
}

// TestDeadClusterMasterLeavesOtherMastersLimited kills one of three
// masters (no replicas, so its slots stay down) and sends a steady mix of
// keys over all masters for more than five seconds: keys on the healthy
// masters stay limited exactly (never past burst + rate*T, never an
// error answer), keys on the dead one follow on_error within the timeout.
func TestDeadClusterMasterLeavesOtherMastersLimited(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	// By default a master refuses every key once any slot is uncovered;
	// operators who want the other masters to keep answering set this.
	for _, m := range c.Masters {
		if err := m.Client(t).ConfigSet(ctx, "cluster-require-full-coverage", "no").Err(); err != nil {
			t.Fatal(err)
		}
	}
	const rate, burst = 2.0, 3
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit %v %d {
	zone deadmaster
	key {http.request.header.X-Key}
	redis {
		address %s
		timeout %v
	}
}`, rate, burst, strings.Join(c.Addrs, " "), topologyTimeout))
	logs := observeLogs(h, zap.DebugLevel)

	// Ten keys per master, by where their buckets live.
	cc := c.Client(t)
	dead := c.Masters[0].Addr
	var healthyKeys, deadKeys []string
	for i := 0; len(healthyKeys) < 20 || len(deadKeys) < 10; i++ {
		key := "k" + strconv.Itoa(i)
		master, err := cc.MasterForKey(ctx, h.limits[0].KeyPrefix+key)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case master.Options().Addr == dead && len(deadKeys) < 10:
			deadKeys = append(deadKeys, key)
		case master.Options().Addr != dead && len(healthyKeys) < 20:
			healthyKeys = append(healthyKeys, key)
		}
	}
	c.Masters[0].Kill(t)

	// 30 keys at about 300 requests a second in all, for six seconds:
	// far more failures on the dead master than the breaker's threshold.
	type tally struct {
		admitted    int
		first, last time.Time
	}
	var mu sync.Mutex
	tallies := map[string]*tally{}
	var wg sync.WaitGroup
	keys := append(append([]string(nil), healthyKeys...), deadKeys...)
	deadline := time.Now().Add(6 * time.Second)
	for w, key := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			onDeadMaster := w >= len(healthyKeys)
			for time.Now().Before(deadline) {
				sent := time.Now()
				status, remaining, took := hit(h, key)
				switch {
				case onDeadMaster && (status != 200 || remaining != "-1"):
					t.Errorf("key %s on the dead master: %d remaining %q, want on_error allow (200, -1)", key, status, remaining)
				case onDeadMaster && took > topologyTimeout+failoverSlack:
					t.Errorf("key %s on the dead master took %v, more than the timeout %v", key, took, topologyTimeout)
				case !onDeadMaster && (status != 200 && status != 429 || remaining == "-1" || remaining == ""):
					t.Errorf("key %s on a healthy master: %d remaining %q; its master answers, so it must be limited", key, status, remaining)
				case !onDeadMaster && status == 200:
					mu.Lock()
					tl := tallies[key]
					if tl == nil {
						tl = &tally{first: sent}
						tallies[key] = tl
					}
					tl.admitted++
					tl.last = time.Now()
					mu.Unlock()
				}
				if t.Failed() {
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	for _, key := range healthyKeys {
		tl := tallies[key]
		if tl == nil {
			t.Errorf("key %s on a healthy master: nothing admitted in six seconds", key)
			continue
		}
		// Admitted between the first request's start and the last answer.
		bound := burst + int(rate*tl.last.Sub(tl.first).Seconds())
		if tl.admitted > bound {
			t.Errorf("key %s on a healthy master: %d admitted over %v, bound %d", key, tl.admitted, tl.last.Sub(tl.first), bound)
		}
	}
	if countLogs(logs, "circuit breaker opened") == 0 {
		t.Error("the dead master's breaker never opened")
	}
	if open := h.limiter.OpenBreakers(); open != 1 {
		t.Errorf("%d node breakers open, want 1 (the dead master's)", open)
	}
}

// breakerGauge reads caddy_rate_limit_breaker_open of a zone as a scrape
// of Caddy's /metrics would.
func breakerGauge(t *testing.T, zone string) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := reg.Register(collectors.breakerOpen); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "zone" && l.GetValue() == zone {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("no caddy_rate_limit_breaker_open series for zone %s", zone)
	return 0
}

// TestBreakerOfFailedOverMasterIsDropped kills a Cluster master whose
// replica takes over. The dead master's breaker opens while its slots
// have no master; once limiting has resumed on the promoted replica,
// that breaker is dropped within a few seconds: the gauge reads 0 again
// and "circuit breaker closed" is logged, though no request ever reaches
// the dead node again.
func TestBreakerOfFailedOverMasterIsDropped(t *testing.T) {
	c := redistest.StartCluster(t, 3, 1)
	ctx := context.Background()
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit 100 1000 {
	zone dropbreaker
	key {http.request.header.X-Key}
	redis {
		address %s
		timeout %v
	}
}`, strings.Join(c.Addrs, " "), topologyTimeout))
	logs := observeLogs(h, zap.DebugLevel)
	cc := c.Client(t)
	var keys []string // on the master to kill
	for i := 0; len(keys) < 10; i++ {
		key := "k" + strconv.Itoa(i)
		master, err := cc.MasterForKey(ctx, h.limits[0].KeyPrefix+key)
		if err != nil {
			t.Fatal(err)
		}
		if master.Options().Addr == c.Masters[0].Addr {
			keys = append(keys, key)
		}
	}
	for _, key := range keys {
		if _, remaining, _ := hit(h, key); remaining == "-1" || remaining == "" {
			t.Fatalf("key %s before the kill: remaining %q, want limited", key, remaining)
		}
	}

	c.Masters[0].Kill(t)
	eventually(t, 10*time.Second, "the dead master's breaker opens", func() bool {
		for _, key := range keys {
			hit(h, key)
		}
		return breakerGauge(t, "dropbreaker") >= 1
	})
	t.Logf("breaker gauge %v with the master dead", breakerGauge(t, "dropbreaker"))
	c.WaitHealthy(t, 30*time.Second)
	resumed := eventually(t, 10*time.Second, "limiting resumes on the promoted replica", func() bool {
		for _, key := range keys {
			if _, remaining, _ := hit(h, key); remaining == "-1" || remaining == "" {
				return false
			}
		}
		return true
	})
	dropped := eventually(t, 5*time.Second, "the gauge returns to 0", func() bool {
		hit(h, keys[0]) // traffic goes on, to the new master only
		return breakerGauge(t, "dropbreaker") == 0
	})
	t.Logf("limiting resumed %v after the cluster was healthy; the gauge read 0 %v later",
		resumed.Round(time.Millisecond), dropped.Round(time.Millisecond))
	closed := logs.FilterMessageSnippet("circuit breaker closed").All()
	if len(closed) == 0 {
		t.Fatal("no 'circuit breaker closed' line for the dead master's breaker")
	}
	for _, e := range closed {
		t.Logf("logged: %s (node %v)", e.Message, e.ContextMap()["node"])
	}
	if n := countLogs(logs, "circuit breaker opened"); n < 1 {
		t.Errorf("'circuit breaker opened' logged %d times", n)
	}
	if open := h.limiter.OpenBreakers(); open != 0 {
		t.Errorf("%d breakers counted open after the failover, want 0", open)
	}
}

// TestUnknownSlotsBreakerIsDroppedOnceTheSlotMapLoads starts a handler
// while every Cluster node is paused (CLIENT PAUSE): the slot map cannot
// be loaded, and the breaker kept for that opens. Once the nodes answer,
// requests go to the masters, and that breaker, which no request meets
// any more, is dropped: the gauge reads 0 again.
func TestUnknownSlotsBreakerIsDroppedOnceTheSlotMapLoads(t *testing.T) {
	c := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	// A short timeout, for the breaker's five failures in a row to come
	// well within the pause, on a loaded machine too.
	const pause, timeout = 4 * time.Second, 200 * time.Millisecond
	for _, m := range c.Masters {
		if err := m.Client(t).Do(ctx, "CLIENT", "PAUSE", pause.Milliseconds(), "ALL").Err(); err != nil {
			t.Fatal(err)
		}
	}
	paused := time.Now()
	h := caddyfileHandler(t, fmt.Sprintf(`rate_limit 100 1000 {
	zone unknownslots
	key {http.request.header.X-Key}
	redis {
		address %s
		timeout %v
	}
}`, strings.Join(c.Addrs, " "), timeout))
	logs := observeLogs(h, zap.DebugLevel)
	for i := 0; breakerGauge(t, "unknownslots") == 0; i++ {
		if time.Since(paused) > pause-timeout {
			t.Fatalf("the breaker of the unknown slot map did not open while the nodes were paused (%d requests)", i)
		}
		hit(h, "k"+strconv.Itoa(i))
	}
	if opened := logs.FilterMessageSnippet("circuit breaker opened").All(); len(opened) == 0 || opened[0].ContextMap()["node"] != redisbatch.UnknownSlots {
		t.Fatalf("the open breaker is not the unknown slot map's: %v", opened)
	}
	resumed := eventually(t, 10*time.Second, "limiting resumes", func() bool {
		_, remaining, _ := hit(h, "after")
		return remaining != "-1" && remaining != ""
	})
	dropped := eventually(t, 5*time.Second, "the gauge returns to 0", func() bool {
		hit(h, "after")
		return breakerGauge(t, "unknownslots") == 0
	})
	t.Logf("limiting resumed %v after the breaker opened; the gauge read 0 %v later", resumed.Round(time.Millisecond), dropped.Round(time.Millisecond))
	closed := logs.FilterMessageSnippet("circuit breaker closed").All()
	if len(closed) != 1 || closed[0].ContextMap()["node"] != redisbatch.UnknownSlots {
		t.Errorf("'circuit breaker closed' logged for %v, want once for %q", closed, redisbatch.UnknownSlots)
	}
	for _, e := range closed {
		t.Logf("logged: %s", e.Message)
	}
}
