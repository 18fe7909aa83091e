"""Exploratory (dev VM, sixth session): does the prefill cache's alignment change a
random-order block gather into a shm segment? 1 GiB, sources at page offsets 0, 16 (where a
large np.empty / np.random array starts: malloc's chunk header), 64 and 2048 of one
allocation, plus a plain np.random array; for each, a contiguous np.copyto (the benchmark's
ceiling) and an np.take of the blocks in random order, interleaved, 10 repetitions; the
ratio is the median of per-repetition ratios (p25/p75 beside it).
    python docs/perf-logs/scripts/alignment.py 32
Produced ../devvm-alignment-s6.log."""
import sys
import time

import numpy as np

import pdkv

N = 1 << 30
bs = int(sys.argv[1]) << 10
nb = N // bs
perm = np.random.default_rng(1).permutation(nb)
r = np.random.default_rng(32).integers(0, 256, N, dtype=np.uint8)
big = pdkv.aligned_empty(N + 4096)
big[:] = 1
b = pdkv.SharedBuffer.create(N, pin="never")
d = np.frombuffer(b.buf, np.uint8)[:N]
srcs = {f"np.random (offset {r.ctypes.data % 4096})": r, "offset 0": big[:N], "offset 16": big[16:16 + N],
        "offset 64": big[64:64 + N], "offset 2048": big[2048:2048 + N]}
res: dict = {}
for rep in range(10):
    for name, s in srcs.items():
        t = time.perf_counter()
        np.copyto(d, s)
        c = N / (time.perf_counter() - t)
        t = time.perf_counter()
        np.take(s.reshape(nb, bs), perm, axis=0, out=d.reshape(nb, bs), mode="clip")
        g = N / (time.perf_counter() - t)
        res.setdefault(name, []).append((c / 2**30, g / 2**30, g / c))
print(f"{bs >> 10} KiB blocks, GiB/s, medians of 10; ratio p25/p50/p75")
for name, v in res.items():
    a = np.array(v)
    q = np.percentile(a[:, 2], [25, 50, 75])
    print(f"{name:>24}: contiguous {np.median(a[:, 0]):6.2f}  gather {np.median(a[:, 1]):6.2f}"
          f"  ratio {q[0]:.2f}/{q[1]:.2f}/{q[2]:.2f}")
d = None
b.close()
