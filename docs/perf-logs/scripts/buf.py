"""Exploratory: shm buffer start-up variants on the GPU host (pipelined fallocate, one CUDA
registration per stripe). Its run stopped at the copy that spans two registrations with
cudaErrorInvalidValue: that error is the finding that ruled out pinning per stripe
(docs/PERF.md). Run on the GPU host: python docs/perf-logs/scripts/buf.py 8"""
import mmap, os, sys, threading, time, json, subprocess
import numpy as np
import pdkv
from pdkv import _ffi
from pdkv.shm import _populate

GIB = float(sys.argv[1]) if len(sys.argv) > 1 else 8
size = int(GIB * (1 << 30))
cu = _ffi.cuda
cu.set_device(0)
from cuda.bindings import runtime as rt
rt.cudaFree(0)
print("canUseHostPointerForRegisteredMem", rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem, 0))
print("thp shmem", open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip())

def mk(dirpath="/dev/shm"):
    name = f"{dirpath}/pdkv-exp-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    return name, fd

def finish(name, fd, mm, regs):
    for a in regs: cu.host_unregister(a)
    mm.close(); os.close(fd); os.unlink(name)

def v_current():
    t0 = time.perf_counter()
    b = pdkv.SharedBuffer.create(size, require_pinned=True)
    t = time.perf_counter() - t0
    b.close(); b.unlink(); return t, {}

def pipeline(C=256 << 20, reg_chunk=None, threads=8, dirpath="/dev/shm", falloc=True):
    t0 = time.perf_counter()
    name, fd = mk(dirpath)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = _ffi.libc.buffer_address(mm)
    n = (size + C - 1) // C
    ready = [threading.Event() for _ in range(n)]
    populated = [threading.Event() for _ in range(n)]
    times = {}
    def fal():
        for i in range(n):
            off = i * C
            if falloc:
                os.posix_fallocate(fd, off, min(C, size - off))
            ready[i].set()
        times["falloc_done"] = time.perf_counter() - t0
    nxt = [0]; lock = threading.Lock()
    def pop():
        while True:
            with lock:
                i = nxt[0]; nxt[0] += 1
            if i >= n: return
            ready[i].wait()
            off = i * C
            _ffi.libc.madvise(addr + off, min(C, size - off), _ffi.libc.MADV_POPULATE_WRITE)
            populated[i].set()
    regs = []
    def reg():
        per = reg_chunk // C
        for j in range(0, n, per):
            for i in range(j, min(n, j + per)): populated[i].wait()
            a = addr + j * C; ln = min(reg_chunk, size - j * C)
            cu.host_register(a, ln, mapped=True, portable=True); regs.append(a)
    ts = [threading.Thread(target=fal)] + [threading.Thread(target=pop) for _ in range(threads)]
    if reg_chunk: ts.append(threading.Thread(target=reg))
    for t in ts: t.start()
    for t in ts: t.join()
    times["populated"] = time.perf_counter() - t0
    if not reg_chunk:
        cu.host_register(addr, size, mapped=True, portable=True); regs.append(addr)
    tt = time.perf_counter() - t0
    return tt, times, (name, fd, mm, regs, addr)

def par_register(nthreads=4):
    name, fd = mk()
    os.posix_fallocate(fd, 0, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = _ffi.libc.buffer_address(mm)
    _populate(addr, size, 8)
    C = size // nthreads
    t0 = time.perf_counter()
    ts = [threading.Thread(target=cu.host_register, args=(addr + i * C, C), kwargs=dict(mapped=True, portable=True)) for i in range(nthreads)]
    for t in ts: t.start()
    for t in ts: t.join()
    dt = time.perf_counter() - t0
    finish(name, fd, mm, [addr + i * C for i in range(nthreads)])
    return dt

res = {}
def rec(k, v):
    res.setdefault(k, []).append(v); print(k, v, flush=True)

for r in range(2):
    rec("current", v_current()[0])
    tt, times, st = pipeline(); finish(*st[:4]); rec("pipe_single_reg", (round(tt,3), times))
    tt, times, st = pipeline(reg_chunk=1 << 30); 
    if r == 0:
        name, fd, mm, regs, addr = st
        dps = [cu.host_device_pointer(a) for a in regs]
        print("devptr==host", all(d == a for d, a in zip(dps, regs)))
        # copy spanning registrations vs cudaMallocHost
        n = 2 << 30
        dev = cu.malloc(n); mh = cu.malloc_host(n)
        s = cu.stream_create(); e0, e1 = cu.event_create(timing=True), cu.event_create(timing=True)
        def bw(src, off=0):
            out = []
            for i in range(4):
                cu.event_record(e0, s); cu.memcpy_async(dev, src + off, n, s); cu.event_record(e1, s); cu.event_synchronize(e1)
                if i: out.append(n / cu.event_elapsed_ms(e0, e1) / 1e6)
            return round(float(np.median(out)), 1)
        v = np.frombuffer(mm, np.uint8)
        v[:n + (1 << 29)] = np.random.default_rng(0).integers(0, 256, n + (1 << 29), dtype=np.uint8)
        off = 512 << 20  # spans the 1 GiB boundaries
        print("h2d GB/s: spanning regs", bw(addr, off), "one reg region", bw(addr + (1 << 30) * 4, 0) if size >= 7 << 30 else None, "cudaMallocHost", bw(mh))
        back = np.empty(n, np.uint8)
        cu.memcpy_async(dev, addr + off, n, s); cu.stream_synchronize(s)
        cu.memcpy(back.ctypes.data, dev, n)
        print("spanning copy correct", np.array_equal(back, v[off:off + n]))
        del v
        cu.free(dev); cu.free_host(mh)
    finish(*st[:4]); rec("pipe_reg_1g", (round(tt,3), times))
    tt, times, st = pipeline(reg_chunk=512 << 20); finish(*st[:4]); rec("pipe_reg_512m", (round(tt,3), times))
    tt, times, st = pipeline(falloc=False, reg_chunk=1 << 30); finish(*st[:4]); rec("nofalloc_reg_1g", (round(tt,3), times))
    rec("par_register4", round(par_register(4), 3))
    rec("par_register1", round(par_register(1), 3))

# huge tmpfs
try:
    os.makedirs("/mnt/pdkvhuge", exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=always,size={int(GIB)+2}G,mode=1777", "none", "/mnt/pdkvhuge"], check=True)
    for r in range(2):
        tt, times, st = pipeline(dirpath="/mnt/pdkvhuge", falloc=True, C=1 << 30, threads=8); finish(*st[:4]); rec("huge_tmpfs_pipe_single", (round(tt,3), times))
        tt, times, st = pipeline(dirpath="/mnt/pdkvhuge", falloc=False, C=1 << 30, threads=8); finish(*st[:4]); rec("huge_tmpfs_nofalloc", (round(tt,3), times))
    subprocess.run(["umount", "/mnt/pdkvhuge"])
except Exception as e:
    print("huge tmpfs failed:", e)
print(json.dumps({k: v for k, v in res.items()}, default=str))
