"""The benchmark scripts stay runnable (loopback, tiny sizes). Nothing here is timed:
figures come from running the scripts themselves (docs/PERF.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")


def run(script, *args, timeout=300):
    return subprocess.run(
        [sys.executable, os.path.join(TOOLS, script), *args], capture_output=True, text=True, timeout=timeout
    )


def test_bench_scheduler_smoke():
    p = run("bench_scheduler.py", "--requests", "640", "--reps", "1", "--layers", "4")
    assert p.returncode == 0, p.stderr
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["lifecycles_per_s"] > 0 and last["pool_ops_per_s"] > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("what", ["scheduler", "transfer"])
def test_soak_memory_smoke(what, no_leaks):
    p = run("soak_memory.py", what, "--requests", "3000", "--samples", "3")
    assert p.returncode == 0, p.stderr
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["requests"] == 3000 and last["rss_mib_end"] > 0 and last["live_requests_at_end"] == 0
    if what == "transfer":
        assert last["outcomes"] == {"received": 3000}


def test_bench_transport_smoke(no_leaks):
    p = run("bench_transport.py", "--gib", "0.02", "--sizes-kib", "32", "--reps", "1", "--control-requests", "5")
    assert p.returncode == 0, p.stderr
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"shm_vs_ceiling", "tcp_vs_socket", "tcp_GiBps", "control_p50_ms"} <= set(last)


@pytest.mark.multiproc
def test_bench_nixl_smoke(no_leaks):
    pytest.importorskip("nixl")
    p = run("bench_nixl.py", "--gib", "0.02", "--sizes-kib", "128", "--ucx", "tcp", "--reps", "1")
    assert p.returncode == 0, p.stderr
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["min_ratio"] > 0 and last["rows"][0]["bare"] > 0


def test_bench_nixl_gpu_says_what_is_missing():
    pytest.importorskip("nixl")
    from pdkv import _ffi

    if _ffi.cuda.device_count() > 0:
        pytest.skip("a GPU is present: run the benchmark itself")
    p = run("bench_nixl.py", "--gpu", timeout=120)
    assert p.returncode == 2 and "needs a CUDA device" in p.stderr, p.stderr


@pytest.mark.parametrize("script", ["bench_swap.py", "bench_buffer.py", "bench_cuda_ipc.py", "bench_staged.py"])
def test_gpu_benches_say_what_is_missing(script):
    from pdkv import _ffi

    if _ffi.cuda.device_count() > 0:
        pytest.skip("a GPU is present: run the benchmark itself")
    p = run(script, timeout=120)
    assert p.returncode == 2
    assert "needs" in p.stderr and ("GPU" in p.stderr or "torch" in p.stderr or "cuda" in p.stderr.lower())
