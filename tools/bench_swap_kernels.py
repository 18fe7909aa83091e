#!/usr/bin/env python3
"""The swap kernel's shape against the link: variants of pdkv's gather/scatter kernel on
the same scattered-block plan, each against one contiguous copy of the same bytes (the
ceiling) measured in the same run.

pdkv's swap kernel (``pdkv.swap.kernels``) reads pinned host memory from the GPU (host to
GPU) or writes it (GPU to host), one CTA of 512 threads per piece, four 16-byte loads of a
thread in flight before its stores. This sweeps what could limit that: threads per CTA
(256, 512, 1024), loads in flight per thread (4, 8) and CTAs per piece (1, 2, 4), and
prints each as a fraction of the ceiling: if every shape gives the same figure, the limit
is the path (GPU reads of host memory over PCIe), not the kernel. Median of 5 timings of
16 launches of ``--blocks`` random blocks out of pools twice as large.

Needs a CUDA GPU and torch.  python tools/bench_swap_kernels.py [--sizes-kib 16,32,64] [--blocks 4096]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from _bench import torch_with_cuda

from pdkv import _ffi
from pdkv.swap.kernels import KERNEL_SOURCE

# pdkv's kernel with its shape as parameters: UNR loads in flight a thread, `split` CTAs a
# piece (each a contiguous 1/split of it)
VARIANT = r"""
extern "C" __global__ void __launch_bounds__(1024)
copy_variant(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
             const unsigned long long* __restrict__ len, long long n, int split)
{
    for (long long q = blockIdx.x; q < n * split; q += gridDim.x) {
        long long i = q / split; int part = (int)(q % split);
        unsigned long long L = len[i] / split;
        const uint4* s4 = (const uint4*)((const char*)src[i] + part * L);
        uint4* d4 = (uint4*)((char*)dst[i] + part * L);
        long long n4 = (long long)(L >> 4), bd = blockDim.x;
        for (long long base = threadIdx.x; base < n4; base += UNR * bd) {
            uint4 r[UNR];
            #pragma unroll
            for (int k = 0; k < UNR; k++) { long long j = base + k * bd; if (j < n4) r[k] = s4[j]; }
            #pragma unroll
            for (int k = 0; k < UNR; k++) { long long j = base + k * bd; if (j < n4) d4[j] = r[k]; }
        }
    }
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="16,32,64")
    ap.add_argument("--blocks", type=int, default=4096)
    a = ap.parse_args()
    torch = torch_with_cuda("bench_swap_kernels")
    if torch is None:
        return 2
    cu = _ffi.cuda
    torch.cuda.set_device(0)
    n, pool = a.blocks, 2 * a.blocks
    rng = np.random.default_rng(0)
    stream = torch.cuda.current_stream().cuda_stream
    t0, t1 = cu.event_create(True), cu.event_create(True)
    shapes = [(u, t, s) for u in (4, 8) for t in (256, 512, 1024) for s in (1, 2, 4)]
    kernels = {u: cu.compile_kernel(VARIANT.replace("UNR", str(u)), "copy_variant", 0) for u in (4, 8)}
    pdkv_kernel = cu.compile_kernel(KERNEL_SOURCE, "pdkv_copy", 0)
    out: dict[str, dict[str, float]] = {}
    print(f"{n} scattered blocks a launch; GB/s of pdkv's kernel, and each shape's fraction of the ceiling")
    print(f"{'KiB':>4} {'dir':>4} {'ceiling':>8} {'pdkv':>13} {'best shape':>24} {'worst shape':>24}")
    for kib in (int(x) for x in a.sizes_kib.split(",")):
        size = kib << 10
        host = torch.empty(pool * size, dtype=torch.uint8, pin_memory=True)
        host.random_(0, 255)
        gpu = torch.empty(pool * size, dtype=torch.uint8, device="cuda")
        hs = host.data_ptr() + rng.choice(pool, n, replace=False).astype(np.uint64) * size
        gs = gpu.data_ptr() + rng.choice(pool, n, replace=False).astype(np.uint64) * size
        total = n * size

        def rate(fn, total=total, reps=16):
            fn()
            got = []
            for _ in range(5):
                cu.event_record(t0, stream)
                for _ in range(reps):
                    fn()
                cu.event_record(t1, stream)
                cu.event_synchronize(t1)
                got.append(total * reps / (cu.event_elapsed_ms(t0, t1) / 1e3) / 1e9)
            return float(np.median(got))

        for direction in ("h2d", "d2h"):
            s, d = (hs, gs) if direction == "h2d" else (gs, hs)
            desc = torch.from_numpy(np.concatenate([s, d, np.full(n, size, np.uint64)]).view(np.int64)).cuda()
            args = [("ptr", desc.data_ptr()), ("ptr", desc.data_ptr() + 8 * n), ("ptr", desc.data_ptr() + 16 * n)]
            hp, gp = host.data_ptr(), gpu.data_ptr()
            big_s, big_d = (hp, gp) if direction == "h2d" else (gp, hp)

            def ceiling_copy(big_s=big_s, big_d=big_d, total=total):
                cu.memcpy_async(big_d, big_s, total, stream)

            def pdkv_launch(args=args):
                cu.launch(pdkv_kernel, n, 512, [*args, ("i64", n)], stream)

            ceiling = rate(ceiling_copy)
            mine = rate(pdkv_launch)
            fr = {}
            for u, t, sp in shapes:

                def variant(u=u, t=t, sp=sp, args=args):
                    cu.launch(kernels[u], n * sp, t, [*args, ("i64", n), ("i32", sp)], stream)

                fr[f"{u} loads x {t} threads x {sp} CTA"] = rate(variant) / ceiling
            best = max(fr, key=fr.__getitem__)
            worst = min(fr, key=fr.__getitem__)
            print(
                f"{kib:4d} {direction:>4} {ceiling:8.1f} {mine:6.1f} ({mine / ceiling:.3f}) "
                f"{fr[best]:.3f} {best:>18} {fr[worst]:.3f} {worst:>18}",
                flush=True,
            )
            out[f"{kib}_{direction}"] = {"ceiling_GBps": round(ceiling, 1), "pdkv": round(mine / ceiling, 3)} | {
                k: round(v, 3) for k, v in fr.items()
            }
        del host, gpu
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
