# shellcheck shell=bash
# Shared helpers, sourced by the other scripts in this directory. The
# scripts are run by make, whose Makefile puts Go and Go's install
# directory (where xcaddy goes) on PATH; with a PATH that has both, they
# also run on their own.

# shellcheck disable=SC2034 # used by the scripts that source this file
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { printf '%s: %s\n' "${SCRIPT_NAME:-${0##*/}}" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# stop_child PID NAME: SIGTERM, SIGKILL after 10 s, then reaps it. Only for
# children of the calling script; -PID stops the child's process group. An
# empty PID is a no-op.
stop_child() {
	local pid="$1" name="$2" i
	[[ -n "$pid" ]] || return 0
	if kill -TERM -- "$pid" 2>/dev/null; then
		for ((i = 0; i < 100; i++)); do
			kill -0 -- "$pid" 2>/dev/null || break
			sleep 0.1
		done
		if kill -KILL -- "$pid" 2>/dev/null; then
			log "$name (pid ${pid#-}) did not stop within 10s of SIGTERM; killed it"
		fi
	fi
	wait "${pid#-}" 2>/dev/null || true
}

# wait_listening PORT PID: waits up to 10 s until 127.0.0.1:PORT accepts a
# connection; fails early if PID exits, and at the deadline.
wait_listening() {
	local port="$1" pid="$2" i
	for ((i = 0; i < 200; i++)); do
		if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
			return 0
		fi
		kill -0 "$pid" 2>/dev/null || return 1
		sleep 0.05
	done
	return 1
}
