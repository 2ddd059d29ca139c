#!/usr/bin/env bash
# The test command: unit, property, simulator and network-lab suites.
# The lab suites need root (network namespaces); as non-root they fail unless
# MESHD_LAB_SKIP=1 is set, which skips them loudly. The NCCL suites run when
# MESHD_NCCL_LIB names libnccl.so.2 (scripts/fetch-nccl.sh) and must when MESHD_REQUIRE_NCCL=1.
set -uo pipefail
cd "$(dirname "$0")/.."
cargo build --bins --quiet || exit $?
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace --all-targets "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# One closing line over every suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;/) p += $i; if ($(i+1) ~ /^failed;/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
