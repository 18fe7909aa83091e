"""The tool's report: figures against their ceilings, failures by request, the optional plot."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

from ...layout import KVLayout
from .decode_mode import DecodeSide
from .stats import LineFit, PrefillTally, Quantiles


def _pct(q: Quantiles, p: float) -> float:
    return q.percentile(p)


def build_report(
    dec: DecodeSide,
    pre: PrefillTally | None,
    wall: float,
    lay: KVLayout,
    D: int,
    requests: int | None = None,
) -> dict[str, Any]:
    """Every figure of a run, each named for what it is, from decode's tally of its ended
    requests (those still in flight folded in here) and the prefill ranks' (local mode).
    ``wall`` is the whole run, start-up included; rates are over the transfer span, from
    the first grant to the last request received (or ready)."""
    pre = pre if pre is not None else PrefillTally(1)
    pre.close()
    with dec.lock:
        tally = copy.deepcopy(dec.tally)
        tracks = list(dec.tracks.items())
    inst_block = lay.block_bytes * D
    in_flight = 0
    for rid, tr in tracks:  # still held at the end: ready ones (decode "generating") count as such
        if tr.state:
            tally.fold(rid, tr, inst_block)
            continue
        in_flight += 1  # neither ready nor failed
        tally.landed_blocks += tr.blocks if tr.received else 0
        if tr.reserved:
            tally.first_grant = min(tally.first_grant, tr.reserved)
    busy = pre.busy.seconds()
    sent = sum(int(p.get("bytes", 0)) for p in pre.summaries)
    total_bytes = tally.ready_blocks * inst_block
    # every byte that landed in decode, the requests that ended badly after landing (an
    # interrupted run aborts them) too: what was verified is a part of it
    landed_bytes = tally.landed_blocks * inst_block
    span = tally.last_end - tally.first_grant if tally.ready and tally.first_grant < math.inf else 0.0
    m = dec.sched.metrics()
    failed = dict(pre.failed)
    failed.update(tally.failed)  # decode's word where both sides speak of a request
    peak_buf = int(m["buffer_blocks_peak"])
    n_req = max(requests or 0, tally.ready + len(failed) + in_flight)
    # requests issued that neither became ready nor reported a failure: lost, and failed
    lost = max(0, n_req - tally.ready - len(failed)) if requests else 0
    failures = list(dec.failures)
    if dec.failures_more:
        failures.append(f"... and {dec.failures_more} more failure line(s)")
    if lost:
        failures.append(f"{lost} request(s) issued but neither ready nor failed (no outcome reported)")
    shown = sorted(failed.items())[:20]
    failures += [f"{rid}: {why}" for rid, why in shown]
    if len(failed) > len(shown):
        failures.append(f"... and {len(failed) - len(shown)} more failed request(s)")
    return {
        "requests": n_req,
        "requests_ready": tally.ready,
        "requests_into_gpu_blocks": tally.into_gpu,
        "requests_queued": int(m["reservations_queued"]),
        "requests_failed": len(failed) + lost,
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
        "request_GBps_p50": _pct(tally.request_gbps, 50),
        "request_GBps_p1": _pct(tally.request_gbps, 1),  # the slowest 1%: 99% of requests beat it
        "layer_latency_ms_p50": _pct(pre.layer_s, 50) * 1e3,
        "layer_latency_ms_p99": _pct(pre.layer_s, 99) * 1e3,
        "grant_to_received_ms_p50": _pct(tally.grant_to_received, 50) * 1e3,
        "grant_to_received_ms_p99": _pct(tally.grant_to_received, 99) * 1e3,
        "grant_to_ready_ms_p50": _pct(tally.grant_to_ready, 50) * 1e3,
        "grant_to_ready_ms_p99": _pct(tally.grant_to_ready, 99) * 1e3,
        "prefill_wait_ms_p50": _pct(pre.waits, 50) * 1e3,
        "prefill_wait_ms_p99": _pct(pre.waits, 99) * 1e3,
        "prefill_wait_ms_max": _pct(pre.waits, 100) * 1e3,
        "ttft_ms_p50": _pct(pre.ttfts, 50) * 1e3,
        "ttft_ms_p99": _pct(pre.ttfts, 99) * 1e3,
        "peak_buffer_blocks": peak_buf,
        "buffer_blocks": dec.nb,
        "gpu_blocks": dec.gpu_blocks,
        "peak_buffer_occupancy": peak_buf / dec.nb if dec.nb else 0.0,
        "swap_GBps": m["swap_bytes"] / m["swap_busy_seconds"] / 1e9 if m["swap_busy_seconds"] else 0.0,
        "prefill_wait_avoided_s_total": m["prefill_wait_avoided_seconds_sum"],
        "prefill_wait_avoided_s_max": m["prefill_wait_avoided_seconds_max"],
        "gpu": dec.cuda,
        "failures": failures,
    }


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
    fit = LineFit()
    for t, sec in zip(tokens, seconds, strict=True):
        fit.add(float(t), float(sec))
    return fit.fit()


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

    tl = dec.timeline.points or [(0.0, 0, 0, 0)]
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
