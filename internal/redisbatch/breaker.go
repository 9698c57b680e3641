package redisbatch

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Circuit breaker settings: after BreakerThreshold failures in a row of
// one Redis node (a failed batch is one failure, however many calls it
// held), calls to that node skip Redis (and follow on_error at once) for
// BreakerCooldown, after which one call probes it again.
const (
	BreakerThreshold = 5
	BreakerCooldown  = 500 * time.Millisecond
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
	// counted says the breaker is counted open in nodeBreakers.open;
	// guarded by nodeBreakers.mu.
	counted bool
}

// allow says whether a call may go to the node. While open, the first
// call after each cooldown is let through as the probe.
func (b *breaker) allow() bool {
	until := b.openUntil.Load()
	if until == 0 {
		return true
	}
	now := time.Now().UnixNano()
	return now >= until && b.openUntil.CompareAndSwap(until, now+int64(BreakerCooldown))
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
func (b *breaker) failure() (opened bool) {
	n := b.failures.Add(1)
	if n < BreakerThreshold || b.openUntil.Load() != 0 {
		return false
	}
	return b.openUntil.CompareAndSwap(0, time.Now().Add(BreakerCooldown).UnixNano())
}

func (b *breaker) isOpen() bool { return b.openUntil.Load() != 0 }

// UnknownSlots names the breaker of a Cluster whose slot map could not be
// loaded: no call can be routed to a node then.
const UnknownSlots = "cluster (slot map unknown)"

// nodeBreakers holds one breaker per Redis master: a dead Cluster master
// fails its own keys fast while the other masters' keys are limited as
// usual. Standalone and Sentinel have one. A Cluster's breakers follow
// its topology: a node that no longer serves slots has its breaker
// dropped (see Batcher.pruneBreakers).
type nodeBreakers struct {
	mu     sync.RWMutex
	byNode map[string]*breaker
	open   atomic.Int64 // breakers in byNode counted open; changed under mu
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

// sync counts b as it is now, open or closed, after a success or failure
// changed it; changed says whether that changed the count, and so is
// news to log. A breaker dropped meanwhile (its node left) or already
// counted as it is changes nothing, so that two workers racing to open
// and close it, or a worker and pruning, count it once.
func (n *nodeBreakers) sync(b *breaker) (changed, open bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	open = b.isOpen()
	if n.byNode[b.node] != b || b.counted == open {
		return false, open
	}
	b.counted = open
	if open {
		n.open.Add(1)
	} else {
		n.open.Add(-1)
	}
	return true, open
}

// retain drops the breakers of the nodes that keep refuses, and returns
// the nodes of those that were counted open: they no longer are.
func (n *nodeBreakers) retain(keep func(node string) bool) (closed []string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for node, b := range n.byNode {
		if keep(node) {
			continue
		}
		delete(n.byNode, node)
		if b.counted {
			b.counted = false
			n.open.Add(-1)
			closed = append(closed, node)
		}
	}
	return closed
}

// How often a Cluster's breakers are checked against its masters: every
// second while one is open (so the gauge and the logs follow a failover
// within a moment), every minute otherwise (to forget nodes that left).
const (
	pruneWhileOpen = time.Second
	pruneIdle      = time.Minute
)

// pruneBreakers runs beside a Cluster's batcher until it closes, never on
// a request's path: it drops the breakers of nodes that serve no slots
// any more (a master that failed over to its replica, a node removed),
// and the one of an unknown slot map once the map is known. Otherwise a
// breaker that opened for a dead master would stay open for good, since
// no call goes to that node again: counted by the gauge, never logged as
// closed. Each check asks the cluster for its slot map (CLUSTER SLOTS).
func (b *Batcher) pruneBreakers() {
	tick := time.NewTicker(pruneWhileOpen)
	defer tick.Stop()
	checked := time.Now()
	for {
		select {
		case <-b.stop:
			return
		case <-tick.C:
		}
		if b.breakers.open.Load() == 0 && time.Since(checked) < pruneIdle {
			continue
		}
		checked = time.Now()
		masters, err := b.clusterMasters()
		if err != nil {
			continue // no slot map: keep everything, the UnknownSlots breaker too
		}
		for _, node := range b.breakers.retain(func(node string) bool { return masters[node] }) {
			b.hooks.BreakerDropped(node)
		}
	}
}

// clusterMasters reloads the slot map and returns the masters that serve
// slots in it, by the addresses the client routes to (as nodeBreaker
// names them).
func (b *Batcher) clusterMasters() (map[string]bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var mu sync.Mutex
	masters := make(map[string]bool)
	err := b.cluster.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		masters[c.Options().Addr] = true
		mu.Unlock()
		return nil
	})
	return masters, err
}

// breakerChanged counts a node's breaker opening or closing and tells
// the hooks. It runs in a worker, never on a caller's path.
func (b *Batcher) breakerChanged(br *breaker) {
	changed, open := b.breakers.sync(br)
	if !changed {
		return
	}
	b.hooks.BreakerChanged(br.node, open, br.failures.Load())
}

// OpenBreakers is how many of the node breakers are open.
func (b *Batcher) OpenBreakers() int64 { return b.breakers.open.Load() }

// nodeBreaker returns the breaker of the master that serves key. A
// Cluster client that cannot load its slot map at all has one breaker
// for that; resolved says whether the map was there, so that a batch
// tries to load it once, not once per call.
func (b *Batcher) nodeBreaker(ctx context.Context, key string, resolved *bool) *breaker {
	if b.cluster == nil {
		return b.breakers.get(b.node)
	}
	if *resolved {
		if master, err := b.cluster.MasterForKey(ctx, key); err == nil {
			return b.breakers.get(master.Options().Addr)
		}
		*resolved = false
	}
	return b.breakers.get(UnknownSlots)
}

// reloadSlotsAfter makes a cluster client find a failed-over master
// sooner: go-redis reloads its slot map only on MOVED or once a minute.
func (b *Batcher) reloadSlotsAfter(err error) {
	if b.cluster == nil || !IsNetworkError(err) {
		return
	}
	now := time.Now().UnixNano()
	last := b.lastReload.Load()
	if now-last < int64(250*time.Millisecond) || !b.lastReload.CompareAndSwap(last, now) {
		return
	}
	b.cluster.ReloadState(context.Background())
}

// IsNetworkError says whether err is the network's or a timeout's, or a
// Cluster's that lost a node: one after which the slot map may be stale.
func IsNetworkError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, context.DeadlineExceeded) ||
		redis.HasErrorPrefix(err, "CLUSTERDOWN") || strings.Contains(err.Error(), "connection refused")
}
