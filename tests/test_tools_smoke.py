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
    args = ["--gib", "0.02", "--sizes-kib", "32", "--reps", "1", "--control-requests", "5"]
    p = run("bench_transport.py", *args, "--streams", "1,2")
    assert p.returncode == 0, p.stderr
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"shm_vs_ceiling", "tcp_vs_socket", "tcp_GiBps", "control_p50_ms"} <= set(last)
    assert last["streams"] == [1, 2] and set(last["tcp_by_streams"]) == {"1", "2"}
    assert set(last["tcp_by_streams"]["2"]["32"]) == {"tcp", "socket", "ratio"}
    assert "tcp by streams" in p.stdout
    # each peer library measured (GiB/s and pdkv's multiple of it), or named with why it is not
    assert set(last["peers"]) == {"nixl", "mooncake"}
    for name, got in last["peers"].items():
        if isinstance(got, str):
            assert "not measured" in p.stdout and got in p.stdout, (name, got)
        else:
            assert got["32"]["GiBps"] > 0 and got["32"]["tcp_x"] > 0, (name, got)
    try:
        import nixl  # noqa: F401
    except ImportError:
        assert "NIXL is not installed" in last["peers"]["nixl"]
    else:
        assert isinstance(last["peers"]["nixl"], dict), last["peers"]["nixl"]
    for bad in ("0", "2,2", "x"):
        p = run("bench_transport.py", *args, "--streams", bad)
        assert p.returncode == 2 and "--streams" in p.stderr, p.stderr
    for bad in ("rdma", "nixl,nixl"):
        p = run("bench_transport.py", *args, "--peers", bad)
        assert p.returncode == 2 and "--peers" in p.stderr, p.stderr


@pytest.mark.multiproc
def test_bench_nixl_smoke(no_leaks):
    pytest.importorskip("nixl")
    p = run("bench_nixl.py", "--gib", "0.02", "--sizes-kib", "128", "--ucx", "tcp", "--reps", "1")
    assert p.returncode == 0, p.stderr
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert last["min_ratio"] > 0 and last["rows"][0]["bare"] > 0


def test_bench_sglang_smoke(no_leaks):
    p = run("bench_sglang.py", "--pages", "4", "--chunks", "2", "--compute-ms", "5", "--reps", "1")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])["rows"]
    assert {(r["transport"], r["streamed"]) for r in rows} >= {("tcp", True), ("tcp", False)}
    assert all(0 < r["tail_s"] <= r["request_s"] for r in rows)
    p = run("bench_sglang.py", "--pages", "4", "--chunks", "2", "--compute-ms", "5", "--reps", "1",
            "--transports", "tcp", "--dest", "device-staged")  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])["rows"]
    assert {(r["dest"], r["streamed"]) for r in rows} == {("device-staged", True), ("device-staged", False)}
    p = run("bench_sglang.py", "--pages", "1", "--chunks", "2")
    assert p.returncode == 2 and "--pages must be >= --chunks" in p.stderr, p.stderr


def test_bench_nixl_gpu_says_what_is_missing():
    pytest.importorskip("nixl")
    from pdkv import _ffi

    if _ffi.cuda.device_count() > 0:
        pytest.skip("a GPU is present: run the benchmark itself")
    p = run("bench_nixl.py", "--gpu", timeout=120)
    assert p.returncode == 2 and "needs a CUDA device" in p.stderr, p.stderr


@pytest.mark.parametrize(
    "script",
    [
        "bench_swap.py",
        "bench_swap_kernels.py",
        "bench_swap_paths.py",
        "bench_interference.py",
        "bench_host_gather.py",
        "bench_buffer.py",
        "bench_cuda_ipc.py",
        "bench_staged.py",
    ],
)
def test_gpu_benches_say_what_is_missing(script):
    from pdkv import _ffi

    if _ffi.cuda.device_count() > 0:
        pytest.skip("a GPU is present: run the benchmark itself")
    p = run(script, timeout=120)
    assert p.returncode == 2
    assert "needs" in p.stderr and ("GPU" in p.stderr or "torch" in p.stderr or "cuda" in p.stderr.lower())


def test_mutation_write_table_replaces_only_the_modules_run(tmp_path):
    sys.path.insert(0, TOOLS)
    try:
        import mutation
    finally:
        sys.path.remove(TOOLS)
    readme = tmp_path / "README.md"
    old_a = "| `a` | `test_a.py` | 10 | 5 | 0 | 50.0% | 2026-01-01 | aaaaaaa |"
    old_z = "| `z` | `test_z.py` | 3 | 3 | 0 | 100.0% | 2026-01-01 | aaaaaaa |"
    readme.write_text(f"# T\n\n{mutation.TABLE_BEGIN}\n{old_z}\n{old_a}\n{mutation.TABLE_END}\n\nafter\n")
    r = {"module": "b", "mutants": 20, "killed": 18, "equivalent": 1, "score": 18 / 19}
    row = mutation.table_row(r, ["tests/test_b.py"], "2026-12-04", "abc1234+")
    mutation.write_table({"b": row}, ["a", "b"], readme)
    text = readme.read_text()
    new_b = "| `b` | `test_b.py` | 20 | 18 | 1 | 94.7% | 2026-12-04 | abc1234+ |"
    body = text.split(mutation.TABLE_BEGIN)[1].split(mutation.TABLE_END)[0].strip().splitlines()
    assert body == [*mutation.TABLE_HEAD, old_a, new_b, old_z]  # the pyproject's order, others after
    assert text.startswith("# T\n\n") and text.endswith("\n\nafter\n")
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="no mutation table markers"):
        mutation.write_table({}, [], readme)


def test_mutation_sources_digest_sees_code_and_tests_not_the_table(tmp_path, monkeypatch):
    sys.path.insert(0, TOOLS)
    try:
        import mutation
    finally:
        sys.path.remove(TOOLS)
    for d in ("pdkv", "tests", "docs"):
        (tmp_path / d).mkdir()
    (tmp_path / "pdkv" / "a.py").write_text("x = 1\n")
    (tmp_path / "tests" / "test_a.py").write_text("def test(): pass\n")
    (tmp_path / "tests" / "README.md").write_text("table\n")
    monkeypatch.setattr(mutation, "ROOT", str(tmp_path))
    first = mutation.sources_digest()
    (tmp_path / "tests" / "README.md").write_text("table with a new row\n")
    assert mutation.sources_digest() == first  # the table's own file does not count
    (tmp_path / "tests" / "test_a.py").write_text("def test(): assert 1\n")
    second = mutation.sources_digest()
    assert second != first
    (tmp_path / "docs" / "LIMITS.md").write_text("x\n")
    assert mutation.sources_digest() != second


def test_mutation_equivalents_are_pinned_to_their_change(tmp_path, monkeypatch):
    sys.path.insert(0, TOOLS)
    try:
        import mutation
    finally:
        sys.path.remove(TOOLS)
    diff = "--- pdkv/a.py\n+++ pdkv/a.py\n@@ -1,3 +1,3 @@ def f(n):\n-    if n > 4:\n+    if n >= 4:\n     return n\n"
    fp = mutation.fingerprint(diff)
    assert len(fp) == 8 and int(fp, 16) >= 0
    assert mutation.fingerprint(diff.replace("    return n", "        return n")) == fp  # context does not count
    assert mutation.fingerprint(diff.replace("n >= 4", "n >= 5")) != fp  # another change
    assert mutation.fingerprint(diff.replace("--- pdkv/a.py", "--- pdkv/b.py")) == fp  # nor the file headers
    eq = tmp_path / "eq.txt"
    eq.write_text(f"# a comment\npdkv.a.x_f__mutmut_1  @{fp}  # same\npdkv.a.x_f__mutmut_2  # old entry, no pin\n")
    monkeypatch.setattr(mutation, "EQUIVALENT", str(eq))
    assert mutation.equivalents() == {
        "pdkv.a.x_f__mutmut_1": (fp, "same"),
        "pdkv.a.x_f__mutmut_2": ("", "old entry, no pin"),
    }
