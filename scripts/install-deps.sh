#!/usr/bin/env bash
# Installs what building, testing and running the plugin needs (`make deps`,
# `make test`). Idempotent: anything already present is left alone.
#
#   scripts/install-deps.sh                redis-server, redis-cli, gcc (for
#                                          go test -race) and xcaddy
#   scripts/install-deps.sh --xcaddy-only  only xcaddy (what building needs)
#
# System packages come from apt (Debian/Ubuntu), through sudo when not root.
# xcaddy is `go install`ed into Go's install directory, which the Makefile
# puts on PATH. This never starts or stops any Redis server.
set -euo pipefail
SCRIPT_NAME=install-deps
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

XCADDY_VERSION=v0.4.5

want_system=1
case "${1:-}" in
"") ;;
--xcaddy-only) want_system=0 ;;
*) die "unknown argument: $1 (usage: scripts/install-deps.sh [--xcaddy-only])" ;;
esac

command -v go >/dev/null 2>&1 ||
	die "Go is not installed (or not on PATH). Install Go 1.26 or newer from https://go.dev/dl/ into /usr/local/go, then re-run."

# --- system packages -------------------------------------------------------
pkgs=()
if ((want_system)); then
	if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
		pkgs+=(redis-server redis-tools)
	fi
	# go test -race needs cgo, i.e. a C compiler and libc headers.
	if ! command -v gcc >/dev/null 2>&1; then
		pkgs+=(gcc libc6-dev)
	fi
fi

if ((${#pkgs[@]})); then
	manual="install them yourself, e.g.: sudo apt-get update && sudo apt-get install -y ${pkgs[*]}"
	command -v apt-get >/dev/null 2>&1 ||
		die "missing: ${pkgs[*]}, and apt-get is not available. Install the equivalent packages with your system's package manager (redis-server + redis-cli, gcc)."
	sudo=()
	if [[ $(id -u) -ne 0 ]]; then
		command -v sudo >/dev/null 2>&1 ||
			die "missing: ${pkgs[*]}; not root and sudo is not available. Install them as root: apt-get update && apt-get install -y ${pkgs[*]}"
		sudo=(sudo)
	fi
	log "installing ${pkgs[*]} with apt-get${sudo[*]:+ (via sudo)}"
	if ! ${sudo[@]+"${sudo[@]}"} apt-get update ||
		! ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${pkgs[@]}"; then
		die "apt-get failed; $manual"
	fi
	hash -r
fi

if ((want_system)); then
	for bin in redis-server redis-cli gcc; do
		command -v "$bin" >/dev/null 2>&1 || die "$bin still not found after installing; check the apt-get output above"
	done
	log "ok: redis-server ($(command -v redis-server)), redis-cli, gcc"
fi

# --- xcaddy ------------------------------------------------------------------
if ! command -v xcaddy >/dev/null 2>&1; then
	log "installing xcaddy $XCADDY_VERSION with go install"
	go install "github.com/caddyserver/xcaddy/cmd/xcaddy@$XCADDY_VERSION" ||
		die "go install of xcaddy failed (needs access to the Go module proxy)"
	hash -r
	command -v xcaddy >/dev/null 2>&1 ||
		die "xcaddy was installed but is not on PATH; run this through make, or put GOBIN (default \$(go env GOPATH)/bin) on PATH"
fi
log "ok: xcaddy ($(command -v xcaddy))"
