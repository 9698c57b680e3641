package soak

// What the soak records, and what it makes of it: the token bucket bound
// per key and window, latencies, the time to resume limiting after each
// restart, the Caddy log lines, and the summary with its verdict.

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// --- records -------------------------------------------------------------------

// fault is one thing done to Redis, in time since the start of the load.
type fault struct {
	kind string        // "outage" or "flush"
	at   time.Duration // SIGTERM sent / SCRIPT FLUSH sent
	dead time.Duration // outage: the process had exited
	back time.Duration // outage: the new process answered PING
}

// outage is a fault of kind "outage".
func (f fault) outage() bool { return f.kind == "outage" }

// limits are the bucket parameters, as Caddy reports them.
type limits struct {
	rate      float64
	burst     int64
	requested int64
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
