"""The tool's statistics in bounded memory: a run of any length keeps the same few kilobytes
per figure, never a record per request.

- :class:`Quantiles`: count, sum, min, max exactly, and percentiles from a histogram of
  logarithmic buckets 1 % wide (a percentile is within 0.5 % of a value seen at that rank).
- :class:`LineFit`: the least-squares line ``y = a + b x`` from running sums.
- :class:`Busy`: seconds covered by the union of ``[start, end]`` intervals that arrive
  roughly in time order (intervals older than a horizon are folded into a total).
- :class:`Series`: a time series that halves its resolution when full (the plot's data).

Written here rather than taken from a sketch library (HdrHistogram, t-digest): each is a few
lines over numpy, and the ranks hand theirs to the tool as plain JSON event lines.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

_GROWTH = 1.01
_LOG_GROWTH = math.log(_GROWTH)
_TINY = 1e-9  # values at or below this (zero waits) count in a bucket of their own
# requests remembered after they ended, so that a late event of one is not taken for a new
# request: events of one request come within milliseconds of each other
_LATE = 256


class Quantiles:
    """Streaming percentiles of non-negative values (seconds, rates) in bounded memory."""

    __slots__ = ("n", "total", "lo", "hi", "zeros", "buckets")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.lo = math.inf
        self.hi = -math.inf
        self.zeros = 0
        self.buckets: dict[int, int] = {}  # floor(log(x) / log(1.01)) -> count

    def add(self, x: float) -> None:
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(f"Quantiles.add({x}): not a finite value")
        self.n += 1
        self.total += x
        self.lo = min(self.lo, x)
        self.hi = max(self.hi, x)
        if x <= _TINY:
            self.zeros += 1
        else:
            k = math.floor(math.log(x) / _LOG_GROWTH)
            self.buckets[k] = self.buckets.get(k, 0) + 1

    def __len__(self) -> int:
        return self.n

    def percentile(self, q: float) -> float:
        """The value at percentile ``q`` (0-100), nearest rank; NaN when empty. The exact
        minimum and maximum at the ends, a bucket's geometric middle (clamped to them) between."""
        if not self.n:
            return math.nan
        rank = max(1, math.ceil(q / 100 * self.n))
        if rank >= self.n:
            return self.hi
        if rank <= max(1, self.zeros):
            return self.lo
        seen = self.zeros
        for k in sorted(self.buckets):
            seen += self.buckets[k]
            if seen >= rank:
                return min(self.hi, max(self.lo, math.exp((k + 0.5) * _LOG_GROWTH)))
        return self.hi

    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    def merge(self, other: Quantiles) -> None:
        self.n += other.n
        self.total += other.total
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)
        self.zeros += other.zeros
        for k, c in other.buckets.items():
            self.buckets[k] = self.buckets.get(k, 0) + c

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "total": self.total,
            "lo": self.lo if self.n else 0.0,
            "hi": self.hi if self.n else 0.0,
            "zeros": self.zeros,
            "buckets": [[k, c] for k, c in sorted(self.buckets.items())],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Quantiles:
        """From :meth:`to_json`'s form (a rank's event line): every field checked."""
        q = cls()
        try:
            q.n, q.zeros = int(d["n"]), int(d["zeros"])
            q.total = float(d["total"])
            q.buckets = {int(k): int(c) for k, c in d["buckets"]}
            if q.n:
                q.lo, q.hi = float(d["lo"]), float(d["hi"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a quantile sketch: {exc}") from None
        if q.n < 0 or q.zeros < 0 or any(c <= 0 for c in q.buckets.values()):
            raise ValueError("not a quantile sketch: negative counts")
        if q.zeros + sum(q.buckets.values()) != q.n:
            raise ValueError("not a quantile sketch: bucket counts do not add up to n")
        return q


class LineFit:
    """Least squares ``y = fixed + x / rate`` from running sums (what :func:`fit_prefill`
    fits to lists)."""

    __slots__ = ("n", "sx", "sy", "sxx", "sxy", "xlo", "xhi")

    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.xlo, self.xhi = math.inf, -math.inf

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y
        self.xlo, self.xhi = min(self.xlo, x), max(self.xhi, x)

    def fit(self, shift: float = 0.0) -> tuple[float, float]:
        """``(fixed, rate)`` of the line through the points with ``shift`` added to every y;
        with one x value only, or a fit that is not a positive rate with a fixed part >= 0,
        no fixed part and the mean rate (``(0, 0)`` with no points)."""
        sy = self.sy + shift * self.n
        if not self.n or sy <= 0:
            return 0.0, 0.0
        mean_rate = self.sx / sy
        if self.xhi <= self.xlo:
            return 0.0, mean_rate
        den = self.n * self.sxx - self.sx * self.sx
        slope = (self.n * (self.sxy + shift * self.sx) - self.sx * sy) / den
        fixed = (sy - slope * self.sx) / self.n
        if slope <= 0 or fixed < 0:
            return 0.0, mean_rate
        return fixed, 1 / slope


class Busy:
    """Seconds covered by the union of intervals. Intervals may overlap and arrive out of
    order within ``horizon_s`` of the latest end seen; older ones are folded into a total
    (an interval arriving later than that is still added, and counted whole)."""

    __slots__ = ("horizon", "starts", "ends", "closed", "latest")

    def __init__(self, horizon_s: float = 60.0) -> None:
        self.horizon = horizon_s
        self.starts: list[float] = []  # disjoint intervals, sorted
        self.ends: list[float] = []
        self.closed = 0.0
        self.latest = -math.inf

    def add(self, a: float, b: float) -> None:
        if not b > a:
            return
        self.latest = max(self.latest, b)
        S, E = self.starts, self.ends
        i = bisect.bisect_left(E, a)  # the first interval ending at or after a
        j = bisect.bisect_right(S, b)  # the first starting after b
        if i < j:
            a, b = min(a, S[i]), max(b, E[j - 1])
        S[i:j] = [a]
        E[i:j] = [b]
        if len(S) > 256:
            k = bisect.bisect_left(E, self.latest - self.horizon)
            if k:
                self.closed += sum(E[:k]) - sum(S[:k])
                del S[:k], E[:k]

    def seconds(self) -> float:
        return self.closed + sum(self.ends) - sum(self.starts)


class Series:
    """Points ``(t, *values)`` at least ``step`` seconds apart, at most ``cap`` of them: when
    full, every other point goes and the step doubles (a long run's plot at coarser grain).
    Preallocated: the same memory from the first point to the last."""

    __slots__ = ("step", "cap", "_rows", "_n")

    def __init__(self, step: float = 0.05, cap: int = 4096, width: int = 4) -> None:
        import numpy as np

        self.step, self.cap = step, cap
        self._rows = np.zeros((cap + 1, width))
        self._n = 0

    def due(self, t: float) -> bool:
        return not self._n or t - float(self._rows[self._n - 1, 0]) >= self.step

    def add(self, point: tuple[float, ...]) -> None:
        self._rows[self._n] = point
        self._n += 1
        if self._n > self.cap:
            kept = self._rows[: self._n : 2].copy()
            self._n = len(kept)
            self._rows[: self._n] = kept
            self.step *= 2

    @property
    def points(self) -> list[tuple[float, ...]]:
        """The points, oldest first (the time a float, the counts integers)."""
        return [(r[0], *(int(v) for v in r[1:])) for r in self._rows[: self._n].tolist()]


class _Pending:
    """One request's figures while its prefill ranks report: each the slowest rank's."""

    __slots__ = ("grants", "wait", "tokens", "computed", "ttft", "compute", "served", "busy", "outcomes", "state")

    def __init__(self) -> None:
        self.grants = self.computed = self.served = self.outcomes = 0
        self.wait = self.ttft = self.compute = self.busy = 0.0
        self.tokens = 0
        self.state = ""


class PrefillTally:
    """What the prefill ranks' event lines add up to (local mode), in bounded memory: a
    request is held only until every rank reported it; failed requests by id (the report
    names them)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.pending: dict[str, _Pending] = {}
        self.waits = Quantiles()  # prefill's wait for decode blocks (the slowest rank's)
        self.ttfts = Quantiles()  # arrival -> last layer computed
        self.computes = Quantiles()  # grant -> last layer computed
        self.compute_tokens = 0  # prompt tokens of the requests in ``computes``
        self.fit = LineFit()  # (tokens, busy - wait): the planner's prefill cost, less the wait
        self.min_wait = math.inf  # the control round trip: the least wait seen
        self.layer_s = Quantiles()
        self.busy = Busy()  # when some rank was writing
        self.received = 0
        self.failed: dict[str, str] = {}  # request -> reason
        self.summaries: list[dict[str, Any]] = []
        self._ended: dict[str, None] = {}  # recently dropped requests (insertion-ordered)

    def event(self, ev: dict[str, Any]) -> None:
        """Fold one event line of a rank (already parsed JSON); a malformed one raises
        ``KeyError``, ``TypeError`` or ``ValueError``."""
        kind = ev.get("type")
        if kind == "layers":
            for x in ev["s"]:
                self.layer_s.add(float(x))
            for a, b in ev["w"]:
                self.busy.add(float(a), float(b))
            return
        if kind == "summary":
            self.summaries.append(ev)
            return
        if kind not in ("grant", "computed", "served", "outcome"):
            return
        rid = str(ev["rid"])
        if rid in self._ended:
            return
        p = self.pending.get(rid)
        if p is None:
            p = self.pending[rid] = _Pending()
        if kind == "grant":
            p.grants += 1
            p.wait, p.tokens = max(p.wait, float(ev["wait"])), int(ev.get("tokens", 0))
            if p.grants == self.ranks:
                self.waits.add(p.wait)
                self.min_wait = min(self.min_wait, p.wait)
        elif kind == "computed":
            p.computed += 1
            p.ttft, p.compute = max(p.ttft, float(ev["ttft"])), max(p.compute, float(ev["compute"]))
            if p.computed == self.ranks:
                self._computed(p)
        elif kind == "served":
            p.served += 1
            p.busy = max(p.busy, float(ev["busy"]))
            if p.served == self.ranks and p.grants == self.ranks:
                self.fit.add(p.tokens, p.busy - p.wait)
        else:
            p.outcomes += 1
            state = str(ev["state"])
            if state != "received" and not p.state:
                p.state = state
                self.failed[rid] = f"{state}" + (f" ({ev['reason']})" if ev.get("reason") else "")
            if p.outcomes == self.ranks:
                self.received += not p.state
                if p.state or p.served == self.ranks:
                    self._drop(rid)
        if p.served == self.ranks and p.outcomes == self.ranks:
            self._drop(rid)

    def _computed(self, p: _Pending) -> None:
        self.ttfts.add(p.ttft)
        self.computes.add(p.compute)
        self.compute_tokens += p.tokens

    def _drop(self, rid: str) -> None:
        if self.pending.pop(rid, None) is None:
            return
        self._ended[rid] = None
        if len(self._ended) > _LATE:
            del self._ended[next(iter(self._ended))]

    def close(self) -> None:
        """At the report: fold what the ranks that did report said of the requests still
        held (an interrupted run's, a dead rank's)."""
        for p in self.pending.values():
            if 0 < p.grants < self.ranks:
                self.waits.add(p.wait)
                self.min_wait = min(self.min_wait, p.wait)
            if 0 < p.computed < self.ranks:
                self._computed(p)
        self.pending.clear()

    def prefill_fit(self) -> tuple[float, float]:
        """``(fixed_s, tokens_per_s)``: the server's time per request less its wait for
        decode blocks beyond the control round trip (the planner simulates that wait)."""
        return self.fit.fit(shift=self.min_wait if self.fit.n else 0.0)
