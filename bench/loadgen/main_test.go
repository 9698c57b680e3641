package main

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func TestHistogramBuckets(t *testing.T) {
	var h histogram
	last := -1
	for _, v := range []uint64{0, 1, 511, 512, 513, 1023, 1024, 1 << 20, 1<<40 + 12345, math.MaxUint64} {
		i := bucketOf(v)
		if i < last || i >= len(h.counts) {
			t.Fatalf("bucketOf(%d) = %d (previous %d, %d buckets)", v, i, last, len(h.counts))
		}
		last = i
		if mid := bucketMid(i); v > 0 && math.Abs(mid-float64(v))/float64(v) > 0.004 {
			t.Errorf("bucketMid(bucketOf(%d)) = %.0f, off by more than 0.4%%", v, mid)
		}
	}
}

func TestHistogramQuantiles(t *testing.T) {
	var h histogram
	for i := 1; i <= 100_000; i++ {
		h.record(uint64(i) * 1000) // 1 µs .. 100 ms, uniform
	}
	for _, q := range []float64{0.5, 0.99} {
		want := q * 100_000 * 1000
		if got := h.quantile(q); math.Abs(got-want)/want > 0.005 {
			t.Errorf("quantile(%v) = %.0f, want %.0f", q, got, want)
		}
	}
	var a, b histogram
	for range 1000 {
		v := rand.Uint64N(1 << 30)
		a.record(v)
		b.record(v)
	}
	a.merge(&b)
	if a.quantile(0.5) != b.quantile(0.5) {
		t.Error("merging a histogram with a copy of itself moved the median")
	}
}

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
	}{
		{nil, 0},
		{[]float64{3}, 3},
		{[]float64{3, 1, 2}, 2},
		{[]float64{4, 1, 3, 2}, 2.5},
		{[]float64{5, -1, 5, 0, 7}, 5},
	} {
		in := append([]float64(nil), tc.in...)
		if got := median(in); got != tc.want {
			t.Errorf("median(%v) = %v, want %v", tc.in, got, tc.want)
		}
		if !slices.Equal(in, tc.in) {
			t.Errorf("median(%v) reordered its argument to %v", tc.in, in)
		}
	}
}

// tableOf runs the table on result lines and returns its rows by case.
func tableOf(t *testing.T, results string) map[string][]string {
	t.Helper()
	cases, err := readResults(strings.NewReader(results), "0", "1")
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	writeTable(&b, cases, "0", "1", "1s", "3s")
	rows := map[string][]string{}
	for _, line := range strings.Split(b.String(), "\n") {
		if f := strings.Fields(line); len(f) == 21 && strings.Contains(f[0], "@") {
			rows[f[0]] = f
		}
	}
	return rows
}

// Columns of a row (p50 and p99 carry "ms").
const (
	colRPS      = 2
	colP50      = 3
	colP99Bare  = 5
	colBare64   = 6
	colBare256  = 7
	colFloor    = 8
	colAllowed  = 9
	colMholt    = 10
	colCaddyUS  = 11
	colReadsReq = 12
	colErrors   = 20
)

func TestTableRatiosAreMediansOfRoundRatios(t *testing.T) {
	// Rounds' own ratios 0.9, 0.5, 0.9: median 0.9; the ratio of the
	// medians (100/200) would be 0.5.
	rows := tableOf(t, `case=bare@64 round=1 requests=300 rps=100 p50_us=1000
case=allowed@64 round=1 requests=270 rps=90 p50_us=2000
case=bare@64 round=2 requests=600 rps=200 p50_us=3000
case=allowed@64 round=2 requests=300 rps=100 p50_us=4000
case=bare@64 round=3 requests=900 rps=300 p50_us=5000
case=allowed@64 round=3 requests=810 rps=270 p50_us=6000
`)
	a := rows["allowed@64"]
	if a == nil {
		t.Fatalf("no allowed@64 row in %v", rows)
	}
	if a[colBare64] != "0.900" {
		t.Errorf("allowed@64 vs bare64 = %s, want 0.900 (median of the rounds' ratios)", a[colBare64])
	}
	if a[colRPS] != "100" || a[colP50] != "4.00ms" {
		t.Errorf("allowed@64 req/s %s, p50 %s; want the medians 100 and 4.00ms", a[colRPS], a[colP50])
	}
	if b := rows["bare@64"]; b[colBare64] != "1.000" || b[colRPS] != "200" {
		t.Errorf("bare@64 row %v", b)
	}
}

func TestTableMissingBaselines(t *testing.T) {
	// Any <name>@<conns> is set beside bare@64, bare@256 (at 256 only)
	// and its floor at <conns> (floor3 for multi, memfloor for memory and
	// lease, floor for the others), when those cases ran; "-" otherwise.
	rows := tableOf(t, `case=bare@64 round=1 requests=100 rps=100
case=multi@64 round=1 requests=50 rps=50
case=lease@256 round=1 requests=40 rps=40
case=floor@256 round=1 requests=80 rps=80
case=memfloor@256 round=1 requests=50 rps=50
case=allowed@256 round=1 requests=40 rps=40
case=memory@128 round=1 requests=20 rps=20
case=floor@128 round=1 requests=20 rps=20
`)
	for name, want := range map[string][3]string{
		"bare@64":     {"1.000", "-", "-"},
		"multi@64":    {"0.500", "-", "-"},
		"lease@256":   {"0.400", "-", "0.800"},
		"allowed@256": {"0.400", "-", "0.500"},
		"floor@256":   {"0.800", "-", "1.000"},
		"memory@128":  {"0.200", "-", "-"},
	} {
		row := rows[name]
		if row == nil {
			t.Errorf("no %s row", name)
			continue
		}
		if got := [3]string{row[colBare64], row[colBare256], row[colFloor]}; got != want {
			t.Errorf("%s: vs bare64, bare256, floor = %v, want %v", name, got, want)
		}
	}
	// Without bare@64 the first ratio column is "-" too.
	rows = tableOf(t, "case=allowed@256 round=1 requests=10 rps=10\ncase=bare@256 round=1 requests=20 rps=20\n")
	if got := rows["allowed@256"]; got[colBare64] != "-" || got[colBare256] != "0.500" || got[colFloor] != "-" {
		t.Errorf("allowed@256 row %v", got)
	}
}

func TestTableVsMholt(t *testing.T) {
	// The cases decided in the process are set beside mholt's allowed
	// path, denied beside its denied path, of the same connection count;
	// the others, and cases whose peer did not run, get "-".
	rows := tableOf(t, `case=mholt@64 round=1 requests=100 rps=100
case=mholt-denied@64 round=1 requests=50 rps=50
case=memory@64 round=1 requests=97 rps=97
case=lease@64 round=1 requests=90 rps=90
case=memfloor@64 round=1 requests=99 rps=99
case=denied@64 round=1 requests=120 rps=120
case=allowed@64 round=1 requests=60 rps=60
case=memory@256 round=1 requests=60 rps=60
`)
	for name, want := range map[string]string{
		"memory@64": "0.970", "lease@64": "0.900", "memfloor@64": "0.990", "denied@64": "2.400",
		"allowed@64": "-", "memory@256": "-", "mholt@64": "-",
	} {
		if got := rows[name]; got == nil || got[colMholt] != want {
			t.Errorf("%s: vs mholt in row %v, want %s", name, got, want)
		}
	}
}

func TestTableZeroRequests(t *testing.T) {
	// A round without requests counts 0 per request (not NaN), errors add up.
	rows := tableOf(t, `case=denied@64 round=1 requests=0 rps=0 server_cpu=50 reads=10 errors=3 unexpected=1
case=denied@64 round=2 requests=0 rps=0 server_cpu=50 reads=10 errors=2
`)
	d := rows["denied@64"]
	if d[colCaddyUS] != "0.0" || d[colReadsReq] != "0.000" || d[colErrors] != "6" {
		t.Errorf("denied@64 row %v", d)
	}
}

func TestTableLeaseAgainstMemory(t *testing.T) {
	// lease@N beside memory@N: the rounds' own req/s ratios (0.9, 0.95,
	// 0.6: median 0.9), p99 differences (+1, +0.5, +3: +1) and ratios.
	cases, err := readResults(strings.NewReader(`case=memory@64 round=1 requests=100 rps=100 p99_us=4000
case=lease@64 round=1 requests=90 rps=90 p99_us=5000
case=memory@64 round=2 requests=200 rps=200 p99_us=2000
case=lease@64 round=2 requests=190 rps=190 p99_us=2500
case=memory@64 round=3 requests=100 rps=100 p99_us=1000
case=lease@64 round=3 requests=60 rps=60 p99_us=4000
case=lease@256 round=1 requests=60 rps=60 p99_us=4000
`), "0", "1")
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	writeTable(&b, cases, "0", "1", "1s", "3s")
	_, versus, ok := strings.Cut(b.String(), "(lease against memory")
	if !ok {
		t.Fatalf("no lease against memory section in\n%s", b.String())
	}
	if want := "lease@64          0.900      +1.00ms        1.250\n"; !strings.Contains(versus, want) || strings.Contains(versus, "lease@256") {
		t.Errorf("lease against memory:\n%s\nwant the line %q, and no lease@256 (no memory@256 ran)", versus, want)
	}
}

func TestTableAgainstBaseline(t *testing.T) {
	// allowed@64 beside allowed.base@64 (the baseline build): the rounds'
	// own req/s ratios (1.1, 0.9, 0.95: median 0.95) and each build's CPU
	// per request; cases without a twin get no line.
	cases, err := readResults(strings.NewReader(`case=allowed@64 round=1 requests=110 rps=110 server_cpu=55 redis_cpu=11 scripts=110
case=allowed.base@64 round=1 requests=100 rps=100 server_cpu=50 redis_cpu=10 scripts=100
case=allowed@64 round=2 requests=90 rps=90 server_cpu=45 redis_cpu=9 scripts=90
case=allowed.base@64 round=2 requests=100 rps=100 server_cpu=50 redis_cpu=10 scripts=100
case=allowed@64 round=3 requests=95 rps=95 server_cpu=47.5 redis_cpu=9.5 scripts=95
case=allowed.base@64 round=3 requests=100 rps=100 server_cpu=60 redis_cpu=10 scripts=200
case=memory@64 round=1 requests=100 rps=100
`), "0", "1")
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	writeTable(&b, cases, "0", "1", "1s", "3s")
	_, versus, ok := strings.Cut(b.String(), "(this build against the baseline build")
	if !ok {
		t.Fatalf("no baseline section in\n%s", b.String())
	}
	want := "allowed@64         0.950    5000.0    5000.0    1000.0    1000.0       1.000       1.000\n"
	if !strings.Contains(versus, want) || strings.Contains(versus, "memory@64") || strings.Contains(versus, "allowed.base@64 ") {
		t.Errorf("against the baseline:\n%s\nwant the line %q, and no line for memory@64 (no twin) or the twin itself", versus, want)
	}
}

// TestTableOutput compares the whole output for fixed lines with the
// table as it was checked by hand (the columns up to p99 and from
// vs bare64 on are what the awk program scripts/bench.sh used before
// printed).
func TestTableOutput(t *testing.T) {
	cases, err := readResults(strings.NewReader(tableFixture), "0", "1")
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	writeTable(&b, cases, "0", "1", "1s", "3s")
	if b.String() != tableGolden {
		t.Errorf("got\n%s\nwant\n%s", b.String(), tableGolden)
	}
}

const tableFixture = `case=bare@64 round=1 requests=60000 seconds=3.000 rps=20000 p50_us=3000.0 p99_us=9000.0 errors=0 unexpected=0 load_cpu=60.0 server_cpu=99.0 cpu0_busy=100.0 cpu1_busy=90.0 reads=0 scripts=0 commands=3 redis_cpu=1.0
case=floor@64 round=1 requests=45000 seconds=3.000 rps=15000 p50_us=3600.0 p99_us=10000.0 errors=0 unexpected=0 load_cpu=45.0 server_cpu=98.0 cpu0_busy=99.0 cpu1_busy=95.0 reads=3000 scripts=45000 commands=45003 redis_cpu=40.0
case=allowed@256 round=1 requests=39000 seconds=3.000 rps=13000 p50_us=18000.0 p99_us=37000.0 errors=1 unexpected=2 load_cpu=40.0 server_cpu=99.5 cpu0_busy=100.0 cpu1_busy=92.0 reads=900 scripts=39000 commands=39003 redis_cpu=45.0
case=bare@64 round=2 requests=30000 seconds=3.000 rps=10000 p50_us=5000.0 p99_us=12000.0 errors=0 unexpected=0 load_cpu=30.0 server_cpu=97.0 cpu0_busy=100.0 cpu1_busy=50.0 reads=0 scripts=0 commands=3 redis_cpu=1.0
case=floor@64 round=2 requests=24000 seconds=3.000 rps=8000 p50_us=6000.0 p99_us=14000.0 errors=0 unexpected=0 load_cpu=25.0 server_cpu=96.0 cpu0_busy=98.0 cpu1_busy=60.0 reads=1600 scripts=24000 commands=24003 redis_cpu=20.0
case=allowed@256 round=2 requests=0 seconds=3.000 rps=0 p50_us=0.0 p99_us=0.0 errors=7 unexpected=0 load_cpu=5.0 server_cpu=10.0 cpu0_busy=12.0 cpu1_busy=9.0 reads=0 scripts=0 commands=0 redis_cpu=0.0
`

const tableGolden = `case            conns    req/s      p50      p99  p99-bare vs bare64 vs bare256 vs floor vs allowed vs mholt  caddy-us reads/req scripts/req  redis-us caddy%  load% redis% other0 other1 errors
bare@64            64    15000   4.00ms  10.50ms   +0.00ms     1.000          -    1.292          -        -      73.2     0.000       0.000       0.8     98     45      1      2     24      0
floor@64           64    11500   4.80ms  12.00ms   +1.50ms     0.775          -    1.000          -        -      92.7     0.067       1.000      25.8     97     35     30      2     12      0
allowed@256       256     6500   9.00ms  18.50ms         -     0.325          -        -      0.500        -      38.3     0.012       0.500      17.3     55     22     22      1      6     10
(medians of 2 rounds, 1s warm-up + 3s measured per case. caddy-us/redis-us: CPU time of Caddy /
 Redis per request in microseconds (caddy-us minus bare's is the limiter's cost). caddy%/load%/redis%: CPU use over the
 measured window, % of one CPU, of Caddy (CPU 0), the load generator and Redis (both CPU 1); other0/other1:
 what other processes took of CPU 0 / CPU 1 meanwhile (well above 0: the figures are not clean);
 errors: transport errors + unexpected statuses, summed over rounds)
`

func TestTableManyKeysBesideAllowedOfTheirShape(t *testing.T) {
	// A case over many keys is set beside allowed and the peer over the
	// same keys, never beside a floor (one key per connection); the lease
	// table beside allowed shows both's costs.
	results := `case=allowed-keys@64 round=1 requests=1000 rps=100 server_cpu=50 redis_cpu=10 scripts=1000 p99_us=2000
case=lease-keys@64 round=1 requests=990 rps=99 server_cpu=50 redis_cpu=10 scripts=990 p99_us=2100
case=mholt-keys@64 round=1 requests=2000 rps=200
case=floor@64 round=1 requests=500 rps=50
case=allowed-mixed@64 round=1 requests=1000 rps=100 scripts=1000
case=lease-mixed@64 round=1 requests=3000 rps=300 scripts=150
`
	rows := tableOf(t, results)
	if r := rows["lease-keys@64"]; r == nil || r[colAllowed] != "0.990" || r[colMholt] != "0.495" || r[colFloor] != "-" {
		t.Errorf("lease-keys@64 row %v; want 0.990 vs allowed-keys, 0.495 vs mholt-keys, no floor", r)
	}
	if r := rows["lease-mixed@64"]; r == nil || r[colAllowed] != "3.000" {
		t.Errorf("lease-mixed@64 row %v; want 3.000 vs allowed-mixed", r)
	}
	cases, err := readResults(strings.NewReader(results), "0", "1")
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	writeTable(&b, cases, "0", "1", "1s", "3s")
	beside := map[string][]string{}
	for _, line := range strings.Split(b.String(), "\n") {
		if f := strings.Fields(line); len(f) == 9 && strings.HasPrefix(f[0], "lease-") {
			beside[f[0]] = f
		}
	}
	if r := beside["lease-keys@64"]; r == nil || r[1] != "0.990" || r[2] != "+0.10ms" || r[7] != "1.000" || r[8] != "1.000" {
		t.Errorf("lease-keys@64 beside allowed-keys: %v", r)
	}
	if r := beside["lease-mixed@64"]; r == nil || r[1] != "3.000" || r[7] != "0.050" || r[8] != "1.000" {
		t.Errorf("lease-mixed@64 beside allowed-mixed: %v", r)
	}
}

func TestWorkerCyclesKeys(t *testing.T) {
	// -keys: each request the next key after next, around; -hot: about hotShare of
	// them to the hot keys, in turn.
	w := &worker{cold: [][]byte{[]byte("a"), []byte("b"), []byte("c")}, next: 1, rng: rand.New(rand.NewPCG(1, 2))}
	var got []string
	for range 4 {
		got = append(got, string(w.request()))
	}
	if strings.Join(got, "") != "cabc" {
		t.Errorf("cycling 3 keys from 1: %v", got)
	}
	w.hot, w.hotShare = [][]byte{[]byte("H")}, 0.9
	hot := 0
	for range 10000 {
		if string(w.request()) == "H" {
			hot++
		}
	}
	if hot < 8800 || hot > 9200 {
		t.Errorf("%d of 10000 requests to the hot key; want about 9000", hot)
	}
}
