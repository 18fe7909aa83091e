"""Sender planning cost of one layer: 1 GiB of 32 KiB blocks in 16 requests (dev VM).
python docs/perf-logs/scripts/plan_ipc.py"""
import time, numpy as np, pdkv
from pdkv.transfer import PrefillSender
from pdkv.layout import tp_segments, CacheSpec
from pdkv.swap import CopyPlan
kib=32
lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=kib, dtype="bf16", mla=True)
nb=(1<<30)//lay.block_bytes
src=CacheSpec.for_buffer(lay, nb, 1<<40); dst=CacheSpec.for_buffer(lay, nb, 1<<41)
tx = PrefillSender.__new__(PrefillSender)
tx.layout, tx._dst_layout, tx.cache = lay, lay, src
tx.segments = [g for g in tp_segments(lay, lay)]
tx._dst_specs = {0: dst}
perm = np.random.default_rng(0).permutation(nb)
per = nb//16
work = [(f"r{i}", None, perm[i*per:(i+1)*per].astype(np.int64), np.arange(i*per,(i+1)*per), 0) for i in range(16)]
for _ in range(3):
    t0=time.perf_counter()
    plans,total = tx._pieces(0, work)
    t1=time.perf_counter()
    plan = CopyPlan(np.concatenate([p[1] for p in plans]).astype(np.uint64), np.concatenate([p[2] for p in plans]).astype(np.uint64),
                    np.concatenate([p[3] for p in plans]).astype(np.uint64), np.asarray([sum(p[3].size for p in plans)], np.int64), total)
    cp = plan.chunked(); desc = np.concatenate([cp.src, cp.dst, cp.lengths])
    t2=time.perf_counter()
    print(f"pieces {1e3*(t1-t0):.2f} ms, plan+chunk+desc {1e3*(t2-t1):.2f} ms, {plan.pieces} pieces")
import cProfile, pstats
cProfile.run("tx._pieces(0, work)", "/tmp/pi")
pstats.Stats("/tmp/pi").sort_stats("tottime").print_stats(8)
import timeit
print("np.asarray of one request's 2048 ids as a list:", timeit.timeit(lambda: np.asarray(work[0][2].tolist(), dtype=np.int64), number=200)/200*1e6, "us")
print("_pieces (ids as int64 arrays):", timeit.timeit(lambda: tx._pieces(0, work), number=20)/20*1e3, "ms")
sb = np.concatenate([np.asarray(w[2], dtype=np.int64) for w in work]); db = np.concatenate([np.asarray(w[3], dtype=np.int64) for w in work])
from pdkv.transfer import _plan_layer
print("_plan_layer only:", timeit.timeit(lambda: _plan_layer(tx.segments, lay, lay, src, {0: dst}, sb, db, 0), number=20)/20*1e3, "ms")
