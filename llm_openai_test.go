//go:build !fast

package ratelimit

// The README's LLM gateway example, driven by the OpenAI Go client as a
// user's code would drive it. Apart from the rest of llm_test.go because
// the client is large: `make check` (-tags fast) leaves it out, which
// links the fast tier's test binary several seconds sooner; the test
// starts processes, so -short would skip it anyway. `make test` and
// plain `go test` build and run it.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
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

	// The reservation follows max_tokens: while the upstream holds the
	// answer, the budget of a fresh key holds max_tokens × 10 +
	// body bytes × 0.625 (rounded up) less; its model's tokens,
	// max_tokens + body bytes / 4 (and what refilled since).
	for _, maxTokens := range []int64{1000, 7000} {
		key := fmt.Sprintf("sk-reserve-%d", maxTokens)
		id := key
		done := make(chan error, 1)
		up.release = make(chan struct{})
		start := time.Now()
		go func() {
			fresh := openAIClient(c, key, nil, nil)
			_, err := fresh.Chat.Completions.New(ctx, chat("gpt-4o", maxTokens), option.WithHeader("X-Body-Id", id), option.WithHeader("X-Hold", "1"))
			done <- err
		}()
		size := float64(up.body(t, id).size)
		if got, want := gatewayTokens(t, c, key, "gpt-4o", "dollars"), gatewayBudget-float64(maxTokens)*10-ceilF(size*0.625); got != want {
			t.Errorf("max_tokens %d: the budget holds %v while the answer is held, want %v (a reservation of max_tokens × 10 + %v bytes × 0.625)",
				maxTokens, got, want, size)
		}
		reserved := float64(maxTokens) + ceilF(size/4)
		tokens := gatewayTokens(t, c, key, "gpt-4o", "tokens")
		refilled := time.Since(start).Seconds()*100000/60 + 1 // and a token for Redis's clock against this one
		if tokens < 100000-reserved || tokens > 100000-reserved+refilled {
			t.Errorf("max_tokens %d: the model's tokens hold %v, want %v less (and at most %.0f refilled)", maxTokens, tokens, reserved, refilled)
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
