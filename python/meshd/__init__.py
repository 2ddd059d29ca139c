"""meshd's Python client: collectives that need only meshd's one UDP port.

Inside a job started by ``meshd run``, every rank reaches its node's meshd through the
Unix socket in ``MESHD_SOCKET``; meshd reduces the node's ranks locally and runs a ring
allreduce over QUIC between the nodes. Standard library only; numpy arrays and CPU torch
tensors are used in place when those packages are present (tensors without numpy too).

    import meshd
    c = meshd.connect()                 # reads MESHD_SOCKET, RANK, WORLD_SIZE
    c.allreduce(buf, op="sum")          # in place, across all ranks of the job
    c.broadcast(buf, root=0)
    c.barrier()
    c.store_set("key", b"value"); c.store_get("key", timeout=30.0)

No call waits on meshd forever: a reply (or room to send a request) that does not come
within ``timeout`` seconds of silence on the socket raises MeshdError, and the connection
is closed. The default, 1800 s, is generous (other ranks may be that far behind at a
collective); ``MESHD_TIMEOUT`` sets it in seconds, ``0`` waits forever.
"""

import ctypes
import json
import os
import socket
import struct
import time
import weakref

__all__ = ["connect", "Client", "MeshdError"]

_MAX_HEADER = 64 << 10
# Payloads up to this size go in the same send as their header.
_SMALL = 64 << 10

# Buffer-protocol format characters -> meshd dtype names.
_FORMATS = {"f": "float32", "d": "float64", "e": "float16", "i": "int32", "q": "int64"}
_NUMPY = {"float32": "float32", "float64": "float64", "float16": "float16", "int32": "int32", "int64": "int64"}
_TORCH = {
    "torch.float32": "float32",
    "torch.float64": "float64",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.int32": "int32",
    "torch.int64": "int64",
}
_OPS = ("sum", "avg", "min", "max")

# Seconds a call may wait on a silent meshd socket (MESHD_TIMEOUT; 0 = forever).
DEFAULT_TIMEOUT = 1800.0
# A store_get waits for its own timeout plus this long for meshd's answer.
_STORE_MARGIN = 30.0
# After a call timed out: how long to wait for meshd to confirm it abandoned the request
# (it closes the connection once nothing more will be written into our buffers).
_GIVE_UP_WAIT = 5.0


def _timeout_from_env():
    """MESHD_TIMEOUT in seconds: None (wait forever) for 0, the default when unset."""
    raw = os.environ.get("MESHD_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        t = float(raw)
    except ValueError:
        raise MeshdError(f"MESHD_TIMEOUT={raw!r} is not a number of seconds (0 waits forever)") from None
    if t != t or t < 0:
        raise MeshdError(f"MESHD_TIMEOUT={raw!r} must be 0 (forever) or more seconds")
    return None if t == 0 else t


class MeshdError(RuntimeError):
    """A request meshd refused or could not complete, or meshd did not answer; the message
    says why."""


def _as_bytes_view(buf, dtype=None):
    """Returns (writable byte memoryview, dtype name, finisher) for a supported buffer."""
    mod = type(buf).__module__
    if mod.startswith("torch"):
        import torch

        name = _TORCH.get(str(buf.dtype))
        if name is None:
            raise TypeError(f"unsupported torch dtype {buf.dtype}; use one of {sorted(_TORCH)}")
        if buf.device.type != "cpu":
            # CUDA tensors are staged through host memory: a pinned buffer kept for the
            # next call of the same size (DDP's buckets repeat every step).
            host = _staging(buf)
            host.copy_(buf.detach().reshape(-1))
            view, _, fin = _as_bytes_view(host)

            def finish():
                fin()
                buf.copy_(host.view(buf.shape))

            return view, name, finish
        if buf.layout != torch.strided:
            raise TypeError(f"unsupported tensor layout {buf.layout}; pass a dense (strided) tensor")
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous (call .contiguous() and copy back)")
        return _tensor_bytes(buf), name, lambda: None
    if mod.startswith("numpy"):
        name = _NUMPY.get(str(buf.dtype))
        if name is None:
            raise TypeError(f"unsupported numpy dtype {buf.dtype}; use one of {sorted(_NUMPY)}")
        if not buf.flags["C_CONTIGUOUS"] or not buf.flags["WRITEABLE"]:
            raise ValueError("array must be C-contiguous and writeable")
        return memoryview(buf).cast("B"), name, lambda: None
    view = memoryview(buf)
    if view.readonly:
        raise ValueError("buffer is read-only; pass a bytearray, array, numpy array or tensor")
    if not view.c_contiguous:
        raise ValueError("buffer must be contiguous")
    fmt = view.format.lstrip("@=<")
    if dtype is None:
        if fmt in ("l",) and view.itemsize == 8:
            dtype = "int64"
        elif fmt in ("l",) and view.itemsize == 4:
            dtype = "int32"
        else:
            dtype = _FORMATS.get(fmt)
    if dtype is None:
        dtype = "float32"  # raw bytes (bytearray): float32 unless told otherwise
    return view.cast("B"), dtype, lambda: None


def _tensor_bytes(t):
    """A writable byte memoryview over a contiguous CPU tensor's own memory, without numpy
    (torch 2.x no longer needs it, and ``Tensor.numpy()`` raises "Numpy is not available"
    without it): ctypes over ``data_ptr()``, which accounts for the storage offset. The view
    keeps the tensor alive; it is used while the caller's call holds ``t`` anyway."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    raw = (ctypes.c_char * n).from_address(t.data_ptr())
    raw._meshd_tensor = t  # the tensor outlives any view of its memory
    return memoryview(raw).cast("B")


# Host buffers that device tensors are staged through, by (dtype, element count); at most
# _STAGING_LIMIT bytes are kept. A Client is used from one thread at a time, so one buffer
# per size is enough.
_STAGING = {}
_STAGING_LIMIT = 1 << 30


def _staging(buf):
    """A contiguous 1-D host tensor for ``buf``'s elements: pinned (page-locked) when the
    CUDA runtime can pin it, which makes the copies to and from the GPU about twice as fast
    as pageable memory, and reused from call to call, which saves allocating and faulting
    in a fresh buffer for every gradient bucket."""
    import torch

    key = (buf.dtype, buf.numel())
    host = _STAGING.get(key)
    if host is None:
        size = buf.numel() * buf.element_size()
        if sum(t.numel() * t.element_size() for t in _STAGING.values()) + size > _STAGING_LIMIT:
            _STAGING.clear()
        try:
            host = torch.empty(buf.numel(), dtype=buf.dtype, pin_memory=True)
        except RuntimeError:  # no CUDA runtime to pin with: pageable memory
            host = torch.empty(buf.numel(), dtype=buf.dtype)
        if size <= _STAGING_LIMIT:
            _STAGING[key] = host
    return host


def _address(view):
    """Address of a writable, contiguous byte memoryview's first byte."""
    return ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view))


# Clients of this process. A forked child gets copies of their sockets: it closes its
# copies (the parent's connections stay open) and refuses to use them, since a reply
# from meshd would go to whichever process read first and both would send on one stream.
_CLIENTS = weakref.WeakSet()


def _after_fork_in_child():
    for c in list(_CLIENTS):
        c._forked = True
        try:
            c._sock.close()
        except Exception:  # noqa: BLE001 - best effort in the child
            pass
    _CLIENTS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """A connection from one rank to its node's meshd.

    ``timeout``: seconds a call may wait on a silent socket before it raises MeshdError
    (None waits forever); default ``MESHD_TIMEOUT``, else 1800."""

    _forked = False
    _pid = None
    _broken = None

    def __init__(self, path=None, rank=None, world_size=None, timeout=None):
        self.path = path or os.environ.get("MESHD_SOCKET")
        if not self.path:
            raise MeshdError(
                "MESHD_SOCKET is not set: start this program with `meshd run` "
                "(or pass the socket path)"
            )
        self.rank = int(rank if rank is not None else os.environ.get("RANK", "0"))
        self.world_size = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1"))
        self._pid = os.getpid()
        self.timeout = _timeout_from_env() if timeout is None else (float(timeout) or None)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(self.timeout)
        _CLIENTS.add(self)
        # Replies are read through this buffer: the length, the header and a small body
        # usually arrive in one recv.
        self._rbuf = bytearray(_MAX_HEADER + 4)
        self._rview = memoryview(self._rbuf)
        self._rlen = 0
        try:
            self._sock.connect(self.path)
        except OSError as e:
            self._sock.close()
            raise MeshdError(f"cannot reach meshd at {self.path}: {e}") from e
        hello = {"op": "hello", "rank": self.rank}
        # In place: meshd reads our buffers and writes results straight into them
        # (process_vm_readv/writev), one copy each way instead of the socket's payloads.
        # The probe proves it can; MESHD_IN_PLACE=0 turns it off.
        probe = bytearray(os.urandom(16))
        if os.environ.get("MESHD_IN_PLACE", "1") != "0":
            hello.update(probe_addr=_address(memoryview(probe)), probe=probe.hex())
        head, _ = self._call(hello)
        self.in_place = bool(head.get("in_place", False))
        self.world_size = int(head.get("world", self.world_size))
        self.local_world_size = int(head.get("local_world", 1))

    # -- framing ------------------------------------------------------------------
    def _send(self, head, payload=b""):
        head = dict(head)
        head["nbytes"] = len(payload)
        h = json.dumps(head).encode()
        if len(payload) <= _SMALL:
            self._sock.sendall(struct.pack(">I", len(h)) + h + payload)
        else:
            self._sock.sendall(struct.pack(">I", len(h)) + h)
            self._sock.sendall(payload)

    def _recv_exact(self, view):
        got = 0
        n = len(view)
        while got < n:
            k = self._sock.recv_into(view[got:], n - got)
            if k == 0:
                raise MeshdError("meshd closed the connection (job stopping?)")
            got += k

    def _fill(self, need):
        """Reads until the receive buffer holds at least ``need`` bytes."""
        while self._rlen < need:
            k = self._sock.recv_into(self._rview[self._rlen :])
            if k == 0:
                raise MeshdError("meshd closed the connection (job stopping?)")
            self._rlen += k

    def _consume(self, n):
        """Drops the first ``n`` buffered bytes."""
        rest = self._rlen - n
        if rest:
            self._rbuf[:rest] = self._rbuf[n : self._rlen]
        self._rlen = rest

    def _recv(self, into=None):
        self._fill(4)
        (hl,) = struct.unpack_from(">I", self._rbuf, 0)
        if hl > _MAX_HEADER:
            raise MeshdError(f"reply header of {hl} bytes is too large")
        self._fill(4 + hl)
        head = json.loads(self._rbuf[4 : 4 + hl])
        self._consume(4 + hl)
        n = int(head.get("nbytes", 0))
        direct = into is not None and n == len(into)
        body = into if direct else memoryview(bytearray(n))
        took = min(self._rlen, n)
        if took:
            body[:took] = self._rview[:took]
            self._consume(took)
        if n > took:
            self._recv_exact(body[took:])
        return head, (None if direct else bytes(body))

    def _call(self, head, payload=b"", into=None, wait=None):
        """One request and its reply; ``wait`` (seconds) replaces the client's timeout for
        this call when longer (a store_get's own wait)."""
        if self._forked:
            raise MeshdError(_forked_message(self._pid))
        if self._broken:
            raise MeshdError(self._broken)
        limit = self.timeout
        if limit is not None and wait is not None and wait > limit:
            self._sock.settimeout(wait)
            limit = wait
        try:
            self._send(head, payload)
            reply, body = self._recv(into)
        except socket.timeout:
            # A reply may still come: the stream is out of step, so no later call may use it.
            self._broken = (
                f"meshd at {self.path} did not answer {head.get('op')!r} for {limit:g} s "
                "(its node's collective or a peer may be stuck; MESHD_TIMEOUT or Client(timeout=) "
                "sets this limit); the connection is closed"
            )
            self._give_up()
            raise MeshdError(self._broken) from None
        except MeshdError as e:
            self._broken = str(e)
            self._sock.close()
            raise
        except OSError as e:
            self._broken = f"lost meshd at {self.path} during {head.get('op')!r}: {e}"
            self._sock.close()
            raise MeshdError(self._broken) from e
        finally:
            if limit != self.timeout and not self._broken:
                self._sock.settimeout(self.timeout)
        if not reply.get("ok"):
            raise MeshdError(reply.get("error", "meshd refused the request"))
        return reply, body

    def _give_up(self):
        """Abandons the call in flight: half-closes, then waits (at most ``_GIVE_UP_WAIT``
        seconds) until meshd closes its end. meshd closes only once it marked the request
        abandoned, with no write into this process's buffers in progress or to come, so the
        caller may reuse its buffer when this returns (``except MeshdError:`` saving a
        checkpoint from it)."""
        deadline = time.monotonic() + _GIVE_UP_WAIT
        try:
            self._sock.shutdown(socket.SHUT_WR)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._sock.settimeout(left)
                if not self._sock.recv(65536):
                    break
        except OSError:
            pass
        self._sock.close()

    def _collective(self, head, view):
        if self.in_place and len(view):
            head.update(addr=_address(view), len=len(view))
            self._call(head)
        else:
            self._call(head, view, into=view)

    # -- collectives --------------------------------------------------------------
    def allreduce(self, buf, op="sum", dtype=None):
        """Reduces ``buf`` in place across every rank of the job (sum, avg, min, max)."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS}, not {op!r}")
        view, name, finish = _as_bytes_view(buf, dtype)
        self._collective({"op": "allreduce", "dtype": name, "reduce": op}, view)
        finish()
        return buf

    def broadcast(self, buf, root=0):
        """Copies ``buf`` of rank ``root`` into ``buf`` of every rank, in place."""
        view, _, finish = _as_bytes_view(buf, "int64")
        self._collective({"op": "broadcast", "root": int(root)}, view)
        finish()
        return buf

    def barrier(self):
        """Returns once every rank of the job called barrier()."""
        self._call({"op": "barrier"})

    # -- store ---------------------------------------------------------------------
    def store_set(self, key, value):
        """Sets ``key`` to ``value`` (bytes or str) for every rank of the job.

        Returns once every other node of the job holds the value (or a newer one of the same
        key: of concurrent sets, the same one wins on every node). Raises ``MeshdError``
        naming the node when one does not acknowledge within 10 s, and naming the limit when
        the store is full (65,536 keys or 64 MiB per node; keys 1-1024 bytes, values at
        most 1 MiB)."""
        if isinstance(value, str):
            value = value.encode()
        self._call({"op": "store_set", "key": str(key)}, bytes(value))

    def store_get(self, key, timeout=30.0):
        """Waits up to ``timeout`` seconds for ``key`` and returns its value (bytes)."""
        t = float(timeout)
        _, body = self._call({"op": "store_get", "key": str(key), "timeout": t}, wait=t + _STORE_MARGIN)
        return body

    def close(self):
        self._sock.close()

    def _interrupt(self):
        """Ends a wait for meshd's reply on another thread (the connection is unusable
        after this): used at exit by meshd.torch's hook thread."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError):
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _forked_message(pid):
    return (
        f"this meshd connection was made by process {pid}, and process {os.getpid()} is a "
        "fork of it: a forked child (a DataLoader worker, multiprocessing with fork) must not "
        "use its parent's connection, nor connect as the same rank; run collectives in the "
        "rank's own process"
    )


_default = None


def connect(path=None):
    """Connects this rank to its node's meshd (once; later calls return the same client).

    In a process forked from one that connected, raises MeshdError: the child is not a
    rank of its own, and must not use the parent's connection."""
    global _default
    if _default is not None and _default._forked:
        raise MeshdError(_forked_message(_default._pid))
    if path is not None:
        return Client(path)
    if _default is None:
        _default = Client()
    return _default
