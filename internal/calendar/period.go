// package calendar computes the periods a quota counts in: which period
// an instant falls in, on the calendar of a time zone (minute to year,
// with month_day and week_starts) or in multiples of a duration from the
// Unix epoch, and the four consecutive boundaries a quota passes to the
// script. It judges a quota's per, time_zone, month_day and week_starts,
// with the messages that the Caddyfile parser and Validate give.
//
// It knows nothing of Caddy's handler or of Redis: it reads times and
// the values as written. Of Caddy it borrows only the way a duration is
// written (caddy.ParseDuration, which reads 1d), so that per reads as
// every other duration in a Caddyfile.
package calendar

import (
	"fmt"
	"sync/atomic"
	"time"
	_ "time/tzdata" // the zone database in the binary: time_zone works in a Caddy built into a scratch image

	"github.com/caddyserver/caddy/v2"
)

// Period is how a quota renews, read from its `per` and its block's
// `time_zone`, `month_day` and `week_starts` by New. A period
// includes its start and excludes its end, so an instant exactly on a
// boundary is in the new period. All boundaries fall on whole seconds.
//
//   - minute, hour: the minutes and hours of the zone's clock, 60 and
//     3600 seconds each (an hour starts at :15 UTC in Asia/Kathmandu).
//     Clocks move by whole hours, so a change cuts no period: when they
//     go back, the repeated hour is a period of its own; the hour they
//     skip is none. Where a change moves the clock by less
//     (Australia/Lord_Howe's half hour), it ends one period and starts
//     the next, so periods never overlap.
//   - day, week, month, year: from the first instant the zone's clock
//     shows the period's first day (its midnight) to the first instant
//     it shows the next period's. So days last 23 or 25 hours when
//     clocks change, months 28 to 31 days, years 365 or 366. A week
//     starts on Monday (week_starts sunday: on Sunday). A month starts on
//     its month_day (1 to 28, default 1): month_day 15 runs from the
//     15th to the next month's 15th. Where a clock change skips midnight
//     (America/Havana in March, 00:00 to 01:00), the day starts at the
//     change (time.Date alone would start it at 23:00 the day before in
//     western zones); where it repeats midnight, at the first one.
//   - a duration (per 6h, 2s, 90m; whole seconds from 1s to ten years):
//     consecutive multiples of it from the Unix epoch, the same instants
//     in every zone, so time_zone is refused with it. per 1d is a day in
//     UTC; per 7d starts on Thursdays, like the epoch.
//
// time_zone (an IANA name, default UTC) places the named periods, minute
// to year. The zone database is embedded (time/tzdata), though Go prefers
// the host's when it has one.
type Period struct {
	every    time.Duration  // minute, hour or a duration; zero for the calendar periods
	calendar string         // day, week, month or year when every is zero
	loc      *time.Location // time_zone; UTC for durations

	weekStart time.Weekday
	monthDay  int

	current atomic.Pointer[Bounds] // the last bounds returned; see Bounds
}

// Bounds are four consecutive boundaries in Unix microseconds (the
// script's clock): the period asked about runs from [1] to [2], the one
// before it from [0] to [1], the one after from [2] to [3]. The script
// picks among the three by Redis time, which may differ a little from
// Caddy's clock; a Redis time outside [0] to [3] means the clocks differ
// by more than a period.
type Bounds [4]int64

// The limits of a duration period: whole seconds, since headers and
// Retry-After count in seconds, and short enough that its neighbours'
// boundaries stay exact in the script's microseconds (2^53 is in 2255).
// MaxPeriod is also the longest any period lasts (a year is shorter), so
// it bounds the wait a quota may give.
const (
	minPeriod = time.Second
	MaxPeriod = 3650 * 24 * time.Hour
)

// WantPer says what per may be, for the messages that refuse it.
const WantPer = "want minute, hour, day, week, month, year, or a duration like 6h (whole seconds, 1s to 3650d)"

// WantMonthDay says what month_day may be, for the messages that refuse
// it.
const WantMonthDay = "want the day of the month a period starts on, 1 to 28 (every month has it; default 1)"

// New reads a quota's period: per (minute, hour, day, week, month,
// year, or a duration) and its options, each empty or zero for its
// default: timeZone (UTC), monthDay (1), weekStarts (monday). Its error
// is that of the first check that fails: CheckPer, CheckTimeZone,
// CheckMonthDay, CheckWeekStarts. The Caddyfile parser calls those as it
// reads each value, for the line number; Validate calls New.
func New(per, timeZone string, monthDay int, weekStarts string) (*Period, error) {
	if err := CheckPer(per); err != nil {
		return nil, err
	}
	loc, err := loadTimeZone(per, timeZone)
	if err != nil {
		return nil, err
	}
	if err := CheckMonthDay(per, monthDay); err != nil {
		return nil, err
	}
	if err := CheckWeekStarts(per, weekStarts); err != nil {
		return nil, err
	}
	p := &Period{loc: loc, weekStart: time.Monday, monthDay: 1}
	switch per {
	case "minute":
		p.every = time.Minute
	case "hour":
		p.every = time.Hour
	case "day", "week", "month", "year":
		p.calendar = per
	default:
		p.every, _ = caddy.ParseDuration(per) // checked above
	}
	if weekStarts == "sunday" {
		p.weekStart = time.Sunday
	}
	if monthDay != 0 {
		p.monthDay = monthDay
	}
	return p, nil
}

// Location is the zone whose calendar places the period: its time_zone,
// UTC by default and for a duration.
func (p *Period) Location() *time.Location { return p.loc }

// namedPer says whether per names a period (minute to year), which
// time_zone places, rather than giving a duration.
func namedPer(per string) bool {
	switch per {
	case "minute", "hour", "day", "week", "month", "year":
		return true
	}
	return false
}

// CheckPer judges per: a named period, or a duration of whole seconds
// from 1s to ten years.
func CheckPer(per string) error {
	if namedPer(per) {
		return nil
	}
	d, err := caddy.ParseDuration(per)
	switch {
	case err != nil:
		return fmt.Errorf("per '%s': %s", per, WantPer)
	case d < minPeriod:
		return fmt.Errorf("per '%s' is shorter than a second, the unit headers and Retry-After count in; use 1s or more", per)
	case d%time.Second != 0:
		return fmt.Errorf("per '%s' is not a whole number of seconds, which headers and Retry-After count in; use %v or %v",
			per, d.Truncate(time.Second), d.Truncate(time.Second)+time.Second)
	case d > MaxPeriod:
		return fmt.Errorf("per '%s' is longer than ten years, past which the script's times stop being exact; use per year, or at most 3650d", per)
	}
	return nil
}

// CheckTimeZone judges time_zone for per; empty is the default (UTC).
func CheckTimeZone(per, zone string) error {
	_, err := loadTimeZone(per, zone)
	return err
}

// loadTimeZone reads time_zone for per: empty is UTC. A duration period
// is the same in every zone, and the host's own zone (Local) can differ
// between the Caddy instances that share a quota: both are refused.
func loadTimeZone(per, zone string) (*time.Location, error) {
	switch {
	case zone == "":
		return time.UTC, nil
	case !namedPer(per):
		return nil, fmt.Errorf("time_zone '%s' with per '%s': a duration is counted from the Unix epoch, the same instants in every zone; "+
			"remove time_zone, or use a period of the calendar like per day", zone, per)
	case zone == "Local":
		return nil, fmt.Errorf("time_zone 'Local' is the host's zone, which can differ between the Caddy instances that share a quota; name the zone, like Europe/Berlin")
	}
	loc, err := time.LoadLocation(zone)
	if err != nil {
		return nil, fmt.Errorf("time_zone '%s' is not in the IANA time zone database; use a name like Europe/Berlin, America/New_York or UTC (the default)", zone)
	}
	return loc, nil
}

// CheckMonthDay judges month_day for per; zero is the default.
func CheckMonthDay(per string, day int) error {
	switch {
	case day == 0:
		return nil
	case day < 1 || day > 28:
		return fmt.Errorf("month_day '%d': %s", day, WantMonthDay)
	case per != "month":
		return fmt.Errorf("month_day '%d' with per '%s': month_day is the day a monthly period starts on; remove it, or use per month", day, per)
	}
	return nil
}

// CheckWeekStarts judges week_starts for per; empty is the default.
func CheckWeekStarts(per, day string) error {
	switch {
	case day == "":
		return nil
	case day != "monday" && day != "sunday":
		return fmt.Errorf("week_starts '%s': want monday (the default) or sunday", day)
	case per != "week":
		return fmt.Errorf("week_starts '%s' with per '%s': week_starts is the day a weekly period starts on; remove it, or use per week", day, per)
	}
	return nil
}

// Bounds returns the period containing now and its neighbours. It runs
// on every request, so it keeps the last bounds it returned and computes
// anew only when now falls outside their period (once per period, or
// while requests' clock readings straddle a boundary): 6 ns and no
// allocation instead of 830 ns and one (BenchmarkPeriodBounds, month in
// Europe/Berlin).
func (p *Period) Bounds(now time.Time) Bounds {
	us := now.UnixMicro()
	if b := p.current.Load(); b != nil && b[1] <= us && us < b[2] {
		return *b
	}
	start, end := p.span(now)
	before, _ := p.span(start.Add(-time.Nanosecond))
	_, after := p.span(end)
	b := &Bounds{before.UnixMicro(), start.UnixMicro(), end.UnixMicro(), after.UnixMicro()}
	p.current.Store(b)
	return *b
}

// span returns the period containing t: start <= t < end, both in the
// period's zone. It computes every time; Bounds is the cached way.
func (p *Period) span(t time.Time) (start, end time.Time) {
	if p.every > 0 {
		return p.fixedSpan(t)
	}
	return p.calendarSpan(t)
}

// fixedSpan is span for minute, hour and durations: multiples of the
// length on the zone's clock (UTC for durations: from the epoch).
func (p *Period) fixedSpan(t time.Time) (start, end time.Time) {
	local := t.In(p.loc)
	_, offset := local.Zone()
	n := int64(p.every / time.Second)
	wall := t.Unix() + int64(offset)
	s := wall - (wall%n+n)%n - int64(offset)
	start, end = time.Unix(s, 0).In(p.loc), time.Unix(s+n, 0).In(p.loc)
	// A change of offset by other than whole periods would make the
	// periods on either side of it overlap: it ends one and starts the next.
	changed, changes := local.ZoneBounds()
	if !changed.IsZero() && changed.After(start) && p.offGrid(changed) {
		start = changed
	}
	if !changes.IsZero() && changes.Before(end) && p.offGrid(changes) {
		end = changes
	}
	return start, end
}

// offGrid says whether the zone's change at instant c moves its clock by
// other than whole periods. Not all changes move it: some only rename
// the zone, or mark the end of the data (2038 in zones without
// daylight saving).
func (p *Period) offGrid(c time.Time) bool {
	_, before := c.Add(-time.Second).In(p.loc).Zone()
	_, after := c.In(p.loc).Zone()
	return (after-before)%int(p.every/time.Second) != 0
}

// calendarSpan is span for day, week, month and year.
func (p *Period) calendarSpan(t time.Time) (start, end time.Time) {
	local := t.In(p.loc)
	y, m, d := local.Date()
	switch p.calendar {
	case "week":
		d -= (int(local.Weekday()) - int(p.weekStart) + 7) % 7
	case "month":
		if d < p.monthDay {
			m--
		}
		d = p.monthDay
	case "year":
		m, d = time.January, 1
	}
	start, end = p.startAfter(y, m, d, 0), p.startAfter(y, m, d, 1)
	// Where the clock went back over midnight (America/St_Johns until
	// 2011: 00:01 to 23:01 the day before), t shows a day whose successor
	// has begun already: t is in the successor.
	for n := 2; !end.After(t); n++ {
		start, end = end, p.startAfter(y, m, d, n)
	}
	return start, end
}

// startAfter is the start of the calendar period n periods after the one
// that starts on y-m-d (time.Date normalises the date).
func (p *Period) startAfter(y int, m time.Month, d, n int) time.Time {
	switch p.calendar {
	case "day":
		d += n
	case "week":
		d += 7 * n
	case "month":
		m += time.Month(n)
	case "year":
		y += n
	}
	return firstInstant(y, m, d, p.loc)
}

// firstInstant is when the clock in loc first shows the date y-m-d: its
// midnight, except where a clock change skips or repeats midnight.
// time.Date then gives the offset before or after the change depending on
// the zone (America/Havana's skipped midnight comes out as 23:00 the day
// before; Pacific/Apia's skipped 2011-12-30 as the 29th), so take the
// change itself, or the first of the two midnights.
func firstInstant(y int, m time.Month, d int, loc *time.Location) time.Time {
	t := time.Date(y, m, d, 0, 0, 0, 0, loc)
	midnight := time.Date(y, m, d, 0, 0, 0, 0, time.UTC).Unix() // as the clock reads it
	_, offset := t.Zone()
	changed, changes := t.ZoneBounds()
	switch wall := t.Unix() + int64(offset); {
	case wall < midnight: // skipped; t is before the change
		return changes
	case wall > midnight: // skipped; t is after the change
		return changed
	}
	// Repeated: the clock showed this midnight before, on the zone's
	// previous offset, if that offset places it before the change.
	if !changed.IsZero() {
		_, before := changed.Add(-time.Second).Zone()
		if earlier := midnight - int64(before); earlier < changed.Unix() {
			return time.Unix(earlier, 0).In(loc)
		}
	}
	return t
}
