package ratelimit

import (
	"context"
	"errors"

	"github.com/caddy-redis/ratelimit/internal/limit"
)

// noStore is the store of a handler whose limits all block (burst 0):
// none is ever asked to take, and it keeps nothing.
type noStore struct{}

func (noStore) Take(context.Context, *limit.Call) (bool, error)        { return false, errNoStore }
func (noStore) Settle(*limit.Call, []limit.Settling)                   {}
func (noStore) Hold(*limit.Call) limit.Holding                         { return nil }
func (noStore) Peek(context.Context, limit.Bucket) (limit.View, error) { return limit.View{}, nil }
func (noStore) Reset(context.Context, limit.Bucket) error              { return nil }

var errNoStore = errors.New("no store: every limit blocks")
