package ratelimit

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redisresets"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The scripts: check-and-take, give back, settle, and the admin API's
// read. A part with a script of its own registers it (registerScript).
var (
	//go:embed script.lua
	scriptSource string
	//go:embed giveback.lua
	giveBackSource string
	//go:embed peek.lua
	peekSource string
	//go:embed settle.lua
	settleSource string

	takeScript     = redisbatch.NewScript(scriptSource)
	giveBackScript = redisbatch.NewScript(giveBackSource)
	settleScript   = redisbatch.NewScript(settleSource)
	scriptSHA      = takeScript.SHA()
)

// scriptSources are the scripts loadScript loads: the limiter's, then
// those registered.
var scriptSources = []string{scriptSource, giveBackSource, settleSource}

// registerScript adds a part's script to those loaded ahead of the
// first request (from a package-level var of its file), and returns it.
func registerScript(source string) *redisbatch.Script {
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

// limiter is one Redis client with its batcher, shared by every
// handler with the same Redis settings, also across config reloads.
type limiter struct {
	client  redis.UniversalClient
	cluster *redis.ClusterClient // the same client, when it is a Cluster's
	timeout time.Duration
	batcher *redisbatch.Batcher
	// watchers are the handlers using the limiter, told when a node's
	// breaker opens or closes, and when buckets were reset.
	watchersMu sync.Mutex
	watchers   map[limiterWatcher]struct{}
	// resets is the pub/sub channel on which every instance that shares
	// the Redis learns of buckets the admin API reset (resets.go).
	resets    *redisresets.Channel
	keyPrefix string

	// parts are what parts of the package keep in the limiter
	// (registerLimiterPart), in their order.
	parts []limiterPart

	// noEvalRO: the server answered that it knows no EVAL_RO (Redis
	// before 7), so the admin API's reads use EVAL of the same script.
	noEvalRO atomic.Bool
}

// A limiterPart is what a part of the package keeps in each limiter
// (registerLimiterPart): calls it queues apart from the requests' own,
// which the batcher takes into each batch (batchHooks), and what keeps
// the limiter open (Destruct).
type limiterPart interface {
	// firstCalls and lastCalls append its queued calls to a batch,
	// before and after the batch's own; more says some are left.
	firstCalls(l *limiter, now time.Time, batch []*redisbatch.Call) (_ []*redisbatch.Call, more bool)
	lastCalls(l *limiter, now time.Time, batch []*redisbatch.Call) (_ []*redisbatch.Call, more bool)
	// inUse says whether requests still need the limiter, however long
	// they run; queued whether calls wait to be sent. The limiter closes
	// once neither is so and it is idle: inUse asked first, queued last.
	inUse() bool
	queued() bool
}

// limiterParts make the parts each new limiter gets. A part's script
// registers itself (registerScript).
var limiterParts []func() limiterPart

// registerLimiterPart adds a part to every limiter made from now on
// (from its file's init), and is its index in limiter.parts.
func registerLimiterPart(newPart func() limiterPart) int {
	limiterParts = append(limiterParts, newPart)
	return len(limiterParts) - 1
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
		watchers:  make(map[limiterWatcher]struct{}),
		keyPrefix: c.KeyPrefix,
	}
	l.cluster, _ = l.client.(*redis.ClusterClient)
	for _, p := range limiterParts {
		l.parts = append(l.parts, p())
	}
	l.resets = redisresets.New(l.client, c.KeyPrefix+"reset", c.KeyPrefix, newResetReceiver(l)) // before the first dial
	node := opts.Addrs[0]
	if opts.MasterName != "" {
		node = "master " + opts.MasterName
	}
	l.batcher = redisbatch.New(redisbatch.Config{Client: l.client, Node: node, Timeout: l.timeout,
		Hooks: batchHooks{l}, Settlements: settlements})
	go l.loadScript(time.Duration(c.DialTimeout) + l.timeout)
	go l.resets.Listen(l.batcher.Done())
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

// batchHooks is what the limiter gives its batcher: the calls its parts
// queued, and the watchers to tell of breaker changes. Its methods run
// in a batch worker, never on a request's path.
type batchHooks struct{ l *limiter }

// FirstCalls: the parts' calls that go ahead of the batch's own.
func (h batchHooks) FirstCalls(now time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	return h.partsCalls(limiterPart.firstCalls, now, batch)
}

// LastCalls: the parts' calls that go after the batch's own.
func (h batchHooks) LastCalls(now time.Time, batch []*redisbatch.Call) ([]*redisbatch.Call, bool) {
	return h.partsCalls(limiterPart.lastCalls, now, batch)
}

// partsCalls appends each part's calls (firstCalls or lastCalls) to
// batch, and says whether some part has more left.
func (h batchHooks) partsCalls(calls func(limiterPart, *limiter, time.Time, []*redisbatch.Call) ([]*redisbatch.Call, bool),
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
		w.breakerChanged(node, open, failures)
	}
}

func (h batchHooks) BreakerDropped(node string) {
	for _, w := range h.l.watcherList() {
		w.breakerDropped(node)
	}
}

// openBreakers is how many of the limiter's node breakers are open.
func (l *limiter) openBreakers() int64 { return l.batcher.OpenBreakers() }

// loadScript loads the script ahead of the first request (on every
// master of a cluster), so that request needs no second round trip. It
// is only a head start: a failure here is retried by requests.
func (l *limiter) loadScript(within time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	for _, source := range scriptSources {
		_ = l.client.ScriptLoad(ctx, source).Err()
	}
}

// lingerIdle is how long a released limiter must go without calls before
// it closes. Caddy cleans up an old config while its servers still finish
// requests; those keep being limited rather than failing.
const lingerIdle = time.Second

// Destruct closes the limiter once its last requests are done: when no
// part has them in use (limiterPart.inUse) nor calls queued, and no call
// has come for lingerIdle. It returns at once.
func (l *limiter) Destruct() error {
	go func() {
		tick := time.NewTicker(lingerIdle / 4)
		defer tick.Stop()
		for range tick.C {
			// In use first: what leaves it queues its calls, which the
			// queued checks then see.
			if !l.partsInUse() && l.batcher.Idle(lingerIdle) && !l.partsQueued() {
				break
			}
		}
		l.batcher.Close()
		l.resets.Close()
		_ = l.client.Close()
	}()
	return nil
}

func (l *limiter) partsInUse() bool {
	return slices.ContainsFunc(l.parts, limiterPart.inUse)
}

func (l *limiter) partsQueued() bool {
	return slices.ContainsFunc(l.parts, limiterPart.queued)
}

// take checks and takes every bucket's requested tokens, all or none,
// and fills in each bucket's answer. The answer comes within the timeout
// from now. A call whose client has left (clientCtx done) by the time its
// batch goes out is not sent, so it takes no tokens.
func (l *limiter) take(clientCtx context.Context, now time.Time, buckets []limit.Bucket) (allowed bool, err error) {
	c, err := l.call(clientCtx, now, takeScript, buckets)
	if err == nil {
		allowed, err = readTake(c.Reply, buckets, false)
	}
	if c != nil {
		c.Release()
	}
	return allowed, err
}

// giveBack returns each bucket's requested tokens, which the request took
// before a later group of its buckets refused.
func (l *limiter) giveBack(clientCtx context.Context, now time.Time, buckets []limit.Bucket) error {
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
func (l *limiter) call(clientCtx context.Context, now time.Time, script *redisbatch.Script, buckets []limit.Bucket) (*redisbatch.Call, error) {
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
func (l *limiter) peek(ctx context.Context, buckets []limit.Bucket) ([]limit.View, error) {
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
func (l *limiter) peekOne(ctx context.Context, b limit.Bucket) ([]any, error) {
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

// reset deletes buckets, which makes them full, and tells every
// instance sharing the Redis to drop its cached denials of them.
func (l *limiter) reset(ctx context.Context, keys []string) error {
	pipe := l.client.Pipeline()
	for _, key := range keys {
		pipe.Del(ctx, key)
	}
	pipe.Publish(ctx, l.resets.Name(), strings.Join(keys, "\n"))
	_, err := pipe.Exec(ctx)
	return err
}

// maxRetryMicros bounds the wait a reply may give: no bucket takes longer
// than a year to fill (limitValues.check), nor to pay back its debt
// (maxDebtFor); no calendar period is longer than maxPeriod, and the
// script counts at most to the end of the period after Caddy's.
const maxRetryMicros = max(2*maxFillSeconds*1_000_000, 2*int64(maxPeriod/time.Microsecond))

// readTake reads the check-and-take reply, {allowed, then per bucket:
// remaining, microseconds until it holds its requested tokens; from a
// layer's script (layerWords), then a count per bucket, at least 0,
// which the layer reads from the reply itself; then each kind's
// replyWords (a calendar period counted in)}, into the buckets. A kind's
// words that decide nothing are its kindError (readReply). Anything else
// is no answer at all: never read as a denial.
func readTake(reply []int64, buckets []limit.Bucket, layerWords bool) (allowed bool, err error) {
	n := len(buckets)
	want := 1 + 2*n
	if layerWords {
		want += n
	}
	kindWords := want
	for i := range buckets {
		want += buckets[i].Kind().ReplyWords()
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
		if remaining < 0 || wait < 0 || wait > maxRetryMicros {
			return false, fmt.Errorf("unexpected script reply %v", reply)
		}
		buckets[i].Remaining, buckets[i].RetryAfter = remaining, time.Duration(wait)*time.Microsecond
	}
	return reply[0] == 1, nil
}
