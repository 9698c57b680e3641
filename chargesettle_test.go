package ratelimit

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// When the writer that watches a response (cost.Writer) has the request
// settled, in store memory: as soon as its cost is known.

// nextAtEndWriter is a client that sends its next request (next) as
// soon as the bytes that end its answer reach it, while the handler of
// the first still runs: the status, when end is "", else the first
// write after which what it received holds end.
type nextAtEndWriter struct {
	*httptest.ResponseRecorder
	end        string
	next       func() int
	nextStatus int // 0 until sent
}

func (w *nextAtEndWriter) WriteHeader(status int) {
	w.ResponseRecorder.WriteHeader(status)
	if w.end == "" && w.nextStatus == 0 {
		w.nextStatus = w.next()
	}
}

func (w *nextAtEndWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseRecorder.Write(p)
	if w.end != "" && w.nextStatus == 0 && strings.Contains(w.Body.String(), w.end) {
		w.nextStatus = w.next()
	}
	return n, err
}

// TestChargeSettlesBeforeTheEndOfTheAnswerPasses: the writer settles a
// request as soon as its cost is known, before the bytes that tell the
// client so pass: a client that sends its next request the moment they
// reach it (here from the write that carries them, in store memory)
// finds the settlement done. Each answer costs 950 of a reservation of
// 100 from 1,000, so the next request is refused: at the end of a JSON
// document, at `data: [DONE]` (a usage after it is not read), at
// Anthropic's message_stop. A login that charge_status 401 does not
// charge gives its token back at the status. A cost header may still be
// overridden by a trailer, so it settles only when the handler returns,
// and the next request is admitted. Each request settles once: the
// bucket then holds what one settlement leaves.
func TestChargeSettlesBeforeTheEndOfTheAnswerPasses(t *testing.T) {
	for _, tc := range []struct {
		name, limit, contentType string
		pieces                   []string
		end                      string
		next                     int
		left                     float64
	}{
		{"a JSON answer", "1000 {\nrequested_tokens 100\ncharge json usage.total_tokens", "application/json",
			[]string{`{"usage":{"total_tokens":`, `950}}`, "\n"}, "}}", 429, 50},
		{"an OpenAI stream", "1000 {\nrequested_tokens 100\ncharge json usage.total_tokens", "text/event-stream",
			[]string{"data: {\"usage\":{\"total_tokens\":950}}\n\n", "data: [DONE]\n\n", "data: {\"usage\":{\"total_tokens\":5}}\n\n"}, "[DONE]", 429, 50},
		{"an Anthropic stream", "1000 {\nrequested_tokens 100\ncharge json message.usage.input_tokens usage.output_tokens", "text/event-stream",
			[]string{"event: message_start\ndata: {\"message\":{\"usage\":{\"input_tokens\":50}}}\n\n",
				"event: message_delta\ndata: {\"usage\":{\"output_tokens\":900}}\n\n", "event: message_stop\ndata: {}\n\n"}, "message_stop", 429, 50},
		{"a login not charged", "100 {\nrequested_tokens 100\ncharge_status 401", "text/html",
			[]string{"<p>welcome</p>"}, "", 200, 100},
		{"a cost header", "1000 {\nrequested_tokens 100\ncharge header X-Cost", "application/json",
			[]string{`{"usage":{"total_tokens":950}}`}, "}}", 200, -50},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := memoryHandler(t, "0.001 "+strings.Split(tc.limit, " ")[0], "key {http.request.header.X-Key}\n"+strings.SplitN(tc.limit, "{\n", 2)[1])
			answer := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				w.Header().Set("Content-Type", tc.contentType)
				w.Header().Set("X-Cost", "950")
				w.WriteHeader(http.StatusOK)
				for _, p := range tc.pieces {
					if _, err := io.WriteString(w, p); err != nil {
						return err
					}
				}
				return nil
			})
			costsItsReservation := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				w.Header().Set("X-Cost", "100")
				w.WriteHeader(http.StatusOK)
				return nil
			})
			client := &nextAtEndWriter{ResponseRecorder: httptest.NewRecorder(), end: tc.end, next: func() int {
				r, w := newRequest("192.0.2.1", "k")
				return statusOf(h.ServeHTTP(w, r, costsItsReservation), w.Code)
			}}
			if err := h.ServeHTTP(client, prepareRequest("192.0.2.1", "k", client), answer); err != nil {
				t.Fatal(err)
			}
			if client.Code != 200 || client.Body.String() != strings.Join(tc.pieces, "") {
				t.Fatalf("the answer: %d %q, want 200 with every piece", client.Code, client.Body.String())
			}
			if client.nextStatus != tc.next {
				t.Errorf("the next request, sent as the end of the answer reached the client: %d, want %d", client.nextStatus, tc.next)
			}
			r, _ := newRequest("192.0.2.1", "k")
			buckets, _, err := h.resolveBuckets(r, r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer), nil)
			if err != nil {
				t.Fatal(err)
			}
			view, err := h.store.Peek(context.Background(), buckets[0])
			if err != nil || view.Tokens < tc.left || view.Tokens > tc.left+1 {
				t.Errorf("the bucket holds %v (%v), want %v: one settlement", view.Tokens, err, tc.left)
			}
		})
	}
}
