package ratelimit

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// llmUpstream is an OpenAI-compatible upstream of the test's own: it
// answers chat completions, as JSON or, when the body asks, as an event
// stream (with usage when stream_options.include_usage), and records
// each body it received under its X-Body-Id. Usage is X-Prompt-Tokens
// (default 1000) and X-Completion-Tokens (default 200; `most`: the most
// the request allows, n (default 1) times the larger of max_tokens and
// max_completion_tokens). X-Hold: 1 holds the answer until release is
// closed, after the body was recorded.
type llmUpstream struct {
	*httptest.Server
	release  chan struct{}
	received chan string // X-Body-Id of each body recorded
	mu       sync.Mutex
	bodies   map[string]receivedBody
	answered atomic.Int64 // responses with usage
	spent    atomic.Int64 // completion tokens of those
}

type receivedBody struct {
	sum  [32]byte
	size int
}

func startLLMUpstream(t *testing.T) *llmUpstream {
	u := &llmUpstream{release: make(chan struct{}), received: make(chan string, 1024), bodies: map[string]receivedBody{}}
	u.Server = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.Close)
	return u
}

func (u *llmUpstream) host() string { return strings.TrimPrefix(u.URL, "http://") }

func (u *llmUpstream) serve(w http.ResponseWriter, r *http.Request) {
	h := sha256.New()
	var head bytes.Buffer // the first 64 KiB, to read the request
	n, err := io.Copy(io.MultiWriter(h, &limitedBuffer{&head, 64 << 10}), r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var rb receivedBody
	copy(rb.sum[:], h.Sum(nil))
	rb.size = int(n)
	if id := r.Header.Get("X-Body-Id"); id != "" {
		u.mu.Lock()
		u.bodies[id] = rb
		u.mu.Unlock()
		u.received <- id
	}
	if r.Header.Get("X-Hold") == "1" {
		<-u.release
	}
	var req struct {
		Model               string `json:"model"`
		Stream              bool   `json:"stream"`
		N                   int64  `json:"n"`
		MaxTokens           int64  `json:"max_tokens"`
		MaxCompletionTokens int64  `json:"max_completion_tokens"`
		StreamOptions       struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	_ = json.Unmarshal(head.Bytes(), &req) // a body that is not JSON gets an answer too
	num := func(name string, def int64) int64 {
		if v, err := strconv.ParseInt(r.Header.Get(name), 10, 64); err == nil {
			return v
		}
		return def
	}
	prompt, completion := num("X-Prompt-Tokens", 1000), num("X-Completion-Tokens", 200)
	if r.Header.Get("X-Completion-Tokens") == "most" {
		completion = max(req.N, 1) * max(req.MaxTokens, req.MaxCompletionTokens)
	}
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`, prompt, completion, prompt+completion)
	u.answered.Add(1)
	u.spent.Add(completion)
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":%s}`, req.Model, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	for _, part := range []string{"Hi", " there"} {
		fmt.Fprintf(w, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":%q,\"choices\":[{\"index\":0,\"delta\":{\"content\":%q}}]}\n\n", req.Model, part)
		w.(http.Flusher).Flush()
	}
	if req.StreamOptions.IncludeUsage {
		fmt.Fprintf(w, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":%q,\"choices\":[],\"usage\":%s}\n\n", req.Model, usage)
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
}

// limitedBuffer keeps the first max bytes written to it.
type limitedBuffer struct {
	b   *bytes.Buffer
	max int
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if room := l.max - l.b.Len(); room > 0 {
		l.b.Write(p[:min(room, len(p))])
	}
	return len(p), nil
}

// body is what the upstream received under id, waiting for it.
func (u *llmUpstream) body(t *testing.T, id string) receivedBody {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		u.mu.Lock()
		rb, ok := u.bodies[id]
		u.mu.Unlock()
		if ok {
			return rb
		}
		select {
		case <-u.received:
		case <-deadline:
			t.Fatalf("the upstream received no body %s within 10 s", id)
		}
	}
}

// readmeLLMGateway is the README's "LLM gateway" Caddyfile with its site
// address, its upstream and a redis line replaced.
func startReadmeLLMGateway(t *testing.T, redisAddr string, up *llmUpstream) *chargeCaddy {
	t.Helper()
	block := readmeExample(t, "LLM gateway")
	if !strings.HasPrefix(block, "llm.example.com {") || !strings.Contains(block, "reverse_proxy localhost:8000\n") {
		t.Fatalf("the README's LLM gateway is not the site expected:\n%s", block)
	}
	site := strings.Replace(block, "llm.example.com {", "http://127.0.0.1:{{http_port}} {", 1)
	site = strings.Replace(site, "reverse_proxy localhost:8000", "reverse_proxy %[2]s", 1)
	site = strings.Replace(site, "\t\tzone llm-gateway\n", "\t\tzone llm-gateway\n\t\tredis %[1]s\n", 1)
	return startChargeCaddy(t, site, redisAddr, up.host())
}

const gatewayBudget = 50_000_000 // micro-dollars a day: the README's gateway's

// gatewayTokens is what the bucket of a limit or quota of the README's
// gateway holds for a key and model (admin API).
func gatewayTokens(t *testing.T, c *chargeCaddy, apiKey, model, limit string) float64 {
	t.Helper()
	var got struct {
		Buckets []struct {
			Limit  string          `json:"limit"`
			Tokens string          `json:"tokens"`
			Other  json.RawMessage `json:"quota"`
		} `json:"buckets"`
	}
	q := gatewayQuery(apiKey, model)
	resp, body := send(t, c.client, c.admin+bucketsPath("llm-gateway", q))
	if resp.StatusCode != 200 {
		t.Fatalf("admin API: %d %s", resp.StatusCode, body)
	}
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("admin API: %v: %s", err, body)
	}
	for _, b := range got.Buckets {
		if b.Limit == limit {
			v, err := strconv.ParseFloat(b.Tokens, 64)
			if err != nil {
				t.Fatalf("admin API: tokens %q", b.Tokens)
			}
			return v
		}
	}
	t.Fatalf("admin API: no bucket of %s in %s", limit, body)
	return 0
}

func ceilF(v float64) float64 { return math.Min(math.Ceil(v), maxExactTokens) }

// requestBodySites passes every request on, whatever its values
// (deny_empty_key false), with a bound of 4 KiB, so that the upstream
// shows what each body became.
const requestBodySites = `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone bodies
		redis %[1]s
		key {http.request.header.X-Body-Id}:{http.rate_limit.request.model}
		deny_empty_key false
		replenish_rate 1000
		burst_capacity 1000000
		request_body {
			json model max_tokens
			max_size 4KiB
		}
	}
	reverse_proxy %[2]s
}
`

// post sends body to path with the headers (name, value, ...), and
// reads the answer. A body of a *bytes.Reader or *strings.Reader is sent
// with its Content-Length, any other chunked, unless a header
// Content-Length says its length.
func post(t *testing.T, client *http.Client, url string, body io.Reader, headers ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, body)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if headers[i] == "Content-Length" {
			req.ContentLength, _ = strconv.ParseInt(headers[i+1], 10, 64)
		}
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestLLMUpstreamReceivesEveryBodyByteForByte: bodies that the limiter
// read in part, all, past its bound, or not at all (gzip) reach the
// upstream byte for byte, with and without Content-Length.
func TestLLMUpstreamReceivesEveryBodyByteForByte(t *testing.T) {
	srv := redistest.Start(t)
	up := startLLMUpstream(t)
	c := startChargeCaddy(t, requestBodySites, srv.Addr, up.host())
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	fmt.Fprintf(zw, `{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":%q}]}`, strings.Repeat("compressed ", 1000))
	zw.Close()
	bodies := map[string][]byte{
		"small":         []byte(`{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`),
		"found-early":   fmt.Appendf(nil, `{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":%q}]}`, strings.Repeat("x", 3<<20)),
		"past-bound":    fmt.Appendf(nil, `{"messages":[{"role":"user","content":%q}],"model":"gpt-4o","max_tokens":5}`, strings.Repeat("y", 64<<10)),
		"at-the-bound":  fmt.Appendf(nil, `{"messages":[{"content":%q}],"model":"m"}`, strings.Repeat("z", 4096-len(`{"messages":[{"content":""}],"model":"m"}`))),
		"gzip":          gz.Bytes(),
		"not-json":      []byte("model=gpt-4o&max_tokens=5"),
		"empty":         nil,
		"binary":        bytes.Repeat([]byte{0, 0xff, '{', '"'}, 10000),
		"one-byte-over": fmt.Appendf(nil, `{"messages":[{"content":%q}],"model":"m"}`, strings.Repeat("z", 4097-len(`{"messages":[{"content":""}],"model":"m"}`))),
	}
	for id, b := range bodies {
		for _, chunked := range []bool{false, true} {
			var r io.Reader = bytes.NewReader(b)
			if chunked {
				r = io.MultiReader(r) // hides the length: sent chunked
			}
			name := fmt.Sprintf("%s/chunked=%v", id, chunked)
			headers := []string{"X-Body-Id", name, "Content-Type", "application/json"}
			if id == "gzip" {
				headers = append(headers, "Content-Encoding", "gzip")
			}
			if status, answer := post(t, c.client, c.URL+"/v1/chat/completions", r, headers...); status != 200 {
				t.Fatalf("%s: %d %s", name, status, answer)
			}
			if got := up.body(t, name); got.sum != sha256.Sum256(b) || got.size != len(b) {
				t.Errorf("%s: the upstream received %d bytes (sha256 %x), not the %d sent", name, got.size, got.sum[:4], len(b))
			}
		}
	}
	// What each read set, as the buckets' keys show it.
	// found-early is larger than max_size: its rest could name the model
	// again, so it has none, and counts as too_large with past-bound and
	// one-byte-over (each sent twice).
	for id, model := range map[string]string{"small": "gpt-4o", "at-the-bound": "m"} {
		if b := getAdminBuckets(t, c.admin, "bodies", q("header.X-Body-Id", id+"/chunked=true", "http.rate_limit.request.model", model)); len(b) == 0 || b[0].Tokens == "" {
			t.Errorf("%s: no bucket keyed by the model %q", id, model)
		}
	}
	unread := scrapeMetricsAt(t, c.admin).samples
	for reason, least := range map[string]float64{"encoded": 2, "not_json": 2, "too_large": 6} {
		if n := unread[fmt.Sprintf(`caddy_rate_limit_request_body_unread_total{reason=%q,zone="bodies"}`, reason)]; n < least {
			t.Errorf("request_body_unread_total{reason=%q}: %v, want at least %v", reason, n, least)
		}
	}
}

// readmeGatewayLine is the first line of the README's LLM gateway that
// starts with prefix (after its tabs), such as its tokens limit's
// requested_tokens.
func readmeGatewayLine(t *testing.T, prefix string) string {
	t.Helper()
	for _, line := range strings.Split(readmeExample(t, "LLM gateway"), "\n") {
		if line = strings.TrimSpace(line); strings.HasPrefix(line, prefix) {
			return line
		}
	}
	t.Fatalf("the README's LLM gateway has no line %q", prefix)
	return ""
}

// TestLLMReservationOfTheReadmeCoversNChoicesAndMaxCompletionTokens: the
// README gateway's reservation of tokens (its request_body paths and its
// tokens limit's requested_tokens, as written) on a quota of 1,000 a
// day with max_debt 100: ten concurrent requests, each answered the
// most it allows (n × the larger of max_tokens and
// max_completion_tokens), are served no more than 1,100 tokens in all,
// with n: 5 and max_tokens: 100, and with max_tokens: 1 and
// max_completion_tokens: 500.
func TestLLMReservationOfTheReadmeCoversNChoicesAndMaxCompletionTokens(t *testing.T) {
	srv := redistest.Start(t)
	up := startLLMUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit /v1/chat/completions {
		zone covers
		redis %[1]s
		key {http.request.header.Authorization}
		request_body {
			`+readmeGatewayLine(t, "json ")+`
		}
		quota day 1000 per day {
			`+readmeGatewayLine(t, "requested_tokens ")+`
			charge json usage.completion_tokens
			charge_status 2xx
			max_debt 100
		}
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	const budget, maxDebt = 1000, 100
	for _, tc := range []struct{ name, body string }{
		{"n 5, max_tokens 100", `{"model":"m","n":5,"max_tokens":100,"messages":[{"role":"user","content":"Say hi."}]}`},
		{"max_tokens 1, max_completion_tokens 500", `{"model":"m","max_tokens":1,"max_completion_tokens":500,"messages":[{"role":"user","content":"Say hi."}]}`},
	} {
		up.release = make(chan struct{})
		spent := up.spent.Load()
		const clients = 10
		statuses := make(chan int, clients)
		for i := range clients {
			go func() {
				status, _ := post(t, c.client, c.URL+"/v1/chat/completions", strings.NewReader(tc.body), "Authorization", tc.name,
					"Content-Type", "application/json", "X-Body-Id", fmt.Sprintf("%s/%d", tc.name, i), "X-Hold", "1",
					"X-Prompt-Tokens", "0", "X-Completion-Tokens", "most")
				statuses <- status
			}()
		}
		// Every request is decided while the admitted ones are held: all
		// ten in flight at once.
		admitted, refused, done := 0, 0, 0
		for deadline := time.After(10 * time.Second); admitted+refused < clients; {
			select {
			case <-up.received:
				admitted++
			case status := <-statuses:
				done++
				if status != http.StatusTooManyRequests {
					t.Fatalf("%s: a request answered %d before the upstream released any", tc.name, status)
				}
				refused++
			case <-deadline:
				t.Fatalf("%s: %d admitted and %d refused within 10 s, of %d", tc.name, admitted, refused, clients)
			}
		}
		close(up.release)
		for ; done < clients; done++ {
			if status := <-statuses; status != 200 {
				t.Errorf("%s: an admitted request answered %d", tc.name, status)
			}
		}
		served := up.spent.Load() - spent
		t.Logf("%s: %d admitted, %d refused, %d tokens served", tc.name, admitted, refused, served)
		if served > budget+maxDebt || admitted == 0 {
			t.Errorf("%s: %d admitted of %d at once, served %d tokens: more than the budget %d + max_debt %d (or none admitted)",
				tc.name, admitted, clients, served, budget, maxDebt)
		}
	}
}

// TestLLMReadmeAnthropicMoneyExampleRunsAsWritten: the README's budget
// in money for Anthropic, with its site address, its upstream and a
// redis line replaced, charges each model's prices on the input, output
// and cache tokens, the same for a JSON answer, a stream and a current
// stream (whose message_delta repeats the cumulative counts); an
// upstream failure costs nothing, and a request without max_tokens is
// refused with 400.
func TestLLMReadmeAnthropicMoneyExampleRunsAsWritten(t *testing.T) {
	raw, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(raw), "\n### A budget in money for Anthropic\n")
	_, block, _ := strings.Cut(section, "```caddyfile\n")
	block, _, _ = strings.Cut(block, "```")
	upstream := "reverse_proxy https://api.anthropic.com {\n\t\theader_up Host {upstream_hostport}\n\t}"
	if !strings.HasPrefix(block, "api.example.com {") || !strings.Contains(block, upstream) || !strings.Contains(block, "\t\tzone anthropic-dollars\n") {
		t.Fatalf("the README's Anthropic money example is not the site expected:\n%s", block)
	}
	site := strings.Replace(block, "api.example.com {", "http://127.0.0.1:{{http_port}} {", 1)
	site = strings.Replace(site, upstream, "reverse_proxy %[2]s", 1)
	site = strings.Replace(site, "\t\tzone anthropic-dollars\n", "\t\tzone anthropic-dollars\n\t\tredis %[1]s\n", 1)
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, site, srv.Addr, up.host())
	charged := func() float64 {
		return scrapeMetricsAt(t, c.admin).samples[chargeSeries("charged_total", "anthropic-dollars", "dollars")]
	}
	const usage = "in=1000&out=200&cache_write=2000&cache_read=10000"
	for _, tc := range []struct {
		name, model, query string
		maxTokens          string
		status             int
		charged            float64
		chunked            bool // sent without Content-Length: reserved by its size as read
	}{
		// 1000 × 3 + 200 × 15 + 2000 × 3 × 1.25 + 10000 × 3 × 0.1
		{"claude-sonnet-4-5, a JSON answer", "claude-sonnet-4-5", usage, "1024", 200, 16_500, false},
		{"claude-sonnet-4-5, a stream", "claude-sonnet-4-5", usage + "&stream=1", "1024", 200, 16_500, false},
		{"claude-sonnet-4-5, a current stream", "claude-sonnet-4-5", usage + "&stream=1&delta_in=1", "1024", 200, 16_500, false},
		{"claude-sonnet-4-5, a body sent chunked", "claude-sonnet-4-5", usage, "1024", 200, 16_500, true},
		// 1000 × 1 + 200 × 5 + 2000 × 1 × 1.25 + 10000 × 1 × 0.1
		{"claude-haiku-4-5", "claude-haiku-4-5", usage, "1024", 200, 5_500, false},
		// 1000 × 15 + 200 × 75 + 2000 × 15 × 1.25 + 10000 × 15 × 0.1
		{"a model the map does not name", "claude-next", usage + "&stream=1&delta_in=1", "1024", 200, 82_500, false},
		{"an upstream failure", "claude-sonnet-4-5", usage + "&status=529", "1024", 529, 0, false},
		{"no max_tokens", "claude-sonnet-4-5", usage, "", 400, 0, false},
	} {
		before := charged()
		body := fmt.Sprintf(`{"model":%q,"max_tokens":%s,"messages":[{"role":"user","content":"Hi"}]}`, tc.model, tc.maxTokens)
		if tc.maxTokens == "" {
			body = fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"Hi"}]}`, tc.model)
		}
		var sent io.Reader = strings.NewReader(body)
		if tc.chunked {
			sent = io.MultiReader(sent) // hides the length: sent chunked
		}
		status, answer := post(t, c.client, c.URL+"/v1/messages?format=anthropic&"+tc.query, sent,
			"X-Api-Key", "sk-ant-1", "Content-Type", "application/json")
		if status != tc.status {
			t.Fatalf("%s: %d %s, want %d", tc.name, status, answer, tc.status)
		}
		eventually(t, 3*time.Second, tc.name+" charged", func() bool { return charged()-before == tc.charged })
	}
}

// vmHWM is the peak resident memory of a process, in bytes (Linux).
func vmHWM(t *testing.T, pid int) int64 {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM")
	return 0
}

// TestLLMBadRequestBodiesAnsweredByTheRules: through the README's
// gateway, bad bodies are answered as its rules say: a model that is not
// a string, number or boolean, a path given twice, invalid UTF-8 and a
// body too deep to follow leave the model empty (403, the key is
// empty); a max_tokens out of range is refused (400); a 100 MB body
// whose values come first passes, whole, and one whose values are past
// the bound is refused, with Caddy's memory well within 100 MB.
func TestLLMBadRequestBodiesAnsweredByTheRules(t *testing.T) {
	srv := redistest.Start(t)
	up := startLLMUpstream(t)
	c := startReadmeLLMGateway(t, srv.Addr, up)
	deep := `{"model":"gpt-4o","x":` + strings.Repeat("[", 100_000) + strings.Repeat("]", 100_000) + `,"max_tokens":5}`
	for _, tc := range []struct {
		name, body string
		status     int
	}{
		{"model as a number", `{"model":42,"max_tokens":5}`, 200},
		{"model as an object", `{"model":{"id":"gpt-4o"},"max_tokens":5}`, 403},
		{"model as an array", `{"model":["gpt-4o"],"max_tokens":5}`, 403},
		{"model twice", `{"model":"gpt-4o-mini","messages":[],"model":"gpt-4o","max_tokens":5}`, 403},
		{"invalid UTF-8", "{\"model\":\"gpt-4o\xff\",\"max_tokens\":5}", 403},
		{"nested 100,000 deep", deep, 403},
		{"max_tokens 1e308", `{"model":"gpt-4o","max_tokens":1e308}`, 400},
		{"max_tokens -5", `{"model":"gpt-4o","max_tokens":-5}`, 400},
		{"max_tokens abc", `{"model":"gpt-4o","max_tokens":"abc"}`, 400},
		{"not JSON", `model=gpt-4o`, 403},
	} {
		status, answer := post(t, c.client, c.URL+"/v1/chat/completions", strings.NewReader(tc.body),
			"Authorization", "Bearer sk-bad", "X-Body-Id", tc.name, "Content-Type", "application/json")
		if status != tc.status {
			t.Errorf("%s: %d %s, want %d", tc.name, status, answer, tc.status)
		}
		if status == 200 {
			if got := up.body(t, tc.name); got.sum != sha256.Sum256([]byte(tc.body)) {
				t.Errorf("%s: the upstream received another body", tc.name)
			}
		}
	}

	// 100 MB: more than the model's tokens could ever reserve at a
	// quarter token a byte.
	big := io.MultiReader(strings.NewReader(`{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":"`), io.LimitReader(repeatByte('a'), 100<<20))
	if status, answer := post(t, c.client, c.URL+"/v1/chat/completions", big, "Content-Length", strconv.Itoa(100<<20+100),
		"Authorization", "Bearer sk-big", "X-Body-Id", "100MB", "Content-Type", "application/json"); status != 400 {
		t.Fatalf("100 MB: %d %s, want 400 (its reservation is more than the burst)", status, answer)
	}
}

// TestLLMHundredMegabyteBodiesPassWholeWithinTheBound: a 100 MB body
// whose values come first is read as far as they are, then streamed
// through; one whose values lie past the bound leaves them empty. Both
// reach the upstream whole, and Caddy's peak memory grows by far less
// than a body.
func TestLLMHundredMegabyteBodiesPassWholeWithinTheBound(t *testing.T) {
	srv := redistest.Start(t)
	up := startLLMUpstream(t)
	c := startChargeCaddy(t, requestBodySites, srv.Addr, up.host())
	if status, _ := post(t, c.client, c.URL+"/", strings.NewReader(`{"model":"warm"}`), "X-Body-Id", "warm-up"); status != 200 {
		t.Fatalf("warm-up: %d", status)
	}
	before := vmHWM(t, c.PID())
	const size = 100 << 20
	for _, tc := range []struct{ name, head, tail, model string }{
		{"values-first", `{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":"`, `"}]}`, "gpt-4o"},
		{"values-last", `{"messages":[{"role":"user","content":"`, `"}],"model":"gpt-4o","max_tokens":5}`, ""},
	} {
		hash := sha256.New()
		body := io.MultiReader(strings.NewReader(tc.head), io.LimitReader(repeatByte('a'), size), strings.NewReader(tc.tail))
		length := len(tc.head) + size + len(tc.tail)
		if status, answer := post(t, c.client, c.URL+"/v1/chat/completions", io.TeeReader(body, hash), "Content-Length", strconv.Itoa(length),
			"X-Body-Id", tc.name, "Content-Type", "application/json"); status != 200 {
			t.Fatalf("%s: %d %s", tc.name, status, answer)
		}
		if got := up.body(t, tc.name); got.size != length || !bytes.Equal(got.sum[:], hash.Sum(nil)) {
			t.Fatalf("%s: the upstream received %d bytes, not the same %d", tc.name, got.size, length)
		}
		if tc.model != "" {
			if b := getAdminBuckets(t, c.admin, "bodies", q("header.X-Body-Id", tc.name, "http.rate_limit.request.model", tc.model)); len(b) == 0 {
				t.Errorf("%s: no bucket keyed by the model %q", tc.name, tc.model)
			}
		}
	}
	if grew := vmHWM(t, c.PID()) - before; grew > 32<<20 {
		t.Fatalf("Caddy's peak memory grew by %d MiB for two bodies of 100 MB, want at most 32 MiB (the bound is 4 KiB)", grew>>20)
	}
}

// repeatByte reads b forever.
type repeatByte byte

func (r repeatByte) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(r)
	}
	return len(p), nil
}

// BenchmarkServeHTTPLLM is BenchmarkServeHTTPCharged's charge_header case
// for an LLM gateway as make bench's llm@64: a 2 KiB JSON request body
// whose model and max_tokens request_body reads (max_tokens at its end),
// a key per model, prices as a map would give them, a weighted
// reservation and a weighted settlement from a JSON answer's usage; the
// next handler reads the body, as a proxy does. "no_paths" is the same
// handler without request_body, reservation or settlement from the body
// (a fixed requested_tokens, charge json usage.total_tokens), for scale.
func BenchmarkServeHTTPLLM(b *testing.B) {
	payload, err := os.ReadFile("bench/llm-request.json")
	if err != nil {
		b.Fatal(err)
	}
	answer := []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":500,"completion_tokens":100,"total_tokens":600}}`)
	jsonType := []string{"application/json"}
	upstream := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return err
		}
		w.Header()["Content-Type"] = jsonType
		w.WriteHeader(http.StatusOK)
		_, err := w.Write(answer)
		return err
	})
	for _, c := range []struct {
		name      string
		configure func(h *Handler)
	}{
		{"no_paths", func(h *Handler) {
			h.RequestedTokens = "3280"
			h.Charge = &Charge{JSON: []string{"usage.total_tokens"}}
		}},
		{"llm", func(h *Handler) {
			h.Key = "{http.request.header.X-Key}:{http.rate_limit.request.model}"
			h.RequestBody = &RequestBody{JSON: []string{"model", "max_tokens"}}
			h.RequestedTokens = "{http.rate_limit.request.max_tokens:4096}*{out_price} {http.rate_limit.request_size}*{in_byte_price}"
			h.Charge = &Charge{JSON: []string{"usage.prompt_tokens*{in_price}", "usage.completion_tokens*{out_price}"}}
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			srv := redistest.Start(b)
			h := &Handler{Zone: "bench-llm", Key: "{http.request.header.X-Key}", ReplenishRate: "1e9", BurstCapacity: "1000000000",
				Redis: &RedisConfig{Addresses: []string{srv.Addr}, Timeout: caddy.Duration(2 * time.Second)}}
			c.configure(h)
			provision(b, h)
			observeLogs(h, zap.InfoLevel)
			// The map's outputs, boxed once as map's would be per request.
			prices := [][2]any{{"in_price", "2.5"}, {"out_price", "10"}, {"in_byte_price", "0.625"}}
			length := []string{strconv.Itoa(len(payload))}
			var clients atomic.Int64
			b.SetParallelism(32)
			b.ReportAllocs()
			cpu := processCPU()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				n := clients.Add(1)
				r, w := benchRequest(fmt.Sprintf("192.0.2.%d", n%250+1), "client-"+strconv.FormatInt(n, 10))
				r.Method = http.MethodPost
				r.Header["Content-Length"] = length
				r.ContentLength = int64(len(payload))
				repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
				for _, p := range prices {
					repl.Set(p[0].(string), p[1])
				}
				body := new(benchBody)
				for pb.Next() {
					w.h = freshHeader()
					body.Reset(payload)
					r.Body = body
					if err := h.ServeHTTP(w, r, upstream); err != nil || w.status != http.StatusOK {
						b.Errorf("goroutine %d: %v %d", n, err, w.status)
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(processCPU()-cpu)/float64(b.N), "cpu-ns/op")
		})
	}
}

// benchBody is a request body read again for each request.
type benchBody struct{ bytes.Reader }

func (*benchBody) Close() error { return nil }

// gatewayQuery names a client of the README's gateway in the admin API:
// its API key and model.
func gatewayQuery(apiKey, model string) map[string][]string {
	return q("header.Authorization", "Bearer "+apiKey, "http.rate_limit.request.model", model,
		// The values the admin API resolves with the keys: any will do.
		"http.rate_limit.request.max_tokens:4096", "1", "http.rate_limit.request.max_completion_tokens:0", "1", "http.rate_limit.request.n:1", "1",
		"http.rate_limit.request_size", "1", "in_byte_price", "1", "out_price", "1")
}

// heldReservation posts body to the README's gateway c as apiKey, with
// the headers, while the upstream holds its answer, and reads what the
// request reserved of its model's tokens and of the budget meanwhile
// (each bucket fresh before); then lets the answer go. The model's
// tokens refill meanwhile: reservedTokens says whether tokens is what
// they show. The status is the gateway's when it answered without the
// upstream.
func heldReservation(t *testing.T, c *chargeCaddy, up *llmUpstream, apiKey, model, id string, body io.Reader, headers ...string) (status int, reservedTokens func(tokens float64) bool, dollars float64) {
	t.Helper()
	up.release = make(chan struct{})
	done := make(chan int, 1)
	defer func() {
		close(up.release)
		<-done // before the next request may replace up.release
	}()
	headers = append(headers, "Authorization", "Bearer "+apiKey, "X-Body-Id", id, "X-Hold", "1", "Content-Type", "application/json")
	start := time.Now()
	go func() {
		status, _ := post(t, c.client, c.URL+"/v1/chat/completions", body, headers...)
		done <- status
	}()
	select {
	case status := <-done:
		done <- status // for the deferred wait
		return status, nil, 0
	case <-up.received:
	}
	taken := 100000 - gatewayTokens(t, c, apiKey, model, "tokens")
	refilled := time.Since(start).Seconds()*100000/60 + 1 // and a token for Redis's clock against this one
	dollars = gatewayBudget - gatewayTokens(t, c, apiKey, model, "dollars")
	return 200, func(tokens float64) bool { return taken <= tokens && taken >= tokens-refilled }, dollars
}

// TestLLMGatewayReadsAKeyInAnotherCaseAsThePathGivenAgain: a Go upstream
// (this test's own, decoding into a struct) reads `MODEL` as `model` and
// keeps the last, so through the README's gateway a dear model named in
// capitals after a cheap one leaves the model empty (403, the key is
// empty), and a max_tokens of 1 followed by MAX_TOKENS 900 (K, the
// Kelvin sign, too) reserves what a body without max_tokens reserves:
// 4,096, not 1.
func TestLLMGatewayReadsAKeyInAnotherCaseAsThePathGivenAgain(t *testing.T) {
	srv := redistest.Start(t)
	up := startLLMUpstream(t)
	c := startReadmeLLMGateway(t, srv.Addr, up)
	for _, body := range []string{
		`{"model":"gpt-4o-mini","MODEL":"gpt-4o","max_tokens":600}`,
		`{"Model":"gpt-4o","max_tokens":600}`,
	} {
		if status, answer := post(t, c.client, c.URL+"/v1/chat/completions", strings.NewReader(body),
			"Authorization", "Bearer sk-case", "Content-Type", "application/json"); status != http.StatusForbidden {
			t.Errorf("%s: %d %s, want 403 (no model)", body, status, answer)
		}
	}
	for i, body := range []string{
		`{"model":"gpt-4o","max_tokens":1,"MAX_TOKENS":900}`,
		`{"model":"gpt-4o","max_tokens":1,"max_to` + "\u212a" + `ens":900}`,
	} {
		key := fmt.Sprintf("sk-case-%d", i)
		status, reserved, dollars := heldReservation(t, c, up, key, "gpt-4o", key, strings.NewReader(body))
		bytesTokens, bytesDollars := ceilF(float64(len(body))*0.25), ceilF(float64(len(body))*0.625)
		if status != 200 || !reserved(4096+bytesTokens) || dollars != 4096*10+bytesDollars {
			t.Errorf("%s: %d, reserved %.0f of the budget, want 40,960 + %.0f, and 4,096 + %.0f tokens: %v (max_tokens unknown: its default)",
				body, status, dollars, bytesDollars, bytesTokens, reserved != nil && reserved(4096+bytesTokens))
		}
	}
}

// TestLLMGatewayReservesAChunkedBodyByItsSize: a body sent without
// Content-Length (chunked, as streaming and HTTP/2 clients may send it)
// passes the README's gateway, which reserves by the body's size as
// read, {http.rate_limit.request_size}: the same as for the same body
// with Content-Length. A chunked body larger than max_size, or not JSON,
// has no size (nor values): its reservation is refused, 400.
func TestLLMGatewayReservesAChunkedBodyByItsSize(t *testing.T) {
	srv := redistest.Start(t)
	up := startLLMUpstream(t)
	c := startReadmeLLMGateway(t, srv.Addr, up)
	body := `{"model":"gpt-4o","max_tokens":100,"messages":[{"role":"user","content":"` + strings.Repeat("x", 3000) + `"}]}`
	for _, chunked := range []bool{false, true} {
		var r io.Reader = strings.NewReader(body)
		if chunked {
			r = io.MultiReader(r) // hides the length: sent chunked
		}
		key := fmt.Sprintf("sk-chunked-%v", chunked)
		status, reserved, dollars := heldReservation(t, c, up, key, "gpt-4o", key, r)
		if status != 200 {
			t.Fatalf("chunked %v: %d, want 200", chunked, status)
		}
		if got := up.body(t, key); got.size != len(body) {
			t.Fatalf("chunked %v: the upstream received %d bytes of %d", chunked, got.size, len(body))
		}
		bytesTokens, bytesDollars := ceilF(float64(len(body))*0.25), ceilF(float64(len(body))*0.625)
		if !reserved(100+bytesTokens) || dollars != 100*10+bytesDollars {
			t.Errorf("chunked %v: reserved %.0f of the budget, want 1,000 + %.0f, and 100 + %.0f tokens: %v",
				chunked, dollars, bytesDollars, bytesTokens, reserved(100+bytesTokens))
		}
	}
	if status, answer := post(t, c.client, c.URL+"/v1/chat/completions", io.MultiReader(strings.NewReader("model=gpt-4o")),
		"Authorization", "Bearer sk-chunked-form", "Content-Type", "application/x-www-form-urlencoded"); status != http.StatusBadRequest {
		t.Errorf("a chunked body that is not JSON: %d %s, want 400 (no size)", status, answer)
	}
	large := io.MultiReader(strings.NewReader(`{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":"`), io.LimitReader(repeatByte('a'), 2<<20), strings.NewReader(`"}]}`))
	if status, answer := post(t, c.client, c.URL+"/v1/chat/completions", large,
		"Authorization", "Bearer sk-chunked-large", "Content-Type", "application/json"); status != http.StatusBadRequest {
		t.Errorf("a chunked body of 2 MiB: %d %s, want 400 (past max_size: no size)", status, answer)
	}
}
