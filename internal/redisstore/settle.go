package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
)

// The settlement of a served response's charge in Redis: a call to
// settle.lua that the batch worker answers.

// settleCall is one settlement call on its way to Redis (a request's
// buckets, or on a Cluster those of one slot group) and what each of its
// buckets charged, read when Redis answers. Pooled, with its call: a
// settlement costs no goroutine and no allocation of its own.
type settleCall struct {
	store  *Store
	items  []settlement
	inline [limit.MaxInline]settlement
}

var settleCalls = sync.Pool{New: func() any {
	s := new(settleCall)
	s.items = s.inline[:0]
	return s
}}

// settlement is one bucket's part of a settleCall.
type settlement struct {
	limit          *limit.Limit
	cost, reserved int64
	diff           int64
}

// settleInRedis queues the settlement of a request's buckets, one script
// call for all of them (one per slot group on a Cluster), before the
// request returns, so that it precedes the client's next request in the
// queue; what Redis answers is read by the batcher's worker (TakeAnswer),
// off the request path. A call is sent at most once: one lost to a
// failure is counted and logged, and the reservation stands.
func (s *Store) settleInRedis(buckets []limit.Bucket, items []limit.Settling) {
	groups := 1
	if s.groups != nil {
		groups = len(s.groups)
	}
	now := time.Now()
	var inline [limit.MaxInline]limit.Settling
	for g := range groups {
		group := inline[:0]
		for _, it := range items {
			if s.groups == nil || buckets[it.Bucket].Limit.Group == g {
				group = append(group, it)
			}
		}
		if len(group) == 0 {
			continue
		}
		sc := settleCalls.Get().(*settleCall)
		sc.store = s
		c := redisbatch.NewCall()
		for _, it := range group {
			c.Keys = append(c.Keys, buckets[it.Bucket].Key)
		}
		c.Command(settleScript)
		for _, it := range group {
			b := &buckets[it.Bucket]
			c.Args = append(c.Args, b.Charged().SettleArg(*b), b.Args[1], DiffArg(it.Diff), b.Limit.Charge.MaxDebtArg(b.Values.Burst, b.Values.Rate, b.Args[1]))
			sc.items = append(sc.items, settlement{limit: b.Limit, cost: it.Cost, reserved: b.Values.Requested, diff: it.Diff})
		}
		c.ClientCtx, c.Then = context.Background(), sc // sent even when the client has left
		if err := s.client.batcher.Enqueue(c, now); err != nil {
			c.Err = err
			sc.TakeAnswer(c)
		}
	}
}

// smallDiffs are the differences of -512 to 511 as script arguments,
// boxed once.
var smallDiffs = func() (v [1024]any) {
	for i := range v {
		v[i] = strconv.Itoa(i - 512)
	}
	return v
}()

// DiffArg is a settlement's difference from its reservation as a
// script argument.
func DiffArg(diff int64) any {
	if diff >= -512 && diff < 512 {
		return smallDiffs[diff+512]
	}
	return strconv.FormatInt(diff, 10)
}

// TakeAnswer reads what Redis answered to a settlement call, in the
// batcher's worker: it counts what was charged and forgiven, and
// releases the call and itself.
func (s *settleCall) TakeAnswer(c *redisbatch.Call) {
	report := s.store.report
	err := c.Err
	if err == nil && len(c.Reply) != 2*len(s.items) {
		err = fmt.Errorf("unexpected settle reply %v", c.Reply)
	}
	if err != nil {
		report.SettleFailed(err)
		for _, it := range s.items {
			report.Charged(it.limit, float64(it.reserved), 0)
		}
	} else {
		gaveBack, unsettled := false, false
		for i, it := range s.items {
			if r := c.Reply[2*i]; r < 0 {
				// -2: a bucket whose reservation's period is no longer
				// counted, with nothing to settle; else its key holds
				// another type, or the write was refused.
				unsettled = unsettled || r != -2
				report.Charged(it.limit, float64(it.reserved), 0)
				continue
			}
			forgiven := float64(c.Reply[2*i]) + float64(c.Reply[2*i+1])/1e6
			report.Charged(it.limit, float64(it.cost)-forgiven, forgiven)
			gaveBack = gaveBack || it.diff < 0
		}
		if unsettled {
			report.SettleFailed(ErrUnsettled)
		}
		if gaveBack {
			report.Refilled(c.Keys)
		}
	}
	c.Release()
	clear(s.items)
	s.store, s.items = nil, s.items[:0]
	settleCalls.Put(s)
}

// Settlements are merged per batch (redisbatch.MergedKind): settle.lua
// settles each bucket on its own (make bench, charge@64: scripts/req
// 2.00 -> 1.05, Redis µs per request 15.6 -> 13.6;
// BenchmarkServeHTTPCharged 15 -> 13 allocs). The batcher also keeps
// them ahead of the calls queued after them.
var Settlements = &redisbatch.MergedKind{Name: "settle", Script: settleScript, Width: 2,
	Is: func(c *redisbatch.Call) bool { return c.Script == settleScript && c.Then != nil }}

// ErrUnsettled is a bucket that settle.lua could not settle.
var ErrUnsettled = errors.New("a bucket was not settled: its key holds another type, or Redis refused the write")
