package ratelimit

import (
	"fmt"

	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// The redis block of the rate_limit directive, and its tls block.

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
			err = secret(d, &rc.SentinelPassword)
		case "username":
			err = value(into(&rc.Username))
		case "password":
			err = secret(d, &rc.Password)
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
			// Perhaps an address on a line of its own: shown as addresses are.
			return d.Errf("unrecognized redis subdirective '%s'", logs.RedactAddress(sub))
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
