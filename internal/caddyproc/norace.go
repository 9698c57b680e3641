//go:build !race

package caddyproc

const raceEnabled = false
