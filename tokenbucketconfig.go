package ratelimit

import (
	"cmp"
	"fmt"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
)

// The token bucket's config: its limits as the handler's config gives
// them, and their judgment (internal/kind/tokenbucket holds the kind,
// which compose.go makes).

// Bounds of a limit: token counts stay exact in the script's doubles,
// and an empty bucket fills within a year.
const (
	maxExactTokens = cost.MaxTokens
	maxFillSeconds = cost.MaxFillSeconds
)

// bucketConfigs are the handler's token buckets as configured: its
// `limits`, or its own limit.
func bucketConfigs(h *Handler) []limitConfig {
	limits, what := h.Limits, "limit"
	if h.hasOwnLimit() {
		limits, what = []Limit{{}}, ""
	}
	configs := make([]limitConfig, 0, len(limits))
	for _, c := range limits {
		c.ReplenishRate, c.BurstCapacity = cmp.Or(unset(c.ReplenishRate), unset(h.ReplenishRate)), cmp.Or(c.BurstCapacity, h.BurstCapacity)
		c.RequestedTokens = cmp.Or(unset(c.RequestedTokens), unset(h.RequestedTokens))
		c.MaxWait = cmp.Or(c.MaxWait, h.MaxWait)
		rate := c.ReplenishRate
		configs = append(configs, limitConfig{
			Limit: c, what: what, own: what == "", charges: true,
			checkDebt: func(maxDebt int64) error { return checkDebtRefill(maxDebt, rate) },
			newKind:   newTokenBucket,
		})
	}
	return configs
}

// checkDebtRefill judges a max_debt against the rate that pays it back:
// within a year.
func checkDebtRefill(maxDebt int64, rate Param) error {
	if r, err := parseRate(string(rate)); err == nil && float64(maxDebt)/r > maxFillSeconds {
		return fmt.Errorf("max_debt '%d': a debt that large takes more than a year to pay back at replenish_rate '%v'; lower it to at most %d",
			maxDebt, r, int64(r*maxFillSeconds))
	}
	return nil
}

// checkMaxWait judges a max_wait as configured: a fixed one now, one
// with placeholders per request.
func checkMaxWait(p Param) error {
	if p == "" || p.PerRequest() {
		return nil
	}
	_, err := limit.ParseMaxWait(string(p))
	return err
}

// checkBuckets judges the handler's own limit and its `limits`.
func checkBuckets(h *Handler, names map[string]bool) error {
	if err := checkTokenBucketValues(unset(h.ReplenishRate), h.BurstCapacity, unset(h.RequestedTokens), h.hasOwnLimit()); err != nil {
		return err
	}
	if err := checkMaxWait(h.MaxWait); err != nil {
		return err
	}
	for _, l := range h.Limits {
		if err := checkLimitName(l.Name); err != nil {
			return err
		}
		if names[l.Name] {
			return fmt.Errorf("limit '%s' is given twice: limit names must be unique in a handler", l.Name)
		}
		names[l.Name] = true
		err := checkPrefixes(l.IPv4Prefix, l.IPv6Prefix)
		if err == nil && l.Key != "" {
			_, err = keys.Parse(l.Key)
		}
		if err == nil {
			err = checkMaxWait(l.MaxWait)
		}
		if err == nil {
			err = checkTokenBucketValues(cmp.Or(unset(l.ReplenishRate), unset(h.ReplenishRate)), cmp.Or(l.BurstCapacity, h.BurstCapacity),
				cmp.Or(unset(l.RequestedTokens), unset(h.RequestedTokens)), true)
		}
		if err != nil {
			return fmt.Errorf("limit %s: %w", l.Name, err)
		}
	}
	return nil
}
