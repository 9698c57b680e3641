# shellcheck shell=bash
# Shared helpers, sourced by the other scripts in this directory (never run
# on its own). Sets REPO_ROOT and puts Go and the Go install directory
# (GOBIN, else the first GOPATH entry's bin/) on PATH.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Caddy release the plugin is built against; override with CADDY_VERSION=...
: "${CADDY_VERSION:=v2.11.9}"
# xcaddy release installed by install-deps.sh when none is found.
: "${XCADDY_VERSION:=v0.4.5}"

log() { printf '%s: %s\n' "${SCRIPT_NAME:-${0##*/}}" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Go from the official tarball lives in /usr/local/go/bin, which a fresh
# shell's PATH often lacks.
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
	PATH="$PATH:/usr/local/go/bin"
fi
if command -v go >/dev/null 2>&1; then
	_gobin="$(go env GOBIN 2>/dev/null || true)"
	if [[ -z "$_gobin" ]]; then
		_gopath="$(go env GOPATH 2>/dev/null || true)"
		[[ -n "$_gopath" ]] && _gobin="${_gopath%%:*}/bin"
	fi
	if [[ -n "$_gobin" && ":$PATH:" != *":$_gobin:"* ]]; then
		PATH="$_gobin:$PATH"
	fi
	# shellcheck disable=SC2034 # used by the scripts that source this file
	GO_INSTALL_DIR="$_gobin"
	unset _gobin _gopath
fi
export PATH

# The plugin's module path, read from go.mod so a rename needs no edits here.
module_path() {
	awk '$1 == "module" { print $2; exit }' "$REPO_ROOT/go.mod"
}

# ensure_caddy BIN [MODULE=DIR]...: builds BIN with xcaddy
# (scripts/build-caddy.sh, installing xcaddy when missing), with the plugin
# and any extra local modules, if it is missing or stale: when any non-test
# Go file, script.lua, go.mod or go.sum of the plugin (bench/ holds only
# the load tools) or of an extra module's DIR is newer than it.
ensure_caddy() {
	local bin="$1" spec stale=""
	shift
	if [[ ! -x "$bin" ]]; then
		stale=1
	else
		stale="$(cd "$REPO_ROOT" && find . \( -path ./bin -o -path ./.git -o -path ./bench \) -prune -o \
			\( \( -name '*.go' ! -name '*_test.go' \) -o -name script.lua -o -name go.mod -o -name go.sum \) \
			-newer "$bin" -print -quit)"
		for spec in "$@"; do
			[[ -n "$stale" ]] || stale="$(find "${spec#*=}" \( -name '*.go' -o -name go.mod -o -name go.sum \) -newer "$bin" -print -quit)"
		done
	fi
	if [[ -n "$stale" ]]; then
		command -v xcaddy >/dev/null 2>&1 || bash "$REPO_ROOT/scripts/install-deps.sh" --xcaddy-only
		XCADDY_QUIET="${XCADDY_QUIET:-1}" bash "$REPO_ROOT/scripts/build-caddy.sh" "$bin" "$@"
	else
		log "${bin#"$REPO_ROOT"/} is up to date"
	fi
}

# stop_child PID [SECONDS]: SIGTERM, then SIGKILL after SECONDS (10), then
# reaps it. An empty PID is a no-op.
stop_child() {
	local pid="$1" i
	[[ -n "$pid" ]] || return 0
	if kill -TERM "$pid" 2>/dev/null; then
		for ((i = 0; i < ${2:-10} * 10; i++)); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$pid" 2>/dev/null || true
	fi
	wait "$pid" 2>/dev/null || true
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
