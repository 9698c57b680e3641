package ratelimit

// Quotas: a count of tokens per calendar period (per day, per month in a
// time zone), renewed at the boundary, decided with the token buckets in
// the same script call. This file holds the quota's JSON config;
// quotaconfig.go reads and judges it; internal/kind/quota is the kind.

import (
	"github.com/caddy-redis/ratelimit/internal/calendar"
)

// Quota is a fixed-period quota of a policy: at most Count tokens per
// period, renewed at the period's boundary (not refilled over time, as a
// limit's bucket is). A request is admitted only if every limit and
// every quota of its handler holds the tokens it asks; then all are
// taken, else none.
type Quota struct {
	// Name names the quota as a limit's name does (headers, placeholders,
	// metrics, Redis keys): letters, digits, `-` and `_`, unique among
	// the handler's limits and quotas. Required.
	Name string `json:"name,omitempty"`

	// Count is the most tokens a client may take per period: a whole
	// number of at least 1, or placeholders resolved per request (a plan
	// from `map`); `unlimited` exempts the request. Required.
	Count Param `json:"count,omitempty"`

	// Per is the period: `minute`, `hour`, `day`, `week`, `month`,
	// `year`, or a duration of whole seconds (`6h`, `90m`, 1s to 3650d),
	// counted in multiples of it from the Unix epoch. Required.
	Per string `json:"per,omitempty"`

	// TimeZone is the IANA zone whose calendar places the named periods
	// (`Europe/Berlin`): days of 23 or 25 hours when its clocks change.
	// Not with a duration. Default: `UTC`.
	TimeZone string `json:"time_zone,omitempty"`

	// MonthDay is the day a monthly period starts on, 1 to 28. Default: 1.
	MonthDay int `json:"month_day,omitempty"`

	// WeekStarts is the day a weekly period starts on: `monday` (the
	// default) or `sunday`.
	WeekStarts string `json:"week_starts,omitempty"`

	// Key, RequestedTokens, IPv4Prefix and IPv6Prefix are as a limit's,
	// and default to the handler's values.
	Key             string `json:"key,omitempty"`
	RequestedTokens Param  `json:"requested_tokens,omitempty"`
	IPv4Prefix      *int   `json:"ipv4_prefix,omitempty"`
	IPv6Prefix      *int   `json:"ipv6_prefix,omitempty"`

	// Charge, ChargeStatus and MaxDebt are as a limit's, and default to
	// the handler's: a charged quota counts what responses cost, and may
	// run past Count by the response that crossed it (up to MaxDebt).
	Charge       *Charge `json:"charge,omitempty"`
	ChargeStatus []int   `json:"charge_status,omitempty"`
	MaxDebt      *int64  `json:"max_debt,omitempty"`
}

// maxPeriod is the longest a quota's period lasts, which bounds the wait
// a script's reply may give (maxRetryMicros).
const maxPeriod = calendar.MaxPeriod
