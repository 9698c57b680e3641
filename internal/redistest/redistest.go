// package redistest starts real redis-server processes on free loopback
// ports for tests: standalone, TLS, cluster and sentinel setups.
//
// Every process is started by the test binary, bound to 127.0.0.1, keeps
// its data and log in a t.TempDir(), and is killed by PID in t.Cleanup.
// Nothing here ever talks to a Redis the package did not start.
//
// Under `go test -short` every Start* function skips the test instead
// (testproc.SkipShort): the fast tier runs without any server.
package redistest

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/testproc"
	"github.com/redis/go-redis/v9"
)

const (
	readyTimeout = 5 * time.Second
	pollInterval = 25 * time.Millisecond
	// stopTimeout bounds a graceful Stop before falling back to SIGKILL.
	stopTimeout = 10 * time.Second
	// bindAttempts covers the window between probing a free port and
	// redis binding it, in which another process may grab the port.
	bindAttempts = 5
)

// Server is one redis-server process (standalone, cluster node or sentinel).
type Server struct {
	// Addr is "127.0.0.1:<Port>"; for TLS servers it is the TLS address.
	Addr string
	// Port is the client port (the TLS port for TLS servers).
	Port int
	// Dir is the server's working directory, removed after the test.
	Dir string
	// LogFile receives redis's log plus anything it prints to stdout/stderr.
	LogFile string

	ports     []int // all ports the process binds; ports[0] == Port
	argsFn    func(ports []int) []string
	tlsConfig *tls.Config // used by readiness checks and clients

	proc  testproc.Process
	mu    sync.Mutex
	admin *redis.Client // lazily created, for the harness's own polling
}

// spec describes how to launch a server; startServers turns it into a Server.
type spec struct {
	nports    int
	ports     []int // optional pre-chosen ports for the first attempt
	argsFn    func(dir string, ports []int) []string
	tlsConfig *tls.Config
	dir       string // optional; a fresh TempDir otherwise
}

// Start starts a standalone redis-server and waits until it answers PING.
// extraArgs are appended to the command line (e.g. "--maxmemory", "1mb").
func Start(tb testing.TB, extraArgs ...string) *Server {
	tb.Helper()
	return startServers(tb, []spec{plainSpec(extraArgs...)})[0]
}

func plainSpec(extraArgs ...string) spec {
	extra := append([]string(nil), extraArgs...)
	return spec{
		nports: 1,
		argsFn: func(dir string, ports []int) []string {
			args := append(baseArgs(dir), "--port", strconv.Itoa(ports[0]))
			return append(args, extra...)
		},
	}
}

// baseArgs are shared by every data node. The diskless sync delay defaults
// to 5 s, which would dominate replica start-up, so it is zeroed.
func baseArgs(dir string) []string {
	return []string{
		"--bind", "127.0.0.1",
		"--daemonize", "no",
		"--save", "",
		"--appendonly", "no",
		"--dir", dir,
		"--logfile", filepath.Join(dir, "redis.log"),
		"--repl-diskless-sync", "yes",
		"--repl-diskless-sync-delay", "0",
		"--enable-debug-command", "local",
	}
}

// startServers launches all specs concurrently and waits until each answers
// PING. Cleanup (kill by PID) is registered before anything is started.
// Every server of the package starts here, so under -short every test
// that needs one is skipped here.
func startServers(tb testing.TB, specs []spec) []*Server {
	tb.Helper()
	testproc.SkipShort(tb, "redis-server")
	requireRedisServer(tb)
	servers := make([]*Server, len(specs))
	for i, sp := range specs {
		dir := sp.dir
		if dir == "" {
			dir = tb.TempDir()
		}
		s := &Server{
			Dir:       dir,
			LogFile:   filepath.Join(dir, "redis.log"),
			tlsConfig: sp.tlsConfig,
		}
		argsFn := sp.argsFn
		s.argsFn = func(ports []int) []string { return argsFn(dir, ports) }
		servers[i] = s
		tb.Cleanup(s.cleanup)
	}
	errs := make([]error, len(specs))
	var wg sync.WaitGroup
	for i := range specs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = servers[i].bootFresh(specs[i].nports, specs[i].ports)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			tb.Fatalf("redistest: starting redis-server (%s): %v\n--- log tail (%s) ---\n%s",
				servers[i].Dir, err, servers[i].LogFile, servers[i].LogTail(30))
		}
	}
	return servers
}

// requireRedisServer fails the test, saying how to install it, when
// redis-server is not on PATH.
func requireRedisServer(tb testing.TB) {
	tb.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		tb.Fatalf("redistest: redis-server not found on PATH (%v); `make test` installs it "+
			"(apt-get install redis-server redis-tools)", err)
	}
}

// bootFresh picks free ports (or uses pre-chosen ones on the first try) and
// starts the process, retrying with new ports if a bind race is lost.
func (s *Server) bootFresh(nports int, preset []int) error {
	var err error
	for attempt := 0; attempt < bindAttempts; attempt++ {
		ports := preset
		if attempt > 0 || len(ports) != nports {
			if ports, err = testproc.FreePorts(nports); err != nil {
				return err
			}
		}
		s.ports = ports
		s.Port = ports[0]
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0]))
		if err = s.boot(); err == nil || !errors.Is(err, errBind) {
			return err
		}
	}
	return err
}

var errBind = errors.New("address already in use")

// boot starts the process on s.ports and waits for PING.
func (s *Server) boot() error {
	logStart := testproc.FileSize(s.LogFile)
	// Stdout/stderr go to the log too, so config errors printed before
	// redis opens its logfile still show up in LogTail.
	f, err := os.OpenFile(s.LogFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	cmd := exec.Command("redis-server", s.argsFn(s.ports)...)
	cmd.Dir = s.Dir
	cmd.Stdout = f
	cmd.Stderr = f
	exited, err := s.proc.Start(cmd)
	if err != nil {
		return fmt.Errorf("exec redis-server: %w", err)
	}

	// If the port was lost to another listener, a PING there would hang
	// until its deadline; abort it as soon as redis exits instead.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-exited:
			cancel()
		case <-ctx.Done():
		}
	}()
	deadline := time.Now().Add(readyTimeout)
	var lastErr error
	for {
		select {
		case <-exited:
			out := testproc.ReadFrom(s.LogFile, logStart)
			if strings.Contains(out, "Address already in use") {
				return fmt.Errorf("redis-server exited: %w", errBind)
			}
			return fmt.Errorf("redis-server exited before answering PING (%s)", cmd.ProcessState)
		default:
		}
		if lastErr = ping(ctx, s.Addr, s.tlsConfig); lastErr == nil {
			return nil
		}
		if time.Now().After(deadline) {
			s.kill()
			return fmt.Errorf("no PONG from %s within %v: %v", s.Addr, readyTimeout, lastErr)
		}
		time.Sleep(pollInterval)
	}
}

// ping sends a raw RESP PING so readiness checks need no client state and
// produce no go-redis log noise.
func ping(ctx context.Context, addr string, tlsConfig *tls.Config) error {
	d := &net.Dialer{Timeout: 250 * time.Millisecond}
	var conn net.Conn
	var err error
	if tlsConfig != nil {
		conn, err = (&tls.Dialer{NetDialer: d, Config: tlsConfig}).DialContext(ctx, "tcp", addr)
	} else {
		conn, err = d.DialContext(ctx, "tcp", addr)
	}
	if err != nil {
		return err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	_ = conn.SetDeadline(time.Now().Add(time.Second))
	if _, err := conn.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return err
	}
	if line = strings.TrimSpace(line); line != "+PONG" {
		return fmt.Errorf("PING replied %q", line)
	}
	return nil
}

// Options returns go-redis options for this server (TLS included), for
// callers that want to tune timeouts before creating their own client.
func (s *Server) Options() *redis.Options {
	o := &redis.Options{Addr: s.Addr}
	if s.tlsConfig != nil {
		o.TLSConfig = s.tlsConfig.Clone()
	}
	return o
}

// Client returns a go-redis client for the server, closed in Cleanup.
func (s *Server) Client(tb testing.TB) *redis.Client {
	tb.Helper()
	c := redis.NewClient(s.Options())
	tb.Cleanup(func() { c.Close() })
	return c
}

// adminClient is the harness's own connection: short timeouts and no
// retries so polling loops stay responsive while nodes die.
func (s *Server) adminClient() *redis.Client {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.admin == nil {
		s.admin = redis.NewClient(s.adminOptions())
	}
	return s.admin
}

func (s *Server) adminOptions() *redis.Options {
	o := s.Options()
	o.Protocol = 2
	o.MaxRetries = -1
	o.DialTimeout = 500 * time.Millisecond
	o.ReadTimeout = time.Second
	o.WriteTimeout = time.Second
	o.PoolSize = 2
	return o
}

// PID returns the PID of the most recently started process.
func (s *Server) PID() int { return s.proc.PID() }

// Running reports whether the process is alive (not stopped or killed).
func (s *Server) Running() bool { return s.proc.Running() }

// Stop shuts the server down gracefully (SIGTERM; with saving disabled this
// is SHUTDOWN NOSAVE) and waits for it to exit. No-op if not running.
func (s *Server) Stop(tb testing.TB) {
	tb.Helper()
	if !s.proc.Stop(stopTimeout) {
		tb.Fatalf("redistest: %s did not exit within %v of SIGTERM; killed\n--- log tail ---\n%s",
			s.Addr, stopTimeout, s.LogTail(20))
	}
}

// Kill sends SIGKILL and waits for the process to exit. No-op if not running.
func (s *Server) Kill(tb testing.TB) {
	tb.Helper()
	if !s.proc.Kill(stopTimeout) {
		tb.Fatalf("redistest: %s (pid %d) did not exit after SIGKILL", s.Addr, s.PID())
	}
}

// Restart starts the server again on the same port(s) with the same
// arguments and data dir (cluster nodes keep nodes.conf) and waits for
// PING. A running server is stopped gracefully first.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.Stop(tb)
	var err error
	// The port cannot change, so a bind failure (e.g. a lingering socket)
	// is retried in place.
	for attempt := 0; attempt < bindAttempts*4; attempt++ {
		if err = s.boot(); err == nil || !errors.Is(err, errBind) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		tb.Fatalf("redistest: restarting %s: %v\n--- log tail ---\n%s", s.Addr, err, s.LogTail(30))
	}
}

func (s *Server) kill() { s.proc.Kill(stopTimeout) }

func (s *Server) cleanup() {
	s.kill()
	s.mu.Lock()
	admin := s.admin
	s.admin = nil
	s.mu.Unlock()
	if admin != nil {
		admin.Close()
	}
}

// LogTail returns the last n lines of the server's log.
func (s *Server) LogTail(n int) string { return testproc.LogTail(s.LogFile, n) }

// infoField extracts "field:value" from INFO or CLUSTER INFO output.
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// pollUntil calls check every pollInterval until it returns "" (success)
// or timeout passes; it returns the last non-empty reason on timeout.
func pollUntil(timeout time.Duration, check func(ctx context.Context) string) string {
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		reason := check(ctx)
		cancel()
		if reason == "" {
			return ""
		}
		if time.Now().After(deadline) {
			return reason
		}
		time.Sleep(pollInterval)
	}
}

// StartBlackhole listens on a loopback port, accepts connections and never
// writes to them, to simulate a hung Redis. Connections stay open until
// Cleanup. It returns the listener's address.
func StartBlackhole(tb testing.TB) string {
	tb.Helper()
	// No process, but it stands for a hung Redis: the tests that use it
	// wait out timeouts, and belong with the Redis tier.
	testproc.SkipShort(tb, "a stand-in for a hung Redis")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("redistest: blackhole listen: %v", err)
	}
	var (
		mu     sync.Mutex
		conns  []net.Conn
		drains sync.WaitGroup
		done   = make(chan struct{})
	)
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			// Drain what the client sends so its writes never block; never reply.
			drains.Add(1)
			go func() {
				defer drains.Done()
				_, _ = io.Copy(io.Discard, c)
			}()
		}
	}()
	tb.Cleanup(func() {
		l.Close()
		<-done
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		drains.Wait()
	})
	return l.Addr().String()
}

// ScriptCalls counts the script commands (EVAL, EVALSHA and their _RO
// forms) the Redis of rdb has served.
func ScriptCalls(tb testing.TB, rdb *redis.Client) int64 {
	tb.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		tb.Fatal(err)
	}
	var total int64
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "cmdstat_eval") {
			continue
		}
		_, rest, _ := strings.Cut(line, "calls=")
		n, _, _ := strings.Cut(rest, ",")
		v, _ := strconv.ParseInt(n, 10, 64)
		total += v
	}
	return total
}
