package ratelimit

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddy-redis/ratelimit/internal/cost"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// chargeThrough sends a POST of body (with the headers: name, value,
// ...) through h, a handler with store memory, whose next handler
// answers answer as contentType (JSON when empty). It returns the
// status, X-RateLimit-Remaining, and {http.rate_limit.charged} once the
// response was settled (in the process, at once).
func chargeThrough(t *testing.T, h *Handler, body, contentType, answer string, headers ...string) (status int, remaining, charged string) {
	t.Helper()
	r, err := http.NewRequest(http.MethodPost, "http://example.com/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		r.Header.Set(headers[i], headers[i+1])
	}
	r.RemoteAddr = "192.0.2.1:1234"
	w := httptest.NewRecorder()
	repl := caddy.NewReplacer()
	r = caddyhttp.PrepareRequest(r, repl, w, &caddyhttp.Server{})
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if contentType == "" {
			contentType = "application/json"
		}
		w.Header().Set("Content-Type", contentType)
		w.WriteHeader(http.StatusOK)
		_, err := w.Write([]byte(answer))
		return err
	})
	err = h.ServeHTTP(w, r, next)
	return statusOf(err, w.Code), w.Header().Get("X-RateLimit-Remaining"), repl.ReplaceAll("{http.rate_limit.charged}", "")
}

// usageAnswer is a chat completion's JSON answer with its usage.
func usageAnswer(prompt, completion string) string {
	return fmt.Sprintf(`{"id":"chatcmpl-1","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}],"usage":{"prompt_tokens":%s,"completion_tokens":%s}}`, prompt, completion)
}

// TestWeightedSumsOfDecimalsStayExact: a product or sum that is exact in
// decimal is not rounded up by binary floating point's last digit:
// {max_tokens}*0.07 with 100 reserves 7 (not 8), prompt*0.14 +
// completion*0.07 with 100 and 100 charges 21 (not 22), a sum of numbers
// at load 0.1 0.2 0.7 is 1; a fraction read from the request's or the
// response's body multiplies as written, and only the sum is rounded up.
func TestWeightedSumsOfDecimalsStayExact(t *testing.T) {
	h := bodyMemoryHandler(t, `	key {http.request.header.X-Key}
	replenish_rate 0.001
	burst_capacity 1000
	requested_tokens {http.rate_limit.request.max_tokens}*0.07
	charge json usage.prompt_tokens*0.14 usage.completion_tokens*0.07
	request_body {
		json max_tokens
	}`)
	for _, tc := range []struct {
		name, maxTokens, prompt, completion string
		remaining, charged                  string
	}{
		{"100 × 0.07 reserved; 100 × 0.14 + 100 × 0.07 charged", "100", "100", "100", "993", "21"},
		{"fractions from the bodies: 100.0 × 0.07; 12.5 × 0.14 + 75 × 0.07 (7)", "100.0", "12.5", "75", "993", "7"},
		{"fractions rounded up once: 100.5 × 0.07 (7.035, 8); 0.5 × 0.14 + 100 × 0.07 (7.07, 8)", "100.5", "0.5", "100", "992", "8"},
		{"fractions summed before rounding: 0.1 × 0.07 (1); 1e-2 × 0.14 + 0.1 × 0.07 (0.0084, 1)", "0.1", "1e-2", "0.1", "999", "1"},
	} {
		status, remaining, charged := chargeThrough(t, h, `{"max_tokens":`+tc.maxTokens+`}`, "", usageAnswer(tc.prompt, tc.completion), "X-Key", tc.name)
		if status != 200 || remaining != tc.remaining || charged != tc.charged {
			t.Errorf("%s: %d, remaining %s, charged %s; want 200, %s, %s", tc.name, status, remaining, charged, tc.remaining, tc.charged)
		}
	}

	for _, tc := range []struct {
		cost string
		want int64
	}{
		{"100*0.07", 7},
		{"0.1 0.2 0.7", 1},
		{"0.29*100", 29},
		{"4.35*100 1.005*1000", 1440},
		{"3*1.25 0.1", 4},
		{"2.5e1*0.04", 1},
		{"100*0.14 100*0.07", 21},
	} {
		h := caddyfileHandler(t, "rate_limit {\n\tstore memory\n\treplenish_rate 10\n\tburst_capacity 5000\n\trequested_tokens "+tc.cost+"\n}")
		if got := h.limits[0].Values.Requested; got != tc.want {
			t.Errorf("requested_tokens %s: %d at load, want %d", tc.cost, got, tc.want)
		}
	}
}

// TestTermsMultiplyEveryFactor: a term of several factors, numbers and
// placeholders alike, is their product: requested_tokens {X-Max}*2*5
// with 100 reserves 1000 and charge json usage.total_tokens*2*5 charges
// 10 times the usage; {max_tokens}*{n:1}*0.07*{price} with 100 and 5
// reserves 35, 7 without n (its default 1); a body's value in a factor
// after the first is the client's (400), a price the configuration's
// (500).
func TestTermsMultiplyEveryFactor(t *testing.T) {
	header := bodyMemoryHandler(t, `	key {http.request.header.X-Key}
	replenish_rate 1
	burst_capacity 100000
	requested_tokens {http.request.header.X-Max}*2*5
	charge json usage.total_tokens*2*5`)
	status, remaining, charged := chargeThrough(t, header, `{}`, "", `{"usage":{"total_tokens":30}}`, "X-Key", "k", "X-Max", "100")
	if status != 200 || remaining != "99000" || charged != "300" {
		t.Errorf("X-Max 100 × 2 × 5, total_tokens 30 × 2 × 5: %d, remaining %s, charged %s; want 200, 99000, 300", status, remaining, charged)
	}

	body := bodyMemoryHandler(t, `	key {http.request.header.X-Key}
	replenish_rate 0.001
	burst_capacity 1000
	requested_tokens {http.rate_limit.request.max_tokens}*{http.rate_limit.request.n:1}*0.07*{http.request.header.X-Price}
	request_body {
		json max_tokens n
	}`)
	for _, tc := range []struct {
		name, body, price string
		status            int
		remaining         string
	}{
		{"max_tokens 100 × n 5 × 0.07", `{"max_tokens":100,"n":5}`, "1", 200, "965"},
		{"n absent: its default 1", `{"max_tokens":100}`, "1", 200, "993"},
		{"n 1.5 (10.5, rounded up)", `{"max_tokens":100,"n":1.5}`, "1", 200, "989"},
		{"a price of 2", `{"max_tokens":100,"n":5}`, "2", 200, "930"},
		{"n negative: the client's value", `{"max_tokens":100,"n":-1}`, "1", 400, ""},
		{"n not a number: the client's value", `{"max_tokens":100,"n":"many"}`, "1", 400, ""},
		{"a price not a number: a weight", `{"max_tokens":100}`, "cheap", 500, ""},
	} {
		status, remaining, _ := chargeThrough(t, body, tc.body, "", "{}", "X-Key", tc.name, "X-Price", tc.price)
		if status != tc.status || remaining != tc.remaining {
			t.Errorf("%s: %d, remaining %q; want %d, %q", tc.name, status, remaining, tc.status, tc.remaining)
		}
	}
}

// TestMalformedTermsRefusedAtLoadNamingThem: a term with an empty factor
// (a '*' at an end, two together), a brace without its pair, a path
// without a field, a charge json path holding a placeholder or a space,
// and field paths with different weights are refused at load, in the
// Caddyfile and in JSON, with the term, the reason and the fix.
func TestMalformedTermsRefusedAtLoadNamingThem(t *testing.T) {
	for _, tc := range []struct{ name, line, want string }{
		{"two stars", "requested_tokens {x}**2", "requested_tokens '{x}**2': an empty factor (a '*' at an end, or two together); write factors joined by one '*'"},
		{"a trailing star", "requested_tokens {x}*2*", "requested_tokens '{x}*2*': an empty factor"},
		{"a leading star", "requested_tokens *2", "requested_tokens '*2': a term without a value"},
		{"a lone star between", "requested_tokens {x} * 2", "requested_tokens '*': a term without a value"},
		{"an unclosed brace", "requested_tokens {x*2", "requested_tokens '{x*2': factor '{x*2' has a brace without its pair"},
		{"a second weight not a number", "requested_tokens {x}*2*abc", "requested_tokens '{x}*2*abc': weight 'abc' is not a number"},
		{"a second weight negative", "requested_tokens 5*2*-1", "requested_tokens '5*2*-1': weight '-1' is negative"},
		{"charge json two stars", "charge json usage.total_tokens**2", "charge json 'usage.total_tokens**2': an empty factor"},
		{"charge json a trailing star", "charge json usage.total_tokens*", "charge json 'usage.total_tokens*': an empty factor"},
		{"charge json a second weight", "charge json usage.total_tokens*2*x", "charge json 'usage.total_tokens*2*x': weight 'x' is not a number"},
		{"charge json no path", "charge json *2", "charge json '*2': a term without a path"},
		{"charge json a placeholder in the path", "charge json usage.{model}*2", "charge json 'usage.{model}*2': path 'usage.{model}' cannot hold '{': a path is fixed keys of the body, not placeholders; put placeholders in a weight after it"},
		{"charge json field two stars", "charge json {\n\t\tinput usage.input_tokens**2\n\t}", "charge json field 'input', path 'usage.input_tokens**2': an empty factor"},
		{"charge json field a placeholder in the path", "charge json {\n\t\tinput usage.{x}\n\t}", "charge json field 'input', path 'usage.{x}': path 'usage.{x}' cannot hold '{'"},
		{"charge json field weights that differ", "charge json {\n\t\tinput usage.input_tokens*2 message.usage.input_tokens\n\t}",
			"charge json field 'input': 'usage.input_tokens*2' and 'message.usage.input_tokens' have different weights ('2' and '1'): a field is one count, found at any of its paths, so each path carries the same; write message.usage.input_tokens*2"},
	} {
		_, err := parseTestCaddyfile("rate_limit 10 100 {\n\t" + tc.line + "\n}")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		h    *Handler
		want string
	}{
		{"requested_tokens two stars", &Handler{ReplenishRate: "1", BurstCapacity: "10", RequestedTokens: "{a}**3"}, "requested_tokens '{a}**3': an empty factor"},
		{"charge json a space in a path", &Handler{ReplenishRate: "1", Charge: &Charge{JSON: []string{"usage.prompt_tokens usage.completion_tokens"}}},
			"charge json 'usage.prompt_tokens usage.completion_tokens': path 'usage.prompt_tokens usage.completion_tokens' cannot hold spaces or control characters; write keys separated by '.', such as usage.total_tokens, a term per path (in JSON, a string per term)"},
		{"charge json a brace", &Handler{ReplenishRate: "1", Charge: &Charge{JSON: []string{"usage.}x"}}}, "path 'usage.}x' cannot hold '}'"},
		{"json_fields a trailing star", &Handler{ReplenishRate: "1", Charge: &Charge{JSONFields: map[string][]string{"out": {"usage.output_tokens*"}}}}, "charge json field 'out', path 'usage.output_tokens*': an empty factor"},
		{"json_fields weights that differ", &Handler{ReplenishRate: "1", Charge: &Charge{JSONFields: map[string][]string{"out": {"usage.output_tokens*{p}", "message.usage.output_tokens*{q}"}}}}, "have different weights ('{p}' and '{q}')"},
	} {
		tc.h.Store = storeMemory
		if err := tryProvision(t, tc.h); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}

// anthropicMessage is a Messages API answer; anthropicStream its event
// stream, whose message_delta repeats the cumulative input tokens.
func anthropicMessage(in, out int) string {
	return fmt.Sprintf(`{"id":"msg_1","type":"message","content":[{"type":"text","text":"Hi"}],"usage":{"input_tokens":%d,"cache_read_input_tokens":0,"output_tokens":%d}}`, in, out)
}

func anthropicStream(in, out int) string {
	return fmt.Sprintf("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":%d,\"output_tokens\":1}}}\n\n", in) +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n" +
		fmt.Sprintf("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":%d,\"output_tokens\":%d}}\n\n", in, out) +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
}

// TestChargeJSONFieldWeightsPriceEachField: the paths of a charge json
// field carry weights (numbers and placeholders, several factors): a
// JSON answer and a stream of Anthropic's Messages API are charged
// input × its price + output × its price, the same, once each.
func TestChargeJSONFieldWeightsPriceEachField(t *testing.T) {
	h := bodyMemoryHandler(t, `	key {http.request.header.X-Key}
	replenish_rate 1
	burst_capacity 100000
	requested_tokens 4000
	charge json {
		input usage.input_tokens*{http.request.header.X-In-Price} message.usage.input_tokens*{http.request.header.X-In-Price}
		output usage.output_tokens*2*5 message.usage.output_tokens*2*5
	}`)
	for _, tc := range []struct {
		name, contentType, answer string
	}{
		{"a JSON answer", "application/json", anthropicMessage(1000, 200)},
		{"a stream", "text/event-stream", anthropicStream(1000, 200)},
	} {
		// 1000 × 0.3 + 200 × 2 × 5
		status, _, charged := chargeThrough(t, h, `{}`, tc.contentType, tc.answer, "X-Key", tc.name, "X-In-Price", "0.3")
		if status != 200 || charged != "2300" {
			t.Errorf("%s: %d, charged %q; want 200, 2300", tc.name, status, charged)
		}
	}
}

// TestWeightFactorsKnowRequestBodyPlaceholders: a factor naming a value
// of request_body's is the client's (400 when out of range), as the cost
// package recognises it by request_body's placeholder prefix.
func TestWeightFactorsKnowRequestBodyPlaceholders(t *testing.T) {
	if cost.RequestValuePrefix != "{"+requestPlaceholderPrefix {
		t.Errorf("cost.RequestValuePrefix %q, want {%s", cost.RequestValuePrefix, requestPlaceholderPrefix)
	}
}
