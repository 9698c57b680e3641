package lease_test

import (
	"github.com/caddy-redis/ratelimit/internal/kind/tokenbucket"
	"github.com/caddy-redis/ratelimit/internal/limit"
)

// A lease gives back with the plain kind's script arguments
// (limit.Plain), the token bucket's, which the handler sets.
func init() { limit.Plain = tokenbucket.Kind{} }
