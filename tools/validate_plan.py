"""The capacity planner against a real run: the same scaled trace, the same hold times.

Runs ``pdkv-transfer-test`` locally on a trace (decode holding each request's GPU blocks for
output_length x --token-ms, prefill computing --layer-ms a layer), then ``pdkv-transfer-test
plan`` on the same trace at the same buffer and GPU pool, given the rates that real run
measured: prefill's cost per request (a fixed part plus a rate, ``prefill_fixed_ms`` and
``prefill_fit_tokens_per_s``, fitted to its requests), the link's rate over the time prefill
was writing (``link_GBps``) and the swap rate over the time swaps were in flight
(``swap_GBps``). So the comparison tests the planner's model of queueing, buffering and
swapping, not how well a separate measurement guessed the rates under load. Prints both sets
of figures side by side, whether each is within the tolerance (``--tolerance`` relative, or
``--floor-ms`` absolute for latencies, or ``--floor-requests`` for the requests queued), and
beside them the planner as an operator runs it: the link and swap rates from its own burst
on this host. Last line: one JSON object; exit status 1 when a figure is out.

    python tools/validate_plan.py                      # the shipped trace, defaults below, 3 runs
    python tools/validate_plan.py --buffer-blocks 6000  # a buffer that fills
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
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


def one_rep(a: argparse.Namespace, common: list[str], k: int) -> dict:
    """One real run; the planner given the rates that run measured (prefill's cost per
    request fitted to its requests, the link's rate over the time prefill was writing, the
    swap rate over the time swaps were in flight); and the planner as an operator runs it,
    measuring the link and swap rates itself with its burst on this host (same prefill cost)."""
    with tempfile.TemporaryDirectory(prefix="pdkv-validate-") as d:
        real = tool(
            [*common, "--buffer-blocks", str(a.buffer_blocks), "--prefill-blocks", "65536", "--concurrency", "4096"]
            + ["--no-verify", "--transport", "shm", "--no-gpu", "--timeout", "60"],
            os.path.join(d, "real.json"),
        )
        rate, fixed = real["prefill_fit_tokens_per_s"], real["prefill_fixed_ms"]
        link, swap = real["link_GBps"], real["swap_GBps"]
        if not (rate > 0 and link > 0 and swap > 0):
            raise SystemExit(f"the real run measured no rate to plan with: prefill {rate}, link {link}, swap {swap}")
        gib = a.buffer_blocks * real["layout"]["block_bytes"] / (1 << 30)
        i = common.index("--layer-ms")
        plan_common = [*common[:i], *common[i + 2 :], "--buffer-sweep", repr(gib)]
        plan_common += ["--prefill-tokens-per-s", f"{rate:.1f}", "--prefill-overhead-ms", f"{fixed:.3f}"]
        plan_common += ["--prefill-instances", "1"]  # the transfer test's prefill: one instance
        plan = tool(
            ["plan", *plan_common, "--bandwidth-gbps", f"{link:.6f}", "--swap-gbps", f"{swap:.6f}"],
            os.path.join(d, "plan.json"),
        )
        burst = tool(["plan", *plan_common], os.path.join(d, "burst.json"))

    def pick(p: dict) -> dict:
        return next(r for r in p["sweep"] if r["buffer_blocks"] == a.buffer_blocks)

    return {
        "real": real,
        "row": pick(plan),
        "burst": pick(burst),
        "link": link,
        "swap": swap,
        "burst_link": burst["config"]["bandwidth_GBps"],
        "burst_swap": burst["config"]["swap_GBps"],
        "fixed": fixed,
        "rate": rate,
    }


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
    ap.add_argument(
        "--floor-requests",
        type=int,
        default=None,
        help="difference in requests queued always allowed (default: 5%% of the requests replayed; the real "
        "runs' own spread, 3-4 of 100 at 6,000 blocks, is 25%% of the count)",
    )
    ap.add_argument("--reps", type=int, default=3, help="real runs (each with its own plan); medians compared")
    a = ap.parse_args()
    common = ["--model", a.model, "--trace", a.trace, "--trace-limit", str(a.trace_limit)]
    common += ["--time-scale", str(a.time_scale), "--token-ms", str(a.token_ms), "--layer-ms", str(a.layer_ms)]
    common += ["--gpu-blocks", str(a.gpu_blocks)]
    floor_requests = a.floor_requests if a.floor_requests is not None else math.ceil(0.05 * a.trace_limit)
    reps = [one_rep(a, common, k) for k in range(a.reps)]
    med = statistics.median
    link, swap = med(r["link"] for r in reps), med(r["swap"] for r in reps)
    blink, bswap = med(r["burst_link"] for r in reps), med(r["burst_swap"] for r in reps)
    fixed, rate = med(r["fixed"] for r in reps), med(r["rate"] for r in reps)
    print(
        f"{a.trace_limit} requests of {os.path.basename(a.trace)} x {a.time_scale} in time, {a.model}, "
        f"{a.layer_ms} ms a layer, {a.token_ms} ms a token, {a.gpu_blocks} GPU blocks, {a.buffer_blocks} buffer "
        f"blocks; {a.reps} real run(s), each with its own plans. Rates the real runs measured (medians): link "
        f"{link:.2f} GB/s, swap {swap:.2f} GB/s, prefill {fixed:.1f} ms + {rate:,.0f} tokens/s a request; the "
        f"planner's own burst on this host: link {blink:.2f} GB/s, swap {bswap:.2f} GB/s"
    )
    print(
        f"{'figure':22} {'real run':>10} {'real range':>15} {'planner':>10} {'diff':>9}  within  "
        f"{'burst rates':>11} {'burst range':>15}"
    )
    out = {}
    ok_all = True

    def value(row: dict, key: str) -> float:
        return float(row[key]) if row[key] is not None else math.nan

    for rk, pk, kind in FIGURES:
        rs = [float(r["real"][rk]) for r in reps]
        rv = med(rs)
        pv = med(value(r["row"], pk) for r in reps)
        bs = [value(r["burst"], pk) for r in reps]
        bv = med(bs)
        diff = pv - rv
        floor = a.floor_ms if kind == "ms" else a.floor_blocks if kind == "blocks" else floor_requests
        ok = abs(diff) <= max(floor, a.tolerance * max(abs(rv), abs(pv)))
        ok_all &= ok
        span, bspan = f"{min(rs):.1f}-{max(rs):.1f}", f"{min(bs):.1f}-{max(bs):.1f}"
        within = "yes" if ok else "NO"
        print(f"{rk:22} {rv:10.1f} {span:>15} {pv:10.1f} {diff:+9.1f}  {within:6}  {bv:11.1f} {bspan:>15}")
        out[rk] = {"real": rv, "real_runs": rs, "plan": pv, "within": ok, "plan_burst": bv, "plan_burst_runs": bs}
    print(
        f"tolerance: {a.tolerance:.0%} of the larger, or {a.floor_ms:g} ms for latencies, or {floor_requests} "
        "requests queued, between the medians of the real runs and of the planner given their rates: "
        + ("met" if ok_all else "NOT met")
    )
    print(
        json.dumps(
            {
                "figures": out,
                "met": ok_all,
                "reps": a.reps,
                "link_GBps": link,
                "swap_GBps": swap,
                "burst_link_GBps": blink,
                "burst_swap_GBps": bswap,
                "prefill_fixed_ms": fixed,
                "prefill_tokens_per_s": rate,
            }
        )
    )
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
