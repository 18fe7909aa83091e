"""vLLM's decode halves in one thread: the scheduler half (:class:`DecodeSide`) with a
clock the test moves and prefill played on its scheduler directly (reserve, land, complete:
what the receiver does for a peer), each of vLLM's calls answered exactly; and the worker
half (:class:`LoadWorker`) against a scripted swap engine and against a real buffer.

tests/test_vllm_parts.py runs both halves with a real prefill over the network."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import zmq
from ports import free_port

from pdkv import CacheSpec, SharedBuffer
from pdkv.errors import PdkvError
from pdkv.integrations.vllm import consumer, loader
from pdkv.integrations.vllm.consumer import DecodeSide, LoadWorker, WorkerSwaps
from pdkv.integrations.vllm.settings import (
    PARAM_CAP,
    PARAM_ID,
    Load,
    StepMeta,
    binding_of,
    layout_for,
    parse_settings,
    token_digest,
)
from pdkv.scheduling.lifecycle import State

LAY = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=8, dtype="torch.float32", tp_size=1, tp_rank=0)
LIMIT = 5.0  # load_timeout_s


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cap(pid):
    return f"cap-of-{pid}"


def _params(pid):
    """What prefill's answer carries: the id and the capability."""
    return {"do_remote_prefill": True, PARAM_ID: pid, PARAM_CAP: _cap(pid) if isinstance(pid, str) else None}


def _prompt(n):
    return list(range(n))


class Decode:
    """A DecodeSide of 12 buffer blocks on a test clock, with prefill played on its
    scheduler."""

    def __init__(self, recompute=False, **extra):
        self.lay = layout_for(**LAY, order=("head", False))
        self.clock = Clock()
        cfg = {"buffer_blocks": 12, "load_timeout_s": LIMIT, **extra}
        self.d = DecodeSide(parse_settings("kv_consumer", "d", cfg), [self.lay], recompute=recompute, clock=self.clock)
        self.d._stop.set()  # the sweeper's rounds are run by the test (_sweep)
        self.d._sweeper.join()
        self.sched = self.d.sched

    def reserve(self, pid, tokens):
        binding = binding_of(_cap(pid), token_digest(_prompt(tokens)))  # what prefill's connector reserves with
        res = self.sched.reserve(pid, num_tokens=tokens, peer="prefill-a", binding=binding)
        assert res.grant is not None
        return res.grant

    def receive(self, pid, tokens):
        g = self.reserve(pid, tokens)
        self.sched.land_layers(pid, g.token, range(self.lay.total_layers))
        assert self.sched.complete(pid, g.token) is State.RECEIVED
        return g

    def state(self, pid):
        return self.sched.request(pid).state

    def close(self):
        self.d.close()


@pytest.fixture
def dec():
    d = Decode()
    yield d
    d.close()


@pytest.fixture
def dec_recompute():
    d = Decode(recompute=True)
    yield d
    d.close()


@pytest.mark.parametrize(
    "params",
    [None, {}, {PARAM_ID: "x"}, {"do_remote_prefill": False, PARAM_ID: "x"}, _params(""), _params(7), _params(None)],
)
def test_requests_without_pdkvs_parameters_are_not_the_connectors(dec, params):
    assert dec.d.matched("v", params, _prompt(16), 0) == (0, False)
    assert dec.d._wants == {}
    dec.d.allocated("v", [1, 2], 16)
    assert dec.d.step_meta().loads == [] and dec.d.finished("v") is False


def test_kv_on_its_way_is_asked_for_later_until_the_limit(dec):
    """Not reserved, then reserved, then receiving: 'ask later' up to load_timeout_s after
    vLLM first asked (the limit itself included), then received: the tokens to load."""
    assert dec.d.matched("v", _params("p"), _prompt(20), 0) == (None, False)
    dec.clock.t += LIMIT
    assert dec.d.matched("v", _params("p"), _prompt(20), 0) == (None, False)
    g = dec.reserve("p", 20)
    assert dec.d.matched("v", _params("p"), _prompt(20), 0) == (None, False)
    dec.sched.land_layers("p", g.token, [0])
    assert dec.state("p") is State.RECEIVING
    assert dec.d.matched("v", _params("p"), _prompt(20), 0) == (None, False)
    dec.sched.land_layers("p", g.token, [1])
    dec.sched.complete("p", g.token)
    assert dec.d.matched("v", _params("p"), _prompt(20), 0) == (20, True)
    assert dec.d._wants["v"].since == 1000.0 and dec.d._wants["v"].local == 0


@pytest.mark.parametrize("recompute", [False, True])
def test_kv_that_never_comes_follows_the_failure_policy(recompute, caplog):
    """Past load_timeout_s: with 'recompute' vLLM computes the prompt (0 tokens), with
    'fail' vLLM is told the tokens are there and the load then fails; a late reservation
    is aborted at decode either way."""
    d = Decode(recompute=recompute)
    try:
        assert d.d.matched("v", _params("p"), _prompt(20), 4) == (None, False)
        d.reserve("p", 20)
        d.clock.t += LIMIT + 0.001
        got = d.d.matched("v", _params("p"), _prompt(20), 4)
        assert got == ((0, False) if recompute else (16, True))
        assert d.state("p") is State.ABORTED
        assert f"request v (pdkv p): no KV within load_timeout_s={LIMIT}s" in caplog.text
        if recompute:
            assert "v" not in d.d._wants
            return
        assert d.d.matched("v", _params("p"), _prompt(20), 8) == (12, True)  # asked again: the same answer
        d.d.allocated("v", [4, 5, 6], 12)
        # nothing to copy: the load fails, its errors the blocks past what vLLM holds itself
        assert d.d.step_meta().loads == [Load("v", (), (5, 6))]
        d.d.loaded({"v"})
        assert d.d._wants == {}
    finally:
        d.close()


def test_kv_that_failed_or_does_not_match_the_prompt_is_given_up(dec_recompute, caplog):
    d = dec_recompute
    g = d.reserve("p", 16)
    d.sched.fail("p", "prefill broke", g.token)
    assert d.d.matched("v", _params("p"), _prompt(16), 0) == (0, False)
    assert "request v (pdkv p): its KV is failed (prefill broke): computed here" in caplog.text
    d.receive("q", 16)
    # another prompt than prefill's: no proof that q is this request's, so it is computed
    # here and q is left as it was (its own request may still come)
    assert d.d.matched("w", _params("q"), _prompt(17), 0) == (0, False)
    assert "request w claims pdkv 'q': its pdkv_cap and prompt do not match what prefill reserved" in caplog.text
    assert d.state("q") is State.RECEIVED and d.d.refused == 1
    assert d.sched.buffer.num_free == 8 and d.d._wants == {}  # q's held; p's quarantined (a failed grant)


def test_fail_policy_with_nothing_left_to_load_computes_nothing(dec):
    """Under 'fail', a request whose whole prompt vLLM holds already is not failed: 0 tokens."""
    g = dec.reserve("p", 16)
    dec.sched.fail("p", "gone", g.token)
    assert dec.d.matched("v", _params("p"), _prompt(16), 16) == (0, False)
    assert dec.d._wants == {}


def test_a_prompt_vllm_holds_whole_drops_the_kv(dec):
    dec.receive("p", 16)
    assert dec.d.matched("v", _params("p"), _prompt(16), 16) == (0, False)
    assert dec.state("p") is State.ABORTED
    assert dec.sched.request("p").reason == "decode holds the whole prompt already"
    assert dec.d._wants == {} and dec.sched.buffer.num_free == 12


@pytest.mark.parametrize(
    "local,tokens,given,first,bound",
    [
        (0, 20, [10, 2, 5, 9], 0, (10, 2, 5)),  # one block more than needed: not bound
        (8, 20, [6, 11, 12], 1, (11, 12)),  # a local prefix of one block: only the rest
        (16, 24, [1, 2, 3], 2, (3,)),
        (0, 8, [4], 0, (4,)),
    ],
)
def test_allocated_binds_the_blocks_past_the_local_prefix(dec, local, tokens, given, first, bound):
    dec.receive("p", tokens)
    received = dec.sched.request("p").buffer_blocks
    assert dec.d.matched("v", _params("p"), _prompt(tokens), local) == (tokens - local, True)
    dec.d.allocated("v", given, tokens - local)
    info = dec.sched.request("p")
    assert info.state is State.SWAPPING and info.gpu_blocks == bound and info.buffer_blocks == received[first:]
    assert dec.sched.buffer.num_free == 12 - len(bound)  # the locally held prefix's buffer blocks are back
    (ld,) = dec.d.step_meta().loads
    assert ld.req_id == "v" and ld.blocks == bound and ld.buffer_blocks == received[first:]
    assert dec.d.step_meta().loads == []  # handed once
    dec.d.allocated("v", [7, 7, 7, 7], tokens - local)  # bound already: ignored
    assert dec.d.step_meta().loads == []


def test_allocated_with_nothing_external_or_unknown_does_nothing(dec):
    dec.receive("p", 16)
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    dec.d.allocated("v", [1, 2], 0)
    dec.d.allocated("other", [1, 2], 16)
    assert dec.d.step_meta().loads == [] and dec.d._wants["v"].bound is None


def test_too_few_blocks_fail_the_load_and_free_the_buffer_at_once(dec):
    dec.receive("p", 16)
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    dec.d.allocated("v", [4], 16)
    assert dec.state("p") is State.ABORTED
    assert dec.sched.request("p").reason == "vLLM gave 1 blocks for 2"
    assert dec.d.step_meta().loads == [Load("v", (), (4,))]
    assert dec.sched.buffer.num_free == 12


def test_a_request_that_ended_between_match_and_allocation_fails_its_load(dec, caplog):
    dec.receive("p", 16)
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    dec.sched.abort("p", "operator")
    dec.d.allocated("v", [4, 5], 16)
    assert dec.d.step_meta().loads == [Load("v", (), (4, 5))]
    assert "request v (pdkv p) could not be bound" in caplog.text


def test_step_meta_names_the_buffers_and_their_size(dec):
    m = dec.d.step_meta()
    assert list(m.buffers) == [dec.d.buffers[0].name] and m.buffer_blocks == 12 and m.loads == []


def test_loaded_frees_the_buffer_and_reports_failed_copies(dec):
    """A load the workers finished: its buffer blocks come back; one whose blocks are load
    errors fails the request at decode; a failed load (nothing bound) is only forgotten."""
    dec.receive("p", 16)
    dec.receive("q", 8)
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    dec.d.matched("w", _params("q"), _prompt(8), 0)
    dec.d.allocated("v", [1, 2], 16)
    dec.d.allocated("w", [3], 8)
    dec.d.step_meta()
    assert dec.sched.buffer.num_free == 9
    dec.d.loaded({"v", "w", "unknown"}, invalid_blocks=[3, 99])
    assert dec.d._wants == {} and dec.sched.buffer.num_free == 12
    assert dec.sched.live_requests() == []
    assert dec.sched.request("q").state is State.FAILED
    assert dec.sched.request("p").state is State.FINISHED
    dec.d.loaded({"v"})  # again: nothing
    assert dec.sched.buffer.num_free == 12


def test_loaded_before_any_binding_is_ignored(dec):
    dec.receive("p", 16)
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    dec.d.loaded({"v"})
    assert dec.state("p") is State.RECEIVED and "v" not in dec.d._wants


def test_unclaimed_kv_is_swept_after_the_limit_and_claimed_kv_stays(dec, caplog):
    dec.receive("p", 8)
    dec.receive("q", 8)
    dec.clock.t += 1
    dec.receive("r", 8)
    dec.d.matched("v", _params("q"), _prompt(8), 0)  # q is claimed
    dec.clock.t += LIMIT - 1
    dec.d._sweep()  # p and q at exactly the limit: kept
    assert [dec.state(x) for x in "pqr"] == [State.RECEIVED] * 3
    dec.clock.t += 0.001
    dec.d._sweep()
    assert [dec.state(x) for x in "pqr"] == [State.ABORTED, State.RECEIVED, State.RECEIVED]
    assert dec.sched.request("p").reason == f"no vLLM request asked for it within load_timeout_s={LIMIT}s"
    assert list(dec.d._received) == ["r"]
    dec.clock.t += 1
    dec.d._sweep()
    assert dec.state("r") is State.ABORTED and dec.d._received == {}


def test_the_sweeper_thread_outlives_a_failing_sweep(monkeypatch, caplog):
    d = Decode(load_timeout_s=0.04)
    try:
        calls = []

        def boom():
            calls.append(1)
            raise RuntimeError("boom")

        monkeypatch.setattr(d.d, "_sweep", boom)
        d.d._stop.clear()
        import threading
        import time

        t = threading.Thread(target=d.d._sweep_loop)
        t.start()
        deadline = time.monotonic() + 5
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        d.d._stop.set()
        t.join(5)
        assert len(calls) >= 3 and not t.is_alive()
        assert "sweeping unclaimed requests failed" in caplog.text
    finally:
        d.close()


def test_finished_before_binding_drops_the_kv_after_keeps_the_blocks(dec):
    dec.receive("p", 8)
    dec.receive("q", 8)
    assert dec.d.finished("nobody") is False
    dec.d.matched("a", _params("p"), _prompt(8), 0)
    assert dec.d.finished("a") is False
    assert dec.state("p") is State.ABORTED
    assert dec.sched.request("p").reason == "vLLM finished the request before its KV was loaded"
    dec.d.matched("b", _params("q"), _prompt(8), 0)
    dec.d.allocated("b", [3], 8)
    assert dec.d.finished("b") is True  # a worker may still write block 3
    info = dec.sched.request("q")
    assert info.state is State.SWAPPING and info.gpu_blocks == (3,)
    assert "b" in dec.d._wants  # its load is still to be reported


def test_buffer_sized_by_bytes_and_a_buffer_with_no_block_is_refused():
    lay = layout_for(**LAY, order=("head", False))
    with pytest.raises(ValueError, match=r"a buffer of 1073 bytes holds no block of 4096 bytes: raise .*buffer_gib"):
        DecodeSide(parse_settings("kv_consumer", "d", {"buffer_gib": 1e-6}), [lay])
    d = DecodeSide(parse_settings("kv_consumer", "d", {"buffer_gib": 4096 * 5 / 2**30}), [lay])
    try:
        assert d.num_blocks == 5 and d.sched.buffer.num_total == 5
    finally:
        d.close()


def test_close_is_idempotent_and_removes_the_buffers():
    d = Decode()
    name = d.d.buffers[0].name
    d.close()
    d.close()
    with pytest.raises(FileNotFoundError):
        SharedBuffer.open(name)


def test_worker_swaps_done_once():
    s = WorkerSwaps()
    h = s.submit("p", (1,), (2,))
    assert not h.done()
    s.done("p", RuntimeError("x"))
    assert h.done() and str(h.error) == "x"
    s.done("p")  # unknown now: nothing
    assert str(h.error) == "x"
    s.done("never")


# ------------------------------------------------------------------ the worker half


class _H:
    def __init__(self, ok=True, done=False):
        self.ok, self.is_done = ok, done
        self.error = None if ok else RuntimeError("copy failed on stream 0")

    def done(self):
        return self.is_done


class _Engine:
    def __init__(self, fail=None):
        self.calls, self.fail, self.closed, self.handles = [], fail, 0, []

    def submit(self, rid, buf, blocks):
        self.calls.append((rid, tuple(buf), tuple(blocks)))
        if self.fail is not None:
            raise self.fail
        h = _H()
        self.handles.append(h)
        return h

    def copy(self, buf, blocks):  # a step's loads as one copy
        return self.submit("*", buf, blocks)

    def close(self):
        self.closed += 1


def _worker(engine):
    lay = layout_for(**LAY, order=("head", False))
    w = LoadWorker(lay, CacheSpec.for_buffer(lay, 16, 1 << 20))
    w._swap = lambda meta: engine  # type: ignore[method-assign]
    return w


def _meta(*loads):
    return StepMeta(buffers=["unused"], buffer_blocks=12, loads=list(loads))


def test_load_worker_reports_each_load_once_its_copy_is_done():
    """A step's loads go as one copy; each load is reported once, when that copy is done;
    a later step's load is a copy of its own."""
    e = _Engine()
    w = _worker(e)
    w.start(_meta(Load("a", (0, 1), (5, 6)), Load("b", (2,), (7,))))
    assert e.calls == [("*", (0, 1, 2), (5, 6, 7))]
    w.start(_meta(Load("c", (3,), (8,))))
    assert e.calls[1:] == [("c", (3,), (8,))]
    assert w.finished() == set() and w.load_errors() == set()
    e.handles[1].is_done = True
    assert w.finished() == {"c"}
    assert w.finished() == set()
    e.handles[0].is_done = True
    assert w.finished() == {"a", "b"} and w.load_errors() == set()
    w.close()
    assert e.closed == 0  # the stand-in engine is not the worker's (only _swap's is)


def test_load_worker_failures_are_load_errors(caplog):
    e = _Engine()
    w = _worker(e)
    w.start(_meta(Load("nokv", (), (1, 2)), Load("a", (0,), (3,))))
    e.handles[0].ok, e.handles[0].error, e.handles[0].is_done = False, RuntimeError("copy failed"), True
    assert w.finished() == {"nokv", "a"}
    assert w.load_errors() == {1, 2, 3}
    assert w.load_errors() == set()
    assert "load of nokv failed: its KV did not arrive" in caplog.text
    assert "load of a failed: copy failed" in caplog.text


@pytest.mark.parametrize("exc", [PdkvError("the buffer is gone"), OSError("no such file")])
def test_load_worker_that_cannot_swap_fails_the_load(exc, caplog):
    w = _worker(_Engine(fail=exc))
    w.start(_meta(Load("a", (0,), (3,))))
    assert w.finished() == {"a"} and w.load_errors() == {3}
    assert f"load of a failed: {exc}" in caplog.text


def test_load_worker_recent_is_bounded(monkeypatch):
    monkeypatch.setattr(loader, "RECENT", 2)
    w = _worker(_Engine())
    w.start(_meta(*(Load(f"r{i}", (i,), (i + 1,)) for i in range(4))))
    assert list(w.recent.items()) == [("r2", (3,)), ("r3", (4,))]
    assert loader.RECENT == 2


def test_load_worker_close_waits_for_running_copies_a_bounded_time(monkeypatch):
    e = _Engine()
    w = _worker(e)
    w.start(_meta(Load("a", (0,), (3,))))
    clock = [0.0]

    def mono():
        clock[0] += 4.0  # each look at the clock: 4 s later
        return clock[0]

    sleeps = []
    monkeypatch.setattr(loader.time, "monotonic", mono)
    monkeypatch.setattr(loader.time, "sleep", sleeps.append)
    w.close()  # never done: gives up after 10 s
    assert sleeps == [0.001, 0.001] and w._pending == []


def test_load_worker_copies_from_a_real_buffer_and_refuses_a_renamed_one(no_leaks):
    """Through the real swap engine (host threads): the blocks vLLM named receive the
    buffer's blocks; a step naming another buffer is refused, the load failed."""
    lay = layout_for(**LAY, order=("head", False))
    nb = 4
    buf = SharedBuffer.create(CacheSpec.buffer_bytes(lay, nb))
    other = SharedBuffer.create(CacheSpec.buffer_bytes(lay, nb))
    cache = np.zeros(lay.block_bytes * 8, np.uint8)
    w = LoadWorker(lay, CacheSpec.for_buffer(lay, 8, cache.ctypes.data))
    try:
        src = np.random.default_rng(5).integers(0, 256, buf.size, dtype=np.uint8)
        buf.buf[:] = src.tobytes()
        meta = StepMeta(buffers=[buf.name], buffer_blocks=nb, loads=[Load("a", (3, 1), (6, 0))])
        w.start(meta)
        import time

        deadline, done = time.monotonic() + 10, set()
        while "a" not in done and time.monotonic() < deadline:
            done |= w.finished()
        assert done == {"a"} and w.load_errors() == set()
        span = lay.layer_block_bytes
        for layer in range(lay.total_layers):
            for b_src, b_dst in ((3, 6), (1, 0)):
                got = cache[(layer * 8 + b_dst) * span : (layer * 8 + b_dst + 1) * span]
                want = src[(layer * nb + b_src) * span : (layer * nb + b_src + 1) * span]
                assert bytes(got) == bytes(want)
        w.start(StepMeta(buffers=[other.name], buffer_blocks=nb, loads=[Load("b", (0,), (2,))]))
        assert w.finished() == {"b"} and w.load_errors() == {2}
        assert not cache[2 * span : 3 * span].any()
    finally:
        w.close()
        for b in (buf, other):
            b.close()
            b.unlink()


def test_load_worker_buffer_of_the_wrong_size_is_refused(no_leaks, caplog):
    lay = layout_for(**LAY, order=("head", False))
    buf = SharedBuffer.create(CacheSpec.buffer_bytes(lay, 2))
    w = LoadWorker(lay, CacheSpec.for_buffer(lay, 8, np.zeros(lay.block_bytes * 8, np.uint8).ctypes.data))
    try:
        w.start(StepMeta(buffers=[buf.name], buffer_blocks=4, loads=[Load("a", (0,), (1,))]))
        assert w.finished() == {"a"} and w.load_errors() == {1}
        assert w._buffer is None and w._engine is None
    finally:
        w.close()
        buf.close()
        buf.unlink()


# ---- what the scheduler half is made of, and its words


def logged(caplog):
    return [r.getMessage() for r in caplog.records if r.name == consumer.__name__]


def test_decode_side_is_built_from_its_settings(caplog):
    """The receiver serves the configured control address, transports, secret and data
    host; grants carry the configured lease; the buffer is named; the sweeper is a named
    daemon; the failure policy is 'fail' unless told; the start is logged."""
    caplog.set_level(logging.INFO, logger=consumer.__name__)
    lay = layout_for(**LAY, order=("head", False))
    port = free_port()
    cfg = {
        "buffer_blocks": 3,
        "control": f"tcp://127.0.0.1:{port}",
        "transports": ["tcp"],
        "secret": "s" * 32,
        "lease_s": 7.0,
        "data_host": "127.0.0.1",
    }
    d = DecodeSide(parse_settings("kv_consumer", "d", cfg), [lay])
    try:
        assert d.control_address == d.receiver.control_address == f"tcp://127.0.0.1:{port}"
        assert list(d.receiver._transports) == ["tcp"] and d.receiver.secret == b"s" * 32
        assert d.receiver.options.data_host == "127.0.0.1" and d.receiver.options.auto_tick is True
        assert d.recompute is False and d.sched.options.bind == "engine"
        assert d.sched.options.direct_to_gpu is False and d.sched.buffer.name == "buffer"
        g = d.sched.reserve("p", num_tokens=8).grant
        assert g is not None and g.location == "buffer" and g.lease_s == 7.0
        assert d._sweeper.name == "pdkv-vllm-sweep" and d._sweeper.daemon and d._sweeper.is_alive()
        assert logged(caplog)[-1] == (
            f"pdkv decode: 3 buffer blocks of {lay.block_bytes} bytes per rank x 1 ranks, control {d.control_address}"
        )
    finally:
        d.close()
    assert not d._sweeper.is_alive() and d.receiver.closed


def test_a_buffer_of_one_block_is_a_buffer():
    lay = layout_for(**LAY, order=("head", False))
    d = DecodeSide(parse_settings("kv_consumer", "d", {"buffer_blocks": 1}), [lay])
    try:
        assert d.num_blocks == 1
    finally:
        d.close()


def test_a_killed_engines_buffers_are_named_at_start(monkeypatch, caplog):
    monkeypatch.setattr(consumer, "stale_note", lambda: "2 stale buffers of dead processes: pdkv-shm clean")
    d = Decode()
    try:
        assert logged(caplog)[0] == "pdkv decode: 2 stale buffers of dead processes: pdkv-shm clean"
    finally:
        d.close()


def test_a_receiver_that_cannot_start_leaves_nothing(no_leaks):
    lay = layout_for(**LAY, order=("head", False))
    busy = DecodeSide(parse_settings("kv_consumer", "d", {"buffer_blocks": 2}), [lay])
    try:
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            DecodeSide(parse_settings("kv_consumer", "d", {"buffer_blocks": 2, "control": busy.control_address}), [lay])
    finally:
        busy.close()


def test_give_up_reasons_and_the_fail_policys_answers(dec, caplog):
    """Under 'fail': KV that is gone when the request comes (here: prefill's transfer
    failed) is computed here, not failed, with the reason logged and counted; a prompt that
    is not prefill's is no claim at all."""
    assert dec.d.matched("v", _params("p"), _prompt(17), 16) == (None, False)
    g = dec.reserve("p", 17)
    dec.sched.fail("p", "prefill broke", g.token)
    assert dec.d.matched("v", _params("p"), _prompt(17), 16) == (0, False)  # computed here, never failed
    assert dec.d.take_stats()["c"]["kv_gone"] == 1
    dec.receive("q", 16)
    assert dec.d.matched("w", _params("q"), _prompt(17), 4) == (0, False)  # not q's prompt: computed here
    assert dec.state("q") is State.RECEIVED
    assert logged(caplog) == [
        "pdkv decode: request v (pdkv p): its KV is failed (prefill broke): computed here",
        "pdkv decode: request w claims pdkv 'q': its pdkv_cap and prompt do not match what prefill reserved; "
        "computed here",
    ]


def test_too_few_blocks_are_not_bound_again(dec, caplog):
    dec.receive("p", 16)
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    dec.d.allocated("v", [4], 16)
    assert logged(caplog) == []  # failed at once: no binding of an aborted request tried


def test_a_timed_out_request_is_aborted_with_its_reason(dec):
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    dec.reserve("p", 16)
    dec.clock.t += LIMIT + 1
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    assert dec.sched.request("p").reason == f"no KV within load_timeout_s={LIMIT}s"


def test_one_token_to_load_is_bound(dec):
    dec.receive("p", 17)
    assert dec.d.matched("v", _params("p"), _prompt(17), 16) == (1, True)
    dec.d.allocated("v", [8, 9, 10], 1)
    (ld,) = dec.d.step_meta().loads
    assert ld.blocks == (10,) and len(ld.buffer_blocks) == 1


def test_a_bind_that_fails_is_logged(dec, caplog):
    dec.receive("p", 16)
    dec.d.matched("v", _params("p"), _prompt(16), 0)
    dec.sched.abort("p", "operator")
    dec.d.allocated("v", [4, 5], 16)
    assert logged(caplog) == [
        "pdkv decode: request v (pdkv p) could not be bound: request 'p' is already aborted (operator)"
    ]


def test_loaded_goes_on_past_loads_it_does_not_know(dec):
    dec.receive("p", 8)
    dec.d.matched("v", _params("p"), _prompt(8), 0)
    dec.d.allocated("v", [3], 8)
    dec.d.step_meta()
    dec.d.loaded(["unknown", "v"], invalid_blocks=[3])
    info = dec.sched.request("p")
    assert info.state is State.FAILED and info.reason == "swap failed: a worker failed to copy the request's blocks"


def test_the_sweeper_thread_drops_unclaimed_kv_soon_after_the_limit(no_leaks):
    """The real thread, load_timeout_s=0.2: it sweeps every 0.05 s, so KV nobody asks for is
    dropped well within a second of arriving."""
    import time

    lay = layout_for(**LAY, order=("head", False))
    d = DecodeSide(parse_settings("kv_consumer", "d", {"buffer_blocks": 4, "load_timeout_s": 0.2}), [lay])
    try:
        g = d.sched.reserve("p", num_tokens=8).grant
        d.sched.land_layers("p", g.token, range(lay.total_layers))
        d.sched.complete("p", g.token)
        t0 = time.monotonic()
        while d.sched.request("p").state is State.RECEIVED and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert d.sched.request("p").state is State.ABORTED
        assert time.monotonic() - t0 < 0.6
    finally:
        d.close()


def test_close_warns_of_a_buffer_still_viewed_and_removes_it(caplog):
    d = Decode()
    view = d.d.buffers[0].buf[:16]  # a view derived from the mapping: close() cannot unmap it
    name = d.d.buffers[0].name
    try:
        d.close()
        assert logged(caplog)[-1].startswith(f"pdkv decode: buffer {name}: ")
        with pytest.raises(FileNotFoundError):
            SharedBuffer.open(name)
    finally:
        view.release()
        d.d.buffers[0].close()


def test_load_worker_failures_are_logged_whole(caplog):
    e = _Engine()
    w = _worker(e)
    w.start(_meta(Load("nokv", (), (1,))))
    assert logged(caplog) == ["pdkv decode: load of nokv failed: its KV did not arrive"]


def test_load_worker_goes_on_after_a_load_it_cannot_submit():
    class Picky(_Engine):
        def submit(self, rid, buf, blocks):
            if rid in ("bad", "*"):  # the step's copy holds the bad load's blocks too
                raise PdkvError("no such blocks")
            return super().submit(rid, buf, blocks)

    e = Picky()
    w = _worker(e)
    w.start(_meta(Load("bad", (0,), (1,)), Load("good", (2,), (3,))))
    assert e.calls == [("good", (2,), (3,))]  # refused as one copy, retried load by load
    e.handles[0].is_done = True
    assert w.finished() == {"bad", "good"} and w.load_errors() == {1}


def test_a_renamed_buffer_is_named_in_the_failure(caplog, no_leaks):
    lay = layout_for(**LAY, order=("head", False))
    a = SharedBuffer.create(CacheSpec.buffer_bytes(lay, 2))
    b = SharedBuffer.create(CacheSpec.buffer_bytes(lay, 2))
    cache = np.zeros(lay.block_bytes * 4, np.uint8)
    w = LoadWorker(lay, CacheSpec.for_buffer(lay, 4, cache.ctypes.data))
    try:
        w.start(StepMeta(buffers=[a.name], buffer_blocks=2, loads=[]))
        w._swap(StepMeta(buffers=[a.name], buffer_blocks=2))
        w.start(StepMeta(buffers=[b.name], buffer_blocks=2, loads=[Load("x", (0,), (1,))]))
        assert logged(caplog) == [f"pdkv decode: load of x failed: decode's buffer changed name ({a.name} -> {b.name})"]
    finally:
        w.close()
        for s in (a, b):
            s.close()
            s.unlink()


def test_a_request_later_than_load_timeout_is_computed_not_failed(dec, caplog):
    """Under 'fail' too: KV that no request claimed within load_timeout_s is dropped from
    the buffer; its request coming later is computed here (0 tokens), counted, never failed."""
    dec.receive("p", 16)
    dec.clock.t += LIMIT + 1
    dec.d._sweep()
    assert dec.state("p") is State.ABORTED and dec.sched.buffer.num_free == dec.sched.buffer.num_total
    assert dec.d.matched("v", _params("p"), _prompt(16), 0) == (0, False)
    assert dec.d._wants == {} and dec.d.take_stats()["c"]["kv_gone"] == 1
    assert "request v (pdkv p): its KV is aborted (no vLLM request asked for it within" in caplog.text
