"""Gloo's rendezvous and collectives through a store something else serves.

    python tcpstore_gloo.py store RANK HOST PORT   init_process_group(store=TCPStore(is_master=False))
                                                   under a torchft-like PrefixStore
    python tcpstore_gloo.py env RANK               init_method="env://" with MASTER_ADDR/PORT and
                                                   TORCHELASTIC_USE_AGENT_STORE=True (torchrun's agent store)
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

WORLD = 2


def main():
    mode, rank = sys.argv[1], int(sys.argv[2])
    timeout = datetime.timedelta(seconds=60)
    if mode == "store":
        host, port = sys.argv[3], int(sys.argv[4])
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        base = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
        store = dist.PrefixStore(f"{host}:{port}/torchft/0/0", base)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    else:
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(WORLD)
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    t = torch.tensor([float(rank + 1)] * 4)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4, t
    dist.barrier()
    g = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_gather(g, torch.tensor([float(rank)]))
    assert [x.item() for x in g] == [0.0, 1.0], g
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank} {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
