package ratelimit

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// Fuzz tests; their seed corpora are in testdata/fuzz. `make test` runs
// each for a few seconds:
//
//	go test -run '^$' -fuzz '^FuzzUnmarshalCaddyfile$' -fuzztime 5s .

// FuzzUnmarshalCaddyfile: any token stream gives an error or a handler
// that validates, never a panic.
func FuzzUnmarshalCaddyfile(f *testing.F) {
	f.Add("rate_limit 10 20 2")
	f.Add("rate_limit {\n\tzone api\n\tkey {http.request.header.X-API-Key}\n\treplenish_rate 100/1m\n\tburst_capacity 100\n}")
	f.Add("rate_limit 1 1 {\n\tredis h1:6379 h2:6379 {\n\t\tmaster_name m\n\t\ttls {\n\t\t\tcert c\n\t\t\tkey k\n\t\t}\n\t}\n}")
	f.Add("rate_limit 1 10 {\n\tcharge json usage.total_tokens\n\tmax_debt 5\n\tmax_body 1MiB\n\tlimit t {\n\t\tcharge_status 4xx\n\t}\n}")
	f.Add("rate_limit {\n\tlimit requests 60/1m 60\n\tconcurrent gen 4 {\n\t\thold 30s\n\t\tretry_after 2\n\t\tkey {http.request.header.A}\n\t}\n}")
	f.Fuzz(func(t *testing.T, input string) {
		tokens, err := caddyfile.Tokenize([]byte(input), "Fuzzfile")
		if err != nil || len(tokens) == 0 {
			return
		}
		h := new(Handler)
		if err := h.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens)); err != nil {
			return
		}
		h.applyDefaults()
		if err := h.Validate(); err != nil {
			t.Fatalf("parsed, then refused by Validate: %v\n%q", err, input)
		}
		if _, err := parseKeyTemplate(h.Key); err != nil {
			t.Fatalf("parsed, then the key template failed: %v\n%q", err, input)
		}
		if h.Redis != nil {
			if err := h.Redis.validate(); err != nil {
				t.Fatalf("parsed, then the redis block was refused: %v\n%q", err, input)
			}
		}
	})
}

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
		tmpl, err := parseKeyTemplate(template)
		if err != nil {
			return
		}
		const prefix = "rate_limit:zone|tag|"
		resolve := func(values map[string]string) string {
			repl := caddy.NewReplacer()
			for name, v := range values {
				repl.Set(name, v)
			}
			return tmpl.redisKey(repl, prefix, "")
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

// FuzzParseReply: any array of integers a script may answer (the
// batcher reads replies as such: go-redis refuses any other shape) is an
// answer or an error, never a panic, and a malformed one is never read
// as a decision.
func FuzzParseReply(f *testing.F) {
	f.Add(uint8(3), int64(1), int64(4), int64(0))
	f.Add(uint8(3), int64(0), int64(0), int64(500000))
	f.Add(uint8(11), int64(1), int64(3), int64(0))
	f.Add(uint8(2), int64(1), int64(1), int64(1))
	f.Add(uint8(7), int64(-1), int64(-5), int64(-1))
	f.Add(uint8(27), int64(1), int64(4), int64(0)) // two buckets, leasing
	f.Fuzz(func(t *testing.T, shape uint8, a, b, c int64) {
		buckets := make([]bucket, 1+int(shape/8)%2) // one bucket, or two
		leasing := shape&16 != 0                    // then each bucket also lent b tokens
		var reply []int64
		wellFormed := false
		switch shape % 8 {
		case 0:
		case 1:
			reply = []int64{a}
		case 2:
			reply = []int64{a, b}
		case 3:
			reply = []int64{a, b, c}
			if len(buckets) == 2 {
				reply = append(reply, b, c)
			}
			if leasing {
				for range buckets {
					reply = append(reply, b)
				}
			}
			wellFormed = (a == 0 || a == 1) && b >= 0 && c >= 0 && c <= maxRetryMicros
		default:
			reply = []int64{a, b, c, a, b, c, a}[:shape%8]
		}
		if shape%8 > 3 { // another length: well formed only if it fits the buckets, each value in range
			n := len(buckets)
			want := 1 + 2*n
			if leasing {
				want += n
			}
			wellFormed = len(reply) == want && (a == 0 || a == 1)
			for i := 0; wellFormed && i < n; i++ {
				wellFormed = reply[1+2*i] >= 0 && reply[2+2*i] >= 0 && reply[2+2*i] <= maxRetryMicros && (!leasing || reply[1+2*n+i] >= 0)
			}
		}
		allowed, err := readTake(reply, buckets, leasing)
		leased := func(i int) int64 { return reply[1+2*len(buckets)+i] } // what the lease layer reads, once readTake judged them
		if wellFormed != (err == nil) {
			t.Fatalf("reply %v: error %v; well-formed %v", reply, err, wellFormed)
		}
		for i, bk := range buckets {
			if err == nil && shape%8 == 3 && (allowed != (a == 1) || bk.remaining != b || bk.retryAfter.Microseconds() != c || leasing && leased(i) != b) {
				t.Fatalf("reply %v read as %v %+v", reply, allowed, buckets)
			}
			if err == nil && (bk.remaining < 0 || bk.retryAfter < 0 || leasing && leased(i) < 0) {
				t.Fatalf("reply %v read as negative counts %+v", reply, buckets)
			}
		}
	})
}
