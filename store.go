package ratelimit

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"time"
)

// store decides requests with the buckets it keeps. A layer is a store
// that wraps another and answers the same call. Each registers how the
// handler's config asks for it (registerStore, registerLayer, from its
// file's init); Provision builds a handler's stack once (buildStore),
// and the request path calls its top and never asks what it holds.
type store interface {
	// take takes what the request asks of every one of its buckets, or
	// of none, as at r.sent, and fills in each bucket's
	// answer (remaining, wait). err is a failure to decide; a layer that
	// decides despite it (a fallback) says so in r.
	take(ctx context.Context, r *call) (allowed bool, err error)
	// settle settles the charges of a served request, items, where its
	// buckets were taken (charge.go).
	settle(r *call, items []settling)
	// hold is what an admitted request holds while it is served, where
	// its buckets were taken: those of its limits held while served
	// (heldKind), to give back once its response has ended (holdStep);
	// nil when it holds nothing.
	hold(r *call) holding
	// peek reads a bucket without changing it, for the admin API: a
	// bucket held while served, as what requests hold of it.
	peek(ctx context.Context, b bucket) (bucketView, error)
	// reset makes a bucket full again, and frees what requests hold of
	// it while they are served.
	reset(ctx context.Context, b bucket) error
}

// noStore is the store of a handler whose limits all block (burst 0):
// none is ever asked to take, and it keeps nothing.
type noStore struct{}

func (noStore) take(context.Context, *call) (bool, error)        { return false, errNoStore }
func (noStore) settle(*call, []settling)                         {}
func (noStore) hold(*call) holding                               { return nil }
func (noStore) peek(context.Context, bucket) (bucketView, error) { return bucketView{}, nil }
func (noStore) reset(context.Context, bucket) error              { return nil }

var errNoStore = errors.New("no store: every limit blocks")

// A storeConfig is how a store or a layer joins a handler's stack, from
// its file's init (registerStore, registerLayer).
type storeConfig struct {
	// order is its place: among the stores, the first that the config
	// asks for is the bottom; the layers wrap it in order.
	order int
	// build makes it for h over below, the stack built so far (nil for a
	// store), or returns below when h's config does not ask for it.
	build func(h *Handler, below store) store
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
	var s store
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

// refusals is what a layer remembers of the store's refusals, to refuse
// a request again without asking the store. A layer that decides
// requests with calls of its own, not by asking the store below it,
// takes the place of such a layer below it, and asks its refusals
// itself (takeRefusals).
type refusals interface {
	// answer refuses a request at now when one of its buckets is known to
	// refuse it, and fills in the answer of each such bucket; the others
	// are marked unknown.
	answer(buckets []bucket, now time.Time) bool
	// answered keeps what the store answered to a request sent at sent.
	answered(buckets []bucket, sent time.Time, allowed bool)
	// forget drops what is kept of the bucket at key, and forgetKeys of
	// the buckets at keys: they hold tokens again sooner than time alone
	// would bring them. One key is not a variadic slice: through an
	// interface that would escape, an allocation per settlement that
	// gives back (go build -gcflags=-m).
	forget(key string)
	forgetKeys(keys []string)
	// keepAtMost bounds how long a refusal is kept, when the layer above
	// may bring tokens back at any time.
	keepAtMost(d time.Duration)
}

// refuser is a store or layer that knows, without a call, that it
// refuses a request's buckets now, which may be only some of them (those
// known before the request's body is read: beforebody.go), and then
// answers them as its take would. mayRefuse says, at little cost, whether
// it may know a refusal now at all: when not, a request's buckets need
// not be resolved to ask it.
type refuser interface {
	mayRefuse() bool
	refuses(now time.Time, buckets []bucket) bool
}

// refuserOf is the refuser of a stack whose top is s: what decides a
// request first, when it is one; a layer that decides only what the
// store below it could not passes that store's on (refuserBelow). nil
// when what decides first does not know refusals without a call.
func refuserOf(s store) refuser {
	switch s := s.(type) {
	case refuser:
		return s
	case passesRefuser:
		return s.refuserBelow()
	}
	return nil
}

// passesRefuser is a layer that decides only what the store below it
// could not, and so passes that store's refuser on (refuserOf).
type passesRefuser interface{ refuserBelow() refuser }

// refusalKeeper is a layer that keeps refusals: under is the store it
// wraps.
type refusalKeeper interface {
	store
	refusalsKept() (under store, kept refusals)
}

// takeRefusals is the store under below when below keeps refusals, and
// those refusals; else below itself, and noRefusals.
func takeRefusals(below store) (store, refusals) {
	if k, ok := below.(refusalKeeper); ok {
		return k.refusalsKept()
	}
	return below, noRefusals{}
}

// noRefusals keeps nothing.
type noRefusals struct{}

func (noRefusals) answer([]bucket, time.Time) bool    { return false }
func (noRefusals) answered([]bucket, time.Time, bool) {}
func (noRefusals) forget(string)                      {}
func (noRefusals) forgetKeys([]string)                {}
func (noRefusals) keepAtMost(time.Duration)           {}
