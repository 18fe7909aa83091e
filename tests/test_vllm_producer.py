"""vLLM's prefill halves in one thread: the scheduler half's bookkeeping
(:class:`PrefillSide`), and the worker half (:class:`SendWorker`) against a scripted
sender: every call it makes on pdkv's sender (reservations, chunks, whole layers,
confirmations, closes), with which arguments and in which order, on each path: granted in
time, granted late (deferred), never granted, refused, a session that broke, a sender that
cannot be opened, a layer or a confirmation that fails, vLLM cutting a request short.

The background thread's rounds are run by the test (``_round``), so that what the thread
would do between two of vLLM's calls is exact; tests/test_vllm_parts.py runs the same
worker with its thread against a real receiver."""

from __future__ import annotations

import logging
import queue
import time

import numpy as np
import pytest
from test_transfer import Decode

from pdkv import CacheSpec, KVLayout
from pdkv.errors import ClosedError, PdkvError, PdkvTimeoutError, PeerError, RequestError
from pdkv.integrations.vllm import producer
from pdkv.integrations.vllm.producer import PrefillSide, SendWorker
from pdkv.integrations.vllm.settings import (
    PARAM_CAP,
    PARAM_DECODE,
    PARAM_ID,
    PARAM_TOKENS,
    Save,
    StepMeta,
    layout_for,
    parse_settings,
)
from pdkv.transfer import RequestOutcome, SendGrant
from pdkv.transfer.sessions.identity import instance_key_of, key_fingerprint

LAY = dict(num_layers=3, kv_heads=2, head_dim=16, block_size=8, dtype="torch.float32", tp_size=1, tp_rank=0)
D1, D2 = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


DEC = "tcp://d:1"  # the decode the scheduler half is configured with


def _remote(pid, decode=DEC):
    return {"do_remote_decode": True, PARAM_ID: pid, PARAM_DECODE: decode}


def _side(**extra):
    return PrefillSide(parse_settings("kv_producer", "e", {"decode": DEC, **extra}))


def _toks(n):
    return list(range(n))


def _pids(side):
    """The pdkv id the scheduler half minted for each request it tracks."""
    return {rid: t.pid for rid, t in side._reqs.items()}


def _saved(m, side_pids, rid, *rest):
    """The Save the scheduler half makes for ``rid``: its minted id, the configured decode."""
    t = [s for s in m.saves if s.req_id == rid]
    assert len(t) == 1
    return t[0] == Save(rid, side_pids[rid], DEC, *rest, t[0].binding)


def test_prefill_side_tracks_chunks_blocks_and_hands_decode_its_params():
    side = _side()
    m = side.step(
        [
            ("a", _remote("pa"), _toks(20), [4, 5], 0),
            ("plain", None, _toks(9), [7], 0),
            ("b", _remote("pb"), _toks(5), [9], 0),
        ],
        [],
        {"a": 16, "plain": 9, "b": 5},
    )
    pids = _pids(side)
    assert pids["a"].startswith("pa.") and pids["b"].startswith("pb.") and "plain" not in pids
    assert [s.req_id for s in m.saves] == ["a", "b"]
    assert _saved(m, pids, "a", 20, (4, 5), 0, 16) and _saved(m, pids, "b", 5, (9,), 0, 5)
    assert not m.saves[0].complete and m.saves[1].complete
    m = side.step([], [("a", [6], 16, False), ("plain", None, 9, False)], {"a": 4})
    assert _saved(m, pids, "a", 20, (4, 5, 6), 16, 20) and m.saves[0].complete
    # a resumed request's blocks replace the old ones; nothing more is saved once computed
    m = side.step([], [("a", [1, 2, 3], 20, True)], {"a": 1})
    assert m.saves == []
    cap = side._reqs["a"].cap
    assert side.finished("a") == (
        True,
        {"do_remote_prefill": True, "do_remote_decode": False, PARAM_ID: pids["a"], PARAM_TOKENS: 20, PARAM_CAP: cap},
    )
    assert side.finished("a") == (False, None) and side.finished("plain") == (False, None)
    # seen but never scheduled: vLLM frees its blocks at once
    side.step([("c", _remote("pc"), _toks(8), [1], 0)], [], {})
    pc, cap = side._reqs["c"].pid, side._reqs["c"].cap
    want = {"do_remote_prefill": True, "do_remote_decode": False, PARAM_ID: pc, PARAM_TOKENS: 8, PARAM_CAP: cap}
    assert side.finished("c") == (False, want)


def test_prefill_side_without_a_configured_decode_computes_locally(caplog):
    side = PrefillSide(parse_settings("kv_producer", "e", {}))
    for params in ({"do_remote_decode": True}, {"do_remote_decode": True, PARAM_ID: "x"}, {PARAM_ID: "x"}):
        assert side.step([("r", params, _toks(8), [1], 0)], [], {"r": 8}).saves == []
    assert logged(caplog) == ["pdkv prefill: do_remote_decode, but extra config 'decode' names no decode"]  # once
    # with one configured, an id is not needed (the scheduler half mints it)
    assert _side().step([("r", {"do_remote_decode": True}, _toks(8), [1], 0)], [], {"r": 8}).saves


def test_prefill_side_resumed_mid_prompt_takes_its_new_blocks_and_goes_on():
    """A request preempted mid-prompt and resumed: its block ids are replaced (not
    appended), and the next save starts where vLLM says it is computed; a cached request
    with no new blocks keeps its own."""
    side = _side()
    side.step([("a", _remote("pa"), _toks(32), [4, 5], 0)], [], {"a": 8})
    pids = _pids(side)
    m = side.step([], [("a", None, 8, False)], {"a": 8})
    assert _saved(m, pids, "a", 32, (4, 5), 8, 16)
    m = side.step([], [("a", [9, 10], 8, True)], {"a": 16})  # resumed: recomputes from token 8
    assert _saved(m, pids, "a", 32, (9, 10), 8, 24)
    m = side.step([], [("a", None, 24, True)], {"a": 8})  # resumed with no blocks listed: none kept
    assert _saved(m, pids, "a", 32, (), 24, 32) and m.saves[0].complete
    m = side.step([], [("gone", [1], 0, False)], {"gone": 8})  # not ours: ignored
    assert m.saves == []


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_decode": True, PARAM_ID: "x", PARAM_DECODE: "tcp://elsewhere:1"},
        {"do_remote_decode": True, PARAM_ID: "x", PARAM_DECODE: 5},
        {"do_remote_decode": False, PARAM_ID: "x", PARAM_DECODE: DEC},
        {},
        None,
    ],
)
def test_prefill_side_params_that_do_not_ask_for_a_configured_decode(params):
    assert _side().params_of(params) is None


def test_prefill_side_params_pick_among_the_configured_decodes():
    side = _side(decode=[DEC, "tcp://d:2"])
    pid, decode, cap = side.params_of({"do_remote_decode": True, PARAM_ID: "x"})
    assert pid.startswith("x.") and decode == DEC and cap == ""  # the first by default; a capability minted later
    assert side.params_of(_remote("y", "tcp://d:2"))[1] == "tcp://d:2"
    for bad in ("", 7, "a\nb", "z" * 65):  # an id a client names is only a prefix, when printable and short
        pid, _, _ = side.params_of({"do_remote_decode": True, PARAM_ID: bad})
        assert pid.startswith("vllm.")


class FakeTx:
    """pdkv's PrefillSender as the worker uses it: every call logged as a tuple; answers
    scripted per request id; ``fail`` maps a method to the exception it raises."""

    def __init__(self, decode: str, log: list) -> None:
        self.decode, self.log = decode, log
        self.grants: dict[str, object] = {}
        self.outcomes: dict[str, object] = {}
        self.fail: dict[str, BaseException] = {}

    def _call(self, *call):
        self.log.append((self.decode, *call))
        exc = self.fail.get(call[0])
        if exc is not None:
            raise exc

    def reserve_nowait(self, requests, timeout=None):
        self._call("reserve", tuple(requests), timeout)

    def poll_grant(self, pid):
        self._call("poll_grant", pid)
        return self.grants.get(pid)

    def poll_outcome(self, pid):
        self._call("poll_outcome", pid)
        got = self.outcomes.get(pid)
        if isinstance(got, BaseException):
            raise got
        return got

    def send_chunk(self, layer, pid, blocks, first, event=None):
        self._call("chunk", layer, pid, tuple(blocks), first, event)

    def send_layer(self, layer, items):
        self._call("layer", layer, tuple((pid, tuple(b)) for pid, b in items))

    def finish(self, pid, ok=True, error=""):
        self._call("finish", pid, ok, error)

    def close(self):
        self._call("close")


class Worker:
    """A SendWorker whose background rounds the test runs (``rounds``), with the senders it
    opened (``txs``, by decode address, in order) and every call on them (``log``)."""

    def __init__(self, make=None, **extra):
        self.log: list = []
        self.txs: dict[str, list[FakeTx]] = {}
        self.lay = layout_for(**LAY, order=("head", False))
        settings = parse_settings("kv_producer", "p", {"reserve_timeout_s": 7.5, **extra})

        def opener(decode):
            self.log.append((decode, "open"))
            if make is not None:
                make(decode)
            tx = FakeTx(decode, self.log)
            self.txs.setdefault(decode, []).append(tx)
            return tx

        jobs: queue.Queue = queue.Queue()
        self.jobs = jobs

        class _Manual(SendWorker):
            def _put(self, r) -> None:  # one queue, whose rounds the test runs
                jobs.put(r)

        self.w = _Manual(settings, self.lay, CacheSpec.for_buffer(self.lay, 16, 1 << 20), sender=opener)
        self.waiting: list = []

    def tx(self, decode=D1, i=-1) -> FakeTx:
        return self.txs[decode][i]

    def rounds(self, n=1):
        """The background thread's rounds: every queued job taken, then ``n`` more rounds."""
        while not self.jobs.empty():
            assert self.w._round(self.jobs, self.waiting, 0)
        for _ in range(n):
            assert self.w._round(self.jobs, self.waiting, 0)

    def calls(self):
        out, self.log[:] = list(self.log), []
        return out

    def step(self, *saves, layers=None, event=None):
        """One vLLM step: metadata bound, every layer saved, the step ended."""
        self.w.start(StepMeta(saves=list(saves)))
        for layer in range(self.lay.total_layers) if layers is None else layers:
            self.w.save_layer(layer, event)
        self.w.end_step()


def logged(caplog):
    """The producer's log lines, whole."""
    return [r.getMessage() for r in caplog.records if r.name == producer.__name__]


def grant(pid):
    return SendGrant(pid, "decode-buffer", (0, 1, 2), 77, 5.0)


def save(rid="a", pid="P", decode=D1, plen=20, blocks=(3, 7, 8), start=0, end=None):
    return Save(rid, pid, decode, plen, tuple(blocks), start, plen if end is None else end)


@pytest.fixture
def wk():
    w = Worker()
    yield w
    w.w.close()


def test_first_request_opens_a_session_then_reserves_from_the_pool_at_once(wk):
    """The first request to a decode address has no session: the background thread opens
    one and reserves through it; the next request is reserved from vLLM's thread at once,
    with the configured timeout, and no second session is opened."""
    wk.w.start(StepMeta(saves=[save("a", "P1")]))
    assert wk.calls() == []  # nothing done on vLLM's thread
    wk.rounds()
    assert wk.calls() == [(D1, "open"), (D1, "reserve", (("P1", 20, b""),), 7.5)]
    wk.w.start(StepMeta(saves=[save("b", "P2", plen=9)]))
    assert wk.calls() == [(D1, "reserve", (("P2", 9, b""),), 7.5)]
    wk.rounds()
    assert wk.calls() == []
    wk.w.start(StepMeta(saves=[save("c", "P3", decode=D2)]))  # another decode: its own session
    wk.rounds()
    assert wk.calls() == [(D2, "open"), (D2, "reserve", (("P3", 20, b""),), 7.5)]
    assert list(wk.w._senders) == [D1, D2]


def test_granted_chunks_send_each_steps_complete_blocks_of_every_layer(wk):
    """Chunked prefill, 20 tokens in 8-token blocks (3, 7, 8) over chunks 0-12, 12-16, 16-20:
    each step sends the blocks it completed (none when it completed none), the last step
    the partial last block, every layer in order with vLLM's event; then one confirmation."""
    wk.w.start(StepMeta(saves=[save(end=12)]))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.calls()
    for layer in range(3):
        wk.w.save_layer(layer, 41)
    wk.w.end_step()
    assert wk.calls() == [
        (D1, "poll_grant", "P"),
        *[(D1, "chunk", layer, "P", (3,), 0, 41) for layer in range(3)],
    ]
    wk.step(save(start=12, end=16), event=42)
    assert wk.calls() == [(D1, "chunk", layer, "P", (7,), 1, 42) for layer in range(3)]
    wk.step(save(start=16, end=20), event=None)
    assert wk.calls() == [
        *[(D1, "chunk", layer, "P", (8,), 2, None) for layer in range(3)],
        (D1, "finish", "P", True, ""),
    ]
    assert wk.w.stats == {"direct": 1, "deferred": 0, "received": 0, "failed": 0}
    wk.step(save(start=16, end=20))  # handed: a repeated step sends nothing
    assert wk.calls() == []


@pytest.mark.parametrize(
    "start,end,sent",
    [
        (0, 7, None),  # inside the first block: nothing complete yet
        (0, 8, ((3,), 0)),  # exactly one block
        (0, 9, ((3,), 0)),
        (7, 17, ((3, 7), 0)),  # block 0 was not complete before this step: sent with block 1
        (8, 16, ((7,), 1)),
        (8, 24, ((7, 8), 1)),  # the last step of a 24-token prompt: both blocks
        (15, 24, ((7, 8), 1)),
        (16, 24, ((8,), 2)),
    ],
)
def test_chunk_block_ranges(wk, start, end, sent):
    wk.w.start(StepMeta(saves=[save(plen=24, start=start, end=end)]))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.calls()
    wk.w.save_layer(0)
    got = [c[4:6] for c in wk.calls() if c[1] == "chunk"]
    assert got == ([] if sent is None else [sent])


def test_grant_after_the_first_layer_defers_the_request_to_its_steps_end(wk):
    """Not granted when layer 0 is saved: no layer is sent from vLLM's thread; once the step
    ended and the grant came, the background thread sends every layer whole (the prompt's
    blocks only) and confirms."""
    wk.w.start(StepMeta(saves=[save(plen=20, blocks=(3, 7, 8, 9))]))  # one block more than needed
    wk.rounds()
    wk.calls()
    wk.w.save_layer(0)
    wk.tx().grants["P"] = grant("P")  # granted while the forward runs
    wk.w.save_layer(1)
    wk.w.save_layer(2)
    assert wk.calls() == [(D1, "poll_grant", "P")]
    wk.rounds(3)
    assert wk.calls() == []  # the step has not ended: nothing sent
    wk.w.end_step()
    wk.rounds()
    assert wk.calls() == [
        (D1, "poll_grant", "P"),
        *[(D1, "layer", layer, (("P", (3, 7, 8)),)) for layer in range(3)],
        (D1, "finish", "P", True, ""),
    ]
    assert wk.w.stats["deferred"] == 1 and wk.w.stats["direct"] == 0
    wk.rounds()
    assert wk.calls() == []  # done: no longer waiting


def test_deferred_request_waits_for_its_grant_without_resending(wk):
    wk.step(save(plen=8, blocks=(5,)))
    wk.rounds()
    wk.calls()
    wk.rounds(3)
    assert wk.calls() == [(D1, "poll_grant", "P")] * 3  # polled each round, nothing sent
    wk.tx().grants["P"] = grant("P")
    wk.rounds(2)
    assert wk.calls() == [
        (D1, "poll_grant", "P"),
        *[(D1, "layer", layer, (("P", (5,)),)) for layer in range(3)],
        (D1, "finish", "P", True, ""),
    ]


def test_a_failed_reservation_settles_the_request_as_failed(wk, caplog):
    """Decode answered the reservation with an error: nothing is sent, vLLM is told the
    request is done (its blocks may be freed) with the reason logged."""
    wk.w.start(StepMeta(saves=[save()]))
    wk.rounds()
    wk.tx().grants["P"] = PdkvTimeoutError("no grant for 'P' within 7.5s")
    for layer in range(3):
        wk.w.save_layer(layer)
    wk.w.end_step()
    assert wk.w.finished({"a"}) == {"a"}
    assert [c for c in wk.calls() if c[1] not in ("open", "reserve")] == [(D1, "poll_grant", "P")]
    assert wk.w.stats == {"direct": 0, "deferred": 0, "received": 0, "failed": 1}
    assert logged(caplog) == [
        "pdkv prefill: request a (pdkv P) not received: reservation failed: no grant for 'P' within 7.5s"
    ]
    assert wk.w.finished({"a"}) == set()  # reported once


def test_reservation_refused_by_the_sender_is_the_requests_error(wk, caplog):
    wk.w.start(StepMeta(saves=[save("a", "P1")]))
    wk.rounds()
    wk.tx().fail["reserve"] = RequestError("request 'P2' is already reserved")
    wk.calls()
    wk.step(save("b", "P2"))
    assert wk.calls() == [(D1, "reserve", (("P2", 20, b""),), 7.5)]  # no layer, no confirmation
    assert wk.w.finished({"b"}) == {"b"}
    assert logged(caplog)[0] == "pdkv prefill: request b: reservation refused: request 'P2' is already reserved"
    wk.rounds()
    assert wk.calls() == []  # P1 is sent from vLLM's thread once granted; P2 is gone
    assert list(wk.w._senders.values()) == [wk.tx()]  # the session stays in the pool


@pytest.mark.parametrize("exc", [PeerError("decode went away"), ClosedError("sender closed")])
def test_a_broken_pooled_session_is_retired_closed_and_replaced(wk, exc):
    """The pooled session broke: the request's reservation is not its error; the sender
    leaves the pool, the background thread closes it and opens another, through which the
    request is reserved and sent."""
    wk.w.start(StepMeta(saves=[save("a", "P1")]))
    wk.rounds()
    old = wk.tx()
    old.fail["reserve"] = exc
    wk.calls()
    wk.w.start(StepMeta(saves=[save("b", "P2", plen=8, blocks=(4,))]))
    assert wk.calls() == [(D1, "reserve", (("P2", 8, b""),), 7.5)]
    assert D1 not in wk.w._senders and wk.w._retired == [old]
    wk.rounds()
    new = wk.tx()
    assert new is not old and wk.w._senders[D1] is new and wk.w._retired == []
    calls = wk.calls()
    assert (D1, "open") in calls and (D1, "reserve", (("P2", 8, b""),), 7.5) in calls
    assert calls[-1] == (D1, "close") and sum(c[1] == "close" for c in calls) == 1
    new.grants["P2"] = grant("P2")
    for layer in range(3):
        wk.w.save_layer(layer)
    wk.w.end_step()
    assert wk.calls()[-1] == (D1, "finish", "P2", True, "")


def test_broken_session_found_by_the_background_thread_retries_next_round(wk):
    """The background thread's own reservation meets a broken pooled session: the request
    stays waiting (no error) and the next round opens a new session for it."""
    wk.w.start(StepMeta(saves=[save("a", "P1")]))
    wk.rounds()
    old = wk.tx()
    old.fail["reserve"] = PeerError("gone")
    wk.w._senders[D1] = old  # pooled, and about to fail
    r = wk.w._reqs["a"]
    r.tx = None  # as if a's reservation had not been posted yet
    wk.jobs.put(r)
    wk.calls()
    wk.w._round(wk.jobs, wk.waiting, 0)
    assert wk.calls() == [(D1, "reserve", (("P1", 20, b""),), 7.5), (D1, "close")]
    assert r.error == "" and wk.waiting == [r]
    wk.w._round(wk.jobs, wk.waiting, 0)
    assert wk.calls()[:2] == [(D1, "open"), (D1, "reserve", (("P1", 20, b""),), 7.5)]
    assert r.tx is wk.tx() and r.tx is not old


@pytest.mark.parametrize("exc", [OSError("refused"), ValueError("bad address"), PdkvError("handshake refused")])
def test_no_session_settles_the_request_as_failed(exc, caplog):
    """The sender cannot be opened: the request fails (logged with the decode address) and
    vLLM is told it is done; the next request tries to open a session again."""

    def make(decode):
        raise exc

    wk = Worker(make=make)
    try:
        wk.step(save())
        wk.rounds()
        assert wk.calls() == [(D1, "open")]
        assert wk.w.finished({"a"}) == {"a"}
        assert wk.w.stats["failed"] == 1
        assert logged(caplog)[0] == f"pdkv prefill: request a: no session with decode {D1}: {exc}"
        wk.step(save("b", "P2"))
        wk.rounds()
        assert wk.calls() == [(D1, "open")]
    finally:
        wk.w.close()


def test_a_layer_that_fails_to_send_fails_the_request_at_decode_and_sends_no_more(wk, caplog):
    """A layer the sender refuses: no later layer is sent, decode is told the request
    failed (its buffer blocks come back now), and vLLM keeps prefill's blocks until decode's
    outcome says the writes already handed over ended."""
    wk.w.start(StepMeta(saves=[save(plen=8, blocks=(5,))]))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.calls()
    wk.w.save_layer(0)
    wk.tx().fail["chunk"] = RequestError("source block ids [5] out of range")
    wk.w.save_layer(1)
    wk.w.save_layer(2)
    wk.w.end_step()
    why = "sending layer 1 failed: source block ids [5] out of range"
    assert wk.calls() == [
        (D1, "poll_grant", "P"),
        (D1, "chunk", 0, "P", (5,), 0, None),
        (D1, "chunk", 1, "P", (5,), 0, None),
        (D1, "finish", "P", False, why),
    ]
    assert logged(caplog) == [f"pdkv prefill: request a (pdkv P): {why}"]
    assert wk.w.finished({"a"}) == set()  # the writes handed over may still read vLLM's blocks
    wk.tx().outcomes["P"] = RequestOutcome("P", "failed", why)
    assert wk.w.finished(set()) == {"a"} and wk.w.stats["failed"] == 1


def test_a_failure_decode_cannot_be_told_of_still_settles(wk, caplog):
    """The sender broke: telling decode fails too (the broken sender failed the request's
    outcome itself), and the request settles from that outcome."""
    caplog.set_level(logging.INFO, logger="pdkv.integrations.vllm.producer")
    wk.w.start(StepMeta(saves=[save(plen=8, blocks=(5,))]))
    wk.rounds()
    tx = wk.tx()
    tx.grants["P"] = grant("P")
    tx.fail["chunk"] = tx.fail["finish"] = ClosedError("the session with decode broke")
    wk.calls()
    wk.step(save(plen=8, blocks=(5,)))
    assert [c[1] for c in wk.calls()] == ["poll_grant", "chunk", "finish"]
    assert logged(caplog) == [
        "pdkv prefill: request a (pdkv P): sending layer 0 failed: the session with decode broke",
        "pdkv prefill: request P: decode not told (the session with decode broke)",
    ]
    tx.outcomes["P"] = RequestOutcome("P", "failed", "the session with decode broke")
    assert wk.w.finished({"a"}) == {"a"} and wk.w.stats["failed"] == 1


def test_a_confirmation_that_fails_fails_the_request(wk):
    wk.w.start(StepMeta(saves=[save(plen=8, blocks=(5,))]))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.tx().fail["finish"] = ClosedError("sender closed")
    wk.calls()
    for layer in range(3):
        wk.w.save_layer(layer)
    wk.w.end_step()
    assert wk.calls()[-2:] == [
        (D1, "finish", "P", True, ""),
        (D1, "finish", "P", False, "confirming failed: sender closed"),
    ]
    r = wk.w._reqs["a"]
    assert r.error == "confirming failed: sender closed" and not r.handed
    assert wk.w.stats["direct"] == 0
    wk.rounds()
    assert wk.calls() == []  # nothing retried


def test_a_deferred_send_that_fails_fails_the_request(wk):
    wk.step(save(plen=8, blocks=(5,)))
    wk.rounds()
    tx = wk.tx()
    tx.grants["P"] = grant("P")
    tx.fail["layer"] = PeerError("connection reset")
    wk.calls()
    wk.rounds()
    assert wk.calls() == [
        (D1, "poll_grant", "P"),
        (D1, "layer", 0, (("P", (5,)),)),
        (D1, "finish", "P", False, "sending failed: connection reset"),
    ]
    r = wk.w._reqs["a"]
    assert r.error == "sending failed: connection reset" and not r.handed
    assert wk.w.stats["deferred"] == 0
    assert wk.w.finished({"a"}) == set()
    tx.outcomes["P"] = RequestOutcome("P", "failed", "prefill failed the request")
    assert wk.w.finished(set()) == {"a"} and wk.w.stats["failed"] == 1


def test_finished_waits_for_decodes_outcome(wk, caplog):
    """vLLM's get_finished names a request only once decode's outcome is known: received
    counts as received; another state as failed, with decode's reason logged."""
    wk.step(save("a", "P1", plen=8, blocks=(1,)), save("b", "P2", plen=8, blocks=(2,)))
    wk.rounds()
    for pid in ("P1", "P2"):
        wk.tx().grants[pid] = grant(pid)
    wk.rounds()  # both deferred (no grant at their first layer): sent whole now
    assert wk.w.stats["deferred"] == 2
    assert wk.w.finished({"a", "b"}) == set()  # no outcome yet
    assert wk.w.finished(set()) == set()
    wk.tx().outcomes["P1"] = RequestOutcome("P1", "received")
    assert wk.w.finished(set()) == {"a"}
    wk.tx().outcomes["P2"] = RequestOutcome("P2", "expired", "lease expired")
    assert wk.w.finished(set()) == {"b"}
    assert wk.w.stats == {"direct": 0, "deferred": 2, "received": 1, "failed": 1}
    assert logged(caplog) == ["pdkv prefill: request b (pdkv P2) not received: lease expired"]
    assert wk.w._reqs == {}


def test_an_unknown_outcome_settles_as_failed(wk, caplog):
    wk.w.start(StepMeta(saves=[save(plen=8, blocks=(5,))]))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.step(save(plen=8, blocks=(5,)))
    wk.tx().outcomes["P"] = RequestError("unknown request 'P'")
    assert wk.w.finished({"a"}) == {"a"}
    assert wk.w.stats == {"direct": 1, "deferred": 0, "received": 0, "failed": 1}
    assert logged(caplog) == ["pdkv prefill: request a (pdkv P) not received: unknown request 'P'"]


def test_finished_ignores_requests_vllm_did_not_finish(wk):
    wk.step(save(plen=8, blocks=(5,)))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.rounds()
    wk.tx().outcomes["P"] = RequestOutcome("P", "received")
    assert wk.w.finished({"other"}) == set()  # not ours, and a is not finished by vLLM
    assert wk.w.finished({"a"}) == {"a"}


def test_cut_short_before_its_grant_is_ended_at_decode_once_granted(wk):
    """vLLM finishes a request after its first chunk: once granted, the background thread
    tells decode it failed (no layer sent), and vLLM hears it settled from decode's outcome."""
    wk.step(save(plen=24, end=8))
    wk.rounds()
    assert wk.w.finished({"a"}) == set()
    wk.calls()
    wk.rounds(0)
    assert wk.calls() == [(D1, "poll_grant", "P")]
    wk.tx().grants["P"] = grant("P")
    wk.rounds()
    assert wk.calls() == [
        (D1, "poll_grant", "P"),
        (D1, "finish", "P", False, "vLLM finished the request before its prompt was computed"),
    ]
    wk.tx().outcomes["P"] = RequestOutcome("P", "failed", "prefill failed the request")
    assert wk.w.finished(set()) == {"a"}
    assert wk.w.stats["failed"] == 1 and wk.w.stats["deferred"] == 0


def test_cut_short_after_sending_chunks_is_ended_at_decode(wk):
    wk.w.start(StepMeta(saves=[save(plen=24, end=8)]))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    for layer in range(3):
        wk.w.save_layer(layer)
    wk.w.end_step()
    assert wk.w.finished({"a"}) == set()
    wk.calls()
    wk.rounds()
    assert wk.calls() == [(D1, "finish", "P", False, "vLLM finished the request before its prompt was computed")]


def test_a_handed_request_is_not_queued_again_when_vllm_finishes_it(wk):
    wk.w.start(StepMeta(saves=[save(plen=8, blocks=(5,))]))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.step(save(plen=8, blocks=(5,)))
    assert wk.w.finished({"a"}) == set()
    assert wk.jobs.empty()
    wk.calls()
    wk.rounds()
    assert wk.calls() == []


def test_recent_remembers_the_last_requests_blocks_only(wk, monkeypatch):
    monkeypatch.setattr(producer, "RECENT", 3)
    for i in range(5):
        wk.w.start(StepMeta(saves=[save(f"r{i}", f"P{i}", blocks=(i, i + 1, i + 2))]))
    assert list(wk.w.recent.items()) == [("r2", (2, 3, 4)), ("r3", (3, 4, 5)), ("r4", (4, 5, 6))]
    wk.w.start(StepMeta(saves=[save("r2", "P2", blocks=(9, 9, 9))]))  # seen again: newest
    assert list(wk.w.recent) == ["r3", "r4", "r2"] and wk.w.recent["r2"] == (9, 9, 9)
    assert producer.RECENT == 3


def test_recent_default_bound():
    assert producer.RECENT == 256


def test_a_request_seen_again_keeps_its_state_and_takes_the_new_save(wk):
    wk.w.start(StepMeta(saves=[save(plen=24, end=8)]))
    wk.rounds()
    r = wk.w._reqs["a"]
    wk.w.start(StepMeta(saves=[save(plen=24, start=8, end=16)]))
    assert wk.w._reqs["a"] is r and r.save.start == 8 and wk.w._step == [r]
    assert wk.jobs.empty()  # not queued again


def test_close_closes_every_sender_pooled_and_retired():
    wk = Worker()
    wk.step(save("a", "P1"), save("b", "P2", decode=D2))
    wk.rounds()
    retired = FakeTx("tcp://127.0.0.1:9", wk.log)
    wk.w._retired.append(retired)
    wk.calls()
    wk.w.close()
    assert sorted(wk.calls()) == [(D1, "close"), (D2, "close"), ("tcp://127.0.0.1:9", "close")]
    assert wk.w._senders == {} and wk.w._retired == []


def _threaded(make=None):
    """A SendWorker with its real background threads, its senders scripted (FakeTx)."""
    log: list = []
    lay = layout_for(**LAY, order=("head", False))
    return SendWorker(
        parse_settings("kv_producer", "p", {}), lay, CacheSpec.for_buffer(lay, 16, 1 << 20),
        sender=make or (lambda d: FakeTx(d, log)),
    )  # fmt: skip


def test_the_background_thread_stops_on_close_and_ends_its_rounds():
    """The real threads (one per decode, started on first use): a round returns False on
    the stop sentinel; close() ends every one."""
    w = _threaded()
    assert w._lanes == {}  # no thread before a request needs one
    w.start(StepMeta(saves=[save("a", "P1"), save("b", "P2", decode=D2)], instance_key=b"k" * 32))
    threads = [t for _, t in w._lanes.values()]
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    w.close()
    assert not any(t.is_alive() for t in threads)
    q: queue.Queue = queue.Queue()
    q.put(None)
    assert w._round(q, [], 0) is False
    assert w._round(q, [], 0) is True  # an empty queue: a round with nothing to do


# ---- what each call leaves behind: the background thread's list, counts, a second request


def test_prefill_side_goes_on_from_where_its_last_save_ended():
    """A request scheduled again without vLLM listing it among the cached ones: its next
    save starts where the last one ended."""
    side = _side()
    side.step([("a", _remote("pa"), _toks(24), [4, 5, 6], 0)], [], {"a": 8})
    m = side.step([], [], {"a": 8})
    assert _saved(m, _pids(side), "a", 24, (4, 5, 6), 8, 16)


def test_the_worker_threads_are_named_and_do_not_keep_the_process():
    w = _threaded()
    try:
        w.start(StepMeta(saves=[save("a", "P1")], instance_key=b"k" * 32))
        ((_, t),) = w._lanes.values()
        assert t.name == "pdkv-vllm-send" and t.daemon is True
    finally:
        w.close()


def test_saving_or_ending_a_step_before_any_metadata_does_nothing(wk):
    wk.w.save_layer(0)
    wk.w.end_step()
    wk.w.end_step()
    wk.w.save_layer(1)  # after a step ended: no request of that step is sent again
    assert wk.calls() == []


def test_a_reservation_posted_from_vllms_thread_leaves_nothing_for_the_background(wk):
    wk.w.start(StepMeta(saves=[save("a", "P1")]))
    wk.rounds()
    assert wk.waiting == []
    wk.w.start(StepMeta(saves=[save("b", "P2")]))
    assert wk.jobs.empty() and wk.w._reqs["b"].tx is wk.tx()


def test_each_request_of_a_step_is_handled_whatever_the_one_before_it(wk):
    """Two requests in one step: the first is deferred (no grant) or not complete; the
    second is still sent and confirmed; two direct confirmations count two."""
    wk.w.start(StepMeta(saves=[save("a", "P1", plen=8, blocks=(1,)), save("b", "P2", plen=8, blocks=(2,))]))
    wk.rounds()
    tx = wk.tx()
    tx.grants["P2"] = grant("P2")
    wk.calls()
    for layer in range(3):
        wk.w.save_layer(layer)
    wk.w.end_step()
    assert [c for c in wk.calls() if c[1] != "poll_grant"] == [
        *[(D1, "chunk", layer, "P2", (2,), 0, None) for layer in range(3)],
        (D1, "finish", "P2", True, ""),
    ]
    wk.w.start(StepMeta(saves=[save("c", "P3", plen=16, blocks=(3, 4), end=8), save("d", "P4", plen=8, blocks=(5,))]))
    tx.grants["P3"], tx.grants["P4"] = grant("P3"), grant("P4")
    for layer in range(3):
        wk.w.save_layer(layer)
    wk.w.end_step()
    assert wk.calls()[-1] == (D1, "finish", "P4", True, "")
    assert wk.w.stats["direct"] == 2


def test_two_received_and_two_failed_are_counted(wk):
    wk.w.start(StepMeta(saves=[save(f"r{i}", f"P{i}", plen=8, blocks=(i,)) for i in range(4)]))
    wk.rounds()
    tx = wk.tx()
    for i in range(4):
        tx.grants[f"P{i}"] = grant(f"P{i}")
    wk.step(*(save(f"r{i}", f"P{i}", plen=8, blocks=(i,)) for i in range(4)))
    for i in range(4):
        tx.outcomes[f"P{i}"] = RequestOutcome(f"P{i}", "received" if i < 2 else "failed", "x")
    assert wk.w.finished({f"r{i}" for i in range(4)}) == {"r0", "r1", "r2", "r3"}
    assert wk.w.stats == {"direct": 4, "deferred": 0, "received": 2, "failed": 2}


def test_background_work_ends_with_each_request(wk):
    """What the background thread keeps waiting on: a request with no session (failed), a
    refused background reservation, a direct request once reserved, a deferred one once
    sent: none of them stays; a deferred request whose grant failed does not either."""
    fail_open = Worker(make=lambda d: (_ for _ in ()).throw(OSError("refused")))
    try:
        fail_open.w.start(StepMeta(saves=[save()]))
        fail_open.rounds(0)
        assert fail_open.waiting == []
    finally:
        fail_open.w.close()
    wk.w.start(StepMeta(saves=[save("a", "P1", plen=8, blocks=(1,))]))
    wk.rounds(0)
    assert wk.waiting == []  # reserved, sent from vLLM's thread later
    tx = wk.tx()
    del wk.w._senders[D1]  # the next request opens a session of its own...
    real_open = wk.w._make

    def refusing(decode):
        t = real_open(decode)
        t.fail["reserve"] = RequestError("duplicate")
        return t

    wk.w._make = refusing
    wk.w.start(StepMeta(saves=[save("b", "P2", plen=8, blocks=(2,))]))
    wk.rounds(0)
    assert wk.waiting == [] and wk.w._reqs["b"].error == "reservation refused: duplicate"
    wk.w._make = real_open
    wk.w._senders[D1] = tx
    wk.step(save("c", "P3", plen=8, blocks=(3,)))  # not granted in time: deferred
    wk.rounds(0)
    assert [r.save.pid for r in wk.waiting] == ["P3"]
    tx.grants["P3"] = PdkvTimeoutError("no grant")
    wk.rounds(1)
    assert wk.waiting == [] and wk.w._reqs["c"].error == "reservation failed: no grant"


def test_a_deferred_request_sent_whole_is_sent_once(wk):
    wk.step(save(plen=8, blocks=(5,)))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.rounds(1)
    assert wk.waiting == [] and wk.w._reqs["a"].handed is True
    wk.calls()
    assert wk.w.finished({"a"}) == set()  # vLLM finished it; the outcome is still to come
    wk.rounds(2)
    assert [c[1] for c in wk.calls()] == ["poll_outcome"]  # nothing sent again


def test_a_cut_request_is_ended_once(wk):
    wk.step(save(plen=24, end=8))
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.w.finished({"a"})
    wk.rounds(3)
    finishes = [c for c in wk.calls() if c[1] == "finish"]
    assert len(finishes) == 1 and wk.waiting == []


def test_a_round_waits_for_a_job_at_most_its_timeout():
    wk = Worker()
    try:
        t0 = time.monotonic()
        assert wk.w._round(wk.jobs, [], 0.05) is True
        assert 0.04 < time.monotonic() - t0 < 2
    finally:
        wk.w.close()


def test_the_background_thread_moves_a_waiting_request_on_within_milliseconds():
    """The real thread: a deferred request is sent soon after its grant comes (the thread
    polls what waits every few ms, not once a second)."""

    log: list = []
    txs = []

    def make(decode):
        t = FakeTx(decode, log)
        txs.append(t)
        return t

    w = _threaded(make)
    try:
        w.start(StepMeta(saves=[save(plen=8, blocks=(5,))]))
        for layer in range(3):
            w.save_layer(layer)
        w.end_step()
        deadline = time.monotonic() + 5
        while not any(c[1] == "reserve" for c in log) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        t0 = time.monotonic()
        txs[0].grants["P"] = grant("P")
        while not any(c[1] == "finish" for c in log) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert time.monotonic() - t0 < 0.5
        assert [c for c in log if c[1] == "finish"] == [(D1, "finish", "P", True, "")]
    finally:
        w.close()


def test_a_broken_session_is_logged_with_its_address(wk, caplog):
    caplog.set_level(logging.INFO, logger=producer.__name__)
    wk.w.start(StepMeta(saves=[save("a", "P1")]))
    wk.rounds()
    wk.tx().fail["reserve"] = PeerError("gone")
    wk.w.start(StepMeta(saves=[save("b", "P2")]))
    assert logged(caplog) == [f"pdkv prefill: the session with {D1} ended (gone): opening another"]


def test_the_worker_opens_pdkvs_sender_with_its_settings(no_leaks):
    """Without a stand-in, the worker opens a real PrefillSender with the configured
    instance, instance key, secret and transport: decode sees that instance, proving that
    key, over tcp."""
    secret, key = "z" * 32, "instance-key-of-pf-7"
    dec = Decode(secret=secret.encode(), transports=("tcp", "shm"))
    lay = KVLayout(num_layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, dtype="bf16")
    cache = np.zeros(lay.block_bytes * 4, np.uint8)
    settings = parse_settings(
        "kv_producer",
        "p",
        {"secret": secret, "instance": "pf-7", "instance_key": key, "transport": "tcp"},
    )
    w = SendWorker(settings, lay, CacheSpec.for_buffer(lay, 4, cache.ctypes.data))
    try:
        tx = w._open(dec.rx.control_address)
        try:
            (peer,) = dec.rx._peers.values()
            assert peer.instance == "pf-7" and tx.transport == "tcp" and tx.instance == "pf-7"
            assert peer.key_fp == key_fingerprint(instance_key_of("pf-7", settings.instance_key))
            assert tx.layout is lay and tx.cache.num_blocks == 4
        finally:
            tx.close()
    finally:
        w.close()
        dec.close()


def test_a_request_deferred_before_its_session_opened_waits_for_its_step_to_end(wk):
    """Layer 0 saved before the background thread opened the session: the request is
    deferred; the thread opens the session and reserves, the grant comes mid-step, and
    still nothing is sent until vLLM's step ends."""
    wk.w.start(StepMeta(saves=[save(plen=8, blocks=(5,))]))
    wk.w.save_layer(0)  # no session yet: deferred
    wk.rounds()
    wk.tx().grants["P"] = grant("P")
    wk.rounds(3)
    wk.w.save_layer(1)
    wk.w.save_layer(2)
    assert [c[1] for c in wk.calls() if c[1] in ("layer", "chunk", "finish")] == []
    wk.w.end_step()
    wk.rounds()
    assert [c[1:3] for c in wk.calls() if c[1] != "poll_grant"] == [
        ("layer", 0),
        ("layer", 1),
        ("layer", 2),
        ("finish", "P"),
    ]


def test_a_request_settled_as_failed_is_never_sent_afterwards(wk):
    """A deferred request whose grant vLLM's thread saw and whose outcome then failed (the
    sender forgot it): vLLM is told it is done and frees its blocks, so the background
    thread must not send from them afterwards."""
    wk.step(save(plen=8, blocks=(5,)))  # deferred: no session at its first layer
    wk.rounds()  # session opened, reserved: waiting for the grant
    tx = wk.tx()
    tx.grants["P"] = grant("P")
    tx.outcomes["P"] = RequestError("unknown request 'P'")
    assert wk.w.finished({"a"}) == {"a"}  # grant seen, outcome failed: settled here
    wk.calls()
    wk.rounds(2)
    assert [c for c in wk.calls() if c[1] in ("layer", "finish")] == []
    assert wk.waiting == []
