package concurrent

import (
	"encoding/hex"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"unsafe"
)

// instanceID starts every slot id of this process: slots of instances
// that share a Redis never meet.
var instanceID = func() string {
	var b [8]byte
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return hex.EncodeToString(b[:])
}()

// idCounter counts the slot ids of this process.
var idCounter atomic.Uint64

// slotID is a slot id and the room for its text: boxed as &text, it is
// one allocation where a string in an interface is two
// (BenchmarkServeHTTPConcurrentParallel 12 -> 11 allocs).
type slotID struct {
	text string
	room [32]byte // instanceID (16), ':', the count in base 36 (at most 13)
}

// newSlotID is a slot id no other request of any instance has.
func newSlotID() any {
	id := new(slotID)
	text := append(append(id.room[:0], instanceID...), ':')
	text = strconv.AppendUint(text, idCounter.Add(1), 36)
	id.text = unsafe.String(&text[0], len(text)) // id.room is not written again
	return &id.text
}
