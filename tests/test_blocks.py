from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from pdkv.errors import BlockError, OutOfBlocksError
from pdkv.scheduling.blocks import BlockAllocator, BlockPool, runs_of


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


# ------------------------------------------------------------------ a model of the pool

_ID = st.one_of(st.integers(-3, 70), st.sampled_from([1.0, "3", None, True]))


def _expected_free_error(model_free, n_total, blocks):
    """The error BlockPool.free must raise for ``blocks`` (None: it must succeed), in the
    order the pool checks: ids outside the pool, then double frees, then duplicates."""
    ok_ids = [b for b in blocks if type(b) is int and 0 <= b < n_total]
    if len(ok_ids) != len(blocks):
        return "not in this pool"
    if len(set(blocks)) != len(blocks):
        return "duplicate|already free"  # which comes first depends on where the repeat sits
    if any(b in model_free for b in blocks):
        return "already free"
    return None


class ModelPoolMachine(RuleBasedStateMachine):
    """The pool against a model (the set of free ids): every allocation is exactly the n
    lowest free ids, every free succeeds or fails exactly as the model says, whatever the
    input: unsorted, duplicated, foreign (another allocation's), out of range, not ints."""

    N = 64

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(self.N, "m")
        self.free_ids: set[int] = set(range(self.N))
        self.allocs: list[list[int]] = []

    @rule(n=st.integers(-2, 70))
    def allocate(self, n):
        if n <= 0:
            with pytest.raises(ValueError, match="must be a positive integer"):
                self.pool.try_allocate(n)
            return
        got = self.pool.try_allocate(n)
        if n > len(self.free_ids):
            assert got is None
            with pytest.raises(OutOfBlocksError, match=f"asked for {n} blocks, {len(self.free_ids)} of {self.N} free"):
                self.pool.allocate(n)
            return
        assert got == sorted(self.free_ids)[:n]
        self.free_ids -= set(got)
        self.allocs.append(got)

    @rule(data=st.data())
    def free_an_allocation_in_any_order(self, data):
        if not self.allocs:
            return
        blocks = self.allocs.pop(data.draw(st.integers(0, len(self.allocs) - 1)))
        blocks = data.draw(st.permutations(blocks))
        self.pool.free(list(blocks))
        self.free_ids |= set(blocks)

    @rule(data=st.data())
    def free_part_of_an_allocation(self, data):
        if not self.allocs:
            return
        i = data.draw(st.integers(0, len(self.allocs) - 1))
        part = data.draw(st.lists(st.sampled_from(self.allocs[i]), unique=True, min_size=1))
        self.pool.free(part)
        self.allocs[i] = [b for b in self.allocs[i] if b not in part]
        if not self.allocs[i]:
            del self.allocs[i]
        self.free_ids |= set(part)

    @rule(blocks=st.lists(_ID, max_size=6))
    def free_anything(self, blocks):
        want = _expected_free_error(self.free_ids, self.N, blocks)
        before = (self.pool.num_free, bytes(self.pool._held))
        if want is None:
            self.pool.free(blocks)
            self.free_ids |= set(blocks)
            for a in self.allocs:
                a[:] = [b for b in a if b not in blocks]
            self.allocs = [a for a in self.allocs if a]
            return
        with pytest.raises(BlockError, match=want):
            self.pool.free(blocks)
        assert (self.pool.num_free, bytes(self.pool._held)) == before  # refused: nothing changed

    @invariant()
    def matches_the_model(self):
        assert self.pool.num_free == len(self.free_ids)
        assert self.pool.num_held == self.N - len(self.free_ids)
        assert all(self.pool.is_held(b) == (b not in self.free_ids) for b in range(self.N))
        self.pool.check()  # runs exact and maximal


ModelPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestModelPool = ModelPoolMachine.TestCase


@pytest.mark.parametrize(
    "blocks, why",
    [
        ([0, 1, 1, 3], "duplicate"),  # a repeat inside a run-shaped list: never frees block 2
        ([1, 1], "duplicate"),
        ([3, 1, 3], "duplicate"),
        ([5, 0, 5], "duplicate"),
    ],
)
def test_duplicates_are_refused_whatever_their_order(blocks, why):
    p = BlockPool(8)
    p.allocate(8)
    with pytest.raises(BlockError, match=why):
        p.free(blocks)
    assert p.num_free == 0 and all(p.is_held(b) for b in range(8))


def test_unsorted_and_foreign_ids_free_exactly_those():
    p = BlockPool(10, "gpu")
    a, b = p.allocate(4), p.allocate(4)
    p.free([5, 0])  # unsorted, one from each allocation: legal, both go
    assert not p.is_held(5) and not p.is_held(0) and p.num_free == 4 and p.num_held == 6
    p.free([3, 1, 2])
    assert p.num_free == 7 and sorted(p.allocate(7)) == [0, 1, 2, 3, 5, 8, 9]
    p.check()
    assert repr(p) == "<BlockPool 'gpu' 0/10 free>"
    assert a and b


def test_freed_runs_merge_on_both_sides():
    p = BlockPool(9)
    p.allocate(9)
    for blocks in ([1], [3], [2], [7, 8], [0], [5], [4, 6]):
        p.free(blocks)
        p.check()
    assert p._starts == {0: 9}
    assert p.allocate(9) == list(range(9))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3", None])
def test_bad_sizes_and_pool_sizes(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        BlockPool(bad)
    p = BlockPool(4)
    with pytest.raises(ValueError, match=r"cannot allocate n=.* blocks \(must be a positive integer\)"):
        p.try_allocate(bad)


def test_out_of_range_ids_are_named():
    p = BlockPool(4, "buf")
    p.allocate(4)
    with pytest.raises(BlockError, match=r"buf: block ids \[4, -1\] are not in this pool of 4"):
        p.free([4, -1])
    with pytest.raises(BlockError, match=r"buf: block ids \[1.0\] are not in this pool"):
        p.free([1.0])
    p.free([3])
    with pytest.raises(BlockError, match=r"buf: blocks \[3\] are already free \(double free\)"):
        p.free([2, 3])
    assert p.num_free == 1


@given(st.lists(st.integers(0, 40), max_size=30))
def test_runs_of_any_order_are_maximal_and_in_order(ids):
    runs = runs_of(ids)
    assert [i for s, e in runs for i in range(s, e)] == ids  # same ids, same order
    for (_, e0), (s1, _) in zip(runs, runs[1:]):
        assert s1 != e0  # maximal: a run never continues the previous one
    assert runs_of(tuple(ids)) == runs


def test_the_heap_is_compacted_and_stays_exact():
    p = BlockPool(2000)
    held = p.allocate(2000)
    for b in held[::2]:  # many one-block runs: stale heap entries pile up as they are taken
        p.free([b])
    for _ in range(300):
        got = p.allocate(3)  # takes from three runs at once
        p.free(got[::-1])
    p.check()
    assert len(p._heap) <= 4 * len(p._starts) + 64


def test_a_one_block_pool_and_the_default_name():
    p = BlockPool(1)
    assert p.name == "pool" and repr(p) == "<BlockPool 'pool' 1/1 free>"
    assert p.allocate(1) == [0] and p.try_allocate(1) is None
    p.free([0])
    p.check()


def test_messages_list_at_most_eight_ids_and_only_the_offending_ones():
    p = BlockPool(32, "buf")
    p.allocate(32)
    with pytest.raises(BlockError) as e:
        p.free(list(range(40, 50)))  # ten foreign ids
    assert str(e.value) == "buf: block ids [40, 41, 42, 43, 44, 45, 46, 47] are not in this pool of 32"
    p.free([0])  # free, below the run freed next
    p.free(list(range(10, 20)))
    with pytest.raises(BlockError) as e:
        p.free(list(range(8, 22)))  # 8, 9, 20, 21 held; 10-19 already free
    assert str(e.value) == "buf: blocks [10, 11, 12, 13, 14, 15, 16, 17] are already free (double free)"
    with pytest.raises(BlockError) as e:
        p.free(tuple(range(8, 22)))  # the same, not a list: the general path names the same ids
    assert str(e.value) == "buf: blocks [10, 11, 12, 13, 14, 15, 16, 17] are already free (double free)"
    assert p.num_free == 11
    p.check()


def test_an_int_subclass_is_a_count():
    class Count(int):
        pass

    p = BlockPool(8)
    assert p.try_allocate(Count(1)) == [0]
    assert p.try_allocate(Count(2)) == [1, 2]
    assert p.allocate(Count(5)) == [3, 4, 5, 6, 7] and p.try_allocate(Count(1)) is None
    p.check()


def test_non_integer_ids_never_take_the_fast_path():
    p = BlockPool(8)
    p.allocate(8)
    for bad in ([0, 1.0, 2], [0, 1, 2.0, 3], [4, np.float64(5), 6]):
        with pytest.raises(BlockError, match="are not in this pool"):
            p.free(bad)
    p.free([np.int64(0), np.int32(1), 2])  # numpy integers are ids
    assert p.num_free == 3
    p.check()


def _pool_with_a_hole():
    """8 blocks, all held but 2 and 3: one free run [2, 4)."""
    p = BlockPool(8, name="p")
    p.allocate(8)
    p.free([2, 3])
    p.check()
    return p


def _split(p):  # the run [2, 4) listed as [2, 3) and [3, 4)
    p._starts, p._ends, p._heap = {2: 3, 3: 4}, {3: 2, 4: 3}, [2, 3]


def _free_beside(p, b):  # block b marked free and counted, but no run covers it
    p._held[b] = 0
    p._free += 1


def _beside_and_listed(p, b):  # block b free and counted, listed as a run of its own
    _free_beside(p, b)
    p._starts[b], p._ends[b + 1] = b + 1, b


CORRUPTIONS = [
    ("a held block inside a free run", lambda p: p._held.__setitem__(2, 1),
     "p: 1 blocks are marked free, but the free count is 2"),
    ("the free count off by one", lambda p: setattr(p, "_free", 3),
     "p: 2 blocks are marked free, but the free count is 3"),
    ("a run end left behind", lambda p: p._ends.__setitem__(7, 6), "p: 1 free runs start but 2 end"),
    ("a run end naming another start", lambda p: p._ends.__setitem__(4, 1),
     "p: free run 2-4 ends at 4, which names the run from 1"),
    ("an empty run", lambda p: (p._starts.__setitem__(5, 5), p._ends.__setitem__(5, 5)),
     "p: free run 5-5 is empty or outside 0-8"),
    ("a run past the pool", lambda p: (p._starts.__setitem__(2, 9), p._ends.pop(4), p._ends.__setitem__(9, 2)),
     "p: free run 2-9 is empty or outside 0-8"),
    ("a run over held blocks", lambda p: (p._starts.__setitem__(2, 5), p._ends.pop(4), p._ends.__setitem__(5, 2)),
     "p: free run 2-5 holds held block 4"),
    ("a run over two held blocks", lambda p: (p._starts.__setitem__(2, 6), p._ends.pop(4), p._ends.__setitem__(6, 2)),
     "p: free run 2-6 holds held block 4"),  # the first of them
    ("two touching runs not merged", _split, "p: free runs 2-3 and 3-4 are not merged"),
    ("a free block before a run, listed alone", lambda p: _beside_and_listed(p, 1),
     "p: free runs 1-2 and 2-4 are not merged"),
    ("a free block after a run, listed alone", lambda p: _beside_and_listed(p, 4),
     "p: free runs 2-4 and 4-5 are not merged"),
    ("a free block before a run, in no run", lambda p: _free_beside(p, 1),
     "p: free run 2-4 is not maximal: block 1 before it is free"),
    ("a free block after a run, in no run", lambda p: _free_beside(p, 4),
     "p: free run 2-4 is not maximal: block 4 after it is free"),
    ("a free block apart, in no run", lambda p: _free_beside(p, 6),
     "p: free runs cover 2 blocks, but the free count is 3"),
    ("a run start missing from the heap", lambda p: setattr(p, "_heap", []), "p: free run 2-4 missing from the heap"),
]  # fmt: skip


@pytest.mark.parametrize("corrupt, why", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_check_names_each_corruption(corrupt, why):
    p = _pool_with_a_hole()
    corrupt(p)
    with pytest.raises(AssertionError) as e:
        p.check()
    assert str(e.value) == why


@pytest.mark.parametrize(
    "free, why", [([0, 1], "block 2 after"), ([6, 7], "block 5 before"), ([1, 2], "block 0 before")]
)
def test_check_names_a_run_at_either_end_of_the_pool_that_is_not_maximal(free, why):
    p = BlockPool(8, name="p")
    p.allocate(8)
    p.free(free)
    p.check()
    b = int(why.split()[1])
    _free_beside(p, b)
    with pytest.raises(
        AssertionError, match=f"^p: free run {free[0]}-{free[-1] + 1} is not maximal: {why} it is free$"
    ):
        p.check()


def test_heap_compaction_on_the_multi_run_path():
    p = BlockPool(2000)
    p.allocate(2000)
    for b in range(0, 2000):
        if b != 5:
            p.free([b])  # each merges with its left neighbour: stale heap entries would pile up
            assert len(p._heap) <= 4 * len(p._starts) + 64  # free compacts the heap past its bound
    got = p.allocate(10)  # the lowest run [0, 5) is too short: the multi-run path, then compaction
    assert got == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert set(p._heap) >= set(p._starts) and len(p._heap) <= 4 * len(p._starts) + 64
    assert p.allocate(3) == [11, 12, 13]
    p.check()


def test_a_pool_that_takes_its_lowest_run_keeps_its_heap_bounded():
    """Allocate and free the same lowest blocks, as a scheduler's steady state does: every free
    pushed the run's start again and the fast path never dropped the repeats, so the heap grew
    by one entry a request (1.4 MB after 170,000 lifecycles), for ever."""
    p = BlockPool(64)
    for _ in range(100_000):
        p.free(p.allocate(2))
    assert len(p._heap) <= 4 * len(p._starts) + 64
    p.check()


def test_a_multi_run_allocation_compacts_the_heap_it_emptied():
    # 1,000 single free blocks below 2,000, and above it one run made of 4,000 blocks freed
    # odd ones first: many of its old starts stay in the heap (lazily deleted), within the
    # bound of free(). Taking the 1,000 singles leaves one run: the heap is rebuilt from it.
    p = BlockPool(6000)
    p.allocate(6000)
    for b in range(1, 2000, 2):
        p.free([b])
    for b in range(2001, 6000, 2):
        p.free([b])
    for b in range(2002, 6000, 2):
        p.free([b])
    assert len(p._starts) == 1001 and len(p._heap) > 1000 + 4 * 1 + 64  # past the bound once the singles go
    got = p.allocate(1000)
    assert got == list(range(1, 2000, 2))
    assert p._heap == [2001] and p._starts == {2001: 6000}
    assert p.allocate(3) == [2001, 2002, 2003]
    p.check()
