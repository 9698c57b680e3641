package logs

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestThrottleLetsItsLinesThroughOnceWhenCalledTogether: calls that
// meet a new interval together let through at most its lines, however
// they interleave (a zone's release failures are answered on two
// workers at once). Each round is a fresh throttle and goroutines
// released together.
func TestThrottleLetsItsLinesThroughOnceWhenCalledTogether(t *testing.T) {
	const rounds, callers = 20000, 8
	over := 0
	for range rounds {
		th := &Throttle{Every: 10 * time.Second}
		var allowed atomic.Int64
		var ready, done sync.WaitGroup
		start := make(chan struct{})
		for range callers {
			ready.Add(1)
			done.Add(1)
			go func() {
				defer done.Done()
				ready.Done()
				<-start
				if ok, _ := th.Allow(); ok {
					allowed.Add(1)
				}
			}()
		}
		ready.Wait()
		close(start)
		done.Wait()
		if allowed.Load() > 1 {
			over++
		}
	}
	if over > 0 {
		t.Errorf("%d of %d rounds let more than one line through a throttle of one line per 10s", over, rounds)
	}
}
