"""The swap engine: scattered KV blocks between the pinned CPU buffer and GPU blocks.

A copy is planned once (pure numpy: addresses of every (layer, tensor, block), runs of
blocks contiguous on both sides merged into one piece) and then executed by a strategy:

``kernel``  (default with a GPU) an NVRTC gather/scatter kernel that reads and writes
            mapped pinned host memory directly; one launch per copy (or per layer).
``batch``   ``cudaMemcpyBatchAsync`` (CUDA 12.8+), in sub-batches growing from 64 pieces
            to 1024, so the copy engines start while the rest is being submitted.
``memcpy``  one ``cudaMemcpyAsync`` per coalesced piece (the last fallback).
``host``    ``memmove`` on a worker thread, for host-to-host copies (CPU-only hosts,
            tests, the local transfer tool without a GPU).

Every copy is asynchronous and returns a :class:`CopyHandle` with ``done()``,
``wait(timeout)`` and ``error``; with ``layerwise=True`` it also has one completion per
layer, so an engine can start on layer 0 before the last layer lands.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np

from .. import _ffi
from ..errors import ClosedError, CudaUnavailableError, PdkvError, SwapError
from ..layout import CacheSpec
from ..plan import CopyPlan, plan_copy, split_runs
from .handles import _DRAIN_TIMEOUT_S, CopyHandle, _CudaHandle, _destroy_events, _drain, _FutureHandle
from .kernels import KERNEL_SOURCE

# CopyPlan, plan_copy and split_runs live in pdkv.plan (re-exported here); the kernel in pdkv.swap.kernels
__all__ = ["CopyPlan", "plan_copy", "split_runs", "CopyHandle", "SwapEngine", "Strategy", "KERNEL_SOURCE"]

Strategy = Literal["auto", "kernel", "batch", "memcpy", "host"]
# auto: mean piece at least this -> cudaMemcpyBatchAsync (H200, 4096 blocks, batches
# submitted in growing sub-batches). The copy engines beat the kernel from 64 KiB
# host->GPU (54.4 vs 50.9 GB/s) but only from 256 KiB GPU->host (51.4 vs 52.2 at 128 KiB).
# Handing the driver a piece costs ~1-2 us of CPU, a 64 KiB piece moves in 1.2 us: at
# 64 KiB the batch is CPU-bound, and on a busier host it fell to 43.1 GB/s (bare one-call
# batch 47.4) while the kernel, which costs no CPU per piece, holds ~51. From 128 KiB
# (2.4 us a piece) the copy engines keep a 2x margin.
_BATCH_MIN_PIECE: dict[str | None, int | None] = {
    "h2d": 128 << 10,
    "d2h": 256 << 10,
    None: 256 << 10,
    # device to device (cuda_ipc): the kernel always; the copy
    # engines moved 196 GB/s of 1 MiB pieces against its 1 TB/s
    "d2d": None,
}
# a batch is submitted as several cudaMemcpyBatchAsync calls, the first small and each
# next one twice as large up to the cap, so the copy engines start on the first pieces
# while the rest are still being handed to the driver
_BATCH_FIRST, _BATCH_MAX = 64, 1024


def _batch_spans(a: int, b: int, first: int | None = None, cap: int | None = None) -> list[tuple[int, int]]:
    """``[a, b)`` cut into consecutive spans of ``first``, ``2*first``, ... at most ``cap`` items."""
    n = _BATCH_FIRST if first is None else first
    cap = _BATCH_MAX if cap is None else cap
    if n < 1 or cap < n:
        raise ValueError(f"batch spans need 1 <= first <= cap, got first={n}, cap={cap}")
    out = []
    while a < b:
        out.append((a, min(b, a + n)))
        a += n
        n = min(cap, 2 * n)
    return out


class _Busy:
    def done(self) -> bool:
        return False


_BUSY = _Busy()


class _PinnedStaging:
    """Kernel descriptors: pinned host memory the CPU fills, its device twin the kernel
    reads, and the event that says the upload landed. Reused once the copy that read it
    is done."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.addr = _ffi.cuda.malloc_host(nbytes)
        self._fin = weakref.finalize(self, _ffi.cuda.free_host, self.addr)
        try:
            self.dev = _ffi.cuda.malloc(nbytes)
            self._fin_dev = weakref.finalize(self, _ffi.cuda.free, self.dev)
            self.uploaded = _ffi.cuda.event_create()
            self._fin_ev = weakref.finalize(self, _ffi.cuda.event_destroy, self.uploaded)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for f in ("_fin_ev", "_fin_dev", "_fin"):
            if hasattr(self, f):
                getattr(self, f)()


class SwapEngine:
    """Copies blocks between two caches (a pinned buffer and a GPU cache, or two host
    caches with ``strategy='host'``).

    Parameters
    ----------
    buffer:
        :class:`~pdkv.layout.CacheSpec` of the CPU buffer (pinned for GPU strategies).
    gpu:
        :class:`~pdkv.layout.CacheSpec` of the engine's GPU cache (or a host cache).
    strategy:
        ``auto`` (kernel, else batch, else memcpy; ``host`` without CUDA), or one forced.
    stream:
        CUDA stream for copies (default: one the engine creates, non-blocking).
    device:
        CUDA device the copies run on: the GPU cache's (``gpu.device``) unless given, else
        the device current in the constructing thread. The engine makes it current for each
        call and restores the caller's afterwards, so it may be used from any thread.
    buffer_pinned:
        Whether ``buffer`` is registered with CUDA; GPU strategies refuse otherwise.
    layerwise:
        Default for :meth:`submit`: one completion per layer.
    priority:
        ``throughput`` (``auto`` picks the kernel under 128 KiB pieces host->GPU, 256 KiB
        GPU->host: the fastest copy) or ``decode`` (``auto`` moves host<->GPU copies on the
        copy engines at every piece size: no SM is taken from a decode step running beside
        the swap, and per GB/s moved they cost that step the least of every option measured,
        2 KiB to 2 MiB pieces, at a lower rate for small pieces; ``tools/bench_interference.py``,
        docs/PERF.md).
    max_ctas:
        The kernel's grid at most this many CTAs (each loops over its share of the pieces):
        fewer SMs taken from a decode step running beside the swap, at some bandwidth
        (``tools/bench_interference.py`` measures both). Default: one CTA per piece.

    The engine is a :class:`~pdkv.scheduling.scheduler.SwapBackend`: :meth:`submit` copies buffer
    blocks into GPU blocks. Ownership: the engine owns its stream, events and staging
    memory and frees them on :meth:`close`; the caches belong to the caller.
    """

    def __init__(
        self,
        buffer: CacheSpec,
        gpu: CacheSpec,
        *,
        strategy: Strategy = "auto",
        stream: int | None = None,
        device: int | None = None,
        buffer_pinned: bool = True,
        layerwise: bool = False,
        host_threads: int = 2,
        max_ctas: int | None = None,
        priority: Literal["throughput", "decode"] = "throughput",
    ) -> None:
        if buffer.layout.block_bytes != gpu.layout.block_bytes or buffer.layout.tensors != gpu.layout.tensors:
            raise SwapError("buffer and GPU cache have different layouts")
        if strategy not in ("auto", "kernel", "batch", "memcpy", "host"):
            raise ValueError(f"strategy={strategy!r} must be auto, kernel, batch, memcpy or host")
        if max_ctas is not None and (not isinstance(max_ctas, int) or isinstance(max_ctas, bool) or max_ctas < 1):
            raise ValueError(f"max_ctas={max_ctas!r} must be a positive integer")
        self._ctas = max_ctas
        if priority not in ("throughput", "decode"):
            raise ValueError(f"priority={priority!r} must be 'throughput' or 'decode'")
        self.priority = priority
        if device is None:
            device = gpu.device
        elif gpu.device is not None and gpu.device != device:
            raise SwapError(f"device={device}, but the GPU cache is on device {gpu.device}")
        if device is not None and (not isinstance(device, int) or device < 0):
            raise ValueError(f"device={device!r} must be a CUDA device ordinal")
        self.buffer, self.gpu = buffer, gpu
        self.layerwise = layerwise
        self.device: int | None = device  # GPU strategies resolve None below (then always an int)
        self._closed = False
        self._lock = threading.Lock()
        self._staging: list[tuple[_PinnedStaging, CopyHandle | _Busy | None]] = []
        self._own_stream = False
        self._side = 0
        self._stream = 0
        self._pool: ThreadPoolExecutor | None = None
        self._auto = strategy == "auto"
        if strategy == "auto":
            strategy = "host" if _ffi.cuda.device_count() == 0 else "kernel"
        if strategy != "host":
            if _ffi.cuda.device_count() == 0:
                raise CudaUnavailableError(f"strategy={strategy!r} needs a CUDA device; none found")
            if not buffer_pinned:
                raise SwapError(
                    "the CPU buffer is not pinned: GPU copies from pageable memory are synchronous and "
                    "~7x slower; create it with SharedBuffer.create(..., require_pinned=True)"
                )
            if device is None:  # a cache without a device: this thread's current one
                device = _ffi.cuda.current_device()
            self.device = device
            # the engine's kernel, streams and events live on its device; every call makes
            # that device current for itself and gives the caller's back (on_device)
            with _ffi.cuda.on_device(device):
                try:
                    strategy = self._init_cuda(strategy, stream, device)
                except BaseException:
                    self._close_cuda()  # a stream made before the failure is not left behind
                    raise
        else:
            self._pool = ThreadPoolExecutor(max_workers=host_threads, thread_name_prefix="pdkv-swap")
        self.strategy: Strategy = strategy

    def _init_cuda(self, strategy: Strategy, stream: int | None, device: int) -> Strategy:
        """The kernel, streams and the strategy that runs (the device is current)."""
        if strategy == "kernel":
            try:
                self._fn = _ffi.cuda.compile_kernel(KERNEL_SOURCE, "pdkv_copy", device)
                # one CTA per chunk measured best on an H200 (exp: 50 vs 46.5 GB/s at
                # 16 KiB for a persistent 4-per-SM grid); the loop covers huge plans
                self._max_grid = self._ctas or (1 << 31) - 1
            except CudaUnavailableError:
                strategy = "batch"
        if strategy == "batch" and not _ffi.cuda.batch_copy_supported():
            strategy = "memcpy"
        if stream is None:
            self._stream = _ffi.cuda.stream_create(nonblocking=True)
            self._own_stream = True
        else:
            self._stream = stream
        if strategy == "kernel":
            # descriptors are uploaded on a side stream, so the upload for the next copy
            # overlaps the kernel of the one before instead of queueing behind it
            self._side = _ffi.cuda.stream_create(nonblocking=True)
        return strategy

    # ------------------------------------------------------------------ API
    def submit(self, request_id: str, buffer_blocks: Sequence[int], gpu_blocks: Sequence[int]) -> CopyHandle:
        """Buffer -> GPU copy of one request's blocks (the scheduler's swap)."""
        return self.copy(buffer_blocks, gpu_blocks, direction="h2d")

    def copy(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        *,
        direction: Literal["h2d", "d2h"] = "h2d",
        layerwise: bool | None = None,
        stream: int | None = None,
    ) -> CopyHandle:
        """Copy ``src_blocks[i] -> dst_blocks[i]`` for every layer and tensor.

        ``h2d`` reads the buffer and writes the GPU cache; ``d2h`` the reverse. Everything
        is validated before anything is launched.
        """
        if self._closed:
            raise ClosedError("swap engine is closed")
        src, dst = (self.buffer, self.gpu) if direction == "h2d" else (self.gpu, self.buffer)
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"direction={direction!r} must be 'h2d' or 'd2h'")
        plan = plan_copy(src, dst, src_blocks, dst_blocks)
        lw = self.layerwise if layerwise is None else layerwise
        if self.strategy == "host":
            return self._run_host(plan, lw)
        return self._run_cuda(plan, lw, self._stream if stream is None else stream, direction)

    def copy_plan(
        self,
        plan: CopyPlan,
        *,
        layerwise: bool = False,
        stream: int | None = None,
        direction: Literal["h2d", "d2h", "d2d"] | None = None,
    ) -> CopyHandle:
        """Execute a plan made by :func:`plan_copy` (e.g. with TP segments). ``direction``
        (when known) lets ``auto`` pick the copy engines or the kernel for it."""
        if self._closed:
            raise ClosedError("swap engine is closed")
        if direction not in _BATCH_MIN_PIECE:
            raise ValueError(f"direction={direction!r} must be h2d, d2h, d2d or None")
        if self.strategy == "host":
            return self._run_host(plan, layerwise)
        return self._run_cuda(plan, layerwise, self._stream if stream is None else stream, direction)

    def close(self) -> None:
        """Wait for nothing, free the engine's stream, staging and workers. Idempotent.
        In-flight copies keep their own events; staging memory is freed after a sync."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.strategy != "host":
            assert self.device is not None  # resolved for every GPU strategy
            with _ffi.cuda.on_device(self.device):
                self._close_cuda()

    def _close_cuda(self) -> None:
        for stream in (self._stream, self._side):
            if stream:
                _ffi.cuda.stream_synchronize(stream)
        for st, h in self._staging:
            if isinstance(h, CopyHandle):  # a copy on a caller's stream may still read it
                try:
                    h.wait(60)
                except PdkvError:
                    pass
            st.close()
        self._staging.clear()
        if self._own_stream:
            _ffi.cuda.stream_destroy(self._stream)
        if self._side:
            _ffi.cuda.stream_destroy(self._side)
            self._side = 0

    def __enter__(self) -> SwapEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ strategies
    def _run_host(self, plan: CopyPlan, layerwise: bool) -> CopyHandle:
        assert self._pool is not None
        nl = plan.layer_ends.size
        flags = [threading.Event() for _ in range(nl)]
        src, dst, lens, ends = plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), plan.layer_ends.tolist()

        def work() -> None:
            i = 0
            for layer, end in enumerate(ends):
                while i < end:
                    _ffi.libc.memmove(dst[i], src[i], lens[i])
                    i += 1
                flags[layer].set()

        return _FutureHandle(plan.nbytes, nl, self._pool.submit(work), flags)

    def _staging_for(self, nbytes: int, handle_slot: list[int]) -> _PinnedStaging:
        with self._lock:
            for i, (st, h) in enumerate(self._staging):
                if st.nbytes >= nbytes and (h is None or h.done()):
                    self._staging[i] = (st, _BUSY)
                    handle_slot.append(i)
                    return st
            st = _PinnedStaging(max(1 << 16, 1 << (nbytes - 1).bit_length()))
            self._staging.append((st, _BUSY))
            handle_slot.append(len(self._staging) - 1)
            return st

    def _run_cuda(self, plan: CopyPlan, layerwise: bool, stream: int, direction: str | None = None) -> CopyHandle:
        assert self.device is not None  # resolved for every GPU strategy
        with _ffi.cuda.on_device(self.device):  # events, launches and copies on the engine's device
            return self._launch(plan, layerwise, stream, direction)

    def _launch(self, plan: CopyPlan, layerwise: bool, stream: int, direction: str | None) -> CopyHandle:
        nl = plan.layer_ends.size
        events = [_ffi.cuda.event_create() for _ in range(nl if layerwise else 1)]
        keep: object = None
        slot: list[int] = []
        strategy, grid = self._choose(plan, direction)
        queued = False  # set once anything is enqueued on `stream`
        try:
            if strategy == "kernel":
                cp = plan.chunked()
                n = cp.pieces
                desc = np.concatenate([cp.src, cp.dst, cp.lengths])
                st = self._staging_for(desc.nbytes, slot)
                _ffi.libc.host_view(st.addr, desc.nbytes)[:] = desc.view(np.uint8).data
                # descriptors go to device memory on the side stream, overlapping the copy
                # in flight; the kernel waits for them. H200, 16 KiB blocks, 16 kernels back
                # to back: descriptors already in device memory 50.9 GB/s, read from pinned
                # host memory by each CTA 50.4, uploaded in the kernel's own stream 49.6; 64
                # calls, A/B in ABBA order: side-stream upload 50.6-50.7, read from host 50.1-50.2
                _ffi.cuda.memcpy_async(st.dev, st.addr, desc.nbytes, self._side)
                _ffi.cuda.event_record(st.uploaded, self._side)
                _ffi.cuda.stream_wait_event(stream, st.uploaded)
                dev = st.dev
                groups = self._groups(cp.layer_ends, layerwise)
                for (a, b), ev in zip(groups, events):
                    if b > a:
                        _ffi.cuda.launch(
                            self._fn,
                            min(b - a, grid),
                            512,
                            [
                                ("ptr", dev + 8 * a),
                                ("ptr", dev + 8 * (n + a)),
                                ("ptr", dev + 8 * (2 * n + a)),
                                ("i64", b - a),
                            ],
                            stream,
                        )
                        queued = True
                    _ffi.cuda.event_record(ev, stream)
                keep = st
            else:
                groups = self._groups(plan.layer_ends, layerwise)
                for (a, b), ev in zip(groups, events):
                    if strategy == "batch":
                        for x, y in _batch_spans(a, b):
                            _ffi.libcuda.memcpy_batch_arrays(
                                np.ascontiguousarray(plan.dst[x:y], np.uint64),
                                np.ascontiguousarray(plan.src[x:y], np.uint64),
                                np.ascontiguousarray(plan.lengths[x:y], np.uint64),
                                stream,
                            )
                            queued = True
                    else:
                        src, dst, lens = plan.src[a:b].tolist(), plan.dst[a:b].tolist(), plan.lengths[a:b].tolist()
                        for i in range(b - a):
                            _ffi.cuda.memcpy_async(dst[i], src[i], lens[i], stream)
                            queued = True
                    _ffi.cuda.event_record(ev, stream)
        except BaseException as exc:
            # part of the copy may be queued already: let it finish before the error is
            # raised, so nothing writes into the destination (or reads the descriptors)
            # once the caller has been told the copy failed
            drained = _drain(stream) if queued else True
            _destroy_events(events)
            if slot:
                with self._lock:
                    self._staging[slot[0]] = (self._staging[slot[0]][0], None if drained else _BUSY)
            if not drained:
                raise SwapError(
                    f"{exc}; and the part of the copy already queued did not finish within "
                    f"{_DRAIN_TIMEOUT_S:g} s: its destination blocks may still be written"
                ) from exc
            raise
        h = _CudaHandle(plan.nbytes, nl, events, keep)
        if slot:
            with self._lock:
                self._staging[slot[0]] = (self._staging[slot[0]][0], h)
        return h

    def _choose(self, plan: CopyPlan, direction: str | None) -> tuple[Strategy, int]:
        """The strategy of one copy and, for the kernel, its grid's cap. ``auto`` follows the
        pieces: priority ``throughput`` takes the copy engines from ``_BATCH_MIN_PIECE`` (the
        fastest copy) and the kernel below; priority ``decode`` the copy engines at every size
        (``memcpy`` where libcuda has no batch call): per GB/s moved they cost a decode step
        beside them the least of every option at every piece size measured, 2 KiB to 2 MiB
        (H100: +0.10-0.21 % of the step a GB/s, the kernel on 1-8 CTAs +0.17-1.5 %; PERF.md)."""
        strategy = self.strategy
        min_piece = _BATCH_MIN_PIECE[direction]
        if not (self._auto and strategy == "kernel" and plan.pieces and min_piece is not None):
            return strategy, self._max_grid if strategy == "kernel" else 0
        if self.priority == "decode":
            return ("batch" if _ffi.cuda.batch_copy_supported() else "memcpy"), 0
        if plan.nbytes >= min_piece * plan.pieces and _ffi.cuda.batch_copy_supported():
            return "batch", 0  # large pieces: the copy engines beat the kernel (0.98 vs 0.92 at 512 KiB)
        return "kernel", self._max_grid

    @staticmethod
    def _groups(ends: np.ndarray, layerwise: bool) -> list[tuple[int, int]]:
        e = ends.tolist()
        if not layerwise:
            return [(0, e[-1] if e else 0)]
        return list(zip([0] + e[:-1], e))
