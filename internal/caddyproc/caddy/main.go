// Command caddy is Caddy with the standard modules and rate_limit: the
// binary xcaddy would build, for caddyproc's tests.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddy-redis/ratelimit"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

func main() {
	caddycmd.Main()
}
