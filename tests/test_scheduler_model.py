"""The decode scheduler against a model of itself.

``ModelScheduler`` is a second, plain implementation of the lifecycle the scheduler
promises (states, lowest-first block ids, leases on a fake clock, quarantine and write
tickets, the FIFO queue, swaps, the GPU reserve, every counter). The state machine drives
both with the same steps, drawn so that most are legal (reservations that fit, the real
tokens, queued grants learned from the listener), and after every step asserts that each
call had exactly the outcome the model predicts (the result, or the precise error class
and message) and that states, block ids, queue, quarantine and metrics agree. Every call
goes through that comparison, so an exception the model does not predict fails the step by
assertion, naming the call and both outcomes. Nothing is caught and discarded.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_scheduler import Clock

from pdkv.errors import GrantViolation, LeaseExpiredError, RequestError
from pdkv.scheduling.blocks import BlockPool
from pdkv.scheduling.scheduler import DecodeScheduler, SchedulerOptions, State

WRITABLE = (State.RESERVED, State.RECEIVING)
LAYERS = 3
BLOCK_BYTES = 100


class Handle:
    def __init__(self):
        self.finished = False
        self.error = None

    def done(self):
        return self.finished


class Swap:
    def __init__(self):
        self.handles: dict[str, Handle] = {}
        self.fail_submit = False

    def submit(self, rid, buf, gpu):
        if self.fail_submit:
            raise RuntimeError("launch failed")
        h = self.handles[rid] = Handle()
        return h


@dataclass
class MReq:
    rid: str
    n: int
    peer: str
    gpu_ok: bool
    state: State = State.QUEUED
    loc: str = ""
    token: int = 0  # what a queued request has until it is granted
    expires: float = 0.0
    landed: set[int] = field(default_factory=set)
    buf: list[int] | None = None
    gpu: list[int] | None = None
    queue_deadline: float = 0.0
    received_at: float = 0.0
    cancel: tuple[State, str] | None = None
    in_ready: bool = False
    reserved_at: float = 0.0
    swap_started: float = 0.0
    writers: list[int] = field(default_factory=lambda: [0])  # shared with quarantine entries
    prefix: tuple[int, ...] = ()  # decode's held prefix (hold_prefix), released once


@dataclass
class MQuar:
    release_at: float
    peer: str
    pool: str
    blocks: list[int]
    writers: list[int]
    fenced: bool = False

    def releasable(self, now):
        return self.writers[0] == 0 and (self.fenced or self.release_at <= now)


class ModelScheduler:
    """What the scheduler must do, written out plainly."""

    def __init__(self, gpu: int, buf: int | None, o: SchedulerOptions):
        self.o = o
        self.total = {"gpu": gpu, "buffer": buf or 0}
        self.free = {"gpu": set(range(gpu)), "buffer": set(range(buf or 0))}
        self.has_buffer = buf is not None
        self.reqs: dict[str, MReq] = {}
        self.tomb: dict[str, tuple[State, str, float]] = {}  # insertion-ordered: state, reason, t
        self.ended_ever: set[str] = set()
        self.queue: list[str] = []
        self.swapq: list[str] = []
        self.swapping: list[str] = []
        self.ready: list[str] = []
        self.quar: list[MQuar] = []
        self.holds: dict[str, tuple[tuple[int, ...], float]] = {}  # unclaimed prefix holds: blocks, deadline
        self.releases: list[tuple[str, tuple[int, ...]]] = []  # prefix releases, in order
        self.unfreed: list[int] = []  # released prefix blocks the engine frees after the call
        self.events: list[tuple] = []  # (kind, rid, reason, t, grant fields or None)
        self.now = 0.0
        self.m = dict.fromkeys(
            (
                "reservations_gpu",
                "reservations_buffer",
                "reservations_queued",
                "reservations_rejected",
                "grants_from_queue",
                "queue_timeouts",
                "layers_landed",
                "requests_received",
                "requests_ready",
                "requests_finished",
                "requests_failed",
                "requests_expired",
                "requests_aborted",
                "late_messages_rejected",
                "swaps_submitted",
                "swaps_completed",
                "swaps_failed",
                "swap_bytes",
                "quarantined_blocks_released",
                "buffer_blocks_peak",
                "writes_admitted",
                "swap_seconds_sum",
                "swap_seconds_max",
                "swap_busy_seconds",
                "prefill_wait_avoided_seconds_sum",
                "prefill_wait_avoided_seconds_max",
                "prefix_blocks_reused",
                "prefix_holds_expired",
            ),
            0,
        )
        self.busy_since = 0.0

    # -- blocks
    def alloc(self, pool, n):
        ids = sorted(self.free[pool])[:n]
        self.free[pool] -= set(ids)
        return ids

    def release(self, req, now):
        quarantine = req.state in WRITABLE
        for pool, attr in (("buffer", "buf"), ("gpu", "gpu")):
            blocks = getattr(req, attr)
            if blocks:
                setattr(req, attr, None)
                if (quarantine and self.o.fence_grace_s > 0) or req.writers[0]:
                    self.quar.append(MQuar(now + self.o.fence_grace_s, req.peer, pool, blocks, req.writers))
                else:
                    self.free[pool] |= set(blocks)

    def release_prefix(self, rid, blocks):
        """The scheduler gives a held prefix back; the engine (the machine) frees it, in
        its release callback, which runs once the scheduler call has returned its lock:
        decisions later in the same call do not see those blocks free (see settle)."""
        if blocks:
            self.releases.append((rid, tuple(blocks)))
            self.unfreed.extend(blocks)

    def settle(self):
        """Released prefixes freed by the engine: before the next call that allocates."""
        self.free["gpu"] |= set(self.unfreed)
        self.unfreed = []

    def free_quar(self, q):
        self.quar.remove(q)
        self.free[q.pool] |= set(q.blocks)
        self.m["quarantined_blocks_released"] += len(q.blocks)

    # -- transitions
    def grant(self, req, now):
        o, n = self.o, req.n
        # GPU room goes first to requests received and waiting for a swap
        if o.direct_to_gpu and req.gpu_ok and not self.swapq and len(self.free["gpu"]) - n >= o.gpu_reserve_blocks:
            req.loc, req.gpu = "gpu", self.alloc("gpu", n)
        elif self.has_buffer and len(self.free["buffer"]) >= n:
            req.loc, req.buf = "buffer", self.alloc("buffer", n)
            self.m["buffer_blocks_peak"] = max(
                self.m["buffer_blocks_peak"], self.total["buffer"] - len(self.free["buffer"])
            )
        else:
            return False
        req.state, req.expires, req.reserved_at = State.RESERVED, now + o.lease_s, now
        self.m["reservations_" + req.loc] += 1
        return True

    def grant_fields(self, req):
        return (req.rid, req.loc, tuple(req.gpu or req.buf), req.expires, self.o.lease_s)

    def entomb(self, rid, state, reason, now):
        self.tomb.pop(rid, None)
        self.tomb[rid] = (state, reason, now)
        self.ended_ever.add(rid)  # forgotten or not: a late message may name it
        while self.tomb and (
            len(self.tomb) > self.o.max_tombstones or next(iter(self.tomb.values()))[2] < now - self.o.tombstone_s
        ):
            del self.tomb[next(iter(self.tomb))]

    def terminate(self, req, state, reason, now):
        if req.state is State.SWAPPING:
            if req.cancel is None:
                req.cancel = (state, reason)
            return
        self.release(req, now)
        if req.state is State.QUEUED and req.rid in self.queue:
            self.queue.remove(req.rid)
        if req.rid in self.swapq:
            self.swapq.remove(req.rid)
        if req.state is State.READY and req.in_ready:
            self.ready.remove(req.rid)
        req.state = state
        self.release_prefix(req.rid, req.prefix)
        req.prefix = ()
        del self.reqs[req.rid]
        self.entomb(req.rid, state, reason, now)
        key = {
            State.FAILED: "requests_failed",
            State.EXPIRED: "requests_expired",
            State.ABORTED: "requests_aborted",
        }.get(state)
        if key:
            self.m[key] += 1
        self.events.append((state.value, req.rid, reason, now, None))

    def live(self, rid):
        """The live request, or the exception the scheduler must raise for ``rid``."""
        req = self.reqs.get(rid)
        if req is not None:
            return req
        self.m["late_messages_rejected"] += 1
        t = self.tomb.get(rid)
        if t is not None and t[0] is State.EXPIRED:
            return LeaseExpiredError(f"request {rid!r}: its lease expired; the message is refused")
        if t is not None:
            return RequestError(f"request {rid!r} is already {t[0].value}" + (f" ({t[1]})" if t[1] else ""))
        return RequestError(f"unknown request {rid!r}")

    def writable(self, req, token, now):
        if req.token != token:
            self.m["late_messages_rejected"] += 1
            return GrantViolation(f"request {req.rid!r}: grant token does not match (stale or forged)")
        if req.state not in WRITABLE:
            self.m["late_messages_rejected"] += 1
            return RequestError(f"request {req.rid!r} is {req.state.value}; no more writes are accepted")
        if now >= req.expires:
            self.terminate(req, State.EXPIRED, f"lease of {self.o.lease_s}s expired", now)
            self.m["late_messages_rejected"] += 1
            return LeaseExpiredError(f"request {req.rid!r}: its lease expired; the message is refused")
        return None

    def tick(self, now, swap: Swap, expiry_order: Sequence[str] = ()):
        self.settle()
        # leases that end at one instant end in no promised order: the real one's order is
        # taken (it decides which tombstones the oldest-first eviction drops)
        rank = {rid: i for i, rid in enumerate(expiry_order)}
        for rid in [r for r, (_, dl) in self.holds.items() if dl <= now]:
            blocks, _ = self.holds.pop(rid)
            self.m["prefix_holds_expired"] += 1
            self.release_prefix(rid, blocks)
        for req in sorted(
            [r for r in self.reqs.values() if r.state in WRITABLE and r.expires <= now],
            key=lambda r: (r.expires, rank.get(r.rid, len(rank))),
        ):
            self.terminate(req, State.EXPIRED, f"lease of {self.o.lease_s}s expired", now)
        while self.queue and self.reqs[self.queue[0]].queue_deadline <= now:
            self.m["queue_timeouts"] += 1
            self.terminate(self.reqs[self.queue[0]], State.REJECTED, "timed out in the reservation queue", now)
        for q in [q for q in self.quar if q.releasable(now)]:
            self.free_quar(q)
        while self.queue:
            req = self.reqs[self.queue[0]]
            if not self.grant(req, now):
                break
            self.queue.pop(0)
            self.m["grants_from_queue"] += 1
            self.events.append(("granted", req.rid, "", now, self.grant_fields(req)))
        for rid in list(self.swapping):
            if rid in swap.handles and swap.handles[rid].finished:
                self.swap_finished(self.reqs[rid], swap.handles.pop(rid).error, now)
        admitted = []
        while self.swapq:
            rid = self.swapq[0]
            if self.o.swap_order == "shortest" and now - self.reqs[rid].received_at < self.o.starvation_s:
                rid = min(self.swapq, key=lambda k: self.reqs[k].n)
            req = self.reqs[rid]
            if len(self.free["gpu"]) - req.n < self.o.gpu_reserve_blocks or len(self.free["gpu"]) < req.n:
                break
            self.swapq.remove(rid)
            req.gpu, req.state, req.swap_started = self.alloc("gpu", req.n), State.SWAPPING, now
            wait = now - req.reserved_at
            self.m["prefill_wait_avoided_seconds_sum"] += wait
            self.m["prefill_wait_avoided_seconds_max"] = max(self.m["prefill_wait_avoided_seconds_max"], wait)
            if not self.swapping:
                self.busy_since = now
            self.swapping.append(rid)
            admitted.append(req)
        for req in admitted:
            self.m["swaps_submitted"] += 1
            if swap.fail_submit:
                self.swap_finished(req, RuntimeError("launch failed"), now)

    def swap_finished(self, req, err, now):
        self.swapping.remove(req.rid)
        if not self.swapping:
            self.m["swap_busy_seconds"] += now - self.busy_since
        self.m["swap_seconds_sum"] += now - req.swap_started
        self.m["swap_seconds_max"] = max(self.m["swap_seconds_max"], now - req.swap_started)
        self.free["buffer"] |= set(req.buf)
        req.buf = None
        if err is not None:
            self.m["swaps_failed"] += 1
            req.state = State.RECEIVED
            self.terminate(req, State.FAILED, f"swap failed: {err}", now)
            return
        self.m["swaps_completed"] += 1
        self.m["swap_bytes"] += req.n * BLOCK_BYTES
        req.state = State.READY
        if req.cancel is not None:
            self.terminate(req, *req.cancel, now)
            return
        req.in_ready = True
        self.ready.append(req.rid)
        self.m["requests_ready"] += 1
        self.events.append(("ready", req.rid, "", now, None))

    def info(self, rid):
        """The RequestInfo fields the scheduler must report for ``rid``."""
        req = self.reqs.get(rid)
        if req is not None:
            return (rid, req.state, req.loc, req.n, len(req.landed), tuple(req.buf or ()), tuple(req.gpu or ()), "")
        state, reason, _ = self.tomb[rid]
        return (rid, state, "", 0, 0, (), (), reason)

    def metrics(self):
        out = dict(self.m)
        for st_ in (State.QUEUED, State.RESERVED, State.RECEIVING, State.RECEIVED, State.SWAPPING, State.READY):
            out[f"live_{st_.value}"] = sum(1 for r in self.reqs.values() if r.state is st_)
        out["gpu_blocks_free"], out["gpu_blocks_total"] = len(self.free["gpu"]), self.total["gpu"]
        if self.has_buffer:
            out["buffer_blocks_free"], out["buffer_blocks_total"] = len(self.free["buffer"]), self.total["buffer"]
        out["quarantined_blocks"] = sum(len(q.blocks) for q in self.quar)
        out["queue_length"] = len(self.queue)
        return out


def _says(expected):
    return "success" if expected is None else f"{type(expected).__name__}: {expected}"


def _outcome(expected, call, what):
    """Run ``call`` and compare its outcome with the model's prediction: ``expected`` None
    (a result, returned) or an exception (exactly its class and message). Any other outcome,
    an exception the model does not predict included, fails by assertion naming the call and
    both outcomes (the exception chained). Returns the call's result."""
    try:
        got = call()
    except Exception as exc:
        if expected is not None and type(exc) is type(expected) and str(exc) == str(expected):
            return None
        raise AssertionError(
            f"{what}: the model predicts {_says(expected)}; the scheduler raised {type(exc).__name__}: {exc}"
        ) from exc
    assert expected is None, f"{what}: the model predicts {_says(expected)}; the scheduler returned {got!r}"
    return got


class Predicted:
    """The scheduler under test, every public call's outcome held to the model's prediction:
    success, unless the call is made inside ``_raises`` (which names the error it predicts).
    So an exception the model does not foresee fails the step by assertion, like a wrong
    result, and is never mistaken for a crash of the test itself."""

    expecting = False

    def __init__(self, real: DecodeScheduler):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args, **kwargs):
            if Predicted.expecting:
                return attr(*args, **kwargs)
            return _outcome(None, lambda: attr(*args, **kwargs), f"{name}()")

        return call


def _raises(expected, call):
    """Run ``call``; assert it raised exactly ``expected``'s class and message (or returned,
    when ``expected`` is None). Returns the call's result."""
    rule_name = sys._getframe(1).f_code.co_name
    event(f"{rule_name}: {'ok' if expected is None else type(expected).__name__}")
    Predicted.expecting = True
    try:
        return _outcome(expected, call, rule_name)
    finally:
        Predicted.expecting = False


class SchedulerModelMachine(RuleBasedStateMachine):
    GPU, BUF = 12, 16
    OPTS = dict(
        lease_s=5.0,
        fence_grace_s=1.0,
        gpu_reserve_blocks=2,
        on_full="queue",
        queue_timeout_s=8.0,
        max_queue=3,
        direct_to_gpu=True,
    )
    BUFFER = True
    POOL = BlockPool  # the pools' class (a test plants a broken one)

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.swap = Swap()
        o = _outcome(None, lambda: SchedulerOptions(**self.OPTS), "SchedulerOptions()")
        self.real_events: list = []
        self.s = Predicted(
            _outcome(
                None,
                lambda: DecodeScheduler(
                    num_layers=LAYERS,
                    gpu=self.POOL(self.GPU, "gpu"),
                    buffer=self.POOL(self.BUF, "buffer") if self.BUFFER else None,
                    swap=self.swap if self.BUFFER else None,
                    block_bytes=BLOCK_BYTES,
                    options=o,
                    clock=self.clock,
                    listener=self.real_events.append,
                ),
                "DecodeScheduler()",
            )
        )
        self.m = ModelScheduler(self.GPU, self.BUF if self.BUFFER else None, o)
        self.k = 0
        self.tickets: list[tuple[object, MReq]] = []
        self.kept: list[list[int]] = []  # GPU blocks the engine kept past finish(free_gpu_blocks=False)
        self.real_released: list[tuple[str, tuple[int, ...]]] = []

    def _released(self, rid, blocks):
        """The engine's release of a held prefix: recorded, and the blocks freed (a second
        release of the same hold would be a double free, which the pool refuses)."""
        self.real_released.append((rid, tuple(blocks)))
        self.s.gpu.free(list(blocks))

    # -- helpers
    def _events(self, ordered=True, returned=None):
        def fields(g):
            return None if g is None else (g.request_id, g.location, g.blocks, g.lease_expires, g.lease_s)

        got = [(e.kind, e.request_id, e.reason, e.t, fields(e.grant)) for e in self.real_events]
        if returned is not None:  # tick() returns what it delivered
            assert [(e.kind, e.request_id, e.reason, e.t, fields(e.grant)) for e in returned] == got
        for e in self.real_events:  # the listener is how a transport learns queued grants' tokens
            if e.grant is not None:
                assert 0 <= e.grant.token < 1 << 63  # what the wire carries
                self.m.reqs[e.request_id].token = e.grant.token
        want = self.m.events
        if not ordered:  # leases expiring at one instant: no order among them is promised
            got, want = sorted(got, key=repr), sorted(want, key=repr)
        assert got == want, (got, want)
        self.real_events.clear()
        self.m.events = []

    def _pick(self, data, states):
        rids = sorted(r for r, q in self.m.reqs.items() if q.state in states)
        return data.draw(st.sampled_from(rids)) if rids else None

    def _any_rid(self, data):
        """Mostly a live request; sometimes a terminal one or one never seen."""
        live = sorted(self.m.reqs)
        if live and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(live))
        return data.draw(st.sampled_from(sorted(self.m.tomb) + ["never-seen"]))

    # -- rules
    @rule(n=st.integers(1, 15), gpu_ok=st.booleans(), peer=st.sampled_from(["A", "B"]), data=st.data())
    def reserve(self, n, gpu_ok, peer, data=None):
        reuse = sorted(r for r in self.m.tomb if r not in self.m.holds)
        if data is not None and reuse and data.draw(st.integers(0, 3)) == 0:
            rid = data.draw(st.sampled_from(reuse))  # an id whose request ended: allowed again
        else:
            self.k += 1
            rid = f"r{self.k}"
        self._reserve(rid, n, gpu_ok, peer)

    def _reserve(self, rid, n, gpu_ok, peer):
        o, m = self.m.o, self.m
        m.settle()
        hold = m.holds.get(rid)
        p = len(hold[0]) if hold is not None else 0
        if p >= n:
            _raises(
                RequestError(
                    f"request {rid!r}: its held prefix of {p} blocks covers all {n} blocks of the prompt; "
                    "nothing would be received"
                ),
                lambda: self.s.reserve(rid, num_blocks=n, peer=peer, gpu_ok=gpu_ok),
            )
            return
        direct = o.direct_to_gpu and gpu_ok
        cap = self.GPU - o.gpu_reserve_blocks
        ns = n - p  # only the suffix is granted
        if ns > cap or (not direct and ns > m.total["buffer"]):
            why = f"request {rid!r} needs {ns} blocks: more than the GPU pool can ever give " + (
                f"({cap} above the reserve)" + ("" if direct else f" or the buffer holds ({m.total['buffer']})")
            )
            _raises(RequestError(why), lambda: self.s.reserve(rid, num_blocks=n, peer=peer, gpu_ok=gpu_ok))
            m.entomb(rid, State.REJECTED, why, self.clock.t)  # refused for good: its tombstone says so
            return
        self.last_rid = rid
        req = MReq(rid, ns, peer, gpu_ok)
        if hold is not None:
            del m.holds[rid]
            req.prefix = hold[0]
        now = self.clock.t
        m.tomb.pop(rid, None)
        if not m.queue and m.grant(req, now):
            m.reqs[rid] = req
            m.events.append(("reserved", rid, "", now, m.grant_fields(req)))
            want, why = req.loc, ""
        elif o.on_full == "queue" and len(m.queue) < o.max_queue:
            req.queue_deadline = now + o.queue_timeout_s
            m.reqs[rid] = req
            m.queue.append(rid)
            m.m["reservations_queued"] += 1
            want, why = "queued", "no room; queued"
        else:
            m.m["reservations_rejected"] += 1
            want, why = "rejected", "queue full" if o.on_full == "queue" else "no free GPU or buffer blocks"
            m.entomb(rid, State.REJECTED, why, now)
            m.release_prefix(rid, req.prefix)
        if p and want != "rejected":
            m.m["prefix_blocks_reused"] += p
            event(f"a held prefix claimed ({want})")
        r = self.s.reserve(rid, num_blocks=n, peer=peer, gpu_ok=gpu_ok)
        assert (r.request_id, r.outcome, r.reason) == (rid, want, why), (r, want, why)
        if r.grant is not None:
            g = r.grant
            assert (g.request_id, g.location, g.blocks, g.lease_expires, g.lease_s) == m.grant_fields(req)
            assert g.prefix_blocks == p
            assert 0 <= g.token < 1 << 63
            req.token = g.token
        else:
            assert r.grant is None
        self._events()

    @rule(k=st.integers(1, 4), data=st.data())
    def hold_prefix(self, k, data):
        """The engine's prefix cache has the first k blocks of a request's prompt: it holds
        k GPU blocks of its own and names them before prefill reserves."""
        m = self.m
        m.settle()
        if len(m.free["gpu"]) < k:
            return
        live = sorted(r for r in m.reqs if r not in m.holds)
        if live and data.draw(st.integers(0, 5)) == 0:
            rid = data.draw(st.sampled_from(live))  # live already: refused, nothing held
        else:
            self.k += 1
            rid = f"h{self.k}"
        ids = m.alloc("gpu", k)
        assert self.s.gpu.allocate(k) == ids  # the engine takes them from the same pool
        if rid in m.reqs:
            _raises(
                RequestError(f"request {rid!r} is already live or holds a prefix"),
                lambda: self.s.hold_prefix(rid, ids, self._released),
            )
            self.s.gpu.free(ids)
            m.free["gpu"] |= set(ids)
            return
        self.s.hold_prefix(rid, ids, self._released)
        m.holds[rid] = (tuple(ids), self.clock.t + m.o.lease_s)

    @rule(k=st.integers(1, 3), extra=st.integers(1, 5), gpu_ok=st.booleans(), data=st.data())
    def serve_with_a_prefix(self, k, extra, gpu_ok, data):
        """The prefix path in one step: hold, reserve the suffix, every layer, complete,
        tick (the engine then takes it with its prefix in front)."""
        before = set(self.m.holds)
        self.hold_prefix(k, data)
        new = sorted(set(self.m.holds) - before)
        if not new:
            return
        rid = new[0]
        self._reserve(rid, k + extra, gpu_ok, "A")
        if rid in self.m.reqs and self.m.reqs[rid].state in WRITABLE:
            self.complete_rid(rid, early=1)
        self.tick()

    @rule(data=st.data(), extra=st.integers(1, 8), gpu_ok=st.booleans())
    def reserve_with_a_held_prefix(self, data, extra, gpu_ok):
        held = sorted(self.m.holds)
        if held:
            rid = data.draw(st.sampled_from(held))
            p = len(self.m.holds[rid][0])
            n = p + extra if data.draw(st.integers(0, 5)) else data.draw(st.integers(1, p))  # sometimes all prefix
            self._reserve(rid, n, gpu_ok, "A")

    @rule(data=st.data())
    def drop_prefix(self, data):
        m = self.m
        held = sorted(m.holds)
        if held and data.draw(st.integers(0, 3)):
            rid = data.draw(st.sampled_from(held))
            blocks, _ = m.holds.pop(rid)
            m.release_prefix(rid, blocks)
            self.s.drop_prefix(rid)
            return
        rid = self._any_rid(data)
        if rid in m.holds:
            return
        claimed = " (it is live: a prefix its reservation claimed is released when it ends)" if rid in m.reqs else ""
        _raises(RequestError(f"request {rid!r} holds no unclaimed prefix{claimed}"), lambda: self.s.drop_prefix(rid))

    @rule(data=st.data())
    def hold_bad_prefixes(self, data):
        """Refused, nothing held: free blocks, duplicates, ids outside the pool."""
        m = self.m
        self.k += 1
        rid = f"bad{self.k}"
        m.settle()
        free = sorted(m.free["gpu"])
        shape = f"request {rid!r}: a prefix must be distinct GPU block ids in [0, {self.GPU}), got "
        cases = [([self.GPU], f"{shape}[{self.GPU}]"), ([], f"{shape}[]")]
        if free:
            cases.append(
                (
                    [free[0]],
                    f"request {rid!r}: prefix blocks [{free[0]}] are free in the GPU pool "
                    "(a prefix is blocks the engine holds)",
                )
            )
        blocks, msg = data.draw(st.sampled_from(cases))
        _raises(RequestError(msg), lambda: self.s.hold_prefix(rid, blocks))
        assert rid not in self.s._holds

    @rule(n=st.integers(1, 6), gpu_ok=st.booleans(), peer=st.sampled_from(["A", "B"]), data=st.data())
    def serve_one(self, n, gpu_ok, peer, data):
        """The common path in one step: reserve, every layer, complete (then tick)."""
        self.last_rid = None
        self.reserve(n, gpu_ok, peer)
        rid = self.last_rid
        if rid in self.m.reqs and self.m.reqs[rid].state in WRITABLE:
            self.complete_rid(rid, early=1)
        self.tick()

    @rule(data=st.data())
    def reserve_a_live_id_again(self, data):
        rid = self._pick(data, tuple(State))
        if rid is not None:
            _raises(
                RequestError(f"request {rid!r} is already live ({self.m.reqs[rid].state.value})"),
                lambda: self.s.reserve(rid, num_blocks=1),
            )

    @rule(data=st.data(), honest=st.integers(0, 9))
    def land(self, data, honest):
        rid = self._pick(data, WRITABLE)
        if rid is None:
            return
        req = self.m.reqs[rid]
        left = sorted(set(range(LAYERS)) - req.landed)
        layers = data.draw(st.lists(st.sampled_from(left), min_size=1, unique=True)) if left and honest else [0]
        if honest == 2 and left:  # the same layers as a range, where they are one
            layers = range(min(left), min(left) + 1 + (len(left) > 1 and max(left) == min(left) + 1))
        if honest == 3:  # an empty list: lands nothing, renews the lease
            layers = []
        token = req.token if honest != 1 else req.token ^ 1
        now = self.clock.t
        err = self.m.writable(req, token, now)
        dup = sorted(set(layers) & req.landed)
        if err is None and dup:
            err = RequestError(f"request {rid!r}: layers {dup[:8]} already landed")
        if err is None:
            req.landed |= set(layers)
            req.state, req.expires = State.RECEIVING, now + self.m.o.lease_s
            self.m.m["layers_landed"] += len(layers)
        if honest >= 5 and isinstance(layers, list) and len(layers) == 1:  # one layer, as a receiver lands them
            got = _raises(err, lambda: self.s.land_layer(rid, token, layers[0]))
        else:
            got = _raises(err, lambda: self.s.land_layers(rid, token, layers))
        if err is None:
            assert got == len(req.landed)
        self._events()

    @rule(data=st.data(), early=st.integers(0, 5))
    def complete(self, data, early):
        rid = self._pick(data, WRITABLE)
        if rid is not None:
            self.complete_rid(rid, early)

    def complete_rid(self, rid, early):
        req, m, now = self.m.reqs[rid], self.m, self.clock.t
        if early:  # land what is missing first (the usual way)
            left = sorted(set(range(LAYERS)) - req.landed)
            if left:
                if m.writable(req, req.token, now) is None:
                    req.landed |= set(left)
                    req.state, req.expires = State.RECEIVING, now + m.o.lease_s
                    m.m["layers_landed"] += len(left)
                    assert self.s.land_layers(rid, req.token, left) == LAYERS
                else:
                    _raises(
                        LeaseExpiredError(f"request {rid!r}: its lease expired; the message is refused"),
                        lambda: self.s.land_layers(rid, req.token, left),
                    )
                    self._events()
                    return
        err = m.writable(req, req.token, now)
        if err is None and len(req.landed) < LAYERS:
            missing = sorted(set(range(LAYERS)) - req.landed)
            err = RequestError(f"request {rid!r}: completion before layers {missing[:8]} landed")
        if err is None:
            m.m["requests_received"] += 1
            req.received_at = now
            if req.loc == "gpu":
                req.state, req.in_ready = State.READY, True
                m.ready.append(rid)
                m.m["requests_ready"] += 1
                m.events.append(("ready", rid, "", now, None))
            else:
                req.state = State.RECEIVED
                m.swapq.append(rid)
                m.events.append(("received", rid, "", now, None))
        got = _raises(err, lambda: self.s.complete(rid, req.token))
        if err is None:
            assert got is req.state
        self._events()

    @rule(data=st.data(), with_token=st.integers(0, 2))
    def fail(self, data, with_token):
        rid = self._any_rid(data)
        req = self.m.live(rid)
        token = None
        if isinstance(req, MReq) and with_token:
            token = req.token if with_token == 1 else req.token ^ 1
        if isinstance(req, MReq):
            if token is not None and token != req.token:
                self.m.m["late_messages_rejected"] += 1
                err = GrantViolation(f"request {rid!r}: grant token does not match (stale or forged)")
            else:
                err = None
                self.m.terminate(req, State.FAILED, "peer said so", self.clock.t)
        else:
            err = req
        _raises(err, lambda: self.s.fail(rid, "peer said so", token=token))
        self._events()

    @rule(data=st.data())
    def abort(self, data):
        rid = self._any_rid(data)
        req = self.m.live(rid)
        err = req if not isinstance(req, MReq) else None
        if err is None:
            self.m.terminate(req, State.ABORTED, "aborted", self.clock.t)
        _raises(err, lambda: self.s.abort(rid))
        self._events()

    @rule(data=st.data())
    def late_message_for_a_terminal_or_unknown_request(self, data):
        rids = sorted(self.m.ended_ever) + ["never-seen"]
        rid = data.draw(st.sampled_from(rids))
        if rid in self.m.reqs:
            return
        err = self.m.live(rid)
        _raises(err, lambda: self.s.land_layer(rid, 1, 0))

    @rule(dt=st.sampled_from([0.25, 1.0, 3.0, 5.0, 8.0]))
    def advance(self, dt):
        self.clock.t += dt

    @rule(data=st.data())
    def advance_to_a_lease_boundary(self, data):
        rid = self._pick(data, WRITABLE)
        if rid is not None:  # exactly at expiry: the lease is over (now >= expires)
            self.clock.t = max(self.clock.t, self.m.reqs[rid].expires)

    @rule()
    def tick(self):
        returned = self.s.tick()
        self.m.tick(self.clock.t, self.swap, [e.request_id for e in returned if e.kind == "expired"])
        self._events(ordered=False, returned=returned)

    @rule(ok=st.booleans(), data=st.data())
    def a_swap_ends(self, ok, data):
        pending = sorted(r for r, h in self.swap.handles.items() if not h.finished)
        if pending:
            h = self.swap.handles[data.draw(st.sampled_from(pending))]
            h.finished, h.error = True, None if ok else RuntimeError("copy failed")

    @precondition(lambda self: self.BUFFER)
    @rule(fail=st.booleans())
    def swap_submission_fails(self, fail):
        self.swap.fail_submit = fail

    @rule(keep=st.integers(0, 4))
    def engine_step(self, keep):
        got = self.s.take_ready()
        assert [r.request_id for r in got] == self.m.ready
        for r in got:
            req = self.m.reqs[r.request_id]
            assert list(r.gpu_blocks) == list(req.prefix) + req.gpu and r.prefix_blocks == len(req.prefix)
            if req.prefix:
                event("a request with a held prefix reached the engine")
            req.in_ready = False
        self.m.ready = []
        for r in got:
            req = self.m.reqs[r.request_id]
            free_them = keep != 0
            blocks, req.gpu = req.gpu, None
            if free_them:
                self.m.free["gpu"] |= set(blocks)
            else:
                self.kept.append(blocks)
            req.state = State.FINISHED
            self.m.release_prefix(req.rid, req.prefix)
            del self.m.reqs[req.rid]
            self.m.entomb(req.rid, State.FINISHED, "", self.clock.t)
            self.m.m["requests_finished"] += 1
            self.s.finish(r.request_id, free_gpu_blocks=free_them)
        self._events()

    @rule(data=st.data())
    def finish_what_is_not_ready(self, data):
        rid = self._any_rid(data)
        req = self.m.reqs.get(rid)
        if req is not None and req.state is State.READY:
            return
        err = (
            self.m.live(rid)
            if req is None
            else RequestError(f"request {rid!r} is {req.state.value}, not ready; cannot finish it")
        )
        _raises(err, lambda: self.s.finish(rid))

    @rule(data=st.data())
    def finish_before_take_ready(self, data):
        """An engine may finish a ready request it has not taken yet."""
        rid = self._pick(data, (State.READY,))
        if rid is None:
            return
        req = self.m.reqs[rid]
        if req.in_ready:
            self.m.ready.remove(rid)
        self.m.free["gpu"] |= set(req.gpu)
        self.m.release_prefix(rid, req.prefix)
        del self.m.reqs[rid]
        self.m.entomb(rid, State.FINISHED, "", self.clock.t)
        self.m.m["requests_finished"] += 1
        self.s.finish(rid)
        self._events()

    @rule(data=st.data(), how=st.sampled_from(["land", "complete", "renew", "check", "begin"]))
    def write_to_a_request_past_receiving(self, data, how):
        rid = self._pick(data, (State.QUEUED, State.RECEIVED, State.SWAPPING, State.READY))
        if rid is None:
            return
        req = self.m.reqs[rid]
        token = req.token
        err = self.m.writable(req, token, self.clock.t)
        call = {
            "land": lambda: self.s.land_layers(rid, token, [0]),
            "complete": lambda: self.s.complete(rid, token),
            "renew": lambda: self.s.renew(rid, token),
            "check": lambda: self.s.check_write(rid, token),
            "begin": lambda: self.s.begin_write(rid, token),
        }[how]
        _raises(err, call)

    @rule(data=st.data(), bad=st.sampled_from([[LAYERS], [-1], [0, 0], range(0, LAYERS + 1), range(-1, 1)]))
    def land_bad_layers(self, data, bad):
        rid = self._pick(data, WRITABLE)
        if rid is None:
            return
        if isinstance(bad, range):
            err = RequestError(f"layers {bad} out of range [0, {LAYERS})")
        elif bad == [0, 0]:
            err = RequestError(f"request {rid!r}: layer 0 given twice")
        else:
            err = RequestError(f"layer {bad[0]!r} out of range [0, {LAYERS})")
        _raises(err, lambda: self.s.land_layers(rid, self.m.reqs[rid].token, bad))

    @rule()
    def engine_frees_kept_blocks(self):
        if self.kept:
            blocks = self.kept.pop(0)
            self.s.gpu.free(blocks)
            self.m.free["gpu"] |= set(blocks)

    @rule(peer=st.sampled_from(["A", "B"]))
    def fence(self, peer):
        n = 0
        for q in [q for q in self.m.quar if q.peer == peer]:
            q.fenced = True
            if q.releasable(self.clock.t):
                self.m.free_quar(q)
                n += len(q.blocks)
        assert self.s.fence(peer) == n

    @rule(data=st.data())
    def begin_write(self, data):
        rid = self._pick(data, WRITABLE)
        if rid is None:
            return
        req = self.m.reqs[rid]
        err = self.m.writable(req, req.token, self.clock.t)
        if err is None:
            req.writers[0] += 1
            self.m.m["writes_admitted"] += 1
        t = _raises(err, lambda: self.s.begin_write(rid, req.token))
        if err is None:
            g = t.grant
            assert (g.request_id, g.location, g.blocks, g.lease_expires, g.lease_s) == self.m.grant_fields(req)
            assert g.token == req.token
            self.tickets.append((t, req))
        self._events()

    @rule(data=st.data())
    def end_write(self, data):
        if not self.tickets:
            return
        t, req = self.tickets.pop(data.draw(st.integers(0, len(self.tickets) - 1)))
        req.writers[0] -= 1
        if req.writers[0] == 0:
            for q in [q for q in self.m.quar if q.writers is req.writers and q.releasable(self.clock.t)]:
                self.m.free_quar(q)
        self.s.end_write(t)
        _raises(RequestError(f"write ticket of {req.rid!r} already ended"), lambda: self.s.end_write(t))

    @rule(data=st.data())
    def renew(self, data):
        rid = self._pick(data, WRITABLE)
        if rid is None:
            return
        req = self.m.reqs[rid]
        err = self.m.writable(req, req.token, self.clock.t)
        if err is None:
            req.expires = self.clock.t + self.m.o.lease_s
        got = _raises(err, lambda: self.s.renew(rid, req.token))
        if err is None:
            assert got == req.expires
        self._events()

    @rule(data=st.data())
    def check_write(self, data):
        rid = self._pick(data, WRITABLE)
        if rid is None:
            return
        req = self.m.reqs[rid]
        err = self.m.writable(req, req.token, self.clock.t)
        g = _raises(err, lambda: self.s.check_write(rid, req.token))
        if err is None:
            assert (g.request_id, g.location, g.blocks, g.lease_expires, g.lease_s) == self.m.grant_fields(req)
            assert g.token == req.token
        self._events()

    # -- invariants
    @invariant()
    def states_blocks_queue_quarantine_and_metrics_match_the_model(self):
        s, m = self.s, self.m
        m.settle()
        assert sorted(s.live_requests()) == sorted(m.reqs)
        for rid in [*m.reqs, *m.tomb]:
            i = s.request(rid)
            got = (
                i.request_id,
                i.state,
                i.location,
                i.num_blocks,
                i.layers_landed,
                i.buffer_blocks,
                i.gpu_blocks,
                i.reason,
            )
            assert got == m.info(rid), (got, m.info(rid))
        for pool, real in (("gpu", s.gpu), ("buffer", s.buffer)):
            if real is None:
                continue
            assert all(real.is_held(b) == (b not in m.free[pool]) for b in range(m.total[pool]))
        assert list(s._queue) == m.queue
        got, want = s.metrics(), m.metrics()
        assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
        assert self.real_released == m.releases
        assert {r: h.blocks for r, h in s._holds.items()} == {r: h[0] for r, h in m.holds.items()}
        # blocks an engine kept past finish() are the engine's, as are held prefixes
        s.check_invariants(engine_blocks=[b for k in self.kept for b in k])

    def teardown(self):
        if sys.exc_info()[1] is not None:
            # hypothesis runs teardown in a finally: a step already failed (or the example was
            # cut short), and that is the finding; cleaning up a broken state would only put a
            # second failure in front of it
            return
        for t, _ in self.tickets:
            self.s.end_write(t)
        for h in self.swap.handles.values():
            h.finished = True
        self.swap.fail_submit = False
        for _ in range(3):
            self.clock.t += 100
            self.s.tick()
            for r in self.s.take_ready():
                self.s.finish(r.request_id)
        for rid in self.s.live_requests():
            self.s.abort(rid)
        for h in self.swap.handles.values():
            h.finished = True
        self.clock.t += 100
        self.s.tick()
        for b in self.kept:
            self.s.gpu.free(b)
        assert self.s.gpu.num_free == self.GPU
        assert self.s.buffer is None or self.s.buffer.num_free == self.BUF


SchedulerModelMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestSchedulerModel = SchedulerModelMachine.TestCase


class BufferOnlyMachine(SchedulerModelMachine):
    """Everything through the buffer (a transport that writes host memory), swaps shortest-first."""

    OPTS = dict(
        SchedulerModelMachine.OPTS,
        direct_to_gpu=False,
        swap_order="shortest",
        starvation_s=4.0,
        on_full="reject",
        gpu_reserve_blocks=1,
        fence_grace_s=0.0,
    )


BufferOnlyMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
TestBufferOnlyModel = BufferOnlyMachine.TestCase


class FewTombstonesMachine(SchedulerModelMachine):
    """Only three terminal requests remembered: older ones become unknown, oldest first."""

    OPTS = dict(SchedulerModelMachine.OPTS, max_tombstones=3)


FewTombstonesMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)
TestFewTombstonesModel = FewTombstonesMachine.TestCase


class GpuOnlyMachine(SchedulerModelMachine):
    """No buffer (``buffer=None``, documented): GPU grants or the queue, nothing else."""

    BUFFER = False
    OPTS = dict(SchedulerModelMachine.OPTS, gpu_reserve_blocks=3)


class ShortTombstonesMachine(SchedulerModelMachine):
    """Ended requests remembered for 6 s only (the clock advances by up to 8 s a step):
    a request ended longer ago is unknown, however few have ended since."""

    OPTS = dict(SchedulerModelMachine.OPTS, tombstone_s=6.0)


ShortTombstonesMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)
TestShortTombstonesModel = ShortTombstonesMachine.TestCase


GpuOnlyMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestGpuOnlyModel = GpuOnlyMachine.TestCase
