package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
)

// table prints the table of `make bench` from the lines scripts/bench.sh
// collects: "case=<name>@<conns> round=<n>" followed by what run printed,
// one line per case and round. Cases appear in the order of their first
// line. Each column is the median over the rounds, except the ratios: a
// ratio is the median of the rounds' own ratios (both cases from the same
// round), which follows the machine's drift from round to round better
// than a ratio of medians. Every case is set beside bare@64, and beside
// bare@<conns>, its floor (see floorOf), allowed@<conns> (a single
// limit; allowed-keys or allowed-mixed for a case over many keys: see
// shapeOf) and the peer plugin (see mholtOf) of its own connection count;
// p99-bare is the median of the rounds' own differences of p99 from
// bare@<conns>'s.
func table(argv []string) {
	fs := flag.NewFlagSet("table", flag.ExitOnError)
	warmup := fs.String("warmup", "1s", "warm-up per case, as given to run (for the footnote)")
	dur := fs.String("d", "3s", "measured duration per case, as given to run (for the footnote)")
	cpus := fs.String("cpus", "0,1", "Caddy's CPU, then the load generator's (and Redis's), as given to run")
	_ = fs.Parse(argv)
	caddyCPU, loadCPU, ok := strings.Cut(*cpus, ",")
	if fs.NArg() != 1 || !ok {
		fmt.Fprintln(os.Stderr, "usage: loadgen table [-warmup 1s] [-d 3s] [-cpus CADDY,LOAD] RESULTS")
		os.Exit(2)
	}
	f, err := os.Open(fs.Arg(0))
	if err != nil {
		fatal(err)
	}
	defer f.Close()
	cases, err := readResults(f, caddyCPU, loadCPU)
	if err != nil {
		fatal(err)
	}
	writeTable(os.Stdout, cases, caddyCPU, loadCPU, *warmup, *dur)
}

// benchCase is one case's figures, one entry per round in file order.
type benchCase struct {
	name   string // "<name>@<conns>"
	conns  string
	rounds []roundFigures
	bad    int64 // transport errors + unexpected statuses, all rounds
}

// roundFigures are one case's figures in one round.
type roundFigures struct {
	rps, p50ms, p99ms            float64
	readsPerReq, scriptsPerReq   float64
	caddyCPU, loadCPU, redisCPU  float64 // % of one CPU
	otherCaddyCPU, otherLoadCPU  float64 // what other processes took of those CPUs, %
	caddyUSPerReq, redisUSPerReq float64 // CPU time per request, µs
}

// readResults parses the result lines; caddyCPU and loadCPU name the
// cpuN_busy fields of Caddy's CPU and the load generator's.
func readResults(r io.Reader, caddyCPU, loadCPU string) ([]*benchCase, error) {
	var cases []*benchCase
	byName := map[string]*benchCase{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		kv := map[string]string{}
		for _, field := range strings.Fields(sc.Text()) {
			k, v, _ := strings.Cut(field, "=")
			kv[k] = v
		}
		name, ok := kv["case"]
		if !ok {
			continue
		}
		num := func(k string) float64 {
			f, _ := strconv.ParseFloat(kv[k], 64) // absent: 0
			return f
		}
		perReq := func(k string) float64 {
			if num("requests") == 0 {
				return 0
			}
			return num(k) / num("requests")
		}
		perRPS := func(k string) float64 { // % of a CPU per req/s, in µs per request
			if num("rps") == 0 {
				return 0
			}
			return num(k) * 1e4 / num("rps")
		}
		c := byName[name]
		if c == nil {
			_, conns, _ := strings.Cut(name, "@")
			c = &benchCase{name: name, conns: conns}
			byName[name] = c
			cases = append(cases, c)
		}
		c.rounds = append(c.rounds, roundFigures{
			rps:           num("rps"),
			p50ms:         num("p50_us") / 1000,
			p99ms:         num("p99_us") / 1000,
			readsPerReq:   perReq("reads"),
			scriptsPerReq: perReq("scripts"),
			caddyCPU:      num("server_cpu"),
			loadCPU:       num("load_cpu"),
			redisCPU:      num("redis_cpu"),
			otherCaddyCPU: num("cpu"+caddyCPU+"_busy") - num("server_cpu"),
			otherLoadCPU:  num("cpu"+loadCPU+"_busy") - num("load_cpu") - num("redis_cpu"),
			caddyUSPerReq: perRPS("server_cpu"),
			redisUSPerReq: perRPS("redis_cpu"),
		})
		c.bad += int64(num("errors") + num("unexpected"))
	}
	return cases, sc.Err()
}

func writeTable(w io.Writer, cases []*benchCase, caddyCPU, loadCPU, warmup, dur string) {
	byName := map[string]*benchCase{}
	rounds := 0
	for _, c := range cases {
		byName[c.name] = c
		rounds = max(rounds, len(c.rounds))
	}
	width := 15 // of the case column: the longest name
	for _, c := range cases {
		width = max(width, len(c.name))
	}
	fmt.Fprintf(w, "%-*s %5s %8s %8s %8s %9s %9s %10s %8s %10s %8s %9s %9s %11s %9s %6s %6s %6s %6s %6s %6s\n",
		width, "case", "conns", "req/s", "p50", "p99", "p99-bare", "vs bare64", "vs bare256", "vs floor", "vs allowed", "vs mholt", "caddy-us", "reads/req",
		"scripts/req", "redis-us", "caddy%", "load%", "redis%", "other0", "other1", "errors")
	for _, c := range cases {
		med := func(field func(roundFigures) float64) float64 {
			vs := make([]float64, len(c.rounds))
			for i, r := range c.rounds {
				vs[i] = field(r)
			}
			return median(vs)
		}
		vsBare256 := "-"
		if c.conns == "256" {
			vsBare256 = ratio(c, byName["bare@256"])
		}
		fmt.Fprintf(w, "%-*s %5s %8.0f %6.2fms %6.2fms %9s %9s %10s %8s %10s %8s %9.1f %9.3f %11.3f %9.1f %6.0f %6.0f %6.0f %6.0f %6.0f %6d\n",
			width, c.name, c.conns,
			med(func(r roundFigures) float64 { return r.rps }),
			med(func(r roundFigures) float64 { return r.p50ms }),
			med(func(r roundFigures) float64 { return r.p99ms }),
			p99Above(c, byName["bare@"+c.conns]),
			ratio(c, byName["bare@64"]), vsBare256, ratio(c, byName[floorOf(c.name)+"@"+c.conns]), ratio(c, byName["allowed"+shapeOf(c.name)+"@"+c.conns]),
			ratio(c, byName[mholtOf(c.name)+"@"+c.conns]),
			med(func(r roundFigures) float64 { return r.caddyUSPerReq }),
			med(func(r roundFigures) float64 { return r.readsPerReq }),
			med(func(r roundFigures) float64 { return r.scriptsPerReq }),
			med(func(r roundFigures) float64 { return r.redisUSPerReq }),
			med(func(r roundFigures) float64 { return r.caddyCPU }),
			med(func(r roundFigures) float64 { return r.loadCPU }),
			med(func(r roundFigures) float64 { return r.redisCPU }),
			med(func(r roundFigures) float64 { return r.otherCaddyCPU }),
			med(func(r roundFigures) float64 { return r.otherLoadCPU }),
			c.bad)
	}
	fmt.Fprintf(w, `(medians of %d rounds, %s warm-up + %s measured per case. caddy-us/redis-us: CPU time of Caddy /
 Redis per request in microseconds (caddy-us minus bare's is the limiter's cost). caddy%%/load%%/redis%%: CPU use over the
 measured window, %% of one CPU, of Caddy (CPU %s), the load generator and Redis (both CPU %s); other0/other1:
 what other processes took of CPU %s / CPU %s meanwhile (well above 0: the figures are not clean);
 errors: transport errors + unexpected statuses, summed over rounds)
`, rounds, warmup, dur, caddyCPU, loadCPU, caddyCPU, loadCPU)
	writeVersus(w, cases, byName, "lease", "memory")
	writeBeside(w, cases, byName, "lease", "allowed")
	writeBaseline(w, cases, byName)
}

// shapeOf is the traffic a case's name says, past its configuration:
// "-keys" (many cold keys), "-mixed" (a few hot keys among them), or ""
// (a key per connection). A case is set beside allowed of its own shape.
func shapeOf(name string) string {
	base, _, _ := strings.Cut(name, "@")
	base = strings.TrimSuffix(base, baselineSuffix)
	for _, shape := range []string{"-keys", "-mixed"} {
		if strings.HasSuffix(base, shape) {
			return shape
		}
	}
	return ""
}

// writeBeside sets each case of config name over many keys (each shape
// of shapeOf but a key per connection) beside config base on the same
// traffic, when both ran: req/s ratio and p99 difference (medians of the
// rounds' own), then Caddy's and Redis's CPU per request and script
// calls per request of each (medians).
func writeBeside(w io.Writer, cases []*benchCase, byName map[string]*benchCase, name, base string) {
	header := false
	for _, c := range cases {
		n, conns, _ := strings.Cut(c.name, "@")
		shape := shapeOf(c.name)
		b := byName[base+shape+"@"+conns]
		if shape == "" || n != name+shape || b == nil {
			continue
		}
		if !header {
			fmt.Fprintf(w, "\n%-17s %10s %12s %9s %9s %9s %9s %11s %11s   (%s against %s on the same keys, medians of the rounds' own figures)\n",
				"case", "vs "+base, "p99-"+base, "caddy-us", "base-us", "redis-us", "base-us", "scripts/req", "base", name, base)
			header = true
		}
		med := func(c *benchCase, field func(roundFigures) float64) float64 {
			vs := make([]float64, len(c.rounds))
			for i, r := range c.rounds {
				vs[i] = field(r)
			}
			return median(vs)
		}
		caddyUS := func(r roundFigures) float64 { return r.caddyUSPerReq }
		redisUS := func(r roundFigures) float64 { return r.redisUSPerReq }
		scripts := func(r roundFigures) float64 { return r.scriptsPerReq }
		fmt.Fprintf(w, "%-17s %10s %12s %9.1f %9.1f %9.1f %9.1f %11.3f %11.3f\n", c.name, ratio(c, b), p99Above(c, b),
			med(c, caddyUS), med(b, caddyUS), med(c, redisUS), med(b, redisUS), med(c, scripts), med(b, scripts))
	}
}

// baselineSuffix marks a case run on the baseline build (BENCH_BASELINE):
// "<name>.base@<conns>" is "<name>@<conns>" on the build before a change.
const baselineSuffix = ".base"

// writeBaseline sets each case beside its run on the baseline build, when
// both ran: req/s ratio (median of the rounds' own), then Caddy's and
// Redis's CPU per request and script calls per request of each.
func writeBaseline(w io.Writer, cases []*benchCase, byName map[string]*benchCase) {
	header := false
	for _, c := range cases {
		name, conns, _ := strings.Cut(c.name, "@")
		b := byName[name+baselineSuffix+"@"+conns]
		if strings.HasSuffix(name, baselineSuffix) || b == nil {
			continue
		}
		if !header {
			fmt.Fprintf(w, "\n%-15s %8s %9s %9s %9s %9s %11s %11s   (this build against the baseline build, medians of the rounds' own figures)\n",
				"case", "vs base", "caddy-us", "base-us", "redis-us", "base-us", "scripts/req", "base")
			header = true
		}
		med := func(c *benchCase, field func(roundFigures) float64) float64 {
			vs := make([]float64, len(c.rounds))
			for i, r := range c.rounds {
				vs[i] = field(r)
			}
			return median(vs)
		}
		caddyUS := func(r roundFigures) float64 { return r.caddyUSPerReq }
		redisUS := func(r roundFigures) float64 { return r.redisUSPerReq }
		scripts := func(r roundFigures) float64 { return r.scriptsPerReq }
		fmt.Fprintf(w, "%-15s %8s %9.1f %9.1f %9.1f %9.1f %11.3f %11.3f\n", c.name, ratio(c, b),
			med(c, caddyUS), med(b, caddyUS), med(c, redisUS), med(b, redisUS), med(c, scripts), med(b, scripts))
	}
}

// writeVersus sets each <name>@<conns> beside <base>@<conns>, when both
// ran: req/s ratio, p99 difference and p99 ratio, each the median of the
// rounds' own (the lease targets are set against the in-process store).
func writeVersus(w io.Writer, cases []*benchCase, byName map[string]*benchCase, name, base string) {
	header := false
	for _, c := range cases {
		b := byName[base+"@"+c.conns]
		if n, _, _ := strings.Cut(c.name, "@"); n != name || b == nil {
			continue
		}
		if !header {
			fmt.Fprintf(w, "\n%-12s %10s %12s %12s   (%s against %s, medians of the rounds' own figures)\n", "case", "vs "+base, "p99-"+base, "p99/"+base, name, base)
			header = true
		}
		n := min(len(c.rounds), len(b.rounds))
		rs := make([]float64, n)
		for i := range n {
			if b.rounds[i].p99ms != 0 {
				rs[i] = c.rounds[i].p99ms / b.rounds[i].p99ms
			}
		}
		fmt.Fprintf(w, "%-12s %10s %12s %12.3f\n", c.name, ratio(c, b), p99Above(c, b), median(rs))
	}
}

// ratio is the median over the rounds of c's req/s over base's in the
// same round, formatted; "-" without base.
func ratio(c, base *benchCase) string {
	if base == nil {
		return "-"
	}
	n := min(len(c.rounds), len(base.rounds))
	rs := make([]float64, n)
	for i := range n {
		if base.rounds[i].rps != 0 {
			rs[i] = c.rounds[i].rps / base.rounds[i].rps
		}
	}
	return fmt.Sprintf("%.3f", median(rs))
}

// floorOf names the measuring stick a case is set beside: floor3 (three
// buckets in one script call) for a policy of three limits, memfloor (an
// in-process bucket keyed by placeholders) for the cases decided in the
// process, floor for the others.
func floorOf(name string) string {
	if shapeOf(name) != "" {
		return "" // the floors send a key per connection
	}
	switch base, _, _ := strings.Cut(name, "@"); base {
	case "multi", "quota":
		return "floor3"
	case "memory", "lease":
		return "memfloor"
	}
	return "floor"
}

// mholtOf names the case of the peer plugin, mholt/caddy-ratelimit, that
// a case is set beside: its allowed path (mholt) for the cases decided in
// the process, its denied path (mholt-denied) for denied; "" for none.
func mholtOf(name string) string {
	switch base, _, _ := strings.Cut(name, "@"); base {
	case "memory", "lease", "memfloor":
		return "mholt"
	case "memory-keys", "lease-keys", "allowed-keys":
		return "mholt-keys"
	case "denied":
		return "mholt-denied"
	}
	return ""
}

// p99Above is the median over the rounds of c's p99 less base's in the
// same round, formatted; "-" without base.
func p99Above(c, base *benchCase) string {
	if base == nil {
		return "-"
	}
	n := min(len(c.rounds), len(base.rounds))
	ds := make([]float64, n)
	for i := range n {
		ds[i] = c.rounds[i].p99ms - base.rounds[i].p99ms
	}
	return fmt.Sprintf("%+.2fms", median(ds))
}

// median of vs (the mean of the middle two for an even count; 0 for none).
func median(vs []float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(vs))
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}
