"""PyTorch Gloo allreduce timing, launched by `meshd run` (or torchrun), for comparison
with `meshd bench allreduce`. Prints one line per rank:
    GLOO bytes=... time_s=... algbw_gbs=... busbw_gbs=...
"""
import argparse
import datetime
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=64 << 20)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    n = dist.get_world_size()
    for size in [8, args.size]:
        t = torch.ones(max(size // 4, 2), dtype=torch.float32)
        dist.all_reduce(t)
        assert float(t[0]) == n
        iters = args.iters if size > 8 else 50
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        dt = (time.perf_counter() - t0) / iters
        alg = t.numel() * 4 / dt / 1e9
        print(
            f"GLOO bytes={t.numel() * 4} time_s={dt:.6f} algbw_gbs={alg:.4f} busbw_gbs={alg * 2 * (n - 1) / n:.4f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
