"""What :meth:`DecodeScheduler.tick` does each engine step, as functions over its state:
leases that ran out expire (in the order they ran out), queued reservations that waited
too long are rejected, quarantined blocks nothing can still write go back, queued
reservations are granted in order, finished swaps are polled, and received buffer
requests are admitted to swaps and submitted (without the lock: the backend may launch
kernels).
"""

from __future__ import annotations

import heapq
import logging

from ..errors import RequestError
from .core import SchedulerCore
from .lifecycle import _WRITABLE, Event, EventKind, State, SwapHandle, _Release, _Req

_log = logging.getLogger(__name__)

__all__ = [
    "expire_due",
    "release_quarantine",
    "grant_queued",
    "admit_swaps",
    "submit",
    "swap_finished",
    "logs_swaps",
    "bind_swap",
]


def expire_due(s: SchedulerCore, now: float) -> None:
    heap = s._expiry
    if len(heap) > 4 * len(s._reqs) + 1024:
        # entries of ended requests wait here until their lease would have run out: at a high
        # rate that is rate x lease_s of them; drop them (the pops below would skip them)
        heap[:] = [e for e in heap if (r := s._reqs.get(e[2])) is not None and r.state in _WRITABLE]
        heapq.heapify(heap)
    while heap and heap[0][0] <= now:
        t, _, rid = heapq.heappop(heap)
        req = s._reqs.get(rid)
        if req is None or req.state not in _WRITABLE:
            continue
        if req.expires != t:
            # a renewed lease, or the entry of an earlier request of this id: due at its
            # own time (leases end in the order they run out)
            s._push_expiry(req)
            continue
        s._expire(req, now)
    while s._queue:
        req = s._reqs[s._queue[0]]
        if req.queue_deadline > now:
            break
        s._m["queue_timeouts"] += 1
        s._terminate(req, State.REJECTED, "timed out in the reservation queue", now)


def release_quarantine(s: SchedulerCore, now: float) -> None:
    if not s._quarantine:
        return
    keep = []
    for q in s._quarantine:
        if q.releasable(now):
            q.pool.free(q.blocks)
            s._m["quarantined_blocks_released"] += len(q.blocks)
            q.writers.entries.remove(q)
        else:
            keep.append(q)
    s._quarantine = keep


def grant_queued(s: SchedulerCore, now: float) -> None:
    """Grant queued reservations in order: the first that cannot be granted stops the
    others, except where the buffer places each request's blocks (``_overtake``), where
    each waits for its own room and a later one that fits is granted past it."""
    i = 0
    while i < len(s._queue):
        req = s._reqs[s._queue[i]]
        grant = s._grant(req, now)
        if grant is None:
            if not s._overtake:
                return
            i += 1
            continue
        del s._queue[i]
        s._m["grants_from_queue"] += 1
        s._event(EventKind.GRANTED, req.rid, grant=grant, t=now)


def admit_swaps(s: SchedulerCore, now: float) -> list[_Req]:
    out: list[_Req] = []
    o = s.options
    if o.bind == "engine":  # the engine binds each received request itself (DecodeScheduler.bind)
        return out
    while s._swapq:
        rid = next(iter(s._swapq))
        if o.swap_order == "shortest":
            head = s._reqs[rid]
            if now - head.received_at < o.starvation_s:
                rid = min(s._swapq, key=lambda k: s._reqs[k].n)
        req = s._reqs[rid]
        if s.gpu.num_free - req.n < o.gpu_reserve_blocks:
            break
        blocks = s.gpu.try_allocate(req.n)
        if blocks is None:
            break
        del s._swapq[rid]
        req.gpu_blocks = blocks
        req.state = State.SWAPPING
        req.swap_started = now
        wait = now - req.reserved_at
        s._m["prefill_wait_avoided_seconds_sum"] += wait
        s._m["prefill_wait_avoided_seconds_max"] = max(s._m["prefill_wait_avoided_seconds_max"], wait)
        if not s._swapping:
            s._busy_since = now
        s._swapping[rid] = req
        out.append(req)
    return out


def submit(s: SchedulerCore, reqs: list[_Req]) -> list[Event | _Release]:
    assert s.swap is not None
    results: list[tuple[_Req, SwapHandle | None, Exception | None]] = []
    debug = logs_swaps()  # once a batch, not once a request
    for req in reqs:  # no lock held: the backend may launch kernels, take time
        try:
            assert req.buffer_blocks is not None and req.gpu_blocks is not None
            results.append((req, s.swap.submit(req.rid, req.buffer_blocks, req.gpu_blocks), None))
            if debug:
                _log.debug("swap of %r submitted: %d buffer blocks -> GPU", req.rid, len(req.buffer_blocks))
        except Exception as exc:  # a failed submit fails the request, never the loop
            results.append((req, None, exc))
    with s._lock:
        now = s.clock()
        for req, handle, err in results:
            s._m["swaps_submitted"] += 1
            if err is not None:
                swap_finished(s, req, err, now)
            else:
                req.handle = handle
        return s._emit()


def logs_swaps() -> bool:
    """Whether each swap's submission and end are logged (this module's debug log is on):
    asked once a batch, not once a request."""
    return _log.isEnabledFor(logging.DEBUG)


def swap_finished(s: SchedulerCore, req: _Req, err: BaseException | None, now: float, debug: bool = True) -> None:
    """A swap ended (``err`` if it failed): its buffer blocks go back, the request becomes
    READY or ends. ``debug``: whether pdkv's debug log is on (the tick asks once a batch)."""
    if s._swapping.pop(req.rid, None) is None:
        return
    if not s._swapping:  # time with at least one swap in flight: swap_bytes / this = swap throughput
        s._m["swap_busy_seconds"] += now - s._busy_since
    dt = now - req.swap_started
    if err is not None or debug:
        _log.debug("swap of %r %s after %.2f ms", req.rid, f"failed: {err}" if err else "done", dt * 1e3)
    m = s._m
    m["swap_seconds_sum"] += dt
    m["swap_seconds_max"] = max(m["swap_seconds_max"], dt)
    req.handle = None
    assert req.buffer_blocks is not None
    s.buffer.free(req.buffer_blocks)  # type: ignore[union-attr]
    req.buffer_blocks = None
    if err is not None:
        m["swaps_failed"] += 1
        req.state = State.RECEIVED  # no writer, no swap: release at once
        s._terminate(req, State.FAILED, f"swap failed: {err}", now)
        return
    m["swaps_completed"] += 1
    m["swap_bytes"] += req.n * s.block_bytes
    req.state = State.READY
    if req.cancel is not None:
        state, reason = req.cancel
        s._terminate(req, state, reason, now)
        return
    req.in_ready = True
    s._ready.append(req)
    m["requests_ready"] += 1
    s._event(EventKind.READY, req.rid, t=now)


def expire_holds(s: SchedulerCore, now: float) -> None:
    """Prefix holds no reservation claimed within ``lease_s`` are released."""
    for rid in [r for r, h in s._holds.items() if h.deadline <= now]:
        h = s._holds.pop(rid)
        s._m["prefix_holds_expired"] += 1
        s._release_prefix(rid, h.blocks, h.release)


def bind_swap(
    s: SchedulerCore, request_id: str, ids: list[int], first_block: int, now: float
) -> tuple[_Req, tuple[int, ...]]:
    """:meth:`DecodeScheduler.bind`'s checks and state change, under the lock: the request
    is SWAPPING into ``ids``; the caller submits it (without the lock). Returns the request
    and the buffer blocks being swapped, in order."""
    with s._lock:
        req = s._get_live(request_id)
        if req.state is not State.RECEIVED:
            raise RequestError(f"request {request_id!r} is {req.state.value}, not received; it cannot be bound")
        if not isinstance(first_block, int) or isinstance(first_block, bool) or not 0 <= first_block < req.n:
            raise RequestError(f"request {request_id!r}: first_block={first_block!r} must be in [0, {req.n})")
        if len(ids) != req.n - first_block:
            raise RequestError(
                f"request {request_id!r}: {len(ids)} GPU blocks for {req.n - first_block} received blocks"
            )
        if len(set(ids)) != len(ids) or not all(isinstance(b, int) and b >= 0 for b in ids):
            raise RequestError(f"request {request_id!r}: GPU blocks must be distinct non-negative ids")
        assert s.buffer is not None and req.buffer_blocks is not None
        if first_block:
            s.buffer.free(req.buffer_blocks[:first_block])
            req.buffer_blocks = req.buffer_blocks[first_block:]
            req.n -= first_block
        del s._swapq[request_id]
        req.gpu_blocks, req.bound, req.state, req.swap_started = ids, True, State.SWAPPING, now
        if not s._swapping:
            s._busy_since = now
        s._swapping[request_id] = req
        s._m["prefill_wait_avoided_seconds_sum"] += now - req.reserved_at
        swapped = tuple(req.buffer_blocks)
    return req, swapped
