"""``tools/vllm_probe``: the served benchmark's count of decode GPU block-seconds held by
requests not yet running. vLLM is not needed: a stand-in package with the two names the
probe reads (``Scheduler.schedule`` over ``requests`` and ``kv_cache_manager``, and
``RequestStatus``) is loaded the way vLLM's engine core loads its scheduler."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parent.parent / "tools" / "vllm_probe"


def _tally_class():
    spec = importlib.util.spec_from_file_location("pdkv_vllm_probe", PROBE / "sitecustomize.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Tally


def test_tally_integrates_the_previous_sample_over_each_interval():
    t = _tally_class()()
    t.add(10.0, 4)  # 4 blocks from t=10
    t.add(10.5, 2)  # 4 x 0.5
    t.add(12.0, 0)  # 2 x 1.5
    t.add(20.0, 0)
    assert t.block_s == pytest.approx(2.0 + 3.0)
    assert (t.peak, t.calls, t.held) == (4, 4, 0)


FAKE = {
    "vllm/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/sched/__init__.py": "",
    "vllm/v1/request.py": """
        import enum
        class RequestStatus(enum.IntEnum):
            WAITING = enum.auto()
            WAITING_FOR_REMOTE_KVS = enum.auto()
            RUNNING = enum.auto()
        class Request:
            def __init__(self, status):
                self.status = status
    """,
    "vllm/v1/core/sched/scheduler.py": """
        class Manager:
            def __init__(self, blocks):
                self.blocks = blocks
            def get_block_ids(self, rid):
                if rid not in self.blocks:
                    raise KeyError(rid)
                return self.blocks[rid]
        class Scheduler:
            def __init__(self, requests, blocks):
                self.requests, self.kv_cache_manager = requests, Manager(blocks)
            def schedule(self, throttle_prefills=False):
                return ("scheduled", throttle_prefills)
    """,
}


def _fake_vllm(tmp_path: Path) -> Path:
    for rel, text in FAKE.items():
        f = tmp_path / "pkg" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


DRIVER = """
import time
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus as S
reqs = {"a": Request(S.WAITING_FOR_REMOTE_KVS), "b": Request(S.WAITING_FOR_REMOTE_KVS),
        "c": Request(S.RUNNING), "d": Request(S.WAITING)}
# a holds 2+1 blocks in two groups, b 2, c (running) 5; d none yet (no blocks: KeyError)
sched = Scheduler(reqs, {"a": ([1, 2], [3]), "b": ([4, 5],), "c": ([6, 7, 8, 9, 10],)})
assert sched.schedule(throttle_prefills=True) == ("scheduled", True)  # 5 waiting from here
time.sleep(0.4)
reqs["a"].status = S.RUNNING
sched.schedule()  # 2 waiting from here
time.sleep(0.4)
reqs["b"].status = S.RUNNING
sched.schedule()  # none: the final write
"""


def test_probe_counts_blocks_of_waiting_requests_inside_the_scheduler_process(tmp_path: Path):
    pkg = _fake_vllm(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{PROBE}{os.pathsep}{pkg}", "PDKV_PROBE_OUT": str(out)}
    subprocess.run([sys.executable, "-c", DRIVER], env=env, check=True, timeout=60)
    files = list(out.glob("*.json"))
    assert len(files) == 1, files
    got = json.loads(files[0].read_text())
    # 5 blocks x >= 0.4 s, then 2 blocks x >= 0.4 s; sleeps overshoot, never undershoot
    assert 2.8 <= got["waiting_block_s"] < 2.8 * 3, got
    assert got["peak_waiting_blocks"] == 5 and got["calls"] == 3, got


def test_probe_is_inert_without_its_variable(tmp_path: Path):
    pkg = _fake_vllm(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PDKV_PROBE_OUT"}
    env["PYTHONPATH"] = f"{PROBE}{os.pathsep}{pkg}"
    check = "from vllm.v1.core.sched.scheduler import Scheduler; print(Scheduler.schedule.__qualname__)"
    r = subprocess.run([sys.executable, "-c", check], env=env, check=True, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "Scheduler.schedule"
