package ratelimit

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// forceReload loads a Caddyfile into the running Caddy even when it is
// unchanged, as `caddy reload --force` does.
func forceReload(t *testing.T, caddyfile string) {
	t.Helper()
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		t.Fatalf("adapting: %v", err)
	}
	req, _ := http.NewRequest(http.MethodPost, "http://localhost:2999/load", bytes.NewReader(cfg))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Cache-Control", "must-revalidate")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("reload: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("reload: status %d", resp.StatusCode)
	}
}

func TestRotatedRedisCertificatesTakeEffectOnReload(t *testing.T) {
	mtls := redistest.StartTLS(t, true) // demands client certificates
	// caddytest rewrites paths ending in .crt and .key in a config; links
	// named otherwise lead to the same files.
	dir := t.TempDir()
	var files []string
	for i, target := range []string{mtls.CAFile, mtls.ClientCertFile, mtls.ClientKeyFile} {
		link := filepath.Join(dir, fmt.Sprintf("file%d.pem", i))
		if err := os.Symlink(target, link); err != nil {
			t.Fatal(err)
		}
		files = append(files, link)
	}
	config := caddyGlobals + fmt.Sprintf(`
http://localhost:9080 {
	rate_limit 0.01 3 {
		zone rotation
		key {http.request.header.X-Key}
		redis %s {
			timeout 1s
			tls {
				ca   %s
				cert %s
				key  %s
			}
		}
	}
	respond "ok"
}`, mtls.Addr, files[0], files[1], files[2])
	tester := loadCaddyfile(t, nil, config)
	if resp, _ := get(t, tester, "/", "before"); resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "2" {
		t.Fatalf("before the rotation: %d remaining %q, want 200 with 2", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
	}

	// A new CA and new pairs in the same files; Redis restarts on them,
	// and the client that read the old files can no longer connect.
	mtls.Rotate(t)
	if resp, _ := get(t, tester, "/", "rotated"); resp.Header.Get("X-RateLimit-Remaining") != "-1" {
		t.Fatalf("after the rotation, before the reload: remaining %q, want -1 (the old certificates fail)",
			resp.Header.Get("X-RateLimit-Remaining"))
	}

	forceReload(t, config)
	for i, want := range []string{"2", "1", "0"} {
		resp, _ := get(t, tester, "/", "reloaded")
		if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != want {
			t.Fatalf("after the reload, request %d: %d remaining %q, want 200 with %s (limited through the new certificates)",
				i+1, resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"), want)
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
