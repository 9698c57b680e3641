package ratelimit

import (
	"net/http"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// TestPlaceholdersOfTwoHandlersAreTheLastOnes sends requests through two
// rate_limit handlers in a row: each placeholder is the last handler's,
// or, where that one sets none, the earlier one's; before either ran,
// none is known.
func TestPlaceholdersOfTwoHandlersAreTheLastOnes(t *testing.T) {
	first := memoryHandler(t, "0.001 5", "zone first\nkey {http.request.header.X-Key}\ndeny_empty_key false")
	second := memoryHandler(t, "0.001 3", "zone second\nkey {http.request.header.X-Second}\ndeny_empty_key false\nlog_key")
	observeLogs(first, zap.InfoLevel)
	observeLogs(second, zap.InfoLevel)
	names := []string{"zone", "result", "limit_name", "limit", "remaining", "retry_after", "key"}
	through := func(secondKey string) map[string]string {
		t.Helper()
		r, w := newRequest("192.0.2.1", "ann")
		if secondKey != "" {
			r.Header.Set("X-Second", secondKey)
		}
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		for _, name := range names {
			if v, ok := repl.Get("http.rate_limit." + name); ok {
				t.Fatalf("{http.rate_limit.%s} is %v before any handler ran", name, v)
			}
		}
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			return second.ServeHTTP(w, r, okHandler)
		})
		_ = first.ServeHTTP(w, r, next)
		got := map[string]string{}
		for _, name := range names {
			if v, ok := repl.GetString("http.rate_limit." + name); ok {
				got[name] = v
			} else {
				got[name] = "<unknown>"
			}
		}
		return got
	}
	for i, tc := range []struct {
		secondKey string
		want      map[string]string
	}{
		// Both admit: the second's values.
		{"bo", map[string]string{"zone": "second", "result": "allowed", "limit_name": "", "limit": "3",
			"remaining": "2", "retry_after": "<unknown>", "key": "bo"}},
		// The second has no key: its zone, result and (empty) key; the
		// bucket's values are the first's.
		{"", map[string]string{"zone": "second", "result": "empty_key", "limit_name": "", "limit": "5",
			"remaining": "3", "retry_after": "<unknown>", "key": ""}},
		{"bo", map[string]string{"zone": "second", "result": "allowed", "limit_name": "", "limit": "3",
			"remaining": "1", "retry_after": "<unknown>", "key": "bo"}},
		{"bo", map[string]string{"zone": "second", "result": "allowed", "limit_name": "", "limit": "3",
			"remaining": "0", "retry_after": "<unknown>", "key": "bo"}},
		// The second refuses: its wait, a token at 0.001/s.
		{"bo", map[string]string{"zone": "second", "result": "denied", "limit_name": "", "limit": "3",
			"remaining": "0", "retry_after": "1000", "key": "bo"}},
	} {
		got := through(tc.secondKey)
		for name, want := range tc.want {
			if got[name] != want {
				t.Errorf("request %d: {http.rate_limit.%s} %q, want %q (all: %v)", i+1, name, got[name], want, got)
			}
		}
	}
}
