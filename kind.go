package ratelimit

import (
	"cmp"
	"fmt"
	"strconv"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
)

// limitConfig is one limit of a handler as its kind reads it from the
// config (kindConfigs): its fields, with the handler's filled in where
// the kind takes them.
type limitConfig struct {
	Limit
	// what names the limit in messages (its subdirective, "limit", with
	// its name); "" for the handler's own limit.
	what string
	// own says it is the handler's own limit, of no `limits`: its key
	// has no hash tag and no name, and its RateLimit items only the zone.
	own bool
	// keySuffix follows the name in its keys, to set them apart from
	// another kind's of the same name.
	keySuffix string
	// charges says the response may charge it (Charge, ChargeStatus,
	// MaxDebt); checkDebt judges a max_debt against its values.
	charges   bool
	checkDebt func(maxDebt int64) error
	// newKind makes its kind when the handler is provisioned; an error
	// names the limit.
	newKind func() (limit.Kind, error)
}

// A kindConfig is how a kind of limit reads its limits from a handler's
// config, and judges them (kindConfigs, compose.go).
type kindConfig struct {
	// configs reads the handler's limits of the kind.
	configs func(h *Handler) []limitConfig
	// check judges them as configured, before provisioning: the parser
	// calls it at the end of the directive, Validate for JSON. names
	// holds the names of the limits judged before, which the kinds share.
	check func(h *Handler, names map[string]bool) error
	// zoneText appends what of its limits names a handler without a
	// zone (derivedZone), if anything: it names their Redis keys, so it
	// never changes.
	zoneText func(h *Handler, text []byte) []byte
}

// limitConfigs are the handler's limits as configured, of every kind, in
// the order of its limits.
func (h *Handler) limitConfigs() []limitConfig {
	var configs []limitConfig
	for _, k := range kindConfigs {
		configs = append(configs, k.configs(h)...)
	}
	return configs
}

// hasOwnLimit says whether the handler's own fields make a limit: when
// it has no `limits`, and, with limits of other kinds, a rate or burst
// of its own.
func (h *Handler) hasOwnLimit() bool {
	switch {
	case len(h.Limits) > 0:
		return false
	case unset(h.ReplenishRate) != "" || h.BurstCapacity != "":
		return true
	}
	for _, k := range kindConfigs[1:] {
		if len(k.configs(h)) > 0 {
			return false
		}
	}
	return true
}

// buildLimits makes the handler's limits from its config.
func (h *Handler) buildLimits(keyPrefix string) ([]*limit.Limit, error) {
	configs := h.limitConfigs()
	groups := map[string]int{}
	limits := make([]*limit.Limit, len(configs))
	for i, c := range configs {
		k, err := c.newKind()
		if err != nil {
			return nil, err
		}
		l := &limit.Limit{
			Index: i, Name: c.Name, NameValue: c.Name, IETFName: h.Zone,
			Rate: c.ReplenishRate, Burst: c.BurstCapacity, Cost: c.RequestedTokens,
		}
		l.SetKind(k)
		if c.charges && l.Charged == nil {
			return nil, fmt.Errorf("%s %s: its kind of limit settles no charge", c.what, c.Name)
		}
		key := cmp.Or(c.Key, h.Key)
		l.KeyText = key
		if l.Template, err = keys.Parse(key); err != nil {
			return nil, err
		}
		l.Template.IPv4Bits = *cmp.Or(c.IPv4Prefix, h.IPv4Prefix, new(32))
		l.Template.IPv6Bits = *cmp.Or(c.IPv6Prefix, h.IPv6Prefix, new(64))
		prefix := keys.BucketPrefix(keyPrefix, h.Zone, key)
		group := fmt.Sprintf("%s/%d/%d", key, l.Template.IPv4Bits, l.Template.IPv6Bits)
		if c.own {
			l.KeyPrefix = prefix
			group = "\x00own" // the own limit's key has no hash tag: a hash slot of its own
		} else {
			// Limits with one key template share a hash tag: their
			// buckets live in one Cluster hash slot, for one script call.
			l.IETFName = h.Zone + "." + c.Name
			l.KeyPrefix = prefix[:len(keyPrefix)] + "{" + prefix[len(keyPrefix):]
			l.KeySuffix = "}" + keys.Separator + c.Name + c.keySuffix
		}
		if _, ok := groups[group]; !ok {
			groups[group] = len(groups)
		}
		l.Group = groups[group]
		if cost.IsWeighted(string(l.Cost)) {
			terms, sum, fixed, err := cost.ParseTerms(string(l.Cost))
			switch {
			case err != nil:
				return nil, err
			case fixed:
				l.Cost = Param(strconv.FormatInt(sum, 10))
			default:
				l.CostTerms = terms
			}
		}
		l.Fixed = !l.Rate.PerRequest() && !l.Burst.PerRequest() && !l.Cost.PerRequest()
		if l.Fixed {
			if l.Values, l.Exempt, err = l.Kind.ResolveValues(string(l.Rate), string(l.Burst), string(l.Cost)); err != nil {
				return nil, err
			}
			l.Args, l.BurstValue = l.Kind.ScriptArgs(l.Values), l.Values.Burst
		}
		if l.Rechecked != nil && !l.Fixed && l.CostTerms != nil && !l.Rate.PerRequest() && !l.Burst.PerRequest() {
			// As resolve would find them, with a cost of 1 for now; a
			// rate or burst out of range is left to resolve to refuse.
			if base, exempt, err := l.Kind.ResolveValues(string(l.Rate), string(l.Burst), ""); err == nil && !exempt && base.Burst > 0 {
				l.CostOnly, l.Base, l.BaseArgs = true, base, l.Kind.ScriptArgs(base)
			}
		}
		if err := h.setWait(l, c.MaxWait); err != nil {
			return nil, err
		}
		limits[i] = l
	}
	return limits, nil
}

// checkLimits judges the limits as configured, before provisioning: the
// parser calls it at the end of the directive, Validate for JSON.
func (h *Handler) checkLimits() error {
	if err := checkPrefixes(h.IPv4Prefix, h.IPv6Prefix); err != nil {
		return err
	}
	seen := map[string]bool{} // the kinds' limits share their names
	for _, k := range kindConfigs {
		if err := k.check(h, seen); err != nil {
			return err
		}
	}
	return nil
}
