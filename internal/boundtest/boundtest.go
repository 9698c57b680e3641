// Package boundtest checks the token bucket's bound on admissions made
// by real processes: over any window of length T, at most burst + rate
// × T. Tests of several packages share it.
package boundtest

import (
	"math"
	"slices"
	"sync"
	"testing"
	"time"
)

// AdmissionLog records admissions from many goroutines, each as the span
// within which it was decided: from before the request to after its
// answer, in nanoseconds since the log's first reading.
type AdmissionLog struct {
	mu     sync.Mutex
	origin time.Time
	spans  [][2]int64
}

// Now is the time since the log's first reading.
func (l *AdmissionLog) Now() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.origin.IsZero() {
		l.origin = time.Now()
	}
	return int64(time.Since(l.origin))
}

// Add records an admission decided between start and now.
func (l *AdmissionLog) Add(start int64) {
	end := l.Now()
	l.mu.Lock()
	l.spans = append(l.spans, [2]int64{start, end})
	l.mu.Unlock()
}

func (l *AdmissionLog) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.spans)
}

// Check asserts that every window [x, y] holds at most burst + rate ×
// (y - x) admissions (burst and rate in requests: tokens over the
// requests' cost), and returns how many windows it checked and the
// tightest: the most admissions a window held beyond its bound (at most
// 0 when none broke it). Only an
// admission whose whole span lies in a window surely counts in it, so the
// check never blames a limiter for the time its answers take; windows
// start where a span starts and end where one ends.
func (l *AdmissionLog) Check(t testing.TB, burst, rate float64) (windows int, tightest float64) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	byEnd := slices.Clone(l.spans)
	slices.SortFunc(byEnd, func(a, b [2]int64) int { return int(a[1] - b[1]) })
	failures := 0
	tightest = math.Inf(-1)
	for _, from := range l.spans {
		x, in := from[0], 0
		for _, s := range byEnd {
			if s[0] < x {
				continue
			}
			in++
			windows++
			bound := burst + rate*float64(s[1]-x)/1e9
			tightest = max(tightest, float64(in)-bound)
			if float64(in) > bound+1e-9 {
				if failures++; failures <= 3 {
					t.Errorf("%d admitted within %v: more than burst + rate × T = %.2f", in, time.Duration(s[1]-x), bound)
				}
			}
		}
	}
	if failures > 3 {
		t.Errorf("... and %d more windows over the bound", failures-3)
	}
	return windows, tightest
}
