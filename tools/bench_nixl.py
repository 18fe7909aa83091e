#!/usr/bin/env python3
"""pdkv over NIXL against bare NIXL doing the same writes, and against pdkv's tcp and shm.

Two processes on this host. For each block size, ``--gib`` moves from this (prefill)
process into a decode process's buffer in random destination order, 16 requests a batch,
every byte verified: through ``PrefillSender(transport="nixl")`` (grants, one NIXL WRITE
per layer, the layer reported, outcomes back), through a bare NIXL agent posting the same
descriptors into the same buffer (agents, registration and metadata exchange done outside
the timing for both), and through pdkv's tcp and shm, interleaved, the ratio to bare NIXL
taken per repetition. UCX runs with ``UCX_TLS`` as ``--ucx`` says (``tcp``; ``cma``: a
same-host single copy, as ``cma,tcp``).

    python tools/bench_nixl.py [--gib 1] [--sizes-kib 128,1024] [--ucx tcp,cma] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from _bench import send_and_wait, stop_decode
from bench_transport import layout_for

import pdkv
from pdkv import _ffi

HERE = os.path.dirname(os.path.abspath(__file__))
NREQ = 16


def run(kib: int, ucx: str, a: argparse.Namespace) -> dict:
    env = dict(os.environ, UCX_TLS="tcp" if ucx == "tcp" else "cma,tcp", UCX_NET_DEVICES="lo")
    os.environ.update({k: env[k] for k in ("UCX_TLS", "UCX_NET_DEVICES")})
    lay = layout_for(kib)
    child = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "bench_transport.py"), "--role", "decode"]
        + ["--kib", str(kib), "--gib", str(a.gib), "--transports", "shm,tcp,nixl"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    txs: dict[str, pdkv.PrefillSender] = {}
    bare = None
    try:
        info = json.loads(child.stdout.readline())
        nb, bb = info["blocks"], lay.block_bytes
        total = nb * bb
        src = pdkv.aligned_empty(total)
        src[:] = np.random.default_rng(kib).integers(0, 256, total, dtype=np.uint8)
        spec = pdkv.CacheSpec.for_buffer(lay, nb, src.ctypes.data)
        view_buf = pdkv.SharedBuffer.open(info["shm"], pin="never")
        dst = np.frombuffer(view_buf.buf, dtype=np.uint8)[:total].reshape(nb, bb)
        srcv = src.reshape(nb, bb)
        perm = np.random.default_rng(1).permutation(nb)
        per = nb // NREQ
        txs = {
            t: pdkv.PrefillSender(lay, spec, info["control"], transport=t, timeout_s=60, instance=f"bench-{t}")
            for t in ("nixl", "tcp", "shm")
        }
        # the bare baseline: its own agent, the same source registered, decode's bare agent added
        bare = _ffi.nixl.Agent(f"bench-bare-src-{os.getpid()}")
        bare.register([(src.ctypes.data, total, 0)], "DRAM")
        peer = bare.add_remote(bytes.fromhex(info["bare_metadata"]))
        base = info["address"]
        counter = [0]

        def verify(what: str, dest_of: np.ndarray) -> None:
            if not np.array_equal(dst[dest_of], srcv[perm[: dest_of.size]]):
                raise SystemExit(f"VERIFY FAILED: {what} {kib} KiB")

        def transfer(t: str) -> float:
            tx = txs[t]
            dst[:] = 0xEE
            counter[0] += 1
            rids = [f"{t}-{counter[0]}-{i}" for i in range(NREQ)]
            grants = [tx.reserve(r, per * lay.tokens_per_block) for r in rids]
            dt = send_and_wait(tx, [(r, perm[i * per : (i + 1) * per].tolist()) for i, r in enumerate(rids)])
            verify(t, np.concatenate([np.asarray(g.blocks) for g in grants]))
            return NREQ * per * bb / dt

        def bare_write() -> float:
            dst[:] = 0xEE
            n = NREQ * per
            order = np.arange(n)  # destination blocks 0..n-1, sources in the same random order
            local = [(src.ctypes.data + int(perm[j]) * bb, bb, 0) for j in order]
            remote = [(base + int(j) * bb, bb, 0) for j in order]
            t0 = time.perf_counter()
            h = bare.write(local, remote, peer, "DRAM")
            while (st := bare.state(h)) not in ("DONE", "ERR"):
                time.sleep(20e-6)
            dt = time.perf_counter() - t0
            bare.release(h)
            assert st == "DONE", st
            verify("bare NIXL", order)
            return n * bb / dt

        bare_write(), transfer("nixl"), transfer("tcp"), transfer("shm")  # warm-up
        reps = [(bare_write(), transfer("nixl"), transfer("tcp"), transfer("shm")) for _ in range(a.reps)]
        med = statistics.median
        dst = srcv = None
        view_buf.close()
        return {
            "kib": kib,
            "ucx": ucx,
            "bare": med(r[0] for r in reps),
            "nixl": med(r[1] for r in reps),
            "ratio": med(r[1] / r[0] for r in reps),
            "tcp": med(r[2] for r in reps),
            "shm": med(r[3] for r in reps),
        }
    finally:
        for tx in txs.values():
            tx.close()
        if bare is not None:
            bare.close()
        stop_decode(child)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--sizes-kib", default="128,1024")
    ap.add_argument("--ucx", default="tcp,cma")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if not _ffi.nixl.available():
        print("bench_nixl.py needs NIXL: pip install 'pdkv[nixl]'", file=sys.stderr)
        return 2
    print(f"{a.gib:g} GiB per run, {NREQ} requests, random destination order, every byte verified; GiB/s")
    print(
        f"{'KiB':>6} {'UCX':>5} {'bare NIXL':>10} {'pdkv nixl':>10} {'ratio':>6} {'pdkv tcp':>9} {'pdkv shm':>9}",
        flush=True,
    )
    rows = []
    for ucx in a.ucx.split(","):
        for kib in map(int, a.sizes_kib.split(",")):
            r = run(kib, ucx, a)
            rows.append(r)
            g = 1 << 30
            print(
                f"{kib:>6} {ucx:>5} {r['bare'] / g:>10.2f} {r['nixl'] / g:>10.2f} {r['ratio']:>6.2f}"
                f" {r['tcp'] / g:>9.2f} {r['shm'] / g:>9.2f}",
                flush=True,
            )
    print("(medians of repetitions; ratio: per-repetition pdkv nixl / bare NIXL, the same writes into the same buffer)")
    print(json.dumps({"min_ratio": round(min(r["ratio"] for r in rows), 3), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
