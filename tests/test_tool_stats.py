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


# ---- exact figures at each edge (what the streaming checks above leave loose)


def test_quantiles_edges_exactly():
    empty = Quantiles()
    assert empty.to_json() == {"n": 0, "total": 0.0, "lo": 0.0, "hi": 0.0, "zeros": 0, "buckets": []}
    back = Quantiles.from_json(empty.to_json())  # an empty sketch (a rank that saw nothing) reads back
    assert back.n == 0 and math.isnan(back.percentile(50))
    tiny = Quantiles()
    tiny.add(1e-9)  # at the zero threshold: a zero
    tiny.add(2e-9)
    assert tiny.zeros == 1 and sum(tiny.buckets.values()) == 1
    # values 2 % apart each fall in a bucket of their own: the nearest rank is exact to 1 %
    s = Quantiles()
    xs = [1.02**i for i in range(1000)]
    for x in xs:
        s.add(x)
    for q in (10, 50, 90, 99):
        want = xs[math.ceil(q / 100 * 1000) - 1]
        assert want / 1.006 <= s.percentile(q) <= want * 1.006, q
    refusals = [
        ({"n": 0, "zeros": -1, "total": 0.0, "buckets": [[1, 1]]}, "not a quantile sketch: negative counts"),
        ({"n": -1, "zeros": 0, "total": 0.0, "buckets": [], "lo": 0, "hi": 0},
         "not a quantile sketch: negative counts"),
        ({"n": 0, "zeros": 0, "total": 0.0, "buckets": [[1, 0]]}, "not a quantile sketch: negative counts"),
        ({"n": 3, "zeros": 1, "total": 1.0, "buckets": [[1, 1]], "lo": 0, "hi": 1},
         "not a quantile sketch: bucket counts do not add up to n"),
    ]  # fmt: skip
    for d, msg in refusals:
        with pytest.raises(ValueError) as e:
            Quantiles.from_json(d)
        assert str(e.value) == msg


def test_linefit_edges_exactly():
    assert LineFit().fit() == (0.0, 0.0) and LineFit().fit(shift=1.0) == (0.0, 0.0)
    zero = LineFit()
    zero.add(100, 0.0)
    zero.add(200, 0.0)
    assert zero.fit() == (0.0, 0.0)  # no time at all: no rate
    flat = LineFit()  # the same time at every size: a slope of 0, the mean rate
    flat.add(100, 1.0)
    flat.add(300, 1.0)
    assert flat.fit() == (0.0, 200.0)
    falling = LineFit()  # a negative slope with a positive fixed part: the mean rate
    falling.add(100, 1.0)
    falling.add(300, 0.5)
    assert falling.fit() == (0.0, 400 / 1.5)
    below = LineFit()  # a negative fixed part: the mean rate
    below.add(100, 0.1)
    below.add(300, 0.5)
    assert below.fit() == (0.0, 400 / 0.6)
    line = LineFit()
    line.add(100, 0.2)
    line.add(300, 0.3)
    fixed, rate = line.fit()
    assert fixed == pytest.approx(0.15) and rate == pytest.approx(2000.0)


def test_busy_edges_exactly():
    b = Busy()
    assert b.horizon == 60.0
    b.add(1.0, 1.0)  # empty and reversed intervals add nothing, not even an entry
    b.add(2.0, 1.0)
    assert b.seconds() == 0.0 and b.starts == [] and b.ends == []
    # past 256 disjoint intervals the ones older than the horizon fold, exactly then
    c = Busy(horizon_s=0.0)
    for i in range(256):
        c.add(float(i), i + 0.5)
    assert len(c.starts) == 256 and c.closed == 0.0
    c.add(256.0, 256.5)
    assert len(c.starts) == 1 and c.closed == 128.0 and c.seconds() == 128.5
    # within the horizon nothing folds: a late copy of an early interval is not counted twice
    d = Busy(horizon_s=1000.0)
    for i in range(300):
        d.add(float(i), i + 0.5)
    d.add(100.0, 100.5)
    assert d.seconds() == 150.0 and d.closed == 0.0


def test_series_edges_exactly():
    s = Series()
    assert (s.step, s.cap) == (0.05, 4096) and s.due(0.0)
    s.add((0.0, 1, 2, 3))
    assert s.points == [(0.0, 1, 2, 3)]
    t = Series(step=1.0, cap=4, width=2)
    t.add((0.0, 0))
    assert not t.due(0.5) and t.due(1.0)  # a step apart, not more
    t.add((1.0, 1))
    assert not t.due(1.5) and t.due(2.0)  # from the latest point
    t.add((2.0, 2))
    t.add((3.0, 3))
    assert [p[0] for p in t.points] == [0.0, 1.0, 2.0, 3.0] and t.step == 1.0  # full, not past it
    t.add((4.0, 4))  # past the cap: every other point goes, the step doubles
    assert t.points == [(0.0, 0), (2.0, 2), (4.0, 4)] and t.step == 2.0


def _ev(kind, rid, **kw):
    return {"type": kind, "rid": rid, **kw}


def test_prefill_tally_every_event_exactly():
    p = PrefillTally(2)
    p.event({"type": "layers", "s": [0.25, 0.5], "w": [[0.0, 1.0], [0.5, 2.0]]})
    p.event({"type": "summary", "rank": 0, "sent": 3})
    p.event({"type": "other", "rid": "zz"})
    assert (p.layer_s.n, p.layer_s.total, p.busy.seconds()) == (2, 0.75, 2.0)
    assert p.summaries == [{"type": "summary", "rank": 0, "sent": 3}] and not p.pending
    assert p.compute_tokens == 0 and p.min_wait == math.inf and p.prefill_fit() == (0.0, 0.0)
    # request a: both ranks, the slower rank's figures
    p.event(_ev("grant", "a", wait=0.25, tokens=100))
    assert p.waits.n == 0 and p.min_wait == math.inf  # one rank of two
    p.event(_ev("grant", "a", wait=0.5, tokens=100))
    assert (p.waits.n, p.waits.total, p.min_wait) == (1, 0.5, 0.5)
    p.event(_ev("computed", "a", ttft=1.0, compute=0.75))
    assert p.ttfts.n == 0
    p.event(_ev("computed", "a", ttft=2.0, compute=0.5))
    assert (p.ttfts.total, p.computes.total, p.compute_tokens) == (2.0, 0.75, 100)
    p.event(_ev("served", "a", busy=1.5))
    assert p.fit.n == 0
    p.event(_ev("outcome", "a", state="received"))
    assert p.received == 0 and "a" in p.pending  # one outcome of two
    p.event(_ev("served", "a", busy=1.0))
    assert (p.fit.n, p.fit.sx, p.fit.sy) == (1, 100.0, 1.0)  # busy 1.5 less wait 0.5
    p.event(_ev("outcome", "a", state="received"))
    assert p.received == 1 and not p.pending and list(p._ended) == ["a"]
    # request b: no tokens given (0), failed on one rank without a reason
    p.event(_ev("grant", "b", wait=0.125))
    p.event(_ev("grant", "b", wait=0.125))
    p.event(_ev("computed", "b", ttft=0.5, compute=0.25))
    p.event(_ev("computed", "b", ttft=0.5, compute=0.25))
    assert p.compute_tokens == 100 and p.min_wait == 0.125
    p.event(_ev("outcome", "b", state="failed"))
    p.event(_ev("outcome", "b", state="received"))
    assert p.failed == {"b": "failed"} and p.received == 1 and not p.pending
    p.event(_ev("served", "b", busy=9.0))  # late: b ended, nothing new
    assert not p.pending and p.fit.n == 1
    # the fit is shifted by the least wait seen (the control round trip)
    assert p.prefill_fit() == p.fit.fit(shift=0.125)
    # computed with no grant seen: no tokens counted
    p.event(_ev("computed", "c", ttft=0.5, compute=0.25))
    p.event(_ev("computed", "c", ttft=0.5, compute=0.25))
    assert p.compute_tokens == 100


def test_prefill_tally_outcomes_before_served():
    """A rank's outcome may come before its served line: the request stays until both are
    in from every rank, then its fit point is added and it is dropped."""
    p = PrefillTally(2)
    for _ in range(2):
        p.event(_ev("grant", "a", wait=0.25, tokens=10))
    for _ in range(2):
        p.event(_ev("outcome", "a", state="received"))
    assert p.received == 1 and "a" in p.pending and p.fit.n == 0
    p.event(_ev("served", "a", busy=1.0))
    assert "a" in p.pending
    p.event(_ev("served", "a", busy=1.25))
    assert not p.pending and list(p._ended) == ["a"] and (p.fit.n, p.fit.sx, p.fit.sy) == (1, 10.0, 1.0)


def test_prefill_tally_close_folds_what_some_ranks_reported():
    p = PrefillTally(3)
    p.event(_ev("grant", "half", wait=0.5, tokens=10))  # 1 of 3 ranks granted and computed
    p.event(_ev("computed", "half", ttft=1.0, compute=0.5))
    p.event(_ev("outcome", "none", state="failed", reason="x"))  # no grant, no compute
    for _ in range(3):  # every rank granted and computed: counted already, not again at close
        p.event(_ev("grant", "all", wait=0.25, tokens=20))
        p.event(_ev("computed", "all", ttft=2.0, compute=1.0))
    assert (p.waits.n, p.ttfts.n, p.compute_tokens, p.min_wait) == (1, 1, 20, 0.25)
    p.close()
    assert not p.pending
    assert (p.waits.n, p.waits.total, p.min_wait) == (2, 0.75, 0.25)
    assert (p.ttfts.n, p.ttfts.total, p.computes.total, p.compute_tokens) == (2, 3.0, 1.5, 30)
    q = PrefillTally(2)
    q.event(_ev("grant", "r", wait=0.0625))
    q.close()
    assert q.min_wait == 0.0625 and q.waits.total == 0.0625


def test_prefill_tally_remembers_the_last_256_ended_requests():
    p = PrefillTally(1)
    for i in range(300):
        p.event(_ev("outcome", f"f{i}", state="failed", reason="r"))  # failed: ended at once
    assert len(p._ended) == 256 and next(iter(p._ended)) == "f44" and not p.pending
    p.event(_ev("grant", "f299", wait=0.5))  # late, remembered: ignored
    assert not p.pending
    p.event(_ev("grant", "f0", wait=0.5))  # forgotten: taken for a new request
    assert list(p.pending) == ["f0"]
