package ratelimit

import (
	"bufio"
	"cmp"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redisstore"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddy-redis/ratelimit/internal/scan"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

// Settling what responses cost (charge.go, settle.lua): settle.lua in a
// real redis-server against tokenbucket.SettleAt (whose arithmetic
// without any process its package tests), and the take script on a
// bucket in debt.

// storeSettleStep is runScriptStep for settle.lua: one MULTI that stores
// b's tokens at key, elapsed microseconds before Redis's time (an absent
// b deletes the key), and settles between two TIME calls. It returns the
// bucket as stored, the two times, the tokens forgiven (whole tokens
// and millionths), the bucket afterwards and its TTL.
func storeSettleStep(t *testing.T, rdb *redis.Client, key string, b scriptBucket, elapsed int64, args []any) (
	stored scriptBucket, t0 int64, forgiven [2]int64, t1 int64, after scriptBucket, ttl int64) {
	t.Helper()
	ctx := context.Background()
	var (
		before, then   *redis.StringCmd
		clock0, clock1 *redis.TimeCmd
		settle         *redis.Cmd
		pttl           *redis.DurationCmd
	)
	_, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		if b.present {
			p.Eval(ctx, storeBucket, []string{key}, strconv.FormatFloat(b.tokens, 'g', 17, 64), elapsed)
		} else {
			p.Del(ctx, key)
		}
		before, clock0 = p.Get(ctx, key), p.Time(ctx)
		settle = p.EvalSha(ctx, settleScript.SHA(), []string{key}, args...)
		clock1, then, pttl = p.Time(ctx), p.Get(ctx, key), p.PTTL(ctx, key)
		return nil
	})
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	v, err := settle.Int64Slice()
	if err != nil || len(v) != 2 || v[1] < 0 || v[1] >= 1e6 {
		t.Fatalf("settle reply %v, %v", v, err)
	}
	if stored, err = parseBucket(before); err == nil {
		after, err = parseBucket(then)
	}
	if err != nil {
		t.Fatal(err)
	}
	return stored, clock0.Val().UnixMicro(), [2]int64(v), clock1.Val().UnixMicro(), after, pttl.Val().Milliseconds()
}

// TestSettleScriptAgreesWithMemoryStore: settle.lua in a real
// redis-server and tokenbucket.SettleAt agree on the tokens stored, the tokens
// forgiven and the key's life, over random buckets (full, fractional, in
// debt, missing) and differences (give-backs past the burst, takes past
// -max_debt); and the take script on the bucket afterwards answers a
// remaining of 0 in debt and the exact wait.
func TestSettleScriptAgreesWithMemoryStore(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	for _, src := range []string{settleSource, scriptSource} {
		if err := rdb.ScriptLoad(ctx, src).Err(); err != nil {
			t.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(3, 21))
	debts, forgivenSeen, cappedSeen := 0, 0, 0
	for i, l := range bucketLimits {
		v := limit.Values{Rate: l.rate, Burst: l.burst, Requested: l.requested}
		maxDebt := []int64{0, l.burst, 3 * l.burst}[i%3]
		for n := range 300 {
			key := fmt.Sprintf("settle:%d:%d", i, n)
			var b scriptBucket
			if rng.IntN(8) > 0 {
				b = scriptBucket{present: true, tokens: float64(l.burst) * (rng.Float64()*2.5 - 1.4)}
				if rng.IntN(3) == 0 {
					b.tokens = math.Round(b.tokens)
				}
			}
			elapsed := rng.Int64N(fillMicros(l.rate, l.burst) / 2)
			diff := rng.Int64N(3*l.burst) - l.burst
			args := []any{tokenbucket.Args(v)[0], tokenbucket.Args(v)[1], redisstore.DiffArg(diff), strconv.FormatInt(maxDebt, 10)}
			stored, t0, forgiven, t1, after, ttl := storeSettleStep(t, rdb, key, b, elapsed, args)
			what := fmt.Sprintf("%s: bucket %+v, diff %d, max_debt %d", l.name, stored, diff, maxDebt)
			if after.at < t0 && after.present || after.at > t1 {
				t.Fatalf("%s: the script's time %d is outside [%d, %d]", what, after.at, t0, t1)
			}
			now := after.at
			if !after.present { // a full bucket without a key stays so: any time will do
				now = t0
			}
			want, wantForgiven := tokenbucket.SettleAt(stored.state(now, l.burst), now, v, diff, maxDebt)
			if !after.present {
				if stored.present || want.Tokens != float64(l.burst) {
					t.Fatalf("%s: no key after, tokenbucket.SettleAt says %+v", what, want)
				}
				continue
			}
			whole := math.Floor(wantForgiven)
			if after.tokens != want.Tokens || forgiven != [2]int64{int64(whole), int64(math.Floor((wantForgiven - whole) * 1e6))} {
				t.Fatalf("%s: the script stored %v and forgave %d, tokenbucket.SettleAt %v and %v", what, after.tokens, forgiven, want.Tokens, wantForgiven)
			}
			// PTTL is read after t1: the key has lived that much longer.
			if wantTTL := (want.Expires - now) / 1000; ttl > wantTTL || ttl < wantTTL-5-(t1-now)/1000 {
				t.Fatalf("%s: TTL %d ms, want %d (until full again)", what, ttl, wantTTL)
			}
			if after.tokens < -float64(maxDebt) && after.tokens < stored.tokens {
				t.Fatalf("%s: the bucket went below -max_debt to %v", what, after.tokens)
			}
			if wantForgiven > 0 {
				forgivenSeen++
			}
			if diff < 0 && after.tokens == float64(l.burst) {
				cappedSeen++
			}
			if after.tokens < 0 {
				debts++
				// The take script in debt: refused, remaining 0 (not
				// negative), the wait until the reservation fits.
				take := limitArgs(l.rate, l.burst, l.requested)
				var took *redis.Cmd
				var clock *redis.TimeCmd
				if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
					took, clock = p.EvalSha(ctx, scriptSHA, []string{key}, take[:]...), p.Time(ctx)
					return nil
				}); err != nil {
					t.Fatalf("%s: take in debt: %v", what, err)
				}
				reply, err := took.Int64Slice()
				if err != nil || len(reply) != 3 {
					t.Fatalf("%s: take in debt: %v %v", what, reply, err)
				}
				// The take runs a moment after the settlement, before the
				// clock was read: its wait is shorter by that moment.
				maxWait := int64(math.Ceil((float64(l.requested) - after.tokens) * 1e6 / l.rate))
				minWait := maxWait - (clock.Val().UnixMicro() - now) - 1
				if reply[0] != 0 || reply[1] != 0 || reply[2] > maxWait || reply[2] < minWait {
					t.Fatalf("%s: take at %v tokens: %v; want refused, remaining 0, a wait of %d to %d µs", what, after.tokens, reply, minWait, maxWait)
				}
			}
		}
	}
	// A cost as large as costs go (2^53): nothing overflows, and all but
	// what the bucket could give is forgiven, to the token.
	_, _, forgiven, _, after, _ := storeSettleStep(t, rdb, "settle:huge", scriptBucket{}, 0,
		[]any{"1", "1000", strconv.FormatInt(maxExactTokens-1, 10), "1000"})
	if after.tokens != -1000 || forgiven != [2]int64{maxExactTokens - 1 - 2000, 0} {
		t.Errorf("a cost of 2^53: %v tokens after, %v tokens forgiven; want -1000 and 2^53-2001", after.tokens, forgiven)
	}
	t.Logf("%d settlements into debt, %d forgave, %d give-backs capped at the burst", debts, forgivenSeen, cappedSeen)
	if debts < 100 || forgivenSeen < 50 || cappedSeen < 50 {
		t.Fatalf("the random settlements tried too little")
	}
}

// ---- Through a real Caddy (internal/caddyproc) with reverse_proxy to an
// upstream written here, and a real redis-server.

// chargeUpstream answers as the APIs that charging reads do. Each request
// says in its query what to answer:
//
//	format=openai     a chat completion (JSON), or with stream=1 its event
//	                  stream, usage=N its usage.total_tokens (none without);
//	                  logprobs=N gives the JSON answer the logprobs of N
//	                  tokens (about 90 bytes each) before its usage, or
//	                  after it with early=1
//	format=responses  a stream of OpenAI's Responses API, whose
//	                  response.completed event repeats the text=N bytes
//	                  of output before its usage (usage=N)
//	format=anthropic  a message (JSON), or with stream=1 its event stream:
//	                  in=N input and out=N output tokens, cache_write=N
//	                  and cache_read=N cache tokens; with delta_in=1
//	                  message_delta carries the cumulative input tokens as
//	                  well as the output tokens, as the API does now
//	format=ollama     Ollama's native stream (JSON lines): in=N, out=N;
//	                  ct=<Content-Type> instead of application/x-ndjson,
//	                  nonl=1 without a newline after the last line
//	format=raw        ct=<Content-Type> and body=<text> as given
//	format=big        size=N bytes of pseudo-random data (seed=S)
//	format=paced      an OpenAI event stream of chunks=N chunks and a
//	                  usage chunk (usage=N), each sent only once the test
//	                  acknowledged the one before on acks (late says when
//	                  it did not within 5 s)
//
//	format=upgrade    101 Switching Protocols (a WebSocket), then echoes
//	                  what the client sends until it closes
//
// and for any of them cost=<text> as the X-Cost header (with
// trailer=declared, as a trailer named in the Trailer header; with
// trailer=undeclared, as a trailer named nowhere before) and status=N as
// the status. hold=1 holds the response until release is closed or the
// request is canceled (the client left), after the first event of a
// stream; wait=1 holds it so before anything is written, and says so on
// waiting.
type chargeUpstream struct {
	*httptest.Server
	release  chan struct{}
	waiting  chan string // the formats of requests held before their headers
	canceled chan string // the formats of held requests canceled
	acks     chan int
	late     chan string
}

func startChargeUpstream(t *testing.T) *chargeUpstream {
	u := &chargeUpstream{release: make(chan struct{}), waiting: make(chan string, 16), canceled: make(chan string, 16),
		acks: make(chan int), late: make(chan string, 64)}
	u.Server = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.Close)
	return u
}

// host is the upstream's address, for reverse_proxy.
func (u *chargeUpstream) host() string { return strings.TrimPrefix(u.URL, "http://") }

func (u *chargeUpstream) serve(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	num := func(name string) int { n, _ := strconv.Atoi(q.Get(name)); return n }
	if q.Get("wait") == "1" {
		u.waiting <- q.Get("format")
		select {
		case <-u.release:
		case <-r.Context().Done():
			u.canceled <- q.Get("format")
			return
		}
	}
	switch cost := q.Get("cost"); {
	case cost == "":
	case q.Get("trailer") == "declared":
		w.Header().Set("Trailer", "X-Cost")
		defer w.Header().Set("X-Cost", cost)
	case q.Get("trailer") == "undeclared":
		defer w.Header().Set(http.TrailerPrefix+"X-Cost", cost)
	default:
		w.Header().Set("X-Cost", cost)
	}
	status := cmp.Or(num("status"), http.StatusOK)
	stream := q.Get("stream") == "1"
	var events []string // each written and flushed on its own
	switch q.Get("format") {
	case "openai":
		usage := ""
		if q.Has("usage") {
			usage = fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`, num("usage")/3, num("usage")-num("usage")/3, num("usage"))
		}
		if !stream {
			w.Header().Set("Content-Type", "application/json")
			var logprobs strings.Builder
			for i := range num("logprobs") {
				if i > 0 {
					logprobs.WriteByte(',')
				}
				fmt.Fprintf(&logprobs, `{"token":"tok%05d","logprob":-0.0123,"bytes":[116,111,107],"top_logprobs":[]}`, i)
			}
			choices := fmt.Sprintf(`"choices":[{"index":0,"message":{"role":"assistant","content":"Hello!"},"logprobs":{"content":[%s]},"finish_reason":"stop"}]`, logprobs.String())
			usage = `"usage":` + cmp.Or(usage, "null")
			if q.Get("early") == "1" {
				choices, usage = usage, choices
			}
			events = []string{fmt.Sprintf(`{"id":"chatcmpl-1","object":"chat.completion",%s,%s}`, choices, usage)}
			break
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for _, word := range []string{"Hel", "lo", "!"} {
			events = append(events, fmt.Sprintf("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":%q}}],\"usage\":null}\n\n", word))
		}
		if usage != "" {
			events = append(events, fmt.Sprintf("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":%s}\n\n", usage))
		}
		events = append(events, "data: [DONE]\n\n")
	case "responses":
		text, _ := json.Marshal(strings.Repeat("word ", num("text")/5))
		in := num("usage") / 3
		w.Header().Set("Content-Type", "text/event-stream")
		events = []string{
			"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null}}\n\n",
			fmt.Sprintf("event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":%s}\n\n", text),
			fmt.Sprintf("event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":2,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\","+
				"\"output\":[{\"id\":\"msg_1\",\"type\":\"message\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":%s,\"annotations\":[]}]}],"+
				"\"usage\":{\"input_tokens\":%d,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":%d,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":%d}}}\n\n",
				text, in, num("usage")-in, num("usage")),
		}
	case "anthropic":
		// As the Messages API answers: usage counts cache reads and writes
		// apart from input_tokens.
		if !stream {
			w.Header().Set("Content-Type", "application/json")
			events = []string{fmt.Sprintf(`{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Hi"}],"stop_reason":"end_turn","stop_sequence":null,`+
				`"usage":{"input_tokens":%d,"cache_creation_input_tokens":%d,"cache_read_input_tokens":%d,"output_tokens":%d,"service_tier":"standard"}}`, num("in"), num("cache_write"), num("cache_read"), num("out"))}
			break
		}
		deltaUsage := fmt.Sprintf(`{"output_tokens":%d}`, num("out"))
		if q.Get("delta_in") == "1" { // cumulative, as message_delta reports them now
			deltaUsage = fmt.Sprintf(`{"input_tokens":%d,"cache_creation_input_tokens":%d,"cache_read_input_tokens":%d,"output_tokens":%d}`, num("in"), num("cache_write"), num("cache_read"), num("out"))
		}
		w.Header().Set("Content-Type", "text/event-stream")
		events = []string{
			fmt.Sprintf("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,"+
				"\"usage\":{\"input_tokens\":%d,\"cache_creation_input_tokens\":%d,\"cache_read_input_tokens\":%d,\"output_tokens\":1,\"service_tier\":\"standard\"}}}\n\n", num("in"), num("cache_write"), num("cache_read")),
			"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
			"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
			"event: ping\ndata: {\"type\": \"ping\"}\n\n",
			"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
			fmt.Sprintf("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":%s}\n\n", deltaUsage),
			"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
		}
	case "ollama":
		w.Header().Set("Content-Type", cmp.Or(q.Get("ct"), "application/x-ndjson"))
		last := fmt.Sprintf("{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"prompt_eval_count\":%d,\"eval_count\":%d}\n", num("in"), num("out"))
		if q.Get("nonl") == "1" {
			last = strings.TrimSuffix(last, "\n")
		}
		events = []string{"{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"Hi\"},\"done\":false}\n", last}
	case "raw":
		w.Header().Set("Content-Type", q.Get("ct"))
		events = []string{q.Get("body")}
	case "paced":
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(status)
		for i := range num("chunks") + 1 {
			event := fmt.Sprintf("data: {\"choices\":[{\"delta\":{\"content\":\"chunk %d\"}}],\"usage\":null}\n\n", i)
			if i == num("chunks") {
				event = fmt.Sprintf("data: {\"choices\":[],\"usage\":{\"total_tokens\":%d}}\n\n", num("usage"))
			}
			_, _ = io.WriteString(w, event)
			_ = http.NewResponseController(w).Flush()
			select {
			case got := <-u.acks:
				if got != i {
					u.late <- fmt.Sprintf("chunk %d acknowledged as %d", i, got)
				}
			case <-time.After(5 * time.Second):
				u.late <- fmt.Sprintf("chunk %d did not reach the client within 5 s, before the next was due", i)
			case <-r.Context().Done():
				return
			}
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
		return
	case "upgrade":
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		defer conn.Close()
		_, _ = rw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		if rw.Flush() == nil {
			_, _ = io.Copy(conn, rw)
		}
		return
	case "big":
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(num("size")))
		w.WriteHeader(status)
		_, _ = io.Copy(w, pseudoRandom(uint64(num("seed")), num("size")))
		return
	}
	w.WriteHeader(status)
	for i, e := range events {
		_, _ = io.WriteString(w, e)
		_ = http.NewResponseController(w).Flush()
		if i == 0 && q.Get("hold") == "1" {
			select {
			case <-u.release:
			case <-r.Context().Done():
				u.canceled <- q.Get("format")
				return
			}
		}
	}
}

// pseudoRandom is n bytes of a stream that the seed fixes.
func pseudoRandom(seed uint64, n int) io.Reader {
	return io.LimitReader(rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)}), int64(n))
}

// chargeCaddy is a Caddy process serving sites (their %[1]s is the Redis
// address, %[2]s the upstream's), and its admin endpoint.
type chargeCaddy struct {
	*caddyproc.Instance
	admin  string
	client *http.Client
}

func startChargeCaddy(t *testing.T, sites, redisAddr, upstream string) *chargeCaddy {
	t.Helper()
	inst := caddyproc.Start(t, caddyproc.Caddyfile(fmt.Sprintf(sites, redisAddr, upstream)))
	return &chargeCaddy{Instance: inst, admin: fmt.Sprintf("http://127.0.0.1:%d", inst.AdminPort), client: caddyClient(t)}
}

// get sends GET path with the headers (name, value, ...) and reads the
// body.
func (c *chargeCaddy) get(t *testing.T, path string, headers ...string) (*http.Response, string) {
	t.Helper()
	return send(t, c.client, c.URL+path, headers...)
}

// tokensOf reads what a client's bucket holds now (admin API).
func (c *chargeCaddy) tokensOf(t *testing.T, zone, key string) float64 {
	t.Helper()
	return c.limitTokens(t, zone, q("header.X-Key", key), "")
}

// limitTokens reads what the bucket of a limit (by name; "" for a
// handler without limits) holds for the client the query names.
func (c *chargeCaddy) limitTokens(t *testing.T, zone string, query url.Values, limit string) float64 {
	t.Helper()
	for _, b := range getAdminBuckets(t, c.admin, zone, query) {
		if b.Limit == limit {
			return b.tokens(t)
		}
	}
	t.Fatalf("zone %s has no bucket of limit %q for %v", zone, limit, query)
	return 0
}

// awaitTokens waits until the bucket holds want, give or take slack (the
// refill): settlements land just after the response.
func (c *chargeCaddy) awaitTokens(t *testing.T, zone, key string, want, slack float64) {
	t.Helper()
	c.awaitLimitTokens(t, zone, q("header.X-Key", key), "", want, slack)
}

func (c *chargeCaddy) awaitLimitTokens(t *testing.T, zone string, query url.Values, limit string, want, slack float64) {
	t.Helper()
	start := time.Now()
	for got := c.limitTokens(t, zone, query, limit); got < want || got > want+slack; got = c.limitTokens(t, zone, query, limit) {
		if time.Since(start) > 10*time.Second {
			t.Fatalf("the %s bucket %q of %v holds %v, not %v (+%v), after 10 s", zone, limit, query, got, want, slack)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// llmSites are handlers that charge what each API style reports, with a
// reservation of 100 from a bucket of 1000 that refills a token every
// 1000 s (negligible during a test).
const llmSites = `
http://127.0.0.1:{{http_port}} {
	rate_limit /openai {
		zone openai
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.total_tokens
		headers both
		redis %[1]s
	}
	rate_limit /anthropic {
		zone anthropic
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.input_tokens message.usage.input_tokens usage.output_tokens
		redis %[1]s
	}
	rate_limit /responses {
		zone responses
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json response.usage.total_tokens
		redis %[1]s
	}
	rate_limit /ollama {
		zone ollama
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json prompt_eval_count eval_count
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`

// TestChargeUsageFromJSONAndStreamsExactly: OpenAI's chat completion and
// its event stream (usage in the last chunk), Anthropic's message and its
// stream (input tokens in message_start, output in message_delta) and
// Ollama's JSON lines are each charged exactly what they report: a
// smaller cost gives back the rest of the reservation, a larger one takes
// more. The admin API shows it, and the next response's headers, which
// describe the bucket after that response's reservation.
func TestChargeUsageFromJSONAndStreamsExactly(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, llmSites, srv.Addr, up.host())
	for _, tc := range []struct {
		name, zone  string
		query       func(cost int) string
		bodyHas     string
		contentType string
	}{
		{"OpenAI JSON", "openai", func(n int) string { return fmt.Sprintf("format=openai&usage=%d", n) }, `"total_tokens"`, "application/json"},
		{"OpenAI stream", "openai", func(n int) string { return fmt.Sprintf("format=openai&stream=1&usage=%d", n) }, "data: [DONE]", "text/event-stream"},
		{"Anthropic JSON", "anthropic", func(n int) string { return fmt.Sprintf("format=anthropic&in=%d&out=%d", n/4, n-n/4) }, `"output_tokens"`, "application/json"},
		{"Anthropic stream", "anthropic", func(n int) string { return fmt.Sprintf("format=anthropic&stream=1&in=%d&out=%d", n/4, n-n/4) }, "message_stop", "text/event-stream"},
		{"Ollama JSON lines", "ollama", func(n int) string { return fmt.Sprintf("format=ollama&in=%d&out=%d", n/4, n-n/4) }, `"done":true`, "application/x-ndjson"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := strings.ReplaceAll(tc.name, " ", "-")
			path := "/" + tc.zone + "?"
			tokens := 1000.0
			for i, cost := range []int{37, 250, 100, 0, 512} {
				resp, body := c.get(t, path+tc.query(cost), "X-Key", key)
				wantRemaining := strconv.Itoa(int(tokens) - 100)
				if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != wantRemaining ||
					!strings.Contains(body, tc.bodyHas) || resp.Header.Get("Content-Type") != tc.contentType {
					t.Fatalf("request %d: %d, X-RateLimit-Remaining %q, %s %q; want 200 with %s and the upstream's body",
						i+1, resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), resp.Header.Get("Content-Type"), body, wantRemaining)
				}
				if tc.zone == "openai" {
					if want := fmt.Sprintf(`"openai";r=%s;t=0`, wantRemaining); resp.Header.Get("RateLimit") != want {
						t.Errorf("request %d: RateLimit %q, want %q", i+1, resp.Header.Get("RateLimit"), want)
					}
				}
				tokens -= float64(cost)
				c.awaitTokens(t, tc.zone, key, tokens, 0.05)
			}
		})
	}
}

// TestChargeStreamedEventOfAnySizeIsRead: OpenAI's Responses API ends a
// stream with response.completed, whose data repeats the whole output
// text before its usage; an answer of any length is charged that usage,
// the event's size is no reason to stop reading it.
func TestChargeStreamedEventOfAnySizeIsRead(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, llmSites, srv.Addr, up.host())
	tokens := 1000.0
	for _, text := range []int{1000, 86 << 10, 1 << 20} {
		key := fmt.Sprintf("text-%d", text)
		resp, body := c.get(t, fmt.Sprintf("/responses?format=responses&text=%d&usage=%d", text, 321), "X-Key", key)
		if resp.StatusCode != 200 || !strings.Contains(body, "event: response.completed") || len(body) < 2*text {
			t.Fatalf("a %d-byte answer: %d with %d bytes, want 200 with the stream", text, resp.StatusCode, len(body))
		}
		c.awaitTokens(t, "responses", key, tokens-321, 0.05)
	}
}

// TestChargeLastJSONLineWithoutNewlineIsRead: JSON Lines allows the last
// line without a newline, and that line carries the usage (Ollama's
// done: true); it is read at the end of the body, in
// application/x-ndjson and application/jsonl alike.
func TestChargeLastJSONLineWithoutNewlineIsRead(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, llmSites, srv.Addr, up.host())
	for _, ct := range []string{"application/x-ndjson", "application/jsonl"} {
		resp, body := c.get(t, "/ollama?format=ollama&in=26&out=290&nonl=1&ct="+url.QueryEscape(ct), "X-Key", ct)
		if resp.StatusCode != 200 || !strings.HasSuffix(body, `"eval_count":290}`) || resp.Header.Get("Content-Type") != ct {
			t.Fatalf("%s: %d, %s %q; want 200 with the lines, the last without a newline", ct, resp.StatusCode, resp.Header.Get("Content-Type"), body)
		}
		c.awaitTokens(t, "ollama", ct, 1000-316, 0.05)
	}
}

// TestChargeJSONBodyOverOneMiBIsChargedItsUsage: a client that inflates
// its answer past 1 MiB (logprobs of many tokens) is charged the usage
// that the answer reports at its end, not the reservation.
func TestChargeJSONBodyOverOneMiBIsChargedItsUsage(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, llmSites, srv.Addr, up.host())
	resp, body := c.get(t, "/openai?format=openai&logprobs=28000&usage=777", "X-Key", "inflated")
	if resp.StatusCode != 200 || len(body) < 2<<20 || !strings.HasSuffix(body, `"total_tokens":777}}`) {
		t.Fatalf("%d with %d bytes, want 200 with a body over 2 MiB", resp.StatusCode, len(body))
	}
	c.awaitTokens(t, "openai", "inflated", 1000-777, 0.05)
}

// TestChargeMaxBodyStopsTheScanAndChargesWhatWasRead: max_body bounds the
// bytes one response's scan reads (its CPU). Past it, the usage already
// read is charged, with a warning that names the bound; a body whose
// usage comes after it is charged its reservation (result
// charge_missing), the reason naming max_body.
func TestChargeMaxBodyStopsTheScanAndChargesWhatWasRead(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone bounded
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.total_tokens
		max_body 64KiB
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	for _, tc := range []struct {
		name, query string
		want        float64
	}{
		{"usage read before the bound", "early=1", 1000 - 321},
		{"usage after the bound", "", 1000 - 100},
	} {
		resp, body := c.get(t, "/?format=openai&logprobs=2000&usage=321&"+tc.query, "X-Key", tc.name)
		if resp.StatusCode != 200 || len(body) < 128<<10 {
			t.Fatalf("%s: %d with %d bytes, want 200 with the whole body", tc.name, resp.StatusCode, len(body))
		}
		c.awaitTokens(t, "bounded", tc.name, tc.want, 0.05)
	}
	eventually(t, 3*time.Second, "a warning that names max_body", func() bool {
		for _, l := range logLines(t, c.LogFile) {
			if reason, _ := l["reason"].(string); strings.Contains(reason, "max_body (65536 bytes)") {
				t.Logf("%s: %s", l["msg"], reason)
				return true
			}
		}
		return false
	})
}

// TestChargeCostSentAsTrailerIsRead: a stream's cost, known only at its
// end, comes as an HTTP trailer; reverse_proxy forwards it to the client,
// and `charge header` charges it, whether the upstream declared it in
// Trailer or not.
func TestChargeCostSentAsTrailerIsRead(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone trailer
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge header X-Cost
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	for _, form := range []string{"declared", "undeclared"} {
		resp, body := c.get(t, "/?format=openai&stream=1&usage=5&cost=42&trailer="+form, "X-Key", form)
		if resp.StatusCode != 200 || !strings.Contains(body, "data: [DONE]") || resp.Header.Get("X-Cost") != "" || resp.Trailer.Get("X-Cost") != "42" {
			t.Fatalf("%s: %d, X-Cost header %q, trailer %q; want 200 with the stream and the trailer X-Cost: 42",
				form, resp.StatusCode, resp.Header.Get("X-Cost"), resp.Trailer.Get("X-Cost"))
		}
		c.awaitTokens(t, "trailer", form, 1000-42, 0.05)
	}
}

// anthropicFields charges what Anthropic's Messages API reports, as the
// README says: a field per kind of token, each the last number found at
// any of its paths, the JSON answer's or the stream's.
const anthropicFields = `charge json {
			input usage.input_tokens message.usage.input_tokens
			output usage.output_tokens message.usage.output_tokens
		}`

// TestChargeAnthropicJSONAndStreamsChargedTheSame: one /v1/messages route
// answers a JSON message or a stream, as the client asks; with a field
// per kind of token each shape is charged the same real cost, input plus
// output tokens: the JSON answer (usage.*), a stream whose message_start
// reports the input and message_delta the output, and a stream whose
// message_delta also repeats the cumulative input (counted once).
func TestChargeAnthropicJSONAndStreamsChargedTheSame(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone messages
		key {http.request.header.X-Key}
		replenish_rate 0.01
		burst_capacity 100000
		requested_tokens 4000
		`+anthropicFields+`
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	for _, tc := range []struct{ name, query, bodyHas string }{
		{"a JSON answer", "", `"output_tokens":12`},
		{"a stream", "&stream=1", "event: message_stop"},
		{"a stream with cumulative input in message_delta", "&stream=1&delta_in=1", `"input_tokens":50000,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":12}}`},
	} {
		resp, body := c.get(t, "/v1/messages?format=anthropic&in=50000&out=12"+tc.query, "X-Key", tc.name)
		if resp.StatusCode != 200 || !strings.Contains(body, tc.bodyHas) {
			t.Fatalf("%s: %d %q, want 200 with the upstream's answer", tc.name, resp.StatusCode, body)
		}
		c.awaitTokens(t, "messages", tc.name, 100_000-50_012, 0.5) // 0.01 tokens/s refill
	}
}

// chargeSeries names a charging counter of a zone's limit.
func chargeSeries(name, zone, limit string) string {
	return fmt.Sprintf(`caddy_rate_limit_%s{limit=%q,zone=%q}`, name, limit, zone)
}

// TestChargeDebtRefusesUntilRefillWithExactRetryAfter: a cost above the
// reservation takes the rest below zero, down to -max_debt (the rest is
// forgiven and counted); the next request is refused with remaining 0,
// IETF r=0 and a Retry-After that is exactly when the refill covers the
// debt and the reservation; the admin API shows the debt as negative
// tokens; a request just before that time is refused, one just after
// admitted.
func TestChargeDebtRefusesUntilRefillWithExactRetryAfter(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone debt
		key {http.request.header.X-Key}
		replenish_rate 2
		burst_capacity 10
		charge header X-Cost
		max_debt 5
		headers both
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	before := scrapeMetricsAt(t, c.admin)
	// 10 tokens, 1 reserved, 16 charged: 15 more from 9 is -6, past
	// -max_debt (-5) by 1, which is forgiven.
	sent := time.Now()
	resp, _ := c.get(t, "/?format=raw&ct=text/plain&body=ok&cost=16", "X-Key", "k")
	if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "9" {
		t.Fatalf("first request: %d remaining %q, want 200 with 9", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
	}
	settled := time.Now()
	// Between its reservation and its settlement the bucket refilled at
	// most 2 tokens a second of the request's time, which the debt's
	// excess (1 token) absorbs before anything is forgiven.
	refilledAtMost := 2 * settled.Sub(sent).Seconds()
	c.awaitTokens(t, "debt", "k", -5, 2*time.Since(settled).Seconds()+0.2)

	resp, _ = c.get(t, "/?format=raw&ct=text/plain&body=ok&cost=1", "X-Key", "k")
	elapsed := time.Since(settled).Seconds()
	// 6 tokens to refill at 2 a second: 3 s from the settlement.
	if elapsed > 0.9 {
		t.Skipf("the machine is too slow for this test's timing: %.2f s after the settlement", elapsed)
	}
	if resp.StatusCode != 429 || resp.Header.Get("X-RateLimit-Remaining") != "0" || resp.Header.Get("Retry-After") != "3" ||
		resp.Header.Get("RateLimit") != `"debt";r=0;t=3` {
		t.Fatalf("in debt: %d, remaining %q, Retry-After %q, RateLimit %q; want 429, 0, 3, \"debt\";r=0;t=3", resp.StatusCode,
			resp.Header.Get("X-RateLimit-Remaining"), resp.Header.Get("Retry-After"), resp.Header.Get("RateLimit"))
	}
	inspected := time.Now()
	b := adminBucketOf(t, c.admin, "debt", q("header.X-Key", "k"))
	read := time.Now()
	if tokens := b.tokens(t); tokens >= 0 || tokens < -5 || math.Abs(b.RetryAfter-(1-tokens)/2) > 0.01 {
		t.Fatalf("admin: %v tokens, retry after %v s; want debt down to -5, with the wait (1 - tokens)/2", tokens, b.RetryAfter)
	}
	// The key lives until the bucket is full again, from the debt.
	if want := (10 - b.tokens(t)) / 2; b.ExpiresIn > want+0.01 || b.ExpiresIn < want-0.3 {
		t.Errorf("admin: expires in %v s, want about %v (full again from %v)", b.ExpiresIn, want, b.tokens(t))
	}
	// The admin read saw the bucket between inspected and read, so the
	// refill covers the debt RetryAfter after a moment in between. Each check below is asserted only
	// when the request's whole time fell on its side of that moment, which
	// a loaded machine may not give.
	coveredEarliest := inspected.Add(time.Duration(b.RetryAfter * float64(time.Second)))
	coveredLatest := read.Add(time.Duration(b.RetryAfter * float64(time.Second)))
	time.Sleep(time.Until(coveredEarliest.Add(-250 * time.Millisecond)))
	resp, _ = c.get(t, "/?format=raw&ct=text/plain&body=ok&cost=1", "X-Key", "k")
	if time.Now().Before(coveredEarliest) && resp.StatusCode != 429 {
		t.Fatalf("before the refill covers the debt: %d, want 429", resp.StatusCode)
	}
	time.Sleep(time.Until(coveredLatest.Add(50 * time.Millisecond)))
	resp, _ = c.get(t, "/?format=raw&ct=text/plain&body=ok&cost=1", "X-Key", "k")
	if resp.StatusCode != 200 {
		t.Fatalf("once the refill covers the debt: %d, want 200", resp.StatusCode)
	}
	// Tokens 1 when covered, 2 half a second later.
	if time.Now().Before(coveredEarliest.Add(500*time.Millisecond)) && resp.Header.Get("X-RateLimit-Remaining") != "0" {
		t.Fatalf("once the refill covers the debt: remaining %q, want 0", resp.Header.Get("X-RateLimit-Remaining"))
	}
	// 16 charged, less what was forgiven: 1 token, less what the bucket
	// refilled between the reservation and the settlement; then 1.
	after := scrapeMetricsAt(t, c.admin)
	charged := after.samples[chargeSeries("charged_total", "debt", "")] - before.samples[chargeSeries("charged_total", "debt", "")]
	forgiven := after.samples[chargeSeries("forgiven_total", "debt", "")] - before.samples[chargeSeries("forgiven_total", "debt", "")]
	if math.Abs(charged+forgiven-17) > 1e-6 || forgiven < 1-refilledAtMost-1e-6 || forgiven > 1 {
		t.Errorf("charged %v and forgave %v tokens; want 17 in all, 1 forgiven less at most %.3f refilled", charged, forgiven, refilledAtMost)
	}
}

// loginHash is the bcrypt hash (cost 4) of "open sesame".
const loginHash = "$2a$04$SiVdzZJhQ648b6CFqQNggeA87/qBp2cI/bYACcuQP5bRUmKspsDjS"

// TestChargeStatus401CountsOnlyFailedLogins: with charge_status 401 on a
// rate_limit before basic_auth (the directive orders itself there), a
// right password gets its reservation back, so right passwords are never
// refused however many; wrong ones are refused once they used the burst.
func TestChargeStatus401CountsOnlyFailedLogins(t *testing.T) {
	srv := redistest.Start(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone logins
		key {client_ip}
		replenish_rate 5/1h
		burst_capacity 5
		charge_status 401
		redis %[1]s {
			timeout 2s # under load a 100 ms take may fail, and a login so admitted settles nothing
		}
	}
	basic_auth {
		alice `+loginHash+`
	}
	respond "welcome {http.auth.user.id}"
}
`, srv.Addr, "")
	login := func(password string) *http.Response {
		req, _ := http.NewRequest(http.MethodGet, c.URL+"/", nil)
		req.SetBasicAuth("alice", password)
		resp, err := c.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	right := func(n int) {
		t.Helper()
		for i := range n {
			if resp := login("open sesame"); resp.StatusCode != 200 {
				t.Fatalf("right password, attempt %d: %d, want 200", i+1, resp.StatusCode)
			}
		}
	}
	wrong := func(want int) {
		t.Helper()
		if resp := login("guess"); resp.StatusCode != want {
			t.Fatalf("wrong password: %d, want %d", resp.StatusCode, want)
		}
	}
	rdb := srv.Client(t)
	before := commandCalls(t, rdb)
	right(20)
	eventually(t, 3*time.Second, "20 right logins: a take and a give-back each", func() bool {
		return commandsSince(t, rdb, before)["evalsha"] == 40
	})
	wrong(401)
	wrong(401)
	right(20) // 3 tokens left: each right login takes one and gets it back
	eventually(t, 3*time.Second, "every right login's token given back", func() bool {
		tokens := adminBucketOf(t, c.admin, "logins", q("client_ip", "127.0.0.1")).tokens(t)
		return tokens >= 3 && tokens < 3.01
	})
	before = commandCalls(t, rdb)
	wrong(401)
	wrong(401)
	wrong(401)
	time.Sleep(200 * time.Millisecond) // a settlement would have landed
	if calls := commandsSince(t, rdb, before)["evalsha"]; calls != 3 {
		t.Errorf("%d script calls for 3 wrong logins, want 3: a 401 keeps its reservation, no settlement", calls)
	}
	wrong(429) // five failures used the burst
	adminBucket := adminBucketOf(t, c.admin, "logins", q("client_ip", "127.0.0.1"))
	if tokens := adminBucket.tokens(t); tokens > 0.05 {
		t.Errorf("after five failures: %v tokens, want 0", tokens)
	}
}

// TestChargeStreamReachesTheClientChunkByChunk: a streamed answer passes
// through the limiter as it is sent: the upstream sends each chunk only
// once the client has read the one before, so a chunk held anywhere on
// the way stops the stream. Its usage is then charged.
func TestChargeStreamReachesTheClientChunkByChunk(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, llmSites, srv.Addr, up.host())
	req, _ := http.NewRequest(http.MethodGet, c.URL+"/openai?format=paced&chunks=8&usage=77", nil)
	req.Header.Set("X-Key", "paced")
	resp, err := c.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "900" {
		t.Fatalf("%d remaining %q, want 200 with 900", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
	}
	events := bufio.NewReader(resp.Body)
	for i := 0; i <= 8; i++ {
		start := time.Now()
		var event string
		for {
			line, err := events.ReadString('\n')
			if err != nil {
				t.Fatalf("chunk %d: %v (so far %q)", i, err, event)
			}
			if line == "\n" {
				break
			}
			event += line
		}
		t.Logf("chunk %d after %v: %s", i, time.Since(start).Round(time.Microsecond), strings.TrimSpace(event))
		if want := fmt.Sprintf("chunk %d", i); i < 8 && !strings.Contains(event, want) || i == 8 && !strings.Contains(event, `"total_tokens":77`) {
			t.Fatalf("chunk %d is %q", i, event)
		}
		up.acks <- i
	}
	if rest, err := io.ReadAll(events); err != nil || string(rest) != "data: [DONE]\n\n" {
		t.Fatalf("the end of the stream: %q %v", rest, err)
	}
	select {
	case late := <-up.late:
		t.Fatal(late)
	default:
	}
	c.awaitTokens(t, "openai", "paced", 1000-77, 0.05)
}

// TestChargeClientLeavingMidStreamKeepsItsReservationOrWhatTheStreamReported:
// a client that leaves mid-stream is charged its reservation, or what the
// stream reported so far when that is more (Anthropic's input tokens, in
// its first event); when it reported nothing yet (OpenAI's usage comes
// last), the reservation. It no longer pays less than the reservation by
// leaving once a small count came.
func TestChargeClientLeavingMidStreamKeepsItsReservationOrWhatTheStreamReported(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, llmSites, srv.Addr, up.host())
	for i, tc := range []struct {
		zone, query, firstEvent string
		want                    float64
	}{
		{"anthropic", "format=anthropic&stream=1&in=400&out=500&hold=1", "message_start", 1000 - 400},
		{"anthropic", "format=anthropic&stream=1&in=40&out=500&hold=1", "message_start", 1000 - 100},
		{"openai", "format=openai&stream=1&usage=300&hold=1", "chat.completion.chunk", 1000 - 100},
	} {
		key := fmt.Sprint("leaver", i)
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.URL+"/"+tc.zone+"?"+tc.query, nil)
		req.Header.Set("X-Key", key)
		resp, err := c.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		first, err := bufio.NewReader(resp.Body).ReadString('\n')
		for err == nil && !strings.Contains(first, tc.firstEvent) {
			first, err = bufio.NewReader(resp.Body).ReadString('\n')
		}
		if err != nil {
			t.Fatalf("%s: reading the first event: %v", tc.zone, err)
		}
		cancel() // the client leaves
		resp.Body.Close()
		select {
		case got := <-up.canceled:
			if got != tc.zone {
				t.Fatalf("the upstream saw %s canceled, want %s", got, tc.zone)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the upstream request was not canceled when the client left", tc.zone)
		}
		c.awaitTokens(t, tc.zone, key, tc.want, 0.05)
	}
}

// TestChargeLargeBodyPassesThroughUntouched: a 10 MiB body reaches the
// client byte for byte through a limiter that scans JSON bodies; it is
// not JSON, so the reservation is the cost.
func TestChargeLargeBodyPassesThroughUntouched(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, llmSites, srv.Addr, up.host())
	const size = 10 << 20
	resp, body := c.get(t, fmt.Sprintf("/openai?format=big&size=%d&seed=21", size), "X-Key", "big")
	want, _ := io.ReadAll(pseudoRandom(21, size))
	if resp.StatusCode != 200 || len(body) != size || body != string(want) {
		t.Fatalf("%d with %d bytes, want 200 with the upstream's %d bytes unchanged", resp.StatusCode, len(body), size)
	}
	c.awaitTokens(t, "openai", "big", 1000-100, 0.05)
}

// accessLogEntry is what an access log line says of the limiter.
type accessLogEntry struct {
	uri, result, charged string
	status               int
}

// accessLog reads the entries of a JSON access log whose lines carry
// log_append fields result and charged.
func accessLog(t *testing.T, path string) []accessLogEntry {
	t.Helper()
	var entries []accessLogEntry
	for _, l := range logLines(t, path) {
		req, _ := l["request"].(map[string]any)
		status, _ := l["status"].(float64)
		entries = append(entries, accessLogEntry{uri: fmt.Sprint(req["uri"]), result: fmt.Sprint(l["result"]),
			charged: fmt.Sprint(l["charged"]), status: int(status)})
	}
	return entries
}

// TestChargeUnreadableCostKeepsTheReservation: a cost that cannot be read
// (no header, not a number, negative, no usage in the body, a body that
// is not JSON or too large) keeps the reservation, with result
// charge_missing, {http.rate_limit.charged} the reservation, and a
// warning in the log (throttled); a cost that can be read is charged.
func TestChargeUnreadableCostKeepsTheReservation(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	log {
		output file `+logPath+` {
			roll_disabled
		}
		format json
	}
	log_append result {http.rate_limit.result}
	log_append charged {http.rate_limit.charged}
	rate_limit /header {
		zone header
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge header X-Cost
		redis %[1]s
	}
	handle /hidden {
		header -X-Cost
		rate_limit {
			zone hidden
			key {http.request.header.X-Key}
			replenish_rate 0.001
			burst_capacity 1000
			requested_tokens 100
			charge header X-Cost
			redis %[1]s
		}
		reverse_proxy %[2]s
	}
	rate_limit /json {
		zone json
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.total_tokens
		max_body 4KiB
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	raw := func(path, ct, body string) string {
		return path + "?" + url.Values{"format": {"raw"}, "ct": {ct}, "body": {body}}.Encode()
	}
	cases := []struct {
		name, zone, uri string
		charged         int
	}{
		{"no cost header", "header", raw("/header", "text/plain", "ok"), 100},
		{"a cost that is not a number", "header", raw("/header", "text/plain", "ok") + "&cost=abc", 100},
		{"a negative cost", "header", raw("/header", "text/plain", "ok") + "&cost=-3", 100},
		{"an infinite cost", "header", raw("/header", "text/plain", "ok") + "&cost=1e999", 100},
		{"a readable cost, rounded up", "header", raw("/header", "text/plain", "ok") + "&cost=12.5", 13},
		{"usage as a string", "json", raw("/json", "application/json", `{"usage":{"total_tokens":"12"}}`), 100},
		{"negative usage", "json", raw("/json", "application/json", `{"usage":{"total_tokens":-5}}`), 100},
		{"not JSON", "json", raw("/json", "text/html", `<p>usage.total_tokens: 5</p>`), 100},
		{"a stream without usage", "json", "/json?format=openai&stream=1", 100},
		{"a body over max_body", "json", raw("/json", "application/json", `{"pad":"`+strings.Repeat("x", 5000)+`","usage":{"total_tokens":12}}`), 100},
		{"readable usage", "json", raw("/json", "application/json", `{"usage":{"total_tokens":12}}`), 12},
	}
	for i, tc := range cases {
		key := fmt.Sprintf("k%d", i)
		if resp, _ := c.get(t, tc.uri, "X-Key", key); resp.StatusCode != 200 {
			t.Fatalf("%s: %d, want 200", tc.name, resp.StatusCode)
		}
		c.awaitTokens(t, tc.zone, key, float64(1000-tc.charged), 0.05)
	}
	var entries []accessLogEntry
	eventually(t, 3*time.Second, "the access log has every request", func() bool {
		entries = accessLog(t, logPath)
		return len(entries) >= len(cases)
	})
	// A cost header that a handler around the limiter removes from the
	// response (`header -X-Cost`, applied as it writes) is still read.
	resp, _ := c.get(t, raw("/hidden", "text/plain", "ok")+"&cost=37", "X-Key", "hidden")
	if resp.StatusCode != 200 || resp.Header.Get("X-Cost") != "" {
		t.Fatalf("/hidden: %d, X-Cost %q; want 200 without X-Cost", resp.StatusCode, resp.Header.Get("X-Cost"))
	}
	c.awaitTokens(t, "hidden", "hidden", 1000-37, 0.05)
	for i, tc := range cases {
		want := accessLogEntry{uri: tc.uri, result: "charge_missing", charged: strconv.Itoa(tc.charged), status: 200}
		if tc.charged != 100 {
			want.result = "allowed"
		}
		if entries[i] != want {
			t.Errorf("%s: access log %+v, want %+v", tc.name, entries[i], want)
		}
	}
	warnings := 0
	for _, l := range logLines(t, c.LogFile) {
		if msg, _ := l["msg"].(string); strings.Contains(msg, "could not be read") {
			warnings++
			t.Logf("warning: %s (%v)", msg, l["reason"])
		}
	}
	if warnings != 2 { // a line per 10 s per handler
		t.Errorf("%d warnings about unreadable costs, want one per handler (throttled)", warnings)
	}
}

// TestChargeSettlementLostWithRedisStoppedIsCountedNotResent: a response
// that ends while Redis is stopped still reaches the client; its
// settlement fails, is counted and logged, and is never sent again (the
// reservation stands).
func TestChargeSettlementLostWithRedisStoppedIsCountedNotResent(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone lost
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge header X-Cost
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	before := scrapeMetricsAt(t, c.admin)
	type answer struct {
		status int
		body   string
		err    error
	}
	done := make(chan answer, 1)
	go func() {
		resp, body, err := getHeaders(c.client, c.URL+"/?format=raw&ct=text/plain&body=held&cost=37&hold=1", "X-Key", "k")
		if err != nil {
			done <- answer{err: err}
			return
		}
		done <- answer{status: resp.StatusCode, body: body}
	}()
	// The reservation is taken; stop Redis while the response is held.
	c.awaitTokens(t, "lost", "k", 900, 0.05)
	srv.Stop(t)
	close(up.release)
	a := <-done
	if a.err != nil || a.status != 200 || a.body != "held" {
		t.Fatalf("the held response: %d %q %v, want 200 held", a.status, a.body, a.err)
	}
	eventually(t, 3*time.Second, "the lost settlement is counted", func() bool {
		s := scrapeMetricsAt(t, c.admin)
		return s.samples[`caddy_rate_limit_settle_failures_total{zone="lost"}`]-before.samples[`caddy_rate_limit_settle_failures_total{zone="lost"}`] == 1
	})
	warned := false
	for _, l := range logLines(t, c.LogFile) {
		msg, _ := l["msg"].(string)
		warned = warned || strings.Contains(msg, "settling a response's cost failed")
	}
	if !warned {
		t.Errorf("no warning about the lost settlement in Caddy's log")
	}
	// The reservation stands: what is charged is the 100 reserved.
	assertDeltas(t, before, scrapeMetricsAt(t, c.admin), map[string]float64{chargeSeries("charged_total", "lost", ""): 100})

	// Back (empty, without persistence): nothing is sent again.
	srv.Restart(t)
	rdb := srv.Client(t)
	time.Sleep(time.Second)
	if n := redistest.ScriptCalls(t, rdb); n != 0 {
		t.Fatalf("%d script calls reached the restarted Redis, want none: the lost settlement was sent again", n)
	}
	if resp, _ := c.get(t, "/?format=raw&ct=text/plain&body=ok&cost=100", "X-Key", "k"); resp.StatusCode != 200 ||
		resp.Header.Get("X-RateLimit-Remaining") != "900" {
		t.Fatalf("after the restart: %d remaining %q, want 200 with 900 (a new bucket)", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
	}
}

// TestChargeBoundUnderConcurrency: many clients at once on one bucket,
// each response costing what the upstream says (from nothing to four
// times the reservation): over any interval of length T, what the limit
// charges stays within burst + rate*T + max_debt; no request is admitted
// while its bucket holds less than its reservation (every script call on
// the bucket, as Redis ran them, replayed: replayBucket); the bucket
// never goes below -max_debt; tokens are conserved (what was charged,
// less what was forgiven, is what the bucket lost plus what it refilled).
func TestChargeBoundUnderConcurrency(t *testing.T) {
	const (
		rate     = 500.0
		burst    = 500
		reserved = 10
		maxDebt  = 30
		clients  = 16
		duration = 3 * time.Second
		// A settlement lands within the Redis timeout of its response
		// (set here, long enough for a loaded machine and -race).
		settleWithin = time.Second
	)
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	for _, src := range []string{scriptSource, settleSource} { // so that no call fails with NOSCRIPT under MONITOR
		if err := rdb.ScriptLoad(context.Background(), src).Err(); err != nil {
			t.Fatal(err)
		}
	}
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, fmt.Sprintf(`
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone bound
		key {http.request.header.X-Key}
		replenish_rate %v
		burst_capacity %d
		requested_tokens %d
		charge header X-Cost
		max_debt %d
		redis %%[1]s {
			timeout %v
		}
	}
	reverse_proxy %%[2]s
}
`, rate, burst, reserved, maxDebt, settleWithin), srv.Addr, up.host())
	before := scrapeMetricsAt(t, c.admin)
	key := adminBucketOf(t, c.admin, "bound", q("header.X-Key", "shared")).StoredKey
	monitor := monitorRedis(t, srv.Addr)

	type admission struct {
		sent, received time.Time
		cost           int
	}
	var (
		mu       sync.Mutex
		admitted []admission
		refused  int
		lowest   = math.Inf(1)
		stop     = make(chan struct{})
		wg       sync.WaitGroup
		start    = time.Now()
		sampling = make(chan struct{})
	)
	go func() { // the bucket, as the admin API reads it, all along
		defer close(sampling)
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			if tokens := c.tokensOf(t, "bound", "shared"); tokens < lowest {
				mu.Lock()
				lowest = tokens
				mu.Unlock()
			}
		}
	}()
	for g := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 21))
			for time.Since(start) < duration {
				cost := rng.IntN(4*reserved + 1)
				sent := time.Now()
				resp, _, err := getHeaders(c.client, fmt.Sprintf("%s/?format=raw&ct=text/plain&body=ok&cost=%d", c.URL, cost), "X-Key", "shared")
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				switch resp.StatusCode {
				case 200:
					admitted = append(admitted, admission{sent, time.Now(), cost})
				case 429:
					refused++
				default:
					t.Errorf("status %d", resp.StatusCode)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	end := time.Now()
	time.Sleep(settleWithin) // the last settlements land
	close(stop)
	<-sampling
	lines := monitor()
	final := c.tokensOf(t, "bound", "shared")
	finalAt := time.Now() // the bucket refilled until then
	after := scrapeMetricsAt(t, c.admin)
	forgiven := after.samples[chargeSeries("forgiven_total", "bound", "")] - before.samples[chargeSeries("forgiven_total", "bound", "")]
	charged := after.samples[chargeSeries("charged_total", "bound", "")] - before.samples[chargeSeries("charged_total", "bound", "")]

	total := 0
	refunds, debts := 0, 0
	for _, a := range admitted {
		total += a.cost
		switch {
		case a.cost < reserved:
			refunds++
		case a.cost > reserved:
			debts++
		}
	}
	elapsed := end.Sub(start).Seconds() + settleWithin.Seconds()
	t.Logf("%d admitted (%d refunds, %d above the reservation), %d refused in %.2f s; charged %d, forgiven %.3f; lowest %.3f, final %.3f tokens",
		len(admitted), refunds, debts, refused, elapsed, total, forgiven, lowest, final)
	replayed, intoDebt, gaveBack := replayBucket(t, lines, key, limit.Values{Rate: rate, Burst: burst, Requested: reserved})
	t.Logf("replayed from %d MONITOR lines: %d admissions, %d settlements into debt, %d give-backs", len(lines), replayed, intoDebt, gaveBack)
	// A cost is drawn from 0 to 4 reservations: about a quarter of the
	// admissions refund, three quarters go above; a tenth each is far
	// below what a run of about a hundred admissions draws, where 20
	// refunds, asked before, failed a run of 94 (about one run in five
	// of that size draws fewer).
	if refused < len(admitted)/10 || refunds < len(admitted)/10 || debts < len(admitted)/10 || intoDebt < 10 || forgiven == 0 {
		t.Fatalf("the run tried too little")
	}
	if replayed != len(admitted) {
		t.Errorf("Redis admitted %d takes; the clients %d requests", replayed, len(admitted))
	}

	if failures := after.samples[`caddy_rate_limit_settle_failures_total{zone="bound"}`]; failures > 0 {
		t.Fatalf("%v settlements failed: what they charged is unknown", failures)
	}
	if math.Abs(charged-(float64(total)-forgiven)) > 1e-6 {
		t.Errorf("the metrics say %v charged and %v forgiven; the upstream charged %d", charged, forgiven, total)
	}
	if lowest < -maxDebt-1e-9 || final < -maxDebt-1e-9 {
		t.Errorf("the bucket went down to %v tokens, below -max_debt (%d)", math.Min(lowest, final), -maxDebt)
	}
	// Whole run: charged = burst - final + refill, refill <= rate*T.
	if net := float64(total) - forgiven; net > burst-final+rate*finalAt.Sub(start).Seconds()+1e-6 || net > burst+rate*elapsed+maxDebt {
		t.Errorf("charged %v in %.3f s, final %v tokens: more than burst + rate*T (+ the debt)", net, elapsed, final)
	}
	// Every interval: the requests admitted in it (sent after its start,
	// settled before its end) charged at most burst + rate*T + max_debt,
	// before what was forgiven.
	slices.SortFunc(admitted, func(a, b admission) int { return a.sent.Compare(b.sent) })
	for i := range admitted {
		from := admitted[i].sent
		sum := 0
		var to time.Time // the last settlement of those so far
		for j := i; j < len(admitted); j++ {
			sum += admitted[j].cost
			to = later(to, admitted[j].received.Add(settleWithin))
			if bound := burst + rate*to.Sub(from).Seconds() + maxDebt + forgiven; float64(sum) > bound {
				t.Fatalf("%d charged by the %d requests sent from %v, settled within %v: more than %v", sum, j-i+1,
					from.Sub(start), to.Sub(from), bound)
			}
		}
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// TestChargeSeveralLimitsAllOrNothingOneSettlementCall: a policy whose
// `tokens` limit charges by the response and whose `requests` limit does
// not: a response's usage settles the tokens bucket only, in one script
// call, and none when the usage equals the reservation; in debt, the
// tokens limit refuses, takes nothing from the requests limit, and the
// headers describe it; {http.rate_limit.charged.tokens} shows the cost.
func TestChargeSeveralLimitsAllOrNothingOneSettlementCall(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	up := startChargeUpstream(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	log {
		output file `+logPath+` {
			roll_disabled
		}
		format json
	}
	log_append result {http.rate_limit.result}
	log_append charged {http.rate_limit.charged.tokens}
	rate_limit {
		zone policy
		key {http.request.header.X-Key}
		limit requests 0.001 100
		limit tokens 0.001 1000 100 {
			charge json usage.total_tokens
		}
		headers both
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	k := q("header.X-Key", "k")
	scriptsLoaded(t, rdb) // else a first call may meet NOSCRIPT and EVAL
	before := commandCalls(t, rdb)
	for i, usage := range []int{100, 100, 40, 1560} {
		if resp, _ := c.get(t, fmt.Sprintf("/?format=openai&usage=%d", usage), "X-Key", "k"); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i+1, resp.StatusCode)
		}
	}
	c.awaitLimitTokens(t, "policy", k, "tokens", 1000-1800, 0.05)
	// The admin API reads with EVAL_RO; requests and settlements are
	// EVALSHA (a take each, a settlement each for the two that differ).
	if calls := commandsSince(t, rdb, before); calls["evalsha"] != 6 || calls["eval"] != 0 {
		t.Fatalf("Redis served %v for four requests, two settled: want 6 EVALSHA", calls)
	}
	// In debt (-800): the tokens limit refuses, for (100 + 800) / 0.001 s.
	resp, _ := c.get(t, "/?format=openai&usage=1", "X-Key", "k")
	if resp.StatusCode != 429 || resp.Header.Get("X-RateLimit-Remaining") != "0" || resp.Header.Get("X-RateLimit-Burst-Capacity") != "1000" ||
		resp.Header.Get("Retry-After") != "900000" || resp.Header.Get("RateLimit") != `"policy.requests";r=96;t=0, "policy.tokens";r=0;t=900000` {
		t.Fatalf("in debt: %d, remaining %q of %q, Retry-After %q, RateLimit %q; want 429 by tokens: 0 of 1000, 900000 s",
			resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), resp.Header.Get("X-RateLimit-Burst-Capacity"),
			resp.Header.Get("Retry-After"), resp.Header.Get("RateLimit"))
	}
	if requests := c.limitTokens(t, "policy", k, "requests"); requests < 96 || requests > 96.05 {
		t.Fatalf("the requests bucket holds %v after the refusal, want 96: a refusal takes nothing", requests)
	}
	var entries []accessLogEntry
	eventually(t, 3*time.Second, "the access log has every request", func() bool {
		entries = accessLog(t, logPath)
		return len(entries) >= 5
	})
	for i, want := range []string{"100", "100", "40", "1560", "<nil>"} {
		if entries[i].charged != want {
			t.Errorf("request %d: {http.rate_limit.charged.tokens} %q, want %s", i+1, entries[i].charged, want)
		}
	}
}

// TestChargeWithPlansFromMap: max_debt defaults to each request's
// burst, here a plan's from `map`.
func TestChargeWithPlansFromMap(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	map {http.request.header.X-Plan} {plan_burst} {
		pro     2000
		default 1000
	}
	rate_limit {
		zone plans
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity {plan_burst}
		requested_tokens 100
		charge header X-Cost
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	for _, tc := range []struct {
		plan, burst string
		want        float64
	}{{"pro", "2000", 2000 - 3500}, {"basic", "1000", -1000}} { // basic: 1000 - 3500, held at -max_debt (its burst)
		if resp, _ := c.get(t, "/?format=raw&ct=text/plain&body=ok&cost=3500", "X-Key", tc.plan, "X-Plan", tc.plan); resp.StatusCode != 200 {
			t.Fatalf("%s: %d", tc.plan, resp.StatusCode)
		}
		c.awaitLimitTokens(t, "plans", q("header.X-Key", tc.plan, "plan_burst", tc.burst), "", tc.want, 0.05)
	}
}

// TestChargeWithStoreMemoryOnErrorLocalAndShadow: the in-process stores
// settle at once (store memory, and on_error local's buckets while Redis
// is down); shadow mode settles what it admits and lets a request in
// debt pass without charging it.
func TestChargeWithStoreMemoryOnErrorLocalAndShadow(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit /memory {
		zone memory
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.total_tokens
		store memory
	}
	rate_limit /local {
		zone local
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.total_tokens
		on_error local
		redis `+deadRedis+`
	}
	rate_limit /shadow {
		zone shadow
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.total_tokens
		shadow
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	for _, zone := range []string{"memory", "local"} {
		remaining := 1000
		for i, usage := range []int{37, 250, 1500} {
			resp, _ := c.get(t, fmt.Sprintf("/%s?format=openai&usage=%d", zone, usage), "X-Key", "k")
			if want := strconv.Itoa(remaining - 100); resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != want {
				t.Fatalf("%s request %d: %d remaining %q, want 200 with %s", zone, i+1, resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), want)
			}
			remaining -= usage
		}
		// -787: refused until (100 + 787) / 0.001 s.
		resp, _ := c.get(t, "/"+zone+"?format=openai&usage=1", "X-Key", "k")
		if resp.StatusCode != 429 || resp.Header.Get("X-RateLimit-Remaining") != "0" || resp.Header.Get("Retry-After") != "887000" {
			t.Fatalf("%s in debt: %d remaining %q Retry-After %q, want 429, 0, 887000", zone, resp.StatusCode,
				resp.Header.Get("X-RateLimit-Remaining"), resp.Header.Get("Retry-After"))
		}
	}
	if tokens := c.tokensOf(t, "memory", "k"); tokens < -787 || tokens > -786.9 {
		t.Errorf("admin, store memory: %v tokens, want -787", tokens)
	}

	for i, usage := range []int{1500, 500} {
		resp, _ := c.get(t, fmt.Sprintf("/shadow?format=openai&usage=%d", usage), "X-Key", "k")
		if resp.StatusCode != 200 || len(rateLimitHeaderNames(resp)) != 0 {
			t.Fatalf("shadow request %d: %d with %v, want 200 without rate-limit headers", i+1, resp.StatusCode, rateLimitHeaderNames(resp))
		}
		c.awaitTokens(t, "shadow", "k", -500, 0.05)
	}
	time.Sleep(300 * time.Millisecond) // long enough for a settlement to land
	if tokens := c.tokensOf(t, "shadow", "k"); tokens > -499.95 || tokens < -500 {
		t.Errorf("shadow: %v tokens, want -500: a request refused in shadow mode is not charged", tokens)
	}
}

// TestChargeOnClusterOneSettlementPerSlotGroup: on a Cluster, a policy
// whose charging limits have two key templates (two hash slots) settles
// each slot group with one script call.
func TestChargeOnClusterOneSettlementPerSlotGroup(t *testing.T) {
	cluster := redistest.StartCluster(t, 3, 0)
	clients := masterClients(t, cluster)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone cluster
		key {http.request.header.X-Key}
		limit client 0.001 1000 100 {
			charge header X-Cost
		}
		limit tenant 0.001 5000 100 {
			key {http.request.header.X-Tenant}
			charge header X-Cost
		}
		on_error deny
		redis %[1]s {
			cluster
			timeout 2s
		}
	}
	reverse_proxy %[2]s
}
`, cluster.Masters[0].Addr, up.host())
	calls := func() int64 {
		var n int64
		for _, rdb := range clients {
			n += commandCalls(t, rdb)["evalsha"]
		}
		return n
	}
	before := calls()
	if resp, _ := c.get(t, "/?format=raw&ct=text/plain&body=ok&cost=350", "X-Key", "k", "X-Tenant", "acme"); resp.StatusCode != 200 {
		t.Fatalf("%d, want 200", resp.StatusCode)
	}
	who := q("header.X-Key", "k", "header.X-Tenant", "acme")
	c.awaitLimitTokens(t, "cluster", who, "client", 1000-350, 0.05)
	c.awaitLimitTokens(t, "cluster", who, "tenant", 5000-350, 0.05)
	if n := calls() - before; n != 4 {
		t.Errorf("%d EVALSHA on the masters, want 4: a take and a settlement per slot group", n)
	}
}

// ---- Configuration

func TestChargeCaddyfileParsesEveryForm(t *testing.T) {
	for _, tc := range []struct {
		name, input string
		want        Handler
	}{
		{"a header", "rate_limit 10 20 {\n\tcharge header X-Cost\n}",
			Handler{ReplenishRate: "10", BurstCapacity: "20", Charge: &Charge{Header: "X-Cost"}}},
		{"JSON paths, statuses, debt and body", "rate_limit 10 20 {\n\tcharge json usage.input_tokens usage.output_tokens\n\tcharge_status 2xx 401\n\tmax_debt 0\n\tmax_body 2MiB\n}",
			Handler{ReplenishRate: "10", BurstCapacity: "20", Charge: &Charge{JSON: []string{"usage.input_tokens", "usage.output_tokens"}},
				ChargeStatus: []int{2, 401}, MaxDebt: ptr(int64(0)), MaxBody: 2 << 20}},
		{"a placeholder", "rate_limit 10 20 {\n\tcharge placeholder {http.reverse_proxy.upstream.duration_ms}\n}",
			Handler{ReplenishRate: "10", BurstCapacity: "20", Charge: &Charge{Placeholder: "{http.reverse_proxy.upstream.duration_ms}"}}},
		{"charge_status alone", "rate_limit 10 20 {\n\tcharge_status 401 403\n\tmax_body 65536\n\tcharge json n\n}",
			Handler{ReplenishRate: "10", BurstCapacity: "20", ChargeStatus: []int{401, 403}, MaxBody: 65536, Charge: &Charge{JSON: []string{"n"}}}},
		{"JSON fields", "rate_limit 10 20 {\n\tcharge json {\n\t\tinput usage.input_tokens message.usage.input_tokens\n\t\toutput usage.output_tokens\n\t}\n\tmax_body 1MiB\n}",
			Handler{ReplenishRate: "10", BurstCapacity: "20", MaxBody: 1 << 20, Charge: &Charge{JSONFields: map[string][]string{
				"input": {"usage.input_tokens", "message.usage.input_tokens"}, "output": {"usage.output_tokens"}}}}},
		{"JSON fields in a limit", "rate_limit {\n\tlimit tokens 1000 100000 1000 {\n\t\tcharge json {\n\t\t\tn a b\n\t\t}\n\t\tcharge_status 2xx\n\t}\n}",
			Handler{Limits: []Limit{{Name: "tokens", ReplenishRate: "1000", BurstCapacity: "100000", RequestedTokens: "1000",
				Charge: &Charge{JSONFields: map[string][]string{"n": {"a", "b"}}}, ChargeStatus: []int{2}}}}},
		{"in a limit", "rate_limit {\n\tlimit requests 1 60\n\tlimit tokens 1000 100000 1000 {\n\t\tcharge json usage.total_tokens\n\t\tcharge_status 2xx\n\t\tmax_debt 50000\n\t}\n}",
			Handler{Limits: []Limit{{Name: "requests", ReplenishRate: "1", BurstCapacity: "60"},
				{Name: "tokens", ReplenishRate: "1000", BurstCapacity: "100000", RequestedTokens: "1000",
					Charge: &Charge{JSON: []string{"usage.total_tokens"}}, ChargeStatus: []int{2}, MaxDebt: ptr(int64(50000))}}}},
	} {
		h, err := parseTestCaddyfile(tc.input)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !reflect.DeepEqual(*h, tc.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.name, *h, tc.want)
		}
	}
}

func TestChargeConfigMistakesNameTheSubdirectiveAndValue(t *testing.T) {
	paths := ""
	for i := range 17 {
		paths += fmt.Sprintf(" p%d", i)
	}
	for _, tc := range []struct{ input, want string }{
		{"charge", "charge: want header <name>, json <path>..., json { <field> <path>... } or placeholder"},
		{"charge json {\n\t}", "charge: want header <name>, json <path>..., json { <field> <path>... } or placeholder <{placeholder}>, got 'json'"},
		{"charge json a {\n\t\tn b\n\t}", "got 'json a' with a block (only json takes one)"},
		{"charge header X-Cost {\n\t\tn b\n\t}", "got 'header X-Cost' with a block"},
		{"charge json {\n\t\tinput\n\t}", "charge json field 'input': want <field> <path>..., such as input usage.input_tokens"},
		{"charge json {\n\t\tinput a\n\t\tinput b\n\t}", "charge json field 'input' is given twice"},
		{"charge json {\n\t\tinput a b\n\t\toutput c b\n\t}", "charge json field 'output': path 'b' is in field 'input' too"},
		{"charge json {\n\t\tinput a..b\n\t}", "charge json 'a..b': want keys separated by '.'"},
		{"limit a 1 1 {\n\t\tcharge json {\n\t\t\tinput\n\t\t}\n\t}", "limit a: charge json field 'input': want <field> <path>..."},
		{"charge header", "charge: want header <name>"},
		{"charge header A B", "got 'header A B'"},
		{"charge cookie X", "got 'cookie X'"},
		{"charge header X:Y", "charge header 'X:Y': not a header name"},
		{"charge json usage..total", "charge json 'usage..total': want keys separated by '.'"},
		{"charge json a.b.c.d.e.f.g.h.i", "charge json 'a.b.c.d.e.f.g.h.i': more than 8 keys"},
		{"charge json" + paths, "charge json: 17 paths in one handler, more than 16"},
		{"charge placeholder duration", "charge placeholder 'duration': want a placeholder"},
		{"charge header X\n\tcharge header Y", "subdirective 'charge' is given twice"},
		{"charge_status", "charge_status: want one or more status codes"},
		{"charge_status 99", "charge_status '99': want a status code (100 to 599) or a class (2xx)"},
		{"charge_status 600", "charge_status '600'"},
		{"charge_status 6xx", "charge_status '6xx'"},
		{"charge_status 2XX", "charge_status '2XX'"},
		{"max_debt -1\n\tcharge_status 401", "max_debt '-1': want a whole number of tokens from 0 to 2^53"},
		{"max_debt lots\n\tcharge_status 401", "max_debt 'lots': want a whole number of tokens"},
		{"max_debt 5", "max_debt '5': nothing can run into debt without charge or charge_status"},
		{"max_debt 100000000\n\tcharge_status 401", "max_debt '100000000': a debt that large takes more than a year to pay back at replenish_rate '1'; lower it to at most 31536000"},
		{"max_body 0\n\tcharge json n", "max_body '0': want a size such as 1MiB"},
		{"max_body 1XB\n\tcharge json n", "max_body '1XB'"},
		{"max_body 1MiB\n\tcharge header X-Cost", "max_body '1048576': only a 'charge json' source reads the body"},
		{"limit a 1 1 {\n\t\tmax_debt 5\n\t}", "limit a: max_debt '5': nothing can run into debt"},
		{"limit a 1 1 {\n\t\tcharge header\n\t}", "limit a: charge: want header <name>"},
		{"limit a 1 1 {\n\t\tcharge_status 7\n\t}", "limit a: charge_status '7'"},
	} {
		input := "rate_limit 1 1 {\n\t" + tc.input + "\n}"
		_, err := parseTestCaddyfile(input)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error with %q", tc.input, err, tc.want)
		}
	}
}

func TestChargeJSONConfigJudgedByValidate(t *testing.T) {
	for _, tc := range []struct {
		h    Handler
		want string
	}{
		{Handler{ReplenishRate: "1", Charge: &Charge{Header: "X-Cost", JSON: []string{"n"}}}, "charge: want exactly one source"},
		{Handler{ReplenishRate: "1", Charge: &Charge{}}, "charge: want exactly one source"},
		{Handler{ReplenishRate: "1", Charge: &Charge{JSON: []string{"n"}, JSONFields: map[string][]string{"m": {"m"}}}}, "charge: want exactly one source"},
		{Handler{ReplenishRate: "1", Charge: &Charge{JSONFields: map[string][]string{"m": nil}}}, "charge json field 'm': want a name and one or more paths"},
		{Handler{ReplenishRate: "1", Charge: &Charge{JSONFields: map[string][]string{"a": {"x", "y"}, "b": {"y"}}}}, "charge json field 'b': path 'y' is in field 'a' too"},
		{Handler{ReplenishRate: "1", ChargeStatus: []int{0}}, "charge_status '0'"},
		{Handler{ReplenishRate: "1", MaxDebt: ptr(int64(3))}, "max_debt '3': nothing can run into debt"},
		{Handler{ReplenishRate: "1", MaxBody: -1, Charge: &Charge{JSON: []string{"n"}}}, "max_body '-1'"},
		{Handler{ReplenishRate: "1", Limits: []Limit{{Name: "t", Charge: &Charge{Placeholder: "x"}}}}, "limit t: charge placeholder 'x'"},
	} {
		h := tc.h
		h.applyDefaults()
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error with %q", tc.h, err, tc.want)
		}
	}
	// What a valid JSON config charges: each limit its own, or the
	// handler's.
	h := offline(&Handler{ReplenishRate: "10", ChargeStatus: []int{401}, Limits: []Limit{
		{Name: "plain"}, {Name: "tokens", Charge: &Charge{JSON: []string{"usage.total_tokens"}}, MaxDebt: ptr(int64(7))}}})
	provision(t, h)
	const burst = 12345 // a bucket's, to tell max_debt from the burst
	if r := h.limits[0].Charge; r == nil || r.MaxDebt(burst, 10) != burst || !r.Charges(401) || r.Charges(403) || r.Charges(200) || r.ReadsJSON() {
		t.Errorf("limit plain: %+v, want the handler's charge_status 401 and max_debt of its burst", r)
	}
	if r := h.limits[1].Charge; r == nil || r.MaxDebt(burst, 10) != 7 || !r.ReadsJSON() || h.limits[1].ChargedKey != "http.rate_limit.charged.tokens" {
		t.Errorf("limit tokens: %+v, want its JSON path and max_debt 7", r)
	}
	// A path of JSON given twice counts once; a field sums nothing: its
	// paths are one number, the last of them in the body.
	h = offline(&Handler{ReplenishRate: "10", Limits: []Limit{
		{Name: "twice", Charge: &Charge{JSON: []string{"n", "m", "n"}}},
		{Name: "fields", Charge: &Charge{JSONFields: map[string][]string{"b": {"m", "k"}, "a": {"n"}}}}}})
	provision(t, h)
	costOf := func(l int) int64 {
		rec := httptest.NewRecorder()
		cw := new(cost.Writer).Reset(rec, &h.charging.Sources, new(scan.Body), nil)
		cw.Header().Set("Content-Type", "application/json")
		cw.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(cw, `{"n":1,"m":10,"k":100}`)
		charged, _ := h.limits[l].Charge.Cost(cost.End{Status: http.StatusOK}, cw, caddy.NewReplacer(), nil, 1)
		return charged
	}
	if got := costOf(0); got != 11 {
		t.Errorf("limit twice: charged %d of n 1 and m 10, want 11: n and m once each", got)
	}
	if got := costOf(1); got != 101 {
		t.Errorf("limit fields: charged %d of n 1, m 10 and k 100, want 101 (a: n; b: m or k, the last in the body)", got)
	}
}

// ---- Benchmarks

// BenchmarkServeHTTPCharged is BenchmarkServeHTTPAllowedParallel (32
// goroutines per CPU, a key each) for a limit that charges by the
// response: `charge header X-Cost` with a cost of 2 against a
// reservation of 1, so every request also settles; `charge_status 2xx`,
// where every response keeps its reservation (no settlement); and the
// same limit without charging, for scale. cpu-ns/op is this process's
// CPU per request (the handler, go-redis, the runtime).
func BenchmarkServeHTTPCharged(b *testing.B) {
	costly := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.Header()["X-Cost"] = costTwo
		w.WriteHeader(http.StatusOK)
		return nil
	})
	for _, c := range []struct {
		name   string
		charge func(h *Handler)
	}{
		{"none", func(*Handler) {}},
		{"charge_status", func(h *Handler) { h.ChargeStatus = []int{2} }},
		{"charge_header", func(h *Handler) { h.Charge = &Charge{Header: "X-Cost"} }},
	} {
		b.Run(c.name, func(b *testing.B) {
			srv := redistest.Start(b)
			h := &Handler{Zone: "bench-charge", Key: "{http.request.header.X-Key}", ReplenishRate: "1e9", BurstCapacity: "1000000000",
				Redis: &RedisConfig{Addresses: []string{srv.Addr}, Timeout: caddy.Duration(2 * time.Second)}}
			c.charge(h)
			serveParallel(b, provision(b, h), costly)
		})
	}
}

var costTwo = []string{"2"}

// readmeLLMExample is the first Caddyfile of the README's "Token budgets
// for LLM APIs" section.
func readmeLLMExample(t *testing.T) string {
	t.Helper()
	block := readmeExample(t, "Token budgets for LLM APIs")
	if !strings.HasPrefix(block, "llm.example.com {") || !strings.Contains(block, "reverse_proxy localhost:8000\n") {
		t.Fatalf("the example is not the site expected:\n%s", block)
	}
	return block
}

// TestChargeReadmeExampleRunsAsWritten: the README's LLM Caddyfile, with
// its site address, its upstream and a redis line replaced, charges
// chat completions and their streams what they report, gives back the
// reservation of a failed answer, keeps it for a stream without usage,
// and refuses a key in debt until the refill covers it.
func TestChargeReadmeExampleRunsAsWritten(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startReadmeLLMCaddy(t, srv.Addr, up)
	charged := func() float64 { return c.chargedTokens(t) }
	for _, tc := range []struct {
		name, query string
		status      int
		charged     float64
	}{
		{"a chat completion", "format=openai&usage=350", 200, 350},
		{"a streamed one", "format=openai&stream=1&usage=4321", 200, 4321},
		{"an upstream failure", "format=openai&usage=9999&status=500", 500, 0},
		{"a stream without usage", "format=openai&stream=1", 200, 2000},
	} {
		before := charged()
		resp, _ := c.get(t, "/v1/chat/completions?"+tc.query, "Authorization", "Bearer sk-1")
		if resp.StatusCode != tc.status {
			t.Fatalf("%s: %d, want %d", tc.name, resp.StatusCode, tc.status)
		}
		eventually(t, 3*time.Second, tc.name+" charged", func() bool { return charged()-before == tc.charged })
	}
	// 250,000 tokens: the bucket goes to -max_debt (-100,000); the next
	// request waits for 102,000 tokens at 100,000 a minute.
	if resp, _ := c.get(t, "/v1/chat/completions?format=openai&usage=250000", "Authorization", "Bearer sk-1"); resp.StatusCode != 200 {
		t.Fatalf("a costly answer: %d", resp.StatusCode)
	}
	eventually(t, 3*time.Second, "the debt", func() bool {
		return c.limitTokens(t, "llm", q("header.Authorization", "Bearer sk-1"), "tokens") < -99000
	})
	resp, _ := c.get(t, "/v1/chat/completions?format=openai&usage=1", "Authorization", "Bearer sk-1")
	if retry, _ := strconv.Atoi(resp.Header.Get("Retry-After")); resp.StatusCode != 429 || retry < 55 || retry > 62 {
		t.Fatalf("in debt: %d, Retry-After %q; want 429 with about 61 s", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if resp, _ := c.get(t, "/v1/chat/completions?format=openai&usage=1", "Authorization", "Bearer sk-2"); resp.StatusCode != 200 {
		t.Fatalf("another key: %d, want 200", resp.StatusCode)
	}
}

// startReadmeLLMCaddy serves the README's LLM Caddyfile, with its site
// address, its upstream and a redis line replaced.
func startReadmeLLMCaddy(t *testing.T, redisAddr string, up *chargeUpstream) *chargeCaddy {
	t.Helper()
	site := strings.Replace(readmeLLMExample(t), "llm.example.com {", "http://127.0.0.1:{{http_port}} {", 1)
	site = strings.Replace(site, "reverse_proxy localhost:8000", "reverse_proxy %[2]s", 1)
	site = strings.Replace(site, "\t\tlimit requests", "\t\tredis %[1]s\n\t\tlimit requests", 1)
	return startChargeCaddy(t, site, redisAddr, up.host())
}

// chargedTokens is what the README example's tokens limit charged.
func (c *chargeCaddy) chargedTokens(t *testing.T) float64 {
	return scrapeMetricsAt(t, c.admin).samples[chargeSeries("charged_total", "llm", "tokens")]
}

// awaitCharged waits until the README example's tokens limit charged
// want since before.
func (c *chargeCaddy) awaitCharged(t *testing.T, what string, before, want float64) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for got := c.chargedTokens(t) - before; got != want; got = c.chargedTokens(t) - before {
		if time.Now().After(deadline) {
			t.Fatalf("%s: charged %v, want %v", what, got, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestChargeReadmeExampleChargesAClientThatLeavesAndAnUpgrade: under the
// README's `charge_status 2xx`, a client that leaves before the answer's
// headers (reverse_proxy records 499 for it) is charged its reservation:
// it kept the LLM busy, and must not be refunded for leaving just before
// the answer came (it was refunded in full). A WebSocket (101) is the
// success of an upgrade: charged its reservation (it was charged
// nothing). An answer of another status is still refunded
// (TestChargeReadmeExampleRunsAsWritten).
func TestChargeReadmeExampleChargesAClientThatLeavesAndAnUpgrade(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startReadmeLLMCaddy(t, srv.Addr, up)

	before := c.chargedTokens(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.URL+"/v1/chat/completions?format=openai&usage=350&wait=1", nil)
	req.Header.Set("Authorization", "Bearer leaver")
	done := make(chan error, 1)
	go func() {
		resp, err := c.client.Do(req)
		if err == nil {
			resp.Body.Close()
			err = fmt.Errorf("answered %d", resp.StatusCode)
		}
		done <- err
	}()
	select {
	case <-up.waiting:
	case <-time.After(5 * time.Second):
		t.Fatal("the request did not reach the upstream")
	}
	cancel() // the client leaves before the answer
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("the request: %v, want it canceled", err)
	}
	select {
	case <-up.canceled:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream request was not canceled when the client left")
	}
	c.awaitCharged(t, "a client that left before the answer", before, 2000)

	before = c.chargedTokens(t)
	conn, err := net.Dial("tcp", strings.TrimPrefix(c.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "GET /v1/realtime?format=upgrade HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer ws\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
		strings.TrimPrefix(c.URL, "http://"))
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("the upgrade: %v %v, want 101", resp, err)
	}
	echo := make([]byte, 4)
	if _, err := conn.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(br, echo); err != nil || string(echo) != "ping" {
		t.Fatalf("the upgraded connection echoed %q %v, want ping", echo, err)
	}
	conn.Close()
	c.awaitCharged(t, "a WebSocket", before, 2000)
}

// TestChargeUpstreamTimeOfTheReadmeChargesAClientThatLeaves: the
// placeholder that the README gives to charge upstream time is set
// however the response ends: a client that holds a stream open and then
// leaves is charged the time it held, not its reservation.
// {http.reverse_proxy.upstream.duration_ms}, the README's before, is set
// only when a response completes: unset, it charged the reservation.
func TestChargeUpstreamTimeOfTheReadmeChargesAClientThatLeaves(t *testing.T) {
	raw, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, row, _ := strings.Cut(string(raw), "| `placeholder {...}` |")
	row, _, _ = strings.Cut(row, "\n")
	_, placeholder, _ := strings.Cut(row, "such as `")
	placeholder, _, _ = strings.Cut(placeholder, "` to charge upstream time")
	if !strings.HasPrefix(placeholder, "{http.") {
		t.Fatalf("the README's charge table gives no placeholder to charge upstream time: %q", row)
	}
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone upstreamtime
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 10000
		requested_tokens 10
		charge placeholder `+placeholder+`
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	const held = 500 * time.Millisecond
	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.URL+"/?format=openai&stream=1&usage=5&hold=1", nil)
	req.Header.Set("X-Key", "holder")
	resp, err := c.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatalf("reading the first event: %v", err)
	}
	time.Sleep(held)
	cancel() // the client leaves
	resp.Body.Close()
	select {
	case <-up.canceled:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream request was not canceled when the client left")
	}
	// The settlement lands at once; a cost of the reservation settles
	// nothing, so wait a while for more.
	tokens := c.tokensOf(t, "upstreamtime", "holder")
	for deadline := time.Now().Add(3 * time.Second); tokens > 10000-10-0.5 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		tokens = c.tokensOf(t, "upstreamtime", "holder")
	}
	if cost, most := 10000-tokens, float64(time.Since(start).Milliseconds()+1); cost < float64(held.Milliseconds()) || cost > most {
		t.Fatalf("%s charged %.0f for a stream held %v and left, want at least %v and at most the %v ms since the request",
			placeholder, cost, held, held.Milliseconds(), most)
	}
}

// TestChargeReadmeAnthropicExampleRunsAsWritten: the README's Caddyfile
// for Anthropic's Messages API, with its site address, its upstream and a
// redis line replaced, charges a JSON answer, a stream and a current
// stream (whose message_delta repeats the input) the same real cost, and
// an upstream failure nothing.
func TestChargeReadmeAnthropicExampleRunsAsWritten(t *testing.T) {
	raw, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(raw), "\n### Anthropic's Messages API\n")
	_, block, _ := strings.Cut(section, "```caddyfile\n")
	block, _, _ = strings.Cut(block, "```")
	upstream := "reverse_proxy https://api.anthropic.com {\n\t\theader_up Host {upstream_hostport}\n\t}"
	if !strings.HasPrefix(block, "api.example.com {") || !strings.Contains(block, upstream) {
		t.Fatalf("the README's Anthropic example is not the site expected:\n%s", block)
	}
	site := strings.Replace(block, "api.example.com {", "http://127.0.0.1:{{http_port}} {", 1)
	site = strings.Replace(site, upstream, "reverse_proxy %[2]s", 1)
	site = strings.Replace(site, "\t\tlimit requests", "\t\tredis %[1]s\n\t\tlimit requests", 1)
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, site, srv.Addr, up.host())
	charged := func() float64 {
		return scrapeMetricsAt(t, c.admin).samples[chargeSeries("charged_total", "anthropic", "tokens")]
	}
	for _, tc := range []struct {
		name, query string
		status      int
		charged     float64
	}{
		{"a JSON answer", "", 200, 50_012},
		{"a stream", "&stream=1", 200, 50_012},
		{"a current stream", "&stream=1&delta_in=1", 200, 50_012},
		{"an upstream failure", "&status=529", 529, 0},
	} {
		before := charged()
		resp, _ := c.get(t, "/v1/messages?format=anthropic&in=50000&out=12"+tc.query, "X-Api-Key", "sk-ant-1")
		if resp.StatusCode != tc.status {
			t.Fatalf("%s: %d, want %d", tc.name, resp.StatusCode, tc.status)
		}
		eventually(t, 3*time.Second, tc.name+" charged", func() bool { return charged()-before == tc.charged })
	}
}

// TestChargeReadsBodiesThatEncodeCompressesOnlyInsideIt: `encode` runs
// after rate_limit in Caddy's order, so the limiter sees the compressed
// body and charges the reservation ("the body is encoded"); with `encode`
// first in a `route`, as the README says, it sees the body as the
// upstream sent it, and the client still gets it compressed.
func TestChargeReadsBodiesThatEncodeCompressesOnlyInsideIt(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	handle /default {
		encode gzip
		rate_limit {
			zone encdefault
			key {http.request.header.X-Key}
			replenish_rate 0.001
			burst_capacity 1000
			requested_tokens 100
			charge json usage.total_tokens
			redis %[1]s
		}
		reverse_proxy %[2]s
	}
	handle /route {
		route {
			encode gzip
			rate_limit {
				zone encroute
				key {http.request.header.X-Key}
				replenish_rate 0.001
				burst_capacity 1000
				requested_tokens 100
				charge json usage.total_tokens
				redis %[1]s
			}
			reverse_proxy %[2]s
		}
	}
}
`, srv.Addr, up.host())
	body := `{"pad":"` + strings.Repeat("lorem ipsum ", 200) + `","usage":{"total_tokens":42}}`
	query := "?" + url.Values{"format": {"raw"}, "ct": {"application/json"}, "body": {body}}.Encode()
	for _, tc := range []struct {
		path, zone string
		want       float64
	}{{"/default", "encdefault", 900}, {"/route", "encroute", 958}} {
		req, _ := http.NewRequest(http.MethodGet, c.URL+tc.path+query, nil)
		req.Header.Set("X-Key", "k")
		req.Header.Set("Accept-Encoding", "gzip") // set by hand: the client then does not decompress
		resp, err := c.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		zr, err := gzip.NewReader(resp.Body)
		if err != nil || resp.Header.Get("Content-Encoding") != "gzip" {
			t.Fatalf("%s: Content-Encoding %q, %v; want a gzipped answer", tc.path, resp.Header.Get("Content-Encoding"), err)
		}
		got, err := io.ReadAll(zr)
		resp.Body.Close()
		if err != nil || string(got) != body {
			t.Fatalf("%s: the body changed: %v", tc.path, err)
		}
		c.awaitTokens(t, tc.zone, "k", tc.want, 0.05)
	}
	found := false
	for _, l := range logLines(t, c.LogFile) {
		found = found || l["reason"] == "the body is encoded (Content-Encoding: gzip)"
	}
	if !found {
		t.Errorf("no warning that the body is encoded")
	}
}

// replayBucket checks, from MONITOR's lines (in the order Redis ran
// them), every script call on the bucket at key: each admission (a take
// that wrote the bucket) found the bucket, refilled to the script's own
// time (which its write stores), holding the reservation, and took
// exactly that; each settlement (several may share a call) left what
// tokenbucket.SettleAt says. It returns the admissions, the settlements that
// went into debt and those that gave back.
func replayBucket(t *testing.T, lines []string, key string, v limit.Values) (admitted, debts, gaveBack int) {
	t.Helper()
	last := limit.State{Tokens: float64(v.Burst)}
	present := false
	var call []string // the script call on key being run, and its writes
	var writes []scriptBucket
	end := func() {
		defer func() { call, writes = nil, nil }()
		if call == nil {
			return
		}
		nkeys, _ := strconv.Atoi(call[2])
		per := 3 // a take's arguments per bucket
		if call[1] == settleScript.SHA() {
			per = 4
		}
		for k := range nkeys {
			if call[3+k] != key {
				continue
			}
			arg := func(i int) int64 { x, _ := strconv.ParseInt(call[3+nkeys+per*k+i], 10, 64); return x }
			var wrote *scriptBucket
			if len(writes) > 0 {
				wrote = &writes[0]
			}
			switch call[1] {
			case takeScript.SHA():
				if wrote == nil {
					continue // a refusal
				}
				before := last
				if !present {
					before = limit.State{Tokens: float64(v.Burst), At: wrote.at}
				}
				if tokens := tokenbucket.Refill(before, wrote.at, v); tokens < float64(arg(2)) || wrote.tokens != tokens-float64(arg(2)) {
					t.Fatalf("a take of %d at %d found %v tokens and left %v: admitted below its reservation, or took another amount",
						arg(2), wrote.at, tokens, wrote.tokens)
				}
				admitted++
			case settleScript.SHA():
				if wrote == nil { // a give-back to a bucket that stays full
					if present || arg(2) >= 0 {
						t.Fatalf("a settlement of %d did not write the bucket", arg(2))
					}
					continue
				}
				before := last
				if !present {
					before = limit.State{Tokens: float64(v.Burst), At: wrote.at}
				}
				want, _ := tokenbucket.SettleAt(before, wrote.at, v, arg(2), arg(3))
				if wrote.tokens != want.Tokens {
					t.Fatalf("a settlement of %d (max_debt %d) at %d from %v tokens left %v, want %v",
						arg(2), arg(3), wrote.at, tokenbucket.Refill(before, wrote.at, v), wrote.tokens, want.Tokens)
				}
				if arg(2) < 0 {
					gaveBack++
				} else if wrote.tokens < 0 {
					debts++
				}
			default:
				t.Fatalf("a script call that is neither a take nor a settlement: %v", call)
			}
			last, present = limit.State{Tokens: wrote.tokens, At: wrote.at}, true
			writes = writes[1:]
		}
		if len(writes) > 0 {
			t.Fatalf("a script call wrote %s more often than it had it: %v", key, call)
		}
	}
	for _, line := range lines {
		args := monitorArgs(t, line)
		if strings.Contains(line, " [0 lua] ") {
			if call != nil && len(args) >= 3 && strings.EqualFold(args[0], "set") && args[1] == key {
				state, err := parseBucket(redis.NewStringResult(args[2], nil))
				if err != nil {
					t.Fatal(err)
				}
				writes = append(writes, state)
			}
			continue
		}
		end()
		if len(args) >= 7 && strings.EqualFold(args[0], "evalsha") && slices.Contains(args[3:], key) {
			call = args
		}
	}
	end()
	return admitted, debts, gaveBack
}

// monitorRedis runs MONITOR on the Redis at addr and returns a function
// that stops it and returns every line it saw, in the order Redis ran
// the commands.
func monitorRedis(t *testing.T, addr string) func() []string {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	rd := bufio.NewReader(conn)
	if _, err := io.WriteString(conn, "MONITOR\r\n"); err != nil {
		t.Fatal(err)
	}
	if ok, err := rd.ReadString('\n'); err != nil || ok != "+OK\r\n" {
		t.Fatalf("MONITOR: %q %v", ok, err)
	}
	var lines []string
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			line, err := rd.ReadString('\n')
			if err != nil {
				return
			}
			lines = append(lines, strings.TrimSuffix(strings.TrimPrefix(line, "+"), "\r\n"))
		}
	}()
	return func() []string {
		_, _ = io.WriteString(conn, "QUIT\r\n") // Redis answers what it monitored so far, then closes
		<-done
		return lines
	}
}

// monitorArgs are the command and arguments of a MONITOR line,
// `<time> [<db> <client>] "cmd" "arg" ...`, unquoted.
func monitorArgs(t *testing.T, line string) []string {
	t.Helper()
	_, rest, ok := strings.Cut(line, "] ")
	if !ok {
		return nil
	}
	var args []string
	for rest = strings.TrimSpace(rest); rest != ""; rest = strings.TrimSpace(rest) {
		if rest[0] != '"' {
			t.Fatalf("MONITOR line %q: an argument not in quotes", line)
		}
		var b strings.Builder
		i := 1
		for ; i < len(rest) && rest[i] != '"'; i++ {
			if rest[i] == '\\' && i+1 < len(rest) {
				i++
			}
			b.WriteByte(rest[i])
		}
		args = append(args, b.String())
		rest = rest[min(i+1, len(rest)):]
	}
	return args
}

// answerRecorder takes a call's answer for a test.
type answerRecorder struct {
	reply []int64
	err   error
	// answered, when set, gets a value once the answer is in.
	answered chan struct{}
}

func (a *answerRecorder) TakeAnswer(c *redisbatch.Call) {
	a.reply, a.err = append([]int64(nil), c.Reply...), c.Err
	c.Release()
	if a.answered != nil {
		a.answered <- struct{}{}
	}
}

// newSettleCall is a settlement call of the buckets in diffs (each
// with args, a max debt of 5, and its difference), as settleInRedis
// queues it, whose answer rec takes.
func newSettleCall(rec redisbatch.AnswerTaker, args [3]any, diffs map[string]int64) *redisbatch.Call {
	c := redisbatch.NewCall()
	keys := slices.Sorted(maps.Keys(diffs))
	c.Keys = append(c.Keys, keys...)
	c.Command(settleScript)
	for _, k := range keys {
		c.Args = append(c.Args, args[0], args[1], redisstore.DiffArg(diffs[k]), "5")
	}
	c.ClientCtx, c.Then = context.Background(), rec
	return c
}

// queueAsOneBatch queues calls on l so that one worker takes them all
// as one batch, as under load: a proxy between l and Redis (proxy, its
// address l's) holds back a pipeline of each of l's two workers, whose
// calls (keys "hold:<n>") must stand for nothing else, until all of
// calls are queued. It waits for the held pipelines' answers.
func queueAsOneBatch(t *testing.T, l *redisstore.Client, proxy *redisProxy, calls []*redisbatch.Call) {
	t.Helper()
	proxy.delayMatching("hold:", time.Second)
	defer proxy.delayMatching("", 0)
	held := proxy.delayHeld.Load()
	var holders []*redisbatch.Call
	for i := range redisbatch.PipelinesInFlight {
		c := newTestCall(fmt.Sprint("hold:", i), limitArgs(1, 10, 1), time.Time{})
		if err := l.Batcher().Enqueue(c, time.Now()); err != nil {
			t.Fatal(err)
		}
		holders = append(holders, c)
		eventually(t, 5*time.Second, "a worker's pipeline is held", func() bool { return proxy.delayHeld.Load() == held+int64(i)+1 })
	}
	for _, c := range calls { // both workers busy: these wait in the queue, and the first free worker takes them all
		if err := l.Batcher().Enqueue(c, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range holders {
		if answered, _ := c.Wait(); !answered || c.Err != nil {
			t.Fatalf("a held call: answered %v, %v", answered, c.Err)
		}
		c.Release()
	}
}

// TestSettlementsOfABatchShareOneScriptCall: the settlement calls that
// one batch sends go to Redis as one call (redisbatch.MergedKind), where the
// first of them stood (not after every other call of the batch, where a
// take of a bucket queued after its settlement did not see it), and each
// gets the answer for its own buckets; other calls go as they are.
func TestSettlementsOfABatchShareOneScriptCall(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	proxy := startRedisProxy(t, srv.Addr)
	l := newTestLimiter(t, proxy.addr, 5*time.Second)
	v := limit.Values{Rate: 0.001, Burst: 100, Requested: 10}
	args := tokenbucket.Args(v)
	// m:bad holds a list: its settlement fails, and only its own.
	if err := rdb.LPush(context.Background(), "m:bad", "x").Err(); err != nil {
		t.Fatal(err)
	}
	var a, b, bad answerRecorder
	a.answered, b.answered, bad.answered = make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{}, 1)
	take := newTestCall("m:take", args, time.Time{})
	batch := []*redisbatch.Call{newSettleCall(&a, args, map[string]int64{"m:a": 30, "m:b": -5}), take,
		newSettleCall(&bad, args, map[string]int64{"m:bad": 3}), newSettleCall(&b, args, map[string]int64{"m:c": 200})}
	scriptsLoaded(t, rdb)
	before := commandCalls(t, rdb)["evalsha"]
	queueAsOneBatch(t, l, proxy, batch)
	if answered, _ := take.Wait(); !answered {
		t.Fatal("the take was not answered")
	}
	for _, rec := range []*answerRecorder{&a, &b, &bad} {
		<-rec.answered
	}
	// The held calls, then the batch: one settlement of 4 buckets where
	// the first stood, then the take.
	if calls := commandCalls(t, rdb)["evalsha"] - before; calls != redisbatch.PipelinesInFlight+2 {
		t.Errorf("%d script calls, want %d: one for each held call, then the settlements merged into one, and the take",
			calls, redisbatch.PipelinesInFlight+2)
	}
	// a: 100 - 30 = 70, and a full bucket given back 5 stays full; b:
	// 100 - 200 is -5 at most, 95 forgiven.
	if a.err != nil || !slices.Equal(a.reply, []int64{0, 0, 0, 0}) || b.err != nil || !slices.Equal(b.reply, []int64{95, 0}) ||
		bad.err != nil || !slices.Equal(bad.reply, []int64{-1, 0}) {
		t.Fatalf("answers: %v %v, %v %v and %v %v; want [0 0 0 0], [95 0] and [-1 0] (not settled)", a.reply, a.err, b.reply, b.err, bad.reply, bad.err)
	}
	for key, want := range map[string]float64{"m:a": 70, "m:c": -5} {
		if st, err := parseBucket(rdb.Get(context.Background(), key)); err != nil || math.Abs(st.tokens-want) > 0.01 {
			t.Errorf("%s holds %+v %v, want %v", key, st, err, want)
		}
	}
	if n, _ := rdb.Exists(context.Background(), "m:b").Result(); n != 0 {
		t.Errorf("m:b, full and given back tokens, was written")
	}
	take.Release()
}

// TestMergedSettlementsNeverPassACallOfTheirBucket: a batch queued as
// a refund of x, a take of x, a refund of y, a debt of x and a take of
// y. The refunds of x and y go as one call where x's stood, so each take
// sees the refund queued before it; the debt of x, queued after the take
// of x, goes after it, on its own. Merged after every other call, both
// takes were refused as if nothing had been refunded.
func TestMergedSettlementsNeverPassACallOfTheirBucket(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	proxy := startRedisProxy(t, srv.Addr)
	l := newTestLimiter(t, proxy.addr, 5*time.Second)
	args := limitArgs(0.001, 100, 60)
	for _, key := range []string{"o:x", "o:y"} {
		mustTake(t, l, key, args) // 40 left
	}
	var refunds, debt answerRecorder
	takeX, takeY := newTestCall("o:x", args, time.Time{}), newTestCall("o:y", args, time.Time{})
	refundX, refundY := newSettleCall(&refunds, args, map[string]int64{"o:x": -50}), newSettleCall(&refunds, args, map[string]int64{"o:y": -50})
	debtX := newSettleCall(&debt, args, map[string]int64{"o:x": 30})
	debt.answered = make(chan struct{}, 1)
	scriptsLoaded(t, rdb)
	before := commandCalls(t, rdb)["evalsha"]
	queueAsOneBatch(t, l, proxy, []*redisbatch.Call{refundX, takeX, refundY, debtX, takeY})
	for _, take := range []*redisbatch.Call{takeX, takeY} {
		if answered, _ := take.Wait(); !answered {
			t.Fatalf("the take of %s was not answered", take.Keys[0])
		}
		b := []limit.Bucket{{}}
		if allowed, err := redisstore.ReadTake(take.Reply, b, false); err != nil || !allowed || b[0].Remaining != 30 {
			t.Errorf("the take of %s after its refund: %v, %v with %d left; want admitted with 90 - 60 = 30 left", take.Keys[0], allowed, err, b[0].Remaining)
		}
		take.Release()
	}
	<-debt.answered
	if calls := commandCalls(t, rdb)["evalsha"] - before; calls != redisbatch.PipelinesInFlight+4 {
		t.Errorf("%d script calls, want %d: one for each held call, then the refunds of x and y merged where x's stood, "+
			"the take of x, the debt of x and the take of y", calls, redisbatch.PipelinesInFlight+4)
	}
	if st, err := parseBucket(rdb.Get(context.Background(), "o:x")); err != nil || math.Abs(st.tokens) > 0.01 {
		t.Errorf("o:x holds %+v %v, want 30 - 30 = 0: the debt after the take", st, err)
	}
}

// TestChargeNextRequestSeesTheSettlementOfTheLast: a settlement is
// queued before its response ends, so the client's next request sees it,
// however busy the batcher: 200 clients at once each send a request and,
// as soon as its response is read, a second one. Where the first cost
// less than its reservation, the second is admitted from the refund and
// its headers count it; where it cost more, the second meets the debt
// and is refused. Before, a settlement merged with others went after
// every other call of its batch, and one taken by the other worker could
// leave after the next request: a false 429 after a refund, an admission
// before a debt.
func TestChargeNextRequestSeesTheSettlementOfTheLast(t *testing.T) {
	srv := redistest.Start(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit /refund {
		zone refund
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 150
		requested_tokens 100
		charge header X-Cost
		redis %[1]s {
			timeout 5s
		}
	}
	rate_limit /debt {
		zone debt
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge header X-Cost
		redis %[1]s {
			timeout 5s
		}
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	const clients = 200
	for round := range 5 {
		var wg sync.WaitGroup
		failures := make(chan string, clients)
		for i := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := fmt.Sprintf("r%d-%d", round, i)
				// Refund: 150 - 100 = 50, the response costs 10: 140, and the
				// next reservation leaves 40. Debt: 1000 - 100 = 900, the
				// response costs 950: 50, short of the next reservation.
				path, cost := "/refund", 10
				expect := []struct {
					status    int
					remaining string
				}{{200, "50"}, {200, "40"}}
				if i%2 == 1 {
					path, cost = "/debt", 950
					expect[0].remaining, expect[1].status, expect[1].remaining = "900", 429, "50"
				}
				url := fmt.Sprintf("%s%s?format=raw&ct=text/plain&body=ok&cost=%d", c.URL, path, cost)
				for n, want := range expect {
					resp, _, err := getHeaders(c.client, url, "X-Key", key)
					if err != nil {
						failures <- fmt.Sprintf("%s %s request %d: %v", path, key, n+1, err)
						return
					}
					if got := resp.Header.Get("X-RateLimit-Remaining"); resp.StatusCode != want.status || got != want.remaining {
						failures <- fmt.Sprintf("%s %s request %d: %d with %s remaining (Retry-After %q), want %d with %s",
							path, key, n+1, resp.StatusCode, got, resp.Header.Get("Retry-After"), want.status, want.remaining)
						return
					}
				}
			}()
		}
		wg.Wait()
		close(failures)
		n := 0
		for f := range failures {
			if n++; n <= 5 {
				t.Error(f)
			}
		}
		if n > 0 {
			t.Fatalf("round %d: %d of %d clients' second requests did not see their first's settlement", round+1, n, clients)
		}
	}
}

// TestChargeWithLeaseSettlesUnderTheLeaseCap: a lending handler settles
// what responses cost with lease.lua: tokens given back never fill the
// bucket past its burst less what it lent (settle.lua, which knows
// nothing of leases, filled it to the burst under the leases), and once
// the lease went back the bucket holds exactly the burst less what the
// responses cost.
func TestChargeWithLeaseSettlesUnderTheLeaseCap(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	up := startChargeUpstream(t)
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	rate_limit {
		zone leased
		key {http.request.header.X-Key}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.total_tokens
		lease 300 1s
		redis %[1]s
	}
	reverse_proxy %[2]s
}
`, srv.Addr, up.host())
	key := adminBucketOf(t, c.admin, "leased", q("header.X-Key", "k")).StoredKey
	spent, maxLent := 0, int64(0)
	for i, usage := range []int{0, 0, 0, 0, 0, 0, 37, 250, 0, 0, 0} {
		resp, _ := c.get(t, fmt.Sprintf("/?format=openai&usage=%d", usage), "X-Key", "k")
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d, want 200", i+1, resp.StatusCode)
		}
		spent += usage
		time.Sleep(50 * time.Millisecond) // its settlement lands
		tokens, _ := tokensNow(t, rdb, key, 0.001, 1000)
		lent := int64(0)
		for _, l := range leaseRecords(t, rdb, key) {
			lent += l.tokens
		}
		maxLent = max(maxLent, lent)
		if tokens+float64(lent) > 1000.01 {
			t.Fatalf("after request %d: the bucket holds %.2f with %d lent: more than its burst of 1000", i+1, tokens, lent)
		}
	}
	if maxLent == 0 {
		t.Fatal("no lease was ever lent: the test settled nothing under a lease")
	}
	eventually(t, 5*time.Second, "the lease given back", func() bool { return len(leaseRecords(t, rdb, key)) == 0 })
	if tokens, _ := tokensNow(t, rdb, key, 0.001, 1000); math.Abs(tokens-float64(1000-spent)) > 0.05 {
		t.Errorf("after the lease went back the bucket holds %.3f; want %d (1000 less what the responses cost)", tokens, 1000-spent)
	}
	t.Logf("most lent at once: %d tokens", maxLent)
}
