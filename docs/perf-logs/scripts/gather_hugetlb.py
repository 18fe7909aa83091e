"""Random-order gather into a shared mapping (memfd) with 4 KiB pages and with hugetlb pages,
against a contiguous copy into each (dev VM; needs vm.nr_hugepages >= 512, e.g.
`echo 600 > /proc/sys/vm/nr_hugepages`, reset to 0 after).
python docs/perf-logs/scripts/gather_hugetlb.py KIB"""
import numpy as np, time, statistics, sys, mmap, os
bs = int(sys.argv[1]) << 10
N = (1 << 30) // bs
def shm_map(huge):
    fd = os.memfd_create("t", os.MFD_HUGETLB if huge else 0)
    os.ftruncate(fd, N * bs); m = mmap.mmap(fd, N * bs); os.close(fd)
    a = np.frombuffer(m, np.uint8).reshape(N, bs); a[:] = 1
    return a
dst4k = shm_map(False)
dsthuge = shm_map(True)
pool = np.ones((2 * N, bs), np.uint8)
rng = np.random.default_rng(0)
pick = rng.choice(2 * N, N, replace=False)
def t(fn, n=5):
    fn(); r = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); r.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(r)
res = {}
for _ in range(2):
    for name, d in (("shm 4K", dst4k), ("shm hugetlb", dsthuge)):
        res.setdefault(f"contig -> {name}", []).append(t(lambda: np.copyto(d, pool[:N])))
        res.setdefault(f"gather -> {name}", []).append(t(lambda: np.take(pool, pick, axis=0, out=d, mode="clip")))
for k, v in res.items():
    print(f"{bs>>10} KiB {k:>22}: " + " ".join(f"{x:.2f}" for x in v) + " GiB/s")
