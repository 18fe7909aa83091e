"""The scheduler's state and its low-level transitions: what :class:`DecodeScheduler`'s
public methods, its tick (``loop``) and its view (``view``) share. Nothing here is public:
engines use :class:`~pdkv.scheduling.scheduler.DecodeScheduler`.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from ..errors import GrantViolation, LeaseExpiredError, RequestError
from ..layout import KVLayout
from .blocks import BlockAllocator, BlockPool
from .lifecycle import (
    _COUNTER_OF,
    _WRITABLE,
    Event,
    EventKind,
    Grant,
    SchedulerOptions,
    State,
    SwapBackend,
    _Hold,
    _make_event,
    _make_grant,
    _Metrics,
    _Quarantine,
    _Release,
    _Req,
)

_log = logging.getLogger(__name__)

__all__ = ["SchedulerCore", "Release"]


Release = Callable[[str, tuple[int, ...]], None]  # a held prefix's release (DecodeScheduler.hold_prefix)
_RESERVATIONS_OF = {"gpu": "reservations_gpu", "buffer": "reservations_buffer"}  # the counter of each location


class _EngineBlocks:
    """The ``gpu`` allocator of an engine-bound scheduler: the engine allocates GPU blocks
    itself, so pdkv has none to give (and never frees one)."""

    num_free = 0
    num_total = 0

    def try_allocate(self, n: int) -> list[int] | None:
        return None

    def free(self, blocks: Sequence[int]) -> None:
        raise AssertionError("pdkv frees no GPU block of an engine-bound scheduler")


class _Locked:
    """The scheduler's lock as a context manager (a class, cheaper on every landing than a
    generator-based one): on exit, with or without an exception, the events made under the
    lock are taken under it and delivered after it."""

    __slots__ = ("_core",)

    def __init__(self, core: SchedulerCore) -> None:
        self._core = core

    def __enter__(self) -> None:
        self._core._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        c = self._core
        try:
            ev = c._emit() if c._events else None
        finally:
            c._lock.release()
        if ev:
            c._deliver(ev)


class SchedulerCore:
    """The state of a :class:`~pdkv.scheduling.scheduler.DecodeScheduler` (its parameters are
    documented there) and the transitions the public methods and the tick share."""

    def __init__(
        self,
        *,
        num_layers: int | None = None,
        gpu: BlockAllocator | None,
        layout: KVLayout | None = None,
        buffer: BlockPool | None = None,
        swap: SwapBackend | None = None,
        tokens_per_block: int | None = None,
        block_bytes: int = 0,
        options: SchedulerOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        listener: Callable[[Event], None] | None = None,
    ) -> None:
        if layout is not None:
            for name, given, own in (
                ("num_layers", num_layers, layout.total_layers),
                ("tokens_per_block", tokens_per_block, layout.tokens_per_block),
            ):
                if given is not None and given != own:
                    raise ValueError(f"{name}={given!r} disagrees with the layout's {own}: give one of them")
            num_layers, tokens_per_block = layout.total_layers, layout.tokens_per_block
            block_bytes = block_bytes or layout.block_bytes
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
            raise ValueError(f"num_layers={num_layers!r} must be a positive integer")
        if num_layers > 4096:
            raise ValueError(f"num_layers={num_layers} is absurd (more than 4096)")
        if buffer is not None and swap is None:
            raise ValueError("a buffer needs a swap backend (swap=...) to move blocks to the GPU")
        self.num_layers = num_layers
        self._all_layers = (1 << num_layers) - 1
        self.options = options or SchedulerOptions()
        if gpu is None:
            if self.options.bind != "engine":
                raise ValueError("gpu=None needs SchedulerOptions(bind='engine'): the engine binds GPU blocks itself")
            gpu = _EngineBlocks()
        self.gpu = gpu
        self.buffer = buffer
        self.swap = swap
        self.tokens_per_block = tokens_per_block
        self.block_bytes = block_bytes
        self.clock = clock
        self.listener = listener
        self._listeners: tuple[Callable[[Event], None], ...] = ()  # add_listener's, after ``listener``
        self._lock = threading.Lock()
        self._locked_cm = _Locked(self)
        self._tok_bytes, self._tok_i = b"", 0
        self._reqs: dict[str, _Req] = {}
        self._tomb: OrderedDict[str, tuple[State, str, float]] = OrderedDict()  # state, reason, t
        self._expiry: list[tuple[float, int, str]] = []
        self._seq = 0
        self._queue: deque[str] = deque()
        # an engine that places each request's blocks itself (try_allocate_for): a queued
        # request waits for room its own blocks need, so one that has room may overtake it,
        # and one that can never be placed (``refusal``) is refused at once
        self._overtake = callable(getattr(buffer, "try_allocate_for", None))
        self._refuses: Callable[[str, int], str] | None = getattr(buffer, "refusal", None)
        self._swapq: dict[str, None] = {}
        self._swapping: dict[str, _Req] = {}
        self._ready: deque[_Req] = deque()
        self._busy_since = 0.0
        self._quarantine: list[_Quarantine] = []
        self._events: list[Event | _Release] = []
        self._holds: dict[str, _Hold] = {}  # hold_prefix's, not yet claimed by a reservation
        self._m = _Metrics().counters

    # ------------------------------------------------------------------ helpers
    def _emit(self) -> list[Event | _Release]:
        # called with the lock held: takes the events (and prefix releases due); the caller
        # delivers them unlocked
        ev, self._events = self._events, []
        return ev

    def _event(self, kind: EventKind, rid: str, grant: Grant | None = None, reason: str = "", t: float = 0.0) -> None:
        if self.listener is not None or self._listeners:
            self._events.append(_make_event(kind, rid, grant, reason, t))

    def _deliver(self, events: list[Event | _Release]) -> None:
        if not events:
            return
        fns = ((self.listener,) if self.listener is not None else ()) + self._listeners
        for e in events:
            if isinstance(e, _Release):
                e.fn(e.request_id, e.blocks)
                continue
            for fn in fns:
                fn(e)

    def _release_prefix(self, rid: str, blocks: tuple[int, ...], fn: Release | None) -> None:
        """A held prefix is no longer needed: ``fn(rid, blocks)`` once the lock is dropped."""
        if blocks and fn is not None:
            self._events.append(_Release(fn, rid, blocks))

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        """Also call ``fn`` with every event (after ``listener``), e.g. a transport's; as
        ``listener``, from whichever thread caused the event, with no lock held."""
        with self._lock:
            self._listeners = (*self._listeners, fn)

    def remove_listener(self, fn: Callable[[Event], None]) -> None:
        """Stop calling ``fn`` (added by :meth:`add_listener`); ValueError if it was not."""
        with self._lock:
            if fn not in self._listeners:
                raise ValueError("remove_listener: that function is not a listener of this scheduler")
            i = self._listeners.index(fn)
            self._listeners = self._listeners[:i] + self._listeners[i + 1 :]

    def _entomb(self, rid: str, state: State, reason: str) -> None:
        """Remember an ended request: the newest ``max_tombstones``, none ended more than
        ``tombstone_s`` ago (a steady rate holds a steady number)."""
        tomb = self._tomb
        now = self.clock()
        tomb.pop(rid, None)  # a request ended again (refused anew) is the newest, not its old place
        tomb[rid] = (state, reason, now)
        cut = now - self.options.tombstone_s
        while tomb and (len(tomb) > self.options.max_tombstones or next(iter(tomb.values()))[2] < cut):
            tomb.popitem(last=False)

    def _get_live(self, rid: str) -> _Req:
        req = self._reqs.get(rid)
        if req is None:
            tomb = self._tomb.get(rid)
            self._m["late_messages_rejected"] += 1
            if tomb is not None:
                state, reason, _ = tomb
                if state is State.EXPIRED:
                    raise LeaseExpiredError(f"request {rid!r}: its lease expired; the message is refused")
                raise RequestError(f"request {rid!r} is already {state.value}" + (f" ({reason})" if reason else ""))
            raise RequestError(f"unknown request {rid!r}")
        return req

    def _locked(self) -> _Locked:
        """The lock, and the events made under it delivered after it, also when the call
        raises (a write refused because the lease just ran out still tells the listener
        that the request expired)."""
        return self._locked_cm

    def _new_token(self) -> int:
        """A grant token: 63 random bits from the OS, read 256 tokens at a time (called under
        the lock; one system call a grant before)."""
        i = self._tok_i
        if i >= len(self._tok_bytes):
            self._tok_bytes, i = os.urandom(8 * 256), 0
        self._tok_i = i + 8
        return int.from_bytes(self._tok_bytes[i : i + 8], "little") >> 1

    def _check_writable(self, req: _Req, token: int, now: float) -> None:
        if req.token != token:
            self._m["late_messages_rejected"] += 1
            raise GrantViolation(f"request {req.rid!r}: grant token does not match (stale or forged)")
        if req.state not in _WRITABLE:
            self._m["late_messages_rejected"] += 1
            raise RequestError(f"request {req.rid!r} is {req.state.value}; no more writes are accepted")
        if now >= req.expires:
            self._expire(req, now)
            self._m["late_messages_rejected"] += 1
            raise LeaseExpiredError(f"request {req.rid!r}: its lease expired; the message is refused")

    def _push_expiry(self, req: _Req) -> None:
        self._seq += 1
        heapq.heappush(self._expiry, (req.expires, self._seq, req.rid))

    def _refusal(self, request_id: str, n: int) -> str:
        """Why the buffer can never place ``n`` blocks for ``request_id`` ('' when it can)."""
        return self._refuses(request_id, n) if self._refuses is not None else ""

    def _grant(self, req: _Req, now: float) -> Grant | None:
        """Try to give ``req`` destination blocks; return the grant or None."""
        n, o = req.n, self.options
        blocks = None
        # GPU room goes first to requests received and waiting for a swap: a new request that
        # took it directly would pass them, and a large one waiting could starve behind a
        # stream of small ones
        if (
            o.direct_to_gpu
            and o.bind == "pdkv"
            and req.gpu_ok
            and not self._swapq
            and self.gpu.num_free - n >= o.gpu_reserve_blocks
        ):
            blocks = self.gpu.try_allocate(n)
            if blocks is not None:
                req.location, req.gpu_blocks = "gpu", blocks
        if blocks is None and self.buffer is not None:
            # an allocator that places by request (an engine's own pages, chosen by the engine)
            place = getattr(self.buffer, "try_allocate_for", None)
            blocks = place(req.rid, n) if place is not None else self.buffer.try_allocate(n)
            if blocks is not None:
                req.location, req.buffer_blocks = "buffer", blocks
                held = self.buffer.num_held
                if held > self._m["buffer_blocks_peak"]:
                    self._m["buffer_blocks_peak"] = held
        if blocks is None:
            return None
        req.state = State.RESERVED
        req.token = self._new_token()
        req.reserved_at = now
        req.expires = now + o.lease_s
        self._push_expiry(req)
        self._m[_RESERVATIONS_OF[req.location]] += 1
        return _make_grant(req.rid, req.location, tuple(blocks), req.token, req.expires, o.lease_s, len(req.prefix))

    def _release_blocks(self, req: _Req, *, quarantine: bool, now: float) -> None:
        w = req.writers
        for pool, attr in ((self.buffer, "buffer_blocks"), (self.gpu, "gpu_blocks")):
            blocks = getattr(req, attr)
            if blocks and attr == "gpu_blocks" and req.bound:
                req.gpu_blocks = None  # the engine's own blocks: it frees them
                continue
            if blocks:
                assert pool is not None  # a request holds buffer blocks only where there is a buffer
                setattr(req, attr, None)
                # an admitted write still running holds its blocks whatever the grace says
                if (quarantine and self.options.fence_grace_s > 0) or w.n:
                    q = _Quarantine(now + self.options.fence_grace_s, req.peer, pool, blocks, w)
                    w.entries.append(q)
                    self._quarantine.append(q)
                else:
                    pool.free(blocks)

    def _terminate(self, req: _Req, state: State, reason: str, now: float) -> None:
        """Move ``req`` to a terminal state; every block returns (or is quarantined)."""
        prev = req.state
        if prev is State.SWAPPING:
            # the swap still reads the buffer and writes the GPU blocks: finish it first
            if req.cancel is None:
                req.cancel = (state, reason)
            return
        self._release_blocks(req, quarantine=prev in _WRITABLE, now=now)
        if prev is State.QUEUED:
            try:
                self._queue.remove(req.rid)
            except ValueError:
                pass
        self._swapq.pop(req.rid, None)
        if prev is State.READY and req.in_ready:
            self._ready.remove(req)
        req.state = state
        req.reason = reason
        prefix, req.prefix = req.prefix, ()
        self._release_prefix(req.rid, prefix, req.release)
        del self._reqs[req.rid]
        self._entomb(req.rid, state, reason)
        key = _COUNTER_OF.get(state)
        if key:
            self._m[key] += 1
        if state is not State.FINISHED:
            self._event(EventKind(state.value), req.rid, reason=reason, t=now)
            _log.info("request %r %s (was %s): %s", req.rid, state.value, prev.value, reason)

    def _expire(self, req: _Req, now: float) -> None:
        self._terminate(req, State.EXPIRED, f"lease of {self.options.lease_s}s expired", now)

    # ------------------------------------------------------------------ reservation
