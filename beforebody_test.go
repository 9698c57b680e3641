package ratelimit

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// beforeBodySite limits each client (X-Key) to one request a minute,
// and, per model of the request's JSON body, to 1,000: the first limit
// names no value of the body. %[1]s is the store's line, %[2]s the
// client limit's.
const beforeBodySite = `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone before-body
		%[1]s
		key {http.request.header.X-Key}
		request_body {
			json model
		}
		%[2]s
		limit model 1000 1000 {
			key {http.request.header.X-Key}:{http.rate_limit.request.model}
		}
	}
	respond "ok"
}
`

// rawPost sends a POST of a body of length bytes to addr on a
// connection of its own, with the headers ("Name: value" lines): the
// headers, then sent of the body's bytes, then nothing more. It returns
// the first status line the server answers within wait, "" for none.
func rawPost(t *testing.T, addr string, length, sent int, wait time.Duration, headers ...string) string {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var req strings.Builder
	fmt.Fprintf(&req, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n", addr, length)
	for _, h := range headers {
		req.WriteString(h + "\r\n")
	}
	req.WriteString("\r\n")
	req.WriteString(strings.Repeat(" ", sent))
	if _, err := conn.Write([]byte(req.String())); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(wait))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return ""
	}
	return strings.TrimSpace(line)
}

// TestClientKnownRefusedGets429BeforeItsBodyIsRead: through a real Caddy,
// once a client's bucket is known empty (by the deny cache for Redis, by
// the memory store, by a hard block), its next request is refused with
// 429 before its body is read: a client that asks `Expect:
// 100-continue` gets its 429 and no `100 Continue`, and one that stalls
// mid-body gets its 429 all the same.
func TestClientKnownRefusedGets429BeforeItsBodyIsRead(t *testing.T) {
	srv := redistest.Start(t)
	for _, tc := range []struct {
		name, store, client string
		blocked             bool
	}{
		{"redis", "redis " + srv.Addr, "limit client 1/1m 1", false},
		{"memory", "store memory", "limit client 1/1m 1", false},
		{"hard block", "store memory", "limit client 1 0", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inst := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(beforeBodySite, tc.store, tc.client)))
			addr := strings.TrimPrefix(inst.URL, "http://")
			client := caddyClient(t)
			body := `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`
			post := func() int {
				req, _ := http.NewRequest(http.MethodPost, inst.URL+"/v1/chat/completions", strings.NewReader(body))
				req.Header.Set("X-Key", "k")
				resp, err := client.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				return resp.StatusCode
			}
			if !tc.blocked {
				// The first request takes the client's token; the second
				// is refused by the store, which the deny cache keeps.
				if status := post(); status != 200 {
					t.Fatalf("the first request: %d, want 200", status)
				}
				if status := post(); status != 429 {
					t.Fatalf("the second request: %d, want 429", status)
				}
			}
			if line := rawPost(t, addr, 1<<20, 0, 5*time.Second, "X-Key: k", "Expect: 100-continue"); !strings.HasPrefix(line, "HTTP/1.1 429 ") {
				t.Errorf("a known-refused client asking Expect: 100-continue: first answer %q, want 429 (no 100 Continue)\n%s", line, inst.LogTail(30))
			}
			if line := rawPost(t, addr, 1<<20, 100, 3*time.Second, "X-Key: k"); !strings.HasPrefix(line, "HTTP/1.1 429 ") {
				t.Errorf("a known-refused client that stalls mid-body: first answer %q within 3 s, want 429", line)
			}
			// Another client is not refused, and gets its 100 Continue.
			if line := rawPost(t, addr, len(body), 0, 5*time.Second, "X-Key: other", "Expect: 100-continue"); !tc.blocked && line != "HTTP/1.1 100 Continue" {
				t.Errorf("another client asking Expect: 100-continue: first answer %q, want 100 Continue", line)
			}
		})
	}
}

// readCounter is a request body that counts the reads made of it.
type readCounter struct {
	io.Reader
	reads int
}

func (b *readCounter) Read(p []byte) (int, error) { b.reads++; return b.Reader.Read(p) }
func (b *readCounter) Close() error               { return nil }

// plans stands in for Caddy's `map {http.rate_limit.request.model}
// {plan_rate} {plan_burst}`, which a request's replacer answers lazily:
// the models a to d and "dear" have a fast plan, any other (none among
// them) the default, slow one.
func plans(repl *caddy.Replacer) {
	repl.Map(func(key string) (any, bool) {
		if key != "plan_rate" && key != "plan_burst" {
			return nil, false // as map: only its outputs, then its input
		}
		fast := strings.Contains(" a b c d dear ", " "+repl.ReplaceAll("{http.rate_limit.request.model}", "")+" ")
		switch {
		case key == "plan_rate" && fast:
			return "1000", true
		case key == "plan_burst" && fast:
			return "1000", true
		case key == "plan_rate":
			return "1/1m", true
		case key == "plan_burst":
			return "1", true
		}
		return nil, false
	})
}

// TestRefusalBeforeBodyIsTheStoresRefusal: a handler that refuses before
// the body when it knows the refusal (here, the memory store; with
// Redis, its deny cache) answers every request of a sequence as the same
// handler that always reads the body first: the same status and
// Retry-After, and X-RateLimit-Remaining where it describes the same
// limit. A limit whose plan comes from the body through a map (plans) is
// left to the body: a client whose model makes its plan fast is not
// refused by the slow default plan its bucket would have without the
// body.
func TestRefusalBeforeBodyIsTheStoresRefusal(t *testing.T) {
	srv := redistest.Start(t)
	for _, tc := range []struct{ name, store string }{{"memory", "store memory"}, {"redis", "redis " + srv.Addr}} {
		store := tc.store
		t.Run(tc.name, func(t *testing.T) {
			config := func(zone string) *Handler {
				return caddyfileHandler(t, `rate_limit {
	zone `+zone+`
	`+store+`
	key {http.request.header.X-Key}
	request_body {
		json model
	}
	limit client 1/1m 3
	limit plan {
		replenish_rate {plan_rate}
		burst_capacity {plan_burst}
	}
	limit model 1/1m 2 {
		key {http.request.header.X-Key}:{http.rate_limit.request.model}
	}
}`)
			}
			early, late := config("before-body-early"), config("before-body-late")
			if early.beforeBody == nil || len(early.beforeBody.limits) != 2 || !early.beforeBody.track {
				t.Fatalf("what the handler asks before the body: %+v, want the limits client and plan, watched", early.beforeBody)
			}
			late.beforeBody = nil // always reads the body first
			send := func(h *Handler, key, model string) (status int, hdr http.Header, read bool) {
				body := &readCounter{Reader: strings.NewReader(`{"model":"` + model + `"}`)}
				r, _ := http.NewRequest(http.MethodPost, "http://example.com/", nil)
				r.Body, r.ContentLength = body, -1
				r.Header.Set("X-Key", key)
				r.RemoteAddr = "192.0.2.1:1"
				w := httptest.NewRecorder()
				repl := caddy.NewReplacer()
				r = caddyhttp.PrepareRequest(r, repl, w, &caddyhttp.Server{})
				plans(repl)
				err := h.ServeHTTP(w, r, okHandler)
				return statusOf(err, w.Code), w.Header(), body.reads > 0
			}
			refusedUnread := 0
			for i, c := range []struct{ key, model string }{
				// k1: the client limit (3) refuses its 4th and later.
				{"k1", "a"}, {"k1", "b"}, {"k1", "c"}, {"k1", "d"}, {"k1", "a"},
				// k2: the model limit (2) refuses a's 3rd: that needs the body.
				{"k2", "a"}, {"k2", "a"}, {"k2", "a"}, {"k2", "b"},
				// k3: the slow plan (burst 1) refuses the 2nd; the fast
				// plan of "dear" admits the 3rd, and the 4th.
				{"k3", "x"}, {"k3", "x"}, {"k3", "dear"}, {"k3", "dear"}, {"k3", "x"},
			} {
				time.Sleep(5 * time.Millisecond) // the fast plan refills 5 tokens
				es, eh, eread := send(early, c.key, c.model)
				ls, lh, _ := send(late, c.key, c.model)
				if es != ls || eh.Get("Retry-After") != lh.Get("Retry-After") {
					t.Errorf("request %d (%s, %s): %d Retry-After %q, but %d %q when the body is read first",
						i, c.key, c.model, es, eh.Get("Retry-After"), ls, lh.Get("Retry-After"))
				}
				if es == 429 && !eread {
					refusedUnread++
					if eh.Get("X-Ratelimit-Remaining") != lh.Get("X-Ratelimit-Remaining") {
						t.Errorf("request %d: remaining %q, %q when the body is read first", i, eh.Get("X-Ratelimit-Remaining"), lh.Get("X-Ratelimit-Remaining"))
					}
				}
			}
			// k1's 5th is known refused from the memory store, and from the
			// deny cache (which the 4th filled).
			if refusedUnread < 1 {
				t.Fatalf("no request was refused before its body was read")
			}
		})
	}
}

// TestSlowBodyIsBoundedByCaddysReadBodyIdleTimeout: request_body has no
// deadline of its own; Caddy's read_body_idle bounds a body that stalls:
// once it has passed, the body counts as cut off (its values empty: here
// the model's key, so 403), and the client has its answer.
func TestSlowBodyIsBoundedByCaddysReadBodyIdleTimeout(t *testing.T) {
	config := caddyproc.Caddyfile(fmt.Sprintf(beforeBodySite, "store memory", "limit client 1/1m 1"))
	config = strings.Replace(config, "\tgrace_period 2s\n", "\tgrace_period 2s\n\tservers {\n\t\ttimeouts {\n\t\t\tread_body_idle 1s\n\t\t}\n\t}\n", 1)
	inst := caddyproc.Start(t, config)
	addr := strings.TrimPrefix(inst.URL, "http://")
	start := time.Now()
	line := rawPost(t, addr, 1<<20, 100, 10*time.Second, "X-Key: slow")
	if !strings.HasPrefix(line, "HTTP/1.1 403 ") {
		t.Fatalf("a body stalled mid-way: first answer %q after %v, want 403 once read_body_idle (1 s) has passed", line, time.Since(start))
	}
	if took := time.Since(start); took < time.Second {
		t.Fatalf("answered after %v, before read_body_idle (1 s) passed", took)
	}
}
