"""PyTorch integration: a DDP communication hook that averages gradients through meshd.

    import meshd.torch
    model = DistributedDataParallel(model)
    model.register_comm_hook(None, meshd.torch.allreduce_hook)

The hook sends each gradient bucket to the node's meshd (CUDA buckets are staged through a
pinned host buffer, reused from step to step), which averages it across every rank of the
job over meshd's one UDP port.
It works where NCCL's and Gloo's TCP sockets cannot: DDP then only needs a process group
for its own bookkeeping, which can be a local one (``init_local_process_group``).
"""

import torch
import torch.distributed as dist

import meshd

__all__ = ["allreduce_hook", "init_local_process_group"]


def allreduce_hook(state, bucket):
    """DDP comm hook: average ``bucket`` across all ranks with meshd's QUIC ring."""
    client = state if isinstance(state, meshd.Client) else meshd.connect()
    tensor = bucket.buffer()
    client.allreduce(tensor, op="avg")
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def init_local_process_group(backend="gloo"):
    """A one-process group for DDP's bookkeeping when TCP between nodes is blocked.

    Gradient averaging goes through ``allreduce_hook``; initial parameters must be the
    same on every rank (seed, or ``meshd.connect().broadcast(p, root=0)`` for each).
    """
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
