package calendar_test

import (
	"fmt"
	"time"

	"github.com/caddy-redis/ratelimit/internal/calendar"
)

// A monthly quota renewed on the 15th in Berlin: the period an instant
// is in, the bounds the script receives (the periods before, at and
// after it), and a mistake refused at load.
func ExampleNew() {
	p, err := calendar.New("month", "Europe/Berlin", 15, "")
	if err != nil {
		panic(err)
	}
	now := time.Date(2026, time.March, 20, 12, 0, 0, 0, time.UTC)
	b := p.Bounds(now)
	start, end := time.UnixMicro(b[1]).In(p.Location()), time.UnixMicro(b[2]).In(p.Location())
	fmt.Println(start, "to", end, "lasts", end.Sub(start))
	for _, us := range b {
		fmt.Println(us, time.UnixMicro(us).In(p.Location()))
	}
	_, err = calendar.New("6h", "Europe/Berlin", 0, "")
	fmt.Println(err)
	// Output:
	// 2026-03-15 00:00:00 +0100 CET to 2026-04-15 00:00:00 +0200 CEST lasts 743h0m0s
	// 1771110000000000 2026-02-15 00:00:00 +0100 CET
	// 1773529200000000 2026-03-15 00:00:00 +0100 CET
	// 1776204000000000 2026-04-15 00:00:00 +0200 CEST
	// 1778796000000000 2026-05-15 00:00:00 +0200 CEST
	// time_zone 'Europe/Berlin' with per '6h': a duration is counted from the Unix epoch, the same instants in every zone; remove time_zone, or use a period of the calendar like per day
}
