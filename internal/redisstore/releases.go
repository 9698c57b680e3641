package redisstore

// Releases of slots held in Redis beyond a served request's own: those
// sent again (after a failure, until they are answered; after a take
// whose answer was lost, until one frees the slot), and the slots of
// takes that did not admit their request (a later Cluster slot group
// refused, or the take's answer was lost).

import (
	"context"
	"errors"
	"net"
	"slices"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
)

// groupEnd is the end of the Cluster slot group of held slots that
// starts at start (the slots of one group are consecutive).
func (s *slotHold) groupEnd(start int) int {
	end := start + 1
	for end < len(s.keys) && s.limits[end].Group == s.limits[start].Group {
		end++
	}
	return end
}

// call is concurrent.lua's release of the held slots start to end, of
// one Cluster slot group.
func (s *slotHold) call(start, end int) *redisbatch.Call {
	c := redisbatch.NewCall()
	c.Keys = append(c.Keys, s.keys[start:end]...)
	c.Command(concurrentScript)
	c.Args = append(c.Args, s.releaseOp())
	for range s.keys[start:end] {
		c.Args = append(c.Args, s.id)
	}
	return c
}

// slotRetry is the release of one slot of hold, in key[0] (an array, so
// that key[:] is a []string without an allocation), to send again until
// the slot has expired by itself (until, on the clock of clockStart).
// pending: it failed, and is counted pending (pendingReleases) until it
// is answered, or its slot has expired; a release sent again only
// because the take it undoes may land later is not.
type slotRetry struct {
	key     [1]string
	hold    *slotHold
	until   time.Duration
	pending bool
}

// expiresBy is when the slot of s in key has expired by itself if the
// last call that took or renewed it landed as it was sent (renewedAt):
// its hold later. One that landed later keeps it longer; its release is
// sent again only until then.
func (s *slotHold) expiresBy(key string) time.Duration {
	for i, k := range s.keys {
		if k == key {
			return s.renewedAt + holdOf(s.limits[i])
		}
	}
	return s.renewedAt + 3*s.every
}

// answerReleases takes the answer to the releases of keys (of holds, one
// per key; reply per key, or err), each counted pending
// (pendingReleases) until now. A release that failed is sent again at
// the next tick, and stays pending meanwhile, so that a refused request
// of its key waits for it (awaitReturns): one lost to a moment of
// slowness (its deadline passed in a latency spike, a new connection's
// handshake timed out) or to an outage would otherwise leave its slot
// taken for the rest of its hold. A release that freed nothing, of a
// slot whose take (or a renewal that asked for it back) had its answer
// lost, is sent again at each tick until it frees the slot: that call
// may still land, later than its release (held in a TCP
// retransmission), and take the slot for a request that has ended. Not
// pending meanwhile: nothing says it will land. A release is
// idempotent, and each is sent again only until its slot has expired by
// itself (expiresBy); a breaker open answers them without a round trip.
func (r *slotRenewals) answerReleases(l *Client, keys []string, holds []*slotHold, reply []int64, err error) {
	now := time.Since(limit.ClockStart)
	kept := false
	r.mu.Lock()
	for i, key := range keys {
		s := holds[i]
		until := s.expiresBy(key)
		switch {
		case now >= until:
		case err != nil && err != redisbatch.ErrClosed:
			r.retries = append(r.retries, slotRetry{key: [1]string{key}, hold: s, until: until, pending: true})
			kept = true
			continue // still pending; the count drops after its retry
		case err == nil && s.lost && i < len(reply) && reply[i] == 0:
			r.retries = append(r.retries, slotRetry{key: [1]string{key}, hold: s, until: until})
			kept = true
		}
		l.slots().releases.add(keys[i:i+1], -1) // after the retry is kept: the client stays open for it
	}
	r.mu.Unlock()
	if kept {
		r.startTicker(l)
	}
}

// retryNow queues at once the releases kept for a retry (answerReleases)
// of the slots among buckets: a request of their key that a full limit
// refused waits for them (awaitReturns), rather than for the next tick.
func (r *slotRenewals) retryNow(l *Client, buckets []limit.Bucket) {
	held := buckets[limit.FirstHeld(buckets):]
	var due []slotRetry
	r.mu.Lock()
	kept := r.retries[:0]
	for _, x := range r.retries {
		if slices.ContainsFunc(held, func(b limit.Bucket) bool { return b.Key == x.key[0] }) {
			due = append(due, x)
		} else {
			kept = append(kept, x)
		}
	}
	clear(r.retries[len(kept):])
	r.retries = kept
	r.mu.Unlock()
	if len(due) > 0 {
		l.queueRetries(due)
	}
}

// send releases the held slots through the batcher, one call per
// Cluster hash slot group, and waits for the answer, within the timeout,
// so that the slot is free in Redis before the request's answer: its
// client may ask again at once. A call is sent at most once; a release
// that fails is sent again as a queued one is (answerReleases), pending
// meanwhile.
func (s *slotHold) send() {
	store := s.store
	p := store.client.slots()
	for start := 0; start < len(s.keys); {
		end := s.groupEnd(start)
		c := s.call(start, end)
		// Sent even when the client has left.
		c, err := store.client.batcher.Send(context.Background(), time.Now(), c)
		if err != nil {
			store.slotsFailed(releaseArg, err)
			keys := s.keys[start:end]
			holds := make([]*slotHold, len(keys))
			for i := range holds {
				holds[i] = s
			}
			p.releases.add(keys, 1)
			p.renewals.answerReleases(store.client, keys, holds, nil, err)
		}
		if c != nil {
			c.Release()
		}
		start = end
	}
}

// releaseTaken gives back the slots of buckets a request took in an
// earlier Cluster group, when a later group refused, and returns the
// token buckets among them, for giveBack. A release that fails is sent
// again at the next tick (send).
func (s *Store) releaseTaken(taken []limit.Bucket) []limit.Bucket {
	k := limit.FirstHeld(taken)
	if k == len(taken) {
		return taken
	}
	tokens := taken[:0:0]
	// Taken a moment ago: its slots expire a hold from now at the latest.
	hold := &slotHold{store: s, released: true, renewedAt: time.Since(limit.ClockStart)}
	for i := range taken {
		b := &taken[i]
		if !b.HeldWhileServed() {
			tokens = append(tokens, *b)
			continue
		}
		hold.id = b.Args[2].(*string)
		hold.keys = append(hold.keys, b.Key)
		hold.limits = append(hold.limits, b.Limit)
		hold.queues = hold.queues || b.Queues()
		if every := holdOf(b.Limit) / 3; hold.every == 0 || every < hold.every {
			hold.every = every
		}
	}
	hold.send()
	return tokens
}

// mayHaveRun says whether a call that failed with err may have run in
// Redis: not one that never left (this instance's overload, an open
// breaker, a closed client, a client that left first, a connection that
// could not be opened).
func mayHaveRun(err error) bool {
	var overload redisbatch.OverloadError
	var dial *net.OpError
	return !(errors.As(err, &overload) || err == redisbatch.ErrBreakerOpen || err == redisbatch.ErrClosed ||
		errors.Is(err, context.Canceled) || errors.As(err, &dial) && dial.Op == "dial")
}

// releaseLostTake releases the slots of a request whose take failed with
// err after it may have run in Redis (mayHaveRun): its reply was cut, or
// came after the timeout. The request is decided without a slot, so
// nothing else would release them, and they would stay taken for their
// hold. A release is idempotent: one of slots the take never got frees
// nothing. The take may also land after its release (held on its way,
// in a TCP retransmission): the release is then sent again at each tick
// until it frees the slot, or the slot would have expired
// (answerReleases).
func (s *Store) releaseLostTake(buckets []limit.Bucket, err error) {
	if !mayHaveRun(err) {
		return
	}
	// Sent before now: its slots expire a hold from now at the latest.
	hold := &slotHold{store: s, released: true, lost: true, renewedAt: time.Since(limit.ClockStart)}
	for i := limit.FirstHeld(buckets); i < len(buckets); i++ {
		b := &buckets[i]
		hold.id = b.Args[2].(*string)
		hold.keys = append(hold.keys, b.Key)
		hold.limits = append(hold.limits, b.Limit)
		hold.queues = hold.queues || b.Queues()
		if every := holdOf(b.Limit) / 3; hold.every == 0 || every < hold.every {
			hold.every = every
		}
	}
	if len(hold.keys) > 0 {
		s.client.slots().releases.add(hold.keys, 1)
		s.client.queueRelease(hold)
	}
}
