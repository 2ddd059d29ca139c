"""What a rank sees when the node at the other end of its tunnelled connections dies
mid-transfer (tests/lab_tunnel.rs). Two nodes, one rank each, plain sockets: each rank
listens on its node's address, connects to the other node's rank (through meshd's tunnel),
reads what that rank streams on the connection it opened and streams on the one it
accepted. Once both directions carried some MiB it creates READY_PREFIX<node address>;
the test then kills the other node. Prints how each socket ended:
    RESET client=<errno N|eof> server=<errno N|eof>
"""
import os
import signal
import socket
import sys
import threading
import time

PORT = 29611
CHUNK = b"\x5a" * (256 << 10)


def main():
    # Outlive the SIGTERM of the job's teardown (SIGKILL follows after --grace) long
    # enough to see how the sockets end.
    signal.signal(signal.SIGTERM, lambda *_: None)
    ready = sys.argv[1] + os.environ["MESHD_NODE_ADDR"]
    me = os.environ["MESHD_NODE_ADDR"]
    (peer,) = [p for p in os.environ["MESHD_TUNNEL_PEERS"].split(",") if p]
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((me, PORT))
    srv.listen(1)
    deadline = time.time() + 60
    while True:
        try:
            client = socket.create_connection((peer, PORT), timeout=10)
            break
        except ConnectionRefusedError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    client.settimeout(None)
    server, _ = srv.accept()
    moved = {"client": 0, "server": 0}
    ended = {}

    def mark():
        if min(moved.values()) > (8 << 20) and not os.path.exists(ready):
            open(ready, "w").close()

    def read_client():
        try:
            while True:
                b = client.recv(1 << 20)
                if not b:
                    ended["client"] = "eof"
                    return
                moved["client"] += len(b)
                mark()
        except OSError as e:
            ended["client"] = f"errno {e.errno}"

    def write_server():
        try:
            while True:
                server.sendall(CHUNK)
                moved["server"] += len(CHUNK)
                mark()
        except OSError as e:
            ended["server"] = f"errno {e.errno}"

    threads = [threading.Thread(target=f, daemon=True) for f in (read_client, write_server)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    print(
        f"RESET client={ended.get('client', 'open')} server={ended.get('server', 'open')} "
        f"moved={moved['client']}/{moved['server']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
