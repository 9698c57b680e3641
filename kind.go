package ratelimit

import (
	"context"
	"net/http"
	"time"
)

// kind is a kind of limit: the token bucket (tokenbucket.go), the quota
// (quota.go) or the concurrent limit (concurrent.go). A limit holds its
// kind (limit.kind), chosen once when the config is provisioned, and the
// rest of the package asks the kind what is particular to it instead of
// asking which kind it is. A kind is responsible for:
//
//   - its values, resolved from their text (policy.go), and its part of
//     a script call: its arguments and its words of the reply
//     (limiter.go);
//   - what it puts in the rate-limit headers (headers.go calls it);
//   - its arithmetic in the process, for store memory and on_error local
//     (memstore.go);
//   - how a charge settles in it (charge.go);
//   - its admin view (admin.go);
//   - whether a request holds it while the response is served, to give
//     it back when the response ends (a concurrent limit's slot).
//   - how long the deny cache may keep its refusal (denycache.go).
//
// What a request knows of a bucket of the kind stays in the request's
// bucket (policy.go): a kind holds what every request of its limit
// shares, never one request's. Its methods take the bucket by value, and
// those that change it return it: a pointer into the request's buckets
// passed to an interface method would move them to the heap, an
// allocation of 768 bytes per request (BenchmarkServeHTTPAllowed 10 ->
// 11 allocs).
type kind interface {
	// burstName is the name of the burst's value in the config, for
	// messages: the burst_capacity of a token bucket, a quota's count.
	burstName() string
	// resolveValues parses a limit's values as written (placeholders
	// replaced) and judges them; isUnlimited says the limit does not
	// apply.
	resolveValues(rate, burst, requested string) (v limitValues, isUnlimited bool, err error)
	// scriptArgs are the values as the script takes them, boxed once
	// for fixed values (limit.args).
	scriptArgs(v limitValues) [3]any
	// begin completes a request's new bucket with what is the request's
	// own (a quota's period, a slot id); shared is what the request's
	// buckets share, returned with what begin made of it.
	begin(b bucket, shared requestShared) (bucket, requestShared)
	// appendArgs appends the bucket's arguments of a script call (its
	// args, and what the kind adds).
	appendArgs(args []any, b bucket) []any
	// replyWords is how many words of a take's reply are the bucket's,
	// after every bucket's remaining and wait (and what each lent);
	// readReply reads them, from reply[at].
	replyWords() int
	readReply(b bucket, reply []int64, at int) (bucket, error)

	// fixedHeaders fills a limit's header values that do not change
	// between requests, when the config loads, and says whether its
	// RateLimit-Policy item (lh.policy) is one of them.
	fixedHeaders(l *limit, lh *limitHeaders) (fixedItem bool)
	// setSpring writes the X-RateLimit values of the bucket that the
	// Spring set describes, but X-RateLimit-Remaining, which is every
	// kind's.
	setSpring(hdr http.Header, v *headerValues, b bucket, lh *limitHeaders)
	// appendPolicy appends the bucket's RateLimit-Policy item, when the
	// handler's whole RateLimit-Policy is not fixed.
	appendPolicy(policy []byte, lh *limitHeaders, b bucket) []byte
	// resetIn is RateLimit's t of an answered bucket: how long until it
	// is back (its wait, or later).
	resetIn(b bucket) time.Duration

	// refused completes the answer of a bucket of a refused request, as
	// a store answered it (a full concurrent limit waits its
	// retry_after: slots come back by release, not by time).
	refused(b bucket) bucket

	// denialTTL is how long the deny cache may keep the bucket's refusal:
	// 0 for one that it must not keep.
	denialTTL(b bucket) time.Duration
	// cachedRemaining is what a bucket that the deny cache answers for
	// holds now, remaining when Redis refused it, wait before the time
	// it holds the requested tokens again.
	cachedRemaining(b bucket, remaining int64, wait time.Duration) int64

	// holds says whether a bucket the memory store holds (state, if ok)
	// has room for the request at now, t on the store's clock; asked of
	// every bucket of a take, before take.
	holds(state memoryBucket, ok bool, now time.Time, t int64, b bucket) (bucket, bool)
	// take is a bucket's part of a memory store take, once the request is
	// known to be allowed or not: the bucket with its answer, as the
	// script's, and the state to store, if store.
	take(state memoryBucket, ok bool, now time.Time, t int64, b bucket, allowed bool) (answered bucket, after memoryBucket, store bool)
	// peek is a bucket the memory store holds (state, if ok), as the
	// admin API shows it.
	peek(state memoryBucket, ok bool, now time.Time, t int64, b bucket) bucketView

	// settleArg is settle.lua's first argument for the bucket: its kind
	// as the script knows it.
	settleArg(b bucket) any
	// settleHeld settles a response's charge in a bucket the memory store
	// holds (state, if ok) at t on the store's clock: diff tokens more
	// than the request reserved (fewer when negative), cost in all, in
	// debt up to maxDebt. after is the state to store, if store; charged
	// and forgiven are what the metrics count.
	settleHeld(state memoryBucket, ok bool, t int64, b bucket, diff, cost, maxDebt int64) (after memoryBucket, store bool, charged, forgiven float64)

	// heldWhileServed says whether a request holds the limit's bucket
	// while its response is served, and gives it back when the response
	// has ended (concurrent.go). Such limits come last (buildLimits).
	heldWhileServed() bool
	// finishing is the step (steps.go) that a handler with limits of the
	// kind runs on an admitted request, to do what must follow its
	// response (give a slot back); nil for none. The limits of a kind
	// share it.
	finishing(h *Handler) step

	// limitInfo is the limit as the admin API lists it, with the
	// defaults filled in where its values are fixed.
	limitInfo(l *limit) limitInfo
	// bucketInfo reads a client's bucket of the kind where h keeps it,
	// and is what the admin API shows of it.
	bucketInfo(ctx context.Context, h *Handler, b bucket) (bucketInfo, error)
}

// kindError is a kind's reason for a store's answer that decides
// nothing (say a quota whose period Redis's clock does not fall in):
// the request follows on_error, and warning is the line the log gives
// it, throttled as Redis failures are.
type kindError interface {
	error
	warning() string
}

// completeRefusal completes the answers of a refused request's buckets
// (kind.refused).
func completeRefusal(buckets []bucket) {
	for i := range buckets {
		buckets[i] = buckets[i].kind().refused(buckets[i])
	}
}

// firstHeld is the index of a request's first bucket held while it is
// served (kind.heldWhileServed); they follow the others. len(buckets)
// when there is none.
func firstHeld(buckets []bucket) int {
	for i := range buckets {
		if buckets[i].kind().heldWhileServed() {
			return i
		}
	}
	return len(buckets)
}

// kind is the bucket's kind of limit: its limit's; a bucket of no limit
// (a lease's renewal, lease.go) is a token bucket.
func (b *bucket) kind() kind {
	if b.limit == nil {
		return tokenBucket{}
	}
	return b.limit.kind
}
