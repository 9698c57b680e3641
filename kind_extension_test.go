package ratelimit

import (
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// A kind of limit defined here, in a test file, and nowhere else: an
// allowance of tokens that never refills. That it runs end to end
// through the in-process store, decided, counted and described in the
// headers like a built-in kind, shows that a kind needs nothing from the
// root but internal/limit's words and a line in kindConfigs.

// allowance is the test's kind: a key may take at most its allowance
// (the burst's place) of tokens, ever; the state of a key held in the
// process is the tokens it used.
type allowance struct{}

var (
	_ limit.Kind       = allowance{}
	_ limit.Arithmetic = allowance{}
)

func (allowance) BurstName() string { return "allowance" }

func (allowance) ResolveValues(_, burst, requested string) (limit.Values, bool, error) {
	n, err := strconv.ParseInt(burst, 10, 64)
	if err != nil || n < 0 {
		return limit.Values{}, false, limit.BadValue("allowance", burst, "is not a whole number, 0 or more")
	}
	cost := int64(1)
	if requested != "" {
		if cost, err = strconv.ParseInt(requested, 10, 64); err != nil || cost < 1 {
			return limit.Values{}, false, limit.BadValue("requested_tokens", requested, "is not a whole number, 1 or more")
		}
	}
	return limit.Values{Burst: n, Requested: cost}, false, nil
}

func (allowance) ScriptArgs(v limit.Values) [3]any                                  { return [3]any{v.Burst, v.Requested, nil} }
func (allowance) Begin(b limit.Bucket, s limit.Shared) (limit.Bucket, limit.Shared) { return b, s }
func (allowance) AppendArgs(args []any, b limit.Bucket) []any                       { return append(args, b.Args[:2]...) }
func (allowance) ReplyWords() int                                                   { return 0 }
func (allowance) ReadReply(b limit.Bucket, _ []int64, _ int) (limit.Bucket, error) {
	return b, nil
}
func (allowance) Refused(b limit.Bucket) limit.Bucket { return b }

// Facts: an allowance has no rate and no window; its unit says so.
func (allowance) Facts(b limit.Bucket) limit.Facts {
	return limit.Facts{Burst: b.Values.Burst, Requested: b.Values.Requested, Unit: "tokens-ever", Reset: b.RetryAfter}
}

func (allowance) LimitInfo(l *limit.Limit) limit.LimitInfo {
	li := l.Info()
	li.BurstCapacity, li.RequestedTokens = l.Burst, l.Cost
	return li
}

func (allowance) BucketInfo(b limit.Bucket, v limit.View) limit.BucketInfo {
	return limit.TokenInfo(b, v)
}

func used(state limit.State, ok bool) float64 {
	if !ok {
		return 0
	}
	return state.Tokens
}

func (allowance) Holds(state limit.State, ok bool, _ time.Time, _ int64, b limit.Bucket) (limit.Bucket, bool) {
	return b, used(state, ok)+float64(b.Values.Requested) <= float64(b.Values.Burst)
}

// never is the wait of a bucket that does not refill: a day, as far as
// Retry-After goes.
const never = 24 * time.Hour

func (allowance) Take(state limit.State, ok bool, _ time.Time, _ int64, b limit.Bucket, allowed bool) (limit.Bucket, limit.State, bool) {
	spent := used(state, ok)
	if allowed {
		spent += float64(b.Values.Requested)
	}
	b.Remaining, b.RetryAfter = int64(float64(b.Values.Burst)-spent), 0
	if spent+float64(b.Values.Requested) > float64(b.Values.Burst) {
		b.RetryAfter = never
	}
	return b, limit.State{Tokens: spent, Expires: math.MaxInt64}, allowed
}

func (allowance) Peek(state limit.State, ok bool, _ time.Time, _ int64, b limit.Bucket) limit.View {
	return limit.View{Tokens: float64(b.Values.Burst) - used(state, ok)}
}

// withAllowance adds the test's kind to kindConfigs for the test: a
// handler of zone "allowance" has one limit of it, named "ever", of 3
// tokens.
func withAllowance(t *testing.T) {
	saved := kindConfigs
	t.Cleanup(func() { kindConfigs = saved })
	kindConfigs = append(kindConfigs[:len(kindConfigs):len(kindConfigs)], kindConfig{
		configs: func(h *Handler) []limitConfig {
			if h.Zone != "allowance" {
				return nil
			}
			return []limitConfig{{Limit: Limit{Name: "ever", BurstCapacity: "3"}, what: "allowance",
				newKind: func() (limit.Kind, error) { return allowance{}, nil }}}
		},
		check: func(*Handler, map[string]bool) error { return nil },
	})
}

func TestAKindDefinedInATestRunsThroughTheInProcessStore(t *testing.T) {
	withAllowance(t)
	h := provision(t, &Handler{Zone: "allowance", Key: "{http.request.header.X-Key}", Store: storeMemory, Headers: "both"})
	if len(h.limits) != 1 || h.limits[0].Name != "ever" {
		t.Fatalf("limits %v: want the test kind's one limit", h.limits)
	}
	for i := 1; i <= 3; i++ {
		status, header := serve(t.Context(), h, "a")
		if want := strconv.Itoa(3 - i); status != 200 || header.Get("X-RateLimit-Remaining") != want {
			t.Fatalf("request %d: %d remaining %q, want 200 with %s", i, status, header.Get("X-RateLimit-Remaining"), want)
		}
	}
	status, header := serve(t.Context(), h, "a")
	if status != 429 || header.Get("Retry-After") != strconv.Itoa(int(never/time.Second)) {
		t.Fatalf("after the allowance: %d Retry-After %q, want 429 with %d", status, header.Get("Retry-After"), int(never/time.Second))
	}
	if policy := header.Get("RateLimit-Policy"); policy != `"allowance.ever";q=3;qu="tokens-ever"` {
		t.Errorf("RateLimit-Policy %q: want the kind's facts, formatted by the handler", policy)
	}
	if status, header := serve(t.Context(), h, "b"); status != 200 || header.Get("X-RateLimit-Remaining") != "2" {
		t.Errorf("another key: %d remaining %q, want 200 with 2: a bucket of its own", status, header.Get("X-RateLimit-Remaining"))
	}
	view, err := h.store.Peek(t.Context(), limit.Bucket{Limit: h.limits[0], Key: h.limits[0].KeyPrefix + "a" + h.limits[0].KeySuffix,
		Values: h.limits[0].Values})
	if err != nil || view.Tokens != 0 {
		t.Errorf("peek of a: %+v, %v; want 0 tokens left", view, err)
	}
}
