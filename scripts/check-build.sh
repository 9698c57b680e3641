#!/usr/bin/env bash
# The last step of `make test`: builds Caddy with the plugin into a
# temporary directory and checks that
#   - `caddy list-modules` includes http.handlers.rate_limit, and
#   - `caddy adapt` accepts Caddyfile.example.
# The temporary directory is removed afterwards; bin/ is not touched.
set -euo pipefail
SCRIPT_NAME=check-build
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODULE_ID=http.handlers.rate_limit

tmpdir="$(mktemp -d "${TMPDIR:-/tmp}/check-build.XXXXXX")"
trap 'rm -rf "$tmpdir"' EXIT
caddy="$tmpdir/caddy"

XCADDY_QUIET=1 bash "$REPO_ROOT/scripts/build-caddy.sh" "$caddy"

modules="$("$caddy" list-modules)" || die "caddy list-modules failed"
grep -qx "$MODULE_ID" <<<"$modules" || die "caddy list-modules does not include $MODULE_ID"
log "ok: caddy list-modules includes $MODULE_ID"

if ! out="$(cd "$REPO_ROOT" && "$caddy" adapt --config Caddyfile.example --adapter caddyfile 2>&1 >/dev/null)"; then
	printf '%s\n' "$out" >&2
	die "caddy adapt rejected Caddyfile.example"
fi
log "ok: caddy adapt accepts Caddyfile.example"
log "PASS"
