"""Exploratory (dev VM): 1 GiB copied into a shm segment as one contiguous np.copyto, as a
random-order gather of whole blocks (np.take), as the same scatter (fancy assignment), and as
the gather in row pieces of 1-8 KiB; three repetitions per block size, GiB/s. Run with and
without GLIBC_TUNABLES to compare glibc's memmove thresholds:
    python docs/perf-logs/scripts/gather.py
    GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=4194304:glibc.cpu.x86_non_temporal_threshold=16448 \
        python docs/perf-logs/scripts/gather.py
Produced ../devvm-gather-s2.log."""
import os
import time

import numpy as np

import pdkv

total = 1 << 30
src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
buf = pdkv.SharedBuffer.create(total, stripes=1)
dst = np.frombuffer(buf.buf, np.uint8)
print("GLIBC_TUNABLES=" + os.environ.get("GLIBC_TUNABLES", ""))


def rate(fn):
    t = time.perf_counter()
    fn()
    return total / (time.perf_counter() - t) / 2**30


for kib in (32, 128, 1024):
    bb = kib * 1024
    nb = total // bb
    perm = np.random.default_rng(1).permutation(nb)
    inv = np.argsort(perm)
    s2, d2 = src.reshape(nb, bb), dst.reshape(nb, bb)

    def pieces(row):
        k = bb // row
        idx = (perm[:, None] * k + np.arange(k)[None, :]).ravel()
        return lambda: np.take(src.reshape(-1, row), idx, axis=0, out=dst.reshape(-1, row), mode="clip")

    runs = {"copy": lambda: np.copyto(dst, src),
            "take": lambda: np.take(s2, perm, axis=0, out=d2, mode="clip"),
            "scatter": lambda: d2.__setitem__(inv, s2),
            "take-8K": pieces(8192), "take-1K": pieces(1024)}
    for f in runs.values():
        f()  # warm-up
    for r in range(3):
        print(kib, "  ".join(f"{k} {rate(f):.2f}" for k, f in runs.items()), flush=True)
    assert np.array_equal(dst.reshape(nb, bb)[7], s2[perm[7]])  # the last run was a piece gather
s2 = d2 = dst = None  # views dropped before the mapping closes
buf.close()
buf.unlink()
