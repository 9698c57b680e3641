package lease

import (
	"slices"
	"sync"
)

// lockShards locks the shards at the indexes, each once and in order, so
// that requests over several shards never wait on each other in a
// circle; it returns the indexes locked, for unlockShards. Whatever
// shards its maps by key locks them so.
func lockShards[T any, P interface {
	*T
	mutex() *sync.Mutex
}](shards []T, indexes []int) []int {
	slices.Sort(indexes)
	indexes = slices.Compact(indexes)
	for _, i := range indexes {
		P(&shards[i]).mutex().Lock()
	}
	return indexes
}

func unlockShards[T any, P interface {
	*T
	mutex() *sync.Mutex
}](shards []T, indexes []int) {
	for _, i := range indexes {
		P(&shards[i]).mutex().Unlock()
	}
}
