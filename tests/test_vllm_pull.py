"""The routers people run, through vLLM's connector halves in this process (the real
scheduler halves, worker halves, receivers and pull endpoint; vLLM's calls made by the
test in vLLM's order):

- *pull*, NixlConnector's protocol exactly: prefill gets ``do_remote_decode`` and nulls,
  answers, and the router picks one of two decodes only then; that decode pulls and the KV
  lands in its buffer and nowhere else;
- *shared id*: a router-chosen ``transfer_id`` in both requests, dispatched at once;
- what a client may put in the parameters changes nothing of another request: a pull
  with the wrong prompt, to an unlisted prefill, for a decode prefill does not send to,
  twice; a pull that never comes frees prefill's blocks after ``pull_timeout_s``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from ports import free_port
from vllm_serve import NIXL

from pdkv import CacheSpec
from pdkv.integrations.vllm.consumer import DecodeSide, LoadWorker
from pdkv.integrations.vllm.producer import PrefillSide, SendWorker
from pdkv.integrations.vllm.settings import (
    PARAM_PULL,
    PARAM_TRANSFER,
    StepMeta,
    layout_for,
    parse_settings,
    transfer_pid,
)
from pdkv.scheduling.lifecycle import State

LAY = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=8, dtype="torch.float32", tp_size=1, tp_rank=0)


def _layout():
    return layout_for(**LAY, order=("head", False))


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class _Decode:
    """One decode engine's halves: scheduler side and a host 'vLLM cache' of 16 blocks."""

    def __init__(self, lay, prefills, control):
        cfg = {"buffer_blocks": 12, "control": control, "prefill": prefills, "load_timeout_s": 20.0}
        self.side = DecodeSide(parse_settings("kv_consumer", "d", cfg), [lay])
        self.cache = np.zeros(lay.block_bytes * 16, np.uint8)
        self.loader = LoadWorker(lay, CacheSpec.for_buffer(lay, 16, self.cache.ctypes.data))

    def matched_until(self, rid, params, prompt, pump, timeout=10.0):
        """vLLM's scheduler asking each step until the answer is not 'later' (``pump``:
        prefill's engine stepping meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.side.matched(rid, params, prompt, 0)
            if got != (None, False):
                return got
            pump()
            time.sleep(0.005)
        return None, False

    def load(self, rid, blocks):
        meta = self.side.step_meta()
        self.loader.start(meta)
        deadline, done = time.monotonic() + 10, set()
        while rid not in done and time.monotonic() < deadline:
            done |= self.loader.finished()
            time.sleep(0.002)
        self.side.loaded(done, self.loader.load_errors())
        return done

    def close(self):
        self.loader.close()
        self.side.close()


class _Cluster:
    """One prefill (scheduler half with its pull endpoint, one worker) and two decodes,
    each a configured decode of prefill and each listing prefill's pull endpoint."""

    def __init__(self, *, pull_timeout_s=60.0, clock=None):
        self.lay = lay = _layout()
        controls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        cfg = {"decode": controls, "pull": "tcp://127.0.0.1:0", "pull_timeout_s": pull_timeout_s}
        self.prefill = PrefillSide(parse_settings("kv_producer", "p", cfg), clock=clock or time.monotonic)
        self.decodes = []
        self.sent = set()
        try:
            for c in controls:
                self.decodes.append(_Decode(lay, [self.prefill.pull_address], c))
            self.src = np.random.default_rng(5).integers(0, 256, lay.block_bytes * 16, dtype=np.uint8)
            self.worker = SendWorker(
                parse_settings("kv_producer", "p", cfg), lay, CacheSpec.for_buffer(lay, 16, self.src.ctypes.data)
            )
        except BaseException:
            self.close()
            raise

    def run_prefill(self, rid, params, prompt, blocks):
        """vLLM's prefill steps for one request computed in one step, then finished (it
        answered): the answer's kv_transfer_params."""
        meta = self.prefill.step([(rid, params, prompt, list(blocks), 0)], [], {rid: len(prompt)})
        self.worker.start(meta)
        for layer in range(self.lay.total_layers):
            self.worker.save_layer(layer)
        self.worker.end_step()
        delay, answer = self.prefill.finished(rid)
        self.worker.finished({rid})
        return delay, answer

    def pump(self):
        """One step of prefill's engine with nothing scheduled (vLLM keeps stepping while
        it holds blocks): the metadata carries pulls and drops; what get_finished reports
        is kept in ``sent``."""
        self.worker.start(self.prefill.step([], [], {}))
        self.worker.end_step()
        self.sent |= self.worker.finished(set())

    def matched(self, d, rid, params, prompt):
        return d.matched_until(rid, params, prompt, self.pump)

    def step_prefill_until_sent(self, rid, timeout=10.0):
        deadline = time.monotonic() + timeout
        while rid not in self.sent and time.monotonic() < deadline:
            self.pump()
            time.sleep(0.005)
        return rid in self.sent

    def block(self, arr, b):
        span, nb = self.lay.layer_block_bytes, len(arr) // self.lay.block_bytes
        return b"".join(
            arr[layer * nb * span + b * span : layer * nb * span + (b + 1) * span].tobytes()
            for layer in range(self.lay.total_layers)
        )

    def close(self):
        for part in (getattr(self, "worker", None), *self.decodes, self.prefill):
            if part is not None:
                part.close()


def test_nixl_protocol_pull_round_robin_each_kv_reaches_the_decode_that_serves_it(no_leaks):
    """Four requests; the router sends each to prefill with NixlConnector's parameters and,
    after prefill answered, to decode 0, 1, 0, 1 with prefill's answer untouched: each KV
    lands in the buffer of the decode that got the request, byte-equal to prefill's
    blocks, and nothing in the other decode's."""
    c = _Cluster()
    try:
        for i in range(4):
            prompt = list(range(i * 100, i * 100 + 20))
            src_blocks = (3 * i % 16, (3 * i + 1) % 16, (3 * i + 2) % 16)
            delay, answer = c.run_prefill(f"r{i}", dict(NIXL), prompt, src_blocks)
            assert delay is True  # prefill keeps the blocks for the pull
            assert answer[PARAM_PULL] == c.prefill.pull_address and answer["do_remote_prefill"] is True
            assert answer["remote_port"] == int(c.prefill.pull_address.rsplit(":", 1)[1])
            d, other = c.decodes[i % 2], c.decodes[1 - i % 2]
            assert d.side.matched(f"v{i}", answer, prompt, 0) == (None, False)  # the pull is on its way
            assert c.step_prefill_until_sent(f"r{i}")
            assert c.matched(d, f"v{i}", answer, prompt) == (20, True)
            d.side.allocated(f"v{i}", [10, 2, 5], 20)
            assert f"v{i}" in d.load(f"v{i}", (10, 2, 5))
            for s, t in zip(src_blocks, (10, 2, 5)):
                assert c.block(d.cache, t) == c.block(c.src, s)
            assert other.side.sched.live_requests() == [] and other.side.sched.buffer.num_free == 12
            assert d.side.sched.buffer.num_free == 12  # loaded: its buffer blocks went back
        assert c.prefill.desk.pulled == 4 and c.worker.stats["received"] == 4
    finally:
        c.close()


def test_a_pull_that_does_not_prove_the_request_moves_nothing(no_leaks):
    """A client that sends decode another request's answer with its own prompt, or the
    right prompt to a decode prefill does not list, or names an unlisted prefill: the pull
    is refused (or never sent), that request is computed at decode, and the victim's pull
    by its own decode still succeeds."""
    c = _Cluster()
    try:
        prompt = list(range(20))
        _, answer = c.run_prefill("victim", dict(NIXL), prompt, (1, 2, 3))
        d0, d1 = c.decodes
        # wrong prompt: the binding differs, prefill refuses the pull
        assert c.matched(d1, "thief", answer, list(range(1, 21))) == (0, False)
        assert d1.side.pull_failed == 1
        # an unlisted prefill: decode connects nowhere
        fake = {**answer, PARAM_PULL: "tcp://127.0.0.1:1"}
        assert d1.side.matched("thief2", fake, prompt, 0) == (0, False) and d1.side.refused == 1
        assert d1.side.puller._socks.keys() <= {c.prefill.pull_address}
        # the victim's own decode pulls it
        assert c.matched(d0, "v", answer, prompt) == (20, True)
        assert c.prefill.desk.pulled == 1
        # the same answer again (a replay, another decode): held no more
        assert c.matched(d1, "again", answer, prompt) == (0, False)
        assert c.step_prefill_until_sent("victim")
        d0.side.allocated("v", [4, 5, 6], 20)
        assert "v" in d0.load("v", (4, 5, 6))
        assert c.block(d0.cache, 4) == c.block(c.src, 1)
    finally:
        c.close()


def test_a_pull_naming_a_decode_prefill_does_not_send_to_is_refused(no_leaks):
    c = _Cluster()
    try:
        prompt = list(range(20))
        _, answer = c.run_prefill("r", dict(NIXL), prompt, (1, 2, 3))
        d = c.decodes[0]
        d.side.advertised = "tcp://127.0.0.1:1"  # a decode prefill is not configured to send to
        assert c.matched(d, "v", answer, prompt) == (0, False) and d.side.pull_failed == 1
        assert c.prefill.server.refused == 1 and c.prefill.desk.pulled == 0
    finally:
        c.close()


def test_a_pull_that_never_comes_frees_prefills_blocks_after_its_timeout(no_leaks):
    clock = _Clock()
    c = _Cluster(pull_timeout_s=30.0, clock=clock)
    try:
        delay, _ = c.run_prefill("r", dict(NIXL), list(range(20)), (1, 2, 3))
        assert delay is True
        c.worker.start(c.prefill.step([], [], {}))
        assert "r" not in c.worker.finished(set())  # held
        clock.t += 31
        meta = c.prefill.step([], [], {})
        assert meta.drops == ["r"] and c.prefill.desk.expired == 1
        c.worker.start(meta)
        assert c.worker.finished(set()) == {"r"}  # vLLM frees the blocks
    finally:
        c.close()


def test_a_request_cut_short_before_its_prompt_is_computed_holds_nothing(no_leaks):
    c = _Cluster()
    try:
        c.prefill.step([("r", dict(NIXL), list(range(20)), [1, 2, 3], 0)], [], {"r": 8})
        assert c.prefill.finished("r") == (False, None)
    finally:
        c.close()


def test_shared_transfer_id_dispatched_at_once(no_leaks):
    """The router gives prefill and decode the same transfer_id and sends both at once:
    decode waits for the reservation, prefill pushes each layer to the decode the request
    names, and the KV is bound to decode's request by the id and its prompt."""
    c = _Cluster()
    try:
        tid = "router-0123456789abcdef"
        prompt = list(range(50, 70))
        d = c.decodes[1]
        dec_params = {"do_remote_prefill": True, PARAM_TRANSFER: tid}
        assert d.side.matched("v", dec_params, prompt, 0) == (None, False)  # before prefill ran
        pre = {"do_remote_decode": True, PARAM_TRANSFER: tid, "pdkv_decode": d.side.control_address}
        delay, answer = c.run_prefill("r", pre, prompt, (7, 8, 9))
        assert answer["pdkv_request_id"] == transfer_pid(tid) and PARAM_PULL not in answer
        assert c.step_prefill_until_sent("r")
        assert c.matched(d, "v", dec_params, prompt) == (20, True)
        d.side.allocated("v", [1, 2, 3], 20)
        assert "v" in d.load("v", (1, 2, 3))
        assert c.block(d.cache, 3) == c.block(c.src, 9)
        # another request naming the same transfer_id with another prompt gets nothing
        assert d.side.sched.buffer.num_free == 12
    finally:
        c.close()


@pytest.mark.parametrize("tid", ["short", 7, "x" * 129, "a\nb" * 8])
def test_a_transfer_id_too_short_or_not_printable_is_refused_on_both_sides(tid, no_leaks):
    c = _Cluster()
    try:
        assert c.prefill.params_of({"do_remote_decode": True, PARAM_TRANSFER: tid}) is None
        d = c.decodes[0]
        assert d.side.matched("v", {"do_remote_prefill": True, PARAM_TRANSFER: tid}, [1, 2], 0) == (0, False)
    finally:
        c.close()


def test_a_thief_naming_a_shared_transfer_id_with_another_prompt_gets_nothing(no_leaks):
    c = _Cluster()
    try:
        tid = "router-fedcba9876543210"
        prompt = list(range(20))
        d = c.decodes[0]
        pre = {"do_remote_decode": True, PARAM_TRANSFER: tid, "pdkv_decode": d.side.control_address}
        c.run_prefill("r", pre, prompt, (1, 2, 3))
        assert c.step_prefill_until_sent("r")
        params = {"do_remote_prefill": True, PARAM_TRANSFER: tid}
        assert c.matched(d, "thief", params, list(range(1, 21))) == (0, False) and d.side.refused == 1
        assert d.side.sched.request(transfer_pid(tid)).state is State.RECEIVED  # untouched
        assert c.matched(d, "v", params, prompt) == (20, True)
    finally:
        c.close()


def test_step_meta_of_a_pull_is_a_whole_send_to_the_pulling_decode():
    """The metadata the workers get for a pull: every block, tokens [0, prompt), the
    decode that asked, marked pulled (no layer-by-layer save)."""
    c = _Cluster()
    try:
        _, answer = c.run_prefill("r", dict(NIXL), list(range(20)), (1, 2, 3))
        d = c.decodes[1]
        d.side.matched("v", answer, list(range(20)), 0)
        deadline = time.monotonic() + 5
        meta = StepMeta()
        while not meta.saves and time.monotonic() < deadline:
            meta = c.prefill.step([], [], {})
            time.sleep(0.005)
        (s,) = meta.saves
        assert (s.req_id, s.decode, s.start, s.end, s.blocks, s.pulled) == (
            "r",
            d.side.control_address,
            0,
            20,
            (1, 2, 3),
            True,
        )
        c.worker.start(meta)
        assert c.step_prefill_until_sent("r")
    finally:
        c.close()


def test_a_pull_with_a_local_prefix_hit_receives_and_loads_only_the_rest(no_leaks):
    """Decode's prefix cache holds the first 2 of a 3-block prompt (vLLM's num_computed 16):
    decode holds that prefix for the claim before it pulls, prefill's grant skips it, and
    only the last block travels and is loaded, byte-equal to prefill's."""
    c = _Cluster()
    try:
        prompt = list(range(20))
        _, answer = c.run_prefill("r", dict(NIXL), prompt, (4, 5, 6))
        d = c.decodes[0]
        d.side.take_stats()
        assert d.side.matched("v", answer, prompt, 16) == (None, False)
        deadline = time.monotonic() + 10
        while (got := d.side.matched("v", answer, prompt, 16)) == (None, False) and time.monotonic() < deadline:
            c.pump()
            time.sleep(0.005)
        assert got == (4, True)  # the 4 tokens vLLM does not hold
        assert c.step_prefill_until_sent("r")
        st = d.side.take_stats()
        assert st["c"]["bytes_received"] == c.lay.block_bytes, st  # one block of three
        d.side.allocated("v", [9, 10, 11], 4)
        assert "v" in d.load("v", (11,))
        assert c.block(d.cache, 11) == c.block(c.src, 6)
        assert c.block(d.cache, 9) == bytes(len(c.block(d.cache, 9)))  # vLLM's own: not written
        assert d.side.sched.buffer.num_free == 12 and d.side.sched.live_requests() == []
    finally:
        c.close()


def test_a_thiefs_prefix_hold_does_not_break_the_victims_request(no_leaks):
    """A thief names the victim's answer with a prefix hit of its own and a wrong prompt:
    its hold is bound to its claim, so the victim's reservation does not take it; the
    victim's request gets its whole KV and loads it."""
    c = _Cluster()
    try:
        prompt = list(range(20))
        _, answer = c.run_prefill("victim", dict(NIXL), prompt, (1, 2, 3))
        d = c.decodes[0]
        thief = [99] * 16 + prompt[16:]
        deadline = time.monotonic() + 10
        while (got := d.side.matched("thief", answer, thief, 16)) == (None, False) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert got == (0, False) and d.side.pull_failed == 1
        assert c.matched(d, "v", answer, prompt) == (20, True)
        assert c.step_prefill_until_sent("victim")
        d.side.allocated("v", [4, 5, 6], 20)
        assert "v" in d.load("v", (4, 5, 6))
        assert c.block(d.cache, 4) == c.block(c.src, 1) and c.block(d.cache, 6) == c.block(c.src, 3)
    finally:
        c.close()


def test_a_pull_that_prefill_never_answers_is_computed_here_after_pull_answer_timeout_s(no_leaks):
    """A listed prefill whose pull endpoint takes the pull and never answers (stalled): the
    request waits ``pull_answer_timeout_s``, not ``load_timeout_s``, then decode computes it."""
    import zmq

    lay = _layout()
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    cfg = {"buffer_blocks": 12, "prefill": [address], "load_timeout_s": 20.0, "pull_answer_timeout_s": 0.5}
    side = DecodeSide(parse_settings("kv_consumer", "d", cfg), [lay])
    c = _Cluster()
    try:
        assert side.puller.timeout_s == 0.5
        prompt = list(range(20))
        _, answer = c.run_prefill("r", dict(NIXL), prompt, (1, 2, 3))
        t0 = time.monotonic()
        got = (None, False)
        while got == (None, False) and time.monotonic() - t0 < 10:
            got = side.matched("r", {**answer, PARAM_PULL: address}, prompt, 0)
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert got == (0, False) and side.pull_failed == 1
        assert 0.4 < took < 5, took
        assert silent.poll(1000) and len(silent.recv_multipart()) == 2  # the pull did reach it
    finally:
        c.close()
        side.close()
        silent.close(linger=0)
        ctx.term()
