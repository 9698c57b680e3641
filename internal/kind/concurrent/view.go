package concurrent

import "github.com/caddy-redis/ratelimit/internal/limit"

// limitInfo is what the admin API lists of a concurrent limit beyond
// every limit's: its slots and hold.
type limitInfo struct {
	Slots    limit.Param `json:"slots,omitempty"`
	Hold     string      `json:"hold,omitempty"`
	MaxWait  string      `json:"max_wait,omitempty"`
	Priority limit.Param `json:"priority,omitempty"`
}

// LimitInfo lists its slots and hold, and its max wait and priority (in
// the rate's place) when it queues.
func (s *Kind) LimitInfo(l *limit.Limit) limit.LimitInfo {
	li := l.Info()
	view := limitInfo{Slots: l.Burst, Hold: s.hold.String(), Priority: l.Rate}
	if s.maxWait > 0 {
		view.MaxWait = s.maxWait.String()
	}
	li.KindView = view
	return li
}

// bucketInfo is what the admin API shows of a client's concurrent
// limit: its slots, how many are held now, and when each held slot
// expires unless renewed, in seconds, soonest first (Redis only;
// in-process slots do not expire).
type bucketInfo struct {
	Slots      int64     `json:"slots"`
	InUse      int64     `json:"in_use"`
	SlotExpiry []float64 `json:"slot_expires_in,omitempty"`
}

// BucketInfo shows how many of its slots are held, and when each held
// slot expires unless renewed (the store's peek reads its slots).
func (*Kind) BucketInfo(b limit.Bucket, v limit.View) limit.BucketInfo {
	slots := bucketInfo{Slots: b.Values.Burst, InUse: v.InUse}
	for _, d := range v.Expiries {
		slots.SlotExpiry = append(slots.SlotExpiry, d.Seconds())
	}
	return limit.BucketInfo{Limit: b.Limit.Name, Key: b.ClientKey(), StoredKey: b.Key, KindView: slots}
}
