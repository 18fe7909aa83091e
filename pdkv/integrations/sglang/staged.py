"""A GPU decode's device destination: prefill writes into pdkv's own staging buffer (a
pinned shared-memory segment, as every pdkv decode has), and pdkv's swap engine copies the
request's blocks into the device pages SGLang chose before the request reports success.

SGLang's device destination hands a backend GPU pages. pdkv's host transports (tcp, NIXL's
DRAM path) write host memory by address, so on a GPU the KV lands in the staging buffer
first, layer by layer as prefill sends it, and one copy per request moves it host -> GPU on
the copy engines (``SwapEngine(priority="decode")``: no SM taken from decode's steps). The
buffer is only a bounce: a request holds its blocks from its grant until its copy ends, so
it is sized for the transfers in flight (``PDKV_SGLANG_STAGING_MB``), not for the pool. A
request that finds it full waits in the scheduler's queue (bounded by
``PDKV_SGLANG_TIMEOUT_S``) while prefill keeps its KV; one larger than the whole buffer is
refused at ``send_metadata``, naming the setting.

:class:`StagedPages` is the scheduler's buffer allocator: staging blocks go only to a
request SGLang designated device pages for, exactly as many, so an authenticated prefill
can be granted nothing else. The scheduler's engine-bound mode does the rest: a received
request is bound to its device pages (:meth:`~pdkv.scheduling.scheduler.DecodeScheduler.bind`),
the copy is submitted, an abort during the copy takes effect when the copy has ended, and
the staging blocks return only then.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Sequence

from ...errors import RequestError
from ...scheduling.blocks import BlockPool

__all__ = ["StagedPages"]


class StagedPages:
    """Staging blocks (``num_blocks``) for a device pool of ``num_pages`` pages. Thread-safe.

    :meth:`designate` records the device pages SGLang chose for a request; the scheduler's
    :meth:`try_allocate_for` then gives that request as many staging blocks (None: not
    designated, a different count, or the buffer full for now). :meth:`holds` is true while
    the request has a designation or staging blocks: its copy into the device pages may
    still run until the scheduler frees them."""

    def __init__(self, num_blocks: int, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages={num_pages!r} must be a positive integer")
        self._pool = BlockPool(num_blocks, name="staging")
        self._pages = num_pages
        self._lock = threading.Lock()
        self._designated: dict[str, tuple[int, ...]] = {}
        self._owner: dict[int, str] = {}  # staging block -> the request holding it
        self._held: dict[str, int] = {}  # request -> staging blocks it holds

    def designate(self, request_id: str, pages: Sequence[int]) -> tuple[int, ...]:
        """SGLang allocated device ``pages`` for ``request_id``. RequestError for an empty
        list, ids out of range or repeated, more pages than the staging buffer holds, or a
        request that already has a designation or blocks here."""
        ids = tuple(pages)
        if not ids or any(
            not isinstance(p, numbers.Integral) or isinstance(p, bool) or not 0 <= p < self._pages for p in ids
        ):
            raise RequestError(f"request {request_id!r}: pages must be ids in [0, {self._pages}), got {list(ids)[:8]}")
        ids = tuple(int(p) for p in ids)
        if len(set(ids)) != len(ids):
            raise RequestError(f"request {request_id!r}: a page is listed twice")
        if len(ids) > self._pool.num_total:
            raise RequestError(
                f"request {request_id!r}: {len(ids)} pages, more than the staging buffer's "
                f"{self._pool.num_total} (raise PDKV_SGLANG_STAGING_MB)"
            )
        with self._lock:
            if request_id in self._designated or request_id in self._held:
                raise RequestError(f"request {request_id!r} already has pages here")
            self._designated[request_id] = ids
        return ids

    def withdraw(self, request_id: str) -> bool:
        """Drop a designation prefill never reserved; False if there is none."""
        with self._lock:
            return self._designated.pop(request_id, None) is not None

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._designated or request_id in self._held

    # ------------------------------------------------------------------ the scheduler's side
    def try_allocate_for(self, request_id: str, n: int) -> list[int] | None:
        with self._lock:
            ids = self._designated.get(request_id)
            if ids is None or len(ids) != n:
                return None
            blocks = self._pool.try_allocate(n)
            if blocks is None:
                return None  # full for now: the reservation queues
            del self._designated[request_id]
            self._held[request_id] = n
            for b in blocks:
                self._owner[b] = request_id
            return blocks

    def try_allocate(self, n: int) -> list[int] | None:
        return None  # blocks come only by request

    def free(self, blocks: Sequence[int]) -> None:
        ids = [int(b) for b in blocks]
        with self._lock:
            if len(set(ids)) != len(ids) or any(b not in self._owner for b in ids):
                raise RequestError(f"staging blocks {ids[:8]} are not held")
            for b in ids:
                rid = self._owner.pop(b)
                self._held[rid] -= 1
                if not self._held[rid]:
                    del self._held[rid]
            self._pool.free(ids)

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_total(self) -> int:
        return self._pool.num_total

    @property
    def num_held(self) -> int:
        return self._pool.num_held
