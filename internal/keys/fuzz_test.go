package keys

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// The fuzz test's seed corpus is in testdata/fuzz. `make test` runs it
// for a few seconds:
//
//	go test -run '^$' -fuzz '^FuzzKeyTemplate$' -fuzztime 5s ./internal/keys

// FuzzKeyTemplate: for any template and any placeholder values, keys of
// different values differ, keys stay bounded in length, and no brace
// from a value reaches Redis.
func FuzzKeyTemplate(f *testing.F) {
	f.Add("{a}", "x", "y")
	f.Add("{a}:{b}", "1:2", "1")
	f.Add("{a}{b}", "|", "%7C")
	f.Add("#{a}", "{tag}", strings.Repeat("z", 100))
	f.Add("t-{a}%{b}", "%", "")
	f.Fuzz(func(t *testing.T, template, v1, v2 string) {
		tmpl, err := Parse(template)
		if err != nil {
			return
		}
		const prefix = "rate_limit:zone|tag|"
		resolve := func(values map[string]string) string {
			repl := caddy.NewReplacer()
			for name, v := range values {
				repl.Set(name, v)
			}
			return tmpl.ReplacerKey(repl, prefix, "")
		}
		// Each placeholder takes v1, then one of them takes v2 instead.
		names := map[string]bool{}
		for _, p := range tmpl.parts {
			if p.placeholder != "" {
				names[p.placeholder] = true
			}
		}
		first := map[string]string{}
		for n := range names {
			first[n] = v1
		}
		k1 := resolve(first)
		for n := range names {
			second := map[string]string{}
			for m := range names {
				second[m] = v1
			}
			second[n] = v2
			k2 := resolve(second)
			if v1 != v2 && v1 != "" && v2 != "" && k1 == k2 {
				t.Fatalf("template %q: %q=%q and %q=%q give the same key %q", template, n, v1, n, v2, k1)
			}
			checkKey(t, template, prefix, k2)
		}
		checkKey(t, template, prefix, k1)
	})
}

func checkKey(t *testing.T, template, prefix, key string) {
	t.Helper()
	if key == "" {
		return // a placeholder was empty
	}
	client := strings.TrimPrefix(key, prefix)
	if len(client) > maxVerbatimKey+len(template)+1 && len(client) > 23 {
		t.Fatalf("template %q: key of %d bytes: %q", template, len(client), client)
	}
	if len(client) > maxVerbatimKey && client[0] != '#' {
		t.Fatalf("template %q: a key over %d bytes is not hashed: %q", template, maxVerbatimKey, client)
	}
	if strings.ContainsAny(client, "{}") {
		t.Fatalf("template %q: a brace reached the key %q", template, client)
	}
	// Values are escaped to printable ASCII; the template's own text is
	// the operator's.
	unprintable := func(r rune) bool { return r < 0x21 || r >= 0x7f }
	if !strings.ContainsFunc(template, unprintable) && strings.ContainsFunc(client, unprintable) {
		t.Fatalf("template %q: a control or non-ASCII byte of a value reached the key %q", template, client)
	}
}
