"""A small PyTorch DDP training job over Gloo, launched by meshd (or torchrun).

Every rank trains on its own data; DDP averages gradients, so every rank must end with
bit-identical parameters. Prints one line per rank with a SHA-256 of the parameters.

    meshd run --nnodes 3 --peers ... --nproc-per-node 2 -- python3 examples/ddp_gloo.py --steps 20
"""
import argparse
import ctypes
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    first = None
    for _ in range(args.steps):
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())).hexdigest()
    print(
        f"DDP rank={rank} world={world} first_loss={first:.4f} last_loss={loss.item():.4f} "
        f"params_sha256={digest} secs={time.time() - t0:.1f} "
        f"iface={os.environ.get('GLOO_SOCKET_IFNAME')}",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
