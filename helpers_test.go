package ratelimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// provision provisions h as Caddy would, and cleans it up after the test.
func provision(tb testing.TB, h *Handler) *Handler {
	tb.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	tb.Cleanup(cancel)
	if err := h.Provision(ctx); err != nil {
		tb.Fatalf("provision: %v", err)
	}
	tb.Cleanup(func() { _ = h.Cleanup() })
	if err := h.Validate(); err != nil {
		tb.Fatalf("validate: %v", err)
	}
	return h
}

func ptr[T any](v T) *T { return &v }

// okHandler is the next handler: it answers 200.
var okHandler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	w.WriteHeader(http.StatusOK)
	return nil
})

// newRequest is a request as Caddy's server prepares it, from remoteIP.
func newRequest(remoteIP string, header http.Header) (*http.Request, *httptest.ResponseRecorder) {
	r := httptest.NewRequest(http.MethodGet, "http://example.com/", nil)
	r.RemoteAddr = remoteIP + ":1234"
	for k, v := range header {
		r.Header[k] = v
	}
	w := httptest.NewRecorder()
	r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, nil)
	return r, w
}

// statusOf is the status the handler chain yields: the error's status
// for a denial, else what was written.
func statusOf(err error, w *httptest.ResponseRecorder) int {
	if err != nil {
		if he, ok := err.(caddyhttp.HandlerError); ok {
			return he.StatusCode
		}
		return 500
	}
	return w.Code
}
