package redisresets

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// A channel subscribed to a real Redis process, told of what anyone who
// can PUBLISH sends on it.

// receiver keeps what the channel tells it.
type receiver struct {
	mu       sync.Mutex
	resets   [][]string
	tooLarge [][2]int64 // bytes, dropped so far
	foreign  []int
	missed   int
}

func (r *receiver) Reset(keys []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.resets = append(r.resets, keys)
}

func (r *receiver) Missed() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.missed++
}

func (r *receiver) TooLarge(bytes, droppedTotal int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tooLarge = append(r.tooLarge, [2]int64{bytes, droppedTotal})
}

func (r *receiver) Foreign(keys int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.foreign = append(r.foreign, keys)
}

// reset says whether a reset of key was told.
func (r *receiver) reset(key string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, keys := range r.resets {
		for _, k := range keys {
			if k == key {
				return true
			}
		}
	}
	return false
}

const (
	testPrefix  = "rl:"
	testChannel = testPrefix + "reset"
)

// listen subscribes a channel of its own to srv's Redis, for the keys of
// testPrefix, until the test ends; it returns once it is subscribed, and
// a client to publish with.
func listen(t *testing.T, srv *redistest.Server) (*Channel, *receiver, *redis.Client) {
	t.Helper()
	client := redis.NewClient(srv.Options())
	r := &receiver{}
	c := New(client, testChannel, testPrefix, r)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { defer close(done); c.Listen(stop) }()
	t.Cleanup(func() {
		c.Close()
		close(stop)
		<-done
		_ = client.Close()
	})
	rdb := srv.Client(t)
	for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		n, err := rdb.PubSubNumSub(context.Background(), testChannel).Result()
		if err == nil && n[testChannel] > 0 {
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatal("not subscribed to the reset channel within 5s")
		}
	}
	return c, r, rdb
}

// publishAndWait publishes msg, then a reset of a key of the prefix, and
// waits until that reset was told: msg was handled before it.
func publishAndWait(t *testing.T, r *receiver, rdb *redis.Client, msg, marker string) {
	t.Helper()
	ctx := context.Background()
	for _, m := range []string{msg, marker} {
		if err := rdb.Publish(ctx, testChannel, m).Err(); err != nil {
			t.Fatal(err)
		}
	}
	for start := time.Now(); !r.reset(marker); time.Sleep(20 * time.Millisecond) {
		if time.Since(start) > 5*time.Second {
			t.Fatalf("the reset of %s published after the message not told within 5s", marker)
		}
	}
}

// TestOversizedMessageIsDroppedAndCounted: a message over MaxMessage,
// published as anyone who can PUBLISH may, is dropped unread (no key of
// it is told), counted once, and the receiver told of its size and the
// count; a message published after it is told as usual.
func TestOversizedMessageIsDroppedAndCounted(t *testing.T) {
	srv := redistest.Start(t)
	c, r, rdb := listen(t, srv)
	big := strings.Repeat(testPrefix+"x\n", (1<<20)/len(testPrefix+"x\n"))
	publishAndWait(t, r, rdb, big, testPrefix+"after")
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.missed > 0 {
		t.Fatalf("the subscription was established again (%d times) while the message was published: not heard", r.missed)
	}
	if n := c.tooLarge.Load(); n != 1 {
		t.Errorf("%d messages counted as too large, want 1", n)
	}
	if len(r.tooLarge) != 1 || r.tooLarge[0] != [2]int64{int64(len(big)), 1} {
		t.Errorf("told of too large messages %v, want one of %d bytes, the first dropped", r.tooLarge, len(big))
	}
	if len(r.resets) != 1 {
		t.Errorf("resets told %d times, want once (the message after): %.80q", len(r.resets), r.resets)
	}
}

// TestForeignKeysAreCountedAndIgnored: keys without the channel's key
// prefix are counted, and the receiver told how many, and touch nothing:
// the receiver is told of the prefix's keys of the same message only.
func TestForeignKeysAreCountedAndIgnored(t *testing.T) {
	srv := redistest.Start(t)
	c, r, rdb := listen(t, srv)
	mine := testPrefix + "mine"
	publishAndWait(t, r, rdb, "other:"+mine+"\n"+mine+"\nother:x", testPrefix+"after")
	if n := c.foreign.Load(); n != 2 {
		t.Errorf("%d foreign keys counted, want 2", n)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.foreign) != 1 || r.foreign[0] != 2 {
		t.Errorf("told of foreign keys %v, want 2 once", r.foreign)
	}
	if len(r.resets) != 2 || len(r.resets[0]) != 1 || r.resets[0][0] != mine {
		t.Errorf("resets told %q, want [%s] then the marker", r.resets, mine)
	}
}
