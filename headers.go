package ratelimit

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unsafe"
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
// What does not change between requests is formatted once, as strings:
// each response gets slices of its own (see headerValues).
type rateLimitHeaders struct {
	spring, ietf bool
	limits       []limitHeaders // by limit index
	// policy is RateLimit-Policy when every limit applies with its fixed
	// values ("" when some limit has placeholders).
	policy string
}

// limitHeaders are one fixed limit's header values.
type limitHeaders struct {
	rate, burst, requested string
	quoted                 string // "<zone>" or "<zone>.<name>"
	policy                 string // its RateLimit-Policy item
}

// headerValues are one response's header values, in one allocation: each
// header gets a window of cap 1 on vals. A later handler may write a
// value in place (Caddy's `header` directive replaces text so), which
// must change no other response, and an append copies. The strings
// themselves are immutable and may be shared.
type headerValues struct {
	vals [maxHeaderValues]string
	used int
	// digits holds X-RateLimit-Remaining's text when it is not one of
	// smallCounts (1 alloc less per such response: BenchmarkServeHTTPMemory).
	digits [20]byte
}

// maxHeaderValues is the most values a response gets: the Spring set,
// RateLimit, RateLimit-Policy and Retry-After.
const maxHeaderValues = 7

// put sets the header name to the value s, in a slice of the response's own.
func (v *headerValues) put(hdr http.Header, name, s string) {
	v.vals[v.used] = s
	hdr[name] = v.vals[v.used : v.used+1 : v.used+1]
	v.used++
}

// count is n as text: from smallCounts, or written into digits.
func (v *headerValues) count(n int64) string {
	if s, ok := smallCount(n); ok {
		return s
	}
	text := strconv.AppendInt(v.digits[:0], n, 10)
	return unsafe.String(&text[0], len(text)) // digits is never written again
}

func newRateLimitHeaders(style string, limits []*limit) rateLimitHeaders {
	rh := rateLimitHeaders{
		spring: style == headersSpring || style == headersBoth,
		ietf:   style == headersIETF || style == headersBoth,
		limits: make([]limitHeaders, len(limits)),
	}
	items := make([]string, 0, len(limits))
	for i, l := range limits {
		lh := &rh.limits[i]
		lh.quoted = strconv.Quote(l.ietfName)
		if l.quota != nil { // its items change with its period: quotaPeriod has them
			lh.burst = strconv.FormatInt(l.values.burst, 10)
			lh.requested = strconv.FormatInt(l.values.requested, 10)
			continue
		}
		if l.fixed && !l.exempt {
			lh.rate = strconv.FormatFloat(l.values.rate, 'f', -1, 64)
			lh.burst = strconv.FormatInt(l.values.burst, 10)
			lh.requested = strconv.FormatInt(l.values.requested, 10)
			lh.policy = policyItem(lh.quoted, l.values)
			if l.slots != nil {
				lh.policy = slotPolicyItem(lh.quoted, l.values) // concurrent.go
			}
			items = append(items, lh.policy)
		}
	}
	if len(items) == len(limits) {
		rh.policy = strings.Join(items, ", ")
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
// (burst_capacity 0). A denial (denied) gets Retry-After whatever the
// style: whole seconds until every bucket holds its requested tokens.
func (rh *rateLimitHeaders) set(hdr http.Header, buckets []bucket, described int, denied bool) {
	if !rh.spring && !rh.ietf && !denied {
		return
	}
	v := new(headerValues)
	if denied {
		v.put(hdr, "Retry-After", countText(ceilSeconds(retryAfter(buckets))))
	}
	if rh.spring {
		b := &buckets[described]
		v.put(hdr, "X-Ratelimit-Remaining", v.count(b.remaining))
		if lh := &rh.limits[b.limit.index]; b.quota != nil {
			setQuotaSpring(hdr, v, b, lh)
		} else if b.limit.fixed {
			v.put(hdr, "X-Ratelimit-Replenish-Rate", lh.rate)
			v.put(hdr, "X-Ratelimit-Burst-Capacity", lh.burst)
			v.put(hdr, "X-Ratelimit-Requested-Tokens", lh.requested)
		} else {
			v.put(hdr, "X-Ratelimit-Replenish-Rate", strconv.FormatFloat(b.values.rate, 'f', -1, 64))
			v.put(hdr, "X-Ratelimit-Burst-Capacity", countText(b.values.burst))
			v.put(hdr, "X-Ratelimit-Requested-Tokens", countText(b.values.requested))
		}
	}
	if rh.ietf {
		rh.setIETF(hdr, v, buckets)
	}
}

// setIETF writes RateLimit and RateLimit-Policy. Out of set, so that
// its buffers take no room on the stack of a request without them
// (set's frame 512 -> 128 bytes; see warnFull).
func (rh *rateLimitHeaders) setIETF(hdr http.Header, v *headerValues, buckets []bucket) {
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
		if b.quota != nil {
			policy = appendQuotaPolicy(policy, lh, b)
		} else if rh.policy == "" && b.limit.slots != nil {
			policy = append(policy, slotPolicyItem(lh.quoted, b.values)...)
		} else if rh.policy == "" {
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
		if b.quota != nil { // its reset: the end of the period it counted in
			state = strconv.AppendInt(state, ceilSeconds(max(b.retryAfter, b.quota.untilEnd(time.Now(), b.quotaShift))), 10)
		} else {
			state = strconv.AppendInt(state, ceilSeconds(b.retryAfter), 10)
		}
	}
	if items > 0 {
		v.put(hdr, "Ratelimit", string(state))
	}
	if rh.policy != "" && len(buckets) == len(rh.limits) {
		v.put(hdr, "Ratelimit-Policy", rh.policy)
	} else {
		v.put(hdr, "Ratelimit-Policy", string(policy))
	}
}

// smallCounts are the texts of -1 to 1022, made once: most remaining
// counts and retry times are small, and cost no allocation (3 allocs,
// 40 B per denial: BenchmarkServeHTTPDenied 8 -> 5). Strings are
// immutable: every response may share them (never a slice).
var smallCounts = func() (v [1024]string) {
	for i := range v {
		v[i] = strconv.Itoa(i - 1)
	}
	return v
}()

func smallCount(n int64) (string, bool) {
	if n >= -1 && n < int64(len(smallCounts))-1 {
		return smallCounts[n+1], true
	}
	return "", false
}

// countText is n as text.
func countText(n int64) string {
	if s, ok := smallCount(n); ok {
		return s
	}
	return strconv.FormatInt(n, 10)
}

// ceilSeconds rounds a duration up to whole seconds.
func ceilSeconds(d time.Duration) int64 {
	return int64((d + time.Second - 1) / time.Second)
}

// Quotas' headers (quota.go): their RateLimit-Policy items and X-RateLimit
// replenish rates change with the length of their period, so they come
// from the period (formatted once per period at a fixed count).

// appendQuotaPolicy appends a quota's RateLimit-Policy item.
func appendQuotaPolicy(policy []byte, lh *limitHeaders, b *bucket) []byte {
	if b.quota.policy != "" && b.limit.fixed {
		return append(policy, b.quota.policy...)
	}
	return append(policy, quotaPolicyItem(lh.quoted, b.values.burst, b.quota.window())...)
}

// setQuotaSpring writes the X-RateLimit values of a quota: its count as
// the burst capacity, spread over its period as the replenish rate.
func setQuotaSpring(hdr http.Header, v *headerValues, b *bucket, lh *limitHeaders) {
	if b.limit.fixed {
		v.put(hdr, "X-Ratelimit-Replenish-Rate", b.quota.rate)
		v.put(hdr, "X-Ratelimit-Burst-Capacity", lh.burst)
		v.put(hdr, "X-Ratelimit-Requested-Tokens", lh.requested)
		return
	}
	v.put(hdr, "X-Ratelimit-Replenish-Rate", quotaRate(b.values.burst, b.quota.window()))
	v.put(hdr, "X-Ratelimit-Burst-Capacity", countText(b.values.burst))
	v.put(hdr, "X-Ratelimit-Requested-Tokens", countText(b.values.requested))
}
