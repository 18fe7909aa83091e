"""The tool's report: figures against their ceilings, failures by request, the optional plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...layout import KVLayout
from .decode import DecodeSide, Track
from .workload import UsageError


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def build_report(
    dec: DecodeSide,
    prefill: list[dict[str, Any]],
    outcomes: dict[str, str],
    elapsed: float,
    lay: KVLayout,
    D: int,
    reasons: dict[str, str] | None = None,
) -> dict[str, Any]:
    ready = [t for t in dec.tracks.values() if t.state == "ready"]
    inst_block = lay.block_bytes * D
    per_req_gbps = [t.blocks * inst_block / (t.received - t.reserved) / 1e9 for t in ready if t.received > t.reserved]
    ttr = [t.received - t.reserved for t in ready if t.received]
    tready = [t.ready - t.reserved for t in ready if t.ready]
    layer_s = [x for p in prefill for x in p.get("layer_s", [])]
    total_bytes = sum(t.blocks for t in ready) * inst_block
    m = dec.sched.metrics()
    failed_ids = {rid for rid, st in outcomes.items() if st != "received"}
    failed_ids |= {rid for rid, t in dec.tracks.items() if t.state not in ("ready", "")}
    peak_buf = int(m["buffer_blocks_peak"])
    return {
        "requests": len(set(outcomes) | set(dec.tracks)),
        "requests_ready": len(ready),
        "requests_into_gpu_blocks": sum(1 for t in ready if t.location == "gpu"),
        "requests_failed": len(failed_ids),
        "bytes_verified": dec.bytes_verified,
        "verify_errors": dec.verify_errors,
        "bytes_transferred": total_bytes,
        "elapsed_s": elapsed,
        "throughput_GBps_mean": total_bytes / elapsed / 1e9 if elapsed > 0 else 0.0,
        "request_GBps_p50": _pct(per_req_gbps, 50),
        "request_GBps_p99": _pct(per_req_gbps, 1),  # the rate 99% of requests beat (slow tail)
        "layer_latency_ms_p50": _pct(layer_s, 50) * 1e3,
        "layer_latency_ms_p99": _pct(layer_s, 99) * 1e3,
        "time_to_received_ms_p50": _pct(ttr, 50) * 1e3,
        "time_to_received_ms_p99": _pct(ttr, 99) * 1e3,
        "time_to_ready_ms_p50": _pct(tready, 50) * 1e3,
        "time_to_ready_ms_p99": _pct(tready, 99) * 1e3,
        "peak_buffer_blocks": peak_buf,
        "buffer_blocks": dec.nb,
        "peak_buffer_occupancy": peak_buf / dec.nb if dec.nb else 0.0,
        "swap_GBps": m["swap_bytes"] / m["swap_busy_seconds"] / 1e9 if m["swap_busy_seconds"] else 0.0,
        "prefill_wait_avoided_s_total": m["prefill_wait_avoided_seconds_sum"],
        "prefill_wait_avoided_s_max": m["prefill_wait_avoided_seconds_max"],
        "gpu": dec.cuda,
        "failures": sorted(dec.failures)[:20]
        + sorted(_failure_line(r, outcomes, dec, reasons or {}) for r in list(failed_ids)[:20]),
    }


def _failure_line(rid: str, outcomes: dict[str, str], dec: DecodeSide, reasons: dict[str, str]) -> str:
    tr = dec.tracks.get(rid, Track())
    why = reasons.get(rid) or tr.reason
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
        "requests_failed": "{:d}",
        "verify_errors": "{:d}",
        "bytes_verified": "{:,d}",
        "bytes_transferred": "{:,d}",
        "elapsed_s": "{:.2f}",
        "throughput_GBps_mean": "{:.2f}",
        "request_GBps_p50": "{:.2f}",
        "request_GBps_p99": "{:.2f}",
        "layer_latency_ms_p50": "{:.2f}",
        "layer_latency_ms_p99": "{:.2f}",
        "time_to_received_ms_p50": "{:.1f}",
        "time_to_received_ms_p99": "{:.1f}",
        "time_to_ready_ms_p50": "{:.1f}",
        "time_to_ready_ms_p99": "{:.1f}",
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
    for side in ("prefill", "decode"):
        if rep.get(f"{side}_devices"):
            t.add_row(f"{side} GPUs (by rank)", ", ".join(map(str, rep[f"{side}_devices"])))
    for k, f in fmt.items():
        v = rep[k]
        t.add_row(k, "n/a" if isinstance(v, float) and math.isnan(v) else f.format(v))
    console.print(t)
    for line in rep["failures"]:
        console.print(f"[red]{line}[/red]")


def write_plot(path: str, dec: DecodeSide) -> None:
    tl = dec.timeline
    if path.endswith(".html"):
        if not tl:
            tl = [(0.0, 0, 0, 0)]
        W, H = 800, 300
        tmax = max(x[0] for x in tl) or 1.0
        thr = [0.0] + [(tl[i][3] - tl[i - 1][3]) / max(1e-9, tl[i][0] - tl[i - 1][0]) / 1e9 for i in range(1, len(tl))]
        ymax = max(thr) or 1.0

        def poly(ys: Sequence[float], top: float, color: str) -> str:
            pts = " ".join(
                f"{40 + x[0] / tmax * (W - 60):.1f},{H - 30 - y / top * (H - 60):.1f}" for x, y in zip(tl, ys)
            )
            return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>'

        occ = [x[1] / dec.nb for x in tl]
        svg = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">'
            f'<rect width="{W}" height="{H}" fill="white"/>'
            f"{poly(thr, ymax, '#1f77b4')}{poly(occ, 1.0, '#d62728')}"
            f'<text x="40" y="20" font-size="12">throughput into the buffer (blue, max {ymax:.2f} GB/s) and '
            f"buffer occupancy (red, 0-100%) over {tmax:.1f} s</text></svg>"
        )
        with open(path, "w") as f:
            f.write(f"<!doctype html><meta charset=utf-8><title>pdkv transfer test</title>{svg}")
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot with a .png file needs matplotlib (pip install 'pdkv[plot]'); .html needs nothing"
        ) from None
    ts = [x[0] for x in tl]
    thr = [0.0] + [(tl[i][3] - tl[i - 1][3]) / max(1e-9, tl[i][0] - tl[i - 1][0]) / 1e9 for i in range(1, len(tl))]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(ts, thr, label="throughput into buffer (GB/s)")
    ax2 = ax.twinx()
    ax2.plot(ts, [x[1] / dec.nb * 100 for x in tl], color="tab:red", label="buffer occupancy (%)")
    ax.set_xlabel("s")
    ax.set_ylabel("GB/s")
    ax2.set_ylabel("%")
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
