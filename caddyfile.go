package ratelimit

import (
	"cmp"
	"fmt"
	"strconv"
	"strings"

	"github.com/caddy-redis/ratelimit/internal/calendar"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("rate_limit", parseCaddyfile)
	// Limit before authenticating, as the ecosystem's other rate limiter
	// does, so that users need neither `order` nor `route`.
	httpcaddyfile.RegisterDirectiveOrder("rate_limit", httpcaddyfile.Before, "basic_auth")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	rl := new(Handler)
	err := rl.UnmarshalCaddyfile(h.Dispenser)
	return rl, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	rate_limit [<matcher>] [<replenish_rate> <burst_capacity> [<requested_tokens>]] {
//		zone             <name>
//		key              <template with placeholders>
//		replenish_rate   <tokens per second, or <count>/<duration> like 100/1m>
//		burst_capacity   <integer>
//		requested_tokens <integer> | <value>[*<weight>]...
//		ipv4_prefix      <bits>
//		ipv6_prefix      <bits>
//		charge           header <name> | json <path>[*<weight>]... | json { <field> <path>[*<weight>]... } | placeholder <{placeholder}>
//		charge_status    <code|class>...
//		max_debt         <tokens>
//		max_body         <size>
//		request_body {
//			json     <path>...
//			max_size <size>
//		}
//		limit <name> [<replenish_rate> <burst_capacity> [<requested_tokens>]] {
//			key              <template with placeholders>
//			replenish_rate   <rate>
//			burst_capacity   <integer>
//			requested_tokens <integer> | <value>[*<weight>]...
//			ipv4_prefix      <bits>
//			ipv6_prefix      <bits>
//			charge           header <name> | json <path>[*<weight>]... | json { <field> <path>[*<weight>]... } | placeholder <{placeholder}>
//			charge_status    <code|class>...
//			max_debt         <tokens>
//		}
//		quota <name> <count> per <period> {
//			key              <template with placeholders>
//			requested_tokens <integer> | <value>[*<weight>]...
//			ipv4_prefix      <bits>
//			ipv6_prefix      <bits>
//			time_zone        <IANA zone>
//			month_day        <1-28>
//			week_starts      monday|sunday
//			charge           header <name> | json <path>[*<weight>]... | json { <field> <path>[*<weight>]... } | placeholder <{placeholder}>
//			charge_status    <code|class>...
//			max_debt         <tokens>
//		}
//		reset_jitter     <duration>
//		concurrent <name> <slots> {
//			key              <template with placeholders>
//			ipv4_prefix      <bits>
//			ipv6_prefix      <bits>
//			hold             <duration>
//			retry_after      <seconds>
//		}
//		deny_empty_key   true|false
//		empty_key_status <http status>
//		status_code      <http status>
//		include_headers  true|false
//		on_error         allow|deny|local
//		store            redis|memory
//		lease            <max_tokens> [<hold>]
//		max_keys         <n>
//		max_wait         <duration>
//		max_waiting      <n>
//		headers          spring|ietf|both|none
//		shadow
//		log_key
//		metrics          on|off
//		redis [<address>...] {
//			address      <host:port or redis:// / rediss:// URL>...
//			cluster
//			master_name  <name>
//			sentinel_username <name>
//			sentinel_password <secret>
//			username     <name>
//			password     <secret>
//			db           <index>
//			key_prefix   <prefix>
//			timeout      <duration>
//			dial_timeout <duration>
//			pool_size    <n>
//			tls {
//				ca          <pem file>
//				cert        <pem file>
//				key         <pem file>
//				server_name <name>
//				insecure_skip_verify
//			}
//		}
//	}
//
// The inline arguments set the subdirectives of the same names. Each
// subdirective may be given once; `limit`, `quota` and `concurrent`
// once per name. A quota's period is minute, hour, day, week, month,
// year or a duration (6h). A rate, burst, count, slots or
// cost may be placeholders, resolved per request (a rate of `unlimited`
// exempts the request from that limit).
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name

	seen := map[string]bool{}
	fields := h.limitFields()
	if err := fields.inline(d, seen, "rate_limit", d.RemainingArgs()); err != nil {
		return err
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] && sub != "limit" && sub != "quota" && sub != "concurrent" {
			return d.Errf("subdirective '%s' is given twice", sub)
		}
		seen[sub] = true
		value := func(set func(string) error) error { return oneValue(d, "", set) }
		var err error
		switch sub {
		case "zone":
			err = value(func(v string) error { h.Zone = v; return checkZone(v) })
		case "limit":
			err = h.unmarshalLimit(d)
		case "quota":
			err = h.unmarshalQuota(d)
		case "reset_jitter":
			err = value(func(v string) error { return setDuration(&h.ResetJitter, sub, v) })
		case "concurrent":
			err = h.unmarshalConcurrent(d)
		case "deny_empty_key":
			err = value(func(v string) error { return setBool(&h.DenyEmptyKey, sub, v) })
		case "include_headers":
			err = value(func(v string) error { return setBool(&h.IncludeHeaders, sub, v) })
		case "empty_key_status":
			err = value(func(v string) error { return setStatus(&h.EmptyKeyStatus, sub, v) })
		case "status_code":
			err = value(func(v string) error { return setStatus(&h.StatusCode, sub, v) })
		case "on_error":
			err = value(func(v string) error { h.OnError = v; return checkOnError(v) })
		case "store":
			err = value(func(v string) error { h.Store = v; return checkStore(v, false, "") })
		case "lease":
			err = h.unmarshalLease(d)
		case "max_body":
			err = value(func(v string) error {
				n, err := parseSize(v)
				h.MaxBody = n
				return err
			})
		case "request_body":
			err = h.unmarshalRequestBody(d) // requestbody.go
		case "max_wait":
			err = value(func(v string) error { h.MaxWait = Param(v); return checkMaxWait(h.MaxWait) })
		case "max_waiting":
			err = value(func(v string) error {
				n, err := strconv.Atoi(v)
				if err != nil || n < 1 {
					return fmt.Errorf("max_waiting '%s': want a whole number of requests, 1 or more", v)
				}
				h.MaxWaiting = n
				return nil
			})
		case "max_keys":
			err = value(func(v string) error {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return fmt.Errorf("max_keys '%s': want a whole number of buckets, 1 or more", v)
				}
				h.MaxKeys = n
				return checkMaxKeys(n)
			})
		case "headers":
			err = value(func(v string) error { h.Headers = v; return checkHeaders(v) })
		case "metrics":
			err = value(func(v string) error {
				if v != "on" && v != "off" {
					return fmt.Errorf("metrics '%s': want 'on' or 'off'", v)
				}
				h.DisableMetrics = v == "off"
				return nil
			})
		case "shadow":
			err = noValue(d, "", &h.Shadow)
		case "log_key":
			err = noValue(d, "", &h.LogKey)
		case "redis":
			h.Redis = new(RedisConfig)
			err = h.Redis.unmarshalCaddyfile(d)
		default:
			var known bool
			if known, err = fields.set(d, "", sub); !known {
				return d.Errf("unrecognized rate_limit subdirective '%s'", sub)
			}
		}
		if err != nil {
			return err
		}
	}
	// Validate judges these too; here the message can name the line.
	if err := h.checkLimits(); err != nil {
		return d.WrapErr(err)
	}
	if err := checkStore(cmp.Or(h.Store, storeRedis), h.Redis != nil, h.OnError); err != nil {
		return d.WrapErr(err)
	}
	if err := checkLease(h.Lease, cmp.Or(h.Store, storeRedis)); err != nil { // store may come after lease
		return d.WrapErr(err)
	}
	if err := h.checkCharging(); err != nil {
		return d.WrapErr(err)
	}
	return nil
}

// unmarshalLimit parses one limit of a policy; the dispenser is on
// "limit":
//
//	limit <name> [<replenish_rate> <burst_capacity> [<requested_tokens>]] {
//		key              <template>
//		replenish_rate   <rate>
//		burst_capacity   <integer>
//		requested_tokens <integer> | <value>[*<weight>]...
//		ipv4_prefix      <bits>
//		ipv6_prefix      <bits>
//		charge           header <name> | json <path>[*<weight>]... | json { <field> <path>[*<weight>]... } | placeholder <{placeholder}>
//		charge_status    <code|class>...
//		max_debt         <tokens>
//		max_wait         <duration>
//	}
func (h *Handler) unmarshalLimit(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) == 0 {
		return argErr(d, "limit")
	}
	l := Limit{Name: args[0]}
	if err := checkLimitName(l.Name); err != nil {
		return d.WrapErr(err)
	}
	for _, other := range h.Limits {
		if other.Name == l.Name {
			return d.Errf("limit '%s' is given twice: limit names must be unique in a handler", l.Name)
		}
	}
	block := "limit " + l.Name
	seen := map[string]bool{}
	fields := l.limitFields()
	if err := fields.inline(d, seen, block, args[1:]); err != nil {
		return err
	}
	err := blockSubdirectives(d, block, seen, func(sub string) error {
		if sub == "max_wait" {
			return oneValue(d, block, func(v string) error {
				if l.MaxWait = Param(v); checkMaxWait(l.MaxWait) != nil {
					return fmt.Errorf("%s: %w", block, checkMaxWait(l.MaxWait))
				}
				return nil
			})
		}
		known, err := fields.set(d, block, sub)
		if !known {
			return d.Errf("unrecognized %s subdirective '%s' (a limit takes key, replenish_rate, burst_capacity, requested_tokens, max_wait, ipv4_prefix, ipv6_prefix, charge, charge_status and max_debt)", block, sub)
		}
		return err
	})
	if err != nil {
		return err
	}
	h.Limits = append(h.Limits, l)
	return nil
}

// unmarshalQuota parses `quota <name> <count> per <period> [{ ... }]`.
func (h *Handler) unmarshalQuota(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) != 4 || args[2] != "per" {
		return d.Errf("quota: want <name> <count> per <period>, like 'quota monthly 1000000 per month', got '%s'", strings.Join(args, " "))
	}
	q := Quota{Name: args[0], Count: Param(args[1]), Per: args[3]}
	if err := checkLimitName(q.Name); err != nil {
		return d.WrapErr(fmt.Errorf("quota: %w", err))
	}
	for _, other := range h.Quotas {
		if other.Name == q.Name {
			return d.Errf("quota '%s' is given twice: limit and quota names must be unique in a handler", q.Name)
		}
	}
	block := "quota " + q.Name
	inBlock := func(err error) error {
		if err != nil {
			err = fmt.Errorf("%s: %w", block, err)
		}
		return err
	}
	if err := inBlock(checkQuotaValues(q.Count, "")); err != nil {
		return d.WrapErr(err)
	}
	if err := inBlock(calendar.CheckPer(q.Per)); err != nil {
		return d.WrapErr(err)
	}
	var unusedRate, unusedBurst Param
	fields := limitFields{&q.Key, &unusedRate, &unusedBurst, &q.RequestedTokens, &q.IPv4Prefix, &q.IPv6Prefix,
		&q.Charge, &q.ChargeStatus, &q.MaxDebt}
	err := blockSubdirectives(d, block, map[string]bool{}, func(sub string) error {
		var err error
		known := true
		switch sub {
		case "time_zone":
			err = oneValue(d, block, func(v string) error {
				q.TimeZone = v
				return inBlock(calendar.CheckTimeZone(q.Per, v))
			})
		case "month_day":
			err = oneValue(d, block, func(v string) error {
				n, err := strconv.Atoi(v)
				if err != nil {
					return inBlock(fmt.Errorf("month_day '%s': %s", v, calendar.WantMonthDay))
				}
				q.MonthDay = n
				if n == 0 {
					return inBlock(fmt.Errorf("month_day '0': %s", calendar.WantMonthDay))
				}
				return inBlock(calendar.CheckMonthDay(q.Per, n))
			})
		case "week_starts":
			err = oneValue(d, block, func(v string) error {
				q.WeekStarts = v
				return inBlock(calendar.CheckWeekStarts(q.Per, v))
			})
		case "replenish_rate", "burst_capacity":
			known = false
		default:
			known, err = fields.set(d, block, sub)
		}
		if !known {
			return d.Errf("unrecognized %s subdirective '%s' (a quota takes key, requested_tokens, ipv4_prefix, ipv6_prefix, time_zone, month_day, week_starts, charge, charge_status and max_debt)", block, sub)
		}
		return err
	})
	if err != nil {
		return err
	}
	h.Quotas = append(h.Quotas, q)
	return nil
}

// unmarshalConcurrent parses one concurrent limit; the dispenser is on
// "concurrent":
//
//	concurrent <name> <slots> {
//		key         <template>
//		ipv4_prefix <bits>
//		ipv6_prefix <bits>
//		hold        <duration>
//		retry_after <seconds>
//		max_wait    <duration>
//		priority    <value>
//	}
func (h *Handler) unmarshalConcurrent(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) != 2 {
		return d.Errf("concurrent: want <name> <slots>, got %d argument(s): '%s'", len(args), strings.Join(args, " "))
	}
	c := Concurrent{Name: args[0], Slots: Param(args[1])}
	if err := checkLimitName(c.Name); err != nil {
		return d.WrapErr(fmt.Errorf("concurrent: %w", err))
	}
	for _, other := range h.Concurrent {
		if other.Name == c.Name {
			return d.Errf("concurrent '%s' is given twice: limit names must be unique in a handler", c.Name)
		}
	}
	block := "concurrent " + c.Name
	err := blockSubdirectives(d, block, map[string]bool{}, func(sub string) error {
		switch sub {
		case "key":
			return oneValue(d, block, func(v string) error { c.Key = v; _, err := keys.Parse(v); return err })
		case "ipv4_prefix":
			return oneValue(d, block, func(v string) error { return setPrefix(&c.IPv4Prefix, sub, v, 32) })
		case "ipv6_prefix":
			return oneValue(d, block, func(v string) error { return setPrefix(&c.IPv6Prefix, sub, v, 128) })
		case "hold":
			return oneValue(d, block, func(v string) error { return setDuration(&c.Hold, sub, v) })
		case "retry_after":
			return oneValue(d, block, func(v string) error {
				return setCount(&c.RetryAfter, sub, v, 1, fmt.Sprintf("want whole seconds from 1 to %d", maxSlotRetry))
			})
		case "max_wait": // at most maxSlotWait: checkConcurrentValues
			return oneValue(d, block, func(v string) error { return setDuration(&c.MaxWait, sub, v) })
		case "priority":
			return oneValue(d, block, func(v string) error { c.Priority = Param(v); return nil })
		}
		return d.Errf("unrecognized %s subdirective '%s' (a concurrent limit takes key, ipv4_prefix, ipv6_prefix, hold, retry_after, max_wait and priority)", block, sub)
	})
	if err != nil {
		return err
	}
	if err := checkConcurrentValues(c); err != nil {
		return d.WrapErr(fmt.Errorf("%s: %w", block, err))
	}
	h.Concurrent = append(h.Concurrent, c)
	return nil
}

// blockSubdirectives calls each for every subdirective of the block the
// dispenser is on (a limit's, a quota's, a concurrent limit's), and
// refuses one given twice; seen holds those given already (inline).
func blockSubdirectives(d *caddyfile.Dispenser, block string, seen map[string]bool, each func(sub string) error) error {
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] {
			return d.Errf("%s: subdirective '%s' is given twice", block, sub)
		}
		seen[sub] = true
		if err := each(sub); err != nil {
			return err
		}
	}
	return nil
}

// unmarshalLease parses `lease <max_tokens> [<hold>]`.
func (h *Handler) unmarshalLease(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) < 1 || len(args) > 2 {
		return d.Errf("lease: want <max_tokens> [<hold>], got %d argument(s): '%s'", len(args), strings.Join(args, " "))
	}
	h.Lease = new(Lease)
	n, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil {
		return d.Errf("lease '%s': want the most tokens a call may lease, 1 or more", args[0])
	}
	h.Lease.MaxTokens = n
	if len(args) == 2 {
		if err := setDuration(&h.Lease.Hold, "lease hold", args[1]); err != nil {
			return d.WrapErr(err)
		}
	}
	if err := checkLease(h.Lease, cmp.Or(h.Store, storeRedis)); err != nil {
		return d.WrapErr(err)
	}
	return nil
}
