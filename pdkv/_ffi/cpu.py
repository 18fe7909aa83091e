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
the data (a control message to decode). Pieces go four at a time, their steps side by
side: one stream stalls at the start of every randomly placed block until the hardware
prefetcher has caught on, four keep more misses in flight (glibc's own large copies
interleave four pages for the same reason). Dev VM, 32 KiB blocks in random order: 0.89-0.93
of a one-stream contiguous copy four at a time, 0.67-0.71 one at a time
(tools/bench_transport.py's bare gather column). The loop is LLVM IR, compiled once per process
for the host CPU; no compiler or build step is involved. The ctypes call releases the
GIL, so several threads copy at once.

``tools/bench_transport.py`` on an H200 host's Xeon, 4 copy threads: the shm transport
moved 23-28 / 25-29 / 27-31 GiB/s at 32 KiB / 128 KiB / 1 MiB blocks through this loop
taking one piece at a time, against 16.3 / 19.6 / 20.3 through ``np.take``; four at a time,
26.7-29.4 GiB/s at 32 KiB, 0.84-0.87 of the ceiling against 0.79-0.81 (docs/PERF.md).

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

_WAYS = 4  # pieces copied side by side: 4 streams keep more misses in flight than one


def _step(tag: str, s: str, d: str, k: str) -> tuple[str, str]:
    """IR loading, then storing, the 256 bytes at step ``k`` of a piece whose 64-byte-aligned
    part starts at source ``s`` / destination ``d`` (i64 values)."""
    ld = [
        f"  %{tag}o = shl i64 {k}, 8\n  %{tag}sa = add i64 {s}, %{tag}o\n  %{tag}da = add i64 {d}, %{tag}o\n"
        f"  %{tag}p = inttoptr i64 %{tag}sa to ptr\n  %{tag}q = inttoptr i64 %{tag}da to ptr\n"
    ]
    st = []
    for j in range(4):
        ld.append(
            f"  %{tag}p{j} = getelementptr i8, ptr %{tag}p, i64 {64 * j}\n"
            f"  %{tag}v{j} = load <8 x i64>, ptr %{tag}p{j}, align 1\n"
        )
        st.append(
            f"  %{tag}q{j} = getelementptr i8, ptr %{tag}q, i64 {64 * j}\n"
            f"  store <8 x i64> %{tag}v{j}, ptr %{tag}q{j}, align 64, !nontemporal !0\n"
        )
    return "".join(ld), "".join(st)


def _head(w: str, s: str, d: str, n: str) -> str:
    """IR copying a piece's bytes up to its destination's next 64-byte boundary; defines
    %S{w} / %D{w} (where the aligned part starts), %N{w} (its 256-byte steps), %T{w} (tail)."""
    return (
        f"  %mis{w} = and i64 {d}, 63\n  %h0{w} = sub i64 64, %mis{w}\n  %h1{w} = and i64 %h0{w}, 63\n"
        f"  %hlt{w} = icmp ult i64 %h1{w}, {n}\n  %hd{w} = select i1 %hlt{w}, i64 %h1{w}, i64 {n}\n"
        f"  %hs{w} = inttoptr i64 {s} to ptr\n  %hq{w} = inttoptr i64 {d} to ptr\n"
        f"  call void @llvm.memcpy.p0.p0.i64(ptr %hq{w}, ptr %hs{w}, i64 %hd{w}, i1 false)\n"
        f"  %rm{w} = sub i64 {n}, %hd{w}\n  %N{w} = lshr i64 %rm{w}, 8\n  %T{w} = and i64 %rm{w}, 255\n"
        f"  %S{w} = add i64 {s}, %hd{w}\n  %D{w} = add i64 {d}, %hd{w}\n"
    )


def _load_piece(w: str, i: str) -> str:
    return "".join(
        f"  %{x}p{w} = getelementptr i64, ptr %{arr}, i64 {i}\n  %{x}{w} = load i64, ptr %{x}p{w}\n"
        for x, arr in (("s", "srcs"), ("d", "dsts"), ("l", "lens"))
    )


def _build_ir(ways: int = _WAYS) -> str:
    """The copy loop as LLVM IR. ``@pdkv_nt_gather`` copies pieces ``_WAYS`` at a time: each
    piece's unaligned head, then 256-byte steps of all of them side by side while every one
    has steps left, then each one's remaining steps and tail alone (``@pdkv_rest``); the
    pieces left over (fewer than ``_WAYS``) one at a time."""
    W = ways
    ld, st = _step("r", "%s", "%d", "%k")
    rest = (
        "define internal void @pdkv_rest(i64 %s, i64 %d, i64 %k0, i64 %n, i64 %t) nounwind {\n"
        "entry:\n  br label %loop\nloop:\n  %k = phi i64 [%k0, %entry], [%k1, %step]\n"
        "  %go = icmp ult i64 %k, %n\n  br i1 %go, label %step, label %tail\nstep:\n"
        f"{ld}{st}  %k1 = add i64 %k, 1\n  br label %loop\ntail:\n  %e = shl i64 %n, 8\n"
        "  %ts = add i64 %s, %e\n  %td = add i64 %d, %e\n  %tp = inttoptr i64 %ts to ptr\n"
        "  %tq = inttoptr i64 %td to ptr\n"
        "  call void @llvm.memcpy.p0.p0.i64(ptr %tq, ptr %tp, i64 %t, i1 false)\n  ret void\n}\n"
    )
    idx = "".join(f"  %ix{w} = add i64 %i, {w}\n" for w in range(W))
    heads = "".join(_load_piece(str(w), f"%ix{w}") + _head(str(w), f"%s{w}", f"%d{w}", f"%l{w}") for w in range(W))
    mins = ["%N0"]
    for w in range(1, W):
        mins.append(f"%mn{w}")
        heads += f"  %lt{w} = icmp ult i64 %N{w}, {mins[-2]}\n  %mn{w} = select i1 %lt{w}, i64 %N{w}, i64 {mins[-2]}\n"
    lds, sts = zip(*(_step(f"g{w}", f"%S{w}", f"%D{w}", "%k") for w in range(W)))
    rests = "".join(
        f"  call void @pdkv_rest(i64 %S{w}, i64 %D{w}, i64 {mins[-1]}, i64 %N{w}, i64 %T{w})\n" for w in range(W)
    )
    gather = (
        "define void @pdkv_nt_gather(i64 %n, ptr %srcs, ptr %dsts, ptr %lens) nounwind {\n"
        f"entry:\n  %nr = urem i64 %n, {W}\n  %ng = sub i64 %n, %nr\n  br label %gouter\n"
        "gouter:\n  %i = phi i64 [0, %entry], [%inext, %gdone]\n  %gmore = icmp slt i64 %i, %ng\n"
        "  br i1 %gmore, label %group, label %souter\n"
        f"group:\n{idx}{heads}  br label %gloop\n"
        "gloop:\n  %k = phi i64 [0, %group], [%k1, %gstep]\n"
        f"  %go = icmp ult i64 %k, {mins[-1]}\n  br i1 %go, label %gstep, label %gdone\n"
        f"gstep:\n{''.join(lds)}{''.join(sts)}  %k1 = add i64 %k, 1\n  br label %gloop\n"
        f"gdone:\n{rests}  %inext = add i64 %i, {W}\n  br label %gouter\n"
        "souter:\n  %j = phi i64 [%ng, %gouter], [%j1, %single]\n  %smore = icmp slt i64 %j, %n\n"
        "  br i1 %smore, label %single, label %exit\n"
        f"single:\n{_load_piece('x', '%j')}{_head('x', '%sx', '%dx', '%lx')}"
        "  call void @pdkv_rest(i64 %Sx, i64 %Dx, i64 0, i64 %Nx, i64 %Tx)\n"
        "  %j1 = add i64 %j, 1\n  br label %souter\n"
        "exit:\n  fence seq_cst\n  ret void\n}\n"
    )
    return "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)\n\n" + rest + "\n" + gather + "\n!0 = !{i32 1}\n"


_IR = _build_ir()

_GATHER = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "fn", "engine" once compiled; "reason" once refused


def _jit(llvm: Any, ir: str) -> tuple[Any, Any]:
    """Compile ``ir`` for the host CPU; returns (the engine that owns the code, the loop)."""
    try:  # llvmlite < 0.45 needs it; later ones do it themselves and refuse the call
        llvm.initialize()
    except (RuntimeError, AttributeError):
        pass
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_default_triple()
    tm = target.create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
    )
    mod = llvm.parse_assembly(ir)
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    addr = engine.get_function_address("pdkv_nt_gather")
    if not addr:
        raise RuntimeError("the JIT returned no address for the copy loop")
    return engine, _GATHER(addr)


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
        engine, fn = _jit(llvm, _IR)
    except Exception as exc:  # any LLVM or JIT failure: report it, fall back to numpy
        _state["reason"] = f"the LLVM JIT could not build the copy loop: {type(exc).__name__}: {exc}"
        return
    _state["engine"] = engine  # owns the code: kept for the life of the process
    _state["fn"] = fn


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
