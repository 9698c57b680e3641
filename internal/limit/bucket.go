package limit

import "time"

// HeldWhileServed says whether a request holds the bucket while it is
// served (heldKind); a bucket of no limit is not held.
func (b *Bucket) HeldWhileServed() bool { return b.Limit != nil && b.Limit.Held != nil }

// ClientKey is the bucket's Redis key without what the limit puts around
// the client key: as logs and {http.rate_limit.key} show it.
func (b *Bucket) ClientKey() string {
	return b.Key[len(b.Limit.KeyPrefix) : len(b.Key)-len(b.Limit.KeySuffix)]
}

// Kind is the bucket's kind of limit: its limit's; a bucket of no limit
// (one a layer makes for calls of its own) is a token bucket.
func (b *Bucket) Kind() Kind {
	if b.Limit == nil {
		return Plain
	}
	return b.Limit.Kind
}

// Arithmetic, charged and remembered are what the bucket's kind does of
// the optional interfaces (limit.setKind); nil for what it does not.
func (b *Bucket) Arithmetic() Arithmetic {
	if b.Limit == nil {
		return Plain
	}
	return b.Limit.Arithmetic
}

func (b *Bucket) Charged() Charged {
	if b.Limit == nil {
		return Plain
	}
	return b.Limit.Charged
}

func (b *Bucket) Remembered() Remembered {
	if b.Limit == nil {
		return Plain
	}
	return b.Limit.Remembered
}

// Bucket is one limit's bucket for one request, and Redis's answer.
type Bucket struct {
	Limit  *Limit
	Key    string
	Values Values
	Args   [3]any
	// Remaining is the whole tokens left after the request; -1 when Redis
	// failed.
	Remaining int64
	// RetryAfter is how long until the bucket holds the requested tokens;
	// negative when never (burst 0). For a bucket the request may wait
	// for (Waits) that refused, it is the wait a take now would have had
	// (the same, but for a lent bucket's cap): the request fits within
	// its max wait RetryAfter - MaxWait from now (FitsIn).
	RetryAfter time.Duration
	// Wait is how long an admitted request waits for the bucket before it
	// goes on (its go-time, less the time of the take): the bucket
	// took its tokens at once, below zero, and holds them again then. 0
	// when it went on at once, when refused, and for a bucket that does
	// not wait.
	Wait time.Duration
	// Unknown: a refusal a layer remembered (refusals) says nothing of
	// this bucket.
	Unknown bool
	// KindRef and kindN are what the request knows of its bucket that is
	// its kind's own, set and read by the kind alone (begin, readReply,
	// its arithmetic in the process), such as a period and the period its
	// take counted in, or the generation of a count in the process. A
	// new kind keeps its own there too.
	KindRef any
	KindN   int64
}

// Shared is what a request's buckets share, whatever their kind,
// made by the first that needs it (kind.begin).
type Shared struct {
	Now time.Time // the clock when the request's periods were named (kind.begin)
	ID  any       // the request's id, one for its buckets (kind.begin)
}

// Clock is the request's time: read once, when a bucket first asks.
func (s *Shared) Clock() time.Time {
	if s.Now.IsZero() {
		s.Now = time.Now()
	}
	return s.Now
}

// Blocked is the index of a bucket that holds nothing (burst 0,
// which denies without asking Redis), or -1.
func Blocked(buckets []Bucket) int {
	for i := range buckets {
		if buckets[i].Values.Burst == 0 {
			return i
		}
	}
	return -1
}

// Described picks the bucket that the `X-RateLimit-*` headers and the
// placeholders describe: on a denial the one that refused with the
// longest wait, else the one with the fewest requests left; the first
// such on ties.
func Described(buckets []Bucket, allowed bool) int {
	if allowed {
		if k := FirstHeld(buckets); k > 0 {
			buckets = buckets[:k] // admitted: the buckets taken, not those held while served
		}
	}
	pick := -1
	for i := range buckets {
		b := &buckets[i]
		switch {
		case b.Unknown:
		case pick < 0:
			pick = i
		case !allowed && b.RetryAfter > buckets[pick].RetryAfter:
			pick = i
		case allowed && b.Remaining/b.Values.Requested < buckets[pick].Remaining/buckets[pick].Values.Requested:
			pick = i
		}
	}
	return max(pick, 0)
}

// Waits says whether a request may wait for the bucket: a max wait, of a
// kind that waits (Waiter; a bucket of no limit is a token bucket, which
// does). The kind's script arguments and its reply say so too: a store
// reads the reply's waits when some bucket of the call waits.
func (b *Bucket) Waits() bool {
	return b.Values.MaxWait > 0 && (b.Limit == nil || b.Limit.Waiter != nil)
}

// Wait is how long an admitted request waits before it goes on: the
// longest of its buckets' waits.
func Wait(buckets []Bucket) time.Duration {
	var wait time.Duration
	for i := range buckets {
		wait = max(wait, buckets[i].Wait)
	}
	return wait
}

// FitsIn is how long until a refused request would be admitted, waiting
// where it may: of each known bucket its wait, less the bucket's max wait
// where the request may wait for it (Waits); the longest of them. It is
// RetryAfter when no bucket waits.
func FitsIn(buckets []Bucket) time.Duration {
	var wait time.Duration
	for i := range buckets {
		b := &buckets[i]
		switch {
		case b.Unknown:
		case b.Waits():
			wait = max(wait, b.RetryAfter-b.Values.MaxWait)
		default:
			wait = max(wait, b.RetryAfter)
		}
	}
	return wait
}

// MaxInline is how many buckets a request holds without
// allocating: enough for most policies.
const MaxInline = 4
