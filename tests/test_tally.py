"""pdkv.integrations.core.tally: counters, samples and gauges taken all at once, against a
model; merge of taken tallies; counts from many threads exact."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from pdkv.integrations.core.tally import MAX_SAMPLES, Tally, merge

NAMES = st.sampled_from(["a", "b", "c"])
VALUES = st.one_of(st.integers(-5, 5), st.floats(-1e6, 1e6, allow_nan=False))


class TallyMachine(RuleBasedStateMachine):
    """Every operation against a model; each take compared whole, types included."""

    def __init__(self):
        super().__init__()
        self.t = Tally()
        self.c: dict[str, int] = {}
        self.s: dict[str, list[float]] = {}
        self.g: dict[str, float] = {}

    @rule(name=NAMES, n=st.one_of(st.just(None), st.integers(-3, 10)))
    def count(self, name, n):
        if n is None:
            self.t.count(name)
            n = 1
        else:
            self.t.count(name, n)
        self.c[name] = self.c.get(name, 0) + n

    @rule(name=NAMES, v=VALUES)
    def sample(self, name, v):
        self.t.sample(name, v)
        s = self.s.setdefault(name, [])
        if len(s) < MAX_SAMPLES:
            s.append(float(v))

    @rule(name=NAMES, v=VALUES)
    def gauge(self, name, v):
        self.t.gauge(name, v)
        self.g[name] = float(v)

    @rule()
    def take(self):
        got = self.t.take()
        assert got == {"c": self.c, "s": self.s, "g": self.g}
        assert all(type(x) is float for v in got["s"].values() for x in v)
        assert all(type(x) is float for x in got["g"].values())
        self.c, self.s = {}, {}  # counters and samples start again; gauges stay


TestTally = TallyMachine.TestCase
TestTally.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_samples_past_the_cap_are_dropped_and_the_cap_is_per_name():
    t = Tally()
    for i in range(MAX_SAMPLES + 5):
        t.sample("x", i)
    t.sample("y", 1)
    got = t.take()
    assert got["s"]["x"] == [float(i) for i in range(MAX_SAMPLES)] and got["s"]["y"] == [1.0]
    assert t.take() == {"c": {}, "s": {}, "g": {}}


def test_a_take_is_the_callers_and_later_records_do_not_change_it():
    t = Tally()
    t.count("n")
    t.sample("s", 2)
    t.gauge("g", 3)
    got = t.take()
    t.count("n", 5)
    t.sample("s", 9)
    t.gauge("g", 7)
    assert got == {"c": {"n": 1}, "s": {"s": [2.0]}, "g": {"g": 3.0}}
    assert t.take() == {"c": {"n": 5}, "s": {"s": [9.0]}, "g": {"g": 7.0}}
    assert t.take() == {"c": {}, "s": {}, "g": {"g": 7.0}}  # a gauge is the last value, kept


def test_counts_from_many_threads_are_exact():
    t = Tally()
    n, k = 8, 5000

    def work():
        for _ in range(k):
            t.count("x")
            t.sample("s", 1.0)

    ths = [threading.Thread(target=work) for _ in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    got = t.take()
    assert got["c"] == {"x": n * k} and len(got["s"]["s"]) == MAX_SAMPLES


TALLIES = st.fixed_dictionaries(
    {},
    optional={
        "c": st.dictionaries(NAMES, st.integers(-5, 50), max_size=3),
        "s": st.dictionaries(NAMES, st.lists(st.floats(-10, 10), max_size=6), max_size=3),
        "g": st.dictionaries(NAMES, st.floats(-10, 10), max_size=3),
    },
)


@given(TALLIES, TALLIES)
def test_merge_adds_counters_joins_samples_and_keeps_the_larger_gauge(a, b):
    got = merge(a, b)
    ca, cb = a.get("c", {}), b.get("c", {})
    assert got["c"] == {k: ca.get(k, 0) + cb.get(k, 0) for k in {**ca, **cb}}
    sa, sb = a.get("s", {}), b.get("s", {})
    assert got["s"] == {k: (sa.get(k, []) + sb.get(k, []))[:MAX_SAMPLES] for k in {**sa, **sb}}
    ga, gb = a.get("g", {}), b.get("g", {})
    assert got["g"] == {k: max(v for v in (ga.get(k), gb.get(k)) if v is not None) for k in {**ga, **gb}}


def test_merge_leaves_its_inputs_alone_and_caps_joined_samples():
    a = {"c": {"x": 1}, "s": {"s": [1.0] * (MAX_SAMPLES - 1)}, "g": {"g": 1.0}}
    b = {"c": {"x": 2}, "s": {"s": [2.0, 3.0]}, "g": {"g": 0.5}}
    before = (repr(a), repr(b))
    got = merge(a, b)
    assert (repr(a), repr(b)) == before
    assert got["c"] == {"x": 3} and got["g"] == {"g": 1.0}
    assert got["s"]["s"] == [1.0] * (MAX_SAMPLES - 1) + [2.0]
    got["s"]["s"].append(9.0)
    assert len(a["s"]["s"]) == MAX_SAMPLES - 1  # the merged lists are new ones
    assert merge({}, {}) == {"c": {}, "s": {}, "g": {}}
    assert merge({}, {"g": {"g": -2.0}})["g"] == {"g": -2.0}  # a gauge alone, even negative
