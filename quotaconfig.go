package ratelimit

import (
	"cmp"
	"fmt"
	"time"

	"github.com/caddy-redis/ratelimit/internal/calendar"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
)

// The quota's config: its limits as the handler's config gives them,
// and their judgment (internal/kind/quota holds the kind, which compose.go
// makes).

// quotaConfigs are the handler's quotas as the limits they are built
// into: the count in the burst's place, no rate.
func quotaConfigs(h *Handler) []limitConfig {
	configs := make([]limitConfig, 0, len(h.Quotas))
	for _, q := range h.Quotas {
		configs = append(configs, limitConfig{
			Limit: Limit{Name: q.Name, Key: q.Key, BurstCapacity: q.Count, RequestedTokens: cmp.Or(unset(q.RequestedTokens), unset(h.RequestedTokens)),
				IPv4Prefix: q.IPv4Prefix, IPv6Prefix: q.IPv6Prefix, Charge: q.Charge, ChargeStatus: q.ChargeStatus, MaxDebt: q.MaxDebt},
			what: "quota", charges: true, // a quota's debt is paid back at its boundary: no checkDebt
			newKind: func() (limit.Kind, error) {
				k, err := newQuota(q)
				if err != nil {
					return nil, fmt.Errorf("quota %s: %w", q.Name, err)
				}
				return k, nil
			},
		})
	}
	return configs
}

// checkQuotas judges the handler's quotas as configured: the parser
// calls it at the end of the directive, Validate for JSON. names holds
// the limits' names, which quotas share.
func (h *Handler) checkQuotas(names map[string]bool) error {
	if h.ResetJitter < 0 || h.ResetJitter > 0 && len(h.Quotas) == 0 {
		return fmt.Errorf("reset_jitter '%v': spreads the Retry-After of quotas past their boundary; use a positive duration with quotas, or remove it", time.Duration(h.ResetJitter))
	}
	if err := h.checkLayersWith("quotas", len(h.Quotas)); err != nil {
		return err
	}
	for _, q := range h.Quotas {
		if err := checkLimitName(q.Name); err != nil {
			return fmt.Errorf("quota: %w", err)
		}
		if names[q.Name] {
			return fmt.Errorf("quota '%s': the name is given twice: limit and quota names must be unique in a handler", q.Name)
		}
		names[q.Name] = true
		err := checkPrefixes(q.IPv4Prefix, q.IPv6Prefix)
		if err == nil && q.Key != "" {
			_, err = keys.Parse(q.Key)
		}
		if err == nil && q.Per == "" {
			err = fmt.Errorf("per is required: %s", calendar.WantPer)
		}
		if err == nil {
			_, err = calendar.New(q.Per, q.TimeZone, q.MonthDay, q.WeekStarts)
		}
		if err == nil {
			err = checkQuotaValues(q.Count, cmp.Or(unset(q.RequestedTokens), unset(h.RequestedTokens)))
		}
		if err != nil {
			return fmt.Errorf("quota %s: %w", q.Name, err)
		}
	}
	return nil
}
