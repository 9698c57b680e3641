package redisbatch

// The order of the two workers' batches, for settlements.

import (
	"slices"
	"sync"
)

// batchOrder keeps settlements ahead of the calls queued after them
// across the two workers. A settlement is queued before its response
// ends, so the client's next request is queued after it, and must see
// it in Redis; but the workers' pipelines go on two connections, and a
// later one may reach Redis first. So a worker takes its batch from the
// queue holding mu: each batch is then queued wholly after the other
// worker's last. A batch that holds a call of a bucket that the other
// worker's batch in flight settles waits until that batch is answered.
// Batches without such a call go at once, as before.
type batchOrder struct {
	mu sync.Mutex
	// settles are the keys that each worker's last batch settles (read
	// and written under mu); flying is held by a worker while that batch
	// is in flight.
	settles [pipelinesInFlight][]string
	flying  [pipelinesInFlight]sync.Mutex
	holding [pipelinesInFlight]bool // by the worker itself
}

// take notes the settlements of the worker's new batch, and waits for
// the other worker's batch in flight when it settles a bucket of this
// one. Called under mu.
func (o *batchOrder) take(worker int, batch []*Call, settlements *MergedKind) {
	if settlements != nil {
		for _, c := range batch {
			if settlements.Is(c) {
				o.settles[worker] = append(o.settles[worker], c.Keys...)
			}
		}
	}
	if len(o.settles[worker]) > 0 {
		o.flying[worker].Lock()
		o.holding[worker] = true
	}
	for other, settled := range o.settles {
		if other != worker && len(settled) > 0 && anyKeyOf(batch, settled) {
			o.flying[other].Lock() // until that batch has landed
			o.flying[other].Unlock()
		}
	}
}

// landed says that the worker's batch is answered.
func (o *batchOrder) landed(worker int) {
	if o.holding[worker] {
		o.holding[worker] = false
		o.flying[worker].Unlock()
	}
}

// anyKeyOf says whether a call of batch has one of keys.
func anyKeyOf(batch []*Call, keys []string) bool {
	for _, c := range batch {
		for _, k := range c.Keys {
			if slices.Contains(keys, k) {
				return true
			}
		}
	}
	return false
}
