// Package floor is a measuring stick for `make bench`, not part of the
// plugin: the least work a Caddy handler can do to take one token per
// request from Redis with the plugin's script. It batches requests into
// pipelines as the plugin does, over a hand-written RESP connection, and
// has nothing else: no go-redis, timeouts, headers, placeholders, metrics
// or deny cache. Its throughput is the ceiling for any limiter that asks
// Redis once per allowed request; the bench table sets the plugin beside it.
// With `buckets` above 1 it takes a token from that many buckets per
// request in one script call, the floor of a policy of several limits.
// memory.go holds the in-process floor, bench_memory_floor.
package floor

import (
	"bufio"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(&Floor{})
	httpcaddyfile.RegisterHandlerDirective("bench_floor", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		f := new(Floor)
		return f, f.UnmarshalCaddyfile(h.Dispenser)
	})
}

// Floor takes one token per request, as the plugin's allowed path does
// with a bucket that never runs out.
type Floor struct {
	// Redis is the host:port of the Redis server.
	Redis string `json:"redis"`
	// Script is the path of the plugin's script.lua.
	Script string `json:"script"`
	// Buckets is how many buckets each request takes a token from, in one
	// script call. Default: 1.
	Buckets int `json:"buckets,omitempty"`

	sha   string
	args  []string // the script's arguments after the keys
	queue chan *call
}

type call struct {
	key     string
	allowed bool
	done    chan struct{}
}

// The same batching as the plugin's.
const (
	pipelines = 2
	maxBatch  = 128
)

// CaddyModule returns the Caddy module information.
func (*Floor) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.bench_floor", New: func() caddy.Module { return new(Floor) }}
}

// UnmarshalCaddyfile reads `bench_floor <redis host:port> <script.lua path> [<buckets>]`.
func (f *Floor) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.Args(&f.Redis, &f.Script) {
		return d.ArgErr()
	}
	if d.NextArg() {
		n, err := strconv.Atoi(d.Val())
		if err != nil || n < 1 {
			return d.Errf("buckets %q: want a whole number of at least 1", d.Val())
		}
		f.Buckets = n
	}
	return nil
}

// Provision loads the script and opens one connection per pipeline.
func (f *Floor) Provision(caddy.Context) error {
	src, err := os.ReadFile(f.Script)
	if err != nil {
		return fmt.Errorf("reading the script: %w", err)
	}
	sum := sha1.Sum(src)
	f.sha = hex.EncodeToString(sum[:])
	f.Buckets = max(f.Buckets, 1)
	for range f.Buckets {
		f.args = append(f.args, "1000000000", "1000000000", "1")
	}
	f.queue = make(chan *call, 4096)
	for i := range pipelines {
		conn, err := net.Dial("tcp", f.Redis)
		if err != nil {
			return fmt.Errorf("connecting to Redis: %w", err)
		}
		w, r := bufio.NewWriter(conn), bufio.NewReader(conn)
		if i == 0 {
			writeCommand(w, "SCRIPT", "LOAD", string(src))
			if err := w.Flush(); err != nil {
				return fmt.Errorf("loading the script: %w", err)
			}
			// The reply is $40 and the SHA on the next line, or an error.
			line, err := r.ReadSlice('\n')
			if err == nil && line[0] != '$' {
				err = fmt.Errorf("redis replied %q", line)
			}
			if err == nil {
				_, err = r.ReadSlice('\n')
			}
			if err != nil {
				return fmt.Errorf("loading the script: %w", err)
			}
		}
		go f.work(w, r)
	}
	return nil
}

func writeCommand(w *bufio.Writer, args ...string) {
	w.WriteByte('*')
	w.WriteString(strconv.Itoa(len(args)))
	w.WriteString("\r\n")
	for _, a := range args {
		writeBulk(w, a)
	}
}

func writeBulk(w *bufio.Writer, a string) {
	w.WriteByte('$')
	w.WriteString(strconv.Itoa(len(a)))
	w.WriteString("\r\n")
	w.WriteString(a)
	w.WriteString("\r\n")
}

// work sends whatever is queued in one pipeline and reads the replies;
// any Redis failure ends the process, which the bench reports.
func (f *Floor) work(w *bufio.Writer, r *bufio.Reader) {
	batch := make([]*call, 0, maxBatch)
	for {
		batch = append(batch[:0], <-f.queue)
	more:
		for len(batch) < maxBatch {
			select {
			case c := <-f.queue:
				batch = append(batch, c)
			default:
				break more
			}
		}
		for _, c := range batch {
			f.writeCall(w, c.key)
		}
		if err := w.Flush(); err != nil {
			panic(err)
		}
		for _, c := range batch {
			// The reply is *<1+2n>, :allowed, then :remaining, :wait per bucket.
			for i := range 2 + 2*f.Buckets {
				line, err := r.ReadSlice('\n')
				if err != nil || i == 0 && line[0] != '*' {
					panic(fmt.Sprintf("bench_floor: reply %q, error %v", line, err))
				}
				if i == 1 {
					c.allowed = line[1] == '1'
				}
			}
			c.done <- struct{}{}
		}
	}
}

// writeCall writes the script call for the buckets of key: <key>|1 to
// <key>|n.
func (f *Floor) writeCall(w *bufio.Writer, key string) {
	w.WriteString("*")
	w.WriteString(strconv.Itoa(3 + 4*f.Buckets))
	w.WriteString("\r\n")
	writeBulk(w, "EVALSHA")
	writeBulk(w, f.sha)
	writeBulk(w, strconv.Itoa(f.Buckets))
	for i := range f.Buckets {
		writeBulk(w, key+"|"+strconv.Itoa(i+1))
	}
	for _, a := range f.args {
		writeBulk(w, a)
	}
}

// ServeHTTP takes a token from the request's bucket (one per X-Conn).
func (f *Floor) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	c := &call{key: "floor|" + r.Header.Get("X-Conn"), done: make(chan struct{}, 1)}
	f.queue <- c
	<-c.done
	if !c.allowed {
		w.WriteHeader(http.StatusTooManyRequests)
		return nil
	}
	return next.ServeHTTP(w, r)
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Floor)(nil)
	_ caddyfile.Unmarshaler       = (*Floor)(nil)
	_ caddyhttp.MiddlewareHandler = (*Floor)(nil)
)
