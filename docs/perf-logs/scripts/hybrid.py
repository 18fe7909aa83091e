"""Exploratory: the swap kernel on part of the pieces while cudaMemcpyBatchAsync copies the
rest on a second stream (shares 0-30 %). Produced ../h200-kernel-plus-copy-engines-s2.log.
Run on the GPU host: python docs/perf-logs/scripts/hybrid.py"""
import time, statistics
import numpy as np
import pdkv
from pdkv import _ffi
from pdkv.swap import plan_copy, KERNEL_SOURCE
cu = _ffi.cuda
cu.set_device(0)
N, REPS = 4096, 16
rng = np.random.default_rng(0)
fn = cu.compile_kernel(KERNEL_SOURCE, "pdkv_copy", 0)
for kib in (16, 32, 64):
    size = kib << 10
    lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=size // 1024, dtype="bf16", mla=True)
    nb = 2 * N
    buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
    dev = cu.malloc(nb * size)
    bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address); gspec = pdkv.CacheSpec.for_buffer(lay, nb, dev)
    sb = rng.permutation(nb)[:N]; db = rng.permutation(nb)[:N]
    s1 = cu.stream_create(); s2 = cu.stream_create()
    total = N * size
    plan = plan_copy(bspec, gspec, sb, db).chunked()
    n = plan.pieces
    desc = np.concatenate([plan.src, plan.dst, plan.lengths]); dd = cu.malloc(desc.nbytes)
    cu.memcpy(dd, desc.ctypes.data, desc.nbytes)
    src_l, dst_l, len_l = plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist()
    def wall(fn_):
        fn_(); cu.stream_synchronize(s1); cu.stream_synchronize(s2); ts = []
        for _ in range(5):
            t0 = time.perf_counter(); fn_(); cu.stream_synchronize(s1); cu.stream_synchronize(s2); ts.append(time.perf_counter() - t0)
        return total * REPS / statistics.median(ts) / 1e9
    ceil = wall(lambda: [cu.memcpy_async(dev, buf.address, total, s1) for _ in range(REPS)])
    out = []
    for frac in (0.0, 0.05, 0.1, 0.15, 0.2, 0.3):
        k = int(n * frac)  # the last k pieces go to the copy engines
        m = n - k
        def go():
            for _ in range(REPS):
                cu.launch(fn, m, 512, [("ptr", dd), ("ptr", dd + 8 * n), ("ptr", dd + 16 * n), ("i64", m)], s1)
                if k:
                    cu.memcpy_batch_async(dst_l[m:], src_l[m:], len_l[m:], s2)
        bw = wall(go)
        out.append(f"{frac:.2f}:{bw:.1f}({bw / ceil:.3f})")
    # copy engine alone, pieces merged? and memcpy loop for comparison
    print(f"{kib} KiB h2d  ceiling {ceil:.1f}  " + "  ".join(out), flush=True)
    cu.free(dd); cu.free(dev); buf.close(); buf.unlink()
