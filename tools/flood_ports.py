#!/usr/bin/env python3
"""What peers without the secret can make pdkv's small ports hold, measured: prefill's pull
endpoint, an SGLang decode's aux endpoint and SGLang's bootstrap table (``tests/peers.py
ports``: all three in one process of their own, slots of 64 and 16 bytes) and decode's
metrics endpoint (in this process), each against the bound docs/SECURITY.md states.

Per port and flood: ``idle``, ``--conns`` TCP connections opened and held without a byte;
``junk``, ``--flooders`` connections sending messages that do not verify as fast as they can
(just under 8 MiB for aux, 4 KiB for pull) for ``--seconds``. Printed: the port process's
descriptors and resident memory before and at the flood's peak, how many connections it
held, and the time a peer with the secret took to be served during the flood. The last line
is one JSON object: the rows.

    python tools/flood_ports.py [--conns 2000] [--flooders 8] [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
SECRET = bytes(range(32))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def hold(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        try:
            out.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            break
    return out


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.005)


def legit(which: str, info: dict, lines: list) -> float:
    """Seconds until a peer with the secret is served by ``which`` (pull, aux, boot or
    metrics; ``lines``: what the ports' process printed, where the aux endpoint reports);
    TimeoutError after 10 s."""
    t0 = time.monotonic()
    if which == "pull":
        from pdkv.integrations.core.pull import PullClient

        c = PullClient((info["pull"],), secret=SECRET, timeout_s=10)
        try:
            res = c.pull(info["pull"], "good", b"b" * 32, "tcp://127.0.0.1:1")
            _wait(lambda: res.done, "the pull answered")
            assert res.error == "", res.error
        finally:
            c.close()
    elif which == "aux":
        from pdkv.integrations.sglang.aux import AuxSender

        tx = AuxSender(SECRET)
        try:
            n = len(lines)
            tx.send(info["aux"], "good", [b"a" * 64, b"b" * 16])
            _wait(lambda: any(x.get("aux") == "good" for x in lines[n:]), "the aux message written")
        finally:
            tx.close()
    else:
        url = f"http://127.0.0.1:{info['boot']}/pdkv/ranks" if which == "boot" else info["metrics"]
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read()
        if which == "boot":
            assert r.status == 200 and json.loads(body) == {"ranks": {}}, body[:200]
    return time.monotonic() - t0


def junk_flood(which: str, info: dict, n: int, seconds: float, sample) -> None:
    import msgspec
    import zmq

    from pdkv.integrations.sglang.aux import AuxMsg

    if which == "aux":
        body = msgspec.msgpack.encode(AuxMsg(pid="x", blobs=[os.urandom((8 << 20) - 4096), b"z"], mac=b"0" * 32))
    else:
        body = os.urandom(4000)
    frame = zmq.Frame(body)
    ctx = zmq.Context(io_threads=2)
    stop = threading.Event()

    def run():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 16)
        s.connect(info[which])
        while not stop.is_set():
            try:
                s.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                time.sleep(0.0005)
        s.close(0)

    ts = [threading.Thread(target=run, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sample()
        time.sleep(0.05)
    stop.set()
    for t in ts:
        t.join(5)
    ctx.destroy(linger=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=2000)
    ap.add_argument("--flooders", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, a.conns + 512)), hard))
    sys.path.insert(0, str(TESTS))
    env = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(
        [sys.executable, str(TESTS / "peers.py"), "ports", "--secret", SECRET.hex()],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    info = json.loads(p.stdout.readline())
    lines: list = []
    threading.Thread(target=lambda: [lines.append(json.loads(x)) for x in p.stdout], daemon=True).start()
    metrics = None
    try:
        from pdkv import BlockPool, DecodeScheduler
        from pdkv.metrics import DecodeMetrics

        metrics = DecodeMetrics(DecodeScheduler(num_layers=1, gpu=BlockPool(4)))
        info["metrics"] = f"http://127.0.0.1:{metrics.serve(0)}/metrics"
    except ImportError:
        pass
    time.sleep(0.5)
    rows = []
    print(
        f"{'port':>8} {'flood':>5} {'fds before':>10} {'fds peak':>8} {'RSS MiB before':>14} {'RSS MiB peak':>12} "
        f"{'good peer ms':>12}",
        flush=True,
    )
    me = os.getpid()
    try:
        for which, flood in (("pull", "idle"), ("pull", "junk"), ("aux", "idle"), ("aux", "junk"), ("boot", "idle"),
                             ("metrics", "idle")):  # fmt: skip
            if which == "metrics" and metrics is None:
                continue
            pid = me if which == "metrics" else p.pid
            f0, r0 = fds(pid), rss_mib(pid)
            peak = [f0, r0]

            def sample(pid=pid, peak=peak):
                peak[0], peak[1] = max(peak[0], fds(pid)), max(peak[1], rss_mib(pid))

            good = float("nan")
            if flood == "idle":
                port = int(info[which].rsplit(":", 1)[1].split("/")[0]) if which != "boot" else info["boot"]
                held = hold(port, a.conns)
                try:
                    for _ in range(20):
                        sample()
                        time.sleep(0.05)
                    good = legit(which, info, lines)
                    if which == "metrics":  # this process holds the client ends too: count the server's alone
                        peak[0] -= len(held)
                finally:
                    for s in held:
                        s.close()
            else:
                t = threading.Thread(target=junk_flood, args=(which, info, a.flooders, a.seconds, sample))
                t.start()
                time.sleep(a.seconds / 2)
                good = legit(which, info, lines)
                t.join()
            time.sleep(0.5)
            r = {
                "port": which, "flood": flood, "fds_before": f0, "fds_peak": peak[0], "rss_mib_before": r0,
                "rss_mib_peak": peak[1], "good_ms": 1000 * good,
            }  # fmt: skip
            rows.append(r)
            print(
                f"{which:>8} {flood:>5} {f0:>10} {peak[0]:>8} {r0:>14.0f} {peak[1]:>12.0f} {1000 * good:>12.1f}",
                flush=True,
            )
    finally:
        p.terminate()
        p.wait(10)
        if metrics is not None:
            metrics.close()
    print(json.dumps({"tool": "flood_ports", "conns": a.conns, "flooders": a.flooders, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
