package redisstore

// Waiting for a slot (issue 40): a request whose concurrent limit queues
// (max_wait, limit.Bucket.Queues) and finds every slot taken waits for
// one in the limit's queue in Redis, shared by every instance, instead
// of being refused: script.lua takes its other buckets and enqueues it
// in one call (the queueing form "cq"), and a slot given back goes to
// the head of the queue in the same call as its release (concurrent.lua
// "releaseq"), which publishes the head's slot id on its instance's
// channel. The take waits, inside Store.Take, for that message, for its
// client to leave, or for its max wait to run out:
//
//   - granted: the slot is the request's, held and released as a slot
//     taken at once (Store.Hold);
//   - its client left, or its max wait ran out: it leaves the queue
//     (concurrent.lua "leave": a slot granted meanwhile goes back, to the
//     next head), its other buckets get their tokens back (giveback.lua),
//     and it is refused (its Retry-After the limit's retry_after), or
//     answered its client's error.
//
// Each client (an instance, for the Redis it shares) has its channel,
// <key_prefix>slots:<random>, on the reset channel's subscription
// (redisresets.Also). A waiter renews its queue entry every third of the
// hold ("wait"), which also grants it a slot freed by expiry, and finds
// a grant whose message was lost (as after the subscription was
// established again: then every waiter renews at the next tick); an
// instance that dies stops renewing, and its waiters' entries expire
// within a hold, dropped by the next call that looks at the queue.
//
// A request queues for one limit of a call at most (a second full one
// refuses it); another concurrent limit's slot it took at the enqueue is
// held, and renewed, while it waits. Its token buckets' tokens are taken
// at the enqueue: a wait for a rate (limit.Bucket.Wait) runs from the
// take, so what is left of it after the slot's wait is the handler's to
// wait.

import (
	"context"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redisresets"
)

// Script arguments of concurrent.lua's queue ops, boxed once.
var (
	waitArg  any = "wait"
	leaveArg any = "leave"
)

// queueIndex is the index of the first bucket that may queue for its
// slot (limit.Bucket.Queues), or -1.
func queueIndex(buckets []limit.Bucket) int {
	for i := limit.FirstHeld(buckets); i < len(buckets); i++ {
		if buckets[i].Queues() {
			return i
		}
	}
	return -1
}

// slotWaiters are a client's requests waiting in slot queues, by slot
// id: its part of the queues (registerClientPart), which keeps the client
// open while any waits.
type slotWaiters struct {
	channel    string // this instance's, on which its grants come
	channelArg any
	start      sync.Once
	mu         sync.Mutex
	byID       map[string]*slotWaiter
}

// slotWaiter is one request waiting for a slot.
type slotWaiter struct {
	id     string
	signal chan bool // granted (true), or its entry gone (false); one at most
	// Set once it is queued, under the waiters' lock: its slot key and
	// member, the hold, when it last renewed its entry (on the clock of
	// limit.ClockStart), and whether a renewal is due now or on its way.
	queued      bool
	key, member string
	holdArg     any
	every       time.Duration
	renewedAt   time.Duration
	due, busy   bool
}

var waitersPart int

func init() {
	waitersPart = registerClientPart(func() clientPart { return &slotWaiters{byID: make(map[string]*slotWaiter)} })
}

// waiters is the client's part of the slot queues.
func (l *Client) waiters() *slotWaiters { return l.parts[waitersPart].(*slotWaiters) }

// listenForGrants names the client's channel and has its reset
// subscription listen to it (before the subscription starts).
func (l *Client) listenForGrants(keyPrefix string) {
	var b [8]byte
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	w := l.waiters()
	w.channel = keyPrefix + "slots:" + hex.EncodeToString(b[:])
	w.channelArg = w.channel
	l.resets.ListenAlso(redisresets.Also{Name: w.channel,
		Message: func(payload string) { w.granted(l, payload) },
		Missed:  w.missed})
}

// GrantChannel is the client's channel of slot grants.
func (l *Client) GrantChannel() string { return l.waiters().channel }

func (w *slotWaiters) firstCalls(_ *Client, _ time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	return batch, false
}

func (w *slotWaiters) lastCalls(_ *Client, _ time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	return batch, false
}

func (w *slotWaiters) inUse() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.byID) > 0
}

func (w *slotWaiters) queued() bool { return false }

// register makes the waiter of slot id, before its take is sent: its
// grant may come before the take's answer.
func (w *slotWaiters) register(id string) *slotWaiter {
	wt := &slotWaiter{id: id, signal: make(chan bool, 1)}
	w.mu.Lock()
	w.byID[id] = wt
	w.mu.Unlock()
	return wt
}

// drop forgets a waiter.
func (w *slotWaiters) drop(wt *slotWaiter) {
	w.mu.Lock()
	if w.byID[wt.id] == wt {
		delete(w.byID, wt.id)
	}
	w.mu.Unlock()
}

// queue marks a waiter queued as member of the queue of the slots at
// key, renewed every third of hold from now on.
func (w *slotWaiters) queue(l *Client, wt *slotWaiter, key, member string, hold time.Duration, holdArg any) {
	w.start.Do(func() { go w.renew(l) })
	w.mu.Lock()
	wt.queued, wt.key, wt.member, wt.holdArg = true, key, member, holdArg
	wt.every, wt.renewedAt = hold/3, time.Since(limit.ClockStart)
	w.mu.Unlock()
}

// tell signals the waiter, once.
func (wt *slotWaiter) tell(granted bool) {
	select {
	case wt.signal <- granted:
	default:
	}
}

// granted takes a message of the client's channel: "<slot id> <key>",
// a slot granted to a waiter. One granted to no waiter of this instance
// (it left, or its take's answer was lost) goes back at once.
func (w *slotWaiters) granted(l *Client, payload string) {
	id, key, ok := strings.Cut(payload, " ")
	if !ok {
		return
	}
	w.mu.Lock()
	wt := w.byID[id]
	w.mu.Unlock()
	if wt != nil {
		wt.tell(true)
		return
	}
	go func() {
		_, _ = l.queueOp(key, releaseQueuedArg, id)
	}()
}

// missed: grants may have been missed; every waiter renews at the next
// tick, which finds them.
func (w *slotWaiters) missed() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, wt := range w.byID {
		wt.due = true
	}
}

// renew renews, every RenewTick until the client stops, the queue
// entries of the waiters whose last renewal will be a third of the hold
// ago before the next tick, or that are due.
func (w *slotWaiters) renew(l *Client) {
	ticker := time.NewTicker(RenewTick)
	defer ticker.Stop()
	var due []*slotWaiter
	for {
		select {
		case <-l.batcher.Done():
			return
		case tick := <-ticker.C:
			now := tick.Sub(limit.ClockStart)
			w.mu.Lock()
			for _, wt := range w.byID {
				if wt.queued && !wt.busy && (wt.due || now-wt.renewedAt+RenewTick > wt.every) {
					wt.busy, wt.due, wt.renewedAt = true, false, now
					due = append(due, wt)
				}
			}
			w.mu.Unlock()
			for _, wt := range due {
				reply, err := l.queueOp(wt.key, waitArg, wt.member, wt.id, wt.holdArg)
				switch {
				case err != nil || len(reply) != 1:
					w.mu.Lock()
					wt.due = true
					w.mu.Unlock()
				case reply[0] == 2:
					wt.tell(true)
				case reply[0] == 0:
					wt.tell(false)
				}
				w.mu.Lock()
				wt.busy = false
				w.mu.Unlock()
			}
			clear(due)
			due = due[:0]
		}
	}
}

// queueOp runs one of concurrent.lua's ops on one slot key, whether or
// not a client waits for it, within the timeout.
func (l *Client) queueOp(key string, args ...any) ([]int64, error) {
	c := redisbatch.NewCall()
	c.Keys = append(c.Keys, key)
	c.Command(concurrentScript)
	c.Args = append(c.Args, args...)
	c, err := l.batcher.Send(context.Background(), time.Now(), c)
	var reply []int64
	if err == nil {
		reply = append(reply, c.Reply...)
	}
	if c != nil {
		c.Release()
	}
	return reply, err
}

// callQueue is call's take in which the buckets that may queue
// (limit.Bucket.Queues) are in the queueing form, with the client's
// channel.
func (l *Client) callQueue(clientCtx context.Context, now time.Time, buckets []limit.Bucket) (*redisbatch.Call, error) {
	c := redisbatch.NewCall()
	for i := range buckets {
		c.Keys = append(c.Keys, buckets[i].Key)
	}
	c.Command(takeScript)
	channel := l.waiters().channelArg
	for i := range buckets {
		b := &buckets[i]
		if b.Queues() {
			c.Args = b.Limit.Queuer.AppendQueueArgs(c.Args, *b, channel)
		} else {
			c.Args = b.Kind().AppendArgs(c.Args, *b)
		}
	}
	return l.batcher.Send(clientCtx, now, c)
}

// takeQueueing takes buckets some of which may queue for their slot (q
// the first): when the take queued the request, it waits for its slot
// (waitForSlot).
func (s *Store) takeQueueing(ctx context.Context, r *limit.Call, sent time.Time, buckets []limit.Bucket, q int) (bool, error) {
	l := s.client
	w := l.waiters()
	wt := w.register(*buckets[q].Args[2].(*string))
	c, err := l.callQueue(ctx, sent, buckets)
	if err != nil {
		w.drop(wt)
		if c != nil {
			c.Release()
		}
		return false, err
	}
	reply := c.Reply
	queued := -1
	if len(reply) > 0 && reply[0] == 2 && len(reply) >= 1+2*len(buckets) {
		// The queued limit answers its arrival in its wait word: no other
		// slot waits.
		for i := q; i < len(buckets); i++ {
			if buckets[i].Queues() && reply[2+2*i] > 0 {
				queued = i
				break
			}
		}
	}
	if queued < 0 {
		w.drop(wt)
		allowed, err := ReadTake(reply, buckets, false)
		c.Release()
		return allowed, err
	}
	arrival := reply[2+2*queued]
	reply[0], reply[2+2*queued] = 1, 0
	_, err = ReadTake(reply, buckets, false)
	c.Release()
	if err != nil {
		w.drop(wt)
		return false, err
	}
	return s.waitForSlot(ctx, r, buckets, queued, wt, arrival)
}

// waitForSlot waits for the slot of buckets[q], for which the request
// is queued since arrival (Redis time), with its other buckets taken;
// see the top of the file.
func (s *Store) waitForSlot(ctx context.Context, r *limit.Call, buckets []limit.Bucket, q int, wt *slotWaiter, arrival int64) (bool, error) {
	start := time.Now()
	l := s.client
	w := l.waiters()
	b := &buckets[q]
	hold, holdArg := b.Limit.Queuer.QueueHold()
	member := fmt.Sprintf("%016d %v %v %s %s", arrival, b.Args[1], holdArg, wt.id, w.channel)
	w.queue(l, wt, b.Key, member, hold, holdArg)
	// The request's other slots, taken at the enqueue, held while it
	// waits: renewed, and released if it leaves.
	var others *slotHold
	for i := limit.FirstHeld(buckets); i < len(buckets); i++ {
		if i != q {
			others = s.holdSlotsExcept(buckets, q)
			break
		}
	}
	if r.Waiting != nil {
		r.Waiting.Add(1)
		defer r.Waiting.Add(-1)
	}
	timer := time.NewTimer(b.Values.MaxWait)
	defer timer.Stop()
	granted := false
	select {
	case granted = <-wt.signal:
	case <-ctx.Done():
	case <-timer.C:
	}
	waited := time.Since(start)
	r.Sent, r.Queued = r.Sent.Add(waited), waited // the store's answer took that much less
	if granted {
		w.drop(wt)
		if others != nil {
			l.slots().renewals.forget(others) // the request's hold holds them from now on (Store.Hold)
		}
		b.Remaining = 0
		for i := range buckets {
			buckets[i].Wait = max(0, buckets[i].Wait-waited)
		}
		s.report.Debug(fmt.Sprintf("a request waited %v for a concurrency slot", waited))
		return true, nil
	}
	// Leave: out of the queue, a slot granted meanwhile given back.
	_, err := l.queueOp(b.Key, leaveArg, member, wt.id)
	w.drop(wt)
	if others != nil {
		others.Release()
	}
	var inline [limit.MaxInline]limit.Bucket
	tokens := inline[:0]
	for i := range buckets {
		if !buckets[i].HeldWhileServed() {
			tokens = append(tokens, buckets[i])
		}
	}
	if len(tokens) > 0 {
		if gerr := l.giveBack(context.Background(), time.Now(), tokens); gerr != nil {
			s.report.Warn("Redis failed while giving tokens back; those buckets stay short until they refill", gerr)
		}
	}
	for i := range buckets {
		bi := &buckets[i]
		switch {
		case i == q:
		case bi.Wait > 0:
			bi.RetryAfter, bi.Wait = bi.Wait, 0
		default:
			bi.Remaining += bi.Values.Requested
			bi.RetryAfter = 0
		}
	}
	if err != nil {
		return false, err
	}
	if ctx.Err() != nil {
		return false, ctx.Err()
	}
	return false, nil
}
