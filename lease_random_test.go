package ratelimit

// The bound with leases, at random: several instances with concurrent
// requests on one key, leases, renewals, give-backs, an instance that
// stops answering (its leases expire in Redis), and Redis errors that
// leave the instance unsure whether its call ran, against one real
// Redis; every window of every run is checked against burst + rate × T.

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-redis/ratelimit/internal/boundtest"
	"github.com/caddy-redis/ratelimit/internal/redistest"
)

// randomSchedule is one run: its limit, its instances and their faults.
type randomSchedule struct {
	rate               float64
	burst, maxTokens   int64
	cost               int64 // requested_tokens
	hold               time.Duration
	instances, workers int
	cuts, deaths       int
	// plain instances (the first ones) run without lease: the plain
	// script, as a leasing zone's cold keys do; a share cold of the
	// workers' requests go to other keys, each seen about once.
	plain int
	cold  float64
}

func (s randomSchedule) String() string {
	return fmt.Sprintf("rate %v burst %d cost %d lease %d %v; %d instances (%d without lease) × %d workers, %.0f%% to cold keys; %d cuts, %d deaths",
		s.rate, s.burst, s.cost, s.maxTokens, s.hold, s.instances, s.plain, s.workers, 100*s.cold, s.cuts, s.deaths)
}

// TestLeaseBoundAtRandom runs schedules of instances, each a handler of
// its own behind a proxy to one Redis, whose workers send requests on
// one key in busy phases (rushes, floods, a request every so often, or
// about one per hold, so that the key turns hot and cold on an instance,
// leased or taken by the plain script) between quiet ones, with requests
// to cold keys mixed in and an instance without lease beside (the plain
// script under the others' leases), while at random times a proxy cuts its connections
// for a while (calls run in Redis, their answers are lost) and an
// instance dies (its workers stop and nothing of it reaches Redis any
// more: its leases are never given back and expire). Every window of
// every run holds at most burst + rate × T admissions.
// RATELIMIT_LEASE_SCHEDULES (default 10) sets how many runs, and
// RATELIMIT_LEASE_SEED the seed (default: the time, logged). (Checked:
// with lease.lua refilling into lent tokens, 4 seeds of 5 broke the
// bound here; with an instance counting the tokens admitted during a
// renewal twice, the first seed did.)
func TestLeaseBoundAtRandom(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	for _, source := range []string{scriptSource, leaseSource} { // before any instance: their calls start at once
		if err := rdb.ScriptLoad(context.Background(), source).Err(); err != nil {
			t.Fatal(err)
		}
	}
	schedules := 10
	if v, err := strconv.Atoi(os.Getenv("RATELIMIT_LEASE_SCHEDULES")); err == nil && v > 0 {
		schedules = v
	}
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("RATELIMIT_LEASE_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (RATELIMIT_LEASE_SEED)", seed)
	var windows, admitted, denied, failed, calls int64
	tightest := math.Inf(-1)
	for n := range schedules {
		rng := rand.New(rand.NewPCG(seed, uint64(n)))
		s := randomSchedule{
			burst:     []int64{5, 20, 60}[rng.IntN(3)],
			maxTokens: []int64{2, 8, 32}[rng.IntN(3)],
			hold:      []time.Duration{20 * time.Millisecond, 150 * time.Millisecond, time.Second, time.Second}[rng.IntN(4)],
			instances: 2 + rng.IntN(3),
			workers:   1 + rng.IntN(4),
			cuts:      rng.IntN(4),
			deaths:    rng.IntN(2),
			plain:     rng.IntN(2),
			cold:      []float64{0, 0, 0.5, 0.9}[rng.IntN(4)],
		}
		s.rate = float64(s.burst) * []float64{0.2, 1}[rng.IntN(2)]
		s.cost = []int64{1, 1, 2}[rng.IntN(3)]
		before := redistest.ScriptCalls(t, rdb)
		log, counts := runSchedule(t, rng, fmt.Sprint("random", n), srv.Addr, s)
		calls += redistest.ScriptCalls(t, rdb) - before
		w, tight := log.Check(t, float64(s.burst)/float64(s.cost), s.rate/float64(s.cost))
		t.Logf("schedule %d (%v): %d admitted, %d denied, %d failed; %d windows, the tightest %+.2f of its bound",
			n, s, log.Len(), counts[0], counts[1], w, tight)
		tightest = max(tightest, tight)
		windows += int64(w)
		admitted += int64(log.Len())
		denied += counts[0]
		failed += counts[1]
		if t.Failed() {
			t.Fatalf("schedule %d broke the bound (seed %d)", n, seed)
		}
	}
	t.Logf("%d schedules: %d admissions (%d denied, %d failed) in %d script calls; %d windows checked against burst + rate × T, the tightest %+.2f of its bound",
		schedules, admitted, denied, failed, calls, windows, tightest)
}

// runSchedule runs one schedule for about 3 s on zone, and returns
// its admissions and how many requests were denied and failed. Each
// instance is busy in phases of 5 to 800 ms and quiet for 0.1 to 1 s
// between them (all at once, or each on its own), long enough for the
// bucket to refill while leases are out; in a phase a worker sends as
// fast as it can, or a request every few ms, so that leases lent in a
// calm phase may still hold tokens when a busy one comes.
func runSchedule(t *testing.T, rng *rand.Rand, zone, redisAddr string, s randomSchedule) (*boundtest.AdmissionLog, [2]int64) {
	const length = 3 * time.Second
	type phase struct {
		from, to time.Duration
		gap      time.Duration // the mean pause between a worker's requests
	}
	phases := func() []phase {
		var busy []phase
		for at := time.Duration(rng.IntN(200)) * time.Millisecond; at < length; {
			d := time.Duration(30+rng.IntN(770)) * time.Millisecond
			if rng.IntN(3) == 0 {
				d = time.Duration(5+rng.IntN(25)) * time.Millisecond // a short rush: leases lent, then left
			}
			gap := []time.Duration{0, 2 * time.Millisecond, 10 * time.Millisecond, 50 * time.Millisecond, 200 * time.Millisecond, s.hold / 2, 2 * s.hold}[rng.IntN(7)]
			busy = append(busy, phase{at, at + d, gap})
			at += d + time.Duration(100+rng.IntN(900))*time.Millisecond
		}
		return busy
	}
	together := rng.IntN(2) == 0
	shared := phases()
	// next is the phase that is on at, or the next one; false once none
	// is left.
	next := func(busy []phase, at time.Duration) (phase, bool) {
		for _, p := range busy {
			if at < p.to {
				return p, true
			}
		}
		return phase{}, false
	}
	plainBody := fmt.Sprintf("replenish_rate %v\n\tburst_capacity %d\n\trequested_tokens %d", s.rate, s.burst, s.cost)
	body := plainBody + fmt.Sprintf("\n\tlease %d %v", s.maxTokens, s.hold)
	type instance struct {
		h     *Handler
		proxy *redisProxy
		dead  atomic.Bool
		seed  uint64
		busy  []phase
	}
	instances := make([]*instance, s.instances)
	for i := range instances {
		p := startRedisProxy(t, redisAddr)
		// Each a limiter of its own (its own proxy); timeouts short, so a
		// cut costs a fraction of the run.
		h := caddyfileHandler(t, fmt.Sprintf(`rate_limit {
	zone %s
	key {http.request.header.X-Key}
	on_error deny
	%s
	redis %s {
		timeout 150ms
	}
}`, zone, cond(i < s.plain, plainBody, body), p.addr))
		in := &instance{h: h, proxy: p, seed: rng.Uint64(), busy: shared}
		if !together {
			in.busy = phases()
		}
		instances[i] = in
	}

	// The faults, at random times: cuts of 30 to 150 ms, and deaths.
	type fault struct {
		at, length time.Duration
		instance   int
		death      bool
	}
	var faults []fault
	for range s.cuts {
		faults = append(faults, fault{at: time.Duration(rng.Int64N(int64(length))), length: time.Duration(30+rng.IntN(120)) * time.Millisecond, instance: rng.IntN(s.instances)})
	}
	for range s.deaths {
		faults = append(faults, fault{at: time.Duration(rng.Int64N(int64(length))), instance: rng.IntN(s.instances), death: true})
	}

	var log boundtest.AdmissionLog
	var denied, failed atomic.Int64
	var wg sync.WaitGroup
	log.Now()
	began := time.Now()
	stop := began.Add(length)
	for _, f := range faults {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(f.at)
			in := instances[f.instance]
			if f.death {
				in.dead.Store(true)
				in.proxy.refusing.Store(true)
				return
			}
			in.proxy.cutting.Store(true)
			time.Sleep(f.length)
			in.proxy.cutting.Store(false)
		}()
	}
	for _, in := range instances {
		for w := range s.workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(in.seed, uint64(w)))
				for time.Now().Before(stop) && !in.dead.Load() {
					at := time.Since(began)
					p, more := next(in.busy, at)
					if !more {
						return
					}
					if at < p.from {
						time.Sleep(p.from - at)
						continue
					}
					if p.gap > 0 {
						time.Sleep(time.Duration(r.Int64N(int64(2 * p.gap))))
					}
					if s.cold > 0 && r.Float64() < s.cold {
						hit(in.h, "c"+strconv.Itoa(r.IntN(1_000_000))) // not the key checked
						continue
					}
					start := log.Now()
					status, _, _ := hit(in.h, "k")
					switch {
					case status == 200:
						log.Add(start)
					case status == 429:
						denied.Add(1)
					default:
						failed.Add(1)
					}
				}
			}()
		}
	}
	wg.Wait()
	return &log, [2]int64{denied.Load(), failed.Load()}
}

// cond is a if c, else b.
func cond[T any](c bool, a, b T) T {
	if c {
		return a
	}
	return b
}
