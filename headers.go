package ratelimit

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
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
// Gateway's `X-RateLimit-*` set, which describes one limit, and the IETF
// draft-10 `RateLimit` and `RateLimit-Policy` fields, an item per limit.
// What does not change between requests is formatted once.
type rateLimitHeaders struct {
	spring, ietf bool
	limits       []limitHeaders // by limit index
	// policy is RateLimit-Policy when every limit applies with its fixed
	// values (nil when some limit has placeholders).
	policy []string
}

// limitHeaders are one fixed limit's header values.
type limitHeaders struct {
	rate, burst, requested []string
	quoted                 string // "<zone>" or "<zone>.<name>"
	policy                 string // its RateLimit-Policy item
}

func newRateLimitHeaders(style string, limits []*limit) rateLimitHeaders {
	rh := rateLimitHeaders{
		spring: style == headersSpring || style == headersBoth,
		ietf:   style == headersIETF || style == headersBoth,
		limits: make([]limitHeaders, len(limits)),
	}
	// Shared by every response: saves 3 allocs, 48 B per request
	// (BenchmarkServeHTTPAllowed 19 -> 16). Capacity 1: an append copies.
	one := func(s string) []string { return []string{s} }
	items := make([]string, 0, len(limits))
	for i, l := range limits {
		lh := &rh.limits[i]
		lh.quoted = strconv.Quote(l.ietfName)
		if l.fixed && !l.exempt {
			lh.rate = one(strconv.FormatFloat(l.values.rate, 'f', -1, 64))
			lh.burst = one(strconv.FormatInt(l.values.burst, 10))
			lh.requested = one(strconv.FormatInt(l.values.requested, 10))
			lh.policy = policyItem(lh.quoted, l.values)
			items = append(items, lh.policy)
		}
	}
	if len(items) == len(limits) {
		rh.policy = one(strings.Join(items, ", "))
	}
	return rh
}

// policyItem is a limit's RateLimit-Policy item: its burst as the quota
// and the seconds an empty bucket takes to fill as the window.
func policyItem(quoted string, v limitValues) string {
	fill := int64(0)
	if v.rate > 0 {
		fill = int64(math.Ceil(float64(v.burst) / v.rate))
	}
	return fmt.Sprintf("%s;q=%d;w=%d", quoted, v.burst, fill)
}

// set writes the headers of a request whose buckets were consulted; the
// Spring set describes buckets[described]. A bucket's remaining is -1
// when Redis failed, its retryAfter negative when it never refills
// (burst_capacity 0).
func (rh *rateLimitHeaders) set(hdr http.Header, buckets []bucket, described int) {
	if rh.spring {
		b := &buckets[described]
		hdr["X-Ratelimit-Remaining"] = countValue(b.remaining)
		if lh := &rh.limits[b.limit.index]; b.limit.fixed {
			hdr["X-Ratelimit-Replenish-Rate"] = lh.rate
			hdr["X-Ratelimit-Burst-Capacity"] = lh.burst
			hdr["X-Ratelimit-Requested-Tokens"] = lh.requested
		} else {
			hdr["X-Ratelimit-Replenish-Rate"] = []string{strconv.FormatFloat(b.values.rate, 'f', -1, 64)}
			hdr["X-Ratelimit-Burst-Capacity"] = countValue(b.values.burst)
			hdr["X-Ratelimit-Requested-Tokens"] = countValue(b.values.requested)
		}
	}
	if !rh.ietf {
		return
	}
	// The IETF fields describe buckets; without an answer from Redis, or
	// for a bucket that never refills, there is nothing true to say.
	var stateBuf, policyBuf [128]byte
	state, policy := stateBuf[:0], policyBuf[:0]
	items := 0
	for i := range buckets {
		b := &buckets[i]
		if b.remaining < 0 || b.retryAfter < 0 {
			return // Redis failed, or a bucket never refills: nothing true to say
		}
		lh := &rh.limits[b.limit.index]
		if i > 0 {
			policy = append(policy, ", "...)
		}
		if rh.policy == nil {
			policy = append(policy, policyItem(lh.quoted, b.values)...)
		} else {
			policy = append(policy, lh.policy...)
		}
		if b.unknown { // a cached denial says nothing of this bucket's state
			continue
		}
		if items > 0 {
			state = append(state, ", "...)
		}
		items++
		state = append(state, lh.quoted...)
		state = append(state, ";r="...)
		state = strconv.AppendInt(state, b.remaining, 10)
		state = append(state, ";t="...)
		state = strconv.AppendInt(state, ceilSeconds(b.retryAfter), 10)
	}
	if items > 0 {
		hdr["Ratelimit"] = []string{string(state)}
	}
	if rh.policy != nil && len(buckets) == len(rh.limits) {
		hdr["Ratelimit-Policy"] = rh.policy
	} else {
		hdr["Ratelimit-Policy"] = []string{string(policy)}
	}
}

// smallCounts are the header values of -1 to 1022, made once: most
// remaining counts and retry times are small, and cost no allocation
// (3 allocs, 40 B per denial: BenchmarkServeHTTPDenied 8 -> 5).
var smallCounts = func() (v [1024][]string) {
	for i := range v {
		v[i] = []string{strconv.Itoa(i - 1)}
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
