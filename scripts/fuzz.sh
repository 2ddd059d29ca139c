#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of every decoder a peer or a local process reaches
# (fuzz/README.md). Builds fuzz/ with cargo-fuzz on the STABLE toolchain (--sanitizer
# none: AddressSanitizer needs nightly, and safe Rust does not need it to catch overflow,
# out-of-bounds or a failed property: those panic), writes the seed corpus from the real
# encoders, runs each target for N seconds, and fails on any crash, panic, failed
# property, timeout or out-of-memory. A failing input is kept in fuzz/artifacts/<target>/.
#
# Usage: scripts/fuzz.sh [seconds-per-target (default 15)] [target...]
# Env:   FUZZ_TARGET_DIR  cargo target dir for the fuzz build (default fuzz/target)
#        FUZZ_JOBS        targets fuzzed at once (default: the number of cores)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-15}
shift || true
start=$(date +%s)

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== cargo install cargo-fuzz"
  cargo install --locked cargo-fuzz@0.13.2
fi
# libfuzzer-sys compiles libFuzzer (C++).
if ! command -v c++ >/dev/null; then
  echo "== apt-get install g++ (libFuzzer is C++)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi

# fuzz/ has its own Cargo.lock: what it fuzzes should be what ships.
lockver() { awk -v c="$1" '/^name = /{n=$3} /^version = /{if (n == "\"" c "\"") print $3}' "$2" | sort -u | tr '\n' ' '; }
for c in postcard serde serde_core serde_json; do
  if [ "$(lockver "$c" Cargo.lock)" != "$(lockver "$c" fuzz/Cargo.lock)" ]; then
    echo "warning: $c is $(lockver "$c" Cargo.lock)in Cargo.lock but $(lockver "$c" fuzz/Cargo.lock)in" \
      "fuzz/Cargo.lock: cargo update --manifest-path fuzz/Cargo.toml -p $c --precise <version>"
  fi
done

tdir=${FUZZ_TARGET_DIR:-fuzz/target}
fuzz=(cargo fuzz)
opts=(--sanitizer none --target-dir "$tdir")
echo "== cargo fuzz build (stable, --sanitizer none)"
"${fuzz[@]}" build "${opts[@]}"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <("${fuzz[@]}" list | grep -v '^gen_seeds$')
fi

echo "== seeds from the real encoders"
MESHD_FUZZ_SEEDS=fuzz/seeds "$tdir/x86_64-unknown-linux-gnu/release/gen_seeds"

# One target per core at a time (the fuzzers are single-threaded).
jobs=${FUZZ_JOBS:-$(nproc)}
run_one() {
  local t=$1
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: a decoder blowing up memory.
  "${fuzz[@]}" run "${opts[@]}" "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    >"fuzz/artifacts/$t/log" 2>&1
}
echo "== fuzz ${targets[*]} for ${secs}s each, $jobs at a time"
declare -A pid
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run_one "$t" &
  pid[$t]=$!
done
failed=()
for t in "${targets[@]}"; do
  if ! wait "${pid[$t]}"; then
    failed+=("$t")
    tail -n 40 "fuzz/artifacts/$t/log"
  fi
  echo "$t: $(grep -E '^stat::number_of_executed_units' "fuzz/artifacts/$t/log" | awk '{print $2}') runs," \
    "corpus $(ls "fuzz/corpus/$t" | wc -l) inputs"
done

echo "== fuzzing took $(( $(date +%s) - start )) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FUZZ FAILURES: ${failed[*]} (inputs in fuzz/artifacts/<target>/; replay with" \
    "cargo fuzz run --sanitizer none <target> <input>)"
  exit 1
fi
