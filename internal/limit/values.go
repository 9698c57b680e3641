package limit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddyserver/caddy/v2"
)

// Param is a limit's rate, burst or cost: a number fixed in the config,
// or text with placeholders that each request resolves (`{plan_rate}`),
// parsed then exactly as a fixed value. In JSON a number, or a string.
type Param string

// UnmarshalJSON takes a number as its text, or a string.
func (p *Param) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*p = Param(s)
		return nil
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("want a number or a string, got %s", b)
	}
	*p = Param(n)
	return nil
}

// MarshalJSON writes a plain number as a number, anything else as a
// string.
func (p Param) MarshalJSON() ([]byte, error) {
	if _, err := strconv.ParseFloat(string(p), 64); err == nil && json.Valid([]byte(p)) {
		return []byte(p), nil
	}
	return json.Marshal(string(p))
}

// PerRequest says whether the value has placeholders to resolve per
// request.
func (p Param) PerRequest() bool { return strings.Contains(string(p), "{") }

// Unlimited is the rate (and burst) that exempts a request from a limit.
const Unlimited = "unlimited"

// Values are one limit's rate, burst and cost, resolved, and how long a
// request may wait for its bucket.
type Values struct {
	Rate      float64
	Burst     int64
	Requested int64
	// MaxWait is how long a request that the bucket cannot admit now may
	// wait for it instead of being refused (max_wait): 0 for none. Only a
	// kind that waits (Waiter) honours it (Bucket.Waits); another, a
	// quota, is refused as without it. A kind whose requests queue for
	// its bucket (Queuer: the concurrent limit) honours it too, as the
	// longest a request waits in its queue; the kind sets it (max_wait of
	// its block, fixed).
	MaxWait time.Duration
	// Priority orders a queue for a bucket (Queuer): higher first, then
	// by arrival. 0 for other kinds.
	Priority int64
}

// MaxWaitLimit is the longest max_wait: a request that waits longer is
// better told when to come back.
const MaxWaitLimit = time.Hour

// ParseMaxWait reads a max_wait as written: a duration with its unit
// (`500ms`, `2s`, `1m`), from 0 (no wait) to MaxWaitLimit.
func ParseMaxWait(text string) (time.Duration, error) {
	if text == "0" {
		return 0, nil
	}
	if _, err := strconv.ParseFloat(text, 64); err == nil {
		return 0, BadValue("max_wait", text, "has no unit: want a duration such as 500ms, 2s or 1m")
	}
	d, err := caddy.ParseDuration(text)
	switch {
	case err != nil:
		return 0, BadValue("max_wait", text, "is not a duration: want one such as 500ms, 2s or 1m")
	case d < 0:
		return 0, BadValue("max_wait", text, "is negative: want 0 (no wait) or a duration up to "+MaxWaitLimit.String())
	case d > MaxWaitLimit:
		return 0, BadValue("max_wait", text, "is more than "+MaxWaitLimit.String()+": a client is better told when to come back (Retry-After)")
	}
	return d, nil
}

// ParamError says which value of a limit was wrong: a request's
// requested_tokens usually comes from the client (400), the others from
// the config (500).
type ParamError struct {
	Param string
	Msg   string
}

func (e *ParamError) Error() string { return e.Msg }

// BadValue reports a value: "<param> '<value>' <reason>", where reason
// starts with a verb, or with ": " before a noun phrase. The value may
// come from a request: it is quoted cut short (logs.Cut).
func BadValue(param, value, reason string) *ParamError {
	sep := " "
	if strings.HasPrefix(reason, ":") {
		sep = ""
	}
	return &ParamError{param, fmt.Sprintf("%s '%s'%s%s", param, logs.Cut(value), sep, reason)}
}
