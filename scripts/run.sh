#!/usr/bin/env bash
# Serves Caddyfile.example (http://127.0.0.1:8080/) with bin/caddy in the
# foreground. `make run` builds bin/caddy first.
#
# Redis: if nothing answers PING at $REDIS_ADDRESS (default 127.0.0.1:6379)
# and redis-server is installed, a throwaway in-memory redis-server is
# started on that port for the lifetime of Caddy and killed (by its PID)
# when Caddy exits. An already-running Redis is used as is and never
# stopped or restarted.
#
# Environment:
#   REDIS_ADDRESS  host:port to check (default 127.0.0.1:6379); REDIS_HOST and
#                  REDIS_PORT may be given separately instead
#   CADDYFILE      config to serve (default Caddyfile.example)
#   CADDY_BIN      Caddy binary (default bin/caddy)
# shellcheck disable=SC2317 # functions below run from traps
set -euo pipefail
SCRIPT_NAME=run
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

CADDY_BIN="${CADDY_BIN:-$REPO_ROOT/bin/caddy}"
CADDYFILE="${CADDYFILE:-$REPO_ROOT/Caddyfile.example}"
if [[ -n "${REDIS_ADDRESS:-}" ]]; then
	REDIS_HOST="${REDIS_ADDRESS%:*}"
	REDIS_PORT="${REDIS_ADDRESS##*:}"
fi
REDIS_HOST="${REDIS_HOST:-127.0.0.1}"
REDIS_PORT="${REDIS_PORT:-6379}"
[[ "$REDIS_PORT" =~ ^[0-9]+$ ]] || die "REDIS_PORT/REDIS_ADDRESS port is not a number: $REDIS_PORT"

[[ -x "$CADDY_BIN" ]] || die "$CADDY_BIN not found; build it with: make build"
[[ -f "$CADDYFILE" ]] || die "$CADDYFILE not found"

with_timeout() {
	if command -v timeout >/dev/null 2>&1; then timeout "$@"; else shift; "$@"; fi
}

# redis_reply prints whatever the server at REDIS_HOST:REDIS_PORT answers to
# PING (normally PONG; NOAUTH etc. still mean a server is there), or nothing.
redis_reply() {
	if command -v redis-cli >/dev/null 2>&1; then
		with_timeout 3 redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null || true
	else
		# No redis-cli: speak RESP over bash's /dev/tcp ("+PONG\r\n").
		# shellcheck disable=SC2016
		{ with_timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2" && printf "PING\r\n" >&3 &&
			IFS= read -r line <&3 && printf "%s\n" "$line"' _ "$REDIS_HOST" "$REDIS_PORT" 2>/dev/null || true; } |
			tr -d '\r' | sed 's/^[+-]//'
	fi
}

redis_pid=""
redis_dir=""
caddy_pid=""

# stop_pid PID NAME: SIGTERM, wait up to 10s, then SIGKILL. Only ever called
# with PIDs of children this script started.
stop_pid() {
	local pid="$1" name="$2" i
	kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
	kill -TERM "$pid" 2>/dev/null || true
	for ((i = 0; i < 100; i++)); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$pid" 2>/dev/null; then
		log "$name (pid $pid) did not stop within 10s; sending SIGKILL"
		kill -KILL "$pid" 2>/dev/null || true
	fi
	wait "$pid" 2>/dev/null || true
}

cleanup() {
	local rc=$?
	# Ignore further signals while cleaning up: Ctrl-C, `timeout` and make
	# (which forwards SIGTERM to its recipe) can each deliver one more, and
	# dying here would orphan the throwaway redis-server. Both stops are
	# bounded (SIGKILL after 10s).
	trap '' INT TERM HUP
	trap - EXIT
	if [[ -n "$caddy_pid" ]]; then
		stop_pid "$caddy_pid" caddy
	fi
	if [[ -n "$redis_pid" ]]; then
		stop_pid "$redis_pid" "throwaway redis-server"
		log "stopped throwaway redis-server (pid $redis_pid) on 127.0.0.1:$REDIS_PORT"
	fi
	[[ -z "$redis_dir" ]] || rm -rf "$redis_dir"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

reply="$(redis_reply)"
if [[ -n "$reply" ]]; then
	[[ "$reply" == PONG ]] || log "warning: Redis at $REDIS_HOST:$REDIS_PORT answered PING with: $reply"
	log "using the Redis already answering at $REDIS_HOST:$REDIS_PORT"
else
	case "$REDIS_HOST" in
	127.0.0.1 | localhost | ::1) ;;
	*) die "nothing answers PING at $REDIS_HOST:$REDIS_PORT, which is not local; start Redis there or set REDIS_ADDRESS" ;;
	esac
	if ! command -v redis-server >/dev/null 2>&1; then
		log "nothing answers PING at $REDIS_HOST:$REDIS_PORT and redis-server is not installed."
		log "Install it with:   sudo apt-get install redis-server"
		log "         or with:  make deps"
		log "or start a Redis on $REDIS_HOST:$REDIS_PORT yourself, then re-run."
		exit 1
	fi
	redis_dir="$(mktemp -d "${TMPDIR:-/tmp}/run-redis.XXXXXX")"
	redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
		--daemonize no --dir "$redis_dir" --logfile "" >"$redis_dir/redis.log" 2>&1 &
	redis_pid=$!
	log "nothing answered at $REDIS_HOST:$REDIS_PORT; started a throwaway redis-server (pid $redis_pid, no persistence)"
	for ((i = 0; i < 50; i++)); do
		[[ -n "$(redis_reply)" ]] && break
		if ! kill -0 "$redis_pid" 2>/dev/null; then
			cat "$redis_dir/redis.log" >&2 || true
			redis_pid=""
			die "throwaway redis-server exited at startup (log above); is port $REDIS_PORT taken by something else?"
		fi
		sleep 0.1
	done
	[[ -n "$(redis_reply)" ]] || die "throwaway redis-server did not answer PING within 5s (log: $redis_dir/redis.log)"
fi

if ! grep -q -- "$REDIS_HOST:$REDIS_PORT" "$CADDYFILE"; then
	log "note: $CADDYFILE does not mention $REDIS_HOST:$REDIS_PORT; Caddy will use the Redis address in the config"
fi

cd "$REPO_ROOT"
log "starting: $CADDY_BIN run --config $CADDYFILE --adapter caddyfile"
"$CADDY_BIN" run --config "$CADDYFILE" --adapter caddyfile &
caddy_pid=$!
rc=0
wait "$caddy_pid" || rc=$?
caddy_pid=""
exit "$rc"
