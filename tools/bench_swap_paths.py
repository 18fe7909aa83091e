#!/usr/bin/env python3
"""Other paths for the swap's scattered copy, each against the one-copy ceiling of the
same run: the copy engines fed through the driver directly (``cuMemcpyBatchAsync`` by
ctypes from numpy arrays, no per-piece Python), on one or several streams, with the CPU
time of the submission beside; Hopper's bulk-copy engine (TMA, ``cp.async.bulk``) moving
each piece through shared memory; and pdkv's kernel sharing the copy with the copy engines.

Needs a CUDA GPU (sm_90+ for the bulk-copy rows) and torch.
    python tools/bench_swap_paths.py [--sizes-kib 16,32,64,128] [--blocks 4096]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from _bench import torch_with_cuda

from pdkv import _ffi
from pdkv.swap.kernels import KERNEL_SOURCE

# one warp a CTA; lane 0 runs a STAGES-deep pipeline of bulk loads into shared memory and
# bulk stores out of it, CHUNK bytes a stage
TMA = r"""
extern "C" __global__ void __launch_bounds__(32)
tma_copy(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
         const unsigned long long* __restrict__ len, long long n)
{
    __shared__ __align__(128) unsigned char smem[STAGES * CHUNK];
    __shared__ __align__(8) unsigned long long bar[STAGES];
    if (threadIdx.x != 0) return;
    unsigned sb = (unsigned)__cvta_generic_to_shared(smem);
    unsigned bb = (unsigned)__cvta_generic_to_shared(bar);
    for (int s = 0; s < STAGES; s++)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bb + 8 * s) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    unsigned parity = 0;  // bit s: the phase stage s waits for next
    for (long long i = blockIdx.x; i < n; i += gridDim.x) {
        unsigned long long s0 = src[i], d0 = dst[i], L = len[i];
        long long nc = (long long)((L + CHUNK - 1) / CHUNK);
        for (long long k = 0; k < nc && k < STAGES; k++) {
            unsigned sz = (unsigned)(L - k * CHUNK < CHUNK ? L - k * CHUNK : CHUNK);
            unsigned b = bb + 8 * (unsigned)k, m = sb + (unsigned)k * CHUNK;
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(sz) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(m), "l"(s0 + k * CHUNK), "r"(sz), "r"(b) : "memory");
        }
        for (long long k = 0; k < nc; k++) {
            int s = (int)(k % STAGES);
            unsigned b = bb + 8 * s, m = sb + s * CHUNK;
            unsigned sz = (unsigned)(L - k * CHUNK < CHUNK ? L - k * CHUNK : CHUNK);
            unsigned ok = 0, ph = (parity >> s) & 1u;
            while (!ok)
                asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                             "selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(b), "r"(ph) : "memory");
            parity ^= 1u << s;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(d0 + k * CHUNK), "r"(m), "r"(sz) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            long long kn = k + STAGES;
            if (kn < nc) {
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                unsigned szn = (unsigned)(L - kn * CHUNK < CHUNK ? L - kn * CHUNK : CHUNK);
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(szn) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             :: "r"(m), "l"(s0 + kn * CHUNK), "r"(szn), "r"(b) : "memory");
            }
        }
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
}
"""


def driver_batch():
    """cuMemcpyBatchAsync handed numpy arrays by address: pdkv's own call
    (``pdkv._ffi.libcuda``, what its batch strategy runs), fn(dsts, srcs, sizes, stream)."""
    from pdkv._ffi import libcuda

    return libcuda.memcpy_batch_arrays, "cuMemcpyBatchAsync by address (pdkv._ffi.libcuda)"


def one_direction(torch, host, gpu, hi, gi, size, direction, rate, tma, batch, pdkv_kernel, streams, joins):
    """Every path on one block size and direction: {path: (GB/s, submit seconds)}, and the
    paths whose bytes came out wrong."""
    cu = _ffi.cuda
    main_stream = streams[0]
    n = hi.size
    hs, gs = host.data_ptr() + hi * size, gpu.data_ptr() + gi * size
    total = n * size
    lens = np.full(n, size, np.uint64)
    s, d = (hs, gs) if direction == "h2d" else (gs, hs)
    desc = torch.from_numpy(np.concatenate([s, d, lens]).view(np.int64)).cuda()
    dp = desc.data_ptr()
    kargs = [("ptr", dp), ("ptr", dp + 8 * n), ("ptr", dp + 16 * n)]
    big_s, big_d = (host.data_ptr(), gpu.data_ptr())
    if direction == "d2h":
        big_s, big_d = big_d, big_s
    res: dict[str, tuple[float, float]] = {}
    res["ceiling"] = rate(lambda: cu.memcpy_async(big_d, big_s, total, main_stream), total)
    res["pdkv kernel"] = rate(lambda: cu.launch(pdkv_kernel, n, 512, [*kargs, ("i64", n)], main_stream), total)
    sl, dl, ll = s.tolist(), d.tolist(), lens.tolist()
    res["batch (bindings)"] = rate(lambda: cu.memcpy_batch_async(dl, sl, ll, main_stream), total)

    def driver_on(k: int) -> None:
        # k streams, each a contiguous share, joined back into the main stream
        cu.event_record(joins[0], main_stream)
        for j in range(1, k):
            cu.stream_wait_event(streams[j], joins[0])
        for j in range(k):
            lo, hi_ = n * j // k, n * (j + 1) // k
            batch(d[lo:hi_], s[lo:hi_], lens[lo:hi_], streams[j])
        for j in range(1, k):
            cu.event_record(joins[j], streams[j])
            cu.stream_wait_event(main_stream, joins[j])

    def tma_launch(fn) -> None:
        cu.launch(fn, n, 32, [*kargs, ("i64", n)], main_stream)

    def split(frac: float) -> None:
        m = int(n * frac)  # the first m pieces by the copy engines, the rest by the kernel
        cu.event_record(joins[0], main_stream)
        cu.stream_wait_event(streams[1], joins[0])
        batch(d[:m], s[:m], lens[:m], streams[1])
        rest = [("ptr", dp + 8 * m), ("ptr", dp + 8 * (n + m)), ("ptr", dp + 8 * (2 * n + m)), ("i64", n - m)]
        cu.launch(pdkv_kernel, n - m, 512, rest, main_stream)
        cu.event_record(joins[1], streams[1])
        cu.stream_wait_event(main_stream, joins[1])

    for k in (1, 2, 4):
        res[f"batch (driver) x{k}"] = rate(lambda k=k: driver_on(k), total)
    for name, fn in tma.items():
        res[name] = rate(lambda fn=fn: tma_launch(fn), total)
    for frac in (0.25, 0.5):
        res[f"kernel + batch {frac:g}"] = rate(lambda frac=frac: split(frac), total)
    # the bytes of every new path: poison the destination, run once, compare
    hsv, gsv = host.view(-1, size), gpu.view(-1, size)
    srcv, dstv, si, di = (hsv, gsv, hi, gi) if direction == "h2d" else (gsv, hsv, gi, hi)
    checks = {"batch (driver) x4": lambda: driver_on(4), "kernel + batch 0.5": lambda: split(0.5)}
    checks.update({nm: (lambda fn=fn: tma_launch(fn)) for nm, fn in tma.items()})
    bad = []
    for nm, fn in checks.items():
        dstv[torch.from_numpy(di.astype(np.int64)).to(dstv.device)] = 0xEE
        torch.cuda.synchronize()
        fn()
        cu.stream_synchronize(main_stream)
        torch.cuda.synchronize()
        want = srcv[torch.from_numpy(si.astype(np.int64)).to(srcv.device)].cpu()
        got = dstv[torch.from_numpy(di.astype(np.int64)).to(dstv.device)].cpu()
        if not torch.equal(want, got):
            bad.append(nm)
    return res, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="16,32,64,128")
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=16)
    a = ap.parse_args()
    torch = torch_with_cuda("bench_swap_paths")
    if torch is None:
        return 2
    cu = _ffi.cuda
    torch.cuda.set_device(0)
    n, pool = a.blocks, 2 * a.blocks
    rng = np.random.default_rng(0)
    main_stream = cu.stream_create(True)
    streams = [main_stream] + [cu.stream_create(True) for _ in range(7)]
    t0e, t1e = cu.event_create(True), cu.event_create(True)
    joins = [cu.event_create() for _ in streams]
    pdkv_kernel = cu.compile_kernel(KERNEL_SOURCE, "pdkv_copy", 0)
    tma: dict[str, object] = {}
    for stages, chunk in ((2, 8192), (2, 16384), (4, 8192), (5, 8192), (8, 4096)):  # up to 40 KiB static
        src = TMA.replace("STAGES", str(stages)).replace("CHUNK", str(chunk))
        try:
            tma[f"tma {stages}x{chunk >> 10}K"] = cu.compile_kernel(src, "tma_copy", 0)
        except Exception as exc:  # an older GPU, or NVRTC refusing the PTX: say so, go on
            print(f"tma {stages}x{chunk}: {exc}")
    batch, which = driver_batch()
    print(f"driver batch entry: {which}")
    out: dict[str, dict] = {}

    def rate(fn, total, reps=a.reps):
        """GB/s of ``reps`` calls back to back on the main stream (others joined), median of 5,
        and the CPU seconds a call took to submit."""
        fn()
        torch.cuda.synchronize()
        got, cpu = [], []
        for _ in range(5):
            cu.event_record(t0e, main_stream)
            c0 = time.perf_counter()
            for _ in range(reps):
                fn()
            cpu.append((time.perf_counter() - c0) / reps)
            cu.event_record(t1e, main_stream)
            cu.event_synchronize(t1e)
            torch.cuda.synchronize()
            got.append(total * reps / (cu.event_elapsed_ms(t0e, t1e) / 1e3) / 1e9)
        return float(np.median(got)), float(np.median(cpu))

    print(f"{n} scattered blocks a call, {a.reps} calls back to back; GB/s (fraction of the ceiling), submit us/call")
    for kib in (int(x) for x in a.sizes_kib.split(",")):
        size = kib << 10
        host = torch.empty(pool * size, dtype=torch.uint8, pin_memory=True)
        host.random_(0, 255)
        gpu = torch.empty(pool * size, dtype=torch.uint8, device="cuda")
        gpu.random_(0, 255)
        hi = rng.choice(pool, n, replace=False).astype(np.uint64)
        gi = rng.choice(pool, n, replace=False).astype(np.uint64)
        for direction in ("h2d", "d2h"):
            res, bad = one_direction(
                torch, host, gpu, hi, gi, size, direction, rate, tma, batch, pdkv_kernel, streams, joins
            )
            ceil = res["ceiling"][0]
            line = " | ".join(f"{k} {v[0]:.1f} ({v[0] / ceil:.3f}) {v[1] * 1e6:.0f}us" for k, v in res.items())
            print(f"{kib:4d} KiB {direction}: {line}" + (f"  WRONG: {bad}" if bad else ""), flush=True)
            row = {k: [round(v[0], 2), round(v[0] / ceil, 3), round(v[1] * 1e6)] for k, v in res.items()}
            out[f"{kib}_{direction}"] = {**row, "wrong": bad}
        del host, gpu
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
