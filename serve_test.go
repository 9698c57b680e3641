package ratelimit

import (
	"net/http"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestRefusedWithoutAStoreNeverReachesTheNextHandler: a request refused
// before any store is asked (an empty key, a value out of range, a
// limit that blocks) gets its status, and the next handler never runs,
// also where the denial is written here rather than handed to
// handle_errors.
func TestRefusedWithoutAStoreNeverReachesTheNextHandler(t *testing.T) {
	for _, tc := range []struct {
		name, directive, key string
		status               int
	}{
		{"empty key", "rate_limit 10 10 {\n\tkey {http.request.header.X-Key}\n\tstore memory\n}", "", http.StatusForbidden},
		{"cost out of range", "rate_limit 10 10 {\n\tkey {http.request.header.X-Key}\n\trequested_tokens {http.request.header.X-Key}\n\tstore memory\n}", "abc", http.StatusBadRequest},
		{"blocked", "rate_limit {\n\tkey {http.request.header.X-Key}\n\treplenish_rate 1\n\tburst_capacity 0\n}", "k", http.StatusTooManyRequests},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := caddyfileHandler(t, tc.directive)
			served := false
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				served = true
				w.WriteHeader(http.StatusOK)
				return nil
			})
			r, w := newRequest("192.0.2.1", tc.key)
			err := h.ServeHTTP(w, r, next)
			if status := statusOf(err, w.Code); status != tc.status || served {
				t.Fatalf("status %d, next handler ran: %v; want %d and not run", status, served, tc.status)
			}
		})
	}
}
