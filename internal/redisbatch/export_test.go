package redisbatch

import (
	"context"
	"time"
)

// The batcher's insides, for the package's tests, which build batches
// by hand and send them to real Redis processes.

// Node is the name of the one node, when the client is not a Cluster's.
func (b *Batcher) Node() string { return b.node }

// Closed says whether Close has begun.
func (b *Batcher) Closed() bool {
	b.closing.RLock()
	defer b.closing.RUnlock()
	return b.closed
}

// BreakerState is what the breaker of node counts now: failures in a
// row, and whether it is open; known says the batcher has one for node.
func (b *Batcher) BreakerState(node string) (failures int64, open, known bool) {
	b.breakers.mu.RLock()
	br := b.breakers.byNode[node]
	b.breakers.mu.RUnlock()
	if br == nil {
		return 0, false, false
	}
	return br.failures.Load(), br.isOpen(), true
}

// SendBatch sends batch at once, in the caller's goroutine, as worker 0
// sends a batch it took; worker 0 must be idle.
func (b *Batcher) SendBatch(batch []*Call) { b.sendBatch(0, batch) }

// Pipeline sends batch in one pipeline, by SHA or with the scripts'
// sources, without breakers, merging or answering the calls.
func (b *Batcher) Pipeline(ctx context.Context, batch []*Call, source bool) {
	b.pipeline(ctx, batch, source)
}

// Merge merges the calls of kind in send, as a batch does before it
// goes (Config.Settlements).
func (b *Batcher) Merge(send []*Call, kind *MergedKind) []*Call { return b.merge(send, kind) }

// NewStalled is a batcher whose workers never run, with room for
// queued calls: with none, every call is refused as when Redis is far
// behind.
func NewStalled(c Config, queued int) *Batcher {
	b := newBatcher(c)
	b.queue = make(chan *Call, queued)
	return b
}

// newTestCall is a call of script over keys with args, due by deadline,
// made as a caller makes one (Command).
func newTestCall(script *Script, keys []string, args []any, deadline time.Time) *Call {
	c := &Call{Keys: keys, Deadline: deadline, ClientCtx: context.Background(), done: make(chan struct{}, 1)}
	c.Command(script)
	c.Args = append(c.Args, args...)
	return c
}
