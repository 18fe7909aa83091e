"""The tool's report: figures against their ceilings, failures by request, the optional plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...layout import KVLayout
from .decode_mode import DecodeSide, Track


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _union_s(intervals: Sequence[Sequence[float]]) -> float:
    """Seconds covered by the union of ``[start, end]`` intervals."""
    total, reach = 0.0, -math.inf
    for a, b in sorted((float(w[0]), float(w[1])) for w in intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def build_report(
    dec: DecodeSide,
    prefill: list[dict[str, Any]],
    outcomes: dict[str, str],
    wall: float,
    lay: KVLayout,
    D: int,
    reasons: dict[str, str] | None = None,
    waits: Sequence[float] = (),
    ttfts: Sequence[float] = (),
    requests: int | None = None,
) -> dict[str, Any]:
    """Every figure of a run, each named for what it is. ``wall`` is the whole run, start-up
    included; rates are over the transfer span, from the first grant to the last request
    received (or ready)."""
    ready = [t for t in dec.tracks.values() if t.state == "ready"]
    inst_block = lay.block_bytes * D
    per_req_gbps = [t.blocks * inst_block / (t.received - t.reserved) / 1e9 for t in ready if t.received > t.reserved]
    ttr = [t.received - t.reserved for t in ready if t.received]
    tready = [t.ready - t.reserved for t in ready if t.ready]
    layer_s = [x for p in prefill for x in p.get("layer_s", [])]
    busy = _union_s([w for p in prefill for w in p.get("writes", [])])
    sent = sum(p.get("bytes", 0) for p in prefill)
    total_bytes = sum(t.blocks for t in ready) * inst_block
    # every byte that landed in decode, the requests that ended badly after landing (an
    # interrupted run aborts them) too: what was verified is a part of it
    landed_bytes = sum(t.blocks for t in dec.tracks.values() if t.received) * inst_block
    starts = [t.reserved for t in dec.tracks.values() if t.reserved]
    ends = [max(t.received, t.ready) for t in ready]
    span = max(ends) - min(starts) if starts and ends else 0.0
    m = dec.sched.metrics()
    failed_ids = {rid for rid, st in outcomes.items() if st != "received"}
    failed_ids |= {rid for rid, t in dec.tracks.items() if t.state not in ("ready", "")}
    peak_buf = int(m["buffer_blocks_peak"])
    seen = len(set(outcomes) | set(dec.tracks))
    n_req = max(requests or 0, seen)
    # requests issued that neither became ready nor reported a failure: lost, and failed
    lost = max(0, n_req - len(ready) - len(failed_ids)) if requests else 0
    failures = list(dec.failures)
    if lost:
        failures.append(f"{lost} request(s) issued but neither ready nor failed (no outcome reported)")
    return {
        "requests": n_req,
        "requests_ready": len(ready),
        "requests_into_gpu_blocks": sum(1 for t in ready if t.location == "gpu"),
        "requests_queued": int(m["reservations_queued"]),
        "requests_failed": len(failed_ids) + lost,
        "requests_lost": lost,
        "bytes_verified": dec.bytes_verified,
        "verify_errors": dec.verify_errors,
        "bytes_transferred": landed_bytes,
        "wall_s": wall,
        "transfer_s": span,
        "throughput_GBps": total_bytes / span / 1e9 if span > 0 else 0.0,
        # bytes sent over the time some prefill rank was writing: the link's rate under the run's load
        "link_GBps": sent / busy / 1e9 if busy > 0 else 0.0,
        "link_busy_s": busy,
        "request_GBps_p50": _pct(per_req_gbps, 50),
        "request_GBps_p1": _pct(per_req_gbps, 1),  # the slowest 1%: 99% of requests beat it
        "layer_latency_ms_p50": _pct(layer_s, 50) * 1e3,
        "layer_latency_ms_p99": _pct(layer_s, 99) * 1e3,
        "grant_to_received_ms_p50": _pct(ttr, 50) * 1e3,
        "grant_to_received_ms_p99": _pct(ttr, 99) * 1e3,
        "grant_to_ready_ms_p50": _pct(tready, 50) * 1e3,
        "grant_to_ready_ms_p99": _pct(tready, 99) * 1e3,
        "prefill_wait_ms_p50": _pct(waits, 50) * 1e3,
        "prefill_wait_ms_p99": _pct(waits, 99) * 1e3,
        "prefill_wait_ms_max": max(waits) * 1e3 if len(waits) else float("nan"),
        "ttft_ms_p50": _pct(ttfts, 50) * 1e3,
        "ttft_ms_p99": _pct(ttfts, 99) * 1e3,
        "peak_buffer_blocks": peak_buf,
        "buffer_blocks": dec.nb,
        "gpu_blocks": dec.gpu_blocks,
        "peak_buffer_occupancy": peak_buf / dec.nb if dec.nb else 0.0,
        "swap_GBps": m["swap_bytes"] / m["swap_busy_seconds"] / 1e9 if m["swap_busy_seconds"] else 0.0,
        "prefill_wait_avoided_s_total": m["prefill_wait_avoided_seconds_sum"],
        "prefill_wait_avoided_s_max": m["prefill_wait_avoided_seconds_max"],
        "gpu": dec.cuda,
        "failures": sorted(failures)[:20]
        + sorted(_failure_line(r, outcomes, dec, reasons or {}) for r in list(failed_ids)[:20]),
    }


def _failure_line(rid: str, outcomes: dict[str, str], dec: DecodeSide, reasons: dict[str, str]) -> str:
    tr = dec.tracks.get(rid, Track())
    why = (reasons.get(rid) or tr.reason).replace(f"request {rid!r}: ", "")
    return f"{rid}: {outcomes.get(rid, tr.state)}" + (f" ({why})" if why else "")


def print_report(rep: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title="pdkv transfer test", show_header=True)
    t.add_column("figure")
    t.add_column("value", justify="right")
    fmt = {
        "requests": "{:d}",
        "requests_ready": "{:d}",
        "requests_into_gpu_blocks": "{:d}",
        "requests_queued": "{:d}",
        "requests_failed": "{:d}",
        "verify_errors": "{:d}",
        "bytes_verified": "{:,d}",
        "bytes_transferred": "{:,d}",
        "wall_s": "{:.2f}",
        "transfer_s": "{:.2f}",
        "throughput_GBps": "{:.2f}",
        "link_GBps": "{:.2f}",
        "link_busy_s": "{:.2f}",
        "request_GBps_p50": "{:.2f}",
        "request_GBps_p1": "{:.2f}",
        "layer_latency_ms_p50": "{:.2f}",
        "layer_latency_ms_p99": "{:.2f}",
        "grant_to_received_ms_p50": "{:.1f}",
        "grant_to_received_ms_p99": "{:.1f}",
        "grant_to_ready_ms_p50": "{:.1f}",
        "grant_to_ready_ms_p99": "{:.1f}",
        "prefill_wait_ms_p50": "{:.1f}",
        "prefill_wait_ms_p99": "{:.1f}",
        "prefill_wait_ms_max": "{:.1f}",
        "ttft_ms_p50": "{:.1f}",
        "ttft_ms_p99": "{:.1f}",
        "peak_buffer_blocks": "{:d}",
        "peak_buffer_occupancy": "{:.0%}",
        "swap_GBps": "{:.2f}",
        "prefill_wait_avoided_s_total": "{:.2f}",
        "prefill_wait_avoided_s_max": "{:.3f}",
    }
    if rep.get("transports_chosen"):
        t.add_row("transport", ", ".join(rep["transports_chosen"]))
    if rep.get("data_paths"):
        t.add_row("data path", ", ".join(rep["data_paths"]))
    if rep.get("shm_copy"):
        t.add_row("shm copy", ", ".join(rep["shm_copy"]))
    if rep.get("run"):
        console.print(rep["run"])
    for side in ("prefill", "decode"):
        if rep.get(f"{side}_devices"):
            t.add_row(f"{side} GPUs (by rank)", ", ".join(map(str, rep[f"{side}_devices"])))
    for k, f in fmt.items():
        v = rep[k]
        t.add_row(k, "n/a" if isinstance(v, float) and math.isnan(v) else f.format(v))
    console.print(t)
    for line in rep["failures"]:
        console.print(f"[red]{line}[/red]")


def fit_prefill(tokens: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """``(fixed_s, tokens_per_s)`` of the least-squares line ``seconds = fixed + tokens /
    tokens_per_s`` over requests; with fewer than two prompt lengths, or a fit that is not a
    positive rate with a fixed part >= 0, no fixed part and the mean rate."""
    t = np.asarray(tokens, dtype=np.float64)
    s = np.asarray(seconds, dtype=np.float64)
    if not t.size or s.sum() <= 0:
        return 0.0, 0.0
    mean_rate = float(t.sum() / s.sum())
    if np.unique(t).size < 2:
        return 0.0, mean_rate
    slope, fixed = np.polyfit(t, s, 1)
    if slope <= 0 or fixed < 0:
        return 0.0, mean_rate
    return float(fixed), float(1 / slope)


def save_figure(fig: Any, path: str, title: str) -> None:
    """Write a matplotlib figure to ``path``: PNG for ``.png``, else an HTML page holding it
    as SVG (no script, opens anywhere); then close it."""
    import io

    import matplotlib.pyplot as plt

    try:
        if path.endswith(".png"):
            fig.savefig(path, dpi=110)
        else:
            buf = io.StringIO()
            fig.savefig(buf, format="svg")
            with open(path, "w") as f:
                f.write(f"<!doctype html><meta charset=utf-8><title>{title}</title>\n{buf.getvalue()}")
    finally:
        plt.close(fig)


def write_plot(path: str, dec: DecodeSide) -> None:
    """Bytes landed per second and buffer occupancy over the run (PNG, or SVG in HTML)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = dec.timeline or [(0.0, 0, 0, 0)]
    ts = [x[0] for x in tl]
    thr = [0.0] + [(tl[i][3] - tl[i - 1][3]) / max(1e-9, tl[i][0] - tl[i - 1][0]) / 1e9 for i in range(1, len(tl))]
    fig, ax = plt.subplots(figsize=(9, 4))
    (a1,) = ax.plot(ts, thr, label="bytes landed in decode (GB/s)")
    ax2 = ax.twinx()
    (a2,) = ax2.plot(ts, [x[1] / dec.nb * 100 for x in tl], color="tab:red", label="buffer occupancy (%)")
    (a3,) = ax2.plot(
        ts, [x[2] / dec.gpu_blocks * 100 for x in tl], color="tab:green", ls="--", label="GPU blocks in use (%)"
    )
    ax.set_xlabel("s since decode started")
    ax.set_ylabel("GB/s")
    ax2.set_ylabel("%")
    ax2.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    # below the axes: the legend never covers the curves
    fig.legend(handles=[a1, a2, a3], loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_figure(fig, path, "pdkv transfer test")


def progress_bar(console: Any, label: str, quiet: bool, *extra: Any) -> Any:
    """The tool's progress bar: ``label``, the bar, done of total, elapsed, remaining, then
    ``extra`` columns; it stays on screen when done (what the run did)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    cols = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    return Progress(*cols, *extra, console=console, transient=False, disable=quiet)
