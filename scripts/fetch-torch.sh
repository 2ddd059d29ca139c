#!/usr/bin/env bash
# Make a virtual environment with today's PyTorch from PyPI (the standard Linux wheel with
# its nvidia-* dependencies: it imports, runs CPU tensors and Gloo without a GPU) and the
# frameworks the lab's Python suites launch, and print the path of its python on stdout.
# Used by scripts/test.sh (MESHD_TORCH2_PYTHON) and CI:
#   MESHD_TORCH2_PYTHON=$(scripts/fetch-torch.sh) cargo test --test lab_frameworks
#
# The versions are pinned HERE and nowhere else (tests read them from the venv):
#   torch 2.15.0, torchft 0.2.0 (fault-tolerance suites), pytorch-lightning 2.6.6,
#   accelerate 1.16.0.
# The venv lives in a cache OUTSIDE the repository:
#   ${MESHD_CACHE:-$HOME/.cache/meshd}/torch/<torch version>/venv/
# A stamp file written last (venv/.meshd-stamp: the pins and the base interpreter) makes a
# second run return at once; a venv without a matching stamp (an interrupted or older
# fetch) is removed and made again. The first fetch downloads about 2.8 GB and the venv
# takes about 5.4 GB. The base interpreter is Debian's /usr/bin/python3 (PYTHON overrides),
# without its site packages, so Debian's torch 1.13 is not visible inside.
set -euo pipefail

torch_version=2.15.0
pins=(
    "torch==$torch_version"
    "torchft==0.2.0"
    "pytorch-lightning==2.6.6"
    "accelerate==1.16.0"
)

cache="${MESHD_CACHE:-${HOME:?HOME is not set}/.cache/meshd}"
dir="$cache/torch/$torch_version"
venv="$dir/venv"
stamp="$venv/.meshd-stamp"

say() { printf 'fetch-torch: %s\n' "$*" >&2; }

base="${PYTHON:-/usr/bin/python3}"
if ! command -v "$base" >/dev/null 2>&1; then
    say "error: $base not found (Debian: apt-get install python3 python3-venv; or set PYTHON)"
    exit 2
fi
want="$(printf '%s\n' "${pins[@]}"; "$base" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    printf '%s\n' "$venv/bin/python"
    exit 0
fi

mkdir -p "$dir"
# One fetch at a time (two test runs started together): the second waits, then finds the stamp.
exec 9>"$dir/.lock"
if ! flock -w 1800 9; then
    say "error: another fetch holds $dir/.lock for more than 30 minutes"
    exit 5
fi
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    printf '%s\n' "$venv/bin/python"
    exit 0
fi

start=$(date +%s)
rm -rf "$venv"
say "making $venv with ${pins[*]} (about 2.8 GB download and 5.4 GB on disk, once)"
if ! "$base" -m venv "$venv" >&2; then
    say "error: $base -m venv failed (Debian: apt-get install python3-venv)"
    exit 3
fi
# --no-cache-dir: the venv is the cache; pip's own copy of the wheels would double the disk.
if ! "$venv/bin/python" -m pip install --quiet --no-cache-dir --disable-pip-version-check \
        --only-binary=:all: "${pins[@]}" >&2; then
    say "error: pip install of ${pins[*]} failed (is PyPI reachable? a proxy or index set in PIP_INDEX_URL?)"
    exit 3
fi
# What the suites rely on, checked before the stamp says the venv is good.
if ! "$venv/bin/python" - "$torch_version" <<'PY' >&2
import sys
import torch, torch.distributed as dist
import torchft, pytorch_lightning, accelerate
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert dist.is_available() and dist.is_gloo_available(), "torch without Gloo"
print(f"fetch-torch: torch {torch.__version__}, torchft, pytorch_lightning {pytorch_lightning.__version__}, "
      f"accelerate {accelerate.__version__}: import and Gloo ok")
PY
then
    say "error: the fresh venv at $venv does not import what the suites need"
    exit 4
fi
printf '%s\n' "$want" >"$stamp"
say "done in $(( $(date +%s) - start )) s; $(du -sm "$venv" | cut -f1) MiB in $venv"
printf '%s\n' "$venv/bin/python"
