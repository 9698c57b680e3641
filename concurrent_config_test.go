package ratelimit

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/concurrent"
	"github.com/caddyserver/caddy/v2"
)

// Load-time errors of concurrent limits name the subdirective and the
// value, from the Caddyfile (with the line) and from JSON (Validate).
func TestConcurrentLoadErrorsNameTheValue(t *testing.T) {
	block := func(body string) string { return "rate_limit {\n\t" + body + "\n}" }
	for _, tc := range []struct {
		name  string
		input string
		want  []string
	}{
		{"no slots", block("concurrent gen"), []string{"concurrent: want <name> <slots>, got 1 argument(s): 'gen'"}},
		{"slots not a number", block("concurrent gen four"), []string{"concurrent gen: slots 'four' is not a whole number"}},
		{"negative slots", block("concurrent gen -1"), []string{"slots '-1' is not a whole number from 0"}},
		{"bad name", block("concurrent g.en 4"), []string{"limit name 'g.en'"}},
		{"name twice", block("concurrent gen 4\n\tconcurrent gen 2"), []string{"concurrent 'gen' is given twice"}},
		{"name of a limit", block("limit gen 1 1\n\tconcurrent gen 2"), []string{"concurrent 'gen': the name is given twice"}},
		{"hold too short", block("concurrent gen 4 {\n\t\thold 100ms\n\t}"), []string{"hold '100ms': want a duration from 1s to 24h0m0s"}},
		{"hold not a duration", block("concurrent gen 4 {\n\t\thold soon\n\t}"), []string{"hold 'soon': want a positive duration"}},
		{"retry_after zero", block("concurrent gen 4 {\n\t\tretry_after 0\n\t}"), []string{"retry_after '0': want whole seconds from 1"}},
		{"bad key", block("concurrent gen 4 {\n\t\tkey {unclosed\n\t}"), []string{"{unclosed"}},
		{"bad prefix", block("concurrent gen 4 {\n\t\tipv4_prefix 33\n\t}"), []string{"ipv4_prefix '33'"}},
		{"unknown subdirective", block("concurrent gen 4 {\n\t\tburst 3\n\t}"), []string{"unrecognized concurrent gen subdirective 'burst'"}},
		{"twice in block", block("concurrent gen 4 {\n\t\thold 2s\n\t\thold 3s\n\t}"), []string{"concurrent gen: subdirective 'hold' is given twice"}},
		{"with lease", block("replenish_rate 10\n\tlease 8\n\tconcurrent gen 4"), []string{"lease with concurrent limits"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseTestCaddyfile(tc.input)
			if err == nil {
				t.Fatalf("%q parsed without error", tc.input)
			}
			for _, want := range tc.want {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not contain %q", err, want)
				}
			}
			if !strings.Contains(err.Error(), "Testfile:") {
				t.Errorf("error %q does not name the line", err)
			}
		})
	}

	// The same checks judge JSON.
	for _, tc := range []struct {
		name string
		c    Concurrent
		want string
	}{
		{"no slots", Concurrent{Name: "gen"}, "concurrent gen: slots is required"},
		{"bad slots", Concurrent{Name: "gen", Slots: "2.5"}, "slots '2.5' is not a whole number"},
		{"hold too long", Concurrent{Name: "gen", Slots: "4", Hold: caddy.Duration(48 * time.Hour)}, "hold '48h0m0s'"},
		{"retry_after", Concurrent{Name: "gen", Slots: "4", RetryAfter: -1}, "retry_after '-1'"},
	} {
		t.Run("json "+tc.name, func(t *testing.T) {
			h := &Handler{Concurrent: []Concurrent{tc.c}}
			h.applyDefaults()
			err := h.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// A handler with only concurrent limits needs no rate; with a rate of
// its own, both apply; slots may be placeholders or unlimited.
func TestConcurrentConfigForms(t *testing.T) {
	for _, tc := range []struct {
		name   string
		input  string
		limits []string // name:kind
	}{
		{"concurrent only", "rate_limit {\n\tconcurrent gen 4\n}", []string{"gen:slots"}},
		{"with the handler's rate", "rate_limit 10 20 {\n\tconcurrent gen 4\n}", []string{":tokens", "gen:slots"}},
		{"with limits", "rate_limit {\n\tlimit requests 60/1m 60\n\tconcurrent gen 4 {\n\t\thold 30s\n\t}\n}", []string{"requests:tokens", "gen:slots"}},
		{"placeholder slots", "rate_limit {\n\tconcurrent gen {plan_slots}\n}", []string{"gen:slots"}},
		{"unlimited", "rate_limit {\n\tconcurrent gen unlimited\n}", []string{"gen:slots"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := offline(mustParse(t, tc.input))
			provision(t, h)
			var got []string
			for _, l := range h.limits {
				kind := "tokens"
				if _, ok := l.Kind.(*concurrent.Kind); ok {
					kind = "slots"
				}
				got = append(got, l.Name+":"+kind)
			}
			if strings.Join(got, ",") != strings.Join(tc.limits, ",") {
				t.Errorf("limits %v, want %v", got, tc.limits)
			}
		})
	}
}

// The Caddyfile form adapts to the JSON form, and back through JSON.
func TestConcurrentJSONRoundTrip(t *testing.T) {
	h := mustParse(t, "rate_limit {\n\tconcurrent gen 4 {\n\t\tkey {http.request.header.Authorization}\n\t\thold 45s\n\t\tretry_after 3\n\t}\n}")
	raw, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	want := `"concurrent":[{"name":"gen","slots":4,"key":"{http.request.header.Authorization}","hold":45000000000,"retry_after":3}]`
	if !strings.Contains(string(raw), want) {
		t.Errorf("JSON %s, want it to contain %s", raw, want)
	}
	var back Handler
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Concurrent) != 1 || back.Concurrent[0] != h.Concurrent[0] {
		t.Errorf("round trip %+v, want %+v", back.Concurrent, h.Concurrent)
	}
}

func mustParse(t *testing.T, input string) *Handler {
	t.Helper()
	h, err := parseTestCaddyfile(input)
	if err != nil {
		t.Fatalf("parsing %q: %v", input, err)
	}
	return h
}

// A concurrent limit and a quota of one name would share metrics series,
// RateLimit-Policy names and admin entries: refused at load, as a
// concurrent limit named like a limit is, from the Caddyfile and JSON.
func TestConcurrentNamedLikeAQuotaRefusedAtLoad(t *testing.T) {
	for _, input := range []string{
		"rate_limit {\n\tquota gen 5 per day\n\tconcurrent gen 2\n}",
		"rate_limit {\n\tconcurrent gen 2\n\tquota gen 5 per day\n}",
	} {
		if _, err := parseTestCaddyfile(input); err == nil || !strings.Contains(err.Error(), "gen") {
			t.Errorf("%q: %v, want an error naming 'gen'", input, err)
		}
	}
	h := &Handler{Quotas: []Quota{{Name: "gen", Count: "5", Per: "day"}}, Concurrent: []Concurrent{{Name: "gen", Slots: "2"}}}
	if err := h.checkLimits(); err == nil || !strings.Contains(err.Error(), "gen") {
		t.Errorf("JSON: %v, want an error naming 'gen'", err)
	}
}
