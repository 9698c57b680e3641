package ratelimit

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// The subdirectives that a handler and each of its limits share, and
// the helpers that read one value of a subdirective for the parser.

// limitFields are the subdirectives that a handler and each of its
// limits have alike, as pointers into one of them.
type limitFields struct {
	key               *string
	rate, burst, cost *Param
	ipv4, ipv6        **int
	charge            **Charge
	chargeStatus      *[]int
	maxDebt           **int64
}

func (h *Handler) limitFields() limitFields {
	return limitFields{&h.Key, &h.ReplenishRate, &h.BurstCapacity, &h.RequestedTokens, &h.IPv4Prefix, &h.IPv6Prefix,
		&h.Charge, &h.ChargeStatus, &h.MaxDebt}
}

func (l *Limit) limitFields() limitFields {
	return limitFields{&l.Key, &l.ReplenishRate, &l.BurstCapacity, &l.RequestedTokens, &l.IPv4Prefix, &l.IPv6Prefix,
		&l.Charge, &l.ChargeStatus, &l.MaxDebt}
}

// inline sets `<replenish_rate> <burst_capacity> [<requested_tokens>]`,
// given on the line of the directive or limit, as the subdirectives of
// the same names.
func (f limitFields) inline(d *caddyfile.Dispenser, seen map[string]bool, block string, args []string) error {
	if len(args) == 1 || len(args) > 3 {
		return d.Errf("%s: want <replenish_rate> <burst_capacity> [<requested_tokens>], got %d argument(s): '%s'",
			block, len(args), strings.Join(args, " "))
	}
	for i, arg := range args {
		name := [...]string{"replenish_rate", "burst_capacity", "requested_tokens"}[i]
		seen[name] = true
		if err := f.setValue(name, arg); err != nil {
			return d.WrapErr(err)
		}
	}
	return nil
}

// set parses the subdirective sub, if it is one of the fields; block
// names the enclosing block for messages.
func (f limitFields) set(d *caddyfile.Dispenser, block, sub string) (known bool, err error) {
	inBlock := func(err error) error {
		if err != nil && block != "" {
			err = fmt.Errorf("%s: %w", block, err) // "limit <name>: ..."
		}
		return err
	}
	switch sub {
	case "charge", "charge_status":
		args := d.RemainingArgs()
		var err error
		if sub == "charge" {
			var fields map[string][]string
			if fields, err = chargeFields(d); err == nil {
				*f.charge, err = parseCharge(args, fields)
			}
		} else {
			*f.chargeStatus, err = parseChargeStatuses(args)
		}
		if err != nil {
			return true, d.WrapErr(inBlock(err))
		}
		return true, nil
	case "max_debt":
		return true, oneValue(d, block, func(v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return inBlock(fmt.Errorf("max_debt '%s': want a whole number of tokens from 0 to 2^53", v))
			}
			*f.maxDebt = &n
			return inBlock(checkMaxDebt(&n))
		})
	case "requested_tokens": // one value, or the terms of a weighted sum (internal/cost)
		args := d.RemainingArgs()
		if len(args) == 0 {
			return true, argErr(d, strings.TrimSpace(block+" "+sub))
		}
		if err := f.setValue(sub, strings.Join(args, " ")); err != nil {
			return true, d.WrapErr(inBlock(err))
		}
		return true, nil
	case "key", "replenish_rate", "burst_capacity", "ipv4_prefix", "ipv6_prefix":
		return true, oneValue(d, block, func(v string) error {
			err := f.setValue(sub, v)
			if err != nil && block != "" {
				err = fmt.Errorf("%s: %w", block, err) // "limit <name>: ..."
			}
			return err
		})
	}
	return false, nil
}

// parseCharge reads `charge header <name>`, `charge json <path>...`,
// `charge json { <field> <path>... }` or `charge placeholder
// <{placeholder}>`: args after the subdirective, and the fields of its
// block.
func parseCharge(args []string, fields map[string][]string) (*Charge, error) {
	const want = "charge: want header <name>, json <path>..., json { <field> <path>... } or placeholder <{placeholder}>"
	if fields != nil {
		if len(args) != 1 || args[0] != "json" {
			return nil, fmt.Errorf("%s, got '%s' with a block (only json takes one)", want, strings.Join(args, " "))
		}
		c := &Charge{JSONFields: fields}
		return c, checkCharge(c)
	}
	if len(args) < 2 {
		return nil, fmt.Errorf("%s, got '%s'", want, strings.Join(args, " "))
	}
	c := new(Charge)
	switch kind, values := args[0], args[1:]; {
	case kind == "json":
		c.JSON = values
	case len(values) != 1:
		return nil, fmt.Errorf("%s, got '%s'", want, strings.Join(args, " "))
	case kind == "header":
		c.Header = values[0]
	case kind == "placeholder":
		c.Placeholder = values[0]
	default:
		return nil, fmt.Errorf("%s, got '%s'", want, strings.Join(args, " "))
	}
	return c, checkCharge(c)
}

// chargeFields reads the block of `charge json { ... }`, if there is one:
// a field per line, its name and its paths.
func chargeFields(d *caddyfile.Dispenser) (map[string][]string, error) {
	var fields map[string][]string
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name, paths := d.Val(), d.RemainingArgs()
		if _, twice := fields[name]; twice {
			return nil, fmt.Errorf("charge json field '%s' is given twice: a field lists all its paths on one line", name)
		}
		if len(paths) == 0 {
			return nil, fmt.Errorf("charge json field '%s': want <field> <path>..., such as input usage.input_tokens message.usage.input_tokens", name)
		}
		if fields == nil {
			fields = map[string][]string{}
		}
		fields[name] = paths
	}
	return fields, nil
}

// parseChargeStatuses reads `charge_status <code|class>...`.
func parseChargeStatuses(args []string) ([]int, error) {
	if len(args) == 0 {
		return nil, errors.New("charge_status: want one or more status codes (401) or classes (4xx)")
	}
	statuses := make([]int, 0, len(args))
	for _, a := range args {
		n, err := parseChargeStatus(a)
		if err != nil {
			return nil, err
		}
		statuses = append(statuses, n)
	}
	return statuses, nil
}

// setValue sets one field from its text. Numbers are checked here, and
// judged together at the end of the directive; values with placeholders
// are kept as written, for each request to resolve.
func (f limitFields) setValue(sub, v string) error {
	p := Param(v)
	switch sub {
	case "key":
		*f.key = v
		_, err := keys.Parse(v)
		return err
	case "ipv4_prefix":
		return setPrefix(f.ipv4, sub, v, 32)
	case "ipv6_prefix":
		return setPrefix(f.ipv6, sub, v, 128)
	case "replenish_rate":
		if !p.PerRequest() && v != limit.Unlimited {
			rate, err := parseRate(v)
			if err != nil {
				return limit.BadValue(sub, v, ": "+err.Error())
			}
			p = rateParam(rate)
		}
		*f.rate = p
	case "burst_capacity":
		if !p.PerRequest() && v != limit.Unlimited {
			if _, err := strconv.ParseInt(v, 10, 64); err != nil {
				return limit.BadValue(sub, v, "is not a whole number")
			}
		}
		*f.burst = p
	case "requested_tokens":
		if cost.IsWeighted(v) {
			if _, err := cost.Normalize(v); err != nil {
				return err
			}
		} else if !p.PerRequest() {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return limit.BadValue(sub, v, "is not a whole number")
			}
			if n == 0 { // in JSON, 0 means the default; written out, it is a mistake
				return limit.BadValue(sub, v, "must be at least 1")
			}
		}
		*f.cost = p
	}
	return nil
}

func setPrefix(dst **int, sub, v string, most int) error {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 || n > most {
		return fmt.Errorf("%s '%s': want a prefix length from 0 to %d", sub, v, most)
	}
	*dst = &n
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

// secret reads the single value of a password subdirective. Unlike
// oneValue's, its error does not quote the value (d.ArgErr would quote
// the token the dispenser is on: a password, or part of one).
func secret(d *caddyfile.Dispenser, dst *string) error {
	sub := d.Val()
	if !d.AllArgs(dst) {
		return d.Errf("redis %s: want exactly one value (quote a password that holds spaces)", sub)
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

// Interface guards
var _ caddyfile.Unmarshaler = (*Handler)(nil)
