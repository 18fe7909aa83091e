#!/usr/bin/env python3
"""Buffer start-up and bandwidth: pdkv's create+populate+pin against the baseline
(single-thread ``MAP_POPULATE`` mmap + ``cudaHostRegister``), and host->GPU bandwidth
from the pdkv buffer against a ``cudaMallocHost`` buffer, in one run.

Needs a CUDA GPU and cuda-bindings.  python tools/bench_buffer.py [--gib 8]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time

import pdkv


def _chk(res):
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        print("bench_buffer needs cuda-bindings (pip install 'pdkv[cuda]') and a CUDA GPU", file=sys.stderr)
        return 2
    if rt.cudaGetDeviceCount()[1] in (None, 0):
        print("bench_buffer needs a CUDA GPU", file=sys.stderr)
        return 2
    _chk(rt.cudaSetDevice(0))
    _chk(rt.cudaFree(0))
    size = int(a.gib * (1 << 30))

    import ctypes  # the baseline only: pdkv itself keeps ctypes in pdkv/_ffi

    def baseline_once() -> tuple[float, float]:
        """One thread, mmap(MAP_POPULATE), then cudaHostRegister; everything undone after."""
        name = f"/dev/shm/pdkv-{os.getpid()}-baseline"
        t0 = time.perf_counter()
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            t1 = time.perf_counter()
            _chk(rt.cudaHostRegister(addr, size, rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped))
            t2 = time.perf_counter()
            _chk(rt.cudaHostUnregister(addr))
            mm.close()
        finally:
            os.close(fd)
            os.unlink(name)
        return t1 - t0, t2 - t1

    stripes: list[int] = []

    def pdkv_once() -> float:
        t0 = time.perf_counter()
        b = pdkv.SharedBuffer.create(size, require_pinned=True, populate_threads=a.threads)
        dt = time.perf_counter() - t0
        stripes.append(b.stripes)
        b.close()
        b.unlink()
        return dt

    # ABBA order: whichever runs first on fresh memory is not favoured; means of two each
    b1 = baseline_once()
    p1 = pdkv_once()
    p2 = pdkv_once()
    b2 = baseline_once()
    base_pop, base_pin = (b1[0] + b2[0]) / 2, (b1[1] + b2[1]) / 2
    pd_total = (p1 + p2) / 2

    t0 = time.perf_counter()
    hb = pdkv.SharedBuffer.create(size, require_pinned=True, populate_threads=a.threads, huge_pages=True)
    pd_huge = time.perf_counter() - t0
    hb.close()
    hb.unlink()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"

    sweep = {}
    for k in (1, 2, 4, 8, 16):  # population alone, by stripes (unpinned; threads = max(8, stripes))
        t0 = time.perf_counter()
        sb = pdkv.SharedBuffer.create(size, pin="never", populate_threads=a.threads, stripes=k)
        sweep[k] = time.perf_counter() - t0
        sb.close()
        sb.unlink()

    buf = pdkv.SharedBuffer.create(size, require_pinned=True, populate_threads=a.threads)

    # host -> GPU bandwidth: pdkv buffer against cudaMallocHost
    n = int(a.copy_gib * (1 << 30))
    dev = _chk(rt.cudaMalloc(n))
    mh = _chk(rt.cudaMallocHost(n))
    stream = _chk(rt.cudaStreamCreate())
    e0, e1 = _chk(rt.cudaEventCreate()), _chk(rt.cudaEventCreate())

    def bw(src):
        ts = []
        for i in range(a.reps + 1):
            _chk(rt.cudaEventRecord(e0, stream))
            _chk(rt.cudaMemcpyAsync(dev, src, n, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream))
            _chk(rt.cudaEventRecord(e1, stream))
            _chk(rt.cudaEventSynchronize(e1))
            if i:
                ts.append(_chk(rt.cudaEventElapsedTime(e0, e1)) / 1e3)
        return n / statistics.median(ts) / 1e9

    # from 512 MiB in: with stripes the copy spans stripe boundaries, as real copies do
    bw_pd, bw_mh = bw(buf.address + min(512 << 20, size - n)), bw(mh)
    _chk(rt.cudaFreeHost(mh))
    _chk(rt.cudaFree(dev))
    buf.close()
    buf.unlink()
    base_total = base_pop + base_pin
    print(f"{a.gib:g} GiB buffer")
    print(f"{'':<44}{'seconds':>10}")
    print(f"{'baseline: MAP_POPULATE (1 thread)':<44}{base_pop:>10.2f}")
    print(f"{'baseline: cudaHostRegister':<44}{base_pin:>10.2f}")
    print(f"{'baseline total':<44}{base_total:>10.2f}")
    print(
        f"{'pdkv SharedBuffer.create (populate + pin)':<44}{pd_total:>10.2f}   {base_total / pd_total:.2f}x faster"
        f"   ({stripes[0]} stripes, the default here)"
    )
    print(
        "(runs in order baseline, pdkv, pdkv, baseline: "
        f"{b1[0] + b1[1]:.2f}, {p1:.2f}, {p2:.2f}, {b2[0] + b2[1]:.2f} s)"
    )
    print(
        f"{'pdkv, huge_pages=True (shmem THP: ' + thp + ')':<44}{pd_huge:>10.2f}   {base_total / pd_huge:.2f}x faster"
    )
    print("population alone (unpinned), by stripes: " + ", ".join(f"{k}: {v:.2f} s" for k, v in sweep.items()))
    print(
        f"host->GPU {a.copy_gib:g} GiB: pdkv buffer {bw_pd:.1f} "
        f"GB/s, cudaMallocHost {bw_mh:.1f} GB/s ({bw_pd / bw_mh:.3f})"
    )
    print(
        json.dumps(
            {
                "speedup_vs_baseline": round(base_total / pd_total, 2),
                "h2d_vs_cudamallochost": round(bw_pd / bw_mh, 3),
                "pdkv_create_s": round(pd_total, 3),
                "pdkv_huge_pages_s": round(pd_huge, 3),
                "baseline_s": round(base_total, 3),
                "h2d_GBps": round(bw_pd, 1),
                "cudamallochost_GBps": round(bw_mh, 1),
                "stripes": stripes[0],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
