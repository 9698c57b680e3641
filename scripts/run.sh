#!/usr/bin/env bash
# `make run`: serves Caddyfile.example (http://127.0.0.1:8080/) with
# bin/caddy in the foreground, until Ctrl-C.
#
# Caddyfile.example uses the Redis on 127.0.0.1:6379. A Redis already
# answering there is used as is and never stopped. If nothing answers and
# redis-server is installed, a throwaway in-memory redis-server runs on that
# port for as long as Caddy does, and is stopped by its PID afterwards.
# With STORE=memory (`make run STORE=memory`) the buckets live in Caddy
# and no Redis is needed at all.
set -euo pipefail
SCRIPT_NAME=run
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

caddy="$REPO_ROOT/bin/caddy"
[[ -x "$caddy" ]] || die "$caddy not found; build it with: make build"

redis_pid=""
redis_dir=""
caddy_pid=""
# shellcheck disable=SC2317 # runs from the trap
cleanup() {
	local rc=$?
	# Ignore further signals while cleaning up: Ctrl-C, `timeout` and make
	# (which forwards SIGTERM to its recipe) can each deliver one more, and
	# dying here would orphan the throwaway redis-server.
	trap '' INT TERM HUP
	trap - EXIT
	stop_child "$caddy_pid" caddy
	if [[ -n "$redis_pid" ]]; then
		stop_child "$redis_pid" "throwaway redis-server"
		log "stopped the throwaway redis-server (pid $redis_pid)"
	fi
	[[ -z "$redis_dir" ]] || rm -rf "$redis_dir"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# What 127.0.0.1:6379 answers to PING: +PONG, an error such as -NOAUTH (a
# Redis all the same), or nothing. Over bash's /dev/tcp: redis-cli may be
# missing.
case "${STORE:-redis}" in
memory) export RATE_LIMIT_STORE=memory ;;
redis) export RATE_LIMIT_STORE=redis ;;
*) die "STORE=$STORE: want redis (the default) or memory" ;;
esac
reply=""
if [[ "$RATE_LIMIT_STORE" == redis ]]; then
	reply="$({ exec 3<>/dev/tcp/127.0.0.1/6379 && printf 'PING\r\n' >&3 &&
		IFS=$'\r' read -r -t 3 line <&3 && printf '%s' "$line"; } 2>/dev/null || true)"
fi
if [[ "$RATE_LIMIT_STORE" == memory ]]; then
	log "STORE=memory: the buckets live in Caddy; no Redis needed"
elif [[ -n "$reply" ]]; then
	[[ "$reply" == +PONG ]] || log "warning: 127.0.0.1:6379 answered PING with: $reply"
	log "using the Redis already answering on 127.0.0.1:6379"
else
	command -v redis-server >/dev/null 2>&1 ||
		die "nothing answers on 127.0.0.1:6379 and redis-server is not installed: install it (make deps), start a Redis there, or run without Redis, with the buckets in Caddy: make run STORE=memory"
	redis_dir="$(mktemp -d "${TMPDIR:-/tmp}/run-redis.XXXXXX")"
	redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no \
		--dir "$redis_dir" --logfile "$redis_dir/redis.log" &
	redis_pid=$!
	if ! wait_listening 6379 "$redis_pid"; then
		tail -n 20 "$redis_dir/redis.log" >&2 || true
		die "the throwaway redis-server did not start (log above); is port 6379 taken by something else?"
	fi
	log "nothing answered on 127.0.0.1:6379; started a throwaway redis-server there (pid $redis_pid, no persistence)"
fi

cd "$REPO_ROOT"
log "starting: bin/caddy run --config Caddyfile.example --adapter caddyfile"
"$caddy" run --config Caddyfile.example --adapter caddyfile &
caddy_pid=$!
rc=0
wait "$caddy_pid" || rc=$?
caddy_pid=""
exit "$rc"
