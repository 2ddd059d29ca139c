#!/usr/bin/env bash
# The test command: unit, property, simulator and network-lab suites.
# The lab suites need root (network namespaces); as non-root they fail unless
# MESHD_LAB_SKIP=1 is set, which skips them loudly.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --bins --quiet
exec cargo test --workspace --all-targets "$@"
