//go:build race

package caddyproc

// raceEnabled says the test binary runs with the race detector, so the
// Caddy binary is built with it too (its packages are then in the cache).
const raceEnabled = true
