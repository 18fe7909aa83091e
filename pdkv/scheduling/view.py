"""What :class:`~pdkv.scheduling.scheduler.DecodeScheduler` shows of itself: its counters and gauges
(:func:`metrics`), their Prometheus text (:func:`prometheus`), and the accounting
invariants tests assert (:func:`check_invariants`)."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import RequestError
from .blocks import BlockPool
from .core import SchedulerCore
from .lifecycle import TERMINAL, RequestInfo, State

__all__ = ["request", "metrics", "prometheus", "check_invariants"]


def request(s: SchedulerCore, request_id: str) -> RequestInfo:
    with s._lock:
        req = s._reqs.get(request_id)
        if req is None:
            tomb = s._tomb.get(request_id)
            if tomb is None:
                raise RequestError(f"unknown request {request_id!r}")
            return RequestInfo(request_id, tomb[0], "", 0, 0, (), (), tomb[1])
        return req.info()


def metrics(s: SchedulerCore) -> dict[str, float]:
    """Counters and gauges as a flat dict. ``live_<state>`` counts the live requests in
    each state now (``live_ready``); ``requests_<event>`` are counters since start."""
    with s._lock:
        out = dict(s._m)
        by_state = {st: 0 for st in State if st not in TERMINAL}
        for r in s._reqs.values():
            by_state[r.state] += 1
        for st, n in by_state.items():
            # a name of its own: "requests_received"/"requests_ready" are counters
            out[f"live_{st.value}"] = n
        out["gpu_blocks_free"] = s.gpu.num_free
        out["gpu_blocks_total"] = s.gpu.num_total
        if s.buffer is not None:
            out["buffer_blocks_free"] = s.buffer.num_free
            out["buffer_blocks_total"] = s.buffer.num_total
        out["quarantined_blocks"] = sum(len(q.blocks) for q in s._quarantine)
        out["queue_length"] = len(s._queue)
        return out


def prometheus(s: SchedulerCore, prefix: str = "pdkv_") -> str:
    """:meth:`metrics` in the Prometheus text exposition format."""
    lines = []
    for k, v in sorted(metrics(s).items()):
        kind = "counter" if k in s._m and not k.endswith(("_max", "_peak")) else "gauge"
        lines.append(f"# TYPE {prefix}{k} {kind}")
        lines.append(f"{prefix}{k} {float(v):.9g}")
    return "\n".join(lines) + "\n"


def check_invariants(s: SchedulerCore, engine_blocks: Iterable[int] = ()) -> None:
    """Check the accounting invariants (tests): every pool's held blocks are exactly
    those of live requests plus quarantine, plus on the GPU pool the held prefixes
    (:meth:`~pdkv.DecodeScheduler.hold_prefix`, which may share blocks) and
    ``engine_blocks`` (GPU blocks the engine holds itself); no block has two owners, and no
    prefix block is granted or quarantined. Raises ``AssertionError`` naming the first
    inconsistency found (also under ``python -O``)."""

    def fail(why: str) -> None:
        raise AssertionError(why)

    def name(pool: object) -> str:  # an engine's allocator may have no name
        return str(getattr(pool, "name", "gpu" if pool is s.gpu else "buffer"))

    with s._lock:
        owned: dict[int, dict[int, str]] = {id(s.gpu): {}, id(s.buffer): {}}
        for r in s._reqs.values():
            for pool, blocks in ((s.gpu, None if r.bound else r.gpu_blocks), (s.buffer, r.buffer_blocks)):
                for b in blocks or ():
                    if b in owned[id(pool)]:
                        fail(f"{name(pool)}: block {b} held by {owned[id(pool)][b]} and {r.rid}")
                    owned[id(pool)][b] = r.rid
            if r.state is State.QUEUED and (r.gpu_blocks or r.buffer_blocks):
                fail(f"queued request {r.rid} holds blocks (gpu {r.gpu_blocks}, buffer {r.buffer_blocks})")
            if r.state is State.READY and (not r.gpu_blocks or r.buffer_blocks):
                fail(f"ready request {r.rid} holds gpu {r.gpu_blocks} and buffer {r.buffer_blocks}")
        for q in s._quarantine:
            for b in q.blocks:
                if b in owned[id(q.pool)]:
                    fail(f"{name(q.pool)}: quarantined block {b} also held by {owned[id(q.pool)][b]}")
                owned[id(q.pool)][b] = "<quarantine>"
        prefix = {b for h in s._holds.values() for b in h.blocks} | {b for r in s._reqs.values() for b in r.prefix}
        for b in sorted(prefix):
            if b in owned[id(s.gpu)]:
                fail(f"{name(s.gpu)}: prefix block {b} also held by {owned[id(s.gpu)][b]}")
        extra = prefix | set(engine_blocks)
        for pool in (s.gpu, s.buffer):
            if not isinstance(pool, BlockPool):
                continue
            held = owned[id(pool)]
            outside = extra - held.keys() if pool is s.gpu else set()
            free = sorted(b for b in held.keys() | outside if not pool.is_held(b))
            if free:
                b = free[0]
                fail(f"{pool.name}: block {b} of {held.get(b, 'a prefix or the engine')} is free in the pool")
            want = len(held) + len(outside)
            if pool.num_held != want:
                fail(f"{pool.name}: pool holds {pool.num_held}, owners {want}")
            pool.check()
