"""meshd.torch.allreduce_hook without a meshd: clients that stand in for it.

The hook returns before the allreduce is done (it runs on a background thread, in the
order DDP submits the buckets); DDP waits for it before backward() returns; a failed
allreduce fails backward() and is said on stderr. Prints `HOOK OK` when all hold.
"""
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import meshd  # noqa: E402
import meshd.torch as mt  # noqa: E402

mt.init_local_process_group()


class Doubling(meshd.Client):
    """Doubles each bucket after a delay, on whatever thread calls it."""

    def __init__(self):
        self.gate = threading.Event()
        self.threads = set()
        self.sizes = []

    def allreduce(self, buf, op="sum", dtype=None):
        assert op == "avg", op
        self.gate.wait(10)  # released by the test once the hook has returned
        self.threads.add(threading.current_thread().name)
        self.sizes.append(buf.numel())
        buf.mul_(2)
        return buf


class Failing(meshd.Client):
    def __init__(self):
        pass

    def allreduce(self, buf, op="sum", dtype=None):
        raise meshd.MeshdError("meshd stopped answering (test)")


# Several buckets: small bucket cap over three layers.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
ref = [p.detach().clone() for p in model.parameters()]
net = DDP(model, bucket_cap_mb=0.25)
client = Doubling()
net.register_comm_hook(client, mt.allreduce_hook)
x = torch.randn(8, 512)
# The hook returns with the allreduce still pending: release it only from another thread.
threading.Timer(0.3, client.gate.set).start()
net(x).sum().backward()
# DDP rebuilds its buckets after the first backward pass: the second one has several.
net.zero_grad()
client.sizes.clear()
net(x).sum().backward()
assert client.threads == {"meshd-ddp-hook"}, client.threads
assert len(client.sizes) >= 2, client.sizes
# Reference gradients without DDP, doubled.
plain = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
for p, r in zip(plain.parameters(), ref):
    p.data.copy_(r)
plain(x).sum().backward()
for p, q in zip(model.parameters(), plain.parameters()):
    assert torch.allclose(p.grad, 2 * q.grad), (p.grad.flatten()[:3], q.grad.flatten()[:3])

net2 = DDP(torch.nn.Linear(4, 2))
net2.register_comm_hook(Failing(), mt.allreduce_hook)
try:
    net2(torch.randn(3, 4)).sum().backward()
    raise SystemExit("a failed allreduce must fail backward()")
except RuntimeError as e:
    assert "meshd stopped answering (test)" in str(e), e
print(f"HOOK OK buckets={len(client.sizes)}", flush=True)
