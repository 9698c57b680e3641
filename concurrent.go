package ratelimit

// Concurrency limits: at most n requests of a key in flight,
// across every instance that shares the Redis. A request takes a slot of
// each concurrent limit together with the tokens of the other limits, in
// the same script call, all or nothing (script.lua), and gives it back
// when its response has ended. A slot is held in Redis for a time: it
// expires after its hold unless the request that holds it renews it, so an
// instance that dies loses its slots within a hold.

import (
	_ "embed"
	"errors"
	"fmt"
	"time"

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

	// MaxWait is how long a request that finds every slot of its key
	// taken waits for one, instead of being refused: it waits in a queue
	// kept in Redis (or in the process, with its buckets in memory),
	// shared by every instance, and a slot given back goes to the head of
	// the queue at once. A request still waiting when it runs out, or
	// whose client leaves, leaves the queue, takes no slot, and gets its
	// other limits' tokens back; one that ran out is refused as without
	// it. A fixed duration, from 0 (the default: refused at once) to 1h.
	// The handler bounds how many of its requests wait at once.
	MaxWait caddy.Duration `json:"max_wait,omitempty"`

	// Priority orders the queue: higher first, then by arrival. A whole
	// number from -1000000 to 1000000, or placeholders resolved per
	// request to one (a plan's, from `map`), which then refuses a request
	// whose priority is not one as a bad requested_tokens is. Default: 0.
	// Only with max_wait.
	Priority Param `json:"priority,omitempty"`
}

// Bounds and defaults of a concurrent limit.
const (
	defaultSlotHold  = 30 * time.Second
	minSlotHold      = time.Second
	maxSlotHold      = 24 * time.Hour
	defaultSlotRetry = 1
	maxSlotRetry     = 86400
	maxSlotWait      = time.Hour
)

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
		if err := checkSlots(string(c.Slots)); err != nil {
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
	if wait := time.Duration(c.MaxWait); wait < 0 || wait > maxSlotWait {
		return fmt.Errorf("max_wait '%v': want a duration from 0 (refused at once) to %v", wait, maxSlotWait)
	}
	if c.Priority != "" {
		if c.MaxWait == 0 {
			return fmt.Errorf("priority '%s': orders the requests that wait for a slot; it needs max_wait", c.Priority)
		}
		if !c.Priority.PerRequest() {
			if err := checkPriority(string(c.Priority)); err != nil {
				return err
			}
		}
	}
	return nil
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
			// The priority stands in the rate's place (the kind reads it
			// there), as the slots in the burst's.
			Limit: Limit{Name: c.Name, Key: c.Key, ReplenishRate: c.Priority, BurstCapacity: c.Slots,
				IPv4Prefix: c.IPv4Prefix, IPv6Prefix: c.IPv6Prefix},
			what:      "concurrent",
			keySuffix: keys.Separator + "slots",
			newKind: func() (limit.Kind, error) {
				return newConcurrent(hold, time.Duration(retry)*time.Second, time.Duration(c.MaxWait))
			},
		})
	}
	return configs
}
