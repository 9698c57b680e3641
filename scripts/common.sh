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
