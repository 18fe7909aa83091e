"""Where a 1 GiB shm layer of 32 KiB blocks spends its time in the sender: the bench's transfer
(16 requests of 2048 random blocks, decode in a child process) eight times, each phase
timestamped on first entry/exit (ms from send_layer). Run from the repository root:
T=2 python docs/perf-logs/scripts/send_phases.py   (T: copy threads)"""
import json, os, subprocess, sys, time, numpy as np
sys.path.insert(0, "tools")
import pdkv
import pdkv.transfer as T
from pdkv import _ffi
from _bench import send_and_wait
kib = 32
sys.argv = ["x"]
import bench_transport as bt
lay = bt.layout_for(kib)
child = subprocess.Popen([sys.executable, "tools/bench_transport.py", "--role", "decode", "--kib", str(kib), "--gib", "1"], stdout=subprocess.PIPE, text=True)
info = json.loads(child.stdout.readline())
nb = info["blocks"]; total = nb * lay.block_bytes
src = pdkv.aligned_empty(total); src[:] = 5
spec = pdkv.CacheSpec.for_buffer(lay, nb, src.ctypes.data)
tx = pdkv.PrefillSender(lay, spec, info["control"], transport="shm", timeout_s=60, instance="ov", copy_threads=int(os.environ.get("T", 2)))
perm = np.random.default_rng(1).permutation(nb); per = nb // 16
ev = {}
def wrap(name):
    f = getattr(T.PrefillSender, name)
    def w(self, *a, **k):
        ev.setdefault(name + ">", time.perf_counter())
        try: return f(self, *a, **k)
        finally: ev.setdefault(name + "<", time.perf_counter())
    setattr(T.PrefillSender, name, w)
for n in ("send_layer", "_run_job", "_write_layer", "_grant_ids", "_pieces", "_stream_pieces", "_share"): wrap(n)
og = _ffi.cpu.gather
def g(s, d, l):
    t = time.perf_counter(); ev.setdefault("gather>", t); og(s, d, l)
_ffi.cpu.gather = g
for rep in range(8):
    time.sleep(0.3)
    rids = [f"r{rep}-{i}" for i in range(16)]
    for r in rids: tx.reserve(r, per * lay.tokens_per_block)
    ev.clear()
    t0 = time.perf_counter()
    dt = send_and_wait(tx, [(r, perm[i*per:(i+1)*per]) for i, r in enumerate(rids)])
    print(" ".join(f"{k} {1e3*(v-t0):.2f}" for k, v in sorted(ev.items(), key=lambda kv: kv[1])), f"| total {1e3*dt:.1f}")
tx.close(); child.kill(); child.wait()
