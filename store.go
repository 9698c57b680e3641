package ratelimit

import (
	"cmp"
	"context"
	"errors"
	"slices"

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

// A storeConfig is how a store or a layer joins a handler's stack, from
// its file's init (registerStore, registerLayer).
type storeConfig struct {
	// order is its place: among the stores, the first that the config
	// asks for is the bottom; the layers wrap it in order.
	order int
	// build makes it for h over below, the stack built so far (nil for a
	// store), or returns below when h's config does not ask for it.
	build func(h *Handler, below limit.Store) limit.Store
}

// storeConfigs and layerConfigs are the stores and the layers, in order.
var storeConfigs, layerConfigs []storeConfig

// registerStore adds a store that keeps buckets; registerLayer a layer.
func registerStore(c storeConfig) { storeConfigs = addStoreConfig(storeConfigs, c) }
func registerLayer(c storeConfig) { layerConfigs = addStoreConfig(layerConfigs, c) }

func addStoreConfig(configs []storeConfig, c storeConfig) []storeConfig {
	configs = append(configs, c)
	slices.SortStableFunc(configs, func(a, b storeConfig) int { return cmp.Compare(a.order, b.order) })
	return configs
}

// buildStore builds the handler's stack of a store and its layers, once
// the store's parts are set up (Provision): the first store its config
// asks for (noStore when none: hard blocks only, nothing ever asks a
// store), then each layer it asks for, over the stack so far.
func (h *Handler) buildStore() {
	var s limit.Store
	for _, c := range storeConfigs {
		if s = c.build(h, nil); s != nil {
			break
		}
	}
	if s == nil {
		s = noStore{}
	}
	for _, c := range layerConfigs {
		s = c.build(h, s)
	}
	h.store = s
}
