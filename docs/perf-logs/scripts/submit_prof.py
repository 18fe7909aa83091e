"""Host cost of one kernel-path call, 16 KiB blocks, 4096 pieces (H200 host). python exp/submit_prof.py"""
import statistics, time
import numpy as np, torch, pdkv
from pdkv.swap import plan_copy

N = 4096; size = 16 << 10; nb = 2 * N
lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=16, dtype="bf16", mla=True)
buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
gpu = torch.empty(nb * size, dtype=torch.uint8, device="cuda")
bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address); gspec = pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr())
rng = np.random.default_rng(0)
src = rng.permutation(nb)[:N].tolist(); dst = rng.permutation(nb)[:N].tolist()
sa, da = np.array(src), np.array(dst)
eng = pdkv.SwapEngine(bspec, gspec)
def med(f, n=50):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6
print("plan_copy lists us", med(lambda: plan_copy(bspec, gspec, src, dst)))
print("plan_copy arrays us", med(lambda: plan_copy(bspec, gspec, sa, da)))
print("fromiter one list us", med(lambda: np.fromiter(src, np.int64, len(src))))
def submit_idle(s, d):
    ts = []
    for _ in range(20):
        torch.cuda.synchronize(); time.sleep(0.02)
        t0 = time.perf_counter(); h = eng.copy(s, d); ts.append(time.perf_counter() - t0); h.wait(10)
    return statistics.median(ts) * 1e6
print("submit after idle, lists us", submit_idle(src, dst))
print("submit after idle, arrays us", submit_idle(sa, da))
import cProfile, pstats
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(50):
    eng.copy(src, dst).wait(10)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
eng.close(); buf.close(); buf.unlink()
