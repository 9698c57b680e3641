// package redisresets keeps an instance subscribed to the Redis channel
// on which every instance sharing the Redis learns of the buckets that
// an admin API reset. Anyone who can PUBLISH reaches every instance
// through it, so what arrives is judged before any work is done for it:
// a message over MaxMessage is dropped unread as it arrives, and keys
// without the instance's prefix are ignored.
package redisresets

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// The reset channel: each limiter subscribes to <key_prefix>reset, on
// which the admin API of any instance sharing the Redis publishes the
// keys of the buckets it reset, and drops its handlers' cached denials
// of them; the work never holds up requests.
const (
	// MaxMessage bounds a reset message. One names one client's
	// buckets, a few keys; a longer one is dropped unread as it arrives,
	// never held in memory.
	MaxMessage = 8 << 10
	// resetsPingAfter is how long the subscription may stay silent before
	// it pings; resetsPongWait how long it then waits for any answer
	// before it takes the connection for dead and subscribes anew. A
	// connection can die without a word (a dropped NAT entry, a host that
	// vanished), and resets published meanwhile would be lost unseen.
	resetsPingAfter = time.Second
	resetsPongWait  = 2 * time.Second
	// resetsRetry is the pause before trying again after an error.
	resetsRetry = 500 * time.Millisecond
)

// Receiver is told what the channel brings, in its listening goroutine.
type Receiver interface {
	// Reset names the reset buckets that have the channel's key prefix.
	Reset(keys []string)
	// Missed says that resets may have been missed: the subscription
	// was established again.
	Missed()
	// TooLarge says that a message was dropped for its size: the
	// latest one's bytes, and how many were dropped so far.
	TooLarge(bytes, droppedTotal int64)
	// Foreign says that keys without the key prefix were ignored.
	Foreign(keys int)
}

// Channel is one client's subscription to a reset channel, renewed
// until Close.
type Channel struct {
	client    redis.UniversalClient
	name      string
	keyPrefix string
	receiver  Receiver

	mu     sync.Mutex
	pubsub *redis.PubSub
	closed bool
	// tooLarge counts the messages dropped for their size, lastSize is
	// the latest one's; foreign counts the keys ignored for their prefix.
	tooLarge, lastSize, foreign atomic.Int64

	// also is another channel the subscription listens to (Also), and
	// alsoSubscribed whether it was subscribed before (the listening
	// goroutine's).
	also           *Also
	alsoSubscribed bool
}

// Also is another channel on the same subscription: its messages
// (bounded by MaxMessage as the resets' are) go to Message, unjudged, and
// Missed is told when the subscription was established again, as the
// receiver is. Both run in the listening goroutine.
type Also struct {
	Name    string
	Message func(payload string)
	Missed  func()
}

// Listen on another channel too (call before Listen).
func (c *Channel) ListenAlso(a Also) { c.also = &a }

// New makes the channel name of client, for the buckets of keyPrefix,
// and gives its subscription's connections their filter: call it before
// the client's first dial.
func New(client redis.UniversalClient, name, keyPrefix string, r Receiver) *Channel {
	c := &Channel{client: client, name: name, keyPrefix: keyPrefix, receiver: r}
	c.filterConns()
	return c
}

// Name is the channel's name.
func (c *Channel) Name() string { return c.name }

// open starts a new subscription, none once the channel closed.
func (c *Channel) open(ctx context.Context) *redis.PubSub {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.pubsub = c.client.Subscribe(ctx)
	return c.pubsub
}

// Close ends the subscription for good.
func (c *Channel) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.pubsub != nil {
		_ = c.pubsub.Close()
	}
}

// resetsDial marks the context of the subscription's calls, whose dials
// get a connection that drops oversized messages (resetsConn).
type resetsDial struct{}

// Listen keeps the channel subscribed until Close; stop ends its pauses
// after an error. Each time the subscription is established again, whether
// go-redis dialed again after an error or a dead connection was replaced,
// every cached denial is dropped: a reset may have been published in
// between. The first subscription drops nothing: the caches hold only
// what the moments since the limiter started put there.
func (c *Channel) Listen(stop <-chan struct{}) {
	ctx := context.WithValue(context.Background(), resetsDial{}, true)
	subscribed := false
	for {
		ps := c.open(ctx)
		if ps == nil {
			return
		}
		dead := c.receive(ctx, ps, &subscribed, stop)
		_ = ps.Close()
		if !dead {
			select {
			case <-stop:
				return
			case <-time.After(resetsRetry):
			}
		}
	}
}

// receive handles the messages of one subscription until it is
// closed (false) or its connection has stopped answering (true).
// subscribed says whether the channel was subscribed before.
func (c *Channel) receive(ctx context.Context, ps *redis.PubSub, subscribed *bool, stop <-chan struct{}) (dead bool) {
	names := []string{c.name}
	if c.also != nil {
		names = append(names, c.also.Name)
	}
	_ = ps.Subscribe(ctx, names...) // on failure, the next receive dials and subscribes again
	pinged := false
	for {
		wait := resetsPingAfter
		if pinged {
			wait = resetsPongWait
		}
		msg, err := ps.ReceiveTimeout(ctx, wait)
		var ne net.Error
		switch {
		case errors.Is(err, redis.ErrClosed):
			return false
		case err != nil && errors.As(err, &ne) && ne.Timeout():
			if pinged {
				return true
			}
			pinged = ps.Ping(ctx) == nil
			continue
		case err != nil:
			// A broken connection, or a failed dial: go-redis dials again
			// at the next receive.
			select {
			case <-stop:
				return false
			case <-time.After(resetsRetry):
			}
			pinged = false
			continue
		}
		pinged = false
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind != "subscribe" {
				break
			}
			if c.also != nil && m.Channel == c.also.Name {
				if c.alsoSubscribed {
					c.also.Missed()
				}
				c.alsoSubscribed = true
				break
			}
			if *subscribed {
				c.receiver.Missed()
			}
			*subscribed = true
		case *redis.Message:
			if c.also != nil && m.Channel == c.also.Name {
				if m.Payload != oversizedReset {
					c.also.Message(m.Payload)
				}
				break
			}
			c.apply(m.Payload)
		}
	}
}

// apply tells the receiver of the keys a reset message names, one per
// line. Keys without the channel's key prefix name no bucket of its
// handlers and are ignored; so is a message over MaxMessage.
func (c *Channel) apply(payload string) {
	if payload == oversizedReset || len(payload) > MaxMessage {
		c.receiver.TooLarge(c.lastSize.Load(), c.tooLarge.Load())
		return
	}
	var keys []string
	foreign := 0
	for rest := payload; rest != ""; {
		var key string
		key, rest, _ = strings.Cut(rest, "\n")
		if strings.HasPrefix(key, c.keyPrefix) {
			keys = append(keys, key)
		} else {
			foreign++
		}
	}
	if foreign > 0 {
		c.foreign.Add(int64(foreign))
		c.receiver.Foreign(foreign)
	}
	if len(keys) == 0 {
		return
	}
	c.receiver.Reset(keys)
}

// filterConns gives the subscription's connections, and only
// them, a resetsConn: go-redis would read a message of any size whole
// into memory (24 MiB of newlines took 424 MiB and stalled requests for
// 0.6 s before messages were bounded). Dials of the client's other
// connections pass through unchanged, and its commands meet no hook.
func (c *Channel) filterConns() {
	hook := resetsHook{c}
	if cluster, ok := c.client.(*redis.ClusterClient); ok {
		cluster.OnNewNode(func(node *redis.Client) { node.AddHook(hook) })
		return
	}
	c.client.AddHook(hook)
}

type resetsHook struct{ c *Channel }

func (h resetsHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		if err != nil || ctx.Value(resetsDial{}) == nil {
			return conn, err
		}
		return &resetsConn{Conn: conn, sub: h.c}, nil
	}
}

func (resetsHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (resetsHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// oversizedReset stands in for a message dropped for its size, as the
// bulk string oversizedBulk: a text no reset ever publishes.
const oversizedReset = "\x00oversized reset message"

var oversizedBulk = []byte("$" + strconv.Itoa(len(oversizedReset)) + "\r\n" + oversizedReset + "\r\n")

// resetsConn is a subscription's connection as go-redis reads it: the
// RESP stream passes unchanged, except that a bulk string longer than
// MaxMessage is replaced by oversizedBulk, and its bytes are read
// and dropped as they come. RESP marks every value by its first byte:
// bulk strings ($, and RESP3's = and !) give their length on a header
// line and then that many bytes and CRLF; every other value is one line
// (aggregates announce their elements, which follow as values).
type resetsConn struct {
	net.Conn
	sub *Channel // counts what it drops

	raw  [16 << 10]byte
	r, w int   // raw[r:w] is read and not yet passed on
	err  error // of the last read, returned once raw[r:w] is used up

	state   resetsState
	left    int // bytes of the bulk string being passed or dropped, CRLF included
	head    [32]byte
	nhead   int    // a bulk string's header line so far, in head
	pending []byte // a header to pass on before anything else
}

type resetsState uint8

const (
	atValue  resetsState = iota // at the first byte of a value
	inLine                      // passing a line up to its LF
	inHeader                    // reading a bulk string's header line
	passing                     // passing a bulk string's bytes
	dropping                    // dropping an oversized bulk string's bytes
)

var errResetsProtocol = errors.New("reset channel: a bulk string header that is not one")

func (c *resetsConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for {
		if len(c.pending) > 0 {
			n := copy(p, c.pending)
			c.pending = c.pending[n:]
			return n, nil
		}
		if c.r == c.w {
			if err := c.err; err != nil {
				c.err = nil // a timeout is for this read only; the stream goes on
				return 0, err
			}
			c.r = 0
			c.w, c.err = c.Conn.Read(c.raw[:])
			continue
		}
		if n, err := c.filter(p); n > 0 || err != nil {
			return n, err
		}
	}
}

// filter passes what it can of raw[r:w] into p, and stops early when a
// header is pending.
func (c *resetsConn) filter(p []byte) (n int, err error) {
	for c.r < c.w && n < len(p) && len(c.pending) == 0 {
		in := c.raw[c.r:c.w]
		switch c.state {
		case atValue:
			switch in[0] {
			case '$', '=', '!':
				c.state, c.nhead = inHeader, 0
			default:
				c.state = inLine
			}
		case inLine:
			end := bytes.IndexByte(in, '\n') + 1
			if end == 0 {
				end = len(in)
			}
			k := copy(p[n:], in[:end])
			n, c.r = n+k, c.r+k
			if in[k-1] == '\n' {
				c.state = atValue
			}
		case inHeader:
			if c.nhead == len(c.head) {
				return n, errResetsProtocol
			}
			c.head[c.nhead] = in[0]
			c.nhead++
			c.r++
			if in[0] == '\n' {
				if err := c.endHeader(); err != nil {
					return n, err
				}
			}
		case passing:
			k := copy(p[n:], in[:min(len(in), c.left)])
			n, c.r, c.left = n+k, c.r+k, c.left-k
			if c.left == 0 {
				c.state = atValue
			}
		case dropping:
			k := min(len(in), c.left)
			c.r, c.left = c.r+k, c.left-k
			if c.left == 0 {
				c.state = atValue
			}
		}
	}
	return n, nil
}

// endHeader decides, on a bulk string's complete header line, whether
// its bytes pass or are dropped.
func (c *resetsConn) endHeader() error {
	line := c.head[:c.nhead]
	if len(line) < 4 || line[len(line)-2] != '\r' {
		return errResetsProtocol
	}
	size, err := strconv.Atoi(string(line[1 : len(line)-2]))
	switch {
	case err != nil:
		return errResetsProtocol
	case size < 0: // a null
		c.pending, c.state = line, atValue
	case size <= MaxMessage:
		c.pending, c.state, c.left = line, passing, size+2
	default:
		c.pending, c.state, c.left = oversizedBulk, dropping, size+2
		c.sub.tooLarge.Add(1)
		c.sub.lastSize.Store(int64(size))
	}
	return nil
}
