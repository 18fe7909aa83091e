#!/usr/bin/env python3
"""pdkv over NIXL against bare NIXL doing the same writes, and against pdkv's tcp and shm.

Two processes on this host. For each block size, ``--gib`` moves from this (prefill)
process into a decode process's buffer in random destination order, 16 requests a batch,
every byte verified: through ``PrefillSender(transport="nixl")`` (grants, one NIXL WRITE
per layer, the layer reported, outcomes back), through a bare NIXL agent posting the same
descriptors into the same buffer (agents, registration and metadata exchange done outside
the timing for both: bare NIXL's descriptor lists prepared once, as pdkv's session prepares
its own; a second bare row builds each write's list), and through pdkv's tcp and shm,
interleaved, the ratio to bare NIXL taken per repetition. UCX runs with ``UCX_TLS`` as
``--ucx`` says (``tcp``; ``cma``: a same-host single copy, as ``cma,tcp``; ``default``:
UCX's own choice, ``UCX_TLS`` unset).

``--gpu``: the source is a cache in GPU memory (device 0), and the rows are NIXL's own
VRAM source (bare, and pdkv with ``gpudirect="require"``), pdkv's staged path (the swap
engine's gather into a pinned ring registered as DRAM, one NIXL WRITE per slot: what
``auto`` picks on a host without an RDMA device) and pdkv's staged tcp; every byte
verified against the host copy of the cache.

    python tools/bench_nixl.py [--gib 1] [--sizes-kib 128,1024] [--ucx tcp,cma] [--reps 3] [--gpu]
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
from _bench import send_and_wait, stop_decode, ucx_env
from bench_transport import NREQ, layout_for

import pdkv
from pdkv import _ffi

HERE = os.path.dirname(os.path.abspath(__file__))


def _descs(addr: np.ndarray, n: int, dev: int) -> np.ndarray:
    out = np.zeros((addr.size, 3), np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addr.astype(np.uint64), n, dev
    return out


def run(kib: int, ucx: str, a: argparse.Namespace) -> dict:
    env = ucx_env(ucx, a.gpu)
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
    gptr = 0
    try:
        info = json.loads(child.stdout.readline())
        nb, bb = info["blocks"], lay.block_bytes
        total = nb * bb
        src = pdkv.aligned_empty(total)
        src[:] = np.random.default_rng(kib).integers(0, 256, total, dtype=np.uint8)
        spec = pdkv.CacheSpec.for_buffer(lay, nb, src.ctypes.data)
        if a.gpu:  # the same bytes in GPU memory: the source every row sends from
            gptr = _ffi.cuda.malloc(total)
            _ffi.cuda.memcpy(gptr, src.ctypes.data, total)
            spec = pdkv.CacheSpec.for_buffer(lay, nb, gptr, device=0)
        view_buf = pdkv.SharedBuffer.open(info["shm"], pin="never")
        dst = np.frombuffer(view_buf.buf, dtype=np.uint8)[:total].reshape(nb, bb)
        srcv = src.reshape(nb, bb)
        perm = np.random.default_rng(1).permutation(nb)
        per = nb // NREQ
        rows = ROWS_GPU if a.gpu else ROWS_HOST
        txs = {
            label: pdkv.PrefillSender(
                lay, spec, info["control"], transport=t, timeout_s=60, instance=f"bench-{label}", **kw
            )
            for label, (t, kw) in rows.items()
        }
        paths = {label: tx.stats["path"] for label, tx in txs.items()}
        # the bare baseline: its own agent, the same source registered, decode's bare agent added
        bare = _ffi.nixl.Agent(f"bench-bare-src-{os.getpid()}")
        mem, dev, base_src = ("VRAM", 0, gptr) if a.gpu else ("DRAM", 0, src.ctypes.data)
        bare.register([(base_src, total, dev)], mem)
        peer = bare.add_remote(bytes.fromhex(info["bare_metadata"]))
        base = info["address"]
        counter = [0]
        phases: dict[str, list[tuple[float, float, float]]] = {}

        def verify(what: str, dest_of: np.ndarray) -> None:
            if not np.array_equal(dst[dest_of], srcv[perm[: dest_of.size]]):
                raise SystemExit(f"VERIFY FAILED: {what} {kib} KiB")

        def transfer(t: str) -> float:
            tx = txs[t]
            dst[:] = 0xEE
            counter[0] += 1
            rids = [f"{t}-{counter[0]}-{i}" for i in range(NREQ)]
            grants = [tx.reserve(r, per * lay.tokens_per_block) for r in rids]
            items = [(r, perm[i * per : (i + 1) * per].tolist()) for i, r in enumerate(rids)]
            m0 = time.monotonic()
            dt = send_and_wait(tx, items)
            m1 = time.monotonic()
            # where the time went: handing over (send_layer to the layer's writes beginning),
            # the layer's writes (the NIXL WRITE posted, polled to DONE, the layer reported),
            # and the outcomes (Complete to decode and every outcome back)
            _, _, _, began, done = tx.layer_log.since(len(tx.layer_log) - 1)[0][-1]
            phases.setdefault(t, []).append((began - m0, done - began, m1 - done))
            verify(t, np.concatenate([np.asarray(g.blocks) for g in grants]))
            return NREQ * per * bb / dt

        # bare NIXL's prepared lists, made once outside the timing: every block of the source
        # and of decode's buffer, one strided row each
        prep_local = bare.prepare(np.array([[base_src, bb, dev, bb, nb]], np.uint64), mem)
        prep_remote = bare.prepare(np.array([[base, bb, 0, bb, nb]], np.uint64), "DRAM", peer)

        def bare_write(prepared: bool) -> float:
            dst[:] = 0xEE
            n = NREQ * per
            order = np.arange(n)  # destination blocks 0..n-1, sources in the same random order
            if not prepared:  # Nx3 (address, length, device) arrays, NIXL's cheapest list input
                local = _descs(base_src + perm[order].astype(np.uint64) * bb, bb, dev)
                remote = _descs(base + order.astype(np.uint64) * bb, bb, 0)
            li, ri = perm[order].astype(np.int32), order.astype(np.int32)
            t0 = time.perf_counter()
            if prepared:
                h = bare.write_prepared(prep_local, li, prep_remote, ri)
            else:
                h = bare.write(local, remote, peer, mem)
            while (st := bare.state(h)) not in ("DONE", "ERR"):
                time.sleep(20e-6)
            dt = time.perf_counter() - t0
            bare.release(h)
            assert st == "DONE", st
            verify("bare NIXL", order)
            return n * bb / dt

        def one_rep() -> dict[str, float]:
            return {
                "bare": bare_write(True),
                "bare per-write": bare_write(False),
                **{label: transfer(label) for label in rows},
            }

        one_rep()  # warm-up
        reps = [one_rep() for _ in range(a.reps)]
        med = statistics.median
        dst = srcv = None
        view_buf.close()
        out: dict = {"kib": kib, "ucx": ucx, "paths": paths, **{k: med(r[k] for r in reps) for k in reps[0]}}
        # per repetition: pdkv over NIXL against bare NIXL doing the same writes from the same source
        same = "nixl vram" if a.gpu else "nixl"
        out["ratio"] = med(r[same] / r["bare"] for r in reps)
        out["ratio_per_write"] = med(r[same] / r["bare per-write"] for r in reps)
        # the phases of the timed repetitions (the warm-up's dropped), medians in ms
        out["phases_ms"] = {
            k: [round(med(p[i] for p in v[-a.reps :]) * 1e3, 2) for i in range(3)] for k, v in phases.items()
        }
        out["bare_ms"] = round(NREQ * per * bb / out["bare"] * 1e3, 2)
        if a.gpu:
            out["staged_vs_vram"] = med(r["nixl"] / r["nixl vram"] for r in reps)
        return out
    finally:
        for tx in txs.values():
            tx.close()
        if bare is not None:
            bare.close()
        if gptr:
            _ffi.cuda.free(gptr)
        stop_decode(child)


# label -> (transport, PrefillSender keywords); "nixl" is what transport="nixl" does by default
ROWS_HOST: dict[str, tuple[str, dict]] = {"nixl": ("nixl", {}), "tcp": ("tcp", {}), "shm": ("shm", {})}
ROWS_GPU: dict[str, tuple[str, dict]] = {
    "nixl": ("nixl", {}),  # staged on a host without an RDMA device
    "nixl vram": ("nixl", {"gpudirect": "require"}),
    "tcp": ("tcp", {}),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--sizes-kib", default="128,1024")
    ap.add_argument("--ucx", default="tcp,cma")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gpu", action="store_true", help="send from a cache in GPU memory (device 0)")
    a = ap.parse_args()
    if not _ffi.nixl.available():
        print("bench_nixl.py needs NIXL: pip install 'pdkv[nixl]'", file=sys.stderr)
        return 2
    if a.gpu and _ffi.cuda.device_count() == 0:
        print("bench_nixl.py --gpu needs a CUDA device", file=sys.stderr)
        return 2
    src = "GPU memory (device 0)" if a.gpu else "host memory"
    print(f"{a.gib:g} GiB per run from {src}, {NREQ} requests, random destination order, every byte verified; GiB/s")
    if a.gpu:
        head = f"{'bare VRAM':>10} {'pdkv VRAM':>10} {'ratio':>6} {'pdkv staged':>12} {'staged/VRAM':>12}"
        head += f" {'pdkv tcp':>9}"
    else:
        head = f"{'bare NIXL':>10} {'pdkv nixl':>10} {'ratio':>6} {'bare/write':>11} {'ratio':>6}"
        head += f" {'pdkv tcp':>9} {'pdkv shm':>9}"
    print(f"{'KiB':>6} {'UCX':>7} {head}", flush=True)
    rows = []
    g = 1 << 30
    for ucx in a.ucx.split(","):
        for kib in map(int, a.sizes_kib.split(",")):
            r = run(kib, ucx, a)
            rows.append(r)
            if a.gpu:
                cells = (
                    f"{r['bare'] / g:>10.2f} {r['nixl vram'] / g:>10.2f} {r['ratio']:>6.2f} {r['nixl'] / g:>12.2f}"
                    f" {r['staged_vs_vram']:>12.2f} {r['tcp'] / g:>9.2f}"
                )
            else:
                cells = (
                    f"{r['bare'] / g:>10.2f} {r['nixl'] / g:>10.2f} {r['ratio']:>6.2f}"
                    f" {r['bare per-write'] / g:>11.2f} {r['ratio_per_write']:>6.2f}"
                    f" {r['tcp'] / g:>9.2f} {r['shm'] / g:>9.2f}"
                )
            print(f"{kib:>6} {ucx:>7} {cells}", flush=True)
            ph = r["phases_ms"].get("nixl vram" if a.gpu else "nixl")
            if ph:
                print(
                    f"{'':>14} pdkv nixl, ms: handing over {ph[0]}, the layer's writes {ph[1]}, outcomes {ph[2]}"
                    f" (bare NIXL's write: {r['bare_ms']})",
                    flush=True,
                )
    if a.gpu:
        print(f"(medians of repetitions; pdkv staged: {rows[0]['paths']['nixl']}, what auto picks here;")
        print(" ratio: pdkv with NIXL's VRAM source / bare NIXL doing the same writes; staged/VRAM: pdkv's staged")
        print(" path / pdkv with NIXL's VRAM source; both per repetition)")
    else:
        print(
            "(medians of repetitions; ratio: per repetition, pdkv nixl / bare NIXL, same writes, same buffer;"
            " bare NIXL: prepared lists, bare/write: a list built per write)"
        )
    print(json.dumps({"min_ratio": round(min(r["ratio"] for r in rows), 3), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
