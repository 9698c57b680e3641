#!/usr/bin/env bash
# Load benchmark of Caddy with the rate_limit handler (`make bench`).
#
# Runs on bin/caddy-bench (Caddy with the plugin and bench/floor, which
# make builds first), starts its own redis-server on a free loopback port,
# and runs every case against a fresh Caddy started from
# bench/<caddyfile>.caddyfile:
#
#   bare@64       Caddy `respond "ok"`, 64 connections        (baseline)
#   floor@64      bench/floor: one token per request from Redis with the
#                 plugin's script, batched, over a bare RESP connection, and
#                 nothing else (the ceiling for any limiter that asks Redis
#                 once per allowed request)
#   floor3@64     as floor@64 with three buckets per request in one script
#                 call (the ceiling for a policy of three limits: multi)
#   memfloor@64   bench/floor's in-process bucket keyed by placeholders and
#                 nothing else (the ceiling for an in-process limiter:
#                 memory, lease)
#   allowed@64    rate_limit, always allowed, one bucket per connection
#   multi@64      as allowed@64 with a policy of three limits on one key
#                 template (one script call over three buckets per request)
#   quota@64      as allowed@64 with one limit and one monthly quota in
#                 Europe/Berlin on one key template (one script call over a
#                 bucket and a quota per request; compare with multi@64)
#   memory@64     as allowed@64 with store memory: no Redis at all
#   lease@64      as allowed@64 with `lease 32`: most requests admitted
#                 from tokens leased ahead, without waiting on Redis
#   lease@256     as lease@64 with 256 connections
#   memory@256    as memory@64 with 256 connections (the ceiling of lease@256)
#   memfloor@256  as memfloor@64 with 256 connections
#   nometrics@64  as allowed@64 with `metrics off` (what the metrics cost)
#   charge@64     as allowed@64 with `charge header X-Cost`: every response
#                 costs more than its reservation, so every request also
#                 settles (a second script call, after the response)
#   llm@64        an LLM gateway as the README's: a 2 KiB JSON request body
#                 (POST) whose model and max_tokens request_body reads, a
#                 key per model, prices from map, a weighted reservation
#                 and a weighted settlement from the JSON answer's usage
#                 (every request settles; compare with charge@64)
#   llmbare@64    llm@64's request and answer without rate_limit: its
#                 caddy-us less bare@64's is what the POST and the JSON
#                 answer cost before any limiter (llm@64's ceiling)
#   chargestatus@64  as allowed@64 with `charge_status 2xx`: responses keep
#                 their reservation, no settlement (what the writer costs)
#   denied@64     rate_limit, one empty bucket: every request gets 429
#                 (after the first denial the handler's deny cache answers;
#                 scripts/req near 0 shows it)
#   allowed@256   as allowed@64 with 256 connections
#   floor@256     as floor@64 with 256 connections
#   bare@256      as bare@64 with 256 connections              (its baseline)
#   mholt@64      the peer plugin, mholt/caddy-ratelimit (bin/caddy-mholt):
#                 zone { key {remote_host}; events 1000000; window 1s },
#                 all allowed (memory, lease, memfloor are set beside it)
#   mholt-denied@64  the peer with events 100 per 1s: all but about 100
#                 requests a second denied (denied@64 is set beside it)
#
# Many keys (BENCH_KEYS, 10000): each connection cycles the X-Conn values
# key-000000.. instead of sending its own, so each key sees one request
# per BENCH_KEYS (a few a second: cold, far less than once per hold):
#   allowed-keys@64  allowed@64 over the many keys
#   lease-keys@64    lease@64 over them: every key cold, so every request
#                 goes to Redis as without lease (the `vs allowed` table
#                 sets it beside allowed-keys@64)
#   memory-keys@64   memory@64 over them
#   mholt-keys@64    the peer keyed by X-Conn (bench/mholt-keys: events 100
#                 per 1s per key, all allowed) over them
# Mixed (a real API's shape): a share BENCH_HOT_SHARE (0.9) of each
# connection's requests go to BENCH_HOT (8) hot keys, the rest cycle the
# BENCH_KEYS cold ones:
#   allowed-mixed@64  allowed@64 on that traffic
#   lease-mixed@64    lease@64 on it: the hot keys leased, the cold ones
#                 at the plain script's price
#   memory-mixed@64   memory@64 on it (the in-process ceiling)
#
# Every case but the peer's runs on bin/caddy-bench; the peer's on
# bin/caddy-mholt (both plugins register rate_limit, so they cannot share
# a binary). Caddy runs alone on CPU 0 with GOMAXPROCS=1; Redis and the load
# generator (bench/loadgen: closed loop, one keep-alive connection and one
# X-Conn key per goroutine, log-linear latency histogram) share CPU 1.
# Each case runs WARMUP then DURATION; ROUNDS rounds run interleaved (every
# case once per round) and the table shows per-column medians. Redis
# figures are deltas of INFO over the measured window, per request:
# total_reads_processed (read events: below 1 means requests shared a
# pipeline) and script calls (cmdstat_evalsha + cmdstat_eval).
#
# Environment: BENCH_ROUNDS (5), BENCH_DURATION (3s), BENCH_WARMUP (1s),
# BENCH_KEYS (10000), BENCH_HOT (8), BENCH_HOT_SHARE (0.9),
# BENCH_CASES (all; or a list such as "bare@64 memory@64": fewer cases per
# round set the ones compared closer together in time, which matters on
# a machine whose speed swings from one minute to the next).
# BENCH_GOGC (100, Go's default) is every Caddy's GOGC: the peer's
# config holds a ring of a million events (24 MB), which makes its GC run
# several times less often than the others'; a GOGC of several hundred
# puts every case in that regime, so that ratios show per-request work.
# BENCH_BASELINE=<git revision or caddy-bench binary> also runs every
# case of this plugin on the build of that revision (built once into
# bin/caddy-bench-<commit>), next to the same case on this build, as
# "<name>.base@<conns>": right after it in odd rounds, right before it in
# even ones, so that neither build always has the second place. The
# table then sets each case beside its twin (medians of per-round
# ratios): the one measurement a change that must not cost speed needs.
# BENCH_BASELINE_CASES (all) names the cases that get a baseline twin,
# e.g. "lease-keys@64 lease-mixed@64".
# BENCH_PROFILE=<dir> adds one more 64-connection run of the Caddyfile
# BENCH_PROFILE_CASE names (allowed; or memory, denied, charge, ...) with
# Caddy's admin endpoint on, saves a 5 s CPU profile and allocation
# profile of Caddy into <dir> and prints the top of each.
# Never touches any Redis it did not start; kills only its own PIDs.
set -euo pipefail
SCRIPT_NAME=bench
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ROUNDS="${BENCH_ROUNDS:-5}"
DURATION="${BENCH_DURATION:-3s}"
WARMUP="${BENCH_WARMUP:-1s}"
CADDY_CPU=0
LOAD_CPU=1
caddy_bin="$REPO_ROOT/bin/caddy-bench"
mholt_bin="$REPO_ROOT/bin/caddy-mholt"
PROFILE_CASE="${BENCH_PROFILE_CASE:-allowed}"
GOGC_CADDY="${BENCH_GOGC:-100}"
KEYS="${BENCH_KEYS:-10000}"
HOT="${BENCH_HOT:-8}"
HOT_SHARE="${BENCH_HOT_SHARE:-0.9}"
baseline_bin=""

bench_start=$SECONDS
[[ -x "$caddy_bin" ]] || die "$caddy_bin not found; run: make bench"
[[ -x "$mholt_bin" ]] || die "$mholt_bin not found; run: make bench"
for bin in go redis-server taskset; do
	command -v "$bin" >/dev/null 2>&1 || die "$bin not found (make deps installs redis; taskset is in util-linux)"
done
ncpu="$(nproc)"
if ((ncpu < 2)); then
	log "warning: only $ncpu CPU; Caddy, Redis and the load generator all share CPU 0"
	LOAD_CPU=0
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/bench.XXXXXX")"
redis_pid=""
caddy_pid=""
cleanup() {
	stop_child "$caddy_pid" caddy
	stop_child "$redis_pid" redis-server
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- baseline build ------------------------------------------------------------
if [[ -n "${BENCH_BASELINE:-}" ]]; then
	if [[ -f "$BENCH_BASELINE" && -x "$BENCH_BASELINE" ]]; then
		baseline_bin="$(cd "$(dirname "$BENCH_BASELINE")" && pwd)/$(basename "$BENCH_BASELINE")"
	else
		commit="$(git -C "$REPO_ROOT" rev-parse --short=12 --verify "$BENCH_BASELINE^{commit}" 2>/dev/null)" ||
			die "BENCH_BASELINE: '$BENCH_BASELINE' is neither an executable nor a git revision of this repository"
		baseline_bin="$REPO_ROOT/bin/caddy-bench-$commit"
		if [[ ! -x "$baseline_bin" ]]; then
			log "building the baseline $commit into $baseline_bin"
			git -C "$REPO_ROOT" worktree add --detach --quiet "$work/baseline" "$commit"
			(cd "$work/baseline" && XCADDY_QUIET=1 bash scripts/build-caddy.sh "$baseline_bin" bench/floor) ||
				{ git -C "$REPO_ROOT" worktree remove --force "$work/baseline"; die "building the baseline $commit failed"; }
			git -C "$REPO_ROOT" worktree remove --force "$work/baseline"
		fi
	fi
fi

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
	if wait_listening "$port" "$redis_pid"; then
		redis_port="$port"
		break
	fi
	stop_child "$redis_pid" redis-server
	redis_pid=""
	log "redis-server did not start on port $port (attempt $attempt)"
done
[[ -n "$redis_port" ]] || { tail -n 20 "$work/redis/redis.log" >&2 || true; die "cannot start redis-server"; }
REDIS_ADDR="127.0.0.1:$redis_port"
log "redis-server $(redis-server --version | awk '{print $3}') pid $redis_pid on $REDIS_ADDR (CPU $LOAD_CPU)"

# --- cases ---------------------------------------------------------------------
# name@connections caddyfile expected-status loadgen-flags. The table sets
# each case beside bare@64, its floor at <connections> (floor, floor3 or
# memfloor) and (at 256) bare@256.
CASES=(
	"bare@64 bare 200 -"
	"floor@64 floor 200 -"
	"floor3@64 floor3 200 -"
	"memfloor@64 memfloor 200 -"
	"allowed@64 allowed 200 -"
	"concurrent@64 concurrent 200 -"
	"wait@64 wait 200 -"
	"multi@64 multi 200 -"
	"quota@64 quota 200 -"
	"memory@64 memory 200 -"
	"lease@64 lease 200 -"
	"mholt@64 mholt 200 -"
	"nometrics@64 allowed-nometrics 200 -"
	"charge@64 charge 200 -"
	"chargestatus@64 chargestatus 200 -"
	"llm@64 llm 200 -body=$REPO_ROOT/bench/llm-request.json"
	"llmbare@64 llmbare 200 -body=$REPO_ROOT/bench/llm-request.json"
	"denied@64 denied 429 -same-key"
	"mholt-denied@64 mholt-denied 429,200 -same-key"
	"allowed@256 allowed 200 -"
	"lease@256 lease 200 -"
	"memory@256 memory 200 -"
	"memfloor@256 memfloor 200 -"
	"floor@256 floor 200 -"
	"bare@256 bare 200 -"
	"allowed-keys@64 allowed 200 -keys $KEYS"
	"lease-keys@64 lease 200 -keys $KEYS"
	"memory-keys@64 memory 200 -keys $KEYS"
	"mholt-keys@64 mholt-keys 200 -keys $KEYS"
	"allowed-mixed@64 allowed 200 -keys $KEYS -hot $HOT -hot-share $HOT_SHARE"
	"lease-mixed@64 lease 200 -keys $KEYS -hot $HOT -hot-share $HOT_SHARE"
	"memory-mixed@64 memory 200 -keys $KEYS -hot $HOT -hot-share $HOT_SHARE"
)

if [[ -n "${BENCH_CASES:-}" ]]; then
	selected=()
	for want in $BENCH_CASES; do
		found=""
		for c in "${CASES[@]}"; do
			[[ "${c%% *}" == "$want" ]] && selected+=("$c") && found=1
		done
		[[ -n "$found" ]] || die "BENCH_CASES: no case $want (cases: $(printf '%s ' "${CASES[@]%% *}"))"
	done
	CASES=("${selected[@]}")
fi

# With a baseline, each case of this plugin runs twice a round: on this
# build, then on the baseline's (bare, the measuring sticks and the peer
# are the same in both, so they run once).
if [[ -n "$baseline_bin" ]]; then
	twinned=()
	for c in "${CASES[@]}"; do
		twinned+=("$c")
		read -r name conf rest <<<"$c"
		if [[ -n "${BENCH_BASELINE_CASES:-}" && " $BENCH_BASELINE_CASES " != *" $name "* ]]; then
			continue
		fi
		case "${name%@*}" in
		# llm: request_body is newer than most baselines, which refuse its config.
		bare | floor | floor3 | memfloor | mholt | mholt-denied | mholt-keys | llm | llmbare) ;;
		*) twinned+=("${name%@*}.base@${name#*@} $conf $rest") ;;
		esac
	done
	CASES=("${twinned[@]}")
fi

start_caddy() { # caddyfile-name [admin-address [binary]] -> sets caddy_pid, caddy_port
	local conf="$REPO_ROOT/bench/$1.caddyfile" bin="${3:-$caddy_bin}"
	[[ "$1" != mholt* ]] || bin="$mholt_bin"
	caddy_port="$("$LOADGEN" freeport)"
	mkdir -p "$work/home"
	BENCH_PORT="$caddy_port" BENCH_REDIS="$REDIS_ADDR" BENCH_ADMIN="${2:-off}" BENCH_SCRIPT="$REPO_ROOT/internal/redisstore/script.lua" GOMAXPROCS=1 GOGC="$GOGC_CADDY" \
		HOME="$work/home" XDG_DATA_HOME="$work/home/data" XDG_CONFIG_HOME="$work/home/config" \
		taskset -c "$CADDY_CPU" "$bin" run --config "$conf" --adapter caddyfile \
		>>"$work/caddy.log" 2>&1 &
	caddy_pid=$!
	wait_listening "$caddy_port" "$caddy_pid" && return 0
	tail -n 30 "$work/caddy.log" >&2
	die "Caddy ($1) did not start listening on port $caddy_port"
}

results="$work/results"
: >"$results"
log "$ROUNDS rounds of ${#CASES[@]} cases, $WARMUP warm-up + $DURATION each; Caddy on CPU $CADDY_CPU (GOMAXPROCS=1, GOGC=$GOGC_CADDY), Redis + load generator on CPU $LOAD_CPU"
# round_order is the cases of round $1. A case and its baseline twin
# swap places every other round: the second of two neighbours gains a
# few percent (the machine's caches and clock are warm from the first),
# which would otherwise always go to the same build.
round_order() {
	ORDER=("${CASES[@]}")
	(($1 % 2 == 0)) || return 0
	local i
	for ((i = 0; i + 1 < ${#ORDER[@]}; i++)); do
		if [[ "${ORDER[i + 1]%% *}" == *.base@* && "${ORDER[i]%% *}" != *.base@* ]]; then
			local first="${ORDER[i]}"
			ORDER[i]="${ORDER[i + 1]}"
			ORDER[i + 1]="$first"
			((i++)) || true
		fi
	done
}

for ((round = 1; round <= ROUNDS; round++)); do
	round_order "$round"
	for c in "${ORDER[@]}"; do
		read -r name conf expect flags <<<"$c"
		conns="${name#*@}"
		[[ "$flags" == - ]] && flags=""
		bin="$caddy_bin"
		[[ "$name" != *.base@* ]] || bin="$baseline_bin"
		start_caddy "$conf" off "$bin"
		# shellcheck disable=SC2086
		if ! out="$(GOMAXPROCS=1 taskset -c "$LOAD_CPU" "$LOADGEN" run -addr "127.0.0.1:$caddy_port" \
			-c "$conns" -warmup "$WARMUP" -d "$DURATION" -expect "$expect" -redis "$REDIS_ADDR" -pid "$caddy_pid" -cpus "$CADDY_CPU,$LOAD_CPU" $flags)"; then
			tail -n 30 "$work/caddy.log" >&2
			die "load generator failed on $name"
		fi
		stop_child "$caddy_pid" caddy
		caddy_pid=""
		log "round $round $name: $out"
		echo "case=$name round=$round $out" >>"$results"
	done
done

# --- table ---------------------------------------------------------------------
"$LOADGEN" table -warmup "$WARMUP" -d "$DURATION" -cpus "$CADDY_CPU,$LOAD_CPU" "$results"

# --- profile -------------------------------------------------------------------
if [[ -n "${BENCH_PROFILE:-}" ]]; then
	mkdir -p "$BENCH_PROFILE"
	prof="$(cd "$BENCH_PROFILE" && pwd)"
	admin="127.0.0.1:$("$LOADGEN" freeport)"
	[[ -f "$REPO_ROOT/bench/$PROFILE_CASE.caddyfile" ]] || die "BENCH_PROFILE_CASE: no bench/$PROFILE_CASE.caddyfile"
	profile_expect=200 profile_flags=()
	for c in "${CASES[@]}"; do
		read -r name conf expect flags <<<"$c"
		if [[ "$conf" == "$PROFILE_CASE" ]]; then
			profile_expect="$expect"
			[[ "$flags" == - ]] || profile_flags=("$flags")
			break
		fi
	done
	start_caddy "$PROFILE_CASE" "$admin"
	log "profiling $PROFILE_CASE@64 (admin $admin) into $prof"
	GOMAXPROCS=1 taskset -c "$LOAD_CPU" "$LOADGEN" run -addr "127.0.0.1:$caddy_port" -c 64 -warmup 1s -d 7s \
		-expect "$profile_expect" "${profile_flags[@]}" -redis "$REDIS_ADDR" -pid "$caddy_pid" >"$work/profile-run" &
	lg_pid=$!
	sleep 1.5
	curl -fsS -o "$prof/caddy-cpu.pprof" "http://$admin/debug/pprof/profile?seconds=5" &
	cpu_pid=$!
	curl -fsS -o "$prof/caddy-allocs.pprof" "http://$admin/debug/pprof/allocs?seconds=5" &
	allocs_pid=$!
	wait "$cpu_pid" "$allocs_pid" || log "warning: fetching a profile failed"
	wait "$lg_pid" || true
	log "profile run: $(cat "$work/profile-run")"
	stop_child "$caddy_pid" caddy
	caddy_pid=""
	echo "--- Caddy CPU profile, $PROFILE_CASE@64 (go tool pprof -top $prof/caddy-cpu.pprof) ---"
	go tool pprof -top -nodecount 30 "$prof/caddy-cpu.pprof" 2>/dev/null | sed -n '4,40p'
	echo "--- Caddy allocations, $PROFILE_CASE@64 (go tool pprof -sample_index=alloc_objects -top $prof/caddy-allocs.pprof) ---"
	go tool pprof -sample_index=alloc_objects -top -nodecount 30 "$prof/caddy-allocs.pprof" 2>/dev/null | sed -n '4,40p'
fi
log "done in $((SECONDS - bench_start))s"
