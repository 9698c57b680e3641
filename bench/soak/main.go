// Command soak is the driver of scripts/soak.sh (`make soak`): minutes of
// load against two Caddy instances that share one rate_limit zone in one
// Redis, while that Redis is stopped, restarted and flushed on a schedule;
// then it checks that the limit held and that nothing failed.
//
//	soak freeport
//	soak run -targets http://127.0.0.1:P1,http://127.0.0.1:P2 -redis-port P -redis-dir DIR
//	         [-caddy-logs a.log,b.log] [-d 3m] [-clients 32] [-keys 8] [-client-rps 100] ...
//
// freeport prints a free loopback TCP port.
//
// run owns the redis-server: it starts it on 127.0.0.1:<redis-port>
// (`--save "" --appendonly no`), waits until every Caddy instance answers
// with a live bucket (X-RateLimit-Remaining >= 0) and reads the limit from
// the X-RateLimit-* headers. Then -clients clients, each with its own
// keep-alive connections and one of -keys X-Key values, send GETs for -d,
// alternating between the instances and pacing themselves to at most
// -client-rps each. Every request is recorded: send time, key, instance,
// status, latency and X-RateLimit-Remaining (-1: Redis failed). Meanwhile
// the faults, at fractions of -d:
//
//	20%  stop Redis (SIGTERM to its PID) for -outage, then start it again on the same port
//	50%  SCRIPT FLUSH
//	70%  stop Redis for -outage again, then start it again
//
// The summary reports the outcomes of all requests; the bound check (for
// every key and every -window long window, starting every -step, that
// lies outside the outages and their first -grace after the restart, the
// admitted requests may not exceed burst + rate × L, where L is the span
// from the first send to the last response of those requests: the window
// plus at most one request's latency, and a bucket may enter the window
// full); p50/p99 latency in and out of outages; how long each instance
// took to resume limiting after each restart; and what each Caddy logged
// (rate_limit WARN lines, which should be throttled to a handful, and the
// circuit breaker's opened/closed lines, from -caddy-logs).
//
// The exit status is 1 when a window exceeded the bound, a 5xx or any
// other unexpected status (anything but 200 and 429) or a transport error
// occurred, no window could be checked, or a fault could not be applied;
// 130/143 when interrupted, after stopping Redis.
package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	switch os.Args[1] {
	case "freeport":
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			fmt.Fprintln(os.Stderr, "soak:", err)
			os.Exit(1)
		}
		fmt.Println(l.Addr().(*net.TCPAddr).Port)
		l.Close()
	case "run":
		os.Exit(run(os.Args[2:]))
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: soak freeport | soak run -targets URL,URL -redis-port N -redis-dir DIR [flags]")
	os.Exit(2)
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "soak: "+format+"\n", args...)
}

type config struct {
	duration  time.Duration
	clients   int
	keys      int
	clientRPS float64
	targets   []string
	names     []string // one letter per target: A, B, ...
	caddyLogs []string
	redisPort int
	redisDir  string
	redisBin  string
	outage    time.Duration
	window    time.Duration
	step      time.Duration
	grace     time.Duration
	timeout   time.Duration
}

func parseFlags(argv []string) (config, error) {
	var c config
	var targets, logs string
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.DurationVar(&c.duration, "d", 3*time.Minute, "duration of the load")
	fs.IntVar(&c.clients, "clients", 32, "concurrent clients")
	fs.IntVar(&c.keys, "keys", 8, "distinct X-Key values (client i uses key i mod keys)")
	fs.Float64Var(&c.clientRPS, "client-rps", 100, "most requests per second per client (0: back to back)")
	fs.StringVar(&targets, "targets", "", "comma-separated base URLs of the Caddy instances")
	fs.StringVar(&logs, "caddy-logs", "", "comma-separated log files of the instances, in -targets order")
	fs.IntVar(&c.redisPort, "redis-port", 0, "loopback port for the redis-server this driver starts")
	fs.StringVar(&c.redisDir, "redis-dir", "", "working directory (and log) of that redis-server")
	fs.StringVar(&c.redisBin, "redis-server", "redis-server", "redis-server binary")
	fs.DurationVar(&c.outage, "outage", 15*time.Second, "how long Redis stays down each time (at most d/4)")
	fs.DurationVar(&c.window, "window", 5*time.Second, "bound check window length")
	fs.DurationVar(&c.step, "step", time.Second, "bound check: a window starts every step")
	fs.DurationVar(&c.grace, "grace", 2*time.Second, "bound check: skip windows this close after a restart")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Second, "HTTP request timeout")
	if err := fs.Parse(argv); err != nil {
		return c, err
	}
	for _, t := range strings.Split(targets, ",") {
		if t = strings.TrimRight(strings.TrimSpace(t), "/"); t != "" {
			c.targets = append(c.targets, t)
			c.names = append(c.names, string(rune('A'+len(c.names))))
		}
	}
	if logs != "" {
		c.caddyLogs = strings.Split(logs, ",")
	}
	switch {
	case len(c.targets) == 0 || len(c.targets) > 26:
		return c, errors.New("-targets: give 1 to 26 base URLs")
	case len(c.caddyLogs) != 0 && len(c.caddyLogs) != len(c.targets):
		return c, errors.New("-caddy-logs: give one file per target")
	case c.redisPort <= 0 || c.redisDir == "":
		return c, errors.New("-redis-port and -redis-dir are required")
	case c.duration < 10*time.Second:
		return c, errors.New("-d: at least 10s")
	case c.clients < 1 || c.keys < 1 || c.keys > 256:
		return c, errors.New("-clients must be >= 1 and -keys 1 to 256")
	case c.window <= 0 || c.step <= 0:
		return c, errors.New("-window and -step must be positive")
	}
	c.outage = min(c.outage, c.duration/4)
	return c, nil
}

func run(argv []string) int {
	cfg, err := parseFlags(argv)
	if err != nil {
		logf("%v", err)
		return 2
	}
	// A signal ends the run early; Redis is still stopped (deferred).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(signals)
	var caught atomic.Value
	go func() {
		if sig, ok := <-signals; ok {
			caught.Store(sig)
			cancel()
		}
	}()
	interrupted := func(otherwise int) int {
		if sig, ok := caught.Load().(syscall.Signal); ok {
			logf("interrupted by %v", sig)
			return 128 + int(sig)
		}
		return otherwise
	}

	rs := &redisServer{bin: cfg.redisBin, dir: cfg.redisDir, port: cfg.redisPort}
	defer rs.stop()
	if err := rs.start(); err != nil {
		logf("starting redis-server: %v (log: %s)", err, filepath.Join(cfg.redisDir, "redis.log"))
		return 1
	}
	logf("redis-server pid %d on %s", rs.pid(), rs.addr())

	lim, err := probe(ctx, cfg)
	if err != nil {
		logf("%v", err)
		return interrupted(1)
	}
	logf("limit: replenish_rate %v, burst_capacity %d, requested_tokens %d; %d clients over %d keys for %s",
		lim.rate, lim.burst, lim.requested, cfg.clients, cfg.keys, cfg.duration)

	loadCtx, cancelLoad := context.WithTimeout(ctx, cfg.duration)
	defer cancelLoad()
	t0 := time.Now()
	perClient := make([]clientResult, cfg.clients)
	var clients sync.WaitGroup
	for i := range cfg.clients {
		clients.Add(1)
		go func() {
			defer clients.Done()
			perClient[i] = runClient(loadCtx, cfg, i, t0)
		}()
	}
	var faults []fault
	var faultErr error
	faultsDone := make(chan struct{})
	go func() {
		defer close(faultsDone)
		faults, faultErr = runFaults(loadCtx, cfg, rs, t0)
		if faultErr != nil {
			cancelLoad()
		}
	}()
	clients.Wait()
	end := time.Since(t0)
	<-faultsDone
	if ctx.Err() != nil {
		return interrupted(1)
	}

	var recs []record
	var transportSamples []string
	for _, cr := range perClient {
		recs = append(recs, cr.records...)
		if cr.firstErr != "" && len(transportSamples) < 3 {
			transportSamples = append(transportSamples, cr.firstErr)
		}
	}
	logs := make([]caddyLog, len(cfg.caddyLogs))
	for i, path := range cfg.caddyLogs {
		logs[i] = readCaddyLog(path)
	}
	s := analyze(cfg, lim, recs, faults, end)
	s.transportSamples = transportSamples
	s.faultErr = faultErr
	s.logs = logs
	s.print(os.Stdout)
	if s.failed() {
		return 1
	}
	return 0
}

// --- Redis -------------------------------------------------------------------

// redisServer is the one redis-server process of the soak, started and
// stopped by PID on a fixed loopback port. Redis writes its PID to
// redis.pid in dir, so scripts/soak.sh can stop it should this driver be
// killed without a chance to.
type redisServer struct {
	bin, dir string
	port     int
	cmd      *exec.Cmd
	exited   chan struct{}
}

func (r *redisServer) addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(r.port)) }

func (r *redisServer) pid() int {
	if r.cmd == nil {
		return 0
	}
	return r.cmd.Process.Pid
}

// start starts redis-server and waits until it answers PING. The port
// may still be held for a moment after a stop, so it tries a few times.
func (r *redisServer) start() error {
	var err error
	for attempt := 0; attempt < 10; attempt++ {
		if err = r.startOnce(); err == nil {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return err
}

func (r *redisServer) startOnce() error {
	out, err := os.OpenFile(filepath.Join(r.dir, "redis.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd := exec.Command(r.bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(r.port),
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", r.dir,
		"--logfile", filepath.Join(r.dir, "redis.log"), "--pidfile", filepath.Join(r.dir, "redis.pid"))
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	r.cmd, r.exited = cmd, exited
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		if reply, err := redisCommand(r.addr(), "PING"); err == nil && reply == "+PONG" {
			return nil
		}
		select {
		case <-exited:
			r.cmd = nil
			return fmt.Errorf("redis-server exited at start (port %d taken?)", r.port)
		case <-time.After(20 * time.Millisecond):
		}
	}
	r.stop()
	return errors.New("redis-server did not answer PING within 5s")
}

// stop sends SIGTERM (without save points Redis exits without writing
// anything), waits for the process to exit, and SIGKILLs it after 5 s.
func (r *redisServer) stop() {
	if r.cmd == nil {
		return
	}
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.exited:
	case <-time.After(5 * time.Second):
		_ = r.cmd.Process.Kill()
		<-r.exited
	}
	r.cmd = nil
}

// redisCommand sends one command over a fresh connection and returns the
// first line of the reply, such as "+PONG" or "-ERR ...".
func redisCommand(addr string, args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := io.WriteString(c, b.String()); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimRight(line, "\r\n"), err
}

// --- faults ------------------------------------------------------------------

// fault is one thing done to Redis, in time since the start of the load.
type fault struct {
	kind string        // "outage" or "flush"
	at   time.Duration // SIGTERM sent / SCRIPT FLUSH sent
	dead time.Duration // outage: the process had exited
	back time.Duration // outage: the new process answered PING
}

// outage is a fault of kind "outage".
func (f fault) outage() bool { return f.kind == "outage" }

var schedule = []struct {
	frac float64
	kind string
}{{0.2, "outage"}, {0.5, "flush"}, {0.7, "outage"}}

// runFaults applies the schedule until ctx ends (-outage is at most d/4,
// so the last outage ends before the load does).
func runFaults(ctx context.Context, cfg config, rs *redisServer, t0 time.Time) ([]fault, error) {
	var done []fault
	for _, step := range schedule {
		if !sleepUntil(ctx, t0.Add(time.Duration(step.frac*float64(cfg.duration)))) {
			return done, nil
		}
		f := fault{kind: step.kind, at: time.Since(t0)}
		switch step.kind {
		case "outage":
			old := rs.pid()
			rs.stop()
			f.dead = time.Since(t0)
			logf("t=%5.1fs  stopped redis-server (pid %d)", f.at.Seconds(), old)
			if !sleepUntil(ctx, t0.Add(f.at+cfg.outage)) {
				return done, nil // interrupted; the run is over
			}
			if err := rs.start(); err != nil {
				return done, fmt.Errorf("restarting redis-server: %w", err)
			}
			f.back = time.Since(t0)
			logf("t=%5.1fs  redis-server answers again (pid %d)", f.back.Seconds(), rs.pid())
		case "flush":
			reply, err := redisCommand(rs.addr(), "SCRIPT", "FLUSH")
			if err == nil && reply != "+OK" {
				err = errors.New(reply)
			}
			if err != nil {
				return done, fmt.Errorf("SCRIPT FLUSH: %w", err)
			}
			logf("t=%5.1fs  SCRIPT FLUSH", f.at.Seconds())
		}
		done = append(done, f)
	}
	return done, nil
}

// sleepUntil sleeps until t; false if ctx ended first.
func sleepUntil(ctx context.Context, t time.Time) bool {
	timer := time.NewTimer(time.Until(t))
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-timer.C:
		return true
	}
}

// --- load --------------------------------------------------------------------

// limits are the bucket parameters, as Caddy reports them.
type limits struct {
	rate      float64
	burst     int64
	requested int64
}

// probe waits until every instance answers with a live bucket (Redis
// reachable) and returns the limit from its headers, which must agree.
// It uses a key of its own, so the soak's buckets start full.
func probe(ctx context.Context, cfg config) (limits, error) {
	client := &http.Client{Timeout: time.Second}
	var first limits
	for i, target := range cfg.targets {
		var lim limits
		var last string
		for deadline := time.Now().Add(15 * time.Second); ; {
			if ctx.Err() != nil {
				return first, ctx.Err()
			}
			if time.Now().After(deadline) {
				return first, fmt.Errorf("instance %s (%s) did not answer with a live bucket within 15s; last: %s",
					cfg.names[i], target, last)
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, target+"/", nil)
			req.Header.Set("X-Key", "soak-probe")
			resp, err := client.Do(req)
			if err != nil {
				last = err.Error()
				time.Sleep(100 * time.Millisecond)
				continue
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			h := resp.Header
			last = fmt.Sprintf("status %d, X-RateLimit-Remaining %q", resp.StatusCode, h.Get("X-RateLimit-Remaining"))
			if resp.StatusCode != http.StatusOK || parseRemaining(h.Get("X-RateLimit-Remaining")) < 0 {
				time.Sleep(100 * time.Millisecond)
				continue
			}
			lim.rate, err = strconv.ParseFloat(h.Get("X-RateLimit-Replenish-Rate"), 64)
			if err == nil {
				lim.burst, err = strconv.ParseInt(h.Get("X-RateLimit-Burst-Capacity"), 10, 64)
			}
			if err == nil {
				lim.requested, err = strconv.ParseInt(h.Get("X-RateLimit-Requested-Tokens"), 10, 64)
			}
			if err != nil || lim.rate <= 0 || lim.requested < 1 {
				return first, fmt.Errorf("instance %s: cannot read the limit from the X-RateLimit-* headers: %v", cfg.names[i], h)
			}
			break
		}
		if i == 0 {
			first = lim
		} else if lim != first {
			return first, fmt.Errorf("instances disagree on the limit: %+v vs %+v", first, lim)
		}
	}
	return first, nil
}

// record is one request. sent is since the start of the load.
type record struct {
	sent      time.Duration
	latency   time.Duration
	remaining int32 // X-RateLimit-Remaining; remainingFailed, or remainingNone when absent
	status    int16 // 0: transport error
	key       uint8
	instance  uint8
}

const (
	remainingFailed = -1 // Redis failed (on_error allow lets the request through)
	remainingNone   = -2 // no header, or not a number
)

func (r record) recv() time.Duration { return r.sent + r.latency }
func (r record) admitted() bool      { return r.status == http.StatusOK && r.remaining >= 0 }
func (r record) failOpen() bool      { return r.status == http.StatusOK && r.remaining == remainingFailed }

func parseRemaining(v string) int32 {
	n, err := strconv.ParseInt(v, 10, 32)
	if err != nil || n < remainingFailed {
		return remainingNone
	}
	return int32(n)
}

type clientResult struct {
	records  []record
	firstErr string
}

// runClient sends requests with one key until ctx ends, alternating between
// the instances, at most cfg.clientRPS a second. Each client has its own
// transport, so its own keep-alive connection to each instance. A request
// in flight when ctx ends is finished and recorded.
func runClient(ctx context.Context, cfg config, id int, t0 time.Time) clientResult {
	key := id % cfg.keys
	keyValue := fmt.Sprintf("soak-key-%d", key)
	transport := &http.Transport{MaxIdleConnsPerHost: 1, DisableCompression: true}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport, Timeout: cfg.timeout}
	var res clientResult
	if cfg.clientRPS > 0 {
		res.records = make([]record, 0, int(cfg.clientRPS*cfg.duration.Seconds())+16)
	}
	var interval time.Duration
	next := time.Now()
	if cfg.clientRPS > 0 {
		interval = time.Duration(float64(time.Second) / cfg.clientRPS)
		next = next.Add(rand.N(interval)) // spread the clients out
	}
	for n := id; ; n++ {
		if interval > 0 {
			if !sleepUntil(ctx, next) {
				break
			}
			// Paced, with no catch-up burst after a slow response.
			next = later(next.Add(interval), time.Now())
		}
		if ctx.Err() != nil {
			break
		}
		inst := n % len(cfg.targets)
		req, _ := http.NewRequest(http.MethodGet, cfg.targets[inst]+"/", nil)
		req.Header.Set("X-Key", keyValue)
		start := time.Now()
		r := record{sent: start.Sub(t0), key: uint8(key), instance: uint8(inst), remaining: remainingNone}
		resp, err := client.Do(req)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			r.status = int16(resp.StatusCode)
			r.remaining = parseRemaining(resp.Header.Get("X-RateLimit-Remaining"))
		}
		r.latency = time.Since(start)
		if err != nil {
			r.status = 0
			if res.firstErr == "" {
				res.firstErr = fmt.Sprintf("t=%.1fs instance %s: %v", r.sent.Seconds(), cfg.names[inst], err)
			}
		}
		res.records = append(res.records, r)
	}
	return res
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// --- analysis ----------------------------------------------------------------

type summary struct {
	cfg    config
	lim    limits
	end    time.Duration
	faults []fault

	outages                                                           int
	requests, admitted, failOpen, denied, server5xx, other, transport int
	failOpenOutside, failOpenAfterFlush                               int
	admittedPerKeySecond, admittedPerKeySecondMax, upSeconds          float64

	bound boundResult
	in    latencies // requests sent while Redis was down
	out   latencies // all others

	resumes []resume

	transportSamples []string
	faultErr         error
	logs             []caddyLog
}

type latencies struct {
	n        int
	p50, p99 time.Duration
	max      time.Duration
}

func latencyStats(d []time.Duration) latencies {
	if len(d) == 0 {
		return latencies{}
	}
	slices.Sort(d)
	q := func(p float64) time.Duration { return d[max(0, int(math.Ceil(p*float64(len(d))))-1)] }
	return latencies{n: len(d), p50: q(0.50), p99: q(0.99), max: d[len(d)-1]}
}

// resume is how an outage ended for one instance: how long after the
// restarted Redis answered PING its first response decided by Redis
// arrived, and how many responses still failed open after that PING.
type resume struct {
	outage   int // index into the outages
	instance int
	delay    time.Duration
	ok       bool // a limited response came before the end
	failOpen int  // fail-open responses received after Redis was back
}

func analyze(cfg config, lim limits, recs []record, faults []fault, end time.Duration) *summary {
	s := &summary{cfg: cfg, lim: lim, end: end, faults: faults, requests: len(recs)}
	var outages []fault
	var flushes []time.Duration
	var down time.Duration
	for _, f := range faults {
		if f.outage() {
			outages = append(outages, f)
			down += f.back - f.at
		} else {
			flushes = append(flushes, f.at)
		}
	}
	inOutage := func(t time.Duration, after time.Duration) bool {
		for _, o := range outages {
			if t >= o.at && t < o.back+after {
				return true
			}
		}
		return false
	}
	var inLat, outLat []time.Duration
	for _, r := range recs {
		switch {
		case r.status == 0:
			s.transport++
		case r.admitted():
			s.admitted++
		case r.failOpen():
			s.failOpen++
			if !inOutage(r.sent, cfg.grace) {
				s.failOpenOutside++
			}
			for _, at := range flushes {
				if r.sent >= at && r.sent < at+5*time.Second {
					s.failOpenAfterFlush++
				}
			}
		case r.status == http.StatusTooManyRequests:
			s.denied++
		case r.status >= 500:
			s.server5xx++
		default:
			s.other++
		}
		if r.status == 0 {
			continue
		}
		if inOutage(r.sent, 0) {
			inLat = append(inLat, r.latency)
		} else {
			outLat = append(outLat, r.latency)
		}
	}
	s.in, s.out = latencyStats(inLat), latencyStats(outLat)
	if up := (end - down).Seconds(); up > 0 {
		s.admittedPerKeySecond = float64(s.admitted) / up / float64(cfg.keys)
		// Each key's bucket starts full at the start and after each
		// restart, and refills at rate while Redis is up.
		starts := float64(1 + len(outages))
		s.admittedPerKeySecondMax = (lim.rate + float64(lim.burst)*starts/up) / float64(lim.requested)
		s.upSeconds = up
	}
	s.outages = len(outages)
	s.bound = checkBound(recs, cfg.keys, outages, end, lim, cfg.window, cfg.step, cfg.grace)
	s.resumes = resumes(recs, len(cfg.targets), outages)
	return s
}

// boundResult is the outcome of the bound check.
type boundResult struct {
	checked, violated int
	worst             window // the window with the highest admitted/bound
	violations        []window
}

type window struct {
	key      int
	from     time.Duration
	admitted int
	bound    float64
	ratio    float64
}

// checkBound checks, for each key and each window [from, from+length)
// (from = 0, step, 2·step, ...) that ends by end and does not overlap an
// outage or its first grace after Redis answered again, that the requests
// admitted among those sent in the window fit in the token bucket: at
// most (burst + rate × L) / requested, where L runs from the first send
// to the last response of those requests, so it covers every moment Redis
// may have taken their tokens. The bucket may be full when the window
// begins, hence the whole burst.
func checkBound(recs []record, keys int, outages []fault, end time.Duration, lim limits,
	length, step, grace time.Duration) boundResult {
	byKey := make([][]record, keys)
	for _, r := range recs {
		if r.admitted() {
			byKey[r.key] = append(byKey[r.key], r)
		}
	}
	for _, rs := range byKey {
		slices.SortFunc(rs, func(a, b record) int { return cmp.Compare(a.sent, b.sent) })
	}
	var res boundResult
	for from := time.Duration(0); from+length <= end; from += step {
		to := from + length
		skip := false
		for _, o := range outages {
			if from < o.back+grace && to > o.at {
				skip = true
			}
		}
		if skip {
			continue
		}
		for key, rs := range byKey {
			lo, _ := slices.BinarySearchFunc(rs, from, func(r record, t time.Duration) int { return cmp.Compare(r.sent, t) })
			hi, _ := slices.BinarySearchFunc(rs, to, func(r record, t time.Duration) int { return cmp.Compare(r.sent, t) })
			w := window{key: key, from: from, admitted: hi - lo, bound: float64(lim.burst) / float64(lim.requested)}
			if w.admitted > 0 {
				var last time.Duration
				for _, r := range rs[lo:hi] {
					last = max(last, r.recv())
				}
				span := last - rs[lo].sent
				w.bound = (float64(lim.burst) + lim.rate*span.Seconds()) / float64(lim.requested)
			}
			w.ratio = float64(w.admitted) / w.bound
			res.checked++
			if w.ratio > res.worst.ratio || res.checked == 1 {
				res.worst = w
			}
			if float64(w.admitted) > w.bound+1e-9 {
				res.violated++
				if len(res.violations) < 10 {
					res.violations = append(res.violations, w)
				}
			}
		}
	}
	return res
}

// resumes finds, per outage and instance, the first response that Redis
// decided (200 with remaining >= 0) to a request sent after the old Redis
// had exited. A 429 does not count: the instance's deny cache answers
// those without Redis, until the denied bucket's retry time.
func resumes(recs []record, instances int, outages []fault) []resume {
	byRecv := slices.Clone(recs)
	slices.SortFunc(byRecv, func(a, b record) int { return cmp.Compare(a.recv(), b.recv()) })
	var out []resume
	for i, o := range outages {
		for inst := range instances {
			rs := resume{outage: i, instance: inst}
			for _, r := range byRecv {
				if int(r.instance) != inst || r.sent < o.dead || r.status == 0 {
					continue
				}
				if r.admitted() {
					rs.delay, rs.ok = r.recv()-o.back, true
					break
				}
				if r.remaining == remainingFailed && r.recv() >= o.back {
					rs.failOpen++
				}
			}
			out = append(out, rs)
		}
	}
	return out
}

// --- Caddy logs ----------------------------------------------------------------

// caddyLog is what one Caddy instance logged (JSON lines on stderr).
type caddyLog struct {
	path          string
	err           error
	warn          int   // all WARN lines, Caddy's own included
	redisFailed   int   // rate_limit "Redis failed" warnings
	heldBack      int64 // failures those warnings said they held back
	breakerOpened int
	breakerClosed int
	otherWarn     map[string]int // other WARN messages and their counts
}

func readCaddyLog(path string) caddyLog {
	f, err := os.Open(path)
	if err != nil {
		return caddyLog{path: path, err: err}
	}
	defer f.Close()
	l := parseCaddyLog(f)
	l.path = path
	return l
}

func parseCaddyLog(r io.Reader) caddyLog {
	l := caddyLog{otherWarn: map[string]int{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for sc.Scan() {
		var e struct {
			Level      string `json:"level"`
			Logger     string `json:"logger"`
			Msg        string `json:"msg"`
			Suppressed int64  `json:"suppressed"`
		}
		if json.Unmarshal(sc.Bytes(), &e) != nil {
			continue
		}
		rateLimit := strings.HasPrefix(e.Logger, "http.handlers.rate_limit")
		switch {
		case rateLimit && strings.HasPrefix(e.Msg, "circuit breaker closed"):
			l.breakerClosed++
		case e.Level != "warn":
		case rateLimit && strings.HasPrefix(e.Msg, "Redis failed"):
			l.redisFailed++
			l.heldBack += e.Suppressed
		case rateLimit && strings.HasPrefix(e.Msg, "circuit breaker opened"):
			l.breakerOpened++
		default:
			l.otherWarn[e.Msg]++
		}
		if e.Level == "warn" {
			l.warn++
		}
	}
	l.err = sc.Err()
	return l
}

// --- report --------------------------------------------------------------------

func (s *summary) failed() bool {
	return s.bound.violated > 0 || s.bound.checked == 0 || s.server5xx > 0 || s.other > 0 ||
		s.transport > 0 || s.faultErr != nil
}

func (s *summary) print(w io.Writer) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	pct := func(n int) string {
		if s.requests == 0 {
			return ""
		}
		return fmt.Sprintf("%5.1f%%", 100*float64(n)/float64(s.requests))
	}
	c := s.cfg
	p("")
	p("=== soak summary ===")
	p("load        %.1fs, %d clients (at most %g req/s each) over %d keys, alternating between %d Caddy instances",
		s.end.Seconds(), c.clients, c.clientRPS, c.keys, len(c.targets))
	p("limit       replenish_rate %g/s, burst_capacity %d, requested_tokens %d (from the X-RateLimit-* headers)",
		s.lim.rate, s.lim.burst, s.lim.requested)
	p("faults")
	for _, f := range s.faults {
		if f.outage() {
			p("  t=%6.1fs  Redis stopped (SIGTERM); answering again at t=%.1fs: down %.1fs", f.at.Seconds(), f.back.Seconds(), (f.back - f.at).Seconds())
		} else {
			p("  t=%6.1fs  SCRIPT FLUSH", f.at.Seconds())
		}
	}
	if s.faultErr != nil {
		p("  FAILED: %v", s.faultErr)
	}

	p("")
	p("requests             %8d  (%.0f/s)", s.requests, float64(s.requests)/s.end.Seconds())
	p("  allowed            %8d  %s  200, X-RateLimit-Remaining >= 0", s.admitted, pct(s.admitted))
	p("  allowed in outage  %8d  %s  200, X-RateLimit-Remaining -1 (Redis failed, on_error allow)", s.failOpen, pct(s.failOpen))
	p("  denied             %8d  %s  429", s.denied, pct(s.denied))
	p("  5xx                %8d", s.server5xx)
	p("  other status       %8d", s.other)
	p("  transport errors   %8d", s.transport)
	for _, e := range s.transportSamples {
		p("    e.g. %s", e)
	}
	p("  fail-open outside outages (and %s after them): %d; within 5s after SCRIPT FLUSH: %d",
		c.grace, s.failOpenOutside, s.failOpenAfterFlush)
	p("  admitted per key per second while Redis was up: %.2f; at most %.2f (rate %g + burst %d x %d full starts / %.1fs up)",
		s.admittedPerKeySecond, s.admittedPerKeySecondMax, s.lim.rate, s.lim.burst, 1+s.outages, s.upSeconds)

	b := s.bound
	p("")
	p("bound check: admitted <= (burst + rate x L) / requested, per key, %s windows every %s,", c.window, c.step)
	p("  outside outages and the first %s after each restart (L: first send to last response in the window)", c.grace)
	p("  windows checked    %8d", b.checked)
	p("  violations         %8d", b.violated)
	if b.checked > 0 {
		p("  max admitted/bound   %.4f  (key %d, window t=%.0fs..%.0fs: %d admitted, bound %.2f)",
			b.worst.ratio, b.worst.key, b.worst.from.Seconds(), (b.worst.from + c.window).Seconds(), b.worst.admitted, b.worst.bound)
	}
	for _, v := range b.violations {
		p("  VIOLATION key %d, window t=%.0fs: %d admitted > bound %.2f", v.key, v.from.Seconds(), v.admitted, v.bound)
	}

	p("")
	p("latency              requests       p50       p99       max")
	p("  Redis up           %8d  %8s  %8s  %8s", s.out.n, ms(s.out.p50), ms(s.out.p99), ms(s.out.max))
	p("  Redis down         %8d  %8s  %8s  %8s", s.in.n, ms(s.in.p50), ms(s.in.p99), ms(s.in.max))

	p("")
	p("resuming limiting after each restart (first 200 with remaining >= 0, from the moment Redis answered PING;")
	p("  429s do not count: the deny cache answers them without Redis)")
	for _, r := range s.resumes {
		o := s.outageAt(r.outage)
		if r.ok {
			p("  restart at t=%6.1fs, instance %s: %+8.3fs  (%d fail-open responses after Redis was back)",
				o.back.Seconds(), c.names[r.instance], r.delay.Seconds(), r.failOpen)
		} else {
			p("  restart at t=%6.1fs, instance %s: NOT RESUMED by the end", o.back.Seconds(), c.names[r.instance])
		}
	}

	if len(s.logs) > 0 {
		outages := s.outages
		expect := 0
		for _, f := range s.faults {
			if f.outage() {
				// At most one warning per 10 s per handler, for as long as
				// requests keep failing.
				expect += int((f.back-f.at)/(10*time.Second)) + 2
			}
		}
		p("")
		p("Caddy logs (Redis failure warnings are throttled to one per 10 s per handler; %d outages)", outages)
		for i, l := range s.logs {
			if l.err != nil {
				p("  %s: cannot read %s: %v", c.names[i], l.path, l.err)
				continue
			}
			verdict := "throttled"
			if l.redisFailed > expect {
				verdict = fmt.Sprintf("NOT THROTTLED: more than %d", expect)
			}
			p("  %s: %d WARN lines: %d \"Redis failed\" (%s; they held back %d more failures), %d \"circuit breaker opened\", %d other",
				c.names[i], l.warn, l.redisFailed, verdict, l.heldBack, l.breakerOpened, l.warn-l.redisFailed-l.breakerOpened)
			p("     breaker lines: opened %d, closed %d (info) -> %s", l.breakerOpened, l.breakerClosed,
				yesNo(l.breakerOpened >= outages && l.breakerClosed >= outages && outages > 0, "present for every outage", "MISSING for some outage"))
			for _, msg := range sortedKeys(l.otherWarn) {
				p("     other WARN: %dx %q", l.otherWarn[msg], msg)
			}
		}
	}

	p("")
	if s.failed() {
		var why []string
		if b.violated > 0 {
			why = append(why, fmt.Sprintf("%d windows exceeded the bound", b.violated))
		}
		if b.checked == 0 {
			why = append(why, "no window could be checked")
		}
		if s.server5xx > 0 {
			why = append(why, fmt.Sprintf("%d 5xx responses", s.server5xx))
		}
		if s.other > 0 {
			why = append(why, fmt.Sprintf("%d unexpected statuses", s.other))
		}
		if s.transport > 0 {
			why = append(why, fmt.Sprintf("%d transport errors", s.transport))
		}
		if s.faultErr != nil {
			why = append(why, "a fault could not be applied")
		}
		p("RESULT: FAIL (%s)", strings.Join(why, ", "))
	} else {
		p("RESULT: PASS (no window over the bound, no 5xx, no transport errors)")
	}
}

func (s *summary) outageAt(i int) fault {
	for _, f := range s.faults {
		if f.outage() {
			if i == 0 {
				return f
			}
			i--
		}
	}
	return fault{}
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2fms", float64(d)/1e6) }

func yesNo(ok bool, yes, no string) string {
	if ok {
		return yes
	}
	return no
}

func sortedKeys(m map[string]int) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
