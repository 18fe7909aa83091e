"""check_invariants (scheduling/view.py) names the pool of each corruption: by the pool's
own name, or by its role when an engine's allocator has none; with the GPU blocks the
engine's, the buffer is still checked. test_scheduler.py hands it one corruption at a time."""

from __future__ import annotations

import pytest
from test_scheduler import FakeHandle, FakeSwap, _ready

from pdkv.scheduling.blocks import BlockPool
from pdkv.scheduling.scheduler import DecodeScheduler, SchedulerOptions


class _NamelessPool:
    """An engine's allocator as check_invariants sees it: ids, no ``name``."""

    def __init__(self, pool):
        self._p = pool

    def __getattr__(self, attr):
        if attr == "name":
            raise AttributeError(attr)
        return getattr(self._p, attr)


def _named_requests(gpu_name, buffer_name):
    s = DecodeScheduler(
        num_layers=1,
        gpu=BlockPool(8, name=gpu_name),
        buffer=BlockPool(4, name=buffer_name),
        swap=FakeSwap(),
        options=SchedulerOptions(direct_to_gpu=False, fence_grace_s=1.0),
    )
    s.reserve("a", num_blocks=2)
    s.reserve("b", num_blocks=2)
    return s


@pytest.mark.parametrize(
    "wrap, gpu, buf",
    [(lambda p: p, "G", "B"), (_NamelessPool, "gpu", "buffer")],
    ids=["named pools", "an engine's nameless allocators"],
)
def test_check_invariants_names_each_pool_by_its_name(wrap, gpu, buf):
    """Corruptions in either pool are named by the pool's own name, or by its role when the
    allocator has none."""
    s = _named_requests("G", "B")
    s.gpu, s.buffer = wrap(s.gpu), wrap(s.buffer)
    s._reqs["b"].buffer_blocks[0] = 1
    with pytest.raises(AssertionError, match=f"^{buf}: block 1 held by a and b$"):
        s.check_invariants()
    s = _named_requests("G", "B")
    s.gpu, s.buffer = wrap(s.gpu), wrap(s.buffer)
    _ready(s, "a", [3], [])
    _ready(s, "b", [3], [])
    with pytest.raises(AssertionError, match=f"^{gpu}: block 3 held by a and b$"):
        s.check_invariants()
    s = _named_requests("G", "B")
    s.gpu, s.buffer = wrap(s.gpu), wrap(s.buffer)
    _ready(s, "a", [5], [])
    s.fail("b", "x")
    s._quarantine[0].pool, s._quarantine[0].blocks = s.gpu, [5]
    with pytest.raises(AssertionError, match=f"^{gpu}: quarantined block 5 also held by a$"):
        s.check_invariants()


def test_check_invariants_checks_the_buffer_when_the_gpu_is_the_engines():
    """Engine-bound (no GPU pool of pdkv's): the buffer is still checked."""

    class Swaps:
        def submit(self, rid, buf, gpu):
            return FakeHandle()

    s = DecodeScheduler(
        num_layers=1, gpu=None, buffer=BlockPool(4, name="B"), swap=Swaps(), options=SchedulerOptions(bind="engine")
    )
    s.reserve("a", num_blocks=2)
    s.check_invariants()
    s.buffer.free([1])
    with pytest.raises(AssertionError, match="^B: block 1 of a is free in the pool$"):
        s.check_invariants()
