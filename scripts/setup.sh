#!/usr/bin/env bash
# What the test suites need on a fresh Debian machine, installed when missing. The ONE
# place for it: scripts/test.sh (README's test command) and .ci/run both call it, so the
# two cannot drift.
#   iproute2 (ip), nftables (nft): the network lab's namespaces and firewalls
#   iperf3: the fairness check of the benchmarks
#   python3-torch, python3-numpy: the real PyTorch (CPU, Gloo) and the Python client's tests
#   python3-venv: scripts/wheel-check.sh installs the wheel into a fresh venv
#   dnsmasq-base (dnsmasq): a real DNS server in the lab (tests/lab_dns.rs: dns: peers)
# Needs root to install (the lab suites need root anyway); as another user it says what
# is missing and goes on.
set -euo pipefail

need=()
command -v ip >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
command -v iperf3 >/dev/null || need+=(iperf3)
/usr/bin/python3 -c 'import torch' 2>/dev/null || need+=(python3-torch)
/usr/bin/python3 -c 'import numpy' 2>/dev/null || need+=(python3-numpy)
/usr/bin/python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || need+=(dnsmasq-base)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "setup: missing ${need[*]}; install them as root (apt-get install ${need[*]}) or the lab suites fail" >&2
  exit 0
fi
echo "== apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
