package testproc

import "testing"

// SkipShort skips the test under `go test -short`, the fast tier that
// runs without any process or server: every harness entry point that
// starts redis-server, builds or runs Caddy, or serves Redis's stand-in
// calls it (redistest, caddyproc, and the root package's caddytest
// helper), so a test that needs one is skipped by the harness, never by
// a testing.Short() line of its own. what names the process, for the
// skip message.
func SkipShort(tb testing.TB, what string) {
	tb.Helper()
	if testing.Short() {
		tb.Skipf("-short: the test needs %s", what)
	}
}
