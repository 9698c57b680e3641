package scan

import (
	"os"
	"strings"
	"testing"
)

// readValues reads doc in pieces of size n (the body as a client sends
// it) and returns each path's value or why it has none, and how many
// bytes were read before reading stopped.
func readValues(t *testing.T, doc string, n int, paths ...string) (map[string]string, int) {
	t.Helper()
	var ps Paths
	bits := map[string]uint16{}
	for _, p := range paths {
		bit, err := ps.Add(p)
		if err != nil {
			t.Fatal(err)
		}
		bits[p] = bit
	}
	var v Values
	v.Reset(&ps)
	read := 0
	over := false
	for read < len(doc) && !over {
		end := min(read+n, len(doc))
		over = v.Write([]byte(doc[read:end]))
		read = end
	}
	if !over {
		v.End()
	}
	out := map[string]string{}
	for _, p := range paths {
		value, why := v.Value(bits[p], []byte(doc[:read]))
		switch {
		case v.Why() != "":
			out[p] = "!" + v.Why()
		case why != "":
			out[p] = "!" + why
		default:
			out[p] = string(value)
		}
	}
	return out, read
}

func TestValuesFindsStringsNumbersAndBooleansAtTheirPaths(t *testing.T) {
	doc := `{"model": "gpt-4o", "messages": [{"role": "user", "content": "a \"quoted\" } { text"}], "max_tokens": 512, "stream": true, "n": null, "name": "caf\u00e9"}`
	for _, n := range []int{1, 3, 7, len(doc)} {
		got, _ := readValues(t, doc, n, "model", "max_tokens", "stream", "n", "messages.0.role", "name", "absent")
		want := map[string]string{"model": "gpt-4o", "max_tokens": "512", "stream": "true", "n": "", "messages.0.role": "user", "name": "café", "absent": ""}
		for p, w := range want {
			if got[p] != w {
				t.Errorf("pieces of %d: %s = %q, want %q", n, p, got[p], w)
			}
		}
	}
}

// TestValuesReadsToTheEndSoAPathMetTwiceLateHasNoValue: every path found
// early does not end the reading: a second model at the end of the
// document (which a parser keeping the last value would serve) empties
// the value, and a document read whole has its values.
func TestValuesReadsToTheEndSoAPathMetTwiceLateHasNoValue(t *testing.T) {
	messages := strings.Repeat(`{"role":"user","content":"xxxxxxxx"},`, 1000) + `{}`
	got, read := readValues(t, `{"model":"cheap","max_tokens":7,"messages":[`+messages+`],"model":"dear"}`, 16, "model", "max_tokens")
	if got["model"] != "!repeated" || got["max_tokens"] != "7" {
		t.Fatalf("values %v, want model repeated and max_tokens 7", got)
	}
	doc := `{"model":"m","max_tokens":7,"messages":[` + messages + `]}`
	got, read = readValues(t, doc, 16, "model", "max_tokens")
	if got["model"] != "m" || got["max_tokens"] != "7" || read != len(doc) {
		t.Fatalf("values %v after %d bytes of %d", got, read, len(doc))
	}
}

func TestValuesLeavesBadValuesEmptyAndSaysWhy(t *testing.T) {
	deep := `{"model":"m","x":` + strings.Repeat("[", 100_000) + strings.Repeat("]", 100_000) + `,"max_tokens":1}`
	for _, tc := range []struct {
		name, doc, path, want string
	}{
		{"a number", `{"model": 42}`, "model", "42"},
		{"an object", `{"model": {"id": "x"}}`, "model", "!nested"},
		{"an array", `{"model": ["a", "b"]}`, "model", "!nested"},
		{"a path twice", `{"model": "cheap", "x": 1, "model": "dear"}`, "model", "!repeated"},
		{"invalid UTF-8", "{\"model\": \"a\xff\xfeb\"}", "model", "!invalid_utf8"},
		{"not JSON", `model=gpt-4o&max_tokens=5`, "model", "!not_json"},
		{"cut short", `{"model": "gpt`, "model", "!not_json"},
		{"nested 100,000 deep", deep, "max_tokens", "!not_json"},
		{"a huge number", `{"max_tokens": 1e308}`, "max_tokens", "1e308"},
		{"a negative number", `{"max_tokens": -5}`, "max_tokens", "-5"},
		{"a string", `{"max_tokens": "abc"}`, "max_tokens", "abc"},
	} {
		got, _ := readValues(t, tc.doc, 5, tc.path, "never")
		if got[tc.path] != tc.want {
			t.Errorf("%s: %s = %q, want %q", tc.name, tc.path, got[tc.path], tc.want)
		}
	}
}

// TestValuesStringsWithEscapes: a string's escapes, an escaped quote
// among them, hide nothing from the scan however the document is cut.
func TestValuesStringsWithEscapes(t *testing.T) {
	doc := `{"a":"x\"y\\\\","s":"` + strings.Repeat(`ab\n\"`, 300) + `","model":"m\"1","n":5}`
	for _, n := range []int{1, 2, 3, 7, 64, len(doc)} {
		got, _ := readValues(t, doc, n, "model", "n")
		if got["model"] != `m"1` || got["n"] != "5" {
			t.Errorf("pieces of %d: %v", n, got)
		}
	}
}

// BenchmarkValuesLLMBody reads model and max_tokens from make bench's
// llm@64 request body, 2 KiB, max_tokens at its end.
func BenchmarkValuesLLMBody(b *testing.B) {
	doc, err := os.ReadFile("../../bench/llm-request.json")
	if err != nil {
		b.Fatal(err)
	}
	var ps Paths
	model, _ := ps.Add("model")
	tokens, _ := ps.Add("max_tokens")
	var v Values
	b.SetBytes(int64(len(doc)))
	b.ReportAllocs()
	for b.Loop() {
		v.Reset(&ps)
		v.Write(doc)
		v.End()
		if m, _ := v.Value(model, doc); len(m) == 0 {
			b.Fatal("no model")
		}
		if m, _ := v.Value(tokens, doc); len(m) == 0 {
			b.Fatal("no max_tokens")
		}
	}
}
