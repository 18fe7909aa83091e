"""The transfer tool in CI: local mode with small sizes, asserting on its JSON output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from extras import need

TRACE = os.path.join(os.path.dirname(__file__), "data", "mooncake_synthetic_200.jsonl")  # ships with the tests
SMALL = [
    "--model",
    "tiny",
    "--requests",
    "10",
    "--prompt-len",
    "uniform:20:200",
    "--buffer-blocks",
    "24",
    "--gpu-blocks",
    "16",
    "--timeout",
    "10",
]


def run(args, tmp_path, timeout=120):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    rep = json.loads(out.read_text()) if out.exists() else None
    return p, rep


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "extra",
    [
        ["--transport", "shm"],
        ["--transport", "tcp"],
        ["--transport", "tcp", "--prefill-tp", "2", "--decode-tp", "4", "--streams", "2"],
        ["--transport", "shm", "--prefill-tp", "4", "--decode-tp", "2"],
    ],
)
def test_local_mode_verifies_every_byte(extra, tmp_path, no_leaks):
    p, rep = run(SMALL + extra, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["requests"] == 10 and rep["requests_ready"] == 10 and rep["requests_failed"] == 0
    assert rep["verify_errors"] == 0 and rep["bytes_verified"] == rep["bytes_transferred"] > 0
    assert rep["peak_buffer_blocks"] > 0  # the buffer path was used
    assert rep["transports_chosen"] == [extra[1]]  # what decode picked for the prefill ranks
    from pdkv._ffi import cpu

    # which copy the shm senders ran: the streaming loop wherever it builds here
    assert rep["shm_copy"] == (
        [] if extra[1] != "shm" else ["streaming loop"] if cpu.available() else [f"numpy ({cpu.unavailable_reason()})"]
    )
    # the plot's data: bytes landed over time, on every transport (shm included)
    tl = rep["timeline"]
    assert max(tl["bytes"]) == rep["bytes_transferred"] and tl["bytes"] == sorted(tl["bytes"])
    assert rep["transfer_s"] <= rep["wall_s"] and rep["throughput_GBps"] > 0
    assert rep["version"] and rep["argv"][:2] == SMALL[:2] and rep["host"]["cpus"] >= 1
    for k in (
        "throughput_GBps",
        "request_GBps_p1",
        "grant_to_received_ms_p50",
        "grant_to_ready_ms_p99",
        "prefill_wait_ms_p99",
        "ttft_ms_p50",
        "layer_latency_ms_p50",
        "swap_GBps",
        "prefill_wait_avoided_s_total",
    ):
        assert k in rep
    # the link's rate over the time prefill was writing
    assert 0 < rep["link_busy_s"] <= rep["wall_s"] and rep["link_GBps"] > 0


@pytest.mark.multiproc
def test_trace_replay_and_plot(tmp_path, no_leaks):
    need("matplotlib", "plot")
    plot = tmp_path / "p.html"
    p, rep = run(
        [
            "--model",
            "tiny",
            "--trace",
            TRACE,
            "--trace-limit",
            "6",
            "--time-scale",
            "0.001",
            "--buffer-blocks",
            "4096",
            "--gpu-blocks",
            "4096",
            "--plot",
            str(plot),
            "--prefill-blocks",
            "4096",
        ],
        tmp_path,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["requests_ready"] == 6 and rep["verify_errors"] == 0
    assert "<svg" in plot.read_text()
    # prefill's cost fitted over the trace's prompts, as the planner takes it
    assert rep["prefill_fixed_ms"] >= 0 and rep["prefill_fit_tokens_per_s"] > 0


@pytest.mark.multiproc
def test_trace_replay_with_default_sizes(tmp_path, no_leaks):
    # the buffer sized by the tool for the trace's own requests: every one fits, all succeed
    p, rep = run(["--model", "tiny", "--trace", TRACE, "--trace-limit", "10", "--time-scale", "0.01", "-q"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["requests"] == 10 and rep["requests_ready"] == 10 and rep["verify_errors"] == 0
    assert "Traceback" not in p.stderr


def test_a_trace_larger_than_the_buffer_fails_before_starting(tmp_path, no_leaks):
    p, rep = run(["--model", "tiny", "--trace", TRACE, "--trace-limit", "10", "--buffer-blocks", "128"], tmp_path)
    assert p.returncode == 2 and rep is None
    assert "needs 2663 blocks" in p.stderr and "--buffer-blocks" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.multiproc
def test_decode_hold_times_keep_gpu_blocks(tmp_path, no_leaks):
    # 4 requests of 4 blocks arriving at once, GPU pool of 8, each held 1 output token x 1 s: two at a
    # time, so the pool fills (8 blocks seen) and the second pair is ready only when the first pair's
    # hold ends. A hold much longer than the timeline's 50 ms step and a loaded runner's prefill time.
    args = ["--model", "tiny", "--requests", "4", "--prompt-len", "64", "--gpu-blocks", "8", "--buffer-blocks", "16"]
    p, rep = run([*args, "--token-ms", "1000", "-q"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["requests_ready"] == 4 and max(rep["timeline"]["gpu_blocks"]) == 8
    assert rep["grant_to_ready_ms_p99"] >= 950 and rep["grant_to_ready_ms_p50"] < 950


def test_version(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pdkv.cli.transfer_tool", "--version"], capture_output=True, text=True)
    from pdkv import __version__

    assert p.returncode == 0 and p.stdout.strip() == f"pdkv-transfer-test {__version__}"


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["local", "decode"])
def test_ctrl_c_is_interrupted_rc_130(mode, tmp_path, no_leaks):
    import signal
    import time

    args = ["--model", "tiny", "--timeout", "10"]
    out_json = tmp_path / "r.json"
    if mode == "local":
        args += ["--requests", "400", "--rate", "20", "--json", str(out_json)]  # 20 s of arrivals
    else:
        args = ["decode", "--listen", "tcp://127.0.0.1:0", "--buffer-blocks", "16", *args]
    p = subprocess.Popen(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if mode == "decode":
            assert "listening on" in p.stdout.readline()
        else:
            time.sleep(4)  # started, requests flowing
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, out[-2000:] + err[-2000:]
    assert "interrupted" in out and "FAIL" not in out and "Traceback" not in err
    if mode == "local":
        # what was not issued yet is not failed, and no more bytes verified than landed
        rep = json.loads(out_json.read_text())
        assert rep["requests_not_issued"] > 200 and rep["requests_failed"] < 20, rep
        assert rep["requests_ready"] + rep["requests_failed"] + rep["requests_not_issued"] == 400, rep
        assert rep["bytes_verified"] <= rep["bytes_transferred"], rep


def _decode_mode(*extra):
    """The tool's decode mode on loopback (tiny, 32 buffer blocks, at most 60 s): the process
    and the address it listens on."""
    d = subprocess.Popen(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", "decode", "--listen", "tcp://127.0.0.1:0", "--model", "tiny"]
        + ["--buffer-blocks", "32", "--duration", "60", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return d, d.stdout.readline().split("listening on ")[1].split(" ")[0]


@pytest.mark.multiproc
def test_prefill_mode_by_hand_prints_a_summary(tmp_path, no_leaks):
    tool = [sys.executable, "-m", "pdkv.cli.transfer_tool"]
    d, addr = _decode_mode("--expect-requests", "3")
    try:
        p = subprocess.run(
            [*tool, "prefill", "--connect", addr, "--model", "tiny", "--requests", "3", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out, _ = d.communicate(timeout=60)
    finally:
        if d.poll() is None:
            d.kill()
            d.communicate()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS 3 of 3 requests received by decode" in p.stdout and "{" not in p.stdout
    assert d.returncode == 0 and "PASS 3 requests ready" in out


@pytest.mark.multiproc
def test_prefill_mode_sums_up_when_decode_dies(tmp_path, no_leaks):
    """Decode killed mid-run: prefill names the first few failed requests, then counts the
    rest by reason (it printed one line per request)."""
    from pdkv.buffer.sweeper import clean_segments

    tool = [sys.executable, "-m", "pdkv.cli.transfer_tool"]
    d, addr = _decode_mode()
    procs = [d]
    try:
        p = subprocess.Popen(
            [*tool, "prefill", "--connect", addr, "--model", "tiny", "--requests", "60", "--rate", "20"]
            + ["--timeout", "2", "--concurrency", "40"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        lines: list[str] = []
        connected = threading.Event()

        def read() -> None:  # prefill's stdout, whole; "connected to" once its session is up
            for ln in p.stdout:  # type: ignore[union-attr]
                lines.append(ln)
                if ln.startswith("connected to"):
                    connected.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert connected.wait(60), "".join(lines)  # however loaded the host, decode dies mid-run
        time.sleep(0.5)  # some requests done, most still to come at 20 a second
        d.kill()
        p.wait(120)
        reader.join(10)
        out = "".join(lines)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
            q.communicate()
        # the killed decode's segment, on every path: removed once its creator is provably gone
        deadline = time.monotonic() + 10
        while [n for n in os.listdir("/dev/shm") if n.startswith(f"pdkv-{d.pid}-")]:
            assert time.monotonic() < deadline, "the killed decode's segment was not cleaned"
            clean_segments(dry_run=False, tag=os.environ["PDKV_SHM_TAG"])
            time.sleep(0.05)
    assert p.returncode != 0
    named = [ln for ln in out.splitlines() if ln.startswith("r") and ": failed" in ln]
    assert 0 < len(named) <= 5, out
    assert "FAIL" in out and "request(s) failed" in out, out


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--requests", "0"], "--requests must be positive"),
        (["--model", "gpt-9"], "--model 'gpt-9'"),
        (["--prompt-len", "banana:1"], "--prompt-len"),
        (["--decode-tp", "3"], "kv_heads=8 and tp_size=3"),
        (["prefill"], "needs --connect"),
        (["--bogus"], "unknown flag --bogus"),
        (["--requsts", "5"], "unknown flag --requsts (did you mean --requests?)"),
        (["--rate", "-1"], "--rate -1.0 must be >= 0"),
        (["--token-ms", "-1"], "--token-ms -1.0 must be >= 0"),
        (["--json", "/nonexistent/r.json"], "--json /nonexistent/r.json: no folder /nonexistent"),
        (["--plot", "x.svg"], "needs a .png or .html file name"),
        (["--buffer-gib", "100000"], "does not fit in /dev/shm"),
        (["--secret", "a-secret-of-enough-length"], "--secret puts the secret on the command line"),
        (["--secret-file", "/nonexistent/secret"], "--secret-file /nonexistent/secret: "),
        (["--trace", "/nonexistent"], "no such file"),
        (["--transport", "cuda_ipc", "--no-gpu"], "cannot run with --no-gpu"),
        (["--rdma-gid-index", "-1"], "--rdma-gid-index -1 must be in 0..65535"),
        (["--streams", "0"], "--streams 0 must be in 1..64"),
        (["--streams", "65"], "--streams 65 must be in 1..64"),
        (["plan", "--trace", "t", "--metrics-port", "9400"], "--metrics-port does not apply to plan mode"),
        (["--connect", "tcp://h:1"], "--connect does not apply to local mode (only to prefill)"),
        (["decode", "--listen", "tcp://127.0.0.1:0", "--bandwidth-gbps", "1"], "--bandwidth-gbps does not apply"),
        (["prefill", "--connect", "tcp://h:1", "--listen=tcp://h:2"], "--listen does not apply to prefill mode"),
    ],
)
def test_bad_flags_get_one_line(args, msg, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", *args], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], p.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--transport", "cuda_ipc"],
        ["--transport", "shm", "--prefill-gpu"],
        ["--transport", "tcp", "--prefill-gpu"],
        ["--prefill-gpu"],
        ["prefill", "--connect", "tcp://127.0.0.1:9", "--transport", "cuda_ipc"],
    ],
)
def test_gpu_modes_say_no_gpu_on_a_cpu_host(args, tmp_path):
    from pdkv import _ffi

    if _ffi.cuda.device_count() > 0:
        pytest.skip("this host has a GPU (the modes themselves are tested under -m cuda)")
    p, _ = run(args, tmp_path, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU on this host; none found" in lines[0], p.stderr


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "extra",
    [
        [],  # the README's main job on a GPU host: host caches, shm, the buffer
        ["--prefill-gpu"],  # auto from GPU caches: cuda_ipc, as an engine's sender
        ["--transport", "cuda_ipc"],
        ["--transport", "cuda_ipc", "--prefill-tp", "2", "--decode-tp", "4"],
        ["--transport", "shm", "--prefill-gpu", "--prefill-tp", "4", "--decode-tp", "2"],
        # GPU caches to a decode as if on another host: staged through pinned memory
        ["--transport", "tcp", "--prefill-gpu"],
        ["--transport", "tcp", "--prefill-gpu", "--prefill-tp", "2", "--decode-tp", "4"],
        # two GPUs: prefill ranks on one, decode ranks spread over both
        [
            "--transport",
            "cuda_ipc",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "2",
            "--prefill-devices",
            "1",
            "--decode-devices",
            "0,1",
        ],
        [
            "--transport",
            "shm",
            "--prefill-gpu",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "2",
            "--prefill-devices",
            "1,0",
            "--decode-devices",
            "0,1",
        ],
    ],
)
def test_local_mode_gpu_caches_every_byte(cuda_device, extra, tmp_path, no_leaks):
    # 16 GPU blocks for 10 requests of 2-13 blocks sent at once: with cuda_ipc the first
    # requests get GPU blocks (written by prefill directly), the rest go through the buffer
    # and a swap; both are verified in GPU memory
    from pdkv import _ffi

    if "--decode-devices" in extra and _ffi.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    p, rep = run(SMALL + extra, tmp_path, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["gpu"] and rep["requests_ready"] == 10 and rep["requests_failed"] == 0
    assert rep["verify_errors"] == 0 and rep["bytes_verified"] == rep["bytes_transferred"] > 0
    assert rep["peak_buffer_blocks"] > 0
    ipc = "cuda_ipc" in extra or extra == ["--prefill-gpu"]
    staged = "tcp" in extra
    assert rep["transports_chosen"] == (["cuda_ipc"] if ipc else ["tcp"] if staged else ["shm"])
    if staged:
        assert len(rep["data_paths"]) == 1 and rep["data_paths"][0].startswith("tcp staged (")
    if ipc:
        assert 0 < rep["requests_into_gpu_blocks"] < 10
    else:
        assert rep["requests_into_gpu_blocks"] == 0
    if "--decode-devices" in extra:
        assert rep["decode_devices"] == [0, 1] and rep["prefill_devices"] == ([1, 1] if "cuda_ipc" in extra else [1, 0])


def test_unreachable_decode_is_one_line(tmp_path):
    p, _ = run(
        ["prefill", "--connect", "tcp://127.0.0.1:9", "--timeout", "1", "--model", "tiny", "--requests", "1"],
        tmp_path,
        timeout=60,
    )
    assert p.returncode == 3
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not answer" in lines[0]


@pytest.mark.multiproc
def test_layout_mismatch_between_two_hosts_is_one_line(tmp_path):
    import time

    d = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdkv.cli.transfer_tool",
            "decode",
            "--listen",
            "tcp://127.0.0.1:0",
            "--model",
            "tiny",
            "--buffer-blocks",
            "16",
            "--duration",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = d.stdout.readline()
        addr = line.split("listening on ")[1].split(" ")[0]
        p, _ = run(
            ["prefill", "--connect", addr, "--model", "tiny", "--head-dim", "32", "--requests", "1", "--timeout", "3"],
            tmp_path,
            timeout=60,
        )
        assert p.returncode == 3
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "head_dim is 32 here and 64" in lines[0], p.stderr
    finally:
        d.terminate()
        d.wait(30)
        d.stdout.close()
        d.stderr.close()
    time.sleep(0.1)


@pytest.mark.multiproc
def test_the_buffer_is_sized_to_the_workload_unless_told(tmp_path, no_leaks):
    from pdkv import KVLayout
    from pdkv.cli.transfer_tool import PRESETS

    tpb = KVLayout(**PRESETS["tiny"]).tokens_per_block
    args = ["--model", "tiny", "--requests", "6", "--prompt-len", "100", "--concurrency", "3", "--timeout", "10"]
    p, rep = run(args, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["buffer_blocks"] == 3 * -(-100 // tpb)  # the three largest requests in flight at once
    p, rep = run([*args, "--buffer-blocks", "40"], tmp_path)
    assert p.returncode == 0 and rep["buffer_blocks"] == 40


def test_a_buffer_larger_than_memory_is_a_usage_error(tmp_path, no_leaks):
    # fits /dev/shm's free space but not the memory left: the run's memory check (or, where the
    # run fits but the buffer not, the buffer's own) says so
    import os

    from pdkv.buffer.segments import available_memory

    st = os.statvfs("/dev/shm")
    shm_free, mem = st.f_bavail * st.f_frsize, available_memory()[0]
    if shm_free <= mem + (2 << 30):
        pytest.skip("/dev/shm holds no more than the memory left here")
    gib = (mem + (1 << 30)) / (1 << 30)
    p, rep = run(["--model", "llama3-8b", "--buffer-gib", f"{gib:.1f}", "--requests", "1"], tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    said = "does not fit in memory" in p.stderr or "GiB of host memory" in p.stderr
    assert said and "--buffer-gib" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert rep is None


def test_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        addr = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        p, _ = run(["decode", "--listen", addr, "--model", "tiny", "--buffer-blocks", "8"], tmp_path, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and addr in lines[0] and "Address already in use" in lines[0], p.stderr


@pytest.mark.multiproc
def test_logs_only_with_verbose(tmp_path, no_leaks):
    args = ["--model", "tiny", "--requests", "2", "-q"]
    p, _ = run(args, tmp_path)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    p, _ = run([*args, "-v"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "pdkv.buffer.shared INFO created shared buffer pdkv-" in p.stderr and "DEBUG" not in p.stderr
    # the normal end of a session is said as such, never as a dead peer
    assert "ended its session" in p.stderr and "dead" not in p.stderr and "WARNING" not in p.stderr, p.stderr
    p, _ = run([*args, "-vv"], tmp_path)  # documented: -vv is debug
    assert p.returncode == 0, p.stderr
    for what in ("DEBUG session open: instance", "DEBUG grant 'r0'", "DEBUG swap of 'r0' done"):
        assert what in p.stderr, (what, p.stderr[-2000:])


def test_metrics_port_without_prometheus_client_is_one_usage_line(monkeypatch, capsys):
    """Without the metrics extra, --metrics-port is refused up front (rc 2, one line naming
    the extra), not a traceback after the run has started."""
    import importlib.util

    from pdkv.cli.transfer_tool import main as tool_main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "prometheus_client" else real(name, *a)
    )
    for argv in (["--metrics-port", "0"], ["decode", "--listen", "tcp://127.0.0.1:0", "--metrics-port", "0"]):
        assert tool_main([*argv, "--model", "tiny"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install 'pdkv[metrics]'" in err[0], err


@pytest.mark.multiproc
def test_sweep_mode_one_row_per_size_and_transport(tmp_path, no_leaks):
    p, rep = run(
        [
            "sweep",
            "--model",
            "tiny",
            "--requests",
            "4",
            "--sweep-tokens-per-block",
            "8,32",
            "--sweep-transports",
            "shm",
            "--sweep-reps",
            "2",
        ],
        tmp_path,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = rep["rows"]
    assert all(r["runs"] == 2 and r["grant_to_ready_ms_p99"] >= r["grant_to_ready_ms_p50"] > 0 for r in rows)
    assert [(r["tokens_per_block"], r["transport"], r["result"]) for r in rows] == [
        (8, "shm", "PASS"),
        (32, "shm", "PASS"),
    ]
    assert rows[1]["block_kib"] == 4 * rows[0]["block_kib"] and all(r["bytes_verified"] > 0 for r in rows)
    assert json.loads(p.stdout.strip().splitlines()[-1]) == rep
    p, _ = run(["sweep", "--sweep-tokens-per-block", "x"], tmp_path)
    assert p.returncode == 2 and "--sweep-tokens-per-block 'x'" in p.stderr
    # a transport that does not exist: refused before any run, on stderr, rc 2
    p, _ = run(["sweep", "--model", "tiny", "--sweep-transports", "shm,bogus"], tmp_path, timeout=30)
    assert p.returncode == 2 and "'bogus' is not a transport" in p.stderr, p.stderr


def _decode_side(tracks):
    """A DecodeSide as build_report sees it after a run: ``tracks`` ended (folded into its
    tally) and nothing in flight."""
    from types import SimpleNamespace

    from pdkv.cli.transfer_tool.decode_mode import DecodeSide

    metrics = {
        "reservations_queued": 0,
        "buffer_blocks_peak": 4,
        "prefill_wait_avoided_seconds_max": 0.0,
        "prefill_wait_avoided_seconds_sum": 0.0,
        "swap_busy_seconds": 0.0,
        "swap_bytes": 0,
    }
    dec = DecodeSide(a=None, lay_kw={})
    dec.sched = SimpleNamespace(metrics=lambda: metrics)
    dec.nb = dec.gpu_blocks = 64
    dec.cuda = False
    for rid, tr in tracks.items():
        dec.tally.fold(rid, tr, 1)
    return dec


def test_a_request_neither_ready_nor_failed_is_reported_lost_and_failed():
    """A request issued that never reached decode and reported no outcome (an event lost)
    must not pass as a clean run: it counts as failed, and the report says why."""
    from pdkv.cli.transfer_tool.decode_mode import Track
    from pdkv.cli.transfer_tool.report import build_report
    from pdkv.cli.transfer_tool.stats import PrefillTally
    from pdkv.layout import KVLayout

    lay = KVLayout(num_layers=2, kv_heads=1, head_dim=8, tokens_per_block=16, dtype="bfloat16")

    def ready():
        return {f"r{i}": Track(reserved=1.0, received=2.0, ready=2.5, state="ready", blocks=2) for i in range(5)}

    def tally(extra=()):
        pre = PrefillTally(1)
        for rid in [*ready(), *extra]:
            pre.event({"type": "outcome", "rid": rid, "state": "aborted" if rid in extra else "received"})
        return pre

    dec = _decode_side(ready())
    rep = build_report(dec, tally(), 3.0, lay, 1, requests=6)  # 6 issued, 5 accounted for
    assert (rep["requests"], rep["requests_ready"], rep["requests_lost"], rep["requests_failed"]) == (6, 5, 1, 1)
    assert any("neither ready nor failed" in f for f in rep["failures"])
    rep = build_report(dec, tally(), 3.0, lay, 1, requests=5)
    assert (rep["requests_lost"], rep["requests_failed"]) == (0, 0)
    # a request that landed and was verified, then ended badly (an interrupted run aborts
    # what decode still holds): counted failed once (both sides say so), its bytes in both counts
    dec = _decode_side(dict(ready(), r9=Track(reserved=1.0, received=2.0, ready=2.5, state="aborted", blocks=2)))
    dec.bytes_verified = 6 * 2 * lay.block_bytes
    rep = build_report(dec, tally(["r9"]), 3.0, lay, 1)
    assert rep["requests_failed"] == 1 and rep["bytes_verified"] <= rep["bytes_transferred"], rep
    assert rep["failures"] == ["r9: aborted"], rep["failures"]
    # a request still held by decode at the end (ready, "generating") is ready; one landed
    # but not ready is neither: with the requests issued known, it is lost
    dec = _decode_side(ready())
    dec.tracks["r5"] = Track(reserved=1.0, received=2.0, ready=2.5, state="ready", blocks=2)
    dec.tracks["r6"] = Track(reserved=1.0, received=2.0, blocks=2)
    rep = build_report(dec, tally(), 3.0, lay, 1, requests=7)
    assert (rep["requests_ready"], rep["requests_lost"], rep["bytes_transferred"]) == (6, 1, 7 * 2 * lay.block_bytes)
    # the link's rate: bytes the ranks sent over the time some rank was writing (overlaps once)
    dec = _decode_side(ready())
    pre = tally()
    pre.event({"type": "layers", "s": [0.1, 0.2], "w": [[10.0, 11.0], [10.5, 12.0]]})
    pre.event({"type": "layers", "s": [0.3], "w": [[11.5, 12.5], [14.0, 14.5]]})
    pre.event({"type": "summary", "bytes": 2_000_000_000})
    pre.event({"type": "summary", "bytes": 1_000_000_000})
    rep = build_report(dec, pre, 3.0, lay, 1, requests=5)
    assert rep["link_busy_s"] == pytest.approx(3.0) and rep["link_GBps"] == pytest.approx(1.0)
    assert rep["layer_latency_ms_p99"] == pytest.approx(300.0)
    assert build_report(dec, tally(), 3.0, lay, 1)["link_GBps"] == 0.0


@pytest.mark.parametrize(
    "line, why",
    [
        ('{"timestamp": 0, "input_length": -3, "output_length": 1}', "line 2: needs timestamp >= 0"),
        ('{"time": 0, "input_length": 10}', "line 2: not a trace record ('timestamp')"),
        ("not json", "line 2: not a trace record"),
    ],
)
def test_local_mode_checks_a_trace_as_plan_does(tmp_path, capsys, line, why):
    """A bad trace line is one usage line naming the file and the line, before anything
    starts (rc 2), in local mode as in plan mode."""
    from pdkv.cli.transfer_tool import main as tool_main

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n' + line + "\n")
    for mode in ([], ["plan", "--gpu-gib", "1", "--bandwidth-gbps", "10", "--swap-gbps", "10"]):
        assert tool_main([*mode, "--model", "tiny", "--trace", str(trace)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--trace {trace} {why}" in err[0], err


def test_piped_tables_are_not_cut_at_80_columns(tmp_path):
    """Output to a pipe (CI logs, `| tee`) keeps whole rows: rich cut them at 80 columns
    (`136317…`, `rejec…`)."""
    argv = ["plan", "--trace", TRACE, "--bandwidth-gbps", "25", "--swap-gbps", "50", "--gpu-gib", "24"]
    p = subprocess.run(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", *argv], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "…" not in p.stdout, [ln for ln in p.stdout.splitlines() if "…" in ln][:3]
    # the facts line and the warnings are one line each, not wrapped at column 80
    facts = [ln for ln in p.stdout.splitlines() if ln.startswith("llama3-8b (32 layers")]
    assert len(facts) == 1 and len(facts[0]) > 80 and "GPU blocks" in facts[0], facts


def test_help_gives_each_default_once_and_whole_sentences(capsys):
    from pdkv.cli.shm_tool import main as shm_main
    from pdkv.cli.transfer_tool import main as tool_main

    with pytest.raises(SystemExit):
        tool_main(["--help"])
    raw = capsys.readouterr().out
    text = " ".join(raw.split())
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: )" not in text
    entries, cur = [], []
    for line in raw.splitlines():  # one entry a flag: its line and the help lines under it
        if line.startswith("  -") and cur:
            entries.append(" ".join(cur))
            cur = []
        cur.append(line.strip())
    entries.append(" ".join(cur))
    assert len(entries) > 40 and all(e.count("(default") <= 1 for e in entries), [
        e for e in entries if e.count("(default") > 1
    ]
    assert "nixl" in text.split("--transport", 1)[1].split("--streams", 1)[0]  # auto's offer, nixl included
    with pytest.raises(SystemExit):
        shm_main(["--help"])
    assert "dead creator (clean, a dry run unless --yes)." in " ".join(capsys.readouterr().out.split())


def test_a_run_larger_than_host_memory_is_refused_before_any_allocation(monkeypatch, capsys, no_leaks):
    """--prompt-len 100000 on a 24 GiB host was killed by the OOM killer after 33 s and left
    a 13 GB segment: the whole run's memory (buffer, host stand-in for GPU blocks, prefill
    caches) is checked against what the host has left first, one line, rc 2."""
    from pdkv.cli.transfer_tool import decode_mode
    from pdkv.cli.transfer_tool import main as tool_main

    monkeypatch.setattr(decode_mode, "available_memory", lambda: (24 << 30, "MemAvailable"))
    from pdkv.buffer.sweeper import scan_segments

    before = {s.name for s in scan_segments()}
    assert tool_main(["--requests", "4", "--prompt-len", "100000", "--no-gpu", "--buffer-blocks", "1600"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GiB of host memory" in err[0] and "--prompt-len" in err[0], err
    # new segments of this process or of a dead one (its children): another test process's
    # live buffers (xdist runs tests beside this one) are not this run's
    left = [s for s in scan_segments() if s.name not in before and (s.owner_pid == os.getpid() or not s.owner_alive)]
    assert left == []
    # what fits is not refused (tiny: well within the host)
    assert tool_main(["--model", "tiny", "--requests", "2", "-q"]) == 0


def test_a_killed_runs_buffer_is_named_at_the_next_start(capsys, no_leaks):
    from pdkv.buffer.sweeper import clean_segments
    from pdkv.cli.transfer_tool import main as tool_main

    code = (
        "from pdkv import SharedBuffer; b = SharedBuffer.create(65536); print(b.name, flush=True); "
        "import os; os._exit(0)"
    )
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    try:
        assert tool_main(["--model", "tiny", "--requests", "2", "-q"]) == 0
        err = capsys.readouterr().err
        assert "left by dead processes" in err and name in err and "pdkv-shm clean --yes" in err, err
    finally:
        assert name in clean_segments(dry_run=False, tag=os.environ["PDKV_SHM_TAG"])


@pytest.mark.parametrize(
    "mode, shown, hidden",
    [
        ("plan", ["--gpu-gib", "--trace", "--buffer-sweep"], ["--listen", "--sweep-reps", "--rank"]),
        ("decode", ["--listen", "--buffer-gib", "--metrics-port"], ["--gpu-gib", "--sweep-reps", "--rank"]),
        ("prefill", ["--connect", "--rank", "--requests"], ["--gpu-gib", "--sweep-reps", "--buffer-gib"]),
        ("sweep", ["--sweep-reps", "--sweep-transports"], ["--gpu-gib", "--buffer-sweep"]),
    ],
)
def test_each_mode_has_its_own_help(mode, shown, hidden, capsys):
    from pdkv.cli.transfer_tool import main as tool_main

    with pytest.raises(SystemExit) as e:
        tool_main([mode, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pdkv-transfer-test {mode}")
    assert all(f in out for f in shown) and not any(f in out for f in hidden), out


@pytest.mark.multiproc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_buffer_is_made_leaves_no_segment(sig, no_leaks):
    """Killed by a signal it can catch while its 1.5 GiB buffer is being made (and
    populated): the run leaves nothing in /dev/shm."""
    from pdkv.buffer.segments import available_memory

    if available_memory()[0] < (4 << 30):
        pytest.skip("less than 4 GiB of memory left here")
    p = subprocess.Popen(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", "--model", "tiny", "--buffer-gib", "1.5", "--requests", "2"]
        + ["--gpu-blocks", "64", "-q"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    mine = f"pdkv-{p.pid}-"
    deadline = time.monotonic() + 60
    while not any(n.startswith(mine) for n in os.listdir("/dev/shm")):
        assert p.poll() is None and time.monotonic() < deadline, "the tool made no buffer"
        time.sleep(0.005)
    p.send_signal(sig)
    p.communicate(timeout=60)
    assert p.returncode in (-sig, 130, 1, 2), p.returncode
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(mine)]


def test_a_short_secret_from_a_file_or_the_environment_is_refused(tmp_path):
    f = tmp_path / "secret"
    f.write_text("short\n")
    for args, env in ((["--secret-file", str(f)], {}), ([], {"PDKV_SECRET": "short"})):
        p = subprocess.run(
            [sys.executable, "-m", "pdkv.cli.transfer_tool", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        assert p.returncode == 2 and "the secret must be at least 16 characters" in p.stderr, p.stderr


@pytest.mark.multiproc
def test_no_secret_on_any_command_line_during_a_run(tmp_path, no_leaks):
    """The tool with a secret (from a file; and from $PDKV_SECRET) and two prefill ranks:
    while it runs, no process's command line holds the secret (every /proc/PID/cmdline
    read, the children's among them), and the run passes."""
    secret = "pdkv-test-secret-" + os.urandom(8).hex()
    f = tmp_path / "secret"
    f.write_text(secret + "\n")
    for args, env in ((["--secret-file", str(f)], {}), ([], {"PDKV_SECRET": secret})):
        out = tmp_path / "r.json"
        p = subprocess.Popen(
            [sys.executable, "-m", "pdkv.cli.transfer_tool", *SMALL, "--prefill-tp", "2", "--requests", "40"]
            + ["--rate", "20", "--json", str(out), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        seen, children = [], 0
        try:
            while p.poll() is None:
                for pid in os.listdir("/proc"):
                    if not pid.isdigit():
                        continue
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as fh:
                            cmd = fh.read()
                    except OSError:
                        continue
                    if b"prefill" in cmd and b"transfer_tool" in cmd:
                        children += 1
                    if secret.encode() in cmd:
                        seen.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
                time.sleep(0.05)
            o, e = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        assert not seen, f"the secret on a command line: {seen[:2]}"
        assert children > 0, "no prefill child was seen running"
        assert p.returncode == 0, o[-2000:] + e[-2000:]
        rep = json.loads(out.read_text())
        assert rep["requests_failed"] == 0 and rep["verify_errors"] == 0


def _one_line_exit_2(args, **kw):
    p = subprocess.run(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", *args], capture_output=True, text=True, timeout=60, **kw
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    return lines[0]


def test_bad_traces_and_addresses_get_one_line_and_leave_nothing(tmp_path, no_leaks):
    """A binary or broken-gzip trace, a data host this machine does not have: one line,
    exit 2, no segment left (no_leaks) and no child left."""
    import gzip

    kids = _children()
    binary = tmp_path / "t.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert "not UTF-8 text" in _one_line_exit_2(["--trace", str(binary)])
    broken = tmp_path / "t.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"timestamp": 0, "input_length": 8}\n' * 50)[:40])
    assert f"--trace {broken}" in _one_line_exit_2(["--trace", str(broken)])
    line = _one_line_exit_2(
        ["decode", "--listen", "tcp://127.0.0.1:0", "--data-host", "10.99.99.99", "--model", "tiny"]
        + ["--buffer-blocks", "8"]
    )
    assert "--data-host 10.99.99.99: cannot listen there" in line
    assert _children() <= kids


def _children():
    """This process's children now (the resource tracker among them)."""
    return {int(c) for c in os.listdir("/proc") if c.isdigit() and _child_of_us(int(c))}


def _parent_of(pid):
    from pdkv.procs import _stat_fields

    f = _stat_fields(pid)  # from the state on: the parent's pid is the next field
    return int(f[1]) if f is not None else None


def _child_of_us(pid):
    return _parent_of(pid) == os.getpid()


@pytest.mark.multiproc
def test_a_gzip_trace_and_torchs_fp8_name_run(tmp_path, no_leaks):
    """A gzip-compressed trace is read as the plain one; ``--dtype float8_e4m3fn`` (torch's
    name, the help's example) is float8_e4m3."""
    import gzip

    trace = tmp_path / "t.jsonl.gz"
    with gzip.open(trace, "wt") as f:
        for i in range(6):
            f.write(json.dumps({"timestamp": i * 10, "input_length": 64, "output_length": 1}) + "\n")
    p, rep = run(["--model", "tiny", "--trace", str(trace), "--dtype", "float8_e4m3fn", "--timeout", "10"], tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert rep["requests"] == 6 and rep["requests_failed"] == 0 and rep["verify_errors"] == 0


def test_decode_beyond_loopback_without_a_secret_warns_at_the_default_verbosity(tmp_path, no_leaks):
    d = subprocess.Popen(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", "decode", "--listen", "tcp://0.0.0.0:0", "--model", "tiny"]
        + ["--buffer-blocks", "8", "--duration", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PDKV_SECRET"},
    )
    out, err = d.communicate(timeout=60)
    assert "listening beyond loopback" in err and "without a secret" in err, err
    assert len([ln for ln in err.splitlines() if "without a secret" in ln]) == 1


@pytest.mark.multiproc
def test_ctrl_c_during_plans_measurement_leaves_no_segment_and_no_process(tmp_path, no_leaks):
    """Ctrl-C while plan measures this host's bandwidth (its own run of the tool): the
    measuring run is interrupted as Ctrl-C would, waited for, and nothing stays behind."""
    kids = _children()
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 64}) + "\n" for i in range(20)))
    p = subprocess.Popen(
        [sys.executable, "-m", "pdkv.cli.transfer_tool", "plan", "--trace", str(trace), "--model", "tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    measuring: set[int] = set()  # the measuring run: plan's child

    def theirs():
        return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"pdkv-{k}-") for k in measuring)]

    try:
        deadline = time.monotonic() + 60
        while not theirs() and time.monotonic() < deadline:  # its buffers exist: it is measuring
            measuring |= {int(c) for c in os.listdir("/proc") if c.isdigit() and _parent_of(int(c)) == p.pid}
            time.sleep(0.02)
        assert theirs(), "the measurement never started"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130 and "Traceback" not in err, (p.returncode, err[-2000:])
    assert not theirs(), f"left in /dev/shm: {theirs()}"
    assert not [k for k in measuring if os.path.exists(f"/proc/{k}")], "the measuring run is alive"
    assert _children() <= kids


@pytest.mark.multiproc
def test_the_main_job_passes_over_nixl_and_every_process_exits_cleanly(tmp_path, no_leaks):
    """`pdkv-transfer-test --transport nixl --model tiny` as a user runs it: every request
    moved and verified, and the tool and its prefill process exit 0 (NIXL's agents and their
    registered memory torn down in order: no crash at exit, which a PASS alone would hide)."""
    need("nixl", "nixl")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdkv.cli.transfer_tool",
            "--transport",
            "nixl",
            "--model",
            "tiny",
            "--json",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["requests_ready"] == rep["requests"] == 24 and rep["verify_errors"] == 0
    assert rep["bytes_verified"] == rep["bytes_transferred"] > 0
    assert "died" not in p.stderr and "exit code -" not in p.stderr, p.stderr[-3000:]
