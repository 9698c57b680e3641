package keys

// Client addresses in key templates cut to ipv4_prefix / ipv6_prefix
// bits. The handler's tests check the same through a real Caddy (behind
// a trusted proxy, over IPv6 loopback, two limits of different prefixes).

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// maskedKey resolves template with values (by placeholder name, without
// braces), its addresses cut to v4 and v6 bits as the handler sets them,
// and returns the client key: the Redis key without the zone's prefix.
func maskedKey(t *testing.T, template string, v4, v6 int, values map[string]string) string {
	t.Helper()
	kt, err := Parse(template)
	if err != nil {
		t.Fatalf("parse %q: %v", template, err)
	}
	kt.IPv4Bits, kt.IPv6Bits = v4, v6
	repl := caddy.NewReplacer()
	for k, v := range values {
		repl.Set(k, v)
	}
	const prefix = "rate_limit:z|tag|"
	key := kt.ReplacerKey(repl, prefix, "")
	if key == "" {
		return ""
	}
	if !strings.HasPrefix(key, prefix) {
		t.Fatalf("key %q lost its prefix %q", key, prefix)
	}
	return key[len(prefix):]
}

// clientIPKey is maskedKey of the template {client_ip} for one address.
func clientIPKey(t *testing.T, v4, v6 int, addr string) string {
	t.Helper()
	return maskedKey(t, "{client_ip}", v4, v6, map[string]string{"client_ip": addr})
}

func TestPrefixCutsClientAddressToItsNetwork(t *testing.T) {
	for _, tc := range []struct {
		name   string
		v4, v6 int
		addr   string
		want   string
	}{
		// IPv4
		{"IPv4 with the default /32 is kept as it is", 32, 64, "192.0.2.7", "192.0.2.7"},
		{"IPv4 /24", 24, 64, "192.0.2.7", "192.0.2.0/24"},
		{"IPv4 /24 of the network's first address", 24, 64, "192.0.2.0", "192.0.2.0/24"},
		{"IPv4 /16", 16, 64, "192.0.2.7", "192.0.0.0/16"},
		{"IPv4 /20, not on a byte", 20, 64, "192.0.47.7", "192.0.32.0/20"},
		{"IPv4 /0 is one bucket for all", 0, 64, "192.0.2.7", "0.0.0.0/0"},
		{"IPv4 is not cut by ipv6_prefix", 32, 0, "192.0.2.7", "192.0.2.7"},

		// IPv6
		{"IPv6 with the default /64", 32, 64, "2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"},
		{"IPv6 /128 keeps the address", 32, 128, "2001:db8:1:2:3:4:5:6", "2001:db8:1:2:3:4:5:6"},
		{"IPv6 /48", 32, 48, "2001:db8:1:2:3:4:5:6", "2001:db8:1::/48"},
		{"IPv6 /60, not on a group", 32, 60, "2001:db8:1:2ff::1", "2001:db8:1:2f0::/60"},
		{"IPv6 /0 is one bucket for all", 32, 0, "2001:db8:1:2::1", "::/0"},
		{"IPv6 loopback /64", 32, 64, "::1", "::/64"},
		{"IPv6 is not cut by ipv4_prefix", 8, 128, "2001:db8::1", "2001:db8::1"},
		{"IPv6 written out in full is written canonically", 32, 128, "2001:0DB8:0001:0002:0000:0000:0000:0001", "2001:db8:1:2::1"},
		{"IPv6 written out in full, /64", 32, 64, "2001:0DB8:0001:0002:0000:0000:0000:0001", "2001:db8:1:2::/64"},

		// IPv4-mapped IPv6 counts as IPv4
		{"IPv4-mapped with the defaults", 32, 64, "::ffff:192.0.2.7", "192.0.2.7"},
		{"IPv4-mapped in hex", 32, 64, "::ffff:c000:207", "192.0.2.7"},
		{"IPv4-mapped cut by ipv4_prefix", 24, 64, "::ffff:192.0.2.7", "192.0.2.0/24"},
		{"IPv4-mapped not cut by ipv6_prefix", 32, 0, "::ffff:192.0.2.7", "192.0.2.7"},
		{"IPv4-mapped, ipv6_prefix 128", 32, 128, "::ffff:192.0.2.7", "192.0.2.7"},

		// a zone names the link, not the client
		{"zoned IPv6 /64", 32, 64, "fe80::1%eth0", "fe80::/64"},
		{"zoned IPv6 /128 drops the zone", 32, 128, "fe80::1%eth0", "fe80::1"},
		{"zoned IPv4-mapped", 24, 64, "::ffff:192.0.2.7%eth0", "192.0.2.0/24"},

		// values that are no address are kept as any value
		{"not an address", 24, 48, "unknown", "unknown"},
		{"address with a port", 24, 48, "192.0.2.7:1234", "192.0.2.7:1234"},
		{"IPv6 in brackets", 24, 48, "[2001:db8::1]", "[2001:db8::1]"},
		{"IPv4 with leading zeros", 24, 48, "192.000.002.007", "192.000.002.007"},
		{"a network, not an address", 24, 48, "192.0.2.0/24", "192.0.2.0/24"},
		{"not an address, escaped as any value", 24, 48, "a b%", "a%20b%25"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := clientIPKey(t, tc.v4, tc.v6, tc.addr); got != tc.want {
				t.Errorf("%s with ipv4_prefix %d, ipv6_prefix %d: key %q, want %q", tc.addr, tc.v4, tc.v6, got, tc.want)
			}
		})
	}
}

func TestPrefixCutsEveryAddressPlaceholder(t *testing.T) {
	const addr = "2001:db8:1:2::7"
	for _, name := range []string{"client_ip", "http.vars.client_ip", "remote_host", "http.request.remote.host"} {
		if got := maskedKey(t, "{"+name+"}", 32, 64, map[string]string{name: addr}); got != "2001:db8:1:2::/64" {
			t.Errorf("{%s} = %s: key %q, want 2001:db8:1:2::/64", name, addr, got)
		}
	}
	// Other placeholders are values like any other, even when they hold
	// an address: a header is not the client's address.
	for _, name := range []string{"http.request.header.X-Real-IP", "http.request.remote", "ip"} {
		if got := maskedKey(t, "{"+name+"}", 32, 64, map[string]string{name: addr}); got != addr {
			t.Errorf("{%s} = %s: key %q, want it unchanged", name, addr, got)
		}
	}
}

func TestPrefixIPv4MappedSharesTheKeyOfIPv4(t *testing.T) {
	for _, v4 := range []int{32, 31, 24, 8, 0} {
		for _, v6 := range []int{128, 64, 0} {
			plain := clientIPKey(t, v4, v6, "192.0.2.7")
			if mapped := clientIPKey(t, v4, v6, "::ffff:192.0.2.7"); mapped != plain {
				t.Errorf("ipv4_prefix %d, ipv6_prefix %d: ::ffff:192.0.2.7 has key %q, 192.0.2.7 %q", v4, v6, mapped, plain)
			}
		}
	}
	// The IPv4 network of nothing and the IPv6 one stay apart.
	if v4, v6 := clientIPKey(t, 0, 0, "192.0.2.7"), clientIPKey(t, 0, 0, "2001:db8::1"); v4 == v6 {
		t.Errorf("IPv4 and IPv6 at /0 share the key %q", v4)
	}
}

func TestPrefixSameNetworkSharesAKey(t *testing.T) {
	for _, tc := range []struct {
		v4, v6 int
		a, b   string
		share  bool
	}{
		{32, 64, "2001:db8:1:2::a", "2001:db8:1:2:ffff:ffff:ffff:ffff", true},
		{32, 64, "2001:db8:1:2::a", "2001:db8:1:3::a", false},
		{32, 128, "2001:db8:1:2::a", "2001:db8:1:2::b", false},
		{32, 128, "2001:db8:1:2::a", "2001:db8:1:2:0::a", true},
		{32, 48, "2001:db8:1:2::a", "2001:db8:1:ffff::b", true},
		{32, 48, "2001:db8:1:2::a", "2001:db8:2:2::a", false},
		{32, 64, "fe80::1%eth0", "fe80::2%eth1", true},
		{32, 128, "fe80::1%eth0", "fe80::1", true},
		{32, 64, "192.0.2.7", "192.0.2.8", false},
		{24, 64, "192.0.2.7", "192.0.2.200", true},
		{24, 64, "192.0.2.7", "::ffff:192.0.2.200", true},
		{24, 64, "192.0.2.7", "192.0.3.7", false},
		{0, 0, "192.0.2.7", "198.51.100.1", true},
	} {
		ka, kb := clientIPKey(t, tc.v4, tc.v6, tc.a), clientIPKey(t, tc.v4, tc.v6, tc.b)
		if (ka == kb) != tc.share {
			t.Errorf("ipv4_prefix %d, ipv6_prefix %d: %s has key %q, %s %q; want shared %v", tc.v4, tc.v6, tc.a, ka, tc.b, kb, tc.share)
		}
	}
}

func TestPrefixInCompositeTemplates(t *testing.T) {
	values := func(ip, remote, tenant string) map[string]string {
		return map[string]string{"http.vars.client_ip": ip, "http.request.remote.host": remote, "http.request.header.X-Tenant": tenant}
	}
	for _, tc := range []struct {
		name     string
		template string
		v4, v6   int
		values   map[string]string
		want     string
	}{
		// The template's literal ':' is escaped in values, the address's
		// colons too.
		{"IPv6 before a tenant", "{http.vars.client_ip}:{http.request.header.X-Tenant}", 32, 64,
			values("2001:db8:1:2::7", "", "acme"), "2001%3Adb8%3A1%3A2%3A%3A/64:acme"},
		{"IPv4 before a tenant", "{http.vars.client_ip}:{http.request.header.X-Tenant}", 24, 64,
			values("192.0.2.7", "", "acme"), "192.0.2.0/24:acme"},
		{"IPv4-mapped before a tenant", "{http.vars.client_ip}:{http.request.header.X-Tenant}", 24, 64,
			values("::ffff:192.0.2.7", "", "acme"), "192.0.2.0/24:acme"},
		{"tenant before IPv6, '/' a literal", "{http.request.header.X-Tenant}/{http.vars.client_ip}", 32, 48,
			values("2001:db8:1:2::7", "", "acme"), "acme/2001:db8:1::%2F48"},
		{"two placeholders in a row", "{http.vars.client_ip}{http.request.header.X-Tenant}", 32, 64,
			values("2001:db8:1:2::7", "", "acme"), "2001:db8:1:2::/64|acme"},
		{"two addresses", "{http.vars.client_ip}-{http.request.remote.host}", 16, 56,
			values("2001:db8:1:2ff::7", "192.0.2.7", ""), "2001:db8:1:200::/56-192.0.0.0/16"},
		{"a missing tenant empties the key", "{http.vars.client_ip}:{http.request.header.X-Tenant}", 32, 64,
			values("2001:db8:1:2::7", "", ""), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := maskedKey(t, tc.template, tc.v4, tc.v6, tc.values); got != tc.want {
				t.Errorf("key %q, want %q", got, tc.want)
			}
		})
	}

	// Sharing in a composite key: the network and the tenant both count.
	const tmpl = "{client_ip}:{http.request.header.X-Tenant}"
	key := func(ip, tenant string) string {
		return maskedKey(t, tmpl, 32, 64, map[string]string{"client_ip": ip, "http.request.header.X-Tenant": tenant})
	}
	if key("2001:db8:1:2::a", "acme") != key("2001:db8:1:2::b", "acme") {
		t.Error("one tenant in one /64: two keys")
	}
	if key("2001:db8:1:2::a", "acme") == key("2001:db8:1:3::a", "acme") {
		t.Error("one tenant in two /64s: one key")
	}
	if key("2001:db8:1:2::a", "acme") == key("2001:db8:1:2::a", "other") {
		t.Error("two tenants in one /64: one key")
	}
	if key("192.0.2.7", "acme") != key("::ffff:192.0.2.7", "acme") {
		t.Error("IPv4 and its IPv4-mapped form: two keys")
	}
}
