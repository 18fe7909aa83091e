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
``PDKV_SGLANG_TIMEOUT_S``) while prefill keeps its KV, and a later request that fits is
granted meanwhile (a request waiting for room never blocks one that has it); one larger than
the whole buffer is refused at ``send_metadata``, naming the setting, and a reservation
that can never be granted (no designated pages: a request decode aborted, or one it never
had) is refused at once, naming why.

:class:`StagedPages` is the scheduler's buffer allocator: staging blocks go only to a
request SGLang designated device pages for, exactly as many, so an authenticated prefill
can be granted nothing else. The scheduler's engine-bound mode does the rest: a received
request is bound to its device pages (:meth:`~pdkv.scheduling.scheduler.DecodeScheduler.bind`),
the copy is submitted, an abort during the copy takes effect when the copy has ended, and
the staging blocks return only then.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ...errors import RequestError
from ...scheduling.blocks import BlockPool
from ..core.pages import EnginePages

__all__ = ["StagedPages"]


class StagedPages:
    """Staging blocks (``num_blocks``) for a device pool of ``num_pages`` pages. Thread-safe.

    :meth:`designate` records the device pages SGLang chose for a request (an
    :class:`~pdkv.integrations.core.pages.EnginePages` of the device pool keeps them: no
    page of two live requests); the scheduler's :meth:`try_allocate_for` then gives that
    request as many staging blocks (None: not designated, a different count, or the buffer
    full for now). :meth:`holds` is true while the request has a designation or staging
    blocks: its copy into the device pages may still run until the scheduler frees them,
    and only then are its device pages released."""

    def __init__(self, num_blocks: int, num_pages: int) -> None:
        self._pool = BlockPool(num_blocks, name="staging")
        self._device = EnginePages(num_pages)
        self._lock = threading.Lock()
        self._owner: dict[int, str] = {}  # staging block -> the request holding it
        self._held: dict[str, int] = {}  # request -> staging blocks it holds
        self._pages: dict[str, tuple[int, ...]] = {}  # request -> its device pages, while it holds blocks

    def designate(self, request_id: str, pages: Sequence[int]) -> None:
        """SGLang allocated device ``pages`` for ``request_id``. RequestError as
        :meth:`EnginePages.designate <pdkv.integrations.core.pages.EnginePages.designate>`
        says, or for more pages than the staging buffer holds."""
        if len(pages) > self._pool.num_total:
            raise RequestError(
                f"request {request_id!r}: {len(pages)} pages, more than the staging buffer's "
                f"{self._pool.num_total} (raise PDKV_SGLANG_STAGING_MB)"
            )
        self._device.designate(request_id, pages)

    def withdraw(self, request_id: str) -> bool:
        """Drop a designation prefill never reserved; False if there is none."""
        with self._lock:  # not between try_allocate_for's look at the designation and its use
            return self._device.withdraw(request_id)

    def holds(self, request_id: str) -> bool:
        return self._device.holds(request_id)

    # ------------------------------------------------------------------ the scheduler's side
    def refusal(self, request_id: str, n: int) -> str:
        """Why staging blocks can never be given to ``request_id`` for ``n`` pages ('' when
        they can, now or once the buffer has room): its device pages are not designated, or
        not ``n`` of them."""
        return self._device.refusal(request_id, n)

    def try_allocate_for(self, request_id: str, n: int) -> list[int] | None:
        with self._lock:
            ids = self._device.designated(request_id)
            if ids is None or len(ids) != n:
                return None
            blocks = self._pool.try_allocate(n)
            if blocks is None:
                return None  # full for now: the reservation queues
            pages = self._device.try_allocate_for(request_id, n)
            if pages is None:  # cannot happen: withdraw takes the same lock
                self._pool.free(blocks)
                return None
            self._pages[request_id] = tuple(pages)
            self._held[request_id] = n
            for b in blocks:
                self._owner[b] = request_id
            return blocks

    def try_allocate(self, n: int) -> list[int] | None:
        return None  # blocks come only by request

    def free(self, blocks: Sequence[int]) -> None:
        ids = [int(b) for b in blocks]
        done: list[tuple[int, ...]] = []
        with self._lock:
            if len(set(ids)) != len(ids) or any(b not in self._owner for b in ids):
                raise RequestError(f"staging blocks {ids[:8]} are not held")
            for b in ids:
                rid = self._owner.pop(b)
                self._held[rid] -= 1
                if not self._held[rid]:  # its last block: its copy is over
                    del self._held[rid]
                    done.append(self._pages.pop(rid))
            self._pool.free(ids)
            for pages in done:
                self._device.free(pages)

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_total(self) -> int:
        return self._pool.num_total

    @property
    def num_held(self) -> int:
        return self._pool.num_held
