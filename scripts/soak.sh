#!/usr/bin/env bash
# Soak test of the rate_limit handler under Redis faults (`make soak`).
#
# Builds bin/caddy with xcaddy when it is missing or older than the
# plugin's sources (as scripts/bench.sh does), builds the soak driver
# (bench/soak), picks free loopback ports and starts two Caddy instances
# with bench/soak.caddyfile: one rate_limit zone, keyed by the X-Key
# header, in one Redis that both share. The driver then owns that Redis:
# it starts redis-server on the chosen port (`--save "" --appendonly no`),
# sends SOAK_DURATION of load from SOAK_CLIENTS clients over SOAK_KEYS
# keys, alternating between the two instances, stops Redis at 20 % of the
# run for 15 s and restarts it on the same port, runs SCRIPT FLUSH at
# 50 %, stops it again at 70 %, and prints a summary: outcomes, the token
# bucket bound per key and window outside the outages, latency in and out
# of outages, time to resume limiting after each restart, and the
# rate_limit warnings and circuit breaker lines in each Caddy's log.
# It exits non-zero when the bound was exceeded, a 5xx, another unexpected
# status or a transport error occurred (see bench/soak/main.go).
#
# Nothing is pinned to CPUs: this checks behaviour, not throughput.
#
# Environment: SOAK_DURATION (3m; a Go duration such as 60s, or seconds),
# SOAK_CLIENTS (32), SOAK_KEYS (8), SOAK_CLIENT_RPS (100 per client, 0 for
# back to back), SOAK_KEEP=1 to keep the work directory with the logs (kept
# anyway when the soak fails), CADDY_BIN (bin/caddy).
# Never touches any Redis it did not start; kills only its own PIDs.
# shellcheck disable=SC2317 # functions below run from traps
set -euo pipefail
SCRIPT_NAME=soak
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DURATION="${SOAK_DURATION:-3m}"
[[ "$DURATION" =~ ^[0-9]+$ ]] && DURATION="${DURATION}s"
CLIENTS="${SOAK_CLIENTS:-32}"
KEYS="${SOAK_KEYS:-8}"
CLIENT_RPS="${SOAK_CLIENT_RPS:-100}"
KEEP="${SOAK_KEEP:-0}"
CADDY_BIN="${CADDY_BIN:-$REPO_ROOT/bin/caddy}"

soak_start=$SECONDS
for bin in go redis-server; do
	command -v "$bin" >/dev/null 2>&1 || die "$bin not found (make deps installs redis-server)"
done

# --- build -------------------------------------------------------------------
ensure_caddy "$CADDY_BIN"

work="$(mktemp -d "${TMPDIR:-/tmp}/soak.XXXXXX")"
keep_work=0
caddy_pids=()
driver_pid=""
redis_port=""
cleanup() {
	local rc=$? pid
	trap '' INT TERM HUP
	trap - EXIT
	# The driver stops its redis-server on SIGTERM.
	stop_child "$driver_pid"
	for pid in "${caddy_pids[@]}"; do
		stop_child "$pid"
	done
	# Should the driver have died without stopping it: redis-server wrote
	# its PID here, and the driver started it, on our port.
	if [[ -f "$work/redis/redis.pid" ]]; then
		pid="$(cat "$work/redis/redis.pid" 2>/dev/null || true)"
		if [[ "$pid" =~ ^[0-9]+$ ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null |
			grep -q "redis-server.*:$redis_port"; then
			log "stopping the driver's leftover redis-server (pid $pid)"
			kill -TERM "$pid" 2>/dev/null || true
		fi
	fi
	if [[ "$KEEP" == 1 || "$keep_work" == 1 ]]; then
		log "logs kept in $work (caddy-A.log, caddy-B.log, redis/redis.log)"
	else
		rm -rf "$work"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

log "building the soak driver"
(cd "$REPO_ROOT" && go build -o "$work/soak" ./bench/soak)
SOAK="$work/soak"

# --- ports ---------------------------------------------------------------------
# Three distinct free loopback ports: Redis, Caddy A, Caddy B. Redis is
# started by the driver, on this port, for the whole run.
ports=()
while ((${#ports[@]} < 3)); do
	p="$("$SOAK" freeport)"
	[[ " ${ports[*]} " == *" $p "* ]] || ports+=("$p")
done
redis_port="${ports[0]}"
REDIS_ADDR="127.0.0.1:$redis_port"
mkdir -p "$work/redis"

# --- caddy ---------------------------------------------------------------------
# Both start before Redis does; the handler starts fine without Redis.
targets=()
logs=()
names=(A B)
for i in 0 1; do
	name="${names[$i]}"
	port="${ports[$((i + 1))]}"
	home="$work/home-$name"
	mkdir -p "$home"
	SOAK_PORT="$port" SOAK_REDIS="$REDIS_ADDR" \
		HOME="$home" XDG_DATA_HOME="$home/data" XDG_CONFIG_HOME="$home/config" \
		"$CADDY_BIN" run --config "$REPO_ROOT/bench/soak.caddyfile" --adapter caddyfile \
		>"$work/caddy-$name.log" 2>&1 &
	caddy_pids+=("$!")
	targets+=("http://127.0.0.1:$port")
	logs+=("$work/caddy-$name.log")
done
for i in 0 1; do
	port="${ports[$((i + 1))]}"
	wait_listening "$port" "${caddy_pids[$i]}" && continue
	tail -n 30 "$work/caddy-${names[$i]}.log" >&2 || true
	die "Caddy ${names[$i]} did not start listening on port $port"
done
log "Caddy A pid ${caddy_pids[0]} on ${targets[0]}, Caddy B pid ${caddy_pids[1]} on ${targets[1]}; Redis will be $REDIS_ADDR"

# --- soak ------------------------------------------------------------------------
# In the background and waited for, so that a signal reaches the trap at
# once (a foreground child would delay it until it ends).
log "soaking for $DURATION"
"$SOAK" run -d "$DURATION" -clients "$CLIENTS" -keys "$KEYS" -client-rps "$CLIENT_RPS" \
	-targets "$(IFS=,; echo "${targets[*]}")" -caddy-logs "$(IFS=,; echo "${logs[*]}")" \
	-redis-port "$redis_port" -redis-dir "$work/redis" &
driver_pid=$!
rc=0
wait "$driver_pid" || rc=$?
driver_pid=""
if ((rc > 128)); then
	log "interrupted (exit status $rc) after $((SECONDS - soak_start))s"
	exit "$rc"
elif ((rc != 0)); then
	keep_work=1
	log "soak FAILED (driver exit status $rc) after $((SECONDS - soak_start))s"
	exit "$rc"
fi
log "done in $((SECONDS - soak_start))s"
