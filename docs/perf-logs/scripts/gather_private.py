"""Random-order block gather vs a contiguous copy, private numpy memory on both sides (dev VM).
python docs/perf-logs/scripts/gather_private.py KIB"""
import numpy as np, time, statistics, sys
bs = int(sys.argv[1]) << 10 if len(sys.argv) > 1 else 32 << 10
N = (1 << 30) // bs
pool = np.ones((2 * N, bs), np.uint8); out = np.ones((N, bs), np.uint8); out2 = np.ones((2*N, bs), np.uint8)
rng = np.random.default_rng(0)
pick = rng.choice(2 * N, N, replace=False)
srt = np.sort(pick)
contig = pool[:N]
def t(fn, n=5):
    fn(); r = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); r.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(r)  # GiB/s (1 GiB moved)
res = {}
for _ in range(2):
    res.setdefault("contiguous copy", []).append(t(lambda: np.copyto(out, contig)))
    res.setdefault("gather random", []).append(t(lambda: np.take(pool, pick, axis=0, out=out, mode="clip")))
    res.setdefault("gather sorted", []).append(t(lambda: np.take(pool, srt, axis=0, out=out, mode="clip")))
    def sc(ix):
        out2[ix] = contig
    res.setdefault("scatter random", []).append(t(lambda: sc(pick)))
    res.setdefault("scatter sorted", []).append(t(lambda: sc(srt)))
for k, v in res.items():
    print(f"{bs>>10} KiB {k:>16}: " + " ".join(f"{x:.2f}" for x in v) + " GiB/s")
