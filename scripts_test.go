package ratelimit

import (
	"os"
	"path/filepath"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
	"github.com/caddy-redis/ratelimit/internal/redisstore"
)

// The Redis store's scripts, as the tests here send them by hand, read
// from the package's files: the same text, so the same SHA as the store's.
// settleScript is the store's own, since a settlement is known by it.
var (
	scriptSource     = readStoreScript("script.lua")
	giveBackSource   = readStoreScript("giveback.lua")
	peekSource       = readStoreScript("peek.lua")
	settleSource     = readStoreScript("settle.lua")
	concurrentSource = readStoreScript("concurrent.lua")
	peekSlotsSource  = readStoreScript("peekslots.lua")

	takeScript       = redisbatch.NewScript(scriptSource)
	giveBackScript   = redisbatch.NewScript(giveBackSource)
	settleScript     = redisstore.Settlements.Script // the one settlements merge by (MergedKind.Is)
	concurrentScript = redisbatch.NewScript(concurrentSource)
	scriptSHA        = takeScript.SHA()
)

func readStoreScript(name string) string {
	text, err := os.ReadFile(filepath.Join("internal", "redisstore", name))
	if err != nil {
		panic(err)
	}
	return string(text)
}
