// package caddyproc runs real Caddy processes for tests: a Caddy binary
// with this module (what xcaddy would build) is built once per test
// binary, and each Instance is one `caddy run` on free loopback ports,
// stopped by PID in t.Cleanup.
//
// Configurations are Caddyfiles in which {{http_port}} and {{admin_port}}
// are replaced by the instance's ports. The admin endpoint must be
// 127.0.0.1:{{admin_port}}, since Start waits on it and Reload uses it;
// Caddyfile(sites) puts such global options before the sites.
//
// The binary is built with `go build` of ./caddy (with -race when the
// test binary has it) into os.TempDir()/caddyproc-<pid>-*; without a
// TestMain a test binary cannot remove it on exit, so the next build
// removes the directories of test binaries no longer running. A data
// race that a -race Caddy reports fails the test that ran it.
//
// Under `go test -short`, Binary and Start skip the test instead.
package caddyproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/testproc"
)

const (
	readyTimeout = 20 * time.Second
	// oldListenersTimeout bounds the wait, after a config load, for the
	// old config's sockets to close.
	oldListenersTimeout = 10 * time.Second
	stopTimeout         = 10 * time.Second
	// bindAttempts covers losing a free port to another process between
	// probing it and Caddy binding it.
	bindAttempts = 5
	// dirPrefix names the build directories in os.TempDir(); the PID of
	// the test binary follows, so later runs can remove those left over.
	dirPrefix = "caddyproc-"
)

// Caddyfile returns a Caddyfile with global options for an instance:
// the admin endpoint on {{admin_port}}, HTTP on {{http_port}}, no HTTPS
// and a short grace period; sites follow them.
func Caddyfile(sites string) string {
	return `{
	admin 127.0.0.1:{{admin_port}}
	default_bind 127.0.0.1
	http_port {{http_port}}
	auto_https off
	skip_install_trust
	persist_config off
	grace_period 2s
}
` + sites
}

var build struct {
	once   sync.Once
	path   string
	err    error
	took   time.Duration
	logged atomic.Bool
}

// Binary returns the path of the Caddy binary, building it on first use
// (later calls wait for that build). It is built with -race when the
// test binary is, so that the build cache already holds every package.
//
// Under -short it skips the test (testproc.SkipShort), and so does Start,
// which calls it.
func Binary(tb testing.TB) string {
	tb.Helper()
	testproc.SkipShort(tb, "a Caddy process")
	build.once.Do(func() {
		start := time.Now()
		build.path, build.err = buildCaddy()
		build.took = time.Since(start)
	})
	if build.err != nil {
		tb.Fatalf("caddyproc: building Caddy: %v", build.err)
	}
	if !build.logged.Swap(true) {
		tb.Logf("caddyproc: built %s in %v (race detector: %v)", build.path, build.took.Round(time.Millisecond), raceEnabled)
	}
	return build.path
}

func buildCaddy() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("cannot locate the caddyproc source")
	}
	removeStaleBuilds()
	dir, err := os.MkdirTemp("", dirPrefix+strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "caddy")
	// No DWARF: a quicker link of a smaller binary; stack traces stay.
	args := []string{"build", "-ldflags=-w", "-o", out}
	if raceEnabled {
		args = append(args, "-race")
	}
	args = append(args, "./caddy")
	cmd := exec.Command("go", args...)
	cmd.Dir = filepath.Dir(file)
	if output, err := cmd.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, output)
	}
	return out, nil
}

// removeStaleBuilds deletes the build directories of test binaries that
// are no longer running: a test binary cannot remove its own on exit
// without a TestMain.
func removeStaleBuilds() {
	matches, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, m := range matches {
		rest := strings.TrimPrefix(filepath.Base(m), dirPrefix)
		pidText, _, _ := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidText)
		if err != nil || pid == os.Getpid() {
			continue
		}
		if !alive(pid) {
			os.RemoveAll(m)
		}
	}
}

// alive says whether a process with the PID exists.
func alive(pid int) bool {
	p, err := os.FindProcess(pid)
	if err != nil {
		return false
	}
	err = p.Signal(syscall.Signal(0))
	return err == nil || errors.Is(err, syscall.EPERM)
}

// Instance is one running Caddy process.
type Instance struct {
	// HTTPPort and AdminPort are the ports templated into the Caddyfile.
	HTTPPort, AdminPort int
	// URL is "http://127.0.0.1:<HTTPPort>".
	URL string
	// Dir holds the Caddyfile, Caddy's home (autosave, storage) and the log.
	Dir string
	// LogFile receives Caddy's stdout and stderr.
	LogFile string

	tb   testing.TB
	proc testproc.Process
}

// Start runs Caddy with the Caddyfile (see the package doc for the port
// markers; sites usually are http://127.0.0.1:{{http_port}}) and waits until its admin endpoint answers and its HTTP port
// accepts connections. Cleanup stops it; if the test failed, the log's
// tail is written to the test log.
func Start(tb testing.TB, caddyfile string) *Instance {
	tb.Helper()
	if !strings.Contains(caddyfile, "{{admin_port}}") {
		tb.Fatalf("caddyproc: the Caddyfile must set `admin 127.0.0.1:{{admin_port}}`")
	}
	bin := Binary(tb) // under -short it skips the test here
	dir := tb.TempDir()
	inst := &Instance{Dir: dir, LogFile: filepath.Join(dir, "caddy.log"), tb: tb}
	tb.Cleanup(func() {
		if !inst.Stop() {
			tb.Errorf("caddyproc: Caddy (pid %d) did not exit within %v of SIGTERM; killed", inst.PID(), stopTimeout)
		}
		if log := testproc.ReadFrom(inst.LogFile, 0); strings.Contains(log, "WARNING: DATA RACE") {
			tb.Errorf("caddyproc: the race detector reported a data race in Caddy (pid %d); see %s:\n%s",
				inst.PID(), inst.LogFile, raceReports(log))
		}
		if tb.Failed() {
			tb.Logf("caddyproc: Caddy on %s: last lines of %s:\n%s", inst.URL, inst.LogFile, inst.LogTail(40))
		}
	})
	start := time.Now()
	var err error
	for attempt := 0; attempt < bindAttempts; attempt++ {
		ports, perr := testproc.FreePorts(2)
		if perr != nil {
			tb.Fatalf("caddyproc: %v", perr)
		}
		inst.HTTPPort, inst.AdminPort = ports[0], ports[1]
		inst.URL = "http://127.0.0.1:" + strconv.Itoa(inst.HTTPPort)
		if err = inst.boot(bin, caddyfile); err == nil || !errors.Is(err, errBind) {
			break
		}
	}
	if err != nil {
		tb.Fatalf("caddyproc: starting Caddy: %v\n--- %s ---\n%s", err, inst.LogFile, inst.LogTail(40))
	}
	tb.Logf("caddyproc: Caddy pid %d serving %s (admin port %d), ready in %v",
		inst.PID(), inst.URL, inst.AdminPort, time.Since(start).Round(time.Millisecond))
	return inst
}

var errBind = errors.New("address already in use")

// Rewrite, when set, rewrites each Caddyfile that an instance runs or
// loads, after Template filled in its ports: the plugin's tests give
// their rate_limit handlers a Redis timeout for a loaded machine there.
var Rewrite func(caddyfile string) string

// Template replaces the port markers with this instance's ports, then
// applies Rewrite.
func (inst *Instance) Template(caddyfile string) string {
	caddyfile = strings.NewReplacer(
		"{{http_port}}", strconv.Itoa(inst.HTTPPort),
		"{{admin_port}}", strconv.Itoa(inst.AdminPort),
	).Replace(caddyfile)
	if Rewrite != nil {
		caddyfile = Rewrite(caddyfile)
	}
	return caddyfile
}

func (inst *Instance) boot(bin, caddyfile string) error {
	config := filepath.Join(inst.Dir, "Caddyfile")
	if err := os.WriteFile(config, []byte(inst.Template(caddyfile)), 0o644); err != nil {
		return err
	}
	logStart := testproc.FileSize(inst.LogFile)
	logf, err := os.OpenFile(inst.LogFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "run", "--config", config, "--adapter", "caddyfile")
	cmd.Dir = inst.Dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	// Caddy's autosave, certificates and locks stay in the instance's dir.
	// A -race build would otherwise linger a second at exit.
	cmd.Env = append(os.Environ(),
		"GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"),
		"HOME="+inst.Dir,
		"XDG_CONFIG_HOME="+filepath.Join(inst.Dir, "config"),
		"XDG_DATA_HOME="+filepath.Join(inst.Dir, "data"),
	)
	exited, err := inst.proc.Start(cmd)
	if err != nil {
		return fmt.Errorf("exec %s: %w", bin, err)
	}

	deadline := time.Now().Add(readyTimeout)
	client := &http.Client{Timeout: time.Second}
	adminURL := fmt.Sprintf("http://127.0.0.1:%d/config/", inst.AdminPort)
	var lastErr error
	for {
		select {
		case <-exited:
			if strings.Contains(testproc.ReadFrom(inst.LogFile, logStart), "address already in use") {
				return fmt.Errorf("caddy exited: %w", errBind)
			}
			return fmt.Errorf("caddy exited before it was ready (%s)", cmd.ProcessState)
		default:
		}
		if lastErr = ready(client, adminURL, inst.HTTPPort); lastErr == nil {
			return nil
		}
		if time.Now().After(deadline) {
			inst.Stop()
			return fmt.Errorf("not ready within %v: %v", readyTimeout, lastErr)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

func ready(client *http.Client, adminURL string, httpPort int) error {
	resp, err := client.Get(adminURL)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", adminURL, resp.Status)
	}
	conn, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(httpPort), time.Second)
	if err != nil {
		return err
	}
	return conn.Close()
}

// Reload loads a new Caddyfile through the admin endpoint's /load, as
// `caddy reload` does, and fails the test unless Caddy accepts it.
func (inst *Instance) Reload(tb testing.TB, caddyfile string) {
	tb.Helper()
	if err := inst.Load(caddyfile); err != nil {
		tb.Fatalf("caddyproc: reload: %v", err)
	}
}

// Load is Reload returning the error, for use off the test goroutine.
// Once Caddy took the config, it waits until the sockets of the config
// before have closed (see testproc.ListenersOn): a request sent after
// Load returns meets the new config only.
func (inst *Instance) Load(caddyfile string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	old, _ := testproc.ListenersOn(inst.HTTPPort)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost,
		fmt.Sprintf("http://127.0.0.1:%d/load", inst.AdminPort), strings.NewReader(inst.Template(caddyfile)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST /load: %s: %s", resp.Status, bytes.TrimSpace(body))
	}
	return old.AwaitClosed(oldListenersTimeout, inst.HTTPPort)
}

// PID is the process ID of the running Caddy, or 0.
func (inst *Instance) PID() int { return inst.proc.PID() }

// Stop sends SIGTERM (graceful shutdown) and waits; past stopTimeout it
// kills the process and reports false. Stopping twice is harmless.
func (inst *Instance) Stop() bool { return inst.proc.Stop(stopTimeout) }

// raceReports extracts the race detector's reports from a log.
func raceReports(log string) string {
	var b strings.Builder
	for _, report := range strings.Split(log, "==================\n")[1:] {
		if strings.HasPrefix(report, "WARNING: DATA RACE") {
			b.WriteString(report)
		}
	}
	return b.String()
}

// Kill sends SIGKILL, as a crash would end Caddy: no cleanup runs. It
// reports whether the process is gone within the stop timeout.
func (inst *Instance) Kill() bool { return inst.proc.Kill(stopTimeout) }

// LogTail returns the last n lines of Caddy's log.
func (inst *Instance) LogTail(n int) string { return testproc.LogTail(inst.LogFile, n) }
