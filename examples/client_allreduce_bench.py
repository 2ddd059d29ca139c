"""Allreduce timing through meshd's Python client (the path ranks use when NCCL cannot),
launched by `meshd run`. Prints one line per rank:
    CLIENT bytes=... time_s=... algbw_gbs=... in_place=True|False ranks=...
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import numpy as np  # noqa: E402

import meshd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=64 << 20)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    c = meshd.connect()
    a = np.full(args.size // 4, 1.0, dtype=np.float32)
    c.allreduce(a)
    assert a[0] == c.world_size and a[-1] == c.world_size, (a[0], a[-1])
    c.barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        c.allreduce(a)
    dt = (time.perf_counter() - t0) / args.iters
    print(
        f"CLIENT bytes={args.size} time_s={dt:.6f} algbw_gbs={args.size / dt / 1e9:.4f} "
        f"in_place={c.in_place} ranks={c.world_size}",
        flush=True,
    )


if __name__ == "__main__":
    main()
