"""A torchft DDP training loop on CPU (Gloo), unmodified torchft usage: the replica group's
world comes from torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, whose
TCPStore must already run, as torchrun's agent store does), REPLICA_GROUP_ID and
TORCHFT_LIGHTHOUSE. Prints one JSON line per step (committed or not) and a final line with
a digest of the weights, so that tests can check survivors' progress and agreement.

FT_STEPS: steps to train (default 60); FT_STEP_SLEEP: each step's compute time in seconds,
between the quorum and the allreduce (default 0.05);
FT_TIMEOUT: the process group's and manager's timeout in seconds (default 10);
`FT_LOG/stop_at`, when a test writes a step number there: every group stops at that step
(a test ends the job once it has seen what it waits for);
FT_FAIL_AT: rank 1 exits 3 when it reaches this step, once per log directory (a rank
failure, for tests of restarts);
FT_LOG: a directory where each process also appends its lines to
`g{REPLICA_GROUP_ID}.r{RANK}.p{pid}.jsonl` (read by tests while the job runs). A healing
group gets the live weights from a peer over the process group (torchft's PGTransport, as
its train_ddp.py example), not from a checkpoint file.

FT_TRANSPORT=http: torchft's default checkpoint transport (HTTPTransport: the healing group
fetches from `http://{socket.gethostname()}:port/checkpoint/`) instead of PGTransport.

FT_DDP=wrapper trains through torchft's DistributedDataParallel; the default averages the
gradients with torchft's Manager.allreduce itself (what that wrapper's comm hook calls).
The reason: in torchft 0.2.0 an allreduce that fails inside `wait()` (a peer lost in the
middle of it) leaves the wrapper's future unset, and its hook's `assert fut._fut`
(ddp.py) raises out of `backward()`, killing the survivor's rank under any launcher; with
Manager.allreduce the error is reported and the step is not committed, as torchft means.
"""

import hashlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn, optim
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

STEPS = int(os.environ.get("FT_STEPS", "60"))
SLEEP = float(os.environ.get("FT_STEP_SLEEP", "0.05"))
GROUP = int(os.environ.get("REPLICA_GROUP_ID", "0"))
RANK = int(os.environ["RANK"])
TIMEOUT = timedelta(seconds=float(os.environ.get("FT_TIMEOUT", "10")))
FAIL_AT = int(os.environ.get("FT_FAIL_AT", "-1"))


LOG = None
if os.environ.get("FT_LOG"):
    LOG = open(os.path.join(os.environ["FT_LOG"], f"g{GROUP}.r{RANK}.p{os.getpid()}.jsonl"), "a")


def say(**kv):
    kv.update(group=GROUP, rank=RANK, t=time.time(), pid=os.getpid())
    line = json.dumps(kv)
    print(line, flush=True)
    if LOG:
        LOG.write(line + "\n")
        LOG.flush()


torch.manual_seed(0)
net = nn.Linear(16, 4)
opt_inner = optim.SGD(net.parameters(), lr=0.05)


def load_state_dict(sd):
    net.load_state_dict(sd["model"])
    opt_inner.load_state_dict(sd["optim"])


def state_dict():
    return {"model": net.state_dict(), "optim": opt_inner.state_dict()}


pg = ProcessGroupGloo(timeout=TIMEOUT)
HTTP = os.environ.get("FT_TRANSPORT") == "http"
manager = Manager(
    pg=pg,
    checkpoint_transport=None if HTTP else PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu")),
    min_replica_size=1,
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    replica_id=f"group{GROUP}",
    timeout=TIMEOUT,
)
WRAPPER = os.environ.get("FT_DDP") == "wrapper"
model = DistributedDataParallel(manager, net) if WRAPPER else net
opt = Optimizer(manager, opt_inner)
say(started=True)
gen = torch.Generator().manual_seed(1000 * GROUP + RANK)
def last_step():
    """FT_STEPS, or the step a test asked to stop at (FT_LOG/stop_at)."""
    if LOG:
        try:
            with open(os.path.join(os.environ["FT_LOG"], "stop_at")) as f:
                return min(STEPS, int(f.read().strip()))
        except (OSError, ValueError):
            pass
    return STEPS


while manager.current_step() < last_step():
    before = manager.current_step()
    x = torch.randn(32, 16, generator=gen)
    y = torch.randn(32, 4, generator=gen)
    opt.zero_grad()  # torchft starts the step's quorum here
    time.sleep(SLEEP)  # the step's compute: the quorum is formed, the allreduce comes next
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    if not WRAPPER:
        for w in [manager.allreduce(p.grad) for p in net.parameters()]:
            w.wait()
    opt.step()
    after = manager.current_step()
    say(step=after, committed=after > before, participants=manager.num_participants(), quorum=manager._quorum_id)
    if RANK == 1 and after == FAIL_AT and LOG:
        marker = os.path.join(os.environ["FT_LOG"], f"failed.g{GROUP}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            say(failing=True, step=after)
            os._exit(3)

digest = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in net.parameters())).hexdigest()
say(final=True, step=manager.current_step(), digest=digest)
manager.shutdown(wait=False)
sys.exit(0)
