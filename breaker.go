package ratelimit

import (
	"sync"
	"sync/atomic"
	"time"
)

// Circuit breaker settings: after breakerThreshold failures in a row of
// one Redis node, calls to that node skip Redis (and follow on_error at
// once) for breakerCooldown, after which one call probes it again.
const (
	breakerThreshold = 5
	breakerCooldown  = 500 * time.Millisecond
)

// breaker keeps a failing Redis node from costing every request its
// timeout. The closed path is one atomic load. It only counts: whoever
// reports a success or a failure learns whether that closed or opened it.
type breaker struct {
	node     string // the master's address, for logs
	failures atomic.Int64
	// openUntil is when the next probe may go, in Unix nanoseconds;
	// zero while closed.
	openUntil atomic.Int64
}

// allow says whether a call may go to the node. While open, the first
// call after each cooldown is let through as the probe.
func (b *breaker) allow() bool {
	until := b.openUntil.Load()
	if until == 0 {
		return true
	}
	now := time.Now().UnixNano()
	return now >= until && b.openUntil.CompareAndSwap(until, now+int64(breakerCooldown))
}

// success records an answer from the node; closed says it closed the
// breaker.
func (b *breaker) success() (closed bool) {
	if b.failures.Load() != 0 {
		b.failures.Store(0)
	}
	return b.openUntil.Load() != 0 && b.openUntil.Swap(0) != 0
}

// failure records a failure of the node; opened says it opened the
// breaker, after failures in a row.
func (b *breaker) failure() (opened bool, failures int64) {
	n := b.failures.Add(1)
	if n < breakerThreshold || b.openUntil.Load() != 0 {
		return false, n
	}
	return b.openUntil.CompareAndSwap(0, time.Now().Add(breakerCooldown).UnixNano()), n
}

func (b *breaker) isOpen() bool { return b.openUntil.Load() != 0 }

// unknownSlots names the breaker of a Cluster whose slot map could not be
// loaded: no call can be routed to a node then.
const unknownSlots = "cluster (slot map unknown)"

// nodeBreakers holds one breaker per Redis master: a dead Cluster master
// fails its own keys fast while the other masters' keys are limited as
// usual. Standalone and Sentinel have one.
type nodeBreakers struct {
	mu     sync.RWMutex
	byNode map[string]*breaker
	open   atomic.Int64 // breakers open now
}

// get returns the breaker of node, made on first use. Nodes are the
// masters a client has seen, so the map stays small.
func (n *nodeBreakers) get(node string) *breaker {
	n.mu.RLock()
	b := n.byNode[node]
	n.mu.RUnlock()
	if b != nil {
		return b
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if b = n.byNode[node]; b == nil {
		if n.byNode == nil {
			n.byNode = make(map[string]*breaker)
		}
		b = &breaker{node: node}
		n.byNode[node] = b
	}
	return b
}
