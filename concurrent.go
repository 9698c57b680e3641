package ratelimit

// Concurrency limits (issue 23): at most n requests of a key in flight,
// across every instance that shares the Redis. A request takes a slot of
// each concurrent limit together with the tokens of the other limits, in
// the same script call, all or nothing (script.lua), and gives it back
// when its response has ended. A slot is held in Redis for a time: it
// expires after its hold unless the request that holds it renews it, so an
// instance that dies loses its slots within a hold.

import (
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// Concurrent is a concurrency limit: at most Slots requests of one key in
// flight at once, counted across every Caddy instance that shares the
// Redis (or the process, with its buckets in memory). A request takes one slot
// of each concurrent limit of its handler, together with the tokens of
// its other limits, all or nothing, and gives it back when its response
// has ended: finished, failed, panicked, or when the client left. When
// every slot is taken the request is refused with the handler's
// `status_code` and `Retry-After: <retry_after>`.
type Concurrent struct {
	// Name names the limit as a limit's name does (headers, placeholders,
	// metrics, Redis keys), unique among the handler's limits. Required.
	Name string `json:"name,omitempty"`

	// Slots is how many requests of a key may be in flight at once: a
	// whole number, placeholders resolved per request (plans) to one, or
	// `unlimited`, which exempts the request. 0 refuses every request.
	// Required.
	Slots Param `json:"slots,omitempty"`

	// Key, IPv4Prefix and IPv6Prefix are as the handler's, and default to
	// the handler's values.
	Key        string `json:"key,omitempty"`
	IPv4Prefix *int   `json:"ipv4_prefix,omitempty"`
	IPv6Prefix *int   `json:"ipv6_prefix,omitempty"`

	// Hold is how long a slot lives in Redis without renewal, by Redis's
	// clock: a request renews its slot every third of it while it runs,
	// so a slot of an instance that died is free again within a hold.
	// From 1s to 24h. Default: 30s.
	Hold caddy.Duration `json:"hold,omitempty"`

	// RetryAfter is the `Retry-After` of a request refused because every
	// slot was taken, in seconds: slots come back when responses end, not
	// at a time the limiter knows. Default: 1.
	RetryAfter int `json:"retry_after,omitempty"`
}

// Bounds and defaults of a concurrent limit.
const (
	defaultSlotHold  = 30 * time.Second
	minSlotHold      = time.Second
	maxSlotHold      = 24 * time.Hour
	defaultSlotRetry = 1
	maxSlotRetry     = 86400
	concurrentUnit   = "concurrent-requests" // its RateLimit-Policy's unit (qu)
)

// slotRule is what a concurrent limit adds to its limit: its kind
// (kind.go).
type slotRule struct {
	hold       time.Duration
	holdArg    any // the hold in microseconds as script argument, boxed once
	retryAfter time.Duration
}

// inFlightGauge counts the slots of concurrent limits that this
// instance's requests hold (limit.inFlight).
var inFlightGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
	Namespace: "caddy", Subsystem: "rate_limit", Name: "in_flight",
	Help: "Slots of concurrent limits that this instance's requests hold now, by zone and limit.",
}, []string{"zone", "limit"})

// inFlightSeries gives a zone's concurrent limits their series of the
// in_flight gauge.
func inFlightSeries(zone string, limits []*limit.Limit) {
	for _, l := range limits {
		if l.Held != nil {
			l.InFlight = inFlightGauge.WithLabelValues(zone, l.Name)
		}
	}
}

// Script arguments of concurrent.lua, boxed once.
var (
	kindConcurrentArg any = "c"
)

// checkConcurrent judges the handler's concurrent limits as configured:
// the parser calls it at the end of the directive, Validate for JSON.
// seen holds the names of the limits judged before, which a concurrent
// limit must not take.
func (h *Handler) checkConcurrent(seen map[string]bool) error {
	for _, c := range h.Concurrent {
		if err := checkLimitName(c.Name); err != nil {
			return fmt.Errorf("concurrent: %w", err)
		}
		if seen[c.Name] {
			return fmt.Errorf("concurrent '%s': the name is given twice: limit names must be unique in a handler", c.Name)
		}
		seen[c.Name] = true
		if err := checkConcurrentValues(c); err != nil {
			return fmt.Errorf("concurrent %s: %w", c.Name, err)
		}
	}
	return h.checkLayersWith("concurrent limits", len(h.Concurrent))
}

// checkConcurrentValues judges one concurrent limit's own values.
func checkConcurrentValues(c Concurrent) error {
	if c.Slots == "" {
		return errors.New("slots is required: the most requests of a key in flight at once")
	}
	if !c.Slots.PerRequest() && c.Slots != limit.Unlimited {
		if _, err := parseSlots(string(c.Slots)); err != nil {
			return err
		}
	}
	if c.Key != "" {
		if _, err := keys.Parse(c.Key); err != nil {
			return err
		}
	}
	if err := checkPrefixes(c.IPv4Prefix, c.IPv6Prefix); err != nil {
		return err
	}
	if hold := time.Duration(c.Hold); hold != 0 && (hold < minSlotHold || hold > maxSlotHold) {
		return fmt.Errorf("hold '%v': want a duration from %v to %v (default %v): a request renews its slot every third of it",
			hold, minSlotHold, maxSlotHold, defaultSlotHold)
	}
	if c.RetryAfter < 0 || c.RetryAfter > maxSlotRetry {
		return fmt.Errorf("retry_after '%d': want whole seconds from 1 to %d (default %d)", c.RetryAfter, maxSlotRetry, defaultSlotRetry)
	}
	return nil
}

// parseSlots reads a number of slots.
func parseSlots(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > maxExactTokens {
		return 0, limit.BadValue("slots", s, "is not a whole number from 0 to 2^53 (or 'unlimited')")
	}
	return n, nil
}

// resolveSlots is a concurrent limit's values from its slots as written
// (placeholders replaced): n as the burst, one slot per request.
func resolveSlots(s string) (v limit.Values, isUnlimited bool, err error) {
	if s == limit.Unlimited {
		return v, true, nil
	}
	n, err := parseSlots(s)
	return limit.Values{Burst: n, Requested: 1}, false, err
}

func init() {
	registerKind(kindConfig{order: 2, configs: concurrentConfigs, check: (*Handler).checkConcurrent, zoneText: concurrentZoneText})
	registerMetrics(metricPart{collector: inFlightGauge, zone: inFlightSeries})
}

// concurrentZoneText is what the concurrent limits add to the text that
// names a handler without a zone (derivedZone).
func concurrentZoneText(h *Handler, text []byte) []byte {
	for _, c := range h.Concurrent {
		text = fmt.Appendf(text, "\x00c\x00%s\x00%s\x00%s", c.Name, c.Key, c.Slots)
	}
	return text
}

// concurrentConfigs are the handler's concurrent limits, after its
// other limits: a request's slots follow its buckets. Their keys are
// named limits' keys with a suffix of their own, so a slot set never
// meets a bucket.
func concurrentConfigs(h *Handler) []limitConfig {
	configs := make([]limitConfig, 0, len(h.Concurrent))
	for _, c := range h.Concurrent {
		hold := time.Duration(c.Hold)
		if hold == 0 {
			hold = defaultSlotHold
		}
		retry := c.RetryAfter
		if retry == 0 {
			retry = defaultSlotRetry
		}
		configs = append(configs, limitConfig{
			Limit:     Limit{Name: c.Name, Key: c.Key, BurstCapacity: c.Slots, IPv4Prefix: c.IPv4Prefix, IPv6Prefix: c.IPv6Prefix},
			what:      "concurrent",
			keySuffix: keys.Separator + "slots",
			newKind: func() (limit.Kind, error) {
				return &slotRule{hold: hold, holdArg: strconv.FormatInt(hold.Microseconds(), 10),
					retryAfter: time.Duration(retry) * time.Second}, nil
			},
		})
	}
	return configs
}

// instanceID starts every slot id of this process: slots of instances
// that share a Redis never meet.
var instanceID = func() string {
	var b [8]byte
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return hex.EncodeToString(b[:])
}()

var slotCounter atomic.Uint64

// slotID is a slot id and the room for its text: boxed as &text, it is
// one allocation where a string in an interface is two
// (BenchmarkServeHTTPConcurrentParallel 12 -> 11 allocs).
type slotID struct {
	text string
	room [32]byte // instanceID (16), ':', the count in base 36 (at most 13)
}

// newSlotID is a slot id no other request of any instance has.
func newSlotID() any {
	id := new(slotID)
	text := append(append(id.room[:0], instanceID...), ':')
	text = strconv.AppendUint(text, slotCounter.Add(1), 36)
	id.text = unsafe.String(&text[0], len(text)) // id.room is not written again
	return &id.text
}

// The concurrent limit as a kind of limit (kind.go), with none of the
// optional interfaces (see facts).

var _ limit.Kind = (*slotRule)(nil)

// slotLimitInfo is what the admin API lists of a concurrent limit beyond
// every limit's: its slots and hold.
type slotLimitInfo struct {
	Slots Param  `json:"slots,omitempty"`
	Hold  string `json:"hold,omitempty"`
}

// limitInfo lists its slots and hold.
func (s *slotRule) LimitInfo(l *limit.Limit) limit.LimitInfo {
	li := l.Info()
	li.KindView = slotLimitInfo{Slots: l.Burst, Hold: s.hold.String()}
	return li
}

// slotBucketInfo is what the admin API shows of a client's concurrent
// limit: its slots, how many are held now, and when each held slot
// expires unless renewed, in seconds, soonest first (Redis only;
// in-process slots do not expire).
type slotBucketInfo struct {
	Slots      int64     `json:"slots"`
	InUse      int64     `json:"in_use"`
	SlotExpiry []float64 `json:"slot_expires_in,omitempty"`
}

// bucketInfo shows how many of its slots are held, and when each held
// slot expires unless renewed (the store's peek reads its slots: store.peek).
func (*slotRule) BucketInfo(b limit.Bucket, v limit.View) limit.BucketInfo {
	slots := slotBucketInfo{Slots: b.Values.Burst, InUse: v.InUse}
	for _, d := range v.Expiries {
		slots.SlotExpiry = append(slots.SlotExpiry, d.Seconds())
	}
	return limit.BucketInfo{Limit: b.Limit.Name, Key: clientKey(&b), StoredKey: b.Key, KindView: slots}
}

func (*slotRule) BurstName() string { return "slots" }

// resolveValues reads its slots, in the burst's place.
func (*slotRule) ResolveValues(_, slots, _ string) (limit.Values, bool, error) {
	return resolveSlots(slots)
}

// scriptArgs are "c" and n; the request's slot id follows (begin).
func (*slotRule) ScriptArgs(v limit.Values) [3]any {
	return [3]any{kindConcurrentArg, strconv.FormatInt(v.Burst, 10), nil}
}

// begin gives the bucket the request's slot id, one for all its
// concurrent limits.
func (*slotRule) Begin(b limit.Bucket, shared limit.Shared) (limit.Bucket, limit.Shared) {
	if shared.ID == nil {
		shared.ID = newSlotID()
	}
	b.Args[2] = shared.ID
	return b, shared
}

// appendArgs appends "c", n, the slot id, then the hold.
func (s *slotRule) AppendArgs(args []any, b limit.Bucket) []any {
	return append(append(args, b.Args[:]...), s.holdArg)
}

// heldWhileServed: a request holds its slot until its response has
// ended (heldKind).
func (r *slotRule) HoldFor() (time.Duration, any) { return r.hold, r.holdArg }

func (*slotRule) ReplyWords() int                                                  { return 0 }
func (*slotRule) ReadReply(b limit.Bucket, _ []int64, _ int) (limit.Bucket, error) { return b, nil }

// A concurrent limit's slots in the process are counts of their own
// (slotCounts), never bucket states: it has no bucketArithmetic, and a
// take in the process gives the kinds only the token buckets before the
// slots. It charges nothing (a response costs it its slot): no
// chargedKind. Its slots come back by release, not by time: a layer
// remembers none of its refusals (no rememberedKind).

// facts are its slots as the burst, a token bucket's of no rate, and as
// the policy's q in the IETF unit of concurrent requests; its wait is
// retry_after when it was full (refused).
func (*slotRule) Facts(b limit.Bucket) limit.Facts {
	return limit.Facts{Rate: b.Values.Rate, Burst: b.Values.Burst, Requested: b.Values.Requested,
		Unit: concurrentUnit, Reset: b.RetryAfter}
}

// refused waits retry_after when it was full: slots come back by
// release, not by time (the script says 0).
func (s *slotRule) Refused(b limit.Bucket) limit.Bucket {
	if b.Remaining == 0 && !b.Unknown {
		b.RetryAfter = s.retryAfter
	}
	return b
}
