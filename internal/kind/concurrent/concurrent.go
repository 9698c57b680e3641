// package concurrent is the concurrent limit as a kind of limit: at most
// n requests of a key in flight. Its values are its slots (in the
// burst's place, one per request), a request's buckets of it share one
// request id (Begin), a refusal waits retry_after, and a request holds
// its slot while served (limit.Held). The slots themselves are the
// stores' (held in Redis or in the process); this package keeps no
// count.
package concurrent

import (
	"strconv"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/limit"
)

// unit is its RateLimit-Policy's unit (qu).
const unit = "concurrent-requests"

// kindArg is the concurrent limit's kind as script.lua takes it, boxed
// once.
var kindArg any = "c"

// Kind is what a concurrent limit adds to its limit: its kind of limit
// (limit.Kind), held while served (limit.Held).
type Kind struct {
	hold       time.Duration
	holdArg    any // the hold in microseconds as script argument, boxed once
	retryAfter time.Duration
	// maxWait is how long a request that finds every slot taken waits in
	// the key's queue for one (max_wait); 0: it is refused at once.
	maxWait time.Duration
}

// New is the kind of a concurrent limit whose slot a request holds for
// hold unless renewed, and whose refusal waits retryAfter.
func New(hold, retryAfter time.Duration) *Kind {
	return &Kind{hold: hold, holdArg: strconv.FormatInt(hold.Microseconds(), 10), retryAfter: retryAfter}
}

// WithMaxWait makes the limit's requests that find every slot taken
// wait up to maxWait for one, in a queue (limit.Queuer); 0 refuses them
// at once, as without it.
func (s *Kind) WithMaxWait(maxWait time.Duration) *Kind {
	s.maxWait = maxWait
	return s
}

// MaxPriority bounds a priority, either way.
const MaxPriority = 1_000_000

// ParsePriority reads a queue priority: a whole number from -MaxPriority
// to MaxPriority; "" is 0.
func ParsePriority(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < -MaxPriority || n > MaxPriority {
		return 0, limit.BadValue("priority", s, "is not a whole number from -1000000 to 1000000")
	}
	return n, nil
}

// RateName is "priority": the priority stands in the rate's place, as
// the slots stand in the burst's.
func (*Kind) RateName() string { return "priority" }

// It has none of the optional interfaces but Held, and Queuer. Its slots in the
// process are counts of the store's own, never bucket states: it has no
// limit.Arithmetic, and a take in the process gives the kinds only the
// token buckets before the slots. It charges nothing (a response costs
// it its slot): no limit.Charged. Its slots come back by release, not by
// time: a layer remembers none of its refusals (no limit.Remembered).
var _ limit.Queuer = (*Kind)(nil)

// ParseSlots reads a number of slots.
func ParseSlots(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > cost.MaxTokens {
		return 0, limit.BadValue("slots", s, "is not a whole number from 0 to 2^53 (or 'unlimited')")
	}
	return n, nil
}

// BurstName is "slots": they stand in the burst's place.
func (*Kind) BurstName() string { return "slots" }

// ResolveValues reads its slots, in the burst's place: n as the burst,
// one slot per request; and its priority, in the rate's place. Its max
// wait is its own (fixed).
func (s *Kind) ResolveValues(priority, slots, _ string) (v limit.Values, isUnlimited bool, err error) {
	if slots == limit.Unlimited {
		return v, true, nil
	}
	n, err := ParseSlots(slots)
	if err != nil {
		return limit.Values{}, false, err
	}
	p, err := ParsePriority(priority)
	return limit.Values{Burst: n, Requested: 1, MaxWait: s.maxWait, Priority: p}, false, err
}

// ScriptArgs are "c" and n; the request's slot id follows (Begin).
func (*Kind) ScriptArgs(v limit.Values) [3]any {
	return [3]any{kindArg, strconv.FormatInt(v.Burst, 10), nil}
}

// Begin gives the bucket the request's slot id, one for all its
// concurrent limits: a *string in its third argument, which the stores
// keep to renew and release the slot.
func (*Kind) Begin(b limit.Bucket, shared limit.Shared) (limit.Bucket, limit.Shared) {
	if shared.ID == nil {
		shared.ID = newSlotID()
	}
	b.Args[2] = shared.ID
	return b, shared
}

// AppendArgs appends "c", n, the slot id, then the hold.
func (s *Kind) AppendArgs(args []any, b limit.Bucket) []any {
	return append(append(args, b.Args[:]...), s.holdArg)
}

// kindQueueArg is the queueing form's kind (script.lua).
var kindQueueArg any = "cq"

// AppendQueueArgs appends the queueing form: "cq", n, the slot id, the
// hold, the priority, and the channel that learns of the grant.
func (s *Kind) AppendQueueArgs(args []any, b limit.Bucket, channel any) []any {
	return append(args, kindQueueArg, b.Args[1], b.Args[2], s.holdArg, strconv.FormatInt(b.Values.Priority, 10), channel)
}

// QueueHold is the slot's hold: a waiter renews its queue entry as a
// request renews its slot.
func (s *Kind) QueueHold() (time.Duration, any) { return s.hold, s.holdArg }

// HoldFor is how long a request holds its slot unless it renews it, and
// the same as a script argument: a request holds its slot until its
// response has ended.
func (s *Kind) HoldFor() (time.Duration, any) { return s.hold, s.holdArg }

// ReplyWords is 0: a take's reply has nothing of its own.
func (*Kind) ReplyWords() int { return 0 }

// ReadReply reads nothing.
func (*Kind) ReadReply(b limit.Bucket, _ []int64, _ int) (limit.Bucket, error) { return b, nil }

// Facts are its slots as the burst, a token bucket's of no rate, and as
// the policy's q in the IETF unit of concurrent requests; its wait is
// retry_after when it was full (Refused).
func (*Kind) Facts(b limit.Bucket) limit.Facts {
	return limit.Facts{Rate: b.Values.Rate, Burst: b.Values.Burst, Requested: b.Values.Requested,
		Unit: unit, Reset: b.RetryAfter}
}

// Refused waits retry_after when it was full: slots come back by
// release, not by time (the script says 0).
func (s *Kind) Refused(b limit.Bucket) limit.Bucket {
	if b.Remaining == 0 && !b.Unknown {
		b.RetryAfter = s.retryAfter
	}
	return b
}
