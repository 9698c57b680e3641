package redisbatch

// One batch on the wire: the margin a call needs to be sent, the round
// trip estimate, the pipeline itself, and its reusable deadline.

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// sendMargin is the least time a call must have left to be sent: what a
// round trip takes now, at least a tenth of the timeout, and at most half
// of it, so that calls with half their time left always go, and keep the
// estimate current when Redis slows down.
func (b *Batcher) sendMargin() time.Duration {
	return max(b.timeout/10, min(b.rtt.estimate(), b.timeout/2))
}

// roundTrips estimates how long a pipeline takes, from sending to the
// last answer, as TCP estimates its round trips (RFC 6298): a moving
// mean and mean deviation of recent ones. Both workers update it without
// a lock; an update lost to the other worker's changes little.
type roundTrips struct {
	mean, dev atomic.Int64 // nanoseconds
}

func (r *roundTrips) add(d time.Duration) {
	sample, mean, dev := int64(d), r.mean.Load(), r.dev.Load()
	if mean == 0 {
		r.mean.Store(sample)
		r.dev.Store(sample / 2)
		return
	}
	diff := sample - mean
	r.mean.Store(mean + diff/8)
	r.dev.Store(dev + (max(diff, -diff)-dev)/4)
}

// estimate is the time within which a pipeline is answered but rarely
// later: the mean plus four deviations, as TCP's retransmission timeout.
func (r *roundTrips) estimate() time.Duration {
	return time.Duration(r.mean.Load() + 4*r.dev.Load())
}

// onceCmd is a script call that go-redis must not send again: its
// Cluster client otherwise re-sends after errors where the script may
// have run already (EOF, a reset connection, a read timeout), and each
// run takes tokens. MOVED and ASK are still followed (the script did not
// run there), and a call whose connection never opened may be dialed
// again. Every script the batcher sends answers an array of integers,
// which an IntSliceCmd reads as they come, where a Cmd boxes each one
// into a []any (BenchmarkServeHTTPAllowed 12 -> 10 allocs). An error
// reply (a key of another type) fails its own call only; a reply of
// another shape, which none of our scripts gives, would also fail the
// calls after it in the pipeline, and go-redis drops that connection
// (TestReplyOfAnotherShapeFailsItsCall).
type onceCmd struct{ *redis.IntSliceCmd }

func (onceCmd) NoRetry() bool { return true }

// pipeline sends the calls in one pipeline (or alone when there is one),
// by SHA or, with source, with the script's source, and stores each
// call's own reply or error.
func (b *Batcher) pipeline(ctx context.Context, batch []*Call, source bool) []*redis.IntSliceCmd {
	cmds := make([]*redis.IntSliceCmd, len(batch))
	for i, c := range batch {
		if source {
			eval := append([]any{"eval", c.Script.Source}, c.Args[2:]...)
			cmds[i] = redis.NewIntSliceCmd(ctx, eval...)
		} else {
			cmds[i] = redis.NewIntSliceCmd(ctx, c.Args...)
		}
	}
	if len(batch) == 1 { // alone: a pipeline of one costs 7 allocs, 144 B more (BenchmarkServeHTTPAllowed 23 -> 16)
		_ = b.client.Process(ctx, onceCmd{cmds[0]})
	} else {
		pipe := b.client.Pipeline()
		for _, cmd := range cmds {
			_ = pipe.Process(ctx, onceCmd{cmd})
		}
		_, _ = pipe.Exec(ctx) // each command carries its own error
	}
	for i, c := range batch {
		if c.Err = cmds[i].Err(); c.Err == nil {
			c.Reply = append(c.Reply, cmds[i].Val()...)
		}
	}
	return cmds
}

// batchTimer gives the batches of one worker a context that ends at the
// batch's deadline, as context.WithDeadline would, but reuses one timer
// and, until a batch times out, one Done channel: a batch then costs one
// allocation instead of five (BenchmarkServeHTTPAllowed 20 -> 16 allocs,
// 1192 -> 840 B). go-redis needs both the deadline (for socket
// deadlines) and Done (to stop waiting for a new connection).
type batchTimer struct {
	timer    *time.Timer
	mu       sync.Mutex
	done     chan struct{} // closed when a batch times out, then replaced
	deadline time.Time     // of the batch in flight; zero between batches
}

func newBatchTimer() *batchTimer {
	t := &batchTimer{done: make(chan struct{})}
	t.timer = time.AfterFunc(time.Hour, t.fire)
	t.timer.Stop()
	return t
}

// fire closes Done if the batch in flight is past its deadline; a late
// firing meant for an earlier batch finds a later deadline and does nothing.
func (t *batchTimer) fire() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.deadline.IsZero() && !time.Now().Before(t.deadline) {
		close(t.done)
		t.done = make(chan struct{})
		t.deadline = time.Time{}
	}
}

func (t *batchTimer) start(deadline time.Time) context.Context {
	t.mu.Lock()
	t.deadline = deadline
	done := t.done
	t.mu.Unlock()
	t.timer.Reset(time.Until(deadline))
	return batchContext{deadline: deadline, done: done}
}

func (t *batchTimer) stop() {
	t.timer.Stop()
	t.mu.Lock()
	t.deadline = time.Time{}
	t.mu.Unlock()
}

// batchContext is the context of one batch; see batchTimer.
type batchContext struct {
	deadline time.Time
	done     <-chan struct{}
}

func (c batchContext) Deadline() (time.Time, bool) { return c.deadline, true }
func (c batchContext) Done() <-chan struct{}       { return c.done }
func (c batchContext) Value(any) any               { return nil }

func (c batchContext) Err() error {
	select {
	case <-c.done:
		return context.DeadlineExceeded
	default:
		return nil
	}
}
