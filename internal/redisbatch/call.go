// package redisbatch sends Lua script calls to Redis for many concurrent
// callers: the calls that arrive while a pipeline is in flight wait in a
// queue and go out together in the next one, each with its own deadline,
// behind a circuit breaker per Redis master. It knows nothing of what
// the scripts do; the package above it builds the calls and reads their
// replies.
package redisbatch

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Script is a script as the batcher sends it: by its SHA (EVALSHA), and
// by its source only when the server has lost its script cache.
type Script struct {
	Source string
	// sha is boxed once: a string variable turned into a command word
	// costs an allocation per call (16 B; BenchmarkServeHTTPAllowed 17 -> 16).
	sha any
}

// NewScript returns the script of source.
func NewScript(source string) *Script {
	sum := sha1.Sum([]byte(source))
	return &Script{Source: source, sha: hex.EncodeToString(sum[:])}
}

// SHA is the script's SHA1, as EVALSHA names it.
func (s *Script) SHA() string { return s.sha.(string) }

// Call is one script call's trip through the batcher, pooled (NewCall).
// Its caller waits for the answer until the call's own deadline and then
// releases the call; a caller that gives up at its deadline leaves the
// call to the worker, which releases it once done with it. Its slices
// keep their room from use to use.
type Call struct {
	// Args are the command: EVALSHA, the script's SHA, the number of
	// keys, &Keys[i] for each key, then the script's arguments (Command
	// writes all but the last).
	Args      []any
	Keys      []string // boxed as &Keys[i], which costs no allocation
	Script    *Script
	Deadline  time.Time
	ClientCtx context.Context // only asked whether the client left, so the call need not be sent
	Reply     []int64
	Err       error
	// Then, when set, takes the answer instead of the waiting caller, in
	// the worker: for a call nobody waits on.
	Then AnswerTaker

	breaker *breaker      // of the node that serves the keys
	done    chan struct{} // one answer per use
	// state says who owns the call once it is queued: callPending until
	// the worker answers it or its caller gives it up.
	state atomic.Int32
	sent  atomic.Bool // the worker sent it to Redis
	timer *time.Timer // the caller's deadline, kept from use to use
}

const (
	callPending int32 = iota
	callAnswered
	callAbandoned
)

// AnswerTaker takes a call's answer in the worker that got it, quickly,
// and releases the call.
type AnswerTaker interface{ TakeAnswer(*Call) }

var calls = sync.Pool{New: func() any { return &Call{done: make(chan struct{}, 1)} }}

// NewCall returns an empty call from the pool.
func NewCall() *Call { return calls.Get().(*Call) }

// Release clears a call, keeping its room, and puts it back.
func (c *Call) Release() {
	clear(c.Args)
	c.Args, c.Keys, c.Reply = c.Args[:0], c.Keys[:0], c.Reply[:0]
	c.Script, c.ClientCtx, c.breaker, c.Err, c.Then = nil, nil, nil, nil, nil
	c.state.Store(callPending)
	c.sent.Store(false)
	calls.Put(c)
}

// keyCounts are the numbers of keys of a call, boxed once, up to the
// buckets a request keeps inline (BenchmarkServeHTTPAllowed 17 -> 16).
var keyCounts = func() (v [5]any) {
	for i := range v {
		v[i] = strconv.Itoa(i)
	}
	return v
}()

// Command starts the call's arguments: the script by its SHA, and the
// keys, all of which the caller appended to c.Keys; the script's own
// arguments follow.
func (c *Call) Command(script *Script) {
	var n any
	if len(c.Keys) < len(keyCounts) {
		n = keyCounts[len(c.Keys)]
	} else {
		n = strconv.Itoa(len(c.Keys))
	}
	c.Args = append(c.Args, "evalsha", script.sha, n)
	for i := range c.Keys {
		c.Args = append(c.Args, &c.Keys[i]) // a *string costs no allocation; a string would (BenchmarkServeHTTPAllowed 17 -> 16)
	}
	c.Script = script
}

// Answer hands the call back to its caller, or releases it when the
// caller has given it up. The worker must not touch it afterwards.
func (c *Call) Answer() {
	if c.Then != nil {
		c.Then.TakeAnswer(c)
		return
	}
	if c.state.CompareAndSwap(callPending, callAnswered) {
		c.done <- struct{}{}
		return
	}
	c.Release()
}

// Wait waits for the call's answer until its deadline. A call still
// unanswered then is given up: its batch mates may be answered later, but
// its own time is over; sent says whether it had gone to Redis. The
// worker releases a call given up.
func (c *Call) Wait() (answered, sent bool) {
	d := time.Until(c.Deadline)
	if c.timer == nil {
		c.timer = time.NewTimer(d)
	} else {
		c.timer.Reset(d)
	}
	select {
	case <-c.done:
		if !c.timer.Stop() {
			select { // a timer channel of Go before 1.23 may hold the expiry
			case <-c.timer.C:
			default:
			}
		}
		return true, true
	case <-c.timer.C:
		sent = c.sent.Load() // before giving it up, after which it is the worker's
		if c.state.CompareAndSwap(callPending, callAbandoned) {
			return false, sent
		}
		<-c.done // answered just now
		return true, true
	}
}

// OverloadError fails calls that this instance could not send in time.
// They follow on_error like a Redis failure, but no breaker counts them:
// Redis may well be fine.
type OverloadError string

func (e OverloadError) Error() string { return string(e) }

var (
	ErrQueueFull      = OverloadError("too many requests waiting for Redis")
	ErrWaitedOut      = OverloadError("the timeout ran out while the call waited to be sent to Redis")
	ErrExpiredInQueue = OverloadError("too little of the timeout was left, after waiting to be sent, for a round trip to Redis")
)

// ErrBreakerOpen fails calls to a node whose breaker is open.
var ErrBreakerOpen = errors.New("circuit breaker open: this Redis node failed repeatedly")

// ErrNoAnswer fails a call that was sent and not answered within its
// timeout.
var ErrNoAnswer = fmt.Errorf("no answer from Redis within the timeout: %w", context.DeadlineExceeded)

// ErrClosed answers calls that arrive after the batcher closed.
var ErrClosed = errors.New("the Redis client of an unloaded config is closed")
