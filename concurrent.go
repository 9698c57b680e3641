package ratelimit

// Concurrency limits (issue 23): at most n requests of a key in flight,
// across every instance that shares the Redis. A request takes a slot of
// each concurrent limit together with the tokens of the other limits, in
// the same script call, all or nothing (script.lua), and gives it back
// when its response has ended. A slot is a lease in Redis: it expires
// after its hold unless the request that holds it renews it, so an
// instance that dies loses its slots within a hold.

import (
	"cmp"
	"context"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Concurrent is a concurrency limit: at most Slots requests of one key in
// flight at once, counted across every Caddy instance that shares the
// Redis (with `store memory`, in this process). A request takes one slot
// of each concurrent limit of its handler, together with the tokens of
// its other limits, all or nothing, and gives it back when its response
// has ended: finished, failed, panicked, or when the client left. When
// every slot is taken the request is refused with the handler's
// `status_code` and `Retry-After: <retry_after>`.
type Concurrent struct {
	// Name names the limit as a limit's name does (headers, placeholders,
	// metrics, Redis keys), unique among the handler's limits. Required.
	Name string `json:"name,omitempty"`

	// Slots is how many requests of a key may be in flight at once: a
	// whole number, placeholders resolved per request (plans) to one, or
	// `unlimited`, which exempts the request. 0 refuses every request.
	// Required.
	Slots Param `json:"slots,omitempty"`

	// Key, IPv4Prefix and IPv6Prefix are as the handler's, and default to
	// the handler's values.
	Key        string `json:"key,omitempty"`
	IPv4Prefix *int   `json:"ipv4_prefix,omitempty"`
	IPv6Prefix *int   `json:"ipv6_prefix,omitempty"`

	// Hold is how long a slot lives in Redis without renewal, by Redis's
	// clock: a request renews its slot every third of it while it runs,
	// so a slot of an instance that died is free again within a hold.
	// From 1s to 24h. Default: 30s.
	Hold caddy.Duration `json:"hold,omitempty"`

	// RetryAfter is the `Retry-After` of a request refused because every
	// slot was taken, in seconds: slots come back when responses end, not
	// at a time the limiter knows. Default: 1.
	RetryAfter int `json:"retry_after,omitempty"`
}

// Bounds and defaults of a concurrent limit.
const (
	defaultSlotHold   = 30 * time.Second
	minSlotHold       = time.Second
	maxSlotHold       = 24 * time.Hour
	defaultSlotRetry  = 1
	maxSlotRetry      = 86400
	concurrentQuotaIn = `qu="concurrent-requests"`
)

// slotRule is what a concurrent limit adds to its limit.
type slotRule struct {
	hold       time.Duration
	holdArg    any // the hold in microseconds as script argument, boxed once
	retryAfter time.Duration
}

//go:embed concurrent.lua
var concurrentSource string

var concurrentScript = newLuaScript(concurrentSource)

// Script arguments of concurrent.lua, boxed once.
var (
	kindConcurrentArg any = "c"
	renewArg          any = "renew"
	releaseArg        any = "release"
)

// checkConcurrent judges the handler's concurrent limits as configured:
// the parser calls it at the end of the directive, Validate for JSON.
// names are the token limits' names, which a concurrent limit must not
// take.
func (h *Handler) checkConcurrent() error {
	seen := map[string]bool{}
	for _, l := range h.Limits {
		seen[l.Name] = true
	}
	for _, q := range h.Quotas {
		seen[q.Name] = true
	}
	for _, c := range h.Concurrent {
		if err := checkLimitName(c.Name); err != nil {
			return fmt.Errorf("concurrent: %w", err)
		}
		if seen[c.Name] {
			return fmt.Errorf("concurrent '%s': the name is given twice: limit names must be unique in a handler", c.Name)
		}
		seen[c.Name] = true
		if err := checkConcurrentValues(c); err != nil {
			return fmt.Errorf("concurrent %s: %w", c.Name, err)
		}
	}
	if len(h.Concurrent) > 0 && h.Lease != nil {
		return errors.New("lease with concurrent limits: a lease admits requests without asking Redis, where the slots are; remove lease, or the concurrent limits")
	}
	return nil
}

// checkConcurrentValues judges one concurrent limit's own values.
func checkConcurrentValues(c Concurrent) error {
	if c.Slots == "" {
		return errors.New("slots is required: the most requests of a key in flight at once")
	}
	if !c.Slots.perRequest() && c.Slots != unlimited {
		if _, err := parseSlots(string(c.Slots)); err != nil {
			return err
		}
	}
	if c.Key != "" {
		if _, err := parseKeyTemplate(c.Key); err != nil {
			return err
		}
	}
	if err := checkPrefixes(c.IPv4Prefix, c.IPv6Prefix); err != nil {
		return err
	}
	if hold := time.Duration(c.Hold); hold != 0 && (hold < minSlotHold || hold > maxSlotHold) {
		return fmt.Errorf("hold '%v': want a duration from %v to %v (default %v): a request renews its slot every third of it",
			hold, minSlotHold, maxSlotHold, defaultSlotHold)
	}
	if c.RetryAfter < 0 || c.RetryAfter > maxSlotRetry {
		return fmt.Errorf("retry_after '%d': want whole seconds from 1 to %d (default %d)", c.RetryAfter, maxSlotRetry, defaultSlotRetry)
	}
	return nil
}

// parseSlots reads a number of slots.
func parseSlots(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > maxExactTokens {
		return 0, badValue("slots", s, "is not a whole number from 0 to 2^53 (or 'unlimited')")
	}
	return n, nil
}

// resolveSlots is a concurrent limit's values from its slots as written
// (placeholders replaced): n as the burst, one slot per request.
func resolveSlots(s string) (v limitValues, isUnlimited bool, err error) {
	if s == unlimited {
		return v, true, nil
	}
	n, err := parseSlots(s)
	return limitValues{burst: n, requested: 1}, false, err
}

// buildConcurrent makes the handler's concurrent limits, after its other
// limits (index from first). Their keys are named limits' keys with a
// suffix of their own, so a slot set never meets a bucket; groups are
// the Cluster hash slot groups by key template so far.
func (h *Handler) buildConcurrent(keyPrefix string, first int, groups map[string]int) ([]*limit, error) {
	limits := make([]*limit, 0, len(h.Concurrent))
	for i, c := range h.Concurrent {
		key := or(c.Key, h.Key)
		template, err := parseKeyTemplate(key)
		if err != nil {
			return nil, err
		}
		template.ipv4Bits = *cmp.Or(c.IPv4Prefix, h.IPv4Prefix, new(32))
		template.ipv6Bits = *cmp.Or(c.IPv6Prefix, h.IPv6Prefix, new(64))
		prefix := bucketPrefix(keyPrefix, h.Zone, key)
		hold := time.Duration(c.Hold)
		if hold == 0 {
			hold = defaultSlotHold
		}
		retry := c.RetryAfter
		if retry == 0 {
			retry = defaultSlotRetry
		}
		l := &limit{
			index: first + i, name: c.Name, nameValue: c.Name, ietfName: h.Zone + "." + c.Name,
			keyText: key, template: template, burst: c.Slots,
			keyPrefix: prefix[:len(keyPrefix)] + "{" + prefix[len(keyPrefix):],
			keySuffix: "}" + keySeparator + c.Name + keySeparator + "slots",
			slots: &slotRule{hold: hold, holdArg: strconv.FormatInt(hold.Microseconds(), 10),
				retryAfter: time.Duration(retry) * time.Second},
		}
		group := fmt.Sprintf("%s/%d/%d", key, template.ipv4Bits, template.ipv6Bits)
		if _, ok := groups[group]; !ok {
			groups[group] = len(groups)
		}
		l.group = groups[group]
		l.fixed = !c.Slots.perRequest()
		if l.fixed {
			if l.values, l.exempt, err = resolveSlots(string(c.Slots)); err != nil {
				return nil, err
			}
			l.args = [3]any{kindConcurrentArg, strconv.FormatInt(l.values.burst, 10), nil}
			l.burstValue = l.values.burst
		}
		limits = append(limits, l)
	}
	return limits, nil
}

// slotArgs are a concurrent bucket's script arguments for a request:
// "c", n, the request's slot id (the hold follows, from the limit).
func slotArgs(l *limit, values limitValues, id any) [3]any {
	args := l.args
	if !l.fixed {
		args = [3]any{kindConcurrentArg, strconv.FormatInt(values.burst, 10), nil}
	}
	args[2] = id
	return args
}

// instanceID starts every slot id of this process: slots of instances
// that share a Redis never meet.
var instanceID = func() string {
	var b [8]byte
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return hex.EncodeToString(b[:])
}()

var slotCounter atomic.Uint64

// newSlotID is a slot id no other request of any instance has.
func newSlotID() any {
	var buf [40]byte
	text := append(append(buf[:0], instanceID...), ':')
	text = strconv.AppendUint(text, slotCounter.Add(1), 36)
	return string(text)
}

// firstSlot is the index of a request's first concurrent bucket: they
// follow its token buckets (buildLimits puts the concurrent limits last).
func firstSlot(buckets []bucket) int {
	for i := range buckets {
		if l := buckets[i].limit; l != nil && l.slots != nil {
			return i
		}
	}
	return len(buckets)
}

// slotsAnswered completes the answer of a request's concurrent buckets:
// one that was full waits retry_after, since slots come back by release,
// not by time (the script says 0).
func slotsAnswered(buckets []bucket, allowed bool) {
	if allowed {
		return
	}
	for i := firstSlot(buckets); i < len(buckets); i++ {
		if b := &buckets[i]; b.limit.slots != nil && b.remaining == 0 && !b.unknown {
			b.retryAfter = b.limit.slots.retryAfter
		}
	}
}

// slotPolicyItem is a concurrent limit's RateLimit-Policy item: its slots
// as the quota, in the IETF unit of concurrent requests.
func slotPolicyItem(quoted string, v limitValues) string {
	return fmt.Sprintf("%s;q=%d;%s", quoted, v.burst, concurrentQuotaIn)
}

// In-process slots, for store memory and on_error local: a count per key,
// with a generation that an admin reset renews, so that the releases of
// requests admitted before the reset do not free slots taken after it.

type slotCounts struct {
	mu      sync.Mutex
	entries map[string]*slotEntry
	gen     uint64
}

type slotEntry struct {
	used int64
	gen  uint64
}

// takeInProcess takes a request's token buckets from s and its slots from
// s's slot counts, all or nothing: the slot counts stay locked while the
// tokens are taken.
func (s *memoryStore) takeInProcess(now time.Time, buckets []bucket) (bool, error) {
	k := firstSlot(buckets)
	if k == len(buckets) {
		return s.take(now, buckets)
	}
	sc := &s.slots
	sc.mu.Lock()
	defer sc.mu.Unlock()
	if sc.entries == nil {
		sc.entries = make(map[string]*slotEntry)
	}
	free := true
	for i := k; i < len(buckets); i++ {
		b := &buckets[i]
		used := int64(0)
		if e := sc.entries[s.storedKey(b.key)]; e != nil {
			used = e.used
		}
		b.remaining, b.retryAfter = max(0, b.values.burst-used), 0
		free = free && used < b.values.burst
	}
	if !free {
		for i := range k {
			buckets[i].unknown = true // not asked: the slots refused first
		}
		slotsAnswered(buckets, false)
		return false, nil
	}
	allowed := true
	if k > 0 {
		var err error
		if allowed, err = s.take(now, buckets[:k]); err != nil || !allowed {
			return allowed, err
		}
	}
	for i := k; i < len(buckets); i++ {
		b := &buckets[i]
		key := s.storedKey(b.key)
		e := sc.entries[key]
		if e == nil {
			sc.gen++
			e = &slotEntry{gen: sc.gen}
			sc.entries[key] = e
		}
		e.used++
		b.remaining--
	}
	return true, nil
}

// slotGen is the generation of a slot key's count, for its release.
func (s *memoryStore) slotGen(key string) uint64 {
	s.slots.mu.Lock()
	defer s.slots.mu.Unlock()
	if e := s.slots.entries[s.storedKey(key)]; e != nil {
		return e.gen
	}
	return 0
}

// releaseSlot gives back a slot taken in generation gen.
func (s *memoryStore) releaseSlot(key string, gen uint64) {
	key = s.storedKey(key)
	s.slots.mu.Lock()
	defer s.slots.mu.Unlock()
	if e := s.slots.entries[key]; e != nil && e.gen == gen {
		if e.used--; e.used <= 0 {
			delete(s.slots.entries, key)
		}
	}
}

// slotsInUse is how many slots of a key are held.
func (s *memoryStore) slotsInUse(key string) int64 {
	s.slots.mu.Lock()
	defer s.slots.mu.Unlock()
	if e := s.slots.entries[s.storedKey(key)]; e != nil {
		return e.used
	}
	return 0
}

// resetSlots frees every slot of the keys.
func (s *memoryStore) resetSlots(keys []string) {
	s.slots.mu.Lock()
	defer s.slots.mu.Unlock()
	for _, key := range keys {
		delete(s.slots.entries, s.storedKey(key))
	}
}

// slotHold is the slots one request holds, from admission until its
// response has ended; it renews those in Redis every third of the
// shortest hold.
type slotHold struct {
	h      *Handler
	store  *memoryStore // the in-process slots; nil when they are in Redis
	id     any          // the slot id, as the script took it
	keys   []string
	limits []*limit
	gens   []uint64 // in-process: each slot's generation
	every  time.Duration
	// Room for the slices, so a hold is one allocation.
	inlineKeys   [maxInlineBuckets]string
	inlineLimits [maxInlineBuckets]*limit
	inlineGens   [maxInlineBuckets]uint64

	mu       sync.Mutex
	released bool
	renewal  *time.Timer
}

// serveHolding serves an admitted request that holds slots, through
// next (and charging, when a limit charges), and gives the slots back
// when the response has ended, however it ended: the deferred release
// also runs when a later handler panics, or returns because the client
// left.
func (h *Handler) serveHolding(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, repl *caddy.Replacer,
	buckets []bucket, store *memoryStore, local bool) error {

	hold := h.holdSlots(buckets, store)
	defer hold.release()
	if h.charging != nil {
		return h.serveCharged(w, r, next, repl, buckets, local)
	}
	return next.ServeHTTP(w, r)
}

// holdSlots records the slots a request was admitted with, starts their
// renewal and counts them in the in_flight gauge.
func (h *Handler) holdSlots(buckets []bucket, store *memoryStore) *slotHold {
	k := firstSlot(buckets)
	hold := &slotHold{h: h, store: store}
	hold.keys, hold.limits, hold.gens = hold.inlineKeys[:0], hold.inlineLimits[:0], hold.inlineGens[:0]
	for i := k; i < len(buckets); i++ {
		b := &buckets[i]
		hold.id = b.args[2]
		hold.keys = append(hold.keys, b.key)
		hold.limits = append(hold.limits, b.limit)
		if store != nil {
			hold.gens = append(hold.gens, store.slotGen(b.key))
		}
		if every := b.limit.slots.hold / 3; hold.every == 0 || every < hold.every {
			hold.every = every
		}
		if h.metrics != nil {
			h.metrics.inFlight[b.limit.index].Inc()
		}
	}
	if store == nil {
		hold.renewal = time.AfterFunc(hold.every, hold.renew)
	}
	return hold
}

// release gives the slots back, once.
func (s *slotHold) release() {
	s.mu.Lock()
	if s.released {
		s.mu.Unlock()
		return
	}
	s.released = true
	if s.renewal != nil {
		s.renewal.Stop()
	}
	s.mu.Unlock()
	h := s.h
	if h.metrics != nil {
		for _, l := range s.limits {
			h.metrics.inFlight[l.index].Dec()
		}
	}
	if s.store != nil {
		for i, key := range s.keys {
			s.store.releaseSlot(key, s.gens[i])
		}
		return
	}
	s.sendRelease()
}

// sendRelease queues the release of slots in Redis, one call per Cluster
// hash slot group, before the response ends, and does not wait for it:
// the batcher's worker reads the answer. The limiter counts it pending
// per key until then, so that a request of the same client refused
// meanwhile for that key waits for it and asks again (awaitReleases): a
// client that sends its requests one after another never finds its own
// previous slot still taken. Sent at most once; a release lost to a
// failure expires with its hold.
func (s *slotHold) sendRelease() {
	h := s.h
	now := time.Now()
	for start := 0; start < len(s.keys); {
		end := s.groupEnd(start)
		c := s.call(releaseArg, start, end)
		h.limiter.releases.add(c.keys, 1)
		c.clientCtx, c.then = context.Background(), releaseAnswer{h} // sent even when the client has left
		if err := h.limiter.enqueue(c, now); err != nil {
			c.err = err
			c.then.takeAnswer(c)
		}
		start = end
	}
}

// groupEnd is the end of the Cluster slot group of held slots that
// starts at start (the slots of one group are consecutive).
func (s *slotHold) groupEnd(start int) int {
	end := start + 1
	for end < len(s.keys) && s.limits[end].group == s.limits[start].group {
		end++
	}
	return end
}

// call is concurrent.lua's call of op over the held slots start to end,
// of one Cluster slot group.
func (s *slotHold) call(op any, start, end int) *call {
	c := calls.Get().(*call)
	c.keys = append(c.keys, s.keys[start:end]...)
	c.command(concurrentScript)
	c.args = append(c.args, op)
	for _, l := range s.limits[start:end] {
		c.args = append(c.args, s.id, l.slots.holdArg)
	}
	return c
}

// releaseAnswer reads the answer to a release, in the batcher's worker.
type releaseAnswer struct{ h *Handler }

func (a releaseAnswer) takeAnswer(c *call) {
	a.h.limiter.releases.add(c.keys, -1)
	a.h.slotsAnswered(releaseArg, c, c.err)
	c.release()
}

// pendingReleases counts the releases queued and not yet answered, by
// slot key.
type pendingReleases struct {
	mu   sync.Mutex
	keys map[string]int
}

func (p *pendingReleases) add(keys []string, n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.keys == nil {
		p.keys = make(map[string]int)
	}
	for _, key := range keys {
		if p.keys[key] += n; p.keys[key] <= 0 {
			delete(p.keys, key)
		}
	}
}

// pending says whether a release of any of the buckets' slot keys is
// pending.
func (p *pendingReleases) pending(buckets []bucket) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := firstSlot(buckets); i < len(buckets); i++ {
		if p.keys[buckets[i].key] > 0 {
			return true
		}
	}
	return false
}

// awaitReleases waits, after a refusal by a full concurrent limit of a
// request sent while a release of one of its keys was on its way (and
// may have reached Redis after it), until the releases of its keys are
// answered, at most until the deadline; it says whether the request
// should ask again.
func (l *limiter) awaitReleases(buckets []bucket, deadline time.Time) bool {
	full := false
	for i := firstSlot(buckets); i < len(buckets); i++ {
		full = full || buckets[i].remaining == 0
	}
	if !full {
		return false
	}
	for l.releases.pending(buckets) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Microsecond)
	}
	return true
}

// renew renews the slots in Redis, in the timer's goroutine, and sets the
// timer again while the request runs.
func (s *slotHold) renew() {
	s.mu.Lock()
	released := s.released
	s.mu.Unlock()
	if released {
		return
	}
	s.send(renewArg)
	s.mu.Lock()
	if !s.released {
		s.renewal.Reset(s.every)
	}
	s.mu.Unlock()
}

// send runs concurrent.lua over the held slots through the batcher, one
// call per Cluster hash slot group, and waits for the answer, within the
// timeout. A release is waited for so that the slot is free in Redis
// before the response ends: a client that sends its requests one after
// another must not find its own previous request's slot still taken. A
// call is sent at most once; a release lost to a failure expires with its
// hold.
func (s *slotHold) send(op any) {
	h := s.h
	for start := 0; start < len(s.keys); {
		end := s.groupEnd(start)
		c := s.call(op, start, end)
		// Sent even when the client has left.
		c, err := h.limiter.send(context.Background(), time.Now(), c)
		h.slotsAnswered(op, c, err)
		if c != nil {
			c.release()
		}
		start = end
	}
}

// slotsAnswered logs what went wrong with a renewal or release: a
// failure as a warning (throttled), a slot that was gone at its renewal
// at debug level.
func (h *Handler) slotsAnswered(op any, c *call, err error) {
	switch {
	case err != nil:
		if err != errBreakerOpen {
			if ok, suppressed := h.redisWarns.allow(); ok {
				h.logger.Warn("Redis failed while renewing or releasing concurrency slots; a slot not released expires with its hold",
					zap.String("zone", h.Zone), zap.Any("op", op), zap.Error(err), suppressedField(suppressed))
			}
		}
	case op == renewArg:
		for _, renewed := range c.reply {
			if renewed == 0 {
				if ce := h.logger.Check(zap.DebugLevel, "a concurrency slot had expired, or was freed by the admin API, before its renewal; it is not renewed"); ce != nil {
					ce.Write(zap.String("zone", h.Zone))
				}
				break
			}
		}
	}
}

// releaseTaken gives back the slots of buckets a request took in an
// earlier Cluster group, when a later group refused, and returns the
// token buckets among them, for giveBack.
func (h *Handler) releaseTaken(taken []bucket) []bucket {
	k := firstSlot(taken)
	if k == len(taken) {
		return taken
	}
	tokens := taken[:0:0]
	hold := &slotHold{h: h}
	for i := range taken {
		b := &taken[i]
		if b.limit.slots == nil {
			tokens = append(tokens, *b)
			continue
		}
		hold.id = b.args[2]
		hold.keys = append(hold.keys, b.key)
		hold.limits = append(hold.limits, b.limit)
	}
	hold.released = true
	hold.send(releaseArg)
	return tokens
}

// slotView is a concurrent limit's slots now, for the admin API.
type slotView struct {
	inUse    int64
	expiries []time.Duration // of the slots in Redis, soonest first
}

// peekSlots reads a concurrent limit's slots without changing them.
func (h *Handler) peekSlots(ctx context.Context, b bucket) (slotView, error) {
	switch {
	case h.memory != nil:
		return slotView{inUse: h.memory.slotsInUse(b.key)}, nil
	case h.limiter == nil:
		return slotView{}, nil
	}
	reply, err := h.limiter.client.Eval(ctx, peekSlotsSource, []string{b.key}).Int64Slice()
	if err != nil {
		return slotView{}, err
	}
	v := slotView{inUse: int64(len(reply))}
	for _, us := range reply {
		v.expiries = append(v.expiries, time.Duration(us)*time.Microsecond)
	}
	return v, nil
}

// peekSlotsSource reads the live slots of one set: the microseconds until
// each expires, by Redis time, soonest first. It writes nothing.
const peekSlotsSource = `
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local scores = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
local left = {}
for i = 2, #scores, 2 do
  left[#left + 1] = tonumber(scores[i]) - now
end
return left`

// releases are merged per batch (limiter.merge): concurrent.lua releases
// each slot on its own (make bench, concurrent@64: scripts/req 2.00 ->
// 1.06).
var releases = &mergedKind{name: "release", script: concurrentScript, lead: []any{releaseArg}, width: 1, is: isRelease}

func isRelease(c *call) bool {
	_, ok := c.then.(releaseAnswer)
	return ok && c.script == concurrentScript
}
