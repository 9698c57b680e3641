package scan

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"unicode"
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

// TestValuesKeyInAnotherCaseCountsAsThePathGivenAgain: Go's
// encoding/json reads a key that differs from a struct field's only in
// case (Unicode simple folding: K, the Kelvin sign, is k; ſ, the long s,
// is s) as that field, and keeps the last; most other parsers read it as
// another key. So a key that matches a path's only folded is the path
// given again, at any depth, written raw or escaped: the path has no
// value, whoever reads the body.
func TestValuesKeyInAnotherCaseCountsAsThePathGivenAgain(t *testing.T) {
	for _, tc := range []struct {
		name, doc, path, want string
	}{
		{"a dear model in capitals after a cheap one", `{"model":"gpt-cheap","MODEL":"gpt-dear","max_tokens":600}`, "model", "!repeated"},
		{"max_tokens in capitals after", `{"max_tokens":1,"MAX_TOKENS":900}`, "max_tokens", "!repeated"},
		{"max_tokens in capitals before", `{"MAX_TOKENS":900,"max_tokens":1}`, "max_tokens", "!repeated"},
		{"a key in another case alone", `{"Model":"gpt-dear"}`, "model", "!repeated"},
		{"the Kelvin sign for k", `{"max_tokens":1,"max_to` + "\u212a" + `ens":900}`, "max_tokens", "!repeated"},
		{"the Kelvin sign escaped", `{"max_tokens":1,"max_to\u212Aens":900}`, "max_tokens", "!repeated"},
		{"the long s for s", `{"max_tokens":1,"max_token` + "\u017f" + `":900}`, "max_tokens", "!repeated"},
		{"capitals escaped", `{"model":"a","\u004dODEL":"b"}`, "model", "!repeated"},
		{"capitals escaped in pieces", `{"model":"a","\u004D\u004f\u0044EL":"b"}`, "model", "!repeated"},
		{"a container in another case", `{"stream_options":{"include_usage":false},"Stream_Options":{"include_usage":true}}`, "stream_options.include_usage", "!repeated"},
		{"a container in another case alone", `{"STREAM_OPTIONS":{"include_usage":true}}`, "stream_options.include_usage", "!repeated"},
		{"an inner key in another case", `{"stream_options":{"include_usage":false,"Include_Usage":true}}`, "stream_options.include_usage", "!repeated"},
		{"an array in another case", `{"messages":[{"role":"user"}],"Messages":[{"role":"system"}]}`, "messages.0.role", "!repeated"},
		{"a non-ASCII path in capitals", `{"café":1,"CAF\u00c9":2}`, "café", "!repeated"},
		{"a non-ASCII path, its capital raw", `{"café":1,"cafÉ":2}`, "café", "!repeated"},
		{"an escaped surrogate pair is the path itself", `{"🙂":1,"\ud83d\ude42":2}`, "🙂", "!repeated"},
		{"keys that are not the path in any case", `{"model":"a","models":"b","mode":"c","modèl":"d","ｍodel":"e","MODE":"f","model2":"g"}`, "model", "a"},
		{"a high surrogate alone is not a letter", `{"model":"a","mo\ud83ddel":"b"}`, "model", "a"},
		{"the path in another case inside another path's value", `{"model":"a","metadata":{"MODEL":"b"}}`, "model", "a"},
		{"keys deeper than any path", `{"model":"a","x":` + strings.Repeat(`{"Model":`, 20) + `1` + strings.Repeat(`}`, 20) + `}`, "model", "a"},
	} {
		for _, n := range []int{1, 2, 3, 5, len(tc.doc)} {
			got, _ := readValues(t, tc.doc, n, tc.path, "never")
			if got[tc.path] != tc.want {
				t.Errorf("%s, in pieces of %d: %s = %q, want %q", tc.name, n, tc.path, got[tc.path], tc.want)
			}
		}
	}
}

// TestValuesAgreeWithGoAndExactParsersOnEveryKeyVariant: over bodies
// whose keys are the paths' written in random case, with K and ſ, raw
// and escaped, once or twice, a value Values gives is the one that Go's
// encoding/json gives a struct (case-insensitive, the last kept) and the
// one that an exact parser keeping the last gives (a map): no variant
// gets past it.
func TestValuesAgreeWithGoAndExactParsersOnEveryKeyVariant(t *testing.T) {
	rng := rand.New(rand.NewPCG(38, 1))
	variant := func(key string) string {
		var b strings.Builder
		for _, c := range key {
			switch r := rng.IntN(8); {
			case c == 'k' && r == 0:
				b.WriteString("\u212a")
			case c == 's' && r == 0:
				b.WriteString("\u017f")
			case r == 1:
				fmt.Fprintf(&b, `\u%04x`, unicode.ToUpper(c))
			case r == 2:
				fmt.Fprintf(&b, `\u%04X`, c)
			case r < 5:
				b.WriteRune(unicode.ToUpper(c))
			default:
				b.WriteRune(c)
			}
		}
		return b.String()
	}
	agreed := 0
	for i := range 20000 {
		var members []string
		for range 1 + rng.IntN(3) {
			key := []string{"model", "max_tokens", "mask", "stream"}[rng.IntN(4)]
			if rng.IntN(2) == 0 {
				key = variant(key)
			}
			members = append(members, fmt.Sprintf(`%q:%d`, "KEY", rng.IntN(1000)))
			members[len(members)-1] = strings.Replace(members[len(members)-1], "KEY", key, 1)
		}
		doc := "{" + strings.Join(members, ",") + "}"
		var asGo struct {
			Model     json.RawMessage `json:"model"`
			MaxTokens json.RawMessage `json:"max_tokens"`
		}
		var exact map[string]json.RawMessage
		if err := json.Unmarshal([]byte(doc), &asGo); err != nil {
			t.Fatalf("%s: %v", doc, err)
		}
		if err := json.Unmarshal([]byte(doc), &exact); err != nil {
			t.Fatalf("%s: %v", doc, err)
		}
		got, _ := readValues(t, doc, 1+i%7, "model", "max_tokens")
		for path, goValue := range map[string]json.RawMessage{"model": asGo.Model, "max_tokens": asGo.MaxTokens} {
			value := got[path]
			if value == "" || value[0] == '!' {
				continue // no value: nothing to disagree with
			}
			agreed++
			if value != string(goValue) || value != string(exact[path]) {
				t.Fatalf("%s: %s = %s, but Go's struct reads %s and an exact parser %s", doc, path, value, goValue, exact[path])
			}
		}
	}
	if agreed < 1000 {
		t.Fatalf("only %d values found: the bodies hardly test anything", agreed)
	}
}
