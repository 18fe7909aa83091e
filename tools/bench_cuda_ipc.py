#!/usr/bin/env python3
"""cuda_ipc transport bandwidth: prefill's GPU cache -> decode's GPU cache, two processes.

For each block size, 1 GiB moves from this (prefill) process's GPU cache into a decode
process's GPU blocks over the cuda_ipc transport, in random order (a random permutation
of source blocks into the granted blocks, so nothing coalesces), and decode verifies every
block afterwards (each source block holds a pattern made of its own id). Measured in the
same run, in this process: one contiguous device-to-device copy of the same bytes (the
ceiling) and the swap engine's kernel doing the same scattered copy with no transport
(the bare copy). The clock runs from handing the layer to the sender until every
request's outcome is back; grants are taken before.

With --decode-device N the decode process's cache is on GPU N while prefill's stays on
GPU 0: the transport writes over the peer link, and the ceiling and the bare copy also go
from GPU 0 into GPU N's memory.

Needs a CUDA GPU and torch.   python tools/bench_cuda_ipc.py [--sizes-kib 32,128,1024] [--decode-device 1]
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
from _bench import send_and_wait, torch_with_cuda

import pdkv


def layout_for(kib: int) -> pdkv.KVLayout:
    return pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=kib, dtype="bf16", mla=True)


def pattern(torch, nb: int, bb: int, blocks=None):
    """int64 words: block id in the high half, word index in the low half."""
    ids = torch.arange(nb, device="cuda", dtype=torch.int64) if blocks is None else blocks
    return (ids[:, None] << 32) | torch.arange(bb // 8, device="cuda", dtype=torch.int64)[None, :]


def decode_main(a: argparse.Namespace) -> None:
    import torch

    lay = layout_for(a.kib)
    nb = (a.gib << 30) // lay.block_bytes
    torch.cuda.set_device(a.decode_device)
    gpu = torch.zeros(nb * lay.block_bytes, dtype=torch.uint8, device="cuda")
    gspec = pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr(), device=a.decode_device)
    buf = pdkv.SharedBuffer.create(pdkv.CacheSpec.buffer_bytes(lay, 1))
    sched = pdkv.DecodeScheduler(
        num_layers=1, gpu=pdkv.BlockPool(nb), options=pdkv.SchedulerOptions(direct_to_gpu=True, lease_s=60)
    )
    rx = pdkv.DecodeReceiver(sched, [lay], [buf], 1, transports=("cuda_ipc",), gpu_caches=[gspec], auto_tick=True)
    print(json.dumps({"control": rx.control_address}), flush=True)
    try:
        for line in sys.stdin:  # "finish" requests, or verify {dst block: src block}
            cmd = json.loads(line)
            if cmd["op"] == "finish":  # the engine's part: take the ready requests, free their blocks
                deadline = time.monotonic() + 30
                while sched.live_requests() and time.monotonic() < deadline:
                    for r in sched.take_ready():
                        sched.finish(r.request_id)
                    time.sleep(0.001)
                print(json.dumps({"ok": not sched.live_requests()}), flush=True)
            elif cmd["op"] == "verify":
                torch.cuda.synchronize()
                d = torch.tensor(cmd["dst"], device="cuda")
                s = torch.tensor(cmd["src"], device="cuda")
                got = gpu.view(torch.int64).view(nb, -1)[d]
                print(json.dumps({"ok": bool(torch.equal(got, pattern(torch, nb, lay.block_bytes, s)))}), flush=True)
            else:
                break
    finally:
        rx.close()
        buf.close()
        buf.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-kib", default="32,128,1024")
    ap.add_argument("--gib", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-device", type=int, default=0, help="decode's GPU (prefill uses GPU 0)")
    ap.add_argument("--role", default="prefill", help=argparse.SUPPRESS)
    ap.add_argument("--kib", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch = torch_with_cuda("bench_cuda_ipc")
    if torch is None:
        return 2
    if a.role == "decode":
        decode_main(a)
        return 0
    from pdkv.swap.engine import SwapEngine, plan_copy

    rows, out = [], {}

    def one_size(kib):
        """Measure one block size into ``rows`` and ``out`` (decode in a child process)."""
        lay = layout_for(kib)
        bb = lay.block_bytes
        nb = (a.gib << 30) // bb
        total = nb * bb
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "decode",
                "--kib",
                str(kib),
                "--gib",
                str(a.gib),
                "--decode-device",
                str(a.decode_device),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

        def ask(cmd):
            child.stdin.write(json.dumps(cmd) + "\n")
            child.stdin.flush()
            return json.loads(child.stdout.readline())

        try:
            info = json.loads(child.stdout.readline())
            src = pattern(torch, nb, bb).view(torch.uint8).view(-1)
            spec = pdkv.CacheSpec.for_buffer(lay, nb, src.data_ptr(), device=0)
            # the ceiling's and the bare copy's destination: on decode's GPU
            local = torch.empty_like(src, device=f"cuda:{a.decode_device}")
            lspec = pdkv.CacheSpec.for_buffer(lay, nb, local.data_ptr())
            if a.decode_device != 0:
                pdkv.native.cuda.enable_peer_access(a.decode_device)  # the bare kernel writes GPU N's memory
            perm = np.random.default_rng(kib).permutation(nb)
            nreq, per = 16, nb // 16
            tx = pdkv.PrefillSender(lay, spec, info["control"], transport="cuda_ipc", timeout_s=60, instance="bench")
            eng = SwapEngine(spec, lspec)
            counter = [0]

            def sync():
                for d in {0, a.decode_device}:
                    torch.cuda.synchronize(d)

            def ceiling():
                sync()
                t0 = time.perf_counter()
                local.copy_(src)
                sync()
                return total / (time.perf_counter() - t0)

            plan = plan_copy(spec, lspec, perm[: nreq * per], np.arange(nreq * per))

            def bare():
                sync()
                t0 = time.perf_counter()
                eng.copy_plan(plan, direction="d2d").wait(60)
                return nreq * per * bb / (time.perf_counter() - t0)

            def transfer():
                counter[0] += 1
                rids = [f"r{counter[0]}-{i}" for i in range(nreq)]
                grants = [tx.reserve(r, per * lay.tokens_per_block) for r in rids]
                assert all(g.location == "gpu" for g in grants)
                dt = send_and_wait(tx, [(r, perm[i * per : (i + 1) * per].tolist()) for i, r in enumerate(rids)])
                dst = [b for g in grants for b in g.blocks]
                if not ask({"op": "verify", "dst": dst, "src": perm[: nreq * per].tolist()})["ok"]:
                    raise SystemExit(f"VERIFY FAILED: cuda_ipc {kib} KiB")
                if not ask({"op": "finish"})["ok"]:
                    raise SystemExit("decode did not finish the requests")
                return nreq * per * bb / dt

            ceiling(), bare(), transfer()  # warm-up
            reps = [(ceiling(), transfer(), bare()) for _ in range(a.reps)]
            med = statistics.median
            res = {
                "ipc": med(r[1] for r in reps),
                "ceiling": med(r[0] for r in reps),
                "bare": med(r[2] for r in reps),
                "ratio": med(r[1] / r[0] for r in reps),
                "vs_bare": med(r[1] / r[2] for r in reps),
            }
            out[kib] = res
            rows.append((kib, res))
            tx.close()
            eng.close()
            child.stdin.write(json.dumps({"op": "quit"}) + "\n")
            child.stdin.flush()
            child.wait(30)
        finally:
            child.kill()
            child.wait(10)
            from pdkv.buffer.sweeper import clean_segments

            clean_segments(dry_run=False, tag=os.environ.get("PDKV_SHM_TAG") or None)

    for kib in [int(x) for x in a.sizes_kib.split(",")]:
        one_size(kib)
    where = "one GPU" if a.decode_device == 0 else f"prefill on GPU 0, decode on GPU {a.decode_device}"
    print(f"{a.gib} GiB per run, {where}, random order, every block verified by decode; GB/s (ratio)")
    print(f"{'KiB':>6} {'cuda_ipc':>16} {'bare kernel copy':>17} {'D2D ceiling':>12}")
    for kib, r in rows:
        print(
            f"{kib:>6} {r['ipc'] / 1e9:>9.1f} ({r['ratio']:.2f}) {r['bare'] / 1e9:>10.1f} ({r['vs_bare']:.2f}) "
            f"{r['ceiling'] / 1e9:>12.1f}"
        )
    print(
        "(medians; cuda_ipc ratio to the ceiling, and in the second column its ratio to the bare copy. "
        "ceiling: one contiguous device-to-device copy of the same bytes in one process)"
    )
    print(
        json.dumps(
            {
                "ipc_vs_ceiling_min": round(min(r["ratio"] for r in out.values()), 3),
                "ipc_vs_bare_min": round(min(r["vs_bare"] for r in out.values()), 3),
                "ipc_GBps": {str(k): round(r["ipc"] / 1e9, 1) for k, r in out.items()},
                "decode_device": a.decode_device,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
