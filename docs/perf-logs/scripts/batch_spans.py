"""Sweep the sub-batch sizes of the batch strategy: one-call latency, submit time and
back-to-back throughput, H200. python exp/batch_spans.py"""
import statistics, time, sys
import numpy as np, torch, pdkv
import pdkv.swap as sw

N = 4096
rng = np.random.default_rng(0)
configs = [(1 << 30, 1 << 30), (64, 1024), (128, 512), (32, 256), (256, 256), (64, 4096)]
print(f"{'KiB':>4} {'dir':>4} {'first,cap':>12} {'1call ms':>9} {'submit ms':>9} {'b2b GB/s':>9}")
for kib in (128, 256, 512):
    size = kib << 10
    lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=size // 1024, dtype="bf16", mla=True)
    nb = 2 * N
    buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
    gpu = torch.empty(nb * size, dtype=torch.uint8, device="cuda")
    bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address)
    gspec = pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr())
    src = rng.permutation(nb)[:N].tolist(); dst = rng.permutation(nb)[:N].tolist()
    eng = pdkv.SwapEngine(bspec, gspec, strategy="batch")
    for direction in ("h2d", "d2h"):
        s_, d_ = (src, dst) if direction == "h2d" else (dst, src)
        for first, cap in configs:
            sw._BATCH_FIRST, sw._BATCH_MAX = first, cap
            eng.copy(s_, d_, direction=direction).wait(60)
            lat, sub = [], []
            for _ in range(5):
                t0 = time.perf_counter(); h = eng.copy(s_, d_, direction=direction); t1 = time.perf_counter()
                h.wait(60); t2 = time.perf_counter()
                lat.append(t2 - t0); sub.append(t1 - t0)
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                hs = [eng.copy(s_, d_, direction=direction) for _ in range(16)]
                for h in hs: h.wait(60)
                ts.append(time.perf_counter() - t0)
            bw = 16 * N * size / statistics.median(ts) / 1e9
            print(f"{kib:>4} {direction:>4} {str((min(first,9999), min(cap,9999))):>12} {statistics.median(lat)*1e3:>9.2f} "
                  f"{statistics.median(sub)*1e3:>9.2f} {bw:>9.1f}", flush=True)
    eng.close(); del gpu; torch.cuda.empty_cache(); buf.close(); buf.unlink()
