"""torchft's own clients (torchft 0.2.0's Rust extension) against a lighthouse.

Usage: lighthouse_client.py MODE ADDR [ARGS]; prints one JSON line (the last line of
stdout) that tests/lighthouse_torchft.rs reads.

- `single ADDR`: LighthouseClient.heartbeat, then .quorum with every field set.
- `pair ADDR [TIMEOUT_S]`: two LighthouseClients ask at once (threads); both answers
  (or errors).
- `timeout ADDR MS`: a quorum nobody else joins, with a timeout of MS: the error and how
  long it took.
- `abandon ADDR`: `timeout ADDR 1500`, then at once `pair ADDR 4` (in one process, so that
  the abandoned replica's heartbeat is still fresh): {"timeout": ..., "pair": ...}.
- `managers ADDR`: two ManagerServers (replica groups "g0", "g1") on the lighthouse and a
  ManagerClient._quorum to each at once: both QuorumResults.
"""
import json
import sys
import threading
import time
import uuid
from datetime import timedelta

from torchft._torchft import LighthouseClient, ManagerClient, ManagerServer


def member_json(m):
    return {
        "replica_id": m.replica_id,
        "address": m.address,
        "store_address": m.store_address,
        "step": m.step,
        "world_size": m.world_size,
        "shrink_only": m.shrink_only,
    }


def quorum_json(q):
    return {
        "quorum_id": int(q.quorum_id),
        "participants": [member_json(m) for m in q.participants],
        "created": [q.created.seconds, q.created.nanos],
    }


def ask(addr, replica_id, step, timeout_s, out, key):
    try:
        c = LighthouseClient(addr, timedelta(seconds=10))
        c.heartbeat(replica_id)
        q = c.quorum(
            replica_id,
            timedelta(seconds=timeout_s),
            address=f"http://{replica_id}.example:{1000 + step}",
            store_address=f"{replica_id}.example:{2000 + step}",
            step=step,
            world_size=2,
            shrink_only=False,
        )
        out[key] = quorum_json(q)
    except Exception as e:  # noqa: BLE001: reported to the Rust test
        out[key] = {"error": f"{type(e).__name__}: {e}"}


def run_threads(targets):
    threads = [threading.Thread(target=t, args=a) for t, a in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main():
    mode, addr = sys.argv[1], sys.argv[2]
    out = {}
    if mode == "abandon":
        t = run_mode(["timeout", addr, "1500"])
        p = run_mode(["pair", addr, "4"])
        out = {"timeout": t, "pair": p}
    else:
        out = run_mode(sys.argv[1:])
    print(json.dumps(out), flush=True)


def run_mode(argv):
    mode, addr = argv[0], argv[1]
    out = {}
    if mode == "single":
        ask(addr, "solo", 7, 10, out, "solo")
    elif mode == "pair":
        t = float(argv[2]) if len(argv) > 2 else 20
        run_threads([(ask, (addr, "rep_b", 5, t, out, "b")), (ask, (addr, "rep_a", 3, t, out, "a"))])
    elif mode == "timeout":
        ms = int(argv[2])
        c = LighthouseClient(addr, timedelta(seconds=10))
        t = time.monotonic()
        try:
            c.quorum("lonely", timedelta(milliseconds=ms), address="http://l:1", store_address="l:2", step=1, world_size=1)
            out["error"] = None
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"
        out["elapsed_s"] = time.monotonic() - t
    elif mode == "managers":
        servers = []
        for g in ("g0", "g1"):
            servers.append(
                ManagerServer(
                    replica_id=f"{g}:{uuid.uuid4()}",
                    lighthouse_addr=addr,
                    hostname="127.0.0.1",
                    bind="127.0.0.1:0",
                    store_addr=f"127.0.0.1:{29600 if g == 'g0' else 29601}",
                    world_size=1,
                    heartbeat_interval=timedelta(milliseconds=100),
                    connect_timeout=timedelta(seconds=10),
                    quorum_retries=0,
                )
            )

        def manager_quorum(i, step):
            try:
                c = ManagerClient(servers[i].address(), timedelta(seconds=10))
                r = c._quorum(
                    group_rank=0,
                    step=step,
                    checkpoint_metadata=f"meta{i}",
                    shrink_only=False,
                    timeout=timedelta(seconds=20),
                    commit_failures=0,
                    init_sync=True,
                )
                out[f"g{i}"] = {
                    "quorum_id": r.quorum_id,
                    "replica_rank": r.replica_rank,
                    "replica_world_size": r.replica_world_size,
                    "max_step": r.max_step,
                    "heal": r.heal,
                    "store_address": r.store_address,
                    "recover_src_manager_address": r.recover_src_manager_address,
                    "replica_ids": [x.split(":")[0] for x in r.replica_ids],
                }
            except Exception as e:  # noqa: BLE001
                out[f"g{i}"] = {"error": f"{type(e).__name__}: {e}"}

        run_threads([(manager_quorum, (0, 10)), (manager_quorum, (1, 12))])
        for s in servers:
            s.shutdown()
    else:
        raise SystemExit(f"unknown mode {mode}")
    return out


if __name__ == "__main__":
    main()
