"""A CPU copy loop with non-temporal stores, compiled at run time by llvmlite (LLVM).

The shm transport writes KV blocks into decode's buffer, which this process does not read
again: nothing gains from the written lines staying in this core's caches. glibc's
``memcpy`` switches to non-temporal (streaming) stores only above a threshold of tens of
MiB, so every block copy (16 KiB - 1 MiB) goes through the cache: each destination line is
read from memory before it is overwritten (read-for-ownership), a third memory transfer
per line beside the load and the store, and the caches fill with data nobody reads.

:func:`gather` copies a list of ``(src, dst, length)`` pieces in one call: per piece, a
``memcpy`` of the bytes up to the destination's next 64-byte boundary, 256 bytes a step of
unaligned vector loads and aligned ``!nontemporal`` vector stores (``vmovntps`` /
``vmovntdq`` on x86-64, as wide as the host CPU has), a ``memcpy`` of the tail, and one
``fence seq_cst`` at the end so that every store is visible before the caller announces
the data (a control message to decode). The loop is LLVM IR, compiled once per process
for the host CPU; no compiler or build step is involved. The ctypes call releases the
GIL, so several threads copy at once.

``tools/bench_transport.py`` on an H200 host's Xeon, 4 copy threads: the shm transport
moves 23-28 / 25-29 / 27-31 GiB/s at 32 KiB / 128 KiB / 1 MiB blocks through this loop,
against 16.3 / 19.6 / 20.3 through ``np.take`` (docs/PERF.md).

Without llvmlite, or where the JIT cannot run (no executable memory, an LLVM without this
target), :func:`available` is False, :func:`unavailable_reason` says why, and pdkv copies
with numpy. ``PDKV_CPU_COPY=numpy`` in the environment turns the loop off.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

__all__ = ["available", "unavailable_reason", "gather", "copy"]

_IR = r"""
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)

define void @pdkv_nt_gather(i64 %n, ptr %srcs, ptr %dsts, ptr %lens) nounwind {
entry:
  br label %outer
outer:
  %i = phi i64 [0, %entry], [%i1, %after]
  %more = icmp slt i64 %i, %n
  br i1 %more, label %piece, label %exit
piece:
  %sp = getelementptr i64, ptr %srcs, i64 %i
  %s = load i64, ptr %sp
  %dp = getelementptr i64, ptr %dsts, i64 %i
  %d = load i64, ptr %dp
  %lp = getelementptr i64, ptr %lens, i64 %i
  %l = load i64, ptr %lp
  ; head: up to the destination's next 64-byte boundary (or the whole piece)
  %mis = and i64 %d, 63
  %h0 = sub i64 64, %mis
  %h1 = and i64 %h0, 63
  %hlt = icmp ult i64 %h1, %l
  %head = select i1 %hlt, i64 %h1, i64 %l
  %src0 = inttoptr i64 %s to ptr
  %dst0 = inttoptr i64 %d to ptr
  call void @llvm.memcpy.p0.p0.i64(ptr %dst0, ptr %src0, i64 %head, i1 false)
  %rem = sub i64 %l, %head
  %steps = lshr i64 %rem, 8
  %s1 = add i64 %s, %head
  %d1 = add i64 %d, %head
  br label %loop
loop:
  %k = phi i64 [0, %piece], [%k1, %step]
  %go = icmp ult i64 %k, %steps
  br i1 %go, label %step, label %tail
step:
  %off = shl i64 %k, 8
  %sa = add i64 %s1, %off
  %da = add i64 %d1, %off
  %p0 = inttoptr i64 %sa to ptr
  %q0 = inttoptr i64 %da to ptr
  %p1 = getelementptr i8, ptr %p0, i64 64
  %p2 = getelementptr i8, ptr %p0, i64 128
  %p3 = getelementptr i8, ptr %p0, i64 192
  %q1 = getelementptr i8, ptr %q0, i64 64
  %q2 = getelementptr i8, ptr %q0, i64 128
  %q3 = getelementptr i8, ptr %q0, i64 192
  %v0 = load <8 x i64>, ptr %p0, align 1
  %v1 = load <8 x i64>, ptr %p1, align 1
  %v2 = load <8 x i64>, ptr %p2, align 1
  %v3 = load <8 x i64>, ptr %p3, align 1
  store <8 x i64> %v0, ptr %q0, align 64, !nontemporal !0
  store <8 x i64> %v1, ptr %q1, align 64, !nontemporal !0
  store <8 x i64> %v2, ptr %q2, align 64, !nontemporal !0
  store <8 x i64> %v3, ptr %q3, align 64, !nontemporal !0
  %k1 = add i64 %k, 1
  br label %loop
tail:
  %done = shl i64 %steps, 8
  %rest = sub i64 %rem, %done
  %s2 = add i64 %s1, %done
  %d2 = add i64 %d1, %done
  %src2 = inttoptr i64 %s2 to ptr
  %dst2 = inttoptr i64 %d2 to ptr
  call void @llvm.memcpy.p0.p0.i64(ptr %dst2, ptr %src2, i64 %rest, i1 false)
  br label %after
after:
  %i1 = add i64 %i, 1
  br label %outer
exit:
  fence seq_cst
  ret void
}

!0 = !{i32 1}
"""

_GATHER = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "fn", "engine" once compiled; "reason" once refused


def _compile() -> None:
    if os.environ.get("PDKV_CPU_COPY", "").lower() == "numpy":
        _state["reason"] = "turned off by PDKV_CPU_COPY=numpy"
        return
    try:
        import llvmlite.binding as llvm
    except ImportError:
        _state["reason"] = "llvmlite is not installed (pip install llvmlite)"
        return
    try:
        try:  # llvmlite < 0.45 needs it; later ones do it themselves and refuse the call
            llvm.initialize()
        except (RuntimeError, AttributeError):
            pass
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        target = llvm.Target.from_default_triple()
        tm = target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                          features=llvm.get_host_cpu_features().flatten(), opt=3)
        mod = llvm.parse_assembly(_IR)
        mod.verify()
        engine = llvm.create_mcjit_compiler(mod, tm)
        engine.finalize_object()
        addr = engine.get_function_address("pdkv_nt_gather")
        if not addr:
            raise RuntimeError("the JIT returned no address for the copy loop")
    except Exception as exc:  # any LLVM or JIT failure: report it, fall back to numpy
        _state["reason"] = f"the LLVM JIT could not build the copy loop: {type(exc).__name__}: {exc}"
        return
    _state["engine"] = engine  # owns the code: kept for the life of the process
    _state["fn"] = _GATHER(addr)


def _fn() -> Any:
    if "fn" not in _state and "reason" not in _state:
        with _lock:
            if "fn" not in _state and "reason" not in _state:
                _compile()
    return _state.get("fn")


def available() -> bool:
    """True when the streaming copy loop runs here (compiles it on first call)."""
    return _fn() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False; None when it is True."""
    _fn()
    return _state.get("reason")


def gather(src: Any, dst: Any, lengths: Any) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every i, with
    streaming stores, then fence. Arguments: C-contiguous int64 numpy arrays of one size.
    Pieces must not overlap each other's destinations or any source; the caller has
    checked every address (nothing is checked here). Releases the GIL.

    Raises
    ------
    RuntimeError
        The loop is not available (see :func:`unavailable_reason`).
    """
    fn = _fn()
    if fn is None:
        raise RuntimeError(f"streaming copy unavailable: {_state.get('reason')}")
    n = int(lengths.size)
    if not (src.size == dst.size == n):
        raise ValueError(f"{src.size} sources, {dst.size} destinations, {n} lengths")
    for a in (src, dst, lengths):
        if a.dtype.itemsize != 8 or a.dtype.kind not in "iu" or not a.flags.c_contiguous:
            raise ValueError("src, dst and lengths must be C-contiguous 64-bit integer arrays")
    if n:
        fn(n, src.ctypes.data, dst.ctypes.data, lengths.ctypes.data)


def copy(dst: int, src: int, nbytes: int) -> None:
    """One contiguous copy of ``nbytes`` from ``src`` to ``dst`` with streaming stores."""
    import numpy as np

    gather(np.array([src], np.int64), np.array([dst], np.int64), np.array([nbytes], np.int64))
