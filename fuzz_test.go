package ratelimit

import (
	"testing"

	"github.com/caddy-redis/ratelimit/internal/redisstore"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/limit"
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
		if _, err := keys.Parse(h.Key); err != nil {
			t.Fatalf("parsed, then the key template failed: %v\n%q", err, input)
		}
		if h.Redis != nil {
			if err := h.Redis.validate(); err != nil {
				t.Fatalf("parsed, then the redis block was refused: %v\n%q", err, input)
			}
		}
	})
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
		buckets := make([]limit.Bucket, 1+int(shape/8)%2) // one bucket, or two
		leasing := shape&16 != 0                          // then each bucket also lent b tokens
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
			wellFormed = (a == 0 || a == 1) && b >= 0 && c >= 0 && c <= redisstore.MaxRetryMicros
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
				wellFormed = reply[1+2*i] >= 0 && reply[2+2*i] >= 0 && reply[2+2*i] <= redisstore.MaxRetryMicros && (!leasing || reply[1+2*n+i] >= 0)
			}
		}
		allowed, err := redisstore.ReadTake(reply, buckets, leasing)
		leased := func(i int) int64 { return reply[1+2*len(buckets)+i] } // what the lease layer reads, once readTake judged them
		if wellFormed != (err == nil) {
			t.Fatalf("reply %v: error %v; well-formed %v", reply, err, wellFormed)
		}
		for i, bk := range buckets {
			if err == nil && shape%8 == 3 && (allowed != (a == 1) || bk.Remaining != b || bk.RetryAfter.Microseconds() != c || leasing && leased(i) != b) {
				t.Fatalf("reply %v read as %v %+v", reply, allowed, buckets)
			}
			if err == nil && (bk.Remaining < 0 || bk.RetryAfter < 0 || leasing && leased(i) < 0) {
				t.Fatalf("reply %v read as negative counts %+v", reply, buckets)
			}
		}
	})
}
