package redisbatch

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// countScript is a script of the shape the batcher carries: on one key,
// a count of at most ARGV[1], it takes ARGV[2] when they fit and answers
// {1 if it took, what is left}; arguments that are not numbers are an
// error reply.
var countScript = NewScript(`
local most, n = tonumber(ARGV[1]), tonumber(ARGV[2])
if not most or not n then return redis.error_reply('ERR not a number') end
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used + n > most then return {0, most - used} end
redis.call('INCRBY', KEYS[1], n)
return {1, most - used - n}`)

// testBatcher is a batcher over a client of addr whose workers do not
// run: the tests send its batches themselves, as a worker would.
func testBatcher(t *testing.T, addr string, timeout time.Duration) *Batcher {
	t.Helper()
	client := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout,
		MaxRetries: -1})
	t.Cleanup(func() { _ = client.Close() })
	return NewStalled(Config{Client: client, Node: addr, Timeout: timeout}, 0)
}

func countCall(key string, most, n any, deadline time.Time) *Call {
	return newTestCall(countScript, []string{key}, []any{most, n}, deadline)
}

// TestBatchKeepsResultsApart: one batch, built by hand: three calls on
// one key, one on another asking all it has, and a malformed call whose
// error stays its own; each reads its own answer, in the order queued.
func TestBatchKeepsResultsApart(t *testing.T) {
	srv := redistest.Start(t)
	b := testBatcher(t, srv.Addr, time.Second)
	deadline := time.Now().Add(time.Second)
	batch := []*Call{
		countCall("a", 2, 1, deadline),
		countCall("b", 5, 5, deadline),
		countCall("a", 2, 1, deadline),
		countCall("bad", "not-a-number", "x", deadline),
		countCall("a", 2, 1, deadline),
	}
	b.SendBatch(batch)
	want := []struct {
		reply []int64
		err   bool
	}{{[]int64{1, 1}, false}, {[]int64{1, 0}, false}, {[]int64{1, 0}, false}, {nil, true}, {[]int64{0, 0}, false}}
	for i, c := range batch {
		if answered, _ := c.Wait(); !answered {
			t.Fatalf("call %d not delivered", i)
		}
		if (c.Err != nil) != want[i].err {
			t.Fatalf("call %d: err %v, want error %v", i, c.Err, want[i].err)
		}
		if c.Err == nil && !slices.Equal(c.Reply, want[i].reply) {
			t.Fatalf("call %d: reply %v, want %v", i, c.Reply, want[i].reply)
		}
	}
}

// TestFailedBatchCountsOnceTowardBreaker sends one batch of calls to a
// Redis that never answers: the node failed once, not once per call, so
// its breaker (which opens after BreakerThreshold failures in a row)
// stays closed.
func TestFailedBatchCountsOnceTowardBreaker(t *testing.T) {
	addr := redistest.StartBlackhole(t)
	b := testBatcher(t, addr, 100*time.Millisecond)
	deadline := time.Now().Add(100 * time.Millisecond)
	batch := make([]*Call, 2*BreakerThreshold)
	for i := range batch {
		batch[i] = countCall("k"+strconv.Itoa(i), 5, 1, deadline)
	}
	b.SendBatch(batch)
	for i, c := range batch {
		if c.Err == nil {
			t.Fatalf("call %d to a Redis that never answers: reply %v, want an error", i, c.Reply)
		}
	}
	if failures, open, _ := b.BreakerState(addr); failures != 1 || open {
		t.Fatalf("one failed batch of %d calls: %d failures counted, breaker open %v; want 1 failure, closed", len(batch), failures, open)
	}
}

// TestReplyOfAnotherShapeFailsItsCall: the batcher reads replies as
// arrays of integers. An error reply (a key of another type) fails its
// own call only. A reply of another shape (a string, a nested array, a
// string among the integers: no script of ours answers so) fails its
// call and never reads as an answer; go-redis then fails the calls after
// it in that pipeline and drops the connection, so the next batch reads
// its own replies, in step.
func TestReplyOfAnotherShapeFailsItsCall(t *testing.T) {
	srv := redistest.Start(t)
	b := testBatcher(t, srv.Addr, 2*time.Second)
	deadline := time.Now().Add(2 * time.Second)
	newCall := func(key, body string) *Call {
		c := countCall(key, 10, 1, deadline)
		if body != "" {
			c.Script = NewScript(body)
		}
		return c
	}
	expectTaken := func(what string, c *Call) {
		t.Helper()
		if c.Err != nil || !slices.Equal(c.Reply, []int64{1, 9}) {
			t.Fatalf("%s: reply %v, %v; want [1 9]", what, c.Reply, c.Err)
		}
	}
	// ("with the sources": nothing is cached in this server.)
	failing, good := newCall("shape:error", "return redis.error_reply('WRONGTYPE boom')"), newCall("shape:good0", "")
	b.Pipeline(context.Background(), []*Call{failing, good}, true)
	if failing.Err == nil {
		t.Errorf("an error reply answered %v without an error", failing.Reply)
	}
	expectTaken("the call batched after an error reply", good)

	for i, body := range []string{"return 'OK'", "return {1, {2}, 3}", "return {1, 'x', 0}"} {
		bad, after := newCall(fmt.Sprint("shape:bad", i), body), newCall(fmt.Sprint("shape:after", i), "")
		b.Pipeline(context.Background(), []*Call{bad, after}, true)
		if bad.Err == nil {
			t.Errorf("script %q: answered %v without an error", body, bad.Reply)
		}
		if after.Err == nil {
			expectTaken("the call batched after "+body, after)
		}
		next := newCall(fmt.Sprint("shape:next", i), "")
		b.Pipeline(context.Background(), []*Call{next}, true)
		expectTaken("the next batch after "+body, next)
	}
}

// TestOverloadedCallsCountAgainstNoBreaker: calls this instance could
// not send (a full queue, a deadline that passed in the queue) are
// overload, answered unsent, and count against no node's breaker.
func TestOverloadedCallsCountAgainstNoBreaker(t *testing.T) {
	b := NewStalled(Config{Node: "overloaded-node", Timeout: 100 * time.Millisecond}, 0)
	full := countCall("a", 5, 1, time.Time{})
	var overload OverloadError
	if _, err := b.Send(context.Background(), time.Now(), full); !errors.As(err, &overload) || err != ErrQueueFull {
		t.Errorf("a call with no room in the queue: err %v, want %v", err, ErrQueueFull)
	}
	expired := countCall("b", 5, 1, time.Now().Add(-time.Millisecond))
	b.SendBatch([]*Call{expired})
	if expired.Err != ErrExpiredInQueue || expired.sent.Load() {
		t.Errorf("a call whose deadline passed in the queue: err %v, sent %v; want %v, unsent", expired.Err, expired.sent.Load(), ErrExpiredInQueue)
	}
	if failures, open, _ := b.BreakerState("overloaded-node"); failures != 0 || open {
		t.Errorf("overload counted against the node: %d failures, open %v", failures, open)
	}
}

// TestCallsWhoseClientsLeftCountNoFailure: a pipeline sent to a Redis
// that never answers, whose every caller left while it was in flight,
// says nothing about Redis: its node's breaker counts no failure.
func TestCallsWhoseClientsLeftCountNoFailure(t *testing.T) {
	addr := redistest.StartBlackhole(t)
	b := testBatcher(t, addr, 300*time.Millisecond)
	deadline := time.Now().Add(300 * time.Millisecond)
	batch := make([]*Call, 5)
	for i := range batch {
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(20*time.Millisecond, cancel) // mid-flight
		batch[i] = countCall("gone-"+strconv.Itoa(i), 5, 1, deadline)
		batch[i].ClientCtx = ctx
	}
	b.SendBatch(batch)
	for i, c := range batch {
		if c.Err == nil {
			t.Errorf("call %d to a Redis that never answers: reply %v, want an error", i, c.Reply)
		}
	}
	if failures, open, _ := b.BreakerState(addr); failures != 0 || open {
		t.Errorf("calls whose clients left: %d failures counted, open %v; want none", failures, open)
	}
}
