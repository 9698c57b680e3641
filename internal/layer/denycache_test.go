package layer

import (
	"strconv"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

func TestDenyCacheRemembersUntilTheRetry(t *testing.T) {
	c := NewDenyCache()
	sent := time.Unix(1_700_000_000, 0)
	putDenial(c, "k", sent, 1500*time.Millisecond)
	// The script rounds its wait up to the microsecond: the bucket may
	// hold the tokens up to a microsecond sooner.
	until := sent.Add(1500*time.Millisecond - time.Microsecond)
	if got, ok := cachedUntil(c, "k", until.Add(-time.Nanosecond)); !ok || !got.Equal(until) {
		t.Fatalf("just before the retry: %v %v, want the denial until %v", got, ok, until)
	}
	if got, ok := cachedUntil(c, "k", until); ok {
		t.Fatalf("at the retry: still denied (until %v)", got)
	}
	if _, ok := cachedUntil(c, "other", sent); ok {
		t.Fatal("a key never denied is denied")
	}
}

func TestDenyCacheBounded(t *testing.T) {
	c := NewDenyCache()
	now := time.Now()
	for i := range 3 * denyCacheSize {
		putDenial(c, "k"+strconv.Itoa(i), now, time.Hour)
	}
	if n := len(c.entries); n > denyCacheSize {
		t.Fatalf("%d entries, bound %d", n, denyCacheSize)
	}
	if _, ok := cachedUntil(c, "k"+strconv.Itoa(3*denyCacheSize-1), now); !ok {
		t.Fatal("the newest entry was dropped")
	}

	// A full cache of expired entries makes room by dropping expired ones,
	// many at a time, not one per insertion.
	expired := NewDenyCache()
	for i := range denyCacheSize {
		putDenial(expired, "e"+strconv.Itoa(i), now.Add(-time.Hour), time.Second)
	}
	putDenial(expired, "new", now, time.Hour)
	if n := len(expired.entries); n > denyCacheSize-16 {
		t.Fatalf("%d entries after one insertion into a full cache of expired ones", n)
	}
}

// testValues are the values of the deny cache's unit tests.
var testValues = limit.Values{Rate: 1, Burst: 10, Requested: 1}

// testLimit is the limit of the deny cache's unit tests: its kind's
// refusals are kept for their whole wait, as the token bucket's.
var testLimit = &limit.Limit{Remembered: wholeWait{}}

type wholeWait struct{}

func (wholeWait) DenialTTL(b limit.Bucket) time.Duration { return b.RetryAfter }

func (wholeWait) CachedRemaining(_ limit.Bucket, remaining int64, _ time.Duration) int64 {
	return remaining
}

// putDenial records a denial of the one bucket at key (with testValues)
// sent at sent, short for wait.
func putDenial(c *DenyCache, key string, sent time.Time, wait time.Duration) {
	c.put([]limit.Bucket{{Limit: testLimit, Key: key, Values: testValues, RetryAfter: wait}}, sent)
}

// cachedUntil is until when c denies a request on the one bucket at key
// (with testValues), if it does at now.
func cachedUntil(c *DenyCache, key string, now time.Time) (time.Time, bool) {
	c.mu.Lock()
	d, ok := c.entries[key]
	c.mu.Unlock()
	b := []limit.Bucket{{Limit: testLimit, Key: key, Values: d.values}}
	if !ok || !c.answer(b, now) {
		return time.Time{}, false
	}
	return d.until, true
}

// TestDenyCacheKeepsNoDenialSentBeforeItsBucketWasForgotten: a refund
// that lands while a request's call is in flight drops the bucket's
// cached denial; the denial Redis then gives that call, which may be of
// the bucket before the refund, is not cached (it was, with the whole
// wait: the next request refused from the cache while the bucket held
// its tokens again). A denial of a call sent after the refund is cached.
func TestDenyCacheKeepsNoDenialSentBeforeItsBucketWasForgotten(t *testing.T) {
	c := NewDenyCache()
	sent := time.Now()
	c.Forget("k") // the refund's answer, while the call is in flight
	putDenial(c, "k", sent, 5000*time.Second)
	if until, ok := cachedUntil(c, "k", time.Now()); ok {
		t.Fatalf("a denial sent before its bucket's refund landed is cached until %v", until)
	}
	putDenial(c, "k", time.Now(), 5000*time.Second)
	if _, ok := cachedUntil(c, "k", time.Now()); !ok {
		t.Fatal("a denial sent after the refund landed is not cached")
	}
	sent = time.Now()
	c.ForgetAll() // resets may have been missed
	putDenial(c, "k", sent, 5000*time.Second)
	if until, ok := cachedUntil(c, "k", time.Now()); ok {
		t.Fatalf("a denial sent before every denial was forgotten is cached until %v", until)
	}
}

// TestLeaseDenyCacheLastsAtMostAHold: with lease, a denial is answered
// from the cache until its wait or one hold, whichever comes first; the
// cached answer still says the whole wait.
func TestLeaseDenyCacheLastsAtMostAHold(t *testing.T) {
	c := NewDenyCache()
	c.maxWait = 100 * time.Millisecond
	v := limit.Values{Rate: 0.01, Burst: 10, Requested: 1}
	t0 := time.Unix(1_000_000, 0)
	c.put([]limit.Bucket{{Limit: testLimit, Key: "long", Values: v, RetryAfter: 100 * time.Second}, {Limit: testLimit, Key: "short", Values: v, RetryAfter: 50 * time.Millisecond}}, t0)
	long := []limit.Bucket{{Limit: testLimit, Key: "long", Values: v}}
	if !c.answer(long, t0.Add(99*time.Millisecond)) || long[0].RetryAfter < 99*time.Second {
		t.Errorf("within the hold: %+v; want denied with the whole wait", long[0])
	}
	if c.answer([]limit.Bucket{{Limit: testLimit, Key: "long", Values: v}}, t0.Add(100*time.Millisecond)) {
		t.Error("a denial of 100 s cached past the hold of 100ms")
	}
	if c.answer([]limit.Bucket{{Limit: testLimit, Key: "short", Values: v}}, t0.Add(50*time.Millisecond)) {
		t.Error("a denial of 50ms cached past its wait")
	}
}
