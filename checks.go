package ratelimit

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"strconv"
)

// The handler's own settings: their checks, each judging one value (or
// a limit's values together), the checks of settings of several parts
// together (a store with a layer, a layer with kinds of limit), their
// defaults, and the zone's default name. A part's own values are judged
// in its file. The Caddyfile parser calls the checks where the value is
// written, so the message gets the line; Validate calls them for JSON
// configs.

// defaultMaxKeys is max_keys when the config leaves it out.
const defaultMaxKeys = 1_000_000

const wantStatus = "want an HTTP status from 200 to 599 (a 1xx status cannot end a request)"

var zonePattern = regexp.MustCompile(`^[A-Za-z0-9_.:-]+$`)

func checkZone(zone string) error {
	if !zonePattern.MatchString(zone) {
		return fmt.Errorf("zone '%s': use only letters, digits, '-', '_', '.' and ':'", zone)
	}
	return nil
}

func checkStatus(subdirective string, code int) error {
	if code < 200 || code > 599 {
		return fmt.Errorf("%s '%d': %s", subdirective, code, wantStatus)
	}
	return nil
}

// checkMaxKeys judges max_keys: a store that may hold no bucket would
// decide no request with its buckets.
func checkMaxKeys(n int64) error {
	if n < 1 {
		return fmt.Errorf("max_keys '%d': want a whole number of buckets, 1 or more", n)
	}
	return nil
}

// checkLease judges lease: that there is a Redis to lease from, then
// its size and hold.
func checkLease(l *Lease, store string) error {
	if l != nil && store == storeMemory {
		return errors.New("lease with store 'memory': the buckets are in this process already; remove lease")
	}
	return l.check()
}

// checkLayersWith refuses a layer with a kind of limit it cannot serve:
// n limits of the kind that plural names. Each kind's check asks it
// where its message has always come among the kind's own.
func (h *Handler) checkLayersWith(plural string, n int) error {
	if n == 0 || h.Lease == nil {
		return nil
	}
	switch plural {
	case "quotas":
		return errors.New("lease with quotas: a lease takes tokens ahead for this instance, which a quota would count as used; remove lease, or the quotas")
	case "concurrent limits":
		return errors.New("lease with concurrent limits: a lease admits requests without asking Redis, where the slots are; remove lease, or the concurrent limits")
	}
	return nil
}

// derivedZone names the buckets of a handler without a zone, the same on
// every instance with the same configuration: from its key template, rate
// and burst (as it always has for one fixed limit), and its limits'.
func (h *Handler) derivedZone() string {
	var text []byte
	if rate, err := strconv.ParseFloat(string(h.ReplenishRate), 64); err == nil || h.ReplenishRate == "" {
		burst := int64(math.Ceil(rate)) // the default
		if b, err := strconv.ParseInt(string(h.BurstCapacity), 10, 64); err == nil {
			burst = b
		}
		text = fmt.Appendf(nil, "%s\x00%v\x00%d", h.Key, rate, burst)
	} else {
		text = fmt.Appendf(nil, "%s\x00%s\x00%s", h.Key, h.ReplenishRate, h.BurstCapacity)
	}
	for _, l := range h.Limits {
		text = fmt.Appendf(text, "\x00%s\x00%s\x00%s\x00%s", l.Name, l.Key, l.ReplenishRate, l.BurstCapacity)
	}
	for _, k := range kindConfigs {
		if k.zoneText != nil {
			text = k.zoneText(h, text)
		}
	}
	sum := sha256.Sum256(text)
	return "auto-" + hex.EncodeToString(sum[:6])
}

// applyDefaults fills in what the config left out.
func (h *Handler) applyDefaults() {
	if h.Key == "" {
		h.Key = "{http.vars.client_ip}"
	}
	h.ReplenishRate, h.RequestedTokens = unset(h.ReplenishRate), unset(h.RequestedTokens) // in JSON, 0 means unset
	if h.StatusCode == 0 {
		h.StatusCode = http.StatusTooManyRequests
	}
	if h.EmptyKeyStatus == 0 {
		h.EmptyKeyStatus = http.StatusForbidden
	}
	h.fallbackDefault()
	if h.Headers == "" {
		h.Headers = headersSpring
	}
	if h.Store == "" {
		h.Store = storeRedis
	}
	if h.MaxKeys == 0 {
		h.MaxKeys = defaultMaxKeys
	}
	if h.MaxWaiting == 0 {
		h.MaxWaiting = defaultMaxWaiting
	}
	if h.Zone == "" {
		h.Zone = h.derivedZone()
	}
}
