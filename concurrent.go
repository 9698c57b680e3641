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
	"hash/maphash"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2"
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

// slotRule is what a concurrent limit adds to its limit: its kind
// (kind.go).
type slotRule struct {
	hold       time.Duration
	holdArg    any // the hold in microseconds as script argument, boxed once
	retryAfter time.Duration
}

// slotRule is a concurrent limit's rule.
func (l *limit) slotRule() *slotRule { return l.kind.(*slotRule) }

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
// seen holds the limits' and quotas' names, which a concurrent limit
// must not take.
func (h *Handler) checkConcurrent(seen map[string]bool) error {
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
			keyText: key, template: template, burst: c.Slots, kind: &slotRule{hold: hold, holdArg: strconv.FormatInt(hold.Microseconds(), 10),
				retryAfter: time.Duration(retry) * time.Second},
			keyPrefix: prefix[:len(keyPrefix)] + "{" + prefix[len(keyPrefix):],
			keySuffix: "}" + keySeparator + c.Name + keySeparator + "slots",
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
			l.args = l.kind.scriptArgs(l.values)
			l.burstValue = l.values.burst
		}
		limits = append(limits, l)
	}
	return limits, nil
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

// slotID is a slot id and the room for its text: boxed as &text, it is
// one allocation where a string in an interface is two
// (BenchmarkServeHTTPConcurrentParallel 12 -> 11 allocs).
type slotID struct {
	text string
	room [32]byte // instanceID (16), ':', the count in base 36 (at most 13)
}

// newSlotID is a slot id no other request of any instance has.
func newSlotID() any {
	id := new(slotID)
	text := append(append(id.room[:0], instanceID...), ':')
	text = strconv.AppendUint(text, slotCounter.Add(1), 36)
	id.text = unsafe.String(&text[0], len(text)) // id.room is not written again
	return &id.text
}

// slotsAnswered completes the answer of a request's concurrent buckets:
// one that was full waits retry_after, since slots come back by release,
// not by time (the script says 0).
func slotsAnswered(buckets []bucket, allowed bool) {
	if allowed {
		return
	}
	for i := firstHeld(buckets); i < len(buckets); i++ {
		if b := &buckets[i]; b.remaining == 0 && !b.unknown {
			b.retryAfter = b.limit.slotRule().retryAfter
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
// tokens are taken. Each slot's bucket gets the generation of the count
// it was taken from (slotGen), for its release: read later, it could be
// a count that an admin reset and another take made meanwhile.
func (s *memoryStore) takeInProcess(now time.Time, buckets []bucket) (bool, error) {
	k := firstHeld(buckets)
	if k == len(buckets) {
		return s.takeTokens(now, buckets)
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
		if allowed, err = s.takeTokens(now, buckets[:k]); err != nil || !allowed {
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
		b.slotGen = e.gen
	}
	return true, nil
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
	// slots are, in Redis, each limit's slots n for this request as
	// script argument when one resolves them per request (plans); nil
	// when every limit's n is fixed, in its args (slotN).
	slots []any
	gens  []uint64 // in-process: each slot's generation
	every time.Duration
	// Room for the slices of a request with one concurrent limit, the
	// usual, so that its hold is one allocation of 208 bytes (320 with
	// room for maxInlineBuckets: BenchmarkServeHTTPConcurrentParallel
	// 1436 -> 1330 B/op).
	inlineKeys   [1]string
	inlineLimits [1]*limit
	inlineGens   [1]uint64

	mu       sync.Mutex
	released bool

	// Where the limiter's renewals keep it while it holds slots in Redis
	// (slotRenewals), under their lock: renewing counts its keys whose
	// renewal is queued or on its way, and a release meanwhile waits for
	// them (releaseAfter). renewedAt is on the monotonic clock of
	// clockStart: a time.Time would take two more words.
	releaseAfter bool
	renewing     int32
	prev, next   *slotHold
	renewedAt    time.Duration
}

// slotN is the slots n of held slot i, as script argument.
func (s *slotHold) slotN(i int) any {
	if s.slots != nil {
		return s.slots[i]
	}
	return s.limits[i].args[1]
}

// holdSlots records the slots a request was admitted with, starts their
// renewal and counts them in the in_flight gauge.
func (h *Handler) holdSlots(buckets []bucket, store *memoryStore) *slotHold {
	k := firstHeld(buckets)
	hold := &slotHold{h: h, store: store}
	hold.keys, hold.limits, hold.gens = hold.inlineKeys[:0], hold.inlineLimits[:0], hold.inlineGens[:0]
	perRequest := false
	for i := k; i < len(buckets); i++ {
		b := &buckets[i]
		hold.id = b.args[2]
		hold.keys = append(hold.keys, b.key)
		hold.limits = append(hold.limits, b.limit)
		perRequest = perRequest || !b.limit.fixed
		if store != nil {
			hold.gens = append(hold.gens, b.slotGen)
		}
		if every := b.limit.slotRule().hold / 3; hold.every == 0 || every < hold.every {
			hold.every = every
		}
		if h.metrics != nil {
			h.metrics.inFlight[b.limit.index].Inc()
		}
	}
	if store == nil && perRequest {
		for i := k; i < len(buckets); i++ {
			hold.slots = append(hold.slots, buckets[i].args[1])
		}
	}
	if store == nil {
		h.limiter.renewals.add(hold)
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
	// Pending from now, so that a refused request of these keys waits for
	// it (awaitReleases); queued once no renewal of the slots is on its
	// way, and before the hold stops keeping the limiter open (Destruct).
	l := h.limiter
	l.releases.add(s.keys, 1)
	if l.renewals.leave(s) {
		l.queueRelease(s)
		l.renewals.left()
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

// call is concurrent.lua's release of the held slots start to end, of
// one Cluster slot group.
func (s *slotHold) call(start, end int) *call {
	c := calls.Get().(*call)
	c.keys = append(c.keys, s.keys[start:end]...)
	c.command(concurrentScript)
	c.args = append(c.args, releaseArg)
	for range s.keys[start:end] {
		c.args = append(c.args, s.id)
	}
	return c
}

// queueRelease queues the release of a hold's slots in Redis, counted
// pending by the caller (pendingReleases), and wakes a worker; it does
// not wait: the response ends meanwhile. A worker sends it and reads the
// answer. A request of the same client refused meanwhile for that key
// waits for it and asks again (awaitReleases): a client that sends its
// requests one after another never finds its own previous slot still
// taken. Sent at most once; a release lost to a failure expires with its
// hold. A release is a call as the queue's are (enqueue): it keeps an
// unloaded config's limiter open for lingerIdle, and every release queued
// before the limiter closed is answered; one that meets it closed is
// answered as failed.
func (l *limiter) queueRelease(s *slotHold) {
	l.lastCall.Store(time.Now().UnixNano())
	l.closing.RLock()
	closed := l.closed
	if !closed {
		l.releaseQueue.add(releaseArg, s)
		l.wakeWorker()
	}
	l.closing.RUnlock()
	if closed {
		l.releases.add(s.keys, -1)
		s.h.slotsFailed(releaseArg, errLimiterClosed)
	}
}

// wakeWorker wakes a worker for queued releases or renewals, unless one
// is woken already.
func (l *limiter) wakeWorker() {
	select {
	case l.wake <- struct{}{}:
	default:
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

func (q *slotQueue) add(op any, holds ...*slotHold) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, s := range holds {
		for i, key := range s.keys {
			q.keys = append(q.keys, key)
			q.holds = append(q.holds, s)
			if q.args = append(q.args, s.id); op == renewArg {
				q.args = append(q.args, s.limits[i].slotRule().holdArg, s.slotN(i))
			}
		}
	}
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
func (q *slotQueue) calls(l *limiter, op any, now time.Time, batch []*call) (_ []*call, more bool) {
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
func (l *limiter) hashSlotCalls(op any, keys []string, args []any, holds []*slotHold, now time.Time, batch []*call) []*call {
	w := argsPerSlot(op)
	order := make([]int, len(keys))
	slot := make([]int, len(keys))
	for i, key := range keys {
		order[i], slot[i] = i, hashSlot(key)
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
func (l *limiter) slotsCall(op any, keys []string, args []any, holds []*slotHold, now time.Time) *call {
	c := calls.Get().(*call)
	c.keys = append(c.keys, keys...)
	c.command(concurrentScript)
	c.args = append(append(c.args, op), args...)
	answer := slotBatches.Get().(*slotBatch)
	answer.limiter, answer.op = l, op
	answer.holds = append(answer.holds, holds...)
	c.clientCtx, c.deadline, c.then = context.Background(), now.Add(l.timeout), answer
	return c
}

// slotBatch reads the answer to a call of releases or renewals of many
// requests' slots, in the worker: a failure is told once by each handler
// whose slots it held, a slot found gone at its renewal by its own; the
// renewals learn which holds were renewed, or are due again.
type slotBatch struct {
	limiter *limiter
	op      any         // releaseArg or renewArg
	holds   []*slotHold // per key
}

var slotBatches = sync.Pool{New: func() any { return new(slotBatch) }}

func (b *slotBatch) takeAnswer(c *call) {
	l := b.limiter
	if b.op == releaseArg {
		l.releases.add(c.keys, -1)
	}
	for i, s := range b.holds {
		switch {
		case c.err != nil:
			if !slices.ContainsFunc(b.holds[:i], func(o *slotHold) bool { return o.h == s.h }) {
				s.h.slotsFailed(b.op, c.err)
			}
		case b.op == renewArg && i < len(c.reply) && c.reply[i] != 1:
			s.h.slotGone(c.reply[i])
		}
	}
	if b.op == renewArg {
		l.renewals.renewed(l, b.holds, c.err != nil)
	}
	c.release()
	clear(b.holds)
	b.limiter, b.op, b.holds = nil, nil, b.holds[:0]
	slotBatches.Put(b)
}

// pendingReleases counts the releases queued and not yet answered, per
// slot key, so that a request of a key refused meanwhile waits for its
// own key's releases (awaitReleases), and for no other key's. A count by
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
func (p *pendingReleases) pending(buckets []bucket) bool {
	for i := firstHeld(buckets); i < len(buckets); i++ {
		if p.keyPending(buckets[i].key) {
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

// awaitReleases waits, after a refusal by a full concurrent limit of a
// request sent while a release of one of its keys was on its way (and
// may have reached Redis after it), until the releases of its keys are
// answered, at most until the deadline; it says whether the request
// should ask again.
func (l *limiter) awaitReleases(buckets []bucket, deadline time.Time) bool {
	full := false
	for i := firstHeld(buckets); i < len(buckets); i++ {
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

// slotRenewals are the slot holds of a limiter's requests in flight, in
// a ring, renewed by one ticker for all of them (renewSlots), where a
// timer for each cost every request an allocation and two changes of
// the runtime's timer heap (make bench, concurrent@64: 0.817 -> 0.845 of
// allowed@64; BenchmarkServeHTTPConcurrentParallel 13 -> 12 allocs).
type slotRenewals struct {
	start sync.Once
	mu    sync.Mutex
	ring  slotHold // the ring's head, no hold
	// held counts the holds whose release is not queued yet: in the ring,
	// or waiting for their renewal's answer. The limiter lives while
	// there are any (Destruct).
	held int
}

// renewTick is how often the renewals look for holds due: a hold renews
// on the last tick before a third of its own has passed since its last
// renewal (or take), so every third of it at the latest, and at most a
// sixth of the shortest hold early: a slot always has two thirds of its
// hold left, less a round trip. A renewal that failed is due again at
// the next tick.
const renewTick = minSlotHold / 6

// add puts a hold that took its slots now in the ring, and starts the
// ticker with the first.
func (r *slotRenewals) add(s *slotHold) {
	r.start.Do(func() {
		r.ring.prev, r.ring.next = &r.ring, &r.ring
		go r.renewSlots(s.h.limiter)
	})
	now := time.Since(clockStart)
	r.mu.Lock()
	defer r.mu.Unlock()
	s.renewedAt = now
	s.prev, s.next = r.ring.prev, &r.ring
	r.ring.prev.next = s
	r.ring.prev = s
	r.held++
}

// holding says whether any request holds slots, or has its release
// still to queue.
func (r *slotRenewals) holding() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.held > 0
}

// leave takes a released hold out of the ring. It says false when a
// renewal of its slots is queued or on its way: its answer then queues
// the release (renewed). Sent meanwhile, the release could land first,
// and the renewal bring the slot back.
func (r *slotRenewals) leave(s *slotHold) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if s.next != nil {
		s.prev.next, s.next.prev = s.next, s.prev
		s.prev, s.next = nil, nil
	}
	if s.renewing > 0 {
		s.releaseAfter = true
		return false
	}
	return true
}

// left counts a hold whose release is queued.
func (r *slotRenewals) left() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.held--
}

// renewed takes the answer to the renewal of holds' slots (a hold once
// per key): a failed one is due again at the next tick, and a hold
// released meanwhile has its release queued now.
func (r *slotRenewals) renewed(l *limiter, holds []*slotHold, failed bool) {
	var release []*slotHold
	now := time.Since(clockStart)
	r.mu.Lock()
	for _, s := range holds {
		if failed {
			s.renewedAt = now - s.every // due
		}
		if s.renewing--; s.renewing == 0 && s.releaseAfter {
			release = append(release, s)
		}
	}
	r.mu.Unlock()
	for _, s := range release {
		l.queueRelease(s)
		r.left()
	}
}

// renewSlots queues, every renewTick until the limiter stops, the
// renewal of each hold whose last renewal (or take) will be a third of
// its hold ago before the next tick, unless one is on its way already,
// and wakes a worker: the workers send them spread over their batches
// (slotQueue.calls).
func (r *slotRenewals) renewSlots(l *limiter) {
	ticker := time.NewTicker(renewTick)
	defer ticker.Stop()
	var due []*slotHold
	for {
		select {
		case <-l.stop:
			return
		case tick := <-ticker.C:
			now := tick.Sub(clockStart)
			r.mu.Lock()
			for s := r.ring.next; s != &r.ring; s = s.next {
				if s.renewing == 0 && now-s.renewedAt+renewTick > s.every {
					s.renewedAt, s.renewing = now, int32(len(s.keys))
					due = append(due, s)
				}
			}
			r.mu.Unlock()
			if len(due) > 0 {
				l.renewQueue.add(renewArg, due...)
				l.wakeWorker()
			}
			clear(due)
			due = due[:0]
		}
	}
}

// send releases the held slots through the batcher, one call per
// Cluster hash slot group, and waits for the answer, within the timeout,
// so that the slot is free in Redis before the request's answer: its
// client may ask again at once. A call is sent at most once; a release
// lost to a failure expires with its hold.
func (s *slotHold) send() {
	h := s.h
	for start := 0; start < len(s.keys); {
		end := s.groupEnd(start)
		c := s.call(start, end)
		// Sent even when the client has left.
		c, err := h.limiter.send(context.Background(), time.Now(), c)
		if err != nil {
			h.slotsFailed(releaseArg, err)
		}
		if c != nil {
			c.release()
		}
		start = end
	}
}

// slotsFailed warns, throttled, of a renewal or release that Redis
// failed (one refused by an open breaker was told when it opened).
func (h *Handler) slotsFailed(op any, err error) {
	if err == errBreakerOpen {
		return
	}
	if ok, suppressed := h.redisWarns.allow(); ok {
		h.logger.Warn("Redis failed while renewing or releasing concurrency slots; a slot not released expires with its hold",
			zap.String("zone", h.Zone), zap.Any("op", op), zap.Error(err), suppressedField(suppressed))
	}
}

// slotGone tells, at debug level, of a slot gone at its renewal (expired,
// freed by the admin API, or lost with Redis's data): the renewal brought
// it back (reply 2), or found every slot taken (0).
func (h *Handler) slotGone(reply int64) {
	msg := "a concurrency slot was gone at its renewal and every slot of its limit is taken; its request runs on uncounted, and its next renewal tries again"
	if reply == 2 {
		msg = "a concurrency slot was gone at its renewal; it is back"
	}
	if ce := h.logger.Check(zap.DebugLevel, msg); ce != nil {
		ce.Write(zap.String("zone", h.Zone))
	}
}

// releaseTaken gives back the slots of buckets a request took in an
// earlier Cluster group, when a later group refused, and returns the
// token buckets among them, for giveBack.
func (h *Handler) releaseTaken(taken []bucket) []bucket {
	k := firstHeld(taken)
	if k == len(taken) {
		return taken
	}
	tokens := taken[:0:0]
	hold := &slotHold{h: h}
	for i := range taken {
		b := &taken[i]
		if !b.kind().heldWhileServed() {
			tokens = append(tokens, *b)
			continue
		}
		hold.id = b.args[2]
		hold.keys = append(hold.keys, b.key)
		hold.limits = append(hold.limits, b.limit)
	}
	hold.released = true
	hold.send()
	return tokens
}

// releaseLostTake releases the slots of a request whose take failed with
// err after it may have run in Redis: its reply was cut, or came after
// the timeout. The request follows on_error without a slot, so nothing
// else would release them, and they would stay taken for their hold. A
// release is idempotent: one of slots the take never got frees nothing.
// Not sent for a take that never left (this instance's overload, an
// open breaker, a closed limiter, a client that left first, a connection
// that could not be opened).
func (h *Handler) releaseLostTake(buckets []bucket, err error) {
	var overload overloadError
	var dial *net.OpError
	if errors.As(err, &overload) || err == errBreakerOpen || err == errLimiterClosed || errors.Is(err, context.Canceled) ||
		errors.As(err, &dial) && dial.Op == "dial" {
		return
	}
	hold := &slotHold{h: h, released: true}
	for i := firstHeld(buckets); i < len(buckets); i++ {
		b := &buckets[i]
		hold.id = b.args[2]
		hold.keys = append(hold.keys, b.key)
		hold.limits = append(hold.limits, b.limit)
	}
	if len(hold.keys) > 0 {
		h.limiter.releases.add(hold.keys, 1)
		h.limiter.queueRelease(hold)
	}
}

// slotView is a concurrent limit's slots now, for the admin API.
type slotView struct {
	inUse    int64
	expiries []time.Duration // of the slots in Redis, soonest first
}

// peekSlots reads the slots of a concurrent limit's set in Redis without
// changing them.
func (l *limiter) peekSlots(ctx context.Context, key string) (slotView, error) {
	reply, err := l.client.Eval(ctx, peekSlotsSource, []string{key}).Int64Slice()
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

// The concurrent limit as a kind of limit (kind.go).

// limitInfo lists its slots and hold.
func (s *slotRule) limitInfo(l *limit) limitInfo {
	li := l.limitInfo()
	li.Slots, li.Hold = l.burst, s.hold.String()
	return li
}

// bucketInfo shows how many of its slots are held, and when each held
// slot expires unless renewed.
func (*slotRule) bucketInfo(ctx context.Context, h *Handler, b bucket) (bucketInfo, error) {
	view, err := h.store.peekSlots(ctx, b)
	if err != nil {
		return bucketInfo{}, err
	}
	info := bucketInfo{Limit: b.limit.name, Key: b.clientKey(), StoredKey: b.key, Slots: &b.values.burst, InUse: &view.inUse}
	for _, d := range view.expiries {
		info.SlotExpiry = append(info.SlotExpiry, d.Seconds())
	}
	return info, nil
}

func (*slotRule) burstName() string { return "slots" }

// resolveValues reads its slots, in the burst's place.
func (*slotRule) resolveValues(_, slots, _ string) (limitValues, bool, error) {
	return resolveSlots(slots)
}

// scriptArgs are "c" and n; the request's slot id follows (begin).
func (*slotRule) scriptArgs(v limitValues) [3]any {
	return [3]any{kindConcurrentArg, strconv.FormatInt(v.burst, 10), nil}
}

// begin gives the bucket the request's slot id, one for all its
// concurrent limits.
func (*slotRule) begin(b bucket, shared requestShared) (bucket, requestShared) {
	if shared.slot == nil {
		shared.slot = newSlotID()
	}
	b.args[2] = shared.slot
	return b, shared
}

// appendArgs appends "c", n, the slot id, then the hold.
func (s *slotRule) appendArgs(args []any, b bucket) []any {
	return append(append(args, b.args[:]...), s.holdArg)
}

// heldWhileServed: a request holds its slot until its response has
// ended (serveHolding).
func (*slotRule) heldWhileServed() bool { return true }

func (*slotRule) replyWords() int                                      { return 0 }
func (*slotRule) readReply(b bucket, _ []int64, _ int) (bucket, error) { return b, nil }

// A concurrent limit's slots in the process are counts of their own
// (takeInProcess), never buckets of the memory store's: a take gives the
// store only the token buckets before the slots.

func (*slotRule) holds(memoryBucket, bool, time.Time, int64, bucket) (bucket, bool) {
	panic("concurrent limits take slots (takeInProcess), not tokens")
}

func (*slotRule) take(memoryBucket, bool, time.Time, int64, bucket, bool) (bucket, memoryBucket, bool) {
	panic("concurrent limits take slots (takeInProcess), not tokens")
}

func (*slotRule) peek(memoryBucket, bool, time.Time, int64, bucket) bucketView {
	panic("concurrent limits are read by peekSlots, not peek")
}

// A concurrent limit charges nothing: a response costs it its slot.

func (*slotRule) settleArg(bucket) any { panic("concurrent limits charge nothing") }

func (*slotRule) settleHeld(memoryBucket, bool, int64, bucket, int64, int64, int64) (memoryBucket, bool, float64, float64) {
	panic("concurrent limits charge nothing")
}

// fixedHeaders formats a fixed limit's header values once: its slots as
// the burst capacity, no replenish rate.
func (*slotRule) fixedHeaders(l *limit, lh *limitHeaders) bool {
	if !(tokenBucket{}).fixedHeaders(l, lh) {
		return false
	}
	lh.policy = slotPolicyItem(lh.quoted, l.values)
	return true
}

// setSpring writes its slots as the burst capacity, as a token bucket of
// no rate would.
func (*slotRule) setSpring(hdr http.Header, v *headerValues, b bucket, lh *limitHeaders) {
	tokenBucket{}.setSpring(hdr, v, b, lh)
}

func (*slotRule) appendPolicy(policy []byte, lh *limitHeaders, b bucket) []byte {
	return append(policy, slotPolicyItem(lh.quoted, b.values)...)
}

// resetIn is its wait: retry_after when it was full (slotsAnswered).
func (*slotRule) resetIn(b bucket) time.Duration { return b.retryAfter }

// denialTTL is 0: slots come back by release, not by time.
func (*slotRule) denialTTL(bucket) time.Duration { return 0 }

// cachedRemaining is what it held: the deny cache never keeps a
// concurrent limit's refusal (denialTTL).
func (*slotRule) cachedRemaining(_ bucket, remaining int64, _ time.Duration) int64 { return remaining }
