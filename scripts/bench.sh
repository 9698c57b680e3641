#!/usr/bin/env bash
# Load benchmark of Caddy with the rate_limit handler (`make bench`).
#
# Builds bin/caddy-bench (Caddy with the plugin and bench/floor) with
# xcaddy when it is missing or older than their sources, starts its own
# redis-server on a free loopback port, and runs every case against a
# fresh Caddy started from bench/*.caddyfile:
#
#   bare@64       Caddy `respond "ok"`, 64 connections        (baseline)
#   floor@64      bench/floor: one token per request from Redis with the
#                 plugin's script, batched, over a bare RESP connection, and
#                 nothing else (the ceiling for any limiter that asks Redis
#                 once per allowed request)
#   allowed@64    rate_limit, always allowed, one bucket per connection
#   nometrics@64  as allowed@64 with `metrics off` (what the metrics cost)
#   denied@64     rate_limit, one empty bucket: every request gets 429
#                 (after the first denial the handler's deny cache answers;
#                 scripts/req near 0 shows it)
#   allowed@256   as allowed@64 with 256 connections
#   floor@256     as floor@64 with 256 connections
#   bare@256      as bare@64 with 256 connections              (its baseline)
#
# Caddy runs alone on CPU 0 with GOMAXPROCS=1; Redis and the load
# generator (bench/loadgen: closed loop, one keep-alive connection and one
# X-Conn key per goroutine, log-linear latency histogram) share CPU 1.
# Each case runs WARMUP then DURATION; ROUNDS rounds run interleaved (every
# case once per round) and the table shows per-column medians. Redis
# figures are deltas of INFO over the measured window, per request:
# total_reads_processed (read events: below 1 means requests shared a
# pipeline) and script calls (cmdstat_evalsha + cmdstat_eval).
#
# Environment: BENCH_ROUNDS (5), BENCH_DURATION (3s), BENCH_WARMUP (1s),
# BENCH_CADDY_CPU (0), BENCH_LOAD_CPU (1), CADDY_BIN (bin/caddy-bench).
# BENCH_PROFILE=<dir> adds one more allowed@64 run with Caddy's admin
# endpoint on, saves a 5 s CPU profile and allocation profile of Caddy
# into <dir> and prints the top of each.
# Never touches any Redis it did not start; kills only its own PIDs.
set -euo pipefail
SCRIPT_NAME=bench
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ROUNDS="${BENCH_ROUNDS:-5}"
DURATION="${BENCH_DURATION:-3s}"
WARMUP="${BENCH_WARMUP:-1s}"
CADDY_CPU="${BENCH_CADDY_CPU:-0}"
LOAD_CPU="${BENCH_LOAD_CPU:-1}"
CADDY_BIN="${CADDY_BIN:-$REPO_ROOT/bin/caddy-bench}"

bench_start=$SECONDS
for bin in go redis-server redis-cli taskset; do
	command -v "$bin" >/dev/null 2>&1 || die "$bin not found (scripts/install-deps.sh installs redis; taskset is in util-linux)"
done
ncpu="$(nproc)"
if ((ncpu < 2)); then
	log "warning: only $ncpu CPU; Caddy, Redis and the load generator all share CPU 0"
	CADDY_CPU=0 LOAD_CPU=0
fi

# --- build -------------------------------------------------------------------
ensure_caddy "$CADDY_BIN" "$(module_path)/bench/floor=$REPO_ROOT/bench/floor"

work="$(mktemp -d "${TMPDIR:-/tmp}/bench.XXXXXX")"
redis_pid=""
caddy_pid=""
cleanup() {
	stop_child "$caddy_pid" 5
	stop_child "$redis_pid" 5
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "building the load generator"
(cd "$REPO_ROOT" && go build -o "$work/loadgen" ./bench/loadgen)
LOADGEN="$work/loadgen"

# --- redis ---------------------------------------------------------------------
redis_port=""
for attempt in 1 2 3 4 5; do
	port="$("$LOADGEN" freeport)"
	mkdir -p "$work/redis"
	taskset -c "$LOAD_CPU" redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
		--daemonize no --dir "$work/redis" --logfile "$work/redis/redis.log" &
	redis_pid=$!
	for ((i = 0; i < 100; i++)); do
		if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
			redis_port="$port"
			break 2
		fi
		kill -0 "$redis_pid" 2>/dev/null || break
		sleep 0.05
	done
	stop_child "$redis_pid" 5
	redis_pid=""
	log "redis-server did not start on port $port (attempt $attempt)"
done
[[ -n "$redis_port" ]] || { tail -n 20 "$work/redis/redis.log" >&2 || true; die "cannot start redis-server"; }
REDIS_ADDR="127.0.0.1:$redis_port"
log "redis-server $(redis-server --version | awk '{print $3}') pid $redis_pid on $REDIS_ADDR (CPU $LOAD_CPU)"

# --- cases ---------------------------------------------------------------------
# name caddyfile connections expected-status loadgen-flags
CASES=(
	"bare@64 bare 64 200 -"
	"floor@64 floor 64 200 -"
	"allowed@64 allowed 64 200 -"
	"nometrics@64 allowed-nometrics 64 200 -"
	"denied@64 denied 64 429 -same-key"
	"allowed@256 allowed 256 200 -"
	"floor@256 floor 256 200 -"
	"bare@256 bare 256 200 -"
)

start_caddy() { # caddyfile-name [admin-address] -> sets caddy_pid, caddy_port
	local conf="$REPO_ROOT/bench/$1.caddyfile"
	caddy_port="$("$LOADGEN" freeport)"
	mkdir -p "$work/home"
	BENCH_PORT="$caddy_port" BENCH_REDIS="$REDIS_ADDR" BENCH_ADMIN="${2:-off}" BENCH_SCRIPT="$REPO_ROOT/script.lua" GOMAXPROCS=1 \
		HOME="$work/home" XDG_DATA_HOME="$work/home/data" XDG_CONFIG_HOME="$work/home/config" \
		taskset -c "$CADDY_CPU" "$CADDY_BIN" run --config "$conf" --adapter caddyfile \
		>>"$work/caddy.log" 2>&1 &
	caddy_pid=$!
	wait_listening "$caddy_port" "$caddy_pid" && return 0
	tail -n 30 "$work/caddy.log" >&2
	die "Caddy ($1) did not start listening on port $caddy_port"
}

results="$work/results"
: >"$results"
log "$ROUNDS rounds of ${#CASES[@]} cases, $WARMUP warm-up + $DURATION each; Caddy on CPU $CADDY_CPU (GOMAXPROCS=1), Redis + load generator on CPU $LOAD_CPU"
for ((round = 1; round <= ROUNDS; round++)); do
	for c in "${CASES[@]}"; do
		read -r name conf conns expect flags <<<"$c"
		[[ "$flags" == - ]] && flags=""
		start_caddy "$conf"
		# shellcheck disable=SC2086
		if ! out="$(GOMAXPROCS=1 taskset -c "$LOAD_CPU" "$LOADGEN" run -addr "127.0.0.1:$caddy_port" \
			-c "$conns" -warmup "$WARMUP" -d "$DURATION" -expect "$expect" -redis "$REDIS_ADDR" -pid "$caddy_pid" -cpus "$CADDY_CPU,$LOAD_CPU" $flags)"; then
			tail -n 30 "$work/caddy.log" >&2
			die "load generator failed on $name"
		fi
		stop_child "$caddy_pid" 5
		caddy_pid=""
		log "round $round $name: $out"
		echo "case=$name round=$round $out" >>"$results"
	done
done

# --- table ---------------------------------------------------------------------
# Medians of each column over the rounds. A ratio is the median of the
# rounds' own ratios (both cases from the same round), which follows the
# machine's drift from round to round better than a ratio of medians.
awk -v ccpu="$CADDY_CPU" -v lcpu="$LOAD_CPU" -v cases="$(printf '%s\n' "${CASES[@]}" | awk '{print $1}' | paste -sd' ')" '
function median(arr, n,    i, j, t) {
	for (i = 2; i <= n; i++) { t = arr[i]; for (j = i - 1; j >= 1 && arr[j] > t; j--) arr[j + 1] = arr[j]; arr[j + 1] = t }
	return n % 2 ? arr[(n + 1) / 2] : (arr[n / 2] + arr[n / 2 + 1]) / 2
}
function ratio(c, base,    i, n, r) {
	if (!count[base]) return "-"
	n = count[c] < count[base] ? count[c] : count[base]
	for (i = 1; i <= n; i++) r[i] = v[base, i, 1] ? v[c, i, 1] / v[base, i, 1] : 0
	return sprintf("%.3f", median(r, n))
}
{
	delete kv
	for (i = 1; i <= NF; i++) { split($i, p, "="); kv[p[1]] = p[2] }
	c = kv["case"]; n = ++count[c]
	v[c, n, 1] = kv["rps"]; v[c, n, 2] = kv["p50_us"] / 1000; v[c, n, 3] = kv["p99_us"] / 1000
	v[c, n, 4] = kv["requests"] ? kv["reads"] / kv["requests"] : 0
	v[c, n, 5] = kv["requests"] ? kv["scripts"] / kv["requests"] : 0
	v[c, n, 6] = kv["server_cpu"]; v[c, n, 7] = kv["load_cpu"]; v[c, n, 8] = kv["redis_cpu"]
	# CPU time other processes took on the two CPUs (busy minus ours)
	v[c, n, 9] = kv["cpu" ccpu "_busy"] - kv["server_cpu"]
	v[c, n, 10] = kv["cpu" lcpu "_busy"] - kv["load_cpu"] - kv["redis_cpu"]
	# CPU time per request, in µs: steadier than req/s when others share the CPUs
	v[c, n, 11] = kv["rps"] ? kv["server_cpu"] * 1e4 / kv["rps"] : 0
	v[c, n, 12] = kv["rps"] ? kv["redis_cpu"] * 1e4 / kv["rps"] : 0
	bad[c] += kv["errors"] + kv["unexpected"]
}
END {
	nc = split(cases, order, " ")
	for (k = 1; k <= nc; k++) {
		c = order[k]; n = count[c]
		for (f = 1; f <= 12; f++) {
			for (i = 1; i <= n; i++) a[i] = v[c, i, f]
			m[c, f] = median(a, n)
		}
	}
	printf "%-12s %5s %8s %8s %8s %9s %10s %8s %9s %9s %11s %9s %6s %6s %6s %6s %6s %6s\n", "case", "conns", "req/s", "p50", "p99",
		"vs bare64", "vs bare256", "vs floor", "caddy-us", "reads/req", "scripts/req", "redis-us", "caddy%", "load%", "redis%", "other0", "other1", "errors"
	for (k = 1; k <= nc; k++) {
		c = order[k]; split(c, cc, "@")
		r64 = ratio(c, "bare@64")
		r256 = cc[2] == 256 ? ratio(c, "bare@256") : "-"
		rfl = ratio(c, "floor@" cc[2])
		printf "%-12s %5s %8.0f %6.2fms %6.2fms %9s %10s %8s %9.1f %9.3f %11.3f %9.1f %6.0f %6.0f %6.0f %6.0f %6.0f %6d\n", c, cc[2], m[c, 1], m[c, 2], m[c, 3],
			r64, r256, rfl, m[c, 11], m[c, 4], m[c, 5], m[c, 12], m[c, 6], m[c, 7], m[c, 8], m[c, 9], m[c, 10], bad[c]
	}
}' "$results"
echo "(medians of $ROUNDS rounds, $WARMUP warm-up + $DURATION measured per case. caddy-us/redis-us: CPU time of Caddy /"
echo " Redis per request in microseconds (caddy-us minus bare's is the limiter's cost). caddy%/load%/redis%: CPU use over the"
echo " measured window, % of one CPU, of Caddy (CPU $CADDY_CPU), the load generator and Redis (both CPU $LOAD_CPU); other0/other1:"
echo " what other processes took of CPU $CADDY_CPU / CPU $LOAD_CPU meanwhile (well above 0: the figures are not clean);"
echo " errors: transport errors + unexpected statuses, summed over rounds)"

# --- profile -------------------------------------------------------------------
if [[ -n "${BENCH_PROFILE:-}" ]]; then
	mkdir -p "$BENCH_PROFILE"
	prof="$(cd "$BENCH_PROFILE" && pwd)"
	admin="127.0.0.1:$("$LOADGEN" freeport)"
	start_caddy allowed "$admin"
	log "profiling allowed@64 (admin $admin) into $prof"
	GOMAXPROCS=1 taskset -c "$LOAD_CPU" "$LOADGEN" run -addr "127.0.0.1:$caddy_port" -c 64 -warmup 1s -d 7s \
		-expect 200 -redis "$REDIS_ADDR" -pid "$caddy_pid" >"$work/profile-run" &
	lg_pid=$!
	sleep 1.5
	curl -fsS -o "$prof/caddy-cpu.pprof" "http://$admin/debug/pprof/profile?seconds=5" &
	cpu_pid=$!
	curl -fsS -o "$prof/caddy-allocs.pprof" "http://$admin/debug/pprof/allocs?seconds=5" &
	allocs_pid=$!
	wait "$cpu_pid" "$allocs_pid" || log "warning: fetching a profile failed"
	wait "$lg_pid" || true
	log "profile run: $(cat "$work/profile-run")"
	stop_child "$caddy_pid" 5
	caddy_pid=""
	echo "--- Caddy CPU profile, allowed@64 (go tool pprof -top $prof/caddy-cpu.pprof) ---"
	go tool pprof -top -nodecount 30 "$prof/caddy-cpu.pprof" 2>/dev/null | sed -n '4,40p'
	echo "--- Caddy allocations, allowed@64 (go tool pprof -sample_index=alloc_objects -top $prof/caddy-allocs.pprof) ---"
	go tool pprof -sample_index=alloc_objects -top -nodecount 30 "$prof/caddy-allocs.pprof" 2>/dev/null | sed -n '4,40p'
fi
log "done in $((SECONDS - bench_start))s"
