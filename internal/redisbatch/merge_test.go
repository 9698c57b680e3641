package redisbatch

import (
	"context"
	"slices"
	"testing"
	"time"
)

// testKind merges the calls of a two-word-per-key script that stand
// apart from calls of other scripts.
var (
	mergedScript = NewScript("return {}")
	otherScript  = NewScript("return {1}")
	testKind     = &MergedKind{Name: "test", Script: mergedScript, Width: 2,
		Is: func(c *Call) bool { return c.Script == mergedScript }}
)

func testCallOf(script *Script, keys ...string) *Call {
	return newTestCall(script, keys, []any{"arg:" + keys[0]}, time.Now().Add(time.Second))
}

// TestMergeJoinsCallsWhereTheFirstStoodUnlessACallBetweenHasTheirKey:
// merged calls go where the first of them stood; one whose key a call
// between has starts a merged call of its own after that call; other
// calls keep their places, and the merged call carries each part's
// arguments in order.
func TestMergeJoinsCallsWhereTheFirstStoodUnlessACallBetweenHasTheirKey(t *testing.T) {
	b := NewStalled(Config{Node: "n", Timeout: time.Second}, 0)
	x1, take, y, x2, z := testCallOf(mergedScript, "x"), testCallOf(otherScript, "x"), testCallOf(mergedScript, "y"),
		testCallOf(mergedScript, "x"), testCallOf(mergedScript, "z")
	out := b.Merge([]*Call{x1, take, y, x2, z}, testKind)
	if len(out) != 3 || out[1] != take {
		t.Fatalf("merged into %d calls, want x and y where x stood, the take of x, then x and z", len(out))
	}
	if !slices.Equal(out[0].Keys, []string{"x", "y"}) || !slices.Equal(out[2].Keys, []string{"x", "z"}) {
		t.Fatalf("merged keys %v and %v, want [x y] and [x z]", out[0].Keys, out[2].Keys)
	}
	if got := out[0].Args[3+2:]; !slices.Equal(got, []any{"arg:x", "arg:y"}) {
		t.Fatalf("merged arguments %v, want each part's in order", got)
	}

	// Each part gets its own words of the answer.
	out[0].Reply = append(out[0].Reply, 1, 2, 3, 4)
	out[0].Answer()
	for _, c := range []*Call{x1, y} {
		if answered, _ := c.Wait(); !answered || c.Err != nil {
			t.Fatalf("part %v: answered %v, %v", c.Keys, answered, c.Err)
		}
	}
	if !slices.Equal(x1.Reply, []int64{1, 2}) || !slices.Equal(y.Reply, []int64{3, 4}) {
		t.Fatalf("parts answered %v and %v, want [1 2] and [3 4]", x1.Reply, y.Reply)
	}
	// A reply too short for its parts fails them, not reads as answers.
	out[2].Reply = append(out[2].Reply, 1, 2)
	out[2].Answer()
	if x2.Wait(); x2.Err != nil || !slices.Equal(x2.Reply, []int64{1, 2}) {
		t.Fatalf("first part of a short reply: %v %v, want [1 2]", x2.Reply, x2.Err)
	}
	if z.Wait(); z.Err == nil {
		t.Fatalf("the part the reply fell short of: %v, want an error", z.Reply)
	}
}

// TestBreakerOpensAfterFailuresInARowAndProbesAfterItsCooldown.
func TestBreakerOpensAfterFailuresInARowAndProbesAfterItsCooldown(t *testing.T) {
	var b breaker
	for i := 1; i < BreakerThreshold; i++ {
		if b.failure() {
			t.Fatalf("opened after %d failures, want %d", i, BreakerThreshold)
		}
	}
	if !b.failure() || !b.isOpen() || b.allow() {
		t.Fatalf("after %d failures in a row: open %v, allows %v; want open, refusing", BreakerThreshold, b.isOpen(), b.allow())
	}
	b.openUntil.Store(time.Now().Add(-time.Millisecond).UnixNano()) // the cooldown is over
	if !b.allow() || b.allow() {
		t.Fatal("after the cooldown one call, and only one, probes")
	}
	if !b.success() || b.isOpen() || b.failures.Load() != 0 {
		t.Fatalf("a probe answered: open %v, %d failures; want closed, none", b.isOpen(), b.failures.Load())
	}
}

// TestExpiredCallIsAnsweredUnsentAndCountsAgainstNoBreaker: a call whose
// deadline passed while it waited fails as this instance's overload.
func TestExpiredCallIsAnsweredUnsentAndCountsAgainstNoBreaker(t *testing.T) {
	b := NewStalled(Config{Node: "n", Timeout: 100 * time.Millisecond}, 0)
	c := NewCall()
	c.Keys = append(c.Keys, "k")
	c.Deadline, c.ClientCtx = time.Now().Add(-time.Millisecond), context.Background()
	b.SendBatch([]*Call{c})
	if c.Err != ErrExpiredInQueue || c.sent.Load() {
		t.Fatalf("err %v, sent %v; want %v, unsent", c.Err, c.sent.Load(), ErrExpiredInQueue)
	}
	if _, _, known := b.BreakerState("n"); known {
		t.Fatal("an expired call reached the node's breaker")
	}
}
