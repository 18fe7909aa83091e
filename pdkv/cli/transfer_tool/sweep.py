"""The tool's sweep mode: verified local transfers per block size and transport, a row each
(as nixlbench and Mooncake's transfer bench report by block size): ``--sweep-reps`` runs a
point, the row gives the median throughput and its range over them, and the medians of the
runs' p50 and p99 latencies."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from ...layout import KVLayout
from ...transfer import names as transport_names
from .workload import UsageError, layout_kw

COLUMNS = (
    ("tokens\na block", "tokens_per_block", "{:d}"),
    ("block\nKiB", "block_kib", "{:,.0f}"),
    ("transport", "transport", "{}"),
    ("GB/s", "throughput_GBps", "{:.2f}"),
    ("GB/s\nmin-max", "throughput_range", "{}"),
    ("request\nGB/s p50", "request_GBps_p50", "{:.2f}"),
    ("grant->ready\np50 ms", "grant_to_ready_ms_p50", "{:.1f}"),
    ("grant->ready\np99 ms", "grant_to_ready_ms_p99", "{:.1f}"),
    ("verified", "result", "{}"),
)


def parse_list(value: str, flag: str, kind: type) -> list[Any]:
    try:
        out = [kind(x) for x in value.split(",") if x]
    except ValueError:
        out = []
    if not out:
        raise UsageError(f"{flag} {value!r}: expected a comma-separated list")
    return out


def child_argv(a: argparse.Namespace, tpb: int, transport: str, out: str) -> list[str]:
    """The local run of one row: the sweep's own flags, this size and transport."""
    skip = {
        "--sweep-tokens-per-block",
        "--sweep-transports",
        "--sweep-reps",
        "--json",
        "--plot",
        "--tokens-per-block",
        "--transport",
    }
    argv: list[str] = []
    it = iter(a.argv)
    for tok in it:
        flag = tok.split("=", 1)[0]
        if tok == "sweep":
            continue
        if flag in skip:
            if "=" not in tok:
                next(it, None)
            continue
        argv.append(tok)
    return [sys.executable, "-m", "pdkv.cli.transfer_tool", *argv, "--tokens-per-block", str(tpb)] + [
        "--transport",
        transport,
        "--json",
        out,
        "-q",
    ]


def run_sweep(a: argparse.Namespace, console: Any) -> int:
    from rich.table import Table

    sizes = parse_list(a.sweep_tokens_per_block, "--sweep-tokens-per-block", int)
    transports = parse_list(a.sweep_transports, "--sweep-transports", str)
    known = ["auto", *transport_names()]
    for tr in transports:
        if tr not in known:
            raise UsageError(f"--sweep-transports: {tr!r} is not a transport (one of {', '.join(known)})")
    if a.sweep_reps < 1:
        raise UsageError("--sweep-reps must be positive")
    base = layout_kw(a)
    for tpb in sizes:
        try:
            KVLayout(**dict(base, tokens_per_block=tpb), tp_size=a.decode_tp)
        except Exception as exc:
            raise UsageError(f"--sweep-tokens-per-block {tpb}: {exc}") from None
    rows = []
    failed: list[str] = []
    keys = ("throughput_GBps", "request_GBps_p50", "grant_to_ready_ms_p50", "grant_to_ready_ms_p99")
    with tempfile.TemporaryDirectory(prefix="pdkv-sweep-") as d:
        for tpb in sizes:
            lay = KVLayout(**dict(base, tokens_per_block=tpb), tp_size=a.decode_tp)
            for tr in transports:
                row: dict[str, Any] = {"tokens_per_block": tpb, "block_kib": lay.block_bytes * a.decode_tp / 1024}
                row["transport"] = tr
                reps: list[dict[str, Any]] = []
                why = ""
                for i in range(a.sweep_reps):
                    out = os.path.join(d, f"{tpb}-{tr}-{i}.json")
                    console.print(f"{a.model}, {tpb} tokens a block, {tr}, run {i + 1} of {a.sweep_reps} ...")
                    p = subprocess.run(child_argv(a, tpb, tr, out), capture_output=True, text=True)
                    if p.returncode == 0 and os.path.exists(out):
                        with open(out) as f:
                            reps.append(json.load(f))
                        continue
                    last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or [f"exit {p.returncode}"]
                    why = last[0]
                    break
                if why:
                    failed.append(f"{tpb} tokens a block, {tr}: {why}")
                    row.update({k: 0.0 for k in keys}, throughput_range="-", bytes_verified=0)
                    row["result"] = f"FAIL: {why[:80]}"
                else:
                    row.update({k: statistics.median(r[k] for r in reps) for k in keys})
                    tput = [r["throughput_GBps"] for r in reps]
                    row["throughput_range"] = f"{min(tput):.2f}-{max(tput):.2f}"
                    row["runs"] = len(reps)
                    row["bytes_verified"] = sum(r["bytes_verified"] for r in reps)
                    row["result"] = "PASS"
                rows.append(row)
    t = Table(title=f"pdkv transfer sweep: {a.model}, prefill TP {a.prefill_tp} -> decode TP {a.decode_tp}")
    for name, _, _ in COLUMNS:
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(*(f.format(r[k]) for _, k, f in COLUMNS))
    console.print(t)
    text = json.dumps({"mode": "sweep", "rows": rows})
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)
    for why in failed:
        print(f"pdkv-transfer-test sweep: FAIL {why}", file=sys.stderr)
    return 0 if not failed else 1
