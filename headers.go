package ratelimit

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"time"
)

// Header styles, as the `headers` subdirective names them.
const (
	headersSpring = "spring"
	headersIETF   = "ietf"
	headersBoth   = "both"
	headersNone   = "none"
)

// rateLimitHeaders writes the rate-limit response headers: Spring Cloud
// Gateway's `X-RateLimit-*` set and the IETF draft-10 `RateLimit` and
// `RateLimit-Policy` fields. What does not change between requests is
// formatted once.
type rateLimitHeaders struct {
	spring, ietf           bool
	rate, burst, requested []string
	policy                 []string // RateLimit-Policy: "<zone>";q=<burst>;w=<seconds to fill>
	ietfName               string   // "<zone>";r=
}

func newRateLimitHeaders(style, zone string, rate float64, burst, requested int64) rateLimitHeaders {
	one := func(s string) []string { return []string{s}[:1:1] } // an append copies: never shared
	fill := int64(0)
	if rate > 0 {
		fill = int64(math.Ceil(float64(burst) / rate))
	}
	return rateLimitHeaders{
		spring:    style == headersSpring || style == headersBoth,
		ietf:      style == headersIETF || style == headersBoth,
		rate:      one(strconv.FormatFloat(rate, 'f', -1, 64)),
		burst:     one(strconv.FormatInt(burst, 10)),
		requested: one(strconv.FormatInt(requested, 10)),
		policy:    one(fmt.Sprintf("%q;q=%d;w=%d", zone, burst, fill)),
		ietfName:  strconv.Quote(zone) + ";r=",
	}
}

// set writes the headers of a request whose bucket was consulted.
// remaining is -1 when Redis failed; next is how long until another
// request fits, negative when none ever will (burst_capacity 0).
func (rh *rateLimitHeaders) set(hdr http.Header, remaining int64, next time.Duration) {
	if rh.spring {
		hdr["X-Ratelimit-Remaining"] = countValue(remaining)
		hdr["X-Ratelimit-Replenish-Rate"] = rh.rate
		hdr["X-Ratelimit-Burst-Capacity"] = rh.burst
		hdr["X-Ratelimit-Requested-Tokens"] = rh.requested
	}
	// The IETF fields describe a bucket; without an answer from Redis, or
	// with a bucket that never refills, there is nothing true to say.
	if rh.ietf && remaining >= 0 && next >= 0 {
		b := make([]byte, 0, len(rh.ietfName)+24)
		b = append(b, rh.ietfName...)
		b = strconv.AppendInt(b, remaining, 10)
		b = append(b, ";t="...)
		b = strconv.AppendInt(b, ceilSeconds(next), 10)
		hdr["Ratelimit"] = []string{string(b)}
		hdr["Ratelimit-Policy"] = rh.policy
	}
}

// smallCounts are the header values of -1 to 1022, made once: most
// remaining counts and retry times are small, and cost no allocation.
var smallCounts = func() (v [1024][]string) {
	for i := range v {
		v[i] = []string{strconv.Itoa(i - 1)}[:1:1]
	}
	return v
}()

func countValue(n int64) []string {
	if n >= -1 && n < int64(len(smallCounts))-1 {
		return smallCounts[n+1]
	}
	return []string{strconv.FormatInt(n, 10)}
}

// ceilSeconds rounds a duration up to whole seconds.
func ceilSeconds(d time.Duration) int64 {
	return int64((d + time.Second - 1) / time.Second)
}
