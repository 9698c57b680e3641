package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Waiting instead of refusing (max_wait): a request that its token
// buckets could admit within its max wait has its tokens taken at once,
// for the moment they will be there (the store answers each bucket's
// wait), and goes on then. Between the take and that moment it holds a
// timer and nothing else; a client that leaves meanwhile gets its
// tokens given back.

// defaultMaxWaiting is max_waiting's default: a waiting request holds
// about 17 KB in the process (BenchmarkWaitingRequest: its goroutine's
// stack and what the request keeps on the heap), and its connection's
// buffers, 8 KiB more: 1,000 of them about 25 MB a handler.
const defaultMaxWaiting = 1000

// checkMaxWaiting judges max_waiting as JSON gives it (0 for the
// default).
func checkMaxWaiting(n int) error {
	if n < 0 {
		return fmt.Errorf("max_waiting '%d': want a whole number of requests, 1 or more", n)
	}
	return nil
}

// setWait gives l the max wait its config sets (text, placeholders or
// not); none in shadow mode, whose clients must see no change.
func (h *Handler) setWait(l *limit.Limit, text Param) error {
	if text == "" || h.Shadow || l.Waiter == nil {
		return nil
	}
	if text.PerRequest() {
		l.WaitText = text
		return nil
	}
	d, err := limit.ParseMaxWait(string(text))
	if err != nil {
		return err
	}
	l.SetWait(d)
	l.Values.MaxWait, l.Base.MaxWait = d, d
	return nil
}

// setUpWaiting makes the counts of a handler some of whose limits may
// make requests wait: for tokens (setWait), or in a concurrent limit's
// queue for a slot. None in shadow mode, whose clients must see no
// change: a concurrent limit's request is then refused, and passes, as
// without max_wait.
func (h *Handler) setUpWaiting() {
	waits := slices.ContainsFunc(h.limits, func(l *limit.Limit) bool { return l.Wait > 0 || l.WaitText != "" })
	queues := slices.ContainsFunc(h.Concurrent, func(c Concurrent) bool { return c.MaxWait > 0 })
	if h.Shadow || !waits && !queues {
		return
	}
	h.waits, h.waiting, h.waitingNow = true, new(atomic.Int64), new(atomic.Int64)
	if h.metrics != nil {
		collectors.waiting.watch(h.Zone, h.waitingNow, 1)
	}
}

// cleanUpWaiting stops reporting the handler's waiting requests.
func (h *Handler) cleanUpWaiting() {
	if h.waitingNow != nil && h.metrics != nil {
		collectors.waiting.watch(h.Zone, h.waitingNow, -1)
	}
}

// h.waiting counts a handler's requests that wait now, against
// max_waiting: a request takes its place before its take (mayWait) and
// leaves it once it no longer waits (doneWaiting).

// mayWait takes a place for a request that may wait, if one is free;
// else the request's buckets lose their max wait, and it is refused at
// once where it would have waited.
func (h *Handler) mayWait(req *request) bool {
	if h.waiting.Add(1) <= int64(h.MaxWaiting) {
		return true
	}
	h.waiting.Add(-1)
	for i := range req.Buckets {
		req.Buckets[i].Values.MaxWait = 0
	}
	return false
}

func (h *Handler) doneWaiting() { h.waiting.Add(-1) }

// waitOf is how long an admitted request waits before it goes on: 0
// for a handler whose limits never wait, which need not ask its buckets.
func (h *Handler) waitOf(buckets []limit.Bucket) time.Duration {
	if !h.waits {
		return 0
	}
	return limit.Wait(buckets)
}

// await waits wait for an admitted request whose tokens were taken for
// then: true once it may go on, false when its client left first, whose
// tokens are then given back where they were taken.
func (h *Handler) await(r *http.Request, req *request, wait time.Duration) bool {
	h.waitingNow.Add(1)
	defer h.waitingNow.Add(-1)
	if ce := h.logger.Check(zap.DebugLevel, "waiting for tokens taken ahead"); ce != nil {
		ce.Write(zap.String("zone", h.Zone), zap.Duration("wait", wait))
	}
	t := time.NewTimer(wait)
	select {
	case <-t.C:
		return true
	case <-r.Context().Done():
		t.Stop()
		h.giveBack(req)
		return false
	}
}

// observeWait counts how long an admitted request waited, in a slot
// queue and for its tokens, in caddy_rate_limit_wait_seconds.
func (h *Handler) observeWait(waited time.Duration) {
	if h.metrics != nil {
		h.metrics.waitSeconds.Observe(waited.Seconds())
	}
}

// giveBack gives a request that left while it waited its tokens back,
// in every bucket that settles (what a kind holds while served, a slot,
// is released), where they were taken.
func (h *Handler) giveBack(req *request) {
	items := req.settling[:0]
	for i := range req.Buckets {
		b := &req.Buckets[i]
		if b.Charged() != nil {
			items = append(items, limit.Settling{Bucket: i, Diff: -b.Values.Requested})
		}
	}
	if len(items) > 0 {
		h.store.Settle(&req.Call, items)
	}
	if hold := h.store.Hold(&req.Call); hold != nil {
		hold.Release()
	}
}

// errLeftWaiting ends a request whose client left while it waited.
var errLeftWaiting = caddyhttp.Error(499, context.Canceled)
