"""The scheduler's engine-bound mode (``SchedulerOptions(bind="engine")``, vLLM's
connector): a stateful machine against a model. Every grant is a buffer grant; a received
request waits for the engine to bind it to blocks of the engine's own allocator; the swap
into them is done when the engine says; cancel and failure at every step leave no buffer
block held and never free one of the engine's blocks. Each call's outcome is asserted
exactly (its result, or its error's class and message)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdkv import BlockPool, DecodeScheduler, RequestError, SchedulerOptions, State

B = 12  # buffer blocks
LAYERS = 2


class _Handle:
    def __init__(self) -> None:
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.finished


class _EngineSwaps:
    """The engine's workers: each submitted swap waits until the machine says it ended."""

    def __init__(self) -> None:
        self.handles: dict[str, _Handle] = {}
        self.submitted: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def submit(self, rid, buf, gpu):
        self.submitted.append((rid, tuple(buf), tuple(gpu)))
        h = self.handles[rid] = _Handle()
        return h


class EngineBoundMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.swaps = _EngineSwaps()
        self.s = DecodeScheduler(
            num_layers=LAYERS,
            gpu=None,
            buffer=BlockPool(B),
            swap=self.swaps,
            options=SchedulerOptions(bind="engine", fence_grace_s=0),
        )
        self.free = B  # the model's free buffer blocks
        self.reqs: dict[str, dict] = {}  # rid -> {state, n, token, engine blocks, cancelled}
        self.engine_next = 1000  # the engine's own block ids (pdkv must never free one)
        self.seq = 0

    def _live(self, *states):
        return sorted(r for r, m in self.reqs.items() if m["state"] in states)

    @rule(n=st.integers(1, 8))
    def reserve(self, n):
        self.seq += 1
        rid = f"r{self.seq}"
        res = self.s.reserve(rid, num_blocks=n)
        if n <= self.free:
            assert (res.outcome, len(res.grant.blocks)) == ("buffer", n)
            self.free -= n
            self.reqs[rid] = {"state": State.RESERVED, "n": n, "token": res.grant.token, "bound": ()}
        else:
            assert (res.outcome, res.reason) == ("rejected", "no free GPU or buffer blocks")

    def test_bigger_than_the_buffer_is_refused(self):
        with pytest.raises(RequestError, match=rf"needs {B + 1} blocks: more than the buffer holds \({B}\)"):
            self.s.reserve("huge", num_blocks=B + 1)

    @precondition(lambda self: self._live(State.RESERVED))
    @rule(data=st.data())
    def receive(self, data):
        rid = data.draw(st.sampled_from(self._live(State.RESERVED)))
        m = self.reqs[rid]
        assert self.s.land_layers(rid, m["token"], range(LAYERS)) == LAYERS
        assert self.s.complete(rid, m["token"]) is State.RECEIVED
        m["state"] = State.RECEIVED

    @precondition(lambda self: self._live(State.RECEIVED))
    @rule(data=st.data())
    def bind(self, data):
        rid = data.draw(st.sampled_from(self._live(State.RECEIVED)))
        m = self.reqs[rid]
        first = data.draw(st.integers(0, m["n"] - 1))
        blocks = list(range(self.engine_next, self.engine_next + m["n"] - first))
        self.engine_next += len(blocks)
        buf = self.s.bind(rid, blocks, first_block=first)
        assert len(buf) == m["n"] - first
        assert self.swaps.submitted[-1] == (rid, buf, tuple(blocks))
        self.free += first  # the blocks the engine computed itself go back at once
        m.update(state=State.SWAPPING, n=m["n"] - first, bound=tuple(blocks))

    @precondition(lambda self: self._live(State.RESERVED, State.SWAPPING, State.READY))
    @rule(data=st.data(), n=st.integers(0, 3))
    def bind_refused(self, data, n):
        """Only a received request can be bound; and only to one block per received block."""
        rid = data.draw(st.sampled_from(self._live(State.RESERVED, State.SWAPPING, State.READY)))
        state = self.reqs[rid]["state"]
        with pytest.raises(RequestError) as e:
            self.s.bind(rid, list(range(n)))
        assert str(e.value) == f"request {rid!r} is {state.value}, not received; it cannot be bound"

    @precondition(lambda self: self._live(State.RECEIVED))
    @rule(data=st.data())
    def bind_wrong_blocks(self, data):
        rid = data.draw(st.sampled_from(self._live(State.RECEIVED)))
        n = self.reqs[rid]["n"]
        with pytest.raises(RequestError, match=rf"{n + 1} GPU blocks for {n} received blocks"):
            self.s.bind(rid, list(range(n + 1)))
        with pytest.raises(RequestError, match="GPU blocks must be distinct non-negative ids"):
            self.s.bind(rid, [7] * n if n > 1 else [-1])
        with pytest.raises(RequestError, match=rf"first_block={n} must be in \[0, {n}\)"):
            self.s.bind(rid, [], first_block=n)

    @precondition(lambda self: self._live(State.RECEIVED))
    @rule(data=st.data())
    def release(self, data):
        """An engine whose own pages received the KV takes them in place: no swap."""
        rid = data.draw(st.sampled_from(self._live(State.RECEIVED)))
        self.s.release(rid)
        self.free += self.reqs[rid]["n"]
        self.reqs[rid]["state"] = State.FINISHED

    @precondition(lambda self: self._live(State.RESERVED, State.SWAPPING, State.READY))
    @rule(data=st.data())
    def release_refused(self, data):
        rid = data.draw(st.sampled_from(self._live(State.RESERVED, State.SWAPPING, State.READY)))
        state = self.reqs[rid]["state"]
        with pytest.raises(RequestError) as e:
            self.s.release(rid)
        assert str(e.value) == f"request {rid!r} is {state.value}, not received; it cannot be released"

    @precondition(lambda self: self._live(State.SWAPPING))
    @rule(data=st.data(), ok=st.booleans())
    def swap_ends(self, data, ok):
        rid = data.draw(st.sampled_from(self._live(State.SWAPPING)))
        m = self.reqs[rid]
        h = self.swaps.handles.pop(rid)
        h.error = None if ok else RuntimeError("a worker's copy failed")
        h.finished = True
        self.s.tick()
        self.free += m["n"]  # the buffer blocks go back either way; the engine's blocks stay the engine's
        if not ok:
            m["state"] = State.FAILED  # a failed copy ends it as failed, cancelled or not
        else:
            m["state"] = State.ABORTED if m.get("cancelled") else State.READY

    @precondition(lambda self: self._live(State.READY))
    @rule(data=st.data(), free=st.booleans())
    def finish(self, data, free):
        rid = data.draw(st.sampled_from(self._live(State.READY)))
        taken = {r.request_id: r for r in self.s.take_ready()}
        if rid in taken:
            assert taken[rid].gpu_blocks == self.reqs[rid]["bound"]
        self.s.finish(rid, free_gpu_blocks=free)  # free or not: the engine's blocks are never pdkv's
        self.reqs[rid]["state"] = State.FINISHED

    @precondition(lambda self: self._live(State.RESERVED, State.RECEIVED, State.SWAPPING, State.READY))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self._live(State.RESERVED, State.RECEIVED, State.SWAPPING, State.READY)))
        m = self.reqs[rid]
        self.s.abort(rid, "cancelled")
        if m["state"] is State.SWAPPING:  # the copy still writes: it ends first
            m["cancelled"] = True
            return
        if m["state"] in (State.RESERVED, State.RECEIVED):
            self.free += m["n"]
        m["state"] = State.ABORTED

    @invariant()
    def accounts(self):
        assert self.s.buffer.num_free == self.free
        self.s.check_invariants()
        for rid, m in self.reqs.items():
            assert self.s.request(rid).state is m["state"], rid
            if m["state"] in (State.SWAPPING, State.READY):
                assert self.s.request(rid).gpu_blocks == m["bound"]


EngineBoundMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestEngineBound = EngineBoundMachine.TestCase


def test_bind_needs_the_engine_mode():
    s = DecodeScheduler(num_layers=1, gpu=BlockPool(4), buffer=BlockPool(4), swap=_EngineSwaps())
    with pytest.raises(RequestError, match=r"^bind\(\) is for SchedulerOptions\(bind='engine'\); pdkv allocates GPU"):
        s.bind("x", [1])
    with pytest.raises(RequestError, match=r"^release\(\) is for SchedulerOptions\(bind='engine'\); pdkv hands out"):
        s.release("x")
    with pytest.raises(
        ValueError, match=r"^gpu=None needs SchedulerOptions\(bind='engine'\): the engine binds GPU blocks itself$"
    ):
        DecodeScheduler(num_layers=1, gpu=None, buffer=BlockPool(4), swap=_EngineSwaps())
    with pytest.raises(ValueError, match="bind='x' must be 'pdkv' or 'engine'"):
        SchedulerOptions(bind="x")


def test_bind_checks_each_argument_then_times_and_counts_the_swap():
    t = [0.0]
    swaps = _EngineSwaps()
    s = DecodeScheduler(
        num_layers=1,
        gpu=None,
        buffer=BlockPool(8),
        swap=swaps,
        block_bytes=100,
        options=SchedulerOptions(bind="engine"),
        clock=lambda: t[0],
    )
    t[0] = 1.0
    r = s.reserve("a", num_blocks=5)
    s.land_layers("a", r.grant.token, range(1))
    s.complete("a", r.grant.token)
    for first in (True, -1, 5, 1.0):
        with pytest.raises(RequestError, match=rf"^request 'a': first_block={first!r} must be in \[0, 5\)$"):
            s.bind("a", [0, 1, 2, 3], first_block=first)
    with pytest.raises(RequestError, match=r"^request 'a': 4 GPU blocks for 3 received blocks$"):
        s.bind("a", [0, 1, 2, 3], first_block=2)
    for bad in ([0, 1, -1], [0, 1, 2.0], [0, 1, "2"], [0, 1, 1]):
        with pytest.raises(RequestError, match=r"^request 'a': GPU blocks must be distinct non-negative ids$"):
            s.bind("a", bad, first_block=2)
    assert s.request("a").state is State.RECEIVED and s.buffer.num_free == 3
    t[0] = 3.0
    assert s.bind("a", [0, 1, 2], first_block=2) == r.grant.blocks[2:]  # block 0 is an id like any other
    info = s.request("a")
    assert (info.state, info.num_blocks, info.gpu_blocks) == (State.SWAPPING, 3, (0, 1, 2))
    assert s.buffer.num_free == 5 and s.metrics()["prefill_wait_avoided_seconds_sum"] == 2.0  # reserved at 1
    t[0] = 5.5
    swaps.handles["a"].finished = True
    s.tick()
    m = s.metrics()
    assert s.request("a").state is State.READY and s.buffer.num_free == 8
    assert (m["swap_busy_seconds"], m["swap_seconds_sum"], m["swap_bytes"]) == (2.5, 2.5, 300)
    r = s.reserve("b", num_blocks=1)  # at 5.5
    s.land_layers("b", r.grant.token, range(1))
    s.complete("b", r.grant.token)
    t[0] = 6.0
    s.bind("b", [7])
    assert s.metrics()["prefill_wait_avoided_seconds_sum"] == 2.5  # the sum of both waits
    swaps.handles["b"].finished = True
    s.tick()
    m = s.metrics()
    assert (m["requests_ready"], m["swaps_completed"], m["swap_bytes"]) == (2, 2, 400)


def test_an_engine_bound_scheduler_never_frees_a_gpu_block():
    from pdkv.scheduling.core import _EngineBlocks

    e = _EngineBlocks()
    assert (e.num_free, e.num_total, e.try_allocate(1)) == (0, 0, None)
    with pytest.raises(AssertionError, match="^pdkv frees no GPU block of an engine-bound scheduler$"):
        e.free([1])


def test_a_released_request_is_finished_not_aborted(caplog):
    """The engine took the pages in place: counted as finished, no abort logged or emitted."""
    events: list = []
    s = DecodeScheduler(
        num_layers=1,
        gpu=None,
        buffer=BlockPool(4),
        swap=_EngineSwaps(),
        options=SchedulerOptions(bind="engine"),
        listener=events.append,
    )
    g = s.reserve("a", num_blocks=3).grant
    s.land_layers("a", g.token, [0])
    assert s.complete("a", g.token) is State.RECEIVED
    events.clear()
    with caplog.at_level("INFO", logger="pdkv"):
        s.release("a")
    assert s.request("a").state is State.FINISHED
    assert s.buffer.num_free == 4
    m = s.metrics()
    assert (m["requests_finished"], m["requests_aborted"]) == (1, 0)
    assert not [r for r in caplog.records if "abort" in r.getMessage()]
    assert not [e for e in events if e.kind.value in ("aborted", "failed")]
    with pytest.raises(RequestError, match="request 'a' is already finished"):
        s.release("a")
