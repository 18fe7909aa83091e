"""The examples stay runnable: decode loop and prefill loop, torch and paddle, on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from ports import free_port

EX = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.mark.multiproc
@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_examples_run(framework, no_leaks):
    pytest.importorskip(framework)
    addr = f"tcp://127.0.0.1:{free_port()}"
    d = subprocess.Popen(
        [
            sys.executable,
            os.path.join(EX, "decode_loop.py"),
            "--listen",
            addr,
            "--requests",
            "3",
            "--framework",
            framework,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "decode ready" in d.stdout.readline()
        p = subprocess.run(
            [
                sys.executable,
                os.path.join(EX, "prefill_loop.py"),
                "--connect",
                addr,
                "--requests",
                "3",
                "--framework",
                framework,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr
        assert p.stdout.split() == ["req-0", "received", "req-1", "received", "req-2", "received"]
        out, err = d.communicate(timeout=60)
        assert d.returncode == 0, err
        lines = out.strip().splitlines()
        assert len(lines) == 3 and all("starts with" in x for x in lines)
        assert {x.split("starts with ")[1] for x in lines} == {"1.000", "2.000", "3.000"}
    finally:
        if d.poll() is None:
            d.kill()
            d.wait(10)
        for f in (d.stdout, d.stderr):
            if f:
                f.close()
