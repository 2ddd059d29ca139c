"""One rank of the torchrun-environment diff (tests/lab_torchrun.rs), the same script under
torch's torchrun and under `meshd run`: joins the job's Gloo group from the environment
(env://, as every torchrun script does), checks an allreduce across all ranks, and prints
its whole environment as one JSON line (`ENVRANK {...}`), beside what it checked.
"""
import datetime
import json
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, (t.item(), world)
dist.barrier()
print("ENVRANK " + json.dumps({"rank": rank, "world": world, "env": dict(os.environ)}), flush=True)
dist.destroy_process_group()
