"""Soak: random traffic with injected faults for PDKV_SOAK_S seconds (default 600).
Marked slow: run with `python -m pytest -m slow tests/test_soak.py`. Asserts zero leaked
blocks after every round and flat memory; PDKV_SOAK_REPORT=file writes the figures."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter

import pytest
from faultproxy import FaultProxy
from test_transfer import Decode, _lines, _spawn, prefill_cache

from pdkv import PrefillSender
from pdkv.errors import PdkvError


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


SOAK_S = float(os.environ.get("PDKV_SOAK_S", "600"))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(SOAK_S + 600)
def test_soak(no_leaks):
    duration = SOAK_S
    rng = random.Random(7)
    dec = Decode(lease_s=2.0, peer_timeout_s=2.0, io_timeout_s=1.0)
    c: Counter = Counter()
    recovery = []
    rss = []
    t0 = time.monotonic()
    lay, arr, spec = prefill_cache(1, 0)
    try:
        rnd = 0
        while time.monotonic() - t0 < duration:
            rnd += 1
            kind = rng.choice(["shm", "tcp", "tcp", "kill", "reset", "stall", "abandon"])
            c["rounds"] += 1
            if kind in ("shm", "tcp"):
                with PrefillSender(
                    lay, spec, dec.rx.control_address, transport=kind, timeout_s=5, instance=f"h{rnd}"
                ) as tx:
                    rids = [f"{rnd}-{i}" for i in range(rng.randint(1, 6))]
                    blocks = {}
                    for rid in rids:
                        n = rng.randint(1, 8)
                        try:
                            tx.reserve(rid, n * 8)
                        except PdkvError:
                            c["rejected"] += 1
                            continue
                        blocks[rid] = rng.sample(range(64), n)
                    for layer in range(4):
                        tx.send_layer(layer, list(blocks.items()))
                    for rid in blocks:
                        tx.finish(rid)
                    for rid in blocks:
                        c["ok" if tx.wait_outcome(rid, 15).ok else "failed_healthy"] += 1
            elif kind == "kill":
                p = _spawn(
                    "prefill",
                    "--control",
                    dec.rx.control_address,
                    "--transport",
                    rng.choice(["shm", "tcp"]),
                    "--blocks",
                    str(rng.randint(1, 8)),
                    "--layer-sleep",
                    "0.1",
                    "--instance",
                    f"k{rnd}",
                )
                try:
                    _lines(p, rng.randint(1, 4))
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(10)
                finally:
                    p.stdout.close()
                    p.stderr.close()
                c["faults_kill9"] += 1
            elif kind in ("reset", "stall"):
                host, port = dec.rx.data_address.split(":")
                kw = (
                    {"reset_after": rng.randint(1, 40000)}
                    if kind == "reset"
                    else {"stall_after": rng.randint(1, 40000)}
                )
                proxy = FaultProxy((host, int(port)), **kw)
                dec.rx.data_advertise = f"127.0.0.1:{proxy.port}"
                try:
                    with PrefillSender(
                        lay, spec, dec.rx.control_address, transport="tcp", timeout_s=2, instance=f"f{rnd}"
                    ) as tx:
                        tx.reserve(f"{rnd}-f", 64)
                        for layer in range(4):
                            tx.send_layer(layer, [(f"{rnd}-f", list(range(8)))])
                        tx.finish(f"{rnd}-f")
                        c["ok_through_fault" if tx.wait_outcome(f"{rnd}-f", 15).ok else "failed_by_fault"] += 1
                finally:
                    dec.rx.data_advertise = dec.rx.data_address
                    proxy.close()
                c[f"faults_{kind}"] += 1
            else:  # reserve and walk away: the lease must reclaim
                tx = PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5, instance=f"a{rnd}")
                tx.reserve(f"{rnd}-a", 24)
                tx.close()
                c["faults_abandoned"] += 1
            ts = time.monotonic()
            deadline = ts + 20
            while not (
                dec.sched.buffer.num_free == 64 and dec.sched.gpu.num_free == 64 and not dec.sched.live_requests()
            ):
                assert time.monotonic() < deadline, f"round {rnd} ({kind}): blocks not back after 20 s"
                time.sleep(0.02)
            recovery.append(time.monotonic() - ts)
            dec.sched.check_invariants()
            rss.append((time.monotonic() - t0, rss_mib()))
    finally:
        dec.close()
    warm = [r for t, r in rss if t > min(60.0, duration / 4)]
    growth = (max(warm) - warm[0]) if len(warm) > 1 else 0.0
    report = dict(
        c,
        seconds=round(time.monotonic() - t0, 1),
        leaked_blocks=0,
        recovery_s_max=round(max(recovery), 3),
        recovery_s_p50=round(sorted(recovery)[len(recovery) // 2], 3),
        rss_mib_start=round(warm[0] if warm else 0, 1),
        rss_mib_growth=round(growth, 1),
    )
    if os.environ.get("PDKV_SOAK_REPORT"):
        with open(os.environ["PDKV_SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report))
    assert growth < 64, f"memory grew by {growth:.0f} MiB"
