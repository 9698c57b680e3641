package limit

import "time"

// Kind is a kind of limit: the token bucket, the quota and the
// concurrent limit, each a package under internal/kind. A limit holds its
// kind (Limit.Kind), chosen once when the config is provisioned, and
// stores, layers and the handler ask the kind what is particular to it
// instead of asking which kind it is. A kind is responsible for:
//
//   - its values, resolved from their text, and its part of a script
//     call: its arguments and its words of the reply (which the Redis
//     store sends and reads);
//   - the facts of its buckets that the rate-limit headers say (the
//     handler formats them: a kind formats no header);
//   - its admin view, of what the admin API read of a bucket.
//
// What only some kinds do is an optional interface, found once when the
// config is provisioned (Limit.SetKind), as Caddy finds a module's
// caddy.Provisioner: the arithmetic on a bucket's state kept in the
// process (Arithmetic), how a charge settles in it (Charged), how long a
// layer may remember its refusal (Remembered), whether a request holds
// its bucket while the response is served, to give it back when the
// response ends (Held), a refusal spread over time (Jittered).
//
// What a request knows of a bucket of the kind stays in the request's
// Bucket: a kind holds what every request of its limit
// shares, never one request's. Its methods take the bucket by value, and
// those that change it return it: a pointer into the request's buckets
// passed to an interface method would move them to the heap, an
// allocation of 768 bytes per request (BenchmarkServeHTTPAllowed 10 ->
// 11 allocs).
type Kind interface {
	// BurstName is the name of the burst's value in the config, for
	// messages: the burst_capacity of a token bucket, another kind's own.
	BurstName() string
	// ResolveValues parses a limit's values as written (placeholders
	// replaced) and judges them; isUnlimited says the limit does not
	// apply.
	ResolveValues(rate, burst, requested string) (v Values, isUnlimited bool, err error)
	// ScriptArgs are the values as the script takes them, boxed once
	// for fixed values (limit.args).
	ScriptArgs(v Values) [3]any
	// Begin completes a request's new bucket with what is the request's
	// own (a calendar period, an id); shared is what the request's
	// buckets share, returned with what begin made of it.
	Begin(b Bucket, shared Shared) (Bucket, Shared)
	// AppendArgs appends the bucket's arguments of a script call (its
	// args, and what the kind adds).
	AppendArgs(args []any, b Bucket) []any
	// ReplyWords is how many words of a take's reply are the bucket's,
	// after every bucket's remaining and wait (and what each lent);
	// readReply reads them, from reply[at].
	ReplyWords() int
	ReadReply(b Bucket, reply []int64, at int) (Bucket, error)

	// Refused completes the answer of a bucket of a refused request, as
	// a store answered it (a kind whose buckets come back by release,
	// not by time, gives the wait of its own).
	Refused(b Bucket) Bucket

	// Facts are what the rate-limit headers say of an answered bucket,
	// which headers.go formats.
	Facts(b Bucket) Facts

	// LimitInfo is the limit as the admin API lists it, with the
	// defaults filled in where its values are fixed.
	LimitInfo(l *Limit) LimitInfo
	// BucketInfo is what the admin API shows of a client's bucket, of
	// what was read of it where its handler keeps it (store.peek).
	BucketInfo(b Bucket, v View) BucketInfo
}

// Facts are what a kind says of an answered bucket for the rate-limit
// headers (headers.go formats them). The Spring set describes a bucket
// as a token bucket: rate, burst and requested; the IETF RateLimit-Policy
// item has the burst as its q, and window as w, or unit as qu; the
// RateLimit item has reset as t.
type Facts struct {
	Rate             float64 // tokens per second (a count per period: spread over it)
	Burst, Requested int64
	// Window is the policy's w in seconds (the time an empty token
	// bucket takes to fill, a calendar period's length), when unit is "".
	Window int64
	// Unit is the policy's unit (qu) when it is not requests, and then
	// it has no window.
	Unit string
	// Reset is how long until the bucket is back (its wait), and
	// renewsAt when it is renewed whatever its wait (the end of a
	// calendar period, Unix microseconds; 0 for none): RateLimit's t is
	// the later.
	Reset    time.Duration
	RenewsAt int64
}

// Arithmetic is what a kind whose buckets a store keeps in the
// process as bucket states does (the token bucket, and kinds counted
// per calendar period): its arithmetic there, each step its script's. A
// kind without it keeps no bucket state (a kind held while served keeps
// counts of its own): a take in the process gives it only buckets of
// kinds with it.
type Arithmetic interface {
	// Holds says whether a bucket held in the process (state, if ok)
	// has room for the request at now, t on the store's clock; asked of
	// every bucket of a take, before take.
	Holds(state State, ok bool, now time.Time, t int64, b Bucket) (Bucket, bool)
	// Take is a bucket's part of a take in the process, once the request
	// is known to be allowed or not: the bucket with its answer, as the
	// script's, and the state to store, if store.
	Take(state State, ok bool, now time.Time, t int64, b Bucket, allowed bool) (answered Bucket, after State, store bool)
	// Peek is a bucket held in the process (state, if ok), as the admin
	// API shows it.
	Peek(state State, ok bool, now time.Time, t int64, b Bucket) View
}

// Charged is what a kind whose limits a response may charge does
// (limitConfig.charges): how a charge settles in it (charge.go).
type Charged interface {
	// SettleArg is settle.lua's first argument for the bucket: its kind
	// as the script knows it.
	SettleArg(b Bucket) any
	// SettleHeld settles a response's charge in a bucket held in the
	// process (state, if ok) at t on the store's clock: diff tokens more
	// than the request reserved (fewer when negative), cost in all, in
	// debt up to maxDebt. after is the state to store, if store; charged
	// and forgiven are what the metrics count.
	SettleHeld(state State, ok bool, t int64, b Bucket, diff, cost, maxDebt int64) (after State, store bool, charged, forgiven float64)
}

// Remembered is what a kind whose refusals a layer may remember for
// a while does (refusals); a layer remembers no refusal of another kind
// (whose buckets come back by release, not by time).
type Remembered interface {
	// DenialTTL is how long a layer may remember the bucket's refusal:
	// 0 for one that it must not keep.
	DenialTTL(b Bucket) time.Duration
	// CachedRemaining is what a bucket whose refusal a layer remembered
	// holds now, remaining when Redis refused it, wait before the time
	// it holds the requested tokens again.
	CachedRemaining(b Bucket, remaining int64, wait time.Duration) int64
}

// Jittered is what a kind whose refusals last until a boundary that its
// clients share (a calendar period's end) does: it spreads a refused
// bucket's wait by up to reset_jitter, so that its clients do not all
// come back at once.
type Jittered interface {
	// Jitter is the bucket of a refused request with its wait lengthened
	// by its share of jitter (positive).
	Jitter(b Bucket, jitter time.Duration) Bucket
}

// JitterRefusal applies reset_jitter to a refused request's buckets: each
// of a kind that jitters (Jittered) says to come back up to jitter later.
func JitterRefusal(buckets []Bucket, jitter time.Duration) {
	for i := range buckets {
		if l := buckets[i].Limit; l != nil && l.Jittered != nil {
			buckets[i] = l.Jittered.Jitter(buckets[i], jitter)
		}
	}
}

// Rechecked is what a kind whose resolved values it can judge again,
// with another cost, does (the token bucket): a limit of it whose rate
// and burst are fixed resolves them once, and per request only its cost
// (Limit.CostOnly).
type Rechecked interface {
	// Recheck judges values resolved once but for their cost.
	Recheck(v Values) error
}

// Waiter is what a kind whose requests may wait for their bucket does
// (max_wait, Values.MaxWait): the token bucket. A request its bucket
// cannot admit now, but could within its max wait, is admitted to go on
// later (Bucket.Wait), instead of refused. A kind without it ignores a
// max wait: its requests are refused as without one.
type Waiter interface {
	// WaitArg is a max wait as the kind's script takes it, boxed, for a
	// limit whose max wait is fixed to keep (Limit.SetWait).
	WaitArg(d time.Duration) any
}

// Queuer is a kind held while served whose requests may wait in a
// queue for its bucket (the concurrent limit with max_wait): a request
// that finds every slot taken waits for one, up to its max wait
// (Values.MaxWait), ordered by Values.Priority then arrival, instead of
// being refused. The stores keep the queue (in Redis across instances,
// or in the process).
type Queuer interface {
	Held
	// AppendQueueArgs appends the bucket's arguments of a take that may
	// queue for it, in place of AppendArgs: channel is where the store
	// learns that a queued request was granted its slot (its instance's).
	AppendQueueArgs(args []any, b Bucket, channel any) []any
	// QueueHold is how long a queue entry lives unless its waiter renews
	// it (a dead instance's waiters leave within it), and the same as a
	// script argument.
	QueueHold() (time.Duration, any)
}

// Queues says whether a request may queue for the bucket when it is
// full: a max wait, of a kind that queues (Queuer).
func (b *Bucket) Queues() bool {
	return b.Values.MaxWait > 0 && b.Limit != nil && b.Limit.Queuer != nil
}

// Held is a kind of limit whose bucket a request holds while its
// response is served, and gives back once it has ended: its store says
// what the request holds (store.hold), and the handler's holdStep gives
// it back. Such limits come last (kindConfig.order); a limit knows
// its held kind from when it is built (limit.held, setKind).
type Held interface {
	Kind
	// HoldFor is how long a request's hold lasts unless renewed, and the
	// same as a script argument (microseconds, boxed once).
	HoldFor() (hold time.Duration, arg any)
}

// KindError is a kind's reason for a store's answer that decides
// nothing (say a period that Redis's clock does not fall in): the
// request is decided as when the store fails, and warning is the line the log gives
// it, throttled as Redis failures are.
type KindError interface {
	error
	Warning() string
}

// CompleteRefusal completes the answers of a refused request's buckets
// (kind.refused).
func CompleteRefusal(buckets []Bucket) {
	for i := range buckets {
		buckets[i] = buckets[i].Kind().Refused(buckets[i])
	}
}

// FirstHeld is the index of a request's first bucket held while it is
// served (heldKind); they follow the others. len(buckets) when there is
// none.
func FirstHeld(buckets []Bucket) int {
	for i := range buckets {
		if buckets[i].HeldWhileServed() {
			return i
		}
	}
	return len(buckets)
}

// Plain is the kind of a bucket of no limit (one a layer makes for
// calls of its own): the token bucket, whose package sets it.
var Plain interface {
	Kind
	Arithmetic
	Charged
	Remembered
}
