package keys

import (
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func resolve(t *testing.T, template, prefix string, values map[string]string) string {
	t.Helper()
	kt, err := Parse(template)
	if err != nil {
		t.Fatalf("parse %q: %v", template, err)
	}
	repl := caddy.NewReplacer()
	for k, v := range values {
		repl.Set(k, v)
	}
	return kt.ReplacerKey(repl, prefix, "")
}

func TestKeyTemplateResolvesPlaceholdersAndLiterals(t *testing.T) {
	got := resolve(t, "{ip}:{tenant}", "rl:api|", map[string]string{"ip": "203.0.113.7", "tenant": "acme"})
	if got != "rl:api|203.0.113.7:acme" {
		t.Fatalf("got %q", got)
	}
	if got := resolve(t, "lit-{ip}", "p|", map[string]string{"ip": "1.2.3.4"}); got != "p|lit-1.2.3.4" {
		t.Fatalf("literal and placeholder: got %q", got)
	}
}

func TestKeyEmptyWhenAnyPlaceholderIsEmpty(t *testing.T) {
	for name, values := range map[string]map[string]string{
		"missing": {"ip": "1.2.3.4"},
		"empty":   {"ip": "1.2.3.4", "tenant": ""},
	} {
		if got := resolve(t, "{ip}:{tenant}", "p|", values); got != "" {
			t.Errorf("%s tenant: got %q, want empty key", name, got)
		}
	}
}

func TestKeyValueCannotActAsHashTag(t *testing.T) {
	got := resolve(t, "{h}", "rate_limit:z|", map[string]string{"h": "{victim}"})
	if strings.ContainsAny(got, "{}") {
		t.Fatalf("braces from a header reached the key: %q", got)
	}
}

func TestKeyValueCannotReachAnotherBucket(t *testing.T) {
	// Pairs of requests whose values would give the same key if they were
	// pasted in as they are.
	for _, c := range []struct {
		template string
		a, b     map[string]string
	}{
		{"{x}:{y}", map[string]string{"x": "a:b", "y": "c"}, map[string]string{"x": "a", "y": "b:c"}},
		{"{x}{y}", map[string]string{"x": "ab", "y": "c"}, map[string]string{"x": "a", "y": "bc"}},
		{"{x}", map[string]string{"x": "a%3Ab"}, map[string]string{"x": "a:b"}},
		{"{x}-{y}", map[string]string{"x": "a-b", "y": "c"}, map[string]string{"x": "a", "y": "b-c"}},
		{"{x}{y}", map[string]string{"x": "x", "y": "0A\x01"}, map[string]string{"x": "x\n", "y": "01"}},
		{"{x}%0A{y}", map[string]string{"x": "a", "y": "b"}, map[string]string{"x": "a\n", "y": "b"}},
		{"{x}{y}", map[string]string{"x": "a|", "y": "b"}, map[string]string{"x": "a", "y": "|b"}},
	} {
		ka := resolve(t, c.template, "p|", c.a)
		kb := resolve(t, c.template, "p|", c.b)
		if ka == kb {
			t.Errorf("%s: %v and %v share the key %q", c.template, c.a, c.b, ka)
		}
	}
}

func TestKeyValueCannotLeaveItsZone(t *testing.T) {
	// A value that spells another zone's prefix stays inside its own.
	got := resolve(t, "{h}", "rate_limit:a|", map[string]string{"h": "x\nrate_limit:b|y"})
	if !strings.HasPrefix(got, "rate_limit:a|") || strings.ContainsAny(got, "\n ") {
		t.Fatalf("got %q", got)
	}
}

func TestKeyLengthBoundedByHashing(t *testing.T) {
	long := strings.Repeat("x", 10000)
	got := resolve(t, "{h}", "rate_limit:z|", map[string]string{"h": long})
	if len(got) > len("rate_limit:z|")+maxVerbatimKey {
		t.Fatalf("key of %d bytes for a 10000-byte value", len(got))
	}
	other := resolve(t, "{h}", "rate_limit:z|", map[string]string{"h": long + "y"})
	if got == other {
		t.Fatal("two long values share a key")
	}
	// A short value that looks like a hash is escaped, so it cannot
	// collide with the hash of a long one.
	lookalike := resolve(t, "{h}", "rate_limit:z|", map[string]string{"h": got[len("rate_limit:z|"):]})
	if lookalike == got {
		t.Fatalf("a value equal to a hashed key reached its bucket: %q", lookalike)
	}
}

func TestKeyTemplateRejectsMalformed(t *testing.T) {
	// A literal brace, even escaped, would make a Cluster hash tag.
	for _, s := range []string{"", "{", "{ip", "ip}", "{}", "{a {b}", `\{lit\}{ip}`, `{ip}\}`} {
		if _, err := Parse(s); err == nil {
			t.Errorf("%q accepted", s)
		}
	}
}

// TestKeyFromRequestIsTheReplacersKey resolves key templates for many
// requests twice: with the values read from the request (as ServeHTTP
// does) and with every value asked of the request's replacer. The keys
// must be the same, byte for byte: a client keeps its Redis key.
func TestKeyFromRequestIsTheReplacersKey(t *testing.T) {
	templates := []string{
		"{http.vars.client_ip}", "{http.request.remote.host}", "{http.request.header.X-Key}",
		"{http.request.header.x-key}", "{http.vars.client_ip}:{http.request.header.X-Tenant}",
		"{http.request.header.X-Key}{http.request.remote.host}", "{http.request.uri.path}|{http.request.header.X-Key}",
		"{http.vars.unset}", "{http.request.header.Absent}", "{client_ip}",
	}
	requests := []struct {
		name   string
		remote string
		tls    *tls.ConnectionState
		header http.Header
	}{
		{"IPv4", "192.0.2.7:1234", nil, http.Header{"X-Key": {"alice"}, "X-Tenant": {"acme"}}},
		{"IPv6", "[2001:db8:1:2::7]:443", nil, http.Header{"X-Key": {"a key with spaces%and{braces}|"}}},
		{"IPv4-mapped", "[::ffff:192.0.2.7]:1", nil, http.Header{"X-Tenant": {""}}},
		{"zone", "[fe80::1%eth0]:1", nil, http.Header{"X-Key": {"b", "c"}}}, // two values join with ','
		{"unix socket", "@", nil, http.Header{"X-Key": {strings.Repeat("long", 40)}}},
		{"early data", "192.0.2.7:1234", &tls.ConnectionState{}, http.Header{"X-Key": {"#x"}}},
		{"handshake done", "192.0.2.7:1234", &tls.ConnectionState{HandshakeComplete: true}, http.Header{"X-Key": {"\x00\n\xff"}}},
	}
	resolved := 0
	for _, template := range templates {
		kt, err := Parse(template)
		if err != nil {
			t.Fatal(err)
		}
		kt.IPv6Bits = 48
		for _, rc := range requests {
			r, err := http.NewRequest(http.MethodGet, "http://example.com/some/path", nil)
			if err != nil {
				t.Fatal(err)
			}
			r.RemoteAddr, r.TLS, r.Header = rc.remote, rc.tls, rc.header
			r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), httptest.NewRecorder(), &caddyhttp.Server{})
			repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
			fromRequest := kt.Key(&Values{r: r, repl: repl}, "p|", "|s")
			fromReplacer := kt.ReplacerKey(repl, "p|", "|s")
			if fromRequest != fromReplacer {
				t.Errorf("%s, %s: key %q from the request, %q from the replacer", template, rc.name, fromRequest, fromReplacer)
			}
			if fromRequest != "" {
				resolved++
			}
		}
	}
	if resolved < 30 {
		t.Errorf("only %d of the keys were not empty: the comparison says little", resolved)
	}
}
