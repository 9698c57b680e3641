package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/textproto"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/logs"
	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI serves, on Caddy's admin endpoint, what operators ask of a
// rate limit: the zones of the running config, and one client's buckets,
// to see or to reset.
//
//	GET    /rate_limit/zones
//	GET    /rate_limit/zones/<zone>/buckets?<placeholder>=<value>...
//	DELETE /rate_limit/zones/<zone>/buckets?<placeholder>=<value>...
//
// A client's buckets are named by the values of the placeholders of the
// zone's key templates (`?client_ip=2001:db8::7`,
// `?http.request.header.X-API-Key=abc`), masked and escaped as a
// request's would be. Reading takes no tokens and writes nothing (a
// read-only script); DELETE makes the buckets full and has every Caddy
// instance that shares the Redis drop its cached denials of them. It is
// as reachable as the admin endpoint, which should stay private.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.rate_limit",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the admin routes of the rate limit.
func (adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/rate_limit/", Handler: caddy.AdminHandlerFunc(serveAdmin)}}
}

// loadedZones holds the provisioned handlers by zone: those of the
// running config (and, during a reload, of the one it replaces).
var loadedZones = struct {
	sync.Mutex
	byZone map[string][]*Handler
}{byZone: map[string][]*Handler{}}

func registerZone(h *Handler) {
	loadedZones.Lock()
	defer loadedZones.Unlock()
	loadedZones.byZone[h.Zone] = append(loadedZones.byZone[h.Zone], h)
}

func unregisterZone(h *Handler) {
	loadedZones.Lock()
	defer loadedZones.Unlock()
	handlers := slices.DeleteFunc(loadedZones.byZone[h.Zone], func(o *Handler) bool { return o == h })
	if len(handlers) == 0 {
		delete(loadedZones.byZone, h.Zone)
	} else {
		loadedZones.byZone[h.Zone] = handlers
	}
}

// zoneLimits are the distinct limits of a zone's handlers, newest first,
// with the handler of each.
func zoneLimits(zone string) (limits []*limit.Limit, handlers []*Handler) {
	loadedZones.Lock()
	defer loadedZones.Unlock()
	seen := map[string]bool{}
	byZone := loadedZones.byZone[zone]
	for i := len(byZone) - 1; i >= 0; i-- {
		for _, l := range byZone[i].limits {
			if id := l.KeyPrefix + "\x00" + l.KeySuffix; !seen[id] {
				seen[id] = true
				limits, handlers = append(limits, l), append(handlers, byZone[i])
			}
		}
	}
	return limits, handlers
}

func serveAdmin(w http.ResponseWriter, r *http.Request) error {
	parts := strings.Split(strings.Trim(strings.TrimPrefix(r.URL.Path, "/rate_limit/"), "/"), "/")
	switch {
	case len(parts) == 1 && parts[0] == "zones":
		if r.Method != http.MethodGet {
			return methodNotAllowed(w, r, http.MethodGet)
		}
		return writeJSON(w, listZones())
	case len(parts) == 3 && parts[0] == "zones" && parts[2] == "buckets":
		switch r.Method {
		case http.MethodGet, http.MethodDelete:
			return serveBuckets(w, r, parts[1])
		}
		return methodNotAllowed(w, r, http.MethodGet, http.MethodDelete)
	}
	return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("resource not found: %s", r.URL.Path)}
}

// methodNotAllowed refuses the request's method, with the Allow header
// that HTTP requires of a 405.
func methodNotAllowed(w http.ResponseWriter, r *http.Request, allowed ...string) error {
	w.Header().Set("Allow", strings.Join(allowed, ", "))
	return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed,
		Err: fmt.Errorf("method not allowed: %s (this resource takes %s)", logs.Cut(r.Method), strings.Join(allowed, " and "))}
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

// zoneInfo describes a zone and its limits, as GET /rate_limit/zones
// answers.
type zoneInfo struct {
	Zone   string            `json:"zone"`
	Store  string            `json:"store"`
	Limits []limit.LimitInfo `json:"limits"`
}

func listZones() []zoneInfo {
	loadedZones.Lock()
	names := make([]string, 0, len(loadedZones.byZone))
	for zone := range loadedZones.byZone {
		names = append(names, zone)
	}
	loadedZones.Unlock()
	slices.Sort(names)
	zones := make([]zoneInfo, 0, len(names))
	for _, zone := range names {
		limits, handlers := zoneLimits(zone)
		if len(limits) == 0 {
			continue
		}
		info := zoneInfo{Zone: zone, Store: handlers[0].Store}
		for _, l := range limits {
			info.Limits = append(info.Limits, l.Kind.LimitInfo(l))
		}
		zones = append(zones, info)
	}
	return zones
}

// adminTimeout bounds the Redis calls of one admin request.
const adminTimeout = 5 * time.Second

// serveBuckets shows (GET) or resets (DELETE) one client's buckets.
func serveBuckets(w http.ResponseWriter, r *http.Request, zone string) error {
	limits, handlers := zoneLimits(zone)
	if len(limits) == 0 {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("zone '%s' is in no rate_limit handler of the running config", zone)}
	}
	buckets, exempt, err := clientBuckets(limits, r.URL.Query())
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	infos := make([]limit.BucketInfo, 0, len(limits))
	var reset []string
	for i, l := range limits {
		h := handlers[i]
		b, ok := buckets[l]
		if !ok {
			if exempt[l] {
				infos = append(infos, limit.BucketInfo{Limit: l.Name, Exempt: true})
			}
			continue
		}
		if b.Values.Burst == 0 {
			infos = append(infos, limit.BucketInfo{Limit: l.Name, Blocked: true})
			continue
		}
		if r.Method == http.MethodDelete {
			if err := h.store.Reset(ctx, b); err != nil {
				return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: fmt.Errorf("resetting %s: %w", b.Key, err)}
			}
			reset = append(reset, b.Key)
			continue
		}
		view, err := h.store.Peek(ctx, b)
		if err != nil {
			return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: fmt.Errorf("reading %s: %w", b.Key, err)}
		}
		infos = append(infos, l.Kind.BucketInfo(b, view))
	}
	if r.Method == http.MethodDelete {
		return writeJSON(w, struct {
			Zone  string   `json:"zone"`
			Reset []string `json:"reset"`
		}{zone, reset})
	}
	return writeJSON(w, struct {
		Zone    string             `json:"zone"`
		Buckets []limit.BucketInfo `json:"buckets"`
	}{zone, infos})
}

// placeholderName is a placeholder as a key template names it, from the
// name a query gives: Caddyfile shorthands (`client_ip`, `remote_host`,
// `header.X-Key`) stand for the names they expand to, and header names
// are matched as HTTP matches them, in any case.
func placeholderName(name string) string {
	switch {
	case name == "client_ip":
		return "http.vars.client_ip"
	case name == "remote_host":
		return "http.request.remote.host"
	case strings.HasPrefix(name, "header."):
		name = "http.request.header." + strings.TrimPrefix(name, "header.")
	}
	if rest, ok := strings.CutPrefix(name, "http.request.header."); ok {
		return "http.request.header." + textproto.CanonicalMIMEHeaderKey(rest)
	}
	return name
}

var paramPlaceholder = regexp.MustCompile(`\{([^{}]+)\}`)

// clientBuckets resolves, from a query's placeholder values, a client's
// bucket for every limit whose placeholders the query gives all of. It
// refuses a query that names a placeholder no limit uses, gives one
// twice (by one name or by two spellings of it: which value would count
// is anyone's guess, and a DELETE could reset another client), or gives
// no limit all it needs.
func clientBuckets(limits []*limit.Limit, query url.Values) (map[*limit.Limit]limit.Bucket, map[*limit.Limit]bool, error) {
	given := map[string]string{} // by the placeholder's name, as placeholderName gives it
	spelled := map[string]string{}
	for _, name := range slices.Sorted(maps.Keys(query)) {
		if n := len(query[name]); n > 1 {
			return nil, nil, fmt.Errorf("query parameter '%s' is given %d times: give each placeholder once", logs.Cut(name), n)
		}
		canonical := placeholderName(name)
		if other, ok := spelled[canonical]; ok {
			return nil, nil, fmt.Errorf("query parameters '%s' and '%s' both name the placeholder %s: give it once", logs.Cut(other), logs.Cut(name), logs.Cut(canonical))
		}
		given[canonical], spelled[canonical] = query[name][0], name
	}
	// Each value is set under the name the config writes, which may differ
	// from the canonical one that the query's name maps to: a header's name
	// in another case (`X-API-Key` in the config, `X-Api-Key` canonical),
	// `client_ip` for `http.vars.client_ip`.
	repl := caddy.NewReplacer()
	used := map[string]bool{}
	buckets, exempt := map[*limit.Limit]limit.Bucket{}, map[*limit.Limit]bool{}
	var missing []string
	for _, l := range limits {
		needs := l.Template.Placeholders() // as the config writes them
		for _, p := range []Param{l.Rate, l.Burst, l.Cost} {
			for _, m := range paramPlaceholder.FindAllStringSubmatch(string(p), -1) {
				needs = append(needs, m[1])
			}
		}
		complete := true
		for _, written := range needs {
			name := placeholderName(written)
			used[name] = true
			value, ok := given[name]
			if !ok {
				complete = false
				missing = append(missing, name)
				continue
			}
			repl.Set(written, value)
		}
		if !complete {
			continue
		}
		values, isExempt, err := l.Values, l.Exempt, error(nil)
		if !l.Fixed {
			values, isExempt, err = l.Resolve(repl, nil)
		}
		if err != nil {
			return nil, nil, err
		}
		if isExempt {
			exempt[l] = true
			continue
		}
		key := l.Template.ReplacerKey(repl, l.KeyPrefix, l.KeySuffix)
		if key == "" {
			return nil, nil, fmt.Errorf("a placeholder of key '%s' is empty", l.KeyText)
		}
		buckets[l], _ = l.Kind.Begin(limit.Bucket{Limit: l, Key: key, Values: values, Args: l.Kind.ScriptArgs(values)}, limit.Shared{})
	}
	for name := range given {
		if !used[name] {
			return nil, nil, fmt.Errorf("unknown placeholder '%s': the zone's keys and values use %s", logs.Cut(name), strings.Join(sortedKeys(used), ", "))
		}
	}
	if len(buckets) == 0 && len(exempt) == 0 {
		slices.Sort(missing)
		return nil, nil, fmt.Errorf("missing placeholder(s) %s: give each as a query parameter, e.g. ?%s=<value>",
			strings.Join(slices.Compact(missing), ", "), missing[0])
	}
	return buckets, exempt, nil
}

func sortedKeys(m map[string]bool) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// Interface guards
var _ caddy.AdminRouter = (*adminAPI)(nil)
