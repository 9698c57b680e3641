package ratelimit

import (
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
		if l.kind.fixedHeaders(l, lh) {
			items = append(items, lh.policy)
		}
	}
	if len(items) == len(limits) {
		rh.policy = strings.Join(items, ", ")
	}
	return rh
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
		b.limit.kind.setSpring(hdr, v, *b, &rh.limits[b.limit.index])
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
		if rh.policy == "" {
			policy = b.limit.kind.appendPolicy(policy, lh, *b)
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
		state = strconv.AppendInt(state, ceilSeconds(b.limit.kind.resetIn(*b)), 10)
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
