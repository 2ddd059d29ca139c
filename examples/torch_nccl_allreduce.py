"""A real torch + NCCL allreduce under `meshd run` (GPU machines): every rank joins the
NCCL process group through MASTER_ADDR/MASTER_PORT (and NCCL_SOCKET_IFNAME) set by meshd,
all-reduces a CUDA tensor, checks the sum and prints one line.

    meshd run --nnodes 1 --nproc-per-node auto -- python3 examples/torch_nccl_allreduce.py
"""
import datetime
import os

import torch
import torch.distributed as dist


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    want = world * (world + 1) / 2
    ok = bool((t == want).all().item())
    print(
        f"TORCH-NCCL rank={rank} world={world} ok={ok} sum={t[0].item()} "
        f"nccl={torch.cuda.nccl.version()} id_set={'MESHD_NCCL_UNIQUE_ID' in os.environ} "
        f"iface={os.environ.get('NCCL_SOCKET_IFNAME')}",
        flush=True,
    )
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
