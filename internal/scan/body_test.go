package scan

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
)

// The scans without any process: JSON bodies, event streams and JSON
// lines, fed whole, a byte at a time and in random pieces, must give the
// same sum.

// scanBody scans body, of the content type, for the paths, in the pieces
// that split gives, and returns the sum for all paths or why there is
// none.
func scanBody(t *testing.T, paths []string, contentType, body string, split func(string) []string) (float64, string) {
	t.Helper()
	var ps Paths
	var fields []uint16
	for _, p := range paths {
		bit, err := ps.Add(p)
		if err != nil {
			t.Fatal(err)
		}
		fields = append(fields, bit)
	}
	h := http.Header{}
	if contentType != "" {
		h.Set("Content-Type", contentType)
	}
	var b Body
	b.Reset(&ps, 0)
	b.Begin(h)
	for _, piece := range split(body) {
		if n, err := b.Write([]byte(piece)); n != len(piece) || err != nil {
			t.Fatalf("wrote %d of %d: %v", n, len(piece), err)
		}
	}
	return b.Sum(fields...)
}

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

func TestBodyReadsNumbersAtJSONPaths(t *testing.T) {
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

func TestBodyReadsEventStreamsAndJSONLines(t *testing.T) {
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
		{"an event over 64 KiB counts", "text/event-stream", []string{"usage.total_tokens"}, bigEvent + "data: [DONE]\n\n", 1000, ""},
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

// TestBodyEndsWhereTheAnswerEndsForAClient: Ended says the bytes written
// hold the end of the answer, at the first byte where a client could
// know it: a JSON document's closing bracket; in an event stream, the
// sixth byte of a first data line `[DONE]` (openai-go stops at an event
// whose data starts so), or the blank line that completes an event named
// as a stream's last (Anthropic's message_stop, the Responses API's
// response.completed). Nothing after the end is read, so the values are
// final there. JSON lines, and anything that does not end so, end only
// with the body.
func TestBodyEndsWhereTheAnswerEndsForAClient(t *testing.T) {
	const usage = "data: {\"usage\":{\"total_tokens\":12}}\n\n"
	for _, tc := range []struct {
		name, contentType, body string
		upTo                    string // the answer ends with the first of these in the body; "": it does not end
		want                    float64
	}{
		{"a JSON answer", "application/json", `{"usage":{"total_tokens":12}}`, "}}", 12},
		{"... with space around it", "application/json", ` {"usage":{"total_tokens":12}} ` + "\r\n", "}}", 12},
		{"a JSON answer cut short", "application/json", `{"usage":{"total_tokens":12}`, "", 12},
		{"a number alone, which only the body's end completes", "application/json", `12`, "", 0},
		{"OpenAI's stream", "text/event-stream", openAIStream, "[DONE]", 12},
		{"... with CRLF", "text/event-stream", strings.ReplaceAll(openAIStream, "\n", "\r\n"), "[DONE]", 12},
		{"... and what comes after [DONE] is not read", "text/event-stream", usage + "data: [DONE]\n\n" + strings.ReplaceAll(usage, "12", "99"), "[DONE]", 12},
		{"[DONE] without the space, and as a prefix", "text/event-stream", usage + "data:[DONE]x\n\n", "[DONE]", 12},
		{"[DONE] in an event with a name", "text/event-stream", usage + "event: done\ndata: [DONE]\n\n", "[DONE]", 12},
		{"[DONE] in a second data line does not end it", "text/event-stream", usage + "data: {}\ndata: [DONE]\n\n", "", 12},
		{"nor in a field other than data", "text/event-stream", usage + "id: [DONE]\n\n", "", 12},
		{"nor half of it", "text/event-stream", usage + "data: [DON", "", 12},
		{"Anthropic's stream ends with message_stop", "text/event-stream", anthropicStream, "message_stop\"}\n\n", 40},
		{"... at its blank line, not at its name", "text/event-stream", strings.TrimSuffix(anthropicStream, "\n"), "", 40},
		{"an event named like message_stop does not end it", "text/event-stream", usage + "event: message_stopped\ndata: {}\n\nevent: message_sto\ndata: {}\n\n", "", 12},
		{"a later event line renames the event", "text/event-stream", usage + "event: message_stop\nevent: ping\ndata: {}\n\n", "", 12},
		{"the Responses API's completed event, with its usage", "text/event-stream",
			"event: response.created\ndata: {}\n\nevent: response.completed\ndata: {\"response\":{\"usage\":{\"total_tokens\":12}}}\n\n", "}}}\n\n", 12},
		{"JSON lines end with the body", "application/x-ndjson", ollamaLines, "", 316},
	} {
		end := -1
		if tc.upTo != "" {
			end = strings.Index(tc.body, tc.upTo) + len(tc.upTo)
		}
		for how, split := range splits {
			var ps Paths
			var fields []uint16
			for _, p := range []string{"usage.total_tokens", "response.usage.total_tokens", "message.usage.input_tokens", "usage.output_tokens", "prompt_eval_count", "eval_count"} {
				bit, _ := ps.Add(p)
				fields = append(fields, bit)
			}
			var b Body
			b.Reset(&ps, 0)
			b.Begin(http.Header{"Content-Type": {tc.contentType}})
			written, endedIn, endedAt := 0, -1, -1 // the piece in which it ended: [endedIn, endedAt)
			for _, piece := range split(tc.body) {
				_, _ = b.Write([]byte(piece))
				if b.Ended() && endedIn < 0 {
					endedIn, endedAt = written, written+len(piece)
				}
				written += len(piece)
			}
			switch {
			case end < 0 && endedIn >= 0:
				t.Errorf("%s (%s): ended in bytes %d to %d, want no end", tc.name, how, endedIn, endedAt)
			case end >= 0 && !(endedIn < end && end <= endedAt):
				t.Errorf("%s (%s): ended in bytes %d to %d, want in the piece that holds byte %d", tc.name, how, endedIn, endedAt, end-1)
			}
			if got, why := b.Sum(fields...); got != tc.want && !(tc.want == 0 && why != "") {
				t.Errorf("%s (%s): %v %q, want %v", tc.name, how, got, why, tc.want)
			}
		}
	}
}

// TestSumFieldIsTheLastNumberAtAnyOfItsPaths: a field's value is the
// last number the body gave at any of its paths, and the fields are
// summed: Anthropic's JSON answer and its streams, old and current, cost
// the same; a cumulative count repeated in later events counts once.
func TestSumFieldIsTheLastNumberAtAnyOfItsPaths(t *testing.T) {
	var ps Paths
	var fields []uint16
	for _, field := range [][]string{
		{"usage.input_tokens", "message.usage.input_tokens"},
		{"usage.output_tokens", "message.usage.output_tokens"},
	} {
		var bits uint16
		for _, p := range field {
			bit, err := ps.Add(p)
			if err != nil {
				t.Fatal(err)
			}
			bits |= bit
		}
		fields = append(fields, bits)
	}
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
			var b Body
			b.Reset(&ps, 0)
			b.Begin(http.Header{"Content-Type": {tc.contentType}})
			for _, piece := range split(tc.body) {
				_, _ = b.Write([]byte(piece))
			}
			got, why := b.Sum(fields...)
			if got != tc.want || why != tc.why {
				t.Errorf("%s (%s): %v %q, want %v %q", tc.name, how, got, why, tc.want, tc.why)
			}
			// Field reads each field alone as Sum does: what the weighted
			// sums of the handler add up.
			var byField float64
			for _, f := range fields {
				if v, ok := b.Field(f); ok {
					byField += v
				}
			}
			if why == "" && byField != got {
				t.Errorf("%s (%s): the fields one by one sum to %v, Sum to %v", tc.name, how, byField, got)
			}
		}
	}
	// A body that cannot be read has no field.
	var b Body
	b.Reset(&ps, 0)
	b.Begin(http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"gzip"}})
	_, _ = b.Write([]byte(`{"usage":{"input_tokens":4}}`))
	if v, ok := b.Field(fields[0]); ok {
		t.Errorf("an encoded body: Field %v, want none", v)
	}
}

// TestBodyStopsAtMaxBodyAndSumsWhatItRead: maxBody bounds the bytes of a
// body the scan reads (JSON, events, JSON lines alike): past it the sum
// is what the body gave before, and when that is nothing, the reason
// names max_body.
func TestBodyStopsAtMaxBodyAndSumsWhatItRead(t *testing.T) {
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
			var ps Paths
			bit, _ := ps.Add("n")
			var b Body
			b.Reset(&ps, 100)
			b.Begin(http.Header{"Content-Type": {tc.contentType}})
			for _, piece := range split(tc.body) {
				if n, err := b.Write([]byte(piece)); n != len(piece) || err != nil {
					t.Fatalf("%s (%s): wrote %d of %d: %v", tc.name, how, n, len(piece), err)
				}
			}
			got, why := b.Sum(bit)
			if tc.why == "" && (why != "" || got != tc.want) {
				t.Errorf("%s (%s): %v %q, want %v", tc.name, how, got, why, tc.want)
			}
			if tc.why != "" && !strings.Contains(why, tc.why) {
				t.Errorf("%s (%s): %v %q, want no cost: %q", tc.name, how, got, why, tc.why)
			}
		}
	}
}

func TestBodyGivesUpOnEncodedBodies(t *testing.T) {
	var ps Paths
	bit, _ := ps.Add("n")
	var b Body
	b.Reset(&ps, 100)
	b.Begin(http.Header{"Content-Encoding": {"gzip"}})
	_, _ = b.Write([]byte(`{"n":5}`))
	if _, why := b.Sum(bit); !strings.Contains(why, "encoded (Content-Encoding: gzip)") {
		t.Errorf("a gzipped body: %q, want it refused", why)
	}
}

// TestBodyHoldsNoBody: the scan keeps no part of what it reads, so a
// body of any size costs the same memory.
func TestBodyHoldsNoBody(t *testing.T) {
	var ps Paths
	bit, _ := ps.Add("usage.total_tokens")
	piece := []byte(`{"choices":[{"text":"` + strings.Repeat("y", 4000) + `"}],"usage":{"total_tokens":3}}` + "\n")
	var b Body
	b.Reset(&ps, 1<<30)
	b.Begin(http.Header{"Content-Type": {"application/x-ndjson"}})
	allocs := testing.AllocsPerRun(100, func() { _, _ = b.Write(piece) })
	if allocs > 1 { // a number's text becomes a string to parse
		t.Errorf("%v allocations per 4 KB line scanned, want at most 1", allocs)
	}
	if got, why := b.Sum(bit); got != 3 || why != "" {
		t.Errorf("%v %q, want 3", got, why)
	}
}

// BenchmarkScan is the CPU the scan spends per byte of a body (MB/s): a
// chat completion's logprobs (JSON, many short values), and an event
// stream of a chunk per token, written in pieces of 16 KiB.
func BenchmarkScan(b *testing.B) {
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
			var ps Paths
			bit, _ := ps.Add("usage.total_tokens")
			body := []byte(tc.body)
			h := http.Header{"Content-Type": {tc.contentType}}
			b.SetBytes(int64(len(body)))
			var s Body
			for b.Loop() {
				s.Reset(&ps, 0)
				s.Begin(h)
				for p := body; len(p) > 0; p = p[min(len(p), 16<<10):] {
					_, _ = s.Write(p[:min(len(p), 16<<10)])
				}
				if got, why := s.Sum(bit); got != 777 {
					b.Fatalf("%v %q", got, why)
				}
			}
		})
	}
}
