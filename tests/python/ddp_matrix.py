"""DDP's features that change how gradients reach the collective, under `meshd run`
(tests/lab_ddp.rs): gradient bucketing (a small bucket_cap_mb over a model larger than
DDP's 1 MiB first bucket: several buckets), `no_sync` gradient accumulation, parameters
that a step leaves unused (find_unused_parameters=True), and static_graph=True.

--mode hook: DDP over a local process group, gradients averaged by meshd.torch.allreduce_hook
             (works behind the one-port firewall with --collective quic);
--mode gloo: plain DDP over Gloo (behind the firewall: --collective tunnel).

Every rank trains on its own data. Each rank also replays the whole job in-process (every
rank's data is derived from its seed): the reference parameters DDP must reach. Prints one
line per rank and configuration: `DDP-MATRIX cfg=... rank=R world=W buckets=B
params_sha256=... ref_diff=D numpy=...`; every rank must print the same digest, B > 1 and
D tiny.
"""
import argparse
import copy
import ctypes
import datetime
import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

WIDTH = 256
ACCUM = 2  # micro-batches per optimizer step: the first under no_sync


class Net(torch.nn.Module):
    """Six 256x256 layers (1.6 MB of float32) and a head; `spare` is used only when asked."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(6))
        self.spare = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x, use_spare):
        for layer in self.body:
            x = torch.tanh(layer(x))
        if use_spare:
            x = torch.tanh(self.spare(x))
        return self.head(x)


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(100_000 * rank + 10 * step + micro)
    x = torch.randn(8, WIDTH, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True)


def uses_spare(cfg, rank, step):
    # "rank": some ranks use the spare layer in a step and others not (what
    # find_unused_parameters is for); "never": unused everywhere (static graph).
    return cfg["spare"] == "rank" and (rank + step) % 2 == 0


def digest(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())).hexdigest()


def reference(cfg, world, steps):
    """The job replayed in one process: each step's gradient is the mean over ranks of the
    gradients summed over the micro-batches."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        for r in range(world):
            for micro in range(ACCUM):
                x, y = batch(r, step, micro)
                loss = ((model(x, uses_spare(cfg, r, step)) - y) ** 2).mean() / world
                loss.backward()
        opt.step()
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["hook", "gloo"], required=True)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.mode == "hook":
        import meshd
        import meshd.torch as mt

        client = meshd.connect()
        rank, world = client.rank, client.world_size
        mt.init_local_process_group()
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
    numpy = "numpy" in sys.modules or _numpy_importable()
    configs = [
        {"name": "buckets+no_sync+unused", "spare": "rank", "find_unused": True, "static": False},
        {"name": "static_graph", "spare": "never", "find_unused": False, "static": True},
    ]
    for cfg in configs:
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.25, find_unused_parameters=cfg["find_unused"], static_graph=cfg["static"])
        calls = []
        if args.mode == "hook":

            def counting(state, bucket, calls=calls):
                calls.append(bucket.index())
                return mt.allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, counting)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        buckets = set()
        for step in range(args.steps):
            opt.zero_grad()
            for micro in range(ACCUM):
                x, y = batch(rank, step, micro)
                # The loss of one rank's micro-batch, averaged over the job by DDP.
                # torch's static_graph needs its first backward synced (no_sync there fails
                # an internal assert in 1.13 and 2.15 alike): accumulation from step 1 on.
                if micro < ACCUM - 1 and not (cfg["static"] and step == 0):
                    with ddp.no_sync():
                        ((ddp(x, uses_spare(cfg, rank, step)) - y) ** 2).mean().backward()
                else:
                    ((ddp(x, uses_spare(cfg, rank, step)) - y) ** 2).mean().backward()
            opt.step()
            buckets.update(calls)
            calls.clear()
        if args.mode == "gloo":
            # Buckets are rebuilt after the first step unless find_unused_parameters is set.
            data = ddp._get_ddp_logging_data()
            sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
            buckets = set(range(len([s for s in str(sizes).split(",") if s.strip()])))
        ref = reference(cfg, world, args.steps)
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        print(
            f"DDP-MATRIX cfg={cfg['name']} rank={rank} world={world} mode={args.mode} buckets={len(buckets)} "
            f"params_sha256={digest(model)} ref_diff={diff:.3g} numpy={numpy} torch={torch.__version__.split('+')[0]}",
            flush=True,
        )
        del ddp
    if args.mode == "gloo":
        dist.barrier()
        dist.destroy_process_group()
    else:
        client.barrier()


def _numpy_importable():
    try:
        import numpy  # noqa: F401

        return True
    except ImportError:
        return False


if __name__ == "__main__":
    main()
