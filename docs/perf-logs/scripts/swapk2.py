"""Exploratory: kernel-only throughput of the swap kernel's loop with six load variants and
two block shapes, 4096 scattered blocks, 16 launches back to back, descriptors already in
device memory. Produced ../h200-kernel-load-variants-s2.log.
Run on the GPU host: python docs/perf-logs/scripts/swapk2.py"""
import time, statistics
import numpy as np
import pdkv
from pdkv import _ffi
from pdkv.swap import plan_copy
cu = _ffi.cuda
cu.set_device(0)

def src(name, T, U, load):
    return r"""
__device__ __forceinline__ uint4 ld(const uint4* p) {
    uint4 r;
    %s
    return r;
}
extern "C" __global__ void __launch_bounds__(%d) %s(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
          const unsigned long long* __restrict__ len, long long n) {
    for (long long i = blockIdx.x; i < n; i += gridDim.x) {
        const uint4* s4 = (const uint4*)src[i]; uint4* d4 = (uint4*)dst[i];
        long long n4 = (long long)(len[i] >> 4), bd = %d;
        for (long long base = threadIdx.x; base < n4; base += %d * bd) {
            uint4 r[%d];
            #pragma unroll
            for (int k = 0; k < %d; k++) { long long j = base + k * bd; if (j < n4) r[k] = ld(s4 + j); }
            #pragma unroll
            for (int k = 0; k < %d; k++) { long long j = base + k * bd; if (j < n4) d4[j] = r[k]; }
        }
    }
}""" % (load, T, name, T, U, U, U, U)

LOADS = {
    "plain": "r = *p;",
    "nc": 'asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));',
    "L2_128": 'asm volatile("ld.global.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));',
    "L2_256": 'asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));',
    "nc_L1na_L2_256": 'asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));',
    "cs": 'asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));',
}
N, REPS = 4096, 16
rng = np.random.default_rng(0)
for kib in (16, 32, 64):
    size = kib << 10
    lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=size // 1024, dtype="bf16", mla=True)
    nb = 2 * N
    buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
    hv = np.frombuffer(buf.buf, np.uint8); hv[:] = rng.integers(0, 256, hv.size, dtype=np.uint8)
    dev = cu.malloc(nb * size)
    bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address); gspec = pdkv.CacheSpec.for_buffer(lay, nb, dev)
    sb = rng.permutation(nb)[:N]; db = rng.permutation(nb)[:N]
    s = cu.stream_create(); total = N * size
    def wall(fn):
        fn(); cu.stream_synchronize(s); ts = []
        for _ in range(5):
            t0 = time.perf_counter(); fn(); cu.stream_synchronize(s); ts.append(time.perf_counter() - t0)
        return total * REPS / statistics.median(ts) / 1e9
    ceil = wall(lambda: [cu.memcpy_async(dev, buf.address, total, s) for _ in range(REPS)])
    cp = plan_copy(bspec, gspec, sb, db).chunked(); n = cp.pieces
    desc = np.concatenate([cp.src, cp.dst, cp.lengths]); ddesc = cu.malloc(desc.nbytes)
    cu.memcpy(ddesc, desc.ctypes.data, desc.nbytes)
    for lname, load in LOADS.items():
        for T_, U_ in ((512, 4), (256, 8)):
            nm = f"k_{lname}_{T_}"
            try:
                fn = cu.compile_kernel(src(nm, T_, U_, load), nm, 0)
            except Exception as e:
                print(kib, lname, "compile failed", str(e)[:200]); continue
            bw = wall(lambda: [cu.launch(fn, n, T_, [("ptr", ddesc), ("ptr", ddesc + 8 * n), ("ptr", ddesc + 16 * n), ("i64", n)], s) for _ in range(REPS)])
            print(f"{kib:>4} h2d {lname:<16} {T_}x{U_} {bw:6.1f} {bw / ceil:.3f}", flush=True)
    # verify last
    out = np.empty(size, np.uint8); cu.memcpy(out.ctypes.data, dev + int(db[5]) * size, size)
    print("verify", np.array_equal(out, hv[int(sb[5]) * size:(int(sb[5]) + 1) * size]))
    cu.free(ddesc); cu.free(dev); del hv; buf.close(); buf.unlink()
