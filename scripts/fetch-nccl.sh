#!/usr/bin/env bash
# Fetch libnccl.so.2 from the PyPI wheel nvidia-nccl-cu12 (no GPU, no CUDA toolkit needed)
# and print its absolute path on stdout. Used by CI:
#   MESHD_REQUIRE_NCCL=1 MESHD_NCCL_LIB=$(scripts/fetch-nccl.sh) cargo test -p meshd-nccl
#
# The wheel and the extracted library live in a cache OUTSIDE the repository:
#   ${MESHD_CACHE:-$HOME/.cache/meshd}/nccl/<version>/
# A second run finds the library there and returns at once.
# MESHD_NCCL_VERSION overrides the pinned wheel version (the root of a unique id and every
# rank must run the same NCCL version, so pin what your PyTorch ships).
set -euo pipefail

version="${MESHD_NCCL_VERSION:-2.27.5}"
cache="${MESHD_CACHE:-${HOME:?HOME is not set}/.cache/meshd}"
dir="$cache/nccl/$version"
lib="$dir/libnccl.so.2"

say() { printf 'fetch-nccl: %s\n' "$*" >&2; }

if [[ -s "$lib" ]]; then
    printf '%s\n' "$lib"
    exit 0
fi

python="${PYTHON:-python3}"
if ! command -v "$python" >/dev/null 2>&1; then
    say "error: $python not found; it is needed to download and unpack the wheel"
    exit 2
fi

mkdir -p "$dir"
wheels="$dir/wheel"
mkdir -p "$wheels"

wheel="$(ls "$wheels"/nvidia_nccl_cu12-"$version"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$wheel" ]]; then
    say "downloading nvidia-nccl-cu12==$version (a few hundred MB, once) into $wheels"
    if ! "$python" -m pip download --quiet --no-deps --only-binary=:all: \
            --dest "$wheels" "nvidia-nccl-cu12==$version" >&2; then
        say "error: pip download of nvidia-nccl-cu12==$version failed (is PyPI reachable? a proxy or index set in PIP_INDEX_URL?)"
        exit 3
    fi
    wheel="$(ls "$wheels"/nvidia_nccl_cu12-"$version"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$wheel" ]]; then
        say "error: pip reported success but no nvidia_nccl_cu12-$version wheel is in $wheels"
        exit 3
    fi
fi

# A wheel is a zip: extract only nvidia/nccl/lib/libnccl.so.2, atomically (tmp + rename).
if ! "$python" - "$wheel" "$lib" <<'PY' >&2
import os, shutil, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith("/libnccl.so.2")]
    if not names:
        sys.exit(f"no libnccl.so.2 inside {wheel}")
    tmp = dest + ".tmp.%d" % os.getpid()
    with z.open(names[0]) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
PY
then
    say "error: could not extract libnccl.so.2 from $wheel"
    exit 4
fi

# The library is all we need: drop the wheel to save disk (the library is the cache).
say "$(basename "$wheel"): wheel $(( $(stat -c %s "$wheel") / 1048576 )) MiB, libnccl.so.2 $(( $(stat -c %s "$lib") / 1048576 )) MiB"
rm -f "$wheel"
rmdir "$wheels" 2>/dev/null || true
printf '%s\n' "$lib"
