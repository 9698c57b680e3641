# Build, test and run the rate_limit Caddy plugin. `make` lists the targets.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
.DELETE_ON_ERROR:

# Go from the official tarball lives in /usr/local/go/bin, and `go install`
# puts xcaddy in GOBIN or $(go env GOPATH)/bin; put both on PATH for every
# recipe. ($(shell) sees make's starting PATH, hence the absolute fallback.)
GO := $(shell command -v go 2>/dev/null || { test -x /usr/local/go/bin/go && echo /usr/local/go/bin/go; })
GO_INSTALL_DIR := $(if $(GO),$(shell $(GO) env GOBIN))
ifeq ($(GO_INSTALL_DIR),)
GO_INSTALL_DIR := $(if $(GO),$(firstword $(subst :, ,$(shell $(GO) env GOPATH)))/bin)
endif
export PATH := $(if $(GO_INSTALL_DIR),$(GO_INSTALL_DIR):)$(PATH)$(if $(GO),:$(patsubst %/,%,$(dir $(GO))))

CADDY_VERSION ?= v2.11.9
export CADDY_VERSION

# Only what ends up in the binary: test files, testdata and the load tools
# in bench/ do not trigger a (multi-minute, when cold) rebuild.
BUILD_INPUTS := $(shell find . -path ./bin -prune -o -path ./.git -prune -o -path ./bench -prune -o \
	-name '*.go' ! -name '*_test.go' -print) script.lua go.mod go.sum

.PHONY: help build run deps test vet unit check-build bench soak clean

help: ## List the targets
	@echo "Targets:"
	@awk -F':.*## ' '/^[a-z][a-z-]*:.*## / { printf "  %-12s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

build: bin/caddy ## Build bin/caddy (Caddy v2.11.9 + this plugin; CADDY_VERSION=... to change) with xcaddy

bin/caddy: $(BUILD_INPUTS)
	@bash scripts/install-deps.sh --xcaddy-only
	@bash scripts/build-caddy.sh $@

run: bin/caddy ## Build, then serve Caddyfile.example on :8080 (starts a throwaway Redis if none answers)
	@bash scripts/run.sh

deps: ## Install redis-server, redis-cli, gcc and xcaddy if missing (scripts/install-deps.sh --bench adds wrk)
	@bash scripts/install-deps.sh

test: deps ## go vet, go test -race, then check the xcaddy build and Caddyfile.example
	go vet ./...
	cd bench/floor && go vet ./...
	go test -race -count=1 -timeout 15m ./...
	@bash scripts/check-build.sh

bench: ## Run scripts/bench.sh
	@if [[ -f scripts/bench.sh ]]; then bash scripts/bench.sh; \
	else echo "bench: not yet (scripts/bench.sh does not exist)"; fi

soak: ## Run scripts/soak.sh
	@if [[ -f scripts/soak.sh ]]; then bash scripts/soak.sh; \
	else echo "soak: not yet (scripts/soak.sh does not exist)"; fi

clean: ## Remove bin/
	rm -rf bin/
