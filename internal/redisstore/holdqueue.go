package redisstore

// The queue of slot renewals and releases that the batcher's workers
// send to Redis, many slots a script call, and the count of releases
// on their way that a refused request of the same key waits for: what
// a client keeps of the concurrent limits.

import (
	"cmp"
	"context"
	"hash/maphash"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
)

// redisSlots are the slot holds of a client's requests, its part of the
// concurrent limits (registerClientPart): releases counts the releases of slots on their
// way to Redis, or failed and waiting to be sent again; releaseQueue and renewQueue hold the releases and
// renewals not sent yet, which the batcher takes into each batch
// (firstCalls, lastCalls); renewals renew the slots of requests in
// flight.
type redisSlots struct {
	releases     pendingReleases
	releaseQueue slotQueue
	// queuedReleases are the releases of slots of limits that queue
	// (slotHold.queues), sent as "releaseq".
	queuedReleases slotQueue
	renewQueue     slotQueue
	renewals       slotRenewals
}

// releaseQueueOf is the queue of the hold's releases.
func (p *redisSlots) releaseQueueOf(s *slotHold) *slotQueue {
	if s.queues {
		return &p.queuedReleases
	}
	return &p.releaseQueue
}

// slotsPart is the index of the clients' redisSlots in their parts.
var slotsPart int

func init() {
	slotsPart = registerClientPart(func() clientPart { return new(redisSlots) })
}

// slots is the client's part of the concurrent limits.
func (l *Client) slots() *redisSlots { return l.parts[slotsPart].(*redisSlots) }

// firstCalls: queued releases go first, so that a slot given back before
// a take of its key in the same batch is free for it; each batch takes
// at most maxSlotsPerCall of them.
func (p *redisSlots) firstCalls(l *Client, now time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	batch, more := p.releaseQueue.calls(l, releaseArg, now, batch)
	batch, moreQueued := p.queuedReleases.calls(l, releaseQueuedArg, now, batch)
	return batch, more || moreQueued
}

// lastCalls: queued renewals go last, at most maxSlotsPerCall a batch.
func (p *redisSlots) lastCalls(l *Client, now time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	return p.renewQueue.calls(l, renewArg, now, batch)
}

// inUse: a request holds a slot (its renewals and release need the
// client, however long it runs), or has its release still to queue, or
// to send again. A hold leaves it once its release is queued, which
// queued then sees.
func (p *redisSlots) inUse() bool { return p.renewals.holding() }

func (p *redisSlots) queued() bool {
	return p.releaseQueue.queued() || p.queuedReleases.queued() || p.renewQueue.queued()
}

// returning says whether a release of one of the buckets' slots is on
// its way, or failed and waits to be sent again: a refusal of the
// buckets may be for want of it (awaitReturns).
func (p *redisSlots) returning(buckets []limit.Bucket) bool { return p.releases.pending(buckets) }

// queueRelease queues the release of a hold's slots in Redis, counted
// pending by the caller (pendingReleases), and wakes a worker; it does
// not wait: the response ends meanwhile. A worker sends it and reads the
// answer. A request of the same client refused meanwhile for that key
// waits for it and asks again (awaitReturns): a client that sends its
// requests one after another never finds its own previous slot still
// taken. A release that fails is sent again at the renewals' next tick
// (or sooner, for such a request), until its slot would have expired
// anyway (slotRenewals.answerReleases), pending meanwhile. A
// release is a call as the queue's are (Batcher.WhileOpen): it keeps an
// unloaded config's client open for LingerIdle, and every release
// queued before the client closed is answered; one that meets it
// closed is answered as failed.
func (l *Client) queueRelease(s *slotHold) {
	if !l.batcher.WhileOpen(func() { l.slots().releaseQueueOf(s).addReleases(s) }) {
		l.slots().releases.add(s.keys, -1)
		s.store.slotsFailed(releaseArg, redisbatch.ErrClosed)
	}
}

// queueRetries queues again the releases kept to send again
// (slotRenewals.answerReleases), each pending until answered.
func (l *Client) queueRetries(due []slotRetry) {
	for i := range due {
		if !due[i].pending {
			l.slots().releases.add(due[i].key[:], 1)
		}
	}
	if !l.batcher.WhileOpen(func() {
		for _, x := range due {
			l.slots().releaseQueueOf(x.hold).addRelease(x.key[0], x.hold)
		}
	}) {
		for i := range due {
			l.slots().releases.add(due[i].key[:], -1)
		}
	}
}

// slotQueue gathers the releases, or the renewals, of slots until the
// workers send them, at most maxSlotsPerCall at a time (slotQueue.calls):
// a release costs a lock and a few appends, not a call of its own
// through the queue, the batch and a merge (make bench, concurrent@64:
// 0.782 -> 0.817 of allowed@64, Caddy's CPU per request above allowed's
// 10.1 -> 5.4 µs); renewals due together go out spread over the
// batches, never in one pipeline whose length would take the deadline
// of the admissions in it, nor through the batcher's queue, which a
// burst of them filled.
type slotQueue struct {
	mu    sync.Mutex
	keys  []string
	args  []any       // per key: its arguments in concurrent.lua's order (argsPerSlot)
	holds []*slotHold // per key
}

// maxSlotsPerCall bounds the releases, and the renewals, that a batch
// carries, so that a burst of ended responses (or of long requests) does
// not hold Redis, nor the admissions of the batch, for long; the rest go
// in the next batch.
const maxSlotsPerCall = 512

// argsPerSlot is how many arguments a slot of op takes: the slot id,
// and for a renewal its hold and its limit's slots n.
func argsPerSlot(op any) int {
	if op == renewArg {
		return 3
	}
	return 1
}

// addReleases queues the release of every slot of s.
func (q *slotQueue) addReleases(s *slotHold) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, key := range s.keys {
		q.keys = append(q.keys, key)
		q.holds = append(q.holds, s)
		q.args = append(q.args, s.id)
	}
}

// addRenewals queues the renewal of every slot of holds: one that only
// extends a live slot, or with restore, one that asks for a gone slot
// back (concurrent.lua), with its limit's slots n.
func (q *slotQueue) addRenewals(holds []*slotHold, restore bool) {
	if len(holds) == 0 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, s := range holds {
		for i, key := range s.keys {
			q.keys = append(q.keys, key)
			q.holds = append(q.holds, s)
			n := noSlotsArg
			if restore {
				n = s.slotN(i)
			}
			q.args = append(q.args, s.id, holdArgOf(s.limits[i]), n)
		}
	}
}

// noSlotsArg is the slots n of a renewal that only extends a live slot.
var noSlotsArg any = "0"

// addRelease queues the release of one slot of s, in key.
func (q *slotQueue) addRelease(key string, s *slotHold) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.keys = append(q.keys, key)
	q.holds = append(q.holds, s)
	q.args = append(q.args, s.id)
}

// queued says whether slots wait to be sent.
func (q *slotQueue) queued() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.keys) > 0
}

// calls takes queued slots, at most maxSlotsPerCall, as calls of
// concurrent.lua's op appended to batch: one call on one Redis server,
// one per hash slot on a Cluster (the keys of a call must share one).
// more says some are left.
func (q *slotQueue) calls(l *Client, op any, now time.Time, batch []*redisbatch.Call) (_ []*redisbatch.Call, more bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := min(len(q.keys), maxSlotsPerCall)
	if n == 0 {
		return batch, false
	}
	w := argsPerSlot(op)
	if l.cluster == nil {
		batch = append(batch, l.slotsCall(op, q.keys[:n], q.args[:n*w], q.holds[:n], now))
	} else {
		batch = l.hashSlotCalls(op, q.keys[:n], q.args[:n*w], q.holds[:n], now, batch)
	}
	left := copy(q.keys, q.keys[n:])
	copy(q.args, q.args[n*w:])
	copy(q.holds, q.holds[n:])
	clear(q.keys[left:])
	clear(q.args[left*w:])
	clear(q.holds[left:])
	q.keys, q.args, q.holds = q.keys[:left], q.args[:left*w], q.holds[:left]
	return batch, left > 0
}

// hashSlotCalls appends to batch a call of op per Cluster hash slot of
// keys (with their args and holds, as slotsCall takes them).
func (l *Client) hashSlotCalls(op any, keys []string, args []any, holds []*slotHold, now time.Time, batch []*redisbatch.Call) []*redisbatch.Call {
	w := argsPerSlot(op)
	order := make([]int, len(keys))
	slot := make([]int, len(keys))
	for i, key := range keys {
		order[i], slot[i] = i, redisbatch.Slot(key)
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(slot[a], slot[b]) })
	var groupKeys []string
	var groupArgs []any
	var groupHolds []*slotHold
	for start := 0; start < len(order); {
		end := start + 1
		for end < len(order) && slot[order[end]] == slot[order[start]] {
			end++
		}
		groupKeys, groupArgs, groupHolds = groupKeys[:0], groupArgs[:0], groupHolds[:0]
		for _, i := range order[start:end] {
			groupKeys = append(groupKeys, keys[i])
			groupArgs = append(groupArgs, args[i*w:(i+1)*w]...)
			groupHolds = append(groupHolds, holds[i])
		}
		batch = append(batch, l.slotsCall(op, groupKeys, groupArgs, groupHolds, now))
		start = end
	}
	return batch
}

// slotsCall is one call of concurrent.lua's op over the slots of many
// requests in one Redis server's hash slot (keys, and their arguments in
// the script's order), which a slotBatch answers in the worker; holds
// are whose slot each key is. It copies what it is given.
func (l *Client) slotsCall(op any, keys []string, args []any, holds []*slotHold, now time.Time) *redisbatch.Call {
	c := redisbatch.NewCall()
	c.Keys = append(c.Keys, keys...)
	c.Command(concurrentScript)
	c.Args = append(append(c.Args, op), args...)
	answer := slotBatches.Get().(*slotBatch)
	answer.client, answer.op = l, op
	answer.holds = append(answer.holds, holds...)
	c.ClientCtx, c.Deadline, c.Then = context.Background(), now.Add(l.timeout), answer
	return c
}

// slotBatch reads the answer to a call of releases or renewals of many
// requests' slots, in the worker: a failure is told once by each handler
// whose slots it held, a slot found gone at its renewal by its own; the
// renewals learn which holds were renewed, or are due again.
type slotBatch struct {
	client *Client
	op     any         // releaseArg or renewArg
	holds  []*slotHold // per key
}

var slotBatches = sync.Pool{New: func() any { return new(slotBatch) }}

func (b *slotBatch) TakeAnswer(c *redisbatch.Call) {
	l := b.client
	if b.op == releaseArg || b.op == releaseQueuedArg {
		l.slots().renewals.answerReleases(l, c.Keys, b.holds, c.Reply, c.Err)
	}
	for i, s := range b.holds {
		switch {
		case c.Err != nil:
			if !slices.ContainsFunc(b.holds[:i], func(o *slotHold) bool { return o.store == s.store }) {
				s.store.slotsFailed(b.op, c.Err)
			}
		case b.op == renewArg && i < len(c.Reply) && c.Reply[i] != 1:
			s.store.slotGone(c.Reply[i])
		}
	}
	if b.op == renewArg {
		l.slots().renewals.renewed(l, b.holds, c.Reply, c.Err)
	}
	c.Release()
	clear(b.holds)
	b.client, b.op, b.holds = nil, nil, b.holds[:0]
	slotBatches.Put(b)
}

// pendingReleases counts the releases queued and not yet answered, or
// failed and kept to be sent again (slotRenewals.answerReleases), per
// slot key, so that a request of a key refused meanwhile waits for its
// own key's releases (awaitReturns), and for no other key's. A count by
// hash, read without a lock, answers the usual question (no release of
// any of these keys is on its way) with one atomic load; only when it is
// not zero does the key's own count, under its shard's lock, say. (A
// count by hash alone made a refusal wait for, and ask again after, the
// releases of unrelated keys of the same hash: 220 µs to 3.44 ms, and a
// second script call, with 4 of them busy.)
type pendingReleases struct {
	shards [1024]pendingShard
}

type pendingShard struct {
	n    atomic.Int32 // the releases pending of this shard's keys
	mu   sync.Mutex
	keys map[string]int32 // each key's, none at zero
}

var pendingSeed = maphash.MakeSeed()

func (p *pendingReleases) of(key string) *pendingShard {
	return &p.shards[maphash.String(pendingSeed, key)%uint64(len(p.shards))]
}

func (p *pendingReleases) add(keys []string, n int32) {
	for _, key := range keys {
		sh := p.of(key)
		sh.mu.Lock()
		if sh.keys == nil {
			sh.keys = make(map[string]int32)
		}
		if left := sh.keys[key] + n; left != 0 {
			sh.keys[key] = left
		} else {
			delete(sh.keys, key)
		}
		sh.n.Add(n)
		sh.mu.Unlock()
	}
}

// pending says whether a release of any of the buckets' slot keys is
// pending.
func (p *pendingReleases) pending(buckets []limit.Bucket) bool {
	for i := limit.FirstHeld(buckets); i < len(buckets); i++ {
		if p.keyPending(buckets[i].Key) {
			return true
		}
	}
	return false
}

func (p *pendingReleases) keyPending(key string) bool {
	sh := p.of(key)
	if sh.n.Load() == 0 {
		return false
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.keys[key] > 0
}

// total is how many releases are pending, of every key.
func (p *pendingReleases) total() int64 {
	var n int64
	for i := range p.shards {
		n += int64(p.shards[i].n.Load())
	}
	return n
}

// awaitReturns waits, after a refusal by a full concurrent limit of a
// request sent while a release of one of its keys was on its way (and
// may have reached Redis after it), or waited to be sent again after a
// failure (sent now, not at the next tick), until the releases of its
// keys are answered, at most until the deadline; it says whether the
// request should ask again.
func (p *redisSlots) awaitReturns(l *Client, buckets []limit.Bucket, deadline time.Time) bool {
	full := false
	for i := limit.FirstHeld(buckets); i < len(buckets); i++ {
		full = full || buckets[i].Remaining == 0
	}
	if !full {
		return false
	}
	p.renewals.retryNow(l, buckets)
	for p.releases.pending(buckets) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Microsecond)
	}
	return true
}
