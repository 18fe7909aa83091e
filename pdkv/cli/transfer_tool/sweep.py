"""The tool's sweep mode: one verified local transfer per block size and transport, a row each
(as nixlbench and Mooncake's transfer bench report by block size)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from ...layout import KVLayout
from .workload import UsageError, layout_kw

COLUMNS = (
    ("tokens\na block", "tokens_per_block", "{:d}"),
    ("block\nKiB", "block_kib", "{:,.0f}"),
    ("transport", "transport", "{}"),
    ("GB/s", "throughput_GBps", "{:.2f}"),
    ("request\nGB/s p50", "request_GBps_p50", "{:.2f}"),
    ("grant->ready\np50 ms", "grant_to_ready_ms_p50", "{:.1f}"),
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
    skip = {"--sweep-tokens-per-block", "--sweep-transports", "--json", "--plot", "--tokens-per-block", "--transport"}
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
    base = layout_kw(a)
    for tpb in sizes:
        try:
            KVLayout(**dict(base, tokens_per_block=tpb), tp_size=a.decode_tp)
        except Exception as exc:
            raise UsageError(f"--sweep-tokens-per-block {tpb}: {exc}") from None
    rows = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="pdkv-sweep-") as d:
        for tpb in sizes:
            lay = KVLayout(**dict(base, tokens_per_block=tpb), tp_size=a.decode_tp)
            for tr in transports:
                out = os.path.join(d, f"{tpb}-{tr}.json")
                console.print(f"{a.model}, {tpb} tokens a block, {tr} ...")
                p = subprocess.run(child_argv(a, tpb, tr, out), capture_output=True, text=True)
                row: dict[str, Any] = {"tokens_per_block": tpb, "block_kib": lay.block_bytes * a.decode_tp / 1024}
                row["transport"] = tr
                if p.returncode == 0 and os.path.exists(out):
                    with open(out) as f:
                        rep = json.load(f)
                    row.update({k: rep[k] for k in ("throughput_GBps", "request_GBps_p50", "grant_to_ready_ms_p50")})
                    row["bytes_verified"] = rep["bytes_verified"]
                    row["result"] = "PASS"
                else:
                    failed += 1
                    last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or [f"exit {p.returncode}"]
                    row.update(throughput_GBps=0.0, request_GBps_p50=0.0, grant_to_ready_ms_p50=0.0)
                    row["result"] = f"FAIL: {last[0][:80]}"
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
    return 0 if not failed else 1
