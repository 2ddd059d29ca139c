"""Many allreduces through meshd's Python client, launched by `meshd run`: meshd's memory
(VmRSS of the parent meshd) after each mark. Prints one line per rank:
    SOAK ops=N size=BYTES seconds=S rss_mib=ops:MiB,ops:MiB,...
The result of the last allreduce is checked, so a wrong sum fails the run.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import numpy as np  # noqa: E402

import meshd  # noqa: E402


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=16 << 20)
    ap.add_argument("--ops", type=int, default=1000)
    args = ap.parse_args()
    marks = sorted({m for m in (20, 100, 300, 1000, 3000, 10000, 30000, args.ops) if m <= args.ops})
    meshd_pid = os.getppid()  # `meshd run` starts the ranks itself
    c = meshd.connect()
    a = np.empty(args.size // 4, dtype=np.float32)
    seen = []
    t0 = time.perf_counter()
    for i in range(1, args.ops + 1):
        a[:] = 1.0
        c.allreduce(a)
        if len(seen) < len(marks) and i == marks[len(seen)]:
            seen.append(f"{i}:{rss_mib(meshd_pid)}")
    assert a[0] == c.world_size and a[-1] == c.world_size, (a[0], a[-1])
    print(
        f"SOAK ops={args.ops} size={args.size} seconds={time.perf_counter() - t0:.1f} "
        f"rss_mib={','.join(seen)}",
        flush=True,
    )


if __name__ == "__main__":
    main()
