"""The capacity planner (``pdkv-transfer-test plan``): the simulation against timelines
worked out by hand, its invariants on random traces, the trace reader, the command line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from extras import need
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.cli.transfer_tool import main as tool_main
from pdkv.cli.transfer_tool.capacity import PlanConfig, prefix_savings, simulate
from pdkv.cli.transfer_tool.plan_mode import recommend, sweep_sizes
from pdkv.cli.transfer_tool.workload import TraceRequest, UsageError, read_trace
from pdkv.layout import KVLayout

TRACE = os.path.join(os.path.dirname(__file__), "data", "mooncake_synthetic_200.jsonl")

# 2 layers of 1 KiB blocks (K and V, 1 head of 8, 16 tokens, bf16): a request of 160
# tokens is 10 blocks, 10,240 bytes; at 10,240 B/s its transfer and its swap take 1 s
LAY = KVLayout(num_layers=2, kv_heads=1, head_dim=8, tokens_per_block=16, dtype="bfloat16")


def cfg(gpu_blocks: int = 10, **kw: object) -> PlanConfig:
    base: dict[str, object] = dict(
        layout=LAY,
        decode_tp=1,
        gpu_blocks=gpu_blocks,
        layer_ms=500.0,  # compute 1 s
        bandwidth=10240.0,
        swap_bandwidth=10240.0,
        token_s=0.1,  # 10 output tokens: decode holds the blocks 1 s
        direct_to_gpu=False,
    )
    base.update(kw)
    return PlanConfig(**base)  # type: ignore[arg-type]


TWO = [TraceRequest("a", 0.0, 160, 10), TraceRequest("b", 0.0, 160, 10)]


def test_no_buffer_prefill_waits_for_the_gpu_blocks():
    # a: granted 0, computed 1.0, last layer lands max(1.0 + 0.5, 0.5 + 1.0) = 1.5, ready,
    # finished 2.5. b: its server is free at 1.0, queued until a's blocks come back at 2.5
    r = simulate(TWO, cfg(), 0)
    f = r.figures()
    assert sorted(r.wait_s) == pytest.approx([0.0, 1.5])
    assert sorted(r.ttft_s) == pytest.approx([1.0, 3.5])
    assert sorted(r.decode_start_s) == pytest.approx([1.6, 4.1])
    assert (f["queued"], f["rejected"], f["completed"], f["swaps"]) == (1, 0, 2, 0)
    assert f["prefill_wait_ms_max"] == pytest.approx(1500)
    assert f["peak_gpu_blocks"] == 10 and f["peak_buffer_blocks"] == 0
    assert f["simulated_s"] == pytest.approx(5.0)


def test_a_buffer_for_one_request_frees_at_the_swap():
    # a in the buffer, received 1.5, swapped 1.5-2.5 (ready), finished 3.5; b queued from
    # 1.0 until the swap frees the buffer at 2.5, received 4.0, swapped once a finished
    # (GPU free at 3.5, b received at 4.0): 4.0-5.0
    r = simulate(TWO, cfg(), 10)
    f = r.figures()
    assert sorted(r.wait_s) == pytest.approx([0.0, 1.5])
    assert sorted(r.decode_start_s) == pytest.approx([2.6, 5.1])
    assert (f["queued"], f["swaps"], f["peak_buffer_blocks"]) == (1, 2, 10)
    assert f["peak_buffer_occupancy"] == 1.0


def test_a_buffer_for_both_removes_the_wait():
    # b granted at 1.0 (no wait); both share the link: b lands max(2.0 + 0.5, 1.5 + 1.0) = 2.5,
    # its swap waits for a to finish at 3.5: 3.5-4.5
    r = simulate(TWO, cfg(), 20)
    f = r.figures()
    assert r.wait_s == pytest.approx([0.0, 0.0])
    assert sorted(r.ttft_s) == pytest.approx([1.0, 2.0])
    assert sorted(r.decode_start_s) == pytest.approx([2.6, 4.6])
    assert (f["queued"], f["peak_buffer_blocks"], f["peak_gpu_blocks"]) == (0, 20, 10)


def test_direct_to_gpu_uses_the_buffer_only_when_the_gpu_is_full():
    # a straight into GPU blocks (ready 1.5, finished 2.5); b into the buffer at 1.0,
    # lands 2.5, swapped after a finished: 2.5-3.5
    r = simulate(TWO, cfg(direct_to_gpu=True), 10)
    f = r.figures()
    assert r.wait_s == pytest.approx([0.0, 0.0])
    assert sorted(r.decode_start_s) == pytest.approx([1.6, 3.6])
    assert (f["swaps"], f["peak_buffer_blocks"]) == (1, 10)


def test_two_prefill_instances_and_token_throughput():
    c = cfg(gpu_blocks=20, layer_ms=0.0, prefill_tokens_per_s=160.0, prefill_instances=2)
    r = simulate(TWO, c, 0)
    # both compute at once (1 s each); the link carries a then b: a lands 1.5, b at
    # max(1.0 + 0.5, 1.5 + 1.0) = 2.5
    assert r.wait_s == pytest.approx([0.0, 0.0]) and r.ttft_s == pytest.approx([1.0, 1.0])
    assert sorted(r.decode_start_s) == pytest.approx([1.6, 2.6])


def test_a_fixed_time_per_request_comes_before_the_compute():
    # 0.5 s fixed, then 160 tokens at 160/s: a computed at 1.5, its first layer at
    # 0.5 + 0.5 = 1.0, so it lands max(1.5 + 0.5, 1.0 + 1.0) = 2.0; b's server starts at
    # 1.5 (one instance), computed 3.0, lands 3.5 (the link is free from 2.0)
    c = cfg(gpu_blocks=20, layer_ms=0.0, prefill_tokens_per_s=160.0, overhead_s=0.5)
    r = simulate(TWO, c, 0)
    assert r.wait_s == pytest.approx([0.0, 0.0]) and sorted(r.ttft_s) == pytest.approx([1.5, 3.0])
    assert sorted(r.decode_start_s) == pytest.approx([2.1, 3.6])


def test_fit_prefill_recovers_a_fixed_part_and_a_rate():
    from pdkv.cli.transfer_tool.report import fit_prefill

    toks = [100, 400, 900, 1600]
    fixed, rate = fit_prefill(toks, [0.02 + t / 50_000 for t in toks])
    assert fixed == pytest.approx(0.02) and rate == pytest.approx(50_000)
    # one prompt length, or a fit with a negative fixed part: the mean rate, nothing fixed
    assert fit_prefill([200, 200], [0.01, 0.03]) == (0.0, pytest.approx(10_000))
    assert fit_prefill([100, 200], [0.001, 0.1]) == (0.0, pytest.approx(300 / 0.101))
    assert fit_prefill([], []) == (0.0, 0.0)


requests = st.lists(st.tuples(st.floats(0, 20), st.integers(1, 400), st.integers(0, 30)), min_size=1, max_size=40).map(
    lambda xs: [TraceRequest(f"r{i}", t, n, o) for i, (t, n, o) in enumerate(sorted(xs))]
)


@settings(max_examples=60, deadline=None)
@given(
    trace=requests,
    gpu=st.integers(25, 80),
    buffer=st.sampled_from([0, 25, 40, 200]),
    direct=st.booleans(),
    instances=st.integers(1, 3),
)
def test_every_request_is_served_and_the_accounting_holds(trace, gpu, buffer, direct, instances):
    c = cfg(gpu_blocks=gpu, direct_to_gpu=direct, prefill_instances=instances, layer_ms=50.0, token_s=0.01)
    r = simulate(trace, c, buffer)  # ends with the scheduler's check_invariants
    f = r.figures()
    assert f["completed"] == len(trace) and f["rejected"] == 0 and f["queue_timeouts"] == 0
    assert len(r.wait_s) == len(r.ttft_s) == len(r.decode_start_s) == len(trace)
    assert min(r.wait_s) >= 0
    for req_ttft, dstart in zip(sorted(r.ttft_s), sorted(r.decode_start_s)):
        assert dstart >= req_ttft  # decode starts after prefill computed it
    assert f["peak_buffer_blocks"] <= buffer and f["peak_gpu_blocks"] <= gpu
    if buffer == 0 or direct:
        assert f["swaps"] <= len(trace)
    else:
        assert f["swaps"] == len(trace)  # every request went through the buffer
    if not math.isnan(f["prefill_wait_ms_max"]):
        assert f["prefill_wait_ms_max"] >= f["prefill_wait_ms_p99"] >= f["prefill_wait_ms_p50"]


def test_prefix_savings_counts_leading_blocks_seen_before():
    trace = [
        TraceRequest("a", 0, 1024, 1, (1, 2)),
        TraceRequest("b", 0, 1500, 1, (1, 2, 3)),  # 2 ids of 512 seen: 1024 tokens, 64 blocks of 16
        TraceRequest("c", 0, 700, 1, (9, 2)),  # a first id not seen: nothing reused
        TraceRequest("d", 0, 512, 1, (1,)),  # all of it seen, but one block is always received
    ]
    p = prefix_savings(trace, 16)
    assert p["blocks_total"] == 64 + 94 + 44 + 32
    assert p["blocks_not_transferred"] == 64 + 31
    assert p["requests_with_hash_ids"] == 4


def test_read_trace_checks_every_line(tmp_path):
    t = read_trace(TRACE, limit=10, time_scale=0.5)
    assert len(t) == 10 and t[0].rid == "t0" and t[2].arrival == pytest.approx(0.040 * 0.5)
    assert len(t[0].hash_ids) == 79
    for body, why in (
        ('{"timestamp": 0, "input_length": 10}\nnot json\n', "line 2: not a trace record"),
        ('{"timestamp": 0}\n', "line 1: not a trace record"),
        ('{"timestamp": -1, "input_length": 10}\n', "line 1: needs timestamp >= 0"),
        ('{"timestamp": 0, "input_length": 0}\n', "input_length > 0"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1.5}\n', "output_length >= 0"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": ["x"]}\n', "hash_ids"),
        ("\n\n", "no requests"),
    ):
        p = tmp_path / "t.jsonl"
        p.write_text(body)
        with pytest.raises(UsageError, match=why):
            read_trace(str(p))
    with pytest.raises(UsageError, match="No such file"):
        read_trace(str(tmp_path / "missing.jsonl"))


def test_sweep_sizes_and_recommendation():
    assert sweep_sizes(None, LAY, 100, 30) == [0, 30, 60, 120, 240, 400]
    assert sweep_sizes("0,0.5", LAY, 100) == [0, LAY.blocks_for_bytes(1 << 29)]
    for bad in ("x", "-1", "nan", ""):
        if bad:
            with pytest.raises(UsageError, match="--buffer-sweep"):
                sweep_sizes(bad, LAY, 100)
    row = dict(requests=2, completed=2, rejected=0, queue_timeouts=0, prefill_wait_ms_p99=0.0, ttft_ms_p99=5.0)
    rows = [dict(row, prefill_wait_ms_p99=9.0, buffer_blocks=0), dict(row, buffer_blocks=5), dict(row, buffer_blocks=9)]
    assert recommend(rows, 0.0, None)["buffer_blocks"] == 5
    assert recommend(rows, 10.0, None)["buffer_blocks"] == 0
    assert recommend(rows, 0.0, 1.0) is None
    assert recommend([dict(row, buffer_blocks=1, rejected=1)], 0.0, None) is None


def test_plan_on_the_shipped_trace(tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = ["plan", "--trace", TRACE, "--bandwidth-gbps", "25", "--swap-gbps", "50", "--gpu-gib", "24"]
    argv += ["--prefill-instances", "3", "--json", str(out)]
    assert tool_main(argv) == 0
    text = capsys.readouterr().out
    last = json.loads(text.strip().splitlines()[-1])  # the JSON line comes last
    assert last == json.loads(out.read_text())
    rows = last["sweep"]
    assert rows[0]["buffer_blocks"] == 0 and len(rows) >= 3
    assert all(r["completed"] == 200 for r in rows)
    # without a buffer prefill waits; the recommended buffer removes the wait at p99
    assert rows[0]["prefill_wait_ms_p99"] > 0
    best = [r for r in rows if r["buffer_blocks"] == last["recommended_buffer_blocks"]][0]
    assert best["prefill_wait_ms_p99"] == 0 and best["ttft_ms_p99"] < rows[0]["ttft_ms_p99"]
    assert "recommendation:" in text and "prefix reuse" in text and "what the decode buffer buys" in text
    assert last["prefix_reuse"]["blocks_not_transferred"] > 0


def test_plan_plot_on_the_shipped_trace(tmp_path):
    need("matplotlib", "plot")
    png, html = tmp_path / "p.png", tmp_path / "p.html"
    argv = ["plan", "--trace", TRACE, "--bandwidth-gbps", "25", "--swap-gbps", "50", "--gpu-gib", "24"]
    argv += ["--prefill-instances", "3"]
    assert tool_main([*argv, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tool_main([*argv, "--plot", str(html)]) == 0
    assert "<svg" in html.read_text()


@pytest.mark.parametrize(
    "extra, why",
    [
        ([], "plan needs --trace FILE"),
        (["--trace", TRACE, "--gpu-gib", "0"], "--gpu-gib must be a positive number"),
        (["--trace", TRACE, "--bandwidth-gbps", "-1"], "--bandwidth-gbps: '-1' is not a rate"),
        # units no one can mistake: a NIC's gigabits typed bare, zero, a unit that is neither
        (["--trace", TRACE, "--bandwidth-gbps", "200"], "for a rating in gigabits write 200Gb/s (25 GB/s)"),
        (["--trace", TRACE, "--bandwidth-gbps", "0"], "must be a positive rate (leave the flag out to measure"),
        (["--trace", TRACE, "--bandwidth-gbps", "25gbps"], "the unit 'gbps' is not one of GB/s"),
        (["--trace", TRACE, "--bandwidth-gbps", "9000GB/s"], "above any link there is (400 GB/s)"),
        (["--trace", TRACE, "--swap-gbps", "nan"], "--swap-gbps: 'nan' is not a rate"),
        (["--trace", TRACE, "--gpu-gib", "1e9"], "--gpu-gib 1e+09 is more KV cache than any GPU holds"),
        (["--trace", TRACE, "--gpu-blocks", "1000000000"], "more KV cache than any GPU holds"),
        (["--trace", TRACE, "--time-scale", "nan"], "--time-scale nan must be a positive number"),
        (["--trace", TRACE, "--time-scale", "inf"], "--time-scale inf must be a positive number"),
        # flags plan does not read are refused by name, not ignored
        (["--trace", TRACE, "--buffer-gib", "100000"], "--buffer-gib does not apply to plan mode"),
        (["--trace", TRACE, "--requests", "5"], "--requests does not apply to plan mode"),
        (["--trace", TRACE, "--no-verify"], "--no-verify does not apply to plan mode"),
        (["--trace", TRACE, "--metrics-port", "0"], "--metrics-port does not apply to plan mode"),
        (["--trace", TRACE, "--prefill-overhead-ms", "-1"], "--prefill-overhead-ms must be >= 0"),
        (["--trace", TRACE, "--prefill-instances", "0"], "--prefill-instances must be positive"),
        (["--trace", TRACE, "--target-ttft-ms", "nan"], "--target-ttft-ms"),
        (["--trace", TRACE, "--gpu-gib", "1", "--bandwidth-gbps", "1", "--swap-gbps", "1"], "raise --gpu-gib"),
    ],
)
def test_plan_bad_arguments(extra, why, capsys):
    assert tool_main(["plan", *extra]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err


def test_plan_measures_the_bandwidth_when_not_given(tmp_path):
    out = tmp_path / "p.json"
    p = subprocess.run(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", "plan", "--trace", TRACE, "--model", "tiny", "--trace-limit"]
        + ["50", "--gpu-gib", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    c = json.loads(out.read_text())["config"]
    assert c["bandwidth_measured"] and c["bandwidth_GBps"] > 0 and c["swap_GBps"] > 0
    # the median of three runs of this host's loopback, the spread said, not taken for a real link
    assert len(c["bandwidth_runs_GBps"]) == 3 and sorted(c["bandwidth_runs_GBps"])[1] == pytest.approx(
        c["bandwidth_GBps"], rel=0.01
    )
    text = " ".join(p.stdout.split())
    assert "measured here: this host's loopback, the median of 3 runs, link" in text
    assert "not a production link: give --bandwidth-gbps and --swap-gbps for yours" in text


@pytest.mark.parametrize("link, swap", [(0.0, 3.0), (2.0, 0.0)])
def test_a_measured_rate_of_zero_is_a_usage_error(link, swap, monkeypatch):
    """A burst that measured no link or no swap rate must not reach the simulation, which
    divides by both: the operator is told to give the rates."""
    import types

    from pdkv.cli.transfer_tool.plan_mode import measure_rates
    from pdkv.cli.transfer_tool.workload import UsageError

    class FakeRun:  # the measuring run, as Popen: it writes its report and ends
        def __init__(self, argv, **kw):
            with open(argv[argv.index("--json") + 1], "w") as f:
                json.dump({"link_GBps": link, "swap_GBps": swap}, f)
            self.returncode = 0

        def communicate(self, timeout=None):
            return "", ""

    monkeypatch.setattr(subprocess, "Popen", FakeRun)
    a = types.SimpleNamespace(
        model="tiny", decode_tp=1, layers=None, kv_heads=None, head_dim=None, tokens_per_block=None, dtype=None
    )
    console = types.SimpleNamespace(print=lambda *x, **k: None)
    with pytest.raises(UsageError, match=r"gave no rate .*give --bandwidth-gbps and --swap-gbps"):
        measure_rates(a, console)


def test_an_interrupted_plan_reports_the_sizes_done(monkeypatch, capsys):
    """Ctrl-C during the sweep (the README: Ctrl-C prints what was done): the sizes simulated
    so far are reported, rc 130."""
    from pdkv.cli.transfer_tool import plan_mode

    real, calls = plan_mode.simulate, []

    def simulate(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(plan_mode, "simulate", simulate)
    argv = ["plan", "--trace", TRACE, "--bandwidth-gbps", "25", "--swap-gbps", "50", "--gpu-gib", "24"]
    assert tool_main(argv) == 130
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["interrupted"] and len(last["sweep"]) == 2 and "interrupted" in out


def test_capacity_sized_from_the_trace_when_not_given():
    """Without --prefill-instances and --gpu-gib the planner runs the trace at 80 % of what
    its load needs (Little's law over its span), and says so; a trace of one moment has no
    load to size from: refused, naming the flags."""
    from pdkv.cli.transfer_tool.plan_mode import size_from_trace

    # 10 requests over 9 s, each 1 s of compute (layer_ms 500 x 2 layers) and 10 blocks held 1 s
    trace = [TraceRequest(f"r{i}", float(i), 160, 10) for i in range(10)]
    c = cfg(gpu_blocks=1)
    n, g, lines = size_from_trace(trace, c, None, None)
    # prefill: a request a second, 1 s each: 1 instance busy -> /0.8 -> 2; decode: 10 blocks held
    # at any time -> 12.5 -> 13, rounded up to a whole GiB (1,048,576 of these 1 KiB blocks)
    assert n == 2 and g == LAY.blocks_for_bytes(1 << 30)
    assert "2 instance(s), from the trace (over its 9 s its prompts keep 1.00 instances busy" in lines[0]
    assert "hold 10 blocks on average" in lines[1] and "--gpu-gib" in lines[1]
    assert size_from_trace(trace, c, 3, 40) == (3, 40, [])  # given: used as they are, nothing said
    with pytest.raises(UsageError, match="no load to size from; set --prefill-instances and --gpu-gib"):
        size_from_trace(TWO, c, None, None)
    assert size_from_trace(TWO, c, 1, 20)[:2] == (1, 20)


def test_busiest_window_of_a_load():
    """The sizing looks at the busiest minute, not the mean: a burst of 60 one-second
    requests in 10 s, then one a minute, needs 6 servers' worth in its busiest 60 s."""
    import numpy as np

    from pdkv.cli.transfer_tool.plan_mode import busiest

    starts = np.array([i / 6 for i in range(60)] + [60.0 * k for k in range(2, 10)])
    w = np.ones(len(starts))
    assert busiest(starts, starts + 1, w, 60) == pytest.approx(1.0, abs=0.05)  # 60 s of work in a minute
    assert busiest(starts, starts + 1, w, 10) == pytest.approx(6.0, abs=0.3)
    assert busiest(starts, starts + 1, w, 600) == pytest.approx(68 / 600, abs=0.02)
    # weights are held over [start, end): 3 blocks for 100 s, 7 for the last 50 of them
    assert busiest(np.array([0.0, 50.0]), np.array([100.0, 100.0]), np.array([3.0, 7.0]), 50) == 10.0


def _row(gib, blocks, wait99, ttft50, ttft99, **kw):
    r = dict(
        buffer_gib=gib,
        buffer_blocks=blocks,
        requests=10,
        completed=10,
        rejected=0,
        queue_timeouts=0,
        queued=0,
        swaps=0,
        peak_buffer_occupancy=0.5,
        prefill_wait_ms_p99=wait99,
        ttft_ms_p50=ttft50,
        ttft_ms_p99=ttft99,
    )
    r.update(kw)
    return r


def test_advice_states_the_target_the_difference_and_why_a_buffer_is_worse_than_none(monkeypatch):
    from pdkv.cli.transfer_tool import plan_mode

    alt = dict(prefill_wait_ms_p99=7.0, ttft_ms_p50=40.0, ttft_ms_p99=90.0)
    seen = []

    def fake_simulate(trace, c, nb):
        seen.append((c.gpu_blocks, nb))
        return type("R", (), {"figures": lambda self: alt})()

    monkeypatch.setattr(plan_mode, "simulate", fake_simulate)
    c = cfg(gpu_blocks=10)
    rows = [
        _row(0.0, 0, 1000.0, 50.0, 2000.0, queued=4),
        _row(0.5, 5, 1200.0, 80.0, 2500.0, queued=7, peak_buffer_occupancy=1.0),  # fewer blocks than the GPU
        _row(1.0, 10, 90.0, 45.0, 300.0),
        _row(2.0, 20, 0.0, 45.0, 300.0),
    ]
    rec = plan_mode.advise([], c, rows, None, 0.1, None)
    text = "\n".join(rec["lines"])
    # the default target: a tenth of the no-buffer p99 wait; the smallest row meeting it
    assert rec["target_wait_ms"] == 100.0 and rec["buffer_blocks"] == 10
    assert "p99 prefill wait <= 100 ms (0.1 x the 1000 ms without a buffer)" in text
    assert "p99 prefill wait 1000 -> 90 ms, TTFT p50 50 -> 45 ms, p99 2000 -> 300 ms" in text
    assert "no GPU memory" in text
    # the same memory as GPU blocks instead: one more simulation, no buffer, 10 + 10 blocks
    assert seen == [(20, 0)] and rec["same_memory_as_gpu"]["prefill_wait_ms_p99"] == 7.0
    assert "as GPU KV cache instead" in text and "p99 prefill wait 7 ms" in text
    # the buffer smaller than the GPU pool, every transfer through it: worse, and why
    assert rec["worse_than_none"] == [5]
    assert "0.5 GiB does worse than no buffer (wait p99 1200 vs 1000 ms, ttft p50 80 vs 50 ms, ttft p99" in text
    assert "holds its buffer blocks from its grant, through prefill's compute and the transfer, to its swap" in text
    assert "5 blocks keep fewer requests in flight than decode's 10 GPU blocks" in text
    assert "It was full (peak 100%) and 7 requests queued for its room while GPU blocks were free" in text
    # an absolute target; none meeting it: said, with the largest size's figures
    rec = plan_mode.advise([], c, rows, 0.0, 0.1, 100.0)
    assert rec["best"] is None and "no buffer in the sweep meets p99 prefill wait <= 0 ms and p99 TTFT <= 100 ms" in (
        "\n".join(rec["lines"])
    )
    # no wait without a buffer: the recommendation is none, and says why
    calm = [_row(0.0, 0, 0.0, 50.0, 90.0), _row(1.0, 10, 0.0, 50.0, 90.0)]
    rec = plan_mode.advise([], c, calm, None, 0.1, None)
    assert rec["best"]["buffer_blocks"] == 0 and rec["lines"][-1].startswith("recommendation: no buffer")


def test_plan_with_its_defaults_recommends_on_the_shipped_trace(tmp_path, capsys):
    """No capacity flags, no target: sized from the trace, a recommendation with its
    with/without figures; the plot marks the target and the recommended size."""
    argv = ["plan", "--trace", TRACE, "--bandwidth-gbps", "25", "--swap-gbps", "50"]
    plot = []
    if _have_matplotlib():  # the plot is checked where pdkv[plot] is installed
        plot = ["--plot", str(tmp_path / "p.html")]
    assert tool_main([*argv, *plot]) == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert "from the trace" in out and last["recommended_buffer_blocks"]
    rec = last["recommendation"]
    assert rec["with"]["prefill_wait_ms_p99"] <= rec["target_wait_ms"] < rec["without"]["prefill_wait_ms_p99"]
    assert "Without -> with it" in out and "as GPU KV cache instead" in out
    if plot:
        svg = (tmp_path / "p.html").read_text()
        assert f"recommended {last['recommended_buffer_gib']:.1f} GiB" in svg and "target p99" in svg


def _have_matplotlib():
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


# ---- exact timelines of the paths the tests above do not take: rejections freeing their
# server, queue time-outs freeing theirs, a fixed part before the layers, a compute-bound
# last layer; the figures' arithmetic; prefix savings worked out by hand


def test_rejected_reservations_free_their_server_at_once():
    # 3 servers, a GPU pool of exactly a's 30 blocks, no queue. a: granted 0, computed 1.0,
    # 30 KiB at 10 KiB/s from its first layer (0.5) lands at 3.5, ready, done at 4.5. b and c
    # are rejected at 0 and their servers are free again: d, e, f (10 blocks each, at 10)
    # start together at 10 and share the link: 11.5, 12.5, 13.5
    trace = [TraceRequest("a", 0.0, 480, 10), TraceRequest("b", 0.0, 160, 10), TraceRequest("c", 0.0, 160, 10)]
    trace += [TraceRequest(x, 10.0, 160, 10) for x in "def"]
    r = simulate(trace, cfg(30, prefill_instances=3, max_queue=0, direct_to_gpu=True), 0)
    assert (r.rejected, r.queued, r.completed, r.queue_timeouts) == (2, 0, 4, 0)
    assert r.wait_s == [0.0, 0.0, 0.0, 0.0] and r.ttft_s == [1.0, 1.0, 1.0, 1.0]
    assert r.decode_start_s == pytest.approx([3.6, 1.6, 2.6, 3.6])
    assert r.sim_end_s == pytest.approx(14.5) and r.peak_gpu_blocks == 30


def test_a_queue_timeout_frees_the_server_that_waited():
    # 2 servers, GPU room for one request, reservations queue at most 0.25 s. b queues at 0
    # and is timed out at the next event (c's arrival, 0.5): its server takes c, which queues
    # in turn and is timed out at a's next event (computed, 1.0)
    trace = [TraceRequest("a", 0.0, 160, 10), TraceRequest("b", 0.0, 160, 10), TraceRequest("c", 0.5, 160, 10)]
    r = simulate(trace, cfg(10, prefill_instances=2, queue_timeout_s=0.25, direct_to_gpu=True), 0)
    assert (r.queued, r.queue_timeouts, r.completed, r.rejected) == (2, 2, 1, 0)
    assert r.wait_s == [0.0] and r.ttft_s == [1.0]


def test_the_fixed_part_comes_before_the_first_layer_and_a_slow_compute_bounds_the_last():
    # overhead 0.5 s + 2 layers of 0.5 s: computed at 1.5, the first layer at 0.5 + 1.0 / 2 =
    # 1.0; 20 KiB at 10 KiB/s from there: received at 3.0 (the link, not the compute, bounds it)
    r = simulate([TraceRequest("a", 0.0, 320, 1)], cfg(20, overhead_s=0.5, direct_to_gpu=True), 0)
    assert r.ttft_s == [1.5] and r.decode_start_s == pytest.approx([3.1])
    # a fast link: the last layer leaves when computed (1.0) and takes half of 0.1 s: 1.05
    r = simulate([TraceRequest("a", 0.0, 160, 1)], cfg(10, bandwidth=102400.0, direct_to_gpu=True), 0)
    assert r.decode_start_s == pytest.approx([1.15])


def test_a_request_larger_than_every_pool_names_the_trace_request():
    with pytest.raises(UsageError, match=r"^trace request big \(1600 tokens\): .*100 blocks"):
        simulate([TraceRequest("big", 0.0, 1600, 1)], cfg(10), 0)


def test_result_figures_exactly():
    from pdkv.cli.transfer_tool.capacity import Result

    r = Result(512, 3 << 29, 5, 4, 1, 2, 1, wait_s=[0.0, 0.1, 0.2, 0.3, 1.0], ttft_s=[1.0, 2.0, 3.0],
               decode_start_s=[2.0, 4.0], peak_buffer_blocks=128, peak_gpu_blocks=7, swaps=3,
               sim_end_s=9.5)  # fmt: skip
    f = r.figures()
    assert f == {
        "buffer_gib": 1.5, "buffer_blocks": 512, "requests": 5, "completed": 4, "rejected": 1, "queued": 2,
        "queue_timeouts": 1, "prefill_wait_ms_p50": pytest.approx(200.0), "prefill_wait_ms_p99": pytest.approx(972.0),
        "prefill_wait_ms_max": 1000.0, "ttft_ms_p50": 2000.0, "ttft_ms_p99": pytest.approx(2980.0),
        "decode_start_ms_p50": 3000.0, "decode_start_ms_p99": pytest.approx(3980.0), "peak_buffer_blocks": 128,
        "peak_buffer_occupancy": 0.25, "peak_gpu_blocks": 7, "swaps": 3, "simulated_s": 9.5,
    }  # fmt: skip
    empty = Result(0, 0, 0, 0, 0, 0, 0).figures()
    assert empty["peak_buffer_occupancy"] == 0.0 and empty["buffer_gib"] == 0.0
    for k in ("prefill_wait_ms_p50", "prefill_wait_ms_p99", "prefill_wait_ms_max", "ttft_ms_p50", "ttft_ms_p99",
              "decode_start_ms_p50", "decode_start_ms_p99"):  # fmt: skip
        assert math.isnan(empty[k]), k


def test_compute_desc_in_words():
    assert cfg().compute_desc() == "500 ms a layer"
    assert cfg(layer_ms=0.0, prefill_tokens_per_s=20000.0).compute_desc() == "20,000 tokens/s"
    assert cfg(overhead_s=0.0125).compute_desc() == "500 ms a layer + 12.5 ms a request"


def test_prefix_savings_worked_by_hand():
    # 300 tokens a layout block, 512 a trace hash id. r1: nothing seen. r2: [1, 2] seen, 1024
    # tokens: 3 blocks of its 6. r3: [1] seen, 512 tokens: 1 block of 3. r4: no ids, 1 block
    trace = [
        TraceRequest("r1", 0.0, 1536, 1, (1, 2, 3)),
        TraceRequest("r2", 1.0, 1536, 1, (1, 2, 9)),
        TraceRequest("r3", 2.0, 700, 1, (1, 7)),
        TraceRequest("r4", 3.0, 100, 1),
    ]
    assert prefix_savings(trace, 300) == {
        "requests_with_hash_ids": 3, "blocks_total": 16, "blocks_not_transferred": 4, "fraction_not_transferred": 0.25,
    }  # fmt: skip
    assert prefix_savings([], 300)["fraction_not_transferred"] == 0.0


def _cfg(**kw):
    from pdkv.cli.transfer_tool.capacity import PlanConfig

    lay = KVLayout(num_layers=32, kv_heads=8, head_dim=128, tokens_per_block=16)  # 2 MiB a block
    base = dict(layout=lay, decode_tp=1, gpu_blocks=1000, prefill_tokens_per_s=1e9, token_s=0.0)
    base.update(kw)
    return PlanConfig(**base)


def _trace(arrivals, tokens=1600, out=1):
    from pdkv.cli.transfer_tool.workload import TraceRequest

    return [TraceRequest(f"t{i}", t, tokens, out) for i, t in enumerate(arrivals)]


def test_the_planner_names_a_link_that_saturates_and_the_rate_that_would_not():
    """One request a second of 100 blocks (200 MiB, 0.21 GB/s) for an hour: a 0.1 GB/s link
    saturates on average (2.1x) and the line says which rate would carry it at 80 %; a
    1 GB/s link says nothing; a one-minute burst of ten a second over that hour saturates
    a 1 GB/s link in its busiest window only."""
    from pdkv.cli.transfer_tool.plan_mode import load_warnings

    steady = _trace(np.arange(3600.0))
    lines = load_warnings(steady, _cfg(bandwidth=0.1e9))
    link = [ln for ln in lines if "link saturates" in ln]
    assert len(link) == 1 and "0.21 GB/s of KV on average" in link[0] and "(2.1x)" in link[0], lines
    assert "a link of about 0.3 GB/s" in link[0] and "no buffer size shortens it" in link[0]
    assert not [ln for ln in load_warnings(steady, _cfg(bandwidth=1e9)) if "link" in ln]
    burst = _trace(np.concatenate([np.arange(0, 60, 0.1), [3600.0]]))
    lines = load_warnings(burst, _cfg(bandwidth=1e9))
    assert len(lines) == 1 and lines[0].startswith("the link saturates in bursts: in the trace's busiest 60 s"), lines
    assert "2.10 GB/s" in lines[0]


def test_decode_overload_is_judged_in_the_busiest_window_not_the_whole_trace():
    """A minute where requests hold 3,000 blocks for 10 s each (the pool has 1,000), in an
    otherwise idle hour: the whole-trace average is below the pool, the busiest window is
    not, and the line says so."""
    from pdkv.cli.transfer_tool.plan_mode import load_warnings

    trace = _trace(np.concatenate([np.arange(0, 60, 1 / 3), [3600.0]]), out=1000)  # 10 s held each
    lines = load_warnings(trace, _cfg(token_s=0.01, bandwidth=100e9))
    assert len(lines) == 1 and lines[0].startswith("decode is overloaded: in the trace's busiest 60 s"), lines


def test_plan_on_a_trace_its_link_cannot_carry_names_the_link_not_the_buffer(capsys):
    """The shipped trace over a link far too slow for it: the plan says the link saturates,
    by how much and the rate that would carry it, and its advice names the link instead of
    larger buffers or more GPU memory."""
    argv = ["plan", "--trace", TRACE, "--bandwidth-gbps", "0.05", "--swap-gbps", "50", "--gpu-gib", "24"]
    assert tool_main([*argv, "--prefill-instances", "3", "--buffer-sweep", "0,1"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich folds long lines
    assert "the link saturates: the trace needs" in out and "no buffer size shortens it: a link of about" in out
    assert "more decode GPU memory" not in out


def test_a_recommendation_says_if_it_fills_what_decode_sees_and_if_its_alternative_fits_a_gpu(monkeypatch):
    """The recommended size that itself fills is said to; decode's first step is reported
    beside TTFT; the same memory as GPU KV cache is marked infeasible past one GPU's memory."""
    from pdkv.cli.transfer_tool import plan_mode

    alt = dict(prefill_wait_ms_p99=7.0, ttft_ms_p50=40.0, ttft_ms_p99=90.0)
    monkeypatch.setattr(plan_mode, "simulate", lambda t, c, nb: type("R", (), {"figures": lambda self: alt})())
    lay = KVLayout(num_layers=32, kv_heads=8, head_dim=128, tokens_per_block=16)  # 2 MiB a block
    c = PlanConfig(layout=lay, decode_tp=1, gpu_blocks=60_000)  # 117 GiB of GPU KV cache a rank
    start = dict(decode_start_ms_p50=5544.0, decode_start_ms_p99=9000.0)
    rows = [
        _row(0.0, 0, 1000.0, 50.0, 2000.0, **start),
        _row(61.6, 31_540, 0.0, 45.0, 300.0, queued=41, peak_buffer_occupancy=1.0,
             decode_start_ms_p50=5707.0, decode_start_ms_p99=8800.0),
    ]  # fmt: skip
    text = " ".join(plan_mode.advise([], c, rows, None, 0.1, None)["lines"])
    assert "decode's first step (the request's start at decode), without -> with it: p50 5544 -> 5707 ms" in text
    assert "the recommended size itself fills: peak 100%, 41 requests queued for its room" in text
    assert "not feasible on one GPU: 179 GiB of KV cache a rank is more than an H200's 141 GiB" in text


@pytest.mark.parametrize(
    "text, gbs",
    [("5", 5.0), ("3.1GB/s", 3.1), ("25Gb/s", 3.125), ("400Gbit/s", 50.0), ("2GiB/s", 2 * 1.073741824)]
    + [("800MB/s", 0.8), ("512MiB/s", 0.536870912), ("64", 64.0), ("100GB/s", 100.0)],
)
def test_plan_rates_take_their_unit_and_a_bare_number_is_gigabytes(text, gbs):
    from pdkv.cli.transfer_tool.checks import _link_rate

    assert _link_rate(text) == pytest.approx(gbs)


def test_plan_help_lists_only_the_flags_plan_reads(capsys):
    """Every flag `plan --help` shows is one plan reads (the rest are refused, above); the
    transfer test's own flags are absent, plan's are all there."""
    from pdkv.cli.transfer_tool.checks import _PLAN_READS

    with pytest.raises(SystemExit):
        tool_main(["plan", "--help"])
    out = capsys.readouterr().out
    import re

    # option lines start with two spaces and the flag: "  --gpu-gib GPU_GIB     decode GPU ..."
    shown = {f for m in re.finditer(r"^  (-\S.*?)(?:\s{2,}|$)", out, re.M) for f in re.findall(r"--?[a-z][\w-]*", m[1])}
    assert shown and shown <= _PLAN_READS, shown - _PLAN_READS
    for absent in ("--requests", "--rate", "--buffer-gib", "--no-verify", "--metrics-port", "--listen", "--seed"):
        assert absent not in shown, absent
    for present in ("--trace", "--gpu-gib", "--bandwidth-gbps", "--swap-gbps", "--token-ms", "--decode-tp"):
        assert present in shown, present


@pytest.mark.parametrize(
    "record, why",
    [
        ({"input_length": 100_000_000_000, "output_length": 1}, "line 3: 100000000000 + 1 tokens is more than any"),
        ({"input_length": 1_000_000_000, "output_length": 1}, "line 3: 1000000000 + 1 tokens is more than any"),
        # fits a context, not a GPU: the plan stops naming the line (the outlier rule)
        ({"input_length": 9_000_000, "output_length": 1}, "trace line 3: 9,000,000 tokens need 1,099 GiB of KV"),
    ],
)
def test_plan_names_a_trace_outlier_by_its_line_and_stops(tmp_path, record, why, capsys):
    rows = [{"timestamp": t, "input_length": 512, "output_length": 8, "hash_ids": []} for t in (0, 500)]
    rows.insert(2, {"timestamp": 800, "hash_ids": [], **record})
    rows.append({"timestamp": 1000, "input_length": 512, "output_length": 8, "hash_ids": []})
    path = tmp_path / "outlier.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = tool_main(["plan", "--trace", str(path), "--bandwidth-gbps", "5", "--swap-gbps", "20"])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, why",
    [
        (["decode", "--listen", "tcp://127.0.0.1:0", "--data-host", "no-such-host.invalid"], "--data-host: 'no-such"),
        (["decode", "--listen", "tcp://127.0.0.1:0", "--data-host", "999.1.1.1"], "--data-host: '999.1.1.1' is not"),
        (["prefill", "--connect", "tcp://no-such-host.invalid:5555"], "--connect: 'no-such-host.invalid' is not an"),
        (["prefill", "--connect", "tcp://:5555"], "--connect tcp://:5555: expected tcp://HOST:PORT"),
        (["local", "--buffer-gib", "nan"], "--buffer-gib nan must be a positive number"),
        (["local", "--buffer-gib", "inf"], "--buffer-gib inf must be a positive number"),
        (["local", "--timeout", "inf"], "--timeout inf must be a positive number"),
    ],
)
def test_the_tools_bad_inputs_end_in_one_line_and_exit_2(argv, why, capsys):
    """Names that do not resolve and numbers that are not numbers: one line, exit 2, at once
    (before anything binds, connects or allocates)."""
    import time

    t0 = time.monotonic()
    assert tool_main(argv) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - t0 < 5


def test_plan_verdict_holds_while_the_measured_link_moves_within_its_spread(monkeypatch, capsys):
    """The planner run five times with its defaults (rates measured here) on a trace whose KV
    need sits within the measured link's spread: the same first line five times, and it
    says marginal; measured well above or below the need, the verdict is not marginal."""
    from pdkv.cli.transfer_tool import plan_mode

    trace = read_trace(TRACE)
    lay = KVLayout(num_layers=32, kv_heads=8, head_dim=128, tokens_per_block=64, dtype="bf16")
    span = max(r.arrival for r in trace) - min(r.arrival for r in trace)
    need = sum(lay.blocks_for_tokens(r.input_tokens) for r in trace) * lay.block_bytes / span / 1e9
    rng = np.random.default_rng(7)

    def measured(lo: float, hi: float):
        def fake(a, console):
            links = sorted(float(x) for x in rng.uniform(lo, hi, 3))
            return links[1] * 1e9, 20e9, links, [20.0, 20.0, 20.0]

        return fake

    def first_lines(lo: float, hi: float, n: int) -> list[str]:
        monkeypatch.setattr(plan_mode, "measure_rates", measured(lo, hi))
        out = []
        for _ in range(n):
            assert tool_main(["plan", "--trace", TRACE]) == 0
            out.append(capsys.readouterr().out.splitlines()[0])
        return out

    lines = first_lines(0.75 * need, 1.25 * need, 5)  # each run's median on either side of the need
    assert len(set(lines)) == 1 and lines[0].startswith("verdict: marginal."), lines
    assert f"{need:.2f} GB/s of KV on average" in lines[0]
    assert not first_lines(3 * need, 3.5 * need, 1)[0].startswith("verdict: marginal")
    assert first_lines(0.2 * need, 0.3 * need, 1)[0].startswith("verdict: the link saturates")


def test_a_second_interrupt_still_waits_for_the_measuring_child(monkeypatch, tmp_path):
    """Ctrl-C twice during plan's measurement: the second one does not cut the wait short;
    the child gets its SIGINT, is waited for (bounded) and what it made in /dev/shm goes."""
    import signal

    from pdkv.cli.transfer_tool import measure

    class Child:
        pid = 999_999_999
        returncode = None

        def __init__(self):
            self.signals, self.calls = [], 0

        def poll(self):
            return self.returncode

        def send_signal(self, sig):
            self.signals.append(sig)

        def kill(self):
            self.signals.append(signal.SIGKILL)

        def communicate(self, timeout=None):
            self.calls += 1
            if self.calls == 1:
                raise KeyboardInterrupt  # the user's second Ctrl-C, while the child cleans up
            self.returncode = 0  # then it ends by itself
            return "", ""

    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / f"pdkv-{Child.pid}-seg").write_bytes(b"x")
    (shm / "pdkv-1-other").write_bytes(b"x")
    monkeypatch.setattr("pdkv.buffer.sweeper.SHM_DIR", str(shm))
    child = Child()
    measure._stop_child(child)
    assert child.signals == [signal.SIGINT] and child.calls >= 2 and child.returncode == 0  # not killed
    assert sorted(p.name for p in shm.iterdir()) == ["pdkv-1-other"]


def test_the_measuring_run_is_sized_to_the_memory_free_here(monkeypatch):
    """About 2 GiB of KV where memory allows, a quarter of what is free where it does not,
    and a clear refusal (give the rates) where even that is too little."""
    import argparse
    import subprocess as sp

    from pdkv.cli.transfer_tool import measure

    a = argparse.Namespace(model="llama3-8b", decode_tp=1, layers=None, kv_heads=None, head_dim=None)
    a.tokens_per_block, a.dtype = None, None
    seen = []

    class Stop(Exception):
        pass

    def popen(argv, **kw):
        seen.append(int(argv[argv.index("--prompt-len") + 1]))
        raise Stop

    class Quiet:
        def print(self, *args):
            pass

    monkeypatch.setattr(sp, "Popen", popen)
    for free in (64 << 30, 2 << 30):
        monkeypatch.setattr(measure, "_free_memory", lambda free=free: free)
        with pytest.raises(Stop):
            measure.measure_once(a, Quiet())
    assert seen == [1024, 256]  # 16 requests of 128 KiB a token: 2 GiB, then 512 MiB's floor of 256 tokens
    monkeypatch.setattr(measure, "_free_memory", lambda: 256 << 20)
    with pytest.raises(UsageError, match="needs about 0.5 GiB of free memory, 0.25 GiB is free here; give"):
        measure.measure_once(a, Quiet())


@pytest.mark.parametrize("mode", ["local", "decode", "prefill", "plan", "sweep"])
def test_each_modes_help_lists_only_flags_that_mode_accepts(mode, capsys):
    """Every flag `MODE --help` shows is one that mode reads: none of them is refused as
    another mode's (decode's help has no --connect, prefill's no --listen)."""
    import re

    from pdkv.cli.transfer_tool.checks import _MODES_OF

    with pytest.raises(SystemExit):
        tool_main([mode, "--help"])
    out = capsys.readouterr().out
    shown = {f for m in re.finditer(r"^  (-\S.*?)(?:\s{2,}|$)", out, re.M) for f in re.findall(r"--?[a-z][\w-]*", m[1])}
    assert shown
    other = sorted(f for f in shown if mode not in _MODES_OF.get(f, (mode,)))
    assert other == [], other
