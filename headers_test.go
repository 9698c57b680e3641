package ratelimit

import (
	"net/http"
	"reflect"
	"testing"
	"time"
)

func TestRateLimitHeadersByStyle(t *testing.T) {
	spring := func(remaining, rate, burst, requested string) http.Header {
		return http.Header{
			"X-Ratelimit-Remaining":        {remaining},
			"X-Ratelimit-Replenish-Rate":   {rate},
			"X-Ratelimit-Burst-Capacity":   {burst},
			"X-Ratelimit-Requested-Tokens": {requested},
		}
	}
	for _, tc := range []struct {
		name             string
		style            string
		rate             float64
		burst, requested int64
		remaining        int64
		next             time.Duration
		want             http.Header
	}{
		{"spring", headersSpring, 10, 20, 1, 5, 0, spring("5", "10", "20", "1")},
		{"spring, fractional rate and a large count", headersSpring, 100.0 / 60, 5000, 25, 4975, 0,
			spring("4975", "1.6666666666666667", "5000", "25")},
		{"spring, Redis failed", headersSpring, 0.5, 1, 1, -1, 0, spring("-1", "0.5", "1", "1")},
		// w is the seconds an empty bucket takes to fill, rounded up; t the
		// seconds until one more request fits, rounded up.
		{"ietf", headersIETF, 10, 20, 1, 19, 0, http.Header{
			"Ratelimit": {`"api";r=19;t=0`}, "Ratelimit-Policy": {`"api";q=20;w=2`}}},
		{"ietf, t rounded up", headersIETF, 0.3, 2, 1, 0, time.Microsecond, http.Header{
			"Ratelimit": {`"api";r=0;t=1`}, "Ratelimit-Policy": {`"api";q=2;w=7`}}},
		{"ietf, Redis failed: no bucket to describe", headersIETF, 10, 20, 1, -1, 0, http.Header{}},
		{"ietf, burst 0: never refills", headersIETF, 0, 0, 1, 0, -1, http.Header{}},
		{"both", headersBoth, 0.5, 3, 1, 0, 1500 * time.Millisecond, func() http.Header {
			h := spring("0", "0.5", "3", "1")
			h["Ratelimit"] = []string{`"api";r=0;t=2`}
			h["Ratelimit-Policy"] = []string{`"api";q=3;w=6`}
			return h
		}()},
		{"none", headersNone, 10, 20, 1, 5, time.Second, http.Header{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := &limit{ietfName: "api", fixed: true, values: limitValues{tc.rate, tc.burst, tc.requested}}
			rh := newRateLimitHeaders(tc.style, []*limit{l})
			buckets := []bucket{{limit: l, values: l.values, remaining: tc.remaining, retryAfter: tc.next}}
			got := http.Header{}
			rh.set(got, buckets, 0)
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			// The values are shared between responses: a later handler
			// adding to a header must not change what the next one gets.
			for name := range got {
				got.Add(name, "changed")
			}
			again := http.Header{}
			rh.set(again, buckets, 0)
			if !reflect.DeepEqual(again, tc.want) {
				t.Fatalf("after a response's headers were added to: %v, want %v", again, tc.want)
			}
		})
	}
}
