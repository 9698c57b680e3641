package limit

import "time"

// State is a bucket's state: the tokens it held at a time, and
// when it would be full again, in microseconds of the store's clock.
type State struct {
	Tokens      float64
	At, Expires int64
}

// ClockStart makes the store's clock monotonic: microseconds since the
// process started, unmoved by changes of the wall clock.
var ClockStart = time.Now()

func Micros(t time.Time) int64 { return int64(t.Sub(ClockStart) / time.Microsecond) }
