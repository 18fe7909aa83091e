"""Exploratory (dev VM, sixth session): pdkv's streaming loop built 1, 2, 4, 6 and 8 pieces wide,
1 GiB as 32 KiB / 128 KiB pieces: consecutive (contiguous) and in random source order.
    python docs/perf-logs/scripts/ways_width.py
Produced ../devvm-ways-width-s6.log."""
import time, numpy as np, pdkv, llvmlite.binding as llvm
from pdkv._ffi import cpu
cpu.available()
fns = {w: cpu._jit(llvm, cpu._build_ir(w)) for w in (1, 2, 4, 6, 8)}
N = 1 << 30
src = pdkv.aligned_empty(N); src[:] = 7
b = pdkv.SharedBuffer.create(N, pin="never")
d = np.frombuffer(b.buf, np.uint8)[:N]
for kib in (32, 128):
    bs = kib << 10; nb = N // bs
    perm = np.random.default_rng(1).permutation(nb)
    sa = src.ctypes.data + perm.astype(np.int64) * bs
    da = d.ctypes.data + np.arange(nb, dtype=np.int64) * bs
    la = np.full(nb, bs, np.int64)
    pc = src.ctypes.data + np.arange(nb, dtype=np.int64) * bs  # contiguous as pieces
    res = {}
    for rep in range(7):
        for w, (e, fn) in fns.items():
            t = time.perf_counter(); fn(nb, pc.ctypes.data, da.ctypes.data, la.ctypes.data); c = N / (time.perf_counter() - t)
            t = time.perf_counter(); fn(nb, sa.ctypes.data, da.ctypes.data, la.ctypes.data); x = N / (time.perf_counter() - t)
            res.setdefault(w, []).append((c, x))
    best_c = max(np.median(np.array(v), axis=0)[0] for v in res.values())
    for w, v in res.items():
        a = np.median(np.array(v), axis=0)
        print(f"{kib}K {w} ways: contiguous-as-pieces {a[0]/2**30:6.2f} random {a[1]/2**30:6.2f} ({a[1]/best_c:.2f} of the best contiguous)")
d = None; b.close()
