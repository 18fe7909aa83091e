"""The tool's streaming statistics (``pdkv.cli.transfer_tool.stats``) against exact models:
numpy's percentiles and fits, a naive interval union, and the per-request dictionaries the
tool kept before; and the bound on what they hold."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.cli.transfer_tool.stats import Busy, LineFit, PrefillTally, Quantiles, Series

values = st.lists(
    st.one_of(st.just(0.0), st.floats(min_value=1e-7, max_value=1e4, allow_nan=False)), min_size=1, max_size=300
)


def nearest_rank(xs, q):
    s = sorted(xs)
    return s[max(1, math.ceil(q / 100 * len(s))) - 1]


@settings(max_examples=200, deadline=None)
@given(values, st.sampled_from([0, 1, 5, 50, 90, 99, 99.9, 100]))
def test_quantiles_within_one_bucket_of_the_exact_rank(xs, q):
    s = Quantiles()
    for x in xs:
        s.add(x)
    want = nearest_rank(xs, q)
    got = s.percentile(q)
    assert want / 1.0101 - 1e-9 <= got <= want * 1.0101 + 1e-9, (want, got)
    assert (s.n, s.lo, s.hi) == (len(xs), min(xs), max(xs))
    assert s.total == pytest.approx(sum(xs)) and s.mean() == pytest.approx(sum(xs) / len(xs))
    assert s.percentile(100) == max(xs) and s.percentile(0) == min(xs)


@settings(max_examples=100, deadline=None)
@given(values, values)
def test_quantiles_merge_and_json_equal_one_sketch_of_everything(xs, ys):
    a, b, both = Quantiles(), Quantiles(), Quantiles()
    for x in xs:
        a.add(x)
        both.add(x)
    for y in ys:
        b.add(y)
        both.add(y)
    a.merge(Quantiles.from_json(b.to_json()))
    ja, jb = a.to_json(), both.to_json()
    assert ja.pop("total") == pytest.approx(jb.pop("total")) and ja == jb
    for q in (1, 50, 99):
        assert a.percentile(q) == both.percentile(q)


def test_quantiles_empty_refusals_and_bound():
    s = Quantiles()
    assert math.isnan(s.percentile(50)) and math.isnan(s.mean()) and len(s) == 0
    with pytest.raises(ValueError, match="not a finite value"):
        s.add(math.nan)
    for bad in (
        {},
        {"n": 2, "zeros": 0, "total": 1.0, "buckets": [[1, 1]], "lo": 1, "hi": 1},
        {"n": 1, "zeros": 0, "total": 1.0, "buckets": [[1, -1]], "lo": 1, "hi": 1},
    ):
        with pytest.raises(ValueError, match="not a quantile sketch"):
            Quantiles.from_json(bad)
    # 100,000 values spread over twenty decades: one bucket per 1 % of range, not per value
    rng = np.random.default_rng(0)
    for x in rng.lognormal(0, 6, 100_000):
        s.add(float(x))
    assert s.n == 100_000 and len(s.buckets) <= math.log(s.hi / s.lo) / math.log(1.01) + 2 < 10_000


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10_000), st.floats(0.0, 0.5)), min_size=1, max_size=50))
def test_linefit_is_numpys_least_squares(points):
    from pdkv.cli.transfer_tool.report import fit_prefill

    toks = [t for t, _ in points]
    secs = [0.01 + t / 20_000 + e / 100 for t, e in points]
    fixed, rate = fit_prefill(toks, secs)
    if len(set(toks)) < 2:
        assert (fixed, rate) == (0.0, pytest.approx(sum(toks) / sum(secs)))
        return
    slope, icpt = np.polyfit(toks, secs, 1)
    if slope <= 0 or icpt < 0:
        assert fixed == 0.0 and rate == pytest.approx(sum(toks) / sum(secs))
    else:
        assert fixed == pytest.approx(icpt, abs=1e-9) and rate == pytest.approx(1 / slope, rel=1e-6)


def test_linefit_shift_adds_to_every_y():
    f, g = LineFit(), LineFit()
    for t in (100, 400, 900):
        f.add(t, 0.02 + t / 10_000)
        g.add(t, 0.05 + t / 10_000)
    assert f.fit(shift=0.03) == pytest.approx(g.fit())


def union(ivs):
    total, reach = 0.0, -math.inf
    for a, b in sorted(ivs):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1000), st.floats(0, 5)), max_size=600), st.integers(0, 2**32))
def test_busy_is_the_union_of_intervals_arriving_out_of_order(ivs, seed):
    ivs = [(a, a + d) for a, d in ivs]
    # arrival order: by end, shuffled within 5 s (less than the horizon)
    rng = random.Random(seed)
    order = sorted(ivs, key=lambda iv: iv[1] + rng.uniform(0, 5))
    b = Busy(horizon_s=20.0)
    for a, e in order:
        b.add(a, e)
    assert b.seconds() == pytest.approx(union(ivs), abs=1e-6)
    assert len(b.starts) <= 600


def test_busy_holds_a_bounded_window():
    b = Busy(horizon_s=10.0)
    for i in range(100_000):  # disjoint writes over 100,000 s: folded as they age
        b.add(float(i), i + 0.5)
    assert b.seconds() == pytest.approx(50_000.0) and len(b.starts) <= 300


def test_series_halves_its_resolution_when_full():
    s = Series(step=1.0, cap=100, width=2)
    t = 0.0
    while t < 10_000:
        if s.due(t):
            s.add((t, 7))
        t += 0.5
    assert len(s.points) <= 100 and s.points[0] == (0.0, 7) and s.points[-1][0] > 9_000
    gaps = np.diff([p[0] for p in s.points])
    assert gaps.min() >= 64 and s.step >= 64


def test_prefill_tally_takes_the_slowest_rank_and_forgets_ended_requests():
    """Two ranks report each request; the figures are the slower rank's, exactly as the
    per-request dictionaries gave them, and nothing of an ended request stays."""
    pre = PrefillTally(2)
    rng = np.random.default_rng(1)
    waits, ttfts, busy_wait = [], [], []
    for i in range(20_000):
        rid = f"r{i}"
        w = rng.uniform(0.001, 0.01, 2)
        tt = rng.uniform(0.01, 0.1, 2)
        bz = w + 0.05
        for r in range(2):
            pre.event({"type": "grant", "rid": rid, "wait": w[r], "tokens": 100 + i % 7})
        for r in range(2):
            pre.event({"type": "computed", "rid": rid, "ttft": tt[r], "compute": tt[r] / 2})
            pre.event({"type": "served", "rid": rid, "busy": bz[r]})
            pre.event({"type": "outcome", "rid": rid, "state": "received"})
        waits.append(w.max())
        ttfts.append(tt.max())
        busy_wait.append(bz.max() - w.max())
    assert not pre.pending and len(pre._ended) <= 257 and pre.received == 20_000
    for q in (50, 99):
        assert pre.waits.percentile(q) == pytest.approx(nearest_rank(waits, q), rel=0.0101)
        assert pre.ttfts.percentile(q) == pytest.approx(nearest_rank(ttfts, q), rel=0.0101)
    # late events of an ended request are ignored, not a new record
    pre.event({"type": "served", "rid": "r19999", "busy": 1.0})
    assert not pre.pending
    # a failure on one rank fails the request, named with its reason; the other rank's
    # "received" does not count it received
    pre.event({"type": "outcome", "rid": "x", "state": "failed", "reason": "decode died"})
    pre.event({"type": "outcome", "rid": "x", "state": "received"})
    assert pre.failed == {"x": "failed (decode died)"} and pre.received == 20_000 and not pre.pending
    with pytest.raises(KeyError):
        pre.event({"type": "grant", "rid": "y"})
