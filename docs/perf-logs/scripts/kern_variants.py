"""Kernel variants for scattered pinned-host <-> GPU block copies (H200 experiment)."""
import json, subprocess, sys, time
import numpy as np

K0 = None  # pdkv's kernel
K1 = r"""
extern "C" __global__ void __launch_bounds__(512)
k(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
  const unsigned long long* __restrict__ len, long long n)
{
    for (long long i = blockIdx.x; i < n; i += gridDim.x) {
        const char* s = (const char*)src[i]; char* d = (char*)dst[i];
        long long n4 = (long long)(len[i] >> 4), bd = blockDim.x;
        const uint4* s4 = (const uint4*)s; uint4* d4 = (uint4*)d;
        for (long long base = threadIdx.x; base < n4; base += 4 * bd) {
            uint4 r[4];
            #pragma unroll
            for (int k = 0; k < 4; k++) { long long j = base + k * bd; if (j < n4) {
                asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r[k].x), "=r"(r[k].y), "=r"(r[k].z), "=r"(r[k].w) : "l"(s4 + j)); } }
            #pragma unroll
            for (int k = 0; k < 4; k++) { long long j = base + k * bd; if (j < n4) d4[j] = r[k]; }
        }
    }
}
"""
K2 = r"""
extern "C" __global__ void __launch_bounds__(512)
k(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
  const unsigned long long* __restrict__ len, long long n)
{
    for (long long i = blockIdx.x; i < n; i += gridDim.x) {
        const char* s = (const char*)src[i]; char* d = (char*)dst[i];
        unsigned long long L = len[i];
        if (threadIdx.x == 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(s), "r"((unsigned)L) : "memory");
        __syncthreads();
        long long n4 = (long long)(L >> 4), bd = blockDim.x;
        const uint4* s4 = (const uint4*)s; uint4* d4 = (uint4*)d;
        for (long long base = threadIdx.x; base < n4; base += 4 * bd) {
            uint4 r[4];
            #pragma unroll
            for (int k = 0; k < 4; k++) { long long j = base + k * bd; if (j < n4) r[k] = s4[j]; }
            #pragma unroll
            for (int k = 0; k < 4; k++) { long long j = base + k * bd; if (j < n4) d4[j] = r[k]; }
        }
    }
}
"""
# TMA: bulk copy global -> shared (mbarrier), then shared -> global; one thread drives it
K3 = r"""
extern "C" __global__ void __launch_bounds__(32)
k(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
  const unsigned long long* __restrict__ len, long long n)
{
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    if (threadIdx.x != 0) return;
    unsigned sb = (unsigned)__cvta_generic_to_shared(&bar);
    unsigned sm = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sb) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    unsigned phase = 0;
    for (long long i = blockIdx.x; i < n; i += gridDim.x) {
        unsigned L = (unsigned)len[i];
        unsigned long long state;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;" : "=l"(state) : "r"(sb), "r"(L) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(sm), "l"(src[i]), "r"(L), "r"(sb) : "memory");
        unsigned ok = 0;
        while (!ok) {
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(ok) : "r"(sb), "r"(phase) : "memory");
        }
        phase ^= 1;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst[i]), "r"(sm), "r"(L) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

def run_variant(name, kib, direction, nblocks=4096, reps=64, threads=None):
    import torch
    from pdkv import _ffi
    from pdkv.swap import KERNEL_SOURCE
    src_code = {"K0": KERNEL_SOURCE, "K1": K1, "K2": K2, "K3": K3}[name]
    fname = "pdkv_copy" if name == "K0" else "k"
    torch.cuda.set_device(0)
    size = kib << 10
    nb = 2 * nblocks
    host = torch.empty(nb * size, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (nb * size,), dtype=torch.uint8))
    gpu = torch.empty(nb * size, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(1)
    sblk = rng.permutation(nb)[:nblocks]; dblk = rng.permutation(nb)[:nblocks]
    hb, gb = host.data_ptr(), gpu.data_ptr()
    if direction == "h2d":
        s = hb + sblk * size; d = gb + dblk * size; gpu.fill_(0xEE)
    else:
        s = gb + sblk * size; d = hb + dblk * size
        gpu.copy_(host.cuda()); host.fill_(0x55)
    torch.cuda.synchronize()
    desc = torch.tensor(np.concatenate([s, d, np.full(nblocks, size)]).astype(np.int64), device="cuda")
    fn = _ffi.cuda.compile_kernel(src_code, fname, 0)
    stream = torch.cuda.current_stream().cuda_stream
    thr = threads or (32 if name == "K3" else 512)
    shm = size if name == "K3" else 0
    if shm > 48 * 1024:
        from cuda.bindings import driver as drv
        drv.cuFuncSetAttribute(fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shm)
    p = desc.data_ptr()
    args = [("ptr", p), ("ptr", p + 8 * nblocks), ("ptr", p + 16 * nblocks), ("i64", nblocks)]
    go = lambda: _ffi.cuda.launch(fn, nblocks, thr, args, stream, shm)
    go(); torch.cuda.synchronize()
    # verify
    hv = host.view(nb, size); gv = gpu.view(nb, size)
    if direction == "h2d":
        ok = torch.equal(gv[torch.tensor(dblk, device="cuda")].cpu(), hv[torch.tensor(sblk)])
    else:
        ok = torch.equal(hv[torch.tensor(dblk)], gv[torch.tensor(sblk, device="cuda")].cpu())
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    res = []
    for _ in range(3):
        e0.record()
        for _ in range(reps):
            go()
        e1.record(); torch.cuda.synchronize()
        res.append(nblocks * size * reps / (e0.elapsed_time(e1) / 1e3) / 1e9)
    total = nblocks * size
    flat = host[:total]
    cs = []
    for _ in range(3):
        e0.record()
        for _ in range(reps):
            if direction == "h2d": gpu[:total].copy_(flat, non_blocking=True)
            else: flat.copy_(gpu[:total], non_blocking=True)
        e1.record(); torch.cuda.synchronize()
        cs.append(total * reps / (e0.elapsed_time(e1) / 1e3) / 1e9)
    return {"ok": ok, "GBps": sorted(res)[1], "ceiling": sorted(cs)[1]}

if __name__ == "__main__":
    if len(sys.argv) > 1:
        a = sys.argv[1:]
        print(json.dumps(run_variant(a[0], int(a[1]), a[2], threads=int(a[3]) if len(a) > 3 else None)))
        sys.exit(0)
    rows = []
    for kib in (16, 32, 128):
        for direction in ("h2d", "d2h"):
            for name, thr in (("K0", None), ("K1", None), ("K2", None), ("K3", None), ("K0", 256)):
                t0 = time.time()
                r = subprocess.run([sys.executable, __file__, name, str(kib), direction] + ([str(thr)] if thr else []),
                                   capture_output=True, text=True, timeout=120)
                if r.returncode != 0:
                    rows.append((kib, direction, name, thr, "ERR " + (r.stderr.strip().splitlines() or ["?"])[-1][:80]))
                else:
                    j = json.loads(r.stdout.strip().splitlines()[-1])
                    rows.append((kib, direction, name, thr, f"{j['GBps']:.1f} GB/s ({j['GBps']/j['ceiling']:.3f}) ceil {j['ceiling']:.1f} ok={j['ok']}"))
                print(*rows[-1], flush=True)
    print("=== table")
    for r in rows: print(*r)
