package ratelimit

import (
	"testing"
	"time"

	"os"
	"path/filepath"

	"github.com/caddy-redis/ratelimit/internal/calendar"
	"github.com/caddy-redis/ratelimit/internal/cost"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
)

// The Redis store's scripts and the leases' lease.lua, as the tests here
// send them by hand, read from their packages' files: the same text, so
// the same SHA as the packages' own.
// settleScript is the store's own, since a settlement is known by it.
var (
	scriptSource     = readStoreScript("script.lua")
	giveBackSource   = readStoreScript("giveback.lua")
	peekSource       = readStoreScript("peek.lua")
	settleSource     = readStoreScript("settle.lua")
	concurrentSource = readStoreScript("concurrent.lua")
	peekSlotsSource  = readStoreScript("peekslots.lua")
	leaseSource      = readScript("internal/lease/lease.lua")

	takeScript       = redisbatch.NewScript(scriptSource)
	giveBackScript   = redisbatch.NewScript(giveBackSource)
	settleScript     = redisstore.Settlements.Script // the one settlements merge by (MergedKind.Is)
	concurrentScript = redisbatch.NewScript(concurrentSource)
	leaseScript      = redisbatch.NewScript(leaseSource) // the leases' own, by its SHA
	scriptSHA        = takeScript.SHA()
)

// TestLongestWaitOfAReplyCoversEveryKind: the longest wait the Redis
// store reads from a reply covers a bucket's fill and debt, and the
// longest calendar period (the store keeps its own copy of that bound).
func TestLongestWaitOfAReplyCoversEveryKind(t *testing.T) {
	want := max(2*cost.MaxFillSeconds*1_000_000, 2*int64(calendar.MaxPeriod/time.Microsecond))
	if redisstore.MaxRetryMicros != want {
		t.Fatalf("redisstore.MaxRetryMicros = %d, want %d", redisstore.MaxRetryMicros, want)
	}
}

func readStoreScript(name string) string {
	return readScript(filepath.Join("internal", "redisstore", name))
}

func readScript(file string) string {
	text, err := os.ReadFile(file)
	if err != nil {
		panic(err)
	}
	return string(text)
}
