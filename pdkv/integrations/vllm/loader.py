"""vLLM's decode engine, the worker half (:class:`LoadWorker`, in each worker, where the
cache tensors live): copies decode's buffer blocks into the blocks vLLM chose, with pdkv's
swap engine, and reports each load. The scheduler half is :mod:`.consumer`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Literal

from ...buffer.shared import SharedBuffer
from ...errors import PdkvError
from ...layout import CacheSpec, KVLayout
from ...swap.engine import SwapEngine
from ..core.tally import Tally
from .settings import Load, StepMeta

__all__ = ["LoadWorker", "RECENT"]

_log = logging.getLogger("pdkv.integrations.vllm.consumer")  # the decode side's log lines, one logger
RECENT = 256  # loads each worker remembers (vLLM request -> its blocks), for inspection


class LoadWorker:
    """The worker half of a decode engine, one per TP rank: copies buffer blocks into the
    rank's vLLM cache (``cache``, :class:`~pdkv.CacheSpec` of vLLM's tensors) and reports
    each request once its copy is done (or failed: its blocks are then load errors).
    ``priority``: the swap engine's (``decode``, the default: the copy engines, no SM taken
    from vLLM's decode steps; ``throughput``: the kernel for small pieces).
    Ownership: the buffer mapping and the swap engine are this object's (:meth:`close`)."""

    def __init__(self, layout: KVLayout, cache: CacheSpec, *, priority: str = "decode") -> None:
        self.layout, self.cache, self.priority = layout, cache, priority
        self._buffer: SharedBuffer | None = None
        self._engine: SwapEngine | None = None
        self._pending: list[tuple[Load, Any, float]] = []
        self._finished: set[str] = set()
        self._errors: set[int] = set()
        self.tally = Tally()
        self.recent: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def _swap(self, meta: StepMeta) -> SwapEngine:
        name = meta.buffers[self.layout.tp_rank]
        if self._buffer is not None and self._buffer.name != name:
            raise PdkvError(f"decode's buffer changed name ({self._buffer.name} -> {name})")
        if self._engine is None:
            size = CacheSpec.buffer_bytes(self.layout, meta.buffer_blocks)
            buf = SharedBuffer.open(name, expect_size=size)
            try:
                spec = CacheSpec.for_buffer(self.layout, meta.buffer_blocks, buf.address, order=meta.buffer_order)
                pri: Literal["throughput", "decode"] = "decode" if self.priority == "decode" else "throughput"
                self._engine = SwapEngine(spec, self.cache, buffer_pinned=buf.pinned, priority=pri)
            except BaseException:
                buf.close()  # the next load opens it again: no mapping left behind
                raise
            self._buffer = buf
        return self._engine

    def start(self, meta: StepMeta) -> None:
        """``start_load_kv``: submit this step's loads (asynchronous), all of them as one
        copy (one plan and one launch for the step: 256 loads a step cost 48 ms of vLLM's
        loop one by one on the CPU build, ``tools/bench_vllm.py --hooks``); a copy the
        engine refuses is retried load by load, so that a bad one fails alone."""
        todo = []
        for ld in meta.loads:
            self.recent[ld.req_id] = ld.blocks
            while len(self.recent) > RECENT:
                self.recent.popitem(last=False)
            if not ld.buffer_blocks:
                self._fail(ld, "its KV did not arrive")
            else:
                todo.append(ld)
        if len(todo) > 1:
            try:
                h = self._swap(meta).copy(
                    [b for ld in todo for b in ld.buffer_blocks], [b for ld in todo for b in ld.blocks]
                )
            except (PdkvError, OSError, ValueError):
                pass  # one by one below: the load at fault fails alone
            else:
                now = time.monotonic()
                self._pending += [(ld, h, now) for ld in todo]
                return
        for ld in todo:
            try:
                h = self._swap(meta).submit(ld.req_id, ld.buffer_blocks, ld.blocks)
            except (PdkvError, OSError, ValueError) as exc:  # a buffer gone, renamed or of another size
                self._fail(ld, str(exc))
                continue
            self._pending.append((ld, h, time.monotonic()))

    def _fail(self, ld: Load, why: str) -> None:
        _log.warning("pdkv decode: load of %s failed: %s", ld.req_id, why)
        self.tally.count("load_failed")
        self._errors.update(ld.blocks)
        self._finished.add(ld.req_id)

    def finished(self) -> set[str]:
        """``get_finished``'s receiving half: the loads done since the last call."""
        keep, now = [], time.monotonic()
        done: dict[int, bool] = {}  # a step's loads share one copy: asked once a call
        for ld, h, t0 in self._pending:
            d = done.get(id(h))
            if d is None:
                d = done[id(h)] = h.done()
            if not d:
                keep.append((ld, h, t0))
            elif h.error is not None:
                self._fail(ld, str(h.error))
            else:
                self._finished.add(ld.req_id)
                self.tally.count("loads")
                self.tally.count("bytes_loaded", len(ld.blocks) * self.layout.block_bytes)
                self.tally.sample("load_s", now - t0)
        self._pending = keep
        out, self._finished = self._finished, set()
        return out

    def take_stats(self) -> dict[str, Any]:
        """What vLLM's stats hooks read since the last call (:class:`~pdkv.integrations.core.tally.Tally`)."""
        return self.tally.take()

    def load_errors(self) -> set[int]:
        """``get_block_ids_with_load_errors``: blocks whose load failed since the last call."""
        out, self._errors = self._errors, set()
        return out

    def close(self) -> None:
        deadline = time.monotonic() + 10  # a copy still running writes vLLM's blocks: let it end
        for _, h, _ in self._pending:
            while not h.done() and time.monotonic() < deadline:
                time.sleep(0.001)
        self._pending = []
        if self._engine is not None:
            self._engine.close()
        if self._buffer is not None:
            self._buffer.close()
