//go:build !fast

package ratelimit

// The README's LLM gateway example, driven by the OpenAI Go client as a
// user's code would drive it. Apart from the rest of llm_test.go because
// the client is large: `make check` (-tags fast) leaves it out, which
// links the fast tier's test binary several seconds sooner; the test
// starts processes, so -short would skip it anyway. `make test` and
// plain `go test` build and run it.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

// openAIClient is openai-go's client of the gateway with an API key; it
// never retries, and records each body it sends, by X-Body-Id.
func openAIClient(c *chargeCaddy, apiKey string, sent map[string][]byte, mu *sync.Mutex) openai.Client {
	return openai.NewClient(option.WithBaseURL(c.URL+"/v1/"), option.WithAPIKey(apiKey), option.WithMaxRetries(0),
		option.WithMiddleware(func(r *http.Request, next option.MiddlewareNext) (*http.Response, error) {
			if sent != nil && r.Body != nil {
				b, err := io.ReadAll(r.Body)
				if err != nil {
					return nil, err
				}
				mu.Lock()
				sent[r.Header.Get("X-Body-Id")] = b
				mu.Unlock()
				r.Body = io.NopCloser(bytes.NewReader(b))
			}
			return next(r)
		}))
}

func chat(model string, maxTokens int64) openai.ChatCompletionNewParams {
	p := openai.ChatCompletionNewParams{Model: model, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hi.")}}
	if maxTokens > 0 {
		p.MaxTokens = openai.Int(maxTokens)
	}
	return p
}

// statusOfErr is the HTTP status of an openai-go error, 200 for none.
func statusOfErr(t *testing.T, err error) int {
	t.Helper()
	if err == nil {
		return 200
	}
	var apiErr *openai.Error
	if errors.As(err, &apiErr) {
		return apiErr.StatusCode
	}
	t.Fatalf("not an API error: %v", err)
	return 0
}

// TestLLMGatewayReadmeExampleRunsAsWritten: the README's LLM gateway, as
// written, through openai-go, streamed and not: two models spend the
// money budget at their prices, exactly after each response; each
// request reserves what its max_tokens allows; a model whose tokens per
// minute are spent is refused while the other is admitted.
func TestLLMGatewayReadmeExampleRunsAsWritten(t *testing.T) {
	srv := redistest.Start(t)
	up := startLLMUpstream(t)
	c := startReadmeLLMGateway(t, srv.Addr, up)
	var mu sync.Mutex
	sent := map[string][]byte{}
	client := openAIClient(c, "sk-1", sent, &mu)
	ctx := context.Background()
	dollars := func() float64 { return gatewayTokens(t, c, "sk-1", "gpt-4o", "dollars") }

	// The budget, exact after each response: 1,000 prompt and 200
	// completion tokens cost 1000 × 2.5 + 200 × 10 on gpt-4o, 1000 × 0.15
	// + 200 × 0.6 on gpt-4o-mini.
	spent := 0.0
	for i, tc := range []struct {
		model  string
		stream bool
		cost   float64
	}{
		{"gpt-4o", false, 4500},
		{"gpt-4o-mini", false, 270},
		{"gpt-4o", true, 4500},
		{"gpt-4o-mini", true, 270},
	} {
		id := option.WithHeader("X-Body-Id", fmt.Sprintf("budget-%d", i))
		if tc.stream {
			params := chat(tc.model, 300)
			params.StreamOptions.IncludeUsage = openai.Bool(true)
			stream := client.Chat.Completions.NewStreaming(ctx, params, id)
			var acc openai.ChatCompletionAccumulator
			for stream.Next() {
				acc.AddChunk(stream.Current())
			}
			if err := stream.Err(); err != nil {
				t.Fatalf("%s streamed: %v", tc.model, err)
			}
			if acc.Usage.TotalTokens != 1200 || acc.Choices[0].Message.Content != "Hi there" {
				t.Fatalf("%s streamed: usage %+v, content %q", tc.model, acc.Usage, acc.Choices[0].Message.Content)
			}
		} else {
			resp, err := client.Chat.Completions.New(ctx, chat(tc.model, 300), id)
			if err != nil {
				t.Fatalf("%s: %v", tc.model, err)
			}
			if resp.Model != tc.model || resp.Usage.TotalTokens != 1200 {
				t.Fatalf("%s: model %q, usage %+v", tc.model, resp.Model, resp.Usage)
			}
		}
		spent += tc.cost
		eventually(t, 3*time.Second, fmt.Sprintf("response %d (%s) charged exactly", i, tc.model),
			func() bool { return dollars() == gatewayBudget-spent })
	}

	// The reservation follows max_tokens, max_completion_tokens and n:
	// while the upstream holds the answer, the budget of a fresh key holds
	// (max_tokens + max_completion_tokens) × n × 10 + body bytes × 0.625
	// (rounded up) less, max_tokens 4,096 when absent; its model's tokens,
	// (max_tokens + max_completion_tokens) × n + body bytes / 4 (and what
	// refilled since).
	for _, tc := range []struct {
		name                        string
		maxTokens, maxCompletion, n int64
		answer                      int64 // what the reservation allows for the answer
	}{
		{"max_tokens 1000", 1000, 0, 0, 1000},
		{"max_tokens 7000", 7000, 0, 0, 7000},
		{"max_tokens 1000, n 3", 1000, 0, 3, 3000},
		{"max_completion_tokens 500 alone", 0, 500, 0, 4096 + 500},
		{"max_tokens 100, max_completion_tokens 500, n 2", 100, 500, 2, 1200},
	} {
		key := "sk-reserve-" + strings.ReplaceAll(tc.name, " ", "-")
		id := key
		params := chat("gpt-4o", tc.maxTokens)
		if tc.maxCompletion > 0 {
			params.MaxCompletionTokens = openai.Int(tc.maxCompletion)
		}
		if tc.n > 0 {
			params.N = openai.Int(tc.n)
		}
		done := make(chan error, 1)
		up.release = make(chan struct{})
		start := time.Now()
		go func() {
			fresh := openAIClient(c, key, nil, nil)
			_, err := fresh.Chat.Completions.New(ctx, params, option.WithHeader("X-Body-Id", id), option.WithHeader("X-Hold", "1"))
			done <- err
		}()
		size := float64(up.body(t, id).size)
		if got, want := gatewayTokens(t, c, key, "gpt-4o", "dollars"), gatewayBudget-float64(tc.answer)*10-ceilF(size*0.625); got != want {
			t.Errorf("%s: the budget holds %v while the answer is held, want %v (a reservation of %d × 10 + %v bytes × 0.625)",
				tc.name, got, want, tc.answer, size)
		}
		reserved := float64(tc.answer) + ceilF(size/4)
		tokens := gatewayTokens(t, c, key, "gpt-4o", "tokens")
		refilled := time.Since(start).Seconds()*100000/60 + 1 // and a token for Redis's clock against this one
		if tokens < 100000-reserved || tokens > 100000-reserved+refilled {
			t.Errorf("%s: the model's tokens hold %v, want %v less (and at most %.0f refilled)", tc.name, tokens, reserved, refilled)
		}
		close(up.release)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		eventually(t, 3*time.Second, "the held answer charged", func() bool { return gatewayTokens(t, c, key, "gpt-4o", "dollars") == gatewayBudget-4500 })
	}

	// Per model: an answer of 150,000 tokens takes gpt-4o's minute below
	// zero; gpt-4o is refused, gpt-4o-mini is not.
	if _, err := client.Chat.Completions.New(ctx, chat("gpt-4o", 300), option.WithHeader("X-Completion-Tokens", "150000")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 3*time.Second, "gpt-4o's tokens in debt", func() bool {
		return gatewayTokens(t, c, "sk-1", "gpt-4o", "tokens") < 0
	})
	_, err := client.Chat.Completions.New(ctx, chat("gpt-4o", 300))
	if status := statusOfErr(t, err); status != http.StatusTooManyRequests {
		t.Fatalf("gpt-4o after its minute was spent: %d, want 429", status)
	}
	if _, err := client.Chat.Completions.New(ctx, chat("gpt-4o-mini", 300)); err != nil {
		t.Fatalf("gpt-4o-mini while gpt-4o is refused: %v", err)
	}
	other := openAIClient(c, "sk-2", nil, nil)
	if _, err := other.Chat.Completions.New(ctx, chat("gpt-4o", 300)); err != nil {
		t.Fatalf("another key's gpt-4o: %v", err)
	}

	// Each body the client sent reached the upstream byte for byte.
	mu.Lock()
	defer mu.Unlock()
	for id, b := range sent {
		if id == "" {
			continue
		}
		if got := up.body(t, id); got.sum != sha256.Sum256(b) || got.size != len(b) {
			t.Errorf("body %s: the upstream received %d bytes, not the %d sent", id, got.size, len(b))
		}
	}
}

// TestLLMBudgetUnderConcurrencyNeverPassesTheBoundPlusMaxDebt: 32
// clients of one API key, 8 requests each, each on a model of its own
// (so that no model's tokens per minute refuse it first; unknown models
// pay the map's default prices), whose answers cost 6 dollars each
// against a reservation of about a thousandth of that: the budget of the
// README's gateway is charged no more than its 50 dollars plus
// max_debt's one, however many were in flight at once.
func TestLLMBudgetUnderConcurrencyNeverPassesTheBoundPlusMaxDebt(t *testing.T) {
	srv := redistest.Start(t)
	up := startLLMUpstream(t)
	c := startReadmeLLMGateway(t, srv.Addr, up)
	client := openAIClient(c, "sk-many", nil, nil)
	var admitted, refused atomic.Int64
	var wg sync.WaitGroup
	for g := range 32 {
		wg.Go(func() {
			for i := range 8 {
				// 1,000 × 10 + 149,750 × 40: 6 dollars at the default prices.
				model := fmt.Sprintf("model-%d-%d", g, i)
				_, err := client.Chat.Completions.New(context.Background(), chat(model, 100), option.WithHeader("X-Completion-Tokens", "149750"))
				switch status := statusOfErr(t, err); status {
				case 200:
					admitted.Add(1)
				case 429:
					refused.Add(1)
				default:
					t.Errorf("status %d", status)
				}
			}
		})
	}
	wg.Wait()
	const maxDebt = 1_000_000
	charged := func() float64 {
		return scrapeMetricsAt(t, c.admin).samples[chargeSeries("charged_total", "llm-gateway", "dollars")]
	}
	eventually(t, 5*time.Second, "every settlement", func() bool {
		return gatewayTokens(t, c, "sk-many", "gpt-4o", "dollars") < 0
	})
	time.Sleep(200 * time.Millisecond) // the last settlements, queued before their responses ended
	got := charged()
	left := gatewayTokens(t, c, "sk-many", "gpt-4o", "dollars")
	t.Logf("admitted %d, refused %d; charged %.0f, the budget holds %.0f", admitted.Load(), refused.Load(), got, left)
	if got > gatewayBudget+maxDebt || left < -maxDebt {
		t.Fatalf("charged %.0f with the budget at %.0f: more than %d + max_debt %d", got, left, gatewayBudget, maxDebt)
	}
	if admitted.Load()*6_000_000 < gatewayBudget || refused.Load() == 0 {
		t.Fatalf("admitted %d, refused %d: the test did not reach the budget", admitted.Load(), refused.Load())
	}
}

// answersUpstream answers every request as X-Answer asks, reporting 950
// tokens, and then keeps the response open for hold before it ends it,
// as an upstream (or a proxy before it) may: "openai-stream" an OpenAI
// chat completion stream (usage, then `data: [DONE]`), "anthropic-stream"
// a Messages API stream (input 50 in message_start, output 900 in
// message_delta, then message_stop), anything else a JSON chat
// completion.
func answersUpstream(t *testing.T, hold time.Duration) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		const usage = `{"prompt_tokens":50,"completion_tokens":900,"total_tokens":950}`
		switch r.Header.Get("X-Answer") {
		case "openai-stream":
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n")
			fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":%s}\n\n", usage)
			fmt.Fprint(w, "data: [DONE]\n\n")
		case "anthropic-stream":
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":50,\"output_tokens\":1}}}\n\n",
				"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":900}}\n\n",
				"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
		default:
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":%s}`, usage)
		}
		_ = http.NewResponseController(w).Flush()
		select {
		case <-time.After(hold):
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestChargeNextRequestSentAtTheAnswersEndSeesItsSettlement: a client
// may send its next request as soon as it has the end of its answer,
// while the upstream still keeps the response open: openai-go stops
// reading a stream at `data: [DONE]`, an Anthropic client at
// message_stop, a client that decodes a JSON answer at its last brace
// (each leaves its connection, and sends the next request on a new one).
// The settlement is queued before those bytes pass, so that next request
// never finds the bucket as the reservation left it: with a reservation
// of 100 from 1,000 and answers that cost 950, every next request is
// refused, on Redis and in store memory, however loaded the machine.
// Before, the settlement waited for the handler to return, and most were
// admitted on the 900 the reservation left.
func TestChargeNextRequestSentAtTheAnswersEndSeesItsSettlement(t *testing.T) {
	srv := redistest.Start(t)
	up := answersUpstream(t, 300*time.Millisecond)
	limit := `
		key {http.request.header.Authorization}
		replenish_rate 0.001
		burst_capacity 1000
		requested_tokens 100
		charge json usage.total_tokens message.usage.input_tokens usage.output_tokens
		charge_status 2xx`
	c := startChargeCaddy(t, `
http://127.0.0.1:{{http_port}} {
	@memory header X-Store memory
	rate_limit @memory {
		zone answers-memory
		store memory`+limit+`
	}
	@redis not header X-Store memory
	rate_limit @redis {
		zone answers-redis
		redis %[1]s {
			timeout 5s
		}`+limit+`
	}
	reverse_proxy %[2]s
}
`, srv.Addr, strings.TrimPrefix(up.URL, "http://"))
	newConnections := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	post := func(key, store, answer string) (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, c.URL+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[]}`))
		if err != nil {
			return nil, err
		}
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("X-Store", store)
		req.Header.Set("X-Answer", answer)
		return newConnections.Do(req)
	}
	// Each answer read as its client reads it, up to its end; the next
	// request's status.
	clients := map[string]func(key, store string) (next int, err error){
		"openai-go, a stream": func(key, store string) (int, error) {
			client := openAIClient(c, key, nil, nil)
			opts := []option.RequestOption{option.WithHeader("X-Store", store), option.WithHeader("X-Answer", "openai-stream")}
			params := chat("m", 100)
			params.StreamOptions.IncludeUsage = openai.Bool(true)
			stream := client.Chat.Completions.NewStreaming(context.Background(), params, opts...)
			var acc openai.ChatCompletionAccumulator
			for stream.Next() {
				acc.AddChunk(stream.Current())
			}
			if err := stream.Err(); err != nil || acc.Usage.TotalTokens != 950 {
				return 0, fmt.Errorf("the stream: %v, usage %+v", err, acc.Usage)
			}
			_, err := client.Chat.Completions.New(context.Background(), chat("m", 100), opts...)
			var apiErr *openai.Error
			switch {
			case err == nil:
				return http.StatusOK, nil
			case errors.As(err, &apiErr):
				return apiErr.StatusCode, nil
			}
			return 0, err
		},
		"a JSON decoder": func(key, store string) (int, error) {
			resp, err := post(key, store, "json")
			if err != nil {
				return 0, err
			}
			var answer struct {
				Usage struct {
					TotalTokens int `json:"total_tokens"`
				} `json:"usage"`
			}
			err = json.NewDecoder(resp.Body).Decode(&answer)
			resp.Body.Close()
			if err != nil || answer.Usage.TotalTokens != 950 {
				return 0, fmt.Errorf("the JSON answer: %v, usage %+v", err, answer.Usage)
			}
			return nextStatus(post(key, store, "json"))
		},
		"an Anthropic stream's reader": func(key, store string) (int, error) {
			resp, err := post(key, store, "anthropic-stream")
			if err != nil {
				return 0, err
			}
			lines := bufio.NewScanner(resp.Body)
			stop := false
			for !stop && lines.Scan() {
				stop = lines.Text() == "event: message_stop"
			}
			for lines.Scan() && lines.Text() != "" { // the event's data, up to its blank line
			}
			resp.Body.Close()
			if !stop || lines.Err() != nil {
				return 0, fmt.Errorf("the stream: no message_stop (%v)", lines.Err())
			}
			return nextStatus(post(key, store, "anthropic-stream"))
		},
	}
	const rounds = 20
	for name, read := range clients {
		for _, store := range []string{"redis", "memory"} {
			var wg sync.WaitGroup
			var admitted, refused atomic.Int64
			for round := range rounds {
				key := fmt.Sprintf("%s-%s-%d", strings.ReplaceAll(name, " ", "-"), store, round)
				wg.Go(func() {
					switch next, err := read(key, store); {
					case err != nil:
						t.Errorf("%s, %s, %s: %v", name, store, key, err)
					case next == http.StatusOK:
						admitted.Add(1)
					case next == http.StatusTooManyRequests:
						refused.Add(1)
					default:
						t.Errorf("%s, %s, %s: the next request answered %d", name, store, key, next)
					}
				})
			}
			wg.Wait()
			t.Logf("%s, %s: %d of %d next requests refused", name, store, refused.Load(), rounds)
			if admitted.Load() > 0 {
				t.Errorf("%s, %s: %d of %d next requests admitted on the reservation's 900 tokens, which the settlement (950) leaves at 50",
					name, store, admitted.Load(), rounds)
			}
		}
	}
}

// nextStatus is the status of a response, whose body it drops.
func nextStatus(resp *http.Response, err error) (int, error) {
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}
