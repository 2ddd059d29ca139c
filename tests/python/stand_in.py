"""A stand-in meshd for the client's tests: a Unix socket that serves each connection on
its own thread, no job needed."""
import json
import os
import socket
import struct
import tempfile
import threading


def listen(serve):
    """Listens on a socket in a fresh temporary directory; `serve(conn)` runs on a daemon
    thread for every connection. Returns the socket's path (MESHD_SOCKET)."""
    path = os.path.join(tempfile.mkdtemp(), "sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()

    def accept():
        while True:
            c, _ = listener.accept()
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return path


def requests(conn):
    """The client's requests on `conn`, one JSON head each (a request's bytes are read and
    dropped); ends when the client closes."""
    while True:
        n = conn.recv(4, socket.MSG_WAITALL)
        if len(n) < 4:
            return
        head = json.loads(conn.recv(struct.unpack(">I", n)[0], socket.MSG_WAITALL))
        if head.get("nbytes"):
            conn.recv(head["nbytes"], socket.MSG_WAITALL)
        yield head
