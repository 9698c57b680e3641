package ratelimit

import (
	"context"
	"crypto/sha1"
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

//go:embed script.lua
var scriptSource string

// scriptSHA names the check-and-take script for EVALSHA; the source is
// sent again only when the server has lost its script cache.
var scriptSHA = func() string {
	sum := sha1.Sum([]byte(scriptSource))
	return hex.EncodeToString(sum[:])
}()

// The command words as interface values, boxed once rather than per call.
var (
	evalSHA           any = "evalsha"
	scriptSHAValue    any = scriptSHA
	scriptSourceValue any = scriptSource
)

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

// Defaults of the redis block.
const (
	defaultRedisAddress = "127.0.0.1:6379"
	defaultKeyPrefix    = "rate_limit:"
	defaultTimeout      = 100 * time.Millisecond
)

// Batching: requests that arrive while a Redis call is in flight wait in
// the queue and go out together in one pipeline (one write, one read).
const (
	pipelinesInFlight = 2
	maxBatch          = 128
	queueLength       = 4096
)

// RedisConfig says how to reach Redis: one server, a Cluster or a
// Sentinel-monitored master. Every string takes `{env.*}` placeholders.
type RedisConfig struct {
	// Addresses of Redis: `host:port`, or a `redis://` or `rediss://`
	// (TLS) URL that may carry the user name, password and database.
	// Several addresses mean Redis Cluster seeds, or Sentinel addresses
	// when `master_name` is set. Default: `127.0.0.1:6379`.
	Addresses []string `json:"addresses,omitempty"`

	// Cluster selects Redis Cluster even with a single seed address.
	Cluster bool `json:"cluster,omitempty"`

	// MasterName is the name of the master that the Sentinels at
	// `addresses` monitor. Setting it selects Sentinel mode.
	MasterName string `json:"master_name,omitempty"`

	// SentinelUsername and SentinelPassword authenticate to the
	// Sentinels themselves (not to the master).
	SentinelUsername string `json:"sentinel_username,omitempty"`
	SentinelPassword string `json:"sentinel_password,omitempty"`

	// Username and Password authenticate to Redis (ACL user or
	// `requirepass`).
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`

	// DB is the database index. Redis Cluster has only database 0.
	DB int `json:"db,omitempty"`

	// KeyPrefix starts every Redis key this handler writes.
	// Default: `rate_limit:`.
	KeyPrefix string `json:"key_prefix,omitempty"`

	// Timeout bounds the whole Redis step of one request: waiting for a
	// connection, dialing, sending, retries and the reply. Past it, the
	// request is handled as `on_error` says. Default: 100ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// DialTimeout bounds one attempt to connect. Default: the timeout.
	DialTimeout caddy.Duration `json:"dial_timeout,omitempty"`

	// PoolSize is the most connections for single commands per Redis
	// node; batches of requests use go-redis's separate pipeline pool.
	// Default: go-redis's, 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	// TLS, when set, connects over TLS even to a plain `host:port`.
	TLS *RedisTLS `json:"tls,omitempty"`
}

// RedisTLS configures TLS to Redis.
type RedisTLS struct {
	// CA is a PEM file of the authorities that may sign the server's
	// certificate. Default: the system's roots.
	CA string `json:"ca,omitempty"`

	// Cert and Key are PEM files of the client certificate and its key,
	// for servers that authenticate clients (`tls-auth-clients yes`).
	Cert string `json:"cert,omitempty"`
	Key  string `json:"key,omitempty"`

	// ServerName is the name to verify in the server's certificate.
	// Default: the host of the address.
	ServerName string `json:"server_name,omitempty"`

	// InsecureSkipVerify turns off verification of the server's
	// certificate. For tests only.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`
}

// withPlaceholders returns the configuration with `{env.*}` and other
// global placeholders replaced, and defaults filled in.
func (c *RedisConfig) withPlaceholders() RedisConfig {
	repl := caddy.NewReplacer()
	r := RedisConfig{}
	if c != nil {
		r = *c
	}
	r.Addresses = nil
	if c != nil {
		for _, a := range c.Addresses {
			resolved := strings.Fields(repl.ReplaceAll(a, ""))
			if len(resolved) == 0 {
				resolved = []string{a} // validate names the unresolved value
			}
			r.Addresses = append(r.Addresses, resolved...)
		}
	}
	if len(r.Addresses) == 0 {
		r.Addresses = []string{defaultRedisAddress}
	}
	r.MasterName = repl.ReplaceAll(r.MasterName, "")
	r.SentinelUsername = repl.ReplaceAll(r.SentinelUsername, "")
	r.SentinelPassword = repl.ReplaceAll(r.SentinelPassword, "")
	r.Username = repl.ReplaceAll(r.Username, "")
	r.Password = repl.ReplaceAll(r.Password, "")
	if r.KeyPrefix = repl.ReplaceAll(r.KeyPrefix, ""); r.KeyPrefix == "" {
		r.KeyPrefix = defaultKeyPrefix
	}
	if r.Timeout <= 0 {
		r.Timeout = caddy.Duration(defaultTimeout)
	}
	if r.DialTimeout <= 0 {
		r.DialTimeout = r.Timeout
	}
	if r.TLS != nil {
		t := *r.TLS
		t.CA = repl.ReplaceAll(t.CA, "")
		t.Cert = repl.ReplaceAll(t.Cert, "")
		t.Key = repl.ReplaceAll(t.Key, "")
		t.ServerName = repl.ReplaceAll(t.ServerName, "")
		r.TLS = &t
	}
	return r
}

// validate refuses contradictory or malformed settings.
func (c RedisConfig) validate() error {
	if c.Cluster && c.MasterName != "" {
		return fmt.Errorf("redis: 'master_name %s' (Sentinel) and 'cluster' exclude each other", c.MasterName)
	}
	if c.MasterName == "" && (c.SentinelUsername != "" || c.SentinelPassword != "") {
		return errors.New("redis: 'sentinel_username' and 'sentinel_password' need 'master_name'")
	}
	if c.DB < 0 {
		return fmt.Errorf("redis: 'db %d' must not be negative", c.DB)
	}
	if c.PoolSize < 0 {
		return fmt.Errorf("redis: 'pool_size %d' must not be negative", c.PoolSize)
	}
	db := c.DB
	for _, a := range c.Addresses {
		o, err := parseAddress(a)
		if err != nil {
			return fmt.Errorf("redis: address '%s': %w", a, err)
		}
		if db == 0 {
			db = o.DB
		}
	}
	if db != 0 && c.Cluster {
		return fmt.Errorf("redis: 'db %d' is not possible with 'cluster': Redis Cluster has only database 0", db)
	}
	if db != 0 && len(c.Addresses) > 1 && c.MasterName == "" {
		return fmt.Errorf("redis: 'db %d' is not possible with %d addresses and no 'master_name', which means Redis Cluster: it has only database 0", db, len(c.Addresses))
	}
	if c.TLS != nil && (c.TLS.Cert == "") != (c.TLS.Key == "") {
		return fmt.Errorf("redis: tls: 'cert' and 'key' go together; got cert '%s' and key '%s'", c.TLS.Cert, c.TLS.Key)
	}
	return nil
}

// parseAddress accepts `host:port` or a redis:// or rediss:// URL.
func parseAddress(a string) (*redis.Options, error) {
	if strings.Contains(a, "://") {
		if !strings.HasPrefix(a, "redis://") && !strings.HasPrefix(a, "rediss://") {
			return nil, errors.New("URL scheme must be redis:// or rediss://")
		}
		return redis.ParseURL(a)
	}
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		return nil, fmt.Errorf("want host:port: %w", err)
	}
	if host == "" {
		return nil, errors.New("missing host")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return nil, fmt.Errorf("port '%s' is not a number from 1 to 65535", port)
	}
	return &redis.Options{Addr: a}, nil
}

// options turns the configuration into go-redis options.
func (c RedisConfig) options() (*redis.UniversalOptions, error) {
	timeout := time.Duration(c.Timeout)
	opts := &redis.UniversalOptions{
		MasterName:            c.MasterName,
		IsClusterMode:         c.Cluster,
		SentinelUsername:      c.SentinelUsername,
		SentinelPassword:      c.SentinelPassword,
		Username:              c.Username,
		Password:              c.Password,
		DB:                    c.DB,
		DialTimeout:           time.Duration(c.DialTimeout),
		ReadTimeout:           timeout,
		WriteTimeout:          timeout,
		PoolTimeout:           timeout,
		ContextTimeoutEnabled: true,
		PoolSize:              c.PoolSize,
		// One try: the timeout covers the whole step, and a retry
		// inside it would only hide a failing server from the breaker.
		MaxRetries:      -1,
		MinRetryBackoff: -1,
		MaxRetryBackoff: -1,
		DialerRetries:   1,
		DisableIdentity: true,
	}
	for _, a := range c.Addresses {
		o, err := parseAddress(a)
		if err != nil {
			return nil, fmt.Errorf("address '%s': %w", a, err)
		}
		opts.Addrs = append(opts.Addrs, o.Addr)
		if opts.Username == "" {
			opts.Username = o.Username
		}
		if opts.Password == "" {
			opts.Password = o.Password
		}
		if opts.DB == 0 {
			opts.DB = o.DB
		}
		if o.TLSConfig != nil && opts.TLSConfig == nil {
			opts.TLSConfig = o.TLSConfig // rediss://, with its skip_verify if given
		}
	}
	if c.TLS != nil {
		tc, err := c.TLS.config()
		if err != nil {
			return nil, fmt.Errorf("tls: %w", err)
		}
		if opts.TLSConfig != nil && c.TLS.ServerName == "" {
			tc.ServerName = opts.TLSConfig.ServerName
		}
		opts.TLSConfig = tc
	}
	if opts.TLSConfig != nil && opts.TLSConfig.MinVersion < tls.VersionTLS12 {
		opts.TLSConfig.MinVersion = tls.VersionTLS12
	}
	return opts, nil
}

// config builds the TLS configuration; a nil receiver means defaults.
func (t *RedisTLS) config() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if t == nil {
		return tc, nil
	}
	tc.ServerName = t.ServerName
	tc.InsecureSkipVerify = t.InsecureSkipVerify
	if t.CA != "" {
		pem, err := os.ReadFile(t.CA)
		if err != nil {
			return nil, fmt.Errorf("reading 'ca': %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("'ca %s' holds no PEM certificate", t.CA)
		}
		tc.RootCAs = pool
	}
	if t.Cert != "" {
		cert, err := tls.LoadX509KeyPair(t.Cert, t.Key)
		if err != nil {
			return nil, fmt.Errorf("loading 'cert' and 'key': %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// Result is the outcome of one check-and-take.
type Result struct {
	// Allowed says whether the tokens were taken.
	Allowed bool
	// Remaining is the whole tokens left in the bucket, rounded down.
	Remaining int64
	// RetryAfter is how long until the bucket holds the requested tokens
	// again: when a denied request may retry, or, after an allowed one,
	// when the next fits (zero when it fits now).
	RetryAfter time.Duration
}

// call is one request's trip through the batcher, pooled: the caller
// always gets its answer (by the deadline at the latest) and then puts
// the call back.
type call struct {
	cmd      [7]any // EVALSHA, sha, 1, &key, rate, burst, requested
	key      string // boxed as &key, which costs no allocation
	deadline time.Time
	request  context.Context // only asked whether the client left, so the call need not be sent
	result   Result
	err      error
	done     chan struct{} // one answer per use
}

var calls = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// errQueueFull fails a request at once when Redis is far behind.
var errQueueFull = errors.New("too many requests waiting for Redis")

// backend is one Redis client with its batcher, shared by every handler
// with the same Redis settings (see the usage pool).
type backend struct {
	client  redis.UniversalClient
	cluster *redis.ClusterClient
	timeout time.Duration
	queue   chan *call
	stop    chan struct{}
	workers sync.WaitGroup
	timers  [pipelinesInFlight]*batchTimer // one per worker

	// closing guards closed: once set, no call enters the queue, so every
	// queued call is answered before the workers stop.
	closing sync.RWMutex
	closed  bool
	// lastCall is when the latest call was queued, in Unix nanoseconds.
	lastCall atomic.Int64

	// lastReload throttles cluster slot reloads after network errors.
	lastReload atomic.Int64
}

// lingerIdle is how long a released backend must go without calls before
// it closes. Caddy cleans up an old config while its servers still finish
// requests; those keep being limited rather than failing.
const lingerIdle = time.Second

// errBackendClosed answers calls that arrive after the backend closed.
var errBackendClosed = errors.New("the Redis client of an unloaded config is closed")

// backends holds the clients in use, so that handlers with the same
// Redis settings share one, also across config reloads.
var backends = caddy.NewUsagePool()

// acquireBackend returns the shared backend for the configuration and
// the pool key to release it with.
func acquireBackend(c RedisConfig) (*backend, string, error) {
	raw, err := json.Marshal(c)
	if err != nil {
		return nil, "", err
	}
	key := string(raw)
	v, _, err := backends.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newBackend(c)
	})
	if err != nil {
		return nil, "", err
	}
	return v.(*backend), key, nil
}

func newBackend(c RedisConfig) (*backend, error) {
	opts, err := c.options()
	if err != nil {
		return nil, err
	}
	b := &backend{
		client:  redis.NewUniversalClient(opts),
		timeout: time.Duration(c.Timeout),
		queue:   make(chan *call, queueLength),
		stop:    make(chan struct{}),
	}
	b.cluster, _ = b.client.(*redis.ClusterClient)
	for i := range pipelinesInFlight {
		b.timers[i] = newBatchTimer()
		b.workers.Add(1)
		go b.work(i)
	}
	go b.loadScript(time.Duration(c.DialTimeout) + b.timeout)
	return b, nil
}

// loadScript loads the script ahead of the first request (on every
// master of a cluster), so that request needs no second round trip. It
// is only a head start: a failure here is retried by requests.
func (b *backend) loadScript(within time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	_ = b.client.ScriptLoad(ctx, scriptSource).Err()
}

// Destruct closes the backend once its last requests are done: when no
// call has come for lingerIdle. It returns at once.
func (b *backend) Destruct() error {
	go func() {
		tick := time.NewTicker(lingerIdle / 4)
		defer tick.Stop()
		for range tick.C {
			if time.Since(time.Unix(0, b.lastCall.Load())) >= lingerIdle && len(b.queue) == 0 {
				break
			}
		}
		b.closing.Lock()
		b.closed = true
		b.closing.Unlock()
		close(b.stop)
		b.workers.Wait()
		_ = b.client.Close()
	}()
	return nil
}

// take asks Redis to take the requested tokens from the bucket at key.
// args are the script's arguments (rate, burst, requested). The answer
// comes within the timeout from now. A call whose client has left (ctx canceled)
// by the time its batch goes out is not sent, so it takes no tokens.
func (b *backend) take(ctx context.Context, now time.Time, key string, args []any) (Result, error) {
	c := calls.Get().(*call)
	c.key = key
	c.cmd = [7]any{evalSHA, scriptSHAValue, "1", &c.key, args[0], args[1], args[2]}
	c.deadline = now.Add(b.timeout)
	c.request = ctx
	b.lastCall.Store(now.UnixNano())
	b.closing.RLock()
	var err error
	if b.closed {
		err = errBackendClosed
	} else {
		select {
		case b.queue <- c:
		default:
			err = errQueueFull
		}
	}
	b.closing.RUnlock()
	if err != nil {
		*c = call{done: c.done}
		calls.Put(c)
		return Result{}, err
	}
	<-c.done
	res, err := c.result, c.err
	*c = call{done: c.done}
	calls.Put(c)
	return res, err
}

// work sends batches: it waits for one call, takes whatever else is
// already queued (never waiting for more), and sends them together.
func (b *backend) work(worker int) {
	defer b.workers.Done()
	batch := make([]*call, 0, maxBatch)
	for {
		select {
		case c := <-b.queue:
			batch = append(batch[:0], c)
		case <-b.stop:
			// Nothing enters the queue any more; answer what is left.
			for {
				select {
				case c := <-b.queue:
					c.err = errBackendClosed
					c.done <- struct{}{}
				default:
					return
				}
			}
		}
	more:
		for len(batch) < maxBatch {
			select {
			case c := <-b.queue:
				batch = append(batch, c)
			default:
				break more
			}
		}
		// Calls whose time (nearly) ran out in the queue, or whose client
		// left, are answered without being sent: they must not take
		// tokens, nor cut short the batch, which ends at its earliest
		// deadline.
		last := time.Now().Add(b.timeout / 10)
		live := batch[:0]
		for _, c := range batch {
			switch {
			case c.deadline.Before(last):
				c.err = context.DeadlineExceeded
			case c.request.Err() != nil:
				c.err = c.request.Err()
			default:
				live = append(live, c)
				continue
			}
			c.done <- struct{}{}
		}
		if len(live) > 0 {
			b.send(worker, live)
		}
		clear(batch)
	}
}

// send runs one batch and delivers every call's own result or error.
// The batch ends at the earliest deadline among its calls, so no caller
// waits past its own.
func (b *backend) send(worker int, batch []*call) {
	deadline := batch[0].deadline
	for _, c := range batch[1:] {
		if c.deadline.Before(deadline) {
			deadline = c.deadline
		}
	}
	ctx := b.timers[worker].start(deadline)
	defer b.timers[worker].stop()

	cmds := b.run(ctx, batch, false)
	// After a restart, failover or SCRIPT FLUSH the server has lost the
	// script: send the source for those that failed, which caches it again.
	var lost []*call
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			lost = append(lost, batch[i])
		}
	}
	if len(lost) > 0 {
		b.run(ctx, lost, true)
	}

	for _, c := range batch {
		if c.err != nil {
			b.onError(c.err)
		}
		c.done <- struct{}{}
	}
}

// batchTimer gives the batches of one worker a context that ends at the
// batch's deadline, as context.WithDeadline would, but reuses one timer
// and, until a batch times out, one Done channel: a batch of one request
// then costs one allocation instead of five. go-redis needs both the
// deadline (for socket deadlines) and Done (to stop waiting for a new
// connection).
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

// run sends the calls in one pipeline (or alone when there is one), by
// SHA or, with source, with the script's source, and stores each call's
// own result or error.
func (b *backend) run(ctx context.Context, batch []*call, source bool) []*redis.Cmd {
	args := func(c *call) []any {
		if !source {
			return c.cmd[:]
		}
		eval := c.cmd
		eval[0], eval[1] = "eval", scriptSourceValue
		return eval[:]
	}
	cmds := make([]*redis.Cmd, len(batch))
	if len(batch) == 1 {
		cmds[0] = b.client.Do(ctx, args(batch[0])...)
	} else {
		pipe := b.client.Pipeline()
		for i, c := range batch {
			cmds[i] = pipe.Do(ctx, args(c)...)
		}
		_, _ = pipe.Exec(ctx) // each command carries its own error
	}
	for i, c := range batch {
		c.result, c.err = parseResult(cmds[i])
	}
	return cmds
}

// onError makes a cluster client find a failed-over master sooner:
// go-redis reloads its slot map only on MOVED or once a minute.
func (b *backend) onError(err error) {
	if b.cluster == nil || !isNetworkError(err) {
		return
	}
	now := time.Now().UnixNano()
	last := b.lastReload.Load()
	if now-last < int64(250*time.Millisecond) || !b.lastReload.CompareAndSwap(last, now) {
		return
	}
	b.cluster.ReloadState(context.Background())
}

func isNetworkError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, context.DeadlineExceeded) ||
		redis.HasErrorPrefix(err, "CLUSTERDOWN") || strings.Contains(err.Error(), "connection refused")
}

func parseResult(cmd *redis.Cmd) (Result, error) {
	if err := cmd.Err(); err != nil {
		return Result{}, err
	}
	v, ok := cmd.Val().([]any)
	if !ok || len(v) != 3 {
		return Result{}, fmt.Errorf("unexpected script reply %v", cmd.Val())
	}
	allowed, _ := v[0].(int64)
	remaining, _ := v[1].(int64)
	retry, _ := v[2].(int64)
	return Result{
		Allowed:    allowed == 1,
		Remaining:  remaining,
		RetryAfter: time.Duration(retry) * time.Microsecond,
	}, nil
}
