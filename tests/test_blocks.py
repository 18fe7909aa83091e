from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from pdkv.blocks import BlockAllocator, BlockPool, runs_of
from pdkv.errors import BlockError, OutOfBlocksError


def test_lowest_first_and_contiguous():
    p = BlockPool(100)
    assert p.allocate(3) == [0, 1, 2]
    b = p.allocate(4)
    assert b == [3, 4, 5, 6]
    p.free([1])
    assert p.allocate(2) == [1, 7]
    assert isinstance(p, BlockAllocator)


def test_errors_change_nothing():
    p = BlockPool(10, "gpu")
    a = p.allocate(5)
    with pytest.raises(BlockError, match="not in this pool"):
        p.free([3, 10])
    with pytest.raises(BlockError, match="already free"):
        p.free([4, 6])
    with pytest.raises(BlockError, match="duplicate"):
        p.free([1, 1])
    with pytest.raises(OutOfBlocksError, match="asked for 6 blocks, 5 of 10 free"):
        p.allocate(6)
    assert p.try_allocate(6) is None
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            p.try_allocate(bad)
    assert p.num_free == 5
    p.check()
    p.free(a)
    assert p.num_free == 10
    p.check()


@given(st.lists(st.integers(0, 50), unique=True))
def test_runs_cover_exactly(ids):
    ids = sorted(ids)
    runs = runs_of(ids)
    assert [i for s, e in runs for i in range(s, e)] == ids
    assert all(runs[i][1] < runs[i + 1][0] for i in range(len(runs) - 1))


class PoolMachine(RuleBasedStateMachine):
    held = Bundle("held")

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(64)
        self.mine: set[int] = set()

    @rule(target=held, n=st.integers(1, 20))
    def alloc(self, n):
        got = self.pool.try_allocate(n)
        if got is None:
            assert n > 64 - len(self.mine)
            return ()
        assert len(got) == n and not set(got) & self.mine
        self.mine |= set(got)
        return tuple(got)

    @rule(blocks=consumes(held))
    def free(self, blocks):
        self.pool.free(list(blocks))
        self.mine -= set(blocks)

    @rule(blocks=held)
    def double_free(self, blocks):
        if blocks and not set(blocks) & self.mine:
            with pytest.raises(BlockError):
                self.pool.free(list(blocks))

    @invariant()
    def accounting(self):
        assert self.pool.num_free + len(self.mine) == 64
        self.pool.check()


TestPoolMachine = PoolMachine.TestCase


def test_pool_is_thread_safe():
    p = BlockPool(1000)
    errors = []

    def worker():
        try:
            for _ in range(2000):
                b = p.try_allocate(7)
                if b:
                    p.free(b)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and p.num_free == 1000
    p.check()
