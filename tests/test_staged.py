"""Staged sends (pdkv.transfer.transports.staging): a cache's layers gathered into a staging ring and
sent from there. On CPU CI the swap engine's host strategy stands in for the GPU gather
(``staging="always"`` on a host cache); the ``cuda`` tests run the same path from GPU
caches. Every test name contains ``staged``."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_transfer import (
    Decode,
    _lines,
    _spawn,
    clean_killed_segment,
    expected_block,
    prefill_cache,
    reap,
    send_one,
    wait_until,
)

from pdkv import CacheSpec, PrefillSender, State
from pdkv.errors import ClosedError, PdkvTimeoutError, TransferError
from pdkv.transfer.transports import tcp
from pdkv.transfer.transports.staging import StagedSends, StagingRing, chunk_ranges, default_slot_bytes

BLOCK = 4096  # bytes of one block of one layer (test_transfer.BASE: 2 tensors x 2 KiB)


def _staged_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pdkv-staged-send"]


def _check_tp(dec, caches, src_blocks, grants):
    for rid, sb in src_blocks.items():
        for dst in dec.lays:
            for layer in range(4):
                for t in range(2):
                    for gi, b in enumerate(grants[rid].blocks):
                        want = expected_block([c[0] for c in caches], [c[2] for c in caches], sb, dst, layer, t, gi)
                        assert dec.block(dst.tp_rank, layer, t, b) == want, (rid, dst.tp_rank, layer, t, gi)


# ---------------------------------------------------------------------- the ring


class StagedRingMachine(RuleBasedStateMachine):
    """The ring against a model: the set of slots handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.ring = StagingRing(64, 3)
        self.out: set[int] = set()

    @precondition(lambda self: len(self.out) < 3)
    @rule()
    def acquire(self):
        s = self.ring.acquire(0.5)
        assert s not in self.out and 0 <= s < 3
        # each slot its own bytes: writing one never shows in another
        self.ring.view(s)[:] = bytes([s + 1]) * 64
        self.out.add(s)

    @precondition(lambda self: len(self.out) == 3)
    @rule()
    def acquire_when_full_times_out(self):
        t0 = time.monotonic()
        with pytest.raises(PdkvTimeoutError, match="no staging slot"):
            self.ring.acquire(0.02)
        assert time.monotonic() - t0 < 1

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def release(self, data):
        s = data.draw(st.sampled_from(sorted(self.out)))
        assert bytes(self.ring.view(s)) == bytes([s + 1]) * 64
        self.ring.release(s)
        self.out.remove(s)

    @rule(s=st.integers(0, 2))
    def release_of_a_free_slot_is_refused(self, s):
        if s not in self.out:
            with pytest.raises(ValueError, match="not out"):
                self.ring.release(s)

    @invariant()
    def free_count_matches(self):
        assert self.ring.free_slots == 3 - len(self.out)

    def teardown(self):
        self.ring.close()


test_staged_ring_model = StagedRingMachine.TestCase
test_staged_ring_model.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_staged_ring_wakes_a_waiter_on_release_and_on_close():
    ring = StagingRing(16, 1)
    s = ring.acquire(1)
    got = []
    t = threading.Thread(target=lambda: got.append(ring.acquire(5)))
    t.start()
    time.sleep(0.05)
    ring.release(s)
    t.join(2)
    assert got == [s]
    errs = []

    def wait_closed():
        try:
            ring.acquire(5)
        except ClosedError as exc:
            errs.append(exc)

    t = threading.Thread(target=wait_closed)
    t.start()
    time.sleep(0.05)
    ring.close()
    t.join(2)
    assert len(errs) == 1 and not t.is_alive()
    ring.close()  # idempotent


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_staged_ring_refuses_bad_sizes(bad):
    with pytest.raises(ValueError, match="slot_bytes"):
        StagingRing(bad, 2)
    with pytest.raises(ValueError, match="slots"):
        StagingRing(64, 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=40), st.sampled_from([1, 7, 64]))
def test_staged_chunks_cover_in_order_within_the_cap(sizes, cap):
    if any(n > cap for n in sizes):
        with pytest.raises(TransferError, match="does not fit a staging slot"):
            chunk_ranges(sizes, cap)
        return
    rs = chunk_ranges(sizes, cap)
    flat = [i for lo, hi in rs for i in range(lo, hi)]
    assert flat == list(range(len(sizes)))
    assert all(hi > lo and sum(sizes[lo:hi]) <= cap for lo, hi in rs)
    # greedy: a chunk ends only where the next item would not fit
    assert all(sum(sizes[lo : hi + 1]) > cap for lo, hi in rs[:-1])


def test_staged_default_slot_follows_the_layer_size():
    from pdkv import KVLayout
    from pdkv.layout import tp_segments

    small = KVLayout(num_layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, dtype="bf16")
    segs = tp_segments(small, small)
    assert default_slot_bytes(small, segs) == 16 << 20  # 256 x 4 KiB is under the 16 MiB floor
    big = KVLayout(num_layers=4, kv_heads=4, head_dim=128, tokens_per_block=64, dtype="bf16")
    assert default_slot_bytes(big, tp_segments(big, big)) == 256 * big.layer_block_bytes == 32 << 20
    # a TP 2 -> 1 rank sends half of each block: the slot follows what it sends
    half = KVLayout(num_layers=4, kv_heads=4, head_dim=128, tokens_per_block=64, dtype="bf16", tp_size=2)
    one = KVLayout(num_layers=4, kv_heads=4, head_dim=128, tokens_per_block=64, dtype="bf16")
    mine = [g for g in tp_segments(half, one) if g.src_rank == 0]
    assert default_slot_bytes(half, mine) == 16 << 20
    huge = KVLayout(num_layers=4, kv_heads=64, head_dim=128, tokens_per_block=256, dtype="bf16")
    assert default_slot_bytes(huge, tp_segments(huge, huge)) == 64 << 20  # capped


# ---------------------------------------------------------------------- the pipeline


class _Host:
    """What StagedSends uses of a sender: its cache and fail_request."""

    def __init__(self, nb=32):
        from pdkv import KVLayout

        self.layout = KVLayout(num_layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, dtype="bf16")
        self.arr = np.random.default_rng(1).integers(0, 256, self.layout.block_bytes * nb, dtype=np.uint8)
        self.cache = CacheSpec.for_buffer(self.layout, nb, self.arr.ctypes.data)
        self.failed: dict[str, str] = {}

    def fail_request(self, rid, why):
        self.failed.setdefault(rid, why)


def test_staged_sends_gather_in_order_and_run_callbacks_after_earlier_sends():
    h = _Host()
    s = StagedSends(h, 3 * BLOCK, 2, timeout_s=2)
    got, order = [], []
    try:
        base = h.arr.ctypes.data
        for k in range(6):
            src = np.array([base + (5 * k) * BLOCK, base + (5 * k + 2) * BLOCK], np.int64)
            ln = np.array([BLOCK, 2 * BLOCK], np.int64)
            s.stage(k, src, ln, frozenset({f"r{k}"}), [lambda v, k=k: (got.append((k, bytes(v))), order.append(k))])
            if k == 2:
                s.after(lambda: order.append("mid"))
        s.after(lambda: order.append("end"))
        assert s.drain(5)
        assert order == [0, 1, 2, "mid", 3, 4, 5, "end"]
        for k, data in got:
            a = h.arr
            want = bytes(a[5 * k * BLOCK : (5 * k + 1) * BLOCK]) + bytes(a[(5 * k + 2) * BLOCK : (5 * k + 4) * BLOCK])
            assert data == want
        assert s.ring.free_slots == 2 and not h.failed
        assert [r.layer for r in s.log] == list(range(6))
        fired = []
        s.after(lambda: fired.append(1))  # nothing in flight: runs at once
        assert fired == [1]
    finally:
        s.close()
    assert not _staged_threads()


def test_staged_lanes_run_ahead_of_each_other_and_free_a_slot_when_all_are_done():
    h = _Host()
    s = StagedSends(h, BLOCK, 3, lanes=2, timeout_s=2)
    gate = threading.Event()
    fast, order = [], []
    try:
        src = np.array([h.arr.ctypes.data], np.int64)
        ln = np.array([BLOCK], np.int64)
        for k in range(3):  # lane 1 is held on chunk 0; lane 0 sends all three meanwhile
            s.stage(k, src, ln, frozenset({"a"}), [lambda v, k=k: fast.append(k), lambda v: gate.wait(5)])
        s.after(lambda: order.append("done"))
        wait_until(lambda: fast == [0, 1, 2], 5, "lane 0 to run ahead")
        assert s.ring.free_slots == 0 and order == []  # every slot still has lane 1's share
        gate.set()
        assert s.drain(5)
        assert order == ["done"] and s.ring.free_slots == 3 and not h.failed
        with pytest.raises(ValueError, match="1 sends for 2 lanes"):
            s.stage(0, src, ln, frozenset(), [None])
    finally:
        s.close()


def test_staged_full_ring_waits_with_a_bound_and_fails_nothing_queued():
    h = _Host()
    s = StagedSends(h, BLOCK, 1, timeout_s=0.2)
    gate = threading.Event()
    try:
        src = np.array([h.arr.ctypes.data], np.int64)
        ln = np.array([BLOCK], np.int64)
        s.stage(0, src, ln, frozenset({"a"}), [lambda v: gate.wait(5)])
        t0 = time.monotonic()
        with pytest.raises(PdkvTimeoutError, match="no staging slot"):
            s.stage(1, src, ln, frozenset({"b"}), [lambda v: None])
        assert 0.15 < time.monotonic() - t0 < 2
        gate.set()
        assert s.drain(5)
        assert s.ring.free_slots == 1 and not h.failed  # the refused chunk was never queued
        with pytest.raises(ValueError, match="fit one slot"):
            s.stage(2, np.array([h.arr.ctypes.data] * 2, np.int64), np.array([BLOCK, 1], np.int64), frozenset(), [None])
    finally:
        s.close()


def test_staged_failure_mid_layer_fails_its_requests_and_returns_every_slot():
    h = _Host()
    s = StagedSends(h, 2 * BLOCK, 3, timeout_s=2)
    sent, order = [], []

    def send(k):
        def f(v):
            if k == 2:
                raise OSError("connection reset by peer")
            sent.append(k)

        return f

    try:
        src = np.array([h.arr.ctypes.data], np.int64)
        ln = np.array([BLOCK], np.int64)
        for k in range(5):  # chunk 2 carries bytes of requests b and c
            rids = frozenset({"b", "c"}) if k == 2 else frozenset({"a"})
            s.stage(0, src, ln, rids, [send(k)])
        s.after(lambda: order.append(dict(h.failed)))
        assert s.drain(5)
        assert sent == [0, 1, 3, 4]
        assert set(h.failed) == {"b", "c"} and "connection reset" in h.failed["b"]
        assert order == [h.failed]  # the failures were known before the callback ran
        assert s.ring.free_slots == 3
    finally:
        s.close()


def test_staged_close_with_queued_chunks_fails_them_and_frees_the_ring():
    h = _Host()
    s = StagedSends(h, BLOCK, 4, timeout_s=2)
    gate = threading.Event()
    src = np.array([h.arr.ctypes.data], np.int64)
    ln = np.array([BLOCK], np.int64)
    s.stage(0, src, ln, frozenset({"a"}), [lambda v: gate.wait(0.3)])
    for k in range(1, 4):
        s.stage(0, src, ln, frozenset({f"q{k}"}), [lambda v: None])
    ran = []
    s.after(lambda: ran.append(1))
    t0 = time.monotonic()
    s.close(5)
    assert time.monotonic() - t0 < 2
    assert set(h.failed) >= {"q1", "q2", "q3"} and not ran  # a closed sender confirms nothing
    assert s.ring.free_slots == 4 and not _staged_threads()
    with pytest.raises(ClosedError):
        s.stage(0, src, ln, frozenset(), [None])
    s.close()  # idempotent


# ---------------------------------------------------------------------- through a decode


@pytest.mark.parametrize("P,D,nhd", [(1, 1, False), (2, 4, False), (4, 2, False), (2, 1, True)])
@pytest.mark.parametrize("streams", [1, 3])
def test_staged_tcp_every_byte(P, D, nhd, streams, no_leaks):
    dec = Decode(D=D, token_major=nhd, transports=("tcp",))
    try:
        caches = [prefill_cache(P, r, token_major=nhd) for r in range(P)]
        # 2 blocks a slot: a layer of two requests is several chunks, frames cut to fit
        txs = [
            PrefillSender(
                lay,
                spec,
                dec.rx.control_address,
                transport="tcp",
                instance="pf",
                timeout_s=5,
                streams=streams,
                staging="always",
                staging_slot_bytes=2 * BLOCK,
                staging_slots=2,
            )
            for lay, _, spec in caches
        ]
        assert all(tx.stats["path"] == "tcp staged (host gather)" for tx in txs)
        src_blocks = {"a": [3, 4, 5, 9, 10], "b": [20, 21, 22, 23, 30, 31]}
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, caches, src_blocks, grants)
        for tx in txs:
            st_ = tx.transport_impl.staging
            assert len(st_.log) > 4 and st_.ring.free_slots == 2
            assert sum(r.nbytes for r in st_.log) == tx.stats["bytes"] > 0
            assert [e[0] for e in tx.layer_log] == [0, 1, 2, 3]
            tx.close()
        assert not _staged_threads()
    finally:
        dec.close()


def test_staged_slot_smaller_than_a_block_piece_is_refused_by_name(no_leaks):
    dec = Decode()
    try:
        lay, _, spec = prefill_cache(1, 0)
        with pytest.raises(TransferError, match="staging_slot_bytes=1000 is smaller"):
            PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", staging="always", staging_slot_bytes=1000)
        with pytest.raises(ValueError, match="staging='sometimes'"):
            PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", staging="sometimes")
    finally:
        dec.close()


def test_staged_tcp_default_path_is_direct_for_host_caches(no_leaks):
    dec = Decode()
    try:
        lay, _, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5) as tx:
            assert tx.stats["path"] == "tcp" and tx.transport_impl.staging is None
            assert send_one(tx, "d", [1, 2]).ok
    finally:
        dec.close()


def test_staged_send_failing_mid_layer_reports_the_request_failed(monkeypatch, no_leaks):
    """A staged send that fails after some frames of a layer landed: prefill reports the
    request failed, decode fails it and takes its blocks back, the next request is served."""
    calls = []
    push = tcp._push_staged

    def flaky(sock, fs, sent):
        calls.append(len(fs))
        if len(calls) == 3:
            raise OSError("injected send failure")
        push(sock, fs, sent)

    monkeypatch.setattr(tcp, "_push_staged", flaky)
    dec = Decode()
    try:
        lay, _, spec = prefill_cache(1, 0)
        with PrefillSender(
            lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5, staging="always", staging_slot_bytes=BLOCK
        ) as tx:
            out = send_one(tx, "v", [1, 2, 3])
            assert out.state == "failed" and "injected send failure" in out.reason
            assert tx.transport_impl.staging.ring.free_slots == 4
            wait_until(lambda: dec.sched.buffer.num_free == dec.nb, 5, "the failed request's blocks")
            assert dec.sched.request("v").state is State.FAILED
            assert send_one(tx, "after", [4]).ok
    finally:
        dec.close()


def _kill_prefill_mid_layer(instance, *extra):
    """A staged prefill process on a slow link (0.1 s a frame) killed while layer 0's
    chunks are being sent: decode takes every block back and serves on."""
    dec = Decode(peer_timeout_s=2.0)
    try:
        p = _spawn(
            "prefill",
            "--control",
            dec.rx.control_address,
            "--transport",
            "tcp",
            "--blocks",
            "8",
            "--slot-bytes",
            str(BLOCK),
            "--send-delay",
            "0.1",
            "--instance",
            instance,
            *extra,
        )
        try:
            _lines(p, 3, timeout=60)  # ready, layers 0 and 1 handed over
            wait_until(lambda: dec.rx.stats.get("frames", 0) >= 1, 10, "the first staged frame")
            assert dec.sched.metrics()["layers_landed"] == 0  # mid-layer: layer 0 not complete
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        finally:
            p.stdout.close()
            p.stderr.close()
        wait_until(lambda: dec.sched.buffer.num_free == dec.nb and not dec.sched.live_requests(), 10, "reclaim")
        assert dec.sched.request(f"{instance}-0").state in (State.FAILED, State.EXPIRED)
        dec.sched.check_invariants()
        lay, _, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5, staging="always") as tx:
            assert send_one(tx, "after", [0, 1]).ok
    finally:
        dec.close()


def _slow_staged_link(monkeypatch):
    """Staged frames sent 0.05 s apart; the event is set once the first one goes out."""
    push = tcp._push_staged
    started = threading.Event()

    def slow(sock, fs, sent):
        for f in fs:
            started.set()
            time.sleep(0.05)
            push(sock, [f], sent)

    monkeypatch.setattr(tcp, "_push_staged", slow)
    return started


def _kill_decode_mid_layer(monkeypatch, lay, spec, **kw):
    """A decode process killed while a staged layer is going out: the request fails in
    bounded time, every slot returns, close is bounded, no lane thread is left."""

    started = _slow_staged_link(monkeypatch)
    d = _spawn("decode", "--timeout", "2")
    info = None
    try:
        info = _lines(d, 1)[0]
        tx = PrefillSender(
            lay, spec, info["control"], transport="tcp", timeout_s=1.5, heartbeat_s=0.2, staging_slot_bytes=BLOCK, **kw
        )
        try:
            tx.reserve("r", 64)
            for layer in range(4):
                tx.send_layer(layer, [("r", list(range(8)))])
            assert started.wait(10)
            os.kill(d.pid, signal.SIGKILL)
            d.wait(10)
            t0 = time.monotonic()
            out = tx.wait_outcome("r", 10)
            assert out.state == "failed"
            assert time.monotonic() - t0 < 5
            staged = tx.transport_impl.staging
            wait_until(lambda: staged.idle, 10, "the staged sends to end")
            assert staged.ring.free_slots == staged.ring.slots
        finally:
            t0 = time.monotonic()
            tx.close()
            assert time.monotonic() - t0 < 5
        assert not _staged_threads()
    finally:
        reap(d)
        if info is not None:
            clean_killed_segment(info["shm"])


@pytest.mark.multiproc
def test_staged_prefill_killed_mid_layer_decode_reclaims_and_serves_on(no_leaks):
    _kill_prefill_mid_layer("sk", "--staging", "always")


@pytest.mark.multiproc
def test_staged_decode_killed_mid_layer_prefill_fails_in_bounded_time(monkeypatch, no_leaks):
    lay, _, spec = prefill_cache(1, 0)
    _kill_decode_mid_layer(monkeypatch, lay, spec, staging="always")


# ---------------------------------------------------------------------- from GPU caches


def _gpu_caches(P, nb=64, gpus=1, nhd=False):
    from pdkv import _ffi

    out, ptrs = [], []
    for r in range(P):
        lay, arr, hspec = prefill_cache(P, r, nb=nb, token_major=nhd)
        with _ffi.cuda.on_device(r % gpus):
            ptr = _ffi.cuda.malloc(arr.nbytes)
        ptrs.append(ptr)
        _ffi.cuda.memcpy(ptr, arr.ctypes.data, arr.nbytes)
        out.append((lay, arr, hspec, CacheSpec.for_buffer(lay, nb, ptr, device=r % gpus)))
    return out, ptrs


@pytest.mark.cuda
@pytest.mark.parametrize("P,D,gpus", [(1, 1, 1), (2, 4, 1), (4, 2, 1), (2, 1, 2)])
def test_staged_tcp_from_gpu_caches_every_byte(cuda_device, P, D, gpus, no_leaks):
    from pdkv import _ffi

    if _ffi.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices")
    dec = Decode(D=D, transports=("tcp",))
    caches, ptrs = _gpu_caches(P, gpus=gpus)
    try:
        txs = [
            PrefillSender(lay, gspec, dec.rx.control_address, transport="tcp", instance="gpf", timeout_s=10, streams=2)
            for lay, _, _, gspec in caches
        ]
        assert all(tx.stats["path"].startswith("tcp staged (") for tx in txs)
        # several requests a layer batch
        src_blocks = {f"g{i}": [(7 * i + j * 3) % 64 for j in range(5)] for i in range(4)}
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, [(c[0], c[1], c[2]) for c in caches], src_blocks, grants)
        for tx in txs:
            assert tx.transport_impl.staging.ring.pinned
            tx.close()
        assert _ffi.cuda.current_device() == 0 and not _staged_threads()
    finally:
        for p in ptrs:
            _ffi.cuda.free(p)
        dec.close()


@pytest.mark.cuda
def test_staged_tcp_is_offered_for_gpu_caches_after_the_same_host_transports(cuda_device):
    from pdkv import _ffi
    from pdkv.transfer import auto_offer

    caches, ptrs = _gpu_caches(1)
    try:
        offer = auto_offer(caches[0][3])
        assert offer[-1] == "tcp" and offer.index("shm") < offer.index("tcp")
    finally:
        _ffi.cuda.free(ptrs[0])


@pytest.mark.cuda
@pytest.mark.multiproc
def test_staged_gpu_prefill_killed_mid_layer(cuda_device, no_leaks):
    _kill_prefill_mid_layer("gk", "--gpu")


@pytest.mark.cuda
@pytest.mark.multiproc
def test_staged_gpu_decode_killed_mid_layer(cuda_device, monkeypatch, no_leaks):
    from pdkv import _ffi

    caches, ptrs = _gpu_caches(1)
    try:
        lay, _, _, gspec = caches[0]
        _kill_decode_mid_layer(monkeypatch, lay, gspec)
    finally:
        for p in ptrs:
            _ffi.cuda.free(p)


# ---------------------------------------------------------------------- rdma: staged and GPUDirect


def _rdma_tx(dec, lay, spec, **kw):
    return PrefillSender(lay, spec, dec.rx.control_address, transport="rdma", instance="pf", timeout_s=5, **kw)


def _send_batch(txs, src_blocks):
    grants = {}
    for rid, sb in src_blocks.items():
        for tx in txs:
            g = tx.reserve(rid, len(sb) * 8 - 3)
            assert grants.setdefault(rid, g).blocks == g.blocks
    for layer in range(4):
        for tx in txs:
            tx.send_layer(layer, list(src_blocks.items()))
    for tx in txs:
        tx.finish_many(list(src_blocks))
    for tx in txs:
        for rid in src_blocks:
            out = tx.wait_outcome(rid, 10)
            assert out.state == "received", out
    return grants


@pytest.mark.parametrize("P,D,nhd", [(1, 1, False), (2, 4, False), (4, 2, False), (2, 1, True)])
def test_staged_rdma_every_byte_from_the_registered_ring(P, D, nhd, monkeypatch, no_leaks):
    import fake_verbs

    fabric = fake_verbs.install(monkeypatch)
    dec = Decode(D=D, token_major=nhd, transports=("rdma",))
    try:
        caches = [prefill_cache(P, r, token_major=nhd) for r in range(P)]
        txs = [_rdma_tx(dec, lay, spec, staging="always", staging_slot_bytes=2 * BLOCK) for lay, _, spec in caches]
        assert all(tx.stats["path"] == "rdma staged (host gather)" for tx in txs)
        src_blocks = {"a": [3, 4, 5, 9, 10], "b": [20, 21, 22, 23, 30, 31]}
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, caches, src_blocks, grants)
        assert fabric.bytes == sum(tx.stats["bytes"] for tx in txs) > 0
        # every write came out of a ring: the only local regions registered are the rings
        rings = {(tx.transport_impl.staging.ring.address, tx.transport_impl.staging.ring.nbytes) for tx in txs}
        local = {fabric.mrs[k][:2] for k in fabric.lkeys_used}
        assert local == rings
        for tx in txs:
            assert tx.transport_impl.staging.ring.free_slots == 4
            tx.close()
        assert not _staged_threads()
    finally:
        dec.close()


def test_staged_rdma_failed_completion_fails_the_batch_and_returns_every_slot(monkeypatch, no_leaks):
    import fake_verbs

    fabric = fake_verbs.install(monkeypatch)
    dec = Decode(transports=("rdma",))
    try:
        lay, _, spec = prefill_cache(1, 0)
        tx = _rdma_tx(dec, lay, spec, staging="always", staging_slot_bytes=BLOCK)
        try:
            tx.reserve("x", 32)
            tx.send_layer(0, [("x", [1, 2, 3])])
            wait_until(lambda: tx.transport_impl.staging.idle, 5, "layer 0")
            fabric.fail_next = fake_verbs.REM_ACCESS_ERR
            tx.send_layer(1, [("x", [1, 2, 3])])
            tx.finish("x")
            out = tx.wait_outcome("x", 10)
            assert out.state in ("failed", "aborted") and "RDMA" in out.reason
            st_ = tx.transport_impl.staging  # the chunks still queued fail fast on the broken queue pair
            wait_until(lambda: st_.idle and st_.ring.free_slots == 4, 5, "every slot back")
            wait_until(lambda: dec.sched.buffer.num_free == dec.nb, 5, "decode frees the blocks")
        finally:
            tx.close()
    finally:
        dec.close()


def _fake_gpu_cache(monkeypatch, allocations=1, nb=64):
    """A "GPU" cache in host memory (device 0) over ``allocations`` arrays, with the CUDA
    calls GPUDirect makes answered for them: address ranges, dma-buf fds (of /dev/null)."""
    from test_transfer import BASE

    from pdkv import KVLayout, _ffi

    lay = KVLayout(**BASE)
    per = lay.block_bytes * nb // allocations
    arrs = [np.random.default_rng(i).integers(0, 256, per, dtype=np.uint8) for i in range(allocations)]
    host = np.concatenate(arrs)  # the same bytes in one array, for checking
    spec_h = CacheSpec.for_buffer(lay, nb, host.ctypes.data)
    # regions of each (layer, tensor) laid out as for_buffer does, spread over the arrays
    regions, off = [], 0
    for _layer in range(lay.total_layers):
        row = []
        for t in range(len(lay.tensors)):
            tb = lay.tensor_block_bytes(t)
            a, o = divmod(off, per)
            row.append((arrs[a].ctypes.data + o, tb))
            off += tb * nb
        regions.append(row)
    spec = CacheSpec(lay, nb, regions, device=0)
    fds = []

    def address_range(ptr):
        for a in arrs:
            if a.ctypes.data <= ptr < a.ctypes.data + a.nbytes:
                return a.ctypes.data, a.nbytes
        raise AssertionError(f"{ptr:#x} is in no allocation")

    def dmabuf_fd(base, size):
        fds.append((base, size))
        return os.open("/dev/null", os.O_RDONLY)

    monkeypatch.setattr(_ffi.cuda, "address_range", address_range)
    monkeypatch.setattr(_ffi.cuda, "dmabuf_fd", dmabuf_fd)
    monkeypatch.setattr(_ffi.cuda, "dmabuf_supported", lambda d: True)
    monkeypatch.setattr(_ffi.cuda, "set_sync_memops", lambda p: fds.append(("sync", p)))
    return lay, spec, spec_h, host, arrs, fds


@pytest.mark.parametrize("allocations", [1, 2])
@pytest.mark.parametrize("how", ["dma-buf", "peer memory"])
def test_staged_rdma_gpudirect_registers_each_allocation_once(allocations, how, monkeypatch, no_leaks):
    import fake_verbs

    from pdkv import _ffi
    from pdkv.errors import CudaError

    fabric = fake_verbs.install(monkeypatch)
    fabric.gpudirect = how
    lay, spec, spec_h, host, arrs, fds = _fake_gpu_cache(monkeypatch, allocations)
    if how == "peer memory":  # this driver exports no dma-buf: the address goes to the peer-memory client

        def no_dmabuf(base, size):
            raise CudaError(801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported", "cuMemGetHandleForAddressRange")

        monkeypatch.setattr(_ffi.cuda, "dmabuf_fd", no_dmabuf)
    dec = Decode(transports=("rdma",))
    try:
        with _rdma_tx(dec, lay, spec) as tx:
            assert tx.stats["path"] == f"rdma GPUDirect ({how})" and tx.transport_impl.staging is None
            # one registration per allocation, page-rounded for the export, not per layer or request
            assert sorted(fabric.gpu_regs) == sorted((a.ctypes.data, a.nbytes, how == "dma-buf") for a in arrs)
            if how == "dma-buf":  # SYNC_MEMOPS set, then the export of the whole allocation in 64 KiB units
                bases = sorted(a.ctypes.data for a in arrs)
                assert fds == [x for b in bases for x in (("sync", b), (b, -(-arrs[0].nbytes // 65536) * 65536))]
            src_blocks = {"a": [3, 4, 5, 60], "b": [20, 33, 34]}
            grants = _send_batch([tx], src_blocks)
            _check_tp(dec, [(lay, host, spec_h)], src_blocks, grants)
            assert len(fabric.gpu_regs) == allocations  # still: the requests registered nothing
    finally:
        dec.close()


def test_staged_rdma_gpudirect_refused_stages_or_fails_as_asked(monkeypatch, no_leaks):
    """auto: a NIC that takes no GPU memory makes the sender stage (and say why); require:
    the sender fails naming the reason; off: it stages without trying."""
    import fake_verbs

    from pdkv.errors import RdmaError
    from pdkv.transfer import SenderOptions
    from pdkv.transfer.transports.rdma import RdmaSender

    fabric = fake_verbs.install(monkeypatch)
    fabric.gpudirect = None
    lay, spec, _, _, _, _ = _fake_gpu_cache(monkeypatch)

    class Host:  # what RdmaSender uses before the handshake
        layout, cache, timeout_s = lay, spec, 5.0

    for mode, staged in (("auto", True), ("off", True)):
        s = RdmaSender(Host(), SenderOptions(gpudirect=mode))
        try:
            assert s._stage is staged and not fabric.gpu_regs
            assert ("takes no GPU memory" in s.gpudirect_refused) == (mode == "auto")
        finally:
            s.close()
    with pytest.raises(RdmaError, match="gpudirect='require': GPUDirect registration failed: the simulated NIC"):
        RdmaSender(Host(), SenderOptions(gpudirect="require"))
    with pytest.raises(ValueError, match="gpudirect='maybe'"):
        SenderOptions(gpudirect="maybe")


def test_staged_auto_offers_rdma_before_tcp_for_a_gpu_cache(monkeypatch):
    import fake_verbs

    from pdkv.transfer import auto_offer

    fake_verbs.install(monkeypatch)
    lay, spec, _, _, _, _ = _fake_gpu_cache(monkeypatch)
    offer = auto_offer(spec)
    assert offer.index("shm") < offer.index("rdma") < offer.index("tcp")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["off", "refused"])
@pytest.mark.parametrize("P,D", [(1, 1), (2, 4)])
def test_staged_rdma_from_gpu_caches_every_byte(cuda_device, mode, P, D, monkeypatch, no_leaks):
    """Staged RDMA from H200 memory through the simulated NIC: the real gather into the
    registered pinned ring, the simulated writes out of it. 'refused': the NIC takes no GPU
    memory and gpudirect='auto' falls back to staging."""
    import fake_verbs

    from pdkv import _ffi

    fabric = fake_verbs.install(monkeypatch)
    fabric.gpudirect = None
    dec = Decode(D=D, transports=("rdma",))
    caches, ptrs = _gpu_caches(P)
    try:
        txs = [
            _rdma_tx(dec, lay, gspec, gpudirect="off" if mode == "off" else "auto", staging_slot_bytes=2 * BLOCK)
            for lay, _, _, gspec in caches
        ]
        assert all(tx.stats["path"] == "rdma staged (GPU gather)" for tx in txs)
        src_blocks = {f"g{i}": [(7 * i + j * 3) % 64 for j in range(5)] for i in range(3)}
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, [(c[0], c[1], c[2]) for c in caches], src_blocks, grants)
        for tx in txs:
            assert tx.transport_impl.staging.ring.pinned
            tx.close()
    finally:
        for p in ptrs:
            _ffi.cuda.free(p)
        dec.close()


@pytest.mark.cuda
def test_staged_dmabuf_export_of_a_gpu_allocation(cuda_device):
    """What GPUDirect hands the NIC, on a real GPU: a dma-buf fd of a whole allocation."""
    from pdkv import _ffi
    from pdkv.errors import CudaError

    if not _ffi.cuda.dmabuf_supported(0):
        pytest.skip("this GPU or driver exports no dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)")
    ptr = _ffi.cuda.malloc(3 << 20)
    try:
        base, size = _ffi.cuda.address_range(ptr + 12345)
        assert base == ptr and size >= 3 << 20
        _ffi.cuda.set_sync_memops(base)
        fd = _ffi.cuda.dmabuf_fd(base, -(-size // 65536) * 65536)
        try:
            assert os.fstat(fd).st_size in (0, size)
        finally:
            os.close(fd)
        with pytest.raises(CudaError, match="cuMemGetHandleForAddressRange"):
            _ffi.cuda.dmabuf_fd(base + 1, 4096)  # not page-aligned
    finally:
        _ffi.cuda.free(ptr)
