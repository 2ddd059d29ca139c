#!/usr/bin/env bash
# The prepared GPU check (one run on a machine with NVIDIA GPUs, PyTorch, CUDA and NCCL;
# no network needed). Prints what ran; results go to ${OUT:-/tmp/meshd-gpu}/gpu-check.log.
#  1. CUDA driver and NCCL as meshd sees them (meshd doctor --nnodes 1);
#  2. meshd run --nproc-per-node auto of a real torch+NCCL allreduce (one process per GPU);
#  3. examples/nccl_comm.rs: an NCCL communicator formed from MESHD_NCCL_UNIQUE_ID through cudarc;
#  4. the QUIC collective with CUDA tensors (the DDP hook's path): staged through pinned memory.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/meshd-gpu}"
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
nvidia-smi -L || true
# NCCL for meshd: the active Python environment's nvidia/nccl/lib is searched; else set MESHD_NCCL_LIB.
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
cargo build --release --bin meshd 2>&1 | tail -1
cargo build --release -p meshd-nccl --example nccl_comm 2>&1 | tail -1
M=target/release/meshd
echo "== 1. doctor"
timeout 120 $M doctor --nnodes 1 --port 29451; echo "rc=$?"
echo "== 2. torch + NCCL allreduce, one process per GPU"
timeout 300 $M run --nnodes 1 --port 29452 --nproc-per-node auto -- python3 examples/torch_nccl_allreduce.py; echo "rc=$?"
echo "== 3. cudarc communicator from MESHD_NCCL_UNIQUE_ID"
timeout 300 $M run --nnodes 1 --port 29453 --nproc-per-node auto -- target/release/examples/nccl_comm; echo "rc=$?"
echo "== 4. QUIC collective with CUDA tensors, 2 ranks"
timeout 300 $M run --nnodes 1 --port 29454 --nproc-per-node 2 --collective quic -- python3 examples/cuda_staging_check.py; echo "rc=$?"
