"""A PyTorch training loop whose gradients are averaged by meshd's QUIC ring.

Works where NCCL and Gloo cannot (only meshd's UDP port open between nodes). With
`--ddp`, uses DistributedDataParallel with meshd.torch.allreduce_hook over a local
process group; otherwise averages a flattened gradient by hand. Prints one line per rank
with a SHA-256 of the final parameters: every rank must print the same. Ends with a
barrier, unless `--no-barrier`: then each rank exits as soon as its last step is done, as
README's DDP snippet does.
"""
import argparse
import ctypes
import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch  # noqa: E402

import meshd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--no-barrier", action="store_true", help="exit without a final barrier")
    args = ap.parse_args()
    torch.set_num_threads(1)
    c = meshd.connect()
    rank, world = c.rank, c.world_size
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    # Start from rank 0's weights, whatever each rank's seed gave.
    for p in model.parameters():
        c.broadcast(p.data, root=0)
    net = model
    if args.ddp:
        import meshd.torch as mt
        from torch.nn.parallel import DistributedDataParallel as DDP

        mt.init_local_process_group()
        net = DDP(model)
        net.register_comm_hook(None, mt.allreduce_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    first = None
    for _ in range(args.steps):
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not args.ddp:
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.flatten() for g in grads])
            c.allreduce(flat, op="avg")
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
        opt.step()
        first = first if first is not None else loss.item()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())).hexdigest()
    print(
        f"QUIC-TRAIN rank={rank} world={world} ddp={args.ddp} first_loss={first:.4f} "
        f"last_loss={loss.item():.4f} params_sha256={digest} collective={os.environ.get('MESHD_COLLECTIVE')}",
        flush=True,
    )
    if not args.no_barrier:
        c.barrier()


if __name__ == "__main__":
    main()
