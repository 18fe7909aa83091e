from __future__ import annotations

import re
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from pdkv.errors import GrantViolation, LeaseExpiredError, RequestError
from pdkv.scheduling.blocks import BlockPool
from pdkv.scheduling.scheduler import DecodeScheduler, EventKind, SchedulerOptions, State


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeHandle:
    def __init__(self):
        self._done = False
        self.error = None

    def done(self):
        return self._done


class FakeSwap:
    def __init__(self):
        self.handles: dict[str, FakeHandle] = {}
        self.submitted = []
        self.fail_submit = False

    def submit(self, rid, buf, gpu):
        if self.fail_submit:
            raise RuntimeError("launch failed")
        assert len(buf) == len(gpu)
        h = FakeHandle()
        self.handles[rid] = h
        self.submitted.append((rid, tuple(buf), tuple(gpu)))
        return h

    def finish(self, rid, error=None):
        h = self.handles.pop(rid)
        h.error = error
        h._done = True


def make(gpu=16, buf=32, layers=4, **opt):
    clock = Clock()
    swap = FakeSwap()
    events = []
    s = DecodeScheduler(
        num_layers=layers,
        gpu=BlockPool(gpu, "gpu"),
        buffer=BlockPool(buf, "buffer"),
        swap=swap,
        tokens_per_block=16,
        block_bytes=100,
        options=SchedulerOptions(**{"lease_s": 10.0, "fence_grace_s": 1.0, **opt}),
        clock=clock,
        listener=events.append,
    )
    return s, clock, swap, events


def test_gpu_direct_path():
    s, clock, swap, ev = make()
    r = s.reserve("a", num_tokens=40)
    assert r.outcome == "gpu" and r.grant.blocks == (0, 1, 2)
    assert s.land_layers("a", r.grant.token, range(4)) == 4
    assert s.complete("a", r.grant.token) is State.READY
    assert [e.kind for e in ev] == ["reserved", "ready"]
    assert ev[0].grant.blocks == (0, 1, 2) and ev[1].t == clock.t
    (ready,) = s.take_ready()
    assert ready.gpu_blocks == (0, 1, 2) and ready.num_tokens == 40
    assert s.take_ready() == []
    s.finish("a")
    assert s.gpu.num_free == 16
    assert s.request("a").state is State.FINISHED
    s.check_invariants()


def test_buffer_path_swaps_when_gpu_room_appears_and_frees_buffer_only_after_swap():
    s, clock, swap, ev = make(gpu=8, gpu_reserve_blocks=2)
    big = s.reserve("g", num_blocks=6)
    assert big.outcome == "gpu"
    r = s.reserve("b", num_blocks=4)
    assert r.outcome == "buffer" and s.buffer.num_free == 28
    s.land_layers("b", r.grant.token, range(4))
    assert s.complete("b", r.grant.token) is State.RECEIVED
    s.tick()
    assert s.request("b").state is State.RECEIVED  # no GPU room above the reserve
    # the engine finishes "g": room appears
    s.land_layers("g", big.grant.token, range(4))
    s.complete("g", big.grant.token)
    s.take_ready()
    s.finish("g")
    clock.t += 3
    s.tick()
    assert s.request("b").state is State.SWAPPING
    assert s.buffer.num_free == 28  # still read by the swap
    swap.finish("b")
    s.tick()
    assert s.request("b").state is State.READY and s.buffer.num_free == 32
    assert [x.request_id for x in s.take_ready()] == ["b"]
    m = s.metrics()
    assert m["swaps_completed"] == 1 and m["swap_bytes"] == 400
    assert m["prefill_wait_avoided_seconds_sum"] == pytest.approx(3.0)
    s.check_invariants()


def test_a_layer_landing_at_the_instant_its_lease_ends_is_refused_and_expires_it():
    """A lease ends at ``expires``: a layer landing then (one message per layer) is refused,
    the request expires on that call, and its blocks are quarantined; a moment before, the
    landing renews it."""
    s, clock, swap, ev = make(direct_to_gpu=False)
    r = s.reserve("a", num_blocks=5)
    clock.t = r.grant.lease_expires - 1e-3
    assert s.land_layer("a", r.grant.token, 0) == 1
    assert s.request("a").state is State.RECEIVING
    clock.t += s.options.lease_s  # exactly the renewed lease's end
    with pytest.raises(LeaseExpiredError, match="^request 'a': its lease expired; the message is refused$"):
        s.land_layer("a", r.grant.token, 1)
    assert s.request("a").state is State.EXPIRED and s.request("a").layers_landed == 0
    assert [e.kind for e in ev] == ["reserved", "expired"]
    assert s.metrics()["quarantined_blocks"] == 5 and s.metrics()["layers_landed"] == 1


def test_one_message_per_layer_counts_each_layer_once_and_refuses_what_may_not_land():
    """land_layer, the receiver's call once a layer: it returns the layers landed so far, a
    layer landed twice, a layer that is not an int, a queued request (its token 0) and a
    received one are refused with the general path's errors, and layers landed one by one
    complete the request."""
    s, clock, swap, ev = make(gpu=16, buf=8, layers=4, direct_to_gpu=False, on_full="queue")
    r = s.reserve("a", num_blocks=8)
    q = s.reserve("q", num_blocks=1)
    assert q.outcome == "queued"
    tok = r.grant.token
    assert [s.land_layer("a", tok, i) for i in (2, 0)] == [1, 2]
    with pytest.raises(RequestError, match=r"^request 'a': layers \[0\] already landed$"):
        s.land_layer("a", tok, 0)
    for bad in (1.0, "1", None):
        with pytest.raises(RequestError, match=r"out of range \[0, 4\)"):
            s.land_layer("a", tok, bad)
    with pytest.raises(RequestError, match="^request 'q' is queued; no more writes are accepted$"):
        s.land_layer("q", 0, 0)
    assert s.request("q").layers_landed == 0
    assert [s.land_layer("a", tok, i) for i in (3, 1)] == [3, 4]
    assert s.request("a").layers_landed == 4 and s.metrics()["layers_landed"] == 4
    assert s.complete("a", tok) is State.RECEIVED
    with pytest.raises(RequestError, match="^request 'a' is received; no more writes are accepted$"):
        s.land_layer("a", tok, 1)
    assert s.metrics()["layers_landed"] == 4


def test_lease_expiry_quarantines_then_releases_and_refuses_late_writes():
    s, clock, swap, ev = make(direct_to_gpu=False)
    r = s.reserve("a", num_blocks=5)
    s.land_layer("a", r.grant.token, 0)
    clock.t += 9  # progress extended the lease from t=0 to t=10
    s.tick()
    assert s.request("a").state is State.RECEIVING
    clock.t += 2
    s.tick()
    assert s.request("a").state is State.EXPIRED
    assert s.buffer.num_free == 27 and s.metrics()["quarantined_blocks"] == 5
    with pytest.raises(LeaseExpiredError):
        s.land_layer("a", r.grant.token, 1)
    with pytest.raises(LeaseExpiredError):
        s.complete("a", r.grant.token)
    clock.t += 1
    s.tick()
    assert s.buffer.num_free == 32
    assert [e.kind for e in ev] == ["reserved", "expired"]
    s.check_invariants()


def test_expired_lease_detected_on_write_without_tick():
    s, clock, swap, ev = make(direct_to_gpu=False)
    r = s.reserve("a", num_blocks=1)
    clock.t += 11
    with pytest.raises(LeaseExpiredError):
        s.check_write("a", r.grant.token)
    assert s.request("a").state is State.EXPIRED


def test_fence_releases_quarantine_at_once(caplog):
    s, clock, swap, ev = make()
    r = s.reserve("a", num_blocks=3, peer="p1")
    s.fail("a", "prefill reported an error", token=r.grant.token)
    assert s.gpu.num_free == 13
    caplog.set_level("DEBUG", logger="pdkv.scheduling.scheduler")
    assert s.fence("p2") == 0
    assert s.fence("p1") == 3 and s.gpu.num_free == 16
    got = [r.getMessage() for r in caplog.records if r.name == "pdkv.scheduling.scheduler"]
    assert got == ["peer p2 fenced: 0 quarantined blocks released", "peer p1 fenced: 3 quarantined blocks released"]


def test_grant_tokens_are_63_bits_of_the_os_read_eight_bytes_each(monkeypatch):
    """Tokens come from os.urandom read 256 at a time: token i is bytes 8i..8i+7 of a read
    (little-endian), shifted right once; the 257th grant reads again."""
    import pdkv.scheduling.core as core

    reads = []

    def urandom(n):
        reads.append(n)
        return b"".join(((len(reads) << 20 | i) << 1).to_bytes(8, "little") for i in range(n // 8))

    monkeypatch.setattr(core.os, "urandom", urandom)
    s, *_ = make(gpu=600, buf=8)
    tokens = [s.reserve(f"r{i}", num_blocks=1).grant.token for i in range(258)]
    assert reads == [2048, 2048]
    assert tokens == [1 << 20 | i for i in range(256)] + [2 << 20 | 0, 2 << 20 | 1]
    assert all(0 < t < 1 << 63 for t in tokens)


def test_stale_token_and_reused_id():
    s, clock, swap, ev = make()
    r1 = s.reserve("a", num_blocks=2)
    s.abort("a")
    r2 = s.reserve("a", num_blocks=2)  # id reused after a terminal state
    with pytest.raises(GrantViolation):
        s.land_layer("a", r1.grant.token, 0)
    with pytest.raises(GrantViolation):
        s.fail("a", "x", token=r1.grant.token)
    assert s.request("a").state is State.RESERVED
    s.land_layer("a", r2.grant.token, 0)


def test_bad_input_changes_nothing():
    s, clock, swap, ev = make()
    r = s.reserve("a", num_blocks=2)
    before = s.metrics()
    for kw in (dict(num_blocks=0), dict(num_blocks=-1), dict(num_tokens=0), dict()):
        with pytest.raises(RequestError):
            s.reserve("z", **kw)
    with pytest.raises(RequestError, match="already live"):
        s.reserve("a", num_blocks=1)
    with pytest.raises(RequestError, match="more than the GPU pool"):
        s.reserve("huge", num_blocks=17)
    with pytest.raises(RequestError, match="non-empty"):
        s.reserve("", num_blocks=1)
    with pytest.raises(RequestError, match="unknown request"):
        s.land_layer("nope", 1, 0)
    with pytest.raises(RequestError, match="out of range"):
        s.land_layer("a", r.grant.token, 4)
    s.land_layer("a", r.grant.token, 1)
    with pytest.raises(RequestError, match="already landed"):
        s.land_layers("a", r.grant.token, [0, 1])
    with pytest.raises(RequestError, match="given twice"):
        s.land_layers("a", r.grant.token, [2, 2])
    with pytest.raises(RequestError, match="before layers"):
        s.complete("a", r.grant.token)
    with pytest.raises(RequestError, match="not ready"):
        s.finish("a")
    after = s.metrics()
    assert after["layers_landed"] == 1 and after["gpu_blocks_free"] == before["gpu_blocks_free"]
    assert s.request("a").layers_landed == 1
    with pytest.raises(ValueError, match="lease_s"):
        SchedulerOptions(lease_s=0)
    with pytest.raises(ValueError, match="on_full"):
        SchedulerOptions(on_full="drop")
    with pytest.raises(ValueError, match="swap backend"):
        DecodeScheduler(num_layers=1, gpu=BlockPool(1), buffer=BlockPool(1))


def test_queue_fifo_and_timeout():
    s, clock, swap, ev = make(gpu=4, buf=4, on_full="queue", queue_timeout_s=5.0, max_queue=1)
    a = s.reserve("a", num_blocks=4)
    b = s.reserve("b", num_blocks=4)
    assert (a.outcome, b.outcome) == ("gpu", "buffer")
    assert s.reserve("c", num_blocks=1).outcome == "queued"
    assert s.reserve("d", num_blocks=1).outcome == "rejected"  # queue full
    s.abort("a")
    s.fence("")
    s.tick()
    granted = [e for e in ev if e.kind == "granted"]
    assert granted and granted[0].request_id == "c" and granted[0].grant.location == "gpu"
    assert s.reserve("e", num_blocks=4).outcome == "queued"
    clock.t += 6
    s.tick()
    assert s.request("e").state is State.REJECTED
    s.check_invariants()


def test_shortest_first_without_starvation():
    s, clock, swap, ev = make(gpu=10, buf=30, direct_to_gpu=False, swap_order="shortest", starvation_s=5.0)
    hog = s.gpu.allocate(10)
    for rid, n in (("long", 8), ("short", 2)):
        g = s.reserve(rid, num_blocks=n).grant
        s.land_layers(rid, g.token, range(4))
        s.complete(rid, g.token)
    s.gpu.free(hog)
    s.tick()
    assert [x[0] for x in swap.submitted] == ["short", "long"]
    # starvation: the oldest goes first once it waited long enough
    s2, clock2, swap2, _ = make(gpu=10, buf=30, direct_to_gpu=False, swap_order="shortest", starvation_s=5.0)
    hog = s2.gpu.allocate(10)
    for rid, n in (("long", 8), ("short", 2)):
        g = s2.reserve(rid, num_blocks=n).grant
        s2.land_layers(rid, g.token, range(4))
        s2.complete(rid, g.token)
    clock2.t += 6
    s2.gpu.free(hog[:8])
    s2.tick()
    assert [x[0] for x in swap2.submitted] == ["long"]


def test_abort_during_swap_waits_for_the_swap():
    s, clock, swap, ev = make(direct_to_gpu=False)
    g = s.reserve("a", num_blocks=3).grant
    s.land_layers("a", g.token, range(4))
    s.complete("a", g.token)
    s.tick()
    s.abort("a")
    assert s.request("a").state is State.SWAPPING and s.buffer.num_free == 29
    swap.finish("a")
    s.tick()
    assert s.request("a").state is State.ABORTED
    assert s.buffer.num_free == 32 and s.gpu.num_free == 16


def test_swap_failure_and_submit_failure_fail_the_request_and_free_everything():
    s, clock, swap, ev = make(direct_to_gpu=False)
    for rid in ("a", "b"):
        g = s.reserve(rid, num_blocks=3).grant
        s.land_layers(rid, g.token, range(4))
        s.complete(rid, g.token)
    swap.fail_submit = True
    s.tick()
    assert s.request("a").state is State.FAILED and "launch failed" in s.request("a").reason
    swap.fail_submit = False
    g = s.reserve("c", num_blocks=3).grant
    s.land_layers("c", g.token, range(4))
    s.complete("c", g.token)
    s.tick()
    swap.finish("c", error=RuntimeError("copy error"))
    s.tick()
    assert s.request("c").state is State.FAILED
    assert s.buffer.num_free == 32 and s.gpu.num_free == 16
    assert s.metrics()["swaps_failed"] == 3  # two failed submits, one failed copy


def test_listener_is_called_without_the_lock():
    seen = []
    s, clock, swap, _ = make()

    def listener(e):
        # would deadlock if the lock were held
        seen.append((e.kind, s.metrics()["requests_ready"]))

    s.listener = listener
    g = s.reserve("a", num_blocks=1).grant
    s.land_layers("a", g.token, range(4))
    s.complete("a", g.token)
    assert seen == [("reserved", 0), ("ready", 1)]


def test_prometheus_text_names_the_counters_and_the_pools():
    s, *_ = make()
    text = s.prometheus()
    assert "# TYPE pdkv_reservations_gpu counter" in text
    assert "pdkv_gpu_blocks_free 16" in text


def test_threads_hammer_the_scheduler():
    s, clock, swap, ev = make(gpu=64, buf=64)
    errors = []

    def worker(k):
        try:
            for i in range(300):
                rid = f"{k}-{i}"
                r = s.reserve(rid, num_blocks=1 + i % 4)
                if r.grant is None:
                    continue
                s.land_layers(rid, r.grant.token, range(4))
                s.complete(rid, r.grant.token)
                s.tick()
                for h in list(swap.handles):
                    try:
                        swap.finish(h)
                    except KeyError:
                        pass
                s.tick()
                for rr in s.take_ready():
                    s.finish(rr.request_id)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for _ in range(3):
        for h in list(swap.handles):
            swap.finish(h)
        s.tick()
        for rr in s.take_ready():
            s.finish(rr.request_id)
    s.check_invariants()
    assert s.gpu.num_free == 64 and s.buffer.num_free == 64


# ---------------------------------------------------------------- stateful


class LeakyPool(BlockPool):
    """A planted bug: freeing several blocks at once loses the last one."""

    def free(self, blocks):
        super().free(list(blocks)[:-1] if len(blocks) > 1 else blocks)


def test_machine_catches_a_planted_accounting_bug():
    """The model machine (test_scheduler_model.py: every call's exact outcome) fails on a
    pool that loses a block."""
    from test_scheduler_model import SchedulerModelMachine

    class Broken(SchedulerModelMachine):
        POOL = LeakyPool

    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            Broken,
            settings=settings(
                max_examples=200, stateful_step_count=40, deadline=None, database=None, report_multiple_bugs=False
            ),
        )


@pytest.mark.slow
def test_hundred_thousand_random_steps_leak_nothing():
    import random

    rng = random.Random(7)
    from collections import Counter

    s, clock, swap, ev = make(gpu=200, buf=400, layers=4, on_full="queue", gpu_reserve_blocks=10)
    tokens = {}
    refused: Counter = Counter()
    for step in range(100_000):
        op = rng.random()
        live = s.live_requests()
        try:
            if op < 0.25:
                rid = f"r{step}"
                r = s.reserve(rid, num_blocks=rng.randint(1, 40))
                if r.grant:
                    tokens[rid] = r.grant.token
            elif op < 0.5 and live:
                rid = rng.choice(live)
                s.land_layers(rid, tokens.get(rid, 0), range(4))
                s.complete(rid, tokens.get(rid, 0))
            elif op < 0.55 and live:
                s.abort(rng.choice(live))
            elif op < 0.6 and live:
                s.fail(rng.choice(live), "random")
            elif op < 0.75:
                if swap.handles:
                    swap.finish(rng.choice(sorted(swap.handles)), None if rng.random() < 0.95 else RuntimeError())
            elif op < 0.85:
                for r in s.take_ready():
                    s.finish(r.request_id)
            else:
                clock.t += rng.choice([0.1, 1.0, 12.0])
                s.tick()
        except (RequestError, LeaseExpiredError) as exc:  # a random walk names ended requests
            refused[type(exc).__name__] += 1
        for granted in (e for e in ev if e.kind == "granted"):
            tokens[granted.request_id] = granted.grant.token
        ev.clear()
        if step % 1000 == 0:
            s.check_invariants()
    for rid in s.live_requests():
        s.abort(rid)
    for _ in range(3):
        for rid in list(swap.handles):
            swap.finish(rid)
        clock.t += 100
        s.tick()
    s.check_invariants()
    assert s.gpu.num_free == 200 and s.buffer.num_free == 400
    # the walk did meet ended requests (and only those errors: any other class escapes)
    assert refused["RequestError"] > 0, refused


def test_renew_extends_a_live_lease_only():
    s, clock, swap, ev = make(direct_to_gpu=False)
    g = s.reserve("a", num_blocks=2).grant
    clock.t += 8
    assert s.renew("a", g.token) == clock.t + 10
    clock.t += 8  # 16 s after the grant, 8 after the renewal: still live
    s.tick()
    assert s.request("a").state is State.RESERVED
    with pytest.raises(GrantViolation):
        s.renew("a", g.token + 1)
    clock.t += 3
    with pytest.raises(LeaseExpiredError):
        s.renew("a", g.token)


# ------------------------------------------------------------------ write tickets


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["advance", "tick", "fence", "end", "fail", "reserve_b"]), st.floats(0, 3)),
        max_size=25,
    ),
    lease=st.floats(0.5, 3),
    grace=st.floats(0, 2),
)
def test_no_block_is_granted_again_while_an_admitted_write_may_run(steps, lease, grace):
    from pdkv import BlockPool, DecodeScheduler, SchedulerOptions

    class NoSwap:
        def submit(self, *a):
            raise AssertionError("no swap in this test")

    clock = _Clock()
    s = DecodeScheduler(
        num_layers=2,
        gpu=BlockPool(4),
        buffer=BlockPool(2),
        swap=NoSwap(),
        clock=clock,
        options=SchedulerOptions(direct_to_gpu=False, lease_s=lease, fence_grace_s=grace),
    )
    ga = s.reserve("a", num_blocks=2, peer="A").grant
    ticket = s.begin_write("a", ga.token)
    open_ = True
    for op, x in steps:
        if op == "advance":
            clock.t += x
        elif op == "tick":
            s.tick()
        elif op == "fence":
            s.fence("A")
        elif op == "end" and open_:
            s.end_write(ticket)
            open_ = False
        elif op == "fail":
            try:
                s.fail("a", "peer went away")
            except (RequestError, LeaseExpiredError) as exc:  # it ended before: said so
                assert "request 'a' is already" in str(exc) or "'a': its lease expired" in str(exc), exc
        elif op == "reserve_b":
            if "b" not in s.live_requests():
                r = s.reserve("b", num_blocks=2, peer="B")
                if r.grant is not None:
                    assert not open_, "a's blocks granted to b while a's write may still land"
        s.check_invariants()
    if open_:
        s.end_write(ticket)
    with pytest.raises(Exception, match="already ended"):
        s.end_write(ticket)


def test_a_write_ticket_holds_its_blocks_past_grace_fence_and_expiry():
    class NoSwap:
        def submit(self, *a):
            raise AssertionError("no swap here")

    clock = _Clock()
    s = DecodeScheduler(
        num_layers=2,
        gpu=BlockPool(4),
        buffer=BlockPool(2),
        swap=NoSwap(),
        clock=clock,
        options=SchedulerOptions(direct_to_gpu=False, lease_s=1.0, fence_grace_s=0.5),
    )
    g = s.reserve("a", num_blocks=2, peer="A").grant
    t = s.begin_write("a", g.token)
    assert t.grant.blocks == g.blocks and s.metrics()["writes_admitted"] == 1
    clock.t = 5.0
    s.tick()  # the lease expired and the grace passed: still held by the write
    assert s.request("a").state is State.EXPIRED
    assert s.fence("A") == 0 and s.buffer.num_free == 0
    assert s.reserve("b", num_blocks=2, peer="B").outcome == "rejected"
    s.end_write(t)  # the write ended: the blocks come back at once
    assert s.buffer.num_free == 2 and s.metrics()["quarantined_blocks"] == 0
    with pytest.raises(RequestError, match="already ended"):
        s.end_write(t)
    with pytest.raises(LeaseExpiredError):
        s.begin_write("a", g.token)
    s.check_invariants()


# ------------------------------------------------------------------ every validation, its exact message


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(lease_s=0), "lease_s=0 must be a positive number of seconds"),
        (dict(queue_timeout_s=-1), "queue_timeout_s=-1 must be a positive number of seconds"),
        (dict(starvation_s="5"), "starvation_s='5' must be a positive number of seconds"),
        (dict(fence_grace_s=-1), "fence_grace_s=-1 must be >= 0"),
        (dict(fence_grace_s="1"), "fence_grace_s='1' must be >= 0"),
        (dict(gpu_reserve_blocks=-1), "gpu_reserve_blocks=-1 must be a non-negative integer"),
        (dict(max_queue=1.5), "max_queue=1.5 must be a non-negative integer"),
        (dict(max_tombstones=-3), "max_tombstones=-3 must be a non-negative integer"),
        (dict(on_full="drop"), "on_full='drop' must be 'reject' or 'queue'"),
        (dict(swap_order="lifo"), "swap_order='lifo' must be 'fifo' or 'shortest'"),
    ],
)
def test_options_validation_messages(kw, msg):
    with pytest.raises(ValueError) as e:
        SchedulerOptions(**kw)
    assert str(e.value) == msg
    SchedulerOptions(fence_grace_s=0, gpu_reserve_blocks=0, max_queue=0)  # the boundaries are allowed


def test_scheduler_construction_and_reserve_validation_messages():
    def fails(msg, **kw):
        with pytest.raises(ValueError) as e:
            DecodeScheduler(gpu=BlockPool(4), **{"num_layers": 2, **kw})
        assert str(e.value) == msg

    fails("num_layers=0 must be a positive integer", num_layers=0)
    fails("num_layers=1.0 must be a positive integer", num_layers=1.0)
    fails("num_layers=4097 is absurd (more than 4096)", num_layers=4097)
    fails("a buffer needs a swap backend (swap=...) to move blocks to the GPU", buffer=BlockPool(4))
    DecodeScheduler(num_layers=4096, gpu=BlockPool(4))
    DecodeScheduler(num_layers=1, gpu=BlockPool(4))
    s = DecodeScheduler(num_layers=2, gpu=BlockPool(8), options=SchedulerOptions(gpu_reserve_blocks=2))
    for kw, msg in (
        (dict(request_id=""), "request_id='' must be a non-empty string of at most 256 characters"),
        (dict(request_id=5), "request_id=5 must be a non-empty string of at most 256 characters"),
        (dict(request_id="x" * 257), f"request_id={'x' * 257!r} must be a non-empty string of at most 256 characters"),
        (dict(num_tokens=10), "give num_blocks, or num_tokens with a layout (or tokens_per_block) on the scheduler"),
        (dict(), "give num_blocks, or num_tokens with a layout (or tokens_per_block) on the scheduler"),
        (dict(num_blocks=True), "num_blocks=True must be a positive integer"),
        (dict(num_blocks=0), "num_blocks=0 must be a positive integer"),
        (dict(num_blocks=1, gpu_ok=1), "gpu_ok=1 must be a bool"),
        (dict(num_blocks=7), "request 'a' needs 7 blocks: more than the GPU pool can ever give (6 above the reserve)"),
        (
            dict(num_blocks=1, gpu_ok=False),
            "request 'a' needs 1 blocks: more than the GPU pool can ever give "
            "(6 above the reserve) or the buffer holds (0)",
        ),
    ):
        with pytest.raises(RequestError) as e:
            s.reserve(**{"request_id": "a", **kw})
        assert str(e.value) == msg
    assert s.reserve("x" * 256, num_blocks=6).outcome == "gpu"  # the limits themselves are allowed
    t = DecodeScheduler(num_layers=2, gpu=BlockPool(8), tokens_per_block=16)
    for bad in (0, -1, 2.5):
        with pytest.raises(RequestError) as e:
            t.reserve("a", num_tokens=bad)
        assert str(e.value) == f"num_tokens={bad!r} must be a positive integer"
    assert t.reserve("one", num_tokens=1).grant.blocks == (0,)  # one token: one block
    assert t.reserve("two", num_tokens=17).grant.blocks == (1, 2)
    with pytest.raises(RequestError) as e:
        t.request("nobody")
    assert str(e.value) == "unknown request 'nobody'"


def test_swap_bytes_count_only_with_block_bytes_and_tick_returns_submit_failures():
    clock = Clock()
    swap = FakeSwap()
    seen = []
    s = DecodeScheduler(
        num_layers=1,
        gpu=BlockPool(4),
        buffer=BlockPool(4),
        swap=swap,
        clock=clock,
        options=SchedulerOptions(direct_to_gpu=False),
        listener=seen.append,
    )
    g = s.reserve("a", num_blocks=2).grant
    s.land_layers("a", g.token, [0])
    s.complete("a", g.token)
    s.tick()
    swap.finish("a")
    s.tick()
    assert s.metrics()["swap_bytes"] == 0  # block_bytes not given: bytes are not counted
    g = s.reserve("b", num_blocks=1).grant
    s.land_layers("b", g.token, range(1))
    s.complete("b", g.token)
    swap.fail_submit = True
    seen.clear()
    ev = s.tick()  # the failed submission's event is returned and delivered
    assert [(e.kind, e.request_id, e.reason, e.t) for e in ev] == [
        ("failed", "b", "swap failed: launch failed", clock.t)
    ]
    assert [e.kind for e in seen] == ["failed"]
    e = ev[0]
    assert e.grant is None


@pytest.mark.parametrize("waited, first", [(4.0, "big"), (3.99, "small")])
def test_swaps_shortest_first_until_the_head_waited_starvation_s(waited, first):
    clock = Clock()
    swap = FakeSwap()
    s = DecodeScheduler(
        num_layers=1,
        gpu=BlockPool(10),
        buffer=BlockPool(10),
        swap=swap,
        clock=clock,
        options=SchedulerOptions(direct_to_gpu=False, swap_order="shortest", starvation_s=4.0),
    )
    for rid, n in (("big", 6), ("small", 2)):
        g = s.reserve(rid, num_blocks=n).grant
        s.land_layers(rid, g.token, [0])
        s.complete(rid, g.token)
    hog = s.gpu.allocate(10)  # no room yet
    clock.t += waited  # at starvation_s exactly the head has waited enough and goes first
    s.gpu.free(hog)
    s.tick()
    assert swap.submitted[0][0] == first


def test_fence_counts_every_entry_it_releases():
    clock = Clock()
    s = DecodeScheduler(
        num_layers=1,
        gpu=BlockPool(8),
        buffer=BlockPool(8),
        swap=FakeSwap(),
        clock=clock,
        options=SchedulerOptions(direct_to_gpu=False, fence_grace_s=5.0),
    )
    for rid, n in (("a", 2), ("b", 3), ("c", 1)):
        s.reserve(rid, num_blocks=n, peer="P" if rid != "c" else "Q")
        s.fail(rid, "gone")
    assert s.metrics()["quarantined_blocks"] == 6
    assert s.fence("P") == 5 and s.metrics()["quarantined_blocks"] == 1
    assert s.fence("P") == 0 and s.fence("Q") == 1
    assert s.metrics()["quarantined_blocks_released"] == 6


def test_prometheus_text():
    s = DecodeScheduler(num_layers=1, gpu=BlockPool(4))
    text = s.prometheus("x_")
    lines = text.splitlines()
    assert text.endswith("\n") and not text.endswith("\n\n")
    assert "# TYPE x_reservations_gpu counter" in lines and "x_reservations_gpu 0" in lines
    assert "# TYPE x_swap_seconds_max gauge" in lines and "# TYPE x_buffer_blocks_peak gauge" in lines
    assert "# TYPE x_gpu_blocks_free gauge" in lines and "x_gpu_blocks_free 4" in lines
    assert "# TYPE x_live_ready gauge" in lines
    names = [ln.split()[2] for ln in lines if ln.startswith("# TYPE")]
    assert names == sorted(names) and len(lines) == 2 * len(names)


def _two_requests():
    """Request "a" holds buffer blocks 0-1 (granted), "q" is queued; GPU blocks 6-7 are a held
    prefix of "p" (the engine's), and the scheduler's invariants hold."""
    s = DecodeScheduler(
        num_layers=1,
        gpu=BlockPool(8, name="gpu"),
        buffer=BlockPool(4, name="buffer"),
        swap=FakeSwap(),
        options=SchedulerOptions(direct_to_gpu=False, on_full="queue", fence_grace_s=1.0),
    )
    s.reserve("a", num_blocks=2)
    s.reserve("b", num_blocks=2)
    s.reserve("q", num_blocks=3)  # queued: the buffer is full
    s.gpu.allocate(8)
    s.gpu.free(list(range(6)))
    s.hold_prefix("p", [6, 7])
    s.check_invariants()
    assert s._reqs["q"].state is State.QUEUED and s._reqs["a"].buffer_blocks == [0, 1]
    return s


def _ready(s, rid, gpu, buffer):
    r = s._reqs[rid]
    r.state, r.gpu_blocks, r.buffer_blocks = State.READY, gpu, buffer


SCHEDULER_CORRUPTIONS = [
    ("a block held twice by one request", lambda s: s._reqs["a"].buffer_blocks.append(0),
     "buffer: block 0 held by a and a"),
    ("a block held by two requests", lambda s: s._reqs["b"].buffer_blocks.__setitem__(0, 1),
     "buffer: block 1 held by a and b"),
    ("a queued request holding blocks", lambda s: setattr(s._reqs["q"], "gpu_blocks", [5]),
     "queued request q holds blocks (gpu [5], buffer None)"),
    ("a ready request still holding buffer blocks", lambda s: _ready(s, "a", s.gpu.allocate(2), [0, 1]),
     "ready request a holds gpu [0, 1] and buffer [0, 1]"),
    ("a ready request without gpu blocks",
     lambda s: (s.buffer.free(s._reqs["a"].buffer_blocks), _ready(s, "a", [], [])),
     "ready request a holds gpu [] and buffer []"),
    ("a quarantined block also held by a request", lambda s: (s.fail("a", "x"), s._reqs["b"].buffer_blocks.__setitem__(
        0, 0)), "buffer: quarantined block 0 also held by b"),
    ("a quarantined block free in its pool", lambda s: (s.fail("a", "x"), s.buffer.free([0])),
     "buffer: block 0 of <quarantine> is free in the pool"),
    ("a prefix block also granted", lambda s: _ready(s, "a", [7], []) or s.buffer.free([0, 1]),
     "gpu: prefix block 7 also held by a"),
    ("a request's block free in its pool", lambda s: s.buffer.free([1]),
     "buffer: block 1 of a is free in the pool"),
    ("a prefix block free in the pool", lambda s: s.gpu.free([6]),
     "gpu: block 6 of a prefix or the engine is free in the pool"),
    ("a block held by nobody", lambda s: s.gpu.allocate(1), "gpu: pool holds 3, owners 2"),
    ("the pool's own runs corrupted", lambda s: setattr(s.gpu, "_heap", []), "gpu: free run 0-6 missing from the heap"),
]  # fmt: skip


@pytest.mark.parametrize(
    "corrupt, why", [c[1:] for c in SCHEDULER_CORRUPTIONS], ids=[c[0] for c in SCHEDULER_CORRUPTIONS]
)
def test_check_invariants_names_each_corruption(corrupt, why):
    s = _two_requests()
    corrupt(s)
    with pytest.raises(AssertionError) as e:
        s.check_invariants()
    assert str(e.value) == why


def test_check_invariants_counts_the_engines_blocks():
    s = _two_requests()
    held = s.gpu.allocate(2)  # the engine's own
    with pytest.raises(AssertionError, match="^gpu: pool holds 4, owners 2$"):
        s.check_invariants()
    s.check_invariants(engine_blocks=held)
    with pytest.raises(AssertionError, match="^gpu: block 5 of a prefix or the engine is free in the pool$"):
        s.check_invariants(engine_blocks=[*held, 5])


def test_tombstones_are_forgotten_after_tombstone_s():
    """A steady rate of requests holds a steady number of tombstones: one ended more than
    ``tombstone_s`` ago goes at the next request's end, however few ended since."""
    s, clock, _, _ = make(tombstone_s=30.0)
    for rid, t in (("a", 0.0), ("b", 20.0), ("c", 31.0)):
        clock.t = t
        s.reserve(rid, num_blocks=1)
        s.abort(rid, "gone")
    with pytest.raises(RequestError, match="unknown request 'a'"):
        s.request("a")
    assert s.request("b").state is State.ABORTED and s.request("c").reason == "gone"
    clock.t = 100.0  # forgotten only when another ends: until then still answered
    assert s.request("b").state is State.ABORTED
    s.reserve("d", num_blocks=1)
    s.abort("d")
    for rid in ("b", "c"):
        with pytest.raises(RequestError, match=f"unknown request '{rid}'"):
            s.request(rid)
    with pytest.raises(ValueError, match="tombstone_s=0 must be a positive number of seconds"):
        SchedulerOptions(tombstone_s=0)
    clock.t = 200.0
    s.reserve("e", num_blocks=1)
    s.abort("e")
    clock.t = 230.0  # exactly tombstone_s after "e" ended: still remembered ("more than" ago goes)
    s.reserve("f", num_blocks=1)
    s.abort("f")
    assert s.request("e").state is State.ABORTED


def test_edges_of_ids_prefixes_and_capacities_and_what_a_request_reports():
    s, clock, _, _ = make(gpu=16, buf=8)
    rid = "r" * 256  # the longest id
    s.reserve(rid, num_tokens=20, peer="pf-1")
    info = s.request(rid)
    assert (info.peer, info.num_tokens, info.num_blocks) == ("pf-1", 20, 2)
    s.hold_prefix("p" * 256, [0, 1])  # a prefix under the longest id too (blocks 0-1 the GPU pool handed out)
    with pytest.raises(RequestError, match=r"at most 256 characters"):
        s.hold_prefix("p" * 257, [0])
    with pytest.raises(RequestError) as e:
        s.hold_prefix("q", list(range(2, 12)))  # ten ids the GPU pool has not handed out
    assert str(e.value) == (
        "request 'q': prefix blocks [2, 3, 4, 5, 6, 7, 8, 9] are free in the GPU pool "
        "(a prefix is blocks the engine holds)"
    )
    with pytest.raises(RequestError) as e:
        s.hold_prefix("q", list(range(10)) + [99])
    assert (
        str(e.value) == "request 'q': a prefix must be distinct GPU block ids in [0, 16), got [0, 1, 2, 3, 4, 5, 6, 7]"
    )
    with pytest.raises(RequestError, match=r"its held prefix of 2 blocks covers all 2 blocks of the prompt"):
        s.reserve("p" * 256, num_blocks=2)
    eng = DecodeScheduler(
        num_layers=1, gpu=None, buffer=BlockPool(4), swap=FakeSwap(), options=SchedulerOptions(bind="engine")
    )
    assert eng.reserve("whole", num_blocks=4).outcome == "buffer"  # exactly the buffer
    with pytest.raises(RequestError) as e:
        eng.reserve("big", num_blocks=5)
    assert str(e.value) == "request 'big' needs 5 blocks: more than the buffer holds (4)"


def test_removing_a_listener_keeps_the_others():
    s, clock, _, ev = make()
    seen: dict[str, list] = {"a": [], "b": [], "c": []}
    fns = {k: seen[k].append for k in seen}
    for fn in fns.values():
        s.add_listener(fn)
    s.remove_listener(fns["c"])  # the last
    s.remove_listener(fns["a"])  # the first
    s.reserve("x", num_blocks=1)
    assert [e.kind for e in seen["b"]] == ["reserved"] and seen["a"] == seen["c"] == []
    with pytest.raises(ValueError, match="^remove_listener: that function is not a listener of this scheduler$"):
        s.remove_listener(fns["a"])


def test_tombstones_are_bounded_oldest_first():
    s = DecodeScheduler(num_layers=1, gpu=BlockPool(8), options=SchedulerOptions(max_tombstones=2))
    for rid in ("a", "b", "c"):
        g = s.reserve(rid, num_blocks=1).grant
        s.land_layers(rid, g.token, [0])
        s.complete(rid, g.token)
        s.take_ready()
        s.finish(rid)
    with pytest.raises(RequestError, match="unknown request 'a'"):
        s.request("a")
    assert s.request("b").state is State.FINISHED and s.request("c").reason == ""
    with pytest.raises(RequestError) as e:
        s.land_layer("c", 1, 0)
    assert str(e.value) == "request 'c' is already finished"
    s.reserve("d", num_blocks=1)
    s.abort("d", "client went away")
    with pytest.raises(RequestError) as e:
        s.abort("d")
    assert str(e.value) == "request 'd' is already aborted (client went away)"
    with pytest.raises(RequestError, match="unknown request 'b'"):
        s.request("b")


def test_many_layers_ranges_and_their_messages():
    s = DecodeScheduler(num_layers=12, gpu=BlockPool(4))
    g = s.reserve("a", num_blocks=1).grant
    assert s.land_layers("a", g.token, range(1, 3)) == 2  # a range from 1: layers 1 and 2
    assert s.request("a").layers_landed == 2
    assert s.land_layers("a", g.token, [0]) == 3
    with pytest.raises(RequestError) as e:
        s.land_layers("a", g.token, range(0, 12))
    assert str(e.value) == "request 'a': layers [0, 1, 2] already landed"
    s.land_layers("a", g.token, range(3, 12))
    g2 = s.reserve("b", num_blocks=1).grant
    s.land_layers("b", g2.token, range(2, 3))
    with pytest.raises(RequestError) as e:
        s.complete("b", g2.token)
    assert str(e.value) == "request 'b': completion before layers [0, 1, 3, 4, 5, 6, 7, 8] landed"
    g3 = s.reserve("c", num_blocks=1).grant
    s.land_layers("c", g3.token, range(12))
    with pytest.raises(RequestError) as e:
        s.land_layers("c", g3.token, list(range(12)))
    assert str(e.value) == "request 'c': layers [0, 1, 2, 3, 4, 5, 6, 7] already landed"
    assert s.complete("a", g.token) is State.READY


def test_counters_accumulate():
    clock = Clock()
    swap = FakeSwap()
    s = DecodeScheduler(
        num_layers=1,
        gpu=BlockPool(8),
        buffer=BlockPool(8),
        swap=swap,
        clock=clock,
        options=SchedulerOptions(
            direct_to_gpu=False, on_full="queue", queue_timeout_s=2.0, fence_grace_s=1.0, max_queue=8
        ),
        listener=lambda e: None,
    )
    for rid in ("a", "b"):  # two swaps: the sums add, busy time covers both
        g = s.reserve(rid, num_blocks=2).grant
        clock.t += 1.0
        s.land_layers(rid, g.token, [0])
        s.complete(rid, g.token)
    s.tick()
    clock.t += 3.0
    swap.finish("a")
    s.tick()
    clock.t += 1.0
    swap.finish("b")
    s.tick()
    m = s.metrics()
    assert m["prefill_wait_avoided_seconds_sum"] == 2.0 + 1.0 and m["prefill_wait_avoided_seconds_max"] == 2.0
    assert m["swap_seconds_sum"] == 3.0 + 4.0 and m["swap_seconds_max"] == 4.0
    assert m["swap_busy_seconds"] == 4.0 and m["swaps_completed"] == 2
    for rid in ("c", "d"):  # two quarantines released: the counter adds
        s.reserve(rid, num_blocks=1)
        s.fail(rid, "x")
    clock.t += 1.0
    s.tick()
    assert s.metrics()["quarantined_blocks_released"] == 2
    s.buffer.allocate(s.buffer.num_free)  # no room: three queue, two time out
    for rid in ("q1", "q2", "q3"):
        assert s.reserve(rid, num_blocks=1).outcome == "queued"
    clock.t += 2.0
    ev = s.tick()
    m = s.metrics()
    assert m["queue_timeouts"] == 3 and m["queue_length"] == 0
    assert [(e.kind, e.reason, e.t) for e in ev] == [("rejected", "timed out in the reservation queue", clock.t)] * 3
    with pytest.raises(RequestError) as e:
        s.abort("q1")
    assert str(e.value) == "request 'q1' is already rejected (timed out in the reservation queue)"
    assert s.prometheus().startswith("# TYPE pdkv_")


def test_a_queue_deadline_is_inclusive_and_a_rejected_reuse_is_remembered_as_rejected():
    clock = Clock()
    s = DecodeScheduler(
        num_layers=1,
        gpu=BlockPool(2),
        clock=clock,
        options=SchedulerOptions(on_full="queue", queue_timeout_s=2.0, max_queue=1),
    )
    s.gpu.allocate(2)
    assert s.reserve("q", num_blocks=1).outcome == "queued"
    clock.t += 1.999
    s.tick()
    assert s.request("q").state is State.QUEUED
    clock.t += 0.001  # exactly at the deadline: rejected
    s.tick()
    assert s.request("q").state is State.REJECTED
    s.reserve("z", num_blocks=1)  # the queue is empty again: z waits
    assert s.reserve("q", num_blocks=1).outcome == "rejected"  # queue full
    # its tombstone is this refusal's (whoever asks for q's KV learns it will not come)
    info = s.request("q")
    assert (info.state, info.reason) == (State.REJECTED, "queue full")
    with pytest.raises(RequestError, match="more than the GPU pool can ever give"):
        s.reserve("big", num_blocks=3)
    assert s.request("big").state is State.REJECTED  # refused for good, remembered too


def test_two_tickets_on_one_request_both_hold_its_blocks():
    s = DecodeScheduler(num_layers=1, gpu=BlockPool(4), options=SchedulerOptions(fence_grace_s=0.0))
    g = s.reserve("a", num_blocks=2).grant
    t1, t2 = s.begin_write("a", g.token), s.begin_write("a", g.token)
    s.fail("a", "gone")
    s.end_write(t1)
    assert s.gpu.num_free == 2  # the second write still holds them
    s.end_write(t2)
    assert s.gpu.num_free == 4


def test_finish_keeping_the_gpu_blocks_frees_nothing():
    s = DecodeScheduler(num_layers=1, gpu=BlockPool(4))
    g = s.reserve("a", num_blocks=2).grant
    s.land_layers("a", g.token, [0])
    s.complete("a", g.token)
    s.take_ready()
    s.finish("a", free_gpu_blocks=False)
    assert s.gpu.num_free == 2 and s.request("a").state is State.FINISHED


def test_a_renewed_lease_still_expires_in_tick():
    clock = Clock()
    clock.t = 0.0  # expiry times and the heap's tie-break counter of similar size
    s = DecodeScheduler(num_layers=2, gpu=BlockPool(4), clock=clock, options=SchedulerOptions(lease_s=1.0))
    g = s.reserve("a", num_blocks=1).grant
    clock.t = 0.5
    s.land_layers("a", g.token, [0])  # the lease now ends at 1.5
    clock.t = 1.0
    s.tick()
    assert s.request("a").state is State.RECEIVING
    clock.t = 1.6
    s.tick()
    assert s.request("a").state is State.EXPIRED


def test_busy_time_adds_separate_busy_spells():
    clock = Clock()
    swap = FakeSwap()
    s = DecodeScheduler(
        num_layers=1,
        gpu=BlockPool(8),
        buffer=BlockPool(8),
        swap=swap,
        clock=clock,
        options=SchedulerOptions(direct_to_gpu=False),
    )
    for rid in ("a", "b"):  # one swap at a time: two spells of 2 s
        g = s.reserve(rid, num_blocks=1).grant
        s.land_layers(rid, g.token, [0])
        s.complete(rid, g.token)
        s.tick()
        clock.t += 2.0
        swap.finish(rid)
        s.tick()
        clock.t += 5.0
    assert s.metrics()["swap_busy_seconds"] == 4.0


def test_check_invariants_catches_a_queued_request_holding_blocks():
    s = DecodeScheduler(num_layers=1, gpu=BlockPool(4), options=SchedulerOptions(on_full="queue"))
    s.reserve("big", num_blocks=3)
    assert s.reserve("q", num_blocks=2).outcome == "queued"
    s.check_invariants()
    s._reqs["q"].gpu_blocks = s.gpu.allocate(1)  # held in the pool and owned: only the state is wrong
    with pytest.raises(AssertionError):
        s.check_invariants()


def test_leases_end_in_the_order_they_run_out_also_for_a_reused_id():
    """An aborted request's id reserved again leaves the first lease's expiry entry behind;
    the second request still expires at its own time, after a lease that ran out before it
    (found by the model machine: with few tombstones the order decides which are forgotten)."""
    s, clock, _, events = make(lease_s=5.0, max_tombstones=2)
    s.reserve("r1", num_blocks=1)
    s.reserve("r2", num_blocks=1)
    s.abort("r1")
    clock.t += 0.25
    s.reserve("r1", num_blocks=1)  # expires 0.25 s after r2
    clock.t += 5.0
    s.tick()
    assert [(e.kind, e.request_id) for e in events if e.kind == "expired"] == [("expired", "r2"), ("expired", "r1")]
    s.reserve("r3", num_blocks=1)
    s.abort("r3")  # a third tombstone: the oldest (r2) is forgotten, r1 is remembered
    assert s.request("r1").state is State.EXPIRED
    with pytest.raises(RequestError, match="unknown request 'r2'"):
        s.request("r2")


def test_the_layout_gives_layers_tokens_per_block_and_block_bytes():
    from pdkv import KVLayout

    lay = KVLayout(num_layers=3, kv_heads=2, head_dim=8, tokens_per_block=16, dtype="bf16", mla=False)
    s = DecodeScheduler(layout=lay, gpu=BlockPool(8))
    assert (s.num_layers, s.tokens_per_block, s.block_bytes) == (lay.total_layers, 16, lay.block_bytes)
    assert s.reserve("a", num_tokens=17).grant.blocks == (0, 1)  # 17 tokens: two blocks of 16
    for bad, msg in (
        (dict(num_layers=4), "num_layers=4 disagrees with the layout's 3"),
        (dict(tokens_per_block=8), "tokens_per_block=8 disagrees with the layout's 16"),
    ):
        with pytest.raises(ValueError, match=msg):
            DecodeScheduler(layout=lay, gpu=BlockPool(8), **bad)
    assert (
        DecodeScheduler(layout=lay, gpu=BlockPool(8), block_bytes=2 * lay.block_bytes).block_bytes
        == 2 * lay.block_bytes
    )
    with pytest.raises(ValueError, match="num_layers=None must be a positive integer"):
        DecodeScheduler(gpu=BlockPool(8))


def test_listeners_added_and_removed_see_every_event_after_the_constructor_listener():
    s, clock, swap, ev = make()
    seen_a, seen_b, order = [], [], []
    a = lambda e: (seen_a.append(e.kind), order.append("a"))  # noqa: E731
    b = lambda e: (seen_b.append(e.kind), order.append("b"))  # noqa: E731
    s.listener = lambda e: order.append("main")
    s.add_listener(a)
    s.add_listener(b)
    r = s.reserve("x", num_tokens=16)
    assert order == ["main", "a", "b"] and seen_a == seen_b == ["reserved"]
    s.remove_listener(a)
    s.land_layers("x", r.grant.token, range(4))
    s.complete("x", r.grant.token)
    assert seen_a == ["reserved"] and seen_b == ["reserved", "ready"]
    with pytest.raises(ValueError, match="not a listener"):
        s.remove_listener(a)
    s.remove_listener(b)
    s.listener = None  # no constructor listener: the added ones alone are called
    got = []
    s.add_listener(got.append)
    s.take_ready()
    s.finish("x")
    s.reserve("y", num_tokens=16)
    assert [e.kind for e in got] == ["reserved"]


def test_swaps_count_their_bytes_and_a_ready_request_aborted_before_hand_off_is_not_handed_off():
    s, clock, swap, ev = make(gpu=8, buf=16, direct_to_gpu=False)
    for rid, n in (("b1", 3), ("b2", 2)):
        r = s.reserve(rid, num_blocks=n)
        assert r.outcome == "buffer"
        s.land_layers(rid, r.grant.token, range(4))
        s.complete(rid, r.grant.token)
    s.tick()
    for rid in ("b1", "b2"):
        swap.finish(rid)
    s.tick()
    assert s.metrics()["swap_bytes"] == (3 + 2) * 100  # both swaps, not the last
    assert s.request("b1").state is State.READY and s.request("b2").state is State.READY
    s.abort("b1", "the client went away")
    assert [x.request_id for x in s.take_ready()] == ["b2"]  # b1 left the hand-off queue
    s.check_invariants()


def test_swaps_admitted_before_an_allocator_refuses_are_still_submitted():
    class Refusing(BlockPool):
        """Says it has room, then refuses the second allocation (another user took it)."""

        calls = 0

        def try_allocate(self, n):
            Refusing.calls += 1
            return None if Refusing.calls == 2 else super().try_allocate(n)

    clock, swap = Clock(), FakeSwap()
    s = DecodeScheduler(
        num_layers=4,
        gpu=Refusing(16, "gpu"),
        buffer=BlockPool(32, "buffer"),
        swap=swap,
        options=SchedulerOptions(direct_to_gpu=False, lease_s=10.0),
        clock=clock,
    )
    for rid in ("a", "b"):
        r = s.reserve(rid, num_blocks=2)
        s.land_layers(rid, r.grant.token, range(4))
        s.complete(rid, r.grant.token)
    s.tick()
    assert [x[0] for x in swap.submitted] == ["a"] and s.request("b").state is State.RECEIVED
    s.tick()  # room "appears" again: b goes next
    assert [x[0] for x in swap.submitted] == ["a", "b"]


def test_a_swap_finished_twice_by_racing_ticks_is_finished_once():
    """Two tick() calls may both see a swap done (polled outside the lock): the second
    finishing of it changes nothing."""
    from pdkv.scheduling import loop as schedloop

    s, clock, swap, ev = make(gpu=8, direct_to_gpu=False)
    r = s.reserve("a", num_blocks=2)
    s.land_layers("a", r.grant.token, range(4))
    s.complete("a", r.grant.token)
    s.tick()
    req = s._swapping["a"]
    swap.finish("a")
    s.tick()
    before = s.metrics()
    schedloop.swap_finished(s, req, None, clock.t)  # the racing tick's late call
    assert s.metrics() == before and [x.request_id for x in s.take_ready()] == ["a"]


# ---------------------------------------------------------------------- held prefixes


def test_hold_prefix_refuses_bad_input_and_holds_nothing():
    s, clock, swap, ev = make()
    mine = s.gpu.allocate(3)  # the engine's prefix cache holds these
    cases = [
        ("", mine, "request_id='' must be a non-empty string"),
        (7, mine, "request_id=7 must be a non-empty string"),
        ("x" * 257, mine, "must be a non-empty string of at most 256 characters"),
        ("a", ["z"], "request 'a': prefix blocks must be integers"),
        ("a", None, "request 'a': prefix blocks must be integers"),
        ("a", [], "request 'a': a prefix must be distinct GPU block ids in [0, 16)"),
        ("a", [mine[0], mine[0]], "a prefix must be distinct GPU block ids"),
        ("a", [16], "a prefix must be distinct GPU block ids in [0, 16), got [16]"),
        ("a", [-1], "a prefix must be distinct GPU block ids"),
        ("a", [mine[0], 9], "request 'a': prefix blocks [9] are free in the GPU pool"),
    ]
    for rid, blocks, msg in cases:
        with pytest.raises(RequestError, match=re.escape(msg)):
            s.hold_prefix(rid, blocks)
    with pytest.raises(RequestError, match=re.escape("request 'a': release=3 must be callable")):
        s.hold_prefix("a", mine, release=3)
    assert not s._holds
    s.hold_prefix("a", mine)
    with pytest.raises(RequestError, match=re.escape("request 'a' is already live or holds a prefix")):
        s.hold_prefix("a", mine[:1])
    r = s.reserve("live", num_tokens=16)
    with pytest.raises(RequestError, match=re.escape("request 'live' is already live or holds a prefix")):
        s.hold_prefix("live", mine[:1])
    assert s.request("live").state is State.RESERVED and r.grant.prefix_blocks == 0


def test_a_held_prefix_is_skipped_in_every_grant_view_and_released_without_a_callback():
    """The grant, check_write's grant and the ready request agree on the prefix; a hold
    without a release callback ends silently."""
    s, clock, swap, ev = make(direct_to_gpu=True)
    mine = s.gpu.allocate(2)
    s.hold_prefix("p", mine)  # no release: the engine tracks its blocks itself
    r = s.reserve("p", num_tokens=16 * 5)
    g = r.grant
    assert r.outcome == "gpu" and len(g.blocks) == 3 and g.prefix_blocks == 2 and not set(g.blocks) & set(mine)
    assert s.check_write("p", g.token).prefix_blocks == 2
    assert s.request("p").num_blocks == 3
    s.land_layers("p", g.token, range(4))
    s.complete("p", g.token)
    (ready,) = s.take_ready()
    assert ready.gpu_blocks == (*mine, *g.blocks) and ready.prefix_blocks == 2 and ready.num_tokens == 80
    s.finish("p")
    assert s.gpu.num_free == 16 - 2 and all(s.gpu.is_held(b) for b in mine)  # the prefix stays the engine's
    s.gpu.free(mine)
    s.check_invariants()


def test_every_refused_late_message_is_counted_once():
    s, clock, _, _ = make(direct_to_gpu=False)
    r = s.reserve("a", num_blocks=1)
    late = lambda: s.metrics()["late_messages_rejected"]  # noqa: E731
    for _ in range(2):
        with pytest.raises(GrantViolation):
            s.land_layer("a", r.grant.token + 1, 0)  # a forged token
    assert late() == 2
    with pytest.raises(GrantViolation):
        s.fail("a", "x", token=r.grant.token + 1)
    with pytest.raises(RequestError, match="unknown request 'zz'"):
        s.renew("zz", 1)
    assert late() == 4
    s.land_layers("a", r.grant.token, range(4))
    s.complete("a", r.grant.token)
    with pytest.raises(RequestError, match="is received; no more writes"):
        s.renew("a", r.grant.token)
    b = s.reserve("b", num_blocks=1)
    clock.t += s.options.lease_s
    with pytest.raises(LeaseExpiredError):
        s.land_layer("b", b.grant.token, 0)
    assert late() == 6


def test_a_rejected_reservation_releases_its_held_prefix_and_reuses_nothing():
    s, clock, _, ev = make(gpu=4, buf=2, direct_to_gpu=False)
    held = s.gpu.allocate(2)  # the engine's own blocks: the prompt's cached prefix
    released = []
    s.hold_prefix("x", held, lambda rid, blocks: released.append((rid, blocks)))
    s.reserve("filler", num_blocks=2)  # the buffer is full now
    res = s.reserve("x", num_blocks=4)
    assert (res.outcome, res.reason) == ("rejected", "no free GPU or buffer blocks")
    assert released == [("x", tuple(held))]
    assert s.metrics()["prefix_blocks_reused"] == 0
    s.hold_prefix("y", held, lambda rid, blocks: released.append((rid, blocks)))
    s.abort("filler")
    clock.t += 5  # past the filler's quarantine
    s.tick()
    assert s.reserve("y", num_blocks=4).outcome == "buffer"
    assert s.metrics()["prefix_blocks_reused"] == 2 and released == [("x", tuple(held))]


def test_drop_prefix_and_an_unclaimed_hold_expire_each_release_once():
    s, clock, swap, ev = make()
    got = []
    a, b = s.gpu.allocate(1), s.gpu.allocate(2)
    s.hold_prefix("a", a, release=lambda rid, blocks: got.append((rid, blocks)))
    s.hold_prefix("b", b, release=lambda rid, blocks: got.append((rid, blocks)))
    s.drop_prefix("a")
    assert got == [("a", tuple(a))]
    with pytest.raises(RequestError, match=re.escape("request 'a' holds no unclaimed prefix")):
        s.drop_prefix("a")
    clock.t += 9.9
    s.tick()
    assert got == [("a", tuple(a))]  # b's hold lives for lease_s
    clock.t += 0.1
    assert s.tick() == []  # a release is not an event
    assert got == [("a", tuple(a)), ("b", tuple(b))] and s.metrics()["prefix_holds_expired"] == 1
    s.reserve("c", num_tokens=16)
    with pytest.raises(
        RequestError, match=re.escape("(it is live: a prefix its reservation claimed is released when it ends)")
    ):
        s.drop_prefix("c")


def test_every_ending_but_finish_is_logged_with_the_state_it_left(caplog):
    """An operator reading pdkv's log sees each request that ended badly: its id, the state
    it ended in, the state it left and why (a finished request is not logged)."""
    s, clock, swap, ev = make()
    caplog.set_level("INFO", logger="pdkv.scheduling")
    r = s.reserve("a", num_tokens=40)
    s.land_layers("a", r.grant.token, [0])
    s.fail("a", "peer said so")
    s.reserve("b", num_tokens=16)
    s.abort("b")
    s.reserve("c", num_tokens=16)
    clock.t += 11
    s.tick()
    got = [(rec.name, rec.levelname, rec.getMessage()) for rec in caplog.records]
    assert got == [
        ("pdkv.scheduling.core", "INFO", "request 'a' failed (was receiving): peer said so"),
        ("pdkv.scheduling.core", "INFO", "request 'b' aborted (was reserved): aborted"),
        ("pdkv.scheduling.core", "INFO", "request 'c' expired (was reserved): lease of 10.0s expired"),
    ]


def test_swaps_are_logged_at_debug_with_their_outcome_and_time(caplog):
    caplog.set_level("DEBUG", logger="pdkv.scheduling.loop")
    s, clock, swap, _ = make(direct_to_gpu=False)
    for rid, n in (("a", 2), ("b", 3)):
        g = s.reserve(rid, num_blocks=n).grant
        s.land_layers(rid, g.token, range(4))
        s.complete(rid, g.token)
    s.tick()  # both swaps submitted
    clock.t += 0.0125
    swap.finish("a")
    swap.finish("b", error=RuntimeError("copy engine fault"))
    s.tick()
    got = [(rec.levelname, rec.getMessage()) for rec in caplog.records if rec.name == "pdkv.scheduling.loop"]
    assert got == [
        ("DEBUG", "swap of 'a' submitted: 2 buffer blocks -> GPU"),
        ("DEBUG", "swap of 'b' submitted: 3 buffer blocks -> GPU"),
        ("DEBUG", "swap of 'a' done after 12.50 ms"),
        ("DEBUG", "swap of 'b' failed: copy engine fault after 12.50 ms"),
    ]


def test_pruning_the_expiry_heap_keeps_every_live_lease():
    # past 4 x live requests + 1,024 entries the heap is pruned of ended requests' entries:
    # the live ones stay, and their leases still run out
    s, clock, swap, _ = make(gpu=4, buf=1200, direct_to_gpu=False, lease_s=10.0, fence_grace_s=0.0)
    live = s.reserve("live", num_blocks=1).grant
    for i in range(1100):  # each granted and aborted: its entry stays until pruned
        s.reserve(f"x{i}", num_blocks=1)
        s.abort(f"x{i}")
    assert len(s._expiry) > 4 * len(s._reqs) + 1024
    s.tick()
    assert [e[2] for e in s._expiry] == ["live"]
    s.land_layer("live", live.token, 0)  # still writable
    clock.t += 11
    s.tick()
    assert s.request("live").state is State.EXPIRED


def test_grant_tokens_are_63_random_bits_each_new(monkeypatch):
    """Tokens come from os.urandom 256 at a time: every grant a new 63-bit one, the read
    refilled after 256 grants."""
    import pdkv.scheduling.core as core

    reads = []
    real = core.os.urandom

    def urandom(n):
        reads.append(n)
        return real(n)

    monkeypatch.setattr(core.os, "urandom", urandom)
    s, clock, swap, _ = make(gpu=1024, buf=1024)
    toks = []
    for i in range(300):
        g = s.reserve(f"r{i}", num_blocks=1).grant
        toks.append(g.token)
        s.abort(f"r{i}")
    assert reads == [2048, 2048]
    assert len(set(toks)) == 300 and all(0 <= t < 1 << 63 for t in toks)
    assert max(toks) >= 1 << 60  # 63 bits, not fewer
    monkeypatch.setattr(core.os, "urandom", lambda n: bytes(range(8)) * (n // 8))
    s2, *_ = make()
    assert s2.reserve("x", num_blocks=1).grant.token == int.from_bytes(bytes(range(8)), "little") >> 1


def test_events_of_a_refused_write_are_delivered_after_the_lock():
    """A landing refused because the lease just ran out still tells the listener the
    request expired, without the lock held."""
    seen = []
    s, clock, swap, _ = make()

    def listener(e):
        seen.append((e.kind, s.metrics()["requests_expired"]))  # would deadlock under the lock

    s.listener = listener
    g = s.reserve("a", num_blocks=1).grant
    clock.t += 100
    with pytest.raises(LeaseExpiredError):
        s.land_layers("a", g.token, range(2))
    assert seen == [("reserved", 0), ("expired", 1)]
    assert s._lock.acquire(blocking=False)
    s._lock.release()


@pytest.mark.parametrize(
    "cls, maker, values",
    [
        ("Grant", "_make_grant", ("r", "buffer", (1, 2), 7, 1.5, 30.0, 1)),
        ("Reservation", "_make_reservation", ("r", "queued", None, "no room; queued")),
        ("ReadyRequest", "_make_ready", ("r", (3, 4), 32, 0)),
        ("Event", "_make_event", (EventKind.READY, "r", None, "", 2.0)),
    ],
)
def test_the_hot_paths_constructors_make_the_same_frozen_values(cls, maker, values):
    import dataclasses

    from pdkv.scheduling import lifecycle

    kind = getattr(lifecycle, cls)
    # the module's own (made at import) and one made here, by the same _maker
    for make in (getattr(lifecycle, maker), lifecycle._maker(kind)):
        fast, slow = make(*values), kind(*values)
        assert type(fast) is kind and fast == slow and repr(fast) == repr(slow) and hash(fast) == hash(slow)
        assert dataclasses.astuple(fast) == values
        assert make.__name__ == make.__qualname__ == f"make_{cls}"
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.request_id = "x"
        with pytest.raises(TypeError):
            make(*values[:-1])  # every field is required


def test_gpu_room_goes_first_to_a_received_request_waiting_for_its_swap():
    """direct_to_gpu: once a received request waits for a swap, a new reservation is not
    given GPU blocks directly ahead of it (it goes to the buffer), so a large received
    request is not starved by a stream of small new ones taking every freed block."""
    s, clock, swap, ev = make(gpu=10, buf=32)
    b = s.reserve("b", num_blocks=6)
    assert b.outcome == "gpu"
    a = s.reserve("a", num_blocks=8)
    assert a.outcome == "buffer"
    s.land_layers("a", a.grant.token, range(4))
    s.complete("a", a.grant.token)
    s.tick()
    assert s.request("a").state is State.RECEIVED  # 4 free GPU blocks: it waits for room
    s.land_layers("b", b.grant.token, range(4))
    s.complete("b", b.grant.token)
    s.take_ready()
    s.finish("b")  # 10 free now; a small new request comes before the next tick
    c = s.reserve("c", num_blocks=3)
    assert c.outcome == "buffer"  # not the GPU: that room is a's
    s.tick()
    assert s.request("a").state is State.SWAPPING
    s.check_invariants()


def test_a_requests_binding_is_what_its_reservation_carried():
    """``request(rid).binding``: the reservation's opaque bytes while the request lives (an
    engine adapter checks claims against them); none given, none kept."""
    s, clock, swap, ev = make()
    s.reserve("a", num_tokens=16, binding=b"\x01" * 32)
    s.reserve("b", num_tokens=16)
    assert s.request("a").binding == b"\x01" * 32 and s.request("b").binding == b""
    assert s.request("a").num_tokens == 16
    s.check_invariants()
