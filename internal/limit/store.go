package limit

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

// Settling is one bucket's settlement: the bucket's index in the
// request's buckets (an index, not a pointer, so that they stay on the
// stack), its cost, and the difference from its reservation.
type Settling struct {
	Bucket int
	Cost   int64
	Diff   int64
}

// ClearLayerMarks sets the request's layer marks to 0, one per bucket
// (see layerMarks), and returns them.
func (c *Call) ClearLayerMarks() []int64 {
	if n := len(c.Buckets); n <= MaxInline {
		c.LayerMarks = c.inlineMarks[:n]
	} else {
		c.LayerMarks = make([]int64, n)
	}
	clear(c.LayerMarks)
	return c.LayerMarks
}

// Call is what a handler's stack is asked to decide: a request's
// buckets, when it was sent, and how it was decided. Every store and
// layer takes it (store.take) and fills in the answer.
type Call struct {
	Buckets []Bucket
	// Sent is when the request's decision started: its take is as at
	// then, and its call's timeout runs from then.
	Sent time.Time
	// Admitted and refused name the decision for the metrics and
	// {http.rate_limit.result}: allowed and denied, unless a layer took
	// the buckets elsewhere (takenBy) and names its own.
	Admitted, Refused Decision
	// Failed says that a layer decided without any bucket's answer, as
	// failure (a fallback while the store fails).
	Failed  bool
	Failure Decision
	// TakenBy is the store that took the request's buckets when a layer
	// took them elsewhere than in the store below it (nil: that store
	// took them): what it holds while served is kept there, its charges
	// settle there.
	TakenBy Store
	// LayerMarks are a word per bucket (layerMarks[i] is buckets[i]'s)
	// that the layer deciding the request keeps from its take until its
	// settlement, its own to set and read; in inlineMarks for up to
	// maxInlineBuckets, as the buckets are.
	LayerMarks  []int64
	inlineMarks [MaxInline]int64
	// MayQueue says the request may wait in a queue for a slot of a
	// concurrent limit that queues (Bucket.Queues) when every slot is
	// taken: the handler sets it, false when it already has max_waiting
	// requests waiting; when false such a request is refused at once, as
	// without max_wait. Reset leaves it and Waiting as they are.
	MayQueue bool
	// Waiting, when set, counts the handler's requests waiting in a slot
	// queue: the store adds 1 while this one waits.
	Waiting *atomic.Int64
	// Queued is how long the request waited in a slot queue within Take:
	// 0 when it did not.
	Queued time.Duration
}

// Fail records that a layer decided the request without its buckets.
func (c *Call) Fail(d Decision) { c.Failed, c.Failure = true, d }

// Holding is what a request holds while it is served, where its store
// took it (store.hold), to give back once the response has ended.
type Holding interface{ Release() }

// Store decides requests with the buckets it keeps: the Redis store and
// the memory store (internal/redisstore, internal/memstore). A layer is
// a store that wraps another and answers the same calls (internal/layer,
// internal/lease). The handler builds its stack once (its compose.go),
// and the request path calls its top and never asks what it holds.
type Store interface {
	// Take takes what the request asks of every one of its buckets, or
	// of none, as at r.sent, and fills in each bucket's
	// answer (remaining, wait). err is a failure to decide; a layer that
	// decides despite it (a fallback) says so in r.
	Take(ctx context.Context, r *Call) (allowed bool, err error)
	// Settle settles the charges of a served request, items, where its
	// buckets were taken (charge.go).
	Settle(r *Call, items []Settling)
	// Hold is what an admitted request holds while it is served, where
	// its buckets were taken: those of its limits held while served
	// (heldKind), to give back once its response has ended (holdStep);
	// nil when it holds nothing.
	Hold(r *Call) Holding
	// Peek reads a bucket without changing it, for the admin API: a
	// bucket held while served, as what requests hold of it.
	Peek(ctx context.Context, b Bucket) (View, error)
	// Reset makes a bucket full again, and frees what requests hold of
	// it while they are served.
	Reset(ctx context.Context, b Bucket) error
}

// Refusals is what a layer remembers of the store's refusals, to refuse
// a request again without asking the store. A layer that decides
// requests with calls of its own, not by asking the store below it,
// takes the place of such a layer below it, and asks its refusals
// itself (takeRefusals).
type Refusals interface {
	// Answer refuses a request at now when one of its buckets is known to
	// refuse it, and fills in the answer of each such bucket; the others
	// are marked unknown.
	Answer(buckets []Bucket, now time.Time) bool
	// Answered keeps what the store answered to a request sent at sent.
	Answered(buckets []Bucket, sent time.Time, allowed bool)
	// Forget drops what is kept of the bucket at key, and forgetKeys of
	// the buckets at keys: they hold tokens again sooner than time alone
	// would bring them. One key is not a variadic slice: through an
	// interface that would escape, an allocation per settlement that
	// gives back (go build -gcflags=-m).
	Forget(key string)
	ForgetKeys(keys []string)
	// KeepAtMost bounds how long a refusal is kept, when the layer above
	// may bring tokens back at any time.
	KeepAtMost(d time.Duration)
}

// Refuser is a store or layer that knows, without a call, that it
// refuses a request's buckets now, which may be only some of them (those
// known before the request's body is read: beforebody.go), and then
// answers them as its take would. mayRefuse says, at little cost, whether
// it may know a refusal now at all: when not, a request's buckets need
// not be resolved to ask it.
type Refuser interface {
	MayRefuse() bool
	Refuses(now time.Time, buckets []Bucket) bool
}

// RefuserOf is the refuser of a stack whose top is s: what decides a
// request first, when it is one; a layer that decides only what the
// store below it could not passes that store's on (refuserBelow). nil
// when what decides first does not know refusals without a call.
func RefuserOf(s Store) Refuser {
	switch s := s.(type) {
	case Refuser:
		return s
	case PassesRefuser:
		return s.RefuserBelow()
	}
	return nil
}

// PassesRefuser is a layer that decides only what the store below it
// could not, and so passes that store's refuser on (refuserOf).
type PassesRefuser interface{ RefuserBelow() Refuser }

// RefusalKeeper is a layer that keeps refusals: under is the store it
// wraps.
type RefusalKeeper interface {
	Store
	RefusalsKept() (under Store, kept Refusals)
}

// TakeRefusals is the store under below when below keeps refusals, and
// those refusals; else below itself, and noRefusals.
func TakeRefusals(below Store) (Store, Refusals) {
	if k, ok := below.(RefusalKeeper); ok {
		return k.RefusalsKept()
	}
	return below, NoRefusals{}
}

// NoRefusals keeps nothing.
type NoRefusals struct{}

func (NoRefusals) Answer([]Bucket, time.Time) bool { return false }

func (NoRefusals) Answered([]Bucket, time.Time, bool) {}

func (NoRefusals) Forget(string) {}

func (NoRefusals) ForgetKeys([]string) {}

func (NoRefusals) KeepAtMost(time.Duration) {}

// Reset readies the call for a new request whose buckets go in buckets
// (empty, with the room the caller keeps for them): nothing decided yet.
func (c *Call) Reset(buckets []Bucket) {
	c.Buckets, c.LayerMarks = buckets, c.inlineMarks[:0]
	c.Admitted, c.Refused, c.Failed, c.TakenBy, c.Queued = DecisionAllowed, DecisionDenied, false, nil, 0
}

// ErrFull is a store's refusal of a request whose bucket would be new
// while the store has no room for one (the in-process store at
// max_keys): the request is decided as an overflow, as on_error says.
var ErrFull = errors.New("the in-memory store holds max_keys buckets; a new client's request follows on_error")
