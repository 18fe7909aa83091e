"""The capacity planner: a trace replayed through the real :class:`DecodeScheduler` on a
simulated clock, once per buffer size, to show what the decode-side CPU buffer buys.

The model, per request of the trace (Mooncake format: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``):

- **prefill**: ``prefill_instances`` servers take arrivals in order. A server first
  reserves decode blocks (``DecodeScheduler.reserve``); while the reservation is queued the
  server waits (that is *prefill's wait for decode blocks*), then computes the prompt in
  ``overhead + input_length / prefill_tokens_per_s`` seconds (or ``overhead + layers x
  layer_ms``; ``overhead`` a fixed time per request, 0 unless given) and is free for
  the next request when the last layer is computed: sending is asynchronous.
- **transfer**: layer by layer over one link into decode of ``bandwidth`` bytes/s shared in
  arrival order; the last layer lands at the later of "computed plus one layer's bytes" and
  "link free plus all the request's bytes".
- **swap**: a request received into the buffer is swapped into GPU blocks by the real
  scheduler's admission (when the GPU pool has room), at ``swap_bandwidth``, one at a time.
- **decode** holds each ready request's GPU blocks for ``output_length x token_s`` and then
  finishes it (the blocks of generated tokens are not modelled: leave them out of the GPU
  budget).

With a buffer of 0 blocks the scheduler has no buffer: prefill waits for decode GPU blocks,
as engines without a buffer do. Everything else is the same code.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...layout import KVLayout
from ...scheduling.blocks import BlockPool
from ...scheduling.scheduler import DecodeScheduler, Event, SchedulerOptions
from .workload import TraceRequest, UsageError

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids: one id per 512 prompt tokens


@dataclass(frozen=True, slots=True)
class PlanConfig:
    layout: KVLayout  # one decode rank's
    decode_tp: int
    gpu_blocks: int  # decode GPU pool, blocks per rank
    prefill_instances: int = 1
    prefill_tokens_per_s: float = 0.0  # compute time from the prompt length ...
    layer_ms: float = 0.0  # ... or a fixed time per layer (as the transfer test's --layer-ms)
    overhead_s: float = 0.0  # ... plus a fixed time per request (control round trips, scheduling)
    bandwidth: float = 10e9  # bytes/s into decode (all ranks together)
    swap_bandwidth: float = 40e9  # bytes/s buffer -> GPU (all ranks together)
    token_s: float = 0.03  # decode time per output token
    direct_to_gpu: bool = True  # a grant is GPU blocks while the GPU has room (as SchedulerOptions)
    queue_timeout_s: float = 1e9
    max_queue: int = 1 << 20

    def compute_s(self, tokens: int) -> float:
        """A prefill server's time on a request once granted, its fixed part included."""
        if self.layer_ms:
            return self.overhead_s + self.layout.total_layers * self.layer_ms / 1000
        return self.overhead_s + tokens / self.prefill_tokens_per_s

    def compute_desc(self) -> str:
        """How prefill's compute is modelled, in words."""
        out = f"{self.layer_ms:g} ms a layer" if self.layer_ms else f"{self.prefill_tokens_per_s:,.0f} tokens/s"
        return out + (f" + {self.overhead_s * 1e3:g} ms a request" if self.overhead_s else "")

    @property
    def instance_block_bytes(self) -> int:
        return self.layout.block_bytes * self.decode_tp


@dataclass
class _Sim:
    rid: str
    req: TraceRequest
    blocks: int
    start: float = math.nan  # a prefill server took it (asked for blocks)
    granted: float = math.nan
    computed: float = math.nan  # first token (prefill's)
    received: float = math.nan
    ready: float = math.nan
    token: int = 0


class _SwapHandle:
    __slots__ = ("at", "clock")

    def __init__(self, at: float, clock: _Clock) -> None:
        self.at, self.clock = at, clock

    def done(self) -> bool:
        return self.clock.now >= self.at

    @property
    def error(self) -> BaseException | None:
        return None


@dataclass
class _Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _SimSwap:
    """The scheduler's swap backend on the simulated clock: one swap at a time at the swap
    bandwidth; each completion schedules a scheduler tick."""

    clock: _Clock
    block_bytes: int
    bandwidth: float
    wake: Any
    free_at: float = 0.0

    def submit(self, request_id: str, buffer_blocks: Sequence[int], gpu_blocks: Sequence[int]) -> _SwapHandle:
        start = max(self.clock.now, self.free_at)
        self.free_at = start + len(gpu_blocks) * self.block_bytes / self.bandwidth
        self.wake(self.free_at)
        return _SwapHandle(self.free_at, self.clock)


@dataclass
class Result:
    buffer_blocks: int
    buffer_bytes: int
    requests: int
    completed: int
    rejected: int
    queued: int
    queue_timeouts: int
    wait_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    decode_start_s: list[float] = field(default_factory=list)
    peak_buffer_blocks: int = 0
    peak_gpu_blocks: int = 0
    swaps: int = 0
    sim_end_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            return float(np.percentile(xs, q)) * 1e3 if xs else math.nan

        return {
            "buffer_gib": self.buffer_bytes / (1 << 30),
            "buffer_blocks": self.buffer_blocks,
            "requests": self.requests,
            "completed": self.completed,
            "rejected": self.rejected,
            "queued": self.queued,
            "queue_timeouts": self.queue_timeouts,
            "prefill_wait_ms_p50": pct(self.wait_s, 50),
            "prefill_wait_ms_p99": pct(self.wait_s, 99),
            "prefill_wait_ms_max": max(self.wait_s) * 1e3 if self.wait_s else math.nan,
            "ttft_ms_p50": pct(self.ttft_s, 50),
            "ttft_ms_p99": pct(self.ttft_s, 99),
            "decode_start_ms_p50": pct(self.decode_start_s, 50),
            "decode_start_ms_p99": pct(self.decode_start_s, 99),
            "peak_buffer_blocks": self.peak_buffer_blocks,
            "peak_buffer_occupancy": self.peak_buffer_blocks / self.buffer_blocks if self.buffer_blocks else 0.0,
            "peak_gpu_blocks": self.peak_gpu_blocks,
            "swaps": self.swaps,
            "simulated_s": self.sim_end_s,
        }


def simulate(trace: Sequence[TraceRequest], cfg: PlanConfig, buffer_blocks: int) -> Result:
    """Replay ``trace`` through a real :class:`DecodeScheduler` with ``buffer_blocks`` of
    buffer (0: none) on a simulated clock; every request ends completed or rejected."""
    lay = cfg.layout
    clock = _Clock()
    heap: list[tuple[float, int, str, str]] = []
    seq = 0

    def at(t: float, kind: str, rid: str = "") -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, rid))

    bb = cfg.instance_block_bytes
    swap = _SimSwap(clock, bb, cfg.swap_bandwidth, lambda t: at(t, "tick")) if buffer_blocks else None
    sims: dict[str, _Sim] = {}
    granted_now: list[tuple[str, Any]] = []
    ended: list[str] = []

    def listener(ev: Event) -> None:
        if ev.kind == "granted":
            granted_now.append((ev.request_id, ev.grant))
        elif ev.kind.terminal:
            ended.append(ev.request_id)

    sched = DecodeScheduler(
        layout=lay,
        gpu=BlockPool(cfg.gpu_blocks, "gpu"),
        buffer=BlockPool(buffer_blocks, "buffer") if buffer_blocks else None,
        swap=swap,
        block_bytes=bb,
        options=SchedulerOptions(
            direct_to_gpu=cfg.direct_to_gpu or not buffer_blocks,
            on_full="queue",
            # layers land one by one in a real run and renew the lease each time; the
            # simulation lands them at once, so leases never run out here
            lease_s=1e9,
            queue_timeout_s=cfg.queue_timeout_s,
            max_queue=cfg.max_queue,
        ),
        clock=clock,
        listener=listener,
    )
    waiting: deque[str] = deque()  # arrived, no prefill server yet
    idle = cfg.prefill_instances
    blocked: dict[str, bool] = {}  # rid -> a server waits on its queued reservation
    link_free = 0.0
    res = Result(buffer_blocks, buffer_blocks * bb, len(trace), 0, 0, 0, 0)

    def begin_compute(s: _Sim, grant: Any) -> None:
        nonlocal link_free
        s.granted = clock.now
        c = cfg.compute_s(s.req.input_tokens)
        s.computed = clock.now + c
        nbytes = len(grant.blocks) * bb
        first_layer = clock.now + cfg.overhead_s + (c - cfg.overhead_s) / lay.total_layers
        data_start = max(first_layer, link_free)
        s.received = max(s.computed + nbytes / lay.total_layers / cfg.bandwidth, data_start + nbytes / cfg.bandwidth)
        link_free = s.received
        s.token = grant.token
        at(s.computed, "computed", s.rid)
        at(s.received, "received", s.rid)

    def take_next() -> None:
        nonlocal idle
        while idle and waiting:
            rid = waiting.popleft()
            s = sims[rid]
            s.start = clock.now
            idle -= 1
            try:
                r = sched.reserve(rid, num_tokens=s.req.input_tokens)
            except Exception as exc:  # larger than any pool: the operator's sizing, named
                raise UsageError(f"trace request {rid} ({s.req.input_tokens} tokens): {exc}") from None
            if r.outcome == "queued":
                blocked[rid] = True
                res.queued += 1
            elif r.outcome == "rejected":
                idle += 1
            else:
                begin_compute(s, r.grant)

    for tr in trace:
        sims[tr.rid] = _Sim(tr.rid, tr, lay.blocks_for_tokens(tr.input_tokens))
        at(tr.arrival, "arrive", tr.rid)
    gpu = sched.gpu
    peak_gpu = 0
    while heap:
        t, _, kind, rid = heapq.heappop(heap)
        clock.now = t
        if kind == "arrive":
            waiting.append(rid)
        elif kind == "computed":
            idle += 1
        elif kind == "received":
            tok = sims[rid].token
            sched.land_layers(rid, tok, range(lay.total_layers))
            sched.complete(rid, tok)
        elif kind == "finish":
            sched.finish(rid)
            res.completed += 1
        # engine steps: the scheduler's tick until it has nothing more to do now (a finished
        # swap frees buffer blocks that the next tick grants: a real engine ticks every step)
        for _ in range(8):
            if not sched.tick():
                break
        for grid, grant in granted_now:  # the server waiting on it goes on with this request
            blocked.pop(grid, None)
            begin_compute(sims[grid], grant)
        granted_now.clear()
        for erid in ended:  # a queued reservation timed out: its server is free
            if blocked.pop(erid, None):
                idle += 1
        ended.clear()
        for ready in sched.take_ready():
            s = sims[ready.request_id]
            s.ready = t
            at(t + s.req.output_tokens * cfg.token_s, "finish", ready.request_id)
        take_next()
        peak_gpu = max(peak_gpu, gpu.num_total - gpu.num_free)
    m = sched.metrics()
    res.peak_buffer_blocks = int(m["buffer_blocks_peak"])
    res.peak_gpu_blocks = peak_gpu
    res.swaps = int(m["swaps_completed"])
    res.rejected = int(m["reservations_rejected"])
    res.queue_timeouts = int(m["queue_timeouts"])
    res.sim_end_s = clock.now
    for s in sims.values():
        if not math.isnan(s.granted):
            res.wait_s.append(s.granted - s.start)
            res.ttft_s.append(s.computed - s.req.arrival)
        if not math.isnan(s.ready):
            res.decode_start_s.append(s.ready + cfg.token_s - s.req.arrival)
    sched.check_invariants()
    return res


def prefix_savings(trace: Sequence[TraceRequest], tokens_per_block: int) -> dict[str, Any]:
    """Blocks a decode-side prefix cache would not receive: each request's longest run of
    leading ``hash_ids`` seen in an earlier request (an unbounded cache: the upper bound).
    Only whole blocks of the layout count, and at least one block of each prompt is received."""
    seen: set[int] = set()  # Mooncake's ids hash the block and all before it: an id names a prefix
    total = reused = 0
    have = 0
    for r in trace:
        n = -(-r.input_tokens // tokens_per_block)
        total += n
        if not r.hash_ids:
            continue
        have += 1
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        seen.update(r.hash_ids)
        tok = min(k * TRACE_BLOCK_TOKENS, r.input_tokens)
        # a prefix must leave at least one block to receive (the scheduler's rule)
        reused += min(tok // tokens_per_block, n - 1)
    return {
        "requests_with_hash_ids": have,
        "blocks_total": total,
        "blocks_not_transferred": reused,
        "fraction_not_transferred": reused / total if total else 0.0,
    }


# ---------------------------------------------------------------------- the tool's plan mode
