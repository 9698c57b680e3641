package limit

import (
	"encoding/json"
	"math"
	"strconv"
	"time"
)

type LimitInfo struct {
	Name            string `json:"name"` // empty for a handler without limits
	Key             string `json:"key"`
	ReplenishRate   Param  `json:"replenish_rate"`
	BurstCapacity   Param  `json:"burst_capacity"`
	RequestedTokens Param  `json:"requested_tokens"`
	IPv4Prefix      int    `json:"ipv4_prefix"`
	IPv6Prefix      int    `json:"ipv6_prefix"`
	// A count per calendar period, in place of the rate and burst.
	Count Param  `json:"count,omitempty"`
	Per   string `json:"per,omitempty"`
	// KindView is what a kind lists of its own beyond these (a struct),
	// after them (kind.limitInfo).
	KindView any `json:"-"`
}

func (li LimitInfo) MarshalJSON() ([]byte, error) {
	type fields LimitInfo
	return withKindView(fields(li), li.KindView)
}

// withKindView is v's JSON object with the fields of a kind's view (a
// struct, or nil) after v's own.
func withKindView(v, view any) ([]byte, error) {
	text, err := json.Marshal(v)
	if err != nil || view == nil {
		return text, err
	}
	more, err := json.Marshal(view)
	if err != nil {
		return nil, err
	}
	if len(more) > len("{}") && more[0] == '{' { // an object with fields; anything else (a nil pointer's null) adds none
		text = append(append(text[:len(text)-1], ','), more[1:]...)
	}
	return text, nil
}

// BucketInfo is what a client's bucket holds now, as GET
// /rate_limit/zones/<zone>/buckets answers.
type BucketInfo struct {
	Limit string `json:"limit"` // empty for a handler without limits
	// Key is the client key as stored (escaped, or hashed when long), as
	// logs show it with log_key; StoredKey the whole Redis key.
	Key             string  `json:"key"`
	StoredKey       string  `json:"stored_key"`
	Exempt          bool    `json:"exempt,omitempty"`  // the rate resolved to `unlimited`
	Blocked         bool    `json:"blocked,omitempty"` // burst_capacity 0: every request denied, no bucket kept
	Tokens          string  `json:"tokens,omitempty"`  // a decimal, with the fraction refilled so far
	ReplenishRate   float64 `json:"replenish_rate,omitempty"`
	BurstCapacity   int64   `json:"burst_capacity,omitempty"`
	RequestedTokens int64   `json:"requested_tokens,omitempty"`
	// RetryAfter is the seconds until the bucket holds one more request
	// (0 when it does now); ExpiresIn the seconds until its key expires,
	// when it would be full again (0 when there is no key: it is full).
	RetryAfter float64 `json:"retry_after"`
	ExpiresIn  float64 `json:"expires_in"`
	// Lent is what the bucket has lent to instances ahead, by its mark,
	// until the last of it expires; 0 when it lent nothing. Tokens is then
	// at most the burst less Lent (below zero when the burst went down
	// under it): what another instance can take, as the scripts count it.
	Lent int64 `json:"lent,omitempty"`
	// KindView is what a kind shows of its own beyond these (a struct),
	// after them (kind.bucketInfo).
	KindView any `json:"-"`
}

func (bi BucketInfo) MarshalJSON() ([]byte, error) {
	type fields BucketInfo
	return withKindView(fields(bi), bi.KindView)
}

// TokenInfo is what the admin API shows of a bucket of tokens (the
// token bucket's, and other kinds' with more) of what was read of it.
func TokenInfo(b Bucket, view View) BucketInfo {
	info := BucketInfo{Limit: b.Limit.Name, Key: b.ClientKey(), StoredKey: b.Key,
		ReplenishRate: b.Values.Rate, BurstCapacity: b.Values.Burst, RequestedTokens: b.Values.Requested}
	info.Tokens = strconv.FormatFloat(math.Round(view.Tokens*1e6)/1e6, 'f', -1, 64) // to the millionth
	info.RetryAfter, info.ExpiresIn, info.Lent = view.Wait.Seconds(), view.ExpiresIn.Seconds(), view.Lent
	return info
}

// View is what a bucket holds now, for the admin API.
type View struct {
	Tokens    float64
	Wait      time.Duration // until it holds the requested tokens
	ExpiresIn time.Duration // until its key expires; 0 for none (full)
	Lent      int64         // what it lent to instances ahead, by its mark; 0 for none
	// InUse and expiries are, of a kind held while served, how many
	// requests hold it now, and when each hold expires unless renewed,
	// soonest first (none for those in the process, which do not expire).
	InUse    int64
	Expiries []time.Duration
}
