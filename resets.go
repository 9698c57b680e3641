package ratelimit

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

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The reset channel: each limiter subscribes to <key_prefix>reset, on
// which the admin API of any instance sharing the Redis publishes the
// keys of the buckets it reset (limiter.reset), and drops its handlers'
// cached denials of them. Anyone who can PUBLISH reaches every instance
// through it, so what arrives is judged before any work is done for it,
// and the work never holds up requests.
const (
	// maxResetMessage bounds a reset message. One names one client's
	// buckets, a few keys; a longer one is dropped unread as it arrives,
	// never held in memory.
	maxResetMessage = 8 << 10
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

// resetSubscription is the limiter's current subscription to the reset
// channel, closed with the limiter.
type resetSubscription struct {
	mu     sync.Mutex
	pubsub *redis.PubSub
	closed bool
	// tooLarge counts the messages dropped for their size, lastSize is
	// the latest one's; foreign counts the keys ignored for their prefix.
	tooLarge, lastSize, foreign atomic.Int64
	warns                       logThrottle
}

// open starts a new subscription, none once the limiter closed.
func (s *resetSubscription) open(ctx context.Context, client redis.UniversalClient) *redis.PubSub {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.pubsub = client.Subscribe(ctx)
	return s.pubsub
}

// close ends the subscription for good.
func (s *resetSubscription) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.pubsub != nil {
		_ = s.pubsub.Close()
	}
}

// resetsLogger is the handlers' logger, taken when a line is written:
// the limiter outlives the config whose logs it would otherwise keep.
func resetsLogger() *zap.Logger { return caddy.Log().Named("http.handlers.rate_limit") }

// resetsDial marks the context of the subscription's calls, whose dials
// get a connection that drops oversized messages (resetsConn).
type resetsDial struct{}

// listenResets keeps the limiter subscribed to the reset channel until
// it closes. Each time the subscription is established again, whether
// go-redis dialed again after an error or a dead connection was replaced,
// every cached denial is dropped: a reset may have been published in
// between. The first subscription drops nothing: the caches hold only
// what the moments since the limiter started put there.
func (l *limiter) listenResets() {
	ctx := context.WithValue(context.Background(), resetsDial{}, true)
	subscribed := false
	for {
		ps := l.resetSub.open(ctx, l.client)
		if ps == nil {
			return
		}
		dead := l.receiveResets(ctx, ps, &subscribed)
		_ = ps.Close()
		if !dead {
			select {
			case <-l.batcher.Done():
				return
			case <-time.After(resetsRetry):
			}
		}
	}
}

// receiveResets handles the messages of one subscription until it is
// closed (false) or its connection has stopped answering (true).
// subscribed says whether the limiter was subscribed before.
func (l *limiter) receiveResets(ctx context.Context, ps *redis.PubSub, subscribed *bool) (dead bool) {
	_ = ps.Subscribe(ctx, l.resets) // on failure, the next receive dials and subscribes again
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
			case <-l.batcher.Done():
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
			if *subscribed {
				for _, w := range l.watcherList() {
					w.forgetAllDenials()
				}
			}
			*subscribed = true
		case *redis.Message:
			l.applyReset(m.Payload)
		}
	}
}

// applyReset drops the cached denials of the keys a reset message names,
// one per line. Keys without this limiter's key prefix name no bucket of
// its handlers and are ignored; so is a message over maxResetMessage.
// No lock is held across the message: the watchers are copied first, and
// each key is dropped on its own.
func (l *limiter) applyReset(payload string) {
	if payload == oversizedReset || len(payload) > maxResetMessage {
		if ok, suppressed := l.resetSub.warns.allow(); ok {
			resetsLogger().Warn("ignored a message on the reset channel: larger than a reset of one client's buckets",
				zap.String("channel", l.resets), zap.Int64("bytes", l.resetSub.lastSize.Load()),
				zap.Int("max_bytes", maxResetMessage), zap.Int64("ignored_total", l.resetSub.tooLarge.Load()),
				suppressedField(suppressed))
		}
		return
	}
	var keys []string
	foreign := 0
	for rest := payload; rest != ""; {
		var key string
		key, rest, _ = strings.Cut(rest, "\n")
		if strings.HasPrefix(key, l.keyPrefix) {
			keys = append(keys, key)
		} else {
			foreign++
		}
	}
	if foreign > 0 {
		l.resetSub.foreign.Add(int64(foreign))
		if ok, suppressed := l.resetSub.warns.allow(); ok {
			resetsLogger().Warn("ignored keys on the reset channel without this instance's key_prefix",
				zap.String("channel", l.resets), zap.Int("keys", foreign), zap.String("key_prefix", l.keyPrefix),
				suppressedField(suppressed))
		}
	}
	if len(keys) == 0 {
		return
	}
	for _, w := range l.watcherList() {
		w.forgetDenials(keys)
	}
}

// filterResetsConns gives the subscription's connections, and only
// them, a resetsConn: go-redis would read a message of any size whole
// into memory (24 MiB of newlines took 424 MiB and stalled requests for
// 0.6 s before messages were bounded). Dials of the limiter's other
// connections pass through unchanged, and its commands meet no hook.
func (l *limiter) filterResetsConns() {
	hook := resetsHook{l}
	if l.cluster != nil {
		l.cluster.OnNewNode(func(node *redis.Client) { node.AddHook(hook) })
		return
	}
	l.client.AddHook(hook)
}

type resetsHook struct{ l *limiter }

func (h resetsHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := next(ctx, network, addr)
		if err != nil || ctx.Value(resetsDial{}) == nil {
			return conn, err
		}
		return &resetsConn{Conn: conn, sub: &h.l.resetSub}, nil
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
// maxResetMessage is replaced by oversizedBulk, and its bytes are read
// and dropped as they come. RESP marks every value by its first byte:
// bulk strings ($, and RESP3's = and !) give their length on a header
// line and then that many bytes and CRLF; every other value is one line
// (aggregates announce their elements, which follow as values).
type resetsConn struct {
	net.Conn
	sub *resetSubscription

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
	case size <= maxResetMessage:
		c.pending, c.state, c.left = line, passing, size+2
	default:
		c.pending, c.state, c.left = oversizedBulk, dropping, size+2
		c.sub.tooLarge.Add(1)
		c.sub.lastSize.Store(int64(size))
	}
	return nil
}
