"""Checks what tunnel mode carries, with plain PyTorch and plain sockets (no meshd client).

Under `meshd run` with TCP between the nodes blocked: init_process_group("gloo") over
env://, the TCPStore's set/get/wait across nodes, all_gather_object, a TCP connection this
script opens itself to a rank on another node (with a half-close), and a connection to a
port nobody listens on, which must fail fast with ECONNREFUSED. With MESHD_TEST_OUTSIDE_PORT
set (a port on which something outside the job listens on every node, as sshd would), a
connection to it on the next node must be refused too: the tunnel reaches only the job's
own ports. Prints TUNNEL OK per rank.
"""
import datetime
import errno
import hashlib
import os
import socket
import threading
import time

import torch.distributed as dist


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    me = os.environ["MESHD_NODE_ADDR"]
    store = dist.distributed_c10d._get_default_store()

    # The store: every rank sets a key; every rank waits for and reads all of them.
    store.set(f"tunnel/k{rank}", f"v{rank}@{me}")
    store.wait([f"tunnel/k{r}" for r in range(world)], datetime.timedelta(seconds=30))
    values = [store.get(f"tunnel/k{r}").decode() for r in range(world)]
    assert values[rank] == f"v{rank}@{me}", values

    # all_gather_object: every rank's node address.
    addrs = [None] * world
    dist.all_gather_object(addrs, me)
    assert len(set(addrs)) == world // local_world, addrs

    # User code: listen on this node's address, publish the port; the same local rank on
    # the next node connects, sends, half-closes, and reads the answer to its end.
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((me, 0))
    server.listen(4)
    store.set(f"tunnel/listen{rank}", f"{me}:{server.getsockname()[1]}")
    target = (rank + local_world) % world
    host, port = store.get(f"tunnel/listen{target}").decode().rsplit(":", 1)
    assert host != me, (host, me)
    client = socket.create_connection((host, int(port)), timeout=20)
    assert client.getpeername() == (host, int(port)), client.getpeername()
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = os.urandom(3 << 20)
    served = {}

    def serve():
        # The previous node's rank: read to its half-close, answer, close.
        conn, _ = server.accept()
        got = bytearray()
        while True:
            b = conn.recv(1 << 20)
            if not b:
                break
            got += b
        served["bytes"] = len(got)
        conn.sendall(hashlib.sha256(got).hexdigest().encode())
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    client.sendall(payload)
    client.shutdown(socket.SHUT_WR)
    reply = bytearray()
    while True:
        b = client.recv(65536)
        if not b:
            break
        reply += b
    assert reply.decode() == hashlib.sha256(payload).hexdigest(), reply
    client.close()
    t.join()
    assert served["bytes"] == len(payload), served

    # Nobody listens on port 1 of the next node: refused, fast.
    t0 = time.time()
    try:
        socket.create_connection((host, 1), timeout=20)
        raise AssertionError("connected to a port nobody listens on")
    except ConnectionRefusedError as e:
        assert e.errno == errno.ECONNREFUSED, e
    refused_secs = time.time() - t0
    assert refused_secs < 5, refused_secs

    # Something outside the job listens there (an sshd-like service): refused all the same.
    outside = os.environ.get("MESHD_TEST_OUTSIDE_PORT")
    if outside:
        try:
            socket.create_connection((host, int(outside)), timeout=20)
            raise AssertionError("the tunnel reached a port outside the job")
        except ConnectionRefusedError as e:
            assert e.errno == errno.ECONNREFUSED, e

    dist.barrier()
    print(
        f"TUNNEL OK rank={rank} world={world} collective={os.environ.get('MESHD_COLLECTIVE')} "
        f"store_keys={len(values)} nodes={len(set(addrs))} user_bytes={len(payload)} "
        f"refused_secs={refused_secs:.3f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
