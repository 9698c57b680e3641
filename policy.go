package ratelimit

import (
	"fmt"
	"net/http"
	"regexp"
	"strconv"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddyserver/caddy/v2"
)

// Param is a limit's rate, burst or cost: a number fixed in the config,
// or text with placeholders that each request resolves (`{plan_rate}`),
// parsed then exactly as a fixed value. In JSON a number, or a string.
type Param = limit.Param

// Limit is one token bucket of a policy. A request is admitted only if
// every limit of its handler holds the tokens the request asks of it;
// then all are taken, else none. What a limit leaves out is the
// handler's.
type Limit struct {
	// Name names the limit in headers (`"<zone>.<name>"`), the
	// `{http.rate_limit.limit_name}` placeholder, the `limit` label of
	// the metrics and its Redis keys: letters, digits, `-` and `_`,
	// unique in the handler. Required.
	Name string `json:"name,omitempty"`

	// Key is the template that picks this limit's bucket, as the
	// handler's `key`. Default: the handler's.
	Key string `json:"key,omitempty"`

	// ReplenishRate, BurstCapacity and RequestedTokens are as the
	// handler's, and default to the handler's values.
	ReplenishRate   Param `json:"replenish_rate,omitempty"`
	BurstCapacity   Param `json:"burst_capacity,omitempty"`
	RequestedTokens Param `json:"requested_tokens,omitempty"`

	// MaxWait is as the handler's, and defaults to the handler's.
	MaxWait Param `json:"max_wait,omitempty"`

	// IPv4Prefix and IPv6Prefix are as the handler's, and default to the
	// handler's values.
	IPv4Prefix *int `json:"ipv4_prefix,omitempty"`
	IPv6Prefix *int `json:"ipv6_prefix,omitempty"`

	// Charge, ChargeStatus and MaxDebt are as the handler's, and default
	// to the handler's values: a limit charges by the response when it or
	// its handler has `charge` or `charge_status`.
	Charge       *Charge `json:"charge,omitempty"`
	ChargeStatus []int   `json:"charge_status,omitempty"`
	MaxDebt      *int64  `json:"max_debt,omitempty"`
}

var limitNamePattern = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

func checkLimitName(name string) error {
	if !limitNamePattern.MatchString(name) {
		return fmt.Errorf("limit name '%s': use only letters, digits, '-' and '_'", name)
	}
	return nil
}

// unset is a rate or cost as JSON means it: 0 stands for unset.
func unset(p Param) Param {
	if p == "0" {
		return ""
	}
	return p
}

func checkPrefixes(v4, v6 *int) error {
	if v4 != nil && (*v4 < 0 || *v4 > 32) {
		return fmt.Errorf("ipv4_prefix '%d': want a prefix length from 0 to 32", *v4)
	}
	if v6 != nil && (*v6 < 0 || *v6 > 128) {
		return fmt.Errorf("ipv6_prefix '%d': want a prefix length from 0 to 128", *v6)
	}
	return nil
}

// asksRedis says whether any limit may ever call Redis: not when every
// one is a fixed hard block (burst 0) or exemption.
func (h *Handler) asksRedis() bool {
	for _, l := range h.limits {
		if !l.Fixed || !l.Exempt && l.Values.Burst > 0 {
			return true
		}
	}
	return false
}

// resolveBucketsWith finds a request's bucket for each limit that
// applies to it: the Redis key from the key template, and the values,
// resolved from placeholders where the config has them. skipped is the
// decision when no limit applies: `exempt`, or `empty_key` (with
// deny_empty_key false). It remembers the weights it
// resolves in memo (nil: none), for the rest of the request.
func (h *Handler) resolveBucketsWith(r *http.Request, repl *caddy.Replacer, buckets []limit.Bucket, memo *cost.Memo) (_ []limit.Bucket, skipped limit.Decision, err error) {
	return h.resolveLimits(h.limits, r, repl, buckets, memo)
}

// resolveLimits is resolveBucketsWith for some of the handler's limits,
// in its order.
func (h *Handler) resolveLimits(limits []*limit.Limit, r *http.Request, repl *caddy.Replacer, buckets []limit.Bucket, memo *cost.Memo) (_ []limit.Bucket, skipped limit.Decision, err error) {
	skipped = limit.DecisionEmptyKey
	rv := keys.RequestValues(r, repl) // one pass over the request's placeholders, for every limit
	var shared limit.Shared
	for _, l := range limits {
		values, args, exempt := l.Values, l.Args, l.Exempt
		if !l.Fixed {
			if values, exempt, err = l.Resolve(repl, memo); err != nil {
				if l.Name != "" {
					err = fmt.Errorf("limit %s: %w", l.Name, err)
				}
				return nil, skipped, err
			}
			switch {
			case l.CostOnly:
				args = l.BaseArgs
				args[2] = strconv.FormatInt(values.Requested, 10)
			case !exempt:
				args = l.Kind.ScriptArgs(values)
			}
		}
		if exempt {
			skipped = limit.DecisionExempt
			continue
		}
		if l.WaitText != "" {
			if values.MaxWait, err = l.ResolveWait(repl); err != nil {
				if l.Name != "" {
					err = fmt.Errorf("limit %s: %w", l.Name, err)
				}
				return nil, skipped, err
			}
		} else if l.Wait > 0 && !l.Fixed {
			values.MaxWait = l.Wait // a kind that waits by its own values (a concurrent limit's queue) has set its own
		}
		key := l.Template.Key(&rv, l.KeyPrefix, l.KeySuffix)
		if key == "" {
			if h.denyEmpty {
				return nil, skipped, errEmptyKey
			}
			continue
		}
		var b limit.Bucket
		b, shared = l.Kind.Begin(limit.Bucket{Limit: l, Key: key, Values: values, Args: args}, shared)
		buckets = append(buckets, b)
	}
	return buckets, skipped, nil
}
