package ratelimit

import (
	"context"
	"fmt"
	"testing"

	"github.com/caddy-redis/ratelimit/internal/redistest"
)

func TestRedisPasswordWithBracesTakenLiterally(t *testing.T) {
	srv := redistest.Start(t)
	if err := srv.Client(t).ConfigSet(context.Background(), "requirepass", "ab{cd}efx").Err(); err != nil {
		t.Fatal(err)
	}
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 0.01 2 {\n\tzone braces\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\tpassword \"ab{cd}ef{env.NOT_SET_ANYWHERE}x\"\n\t\ttimeout 1s\n\t}\n}", srv.Addr))
	if got := h.Redis.withPlaceholders().Password; got != "ab{cd}efx" {
		// A known placeholder ({env.*}) is replaced, unknown braces stay.
		t.Fatalf("password resolved to %q, want %q", got, "ab{cd}efx")
	}
	expectBurstThenDeny(t, h, "k", 2)
}

func TestRedisSettingsReplaceOnlyKnownPlaceholders(t *testing.T) {
	t.Setenv("RL_TEST_SECRET", "s3cret")
	c := (&RedisConfig{
		Addresses: []string{"{env.RL_TEST_ADDR_UNSET}127.0.0.1:6380"},
		Password:  "{env.RL_TEST_SECRET}{literal}",
		Username:  "user{1}",
		KeyPrefix: "{app}:",
	}).withPlaceholders()
	for _, f := range []struct{ name, got, want string }{
		{"address", c.Addresses[0], "127.0.0.1:6380"},
		{"password", c.Password, "s3cret{literal}"},
		{"username", c.Username, "user{1}"},
		{"key_prefix", c.KeyPrefix, "{app}:"},
	} {
		if f.got != f.want {
			t.Errorf("%s: %q, want %q", f.name, f.got, f.want)
		}
	}
}

func TestTLSWithoutServerNameChecksEachNodeByItsOwnName(t *testing.T) {
	for _, c := range []struct {
		name   string
		config RedisConfig
		want   string
	}{
		{"cluster of rediss:// seeds", RedisConfig{Addresses: []string{"rediss://node-a:7000", "rediss://node-b:7000"}}, ""},
		{"sentinels with a tls block", RedisConfig{Addresses: []string{"rediss://s1:26379", "s2:26379"}, MasterName: "m", TLS: &RedisTLS{}}, ""},
		{"server_name set", RedisConfig{Addresses: []string{"rediss://node-a:7000", "rediss://node-b:7000"}, TLS: &RedisTLS{ServerName: "redis.internal"}}, "redis.internal"},
	} {
		opts, err := c.config.withPlaceholders().options(tlsFiles{})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		// Go's TLS client checks the dialed host when ServerName is empty.
		if opts.TLSConfig == nil || opts.TLSConfig.ServerName != c.want {
			t.Errorf("%s: TLS config %+v, want ServerName %q", c.name, opts.TLSConfig, c.want)
		}
	}
}
