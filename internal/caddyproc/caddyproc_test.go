package caddyproc

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

func body(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestStartReloadStop(t *testing.T) {
	site := func(text string) string {
		return Caddyfile("http://127.0.0.1:{{http_port}} {\n\trespond \"" + text + "\"\n}\n")
	}
	inst := Start(t, site("one"))
	if got := body(t, inst.URL); got != "one" {
		t.Fatalf("got %q, want one", got)
	}
	inst.Reload(t, site("two"))
	if got := body(t, inst.URL); got != "two" {
		t.Fatalf("after the reload: got %q, want two", got)
	}
	// The plugin is in the binary, and a refused config names its error.
	err := inst.Load(Caddyfile("http://127.0.0.1:{{http_port}} {\n\trate_limit 1 1 {\n\t\tbogus\n\t}\n}\n"))
	if err == nil || !strings.Contains(err.Error(), "unrecognized rate_limit subdirective 'bogus'") {
		t.Fatalf("loading a bad rate_limit: %v", err)
	}
	if got := body(t, inst.URL); got != "two" {
		t.Fatalf("after a refused reload: got %q, want two", got)
	}
	pid := inst.PID()
	if !inst.Stop() {
		t.Fatal("Caddy did not stop on SIGTERM")
	}
	if alive(pid) {
		t.Fatalf("Caddy (pid %d) still running after Stop", pid)
	}
}
