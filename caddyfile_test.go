package ratelimit

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

var update = flag.Bool("update", false, "rewrite the part after ---------- of each testdata/adapt/*.caddyfiletest from what the adapter gives")

func TestUnmarshalCaddyfileParsesEveryForm(t *testing.T) {
	for _, tc := range []struct {
		name  string
		input string
		want  Handler
	}{
		{
			name:  "inline rate and burst",
			input: `rate_limit 10 20`,
			want:  Handler{ReplenishRate: "10", BurstCapacity: "20"},
		},
		{
			name:  "inline rate, burst and requested tokens",
			input: `rate_limit 10 20 2`,
			want:  Handler{ReplenishRate: "10", BurstCapacity: "20", RequestedTokens: "2"},
		},
		{
			name:  "inline args with a block",
			input: "rate_limit 10 20 {\n\tzone api\n}",
			want:  Handler{Zone: "api", ReplenishRate: "10", BurstCapacity: "20"},
		},
		{
			name: "every subdirective",
			input: `rate_limit {
				zone api
				key {http.request.header.X-API-Key}
				replenish_rate 10
				burst_capacity 20
				requested_tokens 2
				deny_empty_key false
				empty_key_status 401
				status_code 503
				include_headers false
				on_error deny
			}`,
			want: Handler{
				Zone:            "api",
				Key:             "{http.request.header.X-API-Key}",
				ReplenishRate:   "10",
				BurstCapacity:   "20",
				RequestedTokens: "2",
				DenyEmptyKey:    ptr(false),
				EmptyKeyStatus:  401,
				StatusCode:      503,
				IncludeHeaders:  ptr(false),
				OnError:         "deny",
			},
		},
		{
			name:  "true booleans and on_error allow",
			input: "rate_limit 1 1 {\n\tdeny_empty_key true\n\tinclude_headers true\n\ton_error allow\n}",
			want: Handler{ReplenishRate: "1", BurstCapacity: "1",
				DenyEmptyKey: ptr(true), IncludeHeaders: ptr(true), OnError: "allow"},
		},
		{
			name:  "store memory with max_keys",
			input: "rate_limit 1 1 {\n\tstore memory\n\tmax_keys 500\n\ton_error deny\n}",
			want:  Handler{ReplenishRate: "1", BurstCapacity: "1", Store: "memory", MaxKeys: 500, OnError: "deny"},
		},
		{
			name:  "on_error local with store redis",
			input: "rate_limit 1 1 {\n\ton_error local\n\tstore redis\n}",
			want:  Handler{ReplenishRate: "1", BurstCapacity: "1", Store: "redis", OnError: "local"},
		},
		{
			name:  "fractional rate",
			input: "rate_limit 0.5 1",
			want:  Handler{ReplenishRate: "0.5", BurstCapacity: "1"},
		},
		{
			name:  "rate per minute",
			input: "rate_limit {\n\treplenish_rate 100/1m\n\tburst_capacity 100\n}",
			want:  Handler{ReplenishRate: "1.6666666666666667", BurstCapacity: "100"},
		},
		{
			name:  "rate per hour inline",
			input: "rate_limit 5000/1h 100",
			want:  Handler{ReplenishRate: tokenbucket.RateParam(5000.0 / 3600), BurstCapacity: "100"},
		},
		{
			name:  "burst_capacity 0 alone blocks",
			input: "rate_limit {\n\tburst_capacity 0\n}",
			want:  Handler{BurstCapacity: "0"},
		},
		{
			name:  "redis addresses inline and in the block add up",
			input: "rate_limit 1 1 {\n\tredis 127.0.0.1:6379 127.0.0.1:6380 {\n\t\taddress 127.0.0.1:6381\n\t}\n}",
			want: Handler{ReplenishRate: "1", BurstCapacity: "1", Redis: &RedisConfig{
				Addresses: []string{"127.0.0.1:6379", "127.0.0.1:6380", "127.0.0.1:6381"},
			}},
		},
		{
			name:  "redis address repeated and URLs",
			input: "rate_limit 1 1 {\n\tredis {\n\t\taddress redis://u:p@h1:6379\n\t\taddress rediss://h2:6380 [::1]:6379\n\t}\n}",
			want: Handler{ReplenishRate: "1", BurstCapacity: "1", Redis: &RedisConfig{
				Addresses: []string{"redis://u:p@h1:6379", "rediss://h2:6380", "[::1]:6379"},
			}},
		},
		{
			name:  "redis address placeholder is left for provisioning",
			input: "rate_limit 1 1 {\n\tredis {env.REDIS_ADDRESS}\n}",
			want: Handler{ReplenishRate: "1", BurstCapacity: "1", Redis: &RedisConfig{
				Addresses: []string{"{env.REDIS_ADDRESS}"},
			}},
		},
		{
			name: "redis block with every field",
			input: `rate_limit 1 1 {
				redis {
					address 10.0.0.1:26379 10.0.0.2:26379
					master_name mymaster
					sentinel_username sentinel-user
					sentinel_password sentinel-secret
					username app
					password secret
					db 3
					key_prefix rl:
					timeout 250ms
					dial_timeout 2s
					pool_size 20
					tls {
						ca /etc/redis/ca.pem
						cert /etc/redis/client.pem
						key /etc/redis/client.key
						server_name redis.internal
						insecure_skip_verify
					}
				}
			}`,
			want: Handler{ReplenishRate: "1", BurstCapacity: "1", Redis: &RedisConfig{
				Addresses:        []string{"10.0.0.1:26379", "10.0.0.2:26379"},
				MasterName:       "mymaster",
				SentinelUsername: "sentinel-user",
				SentinelPassword: "sentinel-secret",
				Username:         "app",
				Password:         "secret",
				DB:               3,
				KeyPrefix:        "rl:",
				Timeout:          caddy.Duration(250 * time.Millisecond),
				DialTimeout:      caddy.Duration(2 * time.Second),
				PoolSize:         20,
				TLS: &RedisTLS{
					CA:                 "/etc/redis/ca.pem",
					Cert:               "/etc/redis/client.pem",
					Key:                "/etc/redis/client.key",
					ServerName:         "redis.internal",
					InsecureSkipVerify: true,
				},
			}},
		},
		// Policies: limits, prefixes and per-request values (issue 11)
		{
			name:  "limit with inline rate and burst",
			input: "rate_limit {\n\tlimit a 10 20\n}",
			want:  Handler{Limits: []Limit{{Name: "a", ReplenishRate: "10", BurstCapacity: "20"}}},
		},
		{
			name:  "limit with inline rate, burst and requested tokens",
			input: "rate_limit {\n\tlimit a 10 20 2\n}",
			want:  Handler{Limits: []Limit{{Name: "a", ReplenishRate: "10", BurstCapacity: "20", RequestedTokens: "2"}}},
		},
		{
			name:  "limit with no values takes the handler's",
			input: "rate_limit 10 20 {\n\tlimit a\n}",
			want:  Handler{ReplenishRate: "10", BurstCapacity: "20", Limits: []Limit{{Name: "a"}}},
		},
		{
			name: "limit block with every subdirective",
			input: `rate_limit {
				limit a {
					key {http.request.header.X-Tenant}
					replenish_rate 100/1m
					burst_capacity 200
					requested_tokens 2
					ipv4_prefix 24
					ipv6_prefix 48
				}
			}`,
			want: Handler{Limits: []Limit{{
				Name: "a", Key: "{http.request.header.X-Tenant}",
				ReplenishRate: "1.6666666666666667", BurstCapacity: "200", RequestedTokens: "2",
				IPv4Prefix: ptr(24), IPv6Prefix: ptr(48),
			}}},
		},
		{
			name:  "limit inline values plus a block",
			input: "rate_limit {\n\tlimit a 10 20 {\n\t\tkey {client_ip}\n\t\tipv6_prefix 56\n\t}\n}",
			want: Handler{Limits: []Limit{{
				Name: "a", Key: "{client_ip}", ReplenishRate: "10", BurstCapacity: "20", IPv6Prefix: ptr(56),
			}}},
		},
		{
			name:  "limit inline rate and burst, requested_tokens in the block",
			input: "rate_limit {\n\tlimit a 10 20 {\n\t\trequested_tokens 5\n\t}\n}",
			want:  Handler{Limits: []Limit{{Name: "a", ReplenishRate: "10", BurstCapacity: "20", RequestedTokens: "5"}}},
		},
		{
			name: "several limits, in order, beside handler fields",
			input: `rate_limit {
				zone api
				key {http.request.header.X-API-Key}
				limit second 10 20
				limit hour 1000/1h 1000
				limit tenant 600/1m 600 {
					key {http.request.header.X-Tenant}
				}
				limit Az09_- 1 1
			}`,
			want: Handler{Zone: "api", Key: "{http.request.header.X-API-Key}", Limits: []Limit{
				{Name: "second", ReplenishRate: "10", BurstCapacity: "20"},
				{Name: "hour", ReplenishRate: tokenbucket.RateParam(1000.0 / 3600), BurstCapacity: "1000"},
				{Name: "tenant", Key: "{http.request.header.X-Tenant}", ReplenishRate: "10", BurstCapacity: "600"},
				{Name: "Az09_-", ReplenishRate: "1", BurstCapacity: "1"},
			}},
		},
		{
			name:  "handler ipv4_prefix and ipv6_prefix",
			input: "rate_limit 10 20 {\n\tipv4_prefix 24\n\tipv6_prefix 48\n}",
			want:  Handler{ReplenishRate: "10", BurstCapacity: "20", IPv4Prefix: ptr(24), IPv6Prefix: ptr(48)},
		},
		{
			name:  "prefixes at their lower bounds",
			input: "rate_limit 10 20 {\n\tipv4_prefix 0\n\tipv6_prefix 0\n\tlimit a {\n\t\tipv4_prefix 0\n\t\tipv6_prefix 0\n\t}\n}",
			want: Handler{ReplenishRate: "10", BurstCapacity: "20", IPv4Prefix: ptr(0), IPv6Prefix: ptr(0),
				Limits: []Limit{{Name: "a", IPv4Prefix: ptr(0), IPv6Prefix: ptr(0)}}},
		},
		{
			name:  "prefixes at their upper bounds",
			input: "rate_limit 10 20 {\n\tipv4_prefix 32\n\tipv6_prefix 128\n\tlimit a {\n\t\tipv4_prefix 32\n\t\tipv6_prefix 128\n\t}\n}",
			want: Handler{ReplenishRate: "10", BurstCapacity: "20", IPv4Prefix: ptr(32), IPv6Prefix: ptr(128),
				Limits: []Limit{{Name: "a", IPv4Prefix: ptr(32), IPv6Prefix: ptr(128)}}},
		},
		{
			name: "placeholders in the handler's values are kept as written",
			input: `rate_limit {
				replenish_rate {plan_rate}
				burst_capacity {plan_burst}
				requested_tokens {http.request.header.X-Cost}
			}`,
			want: Handler{ReplenishRate: "{plan_rate}", BurstCapacity: "{plan_burst}", RequestedTokens: "{http.request.header.X-Cost}"},
		},
		{
			name:  "placeholders inline, in the text of a value",
			input: "rate_limit {http.request.header.X-Count}/1m {plan_burst} {plan_cost}",
			want:  Handler{ReplenishRate: "{http.request.header.X-Count}/1m", BurstCapacity: "{plan_burst}", RequestedTokens: "{plan_cost}"},
		},
		{
			name:  "placeholders in a limit, inline and in its block",
			input: "rate_limit {\n\tlimit plan {plan_rate} {plan_burst} {\n\t\trequested_tokens {http.request.header.X-Cost}\n\t}\n}",
			want: Handler{Limits: []Limit{{Name: "plan", ReplenishRate: "{plan_rate}", BurstCapacity: "{plan_burst}",
				RequestedTokens: "{http.request.header.X-Cost}"}}},
		},
		{
			name:  "a fixed value beside placeholders",
			input: "rate_limit {\n\tlimit a 100/1m {plan_burst}\n}",
			want:  Handler{Limits: []Limit{{Name: "a", ReplenishRate: "1.6666666666666667", BurstCapacity: "{plan_burst}"}}},
		},
		{
			name:  "unlimited rate is kept as written",
			input: "rate_limit {\n\treplenish_rate unlimited\n\tlimit a unlimited unlimited\n}",
			want:  Handler{ReplenishRate: "unlimited", Limits: []Limit{{Name: "a", ReplenishRate: "unlimited", BurstCapacity: "unlimited"}}},
		},
		{
			name:  "fixed rates stored as the JSON number",
			input: "rate_limit {\n\tlimit m 100/1m 100\n\tlimit h {\n\t\treplenish_rate 5000/1h\n\t\tburst_capacity 5000\n\t}\n\tlimit f 0.5 1\n\tlimit e 1e3 1000\n}",
			want: Handler{Limits: []Limit{
				{Name: "m", ReplenishRate: "1.6666666666666667", BurstCapacity: "100"},
				{Name: "h", ReplenishRate: "1.3888888888888888", BurstCapacity: "5000"},
				{Name: "f", ReplenishRate: "0.5", BurstCapacity: "1"},
				{Name: "e", ReplenishRate: "1000", BurstCapacity: "1000"},
			}},
		},
		{
			name:  "lease",
			input: "rate_limit 10 20 {\n\tlease 32\n}",
			want:  Handler{ReplenishRate: "10", BurstCapacity: "20", Lease: &Lease{MaxTokens: 32}},
		},
		{
			name:  "lease with hold",
			input: "rate_limit 10 20 {\n\tlease 32 250ms\n}",
			want:  Handler{ReplenishRate: "10", BurstCapacity: "20", Lease: &Lease{MaxTokens: 32, Hold: caddy.Duration(250 * time.Millisecond)}},
		},
		{
			name:  "empty redis and tls blocks",
			input: "rate_limit 1 1 {\n\tredis {\n\t\ttls\n\t}\n}",
			want: Handler{ReplenishRate: "1", BurstCapacity: "1", Redis: &RedisConfig{
				TLS: &RedisTLS{},
			}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := parseTestCaddyfile(tc.input)
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if !reflect.DeepEqual(*h, tc.want) {
				got, _ := json.Marshal(h)
				want, _ := json.Marshal(tc.want)
				t.Errorf("parsed\n%s\nwant\n%s", got, want)
			}
		})
	}
}

// TestUnmarshalCaddyfileErrorsNameSubdirectiveAndValue holds the many
// small cases, one subdirective or value each. Whole Caddyfiles (matchers,
// snippets, nested blocks, line numbers in a file) and a few
// representative mistakes, with their whole messages, are adapter
// fixtures in testdata/adapt (TestAdaptCaddyfileMatchesTestdata); a case lives in
// one of the two places only.
func TestUnmarshalCaddyfileErrorsNameSubdirectiveAndValue(t *testing.T) {
	// redis wraps a redis block body, rtls a tls block body.
	redis := func(body string) string { return "rate_limit 1 1 {\n\tredis {\n\t\t" + body + "\n\t}\n}" }
	rtls := func(body string) string { return redis("tls {\n\t\t\t" + body + "\n\t\t}") }
	block := func(body string) string { return "rate_limit 1 1 {\n\t" + body + "\n}" }
	block0 := func(body string) string { return "rate_limit {\n\t" + body + "\n}" } // without inline arguments

	for _, tc := range []struct {
		name  string
		input string
		want  []string // substrings of the error
	}{
		// unknown and duplicated subdirectives (fixtures: unknown_subdirective,
		// unknown_in_tls)
		{"unknown subdirective without value", block("bogus"), []string{"unrecognized rate_limit subdirective 'bogus'"}},
		{"unknown redis subdirective", redis("bogus 1"), []string{"unrecognized redis subdirective 'bogus'"}},
		{"unknown redis subdirective without value", redis("bogus"), []string{"unrecognized redis subdirective 'bogus'"}},
		{"duplicated subdirective", block("zone a\n\tzone b"), []string{"subdirective 'zone' is given twice"}},
		{"inline rate plus replenish_rate", block("replenish_rate 5"), []string{"subdirective 'replenish_rate' is given twice"}},
		{"inline burst plus burst_capacity", block("burst_capacity 5"), []string{"subdirective 'burst_capacity' is given twice"}},
		{"inline requested plus requested_tokens", "rate_limit 1 2 1 {\n\trequested_tokens 1\n}", []string{"subdirective 'requested_tokens' is given twice"}},
		{"duplicated redis", block("redis h:1\n\tredis h:2"), []string{"subdirective 'redis' is given twice"}},
		{"duplicated redis subdirective", redis("db 1\n\t\tdb 2"), []string{"redis subdirective 'db' is given twice"}},
		{"duplicated tls subdirective", rtls("ca a\n\t\t\tca b"), []string{"redis tls subdirective 'ca' is given twice"}},

		// argument counts
		{"one inline arg", "rate_limit 10", []string{"rate_limit", "got 1 argument(s): '10'"}},
		{"four inline args", "rate_limit 1 2 3 4", []string{"rate_limit", "got 4 argument(s): '1 2 3 4'"}},
		{"zone without value", block("zone"), []string{"zone: wrong argument count", "after 'zone'"}},
		{"zone with two values", block("zone a b"), []string{"zone: wrong argument count or unexpected line ending after 'a'"}},
		{"key with two values", block("key a b"), []string{"key: wrong argument count"}},
		{"status_code without value", block("status_code"), []string{"status_code: wrong argument count"}},
		{"redis address without value", redis("address"), []string{"redis address: wrong argument count"}},
		{"redis cluster with a value", redis("cluster yes"), []string{"redis cluster: wrong argument count", "after 'yes'"}},
		{"redis password with two values", redis("password a b"), []string{"redis password: want exactly one value"}},
		{"redis tls with a value", redis("tls on"), []string{"redis tls: wrong argument count", "after 'on'"}},
		{"tls ca without value", rtls("ca"), []string{"redis tls ca: wrong argument count"}},
		{"tls insecure_skip_verify with a value", rtls("insecure_skip_verify true"), []string{"redis tls insecure_skip_verify: wrong argument count", "after 'true'"}},

		// rates
		{"rate not a number", "rate_limit abc 10", []string{"replenish_rate 'abc'", "positive number of tokens per second"}},
		{"rate negative", block0("replenish_rate -1"), []string{"replenish_rate '-1'", "positive number"}},
		{"rate zero", "rate_limit 0 10", []string{"replenish_rate '0'", "positive number"}},
		{"rate NaN", "rate_limit NaN 10", []string{"replenish_rate 'NaN'", "positive number"}},
		{"rate infinite", "rate_limit +Inf 10", []string{"replenish_rate '+Inf'", "positive number"}},
		{"rate per zero duration", "rate_limit 10/0s 10", []string{"replenish_rate '10/0s'", "duration after '/' must be positive"}},
		{"rate per bad duration", block0("replenish_rate 10/xyz"), []string{"replenish_rate '10/xyz'", "duration after '/' must be positive"}},
		{"rate per negative duration", "rate_limit 10/-1s 10", []string{"replenish_rate '10/-1s'", "duration after '/' must be positive"}},
		{"rate with bad count", "rate_limit x/1s 10", []string{"replenish_rate 'x/1s'", "positive number"}},

		// whole numbers
		{"inline burst not whole", "rate_limit 10 2.5", []string{"burst_capacity '2.5' is not a whole number"}},
		{"burst not a number", block0("burst_capacity lots"), []string{"burst_capacity 'lots' is not a whole number"}},
		{"inline requested not whole", "rate_limit 10 20 1.5", []string{"requested_tokens '1.5' is not a whole number"}},
		{"requested not a number", block("requested_tokens one"), []string{"requested_tokens 'one' is not a whole number"}},

		// booleans, statuses, on_error
		{"deny_empty_key not a bool", block("deny_empty_key yes"), []string{"deny_empty_key 'yes'", "want true or false"}},
		{"include_headers not a bool", block("include_headers 1"), []string{"include_headers '1'", "want true or false"}},
		{"status_code too small", block("status_code 42"), []string{"status_code '42': want an HTTP status from 200 to 599"}},
		{"status_code too large", block("status_code 600"), []string{"status_code '600'", "200 to 599"}},
		{"status_code not a number", block("status_code abc"), []string{"status_code 'abc'", "200 to 599"}},
		{"empty_key_status too large", block("empty_key_status 600"), []string{"empty_key_status '600'", "200 to 599"}},
		{"on_error unknown", block("on_error ignore"), []string{"on_error 'ignore'", "want 'allow', 'deny' or 'local'"}},

		// store and max_keys: judged where written, and with what depends
		// on them (a redis block, on_error local) at the end of the directive
		{"store unknown", block("store bogus"), []string{"store 'bogus'", "want 'redis' or 'memory'"}},
		{"store without value", block("store"), []string{"store: wrong argument count"}},
		{"store memory with a redis block", block("store memory\n\tredis 127.0.0.1:1"),
			[]string{"store 'memory'", "the 'redis' block has nothing to do", "remove it, or use store redis"}},
		{"redis block before store memory", block("redis {\n\t\taddress 127.0.0.1:1\n\t}\n\tstore memory"),
			[]string{"store 'memory'", "the 'redis' block has nothing to do"}},
		{"store memory with on_error local", block("store memory\n\ton_error local"),
			[]string{"on_error 'local' with store 'memory'", "the buckets are local already"}},
		{"on_error local before store memory", block("on_error local\n\tstore memory"),
			[]string{"on_error 'local' with store 'memory'"}},
		{"max_keys zero", block("max_keys 0"), []string{"max_keys '0'", "want a whole number of buckets, 1 or more"}},
		{"max_keys negative", block("max_keys -5"), []string{"max_keys '-5'", "1 or more"}},
		{"max_keys not a number", block("max_keys many"), []string{"max_keys 'many'", "1 or more"}},
		{"max_keys fractional", block("max_keys 1.5"), []string{"max_keys '1.5'", "1 or more"}},
		{"max_keys without value", block("max_keys"), []string{"max_keys: wrong argument count"}},

		// redis addresses (fixture: bad_redis_address)
		{"redis address with http scheme", block("redis http://x:1"), []string{"redis address 'http://x:1'", "redis:// or rediss://"}},
		{"redis address port out of range", block("redis host:99999"), []string{"redis address 'host:99999'", "port '99999'"}},
		{"redis address without host", redis("address :6379"), []string{"redis address ':6379'", "missing host"}},
		{"redis address bad URL", redis("address redis://h:1/notadb"), []string{"redis address 'redis://h:1/notadb'"}},

		// other redis values
		{"redis timeout not a duration", redis("timeout abc"), []string{"redis timeout 'abc': want a positive duration"}},
		{"redis timeout zero", redis("timeout 0s"), []string{"redis timeout '0s'", "positive duration"}},
		{"redis dial_timeout negative", redis("dial_timeout -1s"), []string{"redis dial_timeout '-1s'", "positive duration"}},
		{"redis db negative", redis("db -1"), []string{"redis db '-1'", "database index"}},
		{"redis db not a number", redis("db one"), []string{"redis db 'one'", "database index"}},
		{"redis pool_size zero", redis("pool_size 0"), []string{"redis pool_size '0'", "1 or more"}},
		{"tls cert without key", rtls("cert /c.pem"), []string{"redis tls: 'cert' and 'key' go together; got cert '/c.pem' and key ''"}},
		{"tls key without cert", rtls("key /k.pem"), []string{"redis tls", "'cert' and 'key' go together", "key '/k.pem'"}},

		// judged together at the end of the directive, as Validate judges JSON
		// (fixture: burst_below_rate)
		{"missing replenish_rate with a burst", block0("burst_capacity 5"), []string{"replenish_rate is required"}},
		{"negative burst_capacity", "rate_limit 10 -1", []string{"burst_capacity '-1' must not be negative"}},
		{"requested_tokens above burst_capacity", "rate_limit 1 2 3", []string{"requested_tokens '3' is more than burst_capacity '2'"}},
		{"requested_tokens negative", "rate_limit 1 2 -1", []string{"requested_tokens '-1' must be at least 1"}},
		{"zone with a bar", block("zone a|b"), []string{"zone 'a|b'", "letters, digits"}},
		{"zone with a space", block("zone \"a b\""), []string{"zone 'a b'"}},
		{"key template unclosed", block("key \"{http.request.host\""), []string{"key '{http.request.host'", "unclosed placeholder"}},

		// policies: limits (fixtures: policy_*, the README's examples, and
		// limit_burst_below_rate, a limit's mistake in a whole Caddyfile)
		{"limit without a name", block("limit"), []string{"limit: wrong argument count"}},
		{"duplicate limit names", block("limit a 1 1\n\tlimit a 2 2"), []string{"limit 'a' is given twice", "unique"}},
		{"duplicate limit names, one with a block", block("limit a\n\tlimit b\n\tlimit a {\n\t\tkey {client_ip}\n\t}"), []string{"limit 'a' is given twice"}},
		{"limit name with a dot", block("limit a.b"), []string{"limit name 'a.b'", "letters, digits, '-' and '_'"}},
		{"limit name with a bar", block("limit a|b 1 1"), []string{"limit name 'a|b'", "letters, digits"}},
		{"limit name with a space", block("limit \"a b\" 1 1"), []string{"limit name 'a b'"}},
		{"limit name with a placeholder", block("limit {plan} 1 1"), []string{"limit name '{plan}'"}},
		{"limit name empty", block("limit \"\" 1 1"), []string{"limit name ''"}},
		{"limit block with an unknown subdirective", block("limit a {\n\t\tzone other\n\t}"), []string{"unrecognized limit a subdirective 'zone'"}},
		{"limit block with a handler-only flag", block("limit a {\n\t\tshadow\n\t}"), []string{"unrecognized limit a subdirective 'shadow'"}},
		{"limit block with a nested limit", block("limit a {\n\t\tlimit b 1 1\n\t}"), []string{"unrecognized limit a subdirective 'limit'"}},
		{"limit with one inline value", block("limit a 10"), []string{"limit a: want <replenish_rate> <burst_capacity> [<requested_tokens>], got 1 argument(s): '10'"}},
		{"limit with four inline values", block("limit a 1 2 1 4"), []string{"limit a:", "got 4 argument(s): '1 2 1 4'"}},
		{"limit subdirective given twice", block("limit a {\n\t\tkey {client_ip}\n\t\tkey {remote_host}\n\t}"), []string{"limit a: subdirective 'key' is given twice"}},
		{"limit inline rate plus replenish_rate", block("limit a 10 20 {\n\t\treplenish_rate 5\n\t}"), []string{"limit a: subdirective 'replenish_rate' is given twice"}},
		{"limit inline cost plus requested_tokens", block("limit a 10 20 2 {\n\t\trequested_tokens 1\n\t}"), []string{"limit a: subdirective 'requested_tokens' is given twice"}},
		{"limit key without value", block("limit a {\n\t\tkey\n\t}"), []string{"limit a key: wrong argument count"}},
		{"limit ipv6_prefix with two values", block("limit a {\n\t\tipv6_prefix 64 48\n\t}"), []string{"limit a ipv6_prefix: wrong argument count"}},

		// static values of a limit, alone (where they are written) and
		// judged together at the end of the directive (fixture:
		// limit_burst_below_rate)
		{"limit rate 0", block0("limit a 0 10"), []string{"replenish_rate '0'", "positive number"}},
		{"limit rate in its block not a number", block0("limit a {\n\t\treplenish_rate fast\n\t}"), []string{"replenish_rate 'fast'", "positive number"}},
		{"limit rate per zero duration", block0("limit a 10/0s 10"), []string{"replenish_rate '10/0s'", "duration after '/' must be positive"}},
		{"limit burst not whole", block0("limit a 10 2.5"), []string{"burst_capacity '2.5' is not a whole number"}},
		{"limit burst unlimited with a fixed rate", block0("limit a 10 unlimited"), []string{"limit a: burst_capacity 'unlimited' is not a whole number"}},
		{"limit requested not whole", block0("limit a 10 20 1.5"), []string{"requested_tokens '1.5' is not a whole number"}},
		{"limit requested unlimited", block0("limit a 10 20 unlimited"), []string{"requested_tokens 'unlimited' is not a whole number"}},
		{"limit requested_tokens 0 inline", block0("limit a 10 20 0"), []string{"requested_tokens '0' must be at least 1"}},
		{"limit requested_tokens 0 in its block", block0("limit a 10 20 {\n\t\trequested_tokens 0\n\t}"), []string{"requested_tokens '0' must be at least 1"}},
		{"limit requested_tokens negative", block0("limit a 1 2 -1"), []string{"limit a: requested_tokens '-1' must be at least 1"}},
		{"limit burst below the handler's rate", block("limit ok 1 1\n\tlimit a {\n\t\tburst_capacity 0\n\t}\n\tlimit b {\n\t\treplenish_rate 3\n\t}"),
			[]string{"limit b: burst_capacity '1' is smaller than replenish_rate '3'"}},
		{"limit requested above burst", block0("limit a 1 2 3"), []string{"limit a: requested_tokens '3' is more than burst_capacity '2'"}},
		{"limit requested above the handler's burst", "rate_limit 1 2 {\n\tlimit a {\n\t\trequested_tokens 3\n\t}\n}", []string{"limit a: requested_tokens '3' is more than burst_capacity '2'"}},
		{"limit handler's requested above the limit's burst", "rate_limit 1 5 5 {\n\tlimit a 1 2\n}", []string{"limit a: requested_tokens '5' is more than burst_capacity '2'"}},
		{"limit negative burst", block0("limit a 10 -1"), []string{"limit a: burst_capacity '-1' must not be negative"}},
		{"limit rate filling in more than a year", block0("limit a 1e-10 1000"), []string{"limit a: replenish_rate '1e-10'", "more than a year"}},
		{"limit burst above 2^53", block0("limit a 1e15 9007199254740993"), []string{"limit a: burst_capacity '9007199254740993'", "2^53"}},
		{"limit without any rate", block0("limit a"), []string{"limit a: replenish_rate is required"}},
		{"second limit without any rate", block0("limit a 1 1\n\tlimit b {\n\t\tburst_capacity 5\n\t}"), []string{"limit b: replenish_rate is required"}},
		// A fixed rate and a fixed burst are judged together even when
		// the cost comes from the request, and a fixed burst and cost
		// when the rate does.
		{"limit burst below rate beside a per-request cost", block0("limit a 10 5 {http.request.header.X-Cost}"),
			[]string{"limit a: burst_capacity '5' is smaller than replenish_rate '10'"}},
		{"limit requested above burst beside a per-request rate", block0("limit a {plan_rate} 2 3"),
			[]string{"limit a: requested_tokens '3' is more than burst_capacity '2'"}},
		{"handler burst below rate beside a per-request cost", "rate_limit 10 5 {http.request.header.X-Cost}",
			[]string{"burst_capacity '5' is smaller than replenish_rate '10'"}},
		{"handler requested above burst beside a per-request rate", "rate_limit {plan_rate} 2 3",
			[]string{"requested_tokens '3' is more than burst_capacity '2'"}},
		{"per-request burst beside a fixed rate 0", block0("limit a 0 {plan_burst}"), []string{"replenish_rate '0'", "positive number"}},
		{"per-request rate beside a negative burst", block0("limit a {plan_rate} -1"), []string{"limit a: burst_capacity '-1'", "0 to 2^53"}},

		// prefixes, of the handler and of a limit
		{"ipv4_prefix above 32", block("ipv4_prefix 33"), []string{"ipv4_prefix '33': want a prefix length from 0 to 32"}},
		{"ipv4_prefix negative", block("ipv4_prefix -1"), []string{"ipv4_prefix '-1'", "0 to 32"}},
		{"ipv4_prefix not a number", block("ipv4_prefix /24"), []string{"ipv4_prefix '/24'", "0 to 32"}},
		{"ipv6_prefix above 128", block("ipv6_prefix 129"), []string{"ipv6_prefix '129': want a prefix length from 0 to 128"}},
		{"ipv6_prefix negative", block("ipv6_prefix -64"), []string{"ipv6_prefix '-64'", "0 to 128"}},
		{"ipv6_prefix placeholder", block("ipv6_prefix {bits}"), []string{"ipv6_prefix '{bits}'", "0 to 128"}},
		{"ipv6_prefix without value", block("ipv6_prefix"), []string{"ipv6_prefix: wrong argument count"}},
		{"ipv4_prefix given twice", block("ipv4_prefix 24\n\tipv4_prefix 16"), []string{"subdirective 'ipv4_prefix' is given twice"}},
		{"limit ipv4_prefix above 32", block("limit a {\n\t\tipv4_prefix 64\n\t}"), []string{"ipv4_prefix '64': want a prefix length from 0 to 32"}},
		{"limit ipv6_prefix above 128", block("limit a {\n\t\tipv6_prefix 129\n\t}"), []string{"ipv6_prefix '129'", "0 to 128"}},
		{"limit ipv6_prefix fractional", block("limit a {\n\t\tipv6_prefix 56.5\n\t}"), []string{"ipv6_prefix '56.5'", "0 to 128"}},

		// key templates of a limit
		{"limit key unclosed", block("limit a {\n\t\tkey \"{http.request.host\"\n\t}"), []string{"key '{http.request.host'", "unclosed placeholder"}},
		{"limit key with a literal brace", block("limit a {\n\t\tkey \\{x\\}{client_ip}\n\t}"), []string{"key '\\{x\\}{client_ip}'", "literal brace"}},
		{"limit key empty", block("limit a {\n\t\tkey \"\"\n\t}"), []string{"key ''", "empty"}},
		{"limit key malformed placeholder", block("limit a {\n\t\tkey {}\n\t}"), []string{"key '{}'", "malformed placeholder"}},

		// lease
		{"lease without value", block("lease"), []string{"lease: want <max_tokens> [<hold>], got 0 argument(s)"}},
		{"lease with three values", block("lease 32 100ms 2"), []string{"lease: want <max_tokens> [<hold>], got 3 argument(s): '32 100ms 2'"}},
		{"lease zero", block("lease 0"), []string{"lease '0'", "1 or more"}},
		{"lease negative", block("lease -4"), []string{"lease '-4'", "1 or more"}},
		{"lease not a number", block("lease lots"), []string{"lease 'lots'", "1 or more"}},
		{"lease fractional", block("lease 1.5"), []string{"lease '1.5'"}},
		{"lease hold not a duration", block("lease 32 soon"), []string{"lease hold 'soon'", "duration"}},
		{"lease hold zero", block("lease 32 0s"), []string{"lease hold '0s'", "positive duration"}},
		{"lease hold above 1s", block("lease 32 2s"), []string{"lease hold '2s'", "at most 1s"}},
		{"lease hold just above 1s", block("lease 32 1001ms"), []string{"lease hold '1.001s'", "at most 1s"}},
		{"lease given twice", block("lease 32\n\tlease 16"), []string{"subdirective 'lease' is given twice"}},
		{"lease with store memory", block("store memory\n\tlease 32"), []string{"lease with store 'memory'"}},
		{"store memory after lease", block("lease 32\n\tstore memory"), []string{"lease with store 'memory'"}},
		{"lease in a limit", block("limit a {\n\t\tlease 32\n\t}"), []string{"unrecognized limit a subdirective 'lease'"}},

		// no rate at all (fixture: no_rate)
		{"bare directive", "rate_limit", []string{"replenish_rate is required"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseTestCaddyfile(tc.input)
			if err == nil {
				t.Fatalf("no error for\n%s", tc.input)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if !strings.Contains(err.Error(), "Testfile:") {
				t.Errorf("error %q does not give the Caddyfile position", err)
			}
		})
	}
}

func TestProvisionValidateRejectsJSONWithReason(t *testing.T) {
	for _, tc := range []struct {
		name string
		json string
		want []string
	}{
		{"missing replenish_rate with a burst", `{"burst_capacity": 5}`,
			[]string{"replenish_rate is required"}},
		{"negative replenish_rate", `{"replenish_rate": -1}`,
			[]string{"replenish_rate '-1'", "positive number of tokens per second"}},
		{"burst_capacity below replenish_rate", `{"replenish_rate": 10, "burst_capacity": 5}`,
			[]string{"burst_capacity '5' is smaller than replenish_rate '10'", "could never hold one second's refill", "at least 10"}},
		{"burst_capacity below fractional rate", `{"replenish_rate": 1.5, "burst_capacity": 1}`,
			[]string{"burst_capacity '1'", "replenish_rate '1.5'", "at least 2"}},
		{"negative burst_capacity", `{"replenish_rate": 10, "burst_capacity": -1}`,
			[]string{"burst_capacity '-1' must not be negative"}},
		{"requested_tokens above burst_capacity", `{"replenish_rate": 1, "burst_capacity": 2, "requested_tokens": 3}`,
			[]string{"requested_tokens '3' is more than burst_capacity '2'", "no request could ever be admitted"}},
		{"requested_tokens negative", `{"replenish_rate": 1, "burst_capacity": 2, "requested_tokens": -1}`,
			[]string{"requested_tokens '-1' must be at least 1"}},
		{"zone with a bar", `{"replenish_rate": 1, "zone": "a|b"}`,
			[]string{"zone 'a|b'", "letters, digits"}},
		{"key template unclosed", `{"replenish_rate": 1, "key": "{http.request.host"}`,
			[]string{"key '{http.request.host'", "unclosed placeholder"}},
		{"status_code out of range", `{"replenish_rate": 1, "status_code": 99}`,
			[]string{"status_code '99'", "200 to 599"}},
		{"empty_key_status out of range", `{"replenish_rate": 1, "empty_key_status": 600}`,
			[]string{"empty_key_status '600'", "200 to 599"}},
		{"unknown on_error", `{"replenish_rate": 1, "on_error": "ignore"}`,
			[]string{"on_error 'ignore'", "want 'allow', 'deny' or 'local'"}},
		{"unknown store", `{"replenish_rate": 1, "store": "bogus"}`,
			[]string{"store 'bogus'", "want 'redis' or 'memory'"}},
		{"max_keys negative", `{"replenish_rate": 1, "on_error": "local", "max_keys": -3}`,
			[]string{"max_keys '-3'", "1 or more"}},
		{"lease without max_tokens", `{"replenish_rate": 1, "lease": {}}`,
			[]string{"lease '0'", "1 or more"}},
		{"lease max_tokens negative", `{"replenish_rate": 1, "lease": {"max_tokens": -2}}`,
			[]string{"lease '-2'", "1 or more"}},
		{"lease hold above 1s", `{"replenish_rate": 1, "lease": {"max_tokens": 32, "hold": "1500ms"}}`,
			[]string{"lease hold '1.5s'", "at most 1s"}},
		{"lease hold negative", `{"replenish_rate": 1, "lease": {"max_tokens": 32, "hold": "-100ms"}}`,
			[]string{"lease hold '-100ms'"}},
		{"unknown headers", `{"replenish_rate": 1, "headers": "all"}`,
			[]string{"headers 'all'", "spring, ietf, both or none"}},
		{"tls cert without key", `{"replenish_rate": 1, "redis": {"tls": {"cert": "/c.pem"}}}`,
			[]string{"'cert' and 'key' go together", "cert '/c.pem'"}},
		{"db with cluster", `{"replenish_rate": 1, "redis": {"cluster": true, "db": 1}}`,
			[]string{"'db 1'", "Redis Cluster"}},
		{"db with several addresses", `{"replenish_rate": 1, "redis": {"addresses": ["h1:6379", "h2:6379"], "db": 2}}`,
			[]string{"'db 2'", "Redis Cluster"}},
		{"master_name with cluster", `{"replenish_rate": 1, "redis": {"cluster": true, "master_name": "mymaster"}}`,
			[]string{"'master_name mymaster'", "'cluster'", "exclude each other"}},

		// policies: limits, prefixes and per-request values. A limit's
		// mistake names the limit ("limit a: ..."), as in the Caddyfile:
		// with several limits, the value alone does not say which.
		{"duplicate limit names", `{"limits": [{"name": "a", "replenish_rate": 1}, {"name": "a", "replenish_rate": 2, "burst_capacity": 2}]}`,
			[]string{"limit 'a' is given twice", "unique"}},
		{"limit without a name", `{"limits": [{"replenish_rate": 1}]}`,
			[]string{"limit name ''", "letters, digits"}},
		{"limit name with a dot", `{"limits": [{"name": "a.b", "replenish_rate": 1}]}`,
			[]string{"limit name 'a.b'", "letters, digits, '-' and '_'"}},
		{"limit name with a brace", `{"limits": [{"name": "a}", "replenish_rate": 1}]}`,
			[]string{"limit name 'a}'"}},
		// In JSON a rate of 0 is unset, as it always was (the Caddyfile
		// refuses `0` where it is written).
		{"limit rate 0", `{"limits": [{"name": "a", "replenish_rate": 0, "burst_capacity": 10}]}`,
			[]string{"limit a", "replenish_rate is required"}},
		{"limit rate not a number", `{"limits": [{"name": "a", "replenish_rate": "fast"}]}`,
			[]string{"limit a", "replenish_rate 'fast'", "positive number"}},
		{"limit burst below rate", `{"limits": [{"name": "ok", "replenish_rate": 1}, {"name": "a", "replenish_rate": 10, "burst_capacity": 5}]}`,
			[]string{"limit a", "burst_capacity '5' is smaller than replenish_rate '10'", "at least 10"}},
		{"limit burst below the handler's rate", `{"replenish_rate": 10, "limits": [{"name": "a", "burst_capacity": 5}]}`,
			[]string{"limit a", "burst_capacity '5' is smaller than replenish_rate '10'"}},
		{"limit burst not whole", `{"limits": [{"name": "a", "replenish_rate": 1, "burst_capacity": 2.5}]}`,
			[]string{"limit a", "burst_capacity '2.5' is not a whole number"}},
		{"limit requested above burst", `{"limits": [{"name": "a", "replenish_rate": 1, "burst_capacity": 2, "requested_tokens": 3}]}`,
			[]string{"limit a", "requested_tokens '3' is more than burst_capacity '2'"}},
		{"limit requested negative", `{"limits": [{"name": "a", "replenish_rate": 1, "burst_capacity": 2, "requested_tokens": -1}]}`,
			[]string{"limit a", "requested_tokens '-1' must be at least 1"}},
		{"limit requested 0 as a string", `{"limits": [{"name": "a", "replenish_rate": 1, "burst_capacity": 2, "requested_tokens": "zero"}]}`,
			[]string{"limit a", "requested_tokens 'zero' is not a whole number"}},
		{"limit rate filling in more than a year", `{"limits": [{"name": "a", "replenish_rate": 1e-10, "burst_capacity": 1000}]}`,
			[]string{"limit a", "replenish_rate '1e-10'", "more than a year"}},
		{"limit without any rate", `{"limits": [{"name": "a", "burst_capacity": 5}]}`,
			[]string{"limit a", "replenish_rate is required"}},
		{"limit burst below rate beside a per-request cost", `{"limits": [{"name": "a", "replenish_rate": 10, "burst_capacity": 5, "requested_tokens": "{http.request.header.X-Cost}"}]}`,
			[]string{"limit a", "burst_capacity '5' is smaller than replenish_rate '10'"}},
		{"limit per-request rate beside a negative burst", `{"limits": [{"name": "a", "replenish_rate": "{plan_rate}", "burst_capacity": -1}]}`,
			[]string{"limit a", "burst_capacity '-1'", "0 to 2^53"}},
		{"limit per-request burst beside a bad rate", `{"limits": [{"name": "a", "replenish_rate": "10/0s", "burst_capacity": "{plan_burst}"}]}`,
			[]string{"limit a", "replenish_rate '10/0s'", "duration after '/' must be positive"}},
		{"limit key unclosed", `{"limits": [{"name": "a", "replenish_rate": 1, "key": "{http.request.host"}]}`,
			[]string{"limit a", "key '{http.request.host'", "unclosed placeholder"}},
		{"limit key with a literal brace", `{"limits": [{"name": "a", "replenish_rate": 1, "key": "\\{x\\}{client_ip}"}]}`,
			[]string{"limit a", "literal brace"}},
		{"handler rate not a number beside limits that set their own", `{"replenish_rate": "fast", "limits": [{"name": "a", "replenish_rate": 1}]}`,
			[]string{"replenish_rate 'fast'", "positive number"}},
		{"handler burst negative beside limits that set their own", `{"burst_capacity": -5, "limits": [{"name": "a", "replenish_rate": 1, "burst_capacity": 1}]}`,
			[]string{"burst_capacity '-5'"}},
		{"ipv4_prefix above 32", `{"replenish_rate": 1, "ipv4_prefix": 33}`,
			[]string{"ipv4_prefix '33': want a prefix length from 0 to 32"}},
		{"ipv4_prefix negative", `{"replenish_rate": 1, "ipv4_prefix": -1}`,
			[]string{"ipv4_prefix '-1'", "0 to 32"}},
		{"ipv6_prefix above 128", `{"replenish_rate": 1, "ipv6_prefix": 129}`,
			[]string{"ipv6_prefix '129': want a prefix length from 0 to 128"}},
		{"ipv6_prefix negative", `{"replenish_rate": 1, "ipv6_prefix": -1}`,
			[]string{"ipv6_prefix '-1'", "0 to 128"}},
		{"handler prefix out of range beside limits", `{"ipv6_prefix": 200, "limits": [{"name": "a", "replenish_rate": 1}]}`,
			[]string{"ipv6_prefix '200'", "0 to 128"}},
		{"limit ipv4_prefix above 32", `{"limits": [{"name": "a", "replenish_rate": 1, "ipv4_prefix": 40}]}`,
			[]string{"limit a", "ipv4_prefix '40'", "0 to 32"}},
		{"limit ipv6_prefix above 128", `{"limits": [{"name": "a", "replenish_rate": 1, "ipv6_prefix": 129}]}`,
			[]string{"limit a", "ipv6_prefix '129'", "0 to 128"}},
		{"limit ipv6_prefix negative", `{"limits": [{"name": "a", "replenish_rate": 1, "ipv6_prefix": -8}]}`,
			[]string{"limit a", "ipv6_prefix '-8'", "0 to 128"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := new(Handler)
			if err := json.Unmarshal([]byte(tc.json), h); err != nil {
				t.Fatalf("json: %v", err)
			}
			err := tryProvision(t, offline(h))
			if err == nil {
				t.Fatalf("no error for %s", tc.json)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

// TestLimitsJSONLoadsStrictly loads limits as Caddy loads a module's
// JSON: unknown fields and values of the wrong type are refused before
// provisioning.
func TestLimitsJSONLoadsStrictly(t *testing.T) {
	for _, tc := range []struct {
		name, json string
		want       []string
	}{
		{"unknown field in a limit", `{"limits": [{"name": "a", "replenish_rate": 1, "zone": "x"}]}`, []string{"unknown field", "zone"}},
		{"burst neither number nor string", `{"limits": [{"name": "a", "replenish_rate": 1, "burst_capacity": true}]}`, []string{"want a number or a string, got true"}},
		{"rate an object", `{"replenish_rate": {"per": "1m"}}`, []string{"want a number or a string"}},
		{"prefix as a string", `{"replenish_rate": 1, "ipv6_prefix": "64"}`, []string{"ipv6_prefix"}},
		{"limits not an array", `{"limits": {"name": "a"}}`, []string{"limits"}},
		{"lease hold not a duration", `{"replenish_rate": 1, "lease": {"max_tokens": 32, "hold": "soon"}}`, []string{"soon"}},
		{"unknown field in lease", `{"replenish_rate": 1, "lease": {"max_tokens": 32, "size": 2}}`, []string{"unknown field", "size"}},
		{"lease max_tokens a string", `{"replenish_rate": 1, "lease": {"max_tokens": "32"}}`, []string{"max_tokens"}},
		{"lease a number", `{"replenish_rate": 1, "lease": 32}`, []string{"lease"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := caddy.StrictUnmarshalJSON([]byte(tc.json), new(Handler))
			if err == nil {
				t.Fatalf("%s loaded", tc.json)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

// TestLimitsJSONAccepted provisions JSON policies that are right,
// including what only JSON can say (0 for the default cost, numbers as
// strings).
func TestLimitsJSONAccepted(t *testing.T) {
	for _, tc := range []struct {
		name, json string
		check      func(t *testing.T, h *Handler)
	}{
		{"requested_tokens 0 in a limit is the default", `{"limits": [{"name": "a", "replenish_rate": 1, "burst_capacity": 2, "requested_tokens": 0}]}`,
			func(t *testing.T, h *Handler) {
				if v := h.limits[0].Values; v.Requested != 1 {
					t.Errorf("requested %d, want 1", v.Requested)
				}
			}},
		{"requested_tokens 0 in a limit is the handler's", `{"requested_tokens": 2, "limits": [{"name": "a", "replenish_rate": 1, "burst_capacity": 4, "requested_tokens": 0}]}`,
			func(t *testing.T, h *Handler) {
				if v := h.limits[0].Values; v.Requested != 2 {
					t.Errorf("requested %d, want the handler's 2", v.Requested)
				}
			}},
		{"numbers in strings", `{"limits": [{"name": "a", "replenish_rate": "100/1m", "burst_capacity": "100", "requested_tokens": "2"}]}`,
			func(t *testing.T, h *Handler) {
				if v := h.limits[0].Values; v.Rate != 100.0/60 || v.Burst != 100 || v.Requested != 2 {
					t.Errorf("values %+v", v)
				}
			}},
		{"placeholders", `{"replenish_rate": "{plan_rate}", "burst_capacity": "{plan_burst}", "requested_tokens": "{http.request.header.X-Cost}"}`, nil},
		{"prefixes at their bounds", `{"replenish_rate": 1, "ipv4_prefix": 0, "ipv6_prefix": 128,
			"limits": [{"name": "a", "ipv4_prefix": 32, "ipv6_prefix": 0}, {"name": "b"}]}`,
			func(t *testing.T, h *Handler) {
				for i, want := range [][2]int{{32, 0}, {0, 128}} {
					if got := [2]int{h.limits[i].Template.IPv4Bits, h.limits[i].Template.IPv6Bits}; got != want {
						t.Errorf("limit %s: bits %v, want %v", h.limits[i].Name, got, want)
					}
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := new(Handler)
			if err := caddy.StrictUnmarshalJSON([]byte(tc.json), h); err != nil {
				t.Fatalf("json: %v", err)
			}
			if err := tryProvision(t, offline(h)); err != nil {
				t.Fatalf("refused: %v", err)
			}
			if tc.check != nil {
				tc.check(t, h)
			}
		})
	}
}

func TestProvisionValidateAcceptsBurstZeroWithoutRedis(t *testing.T) {
	// Redis at an address nothing listens on: a hard block never asks it.
	h, err := parseTestCaddyfile("rate_limit {\n\tburst_capacity 0\n\tredis 127.0.0.1:1\n}")
	if err != nil {
		t.Fatalf("parse: %v", err)
	}
	if err := tryProvision(t, h); err != nil {
		t.Fatalf("burst_capacity 0 without a rate: %v", err)
	}
	if h.limiter != nil {
		t.Error("burst_capacity 0 set up a Redis client; it never needs one")
	}
}

func TestProvisionValidateAcceptsAndDefaults(t *testing.T) {
	for _, tc := range []struct {
		name  string
		input string
		check func(t *testing.T, h *Handler)
	}{
		{"burst defaults to the rate rounded up", "rate_limit {\n\treplenish_rate 2.5\n}", func(t *testing.T, h *Handler) {
			if v := h.limits[0].Values; v.Burst != 3 || v.Requested != 1 {
				t.Errorf("burst %d, requested %d; want 3, 1", v.Burst, v.Requested)
			}
		}},
		{"defaults", "rate_limit 10 20", func(t *testing.T, h *Handler) {
			if h.Key != "{http.vars.client_ip}" || h.StatusCode != 429 || h.EmptyKeyStatus != 403 ||
				h.OnError != "allow" || !h.denyEmpty || !h.failOpen || !strings.HasPrefix(h.Zone, "auto-") {
				t.Errorf("defaults not applied: %+v", h)
			}
		}},
		{"burst equal to rate", "rate_limit 100/1m 2", nil},
		{"full redis block", `rate_limit {
			zone api
			key {http.request.header.X-API-Key}
			replenish_rate 10
			burst_capacity 20
			requested_tokens 1
			redis {
				address 127.0.0.1:6379
				username app
				password secret
				db 1
				key_prefix rl:
				timeout 250ms
				dial_timeout 1s
				pool_size 5
			}
		}`, func(t *testing.T, h *Handler) {
			if h.limiter == nil || !strings.HasPrefix(h.limits[0].KeyPrefix, "rl:api|") || h.limits[0].KeyPrefix != keys.BucketPrefix("rl:", "api", h.Key) {
				t.Errorf("limiter %v, bucket prefix %q", h.limiter, h.limits[0].KeyPrefix)
			}
		}},
		{"sentinel", "rate_limit 1 1 {\n\tredis h1:26379 h2:26379 {\n\t\tmaster_name mymaster\n\t\tdb 1\n\t}\n}", nil},
		{"zone with every allowed character", "rate_limit 1 1 {\n\tzone Az09_.:-\n}", nil},
		{"prefixes: a limit's own, else the handler's, else 32 and 64", `rate_limit 10 20 {
			ipv4_prefix 24
			limit own {
				ipv4_prefix 16
				ipv6_prefix 56
			}
			limit inherited
		}`, func(t *testing.T, h *Handler) {
			for i, want := range [][2]int{{16, 56}, {24, 64}} {
				if got := [2]int{h.limits[i].Template.IPv4Bits, h.limits[i].Template.IPv6Bits}; got != want {
					t.Errorf("limit %s: ipv4/ipv6 bits %v, want %v", h.limits[i].Name, got, want)
				}
			}
		}},
		{"default prefixes without limits", "rate_limit 10 20", func(t *testing.T, h *Handler) {
			if b := h.limits[0].Template; b.IPv4Bits != 32 || b.IPv6Bits != 64 {
				t.Errorf("ipv4/ipv6 bits %d/%d, want 32/64", b.IPv4Bits, b.IPv6Bits)
			}
		}},
		{"handler prefixes without limits", "rate_limit 10 20 {\n\tipv4_prefix 0\n\tipv6_prefix 128\n}", func(t *testing.T, h *Handler) {
			if b := h.limits[0].Template; b.IPv4Bits != 0 || b.IPv6Bits != 128 {
				t.Errorf("ipv4/ipv6 bits %d/%d, want 0/128", b.IPv4Bits, b.IPv6Bits)
			}
		}},
		{"limits of fixed and per-request values", `rate_limit {
			key {http.request.header.X-API-Key}
			limit second 10 20
			limit hour 1000/1h 1000
			limit plan {plan_rate} {plan_burst} {http.request.header.X-Cost}
			limit off {
				replenish_rate unlimited
			}
		}`, func(t *testing.T, h *Handler) {
			if len(h.limits) != 4 {
				t.Fatalf("%d limits, want 4", len(h.limits))
			}
			if l := h.limits[1]; !l.Fixed || l.Values.Burst != 1000 || l.Values.Rate != 1000.0/3600 {
				t.Errorf("hour: fixed %v, values %+v", l.Fixed, l.Values)
			}
			if l := h.limits[2]; l.Fixed {
				t.Errorf("plan: fixed, want per request")
			}
			if l := h.limits[3]; !l.Fixed || !l.Exempt {
				t.Errorf("off: fixed %v exempt %v, want an exempt fixed limit", l.Fixed, l.Exempt)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := parseTestCaddyfile(tc.input)
			if err != nil {
				t.Fatalf("parse: %v", err)
			}
			if err := tryProvision(t, offline(h)); err != nil {
				t.Fatalf("rejected: %v", err)
			}
			if tc.check != nil {
				tc.check(t, h)
			}
		})
	}
}

// adaptCaddyfile adapts a whole Caddyfile to indented JSON, failing on
// warnings (such as an unformatted Caddyfile).
func adaptCaddyfile(t *testing.T, filename string, body []byte) ([]byte, error) {
	t.Helper()
	out, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt(body, map[string]any{"filename": filename})
	if err != nil {
		return nil, err
	}
	for _, w := range warnings {
		t.Errorf("adapter warning: %s", w.String())
	}
	return normalizeJSON(t, out), nil
}

func normalizeJSON(t *testing.T, raw []byte) []byte {
	t.Helper()
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatalf("invalid JSON: %v\n%s", err, raw)
	}
	out, err := json.MarshalIndent(v, "", "\t")
	if err != nil {
		t.Fatal(err)
	}
	return append(out, '\n')
}

// provisionAdaptedHandlers loads every rate_limit handler in the adapted
// JSON strictly, as Caddy would, then provisions and validates it, with
// its Redis pointed at deadRedis (offline): the -short tier talks to no
// Redis. Handlers that read TLS files are only loaded.
func provisionAdaptedHandlers(t *testing.T, adapted []byte) int {
	t.Helper()
	var cfg any
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	var found []map[string]any
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == "rate_limit" {
				found = append(found, v)
			}
			for _, e := range v {
				walk(e)
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		}
	}
	walk(cfg)
	for _, m := range found {
		delete(m, "handler")
		raw, _ := json.Marshal(m)
		h := new(Handler)
		if err := caddy.StrictUnmarshalJSON(raw, h); err != nil {
			t.Errorf("loading %s: %v", raw, err)
			continue
		}
		if r := h.Redis; r != nil && r.TLS != nil && r.TLS.CA+r.TLS.Cert+r.TLS.Key != "" {
			t.Logf("not provisioning %s: it reads TLS files", raw)
			continue
		}
		if err := tryProvision(t, offline(h)); err != nil {
			t.Errorf("provisioning %s: %v", raw, err)
		}
	}
	return len(found)
}

// adaptFixture is one testdata/adapt/<case>.caddyfiletest, in the format
// of Caddy's own (caddytest/integration/caddyfile_adapt in the caddy
// module): a Caddyfile, a line of ----------, then the JSON it adapts to,
// or, for a Caddyfile the adapter refuses, the error message (what does
// not start with '{'), which the error must contain.
type adaptFixture struct {
	path      string
	caddyfile []byte
	want      string // what follows the separator, trimmed
}

const adaptSeparator = "----------\n"

func readAdaptFixture(t *testing.T, path string) adaptFixture {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	caddyfile, want, ok := strings.Cut(string(raw), "\n"+adaptSeparator)
	if !ok {
		t.Fatalf("%s: no line %q after the Caddyfile", path, strings.TrimSpace(adaptSeparator))
	}
	return adaptFixture{path: path, caddyfile: []byte(caddyfile + "\n"), want: strings.TrimSpace(want)}
}

func (f adaptFixture) wantsError() bool { return f.want != "" && !strings.HasPrefix(f.want, "{") }

// rewrite replaces what follows the separator (for -update).
func (f *adaptFixture) rewrite(t *testing.T, want string) {
	t.Helper()
	f.want = strings.TrimSpace(want)
	out := string(f.caddyfile) + adaptSeparator + f.want + "\n"
	if err := os.WriteFile(f.path, []byte(out), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestAdaptCaddyfileMatchesTestdata adapts every fixture of testdata/adapt
// (see adaptFixture) and provisions the handlers of those that adapt.
// With -update it rewrites what follows the separator: the JSON, or the
// whole error message; a new error case needs a line of any text there
// to be one. The fixtures of errors are whole Caddyfiles (matchers,
// snippets, nested blocks, line numbers) and a few representative
// mistakes; the many small per-subdirective cases are the table of
// TestUnmarshalCaddyfileErrorsNameSubdirectiveAndValue, and a case lives
// in one place only.
func TestAdaptCaddyfileMatchesTestdata(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "adapt", "*.caddyfiletest"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata/adapt/*.caddyfiletest: %v", err)
	}
	for _, file := range files {
		t.Run(strings.TrimSuffix(filepath.Base(file), ".caddyfiletest"), func(t *testing.T) {
			f := readAdaptFixture(t, file)
			got, err := adaptCaddyfile(t, file, f.caddyfile)
			if f.wantsError() {
				if err == nil {
					t.Fatalf("no error; want one containing %q", f.want)
				}
				if *update {
					f.rewrite(t, err.Error())
				}
				if !strings.Contains(err.Error(), f.want) {
					t.Errorf("error %q does not contain %q", err, f.want)
				}
				if !strings.Contains(err.Error(), file+":") {
					t.Errorf("error %q does not name the file %s", err, file)
				}
				return
			}
			if err != nil {
				t.Fatalf("adapting: %v", err)
			}
			if *update {
				f.rewrite(t, string(got))
			}
			if want := normalizeJSON(t, []byte(f.want)); !bytes.Equal(got, want) {
				t.Errorf("adapted JSON differs from %s (go test -run TestAdaptCaddyfileMatchesTestdata -update rewrites it):\n%s", file, got)
			}
			if provisionAdaptedHandlers(t, got) == 0 {
				t.Error("no rate_limit handler in the adapted config")
			}
		})
	}
}

func TestAdaptCaddyfileOrdersRateLimitBeforeBasicAuth(t *testing.T) {
	f := readAdaptFixture(t, filepath.Join("testdata", "adapt", "with_basic_auth.caddyfiletest"))
	if !bytes.Contains(f.caddyfile, []byte("basic_auth")) || !bytes.Contains(f.caddyfile, []byte("rate_limit")) {
		t.Fatalf("%s lost its basic_auth or rate_limit:\n%s", f.path, f.caddyfile)
	}
	out, err := adaptCaddyfile(t, f.path, f.caddyfile)
	if err != nil {
		t.Fatal(err)
	}
	rl := bytes.Index(out, []byte(`"handler": "rate_limit"`))
	auth := bytes.Index(out, []byte(`"handler": "authentication"`))
	if rl < 0 || auth < 0 || rl > auth {
		t.Errorf("rate_limit (at %d) is not before authentication (at %d):\n%s", rl, auth, out)
	}
}

func TestAdaptCaddyfileExample(t *testing.T) {
	body, err := os.ReadFile("Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	out, err := adaptCaddyfile(t, "Caddyfile.example", body)
	if err != nil {
		t.Fatalf("adapting Caddyfile.example: %v", err)
	}
	if n := provisionAdaptedHandlers(t, out); n != 1 {
		t.Errorf("Caddyfile.example has %d rate_limit handlers; want 1", n)
	}
}

func TestLimitsThatCannotWorkRefusedAtLoad(t *testing.T) {
	for _, c := range []struct {
		name, caddyfile, json string
		want                  []string
	}{
		{"rate filling in more than a year", "rate_limit 1e-10 1000", `{"redis": {"addresses": ["127.0.0.1:1"]}, "replenish_rate": 1e-10, "burst_capacity": 1000}`,
			[]string{"replenish_rate '1e-10'", "more than a year", "at least"}},
		{"rate of 1e-300", "rate_limit 1e-300 1", `{"redis": {"addresses": ["127.0.0.1:1"]}, "replenish_rate": 1e-300, "burst_capacity": 1}`,
			[]string{"replenish_rate '1e-300'", "more than a year"}},
		{"burst above 2^53", "rate_limit 1e15 9007199254740993", `{"redis": {"addresses": ["127.0.0.1:1"]}, "replenish_rate": 1e15, "burst_capacity": 9007199254740993}`,
			[]string{"burst_capacity '9007199254740993'", "2^53"}},
		{"requested above burst above 2^53", "rate_limit 1 2 9007199254740993", `{"redis": {"addresses": ["127.0.0.1:1"]}, "replenish_rate": 1, "burst_capacity": 2, "requested_tokens": 9007199254740993}`,
			[]string{"requested_tokens '9007199254740993' is more than burst_capacity '2'"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseTestCaddyfile(c.caddyfile)
			if err == nil {
				t.Fatalf("Caddyfile %q accepted", c.caddyfile)
			}
			h := new(Handler)
			if jerr := json.Unmarshal([]byte(c.json), h); jerr != nil {
				t.Fatal(jerr)
			}
			jsonErr := tryProvision(t, h)
			if jsonErr == nil {
				t.Fatalf("JSON %s accepted", c.json)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) || !strings.Contains(jsonErr.Error(), w) {
					t.Errorf("errors %q (Caddyfile) and %q (JSON) must both contain %q", err, jsonErr, w)
				}
			}
		})
	}
	// requested_tokens 0 written out is a mistake; absent, or 0 in JSON,
	// is the default.
	if _, err := parseTestCaddyfile("rate_limit 1 2 0"); err == nil || !strings.Contains(err.Error(), "requested_tokens '0' must be at least 1") {
		t.Errorf("inline requested_tokens 0: %v", err)
	}
	if _, err := parseTestCaddyfile("rate_limit 1 2 {\n\trequested_tokens 0\n}"); err == nil || !strings.Contains(err.Error(), "Testfile:2") {
		t.Errorf("requested_tokens 0: %v, want refused at line 2", err)
	}
	if err := tryProvision(t, &Handler{ReplenishRate: "1", BurstCapacity: "2", Redis: &RedisConfig{Addresses: []string{"127.0.0.1:1"}}}); err != nil {
		t.Errorf("JSON without requested_tokens: %v", err)
	}
	// The bounds themselves are accepted.
	for _, ok := range []string{"rate_limit 1000/8760h 1000", "rate_limit 1e9 9007199254740992"} {
		if _, err := parseTestCaddyfile(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
}
