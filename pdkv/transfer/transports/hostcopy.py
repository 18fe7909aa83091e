"""Host-memory copies of planned pieces: a host cache into decode's shared buffers.

:class:`HostCopier` executes a layer's :func:`~pdkv.plan.layer_pieces` with the streaming
(non-temporal) copy loop of ``_ffi.cpu`` where it builds, else with numpy gathers, shared
among ``threads`` threads that run without the GIL. Every piece is checked against its
source and destination regions before a byte moves: the loops write through raw addresses.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ... import _ffi
from ...layout import CacheSpec, Segment
from ...plan import check_within, split_runs

__all__ = ["HostCopier", "GATHER_PIECE"]

GATHER_PIECE = 4 << 20  # bytes per share when copies are split among threads
Pieces = tuple[Segment, Any, Any, Any]  # one segment's (src, dst, length) arrays: plan.layer_pieces
Take = tuple[Any, Any, Any]  # (source rows, row ids, destination rows) for np.take


class HostCopier:
    """Copies from ``cache`` (host memory of this process) into ``dst_specs`` (decode rank
    -> its buffer mapped here), with ``threads`` threads. Owns its thread pool (:meth:`close`)."""

    def __init__(self, cache: CacheSpec, dst_specs: dict[int, CacheSpec], threads: int) -> None:
        self.cache = cache
        self.dst_specs = dst_specs
        self.threads = threads
        self.piece = GATHER_PIECE
        self._pool: ThreadPoolExecutor | None = None
        self._views: dict[tuple[int, int, int], tuple[memoryview, int]] = {}

    @property
    def threaded(self) -> bool:
        """Whether a copy was ever shared among threads."""
        return self._pool is not None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._views.clear()

    def region_view(self, spec: CacheSpec, layer: int, tensor: int) -> tuple[memoryview, int]:
        """A view of ``spec``'s (layer, tensor) region and its base address (made once)."""
        key = (id(spec), layer, tensor)
        v = self._views.get(key)
        if v is None:
            base, stride = spec.region(layer, tensor)
            v = self._views[key] = (_ffi.libc.host_view(base, stride * spec.num_blocks), base)
        return v

    def copy(self, layer: int, plans: list[Pieces]) -> None:
        """Host-cache pieces into decode's buffer: the streaming copy loop where it runs
        (``_ffi.cpu``: non-temporal stores, no read-for-ownership of the destination),
        else numpy."""
        if _ffi.cpu.available():
            self.stream(layer, plans)
        else:
            self.numpy(layer, plans)

    def numpy(self, layer: int, plans: list[Pieces]) -> None:
        takes: list[Take] = []
        rest = []
        for seg, src, dst, ln in plans:
            sv, sbase = self.region_view(self.cache, layer, seg.tensor)
            dspec = self.dst_specs[seg.dst_rank]
            dv, dbase = self.region_view(dspec, layer, seg.tensor)
            sstride = self.cache.region(layer, seg.tensor)[1]
            dstride = dspec.region(layer, seg.tensor)[1]
            single = ln == seg.length
            if seg.count == 1 and seg.dst_offset == 0 and seg.length == dstride and single.sum() >= 4:
                # whole blocks into a packed buffer: gather runs of consecutive destination
                # blocks with one np.take each (a C loop, no temporary); grants come out of
                # the pool as runs, so there are few
                di = (dst[single] - dbase) // dstride
                si = (src[single] - sbase - seg.src_offset) // sstride
                brk = np.flatnonzero(np.diff(di) != 1) + 1
                if brk.size < di.size // 4:
                    s2 = np.frombuffer(sv, np.uint8).reshape(-1, sstride)[
                        :, seg.src_offset : seg.src_offset + seg.length
                    ]
                    d2 = np.frombuffer(dv, np.uint8).reshape(-1, dstride)
                    # runs cut into pieces of about 4 MiB, so that threads share them evenly
                    step = max(1, self.piece // seg.length)
                    for a, b in zip(np.concatenate(([0], brk)).tolist(), np.concatenate((brk, [di.size])).tolist()):
                        d0 = int(di[a])
                        for lo in range(a, b, step):
                            hi = min(b, lo + step)
                            takes.append((s2, si[lo:hi], d2[d0 + lo - a : d0 + hi - a]))
                    src, dst, ln = src[~single], dst[~single], ln[~single]
            if src.size:
                rest.append((sv, sbase, dv, dbase, src, dst, ln))
        # every request and segment of the layer in one share-out among the copy threads
        self.gather(takes)
        # memoryview slice assignment is a plain memcpy with less call overhead than
        # ctypes.memmove. One thread: two threads fight over the GIL and ran 10x slower;
        # process_vm_writev (scatter-gather in the kernel, no GIL) was no faster into shm.
        for sv, sbase, dv, dbase, src, dst, ln in rest:
            for so, do, n in zip((src - sbase).tolist(), (dst - dbase).tolist(), ln.tolist()):
                dv[do : do + n] = sv[so : so + n]

    def stream(self, layer: int, plans: list[Pieces]) -> None:
        """Every piece of the layer copied by the streaming (non-temporal) copy loop of
        ``_ffi.cpu``, shared among the copy threads in runs of about equal bytes. Each piece
        is checked against its source and destination regions first: the loop writes
        through raw addresses."""
        srcs: list[Any] = []
        dsts: list[Any] = []
        lens: list[Any] = []
        for seg, src, dst, ln in plans:
            sv, sbase = self.region_view(self.cache, layer, seg.tensor)
            dv, dbase = self.region_view(self.dst_specs[seg.dst_rank], layer, seg.tensor)
            # contiguous int64 already from the planner (no copy then), as the loop needs them
            s, d, k = (np.ascontiguousarray(a, dtype=np.int64) for a in (src, dst, ln))
            where = f"(tensor {seg.tensor}, decode rank {seg.dst_rank})"
            check_within(s, k, sbase, len(sv), f"layer {layer}: a planned copy falls outside its source region {where}")
            check_within(
                d, k, dbase, len(dv), f"layer {layer}: a planned copy falls outside its destination region {where}"
            )
            srcs.append(s)
            dsts.append(d)
            lens.append(k)
        if not lens:
            return
        src, dst, ln = (a[0] if len(a) == 1 else np.concatenate(a) for a in (srcs, dsts, lens))
        # pieces stay in destination order (grant order): sorted by source address instead,
        # random 32 KiB blocks ran 0.69-0.73 of the ceiling against 0.79-0.81 on the H200 x2
        # host's Xeon (ABBA runs of tools/bench_transport.py), though 0.73-0.75 against
        # 0.57-0.66 on the dev VM
        n = min(self.threads, max(1, int(ln.sum()) // self.piece))
        if n > 1 and int(ln.max()) > self.piece:  # cut long runs so the threads share evenly
            idx, off, ln = split_runs(ln, self.piece)
            src, dst = src[idx] + off, dst[idx] + off
        cuts: list[int] = np.searchsorted(np.cumsum(ln), np.arange(1, n) * (int(ln.sum()) / n)).tolist()

        def part(a: int, b: int) -> Callable[[], None]:
            return lambda: _ffi.cpu.gather(src[a:b], dst[a:b], ln[a:b])

        self.share([part(a, b) for a, b in zip([0, *cuts], [*cuts, int(ln.size)])])

    def gather(self, takes: list[Take]) -> None:
        """``out[:] = rows[idx]`` for every ``(rows, idx, out)``: np.take copies in C without
        the GIL, so ``threads`` threads run at once."""

        def run(share: list[Take]) -> None:
            for rows, idx, out in share:
                np.take(rows, idx, axis=0, out=out, mode="clip")

        def part(i: int, n: int) -> Callable[[], None]:
            return lambda: run(takes[i::n])

        n = max(1, min(self.threads, len(takes)))
        self.share([part(i, n) for i in range(n)])

    def share(self, parts: list[Callable[[], None]]) -> None:
        """Run the copy ``parts`` at once: this thread takes the first, the copy pool the
        rest (C loops without the GIL); returns when all are done, raising the first error."""
        if len(parts) <= 1:
            for part in parts:
                part()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="pdkv-copy")
        futs = [self._pool.submit(part) for part in parts[1:]]
        try:
            parts[0]()
        finally:
            for f in futs:
                f.result()
