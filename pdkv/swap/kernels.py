"""CUDA C source of pdkv's run-time kernels, compiled by NVRTC (``_ffi.cuda.compile_kernel``).

``pdkv_copy``: the swap engine's gather/scatter: CTA ``b`` copies pieces ``b, b + grid, ...``
of a plan (``src[i] -> dst[i]``, ``len[i]`` bytes) through mapped pinned host memory or
device memory, 16 bytes a thread per load where the piece is 16-byte aligned.
"""

__all__ = ["KERNEL_SOURCE"]

KERNEL_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(512)
pdkv_copy(const unsigned long long* __restrict__ src, const unsigned long long* __restrict__ dst,
          const unsigned long long* __restrict__ len, long long n)
{
    for (long long i = blockIdx.x; i < n; i += gridDim.x) {
        const char* s = (const char*)src[i];
        char* d = (char*)dst[i];
        unsigned long long L = len[i];
        if ((((unsigned long long)s | (unsigned long long)d | L) & 15ull) == 0) {
            const uint4* s4 = (const uint4*)s;
            uint4* d4 = (uint4*)d;
            long long n4 = (long long)(L >> 4), bd = blockDim.x;
            // every load of a round is issued before any store: a PCIe round trip is
            // long, and the compiler may not reorder loads past stores that could alias
            for (long long base = threadIdx.x; base < n4; base += 4 * bd) {
                uint4 r[4];
                #pragma unroll
                for (int k = 0; k < 4; k++) { long long j = base + k * bd; if (j < n4) r[k] = s4[j]; }
                #pragma unroll
                for (int k = 0; k < 4; k++) { long long j = base + k * bd; if (j < n4) d4[j] = r[k]; }
            }
        } else {
            for (unsigned long long j = threadIdx.x; j < L; j += blockDim.x) d[j] = s[j];
        }
    }
}
"""
