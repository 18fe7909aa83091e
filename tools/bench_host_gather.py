#!/usr/bin/env python3
"""How fast the host can gather a swap call's scattered buffer blocks into one pinned
staging area: the first leg of the gather path (host gather, one contiguous copy-engine
copy, a GPU-side scatter) that would move small blocks to the GPU at the link's rate
without SMs. Prints, per block size, the gather's GB/s with 1-12 threads of pdkv's
streaming copy loop (``_ffi.cpu``; pieces in grant order and sorted by source address),
numpy's ``take`` on one thread, and the contiguous host->GPU copy of the same bytes (the
link, the leg after it) measured in the same run.

Needs a CUDA GPU and torch (for pinned memory and the copy).
    python tools/bench_host_gather.py [--sizes-kib 16,64] [--blocks 4096]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import numpy as np
from _bench import torch_with_cuda

import pdkv
from pdkv import _ffi


def rate(nbytes: int, fn, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return nbytes / float(np.median(ts[1:])) / 1e9


def gather_rate(src, dst, ln, threads: int) -> float:
    """GB/s of the streaming copy loop moving every piece, shared among ``threads``."""
    n = int(ln.size)
    cuts = [i * n // threads for i in range(threads + 1)]
    parts = list(zip(cuts[:-1], cuts[1:]))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:

        def run() -> None:
            list(pool.map(lambda ab: _ffi.cpu.gather(src[ab[0] : ab[1]], dst[ab[0] : ab[1]], ln[ab[0] : ab[1]]), parts))

        return rate(int(ln.sum()), run)


def take_rate(buf, stage, s, block: int) -> float:
    view, out = np.frombuffer(buf.buf, dtype=np.uint8).reshape(-1, block), stage.numpy()
    return rate(out.nbytes, lambda: np.take(view, s, axis=0, out=out), reps=3)


def link_rate(torch, stage) -> float:
    gpu = torch.empty(stage.shape, dtype=torch.uint8, device="cuda")

    def h2d() -> None:
        gpu.copy_(stage, non_blocking=True)
        torch.cuda.synchronize()

    return rate(stage.numel(), h2d)


def one_size(torch, kib: int, n: int, threads: list[int]) -> None:
    block = kib << 10
    buf = pdkv.SharedBuffer.create(2 * n * block, require_pinned=True)
    stage = torch.empty((n, block), dtype=torch.uint8, pin_memory=True)
    s = np.random.default_rng(0).permutation(2 * n)[:n]
    src = buf.address + s.astype(np.int64) * block
    dst = stage.data_ptr() + np.arange(n, dtype=np.int64) * block
    ln = np.full(n, block, np.int64)
    order = np.argsort(src)
    for th in threads:
        g1 = gather_rate(src, dst, ln, th)
        g2 = gather_rate(src[order], dst[order], ln, th)
        print(f"{kib:>4} {th:>7} {g1:>16.1f} {g2:>14.1f}", flush=True)
    take = take_rate(buf, stage, s, block)
    link = link_rate(torch, stage)
    print(f"{kib:>4} np.take (1 thread) {take:.1f} GB/s; contiguous host->GPU copy (the link) {link:.1f} GB/s")
    del stage
    buf.close()
    buf.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="16,64")
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--threads", default="1,2,4,8,12")
    a = ap.parse_args()
    torch = torch_with_cuda("bench_host_gather")
    if torch is None:
        return 2
    if not _ffi.cpu.available():
        print(f"pdkv's streaming copy loop is unavailable: {_ffi.cpu.unavailable_reason()}")
        return 2
    print(
        f"{torch.cuda.get_device_name(0)}; {a.blocks} scattered blocks a call, from a pinned buffer of {2 * a.blocks}"
    )
    print(f"{'KiB':>4} {'threads':>7} {'grant order GB/s':>16} {'by source GB/s':>14}")
    for kib in [int(x) for x in a.sizes_kib.split(",")]:
        one_size(torch, kib, a.blocks, [int(x) for x in a.threads.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
