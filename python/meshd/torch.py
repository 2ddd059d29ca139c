"""PyTorch integration: a DDP communication hook that averages gradients through meshd.

    import meshd.torch
    model = DistributedDataParallel(model)
    model.register_comm_hook(None, meshd.torch.allreduce_hook)

The hook sends each gradient bucket to the node's meshd (CUDA buckets are staged through a
pinned host buffer, reused from step to step), which averages it across every rank of the
job over meshd's one UDP port. Gradient bucketing, ``no_sync``, ``static_graph=True`` and
``find_unused_parameters=True`` work as over a process group of every rank: a parameter
that some ranks left unused in a step gets the job-wide average on every rank.
It works where NCCL's and Gloo's TCP sockets cannot: DDP then only needs a process group
for its own bookkeeping, which can be a local one (``init_local_process_group``).
"""

import atexit
import os
import queue
import sys
import threading

import torch
import torch.distributed as dist

import meshd

__all__ = ["allreduce_hook", "init_local_process_group"]

# At exit, how long an allreduce still in flight may take to finish before the hook's
# thread is woken by shutting its connection down, and how long the thread then has to end.
_EXIT_GRACE = 2.0
_EXIT_WAKE = 5.0


class _Worker:
    """One thread that runs this process's hook allreduces in the order DDP submits them
    (every rank submits its buckets in the same order, and meshd pairs the ranks'
    requests in order), so that communication overlaps the rest of the backward pass.

    The thread is a daemon (it waits for work forever), so it is stopped at interpreter
    exit (``_shutdown``, an ``atexit`` handler): a daemon thread that is inside torch's C++
    code with the GIL released when the interpreter finalizes (``Future.set_result`` and
    tensor copies release it) is ended by ``pthread_exit`` on its way back, whose unwinding
    through C++ destructors calls ``std::terminate``: the rank dies by SIGABRT after its
    script returned."""

    def __init__(self):
        self._queue = queue.Queue()
        self._lock = threading.Lock()
        self._client = None  # the client of the allreduce in flight, None between them
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="meshd-ddp-hook", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            client, fn, fut = item
            with self._lock:
                self._client = client
            try:
                value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                with self._lock:
                    self._client = None
                if not self._stopping:
                    # Said here too: DDP reports a failed future only as "Unable to cast ...
                    # to Tensor" (PyTorch 1.13).
                    print(f"meshd DDP hook: allreduce failed: {e}", file=sys.stderr, flush=True)
                fut.set_exception(e)
            else:
                with self._lock:
                    self._client = None
                fut.set_result(value)

    def submit(self, client, fn, devices=None):
        fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        self._queue.put((client, fn, fut))
        return fut

    def stop(self, grace=None, wake=None):
        """Ends the thread: allreduces not started are dropped (nobody is left to wait for
        them), one in flight gets ``grace`` seconds to finish, then its connection is shut
        down so that its wait for meshd's reply ends. Returns whether the thread ended."""
        grace = _EXIT_GRACE if grace is None else grace
        wake = _EXIT_WAKE if wake is None else wake
        self._stopping = True
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._queue.put(None)
        if not self._thread.is_alive():
            return True
        self._thread.join(grace)
        if self._thread.is_alive():
            with self._lock:
                client = self._client
            if client is not None:
                client._interrupt()
            self._thread.join(wake)
        return not self._thread.is_alive()


_worker = None
_worker_lock = threading.Lock()
_atexit_registered = False


def _get_worker():
    global _worker, _atexit_registered
    with _worker_lock:
        if _worker is None:
            _worker = _Worker()
            if not _atexit_registered:
                # Registered after torch and the training script's own imports, so it runs
                # before their handlers (atexit runs the last registered first).
                atexit.register(_shutdown)
                _atexit_registered = True
        return _worker


def _shutdown():
    """Stops the hook's thread while the interpreter can still run it to its end."""
    global _worker
    with _worker_lock:
        w, _worker = _worker, None
    if w is not None and not w.stop():
        print(
            "meshd DDP hook: the allreduce thread did not end at exit "
            f"(waited {_EXIT_GRACE + _EXIT_WAKE:.0f} s)",
            file=sys.stderr,
            flush=True,
        )


def _after_fork_in_child():
    # The hook's thread does not exist in a forked child; a later hook call there (which
    # meshd.connect() refuses anyway) must not queue work for it.
    global _worker, _worker_lock
    _worker = None
    _worker_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def allreduce_hook(state, bucket):
    """DDP comm hook: average ``bucket`` across all ranks with meshd's QUIC ring.

    Returns at once: the allreduce runs on a background thread while backward goes on,
    and DDP waits for every bucket's future before ``backward()`` returns."""
    client = state if isinstance(state, meshd.Client) else meshd.connect()
    tensor = bucket.buffer()
    grads, params = bucket.gradients(), bucket.parameters()

    def run():
        # Slots holding zeros: parameters this rank left unused in this step (DDP with
        # find_unused_parameters or static_graph fills their slots with zeros) or a zero
        # gradient. Over a local process group DDP takes "unused here" for "unused by every
        # rank" and leaves those gradients untouched; other ranks may have used them.
        nonzero = torch.stack([g.ne(0).any() for g in grads]).tolist() if grads else []
        client.allreduce(tensor, op="avg")
        for p, g, local in zip(params, grads, nonzero):
            if not local:  # else DDP copies the average into the gradient itself
                _adopt_average(p, g)
        return tensor

    devices = [tensor.device] if tensor.device.type == "cuda" else None
    return _get_worker().submit(client, run, devices)


def _adopt_average(p, avg):
    """Gives a parameter this rank left unused (or whose gradient here is zero) the job-wide
    average, as DDP over a process group of every rank does: a defined gradient gets it
    copied in (for a used parameter DDP then copies the same values); a missing one gets a
    copy unless the average is zero, i.e. (but for exact zero gradients elsewhere) no rank
    used it, where DDP leaves it None too, so the optimizer skips the parameter."""
    if p.grad is not None:
        if p.grad.data_ptr() != avg.data_ptr():
            p.grad.copy_(avg.view_as(p.grad))
    elif bool(avg.ne(0).any()):
        p.grad = avg.detach().clone().view_as(p)


def init_local_process_group(backend="gloo"):
    """A one-process group for DDP's bookkeeping when TCP between nodes is blocked.

    Gradient averaging goes through ``allreduce_hook``; initial parameters must be the
    same on every rank (seed, or ``meshd.connect().broadcast(p, root=0)`` for each).
    """
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
