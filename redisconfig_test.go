package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/caddyproc"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/caddy-redis/ratelimit/internal/testproc"
	"github.com/redis/go-redis/v9"
)

func TestRedisPasswordWithBracesTakenLiterally(t *testing.T) {
	srv := redistest.Start(t)
	if err := srv.Client(t).ConfigSet(context.Background(), "requirepass", "ab{cd}efx").Err(); err != nil {
		t.Fatal(err)
	}
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 0.01 2 {\n\tzone braces\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\tpassword \"ab{cd}ef{env.NOT_SET_ANYWHERE}x\"\n\t\ttimeout 5s\n\t}\n}", srv.Addr))
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

// secretPassword is the password of the address tests: no message may
// quote it, nor any part of it.
const secretPassword = "Hunter2Sekr3t"

// secretParts are pieces of secretPassword that no message may hold.
var secretParts = []string{"Hunter2", "Sekr3t", "unter2Se"}

func expectNoSecret(t *testing.T, what, text string) {
	t.Helper()
	for _, part := range secretParts {
		if strings.Contains(text, part) {
			t.Errorf("%s quotes the password (%q): %.600s", what, part, grepLines(text, part))
			return
		}
	}
}

// TestAddressErrorsNeverQuoteThePassword: every way an address can be
// wrong (port, database, scheme, host, escapes, a password with '/' or
// '@') is refused, at the parser and when provisioning, by a message that
// names the address with its password as xxxxx, and quotes no part of
// the password.
func TestAddressErrorsNeverQuoteThePassword(t *testing.T) {
	for _, c := range []struct{ address, shown string }{
		{"redis://:" + secretPassword + "@127.0.0.1:notaport", "redis://:xxxxx@127.0.0.1:notaport"},
		{"redis://alice:" + secretPassword + "@127.0.0.1:notaport", "redis://alice:xxxxx@127.0.0.1:notaport"},
		{"redis://:" + secretPassword + "@127.0.0.1:6379/notadb", "redis://:xxxxx@127.0.0.1:6379/notadb"},
		{"redis://:" + secretPassword + "@127.0.0.1:6379/1/2", "redis://:xxxxx@127.0.0.1:6379/1/2"},
		{"redis://:" + secretPassword + "@127.0.0.1:6379?db=x", "redis://:xxxxx@127.0.0.1:6379?db=x"},
		{"redis://:" + secretPassword + "@127.0.0.1:6379?nope=1", "redis://:xxxxx@127.0.0.1:6379?nope=1"},
		{"http://:" + secretPassword + "@127.0.0.1:6379", "http://:xxxxx@127.0.0.1:6379"},
		{"unix://:" + secretPassword + "@/tmp/redis.sock", "unix://:xxxxx@/tmp/redis.sock"},
		{"redis://:" + secretPassword + "@[::1", "redis://:xxxxx@[::1"},
		{"redis://:Hunter2/Sekr3t@127.0.0.1:notaport", "redis://:xxxxx@127.0.0.1:notaport"},
		{"redis://:Hunter2@Sekr3t@127.0.0.1:notaport", "redis://:xxxxx@127.0.0.1:notaport"},
		{"redis://alice:Hunter2%zzSekr3t@127.0.0.1:6379", "redis://alice:xxxxx@127.0.0.1:6379"},
		{"redis://Hunter2%zzSekr3t:x@127.0.0.1:6379", "redis://Hunter2%zzSekr3t:xxxxx@127.0.0.1:6379"}, // a user name is shown
		{"alice:" + secretPassword + "@127.0.0.1:6379", "xxxxx@127.0.0.1:6379"},
		{":" + secretPassword + "@127.0.0.1:6379", "xxxxx@127.0.0.1:6379"},
	} {
		_, err := checkAddress(c.address)
		if err == nil {
			t.Errorf("%s: accepted", c.shown)
			continue
		}
		if !strings.Contains(err.Error(), "'"+c.shown+"'") {
			t.Errorf("%s: error %q does not name the address as %s", c.shown, err, c.shown)
		}
		if strings.HasPrefix(c.address, "redis://Hunter2%zz") {
			continue // the user name is no secret; the test only wants it refused
		}
		expectNoSecret(t, c.shown+": checkAddress", err.Error())
		_, err = (&RedisConfig{Addresses: []string{c.address}}).withPlaceholders().options(tlsFiles{})
		if err == nil {
			t.Errorf("%s: options accepted it", c.shown)
			continue
		}
		expectNoSecret(t, c.shown+": options", err.Error())
		// And through the Caddyfile, given inline and with address.
		for _, form := range []string{"redis %s", "redis {\n\taddress %s\n}", "redis {\n\t%s\n}"} {
			_, err := parseTestCaddyfile("rate_limit 1 2 {\n" + fmt.Sprintf(form, c.address) + "\n}")
			if err == nil {
				t.Errorf("%s: the Caddyfile %q was accepted", c.shown, form)
				continue
			}
			expectNoSecret(t, c.shown+": Caddyfile", err.Error())
		}
	}
}

// TestPasswordSubdirectiveErrorsDoNotQuoteIt: a password (or Sentinel
// password) given with more than one value is refused without quoting
// any of them.
func TestPasswordSubdirectiveErrorsDoNotQuoteIt(t *testing.T) {
	for _, sub := range []string{"password", "sentinel_password"} {
		_, err := parseTestCaddyfile("rate_limit 1 2 {\n\tredis 127.0.0.1:6379 {\n\t\tmaster_name m\n\t\t" + sub + " Hunter2 Sekr3t\n\t}\n}")
		if err == nil || !strings.Contains(err.Error(), sub) {
			t.Errorf("%s with two values: %v, want an error naming %s", sub, err, sub)
			continue
		}
		expectNoSecret(t, sub, err.Error())
	}
}

// TestURLPasswordsTakenWhole: the password of a redis:// URL runs to the
// last '@' and is percent-decoded, so one holding '/', '@' or '#' works
// as written, as does an encoded one.
func TestURLPasswordsTakenWhole(t *testing.T) {
	for _, c := range []struct{ address, user, password, addr string }{
		{"redis://:ab/cd@127.0.0.1:6380", "", "ab/cd", "127.0.0.1:6380"},
		{"redis://u:a@b#c?d@127.0.0.1:6380/2", "u", "a@b#c?d", "127.0.0.1:6380"},
		{"rediss://u:p%40ss%25@cache:6380", "u", "p@ss%", "cache:6380"},
		{"redis://only-user@127.0.0.1", "only-user", "", "127.0.0.1:6379"},
	} {
		o, err := parseAddress(c.address)
		if err != nil {
			t.Errorf("%s: %v", c.address, err)
			continue
		}
		if o.Username != c.user || o.Password != c.password || o.Addr != c.addr {
			t.Errorf("%s: user %q password %q addr %q, want %q %q %q", c.address, o.Username, o.Password, o.Addr, c.user, c.password, c.addr)
		}
	}
}

// TestRedisSecretsKeptByteForByte: passwords, user names and Sentinel
// credentials keep every byte that is no known placeholder, backslashes
// before braces included (Caddy's Replacer.ReplaceKnown drops them); a
// known placeholder is replaced, and its value taken whole.
func TestRedisSecretsKeptByteForByte(t *testing.T) {
	t.Setenv("RL_TEST_SECRET", `v\{al}`)
	for _, c := range []struct{ written, want string }{
		{`ab\{cd`, `ab\{cd`},
		{`ab\{cd\}ef\\g`, `ab\{cd\}ef\\g`},
		{`{x}\{env.RL_TEST_SECRET}`, `{x}\v\{al}`},
		{`{{env.RL_TEST_SECRET}}`, `{v\{al}}`},
		{`pre{env.RL_TEST_SECRET}post{`, `pre` + `v\{al}` + `post{`},
		{`}{`, `}{`},
	} {
		got := (&RedisConfig{Password: c.written, Username: c.written, SentinelPassword: c.written,
			SentinelUsername: c.written, MasterName: "m"}).withPlaceholders()
		for _, v := range []string{got.Password, got.Username, got.SentinelPassword, got.SentinelUsername} {
			if v != c.want {
				t.Errorf("%q resolved to %q, want %q", c.written, v, c.want)
				break
			}
		}
	}
}

// literalSecret holds what Caddy's Replacer would take for escapes:
// backslashes before braces, a doubled backslash, braces around text
// that is no placeholder.
const literalSecret = `ab\{cd}e\\f{x}`

// TestRedisPasswordWithBackslashesAndBracesAuthenticatesAndLimits: a
// redis-server whose password and ACL user name hold backslashes and
// braces; the Caddyfile gives them as written, or through {env.*}. The
// handler authenticates and limits (a refused AUTH would answer -1 for
// remaining with on_error allow: limiting silently off).
func TestRedisPasswordWithBackslashesAndBracesAuthenticatesAndLimits(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	admin := srv.Client(t)
	const user = `us\{er}`
	if err := admin.Do(ctx, "ACL", "SETUSER", user, "on", ">"+literalSecret, "~*", "&*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	if err := admin.ConfigSet(ctx, "requirepass", literalSecret).Err(); err != nil {
		t.Fatal(err)
	}
	t.Setenv("RL_TEST_REDIS_PASSWORD", literalSecret)
	t.Setenv("RL_TEST_REDIS_USER", user)
	for i, credentials := range []string{
		"password " + literalSecret,
		"password {env.RL_TEST_REDIS_PASSWORD}",
		"username " + user + "\n\t\tpassword " + literalSecret,
		"username {env.RL_TEST_REDIS_USER}\n\t\tpassword {env.RL_TEST_REDIS_PASSWORD}",
	} {
		h := caddyfileHandler(t, fmt.Sprintf("rate_limit 0.01 2 {\n\tzone secret%d\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\t%s\n\t\ttimeout 5s\n\t}\n}",
			i, srv.Addr, credentials))
		expectBurstThenDeny(t, h, "k", 2)
	}
}

// TestSentinelCredentialsWithBackslashesAndBracesAuthenticate: the
// Sentinels require a user whose name and password hold backslashes and
// braces; sentinel_username and sentinel_password given as written reach
// them byte for byte, and the handler finds the master and limits.
func TestSentinelCredentialsWithBackslashesAndBracesAuthenticate(t *testing.T) {
	st := redistest.StartSentinel(t)
	ctx := context.Background()
	const user = `sent\{u}`
	for _, s := range st.Sentinels {
		c := redis.NewClient(&redis.Options{Addr: s.Addr})
		err := c.Do(ctx, "ACL", "SETUSER", user, "on", ">"+literalSecret, "+@all").Err()
		if err == nil {
			err = c.Do(ctx, "ACL", "SETUSER", "default", "off").Err() // only that user, from now on
		}
		c.Close()
		if err != nil {
			t.Fatalf("sentinel %s: %v", s.Addr, err)
		}
	}
	h := caddyfileHandler(t, fmt.Sprintf("rate_limit 0.01 2 {\n\tzone sentinelsecret\n\tkey {http.request.header.X-Key}\n\tredis %s {\n\t\tmaster_name %s\n\t\tsentinel_username %s\n\t\tsentinel_password %s\n\t\ttimeout 5s\n\t}\n}",
		strings.Join(st.SentinelAddrs, " "), st.MasterName, user, literalSecret))
	expectBurstThenDeny(t, h, "k", 2)
}

// TestWrongPasswordNeverAdmitsBesideTheRightOne: two zones on one Redis,
// one with its password and one with a wrong one (on_error deny), under
// concurrent requests: every request of the wrong one is refused (503),
// while the right one limits. Handlers share a Redis client only when
// every setting, the password included, is the same, so no credentials
// lend another zone their connections.
func TestWrongPasswordNeverAdmitsBesideTheRightOne(t *testing.T) {
	srv := redistest.Start(t)
	if err := srv.Client(t).ConfigSet(context.Background(), "requirepass", "the-right-one").Err(); err != nil {
		t.Fatal(err)
	}
	directive := func(zone, password string) string {
		return fmt.Sprintf("rate_limit 1000 1000 {\n\tzone %s\n\tkey {http.request.header.X-Key}\n\ton_error deny\n\tredis %s {\n\t\tpassword %s\n\t}\n}",
			zone, srv.Addr, password)
	}
	right := caddyfileHandler(t, directive("rightpass", "the-right-one"))
	wrong := caddyfileHandler(t, directive("wrongpass", secretPassword))
	if right.limiter == wrong.limiter {
		t.Fatal("the zones with two passwords share one Redis client")
	}
	var wg sync.WaitGroup
	var admitted, refused atomic.Int64
	stop := time.Now().Add(time.Second)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(stop); i++ {
				key := fmt.Sprint("k", w, "-", i%4)
				if status, remaining, _ := hit(right, key); status != 200 || remaining == "-1" {
					t.Errorf("the right password: %d remaining %q, want 200 limited by Redis", status, remaining)
					return
				}
				admitted.Add(1)
				if status, remaining, _ := hit(wrong, key); status != 503 || remaining != "-1" {
					t.Errorf("the wrong password: %d remaining %q, want 503 (on_error deny)", status, remaining)
					return
				}
				refused.Add(1)
			}
		}()
	}
	wg.Wait()
	t.Logf("%d admitted with the right password, %d refused with the wrong one", admitted.Load(), refused.Load())
}

// TestRedisPasswordAppearsInNoCaddyOutput runs the real Caddy binary (as
// xcaddy builds it) as an operator would, with a password in Redis
// addresses that are wrong in every way (port, database, scheme, a '/'
// in the password, no scheme), given literally and through {env.*}, with
// and without a user name: `caddy validate`, `caddy run`, and `/load`
// into a running Caddy. Then with addresses that parse but fail when
// used: a wrong password, a dead port, TLS to a plain server. No part of
// the password appears in anything Caddy prints or answers: stdout,
// stderr, its log at debug level, the /load answers, the admin API's.
func TestRedisPasswordAppearsInNoCaddyOutput(t *testing.T) {
	bin := caddyproc.Binary(t)
	srv := redistest.Start(t)
	if err := srv.Client(t).ConfigSet(context.Background(), "requirepass", "another-one").Err(); err != nil {
		t.Fatal(err)
	}
	site := `
http://127.0.0.1:{{http_port}} {
	rate_limit 10 20 {
		zone leak
		key {header.X-Key}
		on_error deny
		redis %s {
			timeout 300ms
		}
	}
	respond "ok"
}`
	wrong := []string{
		"redis://:" + secretPassword + "@127.0.0.1:notaport",
		"redis://alice:" + secretPassword + "@127.0.0.1:6379/notadb",
		"http://:" + secretPassword + "@127.0.0.1:6379",
		"redis://:Hunter2/Sekr3t@127.0.0.1:notaport",
		"alice:" + secretPassword + "@127.0.0.1:6379",
	}
	env := []string{"HOME=" + t.TempDir()}
	for i, a := range wrong {
		env = append(env, fmt.Sprintf("RL_TEST_REDIS_URL_%d=%s", i, a))
	}
	// Each wrong address, written in the Caddyfile and through {env.*}.
	var configs []string
	for i, a := range wrong {
		configs = append(configs, fmt.Sprintf(site, a), fmt.Sprintf(site, fmt.Sprintf("{env.RL_TEST_REDIS_URL_%d}", i)))
	}
	ports, err := testproc.FreePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	caddy := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Dir, cmd.Env = dir, append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	for i, config := range configs {
		path := filepath.Join(dir, fmt.Sprintf("Caddyfile%d", i))
		text := strings.NewReplacer("{{http_port}}", strconv.Itoa(ports[0]), "{{admin_port}}", strconv.Itoa(ports[1])).
			Replace(loggingCaddyfile("DEBUG", config))
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		commands := [][]string{{"validate", "--config", path, "--adapter", "caddyfile"}}
		if i < 2 { // one literal, one through {env.*}: each fails before serving
			commands = append(commands, []string{"run", "--config", path, "--adapter", "caddyfile"})
		}
		for _, args := range commands {
			out, err := caddy(args...)
			if err == nil {
				t.Errorf("caddy %s with %s: succeeded\n%s", args[0], wrong[i/2], out)
			}
			if !strings.Contains(out, "xxxxx") && !strings.Contains(out, "{env.") && i%2 == 0 {
				t.Errorf("caddy %s with %s: the output names no address:\n%s", args[0], wrong[i/2], out)
			}
			expectNoSecret(t, fmt.Sprintf("caddy %s with config %d", args[0], i), out)
		}
	}

	// /load into a running Caddy, then addresses that fail in use.
	for _, e := range env {
		name, value, _ := strings.Cut(e, "=")
		t.Setenv(name, value) // caddyproc passes the test's environment on
	}
	// Until the reload below, every request is answered "before the
	// reload": a 200 of this configuration is told from the routes'.
	inst := caddyproc.Start(t, loggingCaddyfile("DEBUG", "http://127.0.0.1:{{http_port}} {\n\trespond \"before the reload\"\n}"))
	for i, config := range configs {
		err := inst.Load(loggingCaddyfile("DEBUG", config))
		if err == nil {
			t.Errorf("/load of config %d (%s): accepted", i, wrong[i/2])
			continue
		}
		expectNoSecret(t, fmt.Sprintf("/load of config %d", i), err.Error())
	}
	failing := strings.Join([]string{
		"redis://:" + secretPassword + "@" + srv.Addr,       // WRONGPASS
		"redis://alice:" + secretPassword + "@" + deadRedis, // refused
		"rediss://:" + secretPassword + "@" + srv.Addr,      // TLS to a plain server
	}, " ")
	inst.Reload(t, loggingCaddyfile("DEBUG", fmt.Sprintf(`
http://127.0.0.1:{{http_port}} {
	route /wrongpass {
		rate_limit 10 20 {
			zone wrongpass
			key {header.X-Key}
			on_error deny
			redis %[1]s {
				timeout 500ms
			}
		}
	}
	route /dead {
		rate_limit 10 20 {
			zone dead
			key {header.X-Key}
			on_error deny
			redis %[2]s {
				timeout 500ms
			}
		}
	}
	route /tls {
		rate_limit 10 20 {
			zone tls
			key {header.X-Key}
			on_error deny
			redis %[3]s {
				timeout 500ms
			}
		}
	}
	respond "ok"
}`, strings.Fields(failing)[0], strings.Fields(failing)[1], strings.Fields(failing)[2])))
	client := caddyClient(t)
	admin := fmt.Sprintf("http://127.0.0.1:%d", inst.AdminPort)
	for _, zone := range []string{"wrongpass", "dead", "tls"} {
		for range 7 { // past the breaker's 5 failures in a row
			resp, body := send(t, client, inst.URL+"/"+zone, "X-Key", "k")
			if resp.StatusCode != 503 {
				t.Errorf("%s: %d %q, want 503 (on_error deny)", zone, resp.StatusCode, body)
			}
			expectNoSecret(t, zone+": the response", body+fmt.Sprint(resp.Header))
		}
		_, _, answer := adminCall(t, admin, http.MethodGet, bucketsPath(zone, q("header.X-Key", "k")))
		expectNoSecret(t, zone+": the admin API's answer", string(answer))
		_, _, answer = adminCall(t, admin, http.MethodDelete, bucketsPath(zone, q("header.X-Key", "k")))
		expectNoSecret(t, zone+": the admin API's answer to DELETE", string(answer))
	}
	log := testproc.ReadFrom(inst.LogFile, 0)
	for _, cause := range []string{"WRONGPASS", "connection refused", "tls"} {
		if !strings.Contains(log, cause) {
			t.Errorf("Caddy's log does not say %q: the failures did not happen as meant", cause)
		}
	}
	expectNoSecret(t, "Caddy's log", log)
}
