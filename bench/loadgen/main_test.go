package main

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestHistogramBuckets(t *testing.T) {
	var h histogram
	last := -1
	for _, v := range []uint64{0, 1, 511, 512, 513, 1023, 1024, 1 << 20, 1<<40 + 12345, math.MaxUint64} {
		i := bucketOf(v)
		if i < last || i >= len(h.counts) {
			t.Fatalf("bucketOf(%d) = %d (previous %d, %d buckets)", v, i, last, len(h.counts))
		}
		last = i
		if mid := bucketMid(i); v > 0 && math.Abs(mid-float64(v))/float64(v) > 0.004 {
			t.Errorf("bucketMid(bucketOf(%d)) = %.0f, off by more than 0.4%%", v, mid)
		}
	}
}

func TestHistogramQuantiles(t *testing.T) {
	var h histogram
	for i := 1; i <= 100_000; i++ {
		h.record(uint64(i) * 1000) // 1 µs .. 100 ms, uniform
	}
	for _, q := range []float64{0.5, 0.99} {
		want := q * 100_000 * 1000
		if got := h.quantile(q); math.Abs(got-want)/want > 0.005 {
			t.Errorf("quantile(%v) = %.0f, want %.0f", q, got, want)
		}
	}
	var a, b histogram
	for range 1000 {
		v := rand.Uint64N(1 << 30)
		a.record(v)
		b.record(v)
	}
	a.merge(&b)
	if a.quantile(0.5) != b.quantile(0.5) {
		t.Error("merging a histogram with a copy of itself moved the median")
	}
}
