// package keys builds a bucket's Redis key from a request: the `key`
// template compiled once, its placeholders read from the request (client
// addresses cut to their network), each value escaped so that no request
// reaches another client's bucket, and a long client key hashed.
package keys

import (
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/textproto"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Separator parts a placeholder's value from what follows when that
// could otherwise be read as part of the value; values always escape it.
// Prefixes and suffixes built around a template's keys part their own
// pieces with it too.
const Separator = "|"

// maxVerbatimKey is the longest client key kept readable in Redis; a
// longer one is hashed, so Redis key length stays bounded.
const maxVerbatimKey = 64

// BucketPrefix starts the Redis keys of one zone and key template:
// `<key_prefix><zone>|<template tag>|`. The tag, 48 bits of the template's
// SHA-256, keeps apart handlers that share a zone but build keys
// differently: a header a client sets on one route must not reach the
// buckets another route keys by address.
func BucketPrefix(keyPrefix, zone, template string) string {
	sum := sha256.Sum256([]byte(template))
	return keyPrefix + zone + Separator + base64.RawURLEncoding.EncodeToString(sum[:6]) + Separator
}

// Template is the `key` template compiled once at provision time:
// literal text and placeholders, resolved per request without parsing.
type Template struct {
	parts []templatePart
	// escaped marks bytes that a placeholder's value may not contain as
	// they are: '%' (the escape), '|' (Separator), the template's
	// literal bytes, braces and control bytes. Escaping them keeps the
	// mapping from values to keys one-to-one, so no request can reach
	// another client's bucket.
	escaped [256]bool
	// IPv4Bits and IPv6Bits cut client addresses to their network
	// (ipv4_prefix and ipv6_prefix); Parse sets 32 and 64.
	IPv4Bits, IPv6Bits int
}

type templatePart struct {
	literal     string
	placeholder string // without braces; empty for a literal
	address     bool   // the placeholder holds the client's address
	// from says where a request's value is read (see Values); name
	// is the header's canonical name or the variable's.
	from placeholderSource
	name string
}

// placeholderSource is where a request's placeholder value comes from.
type placeholderSource uint8

const (
	fromReplacer   placeholderSource = iota
	fromHeader                       // http.request.header.<name>
	fromVar                          // http.vars.<name>, client_ip among them
	fromRemoteHost                   // http.request.remote.host
)

// sourceOf says where a placeholder's value is read from the request.
func sourceOf(placeholder string) (placeholderSource, string) {
	if name, ok := strings.CutPrefix(placeholder, "http.request.header."); ok {
		return fromHeader, textproto.CanonicalMIMEHeaderKey(name)
	}
	if name, ok := strings.CutPrefix(placeholder, "http.vars."); ok {
		return fromVar, name
	}
	if placeholder == "http.request.remote.host" {
		return fromRemoteHost, ""
	}
	return fromReplacer, ""
}

// Values reads one request's placeholder values, once for all the
// limits of a handler. The most common ones in keys (a header, a variable
// such as client_ip, the remote host) are read from the request itself,
// as the HTTP provider of the request's replacer reads them, which answers
// them before any provider a handler adds: without walking the providers
// before it, and without boxing the value (1 alloc and about 0.1 µs less
// per key of {client_ip}:{http.request.header.X-Key}: BenchmarkKeyResolve,
// ip+header/request against /replacer). The others come from the replacer.
type Values struct {
	r    *http.Request // nil: every value from repl (the admin API's)
	repl *caddy.Replacer
	vars map[string]any // the request's variables, once looked up
	seen bool
}

// RequestValues are the placeholder values of r, read from r itself
// where they can be and else from repl, the request's replacer.
func RequestValues(r *http.Request, repl *caddy.Replacer) Values {
	return Values{r: r, repl: repl}
}

// value is a placeholder's value for the request.
func (rv *Values) value(p *templatePart) string {
	if rv.r != nil {
		switch p.from {
		case fromHeader:
			if vals := rv.r.Header[p.name]; len(vals) == 1 {
				return vals[0]
			} else {
				return strings.Join(vals, ",")
			}
		case fromVar:
			if !rv.seen {
				rv.vars, _ = rv.r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
				rv.seen = true
			}
			return caddy.ToString(rv.vars[p.name])
		case fromRemoteHost:
			if rv.r.TLS != nil && !rv.r.TLS.HandshakeComplete {
				return "" // early data: Caddy does not trust the address yet
			}
			host, _, err := net.SplitHostPort(rv.r.RemoteAddr)
			if err != nil {
				return rv.r.RemoteAddr // a unix socket
			}
			return host
		}
	}
	v, _ := rv.repl.GetString(p.placeholder)
	return v
}

// addressPlaceholders hold the client's address, which ipv4_prefix and
// ipv6_prefix cut to its network.
var addressPlaceholders = map[string]bool{
	"client_ip": true, "http.vars.client_ip": true, "remote_host": true, "http.request.remote.host": true,
}

// HoldsAddress says whether a placeholder (its name without braces)
// holds the client's address, which ipv4_prefix and ipv6_prefix cut to
// its network.
func HoldsAddress(placeholder string) bool { return addressPlaceholders[placeholder] }

// Parse compiles a template such as
// `{client_ip}:{http.request.header.X-Tenant}`. No brace reaches a key:
// values escape them and literal ones are refused. Its errors name the
// `key` subdirective and the template.
func Parse(s string) (Template, error) {
	t, err := compileKeyTemplate(s)
	if err != nil {
		return t, fmt.Errorf("key '%s': %w", s, err)
	}
	return t, nil
}

func compileKeyTemplate(s string) (Template, error) {
	t := Template{IPv4Bits: 32, IPv6Bits: 64}
	var lit strings.Builder
	flush := func() {
		if lit.Len() > 0 {
			t.parts = append(t.parts, templatePart{literal: lit.String()})
			lit.Reset()
		}
	}
	for i := 0; i < len(s); i++ {
		switch ch := s[i]; {
		case ch == '\\' && i+1 < len(s) && (s[i+1] == '{' || s[i+1] == '}'):
			return t, fmt.Errorf("a literal brace ('%s') would reach Redis, where Cluster reads braces as a hash tag; leave it out", s[i:i+2])
		case ch == '{':
			end := strings.IndexByte(s[i:], '}')
			if end < 0 {
				return t, fmt.Errorf("unclosed placeholder at '%s'", s[i:])
			}
			name := s[i+1 : i+end]
			if name == "" || strings.ContainsAny(name, "{ ") {
				return t, fmt.Errorf("malformed placeholder '%s'", s[i:i+end+1])
			}
			flush()
			from, sourceName := sourceOf(name)
			t.parts = append(t.parts, templatePart{placeholder: name, address: addressPlaceholders[name], from: from, name: sourceName})
			i += end
		case ch == '}':
			return t, fmt.Errorf("unopened '}' in '%s'", s)
		default:
			lit.WriteByte(ch)
		}
	}
	flush()
	if len(t.parts) == 0 {
		return t, fmt.Errorf("the key template is empty")
	}
	// A value ends where the next literal begins, at a byte no value holds
	// as it is. A placeholder followed by another, or by a literal that
	// begins with '%' (which escaped values hold too), gets a '|' first.
	parts := t.parts[:0:0]
	for i, p := range t.parts {
		parts = append(parts, p)
		if p.placeholder == "" || i+1 == len(t.parts) {
			continue
		}
		if next := t.parts[i+1]; next.placeholder != "" || next.literal[0] == '%' {
			parts = append(parts, templatePart{literal: Separator})
		}
	}
	t.parts = parts
	for b := range 256 {
		t.escaped[b] = b < 0x21 || b >= 0x7f || b == '%' || b == '{' || b == '}' || b == '#' || b == int(Separator[0])
	}
	for _, p := range t.parts {
		for i := 0; i < len(p.literal); i++ {
			t.escaped[p.literal[i]] = true
		}
	}
	return t, nil
}

// Placeholders lists the template's placeholders (without braces) as
// the template writes them, in its order.
func (t *Template) Placeholders() []string {
	var names []string
	for _, p := range t.parts {
		if p.placeholder != "" {
			names = append(names, p.placeholder)
		}
	}
	return names
}

// ReplacerKey resolves the template from a replacer's values (the admin
// API's) and returns the Redis key of its bucket; see Key.
func (t *Template) ReplacerKey(repl *caddy.Replacer, prefix, suffix string) string {
	return t.Key(&Values{repl: repl}, prefix, suffix)
}

// maxStackKey is the longest key built without a buffer on the heap:
// most are far shorter, and a longer client key is hashed anyway.
const maxStackKey = 256

// Key resolves the template for one request and returns the Redis key of
// its bucket: prefix, the client key, suffix, in one allocation of its
// size (built on the stack: 48 B for ip+header instead of a 96 B builder).
// It returns "" when any placeholder resolves to nothing, so that a
// composite key never merges clients whose header is missing.
func (t *Template) Key(rv *Values, prefix, suffix string) string {
	var buf [maxStackKey]byte
	b := append(buf[:0], prefix...)
	for i := range t.parts {
		p := &t.parts[i]
		if p.placeholder == "" {
			b = append(b, p.literal...)
			continue
		}
		v := rv.value(p)
		switch {
		case v == "":
			return ""
		case p.address:
			b = t.appendAddress(b, v)
		default:
			b = appendEscaped(t, b, v)
		}
	}
	if client := b[len(prefix):]; len(client) > maxVerbatimKey || client[0] == '#' {
		return prefix + hashKey(client) + suffix
	}
	return string(append(b, suffix...))
}

// appendAddress appends a client address cut to its network: `1.2.3.4`
// as it is with the IPv4 default of 32 bits, `2001:db8:1::/64` with the
// IPv6 default. IPv4-mapped IPv6 addresses count as IPv4. A value that is
// no address is written as any value.
func (t *Template) appendAddress(b []byte, v string) []byte {
	if t.IPv4Bits == 32 && strings.IndexByte(v, ':') < 0 {
		// No IPv6 address (and no IPv4-mapped one) without a ':': an IPv4
		// address kept whole or no address at all, both written as they
		// are, without parsing (about 20 ns per key: BenchmarkKeyResolve/client_ip).
		return appendEscaped(t, b, v)
	}
	addr, err := netip.ParseAddr(v)
	if err != nil {
		return appendEscaped(t, b, v)
	}
	bits, full := t.IPv6Bits, 128
	if addr.Is4In6() || addr.Is4() {
		bits, full = t.IPv4Bits, 32
	}
	if addr.Is4() && bits == full {
		return appendEscaped(t, b, v) // the common case, as written
	}
	addr = addr.Unmap().WithZone("")
	var buf [64]byte
	out := buf[:0]
	if bits < full {
		prefix, _ := addr.Prefix(bits)
		out = prefix.Addr().AppendTo(out)
		out = append(out, '/')
		out = strconv.AppendInt(out, int64(bits), 10)
	} else {
		out = addr.AppendTo(out)
	}
	return appendEscaped(t, b, out)
}

// appendEscaped appends v, percent-encoding the bytes the template reserves.
func appendEscaped[S ~string | ~[]byte](t *Template, b []byte, v S) []byte {
	const hex = "0123456789ABCDEF"
	for i := 0; i < len(v); i++ {
		c := v[i]
		if t.escaped[c] {
			b = append(b, '%', hex[c>>4], hex[c&15])
			continue
		}
		b = append(b, c)
	}
	return b
}

// hashKey stands in for a long client key: '#' and 128 bits of SHA-256,
// which no verbatim key can equal since those never start with '#'.
func hashKey(client []byte) string {
	sum := sha256.Sum256(client)
	return "#" + base64.RawURLEncoding.EncodeToString(sum[:16])
}
