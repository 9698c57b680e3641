package keys

import (
	"net"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// BenchmarkKeyResolve is the key template resolution alone: with the
// values read from the request, as ServeHTTP reads them, and with every
// value asked of the replacer, as before (and as the admin API asks).
func BenchmarkKeyResolve(b *testing.B) {
	cases := []struct {
		name, template, key string
	}{
		{"header", "{http.request.header.X-Key}", "client-1"},
		{"client_ip", "{http.vars.client_ip}", ""},
		{"ip+header", "{http.vars.client_ip}:{http.request.header.X-Key}", "tenant-42"},
		{"escaped", "{http.request.header.X-Key}", "a key with spaces%and{braces}"},
		{"hashed", "{http.request.header.X-Key}", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ.sig"},
	}
	for _, c := range cases {
		for _, from := range []string{"request", "replacer"} {
			b.Run(c.name+"/"+from, func(b *testing.B) {
				tmpl, err := Parse(c.template)
				if err != nil {
					b.Fatal(err)
				}
				r := benchRequest("192.0.2.1", c.key)
				repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
				if from == "replacer" {
					r = nil
				}
				const prefix = "rate_limit:bench|"
				if tmpl.Key(&Values{r: r, repl: repl}, prefix, "") == "" {
					b.Fatal("empty key")
				}
				b.ReportAllocs()
				for b.Loop() {
					_ = tmpl.Key(&Values{r: r, repl: repl}, prefix, "")
				}
			})
		}
	}
}

// benchRequest is a request from remoteIP with the X-Key header (if
// key is not empty), prepared as Caddy's server prepares it: with its
// replacer and the client_ip variable.
func benchRequest(remoteIP, key string) *http.Request {
	r, err := http.NewRequest(http.MethodGet, "http://example.com/", nil)
	if err != nil {
		panic(err)
	}
	r.RemoteAddr = net.JoinHostPort(remoteIP, "1234")
	if key != "" {
		r.Header.Set("X-Key", key)
	}
	return caddyhttp.PrepareRequest(r, caddy.NewReplacer(), httptest.NewRecorder(), &caddyhttp.Server{})
}
