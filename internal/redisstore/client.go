// package redisstore keeps buckets in Redis: the Redis client that every
// handler with the same settings shares (Client), the store over it
// (Store: take, settle, hold, peek, reset), Cluster hash-slot groups, the
// slots that requests hold while served, the reset channel, and the
// scripts. What it has to tell its handler goes through a Reporter and a
// Watcher, which the handler implements.
package redisstore

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redisresets"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The scripts: check-and-take, give back, settle, the admin API's read,
// and the concurrent limits' slots. A strategy with a script of its own
// registers it (RegisterScript).
var (
	//go:embed script.lua
	scriptSource string
	//go:embed giveback.lua
	giveBackSource string
	//go:embed peek.lua
	peekSource string
	//go:embed settle.lua
	settleSource string
	//go:embed concurrent.lua
	concurrentSource string

	takeScript     = redisbatch.NewScript(scriptSource)
	giveBackScript = redisbatch.NewScript(giveBackSource)
	settleScript   = redisbatch.NewScript(settleSource)
	scriptSHA      = takeScript.SHA()
)

// concurrentScript takes, renews and releases the slots of concurrent
// limits.
var concurrentScript = RegisterScript(concurrentSource)

// scriptSources are the scripts loadScript loads: the client's, then
// those registered.
var scriptSources = []string{scriptSource, giveBackSource, settleSource}

// RegisterScript adds a script to those loaded ahead of the first
// request (from a package-level var of its file), and returns it.
func RegisterScript(source string) *redisbatch.Script {
	scriptSources = append(scriptSources, source)
	return redisbatch.NewScript(source)
}

func init() {
	redis.SetLogger(redisLogger{})
}

// redisLogger sends go-redis's own messages (failed dials, pool
// trouble) to Caddy's log at debug level: during an outage they would
// otherwise flood stderr, and the handler already warns, throttled.
type redisLogger struct{}

func (redisLogger) Printf(_ context.Context, format string, v ...any) {
	if ce := caddy.Log().Named("rate_limit.redis").Check(zap.DebugLevel, "go-redis"); ce != nil {
		ce.Write(zap.String("message", fmt.Sprintf(format, v...)))
	}
}

// Client is one Redis client with its batcher, shared by every
// handler with the same Redis settings, also across config reloads.
type Client struct {
	client  redis.UniversalClient
	cluster *redis.ClusterClient // the same client, when it is a Cluster's
	timeout time.Duration
	batcher *redisbatch.Batcher
	// watchers are the handlers using the client, told when a node's
	// breaker opens or closes, and when buckets were reset.
	watchersMu sync.Mutex
	watchers   map[Watcher]struct{}
	// resets is the pub/sub channel on which every instance that shares
	// the Redis learns of buckets the admin API reset (resets.go).
	resets    *redisresets.Channel
	keyPrefix string

	// parts are what parts of the package keep in the client
	// (registerClientPart), in their order.
	parts []clientPart

	// noEvalRO: the server answered that it knows no EVAL_RO (Redis
	// before 7), so the admin API's reads use EVAL of the same script.
	noEvalRO atomic.Bool
}

// A clientPart is what a part of the package keeps in each client
// (registerClientPart): calls it queues apart from the requests' own,
// which the batcher takes into each batch (batchHooks), and what keeps
// the client open (Destruct).
type clientPart interface {
	// firstCalls and lastCalls append its queued calls to a batch,
	// before and after the batch's own; more says some are left.
	firstCalls(l *Client, now time.Time, batch []*redisbatch.Call) (_ []*redisbatch.Call, more bool)
	lastCalls(l *Client, now time.Time, batch []*redisbatch.Call) (_ []*redisbatch.Call, more bool)
	// inUse says whether requests still need the client, however long
	// they run; queued whether calls wait to be sent. The client closes
	// once neither is so and it is idle: inUse asked first, queued last.
	inUse() bool
	queued() bool
}

// clientParts make the parts each new client gets. A part's script
// registers itself (RegisterScript).
var clientParts []func() clientPart

// registerClientPart adds a part to every client made from now on
// (from its file's init), and is its index in Client.parts.
func registerClientPart(newPart func() clientPart) int {
	clientParts = append(clientParts, newPart)
	return len(clientParts) - 1
}

// Watcher learns when a node's breaker opens or closes, or is dropped
// with its node, and which buckets were reset (to drop their cached
// denials), or that resets may have been missed (to drop them all).
type Watcher interface {
	BreakerChanged(node string, open bool, failures int64)
	BreakerDropped(node string)
	ForgetDenials(keys []string)
	ForgetAllDenials()
}

// clients holds the clients in use, keyed by their settings (Acquire).
var clients = caddy.NewUsagePool()

// Options are a client's settings: its go-redis options, the timeout of
// a call, the dial timeout (how long the scripts' head start may take),
// and the prefix of every key (the reset channel's name starts with it).
type Options struct {
	Redis       *redis.UniversalOptions
	Timeout     time.Duration
	DialTimeout time.Duration
	KeyPrefix   string
}

// Acquire returns the shared client of the settings that key stands
// for, made with the options that options gives when there is none yet;
// Release takes the same key.
func Acquire(key string, options func() (Options, error)) (*Client, error) {
	v, _, err := clients.LoadOrNew(key, func() (caddy.Destructor, error) {
		o, err := options()
		if err != nil {
			return nil, err
		}
		return New(o), nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*Client), nil
}

// Release gives back what Acquire handed out; the last release closes
// the client once it is idle (see Destruct).
func Release(key string) error {
	_, err := clients.Delete(key)
	return err
}

// New is a client of its own, not shared (Acquire shares them): it
// dials lazily, and loads the scripts in the background.
func New(o Options) *Client {
	opts := o.Redis
	l := &Client{
		client:    redis.NewUniversalClient(opts),
		timeout:   o.Timeout,
		watchers:  make(map[Watcher]struct{}),
		keyPrefix: o.KeyPrefix,
	}
	l.cluster, _ = l.client.(*redis.ClusterClient)
	for _, p := range clientParts {
		l.parts = append(l.parts, p())
	}
	l.resets = redisresets.New(l.client, o.KeyPrefix+"reset", o.KeyPrefix, newResetReceiver(l)) // before the first dial
	l.listenForGrants(o.KeyPrefix)
	node := opts.Addrs[0]
	if opts.MasterName != "" {
		node = "master " + opts.MasterName
	}
	l.batcher = redisbatch.New(redisbatch.Config{Client: l.client, Node: node, Timeout: l.timeout,
		Hooks: batchHooks{l}, Settlements: Settlements})
	go l.loadScript(o.DialTimeout + l.timeout)
	go l.resets.Listen(l.batcher.Done())
	return l
}

// Watch tells w of breaker changes and resets from now on.
func (l *Client) Watch(w Watcher) {
	l.watchersMu.Lock()
	l.watchers[w] = struct{}{}
	l.watchersMu.Unlock()
}

// Unwatch stops telling w.
func (l *Client) Unwatch(w Watcher) {
	l.watchersMu.Lock()
	delete(l.watchers, w)
	l.watchersMu.Unlock()
}

// watcherList is a copy of the watchers, to tell them something without
// holding watchersMu meanwhile.
func (l *Client) watcherList() []Watcher {
	l.watchersMu.Lock()
	defer l.watchersMu.Unlock()
	list := make([]Watcher, 0, len(l.watchers))
	for w := range l.watchers {
		list = append(list, w)
	}
	return list
}

// batchHooks is what the client gives its batcher: the calls its parts
// queued, and the watchers to tell of breaker changes. Its methods run
// in a batch worker, never on a request's path.
type batchHooks struct{ l *Client }

// FirstCalls: the parts' calls that go ahead of the batch's own.
func (h batchHooks) FirstCalls(now time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	return h.partsCalls(clientPart.firstCalls, now, batch)
}

// LastCalls: the parts' calls that go after the batch's own.
func (h batchHooks) LastCalls(now time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	return h.partsCalls(clientPart.lastCalls, now, batch)
}

// partsCalls appends each part's calls (firstCalls or lastCalls) to
// batch, and says whether some part has more left.
func (h batchHooks) partsCalls(calls func(clientPart, *Client, time.Time, []*redisbatch.Call) ([]*redisbatch.Call, bool),
	now time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	more := false
	for _, p := range h.l.parts {
		var left bool
		batch, left = calls(p, h.l, now, batch)
		more = more || left
	}
	return batch, more
}

func (h batchHooks) BreakerChanged(node string, open bool, failures int64) {
	for _, w := range h.l.watcherList() {
		w.BreakerChanged(node, open, failures)
	}
}

func (h batchHooks) BreakerDropped(node string) {
	for _, w := range h.l.watcherList() {
		w.BreakerDropped(node)
	}
}

// OpenBreakers is how many of the client's node breakers are open.
func (l *Client) OpenBreakers() int64 { return l.batcher.OpenBreakers() }

// loadScript loads the script ahead of the first request (on every
// master of a cluster), so that request needs no second round trip. It
// is only a head start: a failure here is retried by requests.
func (l *Client) loadScript(within time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	for _, source := range scriptSources {
		_ = l.client.ScriptLoad(ctx, source).Err()
	}
}

// LingerIdle is how long a released client must go without calls before
// it closes. Caddy cleans up an old config while its servers still finish
// requests; those keep being limited rather than failing.
const LingerIdle = time.Second

// Destruct closes the client once its last requests are done: when no
// part has them in use (clientPart.inUse) nor calls queued, and no call
// has come for LingerIdle. It returns at once.
func (l *Client) Destruct() error {
	go func() {
		tick := time.NewTicker(LingerIdle / 4)
		defer tick.Stop()
		for range tick.C {
			// In use first: what leaves it queues its calls, which the
			// queued checks then see.
			if !l.partsInUse() && l.batcher.Idle(LingerIdle) && !l.partsQueued() {
				break
			}
		}
		l.batcher.Close()
		l.resets.Close()
		_ = l.client.Close()
	}()
	return nil
}

func (l *Client) partsInUse() bool {
	return slices.ContainsFunc(l.parts, clientPart.inUse)
}

func (l *Client) partsQueued() bool {
	return slices.ContainsFunc(l.parts, clientPart.queued)
}

// Take checks and takes every bucket's requested tokens, all or none,
// and fills in each bucket's answer. The answer comes within the timeout
// from now. A call whose client has left (clientCtx done) by the time its
// batch goes out is not sent, so it takes no tokens.
func (l *Client) Take(clientCtx context.Context, now time.Time, buckets []limit.Bucket) (allowed bool, err error) {
	c, err := l.call(clientCtx, now, takeScript, buckets)
	if err == nil {
		allowed, err = ReadTake(c.Reply, buckets, false)
	}
	if c != nil {
		c.Release()
	}
	return allowed, err
}

// giveBack returns each bucket's requested tokens, which the request took
// before a later group of its buckets refused.
func (l *Client) giveBack(clientCtx context.Context, now time.Time, buckets []limit.Bucket) error {
	c, err := l.call(clientCtx, now, giveBackScript, buckets)
	if c != nil {
		c.Release()
	}
	return err
}

// call runs a script over the buckets (their keys and arguments) through
// the batcher and returns the answered call, for the caller to read and
// release; nil when the timeout ran out first (the worker releases it
// then).
func (l *Client) call(clientCtx context.Context, now time.Time, script *redisbatch.Script, buckets []limit.Bucket) (*redisbatch.Call, error) {
	c := redisbatch.NewCall()
	for i := range buckets {
		c.Keys = append(c.Keys, buckets[i].Key)
	}
	c.Command(script)
	for i := range buckets {
		c.Args = buckets[i].Kind().AppendArgs(c.Args, buckets[i])
	}
	return l.batcher.Send(clientCtx, now, c)
}

// peek reads buckets without changing them, with a read-only script
// (EVAL_RO; EVAL of the same script on Redis 6.2, which has no EVAL_RO),
// one bucket per call: on a Cluster they may live on different masters.
func (l *Client) peek(ctx context.Context, buckets []limit.Bucket) ([]limit.View, error) {
	views := make([]limit.View, len(buckets))
	for i := range buckets {
		reply, err := l.peekOne(ctx, buckets[i])
		if err != nil {
			return nil, err
		}
		if len(reply) != 4 {
			return nil, fmt.Errorf("unexpected peek reply %v", reply)
		}
		text, _ := reply[0].(string)
		wait, ok1 := reply[1].(int64)
		pttl, ok2 := reply[2].(int64)
		lent, ok3 := reply[3].(int64)
		tokens, err := strconv.ParseFloat(text, 64)
		if err != nil || !ok1 || !ok2 || !ok3 {
			return nil, fmt.Errorf("unexpected peek reply %v", reply)
		}
		views[i] = limit.View{Tokens: tokens, Wait: time.Duration(wait) * time.Microsecond, Lent: lent}
		if pttl > 0 {
			views[i].ExpiresIn = time.Duration(pttl) * time.Millisecond
		}
	}
	return views, nil
}

// peekOne runs peek.lua on one bucket: with EVAL_RO until the server
// says it has no such command, then with EVAL, which runs the script (it
// writes nothing) as well.
func (l *Client) peekOne(ctx context.Context, b limit.Bucket) ([]any, error) {
	keys, args := []string{b.Key}, b.Kind().AppendArgs(nil, b)
	if !l.noEvalRO.Load() {
		reply, err := l.client.EvalRO(ctx, peekSource, keys, args...).Slice()
		if err == nil || !isUnknownCommand(err) {
			return reply, err
		}
		l.noEvalRO.Store(true)
	}
	return l.client.Eval(ctx, peekSource, keys, args...).Slice()
}

// isUnknownCommand says whether Redis refused a command it does not
// know: "ERR unknown command 'EVAL_RO', with args beginning with: ...".
func isUnknownCommand(err error) bool {
	var reply redis.Error
	return errors.As(err, &reply) && strings.HasPrefix(reply.Error(), "ERR unknown command")
}

// Reset deletes buckets, which makes them full, and tells every
// instance sharing the Redis to drop its cached denials of them.
func (l *Client) Reset(ctx context.Context, keys []string) error {
	pipe := l.client.Pipeline()
	for _, key := range keys {
		pipe.Del(ctx, key)
	}
	pipe.Publish(ctx, l.resets.Name(), strings.Join(keys, "\n"))
	_, err := pipe.Exec(ctx)
	return err
}

// MaxRetryMicros bounds the wait a reply may give: no bucket takes longer
// than a year to fill (limitValues.check), nor to pay back its debt
// (maxDebtFor); no calendar period is longer than longestPeriod, and the
// script counts at most to the end of the period after Caddy's.
const MaxRetryMicros = max(2*cost.MaxFillSeconds*1_000_000, 2*int64(longestPeriod/time.Microsecond))

// longestPeriod is the longest calendar period a kind counts in
// (internal/calendar's MaxPeriod, which a store may not import; the
// root's tests check that both agree).
const longestPeriod = 3650 * 24 * time.Hour

// ReadTake reads the check-and-take reply, {allowed, then per bucket:
// remaining, microseconds until it holds its requested tokens; from a
// layer's script (layerWords), then a count per bucket, at least 0,
// which the layer reads from the reply itself; then each kind's
// replyWords (a calendar period counted in); then, when some bucket
// waits (limit.Bucket.Waits: its arguments were the waiting form), per
// bucket the microseconds the request waits for it}, into the buckets. A
// kind's words that decide nothing are its kindError (readReply).
// Anything else is no answer at all: never read as a denial.
func ReadTake(reply []int64, buckets []limit.Bucket, layerWords bool) (allowed bool, err error) {
	n := len(buckets)
	want := 1 + 2*n
	if layerWords {
		want += n
	}
	kindWords := want
	waits := false
	for i := range buckets {
		want += buckets[i].Kind().ReplyWords()
		waits = waits || buckets[i].Waits()
	}
	waitWords := want
	if waits {
		want += n
	}
	if len(reply) != want || reply[0]>>1 != 0 {
		return false, fmt.Errorf("unexpected script reply %v", reply)
	}
	for i := range buckets {
		k := buckets[i].Kind()
		if words := k.ReplyWords(); words > 0 {
			if buckets[i], err = k.ReadReply(buckets[i], reply, kindWords); err != nil {
				return false, err
			}
			kindWords += words
		}
	}
	for i := 0; layerWords && i < n; i++ {
		if reply[1+2*n+i] < 0 {
			return false, fmt.Errorf("unexpected script reply %v", reply)
		}
	}
	for i := range buckets {
		remaining, wait := reply[1+2*i], reply[2+2*i]
		if remaining < 0 || wait < 0 || wait > MaxRetryMicros {
			return false, fmt.Errorf("unexpected script reply %v", reply)
		}
		var goWait int64
		if waits {
			// Never more than the max wait; and no wait, of a bucket that
			// does not wait or of a refused request.
			goWait = reply[waitWords+i]
			if goWait < 0 || goWait > MaxRetryMicros || goWait > 0 && (reply[0] != 1 || !buckets[i].Waits()) {
				return false, fmt.Errorf("unexpected script reply %v", reply)
			}
		}
		buckets[i].Remaining, buckets[i].RetryAfter = remaining, time.Duration(wait)*time.Microsecond
		buckets[i].Wait = time.Duration(goWait) * time.Microsecond
	}
	return reply[0] == 1, nil
}

// Batcher is the client's batcher, for a strategy that sends calls of
// its own (leases).
func (l *Client) Batcher() *redisbatch.Batcher { return l.batcher }

// Timeout is how long a call may take, from when it is sent.
func (l *Client) Timeout() time.Duration { return l.timeout }

// IsCluster says whether the client is a Redis Cluster's.
func (l *Client) IsCluster() bool { return l.cluster != nil }

// AnnounceReset tells every instance sharing the Redis that the bucket at
// key was reset, so that each drops its cached denials of it.
func (l *Client) AnnounceReset(ctx context.Context, key string) error {
	return l.client.Publish(ctx, l.resets.Name(), key).Err()
}
