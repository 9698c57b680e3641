package cost

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddy-redis/ratelimit/internal/scan"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The writer (writer.go) without any process: what it notes of a
// response and hands to the scan, and what a response costs a rule. The scans themselves, of
// JSON bodies, event streams and JSON lines, are tested in internal/scan.

// discardWriter is a ResponseWriter that keeps nothing.
type discardWriter struct{ h http.Header }

func (w discardWriter) Header() http.Header         { return w.h }
func (w discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w discardWriter) WriteHeader(int)             {}

// newWriter is a writer that watches w for what s reads and settles
// nothing itself.
func newWriter(w http.ResponseWriter, s *Sources) *Writer {
	return new(Writer).Reset(w, s, new(scan.Body), nil)
}

// ruleOf is the rule of a limit that charges so, with the sources it
// adds to.
func ruleOf(t *testing.T, c Charge) (*Rule, *Sources) {
	t.Helper()
	s := new(Sources)
	rule, err := s.Add(c)
	if err != nil {
		t.Fatal(err)
	}
	return rule, s
}

// TestChargeJSONFieldsAreSummedFieldByField: `charge json { <field>
// <path>... }` reaches the scan as a field per name, each the bits of its
// paths: Anthropic's JSON answer and its stream (input in message_start,
// output in message_delta, which repeats the input) cost the same, and a
// body without usage names every path, field by field.
func TestChargeJSONFieldsAreSummedFieldByField(t *testing.T) {
	rule, sources := ruleOf(t, Charge{JSON: [][]string{ // by name, as the handler orders them
		{"usage.input_tokens", "message.usage.input_tokens"},
		{"usage.output_tokens", "message.usage.output_tokens"},
	}})
	stream := "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":25,\"output_tokens\":15}}\n\n"
	for _, tc := range []struct {
		name, contentType, body string
		want                    float64
		why                     string
	}{
		{"a JSON answer", "application/json", `{"type":"message","usage":{"input_tokens":25,"output_tokens":15}}`, 40, ""},
		{"a stream", "text/event-stream", stream, 40, ""},
		{"none", "application/json", `{"usage":{}}`, 0, "no number at usage.input_tokens, message.usage.input_tokens, usage.output_tokens, message.usage.output_tokens in the body"},
	} {
		cw := newWriter(discardWriter{http.Header{"Content-Type": {tc.contentType}}}, sources)
		cw.WriteHeader(200)
		_, _ = cw.Write([]byte(tc.body))
		if got, why := cw.body.Sum(rule.fields...); got != tc.want || why != tc.why {
			t.Errorf("%s: %v %q, want %v %q", tc.name, got, why, tc.want, tc.why)
		}
	}
}

// TestChargeScanReadsAJSONBodyOfAnySizeByDefault: without max_body a JSON
// body is read to its end, so an answer a client inflated (logprobs, n)
// past any size is charged its usage, which comes last.
func TestChargeScanReadsAJSONBodyOfAnySizeByDefault(t *testing.T) {
	_, sources := ruleOf(t, Charge{JSON: [][]string{{"usage.total_tokens"}}})
	cw := newWriter(discardWriter{http.Header{"Content-Type": {"application/json"}}}, sources)
	cw.WriteHeader(200)
	_, _ = cw.Write([]byte(`{"choices":[{"logprobs":{"content":[`))
	entry := []byte(`{"token":"tok","logprob":-0.0123,"bytes":[116,111,107],"top_logprobs":[]},`)
	for written := 0; written < 3<<20; written += len(entry) {
		_, _ = cw.Write(entry)
	}
	_, _ = cw.Write([]byte(`{}]}}],"usage":{"prompt_tokens":9,"completion_tokens":768,"total_tokens":777}}`))
	if got, why := cw.body.Sum(1); got != 777 || why != "" {
		t.Errorf("a 3 MiB answer: %v %q, want its usage, 777", got, why)
	}
}

// TestChargeWriterPassesFlushesAndCopies: the writer is an http.Flusher,
// http.ResponseController flushes through it to the writer beneath, an
// io.Copy into it is scanned when the body is read (through Write) and
// handed to the writer beneath otherwise, and what arrives beneath is
// what was written.
func TestChargeWriterPassesFlushesAndCopies(t *testing.T) {
	c := &Sources{}
	bit, _ := c.paths.Add("n")
	rec := httptest.NewRecorder()
	cw := newWriter(rec, c)
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
	if got, why := cw.body.Sum(bit); got != 7 || why != "" || rec.Body.String() != `{"n":7}` || rec.Code != 201 || cw.status != 201 {
		t.Fatalf("scanned %v %q, body %q, status %d (%d); want 7, the body as written, 201", got, why, rec.Body.String(), rec.Code, cw.status)
	}

	// Without a body scan, a copy goes to the writer beneath (sendfile,
	// where it has it), and an implicit 200 is the status.
	plain := &Sources{}
	rec = httptest.NewRecorder()
	cw = newWriter(rec, plain)
	if n, err := io.Copy(cw, strings.NewReader("file")); n != 4 || err != nil || rec.Body.String() != "file" || cw.end(nil, false).Status != 200 {
		t.Fatalf("copy: %d %v, body %q, status %d", n, err, rec.Body.String(), cw.end(nil, false).Status)
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
	rule, sources := ruleOf(t, Charge{Header: "x-cost"})
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
		cw := newWriter(discardWriter{http.Header{}}, sources)
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
	aborted, failed := ErrAborted, caddyhttp.Error(502, errors.New("upstream"))
	for _, tc := range []struct {
		written    int
		err        error
		clientLeft bool
		want       End
	}{
		{0, nil, false, End{Status: 200}},
		{404, nil, false, End{Status: 404}},
		{0, caddyhttp.Error(401, errors.New("no")), false, End{Status: 401}},
		{0, errors.New("broken"), false, End{Status: 500}},
		{206, caddyhttp.Error(502, errors.New("after the header")), false, End{Status: 206}},
		{0, fmt.Errorf("wrapped: %w", caddyhttp.Error(429, errors.New("no"))), false, End{Status: 429}},
		{101, nil, false, End{Status: 101}},
		{200, nil, true, End{Status: 200}},                                     // complete before the client left
		{499, nil, true, End{CutShort: true}},                                  // reverse_proxy: the client left before the answer
		{0, caddyhttp.Error(499, context.Canceled), true, End{CutShort: true}}, // as older reverse_proxy returns it
		{0, failed, true, End{CutShort: true}},                                 // failed once the client had left
		{200, aborted, true, End{Status: 200, CutShort: true}},                 // the client left mid-stream
		{500, aborted, true, End{Status: 500, CutShort: true}},
		{200, aborted, false, End{Status: 200, CutShort: true}}, // the stream broke off
		{0, aborted, false, End{CutShort: true}},
	} {
		cw := newWriter(httptest.NewRecorder(), &Sources{})
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
	header := &Rule{header: "X-Cost", statuses: []int{2}}
	paths := &Rule{paths: 1, statuses: []int{2}}
	logins := &Rule{statuses: []int{401}}
	c := &Sources{headers: []string{"X-Cost"}}
	if _, err := c.paths.Add("usage.total_tokens"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		rule    *Rule
		end     End
		written int    // the status written, 0 for none
		cost    string // the X-Cost header
		want    int64
	}{
		{"a 2xx", header, End{Status: 200}, 200, "30", 30},
		{"a 500 answered", header, End{Status: 500}, 500, "30", 0},
		{"a 500 answered, cut short", header, End{Status: 500, CutShort: true}, 500, "30", 0},
		{"no answer: the client left first", header, End{CutShort: true}, 0, "", reserved},
		{"a 2xx cut short, reported less", header, End{Status: 200, CutShort: true}, 200, "30", reserved},
		{"a 2xx cut short, reported more", header, End{Status: 200, CutShort: true}, 200, "300", 300},
		{"a 2xx cut short, unreadable", header, End{Status: 200, CutShort: true}, 200, "", reserved},
		{"an upgrade, its header", header, End{Status: 101}, 101, "30", 30},
		{"an upgrade, charge json", paths, End{Status: 101}, 101, "", reserved},
		{"an upgrade under charge_status 401", logins, End{Status: 101}, 101, "", 0},
		{"a 401", logins, End{Status: 401}, 401, "", reserved},
		{"a login the client left", logins, End{CutShort: true}, 0, "", reserved},
	} {
		cw := newWriter(httptest.NewRecorder(), c)
		if tc.cost != "" {
			cw.Header().Set("X-Cost", tc.cost)
		}
		if tc.written != 0 {
			cw.WriteHeader(tc.written)
		}
		cost, why := tc.rule.Cost(tc.end, cw, caddy.NewReplacer(), nil, reserved)
		if cost != tc.want || tc.end.CutShort && why != "" {
			t.Errorf("%s: cost %d (%q), want %d (and no warning for a response cut short)", tc.name, cost, why, tc.want)
		}
	}
}
