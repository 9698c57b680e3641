package soak

// Unit tests of the analysis in summary_test.go, on made-up records.

import (
	"net/http"
	"strings"
	"testing"
	"time"
)

var testLimits = limits{rate: 50, burst: 100, requested: 1}

// bucketRecords simulates one key sending a request every gap for d
// against an exact token bucket that starts full, with a fixed latency.
func bucketRecords(key uint8, d, gap, latency time.Duration) []record {
	tokens, last := float64(testLimits.burst), time.Duration(0)
	var recs []record
	for t := time.Duration(0); t < d; t += gap {
		tokens = min(float64(testLimits.burst), tokens+testLimits.rate*(t-last).Seconds())
		last = t
		r := record{sent: t, latency: latency, key: key, status: http.StatusTooManyRequests}
		if tokens >= 1 {
			tokens--
			r.status = http.StatusOK
		}
		r.remaining = int32(tokens)
		recs = append(recs, r)
	}
	return recs
}

func TestCheckBoundExactBucketPasses(t *testing.T) {
	recs := append(bucketRecords(0, 60*time.Second, time.Millisecond, 200*time.Microsecond),
		bucketRecords(1, 60*time.Second, 3*time.Millisecond, time.Millisecond)...)
	res := checkBound(recs, 2, nil, 60*time.Second, testLimits, 5*time.Second, time.Second, 2*time.Second)
	if want := 2 * 56; res.checked != want {
		t.Errorf("checked %d windows, want %d", res.checked, want)
	}
	if res.violated != 0 {
		t.Errorf("violations %v on an exact bucket", res.violations)
	}
	// The first window starts with a full bucket: the bound is reached.
	if res.worst.ratio < 0.99 || res.worst.ratio > 1 {
		t.Errorf("worst ratio %.3f, want just under 1", res.worst.ratio)
	}
}

func TestCheckBoundCatchesOverAdmission(t *testing.T) {
	recs := bucketRecords(0, 30*time.Second, time.Millisecond, 200*time.Microsecond)
	// A limiter that lets 10 % more through than the bucket allows.
	for i := range recs {
		if recs[i].status != http.StatusOK && i%10 == 0 {
			recs[i].status, recs[i].remaining = http.StatusOK, 0
		}
	}
	res := checkBound(recs, 1, nil, 30*time.Second, testLimits, 5*time.Second, time.Second, 2*time.Second)
	if res.violated == 0 {
		t.Fatalf("no violation found; worst %+v", res.worst)
	}
}

func TestCheckBoundSkipsOutages(t *testing.T) {
	// Admissions far over the bound, but only during an outage and its grace.
	var recs []record
	for t := 20 * time.Second; t < 32*time.Second; t += time.Millisecond {
		recs = append(recs, record{sent: t, latency: time.Millisecond, status: http.StatusOK})
	}
	outages := []fault{{kind: "outage", at: 20 * time.Second, dead: 20 * time.Second, back: 30 * time.Second}}
	res := checkBound(recs, 1, outages, 60*time.Second, testLimits, 5*time.Second, time.Second, 2*time.Second)
	// Windows [0,5)..[15,20) before, [32,37)..[55,60) after.
	if want := 16 + 24; res.checked != want {
		t.Errorf("checked %d windows, want %d", res.checked, want)
	}
	if res.violated != 0 {
		t.Errorf("violations %v in windows that should be skipped", res.violations)
	}
}

func TestResumes(t *testing.T) {
	o := fault{kind: "outage", at: 10 * time.Second, dead: 10100 * time.Millisecond, back: 25 * time.Second}
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	recs := []record{
		{sent: ms(10050), latency: ms(1), status: 200, remaining: 5, instance: 0},                   // before Redis exited
		{sent: ms(10200), latency: ms(1), status: 429, remaining: 0, instance: 0},                   // deny cache
		{sent: ms(24990), latency: ms(20), status: 200, remaining: remainingFailed, instance: 0},    // fail-open after back
		{sent: ms(25300), latency: ms(1), status: 200, remaining: 99, instance: 0},                  // resumed
		{sent: ms(25100), latency: ms(1), status: 200, remaining: remainingFailed, instance: 1},     // fail-open
		{sent: ms(25700), latency: ms(2), status: 200, remaining: 98, instance: 1},                  // resumed
		{sent: ms(26000), latency: ms(1), status: 200, remaining: remainingFailed, instance: 1},     // after resuming
		{sent: ms(26000), latency: ms(1), status: 0, remaining: remainingNone, instance: 1},         // transport error
		{sent: ms(12000), latency: ms(1), status: 200, remaining: remainingFailed, instance: 1},     // during the outage
		{sent: ms(24000), latency: ms(1), status: 200, remaining: remainingFailed, instance: 0},     // during the outage
		{sent: ms(30000), latency: ms(1), status: 200, remaining: remainingFailed, instance: 0},     // after resuming
		{sent: ms(11000), latency: ms(1), status: 429, remaining: 0, instance: 1},                   // deny cache
		{sent: ms(25000), latency: ms(1), status: 200, remaining: remainingFailed, instance: 0},     // fail-open after back
		{sent: ms(9000), latency: ms(1), status: 200, remaining: remainingFailed, instance: 0},      // before
		{sent: ms(25200), latency: ms(1), status: 500, remaining: remainingNone, instance: 0},       // no header
		{sent: ms(25050), latency: ms(1), status: 200, remaining: remainingFailed, instance: 0},     // fail-open after back
		{sent: ms(25290), latency: ms(1), status: 200, remaining: remainingFailed, instance: 0},     // fail-open after back
		{sent: ms(25400), latency: ms(1), status: 200, remaining: remainingFailed, instance: 0},     // after resuming
		{sent: ms(26500), latency: ms(1), status: 200, remaining: remainingFailed, instance: 1},     // after resuming
		{sent: ms(25650), latency: ms(1), status: 200, remaining: remainingFailed, instance: 1},     // fail-open after back
		{sent: ms(25699), latency: ms(1), status: 200, remaining: remainingFailed, instance: 1},     // fail-open after back
		{sent: ms(25701), latency: 0, status: 200, remaining: remainingFailed, instance: 1},         // received before 98
		{sent: ms(10300), latency: ms(1), status: 200, remaining: remainingFailed, instance: 1},     // during the outage
		{sent: ms(10300), latency: ms(14800), status: 200, remaining: remainingFailed, instance: 1}, // received before back
	}
	got := resumes(recs, 2, []fault{o})
	want := []resume{
		{outage: 0, instance: 0, delay: ms(301), ok: true, failOpen: 4},
		{outage: 0, instance: 1, delay: ms(702), ok: true, failOpen: 5},
	}
	if len(got) != len(want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("resume %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
}

func TestParseCaddyLog(t *testing.T) {
	log := strings.Join([]string{
		`{"level":"warn","ts":1.7e9,"logger":"admin","msg":"admin endpoint disabled"}`,
		`{"level":"info","ts":1.7e9,"msg":"serving initial configuration"}`,
		`{"level":"warn","ts":1.7e9,"logger":"http.handlers.rate_limit","msg":"Redis failed; following on_error","zone":"soak","error":"dial tcp: connection refused"}`,
		`{"level":"warn","ts":1.7e9,"logger":"http.handlers.rate_limit","msg":"circuit breaker opened: Redis failed repeatedly; requests skip Redis and follow on_error until it answers","zone":"soak","consecutive_failures":5}`,
		`{"level":"warn","ts":1.7e9,"logger":"http.handlers.rate_limit","msg":"Redis failed; following on_error","zone":"soak","suppressed":27}`,
		`{"level":"info","ts":1.7e9,"logger":"http.handlers.rate_limit","msg":"circuit breaker closed: Redis answers again","zone":"soak"}`,
		`not json`,
	}, "\n")
	l := parseCaddyLog(strings.NewReader(log))
	if l.err != nil || l.warn != 4 || l.redisFailed != 2 || l.heldBack != 27 || l.breakerOpened != 1 || l.breakerClosed != 1 ||
		l.otherWarn["admin endpoint disabled"] != 1 || len(l.otherWarn) != 1 {
		t.Errorf("parsed %+v", l)
	}
}

func TestLatencyStats(t *testing.T) {
	var d []time.Duration
	for i := 100; i >= 1; i-- {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	got := latencyStats(d)
	if got.n != 100 || got.p50 != 50*time.Millisecond || got.p99 != 99*time.Millisecond || got.max != 100*time.Millisecond {
		t.Errorf("got %+v", got)
	}
}
