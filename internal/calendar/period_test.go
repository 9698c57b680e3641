package calendar

// Tests of quota periods: pure computations against fixed times, no
// processes.

import (
	"archive/zip"
	"fmt"
	"io/fs"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// periodOf reads a period written as in a quota's Caddyfile: per, then
// its options ("month time_zone Europe/Berlin month_day 15").
func periodOf(spec string) (*Period, error) {
	f := strings.Fields(spec)
	var zone, weekStarts string
	var monthDay int
	for i := 1; i+1 < len(f); i += 2 {
		switch f[i] {
		case "time_zone":
			zone = f[i+1]
		case "month_day":
			monthDay, _ = strconv.Atoi(f[i+1])
		case "week_starts":
			weekStarts = f[i+1]
		default:
			return nil, fmt.Errorf("test spec %q: unknown option %q", spec, f[i])
		}
	}
	return New(f[0], zone, monthDay, weekStarts)
}

func mustPeriod(tb testing.TB, spec string) *Period {
	tb.Helper()
	p, err := periodOf(spec)
	if err != nil {
		tb.Fatal(err)
	}
	return p
}

func mustTime(tb testing.TB, rfc3339 string) time.Time {
	tb.Helper()
	t, err := time.Parse(time.RFC3339Nano, rfc3339)
	if err != nil {
		tb.Fatal(err)
	}
	return t
}

const day = 24 * time.Hour

// zoneDatabase loads a zone by name.
type zoneDatabase struct {
	name string
	load func(name string) (*time.Location, error)
}

// zoneDatabases are the two a Caddy reads zones from: the host's, and
// Go's own, which time/tzdata embeds for a scratch image. Go's lists each
// zone's changes only to a recent year and goes on by the zone's rule,
// where ZoneBounds has quirks (golang/go#81583), so the periods are
// tested against both.
func zoneDatabases(tb testing.TB) []zoneDatabase {
	dbs := []zoneDatabase{{"host", time.LoadLocation}}
	zr, err := zip.OpenReader(filepath.Join(runtime.GOROOT(), "lib", "time", "zoneinfo.zip"))
	if err != nil {
		tb.Logf("Go's zone database: %v; testing the host's only", err)
		return dbs
	}
	tb.Cleanup(func() { zr.Close() })
	return append(dbs, zoneDatabase{"go", func(name string) (*time.Location, error) {
		data, err := fs.ReadFile(zr, name)
		if err != nil {
			return nil, err
		}
		return time.LoadLocationFromTZData(name, data)
	}})
}

// in is p with its zone loaded from db.
func (db zoneDatabase) in(tb testing.TB, p *Period) *Period {
	tb.Helper()
	if p.loc == time.UTC {
		return p
	}
	loc, err := db.load(p.loc.String())
	if err != nil {
		tb.Fatal(err)
	}
	p.loc = loc
	return p
}

// TestPeriodSpan: the period containing an instant, in the period's zone,
// across daylight-saving changes, month lengths, leap years and year
// ends; an instant on a boundary is in the new period. length restates
// end - start, so that a mistyped expectation shows.
func TestPeriodSpan(t *testing.T) {
	dbs := zoneDatabases(t)
	for _, c := range []struct {
		per            string
		at, start, end string
		length         time.Duration
	}{
		// UTC. 2026-05-17 is a Sunday.
		{"minute", "2026-05-17T10:31:45Z", "2026-05-17T10:31:00Z", "2026-05-17T10:32:00Z", time.Minute},
		{"minute", "2026-05-17T10:32:00Z", "2026-05-17T10:32:00Z", "2026-05-17T10:33:00Z", time.Minute},
		{"hour", "2026-05-17T10:31:45Z", "2026-05-17T10:00:00Z", "2026-05-17T11:00:00Z", time.Hour},
		{"day", "2026-05-17T10:31:45Z", "2026-05-17T00:00:00Z", "2026-05-18T00:00:00Z", day},
		{"week", "2026-05-17T10:31:45Z", "2026-05-11T00:00:00Z", "2026-05-18T00:00:00Z", 7 * day},
		{"week week_starts monday", "2026-05-18T00:00:00Z", "2026-05-18T00:00:00Z", "2026-05-25T00:00:00Z", 7 * day},
		{"week week_starts sunday", "2026-05-17T10:31:45Z", "2026-05-17T00:00:00Z", "2026-05-24T00:00:00Z", 7 * day},
		{"week week_starts sunday", "2026-05-16T23:59:59Z", "2026-05-10T00:00:00Z", "2026-05-17T00:00:00Z", 7 * day},
		{"month", "2026-05-17T10:31:45Z", "2026-05-01T00:00:00Z", "2026-06-01T00:00:00Z", 31 * day},
		{"month", "2026-02-10T00:00:00Z", "2026-02-01T00:00:00Z", "2026-03-01T00:00:00Z", 28 * day},
		{"month", "2026-03-01T00:00:00Z", "2026-03-01T00:00:00Z", "2026-04-01T00:00:00Z", 31 * day},
		{"month month_day 15", "2026-01-20T08:00:00Z", "2026-01-15T00:00:00Z", "2026-02-15T00:00:00Z", 31 * day},
		{"month month_day 15", "2026-01-10T08:00:00Z", "2025-12-15T00:00:00Z", "2026-01-15T00:00:00Z", 31 * day},
		{"month month_day 15", "2026-02-20T08:00:00Z", "2026-02-15T00:00:00Z", "2026-03-15T00:00:00Z", 28 * day},
		{"month month_day 15", "2026-03-14T23:59:59Z", "2026-02-15T00:00:00Z", "2026-03-15T00:00:00Z", 28 * day},
		{"month month_day 15", "2026-03-15T00:00:00Z", "2026-03-15T00:00:00Z", "2026-04-15T00:00:00Z", 31 * day},
		{"month month_day 15", "2028-02-20T08:00:00Z", "2028-02-15T00:00:00Z", "2028-03-15T00:00:00Z", 29 * day},
		{"month month_day 28", "2026-12-28T00:00:00Z", "2026-12-28T00:00:00Z", "2027-01-28T00:00:00Z", 31 * day},
		{"year", "2026-05-17T10:31:45Z", "2026-01-01T00:00:00Z", "2027-01-01T00:00:00Z", 365 * day},

		// Leap day, 2028-02-29 (a Tuesday).
		{"day", "2028-02-29T12:00:00Z", "2028-02-29T00:00:00Z", "2028-03-01T00:00:00Z", day},
		{"week", "2028-02-29T12:00:00Z", "2028-02-28T00:00:00Z", "2028-03-06T00:00:00Z", 7 * day},
		{"month", "2028-02-29T12:00:00Z", "2028-02-01T00:00:00Z", "2028-03-01T00:00:00Z", 29 * day},
		{"year", "2028-02-29T12:00:00Z", "2028-01-01T00:00:00Z", "2029-01-01T00:00:00Z", 366 * day},

		// Year end (2026-12-31 is a Thursday), and its boundary.
		{"day", "2026-12-31T23:59:59.999999Z", "2026-12-31T00:00:00Z", "2027-01-01T00:00:00Z", day},
		{"week", "2026-12-31T12:00:00Z", "2026-12-28T00:00:00Z", "2027-01-04T00:00:00Z", 7 * day},
		{"month", "2026-12-31T12:00:00Z", "2026-12-01T00:00:00Z", "2027-01-01T00:00:00Z", 31 * day},
		{"year", "2026-12-31T23:59:59.999999Z", "2026-01-01T00:00:00Z", "2027-01-01T00:00:00Z", 365 * day},
		{"year", "2027-01-01T00:00:00Z", "2027-01-01T00:00:00Z", "2028-01-01T00:00:00Z", 365 * day},

		// Durations: multiples from the epoch, in UTC whatever the instant's
		// zone. 1970-01-01 was a Thursday.
		{"6h", "2026-05-17T10:31:45Z", "2026-05-17T06:00:00Z", "2026-05-17T12:00:00Z", 6 * time.Hour},
		{"6h", "2026-05-17T12:00:00+02:00", "2026-05-17T06:00:00Z", "2026-05-17T12:00:00Z", 6 * time.Hour},
		{"6h", "2026-05-17T12:00:00Z", "2026-05-17T12:00:00Z", "2026-05-17T18:00:00Z", 6 * time.Hour},
		{"2s", "2026-05-17T10:31:45.5Z", "2026-05-17T10:31:44Z", "2026-05-17T10:31:46Z", 2 * time.Second},
		{"2s", "2026-05-17T10:31:46Z", "2026-05-17T10:31:46Z", "2026-05-17T10:31:48Z", 2 * time.Second},
		{"2s", "2026-05-17T10:31:47.999999999Z", "2026-05-17T10:31:46Z", "2026-05-17T10:31:48Z", 2 * time.Second},
		{"90m", "2026-05-17T10:31:45Z", "2026-05-17T10:30:00Z", "2026-05-17T12:00:00Z", 90 * time.Minute},
		{"7d", "2026-05-17T10:31:45Z", "2026-05-14T00:00:00Z", "2026-05-21T00:00:00Z", 7 * day},
		{"1d", "2026-03-29T12:00:00+02:00", "2026-03-29T00:00:00Z", "2026-03-30T00:00:00Z", day},

		// Europe/Berlin: 2026-03-29 02:00 CET -> 03:00 CEST, 2026-10-25
		// 03:00 CEST -> 02:00 CET.
		{"day time_zone Europe/Berlin", "2026-03-29T12:00:00+02:00", "2026-03-29T00:00:00+01:00", "2026-03-30T00:00:00+02:00", 23 * time.Hour},
		{"day time_zone Europe/Berlin", "2026-10-25T12:00:00+01:00", "2026-10-25T00:00:00+02:00", "2026-10-26T00:00:00+01:00", 25 * time.Hour},
		{"day time_zone Europe/Berlin", "2026-03-28T23:00:00Z", "2026-03-29T00:00:00+01:00", "2026-03-30T00:00:00+02:00", 23 * time.Hour},
		{"hour time_zone Europe/Berlin", "2026-03-29T01:30:00+01:00", "2026-03-29T01:00:00+01:00", "2026-03-29T03:00:00+02:00", time.Hour},
		{"hour time_zone Europe/Berlin", "2026-03-29T03:30:00+02:00", "2026-03-29T03:00:00+02:00", "2026-03-29T04:00:00+02:00", time.Hour},
		{"hour time_zone Europe/Berlin", "2026-10-25T02:30:00+02:00", "2026-10-25T02:00:00+02:00", "2026-10-25T02:00:00+01:00", time.Hour},
		{"hour time_zone Europe/Berlin", "2026-10-25T02:30:00+01:00", "2026-10-25T02:00:00+01:00", "2026-10-25T03:00:00+01:00", time.Hour},
		{"minute time_zone Europe/Berlin", "2026-10-25T02:59:30+02:00", "2026-10-25T02:59:00+02:00", "2026-10-25T02:00:00+01:00", time.Minute},
		{"week time_zone Europe/Berlin", "2026-03-29T12:00:00+02:00", "2026-03-23T00:00:00+01:00", "2026-03-30T00:00:00+02:00", 7*day - time.Hour},
		{"week time_zone Europe/Berlin week_starts sunday", "2026-03-29T12:00:00+02:00", "2026-03-29T00:00:00+01:00", "2026-04-05T00:00:00+02:00", 7*day - time.Hour},
		{"month time_zone Europe/Berlin", "2026-03-20T12:00:00Z", "2026-03-01T00:00:00+01:00", "2026-04-01T00:00:00+02:00", 31*day - time.Hour},
		{"month time_zone Europe/Berlin", "2026-10-31T23:30:00Z", "2026-11-01T00:00:00+01:00", "2026-12-01T00:00:00+01:00", 30 * day},
		{"month time_zone Europe/Berlin", "2026-10-31T22:30:00Z", "2026-10-01T00:00:00+02:00", "2026-11-01T00:00:00+01:00", 31*day + time.Hour},
		{"month time_zone Europe/Berlin month_day 15", "2026-03-20T12:00:00Z", "2026-03-15T00:00:00+01:00", "2026-04-15T00:00:00+02:00", 31*day - time.Hour},
		{"month time_zone Europe/Berlin", "2028-02-29T23:30:00+01:00", "2028-02-01T00:00:00+01:00", "2028-03-01T00:00:00+01:00", 29 * day},
		{"year time_zone Europe/Berlin", "2028-02-29T12:00:00Z", "2028-01-01T00:00:00+01:00", "2029-01-01T00:00:00+01:00", 366 * day},
		{"day time_zone Europe/Berlin", "2026-12-31T23:30:00+01:00", "2026-12-31T00:00:00+01:00", "2027-01-01T00:00:00+01:00", day},
		{"year time_zone Europe/Berlin", "2026-12-31T23:30:00Z", "2027-01-01T00:00:00+01:00", "2028-01-01T00:00:00+01:00", 365 * day},
		{"year time_zone Europe/Berlin", "2026-12-31T22:59:59Z", "2026-01-01T00:00:00+01:00", "2027-01-01T00:00:00+01:00", 365 * day},

		// America/New_York: 2026-03-08 02:00 EST -> 03:00 EDT, 2026-11-01
		// 02:00 EDT -> 01:00 EST.
		{"day time_zone America/New_York", "2026-03-08T12:00:00-04:00", "2026-03-08T00:00:00-05:00", "2026-03-09T00:00:00-04:00", 23 * time.Hour},
		{"day time_zone America/New_York", "2026-11-01T12:00:00-05:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00", 25 * time.Hour},
		{"hour time_zone America/New_York", "2026-03-08T01:30:00-05:00", "2026-03-08T01:00:00-05:00", "2026-03-08T03:00:00-04:00", time.Hour},
		{"hour time_zone America/New_York", "2026-03-08T03:00:00-04:00", "2026-03-08T03:00:00-04:00", "2026-03-08T04:00:00-04:00", time.Hour},
		{"hour time_zone America/New_York", "2026-11-01T01:30:00-04:00", "2026-11-01T01:00:00-04:00", "2026-11-01T01:00:00-05:00", time.Hour},
		{"hour time_zone America/New_York", "2026-11-01T01:30:00-05:00", "2026-11-01T01:00:00-05:00", "2026-11-01T02:00:00-05:00", time.Hour},
		{"week time_zone America/New_York week_starts sunday", "2026-11-01T12:00:00-05:00", "2026-11-01T00:00:00-04:00", "2026-11-08T00:00:00-05:00", 7*day + time.Hour},
		{"month time_zone America/New_York", "2026-11-30T23:59:59-05:00", "2026-11-01T00:00:00-04:00", "2026-12-01T00:00:00-05:00", 30*day + time.Hour},
		{"month time_zone America/New_York month_day 15", "2026-03-10T12:00:00-04:00", "2026-02-15T00:00:00-05:00", "2026-03-15T00:00:00-04:00", 28*day - time.Hour},
		{"year time_zone America/New_York", "2028-02-29T12:00:00Z", "2028-01-01T00:00:00-05:00", "2029-01-01T00:00:00-05:00", 366 * day},
		{"day time_zone America/New_York", "2027-01-01T04:59:59Z", "2026-12-31T00:00:00-05:00", "2027-01-01T00:00:00-05:00", day},
		{"year time_zone America/New_York", "2027-01-01T05:00:00Z", "2027-01-01T00:00:00-05:00", "2028-01-01T00:00:00-05:00", 365 * day},

		// Dec 31 of a leap year, where Go's ZoneBounds ends the zone
		// before the instant in its own zone database (golang/go#81583).
		{"hour time_zone Europe/Berlin", "2028-12-31T12:30:00+01:00", "2028-12-31T12:00:00+01:00", "2028-12-31T13:00:00+01:00", time.Hour},
		{"day time_zone America/New_York", "2028-12-31T20:00:00-05:00", "2028-12-31T00:00:00-05:00", "2029-01-01T00:00:00-05:00", day},
		{"day time_zone Europe/London", "2028-12-31T00:00:00Z", "2028-12-31T00:00:00Z", "2029-01-01T00:00:00Z", day},
		{"hour time_zone Australia/Lord_Howe", "2028-12-31T23:30:00+11:00", "2028-12-31T23:00:00+11:00", "2029-01-01T00:00:00+11:00", time.Hour},

		// Midnight skipped: the day starts at the change. (time.Date alone
		// starts Havana's and Sao Paulo's at 23:00 the day before, and
		// Apia's 2011-12-30, which never happened, on the 29th.)
		{"day time_zone America/Havana", "2026-03-07T23:30:00-05:00", "2026-03-07T00:00:00-05:00", "2026-03-08T01:00:00-04:00", day},
		{"day time_zone America/Havana", "2026-03-08T12:00:00-04:00", "2026-03-08T01:00:00-04:00", "2026-03-09T00:00:00-04:00", 23 * time.Hour},
		{"day time_zone America/Sao_Paulo", "2018-11-04T12:00:00-02:00", "2018-11-04T01:00:00-02:00", "2018-11-05T00:00:00-02:00", 23 * time.Hour},
		{"day time_zone Asia/Beirut", "2026-03-29T12:00:00+03:00", "2026-03-29T01:00:00+03:00", "2026-03-30T00:00:00+03:00", 23 * time.Hour},
		{"day time_zone Pacific/Apia", "2011-12-29T23:59:59-10:00", "2011-12-29T00:00:00-10:00", "2011-12-31T00:00:00+14:00", day},
		{"day time_zone Pacific/Apia", "2011-12-31T00:00:00+14:00", "2011-12-31T00:00:00+14:00", "2012-01-01T00:00:00+14:00", day},
		{"month time_zone Pacific/Apia", "2011-12-15T12:00:00-10:00", "2011-12-01T00:00:00-10:00", "2012-01-01T00:00:00+14:00", 30 * day},

		// Midnight repeated: the day starts at the first, in eastern zones
		// too (time.Date gives Amman's second).
		{"day time_zone America/Havana", "2026-11-01T00:30:00-05:00", "2026-11-01T00:00:00-04:00", "2026-11-02T00:00:00-05:00", 25 * time.Hour},
		{"day time_zone Asia/Amman", "2018-10-26T00:30:00+02:00", "2018-10-26T00:00:00+03:00", "2018-10-27T00:00:00+02:00", 25 * time.Hour},
		{"day time_zone Asia/Amman", "2018-10-25T23:59:59+03:00", "2018-10-25T00:00:00+03:00", "2018-10-26T00:00:00+03:00", day},

		// The clock back over midnight (America/St_Johns until 2011: 00:01
		// NDT -> 23:01 NST): Saturday's repeated hour is in Sunday, which
		// had begun.
		{"day time_zone America/St_Johns", "2010-11-06T23:30:00-02:30", "2010-11-06T00:00:00-02:30", "2010-11-07T00:00:00-02:30", day},
		{"day time_zone America/St_Johns", "2010-11-06T23:30:00-03:30", "2010-11-07T00:00:00-02:30", "2010-11-08T00:00:00-03:30", 25 * time.Hour},

		// Changes by whole hours cut no hour, even off the hour (St_Johns
		// at 00:01) or where only the data changes (Sao Paulo in 2038).
		{"hour time_zone America/St_Johns", "2010-11-07T00:00:30-02:30", "2010-11-07T00:00:00-02:30", "2010-11-07T00:00:00-03:30", time.Hour},
		{"hour time_zone America/Sao_Paulo", "2038-01-19T03:14:07Z", "2038-01-19T00:00:00-03:00", "2038-01-19T01:00:00-03:00", time.Hour},

		// Hours off UTC's: Kathmandu (+05:45) starts its hours at :15 UTC;
		// Lord Howe's half-hour changes (2026-04-05 02:00 +11 -> 01:30
		// +10:30, 2026-10-04 02:00 +10:30 -> 02:30 +11) each make one
		// half-hour period, not overlapping ones.
		{"hour time_zone Asia/Kathmandu", "2026-05-17T10:31:45Z", "2026-05-17T16:00:00+05:45", "2026-05-17T17:00:00+05:45", time.Hour},
		{"hour time_zone Australia/Lord_Howe", "2026-04-05T01:45:00+11:00", "2026-04-05T01:00:00+11:00", "2026-04-05T01:30:00+10:30", time.Hour},
		{"hour time_zone Australia/Lord_Howe", "2026-04-05T01:45:00+10:30", "2026-04-05T01:30:00+10:30", "2026-04-05T02:00:00+10:30", 30 * time.Minute},
		{"hour time_zone Australia/Lord_Howe", "2026-04-05T02:15:00+10:30", "2026-04-05T02:00:00+10:30", "2026-04-05T03:00:00+10:30", time.Hour},
		{"hour time_zone Australia/Lord_Howe", "2026-10-04T01:45:00+10:30", "2026-10-04T01:00:00+10:30", "2026-10-04T02:30:00+11:00", time.Hour},
		{"hour time_zone Australia/Lord_Howe", "2026-10-04T02:45:00+11:00", "2026-10-04T02:30:00+11:00", "2026-10-04T03:00:00+11:00", 30 * time.Minute},
		{"day time_zone Australia/Lord_Howe", "2026-04-05T12:00:00+10:30", "2026-04-05T00:00:00+11:00", "2026-04-06T00:00:00+10:30", 24*time.Hour + 30*time.Minute},
	} {
		t.Run(c.per+" at "+c.at, func(t *testing.T) {
			for _, db := range dbs {
				p := db.in(t, mustPeriod(t, c.per))
				start, end := p.span(mustTime(t, c.at))
				got := start.Format(time.RFC3339) + " to " + end.Format(time.RFC3339)
				if want := c.start + " to " + c.end; got != want {
					t.Errorf("%s zones: got %s, want %s", db.name, got, want)
				}
				if l := end.Sub(start); l != c.length {
					t.Errorf("%s zones: length %v, want %v", db.name, l, c.length)
				}
			}
		})
	}
}

// micros reads RFC 3339 instants as Bounds.
func micros(tb testing.TB, bounds ...string) (b Bounds) {
	for i, s := range bounds {
		b[i] = mustTime(tb, s).UnixMicro()
	}
	return b
}

// TestPeriodBoundsFollowTheClock: Bounds gives the period containing the
// instant with its neighbours, and follows the instant wherever it goes
// (forward over a boundary, onto one, back before one, as a request's
// clock reading taken before another's may), never a stale cached
// period.
func TestPeriodBoundsFollowTheClock(t *testing.T) {
	p := mustPeriod(t, "month time_zone Europe/Berlin")
	march := micros(t, "2026-02-01T00:00:00+01:00", "2026-03-01T00:00:00+01:00", "2026-04-01T00:00:00+02:00", "2026-05-01T00:00:00+02:00")
	april := micros(t, "2026-03-01T00:00:00+01:00", "2026-04-01T00:00:00+02:00", "2026-05-01T00:00:00+02:00", "2026-06-01T00:00:00+02:00")
	d := mustPeriod(t, "2s")
	at44 := micros(t, "2026-05-17T10:31:42Z", "2026-05-17T10:31:44Z", "2026-05-17T10:31:46Z", "2026-05-17T10:31:48Z")
	at46 := micros(t, "2026-05-17T10:31:44Z", "2026-05-17T10:31:46Z", "2026-05-17T10:31:48Z", "2026-05-17T10:31:50Z")
	for _, c := range []struct {
		p    *Period
		at   string
		want Bounds
	}{
		{p, "2026-03-20T12:00:00Z", march},
		{p, "2026-03-31T21:59:59.999999Z", march},
		{p, "2026-04-01T00:00:00+02:00", april},
		{p, "2026-03-31T23:59:59.999999+02:00", march},
		{p, "2026-04-30T23:59:59+02:00", april},
		{d, "2026-05-17T10:31:45Z", at44},
		{d, "2026-05-17T10:31:46Z", at46},
		{d, "2026-05-17T10:31:45.999999Z", at44},
		{d, "2026-05-17T10:31:46.5Z", at46},
	} {
		if got := c.p.Bounds(mustTime(t, c.at)); got != c.want {
			t.Errorf("bounds at %s: got %v, want %v", c.at, got, c.want)
		}
	}
}

// TestPeriodBoundsConcurrentAcrossABoundary: requests whose clock
// readings straddle a boundary, at once on one period, each get the
// bounds of their own instant, whatever the others left in the cache.
func TestPeriodBoundsConcurrentAcrossABoundary(t *testing.T) {
	p := mustPeriod(t, "2s")
	boundary := mustTime(t, "2026-05-17T10:31:46Z")
	before := micros(t, "2026-05-17T10:31:42Z", "2026-05-17T10:31:44Z", "2026-05-17T10:31:46Z", "2026-05-17T10:31:48Z")
	after := micros(t, "2026-05-17T10:31:44Z", "2026-05-17T10:31:46Z", "2026-05-17T10:31:48Z", "2026-05-17T10:31:50Z")
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := range 8 {
		wg.Go(func() {
			for i := range 20000 {
				at := boundary.Add(time.Duration((i*7+g)%21-10) * time.Microsecond)
				want := after
				if at.Before(boundary) {
					want = before
				}
				if got := p.Bounds(at); got != want {
					errs <- fmt.Sprintf("bounds at %s: got %v, want %v", at.Format(time.RFC3339Nano), got, want)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// TestPeriodsTileTime: every period holds the instants it is asked
// about, and meets the periods before and after it exactly (no gap, no
// overlap, none empty), around every clock change from 2008 to 2030 in
// zones whose clocks skip or repeat midnight, move by half an hour or two
// hours, or skip a whole day, and through 2026.
func TestPeriodsTileTime(t *testing.T) {
	zones := []string{"UTC", "Europe/Berlin", "America/New_York", "America/Havana", "America/Sao_Paulo",
		"America/St_Johns", "Asia/Amman", "Asia/Beirut", "Asia/Kathmandu", "Australia/Lord_Howe",
		"Pacific/Apia", "Antarctica/Troll"}
	pers := []string{"minute", "hour", "day", "week", "week week_starts sunday", "month", "month month_day 28", "year"}
	for _, db := range zoneDatabases(t) {
		for _, zone := range zones {
			loc, err := db.load(zone)
			if err != nil {
				t.Fatal(err)
			}
			var instants []time.Time
			for at := time.Date(2026, 1, 1, 0, 0, 0, 0, loc); at.Year() == 2026; at = at.Add(3*time.Hour + 7*time.Minute + 11*time.Second) {
				instants = append(instants, at)
			}
			for at := time.Date(2008, 1, 1, 0, 0, 0, 0, loc); at.Year() < 2030; {
				_, change := at.ZoneBounds()
				if change.IsZero() {
					break
				}
				for _, d := range []time.Duration{-12 * time.Hour, -90 * time.Minute, -30 * time.Minute, -time.Second, 0, time.Second, 30 * time.Minute, 90 * time.Minute, 12 * time.Hour} {
					instants = append(instants, change.Add(d))
				}
				// ZoneBounds can end a zone before the instant (golang/go#81583).
				if change.After(at) {
					at = change
				} else {
					at = at.Add(day)
				}
			}
			for _, per := range pers {
				p := mustPeriod(t, per+" time_zone "+zone)
				p.loc = loc
				for _, at := range instants {
					start, end := p.span(at)
					if at.Before(start) || !at.Before(end) {
						t.Fatalf("%s zones, %s in %s: %v is not in its period %v to %v", db.name, per, zone, at, start, end)
					}
					if next, _ := p.span(end); !next.Equal(end) {
						t.Fatalf("%s zones, %s in %s: the period %v to %v is followed by one from %v", db.name, per, zone, start, end, next)
					}
					if _, prev := p.span(start.Add(-time.Nanosecond)); !prev.Equal(start) {
						t.Fatalf("%s zones, %s in %s: the period %v to %v is preceded by one to %v", db.name, per, zone, start, end, prev)
					}
				}
			}
		}
	}
}

// TestPeriodErrors: each mistake is refused naming the value, the
// subdirective and the fix; the values next to the limits are accepted.
func TestPeriodErrors(t *testing.T) {
	for _, c := range []struct{ spec, want string }{
		{"fortnight", "per 'fortnight': want minute, hour, day, week, month, year, or a duration like 6h (whole seconds, 1s to 3650d)"},
		{"Month", "per 'Month': want minute, hour, day, week, month, year, or a duration like 6h (whole seconds, 1s to 3650d)"},
		{"500ms", "per '500ms' is shorter than a second, the unit headers and Retry-After count in; use 1s or more"},
		{"0s", "per '0s' is shorter than a second, the unit headers and Retry-After count in; use 1s or more"},
		{"-1h", "per '-1h' is shorter than a second, the unit headers and Retry-After count in; use 1s or more"},
		{"1500ms", "per '1500ms' is not a whole number of seconds, which headers and Retry-After count in; use 1s or 2s"},
		{"90.01m", "per '90.01m' is not a whole number of seconds, which headers and Retry-After count in; use 1h30m0s or 1h30m1s"},
		{"3651d", "per '3651d' is longer than ten years, past which the script's times stop being exact; use per year, or at most 3650d"},
		{"day time_zone Europe/Berln", "time_zone 'Europe/Berln' is not in the IANA time zone database; use a name like Europe/Berlin, America/New_York or UTC (the default)"},
		{"day time_zone ../../etc/passwd", "time_zone '../../etc/passwd' is not in the IANA time zone database; use a name like Europe/Berlin, America/New_York or UTC (the default)"},
		{"day time_zone Local", "time_zone 'Local' is the host's zone, which can differ between the Caddy instances that share a quota; name the zone, like Europe/Berlin"},
		{"6h time_zone Europe/Berlin", "time_zone 'Europe/Berlin' with per '6h': a duration is counted from the Unix epoch, the same instants in every zone; remove time_zone, or use a period of the calendar like per day"},
		{"1d time_zone UTC", "time_zone 'UTC' with per '1d': a duration is counted from the Unix epoch, the same instants in every zone; remove time_zone, or use a period of the calendar like per day"},
		{"month month_day 29", "month_day '29': want the day of the month a period starts on, 1 to 28 (every month has it; default 1)"},
		{"month month_day -1", "month_day '-1': want the day of the month a period starts on, 1 to 28 (every month has it; default 1)"},
		{"week month_day 15", "month_day '15' with per 'week': month_day is the day a monthly period starts on; remove it, or use per month"},
		{"week week_starts saturday", "week_starts 'saturday': want monday (the default) or sunday"},
		{"week week_starts Sunday", "week_starts 'Sunday': want monday (the default) or sunday"},
		{"month week_starts sunday", "week_starts 'sunday' with per 'month': week_starts is the day a weekly period starts on; remove it, or use per week"},
		{"1s", ""},
		{"3650d", ""},
		{"minute time_zone Asia/Kathmandu", ""},
		{"day time_zone UTC", ""},
		{"month month_day 28", ""},
		{"month month_day 1", ""},
		{"week week_starts monday", ""},
	} {
		_, err := periodOf(c.spec)
		got := ""
		if err != nil {
			got = err.Error()
		}
		if got != c.want {
			t.Errorf("%s:\n got %q\nwant %q", c.spec, got, c.want)
		}
	}
}

// BenchmarkPeriodBounds: what a quota's period costs a request. cached is
// every request but the first of a period; computed is that first one
// (the three spans and the new bounds); +now adds reading the clock.
//
//	go test -run xxx -bench PeriodBounds -benchmem ./internal/calendar
func BenchmarkPeriodBounds(b *testing.B) {
	at := time.Date(2026, time.March, 20, 12, 0, 0, 0, time.UTC)
	for _, per := range []string{"month time_zone Europe/Berlin", "hour time_zone America/New_York", "2s"} {
		p := mustPeriod(b, per)
		b.Run(per+"/cached", func(b *testing.B) {
			p.Bounds(at)
			for b.Loop() {
				p.Bounds(at)
			}
		})
		b.Run(per+"/computed", func(b *testing.B) {
			for b.Loop() {
				p.current.Store(nil)
				p.Bounds(at)
			}
		})
	}
	p := mustPeriod(b, "month time_zone Europe/Berlin")
	b.Run("month time_zone Europe/Berlin/cached+now", func(b *testing.B) {
		for b.Loop() {
			p.Bounds(time.Now())
		}
	})
}
