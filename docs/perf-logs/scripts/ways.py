"""Exploratory (dev VM, sixth session): the streaming copy loop taking 1 or 4 pieces side by
side (a stand-alone version of it for pieces of one length, a multiple of 256 bytes, with
64-byte-aligned destinations), 1 GiB gathered in random source order, destinations in
order or random, against one contiguous one-stream copy; then the contiguous copy as 4-way
over consecutive pieces. pdkv/_ffi/cpu.py took the 4-way form after this.
    python docs/perf-logs/scripts/ways.py
Produced ../devvm-ways-s6.log."""
import ctypes, time
import numpy as np
import llvmlite.binding as llvm
from pdkv._ffi import cpu as C
C.available()
def make(ways):
    # pieces processed `ways` at a time, all of length L (multiple of 256), dst 64-aligned
    body = []
    loads, stores = [], []
    for w in range(ways):
        body.append(f"  %sp{w} = getelementptr i64, ptr %srcs, i64 %i{w}\n  %s{w} = load i64, ptr %sp{w}\n"
                    f"  %dp{w} = getelementptr i64, ptr %dsts, i64 %i{w}\n  %d{w} = load i64, ptr %dp{w}\n")
    idx = "".join(f"  %i{w} = add i64 %i, {w}\n" for w in range(ways))
    for w in range(ways):
        for j in range(4):
            loads.append(f"  %a{w}_{j} = add i64 %s{w}, %off\n  %pa{w}_{j} = add i64 %a{w}_{j}, {64*j}\n  %p{w}_{j} = inttoptr i64 %pa{w}_{j} to ptr\n  %v{w}_{j} = load <8 x i64>, ptr %p{w}_{j}, align 1\n")
            stores.append(f"  %b{w}_{j} = add i64 %d{w}, %off\n  %qb{w}_{j} = add i64 %b{w}_{j}, {64*j}\n  %q{w}_{j} = inttoptr i64 %qb{w}_{j} to ptr\n  store <8 x i64> %v{w}_{j}, ptr %q{w}_{j}, align 64, !nontemporal !0\n")
    ir = f"""
define void @f(i64 %n, ptr %srcs, ptr %dsts, i64 %L) nounwind {{
entry:
  %steps = lshr i64 %L, 8
  br label %outer
outer:
  %i = phi i64 [0, %entry], [%inext, %done]
  %more = icmp slt i64 %i, %n
  br i1 %more, label %piece, label %exit
piece:
{idx}{''.join(body)}  br label %loop
loop:
  %k = phi i64 [0, %piece], [%k1, %step]
  %go = icmp ult i64 %k, %steps
  br i1 %go, label %step, label %done
step:
  %off = shl i64 %k, 8
{''.join(loads)}{''.join(stores)}  %k1 = add i64 %k, 1
  br label %loop
done:
  %inext = add i64 %i, {ways}
  br label %outer
exit:
  fence seq_cst
  ret void
}}
!0 = !{{i32 1}}
"""
    target = llvm.Target.from_default_triple()
    tm = target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
    mod = llvm.parse_assembly(ir); mod.verify()
    ee = llvm.create_mcjit_compiler(mod, tm); ee.finalize_object()
    return ee, ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(ee.get_function_address("f"))
fns = {w: make(w) for w in (1, 4)}
import pdkv
N = 1 << 30
src = pdkv.aligned_empty(N); src[:] = 7
b = pdkv.SharedBuffer.create(N, pin="never")
d = np.frombuffer(b.buf, np.uint8)[:N]
for kib in (32, 128):
    bs = kib << 10; nb = N // bs
    perm = np.random.default_rng(1).permutation(nb)
    sa = (src.ctypes.data + perm.astype(np.int64) * bs).astype(np.int64)
    dperm = np.random.default_rng(2).permutation(nb)
    res = {}
    for rep in range(7):
        t = time.perf_counter(); C.copy(d.ctypes.data, src.ctypes.data, N); c = N / (time.perf_counter() - t)
        for dn, da in (("dst in order", (d.ctypes.data + np.arange(nb, dtype=np.int64) * bs)), ("dst random", (d.ctypes.data + dperm.astype(np.int64) * bs))):
            for w, (ee, fn) in fns.items():
                t = time.perf_counter(); fn(nb, sa.ctypes.data, da.ctypes.data, bs); x = N / (time.perf_counter() - t)
                res.setdefault(f"{dn}, {w} way", []).append((c, x, x / c))
    for k, v in res.items():
        a = np.median(np.array(v), axis=0)
        print(f"{kib:5d}K {k:>20}: one-stream contiguous {a[0]/2**30:6.2f} gather {a[1]/2**30:6.2f} ({a[2]:.2f})", flush=True)
d = None; b.close()

src = pdkv.aligned_empty(N); src[:] = 7
b = pdkv.SharedBuffer.create(N, pin='never')
d = np.frombuffer(b.buf, np.uint8)[:N]
ee, f4 = fns[4]
r = []
for rep in range(7):
    row = []
    t = time.perf_counter(); C.copy(d.ctypes.data, src.ctypes.data, N); row.append(N / (time.perf_counter() - t))
    for kib in (32, 128, 1024):
        bs = kib << 10; nb = N // bs
        sa = src.ctypes.data + np.arange(nb, dtype=np.int64) * bs
        da = d.ctypes.data + np.arange(nb, dtype=np.int64) * bs
        t = time.perf_counter(); f4(nb, sa.ctypes.data, da.ctypes.data, bs); row.append(N / (time.perf_counter() - t))
    r.append(row)
a = np.median(np.array(r), axis=0) / 2**30
print(f"contiguous one stream {a[0]:.2f}; as 4-way over consecutive pieces of 32K {a[1]:.2f}, 128K {a[2]:.2f}, 1M {a[3]:.2f}")
d = None; b.close()
