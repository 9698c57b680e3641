#!/usr/bin/env bash
# Runs one fuzz target for a time: fuzz-one.sh <package> <target> <fuzztime>.
# Go's fuzzer sometimes ends a run that found nothing with "context
# deadline exceeded", when its time runs out while a worker is still
# starting or minimizing: no failing input is written then, and that is
# not a finding, so the run is made once more. Any other failure, or one
# that writes a failing input (testdata/fuzz), fails at once.
set -uo pipefail
pkg=$1 target=$2 fuzztime=$3
for attempt in 1 2; do
	out=$(go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$pkg" 2>&1)
	status=$?
	printf '%s\n' "$out"
	if [[ $status -eq 0 ]]; then
		exit 0
	fi
	if [[ $attempt -eq 1 ]] && grep -q 'context deadline exceeded' <<<"$out" && ! grep -q 'Failing input written to' <<<"$out"; then
		echo "fuzz: $target: the fuzzer's own deadline ended the run, with no failing input; running it again" >&2
		continue
	fi
	exit "$status"
done
