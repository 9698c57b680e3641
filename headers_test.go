package ratelimit

import (
	"fmt"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
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
		denied           bool // the request was refused: Retry-After
	}{
		{"spring", headersSpring, 10, 20, 1, 5, 0, spring("5", "10", "20", "1"), false},
		{"spring, fractional rate and a large count", headersSpring, 100.0 / 60, 5000, 25, 4975, 0,
			spring("4975", "1.6666666666666667", "5000", "25"), false},
		{"spring, Redis failed", headersSpring, 0.5, 1, 1, -1, 0, spring("-1", "0.5", "1", "1"), false},
		// w is the seconds an empty bucket takes to fill, rounded up; t the
		// seconds until one more request fits, rounded up.
		{"ietf", headersIETF, 10, 20, 1, 19, 0, http.Header{
			"Ratelimit": {`"api";r=19;t=0`}, "Ratelimit-Policy": {`"api";q=20;w=2`}}, false},
		{"ietf, t rounded up", headersIETF, 0.3, 2, 1, 0, time.Microsecond, http.Header{
			"Ratelimit": {`"api";r=0;t=1`}, "Ratelimit-Policy": {`"api";q=2;w=7`}}, false},
		{"ietf, Redis failed: no bucket to describe", headersIETF, 10, 20, 1, -1, 0, http.Header{}, false},
		{"ietf, burst 0: never refills", headersIETF, 0, 0, 1, 0, -1, http.Header{}, false},
		{"both", headersBoth, 0.5, 3, 1, 0, 1500 * time.Millisecond, func() http.Header {
			h := spring("0", "0.5", "3", "1")
			h["Ratelimit"] = []string{`"api";r=0;t=2`}
			h["Ratelimit-Policy"] = []string{`"api";q=3;w=6`}
			return h
		}(), false},
		{"none", headersNone, 10, 20, 1, 5, time.Second, http.Header{}, false},
		// A denial has Retry-After, whatever the style: whole seconds,
		// rounded up.
		{"none, denied", headersNone, 10, 20, 1, 0, 1500 * time.Millisecond, http.Header{"Retry-After": {"2"}}, true},
		{"spring, denied", headersSpring, 0.001, 1, 1, 0, 1000 * time.Second, func() http.Header {
			h := spring("0", "0.001", "1", "1")
			h["Retry-After"] = []string{"1000"}
			return h
		}(), true},
		{"spring, a large count in the response's own text", headersSpring, 1e9, 1e9, 1, 999_999_999, 0,
			spring("999999999", "1000000000", "1000000000", "1"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := &limit.Limit{IETFName: "api", Fixed: true, Values: limit.Values{Rate: tc.rate, Burst: tc.burst, Requested: tc.requested}, Kind: tokenbucket.Kind{}}
			rh := newRateLimitHeaders(tc.style, []*limit.Limit{l})
			buckets := []limit.Bucket{{Limit: l, Values: l.Values, Remaining: tc.remaining, RetryAfter: tc.next}}
			got := http.Header{}
			rh.set(got, buckets, 0, tc.denied)
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			// A later handler writing a response's values in place (as
			// Caddy's `header` replaces text) or adding to them must not
			// change what the next response gets.
			for name, vals := range got {
				vals[0] = "changed"
				got.Add(name, "added")
			}
			again := http.Header{}
			rh.set(again, buckets, 0, tc.denied)
			if !reflect.DeepEqual(again, tc.want) {
				t.Fatalf("after a response's headers were written: %v, want %v", again, tc.want)
			}
		})
	}
}

// TestResponsesEditingTheirHeadersChangeNoOtherResponse serves many
// requests at once, each response's values then written in place as
// Caddy's `header` directive writes them, while other responses are
// read. Run with -race: a value slice shared between responses is a
// data race, and an edit shows up in another response's header.
func TestResponsesEditingTheirHeadersChangeNoOtherResponse(t *testing.T) {
	h := provision(t, &Handler{Zone: "edits", Key: "{http.request.header.X-Key}", Store: storeMemory,
		ReplenishRate: "1000", BurstCapacity: "1000", Headers: headersBoth})
	const workers, requests = 8, 200
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for g := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range requests {
				r, w := newRequest("192.0.2.1", fmt.Sprint("client-", g%2)) // two buckets: equal counts meet
				if err := h.ServeHTTP(w, r, okHandler); err != nil {
					errs <- err
					return
				}
				for name, vals := range w.Header() {
					for _, v := range vals {
						if strings.Contains(v, "edited") {
							errs <- fmt.Errorf("request %d got %s: %q, another response's edit", i, name, v)
							return
						}
					}
				}
				if g%2 == 0 { // half the responses edit theirs, as `header >Name 4 four` does
					for _, vals := range w.Header() {
						for j := range vals {
							vals[j] = "edited " + vals[j]
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestHeaderDirectiveOnOneRouteLeavesAnotherRoutesHeaders runs a real
// Caddy with two routes on two zones: /edited rewrites its rate-limit
// headers with `header >...`, /plain does not. /plain's headers are its
// own, whatever /edited did before or does meanwhile.
func TestHeaderDirectiveOnOneRouteLeavesAnotherRoutesHeaders(t *testing.T) {
	tester := loadCaddyfile(t, nil, caddyGlobals+`
http://localhost:9080 {
	handle /edited {
		header >X-RateLimit-Remaining 4 four
		header >X-RateLimit-Burst-Capacity 10 ten
		header >X-RateLimit-Replenish-Rate 1 one
		header >RateLimit-Policy "edits" "changed"
		rate_limit 0.01 10 {
			zone edits
			key {http.request.header.X-Key}
			headers both
			store memory
		}
		respond "edited"
	}
	handle /plain {
		rate_limit 0.01 10 {
			zone plain
			key {http.request.header.X-Key}
			headers both
			store memory
		}
		respond "plain"
	}
}`)
	plain := func(key string) (remaining int, err error) {
		resp, _, err := getKey(tester.Client, caddytestSite+"/plain", key)
		if err != nil {
			return 0, err
		}
		want := map[string]string{"X-Ratelimit-Burst-Capacity": "10", "X-Ratelimit-Replenish-Rate": "0.01",
			"X-Ratelimit-Requested-Tokens": "1", "Ratelimit-Policy": `"plain";q=10;w=1000`}
		for name, v := range want {
			if got := resp.Header.Get(name); got != v {
				return 0, fmt.Errorf("/plain %s: %q, want %q", name, got, v)
			}
		}
		text := resp.Header.Get("X-Ratelimit-Remaining")
		if remaining, err = strconv.Atoi(text); err != nil {
			return 0, fmt.Errorf("/plain X-RateLimit-Remaining: %q, want a count (headers %v)", text, resp.Header)
		}
		return remaining, nil
	}
	// /edited's remaining counts pass 4 (edited to "four") and its fixed
	// values are edited on every response ...
	for i := range 6 {
		resp, _, err := getKey(tester.Client, caddytestSite+"/edited", "amy")
		if err != nil {
			t.Fatal(err)
		}
		if i == 5 && resp.Header.Get("X-Ratelimit-Remaining") != "four" {
			t.Fatalf("/edited X-RateLimit-Remaining %q, want four (the header directive's edit)", resp.Header.Get("X-Ratelimit-Remaining"))
		}
	}
	// ... and /plain's pass 4 too, each as it is.
	for want := 9; want >= 0; want-- {
		got, err := plain("bo")
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("/plain X-RateLimit-Remaining %d, want %d", got, want)
		}
	}
	// Meanwhile too: both routes at once, /plain on fresh keys.
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				var err error
				if g%2 == 0 {
					_, _, err = getKey(tester.Client, caddytestSite+"/edited", fmt.Sprint("e", g, "-", i))
				} else {
					_, err = plain(fmt.Sprint("p", g, "-", i))
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
