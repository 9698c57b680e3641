package ratelimit

import (
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/caddy-redis/ratelimit/internal/limit"
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
// draft-10 `RateLimit` and `RateLimit-Policy` fields, an item per limit,
// from what each bucket's kind says of it (kind.facts). What does not
// change between requests is formatted once, as strings: each response
// gets slices of its own (see headerValues).
type rateLimitHeaders struct {
	spring, ietf bool
	limits       []limitHeaders // by limit index
	// policy is RateLimit-Policy of a request of every limit, when each
	// has fixed values (nil else), as last formatted: formatted again
	// when an item changes (a calendar period's length).
	policy *atomic.Pointer[wholePolicy]
}

// limitHeaders are one limit's header texts.
type limitHeaders struct {
	quoted string // "<zone>" or "<zone>.<name>"
	// fixed says the limit applies with fixed values: texts are those
	// of its facts, as last formatted.
	fixed bool
	texts atomic.Pointer[factTexts]
}

// factTexts are a fixed limit's facts as the headers say them, but for
// the time until it is back, which changes with every answer.
type factTexts struct {
	facts                  limit.Facts // reset and renewsAt zero
	rate, burst, requested string
	item                   string // its RateLimit-Policy item
}

// wholePolicy is RateLimit-Policy, of the items (each limit's texts)
// it was joined from.
type wholePolicy struct {
	items []*factTexts
	text  string
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

func newRateLimitHeaders(style string, limits []*limit.Limit) rateLimitHeaders {
	rh := rateLimitHeaders{
		spring: style == headersSpring || style == headersBoth,
		ietf:   style == headersIETF || style == headersBoth,
		limits: make([]limitHeaders, len(limits)),
	}
	fixed := 0
	for i, l := range limits {
		lh := &rh.limits[i]
		lh.quoted = strconv.Quote(l.IETFName)
		if lh.fixed = l.Fixed && !l.Exempt; lh.fixed {
			fixed++
		}
	}
	if fixed == len(limits) {
		rh.policy = new(atomic.Pointer[wholePolicy])
	}
	return rh
}

// textsOf are the texts of a bucket's facts f: its fixed limit's,
// formatted by the first answer that says them, and again only when its
// facts change (a calendar period's length); nil for a limit with values
// per request, whose texts are formatted per response.
func (rh *rateLimitHeaders) textsOf(b *limit.Bucket, f limit.Facts) *factTexts {
	lh := &rh.limits[b.Limit.Index]
	if !lh.fixed {
		return nil
	}
	f.Reset, f.RenewsAt = 0, 0
	if t := lh.texts.Load(); t != nil && t.facts == f {
		return t
	}
	t := &factTexts{facts: f, rate: strconv.FormatFloat(f.Rate, 'f', -1, 64),
		burst: strconv.FormatInt(f.Burst, 10), requested: strconv.FormatInt(f.Requested, 10),
		item: string(appendPolicyItem(nil, lh.quoted, f))}
	lh.texts.Store(t)
	return t
}

// appendPolicyItem appends a bucket's RateLimit-Policy item: its burst
// as the policy's q, its window as w, or its unit as qu.
func appendPolicyItem(policy []byte, quoted string, f limit.Facts) []byte {
	policy = append(policy, quoted...)
	policy = append(policy, ";q="...)
	policy = strconv.AppendInt(policy, f.Burst, 10)
	if f.Unit != "" {
		policy = append(policy, `;qu="`...)
		policy = append(policy, f.Unit...)
		return append(policy, '"')
	}
	policy = append(policy, ";w="...)
	return strconv.AppendInt(policy, f.Window, 10)
}

// set writes the headers of a request whose buckets were consulted; the
// Spring set describes buckets[described]. A bucket's remaining is -1
// when Redis failed, its retryAfter negative when it never refills
// (burst_capacity 0). A denial (denied) gets Retry-After whatever the
// style: whole seconds until every bucket holds its requested tokens.
func (rh *rateLimitHeaders) set(hdr http.Header, buckets []limit.Bucket, described int, denied bool) {
	if !rh.spring && !rh.ietf && !denied {
		return
	}
	v := new(headerValues)
	if denied {
		v.put(hdr, "Retry-After", countText(ceilSeconds(limit.FitsIn(buckets))))
	}
	if rh.spring {
		rh.setSpring(hdr, v, &buckets[described])
	}
	if rh.ietf {
		rh.setIETF(hdr, v, buckets)
	}
}

// setSpring writes the Spring set, which describes the bucket b as a
// token bucket.
func (rh *rateLimitHeaders) setSpring(hdr http.Header, v *headerValues, b *limit.Bucket) {
	v.put(hdr, "X-Ratelimit-Remaining", v.count(b.Remaining))
	f := b.Limit.Kind.Facts(*b)
	if t := rh.textsOf(b, f); t != nil {
		v.put(hdr, "X-Ratelimit-Replenish-Rate", t.rate)
		v.put(hdr, "X-Ratelimit-Burst-Capacity", t.burst)
		v.put(hdr, "X-Ratelimit-Requested-Tokens", t.requested)
		return
	}
	v.put(hdr, "X-Ratelimit-Replenish-Rate", strconv.FormatFloat(f.Rate, 'f', -1, 64))
	v.put(hdr, "X-Ratelimit-Burst-Capacity", countText(f.Burst))
	v.put(hdr, "X-Ratelimit-Requested-Tokens", countText(f.Requested))
}

// setIETF writes RateLimit and RateLimit-Policy. Out of set, so that
// its buffers take no room on the stack of a request without them
// (set's frame 512 -> 128 bytes; see warnFull).
func (rh *rateLimitHeaders) setIETF(hdr http.Header, v *headerValues, buckets []limit.Bucket) {
	// The IETF fields describe buckets; without an answer from Redis, or
	// for a bucket that never refills, there is nothing true to say.
	var stateBuf, policyBuf [128]byte
	state, policy := stateBuf[:0], policyBuf[:0]
	// whole is RateLimit-Policy as last formatted, while each item is
	// the one it was joined from.
	var whole *wholePolicy
	every := rh.policy != nil && len(buckets) == len(rh.limits)
	if every {
		whole = rh.policy.Load()
	}
	var now int64 // Unix microseconds, read once, for a bucket renewed at a time
	items := 0
	for i := range buckets {
		b := &buckets[i]
		if b.Remaining < 0 || b.RetryAfter < 0 {
			return // Redis failed, or a bucket never refills: nothing true to say
		}
		f := b.Limit.Kind.Facts(*b)
		if i > 0 {
			policy = append(policy, ", "...)
		}
		if t := rh.textsOf(b, f); t != nil {
			policy = append(policy, t.item...)
			if whole != nil && whole.items[i] != t {
				whole = nil
			}
		} else {
			policy = appendPolicyItem(policy, rh.limits[b.Limit.Index].quoted, f)
		}
		if b.Unknown { // a cached denial says nothing of this bucket's state
			continue
		}
		if items > 0 {
			state = append(state, ", "...)
		}
		items++
		reset := f.Reset
		if f.RenewsAt != 0 {
			if now == 0 {
				now = time.Now().UnixMicro()
			}
			reset = max(reset, time.Duration(f.RenewsAt-now)*time.Microsecond)
		}
		state = append(state, rh.limits[b.Limit.Index].quoted...)
		state = append(state, ";r="...)
		state = strconv.AppendInt(state, b.Remaining, 10)
		state = append(state, ";t="...)
		state = strconv.AppendInt(state, ceilSeconds(reset), 10)
	}
	if items > 0 {
		v.put(hdr, "Ratelimit", string(state))
	}
	switch {
	case whole != nil:
		v.put(hdr, "Ratelimit-Policy", whole.text)
	case every: // formatted once for as long as its items stay
		v.put(hdr, "Ratelimit-Policy", rh.joinPolicy(buckets).text)
	default:
		v.put(hdr, "Ratelimit-Policy", string(policy))
	}
}

// joinPolicy formats RateLimit-Policy of a request of every limit, each
// with fixed values, from their texts, and keeps it (rh.policy).
func (rh *rateLimitHeaders) joinPolicy(buckets []limit.Bucket) *wholePolicy {
	whole := &wholePolicy{items: make([]*factTexts, len(buckets))}
	var text []byte
	for i := range buckets {
		b := &buckets[i]
		t := rh.textsOf(b, b.Limit.Kind.Facts(*b))
		if i > 0 {
			text = append(text, ", "...)
		}
		whole.items[i], text = t, append(text, t.item...)
	}
	whole.text = string(text)
	rh.policy.Store(whole)
	return whole
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

// checkHeaders judges headers: one of the dialects above.
func checkHeaders(v string) error {
	switch v {
	case headersSpring, headersIETF, headersBoth, headersNone:
		return nil
	}
	return fmt.Errorf("headers '%s': want spring, ietf, both or none", v)
}
