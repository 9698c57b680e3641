package ratelimit

import (
	"os"
	"path/filepath"

	"github.com/caddy-redis/ratelimit/internal/redisbatch"
)

// The Redis store's scripts, as the tests here send them by hand, read
// from the package's files: the same text, so the same SHA as the store's.
var (
	scriptSource     = readStoreScript("script.lua")
	giveBackSource   = readStoreScript("giveback.lua")
	peekSource       = readStoreScript("peek.lua")
	settleSource     = readStoreScript("settle.lua")
	concurrentSource = readStoreScript("concurrent.lua")
	peekSlotsSource  = readStoreScript("peekslots.lua")

	takeScript       = redisbatch.NewScript(scriptSource)
	giveBackScript   = redisbatch.NewScript(giveBackSource)
	settleScript     = redisbatch.NewScript(settleSource)
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
