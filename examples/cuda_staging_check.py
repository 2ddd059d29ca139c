"""Checks the QUIC collective path with CUDA tensors (the DDP hook's path on GPUs).

    meshd run --nnodes 1 --nproc-per-node 2 --collective quic -- python3 examples/cuda_staging_check.py

Each rank allreduces CUDA tensors through meshd (staged through a pinned host buffer that
is reused), checks the results, and prints the time per 64 MiB allreduce with the buffer
reused against a fresh pageable copy per call. Prints `CUDA STAGING OK` on success.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import meshd  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("no CUDA device")
local = int(os.environ.get("LOCAL_RANK", "0"))
dev = torch.device("cuda", local % torch.cuda.device_count())
c = meshd.connect()
rank, world = c.rank, c.world_size

# Correctness: float32 sum (non-contiguous view), bfloat16 max, float16 avg.
a = torch.arange(3000, dtype=torch.float32, device=dev).reshape(30, 100).t()
c.allreduce(a, op="sum")
assert torch.equal(a, torch.arange(3000, dtype=torch.float32, device=dev).reshape(30, 100).t() * world), a
b = torch.full((1001,), float(rank), dtype=torch.bfloat16, device=dev)
c.allreduce(b, op="max")
assert (b == float(world - 1)).all(), b[:3]
h = torch.full((77,), float(rank), dtype=torch.float16, device=dev)
c.allreduce(h, op="avg")
assert torch.allclose(h.float(), torch.full((77,), (world - 1) / 2, device=dev)), h[:3]
pinned = meshd._staging(a).is_pinned()

# Time: 64 MiB float32, staging buffer reused (the client) against a fresh pageable copy.
x = torch.ones(16 << 20, dtype=torch.float32, device=dev)


def fresh(t):
    host = t.detach().to("cpu", copy=True)
    c.allreduce(host, op="avg")
    t.copy_(host)


for name, fn in (("reused pinned" if pinned else "reused", lambda t: c.allreduce(t, op="avg")), ("fresh pageable", fresh)):
    fn(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    print(f"rank {rank}: 64 MiB allreduce, {name} staging: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms", flush=True)
assert (x == 1).all()
print(f"CUDA STAGING OK rank={rank} world={world} pinned={pinned}", flush=True)
