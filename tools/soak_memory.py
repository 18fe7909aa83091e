#!/usr/bin/env python3
"""Memory over many requests: RSS sampled at a fixed interval while requests run, and its
growth from the end of the warm-up to the end of the run.

- ``scheduler``: a DecodeScheduler alone (block pools, a swap that completes at once) runs
  reserve -> every layer landed -> complete -> swap -> ready -> finish per request.
- ``transfer``: the library's whole path in one process: a PrefillSender writes each
  request's layers over shm into a DecodeReceiver's buffer, the scheduler swaps them into a
  host stand-in for GPU blocks, an engine thread finishes them; outcomes through
  ``on_outcome`` (the sender is never asked for them), ``--window`` threads issuing.
- ``tool``: ``pdkv-transfer-test`` (local mode, ``--duration``) as a subprocess; the RSS of
  the tool (decode side) and of its prefill process, each.

What an ended request may leave behind: its tombstone (``max_tombstones``, 65,536) and, in
the sender, its outcome until asked for (the newest 65,536); the warm-up is long enough to
fill both, so growth after it is what a request leaks.

    python tools/soak_memory.py scheduler --requests 1000000
    python tools/soak_memory.py transfer --requests 1000000 --every 60
    python tools/soak_memory.py tool --minutes 30 --rate 40 --every 60
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

PAGE = resource.getpagesize()


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of a process in MiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / (1 << 20)
    except (OSError, IndexError, ValueError):
        return 0.0


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


class _Done:
    error = None

    def done(self) -> bool:
        return True


class _Swap:
    def submit(self, request_id: str, buffer_blocks: object, gpu_blocks: object) -> _Done:
        return _Done()


def soak_scheduler(a: argparse.Namespace, sample: Any) -> dict[str, Any]:
    from pdkv import BlockPool, DecodeScheduler, SchedulerOptions

    opts = SchedulerOptions(direct_to_gpu=False, lease_s=a.lease_s)
    s = DecodeScheduler(
        num_layers=32, gpu=BlockPool(1024), buffer=BlockPool(1024), swap=_Swap(), tokens_per_block=16, options=opts
    )
    layers = range(32)
    for i in range(1, a.requests + 1):
        rid = f"req-{i}"
        r = s.reserve(rid, num_tokens=64)
        assert r.grant is not None
        s.land_layers(rid, r.grant.token, layers)
        s.complete(rid, r.grant.token)
        s.tick()
        for x in s.take_ready():
            s.finish(x.request_id)
        sample(i)
    for _ in range(3):  # the last swaps are polled done by the ticks after them
        s.tick()
        for x in s.take_ready():
            s.finish(x.request_id)
    return {"live_requests_at_end": len(s.live_requests())}


def soak_transfer(a: argparse.Namespace, sample: Any) -> dict[str, Any]:
    import numpy as np

    from pdkv import BlockPool, CacheSpec, DecodeReceiver, DecodeScheduler, KVLayout, PrefillSender, SchedulerOptions
    from pdkv.buffer.shared import SharedBuffer
    from pdkv.swap import SwapEngine

    lay = KVLayout(num_layers=4, kv_heads=2, head_dim=64, tokens_per_block=16, dtype="bfloat16")
    nb = 16 * a.window
    buf = SharedBuffer.create(CacheSpec.buffer_bytes(lay, nb))
    gpu = np.zeros(lay.block_bytes * nb, np.uint8)
    eng = SwapEngine(
        CacheSpec.for_buffer(lay, nb, buf.address),
        CacheSpec.for_buffer(lay, nb, gpu.ctypes.data),
        strategy="host",
        buffer_pinned=False,
    )
    sched = DecodeScheduler(
        num_layers=lay.total_layers,
        gpu=BlockPool(nb),
        buffer=BlockPool(nb),
        swap=eng,
        options=SchedulerOptions(direct_to_gpu=False, lease_s=a.lease_s, on_full="queue"),
    )
    rx = DecodeReceiver(sched, [lay], [buf], nb, auto_tick=True)
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            for r in sched.take_ready():
                sched.finish(r.request_id)
            time.sleep(0.0005)

    eng_thread = threading.Thread(target=engine, daemon=True)
    eng_thread.start()
    src = np.zeros(lay.block_bytes * nb, np.uint8)
    spec = CacheSpec.for_buffer(lay, nb, src.ctypes.data)
    states: dict[str, int] = {}
    lock = threading.Lock()
    issued = [0]
    errors: list[BaseException] = []

    def on_outcome(o: Any) -> None:
        with lock:
            states[o.state] = states.get(o.state, 0) + 1

    tx = PrefillSender(lay, spec, rx.control_address, transport="shm", on_outcome=on_outcome)

    def issuer(k: int) -> None:  # one of --window engine threads, each a request at a time
        try:
            while True:
                with lock:
                    if issued[0] >= a.requests:
                        return
                    issued[0] += 1
                    i = issued[0]
                rid = f"req-{i}"
                g = tx.reserve(rid, 32)
                src_blocks = [2 * k, 2 * k + 1]
                for layer in range(lay.total_layers):
                    tx.send_layer(layer, [(rid, src_blocks)])
                tx.finish(rid)
                assert len(g.blocks) == 2
        except BaseException as exc:
            errors.append(exc)

    issuers = [threading.Thread(target=issuer, args=(k,), daemon=True) for k in range(a.window)]
    try:
        for t in issuers:
            t.start()
        while any(t.is_alive() for t in issuers):
            time.sleep(0.05)
            sample(issued[0])
        if errors:
            raise errors[0]
        deadline = time.monotonic() + 30
        while sum(states.values()) < a.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        # An outcome is sent when decode holds a request's KV; the engine thread finishes
        # it a little later (swap, then take_ready), so the last ones may still be live.
        while sched.live_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        tx.close()
        stop.set()
        eng_thread.join(5)
        rx.close()
        eng.close()
        buf.close()
        buf.unlink()
    return {"outcomes": states, "live_requests_at_end": len(sched.live_requests())}


def soak_tool(a: argparse.Namespace) -> int:
    duration = a.minutes * 60
    argv = [
        sys.executable, "-m", "pdkv.cli.transfer_tool", "--model", "tiny", "--rate", str(a.rate),
        "--duration", str(duration), "--requests", str(int(a.rate * duration * 1.5) + 100), "-q",
    ]  # fmt: skip
    if a.json:
        argv += ["--json", a.json]
    t0 = time.monotonic()
    log = open(a.log or os.devnull, "w")  # the tool's own output, apart from this table
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    rows: list[tuple[float, float, float]] = []
    print(" ".join(argv[1:]))
    print(f"{'minute':>7} {'tool RSS MiB':>13} {'prefill RSS MiB':>16}", flush=True)
    while p.poll() is None:
        kids = children(p.pid)
        rows.append((time.monotonic() - t0, rss_mib(p.pid), sum(rss_mib(k) for k in kids)))
        t, r1, r2 = rows[-1]
        print(f"{t / 60:>7.1f} {r1:>13.1f} {r2:>16.1f}", flush=True)  # as it goes: a long run is watched
        deadline = time.monotonic() + a.every
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    log.close()
    out = open(a.log).read() if a.log else ""
    # from the first sample at or after the warm-up to the last taken while the requests ran
    run = [r for r in rows if r[0] <= duration]
    warm = next((r for r in run if r[0] >= a.warmup_s), run[-1] if run else None)
    summary: dict[str, Any] = {"rc": p.returncode, "minutes": a.minutes, "rate": a.rate}
    if warm and run:
        end = run[-1]
        for i, who in ((1, "tool"), (2, "prefill")):
            g = (end[i] - warm[i]) / warm[i] * 100 if warm[i] else 0.0
            print(f"{who}: {warm[i]:.1f} MiB at {warm[0] / 60:.1f} min -> {end[i]:.1f} MiB at {end[0] / 60:.1f} min, "
                  f"{g:+.2f} %")  # fmt: skip
            summary[f"{who}_growth_pct"] = round(g, 3)
    print("\n".join(line for line in out.splitlines() if line.strip())[-2000:])
    print(json.dumps(summary))
    return p.returncode or 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("scheduler", "transfer"):
        s = sub.add_parser(name)
        s.add_argument("--requests", type=int, default=1_000_000)
        s.add_argument("--samples", type=int, default=20, help="RSS samples over the run (with --every 0)")
        s.add_argument("--every", type=float, default=0.0, help="sample every this many seconds instead")
        s.add_argument("--lease-s", type=float, default=30.0)
        s.add_argument("--window", type=int, default=8, help="transfer: engine threads, a request in flight each")
    t = sub.add_parser("tool")
    t.add_argument("--minutes", type=float, default=30.0)
    t.add_argument("--rate", type=float, default=40.0)
    t.add_argument("--every", type=float, default=60.0)
    t.add_argument("--warmup-s", type=float, default=60.0, help="growth is measured from here")
    t.add_argument("--json", default="", help="the tool's JSON report here")
    t.add_argument("--log", default="", help="the tool's output here (its last lines are printed at the end)")
    a = ap.parse_args()
    if a.what == "tool":
        return soak_tool(a)
    t0 = time.monotonic()
    every_n = max(1, a.requests // a.samples)
    rows: list[tuple[int, float, float]] = [(0, 0.0, rss_mib())]
    last = [t0]

    def sample(i: int) -> None:
        now = time.monotonic()
        if (a.every and now - last[0] >= a.every) or (not a.every and i >= rows[-1][0] + every_n):
            last[0] = now
            rows.append((i, now - t0, rss_mib()))

    extra = (soak_scheduler if a.what == "scheduler" else soak_transfer)(a, sample)
    after_run = rss_mib()  # the soak's objects gone: not a sample of the run
    print(f"{'requests':>10} {'seconds':>8} {'RSS MiB':>9}")
    for n, s, rss in rows:
        print(f"{n:>10,} {s:>8.0f} {rss:>9.1f}")
    print(f"after the run (its scheduler, pools and buffers freed): {after_run:.1f} MiB")
    # the warm-up: the tombstones (and the sender's kept outcomes) full, and a minute run
    full = 1 << 16
    after = [r for r in rows if r[0] >= full and (not a.every or r[1] >= 60)]
    base = after[0] if after else rows[-1]
    end = rows[-1]  # the last sample taken while requests ran
    growth = (end[2] - base[2]) / base[2] * 100 if base[2] else 0.0
    print(
        f"from {base[0]:,} requests ({base[1]:.0f} s) to {end[0]:,} ({end[1]:.0f} s): {base[2]:.1f} -> "
        f"{end[2]:.1f} MiB, {growth:+.2f} %; {extra}"
    )
    print(
        json.dumps(
            {
                "what": a.what,
                "requests": a.requests,
                "seconds": round(end[1], 1),
                "rss_mib_start": rows[0][2],
                "rss_mib_warm": base[2],
                "rss_mib_end": end[2],
                "rss_mib_after_run": after_run,
                "growth_pct_after_warmup": round(growth, 3),
                **extra,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
