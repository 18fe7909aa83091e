"""Exploratory: A/B of launching a large copy in two parts (the first 256 blocks, then the
rest) against one launch, interleaved, same host. It toggles pdkv.swap._FIRST_PART, which
existed only in the uncommitted two-part variant of SwapEngine.copy() that this measured and
that was then dropped: against the current code both arms are the same. Produced
../h200-split-launch-ab-s2.log."""
import time, statistics
import numpy as np
import pdkv
import pdkv.swap as sw
from pdkv import _ffi
cu = _ffi.cuda
cu.set_device(0)
N, REPS = 4096, 16
rng = np.random.default_rng(0)
for kib in (16, 32):
    size = kib << 10
    lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=size // 1024, dtype="bf16", mla=True)
    nb = 2 * N
    buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
    dev = cu.malloc(nb * size)
    eng = pdkv.SwapEngine(pdkv.CacheSpec.for_buffer(lay, nb, buf.address), pdkv.CacheSpec.for_buffer(lay, nb, dev))
    sb = rng.permutation(nb)[:N].tolist(); db = rng.permutation(nb)[:N].tolist()
    total = N * size
    s = cu.stream_create()
    def ceil():
        cu.stream_synchronize(s); t = time.perf_counter()
        for _ in range(REPS): cu.memcpy_async(dev, buf.address, total, s)
        cu.stream_synchronize(s); return total * REPS / (time.perf_counter() - t) / 1e9
    def burst():
        t = time.perf_counter(); hs = [eng.copy(sb, db) for _ in range(REPS)]
        for h in hs: h.wait(60)
        return total * REPS / (time.perf_counter() - t) / 1e9
    def one():
        t = time.perf_counter(); eng.copy(sb, db).wait(60); return (time.perf_counter() - t) * 1e3
    res = {"split": ([], []), "nosplit": ([], []), "ceil": ([], [])}
    burst(); one(); ceil()
    for r in range(6):
        for mode in ("split", "nosplit"):
            sw._FIRST_PART = 256 if mode == "split" else 10**9
            res[mode][0].append(burst()); res[mode][1].append(one())
        res["ceil"][0].append(ceil())
    c = statistics.median(res["ceil"][0])
    for mode in ("split", "nosplit"):
        b = statistics.median(res[mode][0]); o = statistics.median(res[mode][1])
        print(f"{kib} KiB h2d {mode:8} burst {b:.1f} GB/s ({b / c:.3f})  one call {o:.2f} ms   ceiling {c:.1f}", flush=True)
    eng.close(); cu.free(dev); buf.close(); buf.unlink()
