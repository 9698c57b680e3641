#!/usr/bin/env bash
# Builds Caddy $CADDY_VERSION (set in the Makefile) with this plugin from the
# working tree, using xcaddy (installed first if missing).
#
#   scripts/build-caddy.sh OUTPUT [DIR | MODULE@VERSION]...
#
# Each DIR adds one more local module, its path read from DIR/go.mod
# (`make bench` adds its measuring stick, bench/floor); each
# MODULE@VERSION a published module, from the module proxy. With
# BUILD_PLUGIN=0 this plugin is left out (`make bench`'s peer,
# mholt/caddy-ratelimit, registers rate_limit too).
#
# Set XCADDY_QUIET=1 to send xcaddy's chatter to a log that is printed only
# if the build fails.
#
# The module path is not published, and the Go proxy answers 403 for it, so
# the plain `--with <module>=<dir>` form (which makes `go get` look the
# module up) fails. Pinning the zero pseudo-version in `--with
# <module>@v0.0.0-00010101000000-000000000000=<dir>` makes go resolve it
# purely through the replace directive, with no network lookup.
set -euo pipefail
SCRIPT_NAME=build-caddy
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${CADDY_VERSION:?not set; the Makefile sets it}"
(($# >= 1)) || die "usage: scripts/build-caddy.sh OUTPUT [DIR | MODULE@VERSION]..."
out="$1"
shift
[[ "$out" = /* ]] || out="$PWD/$out"

command -v go >/dev/null 2>&1 || die "Go is not on PATH; install Go 1.26+ (https://go.dev/dl/)"
command -v xcaddy >/dev/null 2>&1 || bash "$REPO_ROOT/scripts/install-deps.sh" --xcaddy-only

# --with arguments: this module (unless BUILD_PLUGIN=0), then each DIR's,
# by absolute directory, then each MODULE@VERSION as it is.
withs=()
dirs=()
published=()
[[ "${BUILD_PLUGIN:-1}" == 0 ]] || dirs+=("$REPO_ROOT")
for arg in "$@"; do
	if [[ "$arg" == *@* && ! -d "$arg" ]]; then
		published+=("$arg")
	else
		dirs+=("$arg")
	fi
done
for dir in "${dirs[@]}"; do
	dir="$(cd "$dir" && pwd)" || die "no such directory: $dir"
	module="$(awk '$1 == "module" { print $2; exit }' "$dir/go.mod")"
	[[ -n "$module" ]] || die "cannot read the module path from $dir/go.mod"
	withs+=(--with "$module@v0.0.0-00010101000000-000000000000=$dir")
done
for module in "${published[@]}"; do
	withs+=(--with "$module")
done

mkdir -p "$(dirname "$out")"
# xcaddy's build environment, go's work files and the new binary all go into
# a directory of our own (via TMPDIR and --output), removed on exit. The
# binary is then moved into place, so a failed or interrupted build never
# leaves a half-written bin/caddy behind.
work="$(mktemp -d "${TMPDIR:-/tmp}/build-caddy.XXXXXX")"
staged="$out.tmp.$$"
xpid=""
cleanup() {
	local rc=$?
	trap '' INT TERM HUP
	# xcaddy runs in its own process group (see below): stop it and the go
	# build it started (xcaddy does not abort a running build on SIGINT).
	[[ -z "$xpid" ]] || stop_child "-$xpid" xcaddy
	rm -rf "$work"
	rm -f "$staged"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

log "building Caddy $CADDY_VERSION with ${dirs[*]} ${published[*]} -> $out"
start=$SECONDS
cmd=(xcaddy build "$CADDY_VERSION" "${withs[@]}" --output "$work/caddy")
xlog="$work/xcaddy.log"
# xcaddy runs in the background in a process group of its own (set -m), so
# a signal to this script is handled at once (a foreground child would delay
# the trap until it ends) and cleanup can stop the whole build by group id.
set -m
if [[ "${XCADDY_QUIET:-0}" == 1 ]]; then
	(cd "$REPO_ROOT" && TMPDIR="$work" exec "${cmd[@]}") >"$xlog" 2>&1 &
else
	(cd "$REPO_ROOT" && TMPDIR="$work" exec "${cmd[@]}") &
fi
xpid=$!
set +m
rc=0
wait "$xpid" || rc=$?
xpid=""
if ((rc != 0)); then
	if [[ "${XCADDY_QUIET:-0}" == 1 ]]; then
		tail -n 60 "$xlog" >&2
		die "xcaddy build failed (exit $rc); the last 60 lines of its output are above"
	fi
	die "xcaddy build failed (exit $rc)"
fi
cp "$work/caddy" "$staged"
mv -f "$staged" "$out"
log "built $out in $((SECONDS - start))s"
