package memstore

import (
	"testing"
	"unsafe"
)

func TestMemoryShardFillsACacheLine(t *testing.T) {
	// Shards sit side by side; each one's lock on a cache line of its own
	// keeps requests on neighbouring shards from slowing each other.
	if size := unsafe.Sizeof(shard{}); size != 64 {
		t.Errorf("a shard takes %d bytes, want 64 (one cache line)", size)
	}
}
