package ratelimit

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

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
	c := &charging{maxBody: defaultMaxBody}
	var mask uint16
	for _, p := range paths {
		bit, err := c.paths.add(p)
		if err != nil {
			t.Fatal(err)
		}
		mask |= bit
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
	return cw.scanned(mask)
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
	bigEvent := "data: {\"usage\":{\"total_tokens\":1000},\"pad\":\"" + strings.Repeat("x", maxEventBytes) + "\"}\n\n"
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
		{"an event over 64 KiB does not count", "text/event-stream", []string{"usage.total_tokens"}, bigEvent + openAIStream, 12, ""},
		{"... nor stops the ones after it", "text/event-stream", []string{"usage.total_tokens"}, openAIStream + bigEvent, 12, ""},
		{"a field named like data", "text/event-stream", []string{"n"}, "database: {\"n\":5}\ndat: {\"n\":6}\n\n", 0, "no number"},
		{"an event of broken JSON does not count", "text/event-stream", []string{"n"}, "data: {\"n\":5}\n\ndata: {\"n\":7,]}\n\n", 5, ""},
		{"two documents in one event do not count", "text/event-stream", []string{"n"}, "data: {\"n\":5} {\"n\":6}\n\n", 0, "no number"},
		{"no usage in the stream", "text/event-stream", []string{"usage.total_tokens"}, strings.Split(openAIStream, "data: {\"id\":\"c\",\"choices\":[],")[0], 0, "no number"},
		{"Ollama's JSON lines", "application/x-ndjson", []string{"prompt_eval_count", "eval_count"}, ollamaLines, 316, ""},
		{"JSON lines with a blank line and CRLF", "application/jsonl", []string{"n"}, "{\"n\":1}\r\n\r\n{\"n\":3}\r\n", 3, ""},
		{"a JSON line not yet complete does not count", "application/x-ndjson", []string{"n"}, "{\"n\":1}\n{\"n\":3", 1, ""},
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

func TestChargeScanGivesUpOnLargeOrEncodedBodies(t *testing.T) {
	c := &charging{maxBody: 100}
	bit, _ := c.paths.add("n")
	body := `{"n":5,"pad":"` + strings.Repeat("x", 100) + `"}`
	cw := newChargeWriter(discardWriter{http.Header{}}, c)
	_, _ = cw.Write([]byte(body[:50]))
	_, _ = cw.Write([]byte(body[50:]))
	if _, why := cw.scanned(bit); !strings.Contains(why, "larger than max_body (100 bytes)") {
		t.Errorf("a body over max_body: %q, want it refused", why)
	}

	cw = newChargeWriter(discardWriter{http.Header{"Content-Encoding": {"gzip"}}}, c)
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
	c := &charging{maxBody: defaultMaxBody}
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
	if n, err := io.Copy(cw, strings.NewReader("file")); n != 4 || err != nil || rec.Body.String() != "file" || cw.finalStatus(nil) != 200 {
		t.Fatalf("copy: %d %v, body %q, status %d", n, err, rec.Body.String(), cw.finalStatus(nil))
	}
	if cw.Unwrap() != rec {
		t.Fatal("Unwrap does not give the writer beneath")
	}
}

func TestChargeFinalStatus(t *testing.T) {
	for _, tc := range []struct {
		written int
		err     error
		want    int
	}{
		{0, nil, 200},
		{404, nil, 404},
		{0, caddyhttp.Error(401, errors.New("no")), 401},
		{0, errors.New("broken"), 500},
		{206, caddyhttp.Error(502, errors.New("after the header")), 206},
		{0, fmt.Errorf("wrapped: %w", caddyhttp.Error(429, errors.New("no"))), 429},
	} {
		cw := newChargeWriter(httptest.NewRecorder(), &charging{})
		if tc.written != 0 {
			cw.WriteHeader(100) // informational: not the status
			cw.WriteHeader(tc.written)
		}
		if got := cw.finalStatus(tc.err); got != tc.want {
			t.Errorf("written %d, error %v: status %d, want %d", tc.written, tc.err, got, tc.want)
		}
	}
}
