#!/usr/bin/env bash
# A/B runs on a 3-host network lab (the same shape as tests/lab: namespaces on a bridge,
# eth1 198.19.0.X): two or more meshd binaries, run alternately in one session, so that
# the machine's load falls on every version alike. Root only; everything stays inside
# the lab's namespaces and is removed on exit.
#
#   scripts/ab-lab.sh MODE MTU ROUNDS BIN...
#
# MODE tunnel: PyTorch Gloo's allreduce (examples/gloo_allreduce_bench.py, 64 MiB float32,
#   MESHD_AB_ITERS timed, default 10) under `meshd run`, behind the one-port firewall on
#   every host (the preflight picks the tunnel). Prints per run: busbw of each rank, and
#   each meshd's CPU seconds per GB it tunnelled (sent + received) from its end-of-round
#   `tunnel:` line.
# MODE ring: `meshd bench allreduce --size 64MiB --iters 5 --plane auto` (MESHD_AB_RING_ITERS,
#   MESHD_AB_PLANE
#   to change). Prints busbw and CPU s/GB per link of each host.
# MODE gloo: Gloo's allreduce on the open network (no firewall): the yardstick.
#
# In ring mode a BIN of `lean` runs the lean AES-GCM datagram ring of `cargo bench --bench
# allreduce` instead (benches/allreduce/dgram_ring.rs: the data plane's yardstick; the
# newest bench binary under target/release/deps, or MESHD_AB_LEAN_BIN; build it with
# `cargo bench --bench allreduce --no-run`), so that the plane and its yardstick alternate:
#   MESHD_AB_RING_ITERS=10 scripts/ab-lab.sh ring 1500 2 target/release/meshd lean
#
# The binaries run in the order A B B A, repeated ROUNDS times. MESHD_AB_ENV: extra
# `K=V ...` for every meshd. MESHD_AB_KEEP: a folder to keep each run's output in.
set -euo pipefail
mode=$1 mtu=$2 rounds=$3
shift 3
bins=("$@")
here=$(cd "$(dirname "$0")/.." && pwd)
py=${MESHD_AB_PYTHON:-/usr/bin/python3}
iters=${MESHD_AB_ITERS:-10}
size=${MESHD_AB_SIZE:-67108864}
p="mdlab-$$-ab"
octets=(30 7 19)
peers="198.19.0.30,198.19.0.7,198.19.0.19"

cleanup() {
    for i in 0 1 2; do
        for pid in $(ip netns pids "$p-h$i" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$p-h$i" 2>/dev/null || true
    done
    ip netns del "$p-hub" 2>/dev/null || true
}
trap cleanup EXIT
lean_bin=""
for b in "${bins[@]}"; do
    if [ "$b" = lean ]; then
        [ "$mode" = ring ] || { echo "ab-lab: 'lean' is a ring-mode baseline" >&2; exit 2; }
        lean_bin=${MESHD_AB_LEAN_BIN:-$(find "$here/target/release/deps" -maxdepth 1 -type f -executable -name 'allreduce-*' -printf '%T@ %p\n' 2>/dev/null | sort -rn | head -1 | cut -d' ' -f2-)}
        [ -x "$lean_bin" ] || { echo "ab-lab: no bench binary for 'lean' (cargo bench --bench allreduce --no-run, or set MESHD_AB_LEAN_BIN)" >&2; exit 2; }
    fi
done

ip netns add "$p-hub"
ip -n "$p-hub" link add br1 type bridge
ip -n "$p-hub" link set br1 up
for i in 0 1 2; do
    ns="$p-h$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "h${i}e0" netns "$p-hub"
    ip -n "$ns" addr add 198.18.0.4/16 dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$p-hub" link set "h${i}e0" up
    ip -n "$ns" route add default via 198.18.0.1 dev eth0
    ip -n "$ns" link add eth1 type veth peer name "h${i}e1" netns "$p-hub"
    ip -n "$ns" addr add "198.19.0.${octets[$i]}/24" dev eth1
    ip -n "$ns" link set eth1 up
    ip -n "$p-hub" link set "h${i}e1" master br1
    ip -n "$p-hub" link set "h${i}e1" up
    ip -n "$p-hub" link set "h${i}e1" mtu "$mtu"
    ip -n "$ns" link set eth1 mtu "$mtu"
    if [ "$mode" = tunnel ]; then
        ip netns exec "$ns" nft -f - <<EOF
table inet mdlab {
 chain input {
 type filter hook input priority 0; policy accept;
 iifname "lo" accept
 meta l4proto tcp drop
 udp dport != 29400 udp sport != 29400 drop
 }
}
EOF
    fi
done

one() { # BIN LABEL
    local bin=$1 label=$2 out
    out=$(mktemp -d)
    for i in 0 1 2; do
        if [ "$mode" = ring ] && [ "$bin" = lean ]; then
            timeout 300 ip netns exec "$p-h$i" "$lean_bin" --dgram-ring-worker "$i" "$peers" "$size" \
                "${MESHD_AB_RING_ITERS:-5}" "$mtu" >"$out/$i.out" 2>"$out/$i.err" &
        elif [ "$mode" = ring ]; then
            # shellcheck disable=SC2086
            env MESHD_TOKEN=ab MESHD_LOG=warn ${MESHD_AB_ENV:-} timeout 300 ip netns exec "$p-h$i" "$bin" bench allreduce --json \
                --nnodes 3 --peers "$peers" --size "$size" --iters "${MESHD_AB_RING_ITERS:-5}" --plane "${MESHD_AB_PLANE:-auto}" \
                >"$out/$i.out" 2>"$out/$i.err" &
        else
            # shellcheck disable=SC2086
            env MESHD_TOKEN=ab MESHD_LOG=info ${MESHD_AB_ENV:-} timeout 300 ip netns exec "$p-h$i" "$bin" run --nnodes 3 \
                --peers "$peers" --nproc-per-node 1 --collective auto -- "$py" \
                "$here/examples/gloo_allreduce_bench.py" --size "$size" --iters "$iters" \
                >"$out/$i.out" 2>"$out/$i.err" &
        fi
    done
    wait
    local line="$label"
    for i in 0 1 2; do
        if [ "$mode" = ring ]; then
            line+=$(python3 - "$out/$i.out" <<'EOF'
import json, sys
try:
    v = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
    # The lean ring prints its figures at the top level.
    r = v["results"][0] if "results" in v else v
    d = v.get("plane_datagrams") or {}
    per = d.get("opened", 0) / max(d.get("batches", 0), 1) if d else v.get("datagrams_per_recv", 0)
    print(f" | {r['busbw_gbs']:.3f} {r['cpu_s_per_gb']:.2f}s/GB {v.get('peak_rss_mib', 0):.0f}MiB {per:.0f}/batch held {d.get('held_peak', 0) / 2**20:.0f}MiB", end="")
except Exception as e:
    print(f" | failed", end="")
EOF
)
        else
            local bus cpu
            bus=$(grep -o 'GLOO bytes=[0-9]* .*busbw_gbs=[0-9.]*' "$out/$i.out" | awk '$2 != "bytes=8" {sub("busbw_gbs=","",$NF); print $NF}' | tail -1 || true)
            cpu=$(grep 'tunnel: ' "$out/$i.err" | grep 'CPU so far' | tail -1 |
                sed -E 's/.* ([0-9.]+) MiB sent, ([0-9.]+) MiB received[^;]*; CPU so far: meshd ([0-9.]+) s.*/\1 \2 \3/' |
                awk '{ if ($1 + $2 > 0) printf "%.2f", $3 / (($1 + $2) / 1024) }' || true)
            line+=" | ${bus:-failed} ${cpu:+${cpu}s/GB}"
            if [ -z "$bus" ]; then tail -5 "$out/$i.err" >&2; fi
        fi
    done
    echo "$line"
    if [ -n "${MESHD_AB_KEEP:-}" ]; then mkdir -p "$MESHD_AB_KEEP" && cp -r "$out" "$MESHD_AB_KEEP/"; fi
    rm -rf "$out"
}

for r in $(seq "$rounds"); do
    order=()
    for b in "${!bins[@]}"; do order+=("$b"); done
    for ((b = ${#bins[@]} - 1; b >= 0; b--)); do order+=("$b"); done
    for b in "${order[@]}"; do
        one "${bins[$b]}" "round $r $(printf "\\x$(printf %x $((65 + b)))") $(basename "${bins[$b]}")"
    done
done
