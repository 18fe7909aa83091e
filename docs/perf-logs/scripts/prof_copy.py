"""Exploratory: host time of SwapEngine.copy() for 4096 16 KiB blocks, and a cProfile of it.
Produced ../h200-copy-submit-profile-s2.log.
Run on the GPU host: python docs/perf-logs/scripts/prof_copy.py"""
import cProfile, pstats, time
import numpy as np
import pdkv
from pdkv import _ffi
cu = _ffi.cuda
cu.set_device(0)
N = 4096; size = 16 << 10
lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=16, dtype="bf16", mla=True)
nb = 2 * N
buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
dev = cu.malloc(nb * size)
eng = pdkv.SwapEngine(pdkv.CacheSpec.for_buffer(lay, nb, buf.address), pdkv.CacheSpec.for_buffer(lay, nb, dev))
rng = np.random.default_rng(0)
sb = rng.permutation(nb)[:N].tolist(); db = rng.permutation(nb)[:N].tolist()
for _ in range(5): eng.copy(sb, db).wait(10)
ts = []
for _ in range(20):
    t = time.perf_counter(); h = eng.copy(sb, db); ts.append(time.perf_counter() - t); h.wait(10)
print("submit time p50 ms", sorted(ts)[10] * 1e3)
pr = cProfile.Profile()
for _ in range(50):
    pr.enable(); h = eng.copy(sb, db); pr.disable(); h.wait(10)
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
