"""Fault injection: hostile control messages, stalled, slow and reset peers, kills at
chosen points, fuzzed TCP framing. Every case: terminal state on both sides in bounded
time, every block back in its pool, and the survivor keeps serving."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq
from faultproxy import FaultProxy
from hostile import RawSession, data_conn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_transfer import BASE, Decode, _lines, _spawn, clean_killed_segment, prefill_cache, reap, send_one, wait_until

from pdkv import KVLayout, PrefillSender, State
from pdkv.protocol import Codec, Complete, Hello, LayerDone, ReserveReq, layout_desc, pack_frame


def all_free(dec):
    return dec.sched.buffer.num_free == dec.nb and dec.sched.gpu.num_free == dec.nb


def serve_one(dec, control=None, transport="tcp", rid="ok"):
    lay, arr, spec = prefill_cache(1, 0)
    with PrefillSender(
        lay, spec, control or dec.rx.control_address, transport=transport, timeout_s=5, instance=f"healthy-{rid}"
    ) as tx:
        assert send_one(tx, rid, [0, 1]).ok


def test_hostile_control_messages_change_nothing(no_leaks):
    dec = Decode(secret=None, lease_s=1.0)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(dec.rx.control_address)
    try:
        enc = msgspec.msgpack.Encoder()
        lay = KVLayout(**BASE)
        junk = [
            [pack_frame(b"", b"\xc1garbage")],  # not msgpack
            [pack_frame(b"", enc.encode([1, {"type": "reserve"}]))],  # truncated fields
            [pack_frame(b"", enc.encode([1, {"type": "evil", "x": 1}]))],  # unknown type
            [pack_frame(b"x" * 32, enc.encode([1, {"type": "hb", "t": 1.0}]))],  # a MAC where none is configured
            [b""],  # empty frame
            [b"\x07junk"],  # bad MAC length
            [b"", b""],  # two frames
            [pack_frame(b"", b"\x00" * (3 << 20))],  # oversized: zmq drops the peer
        ]
        for f in junk:
            s.send_multipart(f)
        c = Codec(None)
        s.send_multipart(c.encode(Hello(99, "evil", 0, 1, layout_desc(lay), ["tcp"], "b", 1, b"n" * 16)))
        # a proper session, then misbehaviour inside it
        raw = RawSession(dec.rx.control_address, lay, instance="evil2", ctx=ctx)
        s2, c2, frames = raw.sock, raw.codec, raw.hello_frames
        s2.send_multipart(frames)  # replayed hello
        s2.send_multipart(c2.encode(ReserveReq("mine", 16)))
        assert s2.poll(5000)
        s2.recv_multipart()  # the grant
        s2.send_multipart(c2.encode(LayerDone("mine", 1, [0])))  # shm-only message over tcp
        s2.send_multipart(c2.encode(Complete("mine", 12345, True)))  # forged token
        s2.send_multipart(c2.encode(ReserveReq("x" * 300, 16)))  # oversized id
        time.sleep(0.5)
        assert dec.rx.stats["messages_rejected"] >= 6
        assert dec.sched.request("mine").state is State.RESERVED  # nothing was applied
        serve_one(dec)
        # the hostile session never completes: its lease expires and its blocks come back
        wait_until(lambda: all_free(dec), 10, "blocks of the hostile session")
        dec.sched.check_invariants()
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_peer_that_stalls_forever_is_reclaimed(no_leaks):
    dec = Decode(lease_s=1.0, peer_timeout_s=1.5)
    ctx = zmq.Context()
    try:
        lay = KVLayout(**BASE)
        raw = RawSession(dec.rx.control_address, lay, instance="staller", ctx=ctx)
        s, c = raw.sock, raw.codec
        s.send_multipart(c.encode(ReserveReq("stuck", 40)))
        assert s.poll(5000)
        # ... and then nothing, ever: no data, no heartbeat
        t = wait_until(lambda: all_free(dec), 10, "the stalled peer's blocks")
        assert t < 5
        assert dec.sched.request("stuck").state in (State.EXPIRED, State.FAILED)
        serve_one(dec)
    finally:
        ctx.destroy(linger=0)
        dec.close()


@pytest.mark.multiproc
def test_slow_peer_through_a_latency_proxy(no_leaks):
    dec = Decode()
    host, port = dec.rx.data_address.split(":")
    proxy = FaultProxy((host, int(port)), delay_s=0.02, rate=2e6)
    dec.rx.data_advertise = f"127.0.0.1:{proxy.port}"
    try:
        t0 = time.monotonic()
        serve_one(dec, rid="slow")
        assert time.monotonic() - t0 > 0.05 and proxy.forwarded > 0
    finally:
        proxy.close()
        dec.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("fault", ["reset", "stall"])
def test_data_stream_reset_or_stalled_mid_frame(fault, no_leaks):
    dec = Decode(io_timeout_s=1.0, lease_s=3.0)
    host, port = dec.rx.data_address.split(":")
    kw = {"reset_after": 20000} if fault == "reset" else {"stall_after": 20000}
    proxy = FaultProxy((host, int(port)), **kw)
    dec.rx.data_advertise = f"127.0.0.1:{proxy.port}"
    try:
        lay, arr, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=2) as tx:
            tx.reserve("victim", 64)
            for layer in range(4):
                tx.send_layer(layer, [("victim", list(range(8)))])
            tx.finish("victim")
            t0 = time.monotonic()
            out = tx.wait_outcome("victim", 15)
            assert not out.ok
            assert time.monotonic() - t0 < 10
        wait_until(lambda: all_free(dec), 10, "blocks after a broken stream")
        assert dec.sched.request("victim").state in (State.FAILED, State.EXPIRED)
        dec.rx.data_advertise = dec.rx.data_address
        serve_one(dec, rid="after")
    finally:
        proxy.close()
        dec.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("point", ["handshake", "mid-layer", "between-layers"])
def test_prefill_kill_points(point, no_leaks):
    dec = Decode(peer_timeout_s=2.0)
    try:
        sleep = {"handshake": "0", "mid-layer": "0.5", "between-layers": "0.3"}[point]
        p = _spawn(
            "prefill",
            "--control",
            dec.rx.control_address,
            "--transport",
            "tcp",
            "--blocks",
            "8",
            "--layer-sleep",
            sleep,
            "--instance",
            f"k-{point}",
        )
        try:
            if point == "handshake":
                time.sleep(0.05)  # interpreter start: the kill lands before or during the handshake
            else:
                _lines(p, 2 if point == "mid-layer" else 3)
            os.kill(p.pid, 9)
            p.wait(10)
        finally:
            p.stdout.close()
            p.stderr.close()
        t = wait_until(lambda: all_free(dec) and not dec.sched.live_requests(), 10, f"recovery after kill at {point}")
        assert t < 10
        dec.sched.check_invariants()
        serve_one(dec, rid=f"after-{point}")
    finally:
        dec.close()


def test_decode_killed_during_swap_prefill_still_gets_an_outcome(no_leaks):
    """A swap that never completes (a hung GPU copy) must not hang prefill: prefill has its
    outcome at 'received'; decode's request stays SWAPPING with its blocks held, and aborting
    it waits for the swap (no block is reused under a copy)."""

    class Hung:
        def done(self):
            return False

        error = None

    class HungSwap:
        def submit(self, *a):
            return Hung()

    dec = Decode()
    dec.sched.swap = HungSwap()
    try:
        lay, arr, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=3) as tx:
            tx.reserve("h", 16)
            for layer in range(4):
                tx.send_layer(layer, [("h", [0, 1])])
            tx.finish("h")
            assert tx.wait_outcome("h", 5).ok
        wait_until(lambda: dec.sched.request("h").state is State.SWAPPING, 5, "swap admission")
        dec.sched.abort("h")
        assert dec.sched.request("h").state is State.SWAPPING  # blocks stay until the copy is done
        assert dec.sched.buffer.num_free == dec.nb - 2
    finally:
        dec.close()


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=400))
def test_fuzzed_tcp_framing_changes_nothing(shared_decode, data):
    dec, token, grant_token = shared_decode
    host, port = dec.rx.data_address.split(":")
    before = (dec.sched.metrics()["layers_landed"], dec.sched.buffer.num_free)
    s = data_conn(dec.rx.data_address, *token)
    try:
        s.sendall(data)
    finally:
        s.close()
    time.sleep(0.01)
    assert (dec.sched.metrics()["layers_landed"], dec.sched.buffer.num_free) == before
    assert not dec.rx.closed


@pytest.fixture(scope="module")
def shared_decode():
    dec = Decode(lease_s=600, io_timeout_s=0.3)
    lay, arr, spec = prefill_cache(1, 0)
    tx = PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5)
    g = tx.reserve("fuzz", 16)
    yield dec, (tx.session_id, tx.session_key), g.token
    tx.close()
    dec.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("point", ["handshake", "mid-layer", "during-swap"])
def test_decode_kill_points(point, no_leaks):
    from pdkv.errors import PdkvTimeoutError, PeerError

    d = _spawn("decode", "--timeout", "2", "--slow-swap", "30" if point == "during-swap" else "0")
    info = None
    try:
        info = _lines(d, 1)[0]
        lay, arr, spec = prefill_cache(1, 0)
        if point == "handshake":
            os.kill(d.pid, 9)
            d.wait(10)
            t0 = time.monotonic()
            with pytest.raises((PdkvTimeoutError, PeerError)):
                PrefillSender(lay, spec, info["control"], transport="tcp", timeout_s=1.5)
            assert time.monotonic() - t0 < 5
            return
        with PrefillSender(lay, spec, info["control"], transport="tcp", timeout_s=1.5, heartbeat_s=0.2) as tx:
            tx.reserve("r", 16)
            tx.send_layer(0, [("r", [0, 1])])
            if point == "mid-layer":
                os.kill(d.pid, 9)
                d.wait(10)
                out = tx.wait_outcome("r", 10)
                assert out.state == "failed"
            else:
                for layer in range(1, 4):
                    tx.send_layer(layer, [("r", [0, 1])])
                tx.finish("r")
                assert tx.wait_outcome("r", 10).ok  # prefill's part is done: it may free its blocks
                assert _lines(d, 1)[0] == {"swapping": "r"}
                os.kill(d.pid, 9)
                d.wait(10)
                t0 = time.monotonic()
                wait_until(lambda: tx._broken is not None, 10, "prefill notices the dead decode")
                assert time.monotonic() - t0 < 5
    finally:
        reap(d)
        if info is not None:  # the killed decode left its segment: the clean command removes it
            clean_killed_segment(info["shm"])
