#!/usr/bin/env bash
# The wheel as users get it (issue 18.1): builds meshd's one wheel (the `meshd` binary and
# the Python client `import meshd`; pyproject.toml, maturin bindings = "bin"), installs it
# into a fresh venv, and checks, with nothing but the venv's bin and /usr/bin:/bin on PATH
# (no cargo): `import meshd`, README's first command, and a 2-host job on the network lab
# (tests/lab_wheel.rs, given the venv's meshd in MESHD_WHEEL_BIN).
#
#   scripts/wheel-check.sh             dev profile, this machine's glibc (seconds over a test build; what CI runs)
#   scripts/wheel-check.sh --release   the wheel users get: release profile,
#                                      linked by zig (PyPI's ziglang) against glibc 2.17:
#                                      tag manylinux2014 / manylinux_2_17, installs on RHEL 8
#                                      and other older clusters; MESHD_WHEEL_ZIG=0 links
#                                      against this machine's glibc instead (Debian 12:
#                                      manylinux_2_34); MESHD_WHEEL_ZIG=1 uses zig for --dev
#
# aarch64 (not run here: no arm machine): rustup target add aarch64-unknown-linux-gnu, then
#   maturin build --release --target aarch64-unknown-linux-gnu --zig --compatibility manylinux2014
# builds meshd_launcher-*-manylinux2014_aarch64 wheel (README's first command ran under qemu-aarch64).
#
# Needs root for the lab step (like scripts/test.sh). Maturin (and ziglang) come from PyPI
# into a tools venv under ~/.cache/meshd; the wheel and the test venv go to a temporary
# directory (MESHD_WHEEL_DIR keeps them somewhere else), removed unless MESHD_WHEEL_KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

profile=dev
case "${1:-}" in
  --release) profile=release ;;
  "" | --dev) ;;
  *) echo "usage: $0 [--release|--dev]" >&2; exit 2 ;;
esac

python=${PYTHON:-python3}
zig=${MESHD_WHEEL_ZIG:-$([ "$profile" = release ] && echo 1 || echo 0)}
scripts/setup.sh  # python3-venv among the rest

tools="${XDG_CACHE_HOME:-$HOME/.cache}/meshd/wheel-tools"
if [ ! -x "$tools/bin/maturin" ] || { [ "$zig" = 1 ] && ! "$tools/bin/python" -c 'import ziglang' 2>/dev/null; }; then
  echo "== maturin from PyPI into $tools"
  "$python" -m venv "$tools"
  pkgs=('maturin>=1.5,<2')
  [ "$zig" = 1 ] && pkgs+=(ziglang)
  "$tools/bin/pip" install -q "${pkgs[@]}"
fi

work=${MESHD_WHEEL_DIR:-$(mktemp -d /tmp/meshd-wheel.XXXXXX)}
mkdir -p "$work"
if [ "${MESHD_WHEEL_KEEP:-}" != 1 ] && [ -z "${MESHD_WHEEL_DIR:-}" ]; then
  trap 'rm -rf "$work"' EXIT
fi
rm -rf "$work/dist" "$work/venv"

echo "== maturin build --profile $profile$([ "$zig" = 1 ] && echo ' --zig --compatibility manylinux2014')"
build=("$tools/bin/maturin" build --profile "$profile" --out "$work/dist")
if [ "$zig" = 1 ]; then
  build+=(--zig --compatibility manylinux2014)
  export PATH="$tools/bin:$PATH"  # python -m ziglang
fi
t0=$(date +%s)
"${build[@]}"
echo "wheel built in $(( $(date +%s) - t0 )) s"
wheel=$(ls "$work"/dist/meshd_launcher-*.whl)
ls -l "$wheel"
# Both halves in the one wheel: the binary as a script, the client as a package.
"$python" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.endswith(".data/scripts/meshd") for n in names), names
assert "meshd/__init__.py" in names and "meshd/torch.py" in names, names
print("wheel holds:", ", ".join(n for n in names if not n.endswith(("RECORD", ".json"))))
EOF

echo "== fresh venv, pip install the wheel"
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install -q --no-index "$wheel"
venv_bin="$work/venv/bin"
bare_path="$venv_bin:/usr/bin:/bin"
# From now on: the venv and the system only. cargo must not be on that PATH (rustup puts it
# in ~/.cargo/bin); if a system cargo exists it is not used: meshd must be the venv's.
run_bare() { (cd "$work" && env -i HOME="$HOME" PATH="$bare_path" "$@"); }
if run_bare sh -c 'command -v cargo' >/dev/null; then
  echo "note: a system cargo is on /usr/bin; the checks below still require the venv's meshd"
fi
found=$(run_bare sh -c 'command -v meshd')
[ "$found" = "$venv_bin/meshd" ] || { echo "FAIL: meshd on PATH is $found, not $venv_bin/meshd" >&2; exit 1; }

echo "== import meshd (the venv's python)"
run_bare python -c '
import os, sys, meshd
where = os.path.dirname(meshd.__file__)
assert where.startswith(sys.prefix), (where, sys.prefix)
assert callable(meshd.connect)
print("import meshd ok:", where)
'

echo "== README's first command with the venv's meshd"
out=$(run_bare meshd run --nnodes 1 --nproc-per-node 2 -- sh -c 'echo rank $RANK of $WORLD_SIZE')
echo "$out"
for r in 0 1; do
  grep -q "rank $r of 2" <<<"$out" || { echo "FAIL: no 'rank $r of 2' line" >&2; exit 1; }
done

echo "== 2-host lab job with the venv's meshd (tests/lab_wheel.rs)"
MESHD_WHEEL_BIN="$venv_bin/meshd" cargo test --quiet --test lab_wheel -- --nocapture
echo "wheel check ok: $(basename "$wheel") ($(du -h "$wheel" | cut -f1), $profile profile)"
