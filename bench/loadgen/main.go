// Command loadgen is the closed-loop HTTP/1.1 load generator of
// scripts/bench.sh: -c connections, each its own goroutine with its own
// keep-alive TCP connection and its own X-Conn header value (so each
// connection is its own rate_limit bucket), each sending its next GET as
// soon as the previous response is read. Latency goes into a log-linear
// histogram (256 sub-buckets per power of two, under 0.4 % error).
//
// With -keys N, the requests cycle N X-Conn values instead ("key-<n>"):
// connection i starts at key i×N/c and sends the next key each time, so
// every key sees one request per N; with -hot H as well, a share -hot-share
// of each connection's requests (at random) go to H hot keys ("hot-<n>",
// in turn), the rest cycle the N cold ones.
//
//	loadgen run -addr 127.0.0.1:8080 -c 64 -warmup 1s -d 5s [-same-key | -keys 10000 [-hot 8 -hot-share 0.9]] [-expect 200[,429]] [-redis 127.0.0.1:6390] [-pid N] [-cpus 0,1]
//	loadgen table [-warmup 1s -d 3s -cpus 0,1] RESULTS
//	loadgen freeport
//
// run prints one line of key=value pairs: requests, seconds, rps, p50_us,
// p99_us, errors (transport), unexpected (a status -expect does not list),
// load_cpu (its own CPU use, % of one CPU), with -pid server_cpu (the
// server's), with -cpus cpuN_busy (CPU N's busy time, any process, %)
// and, with -redis, the deltas of Redis INFO over the measured window:
// reads (total_reads_processed), scripts (cmdstat_evalsha + cmdstat_eval
// calls), commands (total_commands_processed) and redis_cpu
// (used_cpu_user + used_cpu_sys, %).
//
// table reads run's lines, each prefixed with "case=<name>@<conns>
// round=<n>", and prints the benchmark's table (see table.go).
//
// freeport prints a free loopback TCP port.
package main

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/bits"
	"math/rand/v2"
	"net"
	"os"
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
			fatal(err)
		}
		fmt.Println(l.Addr().(*net.TCPAddr).Port)
		l.Close()
	case "run":
		run(os.Args[2:])
	case "table":
		table(os.Args[2:])
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: loadgen run|table|freeport [flags]")
	os.Exit(2)
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "loadgen:", err)
	os.Exit(1)
}

// Phases of a run; workers record only during measuring.
const (
	warming int32 = iota
	measuring
	done
)

func run(argv []string) {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	addr := fs.String("addr", "127.0.0.1:8080", "host:port of the server")
	conns := fs.Int("c", 64, "connections")
	dur := fs.Duration("d", 5*time.Second, "measured duration")
	warmup := fs.Duration("warmup", time.Second, "warm-up before measuring")
	sameKey := fs.Bool("same-key", false, "every connection sends the same X-Conn value (one bucket)")
	keys := fs.Int("keys", 0, "cycle this many X-Conn values across the connections (0: one per connection)")
	hot := fs.Int("hot", 0, "with -keys: this many hot X-Conn values, which -hot-share of the requests go to")
	hotShare := fs.Float64("hot-share", 0.9, "with -hot: the share of requests that go to the hot keys")
	expectList := fs.String("expect", "200", "expected statuses, comma-separated; others count as unexpected")
	redisAddr := fs.String("redis", "", "Redis host:port whose INFO deltas to report")
	serverPID := fs.Int("pid", 0, "PID of the server, whose CPU use to report (Linux /proc)")
	cpuList := fs.String("cpus", "", "comma-separated CPU numbers whose busy time (any process) to report, e.g. 0,1")
	bodyFile := fs.String("body", "", "a file whose content every request sends as a JSON body, with POST (default: GET without a body)")
	_ = fs.Parse(argv)
	var body []byte
	if *bodyFile != "" {
		var err error
		if body, err = os.ReadFile(*bodyFile); err != nil {
			fatal(fmt.Errorf("-body: %w", err))
		}
	}

	var expect []int
	for _, f := range strings.Split(*expectList, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			fatal(fmt.Errorf("-expect %q: want statuses such as 200 or 429,200", *expectList))
		}
		expect = append(expect, n)
	}

	var rinfo *redisInfo
	if *redisAddr != "" {
		var err error
		if rinfo, err = dialRedis(*redisAddr); err != nil {
			fatal(fmt.Errorf("redis %s: %w", *redisAddr, err))
		}
		defer rinfo.close()
	}

	if *keys < 0 || *hot < 0 || *hot > 0 && *keys == 0 || *hotShare < 0 || *hotShare > 1 || *sameKey && *keys > 0 {
		fatal(fmt.Errorf("-keys %d -hot %d -hot-share %v: want -keys >= 0, -hot only with -keys, a share in [0, 1], no -same-key with -keys", *keys, *hot, *hotShare))
	}
	request := func(key string) []byte {
		if body != nil {
			return append(fmt.Appendf(nil, "POST /v1/chat/completions HTTP/1.1\r\nHost: bench.local\r\nUser-Agent: loadgen\r\nX-Conn: %s\r\n"+
				"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n", key, len(body)), body...)
		}
		return []byte("GET / HTTP/1.1\r\nHost: bench.local\r\nUser-Agent: loadgen\r\nX-Conn: " + key + "\r\n\r\n")
	}
	// The requests of -keys and -hot, built once and shared (read only).
	var cold, hotReqs [][]byte
	for i := range *keys {
		cold = append(cold, request(fmt.Sprintf("key-%06d", i)))
	}
	for i := range *hot {
		hotReqs = append(hotReqs, request(fmt.Sprintf("hot-%04d", i)))
	}

	var phase atomic.Int32
	workers := make([]*worker, *conns)
	for i := range workers {
		key := fmt.Sprintf("conn-%04d", i)
		if *sameKey {
			key = "conn-0000"
		}
		w := &worker{
			addr:     *addr,
			req:      request(key),
			expect:   expect,
			phase:    &phase,
			cold:     cold,
			next:     i * len(cold) / *conns,
			hot:      hotReqs,
			nextHot:  i % max(1, len(hotReqs)),
			hotShare: *hotShare,
			rng:      rand.New(rand.NewPCG(uint64(i), 1)),
		}
		if err := w.dial(); err != nil {
			fatal(err)
		}
		workers[i] = w
	}
	var wg sync.WaitGroup
	for _, w := range workers {
		wg.Add(1)
		go func() { defer wg.Done(); w.loop() }()
	}

	time.Sleep(*warmup)
	var before, after map[string]int64
	var err error
	if rinfo != nil {
		if before, err = rinfo.snapshot(); err != nil {
			fatal(err)
		}
	}
	var cpus []int
	for _, f := range strings.Split(*cpuList, ",") {
		if f = strings.TrimSpace(f); f != "" {
			n, err := strconv.Atoi(f)
			if err != nil {
				fatal(fmt.Errorf("-cpus %q: %w", *cpuList, err))
			}
			cpus = append(cpus, n)
		}
	}
	busy0 := cpuBusy(cpus)
	serverCPU0, selfCPU0 := procCPU(*serverPID), selfCPU()
	t1 := time.Now()
	phase.Store(measuring)
	time.Sleep(*dur)
	phase.Store(done)
	elapsed := time.Since(t1)
	serverCPU1, selfCPU1 := procCPU(*serverPID), selfCPU()
	busy1 := cpuBusy(cpus)
	if rinfo != nil {
		if after, err = rinfo.snapshot(); err != nil {
			fatal(err)
		}
	}
	// Workers stop after their request in flight; a stuck one is cut off.
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(2 * time.Second):
		for _, w := range workers {
			w.conn.Close()
		}
		<-finished
	}

	var total histogram
	var requests, errs, unexpected int64
	for _, w := range workers {
		total.merge(&w.hist)
		requests += w.count
		errs += w.errors
		unexpected += w.unexpected
	}
	pct := func(cpu time.Duration) float64 { return 100 * cpu.Seconds() / elapsed.Seconds() }
	out := fmt.Sprintf("requests=%d seconds=%.3f rps=%.0f p50_us=%.1f p99_us=%.1f errors=%d unexpected=%d load_cpu=%.1f",
		requests, elapsed.Seconds(), float64(requests)/elapsed.Seconds(),
		total.quantile(0.50)/1e3, total.quantile(0.99)/1e3, errs, unexpected, pct(selfCPU1-selfCPU0))
	if *serverPID != 0 {
		out += fmt.Sprintf(" server_cpu=%.1f", pct(serverCPU1-serverCPU0))
	}
	for i, c := range cpus {
		out += fmt.Sprintf(" cpu%d_busy=%.1f", c, pct(busy1[i]-busy0[i]))
	}
	if rinfo != nil {
		d := func(k string) int64 { return after[k] - before[k] }
		out += fmt.Sprintf(" reads=%d scripts=%d commands=%d redis_cpu=%.1f",
			d("total_reads_processed"), d("cmdstat_evalsha")+d("cmdstat_eval"), d("total_commands_processed"),
			pct(time.Duration(d("used_cpu_sys")+d("used_cpu_user"))*time.Microsecond))
	}
	fmt.Println(out)
	if requests == 0 {
		os.Exit(1)
	}
}

// worker is one connection sending requests back to back.
type worker struct {
	addr   string
	req    []byte
	expect []int
	phase  *atomic.Int32

	// With -keys: the cold keys' requests, cycled from next, and the hot
	// keys' (with -hot), cycled from nextHot, which a share of hotShare of
	// the requests go to.
	cold     [][]byte
	next     int
	hot      [][]byte
	nextHot  int
	hotShare float64
	rng      *rand.Rand

	conn net.Conn
	br   *bufio.Reader

	hist       histogram
	count      int64
	errors     int64
	unexpected int64
}

func (w *worker) dial() error {
	c, err := net.DialTimeout("tcp", w.addr, 2*time.Second)
	if err != nil {
		return err
	}
	w.conn = c
	if w.br == nil {
		w.br = bufio.NewReaderSize(c, 4096)
	} else {
		w.br.Reset(c)
	}
	return nil
}

func (w *worker) loop() {
	for {
		ph := w.phase.Load()
		if ph == done {
			w.conn.Close()
			return
		}
		start := time.Now()
		status, keepAlive, err := w.roundTrip()
		if err != nil {
			if w.phase.Load() == measuring {
				w.errors++
			}
			w.conn.Close()
			if w.phase.Load() == done {
				return
			}
			for w.dial() != nil {
				if w.phase.Load() == done {
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
			continue
		}
		lat := time.Since(start)
		if ph == measuring && w.phase.Load() == measuring {
			w.hist.record(uint64(lat))
			w.count++
			if !slices.Contains(w.expect, status) {
				w.unexpected++
			}
		}
		if !keepAlive {
			w.conn.Close()
			if err := w.dial(); err != nil {
				w.errors++
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
}

var errMalformed = errors.New("malformed response")

// request is the next request to send.
func (w *worker) request() []byte {
	switch {
	case len(w.hot) > 0 && w.rng.Float64() < w.hotShare:
		w.nextHot = (w.nextHot + 1) % len(w.hot)
		return w.hot[w.nextHot]
	case len(w.cold) > 0:
		w.next = (w.next + 1) % len(w.cold)
		return w.cold[w.next]
	}
	return w.req
}

// roundTrip writes the request and reads the whole response.
func (w *worker) roundTrip() (status int, keepAlive bool, err error) {
	if _, err = w.conn.Write(w.request()); err != nil {
		return 0, false, err
	}
	line, err := w.br.ReadSlice('\n')
	if err != nil {
		return 0, false, err
	}
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) {
		return 0, false, errMalformed
	}
	status, err = strconv.Atoi(string(line[9:12]))
	if err != nil {
		return 0, false, errMalformed
	}
	keepAlive = true
	length, chunked := int64(-1), false
	for {
		line, err = w.br.ReadSlice('\n')
		if err != nil {
			return 0, false, err
		}
		if len(line) <= 2 {
			break
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			return 0, false, errMalformed
		}
		value = bytes.TrimSpace(value)
		switch {
		case asciiEqualFold(name, "Content-Length"):
			if length, err = strconv.ParseInt(string(value), 10, 64); err != nil {
				return 0, false, errMalformed
			}
		case asciiEqualFold(name, "Transfer-Encoding"):
			chunked = asciiEqualFold(value, "chunked")
		case asciiEqualFold(name, "Connection"):
			keepAlive = !asciiEqualFold(value, "close")
		}
	}
	switch {
	case chunked:
		err = w.discardChunked()
	case length > 0:
		_, err = w.br.Discard(int(length))
	case length < 0 && status != 204 && status != 304:
		_, err = io.Copy(io.Discard, w.br) // body until close
		keepAlive = false
	}
	return status, keepAlive, err
}

func (w *worker) discardChunked() error {
	for {
		line, err := w.br.ReadSlice('\n')
		if err != nil {
			return err
		}
		size, _, _ := strings.Cut(strings.TrimSpace(string(line)), ";")
		n, err := strconv.ParseInt(size, 16, 64)
		if err != nil {
			return errMalformed
		}
		if n == 0 {
			for { // trailers up to the empty line
				line, err = w.br.ReadSlice('\n')
				if err != nil {
					return err
				}
				if len(line) <= 2 {
					return nil
				}
			}
		}
		if _, err := w.br.Discard(int(n) + 2); err != nil {
			return err
		}
	}
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range len(b) {
		x, y := b[i]|0x20, s[i]|0x20
		if x != y {
			return false
		}
	}
	return true
}

// histogram counts nanosecond values, log-linear: values below 2^subBits
// exactly, then 2^(subBits-1) buckets per power of two.
const subBits = 9

type histogram struct {
	counts [(64 - subBits + 2) << (subBits - 1)]uint64
}

func bucketOf(v uint64) int {
	if v < 1<<subBits {
		return int(v)
	}
	e := bits.Len64(v) - subBits
	return e<<(subBits-1) + int(v>>e)
}

// bucketMid is the middle of the values a bucket holds.
func bucketMid(i int) float64 {
	if i < 1<<subBits {
		return float64(i)
	}
	e := i>>(subBits-1) - 1
	m := i - e<<(subBits-1)
	return float64(uint64(m)<<e) + float64(uint64(1)<<e)/2
}

func (h *histogram) record(v uint64) { h.counts[bucketOf(v)]++ }

func (h *histogram) merge(o *histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
}

func (h *histogram) quantile(q float64) float64 {
	var total uint64
	for _, c := range h.counts {
		total += c
	}
	if total == 0 {
		return 0
	}
	rank := uint64(q*float64(total) + 0.5)
	if rank < 1 {
		rank = 1
	}
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			return bucketMid(i)
		}
	}
	return bucketMid(len(h.counts) - 1)
}

// redisInfo reads INFO over one raw RESP connection.
type redisInfo struct {
	conn net.Conn
	br   *bufio.Reader
}

func dialRedis(addr string) (*redisInfo, error) {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	return &redisInfo{conn: c, br: bufio.NewReader(c)}, nil
}

func (r *redisInfo) close() { r.conn.Close() }

// snapshot returns INFO stats counters, INFO cpu seconds (as µs) and, as
// cmdstat_<name>, the calls of every command in INFO commandstats.
func (r *redisInfo) snapshot() (map[string]int64, error) {
	_ = r.conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(r.conn,
		"*2\r\n$4\r\nINFO\r\n$5\r\nstats\r\n*2\r\n$4\r\nINFO\r\n$12\r\ncommandstats\r\n*2\r\n$4\r\nINFO\r\n$3\r\ncpu\r\n"); err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for range 3 {
		body, err := r.bulk()
		if err != nil {
			return nil, err
		}
		for _, line := range strings.Split(body, "\n") {
			k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
			if !ok {
				continue
			}
			if strings.HasPrefix(k, "cmdstat_") {
				// calls=N,usec=...
				calls, _, _ := strings.Cut(strings.TrimPrefix(v, "calls="), ",")
				v = calls
			}
			if n, err := strconv.ParseInt(v, 10, 64); err == nil {
				out[k] = n
			} else if f, err := strconv.ParseFloat(v, 64); err == nil {
				out[k] = int64(f * 1e6) // used_cpu_*: seconds, kept in µs
			}
		}
	}
	return out, nil
}

func (r *redisInfo) bulk() (string, error) {
	line, err := r.br.ReadString('\n')
	if err != nil {
		return "", err
	}
	if !strings.HasPrefix(line, "$") {
		return "", fmt.Errorf("INFO replied %q", strings.TrimSpace(line))
	}
	n, err := strconv.Atoi(strings.TrimSpace(line[1:]))
	if err != nil {
		return "", err
	}
	buf := make([]byte, n+2)
	if _, err := io.ReadFull(r.br, buf); err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// procCPU is the user+system CPU time of process pid so far, from
// /proc/<pid>/stat (0 when pid is 0 or unreadable).
func procCPU(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// Fields after the command name, which is in parentheses and may
	// hold spaces: state is field 3, utime 14, stime 15.
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	const clkTck = 100 // USER_HZ, 100 on every Linux architecture Go supports
	return time.Duration(ut+st) * time.Second / clkTck
}

func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuBusy is the busy (not idle, not iowait) time of each CPU so far, from
// /proc/stat; zeros when unreadable.
func cpuBusy(cpus []int) []time.Duration {
	out := make([]time.Duration, len(cpus))
	if len(cpus) == 0 {
		return out
	}
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return out
	}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 || !strings.HasPrefix(f[0], "cpu") || f[0] == "cpu" {
			continue
		}
		n, err := strconv.Atoi(f[0][3:])
		if err != nil {
			continue
		}
		for i, c := range cpus {
			if c != n {
				continue
			}
			var busy int64
			for j, v := range f[1:] {
				if j == 3 || j == 4 { // idle, iowait
					continue
				}
				if j >= 7 { // guest and guest_nice are already in user and nice
					break
				}
				t, _ := strconv.ParseInt(v, 10, 64)
				busy += t
			}
			out[i] = time.Duration(busy) * time.Second / 100 // USER_HZ
		}
	}
	return out
}
