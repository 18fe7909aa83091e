#!/usr/bin/env python3
"""Staged tcp from a GPU cache against tcp from a host cache, two processes on this host.

For each block size (bytes of one block of one layer) and stream count, ``--gib`` of KV
cache in ``--layers`` layers moves from this (prefill) process into a decode process's
buffer over tcp, 16 requests a batch, random destination order, every byte verified: once
from a host cache (frames sent straight out of the cache) and once from the same bytes in
GPU memory (each layer gathered chunk by chunk into the pinned staging ring by the swap
engine, sent from there while the next chunk is gathered), alternating, the ratio taken
per repetition. The clock runs from handing layer 0 to the sender until every outcome is
back. Also printed for the staged runs: the gather's share hidden behind sending (per
layer: 1 - the time the send worker waited for a gather / the gathers' device time; the
first chunk of a batch has nothing to hide behind), and the gathers' device-time rate.

    python tools/bench_staged.py [--gib 1] [--layers 4] [--sizes-kib 32,128,1024] [--streams 2,4] [--reps 3]
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
from _bench import stop_decode
from bench_transport import layout_for  # same folder: the decode process and its layout

import pdkv
from pdkv import _ffi

HERE = os.path.dirname(os.path.abspath(__file__))
NREQ = 16


def run(kib: int, streams: int, a: argparse.Namespace) -> dict:
    lay = layout_for(kib, a.layers)
    child = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "bench_transport.py"), "--role", "decode"]
        + ["--kib", str(kib), "--gib", str(a.gib), "--layers", str(a.layers)],
        stdout=subprocess.PIPE,
        text=True,
    )
    ptr = 0
    txs: list[pdkv.PrefillSender] = []
    try:
        info = json.loads(child.stdout.readline())
        nb = info["blocks"]
        bb, L = lay.tensor_block_bytes(0), a.layers
        total = nb * lay.block_bytes
        src = pdkv.aligned_empty(total)
        src[:] = np.random.default_rng(kib).integers(0, 256, total, dtype=np.uint8)
        host = pdkv.CacheSpec.for_buffer(lay, nb, src.ctypes.data)
        ptr = _ffi.cuda.malloc(total)
        _ffi.cuda.memcpy(ptr, src.ctypes.data, total)  # the same bytes in GPU memory
        gpu = pdkv.CacheSpec.for_buffer(lay, nb, ptr, device=0)
        view_buf = pdkv.SharedBuffer.open(info["shm"], pin="never")
        dst = np.frombuffer(view_buf.buf, dtype=np.uint8)[:total].reshape(L, nb, bb)
        srcv = src.reshape(L, nb, bb)
        perm = np.random.default_rng(1).permutation(nb)
        per = nb // NREQ
        kw = dict(transport="tcp", streams=streams, timeout_s=60)
        txs = [
            pdkv.PrefillSender(lay, host, info["control"], instance="bench-host", **kw),
            pdkv.PrefillSender(
                lay,
                gpu,
                info["control"],
                instance="bench-gpu",
                staging_slot_bytes=int(a.slot_mib * (1 << 20)) or None,
                staging_slots=a.slots,
                **kw,
            ),
        ]
        tx_host, tx_gpu = txs
        staged = tx_gpu.transport_impl.staging
        assert staged is not None and tx_host.transport_impl.staging is None
        counter = [0]

        def transfer(tx: pdkv.PrefillSender) -> tuple[float, list]:
            dst[:] = 0xEE  # poison
            counter[0] += 1
            rids = [f"r{counter[0]}-{i}" for i in range(NREQ)]
            grants = [tx.reserve(r, per * lay.tokens_per_block) for r in rids]
            items = [(r, perm[i * per : (i + 1) * per].tolist()) for i, r in enumerate(rids)]
            n0 = len(staged.log)
            t0 = time.perf_counter()
            for layer in range(L):
                tx.send_layer(layer, items)
            tx.finish_many(rids)
            outs = [tx.wait_outcome(r, 120) for r in rids]
            dt = time.perf_counter() - t0
            assert all(o.ok for o in outs), outs
            for i, g in enumerate(grants):
                if not np.array_equal(dst[:, np.asarray(g.blocks)], srcv[:, perm[i * per : (i + 1) * per]]):
                    raise SystemExit(f"VERIFY FAILED: {tx.instance} {kib} KiB request {i}")
            return NREQ * per * lay.block_bytes / dt, list(staged.log)[n0:]

        transfer(tx_host), transfer(tx_gpu)  # warm-up
        reps = []
        for i in range(a.reps):  # ABBA: neither side always runs first
            order = (tx_host, tx_gpu) if i % 2 == 0 else (tx_gpu, tx_host)
            got = {tx.instance: transfer(tx) for tx in order}
            reps.append((got["bench-host"][0], got["bench-gpu"][0], got["bench-gpu"][1]))
        hidden, gather_bw = [], []
        for _, _, log in reps:
            for layer in range(L):
                recs = [r for r in log if r.layer == layer]
                g = sum(r.gather_s for r in recs)
                hidden.append(1 - sum(r.wait_s for r in recs) / g if g else float("nan"))
            gather_bw.append(sum(r.nbytes for r in log) / sum(r.gather_s for r in log))
        med = statistics.median
        dst = srcv = None
        view_buf.close()
        return {
            "kib": kib,
            "streams": streams,
            "host": med(r[0] for r in reps),
            "gpu": med(r[1] for r in reps),
            "ratio": med(r[1] / r[0] for r in reps),
            "hidden_med": med(hidden),
            "hidden_min": min(hidden),
            "gather_GBps": med(gather_bw) / 1e9,
            "slot_MiB": staged.slot_bytes / (1 << 20),
            "slots": staged.ring.slots,
            "gather": staged.engine.strategy,
        }
    finally:
        for tx in txs:
            tx.close()
        if ptr:
            _ffi.cuda.free(ptr)
        stop_decode(child)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sizes-kib", default="32,128,1024")
    ap.add_argument("--streams", default="2,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slot-mib", type=float, default=0, help="staging slot size (default: pdkv's, from the layout)")
    ap.add_argument("--slots", type=int, default=4, help="staging slots (default 4, pdkv's)")
    a = ap.parse_args()
    if _ffi.cuda.device_count() == 0:
        print("bench_staged.py needs a CUDA GPU (the staged path gathers from GPU memory)", file=sys.stderr)
        return 2
    print(
        f"{a.gib:g} GiB per run in {a.layers} layers, {NREQ} requests a batch, random destination order,"
        " every byte verified; GiB/s; medians of "
        f"{a.reps} repetitions (host and GPU cache alternating)"
    )
    print(
        f"{'KiB':>6} {'streams':>7} {'host cache':>10} {'GPU cache':>10} {'ratio':>6}"
        f" {'hidden med/min':>15} {'gather GB/s':>11} {'slots':>10} {'engine':>7}",
        flush=True,
    )
    rows = []
    for streams in map(int, a.streams.split(",")):
        for kib in map(int, a.sizes_kib.split(",")):
            r = run(kib, streams, a)
            rows.append(r)
            print(
                f"{r['kib']:>6} {r['streams']:>7} {r['host'] / (1 << 30):>10.2f} {r['gpu'] / (1 << 30):>10.2f}"
                f" {r['ratio']:>6.2f} {r['hidden_med']:>8.2f}/{r['hidden_min']:.2f} {r['gather_GBps']:>11.1f}"
                f" {r['slots']:>3} x {r['slot_MiB']:g} MiB {r['gather']:>7}",
                flush=True,
            )
    print("(ratio: median of per-repetition GPU-cache / host-cache throughput; hidden: per layer, 1 - the send")
    print(" worker's wait for gathers / the gathers' device time, median and least over layers and repetitions)")
    print(json.dumps({"min_ratio": round(min(r["ratio"] for r in rows), 3), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
