package ratelimit

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
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

// The scripts: check-and-take, give back, settle, the admin API's read,
// and leases.
var (
	//go:embed script.lua
	scriptSource string
	//go:embed giveback.lua
	giveBackSource string
	//go:embed peek.lua
	peekSource string
	//go:embed settle.lua
	settleSource string
	//go:embed lease.lua
	leaseSource string

	takeScript     = newLuaScript(scriptSource)
	giveBackScript = newLuaScript(giveBackSource)
	settleScript   = newLuaScript(settleSource)
	leaseScript    = newLuaScript(leaseSource)
	scriptSHA      = takeScript.sha.(string)
)

// luaScript is a script as the batcher sends it: by its SHA (EVALSHA),
// and by its source only when the server has lost its script cache.
type luaScript struct {
	source string
	// sha is boxed once: a string variable turned into a command word
	// costs an allocation per call (16 B; BenchmarkServeHTTPAllowed 17 -> 16).
	sha any
}

func newLuaScript(source string) *luaScript {
	sum := sha1.Sum([]byte(source))
	return &luaScript{source: source, sha: hex.EncodeToString(sum[:])}
}

// keyCounts are the numbers of keys of a call, boxed once
// (BenchmarkServeHTTPAllowed 17 -> 16).
var keyCounts = func() (v [maxInlineBuckets + 1]any) {
	for i := range v {
		v[i] = strconv.Itoa(i)
	}
	return v
}()

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

// limiter is one Redis client with its batcher (batch.go), shared by
// every handler with the same Redis settings, also across config
// reloads.
type limiter struct {
	client  redis.UniversalClient
	cluster *redis.ClusterClient // the same client, when it is a Cluster's
	node    string               // the one node's name, when not a Cluster
	timeout time.Duration
	queue   chan *call
	stop    chan struct{}
	workers sync.WaitGroup
	timers  [pipelinesInFlight]*batchTimer // one per worker
	order   batchOrder                     // keeps settlements ahead of the calls queued after them

	breakers nodeBreakers
	// rtt estimates how long a pipeline takes now (batch.go).
	rtt roundTrips
	// outcomes is each worker's room for what a batch's nodes answered.
	outcomes [pipelinesInFlight][]nodeOutcome
	// watchers are the handlers using the limiter, told when a node's
	// breaker opens or closes, and when buckets were reset.
	watchersMu sync.Mutex
	watchers   map[limiterWatcher]struct{}
	// resets is the pub/sub channel on which every instance that shares
	// the Redis learns of buckets the admin API reset (resets.go).
	resets    string
	keyPrefix string
	resetSub  resetSubscription

	// closing guards closed: once set, no call enters the queue, so every
	// queued call is answered before the workers stop.
	closing sync.RWMutex
	closed  bool
	// lastCall is when the latest call was queued, in Unix nanoseconds.
	lastCall atomic.Int64

	// lastReload throttles cluster slot reloads after network errors.
	lastReload atomic.Int64

	// releases counts the releases of concurrent limits' slots on their
	// way to Redis; releaseQueue and renewQueue hold the releases and
	// renewals not sent yet, and wake tells a worker of them
	// (concurrent.go).
	releases     pendingReleases
	releaseQueue slotQueue
	renewQueue   slotQueue
	wake         chan struct{}
	// renewals renew the slots of requests in flight (concurrent.go).
	renewals slotRenewals

	// noEvalRO: the server answered that it knows no EVAL_RO (Redis
	// before 7), so the admin API's reads use EVAL of the same script.
	noEvalRO atomic.Bool
}

// limiterWatcher learns when a node's breaker opens or closes, or is
// dropped with its node, and which buckets were reset (to drop their
// cached denials), or that resets may have been missed (to drop them all).
type limiterWatcher interface {
	breakerChanged(node string, open bool, failures int64)
	breakerDropped(node string)
	forgetDenials(keys []string)
	forgetAllDenials()
}

// limiters holds the limiters in use, keyed by their Redis settings and
// the contents of their TLS files.
var limiters = caddy.NewUsagePool()

// acquireLimiter returns the shared limiter for the configuration and
// the key that releaseLimiter takes. The TLS files are read on every
// call, so a config load after rotating them gets a new client.
func acquireLimiter(c RedisConfig) (*limiter, string, error) {
	files, err := c.TLS.readFiles()
	if err != nil {
		return nil, "", err
	}
	raw, err := json.Marshal(c)
	if err != nil {
		return nil, "", err
	}
	key := string(raw) + files.digest()
	v, _, err := limiters.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newLimiter(c, files)
	})
	if err != nil {
		return nil, "", err
	}
	return v.(*limiter), key, nil
}

// releaseLimiter gives back what acquireLimiter handed out; the last
// release closes the limiter once it is idle (see Destruct).
func releaseLimiter(key string) error {
	_, err := limiters.Delete(key)
	return err
}

func newLimiter(c RedisConfig, files tlsFiles) (*limiter, error) {
	opts, err := c.options(files)
	if err != nil {
		return nil, err
	}
	l := &limiter{
		client:    redis.NewUniversalClient(opts),
		timeout:   time.Duration(c.Timeout),
		queue:     make(chan *call, queueLength),
		stop:      make(chan struct{}),
		wake:      make(chan struct{}, 1),
		watchers:  make(map[limiterWatcher]struct{}),
		resets:    c.KeyPrefix + "reset",
		keyPrefix: c.KeyPrefix,
	}
	l.cluster, _ = l.client.(*redis.ClusterClient)
	l.resetSub.warns.every = 10 * time.Second
	l.filterResetsConns() // before the first dial
	l.node = opts.Addrs[0]
	if opts.MasterName != "" {
		l.node = "master " + opts.MasterName
	}
	for i := range pipelinesInFlight {
		l.timers[i] = newBatchTimer()
		l.workers.Add(1)
		go l.work(i)
	}
	go l.loadScript(time.Duration(c.DialTimeout) + l.timeout)
	go l.listenResets()
	if l.cluster != nil {
		go l.pruneBreakers()
	}
	return l, nil
}

// watch tells w of breaker changes from now on; unwatch stops it.
func (l *limiter) watch(w limiterWatcher) {
	l.watchersMu.Lock()
	l.watchers[w] = struct{}{}
	l.watchersMu.Unlock()
}

func (l *limiter) unwatch(w limiterWatcher) {
	l.watchersMu.Lock()
	delete(l.watchers, w)
	l.watchersMu.Unlock()
}

// watcherList is a copy of the watchers, to tell them something without
// holding watchersMu meanwhile.
func (l *limiter) watcherList() []limiterWatcher {
	l.watchersMu.Lock()
	defer l.watchersMu.Unlock()
	list := make([]limiterWatcher, 0, len(l.watchers))
	for w := range l.watchers {
		list = append(list, w)
	}
	return list
}

// breakerChanged counts a node's breaker opening or closing and tells the
// watchers. It runs in a batch worker, never on a request's path.
func (l *limiter) breakerChanged(b *breaker) {
	changed, open := l.breakers.sync(b)
	if !changed {
		return
	}
	failures := b.failures.Load()
	for _, w := range l.watcherList() {
		w.breakerChanged(b.node, open, failures)
	}
}

// openBreakers is how many of the limiter's node breakers are open.
func (l *limiter) openBreakers() int64 { return l.breakers.open.Load() }

// nodeBreaker returns the breaker of the master that serves key. A
// Cluster client that cannot load its slot map at all has one breaker
// for that; resolved says whether the map was there, so that a batch
// tries to load it once, not once per call.
func (l *limiter) nodeBreaker(ctx context.Context, key string, resolved *bool) *breaker {
	if l.cluster == nil {
		return l.breakers.get(l.node)
	}
	if *resolved {
		if master, err := l.cluster.MasterForKey(ctx, key); err == nil {
			return l.breakers.get(master.Options().Addr)
		}
		*resolved = false
	}
	return l.breakers.get(unknownSlots)
}

// loadScript loads the script ahead of the first request (on every
// master of a cluster), so that request needs no second round trip. It
// is only a head start: a failure here is retried by requests.
func (l *limiter) loadScript(within time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	_ = l.client.ScriptLoad(ctx, scriptSource).Err()
	_ = l.client.ScriptLoad(ctx, giveBackSource).Err()
	_ = l.client.ScriptLoad(ctx, settleSource).Err()
	_ = l.client.ScriptLoad(ctx, leaseSource).Err()
	_ = l.client.ScriptLoad(ctx, concurrentSource).Err()
}

// lingerIdle is how long a released limiter must go without calls before
// it closes. Caddy cleans up an old config while its servers still finish
// requests; those keep being limited rather than failing.
const lingerIdle = time.Second

// errLimiterClosed answers calls that arrive after the limiter closed.
var errLimiterClosed = errors.New("the Redis client of an unloaded config is closed")

// Destruct closes the limiter once its last requests are done: when none
// holds a concurrency slot (their renewals and releases need it, however
// long they run) and no call has come for lingerIdle. It returns at once.
func (l *limiter) Destruct() error {
	go func() {
		tick := time.NewTicker(lingerIdle / 4)
		defer tick.Stop()
		for range tick.C {
			// Holds first: a hold leaves them once its release is queued,
			// which the queue's checks then see.
			if !l.renewals.holding() && time.Since(time.Unix(0, l.lastCall.Load())) >= lingerIdle &&
				len(l.queue) == 0 && !l.releaseQueue.queued() && !l.renewQueue.queued() {
				break
			}
		}
		l.closing.Lock()
		l.closed = true
		l.closing.Unlock()
		close(l.stop)
		l.workers.Wait()
		l.resetSub.close()
		_ = l.client.Close()
	}()
	return nil
}

// take checks and takes every bucket's requested tokens, all or none,
// and fills in each bucket's answer. The answer comes within the timeout
// from now. A call whose client has left (clientCtx done) by the time its
// batch goes out is not sent, so it takes no tokens.
func (l *limiter) take(clientCtx context.Context, now time.Time, buckets []bucket) (allowed bool, err error) {
	c, err := l.call(clientCtx, now, takeScript, buckets)
	if err == nil {
		allowed, err = readTake(c.reply, buckets, false)
	}
	if c != nil {
		c.release()
	}
	return allowed, err
}

// giveBack returns each bucket's requested tokens, which the request took
// before a later group of its buckets refused.
func (l *limiter) giveBack(clientCtx context.Context, now time.Time, buckets []bucket) error {
	c, err := l.call(clientCtx, now, giveBackScript, buckets)
	if c != nil {
		c.release()
	}
	return err
}

// call runs a script over the buckets (their keys and arguments) through
// the batcher and returns the answered call, for the caller to read and
// release; nil when the timeout ran out first (the worker releases it
// then).
func (l *limiter) call(clientCtx context.Context, now time.Time, script *luaScript, buckets []bucket) (*call, error) {
	c := calls.Get().(*call)
	for i := range buckets {
		c.keys = append(c.keys, buckets[i].key)
	}
	c.command(script)
	for i := range buckets {
		c.args = buckets[i].kind().appendArgs(c.args, buckets[i])
	}
	return l.send(clientCtx, now, c)
}

// command starts the call's arguments: the script by its SHA, and the
// keys, all of which the caller appended to c.keys; its own arguments
// follow.
func (c *call) command(script *luaScript) {
	var n any
	if len(c.keys) < len(keyCounts) {
		n = keyCounts[len(c.keys)]
	} else {
		n = strconv.Itoa(len(c.keys))
	}
	c.args = append(c.args, "evalsha", script.sha, n)
	for i := range c.keys {
		c.args = append(c.args, &c.keys[i]) // a *string costs no allocation; a string would (BenchmarkServeHTTPAllowed 17 -> 16)
	}
	c.script = script
}

// send queues a call made with command and its arguments, and waits for
// its answer, which comes within the timeout from now. It returns the
// answered call, for the caller to read and release; nil when the
// timeout ran out first (the worker releases it then).
func (l *limiter) send(clientCtx context.Context, now time.Time, c *call) (*call, error) {
	c.clientCtx = clientCtx
	if err := l.enqueue(c, now); err != nil {
		return c, err
	}
	if answered, sent := c.wait(); !answered {
		if sent {
			return nil, errNoAnswer
		}
		return nil, errWaitedOut
	}
	return c, c.err
}

// enqueue queues a call that is ready but for its deadline, which the
// timeout from now sets; the caller waits on it (call.wait), or its then
// takes the answer, unless this refuses it (the limiter closed, or its
// queue full).
func (l *limiter) enqueue(c *call, now time.Time) error {
	c.deadline = now.Add(l.timeout)
	l.lastCall.Store(now.UnixNano())
	l.closing.RLock()
	defer l.closing.RUnlock()
	if l.closed {
		return errLimiterClosed
	}
	select {
	case l.queue <- c:
		return nil
	default:
		return errQueueFull
	}
}

// bucketView is what a bucket holds now, for the admin API.
type bucketView struct {
	tokens    float64
	wait      time.Duration // until it holds the requested tokens
	expiresIn time.Duration // until its key expires; 0 for none (full)
}

// peek reads buckets without changing them, with a read-only script
// (EVAL_RO; EVAL of the same script on Redis 6.2, which has no EVAL_RO),
// one bucket per call: on a Cluster they may live on different masters.
func (l *limiter) peek(ctx context.Context, buckets []bucket) ([]bucketView, error) {
	views := make([]bucketView, len(buckets))
	for i := range buckets {
		reply, err := l.peekOne(ctx, buckets[i])
		if err != nil {
			return nil, err
		}
		if len(reply) != 3 {
			return nil, fmt.Errorf("unexpected peek reply %v", reply)
		}
		text, _ := reply[0].(string)
		wait, ok1 := reply[1].(int64)
		pttl, ok2 := reply[2].(int64)
		tokens, err := strconv.ParseFloat(text, 64)
		if err != nil || !ok1 || !ok2 {
			return nil, fmt.Errorf("unexpected peek reply %v", reply)
		}
		views[i] = bucketView{tokens: tokens, wait: time.Duration(wait) * time.Microsecond}
		if pttl > 0 {
			views[i].expiresIn = time.Duration(pttl) * time.Millisecond
		}
	}
	return views, nil
}

// peekOne runs peek.lua on one bucket: with EVAL_RO until the server
// says it has no such command, then with EVAL, which runs the script (it
// writes nothing) as well.
func (l *limiter) peekOne(ctx context.Context, b bucket) ([]any, error) {
	keys, args := []string{b.key}, b.kind().appendArgs(nil, b)
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

// reset deletes buckets, which makes them full, and tells every
// instance sharing the Redis to drop its cached denials of them.
func (l *limiter) reset(ctx context.Context, keys []string) error {
	pipe := l.client.Pipeline()
	for _, key := range keys {
		pipe.Del(ctx, key)
	}
	pipe.Publish(ctx, l.resets, strings.Join(keys, "\n"))
	_, err := pipe.Exec(ctx)
	return err
}

// maxRetryMicros bounds the wait a reply may give: no bucket takes longer
// than a year to fill (limitValues.check), nor to pay back its debt
// (maxDebtFor); no quota's period is longer than maxPeriod, and the
// script counts at most to the end of the period after Caddy's.
const maxRetryMicros = max(2*maxFillSeconds*1_000_000, 2*int64(maxPeriod/time.Microsecond))

// readTake reads the check-and-take reply, {allowed, then per bucket:
// remaining, microseconds until it holds its requested tokens; with
// leases, then the tokens each lent; then per quota, the period it
// counted in: each kind's replyWords}, into the buckets. A quota that
// counted in none (Redis's clock outside its periods) is a
// quotaClockError. Anything else is no answer at all: never read as a
// denial.
func readTake(reply []int64, buckets []bucket, leasing bool) (allowed bool, err error) {
	n := len(buckets)
	want := 1 + 2*n
	if leasing {
		want += n
	}
	kindWords := want
	for i := range buckets {
		want += buckets[i].kind().replyWords()
	}
	if len(reply) != want || reply[0]>>1 != 0 {
		return false, fmt.Errorf("unexpected script reply %v", reply)
	}
	for i := range buckets {
		k := buckets[i].kind()
		if words := k.replyWords(); words > 0 {
			if buckets[i], err = k.readReply(buckets[i], reply, kindWords); err != nil {
				return false, err
			}
			kindWords += words
		}
	}
	for i := range buckets {
		buckets[i].leased = 0
		if leasing {
			if buckets[i].leased = reply[1+2*n+i]; buckets[i].leased < 0 {
				return false, fmt.Errorf("unexpected script reply %v", reply)
			}
		}
	}
	for i := range buckets {
		remaining, wait := reply[1+2*i], reply[2+2*i]
		if remaining < 0 || wait < 0 || wait > maxRetryMicros {
			return false, fmt.Errorf("unexpected script reply %v", reply)
		}
		buckets[i].remaining, buckets[i].retryAfter = remaining, time.Duration(wait)*time.Microsecond
	}
	return reply[0] == 1, nil
}

// reloadSlotsAfter makes a cluster client find a failed-over master
// sooner: go-redis reloads its slot map only on MOVED or once a minute.
func (l *limiter) reloadSlotsAfter(err error) {
	if l.cluster == nil || !isNetworkError(err) {
		return
	}
	now := time.Now().UnixNano()
	last := l.lastReload.Load()
	if now-last < int64(250*time.Millisecond) || !l.lastReload.CompareAndSwap(last, now) {
		return
	}
	l.cluster.ReloadState(context.Background())
}

func isNetworkError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, context.DeadlineExceeded) ||
		redis.HasErrorPrefix(err, "CLUSTERDOWN") || strings.Contains(err.Error(), "connection refused")
}
