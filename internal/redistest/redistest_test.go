package redistest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// eventually retries fn until it succeeds, for operations that need a
// client to notice a topology change.
func eventually(t *testing.T, timeout time.Duration, fn func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := fn()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("still failing after %v: %v", timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestStartPingRestart(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 30*time.Second)
	s := Start(t, "--maxmemory", "1mb")
	if !strings.HasPrefix(s.Addr, "127.0.0.1:") || s.Port == 0 || s.Port == 6379 {
		t.Fatalf("unexpected address %q port %d", s.Addr, s.Port)
	}
	c := s.Client(t)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	if got := c.ConfigGet(ctx, "maxmemory").Val()["maxmemory"]; got != "1048576" {
		t.Fatalf("extra args not applied: maxmemory=%q", got)
	}
	if !strings.Contains(s.LogTail(50), "Ready to accept connections") {
		t.Fatalf("log tail lacks readiness line:\n%s", s.LogTail(50))
	}

	port, pid := s.Port, s.PID()
	s.Kill(t)
	if s.Running() {
		t.Fatal("Running() after Kill")
	}
	if err := ping(context.Background(), s.Addr, nil); err == nil {
		t.Fatal("PING succeeded after Kill")
	}
	s.Restart(t)
	if s.Port != port || s.PID() == pid || !s.Running() {
		t.Fatalf("after restart: port %d (want %d), pid %d (old %d), running %v", s.Port, port, s.PID(), pid, s.Running())
	}
	eventually(t, 5*time.Second, func() error { return c.Ping(ctx).Err() })
	if got := c.ConfigGet(ctx, "maxmemory").Val()["maxmemory"]; got != "1048576" {
		t.Fatalf("extra args lost on restart: maxmemory=%q", got)
	}

	// Graceful stop, then restart again.
	s.Stop(t)
	if s.Running() {
		t.Fatal("Running() after Stop")
	}
	s.Restart(t)
	if s.Port != port {
		t.Fatalf("port changed on second restart: %d != %d", s.Port, port)
	}
	eventually(t, 5*time.Second, func() error { return c.Ping(ctx).Err() })
}

func TestBlackhole(t *testing.T) {
	t.Parallel()
	addr := StartBlackhole(t)
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatalf("dial blackhole: %v", err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
		t.Fatalf("write: %v", err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	var ne net.Error
	if _, err := conn.Read(make([]byte, 16)); !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("read from blackhole: want timeout, got %v", err)
	}

	// A go-redis client with a short read timeout must time out, not hang.
	c := redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: 200 * time.Millisecond, MaxRetries: -1})
	defer c.Close()
	start := time.Now()
	if err := c.Ping(context.Background()).Err(); err == nil {
		t.Fatal("PING to blackhole succeeded")
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("PING to blackhole took %v", d)
	}
}

func TestTLS(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 30*time.Second)

	t.Run("client cert required", func(t *testing.T) {
		t.Parallel()
		s := StartTLS(t, true)
		if err := s.Client(t).Ping(ctx).Err(); err != nil {
			t.Fatalf("PING with CA and client cert: %v", err)
		}

		// plain TCP to the TLS port must not work.
		plain := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, ReadTimeout: time.Second})
		defer plain.Close()
		if err := plain.Ping(ctx).Err(); err == nil {
			t.Fatal("plain-text PING to TLS port succeeded")
		}

		other := s.TLSConfig()
		other.RootCAs = loadPool(t, s.OtherCAFile)
		if err := pingTLS(ctx, s.Addr, other); err == nil {
			t.Fatal("PING trusting the other CA succeeded")
		} else if !strings.Contains(err.Error(), "certificate") {
			t.Fatalf("wrong-CA error does not mention certificates: %v", err)
		}

		noCert := s.TLSConfig()
		noCert.Certificates = nil
		if err := pingTLS(ctx, s.Addr, noCert); err == nil {
			t.Fatal("PING without client cert succeeded although one is required")
		}

		// The files must be usable by other TLS stacks (e.g. Caddy config).
		if _, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile); err != nil {
			t.Fatalf("server pair: %v", err)
		}
	})

	t.Run("client cert optional", func(t *testing.T) {
		t.Parallel()
		s := StartTLS(t, false)
		noCert := s.TLSConfig()
		noCert.Certificates = nil
		if err := pingTLS(ctx, s.Addr, noCert); err != nil {
			t.Fatalf("PING without client cert: %v", err)
		}
		byName := s.TLSConfig()
		byName.ServerName = "localhost"
		if err := pingTLS(ctx, s.Addr, byName); err != nil {
			t.Fatalf("PING verifying SAN localhost: %v", err)
		}
	})
}

func loadPool(t *testing.T, file string) *x509.CertPool {
	t.Helper()
	pemData, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemData) {
		t.Fatalf("no certificates in %s", file)
	}
	return pool
}

func pingTLS(ctx context.Context, addr string, cfg *tls.Config) error {
	c := redis.NewClient(&redis.Options{Addr: addr, TLSConfig: cfg, MaxRetries: -1,
		DialTimeout: time.Second, ReadTimeout: time.Second})
	defer c.Close()
	return c.Ping(ctx).Err()
}

func TestCluster(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 45*time.Second)
	start := time.Now()
	c := StartCluster(t, 3, 1)
	t.Logf("3+3 cluster up in %v", time.Since(start))
	if len(c.Masters) != 3 || len(c.Replicas) != 3 || len(c.Addrs) != 6 {
		t.Fatalf("unexpected topology: %d masters, %d replicas, %d addrs", len(c.Masters), len(c.Replicas), len(c.Addrs))
	}
	cc := c.Client(t)

	const keys = 300
	for i := 0; i < keys; i++ {
		if err := cc.Set(ctx, fmt.Sprintf("key:%d", i), i, 0).Err(); err != nil {
			t.Fatalf("SET key:%d: %v", i, err)
		}
	}
	perMaster := map[string]int64{}
	for _, m := range c.Masters {
		perMaster[m.Addr] = m.adminClient().DBSize(ctx).Val()
	}
	for addr, n := range perMaster {
		if n == 0 {
			t.Fatalf("master %s holds no keys; distribution %v", addr, perMaster)
		}
	}
	checkKeys := func() error {
		for i := 0; i < keys; i++ {
			got, err := cc.Get(ctx, fmt.Sprintf("key:%d", i)).Int()
			if err != nil {
				return fmt.Errorf("GET key:%d: %w", i, err)
			}
			if got != i {
				return fmt.Errorf("GET key:%d = %d", i, got)
			}
		}
		return nil
	}
	if err := checkKeys(); err != nil {
		t.Fatal(err)
	}

	// Make sure replicas have everything before killing a master.
	for _, m := range c.Masters {
		if n, err := m.adminClient().Do(ctx, "WAIT", 1, 2000).Int(); err != nil || n < 1 {
			t.Fatalf("WAIT on %s: %d replicas, %v", m.Addr, n, err)
		}
	}

	victim, heir := c.Masters[0], c.Replicas[0]
	killed := time.Now()
	victim.Kill(t)
	c.WaitHealthy(t, 15*time.Second)
	t.Logf("failover healthy %v after kill", time.Since(killed))
	if role := infoField(heir.adminClient().Info(ctx, "replication").Val(), "role"); role != "master" {
		t.Fatalf("replica %s of killed master has role %q", heir.Addr, role)
	}
	// go-redis only refreshes its slot map on MOVED/ASK or every
	// ClusterStateReloadInterval (60 s by default); a dead master yields
	// "connection refused", not MOVED, so ask for a reload explicitly.
	cc.ReloadState(ctx)
	eventually(t, 5*time.Second, checkKeys)
	if err := cc.Set(ctx, "after-failover", 1, 0).Err(); err != nil {
		t.Fatalf("SET after failover: %v", err)
	}

	// The old master keeps nodes.conf, so it rejoins (as a replica).
	victim.Restart(t)
	c.WaitHealthy(t, 15*time.Second)
	eventually(t, 10*time.Second, func() error {
		info := victim.adminClient().Info(ctx, "replication").Val()
		if role := infoField(info, "role"); role != "slave" {
			return fmt.Errorf("restarted node role %q", role)
		}
		return nil
	})
}

func TestSentinel(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t, 45*time.Second)
	start := time.Now()
	st := StartSentinel(t)
	t.Logf("sentinel setup up in %v", time.Since(start))
	if len(st.SentinelAddrs) != 3 {
		t.Fatalf("want 3 sentinels, got %v", st.SentinelAddrs)
	}
	old := st.CurrentMaster(t)
	if old != st.Master.Addr {
		t.Fatalf("CurrentMaster = %s, want %s", old, st.Master.Addr)
	}
	fc := st.FailoverClient(t)
	if err := fc.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET via sentinel: %v", err)
	}
	if n, err := st.Master.adminClient().Do(ctx, "WAIT", 1, 2000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT: %d, %v", n, err)
	}

	killed := time.Now()
	st.Master.Kill(t)
	got := st.WaitFailover(t, old, 20*time.Second)
	t.Logf("failover took %v", time.Since(killed))
	if got != st.Replica.Addr {
		t.Fatalf("new master %s, want replica %s", got, st.Replica.Addr)
	}
	if cur := st.CurrentMaster(t); cur != got {
		t.Fatalf("CurrentMaster %s after failover, want %s", cur, got)
	}
	eventually(t, 10*time.Second, func() error {
		v, err := fc.Get(ctx, "k").Result()
		if err == nil && v != "v" {
			err = fmt.Errorf("GET k = %q", v)
		}
		return err
	})
	eventually(t, 10*time.Second, func() error { return fc.Set(ctx, "k2", "v2", 0).Err() })
}

func TestBindRaceRetry(t *testing.T) {
	t.Parallel()
	// Occupy a port and hand it to the first attempt, as if another process
	// grabbed it between the probe and redis binding it.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	taken := l.Addr().(*net.TCPAddr).Port
	sp := plainSpec()
	sp.ports = []int{taken}
	s := startServers(t, []spec{sp})[0]
	if s.Port == taken {
		t.Fatalf("server claims the occupied port %d", taken)
	}
	if err := ping(context.Background(), s.Addr, nil); err != nil {
		t.Fatalf("PING after retry: %v", err)
	}
	if !strings.Contains(s.LogTail(100), "Address already in use") {
		t.Fatalf("first attempt did not hit the occupied port; log:\n%s", s.LogTail(100))
	}
}

// fatalTB records Fatalf instead of ending the test, so the failure path
// itself can be checked.
type fatalTB struct {
	*testing.T
	msg string
}

type fatalled struct{}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(fatalled{})
}

// TestMissingBinary checks what every function that starts a
// redis-server says when it is missing (they all call requireRedisServer;
// calling it directly keeps the test in the -short tier, where Start
// skips).
func TestMissingBinary(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	ftb := &fatalTB{T: t}
	func() {
		defer func() {
			if r := recover(); r != nil {
				if _, ok := r.(fatalled); !ok {
					panic(r)
				}
			}
		}()
		requireRedisServer(ftb)
	}()
	if !strings.Contains(ftb.msg, "make test") || !strings.Contains(ftb.msg, "apt-get install redis-server") {
		t.Fatalf("unhelpful message: %q", ftb.msg)
	}
}
