#!/usr/bin/env bash
# The test command: unit, property, simulator and network-lab suites. It installs what
# they need first (scripts/setup.sh: the same step CI uses) and fetches libnccl.so.2 from
# PyPI into a cache outside the clone (scripts/fetch-nccl.sh) unless MESHD_NCCL_LIB names
# one, so the NCCL suites run too.
# The lab suites need root (network namespaces); as non-root they fail unless
# MESHD_LAB_SKIP=1 is set, which skips them loudly. MESHD_REQUIRE_NCCL=1 makes a missing
# libnccl a failure instead of a skip.
# The Python suites run on Debian's torch 1.13 (/usr/bin/python3) and on PyPI's current
# torch: scripts/fetch-torch.sh makes that venv once (cached outside the clone, about 2 min
# and 5.4 GB the first time) unless MESHD_TORCH2_PYTHON names one; tests/torches/mod.rs
# says which tests run on which. MESHD_REQUIRE_TORCH2=1 makes a missing venv a failure.
# Every test binary runs even when one fails (--no-fail-fast); the closing line counts all,
# and the Python tests by torch.
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
if [ -z "${MESHD_TORCH2_PYTHON:-}" ]; then
  if py="$(scripts/fetch-torch.sh)"; then
    export MESHD_TORCH2_PYTHON="$py"
  elif [ "${MESHD_REQUIRE_TORCH2:-}" = 1 ]; then
    echo "test: could not make the torch 2 venv (scripts/fetch-torch.sh) and MESHD_REQUIRE_TORCH2=1" >&2
    exit 1
  else
    echo "test: could not make the torch 2 venv (scripts/fetch-torch.sh); the torch 2 variants will skip" >&2
  fi
fi
cargo build --bins --quiet || exit $?
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace --all-targets --no-fail-fast "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# One closing line over every suite (cargo prints one per test binary), with the Python
# tests by torch (tests/torches/mod.rs names them NAME::torch1_13, ::torch2, ::torch2_numpy).
torch2=""
if [ -n "${MESHD_TORCH2_PYTHON:-}" ]; then
  torch2="$("$MESHD_TORCH2_PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo '?')"
fi
awk -v torch2="$torch2" '
     /^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;/) p += $i; if ($(i+1) ~ /^failed;/) f += $i } }
     /^test .*::torch1_13 \.\.\. ok$/ { a++ } /^test .*::torch1_13 \.\.\. FAILED$/ { af++ }
     /^test .*::torch2(_numpy)? \.\.\. ok$/ { b++ } /^test .*::torch2(_numpy)? \.\.\. FAILED$/ { bf++ }
     END { two = torch2 == "" ? sprintf("torch 2: %d SKIPPED (no venv)", b + bf) \
                              : sprintf("torch %s: %d passed, %d failed", torch2, b, bf)
           printf "tests: %d passed, %d failed; python on torch 1.13: %d passed, %d failed; on %s\n", p, f, a, af, two }' "$log"
exit "$status"
