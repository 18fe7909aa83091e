"""The tool's plan mode: a buffer-size sweep of the capacity simulation (``capacity``) over a
trace, its table, its recommendation, the load warnings and the plot (this host's link and
swap rates, when not given, from ``measure``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...layout import KVLayout
from .capacity import PlanConfig, prefix_savings, simulate
from .measure import _measured_note, measure_rates
from .workload import TraceRequest, UsageError, read_trace

FIGURE_COLUMNS = (  # header, figure, format: fits 80 columns
    ("buf\nGiB", "buffer_gib", "{:.1f}"),
    ("wait\np50 ms", "prefill_wait_ms_p50", "{:.0f}"),
    ("wait\np99 ms", "prefill_wait_ms_p99", "{:.0f}"),
    ("wait\nmax ms", "prefill_wait_ms_max", "{:.0f}"),
    ("TTFT\np50 ms", "ttft_ms_p50", "{:.0f}"),
    ("TTFT\np99 ms", "ttft_ms_p99", "{:.0f}"),
    ("decode\nstart p99", "decode_start_ms_p99", "{:.0f}"),
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


def advise(
    trace: Sequence[TraceRequest],
    cfg: PlanConfig,
    rows: list[dict[str, Any]],
    target_wait_ms: float | None,
    fraction: float,
    target_ttft_ms: float | None,
    saturated: str = "",
) -> dict[str, Any]:
    """The recommendation against the no-buffer row (``rows[0]``): the target (given, or
    ``fraction`` of the no-buffer p99 wait), the smallest buffer meeting it, what it changes
    (wait, TTFT, memory), the same memory given to the GPU pool instead, and why any buffer
    size does worse than none. ``lines`` says it all in words."""
    base = rows[0]
    gib = 1 << 30
    lines: list[str] = []
    if target_wait_ms is None:
        target_wait_ms = fraction * base["prefill_wait_ms_p99"]
        what = f"p99 prefill wait <= {target_wait_ms:.0f} ms ({fraction:g} x the "
        what += f"{base['prefill_wait_ms_p99']:.0f} ms without a buffer)"
    else:
        what = f"p99 prefill wait <= {target_wait_ms:g} ms"
    if target_ttft_ms is not None:
        what += f" and p99 TTFT <= {target_ttft_ms:g} ms"
    out: dict[str, Any] = {"target_wait_ms": target_wait_ms, "target": what}
    bb = cfg.layout.block_bytes
    out["worse_than_none"] = []
    for r in rows[1:]:
        worse = [k for k in ("prefill_wait_ms_p99", "ttft_ms_p50", "ttft_ms_p99") if r[k] > base[k] * 1.05 + 1]
        if not worse:
            continue
        out["worse_than_none"].append(r["buffer_blocks"])
        why = (
            f"{r['buffer_gib']:.1f} GiB does worse than no buffer ("
            + ", ".join(
                f"{k.replace('prefill_', '').replace('_ms_', ' ')} {r[k]:.0f} vs {base[k]:.0f} ms" for k in worse
            )
            + "): "
        )
        if not cfg.direct_to_gpu and r["buffer_blocks"] < cfg.gpu_blocks:
            why += (
                f"every transfer passes through the buffer (shm and tcp write host memory only) and a request holds "
                f"its buffer blocks from its grant, through prefill's compute and the transfer, to its swap: "
                f"{r['buffer_blocks']} blocks keep fewer requests in flight than decode's {cfg.gpu_blocks} GPU blocks "
                f"do without a buffer. It was full (peak {r['peak_buffer_occupancy']:.0%}) and {r['queued']} requests "
                f"queued for its room while GPU blocks were free"
            )
        else:
            why += (
                f"each request passing through it also waits for its swap into GPU blocks "
                f"({cfg.swap_bandwidth / 1e9:.0f} GB/s, one at a time; {r['swaps']} swaps)"
            )
        lines.append(f"[yellow]{why}[/yellow]")
    best = recommend(rows, target_wait_ms, target_ttft_ms)
    out["best"] = best
    if best is None:
        top = rows[-1]
        fix = (
            f"{saturated} saturates (above): no buffer size and no GPU memory fixes that"
            if saturated
            else "try larger sizes (--buffer-sweep), a looser target (--target-wait-ms, --target-wait-fraction), "
            "or more decode GPU memory"
        )
        lines.append(
            f"no buffer in the sweep meets {what}: the largest, {top['buffer_gib']:.1f} GiB, gives p99 wait "
            f"{top['prefill_wait_ms_p99']:.0f} ms and p99 TTFT {top['ttft_ms_p99']:.0f} ms: {fix}"
        )
        return dict(out, lines=lines)
    if best["buffer_blocks"] == 0:
        lines.append(
            f"recommendation: no buffer. Without one this trace already meets {what} (p99 prefill wait "
            f"{base['prefill_wait_ms_p99']:.0f} ms): decode's GPU blocks rarely held prefill up; a buffer helps "
            "when they run short"
        )
        return dict(out, lines=lines)
    out.update(
        buffer_blocks=best["buffer_blocks"],
        buffer_gib=best["buffer_gib"],
        **{
            "without": {k: base[k] for k in ("prefill_wait_ms_p99", "ttft_ms_p50", "ttft_ms_p99")},
            "with": {k: best[k] for k in ("prefill_wait_ms_p99", "ttft_ms_p50", "ttft_ms_p99")},
        },
    )
    lines.append(
        f"recommendation: {best['buffer_gib']:.2f} GiB ({best['buffer_blocks']} blocks) of buffer per decode rank, "
        f"the smallest in the sweep meeting {what}. Without -> with it: p99 prefill wait "
        f"{base['prefill_wait_ms_p99']:.0f} -> {best['prefill_wait_ms_p99']:.0f} ms, TTFT p50 "
        f"{base['ttft_ms_p50']:.0f} -> {best['ttft_ms_p50']:.0f} ms, p99 {base['ttft_ms_p99']:.0f} -> "
        f"{best['ttft_ms_p99']:.0f} ms; it costs {best['buffer_gib']:.2f} GiB of pinned host memory a rank and no "
        f"GPU memory (GPU KV cache {cfg.gpu_blocks * bb / gib:.1f} GiB a rank either way)"
    )
    if "decode_start_ms_p50" in best:  # TTFT is prefill's first token; decode's first step may differ
        lines.append(
            f"decode's first step (the request's start at decode), without -> with it: p50 "
            f"{base['decode_start_ms_p50']:.0f} -> {best['decode_start_ms_p50']:.0f} ms, p99 "
            f"{base['decode_start_ms_p99']:.0f} -> {best['decode_start_ms_p99']:.0f} ms"
        )
    if best["peak_buffer_occupancy"] >= 0.99 or best["queued"]:
        lines.append(
            f"[yellow]the recommended size itself fills: peak {best['peak_buffer_occupancy']:.0%}, {best['queued']} "
            "requests queued for its room (the next size up queues fewer)[/yellow]"
        )
    if best["buffer_blocks"]:
        more = dataclasses.replace(cfg, gpu_blocks=cfg.gpu_blocks + best["buffer_blocks"])
        alt = simulate(trace, more, 0).figures()
        out["same_memory_as_gpu"] = {
            "gpu_gib": more.gpu_blocks * bb / gib,
            **{k: alt[k] for k in ("prefill_wait_ms_p99", "ttft_ms_p50", "ttft_ms_p99")},
        }
        per_rank = more.gpu_blocks * bb / gib
        lines.append(
            f"the same {best['buffer_gib']:.2f} GiB as GPU KV cache instead ({per_rank:.1f} GiB a "
            f"rank, no buffer): p99 prefill wait {alt['prefill_wait_ms_p99']:.0f} ms, TTFT p50 "
            f"{alt['ttft_ms_p50']:.0f} ms, p99 {alt['ttft_ms_p99']:.0f} ms"
            + (
                f" (not feasible on one GPU: {per_rank:.0f} GiB of KV cache a rank is more than an H200's "
                f"{LARGEST_GPU_GIB} GiB of memory)"
                if per_rank > LARGEST_GPU_GIB
                else ""
            )
        )
    return dict(out, lines=lines)


def plan_verdict(warnings: Sequence[str], rec: dict[str, Any], interrupted: bool = False) -> str:
    """The plan's answer in one line: marginal (the link's need within its measured spread),
    saturated (link or prefill: no buffer helps), the recommended buffer, none needed, or none
    in the sweep. Marginal names only the trace's figures, so that it reads the same on every
    run whose measurement falls within the spread."""
    marginal = next((w for w in warnings if w.startswith("the link is marginal:")), "")
    if marginal:
        need = marginal.split("the trace needs ", 1)[1].split(", within", 1)[0]
        return (
            f"verdict: marginal. The trace needs {need}, within what this host's link measures from run to run, "
            "so no answer here would hold: give the production link's rate (--bandwidth-gbps)"
        )
    for w in warnings:
        if w.startswith("the link saturates:"):
            return "verdict: the link saturates; no buffer size fixes it (below: the link that would)"
        if w.startswith("prefill is overloaded"):
            return "verdict: prefill is overloaded; no buffer size fixes it (below: what would)"
    best = rec["best"]
    tail = " (interrupted: of the sizes simulated)" if interrupted else ""
    if best is None:
        return f"verdict: no buffer in the sweep meets the target ({rec['target']}){tail}"
    if best["buffer_blocks"] == 0:
        return f"verdict: no buffer needed; without one the trace meets the target{tail}"
    return f"verdict: {best['buffer_gib']:.2f} GiB of buffer per decode rank ({best['buffer_blocks']} blocks){tail}"


def write_plan_plot(
    path: str, rows: list[dict[str, Any]], title: str, target_wait_ms: float, best_gib: float | None
) -> None:
    """The sweep in three panels; the wait target as a line, the recommended size marked."""
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
    ax.axhline(target_wait_ms, color="tab:gray", ls=":", label=f"target p99 {target_wait_ms:.0f} ms")
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
        if best_gib is not None:
            ax.axvline(best_gib, color="tab:green", ls="--", alpha=0.7, label=f"recommended {best_gib:.1f} GiB")
        ax.set_xlabel("buffer per decode rank (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, "pdkv capacity plan")


def load_warnings(
    trace: Sequence[TraceRequest], cfg: PlanConfig, spread: tuple[float, float] | None = None
) -> list[str]:
    """Offered load of prefill compute over the trace's span, of decode's GPU pool in its
    busiest window, and of the link on average and in its busiest window: above 1 a queue
    grows and every figure measures that queue, not the buffer. One line each that
    saturates, with the figure that would fix it. ``spread``: the lowest and highest of the
    link's measured runs (bytes/s); a need within it (widened by ``MARGIN``) is *marginal*,
    neither saturated nor not: the answer would flip with the next measurement."""
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
    blocks = np.array([cfg.layout.blocks_for_tokens(r.input_tokens) for r in trace], dtype=np.float64)
    arrive = np.array([r.arrival for r in trace]) - min(r.arrival for r in trace)
    held_s = np.array([r.output_tokens * cfg.token_s for r in trace])
    held = busiest(arrive, arrive + held_s, blocks, WINDOW_S) if cfg.token_s else 0.0
    if held > cfg.gpu_blocks:  # judged in the busiest window, not over the whole trace
        out.append(
            f"decode is overloaded: in the trace's busiest {WINDOW_S:.0f} s requests hold {held:,.0f} GPU blocks "
            f"on average, the pool has {cfg.gpu_blocks} (any buffer fills; raise --gpu-gib to about "
            f"{held * cfg.layout.block_bytes / (1 << 30) / LOAD:.0f} GiB a rank)"
        )
    if cfg.bandwidth > 0:
        per_block = cfg.layout.block_bytes * cfg.decode_tp
        avg = float(blocks.sum()) * per_block / span
        peak = busiest(arrive, arrive + 1, blocks * per_block, WINDOW_S)
        if spread is not None and spread[0] / MARGIN <= avg <= spread[1] * MARGIN:
            out.append(
                f"the link is marginal: the trace needs {avg / 1e9:.2f} GB/s of KV on average ({peak / 1e9:.2f} in "
                f"its busiest {WINDOW_S:.0f} s), within the spread of this host's measured link "
                f"({spread[0] / 1e9:.2f}-{spread[1] / 1e9:.2f} GB/s over its runs): whether it saturates depends on "
                "the measurement, not the trace, and the figures below with it. Measure the production link and "
                "give its rate (--bandwidth-gbps)"
            )
        elif avg > cfg.bandwidth:
            out.append(
                f"the link saturates: the trace needs {avg / 1e9:.2f} GB/s of KV on average ({peak / 1e9:.2f} in its "
                f"busiest {WINDOW_S:.0f} s), the link carries {cfg.bandwidth / 1e9:.2f} ({avg / cfg.bandwidth:.1f}x); "
                "TTFT is the link's queue and no buffer size shortens it: a link of about "
                f"{avg / LOAD / 1e9:.1f} GB/s, or the requests split over more decode instances, would"
            )
        elif peak > cfg.bandwidth:
            out.append(
                f"the link saturates in bursts: in the trace's busiest {WINDOW_S:.0f} s it needs {peak / 1e9:.2f} GB/s "
                f"of KV, the link carries {cfg.bandwidth / 1e9:.2f} ({avg / 1e9:.2f} on average); transfers queue "
                "in those spells whatever the buffer"
            )
    return out


LOAD = 0.8  # the load a capacity derived from the trace runs at
MARGIN = 1.1  # a measured spread widened by this either way: what a repeat measurement may still give
LARGEST_GPU_GIB = 141  # an H200's memory: a GPU KV cache a rank above it is no real alternative
WINDOW_S = 60.0  # ... in the trace's busiest window of this length: a buffer absorbs shorter bursts


def busiest(starts: np.ndarray, ends: np.ndarray, weights: np.ndarray, window_s: float) -> float:
    """The highest mean over any ``window_s`` (whole seconds) of the sum of ``weights`` held
    over ``[start, end)`` intervals (seconds): a load's busiest spell."""
    n = int(math.ceil(float(ends.max()))) + 2
    grid = np.zeros(n + 1)
    s, e = starts.astype(np.int64), np.maximum(ends.astype(np.int64), starts.astype(np.int64) + 1)
    np.add.at(grid, s, weights)
    np.add.at(grid, e, -weights)
    per_s = np.cumsum(grid)[:n]  # held during each whole second
    w = max(1, min(n, int(window_s)))
    sums = np.convolve(per_s, np.ones(w), "valid")
    return float(sums.max() / w)


def size_from_trace(
    trace: Sequence[TraceRequest], cfg: PlanConfig, instances: int | None, gpu_blocks: int | None
) -> tuple[int, int, list[str]]:
    """Prefill instances and decode GPU blocks per rank for the trace, where not given: the
    capacity its load needs (prefill's compute, decode's GPU blocks held while generating)
    in its busiest ``WINDOW_S`` (the whole span if shorter), at ``LOAD``; the GPU pool never
    below the largest request. Returns both and a line per derived value saying how; a trace
    with no span (one moment) is refused, naming the flags to set."""
    lay = cfg.layout
    t0 = min(r.arrival for r in trace)
    span = max(r.arrival for r in trace) - t0
    largest = max(lay.blocks_for_tokens(r.input_tokens) for r in trace)
    lines = []
    if (instances is None or gpu_blocks is None) and span <= 0:
        raise UsageError(
            "the trace's requests all arrive at one moment: it has no load to size from; set "
            "--prefill-instances and --gpu-gib (or --gpu-blocks)"
        )
    window = min(WINDOW_S, span)
    arrive = np.array([r.arrival - t0 for r in trace])
    compute = np.array([cfg.compute_s(r.input_tokens) for r in trace])
    where = f"in its busiest {window:.0f} s" if window < span else f"over its {span:.0f} s"
    if instances is None:
        # work arriving, spread over its compute time: instance-seconds a second
        # each request's compute counted in the second it arrives: the instance-seconds of
        # work arriving a second (holding each request a whole second would count a 0.2 s
        # prompt as 1 s of an instance)
        work = busiest(arrive, arrive + 1, compute, window)
        instances = max(1, math.ceil(work / LOAD))
        lines.append(
            f"prefill: {instances} instance(s), from the trace ({where} its prompts keep {work:.2f} instances "
            f"busy at {cfg.compute_desc()}; {LOAD:.0%} load; set --prefill-instances to choose)"
        )
    if gpu_blocks is None:
        blocks = np.array([lay.blocks_for_tokens(r.input_tokens) for r in trace], dtype=np.float64)
        hold = np.array([r.output_tokens * cfg.token_s for r in trace])
        start = arrive + compute
        held = busiest(start, start + hold, blocks, window)
        per_gib = lay.blocks_for_bytes(1 << 30)
        need = max(largest, math.ceil(held / LOAD))
        gpu_blocks = max(need, -(-need // max(1, per_gib)) * per_gib)  # whole GiB
        lines.append(
            f"decode: {gpu_blocks} GPU blocks ({gpu_blocks * lay.block_bytes / (1 << 30):.1f} GiB a rank), from the "
            f"trace ({where} its requests hold {held:,.0f} blocks on average while generating, at "
            f"{cfg.token_s * 1e3:g} ms a token; {LOAD:.0%} load; the largest request {largest}; "
            "set --gpu-gib to choose)"
        )
    return instances, gpu_blocks, lines


def run_plan(a: Any, console: Any, lay_kw: dict[str, Any]) -> int:
    import time

    from rich import box
    from rich.table import Table

    trace = read_trace(a.trace, a.trace_limit, a.time_scale)
    lay = KVLayout(**lay_kw, tp_size=a.decode_tp)
    gpu_given: int | None = None
    if a.gpu_blocks:
        gpu_given = a.gpu_blocks
    elif a.gpu_gib is not None:
        gpu_given = lay.blocks_for_bytes(int(a.gpu_gib * (1 << 30)))
        if gpu_given <= 0:
            raise UsageError(f"--gpu-gib {a.gpu_gib} holds no block of {lay.block_bytes} bytes")
    big = max(trace, key=lambda r: r.input_tokens)
    need = lay.blocks_for_tokens(big.input_tokens)
    line = f"trace line {int(big.rid[1:]) + 1}" if big.rid[1:].isdigit() else f"trace request {big.rid}"
    # the outlier rule: a request no decode GPU could hold stops the plan, named by its line
    if need * lay.block_bytes > LARGEST_GPU_GIB << 30:
        raise UsageError(
            f"{line}: {big.input_tokens:,} tokens need {need * lay.block_bytes / (1 << 30):,.0f} GiB of KV a decode "
            f"rank, more than any GPU's memory ({LARGEST_GPU_GIB} GiB): remove the line, or raise --decode-tp"
        )
    if gpu_given is not None and need > gpu_given:
        raise UsageError(
            f"{line} needs {need} GPU blocks ({big.input_tokens} tokens) but the decode GPU pool "
            f"has {gpu_given}: raise --gpu-gib or --gpu-blocks"
        )
    base_cfg = PlanConfig(
        layout=lay,
        decode_tp=a.decode_tp,
        gpu_blocks=gpu_given or need,
        prefill_tokens_per_s=a.prefill_tokens_per_s,
        layer_ms=a.layer_ms,
        overhead_s=a.prefill_overhead_ms / 1000,
        token_s=a.token_ms / 1000,
        direct_to_gpu=a.direct_to_gpu,
    )
    instances, gpu_blocks, sized = size_from_trace(trace, base_cfg, a.prefill_instances, gpu_given)
    sizes = sweep_sizes(a.buffer_sweep, lay, gpu_blocks, max(1, gpu_blocks // 8) if a.direct_to_gpu else need)
    sizes = sorted({0, *sizes})  # the no-buffer case: what every other size is measured against
    bw = a.bandwidth_gbps * 1e9 if a.bandwidth_gbps is not None else 0.0
    swap_bw = a.swap_gbps * 1e9 if a.swap_gbps is not None else 0.0
    measured = not (bw and swap_bw)
    runs: dict[str, list[float]] = {}
    if measured:
        mbw, mswap, links, swaps = measure_rates(a, console)
        bw, swap_bw = bw or mbw, swap_bw or mswap
        runs = {"bandwidth_runs_GBps": links, "swap_runs_GBps": swaps}
    cfg = dataclasses.replace(
        base_cfg, gpu_blocks=gpu_blocks, prefill_instances=instances, bandwidth=bw, swap_bandwidth=swap_bw
    )
    t0 = time.monotonic()
    rows: list[dict[str, Any] | None] = []
    interrupted = False
    # on a terminal, which size is being simulated (a large trace takes seconds a size)
    status = console.status("") if console.is_terminal and not a.quiet else contextlib.nullcontext()
    try:
        with status:
            for i, nb in enumerate(sizes):
                if nb and not a.direct_to_gpu and nb < need:
                    rows.append(None)  # every request passes through the buffer: it must hold the largest
                    continue
                if console.is_terminal and not a.quiet:
                    status.update(  # type: ignore[union-attr]
                        f"simulating buffer size {i + 1} of {len(sizes)} ({nb * lay.block_bytes / (1 << 30):.1f} GiB) "
                        f"x {len(trace)} requests"
                    )
                rows.append(simulate(trace, cfg, nb).figures())
    except KeyboardInterrupt:  # Ctrl-C: the sizes simulated so far are reported, then rc 130
        if not any(r is not None for r in rows):
            raise
        interrupted, sizes = True, sizes[: len(rows)]
    skipped = [sizes[i] for i, r in enumerate(rows) if r is None]
    rows_ok = [r for r in rows if r is not None]
    elapsed = time.monotonic() - t0
    compute = cfg.compute_desc()
    head = (
        f"{a.model} ({lay.total_layers} layers, {lay.block_bytes * a.decode_tp / (1 << 20):.2f} MiB a block of "
        f"{lay.tokens_per_block} tokens, decode TP {a.decode_tp}); {len(trace)} requests of {a.trace}; "
        f"{instances} prefill instance(s) at {compute}; link {bw / 1e9:.2f} GB/s, swap "
        f"{swap_bw / 1e9:.2f} GB/s{_measured_note(runs) if measured else ''}; decode {a.token_ms} ms a token, "
        f"{gpu_blocks} GPU blocks ({gpu_blocks * lay.block_bytes / (1 << 30):.1f} GiB a rank); "
        + ("transfers into GPU blocks while they last" if a.direct_to_gpu else "every transfer through the buffer")
    )
    link_runs = runs.get("bandwidth_runs_GBps")
    spread = (min(link_runs) * 1e9, max(link_runs) * 1e9) if link_runs and a.bandwidth_gbps is None else None
    warnings = load_warnings(trace, cfg, spread)
    saturated = next(("the link" for w in warnings if w.startswith("the link saturates:")), "")
    saturated = saturated or next(("prefill" for w in warnings if w.startswith("prefill is overloaded")), "")
    rec = advise(trace, cfg, rows_ok, a.target_wait_ms, a.target_wait_fraction, a.target_ttft_ms, saturated)
    verdict = plan_verdict(warnings, rec, interrupted)
    console.print(verdict)  # the first line: the answer, in words that a re-measurement within its spread keeps
    console.print(head)
    for line in sized:
        console.print(line)
    for line in warnings:
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
    console.print(
        "TTFT: arrival to the end of prefill's compute (its first token, as prefill returns it); decode start: "
        "arrival to decode's first step. Behind a router that streams from decode (vLLM's, SGLang's), the user's "
        "first token comes at decode start"
    )
    if skipped:
        console.print(f"left out: buffers of {skipped} blocks hold less than the largest request ({need} blocks)")
    for line in rec["lines"]:
        console.print(line)
    best = rec["best"]
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
            "prefill_instances": instances,
            "sized_from_trace": sized,
            "prefill_tokens_per_s": a.prefill_tokens_per_s,
            "layer_ms": a.layer_ms,
            "prefill_overhead_ms": a.prefill_overhead_ms,
            "bandwidth_GBps": bw / 1e9,
            "swap_GBps": swap_bw / 1e9,
            "bandwidth_measured": measured,
            **runs,
            "token_ms": a.token_ms,
            "direct_to_gpu": a.direct_to_gpu,
            "time_scale": a.time_scale,
        },
        "target": {"prefill_wait_ms_p99": rec["target_wait_ms"], "ttft_ms_p99": a.target_ttft_ms},
        "sweep": rows_ok,
        "verdict": verdict,
        "recommended_buffer_blocks": best["buffer_blocks"] if best else None,
        "recommended_buffer_gib": best["buffer_gib"] if best else None,
        "recommendation": {k: v for k, v in rec.items() if k not in ("best", "lines")},
        "prefix_reuse": pre,
        "simulation_s": elapsed,
        "interrupted": interrupted,
    }
    if interrupted:
        console.print(f"[yellow]interrupted[/yellow]: {len(rows)} buffer sizes simulated, the others not")
    if a.plot:
        title = (
            f"{a.model}, {len(trace)} requests, {instances} prefill instance(s), "
            f"{gpu_blocks * lay.block_bytes / (1 << 30):.0f} GiB of GPU KV a decode rank"
        )
        write_plan_plot(a.plot, rows_ok, title, rec["target_wait_ms"], best["buffer_gib"] if best else None)
        console.print(f"plot written to {a.plot}")
    text = json.dumps(_finite(out))
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)  # the JSON line is the last thing printed
    return 130 if interrupted else 0


def _finite(x: Any) -> Any:
    """NaN (a figure with no samples) as null: the JSON stays standard."""
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
