package ratelimit

// Client addresses in key templates cut to ipv4_prefix / ipv6_prefix
// bits, as a handler sets them, and through a real Caddy behind a
// trusted proxy, over IPv6 loopback, and with two limits of different
// prefixes. The key template's own unit tests are in internal/keys.

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/keys"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
)

// bucketKeys provisions a rate_limit directive offline and returns the
// Redis key of each bucket a request from remoteIP resolves to, as
// ServeHTTP would send them.
func bucketKeys(t *testing.T, h *Handler, remoteIP string) []string {
	t.Helper()
	r, _ := newRequest(remoteIP, "")
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	buckets, _, err := h.resolveBuckets(r, repl, nil)
	if err != nil {
		t.Fatalf("resolving the buckets of %s: %v", remoteIP, err)
	}
	var keys []string
	for _, b := range buckets {
		keys = append(keys, b.Key)
	}
	return keys
}

// TestPrefixesOfEachLimitInItsKeys follows the prefixes from the
// Caddyfile to the Redis keys, without Redis: each limit cuts the
// addresses of its own template with its own prefixes, or the handler's.
func TestPrefixesOfEachLimitInItsKeys(t *testing.T) {
	h, err := parseTestCaddyfile(`rate_limit 10 20 {
		zone nets
		ipv4_prefix 24
		limit per64 {
			ipv6_prefix 64
		}
		limit per48 {
			ipv6_prefix 48
		}
		limit exact {
			ipv4_prefix 32
			ipv6_prefix 128
		}
	}`)
	if err != nil {
		t.Fatal(err)
	}
	provision(t, offline(h))
	prefix := keys.BucketPrefix(defaultKeyPrefix, "nets", "{http.vars.client_ip}")
	named := func(client, name string) string {
		return prefix[:len(defaultKeyPrefix)] + "{" + prefix[len(defaultKeyPrefix):] + client + "}" + keys.Separator + name
	}
	for _, tc := range []struct {
		ip   string
		want []string
	}{
		{"2001:db8:1:2::7", []string{named("2001:db8:1:2::/64", "per64"), named("2001:db8:1::/48", "per48"), named("2001:db8:1:2::7", "exact")}},
		{"192.0.2.7", []string{named("192.0.2.0/24", "per64"), named("192.0.2.0/24", "per48"), named("192.0.2.7", "exact")}},
		{"::ffff:192.0.2.7", []string{named("192.0.2.0/24", "per64"), named("192.0.2.0/24", "per48"), named("192.0.2.7", "exact")}},
	} {
		if got := bucketKeys(t, h, tc.ip); !slices.Equal(got, tc.want) {
			t.Errorf("%s: keys\n%q\nwant\n%q", tc.ip, got, tc.want)
		}
	}

	// Without limits: the handler's own prefixes, one key.
	single := caddyfileHandler(t, "rate_limit 10 20 {\n\tzone one\n\tipv6_prefix 56\n\tredis "+deadRedis+"\n}")
	want := keys.BucketPrefix(defaultKeyPrefix, "one", "{http.vars.client_ip}") + "2001:db8:1:200::/56"
	if got := bucketKeys(t, single, "2001:db8:1:2ff::7"); !slices.Equal(got, []string{want}) {
		t.Errorf("without limits: keys %q, want %q", got, want)
	}
}

// ---- Through a real Caddy

// trustingGlobals is caddyGlobals with every private range, loopback
// included, as trusted proxies: {client_ip} is then the first address
// in X-Forwarded-For.
var trustingGlobals = strings.TrimSuffix(strings.TrimSpace(caddyGlobals), "}") +
	"\tservers {\n\t\ttrusted_proxies static private_ranges\n\t}\n}\n"

// getVia sends GET url with X-Forwarded-For: forwardedFor (none when
// empty) and returns the response with its body read.
func getVia(t *testing.T, client *http.Client, url, forwardedFor string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if forwardedFor != "" {
		req.Header.Set("X-Forwarded-For", forwardedFor)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("GET %s (X-Forwarded-For %q): %v", url, forwardedFor, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: reading the body: %v", url, err)
	}
	return resp, string(body)
}

// expectAnswer sends one request and checks its status, and its
// X-RateLimit-Remaining and body when they are wanted (not "-").
func expectAnswer(t *testing.T, client *http.Client, url, forwardedFor string, status int, remaining, body string) {
	t.Helper()
	resp, gotBody := getVia(t, client, url, forwardedFor)
	gotRemaining := resp.Header.Get("X-RateLimit-Remaining")
	if resp.StatusCode != status || remaining != "-" && gotRemaining != remaining || body != "-" && gotBody != body {
		t.Fatalf("%s from %q: %d, remaining %q, body %q; want %d, remaining %q, body %q",
			url, forwardedFor, resp.StatusCode, gotRemaining, gotBody, status, remaining, body)
	}
}

// redisKeys lists the keys of a test's own Redis server.
func redisKeys(t *testing.T, srv *redistest.Server) []string {
	t.Helper()
	keys, err := srv.Client(t).Keys(context.Background(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	return keys
}

// expectKeysEndingIn checks that the Redis keys are as many as the
// suffixes, and that each key ends in a suffix of its own.
func expectKeysEndingIn(t *testing.T, srv *redistest.Server, suffixes ...string) {
	t.Helper()
	keys := redisKeys(t, srv)
	unmatched := slices.Clone(keys)
	for _, s := range suffixes {
		i := slices.IndexFunc(unmatched, func(k string) bool { return strings.HasSuffix(k, s) })
		if i < 0 {
			break
		}
		unmatched = slices.Delete(unmatched, i, i+1)
	}
	if len(keys) != len(suffixes) || len(unmatched) != 0 {
		t.Errorf("Redis keys\n%s\nwant one for each of\n%s", strings.Join(keys, "\n"), strings.Join(suffixes, "\n"))
	}
}

func TestCaddyForwardedIPv6ClientsShareTheirNetworksBucket(t *testing.T) {
	srv := redistest.Start(t)
	tester := loadCaddyfile(t, nil, trustingGlobals+fmt.Sprintf(`
http://localhost:9080 {
	handle /p64 {
		rate_limit 1/1h 2 {
			zone p64
			key {client_ip}
			log_key
			redis %[1]s
		}
		respond "{http.rate_limit.key}"
	}
	handle /p128 {
		rate_limit 1/1h 2 {
			zone p128
			key {client_ip}
			ipv6_prefix 128
			log_key
			redis %[1]s
		}
		respond "{http.rate_limit.key}"
	}
}`, srv.Addr))
	c, base := tester.Client, caddytestSite

	// One /64: two addresses, one bucket.
	expectAnswer(t, c, base+"/p64", "2001:db8:1:2::a", 200, "1", "2001:db8:1:2::/64")
	expectAnswer(t, c, base+"/p64", "2001:db8:1:2:ffff:ffff:ffff:ffff", 200, "0", "2001:db8:1:2::/64")
	expectAnswer(t, c, base+"/p64", "2001:db8:1:2::c", 429, "0", "-")
	// Another /64: its own bucket; a proxy's port and the next hops are
	// left out as Caddy reads X-Forwarded-For.
	expectAnswer(t, c, base+"/p64", "[2001:db8:1:3::a]:443, 10.0.0.1", 200, "1", "2001:db8:1:3::/64")

	// ipv6_prefix 128: one bucket per address.
	expectAnswer(t, c, base+"/p128", "2001:db8:1:2::a", 200, "1", "2001:db8:1:2::a")
	expectAnswer(t, c, base+"/p128", "2001:db8:1:2::b", 200, "1", "2001:db8:1:2::b")
	expectAnswer(t, c, base+"/p128", "2001:db8:1:2::a", 200, "0", "2001:db8:1:2::a")
	expectAnswer(t, c, base+"/p128", "2001:db8:1:2::a", 429, "0", "-")

	// IPv4 and IPv4-mapped IPv6: one client, one bucket.
	expectAnswer(t, c, base+"/p64", "192.0.2.7", 200, "1", "192.0.2.7")
	expectAnswer(t, c, base+"/p64", "::ffff:192.0.2.7", 200, "0", "192.0.2.7")
	expectAnswer(t, c, base+"/p64", "192.0.2.7", 429, "0", "-")
	expectAnswer(t, c, base+"/p64", "192.0.2.8", 200, "1", "192.0.2.8")

	expectKeysEndingIn(t, srv,
		"|2001:db8:1:2::/64", "|2001:db8:1:3::/64", "|192.0.2.7", "|192.0.2.8",
		"|2001:db8:1:2::a", "|2001:db8:1:2::b")
}

func TestCaddyIPv6LoopbackClientIsItsNetwork(t *testing.T) {
	if l, err := net.Listen("tcp6", "[::1]:0"); err != nil {
		t.Skipf("this machine has no IPv6 loopback (listening on [::1]: %v); the test needs one", err)
	} else {
		l.Close()
	}
	srv := redistest.Start(t)
	// caddytest's client dials 127.0.0.1 whatever the URL says; this one
	// dials [::1] as the URL says.
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	loadCaddyfile(t, nil, caddyGlobals+fmt.Sprintf(`
http://[::1]:9080 {
	bind [::1]
	handle /ip {
		rate_limit 1/1h 2 {
			zone ip
			log_key
			redis %[1]s
		}
		respond "{http.rate_limit.key}"
	}
	handle /host {
		rate_limit 1/1h 2 {
			zone host
			key {remote_host}
			log_key
			redis %[1]s
		}
		respond "{http.rate_limit.key}"
	}
}`, srv.Addr))

	for _, path := range []string{"/ip", "/host"} {
		url := fmt.Sprintf("http://[::1]:%d%s", caddytestPorts.http, path)
		expectAnswer(t, client, url, "", 200, "1", "::/64")
		expectAnswer(t, client, url, "", 200, "0", "::/64")
		expectAnswer(t, client, url, "", 429, "0", "-")
	}
	expectKeysEndingIn(t, srv, "|::/64", "|::/64")
	keys := redisKeys(t, srv)
	for _, zone := range []string{"ip", "host"} {
		if !slices.ContainsFunc(keys, func(k string) bool { return strings.HasPrefix(k, "rate_limit:"+zone+"|") }) {
			t.Errorf("no key of zone %s in %q", zone, keys)
		}
	}
}

func TestCaddyLimitsWithTwoPrefixesOnOneKey(t *testing.T) {
	srv := redistest.Start(t)
	tester := loadCaddyfile(t, nil, trustingGlobals+fmt.Sprintf(`
http://localhost:9080 {
	rate_limit {
		zone nets
		key {client_ip}
		limit per64 1/1h 2 {
			ipv6_prefix 64
		}
		limit per48 1/1h 3 {
			ipv6_prefix 48
		}
		redis %s
	}
	respond "ok"
	handle_errors 429 {
		respond "{http.rate_limit.limit_name}" 429
	}
}`, srv.Addr))
	c, url := tester.Client, caddytestSite+"/"
	const (
		a1 = "2001:db8:1:1::1"  // a and b: two /64s of one /48
		a2 = "2001:db8:1:1::ff" // a2: a's /64
		b1 = "2001:db8:1:2::1"
		c1 = "2001:db8:2:1::1" // another /48
	)
	expect := func(ip string, status int, remaining, burst, body string) {
		t.Helper()
		resp, gotBody := getVia(t, c, url, ip)
		got := [3]string{resp.Header.Get("X-RateLimit-Remaining"), resp.Header.Get("X-RateLimit-Burst-Capacity"), gotBody}
		if resp.StatusCode != status || got != [3]string{remaining, burst, body} {
			t.Fatalf("from %s: %d, remaining %q, burst %q, body %q; want %d, %q, %q, %q",
				ip, resp.StatusCode, got[0], got[1], got[2], status, remaining, burst, body)
		}
	}
	// Headers describe the limit with the fewest requests left, or the
	// one that refused: per64 has burst 2, per48 burst 3.
	expect(a1, 200, "1", "2", "ok") // per64(a) 1 left, per48 2
	expect(a2, 200, "0", "2", "ok") // per64(a) 0, per48 1
	expect(b1, 200, "0", "3", "ok") // per64(b) 1: its own bucket; per48 0: shared
	expect(b1, 429, "0", "3", "per48")
	if resp, _ := getVia(t, c, url, a1); resp.StatusCode != 429 {
		t.Fatalf("from %s after both buckets emptied: %d, want 429", a1, resp.StatusCode)
	}
	expect(c1, 200, "1", "2", "ok") // another /48: buckets of its own

	expectKeysEndingIn(t, srv,
		"|2001:db8:1:1::/64}|per64", "|2001:db8:1:2::/64}|per64", "|2001:db8:1::/48}|per48",
		"|2001:db8:2:1::/64}|per64", "|2001:db8:2::/48}|per48")
}
