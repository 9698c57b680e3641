package floor

import (
	"hash/maphash"
	"net/http"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(&MemoryFloor{})
	httpcaddyfile.RegisterHandlerDirective("bench_memory_floor", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		f := new(MemoryFloor)
		return f, f.UnmarshalCaddyfile(h.Dispenser)
	})
}

// MemoryFloor is the least work a Caddy handler can do to take one token
// per request from an in-process token bucket keyed by Caddy
// placeholders: fill the key template, find the bucket in a sharded map,
// refill it by the time elapsed and take a token. No headers,
// placeholders set, metrics, sweep or limits on the number of buckets.
// Its throughput is the ceiling for any in-process limiter keyed by
// placeholders (the plugin's `store memory`, mholt/caddy-ratelimit).
type MemoryFloor struct {
	// Key is the key template, e.g. {client_ip}:{http.request.header.X-Conn}.
	Key string `json:"key"`

	seed   maphash.Seed
	shards [64]memoryShard
}

type memoryShard struct {
	mu      sync.Mutex
	buckets map[string]*memoryBucket
}

type memoryBucket struct {
	tokens float64
	at     time.Time
}

// A billion tokens refilled at a billion a second, as the bench's
// allowed cases: never denies.
const memoryFloorBurst, memoryFloorRate = 1e9, 1e9

// CaddyModule returns the Caddy module information.
func (*MemoryFloor) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.bench_memory_floor", New: func() caddy.Module { return new(MemoryFloor) }}
}

// UnmarshalCaddyfile reads `bench_memory_floor <key template>`.
func (f *MemoryFloor) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.Args(&f.Key) {
		return d.ArgErr()
	}
	return nil
}

// Provision makes the shards.
func (f *MemoryFloor) Provision(caddy.Context) error {
	f.seed = maphash.MakeSeed()
	for i := range f.shards {
		f.shards[i].buckets = make(map[string]*memoryBucket)
	}
	return nil
}

// ServeHTTP takes a token from the request's bucket.
func (f *MemoryFloor) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	key := repl.ReplaceAll(f.Key, "")
	now := time.Now()
	shard := &f.shards[maphash.String(f.seed, key)%uint64(len(f.shards))]
	shard.mu.Lock()
	b, ok := shard.buckets[key]
	if !ok {
		b = &memoryBucket{tokens: memoryFloorBurst, at: now}
		shard.buckets[key] = b
	}
	b.tokens = min(memoryFloorBurst, b.tokens+now.Sub(b.at).Seconds()*memoryFloorRate)
	b.at = now
	allowed := b.tokens >= 1
	if allowed {
		b.tokens--
	}
	shard.mu.Unlock()
	if !allowed {
		w.WriteHeader(http.StatusTooManyRequests)
		return nil
	}
	return next.ServeHTTP(w, r)
}

// Interface guards
var (
	_ caddy.Provisioner           = (*MemoryFloor)(nil)
	_ caddyfile.Unmarshaler       = (*MemoryFloor)(nil)
	_ caddyhttp.MiddlewareHandler = (*MemoryFloor)(nil)
)
