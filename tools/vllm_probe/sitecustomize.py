"""Decode GPU block-seconds held by requests that are not yet running, counted inside a
vLLM engine process, for ``tools/bench_vllm.py --served`` (any connector alike).

A served benchmark's engine is started with this folder first on ``PYTHONPATH`` and
``PDKV_PROBE_OUT`` naming a folder: Python runs this ``sitecustomize`` in every process of
the server (the api_server, its engine core, any worker), and in the process that imports
vLLM's scheduler it wraps ``Scheduler.schedule``. Each call integrates, over the time since
the previous call, the GPU blocks held by requests in ``WAITING_FOR_REMOTE_KVS`` (blocks
allocated, KV not yet loaded: a connector whose load is asynchronous) as they were at that
previous call, and writes ``{"waiting_block_s", "peak_waiting_blocks", "calls"}`` to
``$PDKV_PROBE_OUT/<pid>.json`` (at most every 0.25 s, and whenever no request waits any
more, so that the value is final once the trace is done). Nothing of vLLM is changed; the
wrapper reads the scheduler's ``requests`` and its KV cache manager's block lists.

Only what the benchmark's own engine processes import: nothing else loads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from typing import Any

_TARGET = "vllm.v1.core.sched.scheduler"


class Tally:
    """The integral of a step function sampled at call times: ``add(now, held)`` adds the
    previous sample's value times the time since it, then takes ``held`` as the value."""

    def __init__(self) -> None:
        self.block_s, self.peak, self.calls = 0.0, 0, 0
        self._last: float | None = None
        self._held = 0

    def add(self, now: float, held: int) -> None:
        if self._last is not None:
            self.block_s += self._held * (now - self._last)
        self._last, self._held = now, held
        self.peak = max(self.peak, held)
        self.calls += 1

    @property
    def held(self) -> int:
        return self._held

    def as_dict(self) -> dict[str, Any]:
        return {"waiting_block_s": self.block_s, "peak_waiting_blocks": self.peak, "calls": self.calls}


def waiting_blocks(scheduler: Any, waiting_status: Any) -> int:
    """GPU blocks held now by the scheduler's requests in ``waiting_status``."""
    n = 0
    for rid, req in list(scheduler.requests.items()):
        if req.status != waiting_status:
            continue
        try:
            groups = scheduler.kv_cache_manager.get_block_ids(rid)
        except Exception:  # noqa: BLE001 - a request without blocks yet holds none
            continue
        n += sum(len(g) for g in groups)
    return n


def _patch(module: Any, out: str) -> None:
    from vllm.v1.request import RequestStatus

    tally, state = Tally(), {"written": 0.0}
    original = module.Scheduler.schedule

    def write() -> None:  # by the pid of the process that schedules (a fork inherits the patch)
        path = os.path.join(out, f"{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(tally.as_dict(), f)
        os.replace(tmp, path)
        state["written"] = time.monotonic()

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            was = tally.held
            tally.add(time.monotonic(), waiting_blocks(self, RequestStatus.WAITING_FOR_REMOTE_KVS))
            if (was and not tally.held) or time.monotonic() - state["written"] > 0.25:
                write()
        except Exception as exc:  # noqa: BLE001 - the probe never fails the engine; it says so
            print(f"pdkv probe: {type(exc).__name__}: {exc}", file=sys.stderr)
        return original(self, *args, **kwargs)

    module.Scheduler.schedule = schedule
    write()


class _Finder(importlib.abc.MetaPathFinder):
    """Runs ``_patch`` on vLLM's scheduler module right after it is executed."""

    def __init__(self, out: str) -> None:
        self.out = out

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, out = spec.loader, self.out
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module, out)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("PDKV_PROBE_OUT"):
    sys.meta_path.insert(0, _Finder(os.environ["PDKV_PROBE_OUT"]))
