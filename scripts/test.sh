#!/usr/bin/env bash
# The test command: unit, property, simulator and network-lab suites. It installs what
# they need first (scripts/setup.sh: the same step CI uses) and fetches libnccl.so.2 from
# PyPI into a cache outside the clone (scripts/fetch-nccl.sh) unless MESHD_NCCL_LIB names
# one, so the NCCL suites run too.
# The lab suites need root (network namespaces); as non-root they fail unless
# MESHD_LAB_SKIP=1 is set, which skips them loudly. MESHD_REQUIRE_NCCL=1 makes a missing
# libnccl a failure instead of a skip.
# Every test binary runs even when one fails (--no-fail-fast); the closing line counts all.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit $?
if [ -z "${MESHD_NCCL_LIB:-}" ]; then
  if lib="$(scripts/fetch-nccl.sh)"; then
    export MESHD_NCCL_LIB="$lib"
  else
    echo "test: could not fetch libnccl.so.2; the NCCL suites will skip" >&2
  fi
fi
cargo build --bins --quiet || exit $?
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace --all-targets --no-fail-fast "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# One closing line over every suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;/) p += $i; if ($(i+1) ~ /^failed;/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
