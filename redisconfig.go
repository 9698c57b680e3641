package ratelimit

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// Defaults of the redis block.
const (
	defaultRedisAddress = "127.0.0.1:6379"
	defaultKeyPrefix    = "rate_limit:"
	defaultTimeout      = 100 * time.Millisecond
)

// RedisConfig says how to reach Redis: one server, a Cluster or a
// Sentinel-monitored master. Every string takes `{env.*}` placeholders.
type RedisConfig struct {
	// Addresses of Redis: `host:port`, or a `redis://` or `rediss://`
	// (TLS) URL that may carry the user name, password and database.
	// Several addresses mean Redis Cluster seeds, or Sentinel addresses
	// when `master_name` is set. Default: `127.0.0.1:6379`.
	Addresses []string `json:"addresses,omitempty"`

	// Cluster selects Redis Cluster even with a single seed address.
	Cluster bool `json:"cluster,omitempty"`

	// MasterName is the name of the master that the Sentinels at
	// `addresses` monitor. Setting it selects Sentinel mode.
	MasterName string `json:"master_name,omitempty"`

	// SentinelUsername and SentinelPassword authenticate to the
	// Sentinels themselves (not to the master).
	SentinelUsername string `json:"sentinel_username,omitempty"`
	SentinelPassword string `json:"sentinel_password,omitempty"`

	// Username and Password authenticate to Redis (ACL user or
	// `requirepass`).
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`

	// DB is the database index. Redis Cluster has only database 0.
	DB int `json:"db,omitempty"`

	// KeyPrefix starts every Redis key this handler writes.
	// Default: `rate_limit:`.
	KeyPrefix string `json:"key_prefix,omitempty"`

	// Timeout bounds the whole Redis step of one request: waiting for a
	// connection, dialing, sending, retries and the reply. Past it, the
	// request is handled as if Redis failed. Default: 100ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// DialTimeout bounds one attempt to connect. Default: the timeout.
	DialTimeout caddy.Duration `json:"dial_timeout,omitempty"`

	// PoolSize is the most connections for single commands per Redis
	// node; batches of requests use go-redis's separate pipeline pool.
	// Default: go-redis's, 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	// TLS, when set, connects over TLS even to a plain `host:port`.
	TLS *RedisTLS `json:"tls,omitempty"`
}

// RedisTLS configures TLS to Redis.
type RedisTLS struct {
	// CA is a PEM file of the authorities that may sign the server's
	// certificate. Default: the system's roots.
	CA string `json:"ca,omitempty"`

	// Cert and Key are PEM files of the client certificate and its key,
	// for servers that authenticate clients (`tls-auth-clients yes`).
	Cert string `json:"cert,omitempty"`
	Key  string `json:"key,omitempty"`

	// ServerName is the name to verify in the server's certificate.
	// Default: the host of the address.
	ServerName string `json:"server_name,omitempty"`

	// InsecureSkipVerify turns off verification of the server's
	// certificate. For tests only.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`
}

// withPlaceholders returns the configuration with `{env.*}` and Caddy's
// other global placeholders replaced, and defaults filled in. Every other
// byte stays as written: a password may well hold `{` or `\{`.
func (c *RedisConfig) withPlaceholders() RedisConfig {
	repl := knownPlaceholders{caddy.NewReplacer()}
	r := RedisConfig{}
	if c != nil {
		r = *c
	}
	r.Addresses = nil
	if c != nil {
		for _, a := range c.Addresses {
			resolved := strings.Fields(repl.replace(a))
			if len(resolved) == 0 {
				resolved = []string{a} // validate names the unresolved value
			}
			r.Addresses = append(r.Addresses, resolved...)
		}
	}
	if len(r.Addresses) == 0 {
		r.Addresses = []string{defaultRedisAddress}
	}
	r.MasterName = repl.replace(r.MasterName)
	r.SentinelUsername = repl.replace(r.SentinelUsername)
	r.SentinelPassword = repl.replace(r.SentinelPassword)
	r.Username = repl.replace(r.Username)
	r.Password = repl.replace(r.Password)
	if r.KeyPrefix = repl.replace(r.KeyPrefix); r.KeyPrefix == "" {
		r.KeyPrefix = defaultKeyPrefix
	}
	if r.Timeout <= 0 {
		r.Timeout = caddy.Duration(defaultTimeout)
	}
	if r.DialTimeout <= 0 {
		r.DialTimeout = r.Timeout
	}
	if r.TLS != nil {
		t := *r.TLS
		t.CA = repl.replace(t.CA)
		t.Cert = repl.replace(t.Cert)
		t.Key = repl.replace(t.Key)
		t.ServerName = repl.replace(t.ServerName)
		r.TLS = &t
	}
	return r
}

// knownPlaceholders replaces the placeholders Caddy knows when the config
// loads (`{env.*}`, `{file.*}`, `{system.*}`, ...) and keeps every other
// byte as written. Caddy's Replacer.ReplaceKnown would also drop the
// backslash of `\{` and `\}`: a password `ab\{cd` would become `ab{cd`,
// which Redis refuses (and with a fallback that allows, limiting would
// stop).
// A replaced value is not read again: an `{env.*}` value is taken whole.
type knownPlaceholders struct{ repl *caddy.Replacer }

func (k knownPlaceholders) replace(s string) string {
	var b strings.Builder
	for {
		open := strings.IndexByte(s, '{')
		if open < 0 {
			break
		}
		length := strings.IndexAny(s[open+1:], "{}")
		if length >= 0 && s[open+1+length] == '}' {
			if v, ok := k.repl.GetString(s[open+1 : open+1+length]); ok {
				b.WriteString(s[:open])
				b.WriteString(v)
				s = s[open+length+2:]
				continue
			}
		}
		b.WriteString(s[:open+1])
		s = s[open+1:]
	}
	if b.Len() == 0 {
		return s
	}
	b.WriteString(s)
	return b.String()
}

// validate refuses contradictory or malformed settings.
func (c RedisConfig) validate() error {
	if c.Cluster && c.MasterName != "" {
		return fmt.Errorf("redis: 'master_name %s' (Sentinel) and 'cluster' exclude each other", c.MasterName)
	}
	if c.MasterName == "" && (c.SentinelUsername != "" || c.SentinelPassword != "") {
		return errors.New("redis: 'sentinel_username' and 'sentinel_password' need 'master_name'")
	}
	if c.DB < 0 {
		return fmt.Errorf("redis: 'db %d' must not be negative", c.DB)
	}
	if c.PoolSize < 0 {
		return fmt.Errorf("redis: 'pool_size %d' must not be negative", c.PoolSize)
	}
	db := c.DB
	for _, a := range c.Addresses {
		o, err := checkAddress(a)
		if err != nil {
			return err
		}
		if o != nil && db == 0 {
			db = o.DB
		}
	}
	if db != 0 && c.Cluster {
		return fmt.Errorf("redis: 'db %d' is not possible with 'cluster': Redis Cluster has only database 0", db)
	}
	if db != 0 && len(c.Addresses) > 1 && c.MasterName == "" {
		return fmt.Errorf("redis: 'db %d' is not possible with %d addresses and no 'master_name', which means Redis Cluster: it has only database 0", db, len(c.Addresses))
	}
	if c.TLS != nil {
		if err := c.TLS.validate(); err != nil {
			return fmt.Errorf("redis: %w", err)
		}
	}
	return nil
}

// validate refuses a client certificate without its key, or a key
// without its certificate.
func (t *RedisTLS) validate() error {
	if (t.Cert == "") != (t.Key == "") {
		return fmt.Errorf("tls: 'cert' and 'key' go together; got cert '%s' and key '%s'", t.Cert, t.Key)
	}
	return nil
}

// checkAddress refuses a malformed address; it passes one with a
// placeholder, which is checked once provisioning has resolved it (and
// which options() refuses if it never resolved).
func checkAddress(a string) (*redis.Options, error) {
	if strings.Contains(a, "{") {
		return nil, nil
	}
	o, err := parseAddress(a)
	if err != nil {
		return nil, fmt.Errorf("redis address '%s': %w", logs.RedactAddress(a), err)
	}
	return o, nil
}

// parseAddress accepts `host:port` or a redis:// or rediss:// URL. Its
// errors never quote the user name or the password (callers name the
// address by logs.RedactAddress): the user information is cut off before
// go-redis parses the rest, since its errors (and net/url's) quote the
// whole URL. It runs to the last '@', so a password may hold '/', '?',
// '#' or '@' unescaped; the user name and password are percent-decoded,
// as in any URL.
func parseAddress(a string) (*redis.Options, error) {
	scheme, rest, isURL := strings.Cut(a, "://")
	if !isURL {
		if strings.Contains(a, "@") {
			return nil, errors.New("a user name or password needs a redis:// or rediss:// URL (or the username and password subdirectives)")
		}
		return parseHostPort(a)
	}
	if scheme != "redis" && scheme != "rediss" {
		return nil, errors.New("URL scheme must be redis:// or rediss://")
	}
	userinfo, hasUser := "", false
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		userinfo, rest, hasUser = rest[:at], rest[at+1:], true
	}
	o, err := redis.ParseURL(scheme + "://" + rest)
	if err != nil {
		return nil, err
	}
	if hasUser {
		user, password, _ := strings.Cut(userinfo, ":")
		if o.Username, err = url.PathUnescape(user); err != nil {
			return nil, errors.New("the user name has a malformed %-escape: write '%' as %25")
		}
		if o.Password, err = url.PathUnescape(password); err != nil {
			return nil, errors.New("the password has a malformed %-escape: write '%' as %25, or give it with the password subdirective, which takes it as written")
		}
	}
	return o, nil
}

// parseHostPort accepts `host:port`.
func parseHostPort(a string) (*redis.Options, error) {
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		return nil, fmt.Errorf("want host:port: %w", err)
	}
	if host == "" {
		return nil, errors.New("missing host")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return nil, fmt.Errorf("port '%s' is not a number from 1 to 65535", port)
	}
	return &redis.Options{Addr: a}, nil
}

// options turns the configuration into go-redis options, with the TLS
// files' contents as read for this config load.
func (c RedisConfig) options(files tlsFiles) (*redis.UniversalOptions, error) {
	timeout := time.Duration(c.Timeout)
	opts := &redis.UniversalOptions{
		MasterName:            c.MasterName,
		IsClusterMode:         c.Cluster,
		SentinelUsername:      c.SentinelUsername,
		SentinelPassword:      c.SentinelPassword,
		Username:              c.Username,
		Password:              c.Password,
		DB:                    c.DB,
		DialTimeout:           time.Duration(c.DialTimeout),
		ReadTimeout:           timeout,
		WriteTimeout:          timeout,
		PoolTimeout:           timeout,
		ContextTimeoutEnabled: true,
		PoolSize:              c.PoolSize,
		// One try: the timeout covers the whole step, a retry inside it
		// would only hide a failing server from the breaker, and a script
		// sent twice takes tokens twice (see onceCmd for Cluster).
		MaxRetries:      -1,
		MinRetryBackoff: -1,
		MaxRetryBackoff: -1,
		DialerRetries:   1,
		DisableIdentity: true,
	}
	for _, a := range c.Addresses {
		o, err := parseAddress(a)
		if err != nil {
			return nil, fmt.Errorf("address '%s': %w", logs.RedactAddress(a), err)
		}
		opts.Addrs = append(opts.Addrs, o.Addr)
		if opts.Username == "" {
			opts.Username = o.Username
		}
		if opts.Password == "" {
			opts.Password = o.Password
		}
		if opts.DB == 0 {
			opts.DB = o.DB
		}
		if o.TLSConfig != nil && opts.TLSConfig == nil {
			opts.TLSConfig = o.TLSConfig // rediss://, with its skip_verify if given
		}
	}
	if c.TLS != nil {
		tc, err := c.TLS.config(files)
		if err != nil {
			return nil, fmt.Errorf("tls: %w", err)
		}
		opts.TLSConfig = tc
	}
	if opts.TLSConfig != nil {
		// Without server_name, each connection checks the certificate
		// against the host it dials (Go's TLS does that for an empty
		// name): every Cluster node and Sentinel by its own name, not by
		// the first seed's, which a rediss:// URL would have put here.
		opts.TLSConfig.ServerName = ""
		if c.TLS != nil {
			opts.TLSConfig.ServerName = c.TLS.ServerName
		}
		opts.TLSConfig.MinVersion = max(opts.TLSConfig.MinVersion, tls.VersionTLS12)
	}
	return opts, nil
}

// tlsFiles are the contents of the TLS files, read at every config load:
// a shared client is kept across a reload only while they are unchanged,
// so rotated certificates take effect with the reload.
type tlsFiles struct {
	ca, cert, key []byte
}

// readFiles reads the files the TLS settings name; a nil receiver has none.
func (t *RedisTLS) readFiles() (tlsFiles, error) {
	var f tlsFiles
	if t == nil {
		return f, nil
	}
	for _, file := range []struct {
		name, path string
		dst        *[]byte
	}{{"ca", t.CA, &f.ca}, {"cert", t.Cert, &f.cert}, {"key", t.Key, &f.key}} {
		if file.path == "" {
			continue
		}
		b, err := os.ReadFile(file.path)
		if err != nil {
			return f, fmt.Errorf("tls: reading '%s': %w", file.name, err)
		}
		*file.dst = b
	}
	return f, nil
}

// digest names the files' contents in the shared client's pool key.
func (f tlsFiles) digest() string {
	h := sha256.New()
	for _, b := range [][]byte{f.ca, f.cert, f.key} {
		fmt.Fprintf(h, "%d:", len(b))
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// config builds the TLS configuration from the files' contents.
func (t *RedisTLS) config(f tlsFiles) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: t.InsecureSkipVerify}
	if f.ca != nil {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(f.ca) {
			return nil, fmt.Errorf("'ca %s' holds no PEM certificate", t.CA)
		}
		tc.RootCAs = pool
	}
	if f.cert != nil {
		cert, err := tls.X509KeyPair(f.cert, f.key)
		if err != nil {
			return nil, fmt.Errorf("loading 'cert' and 'key': %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}
