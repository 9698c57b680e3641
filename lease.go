package ratelimit

import (
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// Lease lets an instance admit most requests without waiting on Redis,
// from tokens its bucket lent it ahead. The bucket counts in Redis what
// it lent to each instance, and does not refill into lent tokens, so the
// bound stays exact: over any interval T a bucket admits at most
// `burst_capacity + replenish_rate × T`, with or without leases, on any
// number of instances.
//
// Only a hot key gets a lease: one this instance sees twice within
// `hold`. The requests of the others go to Redis as without lease, at
// the same cost (one key read and written), with nothing kept for them
// here; a key that cools goes back to them.
//
// A lease is sized to the key's recent rate on this instance (what it
// will use within `hold`, at most `max_tokens`) and renewed in the
// background when it falls to half of what the last call lent, or its
// hold is nearly over (sooner when its calls are slow); a renewal
// reports what was used,
// which then stops counting as lent. Its
// unused tokens go back when the hold ends without a renewal. A lease
// whose instance dies counts as spent once its hold (and a grace for the
// give-back) is over.
type Lease struct {
	// MaxTokens is the most tokens one lease holds.
	MaxTokens int64 `json:"max_tokens,omitempty"`

	// Hold is how long a lease admits requests after the call that lent
	// or renewed it; then its unused tokens go back. At most 1s.
	// Default: 100ms.
	Hold caddy.Duration `json:"hold,omitempty"`
}

// check judges lease's size and hold (module.go's checkLease, which
// judges it with the store too, calls it).
func (l *Lease) check() error {
	switch {
	case l == nil:
		return nil
	case l.MaxTokens < 1:
		return fmt.Errorf("lease '%d': want the most tokens a call may lease, 1 or more", l.MaxTokens)
	}
	return checkLeaseHold(time.Duration(l.Hold))
}
