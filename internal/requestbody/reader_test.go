package requestbody

import (
	"context"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/caddyserver/caddy/v2"
)

// reasons records what a Reader reports.
type reasons []string

func (rs *reasons) Unread(reason, detail string) { *rs = append(*rs, reason) }

func testReader() *Reader {
	return NewReader(Options{
		Paths:   []string{"model", "max_tokens", "model"},
		MaxSize: 64,
		Prefix:  "p.",
		SizeKey: "size",
		Config:  []byte(`{"key":"{p.model}","cost":"{p.max_tokens:7}","other":"{p.n:1}"}`),
	})
}

// post is a request whose body reads as body, in reads of one byte when
// slow, with its replacer.
func post(body string, length int64, slow bool) (*http.Request, *caddy.Replacer) {
	var rd io.Reader = strings.NewReader(body)
	if slow {
		rd = iotest.OneByteReader(rd)
	}
	r, _ := http.NewRequest(http.MethodPost, "http://example.com/", rd)
	r.ContentLength = length
	repl := caddy.NewReplacer()
	return r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)), repl
}

// TestReaderSetsValuesAndReplaysTheBodyByteForByte: the values at the
// paths and the defaults the config writes are set, the body's size is
// its bytes when it has no Content-Length, and the body reads byte for
// byte after the Reader's read, in one-byte reads too.
func TestReaderSetsValuesAndReplaysTheBodyByteForByte(t *testing.T) {
	rr := testReader()
	if got, want := rr.Placeholders(), []string{"p.model", "p.max_tokens", "p.max_tokens:7", "size"}; !slices.Equal(got, want) {
		t.Fatalf("Placeholders %q, want %q", got, want)
	}
	for _, slow := range []bool{false, true} {
		body := `{"model":"gpt-4o","max_tokens":12,"messages":[]}`
		r, repl := post(body, -1, slow)
		var heard reasons
		replay := rr.Read(r, &heard)
		if replay == nil || r.Body != io.ReadCloser(replay) {
			t.Fatalf("slow %v: the body is a %T", slow, r.Body)
		}
		for key, want := range map[string]string{"{p.model}": "gpt-4o", "{p.max_tokens}": "12", "{p.max_tokens:7}": "12", "{size}": "48"} {
			if got := repl.ReplaceAll(key, ""); got != want {
				t.Errorf("slow %v: %s is %q, want %q", slow, key, got, want)
			}
		}
		got, err := io.ReadAll(r.Body)
		if err != nil || string(got) != body || len(heard) != 0 {
			t.Errorf("slow %v: replayed %q (%v), heard %q", slow, got, err, heard)
		}
		replay.Done()
	}
}

// TestReaderReportsWhyValuesAreEmpty: a path met twice, a body larger
// than MaxSize, an encoded body and one that is not JSON leave the
// values empty (the defaults set) and say why; the body still reads
// whole.
func TestReaderReportsWhyValuesAreEmpty(t *testing.T) {
	rr := testReader()
	for _, tc := range []struct{ name, body, encoding, want string }{
		{"repeated", `{"model":"a","MODEL":"b"}`, "", "repeated"},
		{"too large", `{"model":"a","x":"` + strings.Repeat("x", 100) + `"}`, "", "too_large"},
		{"encoded", `{"model":"a"}`, "gzip", "encoded"},
		{"not JSON", `model=a`, "", "not_json"},
	} {
		r, repl := post(tc.body, int64(len(tc.body)), false)
		if tc.encoding != "" {
			r.Header.Set("Content-Encoding", tc.encoding)
		}
		var heard reasons
		replay := rr.Read(r, &heard)
		if !slices.Contains(heard, tc.want) || !slices.Contains(Reasons, tc.want) {
			t.Errorf("%s: heard %q, want %q", tc.name, heard, tc.want)
		}
		if got := repl.ReplaceAll("{p.model}|{p.max_tokens:7}", ""); got != "|7" {
			t.Errorf("%s: values %q, want none and the default", tc.name, got)
		}
		if got, _ := io.ReadAll(r.Body); string(got) != tc.body {
			t.Errorf("%s: replayed %q", tc.name, got)
		}
		if replay != nil {
			replay.Done()
		}
	}
}

// TestReplayKeepsWhatWasNotGivenOutAfterDone: a body not read by the
// handlers still reads whole after Done, which gave its buffer back.
func TestReplayKeepsWhatWasNotGivenOutAfterDone(t *testing.T) {
	body := `{"model":"gpt-4o"}`
	r, _ := post(body, int64(len(body)), false)
	replay := testReader().Read(r, new(reasons))
	replay.Done()
	if replay.pooled != nil {
		t.Error("the buffer was not given back")
	}
	if got, _ := io.ReadAll(r.Body); string(got) != body {
		t.Errorf("replayed %q after Done", got)
	}
}
