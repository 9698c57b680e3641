package ratelimit

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
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
//		requested_tokens <integer>
//		deny_empty_key   true|false
//		empty_key_status <http status>
//		status_code      <http status>
//		include_headers  true|false
//		on_error         allow|deny
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
// subdirective may be given once.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name

	seen := map[string]bool{}
	inline := []struct {
		name string
		set  func(string) error
	}{{"replenish_rate", h.setReplenishRate}, {"burst_capacity", h.setBurstCapacity}, {"requested_tokens", h.setRequestedTokens}}
	args := d.RemainingArgs()
	if len(args) == 1 || len(args) > len(inline) {
		return d.Errf("rate_limit: want <replenish_rate> <burst_capacity> [<requested_tokens>], got %d argument(s): '%s'",
			len(args), strings.Join(args, " "))
	}
	for i, arg := range args {
		seen[inline[i].name] = true
		if err := inline[i].set(arg); err != nil {
			return d.WrapErr(err)
		}
	}

	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] {
			return d.Errf("subdirective '%s' is given twice", sub)
		}
		seen[sub] = true
		value := func(set func(string) error) error { return oneValue(d, "", set) }
		var err error
		switch sub {
		case "zone":
			err = value(func(v string) error { h.Zone = v; return checkZone(v) })
		case "key":
			err = value(func(v string) error {
				h.Key = v
				_, err := parseKeyTemplate(v)
				return err
			})
		case "replenish_rate":
			err = value(h.setReplenishRate)
		case "burst_capacity":
			err = value(h.setBurstCapacity)
		case "requested_tokens":
			err = value(h.setRequestedTokens)
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
			return d.Errf("unrecognized rate_limit subdirective '%s'", sub)
		}
		if err != nil {
			return err
		}
	}
	// Validate judges this too; here the message can name the line.
	if err := checkLimit(h.ReplenishRate, h.BurstCapacity, h.RequestedTokens); err != nil {
		return d.WrapErr(err)
	}
	return nil
}

func (h *Handler) setReplenishRate(v string) error {
	rate, err := parseRate(v)
	if err != nil {
		return fmt.Errorf("replenish_rate '%s': %w", v, err)
	}
	h.ReplenishRate = rate
	return nil
}

func (h *Handler) setBurstCapacity(v string) error {
	burst, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return fmt.Errorf("burst_capacity '%s' is not a whole number", v)
	}
	h.BurstCapacity = &burst
	return nil
}

func (h *Handler) setRequestedTokens(v string) error {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return fmt.Errorf("requested_tokens '%s' is not a whole number", v)
	}
	if n == 0 { // in JSON, 0 means the default; written out, it is a mistake
		return fmt.Errorf("requested_tokens '0' must be at least 1")
	}
	h.RequestedTokens = n
	return nil
}

// unmarshalCaddyfile parses the redis block; the dispenser is on "redis".
// Addresses given inline and with `address` add up.
func (rc *RedisConfig) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	if err := rc.addAddresses(d, d.RemainingArgs()); err != nil {
		return err
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] && sub != "address" {
			return d.Errf("redis subdirective '%s' is given twice", sub)
		}
		seen[sub] = true
		value := func(set func(string) error) error { return oneValue(d, "redis", set) }
		var err error
		switch sub {
		case "address":
			addrs := d.RemainingArgs()
			if len(addrs) == 0 {
				return argErr(d, "redis address")
			}
			err = rc.addAddresses(d, addrs)
		case "cluster":
			err = noValue(d, "redis", &rc.Cluster)
		case "master_name":
			err = value(into(&rc.MasterName))
		case "sentinel_username":
			err = value(into(&rc.SentinelUsername))
		case "sentinel_password":
			err = value(into(&rc.SentinelPassword))
		case "username":
			err = value(into(&rc.Username))
		case "password":
			err = value(into(&rc.Password))
		case "key_prefix":
			err = value(into(&rc.KeyPrefix))
		case "db":
			err = value(func(v string) error {
				return setCount(&rc.DB, "redis db", v, 0, "want a database index, 0 or more")
			})
		case "pool_size":
			err = value(func(v string) error {
				return setCount(&rc.PoolSize, "redis pool_size", v, 1, "want a whole number of connections, 1 or more")
			})
		case "timeout":
			err = value(func(v string) error { return setDuration(&rc.Timeout, "redis timeout", v) })
		case "dial_timeout":
			err = value(func(v string) error { return setDuration(&rc.DialTimeout, "redis dial_timeout", v) })
		case "tls":
			if d.NextArg() {
				return argErr(d, "redis tls")
			}
			rc.TLS = new(RedisTLS)
			err = rc.TLS.unmarshalCaddyfile(d)
		default:
			return d.Errf("unrecognized redis subdirective '%s'", sub)
		}
		if err != nil {
			return err
		}
	}
	if err := rc.validate(); err != nil {
		return d.WrapErr(err)
	}
	return nil
}

// addAddresses adds Redis addresses and checks them where they are
// written. One with a placeholder is checked once resolved, at
// provisioning.
func (rc *RedisConfig) addAddresses(d *caddyfile.Dispenser, addrs []string) error {
	for _, a := range addrs {
		if _, err := checkAddress(a); err != nil {
			return d.WrapErr(err)
		}
	}
	rc.Addresses = append(rc.Addresses, addrs...)
	return nil
}

// unmarshalCaddyfile parses the tls block inside redis.
func (t *RedisTLS) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] {
			return d.Errf("redis tls subdirective '%s' is given twice", sub)
		}
		seen[sub] = true
		value := func(set func(string) error) error { return oneValue(d, "redis tls", set) }
		var err error
		switch sub {
		case "ca":
			err = value(into(&t.CA))
		case "cert":
			err = value(into(&t.Cert))
		case "key":
			err = value(into(&t.Key))
		case "server_name":
			err = value(into(&t.ServerName))
		case "insecure_skip_verify":
			err = noValue(d, "redis tls", &t.InsecureSkipVerify)
		default:
			return d.Errf("unrecognized redis tls subdirective '%s'", sub)
		}
		if err != nil {
			return err
		}
	}
	if err := t.validate(); err != nil {
		return d.WrapErr(fmt.Errorf("redis %w", err))
	}
	return nil
}

// oneValue reads the single value of the subdirective the dispenser is
// on and hands it to set, whose error gets the line appended. block
// names the enclosing blocks for messages ("redis tls").
func oneValue(d *caddyfile.Dispenser, block string, set func(string) error) error {
	sub := d.Val()
	var v string
	if !d.AllArgs(&v) {
		return argErr(d, strings.TrimSpace(block+" "+sub))
	}
	if err := set(v); err != nil {
		return d.WrapErr(err)
	}
	return nil
}

// into stores a value as written.
func into(dst *string) func(string) error {
	return func(v string) error { *dst = v; return nil }
}

// noValue sets a flag subdirective, which takes no value.
func noValue(d *caddyfile.Dispenser, block string, flag *bool) error {
	sub := d.Val()
	if d.NextArg() {
		return argErr(d, strings.TrimSpace(block+" "+sub))
	}
	*flag = true
	return nil
}

// argErr is d.ArgErr naming the subdirective, which d.ArgErr leaves out
// when there are too many arguments.
func argErr(d *caddyfile.Dispenser, sub string) error {
	return fmt.Errorf("%s: %w", sub, d.ArgErr())
}

func setBool(dst **bool, sub, v string) error {
	switch v {
	case "true", "false":
		b := v == "true"
		*dst = &b
		return nil
	}
	return fmt.Errorf("%s '%s': want true or false", sub, v)
}

func setStatus(dst *int, sub, v string) error {
	n, err := strconv.Atoi(v)
	if err != nil {
		return fmt.Errorf("%s '%s': %s", sub, v, wantStatus)
	}
	*dst = n
	return checkStatus(sub, n)
}

func setCount(dst *int, sub, v string, least int, want string) error {
	n, err := strconv.Atoi(v)
	if err != nil || n < least {
		return fmt.Errorf("%s '%s': %s", sub, v, want)
	}
	*dst = n
	return nil
}

func setDuration(dst *caddy.Duration, sub, v string) error {
	dur, err := caddy.ParseDuration(v)
	if err != nil || dur <= 0 {
		return fmt.Errorf("%s '%s': want a positive duration like 100ms or 2s", sub, v)
	}
	*dst = caddy.Duration(dur)
	return nil
}

// parseRate reads tokens per second: a number (`10`, `0.5`) or a count
// per duration (`100/1m`, `5000/1h`).
func parseRate(s string) (float64, error) {
	count, per, found := strings.Cut(s, "/")
	n, err := strconv.ParseFloat(count, 64)
	if err != nil || !(n > 0) || n > 1e15 {
		return 0, fmt.Errorf("%s, or <count>/<duration> like 100/1m", wantRate)
	}
	if !found {
		return n, nil
	}
	d, err := caddy.ParseDuration(per)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("the duration after '/' must be positive, like 1s, 1m or 1h")
	}
	return n / d.Seconds(), nil
}

// Interface guards
var _ caddyfile.Unmarshaler = (*Handler)(nil)
