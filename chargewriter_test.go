package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The body scan (chargewriter.go) without any process: JSON bodies, event
// streams and JSON lines, fed whole, a byte at a time and in random
// pieces, must give the same cost.

// scanBody scans body, of the content type, for the paths, in the pieces
// that split gives, and returns the sum for all paths or why there is
// none.
func scanBody(t *testing.T, paths []string, contentType, body string, split func(string) []string) (float64, string) {
	t.Helper()
	c := &charging{}
	var fields []uint16
	for _, p := range paths {
		bit, err := c.paths.add(p)
		if err != nil {
			t.Fatal(err)
		}
		fields = append(fields, bit)
	}
	cw := newChargeWriter(discardWriter{http.Header{}}, c)
	if contentType != "" {
		cw.Header().Set("Content-Type", contentType)
	}
	cw.WriteHeader(200)
	for _, piece := range split(body) {
		if _, err := cw.Write([]byte(piece)); err != nil {
			t.Fatal(err)
		}
	}
	return cw.scanned(fields...)
}

// discardWriter is a ResponseWriter that keeps nothing.
type discardWriter struct{ h http.Header }

func (w discardWriter) Header() http.Header         { return w.h }
func (w discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w discardWriter) WriteHeader(int)             {}

// splits are the ways a body is cut into writes.
var splits = map[string]func(string) []string{
	"whole": func(s string) []string { return []string{s} },
	"bytes": func(s string) []string { return strings.Split(s, "") },
	"random": func(s string) []string {
		rng := rand.New(rand.NewPCG(7, uint64(len(s))))
		var pieces []string
		for len(s) > 0 {
			n := min(len(s), 1+rng.IntN(9))
			pieces, s = append(pieces, s[:n]), s[n:]
		}
		return pieces
	},
}

func TestChargeScanReadsNumbersAtJSONPaths(t *testing.T) {
	for _, tc := range []struct {
		name  string
		paths []string
		body  string
		want  float64
		why   string // a part of the reason, when there is no cost
	}{
		{"OpenAI chat completion", []string{"usage.total_tokens"},
			`{"id":"x","choices":[{"message":{"content":"usage.total_tokens: 99 \"}"}}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}`, 21, ""},
		{"Anthropic message, two paths summed", []string{"usage.input_tokens", "usage.output_tokens"},
			`{"type":"message","usage":{"input_tokens":25,"output_tokens":150}}`, 175, ""},
		{"Ollama native, two paths", []string{"prompt_eval_count", "eval_count"},
			`{"model":"m","done":true,"total_duration":5e9,"prompt_eval_count":26,"eval_count":290}`, 316, ""},
		{"a key that only starts like the path's", []string{"usage.total_tokens"},
			`{"usage":{"total_tokens_x":5,"total_token":6,"total_tokens":7}}`, 7, ""},
		{"the same key elsewhere does not count", []string{"usage.total_tokens"},
			`{"other":{"total_tokens":500},"usage":{"total_tokens":8},"x":{"usage":{"total_tokens":900}}}`, 8, ""},
		{"escaped key", []string{"usage.total_tokens"}, `{"u\u0073age":{"total\u005ftokens":11}}`, 11, ""},
		{"array index", []string{"choices.1.n"}, `{"choices":[{"n":1},{"n":2,"m":[3]},{"n":4}]}`, 2, ""},
		{"an array element that is an array", []string{"a.1.0"}, `{"a":[[5],[6,7]]}`, 6, ""},
		{"deep nesting around", []string{"a.b"}, `{"z":[[[[[[[[[[[[{"a":{"b":1}}]]]]]]]]]]]],"a":{"b":3}}`, 3, ""},
		{"the last of duplicate keys", []string{"n"}, `{"n":1,"n":2}`, 2, ""},
		{"a fraction rounds up later", []string{"n"}, `{"n":2.25}`, 2.25, ""},
		{"exponent", []string{"n"}, `{"n":1.5e2}`, 150, ""},
		{"spaces everywhere", []string{"a.b"}, " {\n \"a\" : { \"b\" :\t 4 } } \n", 4, ""},
		{"one path missing counts 0", []string{"usage.input_tokens", "usage.output_tokens"}, `{"usage":{"input_tokens":3}}`, 3, ""},
		{"a string is not a number", []string{"n"}, `{"n":"12"}`, 0, "no number at n"},
		{"null is not a number", []string{"usage.total_tokens"}, `{"usage":null}`, 0, "no number at usage.total_tokens"},
		{"an object at the path", []string{"usage"}, `{"usage":{"total_tokens":3}}`, 0, "no number"},
		{"negative", []string{"n"}, `{"n":-4}`, 0, "negative"},
		{"not JSON", []string{"n"}, `<html>n: 5</html>`, 0, "no number"},
		{"empty body", []string{"n"}, ``, 0, "no number"},
		{"a value before the body breaks off counts", []string{"n"}, `{"n":5,"rest":[1,2`, 5, ""},
		{"a value after garbage does not", []string{"n"}, `{"x":tru e,"n":5}`, 0, "no number"},
	} {
		for how, split := range splits {
			got, why := scanBody(t, tc.paths, "application/json", tc.body, split)
			if tc.why == "" && (why != "" || got != tc.want) {
				t.Errorf("%s (%s): %v %q, want %v", tc.name, how, got, why, tc.want)
			}
			if tc.why != "" && !strings.Contains(why, tc.why) {
				t.Errorf("%s (%s): %v %q, want no cost: %q", tc.name, how, got, why, tc.why)
			}
		}
	}
}

// Event streams as the providers send them.
const (
	openAIStream = "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n" +
		"data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\" there\"}}],\"usage\":null}\n\n" +
		"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"total_tokens\":12}}\n\n" +
		"data: [DONE]\n\n"
	anthropicStream = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n" +
		"event: ping\ndata: {\"type\": \"ping\"}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n" +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
	ollamaLines = "{\"model\":\"m\",\"message\":{\"content\":\"Hi\"},\"done\":false}\n" +
		"{\"model\":\"m\",\"message\":{\"content\":\"!\"},\"done\":false}\n" +
		"{\"model\":\"m\",\"done\":true,\"prompt_eval_count\":26,\"eval_count\":290}\n"
)

var anthropicPaths = []string{"message.usage.input_tokens", "usage.output_tokens"}

func TestChargeScanReadsEventStreamsAndJSONLines(t *testing.T) {
	bigEvent := "data: {\"usage\":{\"total_tokens\":1000},\"pad\":\"" + strings.Repeat("x", 64<<10) + "\"}\n\n"
	for _, tc := range []struct {
		name, contentType string
		paths             []string
		body              string
		want              float64
		why               string
	}{
		{"OpenAI's final usage chunk", "text/event-stream", []string{"usage.total_tokens"}, openAIStream, 12, ""},
		{"with a charset", "text/event-stream; charset=utf-8", []string{"usage.total_tokens"}, openAIStream, 12, ""},
		{"CRLF line ends", "text/event-stream", []string{"usage.total_tokens"}, strings.ReplaceAll(openAIStream, "\n", "\r\n"), 12, ""},
		{"CR line ends", "text/event-stream", []string{"usage.total_tokens"}, strings.ReplaceAll(openAIStream, "\n", "\r"), 12, ""},
		{"Anthropic's message_start input and message_delta output", "text/event-stream", anthropicPaths, anthropicStream, 40, ""},
		{"Anthropic's, cut after message_start", "text/event-stream", anthropicPaths, anthropicStream[:strings.Index(anthropicStream, "event: ping")], 25, ""},
		{"the last value of a path wins", "text/event-stream", []string{"n"}, "data: {\"n\":5}\n\ndata: {\"n\":7}\n\n", 7, ""},
		{"data over several lines, comments, other fields", "text/event-stream", []string{"a.b"},
			": ping\n\nid: 1\nevent: x\ndata: {\"a\":\ndata:{\"b\":\ndata:  9}}\nretry: 5\n\n", 9, ""},
		{"an event not yet complete does not count", "text/event-stream", []string{"n"}, "data: {\"n\":5}\n\ndata: {\"n\":7}\n", 5, ""},
		{"an event over 64 KiB counts", "text/event-stream", []string{"usage.total_tokens"}, openAIStream + bigEvent, 1000, ""},
		{"... as do the ones after it", "text/event-stream", []string{"usage.total_tokens"}, bigEvent + openAIStream, 12, ""},
		{"a JSON line over 64 KiB counts", "application/x-ndjson", []string{"usage.total_tokens"}, strings.TrimPrefix(bigEvent, "data: ") + ollamaLines, 1000, ""},
		{"a field named like data", "text/event-stream", []string{"n"}, "database: {\"n\":5}\ndat: {\"n\":6}\n\n", 0, "no number"},
		{"an event of broken JSON does not count", "text/event-stream", []string{"n"}, "data: {\"n\":5}\n\ndata: {\"n\":7,]}\n\n", 5, ""},
		{"two documents in one event do not count", "text/event-stream", []string{"n"}, "data: {\"n\":5} {\"n\":6}\n\n", 0, "no number"},
		{"no usage in the stream", "text/event-stream", []string{"usage.total_tokens"}, strings.Split(openAIStream, "data: {\"id\":\"c\",\"choices\":[],")[0], 0, "no number"},
		{"Ollama's JSON lines", "application/x-ndjson", []string{"prompt_eval_count", "eval_count"}, ollamaLines, 316, ""},
		{"JSON lines with a blank line and CRLF", "application/jsonl", []string{"n"}, "{\"n\":1}\r\n\r\n{\"n\":3}\r\n", 3, ""},
		{"a JSON line not yet complete does not count", "application/x-ndjson", []string{"n"}, "{\"n\":1}\n{\"n\":3", 1, ""},
		{"the last JSON line without a newline counts", "application/x-ndjson", []string{"prompt_eval_count", "eval_count"}, strings.TrimSuffix(ollamaLines, "\n"), 316, ""},
		{"... in application/jsonl", "application/jsonl", []string{"n"}, "{\"n\":1}\r\n{\"n\":3}", 3, ""},
		{"... ending in a number", "application/x-ndjson", []string{"n"}, "{\"n\":1}\n{\"n\":3}  ", 3, ""},
		{"an event without its blank line does not count", "text/event-stream", []string{"n"}, "data: {\"n\":5}\n\ndata: {\"n\":7}", 5, ""},
		{"a stream as one JSON body is not JSON", "application/json", []string{"n"}, "data: {\"n\":5}\n\n", 0, "no number"},
	} {
		for how, split := range splits {
			if how == "bytes" && len(tc.body) > 10000 {
				continue
			}
			got, why := scanBody(t, tc.paths, tc.contentType, tc.body, split)
			if tc.why == "" && (why != "" || got != tc.want) {
				t.Errorf("%s (%s): %v %q, want %v", tc.name, how, got, why, tc.want)
			}
			if tc.why != "" && !strings.Contains(why, tc.why) {
				t.Errorf("%s (%s): %v %q, want no cost: %q", tc.name, how, got, why, tc.why)
			}
		}
	}
}

// TestChargeScanStopsAtMaxBodyAndChargesWhatItRead: max_body bounds the
// bytes of a body the scan reads (JSON, events, JSON lines alike): past
// it the cost is what the body gave before, and when that is nothing,
// the reason names max_body.
// TestChargeScanFieldIsTheLastNumberAtAnyOfItsPaths: with `charge json
// { <field> <path>... }` a field's value is the last number the body gave
// at any of its paths, and the fields are summed: Anthropic's JSON answer
// and its streams, old and current, cost the same; a cumulative count
// repeated in later events counts once.
func TestChargeScanFieldIsTheLastNumberAtAnyOfItsPaths(t *testing.T) {
	h := offline(&Handler{ReplenishRate: "10", BurstCapacity: "100000", Charge: &Charge{JSONFields: map[string][]string{
		"input":  {"usage.input_tokens", "message.usage.input_tokens"},
		"output": {"usage.output_tokens", "message.usage.output_tokens"},
	}}})
	provision(t, h)
	rule := h.limits[0].charge
	currentStream := strings.Replace(anthropicStream, `"usage":{"output_tokens":15}`, `"usage":{"input_tokens":25,"cache_read_input_tokens":0,"output_tokens":15}`, 1)
	for _, tc := range []struct {
		name, contentType, body string
		want                    float64
		why                     string
	}{
		{"a JSON answer", "application/json", `{"type":"message","usage":{"input_tokens":25,"cache_creation_input_tokens":0,"output_tokens":15}}`, 40, ""},
		{"a stream: input in message_start, output in message_delta", "text/event-stream", anthropicStream, 40, ""},
		{"a stream whose message_delta repeats the cumulative input", "text/event-stream", currentStream, 40, ""},
		{"a stream cut after message_start", "text/event-stream", anthropicStream[:strings.Index(anthropicStream, "event: ping")], 26, ""},
		{"several message_delta events, cumulative", "text/event-stream",
			strings.Replace(currentStream, "event: message_stop", "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":25,\"output_tokens\":90}}\n\nevent: message_stop", 1), 115, ""},
		{"in one document, the later path", "application/json", `{"message":{"usage":{"input_tokens":3}},"usage":{"input_tokens":4}}`, 4, ""},
		{"... either way", "application/json", `{"usage":{"input_tokens":4},"message":{"usage":{"input_tokens":3}}}`, 3, ""},
		{"a field's last number negative", "text/event-stream", "data: {\"usage\":{\"input_tokens\":5}}\n\ndata: {\"message\":{\"usage\":{\"input_tokens\":-1}}}\n\n", 0,
			"a number at message.usage.input_tokens is negative"},
		{"none", "application/json", `{"usage":{}}`, 0, "no number at usage.input_tokens, message.usage.input_tokens, usage.output_tokens, message.usage.output_tokens in the body"},
	} {
		for how, split := range splits {
			cw := newChargeWriter(discardWriter{http.Header{"Content-Type": {tc.contentType}}}, h.charging)
			cw.WriteHeader(200)
			for _, piece := range split(tc.body) {
				_, _ = cw.Write([]byte(piece))
			}
			got, why := cw.scanned(rule.fields...)
			if got != tc.want || why != tc.why {
				t.Errorf("%s (%s): %v %q, want %v %q", tc.name, how, got, why, tc.want, tc.why)
			}
		}
	}
}

func TestChargeScanStopsAtMaxBodyAndChargesWhatItRead(t *testing.T) {
	pad := strings.Repeat("x", 200)
	for _, tc := range []struct {
		name, contentType, body string
		want                    float64
		why                     string
	}{
		{"JSON, its usage before the bound", "application/json", `{"n":5,"pad":"` + pad + `"}`, 5, ""},
		{"JSON, its usage after", "application/json", `{"pad":"` + pad + `","n":5}`, 0, "max_body (100 bytes)"},
		{"an event stream: the events before the bound", "text/event-stream", "data: {\"n\":5}\n\ndata: {\"n\":7,\"pad\":\"" + pad + "\"}\n\n", 5, ""},
		{"JSON lines: the lines before the bound", "application/x-ndjson", "{\"n\":5}\n{\"n\":7,\"pad\":\"" + pad + "\"}", 5, ""},
		{"a number cut by the bound is not read", "application/json", `{"pad":"` + pad[:84] + `","n":12345}`, 0, "max_body (100 bytes)"},
	} {
		for how, split := range splits {
			c := &charging{maxBody: 100}
			bit, _ := c.paths.add("n")
			cw := newChargeWriter(discardWriter{http.Header{"Content-Type": {tc.contentType}}}, c)
			cw.WriteHeader(200)
			for _, piece := range split(tc.body) {
				if n, err := cw.Write([]byte(piece)); n != len(piece) || err != nil {
					t.Fatalf("%s (%s): wrote %d of %d: %v", tc.name, how, n, len(piece), err)
				}
			}
			got, why := cw.scanned(bit)
			if tc.why == "" && (why != "" || got != tc.want) {
				t.Errorf("%s (%s): %v %q, want %v", tc.name, how, got, why, tc.want)
			}
			if tc.why != "" && !strings.Contains(why, tc.why) {
				t.Errorf("%s (%s): %v %q, want no cost: %q", tc.name, how, got, why, tc.why)
			}
		}
	}
}

// TestChargeScanReadsAJSONBodyOfAnySizeByDefault: without max_body a JSON
// body is read to its end, so an answer a client inflated (logprobs, n)
// past any size is charged its usage, which comes last.
func TestChargeScanReadsAJSONBodyOfAnySizeByDefault(t *testing.T) {
	h := offline(&Handler{ReplenishRate: "10", Charge: &Charge{JSON: []string{"usage.total_tokens"}}})
	provision(t, h)
	cw := newChargeWriter(discardWriter{http.Header{"Content-Type": {"application/json"}}}, h.charging)
	cw.WriteHeader(200)
	_, _ = cw.Write([]byte(`{"choices":[{"logprobs":{"content":[`))
	entry := []byte(`{"token":"tok","logprob":-0.0123,"bytes":[116,111,107],"top_logprobs":[]},`)
	for written := 0; written < 3<<20; written += len(entry) {
		_, _ = cw.Write(entry)
	}
	_, _ = cw.Write([]byte(`{}]}}],"usage":{"prompt_tokens":9,"completion_tokens":768,"total_tokens":777}}`))
	if got, why := cw.scanned(1); got != 777 || why != "" {
		t.Errorf("a 3 MiB answer: %v %q, want its usage, 777", got, why)
	}
}

func TestChargeScanGivesUpOnEncodedBodies(t *testing.T) {
	c := &charging{maxBody: 100}
	bit, _ := c.paths.add("n")
	cw := newChargeWriter(discardWriter{http.Header{"Content-Encoding": {"gzip"}}}, c)
	cw.WriteHeader(200)
	_, _ = cw.Write([]byte(`{"n":5}`))
	if _, why := cw.scanned(bit); !strings.Contains(why, "encoded (Content-Encoding: gzip)") {
		t.Errorf("a gzipped body: %q, want it refused", why)
	}
}

// TestChargeScanHoldsNoBody: the scan keeps no part of what it reads, so
// a body of any size costs the same memory.
func TestChargeScanHoldsNoBody(t *testing.T) {
	c := &charging{maxBody: 1 << 30}
	bit, _ := c.paths.add("usage.total_tokens")
	piece := []byte(`{"choices":[{"text":"` + strings.Repeat("y", 4000) + `"}],"usage":{"total_tokens":3}}` + "\n")
	cw := newChargeWriter(discardWriter{http.Header{"Content-Type": {"application/x-ndjson"}}}, c)
	cw.WriteHeader(200)
	allocs := testing.AllocsPerRun(100, func() { _, _ = cw.Write(piece) })
	if allocs > 1 { // a number's text becomes a string to parse
		t.Errorf("%v allocations per 4 KB line scanned, want at most 1", allocs)
	}
	if got, why := cw.scanned(bit); got != 3 || why != "" {
		t.Errorf("%v %q, want 3", got, why)
	}
}

// TestChargeWriterPassesFlushesAndCopies: the writer is an http.Flusher,
// http.ResponseController flushes through it to the writer beneath, an
// io.Copy into it is scanned when the body is read (through Write) and
// handed to the writer beneath otherwise, and what arrives beneath is
// what was written.
func TestChargeWriterPassesFlushesAndCopies(t *testing.T) {
	c := &charging{}
	bit, _ := c.paths.add("n")
	rec := httptest.NewRecorder()
	cw := newChargeWriter(rec, c)
	var w http.ResponseWriter = cw
	if _, ok := w.(http.Flusher); !ok {
		t.Fatal("the writer is not an http.Flusher")
	}
	cw.Header().Set("Content-Type", "application/json")
	cw.WriteHeader(201)
	if err := http.NewResponseController(w).Flush(); err != nil || !rec.Flushed {
		t.Fatalf("ResponseController.Flush: %v, flushed %v", err, rec.Flushed)
	}
	if _, err := io.Copy(w, strings.NewReader(`{"n":7}`)); err != nil {
		t.Fatal(err)
	}
	if got, why := cw.scanned(bit); got != 7 || why != "" || rec.Body.String() != `{"n":7}` || rec.Code != 201 || cw.status != 201 {
		t.Fatalf("scanned %v %q, body %q, status %d (%d); want 7, the body as written, 201", got, why, rec.Body.String(), rec.Code, cw.status)
	}

	// Without a body scan, a copy goes to the writer beneath (sendfile,
	// where it has it), and an implicit 200 is the status.
	plain := &charging{}
	rec = httptest.NewRecorder()
	cw = newChargeWriter(rec, plain)
	if n, err := io.Copy(cw, strings.NewReader("file")); n != 4 || err != nil || rec.Body.String() != "file" || cw.end(nil, false).status != 200 {
		t.Fatalf("copy: %d %v, body %q, status %d", n, err, rec.Body.String(), cw.end(nil, false).status)
	}
	if cw.Unwrap() != rec {
		t.Fatal("Unwrap does not give the writer beneath")
	}
}

// TestChargeCostHeaderReadsATrailer: a stream's cost, known at its end,
// comes as a trailer, which reverse_proxy puts in the header map once
// the body is copied: under its name when the upstream declared it in
// Trailer, else under http.TrailerPrefix. Either is the cost, before the
// header as the response was written; a header set later and not
// declared is not.
func TestChargeCostHeaderReadsATrailer(t *testing.T) {
	h := offline(&Handler{ReplenishRate: "10", Charge: &Charge{Header: "x-cost"}})
	provision(t, h)
	rule := h.limits[0].charge
	for _, tc := range []struct {
		name          string
		before, after func(h http.Header)
		want          string
		ok            bool
	}{
		{"a declared trailer", func(h http.Header) { h.Add("Trailer", "X-Other, x-cost") }, func(h http.Header) { h.Add("X-Cost", "42") }, "42", true},
		{"a trailer declared in a second Trailer line", func(h http.Header) { h.Add("Trailer", "X-Other"); h.Add("Trailer", "X-Cost") },
			func(h http.Header) { h.Add("X-Cost", "41") }, "41", true},
		{"an undeclared trailer, as reverse_proxy forwards it", nil, func(h http.Header) { h.Add(http.TrailerPrefix+"X-Cost", "43") }, "43", true},
		{"a declared trailer after a header of the same name", func(h http.Header) { h.Set("X-Cost", "1"); h.Set("Trailer", "X-Cost") },
			func(h http.Header) { h.Add("X-Cost", "44") }, "44", true},
		{"a header set after the response started, undeclared", nil, func(h http.Header) { h.Set("X-Cost", "45") }, "", false},
		{"no trailer: the header as written", func(h http.Header) { h.Set("X-Cost", "7") }, func(h http.Header) { h.Del("X-Cost") }, "7", true},
		{"a declared trailer that never came: the header as written", func(h http.Header) { h.Set("X-Cost", "8"); h.Set("Trailer", "X-Cost") },
			func(h http.Header) { h.Del("X-Cost") }, "8", true},
	} {
		cw := newChargeWriter(discardWriter{http.Header{}}, h.charging)
		if tc.before != nil {
			tc.before(cw.Header())
		}
		cw.WriteHeader(200)
		_, _ = cw.Write([]byte("data: {}\n\n"))
		tc.after(cw.Header())
		if got, ok := cw.costHeader(rule); got != tc.want || ok != tc.ok {
			t.Errorf("%s: %q %v, want %q %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}

// TestChargeResponseEnd: a response answered the status written, else
// its handler's error's, else 200; it answered nothing when the client
// left first (reverse_proxy writes 499, or a handler fails once the
// client has gone) or the handler aborted before writing. It was cut
// short when the client left before it ended or its handler aborted it.
func TestChargeResponseEnd(t *testing.T) {
	aborted, failed := errAborted, caddyhttp.Error(502, errors.New("upstream"))
	for _, tc := range []struct {
		written    int
		err        error
		clientLeft bool
		want       responseEnd
	}{
		{0, nil, false, responseEnd{status: 200}},
		{404, nil, false, responseEnd{status: 404}},
		{0, caddyhttp.Error(401, errors.New("no")), false, responseEnd{status: 401}},
		{0, errors.New("broken"), false, responseEnd{status: 500}},
		{206, caddyhttp.Error(502, errors.New("after the header")), false, responseEnd{status: 206}},
		{0, fmt.Errorf("wrapped: %w", caddyhttp.Error(429, errors.New("no"))), false, responseEnd{status: 429}},
		{101, nil, false, responseEnd{status: 101}},
		{200, nil, true, responseEnd{status: 200}},                                     // complete before the client left
		{499, nil, true, responseEnd{cutShort: true}},                                  // reverse_proxy: the client left before the answer
		{0, caddyhttp.Error(499, context.Canceled), true, responseEnd{cutShort: true}}, // as older reverse_proxy returns it
		{0, failed, true, responseEnd{cutShort: true}},                                 // failed once the client had left
		{200, aborted, true, responseEnd{status: 200, cutShort: true}},                 // the client left mid-stream
		{500, aborted, true, responseEnd{status: 500, cutShort: true}},
		{200, aborted, false, responseEnd{status: 200, cutShort: true}}, // the stream broke off
		{0, aborted, false, responseEnd{cutShort: true}},
	} {
		cw := newChargeWriter(httptest.NewRecorder(), &charging{})
		if tc.written != 0 {
			cw.WriteHeader(100) // informational: not the status
			cw.WriteHeader(tc.written)
		}
		if got := cw.end(tc.err, tc.clientLeft); got != tc.want {
			t.Errorf("written %d, error %v, client left %v: %+v, want %+v", tc.written, tc.err, tc.clientLeft, got, tc.want)
		}
	}
}

// TestChargeCostOfHowTheResponseEnded: under `charge_status 2xx` with a
// cost header and a reservation of 100, a status answered and not named
// costs nothing; a response that answered nothing (the client left
// first) or was cut short costs its reservation, or what it reported if
// more; an upgrade (101) is charged as a 2xx, and with `charge json` its
// reservation (no body to read), but not under `charge_status 401`.
func TestChargeCostOfHowTheResponseEnded(t *testing.T) {
	const reserved = 100
	header := &chargeRule{header: "X-Cost", statuses: []int{2}}
	paths := &chargeRule{paths: 1, statuses: []int{2}}
	logins := &chargeRule{statuses: []int{401}}
	c := &charging{headers: []string{"X-Cost"}}
	if _, err := c.paths.add("usage.total_tokens"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		rule    *chargeRule
		end     responseEnd
		written int    // the status written, 0 for none
		cost    string // the X-Cost header
		want    int64
	}{
		{"a 2xx", header, responseEnd{status: 200}, 200, "30", 30},
		{"a 500 answered", header, responseEnd{status: 500}, 500, "30", 0},
		{"a 500 answered, cut short", header, responseEnd{status: 500, cutShort: true}, 500, "30", 0},
		{"no answer: the client left first", header, responseEnd{cutShort: true}, 0, "", reserved},
		{"a 2xx cut short, reported less", header, responseEnd{status: 200, cutShort: true}, 200, "30", reserved},
		{"a 2xx cut short, reported more", header, responseEnd{status: 200, cutShort: true}, 200, "300", 300},
		{"a 2xx cut short, unreadable", header, responseEnd{status: 200, cutShort: true}, 200, "", reserved},
		{"an upgrade, its header", header, responseEnd{status: 101}, 101, "30", 30},
		{"an upgrade, charge json", paths, responseEnd{status: 101}, 101, "", reserved},
		{"an upgrade under charge_status 401", logins, responseEnd{status: 101}, 101, "", 0},
		{"a 401", logins, responseEnd{status: 401}, 401, "", reserved},
		{"a login the client left", logins, responseEnd{cutShort: true}, 0, "", reserved},
	} {
		cw := newChargeWriter(httptest.NewRecorder(), c)
		if tc.cost != "" {
			cw.Header().Set("X-Cost", tc.cost)
		}
		if tc.written != 0 {
			cw.WriteHeader(tc.written)
		}
		cost, why := tc.rule.costOf(tc.end, cw, caddy.NewReplacer(), reserved)
		if cost != tc.want || tc.end.cutShort && why != "" {
			t.Errorf("%s: cost %d (%q), want %d (and no warning for a response cut short)", tc.name, cost, why, tc.want)
		}
	}
}

// BenchmarkChargeScan is the CPU the scan spends per byte of a body
// (MB/s): a chat completion's logprobs (JSON, many short values), and an
// event stream of a chunk per token.
func BenchmarkChargeScan(b *testing.B) {
	var logprobs, stream strings.Builder
	logprobs.WriteString(`{"choices":[{"logprobs":{"content":[`)
	for i := range 10000 {
		fmt.Fprintf(&logprobs, `{"token":"tok%05d","logprob":-0.0123,"bytes":[116,111,107],"top_logprobs":[]},`, i)
		fmt.Fprintf(&stream, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok%05d\"}}],\"usage\":null}\n\n", i)
	}
	logprobs.WriteString(`{}]}}],"usage":{"total_tokens":777}}`)
	stream.WriteString("data: {\"choices\":[],\"usage\":{\"total_tokens\":777}}\n\ndata: [DONE]\n\n")
	for _, tc := range []struct{ name, contentType, body string }{
		{"json_logprobs", "application/json", logprobs.String()},
		{"event_stream", "text/event-stream", stream.String()},
	} {
		b.Run(tc.name, func(b *testing.B) {
			c := &charging{}
			bit, _ := c.paths.add("usage.total_tokens")
			body := []byte(tc.body)
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				cw := newChargeWriter(discardWriter{http.Header{"Content-Type": {tc.contentType}}}, c)
				cw.WriteHeader(200)
				for p := body; len(p) > 0; p = p[min(len(p), 16<<10):] {
					_, _ = cw.Write(p[:min(len(p), 16<<10)])
				}
				if got, why := cw.scanned(bit); got != 777 {
					b.Fatalf("%v %q", got, why)
				}
			}
		})
	}
}
