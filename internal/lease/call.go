package lease

import (
	"context"
	_ "embed"
	"fmt"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
)

// The calls of a handler with lease: a request whose leases fall short
// takes its tokens with lease.lua (and is lent a lease); renewals go in
// the background; give-backs every half hold. lease.go holds the leases.

// lease.lua, the script of the calls.
var (
	//go:embed lease.lua
	leaseSource string
	leaseScript = redisstore.RegisterScript(leaseSource)
)

// The modes of lease.lua, boxed once.
var (
	leaseModeTake   any = "take"
	leaseModeRenew  any = "renew"
	leaseModeGive   any = "give"
	leaseModeRefund any = "refund"
	leaseModeSettle any = "settle"
	leaseModeReset  any = "reset"
)

// leaseLayer decides the requests of a handler with lease, from this
// instance's leases when it can (checkLeased), else in Redis with
// lease.lua, where its call lends the leases more. Its calls are its
// own, not the store's below it: it takes the place of a layer below
// that keeps refusals, and asks those itself (Leases.refused).
type leaseLayer struct {
	limit.Store // below: its holds and peeks are the layer's
	ls          *Leases
}

// Layer is the lease layer over below: with lease, the leases decide
// first. It takes the place of a layer below that keeps refusals
// (limit.TakeRefusals), and asks those itself.
func (ls *Leases) Layer(below limit.Store) limit.Store {
	below, ls.refused = limit.TakeRefusals(below)
	// Leases given back or reported spent may refill a bucket sooner
	// than its wait: a refusal is kept at most a hold.
	ls.refused.KeepAtMost(ls.hold)
	return leaseLayer{Store: below, ls: ls}
}

// Settle settles in the leases first (settleLeased).
func (l leaseLayer) Settle(r *limit.Call, items []limit.Settling) {
	l.ls.settleLeased(r.Buckets, r.LayerMarks, items)
}

// Reset makes a bucket full less what its leases hold (deleting it would
// drop its mark, and with it what is lent), after this instance's
// refusals of it are forgotten.
func (l leaseLayer) Reset(ctx context.Context, b limit.Bucket) error {
	l.ls.refused.Forget(b.Key)
	return l.ls.reset(ctx, b)
}

func (l leaseLayer) Take(ctx context.Context, r *limit.Call) (bool, error) {
	ls := l.ls
	if waits(r.Buckets) {
		return l.takeWaiting(ctx, r)
	}
	allowed, asked, err := ls.checkLeased(ctx, r.Sent, r.Buckets, r.ClearLayerMarks())
	if asked {
		redisstore.Answered(ctx, r, allowed, err, ls.report)
		if err == nil {
			ls.refused.Answered(r.Buckets, r.Sent, allowed)
		}
	}
	return allowed, err
}

// waits says whether the request may wait for one of its buckets
// (limit.Bucket.Waits).
func waits(buckets []limit.Bucket) bool {
	for i := range buckets {
		if buckets[i].Waits() {
			return true
		}
	}
	return false
}

// takeWaiting decides a request that may wait for one of its buckets
// (max_wait) as without lease: in Redis, by the store below, never from
// a lease (lease.lua knows no waiting). The plain script reads a lent
// bucket as its leases leave it, and counts its wait with their cap, so
// the bound holds with what is lent as with debt. On a Cluster whose hash
// slots the buckets span, a refusal by a later group gives the earlier
// ones back with giveback.lua, which leaves a lent bucket (its mark)
// short of what it took until it refills: never more admitted, at worst
// a request refused that would have fit. Its marks stay 0: it settles
// in Redis.
func (l leaseLayer) takeWaiting(ctx context.Context, r *limit.Call) (bool, error) {
	ls := l.ls
	r.ClearLayerMarks()
	if ls.refused.Answer(r.Buckets, r.Sent) {
		return false, nil
	}
	allowed, err := l.Store.Take(ctx, r) // the store's take says what Redis answered (redisstore.Answered)
	if err == nil {
		ls.refused.Answered(r.Buckets, r.Sent, allowed)
	}
	return allowed, err
}

// groupOf appends to dst the buckets of slot group g, in order, and to
// dstStates their states.
func groupOf(buckets []limit.Bucket, states []leaseState, g int, dst []limit.Bucket, dstStates []leaseState) ([]limit.Bucket, []leaseState) {
	for i := range buckets {
		if buckets[i].Limit.Group == g {
			dst, dstStates = append(dst, buckets[i]), append(dstStates, states[i])
		}
	}
	return dst, dstStates
}

// giveBackSeq is the sequence number of the give-back of what a flight's
// calls landed after the leases closed (land), or 0 when there is none;
// taken before the flight finishes, while no other call of its buckets
// can start: later calls of those buckets come after it (see take).
func giveBackSeq(ls *Leases, back leaseReturns) int64 {
	if back.len() == 0 {
		return 0
	}
	return ls.seq.Add(1)
}

// leaseReturns are leases to give back: their buckets and lease states,
// in order (states[i] is buckets[i]'s).
type leaseReturns struct {
	buckets []limit.Bucket
	states  []leaseState
}

func (r *leaseReturns) add(b limit.Bucket, st leaseState) {
	r.buckets, r.states = append(r.buckets, b), append(r.states, st)
}

func (r *leaseReturns) addAll(more leaseReturns) {
	r.buckets, r.states = append(r.buckets, more.buckets...), append(r.states, more.states...)
}

func (r *leaseReturns) len() int { return len(r.buckets) }

// maxGiveBack bounds the buckets of one give-back call, which Redis runs
// without serving anyone else.
const maxGiveBack = 64

// checkLeased decides a request of a handler with lease: from its
// buckets' leases when they hold its tokens; else, when a call for one
// of its buckets is in flight, after that call, which it shares a
// failure with; else from the refusals kept; else with a call of its own,
// which takes its tokens and lends its leases more (asked: the caller
// records it as a Redis call). A cold request (no lease, no hot key:
// Leases.acquire) is decided as without lease, by the plain script,
// which refills a bucket only up to what its leases leave; on a Cluster
// whose hash slots its buckets span, by lease.lua, which refunds the groups
// before a refusal under that cap (giveback.lua would not know it).
// marks are the request's (see acquire), all 0.
func (ls *Leases) checkLeased(clientCtx context.Context, sent time.Time, buckets []limit.Bucket, marks []int64) (allowed, asked bool, err error) {
	now, counted, lead := sent, false, false
	for {
		outcome, f := ls.acquire(now, buckets, marks, &counted, lead)
		switch {
		case outcome == Admitted:
			if f != nil {
				go ls.renewLeases(f)
			}
			return true, false, nil
		case outcome == Cold && ls.groups == nil:
			if ls.refused.Answer(buckets, sent) {
				return false, false, nil
			}
			allowed, err = ls.client.Take(clientCtx, now, buckets)
			return allowed, true, err
		case outcome == Wait:
			select {
			case <-f.done:
			case <-clientCtx.Done():
				return false, false, clientCtx.Err()
			}
			if f.err != nil {
				return false, false, f.err
			}
			now, lead = time.Now(), false
		case !lead:
			if ls.refused.Answer(buckets, sent) {
				return false, false, nil
			}
			lead = true
		default:
			// A request that waited for a flight has its own timeout from
			// now: the batch of its call ends at its earliest deadline.
			allowed, err = ls.leaseTake(clientCtx, now, f, buckets)
			return allowed, true, err
		}
	}
}

// leaseTake is a request's own call, flight f: it takes the request's
// tokens from every bucket, all or none, and lends the leases more. On a
// Cluster where the buckets span several slot groups, each group is a
// call, in order, and when one refuses or fails, the groups before it get
// back the request's tokens (their leases stay).
func (ls *Leases) leaseTake(clientCtx context.Context, sent time.Time, f *leaseFlight, buckets []limit.Bucket) (allowed bool, err error) {
	var back leaseReturns
	if ls.groups == nil {
		allowed, err = ls.call(clientCtx, sent, leaseModeTake, ls.seq.Add(1), buckets, f.states)
		back = ls.land(f, buckets, f.states, time.Now(), err)
	} else {
		allowed, err, back = ls.leaseTakeGroups(clientCtx, sent, f, buckets)
	}
	shared := err
	if clientCtx.Err() != nil {
		shared = nil // the leader's client left: the requests that waited ask again
	}
	seq := giveBackSeq(ls, back)
	ls.finish(f, buckets, shared)
	if back.len() > 0 {
		go ls.giveBackLeases(back, seq)
	}
	return allowed, err
}

// leaseTakeGroups is leaseTake over the slot groups of a Cluster.
func (ls *Leases) leaseTakeGroups(clientCtx context.Context, sent time.Time, f *leaseFlight, buckets []limit.Bucket) (allowed bool, err error, back leaseReturns) {
	var inline, given [limit.MaxInline]limit.Bucket
	var inlineStates, givenStates [limit.MaxInline]leaseState
	taken, takenStates := given[:0], givenStates[:0]
	ended := -1 // the group that refused or failed
	for g := range ls.groups {
		group, states := groupOf(buckets, f.states, g, inline[:0], inlineStates[:0])
		if len(group) == 0 {
			continue
		}
		allowed, err = ls.call(clientCtx, sent, leaseModeTake, ls.seq.Add(1), group, states)
		back.addAll(ls.land(f, group, states, time.Now(), err))
		j := 0
		for i := range buckets {
			if buckets[i].Limit.Group == g {
				buckets[i].Remaining, buckets[i].RetryAfter = group[j].Remaining, group[j].RetryAfter
				j++
			}
		}
		if err != nil || !allowed {
			ended = g
			break
		}
		taken, takenStates = append(taken, group...), append(takenStates, states...)
	}
	if ended < 0 {
		return true, nil, back
	}
	ls.refundGroups(taken, takenStates)
	for i := range buckets {
		switch g := buckets[i].Limit.Group; {
		case g < ended:
			buckets[i].Remaining += buckets[i].Values.Requested // refunded
		case g > ended:
			buckets[i].Unknown = true // never asked
		}
	}
	return false, err, back
}

// refundGroups returns what a request took from earlier slot groups, a
// call per group (one hash slot each), whether or not the client is still
// there: the tokens must not stay taken. A failure is logged; those
// buckets then stay short until they refill. states are taken's.
func (ls *Leases) refundGroups(taken []limit.Bucket, states []leaseState) {
	for start := 0; start < len(taken); {
		end := start + 1
		for end < len(taken) && taken[end].Limit.Group == taken[start].Limit.Group {
			end++
		}
		if _, err := ls.call(context.Background(), time.Now(), leaseModeRefund, ls.seq.Add(1), taken[start:end], states[start:end]); err != nil {
			ls.warnGiveBack(err)
		}
		start = end
	}
}

// renewLeases sends renewal f in the background: it reports what the
// leases hold and lends them up to what their rate wants.
func (ls *Leases) renewLeases(f *leaseFlight) {
	// From when the call leaves, not when the request that started it
	// came: on a busy instance this goroutine may start much later, and
	// the call's timeout and the new hold count from its send.
	f.sent = time.Now()
	var err error
	var back leaseReturns
	if ls.groups == nil {
		_, err = ls.call(context.Background(), f.sent, leaseModeRenew, ls.seq.Add(1), f.buckets, f.states)
		back = ls.land(f, f.buckets, f.states, time.Now(), err)
	} else {
		var inline [limit.MaxInline]limit.Bucket
		var inlineStates [limit.MaxInline]leaseState
		for g := range ls.groups {
			group, states := groupOf(f.buckets, f.states, g, inline[:0], inlineStates[:0])
			if len(group) == 0 {
				continue
			}
			_, gerr := ls.call(context.Background(), f.sent, leaseModeRenew, ls.seq.Add(1), group, states)
			back.addAll(ls.land(f, group, states, time.Now(), gerr))
			if err == nil {
				err = gerr
			}
		}
	}
	seq := giveBackSeq(ls, back)
	ls.finish(f, f.buckets, err)
	if back.len() > 0 {
		ls.giveBackLeases(back, seq)
	}
}

// giveBackLeases gives leases back: in calls of up to maxGiveBack
// buckets, or a bucket per call on a Cluster, where they may live on
// different masters, each call with sequence number seq, taken when the
// leases were picked (see take). This instance's cached denials of those
// buckets go: the bucket may hold tokens again. What fails counts as
// spent once the lease expires in Redis.
func (ls *Leases) giveBackLeases(back leaseReturns, seq int64) {
	size := maxGiveBack
	if ls.client.IsCluster() {
		size = 1
	}
	for start := 0; start < back.len(); start += size {
		end := min(start+size, back.len())
		chunk := back.buckets[start:end]
		_, _ = ls.call(context.Background(), time.Now(), leaseModeGive, seq, chunk, back.states[start:end])
		keys := make([]string, len(chunk))
		for i := range chunk {
			keys[i] = chunk[i].Key
		}
		ls.refused.ForgetKeys(keys)
	}
}

// GiveBackEvery gives back, every half hold, the leases whose hold ended,
// until stop; then all of them.
func (ls *Leases) GiveBackEvery() {
	defer close(ls.done)
	tick := time.NewTicker(max(ls.hold/2, time.Millisecond)) // a hold of 1ns is valid; a ticker of 0 panics
	defer tick.Stop()
	for {
		select {
		case <-ls.stop:
			ls.giveBackLeases(ls.take(time.Now(), true))
			return
		case now := <-tick.C:
			ls.giveBackLeases(ls.take(now, false))
		}
	}
}

// Close gives back what the leases hold and stops. From then on nothing
// is lent (want), and what a call in flight lands goes back (land).
func (ls *Leases) Close() {
	ls.closed.Store(true)
	close(ls.stop)
	<-ls.done
}

// reset makes the bucket b full less what it has lent (lease.lua's
// reset; deleting it would drop its mark, and the plain script would then
// refill it into lent tokens), and has every instance forget its cached
// denials of it, as the Redis store's reset does.
func (ls *Leases) reset(ctx context.Context, b limit.Bucket) error {
	b.Args = limit.Plain.ScriptArgs(b.Values)
	states := []leaseState{{lease: &lease{record: RecordKey(b.Key)}}}
	if _, err := ls.call(ctx, time.Now(), leaseModeReset, ls.seq.Add(1), []limit.Bucket{b}, states); err != nil {
		return err
	}
	return ls.client.AnnounceReset(ctx, b.Key)
}

// warnGiveBack logs a failed refund, throttled.
func (ls *Leases) warnGiveBack(err error) {
	ls.report.Warn("Redis failed while giving tokens back; those buckets stay short until they refill", err)
}

// call runs lease.lua in mode over the buckets (of one hash slot),
// each with its state (states[i] is buckets[i]'s): its lease's record,
// what the lease holds unused and the most it should hold, as call seq of
// this instance (ls.seq.Add(1) as it leaves, but for a give-back), and
// reads each bucket's answer: remaining and retryAfter into the bucket,
// and into its state leased, what Redis counts as lent to this instance
// now.
func (ls *Leases) call(clientCtx context.Context, sent time.Time, mode any, seq int64, buckets []limit.Bucket, states []leaseState) (allowed bool, err error) {
	c := redisbatch.NewCall()
	for i := range buckets {
		c.Keys = append(c.Keys, buckets[i].Key, states[i].lease.record)
	}
	c.Command(leaseScript)
	c.Args = append(c.Args, mode, ls.idArg, seq, ls.lifeArg)
	for i := range buckets {
		b, st := &buckets[i], &states[i]
		c.Args = append(c.Args, b.Args[0], b.Args[1], b.Args[2], st.held, st.want)
	}
	c, err = ls.client.Batcher().Send(clientCtx, sent, c)
	if err == nil {
		allowed, err = redisstore.ReadTake(c.Reply, buckets, true)
		for i := range states {
			states[i].leased = 0
			if err == nil {
				states[i].leased = c.Reply[1+2*len(buckets)+i] // the layer's words: what each lent (readTake judged them)
			}
		}
	}
	if c != nil {
		c.Release()
	}
	return allowed, err
}

// settleLeased settles the costs of a lending handler's responses
// (charged by the response) with lease.lua, in the background: a lending bucket refills
// only up to what its leases leave, and settle.lua, which knows nothing
// of leases, would refill and give back into lent tokens. One call per
// bucket: a bucket and its lease record share a hash slot, two
// buckets may not. A request admitted from a lease settles in that lease
// when it can (Leases.settle), without a call; marks are the request's
// (see acquire).
func (ls *Leases) settleLeased(buckets []limit.Bucket, marks []int64, items []limit.Settling) {
	type settled struct {
		limit                *limit.Limit
		key, record          string
		rate, burst, maxDebt any
		cost, reserved, diff int64
	}
	parts := make([]settled, 0, len(items))
	now := time.Now()
	for _, it := range items {
		b := &buckets[it.Bucket]
		if it.Bucket < len(marks) && marks[it.Bucket] != 0 && ls.settle(b, marks[it.Bucket], it.Diff, now) {
			ls.report.Charged(b.Limit, float64(it.Cost), 0)
			continue
		}
		parts = append(parts, settled{limit: b.Limit, key: b.Key, record: RecordKey(b.Key),
			rate: b.Args[0], burst: b.Args[1], maxDebt: b.Limit.Charge.MaxDebtArg(b.Values.Burst, b.Values.Rate, b.Args[1]),
			cost: it.Cost, reserved: b.Values.Requested, diff: it.Diff})
	}
	if len(parts) == 0 {
		return
	}
	go func() {
		for _, p := range parts {
			c := redisbatch.NewCall()
			c.Keys = append(c.Keys, p.key, p.record)
			c.Command(leaseScript)
			c.Args = append(c.Args, leaseModeSettle, ls.idArg, ls.seq.Add(1), ls.lifeArg, p.rate, p.burst, redisstore.DiffArg(p.diff), p.maxDebt, 0)
			c, err := ls.client.Batcher().Send(context.Background(), time.Now(), c)
			if err == nil && (len(c.Reply) != 4 || c.Reply[3] < 0) {
				err = fmt.Errorf("unexpected settle reply %v", c.Reply)
			}
			if err != nil {
				ls.report.SettleFailed(err)
				ls.report.Charged(p.limit, float64(p.reserved), 0)
			} else {
				forgiven := float64(c.Reply[3])
				ls.report.Charged(p.limit, float64(p.cost)-forgiven, forgiven)
				if p.diff < 0 {
					ls.refused.Forget(p.key)
				}
			}
			if c != nil {
				c.Release()
			}
		}
	}()
}

// settle settles what a charged response cost (diff: cost less
// reservation) in the lease of a bucket whose request it admitted, when
// that lease is still held with the request's values and has reported
// nothing since fromLease, its reports at the admission (so Redis still
// counts the request's tokens as lent): a
// smaller cost gives the rest back to the lease it came from (tokens the
// lease would hold had the request not taken them), a larger one takes
// the rest from the lease when it holds it. It reports whether it
// settled; otherwise the settlement goes to Redis.
func (ls *Leases) settle(b *limit.Bucket, fromLease, diff int64, now time.Time) bool {
	sh := &ls.shards[ls.shardIndex(b.Key)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	l := sh.byKey[b.Key]
	if l == nil || l.reports != fromLease || !l.counted || !now.Before(l.until) || l.values != b.Values || l.tokens < diff || ls.closed.Load() {
		return false
	}
	l.tokens -= diff
	if l.flight != nil {
		l.spent += diff // the call in flight reported the lease as it was: land counts this
	}
	return true
}
