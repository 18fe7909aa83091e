"""Pages an engine chose itself: :class:`EnginePages`, a buffer allocator for pdkv's
scheduler that places by request.

pdkv's scheduler normally picks a request's destination blocks. An engine that allocates
its own pages first (SGLang's decode: host pages or device pages, then ``send_metadata``)
designates them here under the request's id; when prefill reserves that id, the scheduler
takes exactly those pages (``try_allocate_for``), and every check pdkv makes on a write
(the grant is live, the session is the grant's, the pages are the grant's) applies to them.
When the scheduler frees them (the request received, failed, aborted, or its lease ended,
and no write admitted under its grant still runs) they leave pdkv: :meth:`holds` turns
false, and ``on_free`` is told. Until then the engine must not reuse them.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable, Sequence

from ...errors import RequestError

__all__ = ["EnginePages"]


class EnginePages:
    """``num_pages`` pages of an engine's pool (ids ``0..num_pages-1``), none pdkv's until
    designated. Thread-safe. ``on_free(request_id, pages)`` runs, with no lock held, each
    time the scheduler gives a request's pages back."""

    def __init__(self, num_pages: int, on_free: Callable[[str, tuple[int, ...]], None] | None = None) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages <= 0:
            raise ValueError(f"num_pages={num_pages!r} must be a positive integer")
        self._n = num_pages
        self._on_free = on_free
        self._lock = threading.Lock()
        self._designated: dict[str, tuple[int, ...]] = {}
        self._held: dict[str, tuple[int, ...]] = {}
        self._owner: dict[int, str] = {}  # page -> the request it is designated to or held by

    def designate(self, request_id: str, pages: Sequence[int]) -> None:
        """The engine allocated ``pages`` (in the request's block order) for ``request_id``.
        RequestError for an empty list, ids out of range or repeated, a page another
        request has, or a request that already has pages here."""
        ids = tuple(pages)
        if not ids or any(
            not isinstance(p, numbers.Integral) or isinstance(p, bool) or not 0 <= p < self._n for p in ids
        ):
            raise RequestError(f"request {request_id!r}: pages must be ids in [0, {self._n}), got {list(ids)[:8]}")
        ids = tuple(int(p) for p in ids)
        if len(set(ids)) != len(ids):
            raise RequestError(f"request {request_id!r}: a page is listed twice")
        with self._lock:
            if request_id in self._designated or request_id in self._held:
                raise RequestError(f"request {request_id!r} already has pages here")
            taken = [p for p in ids if p in self._owner]
            if taken:
                raise RequestError(
                    f"request {request_id!r}: pages {taken[:8]} belong to request {self._owner[taken[0]]!r}"
                )
            self._designated[request_id] = ids
            for p in ids:
                self._owner[p] = request_id

    def withdraw(self, request_id: str) -> bool:
        """Take back pages designated to a request prefill never reserved; False if it has
        none designated (none, or the scheduler holds them: abort the request there)."""
        with self._lock:
            ids = self._designated.pop(request_id, None)
            for p in ids or ():
                del self._owner[p]
        return ids is not None

    def designated(self, request_id: str) -> tuple[int, ...] | None:
        """The pages designated to ``request_id`` and not yet granted (None: none)."""
        with self._lock:
            return self._designated.get(request_id)

    def holds(self, request_id: str) -> bool:
        """Whether any page of ``request_id`` is still pdkv's (designated or granted)."""
        with self._lock:
            return request_id in self._designated or request_id in self._held

    # ------------------------------------------------------------------ the scheduler's side
    def refusal(self, request_id: str, n: int) -> str:
        """Why a reservation of ``n`` pages for ``request_id`` can never be granted ('' when
        it can): nothing designated to it, or not ``n`` pages. The scheduler refuses such a
        reservation at once, naming this, instead of queueing it."""
        with self._lock:
            ids = self._designated.get(request_id)
        if ids is None:
            return f"request {request_id[:80]!r}: no pages are designated to it here (unknown, aborted or granted)"
        if len(ids) != n:
            return f"request {request_id[:80]!r}: {len(ids)} pages are designated to it, not {n}"
        return ""

    def try_allocate_for(self, request_id: str, n: int) -> list[int] | None:
        with self._lock:
            ids = self._designated.get(request_id)
            if ids is None or len(ids) != n:
                return None  # nothing designated, or not the pages the reservation needs
            del self._designated[request_id]
            self._held[request_id] = ids
            return list(ids)

    def try_allocate(self, n: int) -> list[int] | None:
        return None  # pages come only by request

    def free(self, blocks: Sequence[int]) -> None:
        ids = tuple(int(b) for b in blocks)
        if not ids:
            return
        with self._lock:
            rid = self._owner.get(ids[0])
            if rid is None or self._held.get(rid) != ids:
                raise RequestError(f"pages {list(ids)[:8]} are not one request's granted pages")
            del self._held[rid]
            for p in ids:
                del self._owner[p]
        if self._on_free is not None:
            self._on_free(rid, ids)

    @property
    def num_free(self) -> int:
        with self._lock:
            return self._n - len(self._owner)

    @property
    def num_total(self) -> int:
        return self._n

    @property
    def num_held(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values())
