"""The capacity planner against a real run: the same scaled trace, the same hold times.

Runs ``pdkv-transfer-test`` locally on a trace (decode holding each request's GPU blocks for
output_length x --token-ms, prefill computing --layer-ms a layer), then ``pdkv-transfer-test
plan`` on the same trace at the same buffer and GPU pool: the planner measures the link and
swap rates itself (its burst run on this host), and takes prefill's time per request from
the real run; prints both sets of figures side by side and whether each is within the
tolerance (``--tolerance`` relative, or ``--floor-ms`` absolute for latencies). Last line:
one JSON object.

    python tools/validate_plan.py                      # the shipped trace, defaults below
    python tools/validate_plan.py --buffer-blocks 4000  # a buffer that fills
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "tests", "data", "mooncake_synthetic_200.jsonl")
FIGURES = [  # (name in the real run, name in the plan, kind)
    ("prefill_wait_ms_p50", "prefill_wait_ms_p50", "ms"),
    ("prefill_wait_ms_p99", "prefill_wait_ms_p99", "ms"),
    ("prefill_wait_ms_max", "prefill_wait_ms_max", "ms"),
    ("ttft_ms_p50", "ttft_ms_p50", "ms"),
    ("ttft_ms_p99", "ttft_ms_p99", "ms"),
    ("peak_buffer_blocks", "peak_buffer_blocks", "blocks"),
    ("requests_queued", "queued", "count"),
]


def tool(args: list[str], out: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", *args, "--json", out, "-q"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if p.returncode != 0:
        raise SystemExit(
            f"pdkv-transfer-test {' '.join(args)} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr}"
        )
    with open(out) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--trace-limit", type=int, default=100)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--token-ms", type=float, default=2.0)
    ap.add_argument("--layer-ms", type=float, default=2.0)
    ap.add_argument("--gpu-blocks", type=int, default=8000)
    ap.add_argument("--buffer-blocks", type=int, default=12000)
    ap.add_argument("--tolerance", type=float, default=0.25, help="relative difference allowed")
    ap.add_argument("--floor-ms", type=float, default=50.0, help="latency difference always allowed (ms)")
    ap.add_argument("--floor-blocks", type=int, default=0, help="block difference always allowed")
    a = ap.parse_args()
    common = ["--model", a.model, "--trace", a.trace, "--trace-limit", str(a.trace_limit)]
    common += ["--time-scale", str(a.time_scale), "--token-ms", str(a.token_ms), "--layer-ms", str(a.layer_ms)]
    common += ["--gpu-blocks", str(a.gpu_blocks)]
    with tempfile.TemporaryDirectory(prefix="pdkv-validate-") as d:
        real = tool(
            [*common, "--buffer-blocks", str(a.buffer_blocks), "--prefill-blocks", "65536", "--concurrency", "4096"]
            + ["--no-verify", "--transport", "shm", "--no-gpu", "--timeout", "60"],
            os.path.join(d, "real.json"),
        )
        # the planner measures the link and swap rates itself (a burst run on this host);
        # prefill's time per request is the real run's (its prefill writes every block's
        # pattern as it "computes", on top of --layer-ms)
        rate = real["prefill_tokens_per_s"]
        block = real["layout"]["block_bytes"]
        gib = a.buffer_blocks * block / (1 << 30)
        i = common.index("--layer-ms")
        plan_common = [*common[:i], *common[i + 2 :], "--prefill-tokens-per-s", f"{rate:.1f}"]
        plan = tool(
            ["plan", *plan_common, "--buffer-sweep", repr(gib)],
            os.path.join(d, "plan.json"),
        )
        bw, swap = plan["config"]["bandwidth_GBps"], plan["config"]["swap_GBps"]
    row = [r for r in plan["sweep"] if r["buffer_blocks"] == a.buffer_blocks][0]
    print(
        f"{a.trace_limit} requests of {os.path.basename(a.trace)} x {a.time_scale} in time, {a.model}, "
        f"{a.layer_ms} ms a layer, {a.token_ms} ms a token, {a.gpu_blocks} GPU blocks, {a.buffer_blocks} buffer "
        f"blocks; link {bw:.2f} GB/s, swap {swap:.2f} GB/s and prefill {rate:,.0f} tokens/s (the link and swap "
        "measured by the planner, prefill's time by the real run)"
    )
    print(f"{'figure':22} {'real run':>10} {'planner':>10} {'diff':>9}  within")
    out = {}
    ok_all = True
    for rk, pk, kind in FIGURES:
        rv, pv = float(real[rk]), float(row[pk] if row[pk] is not None else "nan")
        diff = pv - rv
        floor = a.floor_ms if kind == "ms" else a.floor_blocks if kind == "blocks" else 0
        ok = abs(diff) <= max(floor, a.tolerance * max(abs(rv), abs(pv)))
        ok_all &= ok
        print(f"{rk:22} {rv:10.1f} {pv:10.1f} {diff:+9.1f}  {'yes' if ok else 'NO'}")
        out[rk] = {"real": rv, "plan": pv, "within": ok}
    print(
        f"tolerance: {a.tolerance:.0%} of the larger, or {a.floor_ms:g} ms for latencies: "
        + ("met" if ok_all else "NOT met")
    )
    print(json.dumps({"figures": out, "met": ok_all, "bandwidth_GBps": bw, "swap_GBps": swap}))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
