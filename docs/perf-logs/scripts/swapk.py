"""Exploratory: swap-kernel block shapes and where its descriptors live (uploaded in the
copy's stream per call, already in device memory, read from pinned host memory), kernel and
batch strategies of SwapEngine, 16 calls back to back, 16-128 KiB blocks. The figures in the
comments of pdkv/swap.py (descriptor placement, the copy-engine thresholds) come from its run,
../h200-kernel-variants-and-descriptors-s2.log (made before the side-stream upload existed).
Run on the GPU host: python docs/perf-logs/scripts/swapk.py"""
import time, statistics
import numpy as np
import pdkv
from pdkv import _ffi
from pdkv.swap import plan_copy
cu = _ffi.cuda
from cuda.bindings import runtime as rt  # stream-ordered allocation, which pdkv no longer uses
cu.set_device(0)

def src_block(name, T, U):
    return r"""
extern "C" __global__ void __launch_bounds__(%d) %s(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
          const unsigned long long* __restrict__ len, long long n) {
    for (long long i = blockIdx.x; i < n; i += gridDim.x) {
        const uint4* s4 = (const uint4*)src[i]; uint4* d4 = (uint4*)dst[i];
        long long n4 = (long long)(len[i] >> 4), bd = %d;
        for (long long base = threadIdx.x; base < n4; base += %d * bd) {
            uint4 r[%d];
            #pragma unroll
            for (int k = 0; k < %d; k++) { long long j = base + k * bd; if (j < n4) r[k] = s4[j]; }
            #pragma unroll
            for (int k = 0; k < %d; k++) { long long j = base + k * bd; if (j < n4) d4[j] = r[k]; }
        }
    }
}""" % (T, name, T, U, U, U, U)

def src_warp(name, T, U):
    return r"""
extern "C" __global__ void __launch_bounds__(%d) %s(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
          const unsigned long long* __restrict__ len, long long n) {
    int lane = threadIdx.x & 31;
    long long w = (long long)blockIdx.x * (%d / 32) + threadIdx.x / 32, nw = (long long)gridDim.x * (%d / 32);
    for (long long i = w; i < n; i += nw) {
        const uint4* s4 = (const uint4*)src[i]; uint4* d4 = (uint4*)dst[i];
        long long n4 = (long long)(len[i] >> 4);
        for (long long base = lane; base < n4; base += %d * 32) {
            uint4 r[%d];
            #pragma unroll
            for (int k = 0; k < %d; k++) { long long j = base + k * 32; if (j < n4) r[k] = s4[j]; }
            #pragma unroll
            for (int k = 0; k < %d; k++) { long long j = base + k * 32; if (j < n4) d4[j] = r[k]; }
        }
    }
}""" % (T, name, T, T, U, U, U, U)

N = 4096
REPS = 16
rng = np.random.default_rng(0)
out = {}
for kib in (16, 32, 64, 128):
    size = kib << 10
    T = size // 1024
    lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=T, dtype="bf16", mla=True)
    nb = 2 * N
    buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
    hv = np.frombuffer(buf.buf, np.uint8)
    hv[:] = rng.integers(0, 256, hv.size, dtype=np.uint8)
    dev = cu.malloc(nb * size)
    bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address)
    gspec = pdkv.CacheSpec.for_buffer(lay, nb, dev)
    sb = rng.permutation(nb)[:N]; db = rng.permutation(nb)[:N]
    s = cu.stream_create()
    total = N * size
    # ceiling
    def wall(fn):
        fn(); cu.stream_synchronize(s)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter(); fn(); cu.stream_synchronize(s); ts.append(time.perf_counter() - t0)
        return total * REPS / statistics.median(ts) / 1e9
    ceil_h2d = wall(lambda: [cu.memcpy_async(dev, buf.address, total, s) for _ in range(REPS)])
    ceil_d2h = wall(lambda: [cu.memcpy_async(buf.address, dev, total, s) for _ in range(REPS)])
    res = {"ceil_h2d": ceil_h2d, "ceil_d2h": ceil_d2h}
    for direction in ("h2d", "d2h"):
        plan = plan_copy(bspec, gspec, sb, db) if direction == "h2d" else plan_copy(gspec, bspec, db, sb)
        cp = plan.chunked()
        n = cp.pieces
        desc = np.concatenate([cp.src, cp.dst, cp.lengths])
        hdesc = cu.malloc_host(desc.nbytes)
        _ffi.libc.host_view(hdesc, desc.nbytes)[:] = desc.view(np.uint8)
        ddesc = cu.malloc(desc.nbytes)
        cu.memcpy(ddesc, hdesc, desc.nbytes)
        variants = {}
        for T_, U_ in ((512, 4), (256, 4), (256, 8), (128, 8), (1024, 2)):
            variants[f"blk{T_}x{U_}"] = (src_block(f"kb{T_}_{U_}", T_, U_), f"kb{T_}_{U_}", T_, False)
        for T_, U_ in ((256, 4), (256, 8), (512, 8)):
            variants[f"warp{T_}x{U_}"] = (src_warp(f"kw{T_}_{U_}", T_, U_), f"kw{T_}_{U_}", T_, True)
        for vname, (source, fname, T_, warp) in variants.items():
            fn = cu.compile_kernel(source, fname, 0)
            grid = n if not warp else min((n + T_ // 32 - 1) // (T_ // 32), 132 * 64)
            for mode in ("devdesc_copy", "devdesc_pre", "hostdesc"):
                if mode != "devdesc_pre" and vname not in ("blk512x4", "blk256x8", "warp256x8", "warp512x8"):
                    continue
                def go():
                    for _ in range(REPS):
                        if mode == "devdesc_copy":
                            d = int(rt.cudaMallocAsync(desc.nbytes, s)[1])
                            cu.memcpy_async(d, hdesc, desc.nbytes, s)
                        elif mode == "devdesc_pre":
                            d = ddesc
                        else:
                            d = hdesc
                        cu.launch(fn, grid, T_, [("ptr", d), ("ptr", d + 8 * n), ("ptr", d + 16 * n), ("i64", n)], s)
                        if mode == "devdesc_copy":
                            rt.cudaFreeAsync(d, s)
                res[f"{direction} {vname} {mode}"] = wall(go)
        # the engine as it is
        eng = pdkv.SwapEngine(bspec, gspec, strategy="kernel")
        a_, b_ = (sb, db) if direction == "h2d" else (db, sb)
        def eng_go():
            hs = [eng.copy(a_, b_, direction=direction) for _ in range(REPS)]
            for h in hs: h.wait(60)
        res[f"{direction} engine-kernel"] = wall(eng_go)
        eng.close()
        eng = pdkv.SwapEngine(bspec, gspec, strategy="batch")
        res[f"{direction} engine-batch"] = wall(eng_go)
        eng.close()
        cu.free_host(hdesc); cu.free(ddesc)
    for k, v in res.items():
        c = res["ceil_" + k.split()[0]] if not k.startswith("ceil") else v
        print(f"{kib:>4} {k:<32} {v:6.1f} {v / c:.3f}", flush=True)
    out[kib] = res
    cu.free(dev); cu.stream_destroy(s)
    del hv
    buf.close(); buf.unlink()
