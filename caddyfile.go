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
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name

	seen := map[string]bool{}
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 2, 3:
		rate, err := parseRate(args[0])
		if err != nil {
			return d.Errf("replenish_rate '%s': %v", args[0], err)
		}
		h.ReplenishRate = rate
		seen["replenish_rate"] = true
		burst, err := strconv.ParseInt(args[1], 10, 64)
		if err != nil {
			return d.Errf("burst_capacity '%s' is not a whole number", args[1])
		}
		h.BurstCapacity = &burst
		seen["burst_capacity"] = true
		if len(args) == 3 {
			if h.RequestedTokens, err = strconv.ParseInt(args[2], 10, 64); err != nil {
				return d.Errf("requested_tokens '%s' is not a whole number", args[2])
			}
			seen["requested_tokens"] = true
		}
	default:
		return d.Errf("rate_limit: want <replenish_rate> <burst_capacity> [<requested_tokens>], got %d argument(s): '%s'",
			len(args), strings.Join(args, " "))
	}

	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] {
			return d.Errf("subdirective '%s' is given twice", sub)
		}
		seen[sub] = true
		switch sub {
		case "redis":
			if err := h.unmarshalRedis(d); err != nil {
				return err
			}
			continue
		case "shadow", "log_key":
			if d.NextArg() {
				return d.Errf("%s takes no value, got '%s'", sub, d.Val())
			}
			h.Shadow = h.Shadow || sub == "shadow"
			h.LogKey = h.LogKey || sub == "log_key"
			continue
		}
		if !subdirectives[sub] {
			return d.Errf("unrecognized rate_limit subdirective '%s'", sub)
		}
		var val string
		if !d.AllArgs(&val) {
			return argErr(d, sub)
		}
		var err error
		switch sub {
		case "zone":
			h.Zone = val
		case "key":
			h.Key = val
		case "replenish_rate":
			if h.ReplenishRate, err = parseRate(val); err != nil {
				return d.Errf("replenish_rate '%s': %v", val, err)
			}
		case "burst_capacity":
			burst, err := strconv.ParseInt(val, 10, 64)
			if err != nil {
				return d.Errf("burst_capacity '%s' is not a whole number", val)
			}
			h.BurstCapacity = &burst
		case "requested_tokens":
			if h.RequestedTokens, err = strconv.ParseInt(val, 10, 64); err != nil {
				return d.Errf("requested_tokens '%s' is not a whole number", val)
			}
		case "deny_empty_key":
			b, err := parseBool(val)
			if err != nil {
				return d.Errf("deny_empty_key '%s': %v", val, err)
			}
			h.DenyEmptyKey = &b
		case "include_headers":
			b, err := parseBool(val)
			if err != nil {
				return d.Errf("include_headers '%s': %v", val, err)
			}
			h.IncludeHeaders = &b
		case "empty_key_status":
			if h.EmptyKeyStatus, err = parseStatus(val); err != nil {
				return d.Errf("empty_key_status '%s': %v", val, err)
			}
		case "status_code":
			if h.StatusCode, err = parseStatus(val); err != nil {
				return d.Errf("status_code '%s': %v", val, err)
			}
		case "on_error":
			if val != "allow" && val != "deny" {
				return d.Errf("on_error '%s': want 'allow' or 'deny'", val)
			}
			h.OnError = val
		case "headers":
			switch val {
			case headersSpring, headersIETF, headersBoth, headersNone:
			default:
				return d.Errf("headers '%s': want spring, ietf, both or none", val)
			}
			h.Headers = val
		case "metrics":
			if val != "on" && val != "off" {
				return d.Errf("metrics '%s': want 'on' or 'off'", val)
			}
			h.DisableMetrics = val == "off"
		default:
			return d.Errf("unrecognized rate_limit subdirective '%s'", sub)
		}
	}
	if !seen["replenish_rate"] && !seen["burst_capacity"] {
		// Validate refuses this too; here the error can name the line.
		return d.Err("rate_limit: replenish_rate is required (or burst_capacity 0 to block every request)")
	}
	return nil
}

// subdirectives are the single-valued subdirectives of rate_limit.
var subdirectives = map[string]bool{
	"zone": true, "key": true, "replenish_rate": true, "burst_capacity": true,
	"requested_tokens": true, "deny_empty_key": true, "include_headers": true,
	"empty_key_status": true, "status_code": true, "on_error": true,
	"headers": true, "metrics": true,
}

// argErr is d.ArgErr naming the subdirective, which d.ArgErr leaves out
// when there are too many arguments.
func argErr(d *caddyfile.Dispenser, sub string) error {
	return fmt.Errorf("%s: %w", sub, d.ArgErr())
}

// unmarshalRedis parses the redis block; the dispenser is on "redis".
func (h *Handler) unmarshalRedis(d *caddyfile.Dispenser) error {
	h.Redis = new(RedisConfig)
	rc := h.Redis
	if err := addAddresses(d, rc, d.RemainingArgs()); err != nil {
		return err
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] && sub != "address" {
			return d.Errf("redis subdirective '%s' is given twice", sub)
		}
		seen[sub] = true
		switch sub {
		case "address":
			addrs := d.RemainingArgs()
			if len(addrs) == 0 {
				return argErr(d, "redis address")
			}
			if err := addAddresses(d, rc, addrs); err != nil {
				return err
			}
		case "cluster":
			if d.NextArg() {
				return argErr(d, "redis cluster")
			}
			rc.Cluster = true
		case "tls":
			if d.NextArg() {
				return argErr(d, "redis tls")
			}
			if err := unmarshalRedisTLS(d, rc); err != nil {
				return err
			}
		default:
			if !redisSubdirectives[sub] {
				return d.Errf("unrecognized redis subdirective '%s'", sub)
			}
			var val string
			if !d.AllArgs(&val) {
				return argErr(d, "redis "+sub)
			}
			if err := setRedisValue(rc, sub, val); err != nil {
				return d.Errf("redis %s '%s': %v", sub, val, err)
			}
		}
	}
	return nil
}

// redisSubdirectives are the single-valued subdirectives of redis.
var redisSubdirectives = map[string]bool{
	"master_name": true, "sentinel_username": true, "sentinel_password": true,
	"username": true, "password": true, "key_prefix": true, "db": true,
	"pool_size": true, "timeout": true, "dial_timeout": true,
}

// addAddresses checks Redis addresses where they are written, then adds
// them.
func addAddresses(d *caddyfile.Dispenser, rc *RedisConfig, addrs []string) error {
	for _, a := range addrs {
		if strings.Contains(a, "{") {
			continue // a placeholder; checked once resolved
		}
		if _, err := parseAddress(a); err != nil {
			return d.Errf("redis address '%s': %v", a, err)
		}
	}
	rc.Addresses = append(rc.Addresses, addrs...)
	return nil
}

// setRedisValue sets one single-valued subdirective of the redis block.
func setRedisValue(rc *RedisConfig, sub, val string) error {
	var err error
	switch sub {
	case "master_name":
		rc.MasterName = val
	case "sentinel_username":
		rc.SentinelUsername = val
	case "sentinel_password":
		rc.SentinelPassword = val
	case "username":
		rc.Username = val
	case "password":
		rc.Password = val
	case "key_prefix":
		rc.KeyPrefix = val
	case "db":
		if rc.DB, err = strconv.Atoi(val); err != nil || rc.DB < 0 {
			return errString("want a database index, 0 or more")
		}
	case "pool_size":
		if rc.PoolSize, err = strconv.Atoi(val); err != nil || rc.PoolSize < 1 {
			return errString("want a whole number of connections, 1 or more")
		}
	case "timeout":
		return parsePositiveDuration(val, &rc.Timeout)
	case "dial_timeout":
		return parsePositiveDuration(val, &rc.DialTimeout)
	default:
		return errString("unrecognized redis subdirective")
	}
	return nil
}

func unmarshalRedisTLS(d *caddyfile.Dispenser, rc *RedisConfig) error {
	rc.TLS = new(RedisTLS)
	t := rc.TLS
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if seen[sub] {
			return d.Errf("redis tls subdirective '%s' is given twice", sub)
		}
		seen[sub] = true
		if sub == "insecure_skip_verify" {
			if d.NextArg() {
				return argErr(d, "redis tls insecure_skip_verify")
			}
			t.InsecureSkipVerify = true
			continue
		}
		switch sub {
		case "ca", "cert", "key", "server_name":
		default:
			return d.Errf("unrecognized redis tls subdirective '%s'", sub)
		}
		var val string
		if !d.AllArgs(&val) {
			return argErr(d, "redis tls "+sub)
		}
		switch sub {
		case "ca":
			t.CA = val
		case "cert":
			t.Cert = val
		case "key":
			t.Key = val
		case "server_name":
			t.ServerName = val
		default:
			return d.Errf("unrecognized redis tls subdirective '%s'", sub)
		}
	}
	if (t.Cert == "") != (t.Key == "") {
		return d.Errf("redis tls: 'cert' and 'key' go together; got cert '%s' and key '%s'", t.Cert, t.Key)
	}
	return nil
}

// parseRate reads tokens per second: a number (`10`, `0.5`) or a count
// per duration (`100/1m`, `5000/1h`).
func parseRate(s string) (float64, error) {
	count, per, found := strings.Cut(s, "/")
	n, err := strconv.ParseFloat(count, 64)
	if err != nil || !(n > 0) || n > 1e15 {
		return 0, errString("want a positive number of tokens per second, or <count>/<duration> like 100/1m")
	}
	if !found {
		return n, nil
	}
	d, err := caddy.ParseDuration(per)
	if err != nil || d <= 0 {
		return 0, errString("the duration after '/' must be positive, like 1s, 1m or 1h")
	}
	return n / d.Seconds(), nil
}

func parseBool(s string) (bool, error) {
	switch s {
	case "true":
		return true, nil
	case "false":
		return false, nil
	}
	return false, errString("want true or false")
}

func parseStatus(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 200 || n > 599 {
		return 0, errString("want an HTTP status from 200 to 599 (a 1xx status cannot end a request)")
	}
	return n, nil
}

func parsePositiveDuration(s string, dst *caddy.Duration) error {
	d, err := caddy.ParseDuration(s)
	if err != nil || d <= 0 {
		return errString("want a positive duration like 100ms or 2s")
	}
	*dst = caddy.Duration(d)
	return nil
}

// errString is an error with a fixed message, for parse helpers whose
// callers add the subdirective and the value.
type errString string

func (e errString) Error() string { return string(e) }

// Interface guards
var _ caddyfile.Unmarshaler = (*Handler)(nil)
