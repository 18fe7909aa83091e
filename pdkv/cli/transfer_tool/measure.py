"""This host's link and swap rates for the planner, when not given: runs of the transfer
test on loopback, their median used and their spread said; a Ctrl-C hands the measuring
run a Ctrl-C of its own and waits for it."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from ...layout import KVLayout
from .workload import UsageError, layout_kw

__all__ = ["measure_rates", "measure_once", "MEASURE_REPS"]


def _stop_child(child: Any) -> None:
    """Interrupt the measuring run as Ctrl-C would and wait for it (bounded) to clean up;
    killed only if it does not end in time; what it left in /dev/shm is removed."""
    import signal
    import subprocess
    import time

    if child.poll() is None:
        child.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_WAIT_S
        while child.poll() is None and time.monotonic() < deadline:
            try:  # a second Ctrl-C does not cut the wait short: the child's buffers go first
                child.communicate(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
            except KeyboardInterrupt:
                print("pdkv-transfer-test: still stopping the measuring run (at most 30 s)", file=sys.stderr)
        if child.poll() is None:
            child.kill()
        while True:
            try:
                child.communicate()
                break
            except KeyboardInterrupt:
                continue
    import contextlib
    import os

    from ...buffer.sweeper import SHM_DIR

    # what it made is named after it (pdkv-<pid>-...); it is reaped, so nothing maps them
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"pdkv-{child.pid}-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))


STOP_WAIT_S = 30.0  # a stopped measuring run's time to clean up before it is killed
MEASURE_REPS = 3  # runs of the loopback measurement: its median is used, its spread said


def measure_rates(a: Any, console: Any) -> tuple[float, float, list[float], list[float]]:
    """This host's loopback rates, bytes/s: the median of MEASURE_REPS runs of
    :func:`measure_once`, and every run's link and swap rates (GB/s)."""
    links, swaps = [], []
    for _ in range(MEASURE_REPS):
        link, swap = measure_once(a, console)
        links.append(link / 1e9)
        swaps.append(swap / 1e9)
    return float(np.median(links)) * 1e9, float(np.median(swaps)) * 1e9, links, swaps


def measure_once(a: Any, console: Any) -> tuple[float, float]:
    """Transfer and swap bandwidth of this host for the layout, in bytes/s: a short loopback
    run of the transfer test (16 requests of about 2 GiB in all, sent at once, not verified): the
    link's rate over the time prefill was writing (the transfer span would also count the time
    the test's prefill spends computing its patterns, which the plan models apart) and the swap
    rate over the time swaps were in flight."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pdkv-plan-") as d:
        out = os.path.join(d, "rates.json")
        lay = KVLayout(**layout_kw(a), tp_size=a.decode_tp)
        per_token = lay.block_bytes * a.decode_tp / lay.tokens_per_block
        # about 2 GiB in all, less on a host with less memory free: the run holds about twice
        # its bytes (prefill's caches and decode's buffer)
        total = min(2 << 30, _free_memory() // 4)
        if total < 128 << 20:
            raise UsageError(
                f"measuring the bandwidth needs about 0.5 GiB of free memory, {_free_memory() / (1 << 30):.2f} GiB "
                "is free here; give --bandwidth-gbps and --swap-gbps instead"
            )
        tokens = int(min(16384, max(256, total / 16 / per_token)))
        argv = [sys.executable, "-m", "pdkv.cli.transfer_tool", "--model", a.model, "--requests", "16"]
        argv += ["--prompt-len", str(tokens), "--no-verify", "--concurrency", "16", "--json", out, "-q"]
        argv += ["--decode-tp", str(a.decode_tp), "--gpu-blocks", "0"]
        for opt, attr in (("--layers", "layers"), ("--kv-heads", "kv_heads"), ("--head-dim", "head_dim")):
            if getattr(a, attr) is not None:
                argv += [opt, str(getattr(a, attr))]
        for opt, attr in (("--tokens-per-block", "tokens_per_block"), ("--dtype", "dtype")):
            if getattr(a, attr) is not None:
                argv += [opt, str(getattr(a, attr))]
        console.print(f"measuring this host's transfer and swap bandwidth (16 requests of {tokens} tokens) ...")
        # its own session: a Ctrl-C here is handed to it as one, and waited for, so that it
        # stops its ranks and removes its buffers itself (killed at once, it left them)
        child = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            stdout, stderr = child.communicate(timeout=600)
        except BaseException:
            _stop_child(child)
            raise
        if child.returncode != 0 or not os.path.exists(out):
            last = (stderr.strip() or stdout.strip()).splitlines()[-1:] or ["no output"]
            raise UsageError(
                f"measuring the bandwidth failed ({last[0]}); give --bandwidth-gbps and --swap-gbps instead"
            )
        with open(out) as f:
            rep = json.load(f)
    link, swap = float(rep.get("link_GBps", 0.0)), float(rep.get("swap_GBps", 0.0))
    if not (link > 0 and swap > 0):  # a plan on a zero rate would divide by it
        raise UsageError(
            f"measuring the bandwidth gave no rate (link {link:.3f} GB/s, swap {swap:.3f} GB/s); give "
            "--bandwidth-gbps and --swap-gbps instead"
        )
    return link * 1e9, swap * 1e9


def _free_memory() -> int:
    """Bytes of memory available here (MemAvailable: free plus reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _measured_note(runs: dict[str, list[float]]) -> str:
    link, swap = runs.get("bandwidth_runs_GBps", []), runs.get("swap_runs_GBps", [])
    if not link:
        return " (measured here)"
    return (
        f" (measured here: this host's loopback, the median of {len(link)} runs, link {min(link):.2f}-"
        f"{max(link):.2f}, swap {min(swap):.2f}-{max(swap):.2f} GB/s; not a production link: give "
        "--bandwidth-gbps and --swap-gbps for yours)"
    )
