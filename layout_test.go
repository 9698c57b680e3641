package ratelimit

import (
	"go/parser"
	"go/token"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// The package layout, as the compiler keeps it: the root is the Caddy
// face (config, parser, composition, request path, headers, admin,
// metrics); kinds of limit, stores, leases and layers are internal
// packages over one vocabulary (internal/limit), and each imports only
// what its row below allows. A kind never imports a store, a store never
// a layer or a lease, nothing imports the root. These tests read the
// sources' import lines, so they run in the fast tier.

const modulePath = "github.com/caddy-redis/ratelimit"

// mayImport lists, for each internal package (a path under internal/, a
// trailing "/" for every package below it), the module's packages it may
// import; any other of the module's is a wrong way. Packages outside the
// module (caddy, go-redis, the standard library) are not judged.
var mayImport = map[string][]string{
	// Leaves: they know nothing of limits.
	"calendar":    nil,
	"scan":        nil,
	"logs":        nil,
	"keys":        {"logs"},
	"cost":        {"scan", "logs"},
	"requestbody": {"scan", "logs"},
	"redisbatch":  {"redistest", "testproc"}, // (its tests)
	"redisresets": {"redistest"},             // (its tests)
	// The vocabulary every part speaks.
	"limit": {"cost", "keys", "logs", "scan"},
	// Kinds speak the vocabulary; no kind imports a store, a layer or
	// another kind.
	"kind/": {"limit", "cost", "keys", "logs", "scan", "calendar"},
	// Stores keep buckets of any kind, through the vocabulary.
	"memstore":   {"limit", "cost", "keys", "logs", "scan"},
	"redisstore": {"limit", "cost", "keys", "logs", "scan", "redisbatch", "redisresets"},
	// Leases are a strategy over the Redis store; layers wrap any store.
	"lease": {"limit", "cost", "keys", "logs", "scan", "redisbatch", "redisstore"},
	"layer": {"limit", "cost", "keys", "logs", "scan"},
	// Test support: processes and shared store tests.
	"caddyproc": {"testproc"},
	"redistest": {"testproc"},
	"testproc":  nil,
	"boundtest": nil,
	"storetest": {"limit", "cost", "keys", "logs", "scan", "redistest", "testproc"},
	// A command, not a part: the tests' Caddy, built with the plugin.
	"caddyproc/caddy": {"root"},
}

func allowedImports(pkg string) ([]string, bool) {
	if allowed, ok := mayImport[pkg]; ok {
		return allowed, true
	}
	for prefix, allowed := range mayImport {
		if strings.HasSuffix(prefix, "/") && strings.HasPrefix(pkg, prefix) {
			return allowed, true
		}
	}
	return nil, false
}

// internalImports maps each package under internal/ (its path below
// internal/) to the module's packages its files import, test files
// included, with the file that imports each.
func internalImports(t *testing.T) map[string]map[string]string {
	t.Helper()
	imports := map[string]map[string]string{}
	err := filepath.WalkDir("internal", func(file string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(file, ".go") {
			return err
		}
		parsed, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		pkg := filepath.ToSlash(strings.TrimPrefix(filepath.Dir(file), "internal"+string(filepath.Separator)))
		if strings.HasSuffix(parsed.Name.Name, "_test") {
			return nil // an external test package may import what it tests
		}
		if imports[pkg] == nil {
			imports[pkg] = map[string]string{}
		}
		for _, imp := range parsed.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if p == modulePath || strings.HasPrefix(p, modulePath+"/") {
				imports[pkg][strings.TrimPrefix(strings.TrimPrefix(p, modulePath), "/internal/")] = file
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return imports
}

func TestEachInternalPackageImportsOnlyWhatItsLayerMay(t *testing.T) {
	imports := internalImports(t)
	for pkg, imported := range imports {
		allowed, known := allowedImports(pkg)
		if !known {
			t.Errorf("internal/%s is in no row of mayImport: say what it may import", pkg)
			continue
		}
		for imp, file := range imported {
			switch {
			case imp == "" && contains(allowed, "root"):
			case imp == "":
				t.Errorf("%s imports the root package: nothing below the Caddy face may", file)
			case imp == pkg:
			case !contains(allowed, imp) && !contains(allowed, path.Dir(imp)+"/"):
				t.Errorf("%s (internal/%s) imports internal/%s, which its layer may not", file, pkg, imp)
			}
		}
	}
}

// TestTheLayoutHasItsParts: the vocabulary, the kinds, the stores, the
// lease and the layers are packages of their own, not files of the root.
func TestTheLayoutHasItsParts(t *testing.T) {
	imports := internalImports(t)
	for _, pkg := range []string{"limit", "kind/tokenbucket", "kind/quota", "kind/concurrent",
		"memstore", "redisstore", "lease", "layer", "cost", "keys", "logs", "requestbody"} {
		if _, ok := imports[pkg]; !ok {
			t.Errorf("no package internal/%s", pkg)
		}
	}
}

// concreteParts are the kinds, stores, the lease and the layers: the
// root meets them in its composition file only.
var concreteParts = []string{"kind/", "memstore", "redisstore", "lease", "layer"}

// TestOnlyTheCompositionNamesConcreteParts: of the root's files, only
// compose.go imports a kind, a store, the lease or a layer; every other
// file speaks internal/limit's words, so that adding a kind or a store
// changes what compose.go lists, not the request path, the headers or
// the admin API.
func TestOnlyTheCompositionNamesConcreteParts(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range files {
		if file == "compose.go" || strings.HasSuffix(file, "_test.go") {
			continue
		}
		parsed, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range parsed.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			part := strings.TrimPrefix(p, modulePath+"/internal/")
			for _, c := range concreteParts {
				if part == c || strings.HasSuffix(c, "/") && strings.HasPrefix(part, c) {
					t.Errorf("%s imports internal/%s: only compose.go names a concrete kind, store, lease or layer", file, part)
				}
			}
		}
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
