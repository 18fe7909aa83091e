"""Exploratory (first session): population of one 8 GiB shm file by fallocate and/or
MADV_POPULATE_WRITE threads, then cudaHostRegister. Source of the fallocate/mapping/pin
breakdown in docs/PERF.md. Run on the GPU host: python docs/perf-logs/scripts/populate.py"""
import mmap, os, time
from pdkv import _ffi
from cuda.bindings import runtime as rt
rt.cudaSetDevice(0); rt.cudaFree(0)
size = 8 << 30
def run(name, fall, threads, pin=True):
    path = f"/dev/shm/pdkv-exp-{os.getpid()}-{name}"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    if fall:
        os.posix_fallocate(fd, 0, size)
    t1 = time.perf_counter()
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    addr = _ffi.libc.buffer_address(mm)
    if threads:
        from pdkv.shm import _populate
        _populate(addr, size, threads)
    t2 = time.perf_counter()
    if pin:
        rt.cudaHostRegister(addr, size, rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped)
    t3 = time.perf_counter()
    print(f"{name:28} fallocate {t1-t0:.2f} populate {t2-t1:.2f} pin {t3-t2:.2f} total {t3-t0:.2f}", flush=True)
    if pin:
        rt.cudaHostUnregister(addr)
    mm.close(); os.close(fd); os.unlink(path)
run("madvise x16", False, 16)
run("fallocate + madvise x16", True, 16)
run("fallocate only", True, 0)
run("fallocate + madvise x8", True, 8)
run("madvise x8", False, 8)
