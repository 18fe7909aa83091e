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
import json
import math
import textwrap
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...blocks import BlockPool
from ...layout import KVLayout
from ...scheduler import DecodeScheduler, Event, SchedulerOptions
from .workload import UsageError, layout_kw

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids: one id per 512 prompt tokens


@dataclass(frozen=True, slots=True)
class TraceRequest:
    rid: str
    arrival: float  # seconds
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: str, limit: int = 0, time_scale: float = 1.0) -> list[TraceRequest]:
    """A Mooncake-format JSONL trace; every line checked, errors name the line."""
    out: list[TraceRequest] = []
    try:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if limit and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    ts, n_in = d["timestamp"], d["input_length"]
                    n_out = d.get("output_length", 1)
                    hashes = d.get("hash_ids", [])
                except (ValueError, KeyError, TypeError) as exc:
                    raise UsageError(f"--trace {path} line {i}: not a trace record ({exc})") from None
                ok = (
                    isinstance(ts, (int, float))
                    and ts >= 0
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in (n_in, n_out))
                    and n_in > 0
                    and n_out >= 0
                    and isinstance(hashes, list)
                    and all(isinstance(h, int) for h in hashes)
                )
                if not ok:
                    raise UsageError(
                        f"--trace {path} line {i}: needs timestamp >= 0 (ms), input_length > 0, "
                        "output_length >= 0 (integers) and hash_ids (a list of integers)"
                    )
                out.append(TraceRequest(f"t{i - 1}", ts / 1000.0 * time_scale, n_in, n_out, tuple(hashes)))
    except OSError as exc:
        raise UsageError(f"--trace {path}: {exc.strerror}") from None
    if not out:
        raise UsageError(f"--trace {path}: no requests")
    return out


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

FIGURE_COLUMNS = (  # header, figure, format: fits 80 columns
    ("buf\nGiB", "buffer_gib", "{:.1f}"),
    ("wait\np50 ms", "prefill_wait_ms_p50", "{:.0f}"),
    ("wait\np99 ms", "prefill_wait_ms_p99", "{:.0f}"),
    ("wait\nmax ms", "prefill_wait_ms_max", "{:.0f}"),
    ("TTFT\np50 ms", "ttft_ms_p50", "{:.0f}"),
    ("TTFT\np99 ms", "ttft_ms_p99", "{:.0f}"),
    ("peak\nbuf", "peak_buffer_occupancy", "{:.0%}"),
    ("queued", "queued", "{:d}"),
    ("rejected", "rejected", "{:d}"),
)


def sweep_sizes(spec: str | None, lay: KVLayout, gpu_blocks: int, smallest: int = 1) -> list[int]:
    """Buffer sizes in blocks per rank: ``--buffer-sweep`` GiB values, or by default 0 and
    ``smallest`` doubled up to 4 times the GPU pool (``smallest``: the largest request where
    every transfer goes through the buffer, else 1/8 of the GPU pool)."""
    if not spec:
        top = max(4 * gpu_blocks, smallest)
        out = [0]
        n = max(1, smallest)
        while n < top:
            out.append(n)
            n *= 2
        return out + [top]
    try:
        gibs = [float(x) for x in spec.split(",")]
    except ValueError:
        gibs = []
    if not gibs or any(not math.isfinite(g) or g < 0 for g in gibs):
        raise UsageError(f"--buffer-sweep {spec!r}: expected GiB values >= 0, comma-separated, e.g. 0,1,2,4")
    return sorted({lay.blocks_for_bytes(int(g * (1 << 30))) if g else 0 for g in gibs})


def recommend(rows: list[dict[str, Any]], target_wait_ms: float, target_ttft_ms: float | None) -> dict[str, Any] | None:
    """The smallest buffer whose p99 prefill wait (and p99 TTFT, if given) meets the target
    with every request served; None when none in the sweep does."""
    for r in rows:
        if r["rejected"] or r["queue_timeouts"] or r["completed"] != r["requests"]:
            continue
        if r["prefill_wait_ms_p99"] > target_wait_ms:
            continue
        if target_ttft_ms is not None and r["ttft_ms_p99"] > target_ttft_ms:
            continue
        return r
    return None


def write_plan_plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    from .report import save_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["buffer_gib"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.plot(x, [r["prefill_wait_ms_p50"] for r in rows], "o-", label="p50")
    ax.plot(x, [r["prefill_wait_ms_p99"] for r in rows], "s-", label="p99")
    ax.plot(x, [r["prefill_wait_ms_max"] for r in rows], "^--", label="max")
    ax.set_title("prefill's wait for decode blocks")
    ax.set_ylabel("ms")
    ax = axes[1]
    ax.plot(x, [r["ttft_ms_p50"] for r in rows], "o-", label="TTFT p50")
    ax.plot(x, [r["ttft_ms_p99"] for r in rows], "s-", label="TTFT p99")
    ax.plot(x, [r["decode_start_ms_p99"] for r in rows], "^--", label="decode start p99")
    ax.set_title("time to first token, to first decode step")
    ax.set_ylabel("ms")
    ax = axes[2]
    ax.plot(x, [100 * r["peak_buffer_occupancy"] for r in rows], "o-", label="peak buffer occupancy (%)")
    ax.plot(x, [100 * r["queued"] / max(1, r["requests"]) for r in rows], "s-", label="requests queued (%)")
    ax.set_title("buffer use and queueing")
    ax.set_ylabel("%")
    for ax in axes:
        ax.set_xlabel("buffer per decode rank (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, "pdkv capacity plan")


def load_warnings(trace: Sequence[TraceRequest], cfg: PlanConfig) -> list[str]:
    """Offered load of prefill compute and of decode's GPU pool over the trace's span: above
    1 the queue grows without bound and every figure measures that queue, not the buffer."""
    span = max(r.arrival for r in trace) - min(r.arrival for r in trace)
    if span <= 0:
        return []
    out = []
    work = sum(cfg.compute_s(r.input_tokens) for r in trace) / cfg.prefill_instances
    if work / span > 1:
        out.append(
            f"prefill is overloaded: {work / span:.1f}x its capacity over the trace's {span:.0f} s "
            "(TTFT is prefill queueing; add --prefill-instances or raise --prefill-tokens-per-s)"
        )
    held = sum(cfg.layout.blocks_for_tokens(r.input_tokens) * r.output_tokens * cfg.token_s for r in trace)
    if held / span > cfg.gpu_blocks:
        out.append(
            f"decode is overloaded: requests hold {held / span:,.0f} GPU blocks on average, the pool has "
            f"{cfg.gpu_blocks} (any buffer fills; raise --gpu-gib)"
        )
    return out


def measure_rates(a: Any, console: Any) -> tuple[float, float]:
    """Transfer and swap bandwidth of this host for the layout, in bytes/s: a short loopback
    run of the transfer test (16 requests of about 2 GiB in all, sent at once, not verified): the
    link's rate over the time prefill was writing (the transfer span would also count the time
    the test's prefill spends computing its patterns, which the plan models apart) and the swap
    rate over the time swaps were in flight."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pdkv-plan-") as d:
        out = os.path.join(d, "rates.json")
        lay = KVLayout(**layout_kw(a), tp_size=a.decode_tp)
        per_token = lay.block_bytes * a.decode_tp / lay.tokens_per_block
        tokens = int(min(16384, max(256, (2 << 30) / 16 / per_token)))  # about 2 GiB in all
        argv = [sys.executable, "-m", "pdkv.cli.transfer_tool", "--model", a.model, "--requests", "16"]
        argv += ["--prompt-len", str(tokens), "--no-verify", "--concurrency", "16", "--json", out, "-q"]
        argv += ["--decode-tp", str(a.decode_tp), "--gpu-blocks", "0"]
        for opt, attr in (("--layers", "layers"), ("--kv-heads", "kv_heads"), ("--head-dim", "head_dim")):
            if getattr(a, attr) is not None:
                argv += [opt, str(getattr(a, attr))]
        for opt, attr in (("--tokens-per-block", "tokens_per_block"), ("--dtype", "dtype")):
            if getattr(a, attr) is not None:
                argv += [opt, str(getattr(a, attr))]
        console.print(f"measuring this host's transfer and swap bandwidth (16 requests of {tokens} tokens) ...")
        p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if p.returncode != 0 or not os.path.exists(out):
            last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise UsageError(
                f"measuring the bandwidth failed ({last[0]}); give --bandwidth-gbps and --swap-gbps instead"
            )
        with open(out) as f:
            rep = json.load(f)
    link, swap = float(rep.get("link_GBps", 0.0)), float(rep.get("swap_GBps", 0.0))
    if not (link > 0 and swap > 0):  # a plan on a zero rate would divide by it
        raise UsageError(
            f"measuring the bandwidth gave no rate (link {link:.3f} GB/s, swap {swap:.3f} GB/s); give "
            "--bandwidth-gbps and --swap-gbps instead"
        )
    return link * 1e9, swap * 1e9


def run_plan(a: Any, console: Any, lay_kw: dict[str, Any]) -> int:
    import time

    from rich import box
    from rich.table import Table

    trace = read_trace(a.trace, a.trace_limit, a.time_scale)
    lay = KVLayout(**lay_kw, tp_size=a.decode_tp)
    if a.gpu_blocks:
        gpu_blocks = a.gpu_blocks
    else:
        gpu_blocks = lay.blocks_for_bytes(int(a.gpu_gib * (1 << 30)))
    if gpu_blocks <= 0:
        raise UsageError(f"--gpu-gib {a.gpu_gib} holds no block of {lay.block_bytes} bytes")
    big = max(trace, key=lambda r: r.input_tokens)
    need = lay.blocks_for_tokens(big.input_tokens)
    sizes = sweep_sizes(a.buffer_sweep, lay, gpu_blocks, max(1, gpu_blocks // 8) if a.direct_to_gpu else need)
    bw = a.bandwidth_gbps * 1e9 if a.bandwidth_gbps else 0.0
    swap_bw = a.swap_gbps * 1e9 if a.swap_gbps else 0.0
    measured = not (bw and swap_bw)
    if measured:
        mbw, mswap = measure_rates(a, console)
        bw, swap_bw = bw or mbw, swap_bw or mswap
    cfg = PlanConfig(
        layout=lay,
        decode_tp=a.decode_tp,
        gpu_blocks=gpu_blocks,
        prefill_instances=a.prefill_instances,
        prefill_tokens_per_s=a.prefill_tokens_per_s,
        layer_ms=a.layer_ms,
        overhead_s=a.prefill_overhead_ms / 1000,
        bandwidth=bw,
        swap_bandwidth=swap_bw,
        token_s=a.token_ms / 1000,
        direct_to_gpu=a.direct_to_gpu,
    )
    if need > gpu_blocks:
        raise UsageError(
            f"trace request {big.rid} needs {need} GPU blocks ({big.input_tokens} tokens) but the decode GPU pool "
            f"has {gpu_blocks}: raise --gpu-gib or --gpu-blocks"
        )
    t0 = time.monotonic()
    rows: list[dict[str, Any] | None] = []
    for nb in sizes:
        if nb and not a.direct_to_gpu and nb < need:
            rows.append(None)  # every request passes through the buffer: it must hold the largest
            continue
        rows.append(simulate(trace, cfg, nb).figures())
    skipped = [sizes[i] for i, r in enumerate(rows) if r is None]
    rows_ok = [r for r in rows if r is not None]
    elapsed = time.monotonic() - t0
    compute = f"{a.layer_ms} ms a layer" if a.layer_ms else f"{a.prefill_tokens_per_s:,.0f} tokens/s"
    if a.prefill_overhead_ms:
        compute += f" + {a.prefill_overhead_ms:g} ms a request"
    head = (
        f"{a.model} ({lay.total_layers} layers, {lay.block_bytes * a.decode_tp / (1 << 20):.2f} MiB a block of "
        f"{lay.tokens_per_block} tokens, decode TP {a.decode_tp}); {len(trace)} requests of {a.trace}; "
        f"{a.prefill_instances} prefill instance(s) at {compute}; link {bw / 1e9:.2f} GB/s, swap "
        f"{swap_bw / 1e9:.2f} GB/s{' (measured here)' if measured else ''}; decode {a.token_ms} ms a token, "
        f"{gpu_blocks} GPU blocks ({gpu_blocks * lay.block_bytes / (1 << 30):.1f} GiB a rank); "
        + ("transfers into GPU blocks while they last" if a.direct_to_gpu else "every transfer through the buffer")
    )
    console.print(head)
    for line in load_warnings(trace, cfg):
        console.print(f"[yellow]{line}[/yellow]")
    tb = Table(
        title="what the decode buffer buys (buffer 0: prefill waits for decode GPU blocks)",
        box=box.SIMPLE,
        padding=(0, 1),
    )
    for name, _, _ in FIGURE_COLUMNS:
        tb.add_column(name, justify="right")
    for r in rows_ok:
        tb.add_row(
            *("n/a" if isinstance(r[k], float) and math.isnan(r[k]) else f.format(r[k]) for _, k, f in FIGURE_COLUMNS)
        )
    console.print(tb)
    if skipped:
        console.print(f"left out: buffers of {skipped} blocks hold less than the largest request ({need} blocks)")
    best = recommend(rows_ok, a.target_wait_ms, a.target_ttft_ms)
    target = f"p99 prefill wait <= {a.target_wait_ms:g} ms" + (
        f" and p99 TTFT <= {a.target_ttft_ms:g} ms" if a.target_ttft_ms is not None else ""
    )
    if best is None:
        console.print(f"no buffer in the sweep meets {target}: try larger sizes (--buffer-sweep)")
    else:
        console.print(
            f"recommendation: {best['buffer_gib']:.2f} GiB ({best['buffer_blocks']} blocks) per decode rank is the "
            f"smallest buffer in the sweep meeting {target}"
        )
    pre = prefix_savings(trace, lay.tokens_per_block)
    if pre["requests_with_hash_ids"]:
        console.print(
            "prefix reuse (decode holds every earlier prompt's blocks, by hash_ids): "
            f"{pre['blocks_not_transferred']:,} of "
            f"{pre['blocks_total']:,} blocks not transferred ({pre['fraction_not_transferred']:.1%})"
        )
    console.print(f"{len(rows_ok)} buffer sizes x {len(trace)} requests simulated in {elapsed:.1f} s")
    out = {
        "mode": "plan",
        "trace": a.trace,
        "requests": len(trace),
        "config": {
            "model": a.model,
            "layout": lay.descriptor(),
            "decode_tp": a.decode_tp,
            "gpu_blocks": gpu_blocks,
            "prefill_instances": a.prefill_instances,
            "prefill_tokens_per_s": a.prefill_tokens_per_s,
            "layer_ms": a.layer_ms,
            "prefill_overhead_ms": a.prefill_overhead_ms,
            "bandwidth_GBps": bw / 1e9,
            "swap_GBps": swap_bw / 1e9,
            "bandwidth_measured": measured,
            "token_ms": a.token_ms,
            "direct_to_gpu": a.direct_to_gpu,
            "time_scale": a.time_scale,
        },
        "target": {"prefill_wait_ms_p99": a.target_wait_ms, "ttft_ms_p99": a.target_ttft_ms},
        "sweep": rows_ok,
        "recommended_buffer_blocks": best["buffer_blocks"] if best else None,
        "recommended_buffer_gib": best["buffer_gib"] if best else None,
        "prefix_reuse": pre,
        "simulation_s": elapsed,
    }
    if a.plot:
        write_plan_plot(a.plot, rows_ok, "\n".join(textwrap.wrap(head, 160)))
        console.print(f"plot written to {a.plot}")
    text = json.dumps(_finite(out))
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)  # the JSON line is the last thing printed
    return 0


def _finite(x: Any) -> Any:
    """NaN (a figure with no samples) as null: the JSON stays standard."""
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
