package ratelimit

import (
	"bufio"
	"fmt"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The package's shape, as issue 29 states it: each kind of limit, store
// and layer is named only in its own files, the Caddyfile parser and the
// config's fields (module.go: the Handler's fields and their docs,
// Provision, Validate and Cleanup, which read them; checks.go: the checks
// of settings of several parts together); no file is over 500 lines;
// the internal packages do not import this one. These tests read the
// source, so they run in the fast tier.

// shapeParts are the kinds, stores and layers, each with the words that
// name it and its own files.
var shapeParts = []struct {
	name  string
	words *regexp.Regexp
	own   []string
}{
	{"the quota (a kind)", regexp.MustCompile(`(?i)\bquota`), []string{"quota.go", "quotaconfig.go"}},
	{"the concurrent limit (a kind)", regexp.MustCompile(`(?i)\bconcurren|\bslot`), []string{"concurrent.go", "slotsmemory.go"}},
	{"leases (a layer)", regexp.MustCompile(`(?i)\blease`), []string{"lease.go"}},
	{"the deny cache (a layer)", regexp.MustCompile(`(?i)deny ?cache|denyLayer`), []string{"denycache.go"}},
	{"on_error (a layer)", regexp.MustCompile(`(?i)on_?error`), []string{"onerror.go"}},
	{"the memory store", regexp.MustCompile(`(?i)memory ?store|store ?memory|memstore|inProcess`), []string{"memstore.go", "slotsmemory.go"}},
	// Leases are a strategy over the Redis store (its client, its reply);
	// redisconfig.go is its config, turned into the package's options.
	{"the Redis store", regexp.MustCompile(`(?i)redis ?store`), []string{"redisstore.go", "redisconfig.go", "lease.go"}},
}

// shapeConfigFiles may name every part: the parser, the config and the
// checks that judge the settings of several parts together (checks.go).
var shapeConfigFiles = []string{"caddyfile.go", "caddyfilefields.go", "caddyfileredis.go", "module.go", "checks.go"}

// notAPart are phrases that use a part's words for something else: a
// Redis Cluster's hash slots.
var notAPart = regexp.MustCompile(`(?i)hash slots?|slot groups?|slot map|serves no slots|redisbatch\.Slot|\.Slot\(|clusterSlot`)

func shapeSources(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var sources []string
	for _, f := range files {
		if !strings.HasSuffix(f, "_test.go") {
			sources = append(sources, f)
		}
	}
	return sources
}

func TestEachKindStoreAndLayerIsNamedOnlyInItsOwnFiles(t *testing.T) {
	sources := shapeSources(t)
	for _, part := range shapeParts {
		t.Run(part.name, func(t *testing.T) {
			for _, f := range sources {
				if contains(part.own, f) || contains(shapeConfigFiles, f) {
					continue
				}
				for _, hit := range namingLines(t, f, part.words) {
					t.Errorf("%s names %s: %s", f, part.name, hit)
				}
			}
		})
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// namingLines are the lines of file f (numbered) that words match once
// the phrases of notAPart are taken out.
func namingLines(t *testing.T, f string, words *regexp.Regexp) []string {
	t.Helper()
	file, err := os.Open(f)
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	var hits []string
	lines := bufio.NewScanner(file)
	lines.Buffer(nil, 1<<20)
	for n := 1; lines.Scan(); n++ {
		if words.MatchString(notAPart.ReplaceAllString(lines.Text(), "")) {
			hits = append(hits, fmt.Sprintf("%d: %s", n, strings.TrimSpace(lines.Text())))
		}
	}
	if err := lines.Err(); err != nil {
		t.Fatal(err)
	}
	return hits
}

func TestNoSourceFileIsOver500Lines(t *testing.T) {
	for _, f := range shapeSources(t) {
		text, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(string(text), "\n"); n > 500 {
			t.Errorf("%s has %d lines; split it where its concerns part", f, n)
		}
	}
}

// TestInternalPackagesDoNotImportTheHandler: the compiler keeps the
// direction only if no internal package imports the root one, directly;
// an indirect import would go through another internal package, which
// this checks too.
func TestInternalPackagesDoNotImportTheHandler(t *testing.T) {
	const root = "github.com/caddy-redis/ratelimit"
	dirs, err := filepath.Glob("internal/*")
	if err != nil {
		t.Fatal(err)
	}
	packages := 0
	for _, dir := range dirs {
		files, _ := filepath.Glob(filepath.Join(dir, "*.go"))
		if len(files) == 0 {
			continue
		}
		packages++
		for _, f := range files {
			parsed, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
			if err != nil {
				t.Fatal(err)
			}
			for _, imp := range parsed.Imports {
				if path, _ := strconv.Unquote(imp.Path.Value); path == root {
					t.Errorf("%s imports %s", f, root)
				}
			}
		}
	}
	if packages < 3 {
		t.Errorf("%d internal packages, want at least 3", packages)
	}
}
