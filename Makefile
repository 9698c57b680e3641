# Build, test and run the rate_limit Caddy plugin. `make` lists the targets.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
.DELETE_ON_ERROR:

# The one place that sets up PATH, for every recipe and the scripts they
# run: Go from the official tarball may only be in /usr/local/go/bin, and
# `go install` puts xcaddy into GOBIN, else the first GOPATH entry's bin/.
GO := $(or $(shell command -v go),$(wildcard /usr/local/go/bin/go))
ifneq ($(GO),)
GO_INSTALL_DIR := $(or $(shell $(GO) env GOBIN),$(firstword $(subst :, ,$(shell $(GO) env GOPATH)))/bin)
export PATH := $(GO_INSTALL_DIR):$(PATH):$(patsubst %/,%,$(dir $(GO)))
endif

CADDY_VERSION ?= v2.11.9
export CADDY_VERSION

SOAK_DURATION ?= 3m

# Only what ends up in the binary: test files, testdata and the load tools
# in bench/ do not trigger a (multi-minute, when cold) rebuild.
BUILD_INPUTS := $(shell find . -path ./bin -prune -o -path ./.git -prune -o -path ./bench -prune -o \
	\( -name '*.go' ! -name '*_test.go' -o -name '*.lua' \) -print) go.mod go.sum
FLOOR_INPUTS := $(wildcard bench/floor/*.go) bench/floor/go.mod bench/floor/go.sum

.PHONY: help build run deps check test fuzz bench soak clean

help: ## List the targets
	@echo "Targets:"
	@awk -F':.*## ' '/^[a-z][a-z-]*:.*## / { printf "  %-7s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

build: bin/caddy ## Build bin/caddy (Caddy v2.11.9 + this plugin; CADDY_VERSION=... to change) with xcaddy

bin/caddy: $(BUILD_INPUTS)
	@bash scripts/build-caddy.sh $@

# The benchmark's Caddy also holds its measuring stick, bench/floor.
bin/caddy-bench: $(BUILD_INPUTS) $(FLOOR_INPUTS)
	@XCADDY_QUIET=1 bash scripts/build-caddy.sh $@ bench/floor

# The peer the benchmark sets beside this plugin, mholt/caddy-ratelimit,
# in a Caddy of its own (both plugins register rate_limit), from the
# module proxy.
MHOLT_VERSION ?= v0.1.0
bin/caddy-mholt:
	@XCADDY_QUIET=1 BUILD_PLUGIN=0 bash scripts/build-caddy.sh $@ github.com/mholt/caddy-ratelimit@$(MHOLT_VERSION)

run: bin/caddy ## Build, then serve Caddyfile.example on :8080 (starts a throwaway Redis if none answers; STORE=memory: no Redis)
	@STORE="$(STORE)" bash scripts/run.sh

deps: ## Install redis-server, redis-cli, gcc and xcaddy if missing
	@bash scripts/install-deps.sh

check: ## The fast tests: go test -short (no Redis or Caddy processes); -tags fast leaves out the one test file that needs the OpenAI client (it starts processes, so -short skips it anyway), which links the test binary 30 MB smaller
	go test -short -count=1 -tags fast ./...

# The fuzz tests (each package's fuzz_test.go) as package:target, each
# for FUZZTIME; their seed corpora in the package's testdata/fuzz also
# run with every go test.
FUZZ_TARGETS := .:FuzzUnmarshalCaddyfile ./internal/keys:FuzzKeyTemplate .:FuzzParseReply
FUZZTIME ?= 5s

test: deps ## go vet, go test -race, a few seconds of each fuzzer, then check the xcaddy build and Caddyfile.example
	go vet ./...
	cd bench/floor && go vet ./...
	go test -race -count=1 -timeout 30m ./...
	$(MAKE) --no-print-directory fuzz
	@bash scripts/check-build.sh

fuzz: ## Run each fuzz test for FUZZTIME (5s)
	@for target in $(FUZZ_TARGETS); do \
		bash scripts/fuzz-one.sh "$${target%%:*}" "$${target#*:}" "$(FUZZTIME)" || exit 1; \
	done

bench: bin/caddy-bench bin/caddy-mholt ## Load benchmark, side by side (BENCH_ROUNDS=5 BENCH_DURATION=3s BENCH_WARMUP=1s BENCH_CASES="bare@64 memory@64 lease-keys@64 lease-mixed@64" BENCH_KEYS=10000 BENCH_HOT=8 BENCH_HOT_SHARE=0.9 BENCH_GOGC=100 BENCH_PROFILE=dir BENCH_PROFILE_CASE=allowed BENCH_BASELINE=<rev> BENCH_BASELINE_CASES="lease-mixed@64")
	@bash scripts/bench.sh

soak: ## Load against two Caddy instances while Redis is stopped, restarted and flushed (SOAK_DURATION=3m)
	SOAK_DURATION=$(SOAK_DURATION) go test -run '^TestSoak$$' -v -count=1 -timeout 1h ./bench/soak

clean: ## Remove bin/
	rm -rf bin/
