package ratelimit

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// bodyMemoryHandler parses a rate_limit directive with store memory and
// provisions it: no Redis.
func bodyMemoryHandler(t *testing.T, body string) *Handler {
	t.Helper()
	return caddyfileHandler(t, "rate_limit {\n\tstore memory\n"+body+"\n}")
}

// postThrough sends body through h, whose next handler records what it
// received and the placeholders it saw; it returns the status.
func postThrough(t *testing.T, h *Handler, body io.Reader, headers ...string) (status int, received []byte, seen func(string) string) {
	t.Helper()
	r, err := http.NewRequest(http.MethodPost, "http://example.com/v1/chat/completions", body)
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
		received, err = io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("the next handler's read: %v", err)
		}
		_ = r.Body.Close()
		w.WriteHeader(http.StatusOK)
		return nil
	})
	err = h.ServeHTTP(w, r, next)
	return statusOf(err, w.Code), received, func(ph string) string { return repl.ReplaceAll(ph, "") }
}

// TestRequestBodyValuesSetBeforeKeysAndBodyReplayed: the values of the
// named paths are placeholders when the key resolves and for the next
// handler, which receives the body byte for byte, in small reads and
// whole. A body that names a path twice, also after every path was
// found, or that is larger than max_size, has no values.
func TestRequestBodyValuesSetBeforeKeysAndBodyReplayed(t *testing.T) {
	h := bodyMemoryHandler(t, `	key {http.rate_limit.request.model}
	replenish_rate 1
	burst_capacity 2
	requested_tokens {http.rate_limit.request.max_tokens:1}
	request_body {
		json model max_tokens
		max_size 128KiB
	}`)
	body := `{"model":"gpt-4o","max_tokens":2,"messages":[{"role":"user","content":"` + strings.Repeat("x", 100<<10) + `"}]}`
	status, received, seen := postThrough(t, h, strings.NewReader(body))
	if status != 200 || !bytes.Equal(received, []byte(body)) {
		t.Fatalf("%d, received %d bytes of %d", status, len(received), len(body))
	}
	if seen("{http.rate_limit.request.model}") != "gpt-4o" || seen("{http.rate_limit.request.max_tokens}") != "2" {
		t.Fatalf("placeholders %q %q", seen("{http.rate_limit.request.model}"), seen("{http.rate_limit.request.max_tokens}"))
	}
	// The bucket of gpt-4o holds 2 and is empty now; another model's is
	// not; a body without a model has no key (403).
	if status, _, _ := postThrough(t, h, strings.NewReader(`{"model":"gpt-4o"}`)); status != 429 {
		t.Fatalf("gpt-4o again: %d, want 429", status)
	}
	// The default the config writes, for a body without max_tokens.
	if status, _, seen := postThrough(t, h, strings.NewReader(`{"model":"o3"}`)); status != 200 || seen("{http.rate_limit.request.max_tokens:1}") != "1" {
		t.Fatalf("o3 without max_tokens: %d, default %q", status, seen("{http.rate_limit.request.max_tokens:1}"))
	}
	if _, _, seen := postThrough(t, h, strings.NewReader(`{"model":"o4","max_tokens":2}`)); seen("{http.rate_limit.request.max_tokens:1}") != "2" {
		t.Fatalf("o4 with max_tokens 2: %q", seen("{http.rate_limit.request.max_tokens:1}"))
	}
	for _, tc := range []struct{ name, body, encoding string }{
		{"no model", `{"max_tokens":1}`, ""},
		{"gzip", `{"model":"x"}`, "gzip"},
		{"not JSON", `model=x`, ""},
		{"a second model after every path", `{"model":"o3","max_tokens":1,"model":"o4"}`, ""},
		{"larger than max_size", `{"model":"o3","messages":[{"content":"` + strings.Repeat("x", 200<<10) + `"}]}`, ""},
	} {
		status, received, _ := postThrough(t, h, strings.NewReader(tc.body), "Content-Encoding", tc.encoding)
		if status != 403 || received != nil {
			t.Errorf("%s: %d, want 403 (an empty key)", tc.name, status)
		}
	}
}

// TestRequestBodyHandlerWithoutPathsLeavesTheBodyAlone: a handler that
// names no path does not touch the body.
func TestRequestBodyHandlerWithoutPathsLeavesTheBodyAlone(t *testing.T) {
	h := bodyMemoryHandler(t, "\treplenish_rate 100")
	var sent io.Reader = strings.NewReader(`{"model":"x"}`)
	r, _ := http.NewRequest(http.MethodPost, "http://example.com/", sent)
	orig := r.Body
	r.RemoteAddr = "192.0.2.1:1"
	r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), httptest.NewRecorder(), &caddyhttp.Server{})
	var got io.ReadCloser
	_ = h.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		got = r.Body
		return nil
	}))
	if got != orig {
		t.Fatalf("the body became a %T", got)
	}
}

// TestRequestBodyWeightsResolvedPerRequest: requested_tokens as a
// weighted sum, rounded up; a value out of range refuses with 400, a
// weight out of range with 500, and charge json's weights are checked
// before the request too.
func TestRequestBodyWeightsResolvedPerRequest(t *testing.T) {
	h := bodyMemoryHandler(t, `	key {http.request.header.X-Key}
	replenish_rate 1
	burst_capacity 1000
	requested_tokens {http.rate_limit.request.max_tokens}*{http.request.header.X-Price} 3*0.5
	charge json usage.prompt_tokens*{http.request.header.X-In}
	request_body {
		json max_tokens
	}`)
	for _, tc := range []struct {
		name, body, price, in string
		status                int
		remaining             string
	}{
		{"10 × 2.5 + 1.5 = 26.5, 27", `{"max_tokens":10}`, "2.5", "1", 200, "973"},
		{"a price of 0: 1.5, 2", `{"max_tokens":10}`, "0", "1", 200, "971"},
		{"max_tokens -5", `{"max_tokens":-5}`, "1", "1", 400, ""},
		{"max_tokens abc", `{"max_tokens":"abc"}`, "1", "1", 400, ""},
		{"max_tokens 1e308", `{"max_tokens":1e308}`, "10", "1", 400, ""},
		{"no max_tokens", `{}`, "1", "1", 400, ""},
		{"a negative price", `{"max_tokens":1}`, "-1", "1", 500, ""},
		{"a price not a number", `{"max_tokens":1}`, "cheap", "1", 500, ""},
		{"an infinite price", `{"max_tokens":1}`, "1e999", "1", 500, ""},
		{"a negative charge weight", `{"max_tokens":1}`, "1", "-2", 500, ""},
	} {
		r, _ := http.NewRequest(http.MethodPost, "http://example.com/", strings.NewReader(tc.body))
		r.Header.Set("X-Key", "k")
		r.Header.Set("X-Price", tc.price)
		r.Header.Set("X-In", tc.in)
		r.RemoteAddr = "192.0.2.1:1"
		w := httptest.NewRecorder()
		r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, &caddyhttp.Server{})
		err := h.ServeHTTP(w, r, okHandler)
		if status := statusOf(err, w.Code); status != tc.status || tc.remaining != "" && w.Header().Get("X-RateLimit-Remaining") != tc.remaining {
			t.Errorf("%s: %d remaining %q, want %d %q (%v)", tc.name, status, w.Header().Get("X-RateLimit-Remaining"), tc.status, tc.remaining, err)
		}
	}
}

// TestRequestBodyAndWeightMistakesNameTheValue: the parser's and
// Validate's messages for request_body and weights give the value, the
// reason and the fix.
func TestRequestBodyAndWeightMistakesNameTheValue(t *testing.T) {
	for _, tc := range []struct{ name, input, want string }{
		{"request_body without json", "rate_limit 1 1 {\n\trequest_body {\n\t\tmax_size 1KiB\n\t}\n}", "request_body: want json <path>..."},
		{"request_body json without paths", "rate_limit 1 1 {\n\trequest_body {\n\t\tjson\n\t}\n}", "request_body json: want one or more paths"},
		{"request_body bad path", "rate_limit 1 1 {\n\trequest_body {\n\t\tjson a..b\n\t}\n}", "request_body json 'a..b': want keys separated by '.'"},
		{"request_body bad size", "rate_limit 1 1 {\n\trequest_body {\n\t\tjson model\n\t\tmax_size lots\n\t}\n}", "request_body max_size 'lots': want a size such as 1MiB"},
		{"request_body unknown", "rate_limit 1 1 {\n\trequest_body {\n\t\tjson model\n\t\tdepth 3\n\t}\n}", "unrecognized request_body subdirective 'depth'"},
		{"request_body twice", "rate_limit 1 1 {\n\trequest_body {\n\t\tjson model\n\t}\n\trequest_body {\n\t\tjson model\n\t}\n}", "subdirective 'request_body' is given twice"},
		{"requested_tokens negative weight", "rate_limit 10 100 {\n\trequested_tokens {x}*-1\n}", "requested_tokens '{x}*-1': weight '-1' is negative; want a number, 0 or more"},
		{"requested_tokens weight not a number", "rate_limit 10 100 {\n\trequested_tokens 5*abc\n}", "weight 'abc' is not a number"},
		{"requested_tokens infinite weight", "rate_limit 10 100 {\n\trequested_tokens 5*1e999\n}", "weight '1e999' is infinite"},
		{"requested_tokens sum above burst", "rate_limit 10 100 {\n\trequested_tokens 100*0.5 60\n}", "requested_tokens '110' is more than burst_capacity '100'"},
		{"charge json negative weight", "rate_limit 10 100 {\n\tcharge json usage.total_tokens*-0.5\n}", "charge json 'usage.total_tokens*-0.5': weight '-0.5' is negative"},
	} {
		_, err := parseTestCaddyfile(tc.input)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	// JSON configs: Validate (and Provision) judge the same.
	for _, tc := range []struct {
		name string
		h    *Handler
		want string
	}{
		{"request_body without json", &Handler{ReplenishRate: "1", RequestBody: &RequestBody{}}, "request_body: want json"},
		{"requested_tokens weight", &Handler{ReplenishRate: "1", BurstCapacity: "10", RequestedTokens: "{a}*-3"}, "weight '-3' is negative"},
		{"charge json weight", &Handler{ReplenishRate: "1", Charge: &Charge{JSON: []string{"usage.x*y"}}}, "charge json 'usage.x*y': weight 'y' is not a number"},
	} {
		tc.h.Store = storeMemory
		if err := tryProvision(t, tc.h); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}

// TestWeightedSumOfNumbersIsItsSumAtLoad: a weighted requested_tokens of
// numbers alone is its sum, rounded up, in a limit and in a quota alike.
func TestWeightedSumOfNumbersIsItsSumAtLoad(t *testing.T) {
	h := caddyfileHandler(t, "rate_limit {\n\tstore memory\n\tlimit a 10 100 {\n\t\trequested_tokens 7*0.5 2\n\t}\n\tquota b 1000 per day {\n\t\trequested_tokens 3*1.25 0.1\n\t}\n}")
	if got := h.limits[0].Values.Requested; got != 6 {
		t.Errorf("limit a: requested %d, want 6 (3.5 + 2, rounded up)", got)
	}
	if got := h.limits[1].Values.Requested; got != 4 {
		t.Errorf("quota b: requested %d, want 4 (3.75 + 0.1, rounded up)", got)
	}
}

// TestRequestBodySizeIsContentLengthOrTheBytesReadToTheEnd:
// {http.rate_limit.request_size} is a body's Content-Length when the
// request has one, else the bytes request_body read to the body's end;
// 0 without a body; unset (empty) for a body sent without
// Content-Length that it did not read to its end: larger than max_size,
// not JSON, encoded or cut off.
func TestRequestBodySizeIsContentLengthOrTheBytesReadToTheEnd(t *testing.T) {
	h := bodyMemoryHandler(t, `	replenish_rate 1000
	deny_empty_key false
	request_body {
		json model
		max_size 1KiB
	}`)
	small := `{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat("x", 500) + `"}]}`
	large := `{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat("x", 2000) + `"}]}`
	for _, tc := range []struct {
		name, body string
		length     int64 // -1: sent without Content-Length (chunked)
		encoding   string
		cut        bool
		want       string
	}{
		{"JSON with Content-Length", small, int64(len(small)), "", false, strconv.Itoa(len(small))},
		{"JSON chunked", small, -1, "", false, strconv.Itoa(len(small))},
		{"empty, chunked", "", -1, "", false, "0"},
		{"no body", "", 0, "", false, "0"},
		{"larger than max_size with Content-Length", large, int64(len(large)), "", false, strconv.Itoa(len(large))},
		{"larger than max_size chunked", large, -1, "", false, ""},
		{"not JSON with Content-Length", "model=gpt-4o", 12, "", false, "12"},
		{"not JSON chunked", "model=gpt-4o", -1, "", false, ""},
		{"encoded with Content-Length", small, int64(len(small)), "gzip", false, strconv.Itoa(len(small))},
		{"encoded chunked", small, -1, "gzip", false, ""},
		{"cut off, chunked", small, -1, "", true, ""},
	} {
		var body io.Reader = strings.NewReader(tc.body)
		if tc.cut {
			body = io.MultiReader(strings.NewReader(tc.body[:100]), iotest.ErrReader(io.ErrUnexpectedEOF))
		}
		r, _ := http.NewRequest(http.MethodPost, "http://example.com/", body)
		if tc.body == "" && tc.length == 0 {
			r.Body = http.NoBody
		}
		r.ContentLength = tc.length
		if tc.length >= 0 && r.Body != http.NoBody {
			r.Header.Set("Content-Length", strconv.FormatInt(tc.length, 10))
		}
		if tc.encoding != "" {
			r.Header.Set("Content-Encoding", tc.encoding)
		}
		r.RemoteAddr = "192.0.2.1:1"
		w := httptest.NewRecorder()
		repl := caddy.NewReplacer()
		r = caddyhttp.PrepareRequest(r, repl, w, &caddyhttp.Server{})
		var received []byte
		err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			received, _ = io.ReadAll(r.Body)
			return nil
		}))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := repl.ReplaceAll("{http.rate_limit.request_size}", ""); got != tc.want {
			t.Errorf("%s: {http.rate_limit.request_size} is %q, want %q", tc.name, got, tc.want)
		}
		if !tc.cut && string(received) != tc.body {
			t.Errorf("%s: the next handler received %d bytes, not the %d sent", tc.name, len(received), len(tc.body))
		}
	}
	// A Content-Length header written otherwise than as the number is
	// (leading zeros) gives the number.
	r, _ := http.NewRequest(http.MethodPost, "http://example.com/", strings.NewReader(small))
	r.Header.Set("Content-Length", "000"+strconv.Itoa(len(small)))
	r.RemoteAddr = "192.0.2.1:1"
	repl := caddy.NewReplacer()
	r = caddyhttp.PrepareRequest(r, repl, httptest.NewRecorder(), &caddyhttp.Server{})
	_ = h.ServeHTTP(httptest.NewRecorder(), r, okHandler)
	if got := repl.ReplaceAll("{http.rate_limit.request_size}", ""); got != strconv.Itoa(len(small)) {
		t.Errorf("Content-Length 000%d: {http.rate_limit.request_size} is %q", len(small), got)
	}
}
