package lease_test

// An instance of the lease layer as a handler stacks it (its compose.go):
// Leases.Layer over the Redis store, on a redistest server, with its
// give-back loop; and what its tests read of Redis.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/lease"
	"github.com/caddy-redis/ratelimit/internal/limit"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// leaseRate refills a bucket by 0.001 token a second: within a test's
// few seconds a bucket's arithmetic is exact to 0.01.
const (
	leaseRate  = 0.001
	leaseSlack = 0.01
)

// nopReports is a store's Reporter that keeps nothing.
type nopReports struct{}

func (nopReports) Answered(time.Duration)                 {}
func (nopReports) Failed(error)                           {}
func (nopReports) Overloaded(error)                       {}
func (nopReports) KindFailed(limit.KindError)             {}
func (nopReports) Warn(string, error, ...zap.Field)       {}
func (nopReports) Debug(string)                           {}
func (nopReports) Charged(*limit.Limit, float64, float64) {}
func (nopReports) SettleFailed(error)                     {}
func (nopReports) Refilled([]string)                      {}
func (nopReports) ForgetDenials([]string)                 {}

// instance is one instance's leases over its own client to a Redis, as
// a handler with `lease max hold` stacks them, for one limit's values.
type instance struct {
	ls     *lease.Leases
	store  limit.Store
	values limit.Values
	zone   string
}

// newInstance is an instance limiting with values in zone, its leases
// of at most max tokens held for hold, on the Redis at addr; closed
// (what it holds given back) once the test ends.
func newInstance(t *testing.T, addr, zone string, values limit.Values, max int64, hold time.Duration) *instance {
	t.Helper()
	const timeout = 2 * time.Second
	client := redisstore.New(redisstore.Options{Redis: &redis.UniversalOptions{Addrs: []string{addr}}, Timeout: timeout, DialTimeout: timeout})
	t.Cleanup(func() { _ = client.Destruct() })
	ls := lease.New(lease.Options{MaxTokens: max, Hold: hold, Timeout: timeout, Client: client, Report: nopReports{}})
	go ls.GiveBackEvery() // as the handler runs it
	t.Cleanup(ls.Close)   // before the client's Destruct: it gives back
	return &instance{ls: ls, store: ls.Layer(redisstore.NewStore(client, nil, false, nopReports{})), values: values, zone: zone}
}

// key is the bucket key of client in the instance's zone.
func (in *instance) key(client string) string { return "rate_limit:" + in.zone + "|" + client }

// take sends one request of client through the instance's stack, and
// says whether it was admitted, and the whole tokens the answer says
// remain (what the handler's X-RateLimit-Remaining shows).
func (in *instance) take(client string) (allowed bool, remaining int64, err error) {
	b := limit.Bucket{Key: in.key(client), Values: in.values, Args: tokenbucket.Args(in.values)}
	r := &limit.Call{Sent: time.Now(), Buckets: []limit.Bucket{b}}
	allowed, err = in.store.Take(context.Background(), r)
	return allowed, r.Buckets[0].Remaining, err
}

// hit is take of a request that Redis must not fail.
func (in *instance) hit(t *testing.T, client string) bool {
	t.Helper()
	allowed, _, err := in.take(client)
	if err != nil {
		t.Fatalf("request of %s: %v", client, err)
	}
	return allowed
}

// callsOf counts the script calls a function costs.
func callsOf(t *testing.T, rdb *redis.Client, f func()) int64 {
	t.Helper()
	before := redistest.ScriptCalls(t, rdb)
	f()
	return redistest.ScriptCalls(t, rdb) - before
}

// setBucket stores the bucket at key holding tokens now, by Redis's
// clock, with the mark it had while that lives (what is lent, until
// when), as the script stores it.
func setBucket(t *testing.T, rdb *redis.Client, key string, tokens float64) {
	t.Helper()
	ctx := context.Background()
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	state := fmt.Sprintf("%.17g %d", tokens, now.UnixMicro())
	if old, err := rdb.Get(ctx, key).Result(); err == nil {
		if f := strings.Fields(old); len(f) == 4 {
			if until, _ := strconv.ParseInt(f[3], 10, 64); until > now.UnixMicro() {
				state += " " + f[2] + " " + f[3]
			}
		}
	}
	if err := rdb.Set(ctx, key, state, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
}

// warm sends requests of client until its lease holds tokens (the first
// call of a key lends nothing: its rate is unknown), and returns how
// many were sent, each admitted.
func (in *instance) warm(t *testing.T, client string) int {
	t.Helper()
	for n := 1; n <= 3; n++ {
		if !in.hit(t, client) {
			t.Fatalf("warming %s up: request %d refused", client, n)
		}
		if in.ls.Held(in.key(client)) > 0 {
			return n
		}
	}
	t.Fatalf("no lease on %s after 3 requests", client)
	return 0
}

// settled waits until no call of the instance's leases is in flight.
func (in *instance) settled(t *testing.T) {
	t.Helper()
	eventually(t, 3*time.Second, "the lease calls landed", func() bool { return !in.ls.Flying() })
}

// eventually polls cond every 20ms until it holds, failing the test
// after timeout, and says how long it took.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > timeout {
			t.Fatalf("%s: not within %v", what, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

// recordedTokens is what the bucket at key's lease record counts as lent
// to each instance, by its id (nil: no record).
func recordedTokens(t *testing.T, rdb *redis.Client, key string) map[string]int64 {
	t.Helper()
	text, err := rdb.Get(context.Background(), lease.RecordKey(key)).Result()
	if err == redis.Nil {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	records := map[string]int64{}
	for _, entry := range strings.Split(text, ",") {
		var id string
		var tokens, expiry, seq int64
		if _, err := fmt.Sscanf(entry, "%s %d %d %d", &id, &tokens, &expiry, &seq); err != nil {
			t.Fatalf("lease record %q: %v", text, err)
		}
		records[id] = tokens
	}
	return records
}

// expectTokens asserts that the bucket at key (rate leaseRate, an
// absent one full) holds want tokens now, within leaseSlack: its stored
// tokens, and what leaseRate refilled since, which stays within the slack
// for the seconds a test takes.
func expectTokens(t *testing.T, rdb *redis.Client, key string, burst int64, want float64, why string) {
	t.Helper()
	ctx := context.Background()
	got := float64(burst)
	state, err := rdb.Get(ctx, key).Result()
	switch {
	case err == nil:
		f := strings.Fields(state)
		if got, err = strconv.ParseFloat(f[0], 64); err != nil || len(f) < 2 {
			t.Fatalf("bucket %s: %q", key, state)
		}
		at, _ := strconv.ParseInt(f[1], 10, 64)
		now, err := rdb.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		got = min(float64(burst), got+leaseRate*float64(now.UnixMicro()-at)/1e6)
	case err != redis.Nil:
		t.Fatal(err)
	}
	if got < want-leaseSlack || got > want+leaseSlack {
		t.Errorf("%s: bucket %s holds %.4f tokens, want %v", why, key, got, want)
	}
}
