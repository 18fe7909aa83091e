"""What a connector half counts between two reads of an engine's stats hooks: counters,
samples (latencies, for histograms) and gauges, recorded from any thread and taken all at
once. Engine-neutral: the vLLM connector turns a taken tally into vLLM's connector stats
and Prometheus series (``pdkv.integrations.vllm.stats``); another engine may read the
same dicts.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["Tally", "merge", "MAX_SAMPLES"]

MAX_SAMPLES = 4096  # samples of one name kept between two reads (the rest are counted only)


class Tally:
    """Counters (``count``), samples (``sample``: seconds, bytes) and gauges (``gauge``:
    the last value); :meth:`take` returns ``{"c": ..., "s": ..., "g": ...}`` and starts
    the counters and samples again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._s: dict[str, list[float]] = {}
        self._g: dict[str, float] = {}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def sample(self, name: str, value: float) -> None:
        with self._lock:
            s = self._s.setdefault(name, [])
            if len(s) < MAX_SAMPLES:
                s.append(float(value))

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self._g[name] = float(value)

    def take(self) -> dict[str, Any]:
        with self._lock:
            out = {"c": dict(self._c), "s": self._s, "g": dict(self._g)}
            self._c, self._s = Counter(), {}
        return out


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two taken tallies as one (other ranks, other halves, other steps): counters added,
    samples joined (at most :data:`MAX_SAMPLES` each), gauges the larger."""
    c = Counter(a.get("c", {}))
    c.update(b.get("c", {}))
    s = {k: list(v) for k, v in a.get("s", {}).items()}
    for k, v in b.get("s", {}).items():
        s[k] = (s.get(k, []) + list(v))[:MAX_SAMPLES]
    g = dict(a.get("g", {}))
    for k, v in b.get("g", {}).items():
        g[k] = max(g.get(k, v), v)
    return {"c": dict(c), "s": s, "g": g}
