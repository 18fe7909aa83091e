"""Hostile and careless peers, on loopback: each test plays an attacker (or a broken peer)
against a decode that also serves a good peer, and checks, by comparing the whole CPU
buffer, that nothing outside the attacker's own live grants changed.

Extend it by adding a case: an attacker built from :mod:`hostile` (a raw control session
and raw data connections), the good peer's transfer beside it, and ``outside_unchanged``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq
from hostile import AUTH_HEADER, RawSession, data_conn, recv_n, sender_conn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_transfer import BASE, HERE, Decode, expected_block, prefill_cache, reap, send_one, wait_until

from pdkv import CacheSpec, KVLayout, PrefillSender, State
from pdkv.errors import ProtocolError, TransferError
from pdkv.procs import boot_id
from pdkv.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Auth,
    Challenge,
    Codec,
    Complete,
    CompleteBatch,
    ErrorMsg,
    Heartbeat,
    Hello,
    LayerBatch,
    LayerDone,
    ReserveBatch,
    ReserveReq,
    Welcome,
    layout_desc,
    mask_instance_key,
    new_nonce,
    pack_frame,
)
from pdkv.transfer import FRAME_HEADER, FRAME_ITEM

SECRET = b"s" * 32
TB = KVLayout(**BASE).tensor_block_bytes(0)  # one block of one layer of one tensor


def frame(token, items, *, rank=0, layer=0, tensor=0, off=0, length=TB, count=1, dstride=0) -> bytes:
    """A tcp data frame's header and items (the payload follows)."""
    return FRAME_HEADER.pack(
        b"PDKV", 1, 2, rank, token, layer, tensor, 0, 0, len(items), off, length, count, dstride
    ) + b"".join(FRAME_ITEM.pack(gi, nb) for gi, nb in items)


def block_ranges(dec, rank, blocks):
    """Byte ranges (in rank's buffer) of every layer and tensor of ``blocks``."""
    lay = dec.lays[rank]
    spec = CacheSpec.for_buffer(lay, dec.nb, dec.bufs[rank].address)
    out = []
    for layer in range(lay.total_layers):
        for t in range(len(lay.tensors)):
            for b in blocks:
                a = spec.address(layer, t, b) - dec.bufs[rank].address
                out.append((a, a + lay.tensor_block_bytes(t)))
    return out


def snapshot(dec):
    return [bytes(b.buf) for b in dec.bufs]


def outside_unchanged(dec, before, allowed=()):
    """Every byte of every buffer equals ``before`` except inside ``allowed`` blocks."""
    for r, (b, old) in enumerate(zip(dec.bufs, before)):
        now = np.frombuffer(bytes(b.buf), np.uint8).copy()
        was = np.frombuffer(old, np.uint8).copy()
        for lo, hi in block_ranges(dec, r, allowed):
            now[lo:hi] = was[lo:hi] = 0
        diff = np.flatnonzero(now != was)
        assert diff.size == 0, f"rank {r}: {diff.size} bytes changed outside the allowed blocks, first at {diff[0]}"


def good_peer(dec, rid="good", blocks=(0, 1), instance="good", transport="tcp", secret=None):
    """A real prefill serving one request at the same time as the attacker."""
    lay, arr, spec = prefill_cache(1, 0, seed=7)
    with PrefillSender(
        lay, spec, dec.rx.control_address, transport=transport, timeout_s=5, instance=instance, secret=secret
    ) as tx:
        out = send_one(tx, rid, list(blocks))
    assert out.ok, out
    return arr


def expected_layer_block(arr, layer, t, b):
    lay = KVLayout(**BASE)
    spec = CacheSpec.for_buffer(lay, 64, arr.ctypes.data)
    a = spec.address(layer, t, b) - arr.ctypes.data
    return arr[a : a + lay.tensor_block_bytes(t)].tobytes()


# ------------------------------------------------------------------ 1. late and trickled writes


def _trickle_then_overwrite(lease_s, grace_s, io_timeout_s, peer_timeout_s, trickle_s, trickles):
    """Peer A's frame, validated while its grant was live, trickles past its lease, its
    fence and the grant of the same blocks to B, then delivers its tail after B's first
    layer landed. B's KV must be B's."""
    dec = Decode(nb=2, lease_s=lease_s, fence_grace_s=grace_s, io_timeout_s=io_timeout_s, peer_timeout_s=peer_timeout_s)
    ctx = zmq.Context()
    try:
        lay = KVLayout(**BASE)
        a = RawSession(dec.rx.control_address, lay, instance="slow-a", ctx=ctx)
        a.send(ReserveReq("a", 16))
        ga = a.recv()
        assert ga.outcome == "buffer" and list(ga.blocks) == [0, 1]
        conn = a.data_conn(dec.rx.data_address)
        conn.sendall(frame(ga.token, [(0, 1)]))  # admitted under A's live grant
        for _ in range(trickles):  # one byte at a time: never a stall of io_timeout_s
            try:
                conn.send(b"\xee")
            except OSError:
                break
            time.sleep(trickle_s)
        # B gets the same blocks once A's are back
        lay_b, arr, spec = prefill_cache(1, 0, seed=3)
        with PrefillSender(lay_b, spec, dec.rx.control_address, transport="tcp", timeout_s=10, instance="b") as tx:
            deadline = time.monotonic() + 15
            while True:  # rejected while A's blocks are held (on_full=reject): ask again
                try:
                    gb = tx.reserve("b", 16)
                    break
                except TransferError:
                    assert time.monotonic() < deadline, "A's blocks never came back"
                    time.sleep(0.05)
            assert set(gb.blocks) == {0, 1}
            tx.send_layer(0, [("b", [0, 1])])
            wait_until(lambda: dec.sched.request("b").layers_landed >= 1, 10, "B's first layer")
            try:  # A's tail, all at once
                conn.sendall(b"\xee" * (TB - trickles))
            except OSError:
                pass
            time.sleep(0.3)
            for layer in range(1, 4):
                tx.send_layer(layer, [("b", [0, 1])])
            tx.finish("b")
            assert tx.wait_outcome("b", 10).ok
        for gi, b in enumerate(gb.blocks):
            assert dec.block(0, 0, 0, b) == expected_layer_block(arr, 0, 0, gi), "A's late bytes landed in B's block"
        conn.close()
        a.close()
    finally:
        ctx.destroy(linger=0)
        dec.close()


@pytest.mark.multiproc
def test_a_trickled_frame_never_lands_in_reused_blocks(no_leaks):
    # the timings of the report: lease 1 s, grace 1 s, io_timeout 0.5 s, peer_timeout 1.5 s, a byte every 0.15 s
    _trickle_then_overwrite(1.0, 1.0, 0.5, 1.5, 0.15, 20)


@pytest.mark.multiproc
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lease=st.floats(0.4, 1.5),
    grace=st.floats(0.0, 1.0),
    io=st.floats(0.3, 1.0),
    peer=st.floats(0.6, 2.0),
    trickle=st.floats(0.05, 0.25),
    n=st.integers(1, 25),
)
def test_trickled_frames_never_land_in_reused_blocks_random_timings(no_leaks, lease, grace, io, peer, trickle, n):
    _trickle_then_overwrite(lease, grace, io, peer, trickle, n)


def test_a_fenced_peer_loses_its_data_connections(no_leaks):
    dec = Decode(peer_timeout_s=0.8)
    ctx = zmq.Context()
    try:
        a = RawSession(dec.rx.control_address, KVLayout(**BASE), ctx=ctx)
        conn = a.data_conn(dec.rx.data_address)
        # no heartbeat: the peer is declared dead, and its idle connection is closed and joined
        conn.settimeout(10)
        t0 = time.monotonic()
        assert conn.recv(1) == b""
        assert time.monotonic() - t0 < 5
        wait_until(lambda: not dec.rx.transport("tcp").connections, 5, "the data thread joined and forgotten")
        conn.close()
        a.close()
        good_peer(dec)
    finally:
        ctx.destroy(linger=0)
        dec.close()


# ------------------------------------------------------------------ 2. cross-session tokens


@pytest.mark.parametrize("secret", [None, SECRET])
def test_another_sessions_grant_token_is_refused_everywhere(no_leaks, secret):
    dec = Decode(secret=secret)
    ctx = zmq.Context()
    try:
        lay, arr, spec = prefill_cache(1, 0, seed=5)
        with PrefillSender(
            lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5, instance="victim", secret=secret
        ) as tx:
            g = tx.reserve("v", 16)  # the attacker observed this grant on the wire
            atk = RawSession(dec.rx.control_address, KVLayout(**BASE), secret=secret, instance="attacker", ctx=ctx)
            before = snapshot(dec)
            conn = atk.data_conn(dec.rx.data_address)  # its own, authenticated, data connection
            conn.sendall(frame(g.token, [(0, 1)]) + b"\x66" * TB)
            conn.sendall(frame(g.token, [(1, 1)], tensor=1) + b"\x66" * TB)
            for m in (
                LayerDone("v", g.token, [0]),
                LayerBatch(0, [("v", g.token, 0)]),
                Complete("v", g.token, True),
                Complete("v", g.token, False, "attacker says it failed"),
                CompleteBatch([("v", g.token, True, "")]),
                Abort("v", "attacker"),
            ):
                atk.send(m)
            wait_until(lambda: dec.rx.stats["frames_rejected"] >= 2, 5, "both frames refused")
            time.sleep(0.3)
            outside_unchanged(dec, before)  # not a byte of the victim's blocks moved
            info = dec.sched.request("v")
            assert info.state is State.RESERVED and info.layers_landed == 0
            for layer in range(4):
                tx.send_layer(layer, [("v", [0, 1])])
            tx.finish("v")
            assert tx.wait_outcome("v", 5).ok
            conn.close()
            atk.close()
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_a_frame_that_would_overfill_a_layer_is_refused_before_it_is_written(no_leaks):
    dec = Decode()
    ctx = zmq.Context()
    try:
        a = RawSession(dec.rx.control_address, KVLayout(**BASE), ctx=ctx)
        a.send(ReserveReq("dup", 16))
        g = a.recv()
        conn = a.data_conn(dec.rx.data_address)
        conn.sendall(frame(g.token, [(0, 1)]) + b"\x11" * TB)
        wait_until(lambda: dec.rx.stats["frames"] >= 1, 5, "the first write")
        blk = g.blocks[0]
        assert dec.block(0, 0, 0, blk) == b"\x11" * TB
        before = snapshot(dec)
        conn.sendall(frame(g.token, [(0, 1)]) + b"\x22" * TB)  # the same piece again: would credit twice
        conn.sendall(frame(g.token, [(0, 2)]) + b"\x33" * (2 * TB))  # overlaps it
        wait_until(lambda: dec.rx.stats["frames_rejected"] >= 2, 5, "both refused")
        outside_unchanged(dec, before)  # refused before a byte was written, its own block included
        assert dec.sched.request("dup").layers_landed == 0  # half of layer 0 is still missing
        conn.close()
        a.close()
        good_peer(dec, blocks=(2, 3))
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_a_rank_writes_only_its_own_head_range(no_leaks):
    # prefill TP 2 -> decode TP 1: each prefill rank's frames must carry its own segment
    dec = Decode()
    ctx = zmq.Context()
    try:
        r0 = RawSession(dec.rx.control_address, KVLayout(**BASE, tp_size=2, tp_rank=0), instance="pf", ctx=ctx)
        r0.send(ReserveReq("tp", 8))
        g = r0.recv()
        conn = r0.data_conn(dec.rx.data_address)
        before = snapshot(dec)
        half = TB // 2
        # rank 0 holds heads 0-1: the second half of each block is rank 1's
        conn.sendall(frame(g.token, [(0, 1)], off=half, length=half) + b"\x44" * half)
        conn.sendall(frame(g.token, [(0, 1)], off=0, length=TB) + b"\x44" * TB)  # the whole block
        wait_until(lambda: dec.rx.stats["frames_rejected"] >= 2, 5, "both refused")
        outside_unchanged(dec, before)
        conn.sendall(frame(g.token, [(0, 1)], off=0, length=half) + b"\x55" * half)  # its own: lands
        wait_until(lambda: dec.rx.stats["frames"] >= 1, 5, "rank 0's own piece")
        assert dec.block(0, 0, 0, g.blocks[0])[:half] == b"\x55" * half
        conn.close()
        r0.close()
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_layer_reports_cannot_be_repeated_to_fill_another_ranks_share(no_leaks):
    dec = Decode(transports=("shm",))
    ctx = zmq.Context()
    try:
        r0 = RawSession(
            dec.rx.control_address, KVLayout(**BASE, tp_size=2, tp_rank=0), instance="pf", transports=("shm",), ctx=ctx
        )
        r0.send(ReserveReq("rep", 8))
        g = r0.recv()
        r0.send(LayerDone("rep", g.token, [0]))
        r0.send(LayerDone("rep", g.token, [0]))  # again: would stand in for rank 1's half
        r0.send(LayerDone("rep", g.token, [1, 1]))
        err = [r0.recv(), r0.recv()]
        assert all(isinstance(e, ErrorMsg) for e in err), err
        assert dec.sched.request("rep").layers_landed == 0
        r0.close()
    finally:
        ctx.destroy(linger=0)
        dec.close()


# ------------------------------------------------------------------ 3. replayed handshakes


def test_a_replayed_hello_gets_no_session_and_no_data_access(no_leaks):
    dec = Decode(secret=SECRET)
    ctx = zmq.Context()
    try:
        lay = KVLayout(**BASE)
        victim = RawSession(dec.rx.control_address, lay, secret=SECRET, instance="victim", ctx=ctx)
        victim.send(ReserveReq("v", 16))
        assert victim.recv().outcome == "buffer"
        captured = victim.hello_frames  # everything an observer of the wire saw
        key = mask_instance_key(victim.instance_key, victim.codec.key, victim.nonce, victim.challenge.nonce)
        captured_auth = victim.codec.encode(Auth(victim.challenge.nonce, key))
        npeers = len(dec.rx._peers)
        before = snapshot(dec)
        atk = ctx.socket(zmq.DEALER)
        atk.setsockopt(zmq.LINGER, 0)
        atk.connect(dec.rx.control_address)
        atk.send_multipart(captured)  # replayed from a new connection
        assert atk.poll(5000)
        frames = atk.recv_multipart()  # its nonce was seen: refused at once, no handshake held for it
        refusal = Codec(SECRET).decode(frames)  # (under the secret: the test may read it)
        assert isinstance(refusal, ErrorMsg) and "replayed" in refusal.message and not dec.rx._pending
        atk.send_multipart(captured_auth)
        assert atk.poll(5000)
        frames = atk.recv_multipart()
        assert isinstance(Codec(None).decode(frames), ErrorMsg)  # refused, in the clear: no Welcome
        assert len(dec.rx._peers) == npeers and dec.rx.stats["auth_failed"] >= 1
        # the observed session id and grant token, without the session key: no data connection
        host, port = dec.rx.data_address.split(":")
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(AUTH_HEADER + victim.welcome.session_id)
        assert len(recv_n(s, 16)) == 16  # decode's nonce
        s.sendall(b"\0" * 32)  # a guess at the MAC
        assert s.recv(1) == b""
        s.close()
        with pytest.raises(ConnectionError):
            data_conn(dec.rx.data_address, victim.welcome.session_id, None)  # the unauthenticated MAC
        outside_unchanged(dec, before)
        assert dec.sched.request("v").state is State.RESERVED
        atk.close(0)
        victim.close()
        good_peer(dec, secret=SECRET, blocks=(4, 5))
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_handshakes_in_progress_are_bounded_and_expire(no_leaks):
    dec = Decode(secret=SECRET, max_handshakes=4, auth_timeout_s=0.5)
    ctx = zmq.Context()
    try:
        lay = KVLayout(**BASE)
        half = [
            RawSession(dec.rx.control_address, lay, secret=SECRET, instance=f"h{i}", complete=False, ctx=ctx)
            for i in range(6)
        ]
        got = [h.recv() for h in half]
        # every Hello is answered; past max_handshakes the oldest give way, so holding
        # handshakes open keeps no newcomer out
        assert all(isinstance(m, Challenge) for m in got)
        assert len(dec.rx._pending) == 4
        wait_until(lambda: not dec.rx._pending, 5, "unanswered challenges forgotten")
        for h in half:
            h.close()
        good_peer(dec, secret=SECRET)
    finally:
        ctx.destroy(linger=0)
        dec.close()


# ------------------------------------------------------------------ 4. decoder input


def _nested_body(fields, key, depth, in_map=True):
    """A msgpack envelope whose ``key`` holds ``{"x": [[[...]]]}``, ``depth`` arrays nested
    in each other (built as bytes: no encoder nests that deep). A map first: a field typed
    as a free-form dict (as ``Hello.layout`` once was) accepted it and recursed."""
    body = msgspec.msgpack.encode([1, {**fields, key: "@@NEST@@"}])
    return body.replace(
        msgspec.msgpack.encode("@@NEST@@"), (b"\x81\xa1x" if in_map else b"") + b"\x91" * depth + b"\x00"
    )


def test_deeply_nested_hello_is_a_protocol_error_and_the_loop_serves_on(no_leaks):
    body = _nested_body(
        {
            "type": "hello",
            "version": PROTOCOL_VERSION,
            "instance": "x",
            "tp_rank": 0,
            "tp_size": 1,
            "transports": ["tcp"],
            "boot_id": "b",
            "pid": 1,
            "nonce": b"n" * 16,
        },
        "layout",
        5000,
    )
    assert len(body) < 10_000
    with pytest.raises(ProtocolError):
        Codec(None).decode([pack_frame(b"", body)])
    deep = _nested_body({"type": "hb"}, "t", 100_000, in_map=False)
    with pytest.raises(ProtocolError):
        Codec(None).decode([pack_frame(b"", deep)])
    dec = Decode()
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(dec.rx.control_address)
        for b in (body, deep):
            s.send_multipart([pack_frame(b"", b)])
        assert s.poll(5000)
        assert isinstance(Codec(None).decode(s.recv_multipart()), ErrorMsg)
        good_peer(dec)
        assert dec.rx.stats["loop_errors"] == 0
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_an_exception_in_one_message_does_not_end_the_control_loop(no_leaks, monkeypatch):
    dec = Decode()
    ctx = zmq.Context()
    try:
        real = dec.rx._dispatch
        calls = []

        def boom(peer, msg):
            if isinstance(msg, Heartbeat) and not calls:
                calls.append(msg)
                raise RuntimeError("a bug in one handler")
            return real(peer, msg)

        monkeypatch.setattr(dec.rx, "_dispatch", boom)
        a = RawSession(dec.rx.control_address, KVLayout(**BASE), ctx=ctx)
        a.send(Heartbeat(1.0))
        wait_until(lambda: dec.rx.stats["loop_errors"] == 1, 5, "the failure counted")
        good_peer(dec)
        a.close()
    finally:
        ctx.destroy(linger=0)
        dec.close()


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_values = st.recursive(
    _scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=30
)
_TYPES = [
    "hello",
    "challenge",
    "auth",
    "welcome",
    "reserve",
    "reserves",
    "grant",
    "grants",
    "layer",
    "layers",
    "complete",
    "completes",
    "outcome",
    "outcomes",
    "abort",
    "hb",
    "error",
    "nope",
]


def _fuzz_body(draw_seq, draw_type, fields):
    return msgspec.msgpack.encode([draw_seq, {"type": draw_type, **fields}])


def _decode_only_protocol_errors(body):
    for secret in (None, SECRET):
        c = Codec(secret)
        try:
            c.decode([pack_frame(b"", body)])
        except ProtocolError:
            assert c._recv_seq == -1


@given(seq=_scalars, kind=st.sampled_from(_TYPES), fields=st.dictionaries(st.text(max_size=12), _values, max_size=8))
def test_fuzzed_messages_raise_only_protocol_errors(seq, kind, fields):
    _decode_only_protocol_errors(_fuzz_body(seq, kind, fields))


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 20,000 examples take minutes on 2 cores (and -o faulthandler_timeout=0)
@settings(max_examples=20_000, deadline=None)
@given(
    seq=_scalars,
    kind=st.sampled_from(_TYPES),
    fields=st.dictionaries(st.text(max_size=12), _values, max_size=8),
    depth=st.integers(0, 6000),
)
def test_fuzzed_messages_raise_only_protocol_errors_many(seq, kind, fields, depth):
    body = _fuzz_body(seq, kind, fields)
    if depth > 5000:
        body = _nested_body({"type": kind, **fields}, "layout", depth)
    _decode_only_protocol_errors(body)


# ------------------------------------------------------------------ every message type, misused


def _all_messages(token, lay):
    desc = layout_desc(lay)
    return [
        Hello(PROTOCOL_VERSION, "x", 0, 1, desc, ["tcp"], "b", 1, b"n" * 16),  # a second hello inside a session
        Challenge(b"c" * 16, b"n" * 16),
        Auth(b"c" * 16, b"k" * 32),  # handshake messages out of order
        Welcome(PROTOCOL_VERSION, "x", 1, [0], [desc], "tcp", [], 1, "", b"s" * 16),  # decode's message, from prefill
        ReserveReq("m", 1 << 20),  # more than the buffer
        ReserveBatch([("m", 8), ("m", 8)]),  # the same id twice
        LayerDone("m", token, [99]),
        LayerDone("m", token + 1, [0]),
        LayerDone("nobody", 1, [0]),
        LayerBatch(7, [("m", token, 0)]),
        LayerBatch(0, [("m", token, 9999)]),
        Complete("m", token + 1, True),
        Complete("nobody", 3, True),
        CompleteBatch([("m", token, True, "")]),
        Abort("nobody"),
        ErrorMsg("x", "y"),
    ]


def test_every_message_type_misused_inside_a_session(no_leaks):
    dec = Decode(lease_s=2.0)
    ctx = zmq.Context()
    try:
        lay = KVLayout(**BASE)
        a = RawSession(dec.rx.control_address, lay, ctx=ctx)
        a.send(ReserveReq("m", 16))
        g = a.recv()
        before = snapshot(dec)
        rejected = dec.rx.stats["messages_rejected"]
        for m in _all_messages(g.token, lay):
            a.send(m)
        a.send_raw(a.hello_frames)  # a replayed frame of this session
        wait_until(lambda: dec.rx.stats["messages_rejected"] - rejected >= 10, 5, "misuse refused")
        outside_unchanged(dec, before)
        info = dec.sched.request("m")
        assert info.state is State.RESERVED and info.layers_landed == 0
        good_peer(dec, blocks=(5, 6))
        a.close()
        wait_until(lambda: dec.sched.buffer.num_free == dec.nb, 10, "the abandoned grant's blocks")
    finally:
        ctx.destroy(linger=0)
        dec.close()


@pytest.mark.parametrize(
    "field,value",
    [
        ("rank", 7),
        ("layer", 99),
        ("tensor", 9),
        ("off", TB),
        ("length", TB + 1),
        ("count", 3),
        ("gi", 2),
        ("gi", 1 << 31),
        ("nb", 0),
        ("nb", 3),
        ("nitems", 0),
        ("nitems", 5000),
        ("magic", b"XXXX"),
        ("version", 9),
        ("kind", 7),
    ],
)
def test_every_data_frame_field_out_of_range(no_leaks, field, value):
    dec = Decode()
    ctx = zmq.Context()
    try:
        a = RawSession(dec.rx.control_address, KVLayout(**BASE), ctx=ctx)
        a.send(ReserveReq("f", 16))
        g = a.recv()
        conn = a.data_conn(dec.rx.data_address)
        before = snapshot(dec)
        hdr = dict(
            magic=b"PDKV",
            version=1,
            kind=2,
            rank=0,
            token=g.token,
            layer=0,
            tensor=0,
            nitems=1,
            off=0,
            length=TB,
            count=1,
            dstride=0,
        )
        it = dict(gi=0, nb=1)
        (it if field in it else hdr)[field] = value
        raw = FRAME_HEADER.pack(
            hdr["magic"],
            hdr["version"],
            hdr["kind"],
            hdr["rank"],
            hdr["token"],
            hdr["layer"],
            hdr["tensor"],
            0,
            0,
            hdr["nitems"],
            hdr["off"],
            hdr["length"],
            hdr["count"],
            hdr["dstride"],
        )
        payload = max(1, it["nb"]) * hdr["count"] * hdr["length"]
        try:
            conn.sendall(raw + FRAME_ITEM.pack(it["gi"], it["nb"]) * max(1, min(hdr["nitems"], 8)) + b"\x77" * payload)
        except OSError:
            pass
        wait_until(lambda: dec.rx.stats["frames_rejected"] >= 1, 5, "the frame refused")
        time.sleep(0.1)
        outside_unchanged(dec, before)
        assert dec.sched.request("f").layers_landed == 0
        conn.close()
        a.close()
        good_peer(dec, blocks=(2, 3))
    finally:
        ctx.destroy(linger=0)
        dec.close()


# ------------------------------------------------------------------ 5. and 6. connection floods


def _threads():
    return threading.active_count()


def test_silent_connections_hold_no_thread_and_are_closed(no_leaks):
    dec = Decode(auth_timeout_s=0.5, max_pending_connections=32)
    host, port = dec.rx.data_address.split(":")
    socks = []
    try:
        t0 = _threads()
        for _ in range(200):
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        time.sleep(0.3)
        assert _threads() <= t0 + 1  # pre-authentication connections have no thread
        good_peer(dec)  # served while they wait
        for s in socks:  # every one closed: refused over the cap at once, the rest at their deadline
            s.settimeout(5)
            assert s.recv(1) == b""
        # each one closed for a reason: refused over the cap, or its authentication deadline
        # passed (on a loaded host the first expire before the last connect, so the split varies)
        st = dec.rx.stats
        assert st["connections_refused"] + st["auth_failed"] >= 200 and st["connections_refused"] > 0, st
        # authenticated connections come and go: their threads are forgotten
        lay, arr, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5) as tx:
            for _ in range(100):
                sender_conn(dec.rx.data_address, tx).close()
            wait_until(
                lambda: dec.rx.transport("tcp").connections == tx.transport_impl.connections,
                5,
                "finished threads forgotten",
            )
            assert send_one(tx, "after", [0, 1]).ok
    finally:
        for s in socks:
            s.close()
        dec.close()


@pytest.mark.multiproc
def test_fd_exhaustion_does_not_end_accepting(no_leaks):
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    d = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peers.py"), "decode", "--nofile", "20", "--auth-timeout", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    socks = []
    ctx = zmq.Context()
    try:
        import json

        info = json.loads(d.stdout.readline())
        lay = KVLayout(**BASE)
        a = RawSession(info["control"], lay, ctx=ctx)
        host, port = a.welcome.data_addr.split(":")
        for _ in range(120):  # far more than the decode may have open
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                break
        time.sleep(1.5)
        for s in socks:
            s.close()
        socks.clear()
        a.close()
        time.sleep(1.0)
        _, arr, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, info["control"], transport="tcp", timeout_s=5) as tx:
            assert send_one(tx, "after-emfile", [0, 1]).ok
    finally:
        for s in socks:
            s.close()
        ctx.destroy(linger=0)
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(10)
        finally:
            reap(d)


@pytest.mark.multiproc
def test_a_session_of_another_transport_opens_no_data_connection(no_leaks):
    """The tcp listener authenticates only sessions whose transport is tcp: an shm session,
    with its own key, cannot open a data connection (and so cannot send frames)."""
    dec = Decode(transports=("shm", "tcp"))
    ctx = zmq.Context()
    try:
        shm = RawSession(dec.rx.control_address, KVLayout(**BASE), transports=("shm",), instance="s", ctx=ctx)
        assert shm.welcome.transport == "shm"
        refused = dec.rx.stats["auth_failed"]
        with pytest.raises((ConnectionError, OSError)):
            shm.data_conn(dec.rx.data_address)
        wait_until(lambda: dec.rx.stats["auth_failed"] > refused, 5, "the refusal counted")
        tcp = RawSession(dec.rx.control_address, KVLayout(**BASE), transports=("tcp",), instance="t", ctx=ctx)
        tcp.data_conn(dec.rx.data_address).close()  # a tcp session's, the same way, is accepted
        for s in (shm, tcp):
            s.close()
    finally:
        ctx.destroy(linger=0)
        dec.close()


# ------------------------------------------------------------------ 9. identity, caps, sweepers (round 2)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_a_session_naming_a_live_instance_cannot_join_its_grant(secret, no_leaks):
    """Grant hijack through the instance name: an authenticated attacker names the victim's
    instance, as its own rank and as the other rank of its TP pair. Both are refused, so it
    is never sent the victim's grant; a second live session of the victim's own rank, from
    another process, is refused even with the right key; the victim's real second rank joins
    the grant."""
    dec = Decode(secret=secret)
    ctx = zmq.Context()
    try:
        addr, key = dec.rx.control_address, os.urandom(32)

        def lay(r):
            return KVLayout(**BASE, tp_size=2, tp_rank=r)

        victim = RawSession(addr, lay(0), secret=secret, instance="victim", instance_key=key, ctx=ctx)
        victim.send(ReserveReq("v", 16))
        g = victim.recv()
        assert g.outcome == "buffer"
        before = snapshot(dec)
        for rank in (0, 1):
            atk = RawSession(addr, lay(rank), secret=secret, instance="victim", ctx=ctx, refusable=True)
            assert atk.welcome is None and "another instance key" in atk.refusal.message, atk.refusal
            atk.close()
        dup = RawSession(  # another process of the instance (a same-process one replaces its own)
            addr, lay(0), secret=secret, instance="victim", instance_key=key, ctx=ctx, refusable=True, pid=os.getppid()
        )
        assert dup.welcome is None and "live session" in dup.refusal.message, dup.refusal
        dup.close()
        assert dec.rx.stats["identity_refused"] == 3
        outside_unchanged(dec, before)
        r1 = RawSession(addr, lay(1), secret=secret, instance="victim", instance_key=key, ctx=ctx)
        r1.send(ReserveReq("v", 16))
        g1 = r1.recv()
        assert (g1.token, g1.blocks) == (g.token, g.blocks)  # one instance, one grant
        r1.close()
        victim.close()
        good_peer(dec, secret=secret, blocks=(4, 5))
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_names_from_the_wire_are_printable(no_leaks):
    """An instance name or request id with a line break would forge log lines: refused."""
    dec = Decode()
    ctx = zmq.Context()
    try:
        lay = KVLayout(**BASE)
        h = RawSession(dec.rx.control_address, lay, instance="x\nWARNING forged", complete=False, ctx=ctx)
        m = h.recv()
        assert isinstance(m, ErrorMsg) and "printable" in m.message and not dec.rx._pending
        h.close()
        s = RawSession(dec.rx.control_address, lay, instance="p", ctx=ctx)
        s.send(ReserveReq("r\n1", 8))
        time.sleep(0.3)
        assert dec.rx.stats["messages_rejected"] >= 1 and dec.sched.live_requests() == []
        s.send(ReserveBatch([("a", 8), ("a", 8)]))  # one id twice in a batch: refused whole
        time.sleep(0.3)
        assert dec.sched.live_requests() == []
        s.close()
        good_peer(dec)
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_a_pid_beyond_any_process_is_refused_and_a_broken_check_stops_no_other(monkeypatch, no_leaks):
    """``pid = 2**63 - 1`` made every sweep raise OverflowError, so no dead peer was fenced:
    the schema refuses it, and each peer's check stands alone."""
    dec = Decode(peer_timeout_s=0.5)
    ctx = zmq.Context()
    try:
        lay = KVLayout(**BASE)
        c = Codec(None)
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(dec.rx.control_address)
        s.send_multipart(
            c.encode(Hello(PROTOCOL_VERSION, "big", 0, 1, layout_desc(lay), ["tcp"], boot_id(), 2**63 - 1, new_nonce()))
        )
        assert s.poll(5000)
        m = Codec(None).decode(s.recv_multipart())
        assert isinstance(m, ErrorMsg) and "pid" in m.message
        s.close(0)
        # a check that raises for one peer (whatever the cause) does not shield another
        bad = RawSession(dec.rx.control_address, lay, instance="bad", ctx=ctx)
        silent = RawSession(dec.rx.control_address, lay, instance="silent", ctx=ctx)
        silent.send(ReserveReq("s", 8))
        assert silent.recv().outcome == "buffer"
        from pdkv.transfer.sessions import decode as decode_mod

        real = decode_mod.pid_alive
        for p in dec.rx._peers.values():
            if p.instance == "bad":
                p.same_host, p.pid = True, 4194303

        def pid_alive(pid):
            if pid == 4194303:
                raise OverflowError("as os.kill raised for 2**63 - 1")
            return real(pid)

        monkeypatch.setattr("pdkv.transfer.sessions.decode.pid_alive", pid_alive)
        wait_until(lambda: dec.sched.request("s").state is State.FAILED, 5, "the silent peer fenced")
        bad.close()
        silent.close()
        good_peer(dec)
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_the_sweepers_do_not_hang_on_a_fifo_named_like_a_record(tmp_path):
    """``pdkv-shm list`` and ``clean`` opened ``<name>@origin`` blocking: a FIFO there, which
    any local user can make, hung them for ever."""
    from pdkv.buffer.sweeper import clean, scan_segments

    (tmp_path / "pdkv-9-x").write_bytes(b"\0" * 4096)
    os.mkfifo(tmp_path / "pdkv-9-x@origin")
    out: list = []
    t = threading.Thread(target=lambda: out.append((scan_segments(str(tmp_path)), clean(shm_dir=str(tmp_path)))))
    t.daemon = True
    t.start()
    t.join(10)
    assert not t.is_alive(), "the sweep blocked on a FIFO"
    segs, rep = out[0]
    assert [s.verdict for s in segs] == ["unproven"] and "no pdkv origin record" in segs[0].why
    assert rep.removed == () and (tmp_path / "pdkv-9-x").exists()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _spawn_decode(*args):
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    d = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peers.py"), "decode", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    import json

    return d, json.loads(d.stdout.readline())


def _stop(d):
    d.send_signal(signal.SIGTERM)
    try:
        d.wait(10)
    finally:
        reap(d)


CONTROL_FLOOD_BOUND_MIB = 200  # decode's RSS growth under the flood below, at most (docs/SECURITY.md)


@pytest.mark.multiproc
def test_a_flood_of_large_control_messages_neither_grows_decode_nor_starves_a_good_peer(no_leaks):
    """Eight unauthenticated connections send 1 MiB messages as fast as they can (and some
    of 2 MiB, over the cap): decode's RSS stays within a bound, and a good peer is served
    within its timeout meanwhile."""
    d, info = _spawn_decode("--auth-timeout", "1")
    stop = threading.Event()
    ctx = zmq.Context()
    try:
        time.sleep(0.5)
        base = _rss_mib(d.pid)
        peak = [base]

        def flood(i):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 4)
            s.connect(info["control"])
            junk = [b"\0" + os.urandom(16) * ((1 << 20) // 16 - 8), b"\0" + b"x" * (2 << 20)]
            while not stop.is_set():
                try:
                    s.send(junk[i % 2 and int(time.monotonic() * 10) % 5 == 0], zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)
            s.close(0)

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_mib(d.pid))
                time.sleep(0.05)

        threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(8)]
        threads.append(threading.Thread(target=sample, daemon=True))
        for t in threads:
            t.start()
        time.sleep(1.5)
        lay, arr, spec = prefill_cache(1, 0)
        t0 = time.monotonic()
        with PrefillSender(lay, spec, info["control"], transport="tcp", timeout_s=5, instance="good") as tx:
            assert send_one(tx, "good", [0, 1], timeout=5).ok
        served = time.monotonic() - t0
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(5)
        grew = peak[0] - base
        print(f"decode RSS {base:.0f} MiB, peak {peak[0]:.0f} MiB under the flood; good peer served in {served:.2f} s")
        assert grew < CONTROL_FLOOD_BOUND_MIB, f"decode grew by {grew:.0f} MiB under the flood"
        assert served < 5
    finally:
        stop.set()
        ctx.destroy(linger=0)
        _stop(d)


@pytest.mark.multiproc
def test_idle_control_connections_do_not_exhaust_decode(no_leaks):
    """Control connections that never speak (raw TCP, held open) used to stay for ever: at a
    small descriptor limit a good peer could no longer handshake. Decode closes those
    without a session past max_pending_control and after auth_timeout_s."""
    d, info = _spawn_decode("--nofile", "80", "--auth-timeout", "0.5")
    socks: list[socket.socket] = []
    try:
        host, port = info["control"][len("tcp://") :].rsplit(":", 1)
        for _ in range(150):  # more than decode may have descriptors for
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                break
        time.sleep(0.3)
        lay, arr, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, info["control"], transport="tcp", timeout_s=5, instance="good") as tx:
            assert send_one(tx, "good", [0, 1], timeout=5).ok
    finally:
        for s in socks:
            s.close()
        _stop(d)


def test_silent_data_connections_held_open_keep_no_session_out(no_leaks):
    """An attacker keeps max_pending_connections silent data connections open, opening a
    new one whenever one is closed: the oldest gives way, and a good peer's connections
    authenticate."""
    dec = Decode(max_pending_connections=8, auth_timeout_s=5)
    stop = threading.Event()
    held: list[socket.socket] = []
    t: threading.Thread | None = None
    try:
        host, port = dec.rx.data_address.split(":")

        def hold():
            while not stop.is_set():
                while len(held) < 8 and not stop.is_set():
                    try:
                        held.append(socket.create_connection((host, int(port)), timeout=1))
                    except OSError:
                        time.sleep(0.01)
                for s in list(held):
                    s.setblocking(False)
                    try:
                        if s.recv(1) == b"":
                            held.remove(s)
                            s.close()
                    except BlockingIOError:
                        pass
                    except OSError:
                        held.remove(s)
                        s.close()
                time.sleep(0.005)

        t = threading.Thread(target=hold, daemon=True)
        t.start()
        time.sleep(0.5)
        good_peer(dec, blocks=(2, 3))  # received: every byte of it landed
        assert dec.rx.stats["connections_refused"] > 0  # the attacker's connections gave way
    finally:
        stop.set()
        if t is not None:
            t.join(5)
        for s in held:
            s.close()
        dec.close()


def test_a_replayed_hello_flood_keeps_no_session_out(no_leaks):
    """One captured Hello replayed hundreds of times a second used to fill max_handshakes
    and keep every new session out; decode remembers Hello nonces and refuses a repeat."""
    dec = Decode(secret=SECRET)
    stop = threading.Event()
    ctx = zmq.Context()
    try:
        h = RawSession(dec.rx.control_address, KVLayout(**BASE), secret=SECRET, complete=False, ctx=ctx)
        assert isinstance(h.recv(), Challenge)
        captured = h.hello_frames
        sent = [0]

        def replay():
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(dec.rx.control_address)
            while not stop.is_set():
                s.send_multipart(captured)
                sent[0] += 1
                while s.poll(0):
                    s.recv_multipart()
                time.sleep(0.002)
            s.close(0)

        t = threading.Thread(target=replay, daemon=True)
        t.start()
        time.sleep(1.5)
        good_peer(dec, secret=SECRET)
        stop.set()
        t.join(5)
        assert sent[0] > 300 and len(dec.rx._pending) <= 1
        h.close()
    finally:
        stop.set()
        ctx.destroy(linger=0)
        dec.close()


def test_one_instance_cannot_take_the_whole_buffer_past_its_quota(no_leaks):
    dec = Decode(max_blocks_per_instance=4)
    ctx = zmq.Context()
    try:
        greedy = RawSession(dec.rx.control_address, KVLayout(**BASE), instance="greedy", ctx=ctx)
        greedy.send(ReserveReq("g1", 32))  # 4 blocks
        assert greedy.recv().outcome == "buffer"
        greedy.send(ReserveReq("g2", 8))
        g2 = greedy.recv()
        assert g2.outcome == "rejected" and "max_blocks_per_instance" in g2.reason
        assert dec.rx.stats["quota_refused"] == 1
        good_peer(dec, blocks=(5, 6))  # another instance is served
        greedy.close()
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_one_peers_batches_do_not_starve_anothers_reservation(no_leaks):
    """An authenticated peer sends hundreds of 512-item reservation batches; the control
    loop serves connections in turn, so a good peer's reservation is answered within its
    timeout."""
    dec = Decode(max_blocks_per_instance=16)
    ctx = zmq.Context()
    try:
        atk = RawSession(dec.rx.control_address, KVLayout(**BASE), instance="flood", ctx=ctx)
        for i in range(300):
            atk.send(ReserveBatch([(f"f{i}-{j}", 8) for j in range(512)]))
        lay, arr, spec = prefill_cache(1, 0)
        t0 = time.monotonic()
        with PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5, instance="good") as tx:
            tx.reserve("good", 16, timeout=5)
            waited = time.monotonic() - t0
        assert waited < 5, waited
        atk.close()
    finally:
        ctx.destroy(linger=0)
        dec.close()


def test_a_sender_that_closes_ends_its_session_at_once_and_is_not_called_dead(caplog, no_leaks):
    """The normal end of a session is a Bye, logged at info; the name and rank are free for
    the next sender of this process at once; decode's close tells its peers."""
    import logging

    dec = Decode()
    try:
        caplog.set_level(logging.INFO, logger="pdkv")
        good_peer(dec)
        assert not dec.rx._peers and dec.rx.stats["peers_dead"] == 0
        assert any("ended its session" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "dead" in r.getMessage()]
        good_peer(dec, rid="again", blocks=(2, 3))  # same instance name and rank, right away
        lay, arr, spec = prefill_cache(1, 0)
        tx = PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=30, instance="late")
        tx.reserve("late", 8)
        dec.rx.close()
        out = tx.wait_outcome("late", 3)  # told by decode's Bye, not after its 30 s timeout
        assert not out.ok and "decode" in out.reason, out
        tx.close()
    finally:
        dec.close()


def test_listening_beyond_loopback_without_a_secret_warns(caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="pdkv")
    dec = Decode(control="tcp://0.0.0.0:0")
    try:
        assert any("without a secret" in r.getMessage() for r in caplog.records)
    finally:
        dec.close()
    caplog.clear()
    dec = Decode(control="tcp://0.0.0.0:0", secret=SECRET)
    try:
        assert not any("without a secret" in r.getMessage() for r in caplog.records)
    finally:
        dec.close()


def _zmtp_greetings() -> list[bytes]:
    """Broken starts of a ZMTP connection: random bytes, and truncated or corrupt greetings
    (ZMTP 3: signature 0xFF, 8 bytes, 0x7F, version, mechanism, as-server, filler)."""
    full = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
    return [
        os.urandom(8192),
        os.urandom(64),
        full[:1],
        full[:10],
        full[:11],
        full[:40],
        full + os.urandom(512),  # a greeting, then no handshake but garbage
        full[:11] + b"\x09" + os.urandom(200),  # an unknown version
        b"\x01\x00" + os.urandom(300),  # ZMTP 1.0 framing, a frame of garbage
        b"\xff" * 9 + b"\x7f" + os.urandom(4000),
    ]


@pytest.mark.parametrize("rep", range(20))
def test_random_bytes_on_the_control_port_stop_no_session_and_no_handshake(rep, no_leaks):
    """8 KiB of random bytes (and truncated ZMTP greetings) sent to decode's control port by
    someone without the secret used to end decode's control loop (a receive error of that
    one connection was taken for the socket closing). Now a live session's heartbeats are
    answered in their normal time throughout, and a new handshake succeeds after."""
    dec = Decode(secret=SECRET)
    try:
        live = RawSession(dec.rx.control_address, KVLayout(**BASE), secret=SECRET, instance="live")
        host, port = dec.rx.control_address[len("tcp://") :].rsplit(":", 1)
        slowest = 0.0
        for junk in _zmtp_greetings():
            s = socket.create_connection((host, int(port)), timeout=2)
            with contextlib.suppress(OSError):
                s.sendall(junk)
            time.sleep(0.01)
            s.close()
            for _ in range(3):  # the live session's heartbeat, answered as always
                t0 = time.monotonic()
                live.send(Heartbeat(time.time()))
                assert isinstance(live.recv(timeout_ms=2000), Heartbeat)
                slowest = max(slowest, time.monotonic() - t0)
        assert slowest < 0.5, f"a heartbeat took {slowest:.3f} s"
        good_peer(dec, instance="after", secret=SECRET)  # a new handshake, a transfer, received
        live.close()
    finally:
        dec.close()


@pytest.mark.multiproc
def test_a_decode_resumed_after_a_freeze_serves_the_same_prefills_new_sender(no_leaks):
    """SIGSTOP decode past the sender's silence bound, SIGCONT: the sender gave up and
    closed, and a new sender of the same process and name is served at once (decode used to
    read the old session's queued heartbeats and refuse the rank as live), 20 times in a
    row; the new sender's transfer is received."""
    d, info = _spawn_decode("--timeout", "30")  # decode's own silence bound: far past each freeze
    try:
        lay, arr, spec = prefill_cache(1, 0)
        served = []
        for i in range(20):
            tx = PrefillSender(
                lay, spec, info["control"], transport="tcp", timeout_s=5, heartbeat_s=0.1, instance="frozen"
            )
            tx.timeout_s = 0.6  # its silence bound (the handshake above had 5 s)
            assert send_one(tx, f"before-{i}", [0, 1], timeout=5).ok
            os.kill(d.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 5
                while not tx._broken and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert tx._broken, "the sender did not give up on a frozen decode"
                tx.close()
            finally:
                os.kill(d.pid, signal.SIGCONT)
            t0 = time.monotonic()
            with PrefillSender(lay, spec, info["control"], transport="tcp", timeout_s=5, instance="frozen") as tx2:
                assert send_one(tx2, f"after-{i}", [2, 3], timeout=5).ok
            served.append(time.monotonic() - t0)
        assert max(served) < 2.0, f"slowest new sender served in {max(served):.2f} s"
    finally:
        _stop(d)


def test_a_refusal_fails_the_request_it_names_by_field_alone(no_leaks):
    """Decode refuses ``a:x`` (its id is live for another instance) while this sender's
    ``a`` is granted: ``a:x`` fails, ``a`` is received, byte for byte (the refusal used to
    be attributed by the text before its first ':', failing ``a``)."""
    dec = Decode()
    try:
        lay, arr, spec = prefill_cache(1, 0)
        with (
            PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5, instance="one") as other,
            PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", timeout_s=5, instance="two") as tx,
        ):
            other.reserve("a:x", 16)
            g = tx.reserve("a", 16)
            with pytest.raises(TransferError, match="a:x"):
                tx.reserve("a:x", 16)
            assert tx.poll_outcome("a") is None, "a refusal of a:x resolved a"
            for layer in range(4):
                tx.send_layer(layer, [("a", [0, 1])])
            tx.finish("a")
            out = tx.wait_outcome("a", 5)
            assert out.ok, out
            for layer in range(4):
                for t in range(2):
                    for gi in range(2):
                        want = expected_block([lay], [spec], [0, 1], dec.lays[0], layer, t, gi)
                        assert dec.block(0, layer, t, g.blocks[gi]) == want, "a's bytes differ"
    finally:
        dec.close()


@pytest.mark.multiproc
def test_a_flood_of_distinct_captured_hellos_keeps_no_good_peer_out(no_leaks):
    """A peer without the secret replays distinct captured Hellos (each one's nonce fresh,
    so each costs decode a handshake slot and a connection without a session) at 400 a
    second, each from a new connection (from 127.0.0.2: another host's address): every one
    of 20 good handshakes in a row is served. Decode drops the oldest handshakes and
    connections past its caps (the flood's own first, by max_pending_per_source); a good
    peer whose handshake was dropped is told "busy" (not "wrong secret"), or sees its
    connection closed, and says Hello again."""
    d, info = _spawn_decode("--secret", SECRET.hex(), "--timeout", "30")
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flood = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peers.py"), "hello-flood", "--control", info["control"]]
        + ["--secret", SECRET.hex(), "--rate", "400", "--source", "127.0.0.2"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        first = json.loads(flood.stdout.readline())  # the flood runs: 400 Hellos sent
        lay, arr, spec = prefill_cache(1, 0)
        retried = 0
        for i in range(20):
            with PrefillSender(
                lay, spec, info["control"], transport="tcp", timeout_s=5, instance="good", secret=SECRET
            ) as tx:
                retried += tx.stats.get("handshake_retries", 0)
                assert send_one(tx, f"good-{i}", [0, 1], timeout=5).ok
        assert flood.poll() is None, "the flood stopped"
        last = first
        for line in iter(flood.stdout.readline, ""):
            last = json.loads(line)
            break
        rate = (
            (last["sent"] - first["sent"]) / max(1e-9, last["seconds"] - first["seconds"]) if last is not first else 400
        )
        print(f"20 good handshakes under the flood ({rate:.0f} Hellos/s), {retried} retried")
        assert rate > 300, f"the flood ran at {rate:.0f} Hellos a second, not 400"
    finally:
        flood.kill()
        reap(flood)
        _stop(d)


def test_a_replaced_sender_is_told_at_once(no_leaks):
    """The same process proving the same instance key opens a new session for a rank whose
    session is live (a sender it gave up on): decode replaces the old one and says Bye on
    it, so the replaced sender stops at once, not when its silence bound runs out."""
    dec = Decode(secret=SECRET)
    try:
        key = os.urandom(32)
        lay, arr, spec = prefill_cache(1, 0)
        with PrefillSender(
            lay, spec, dec.rx.control_address, transport="tcp", secret=SECRET, timeout_s=30, instance="me",
            instance_key=key,
        ) as tx:  # fmt: skip
            assert send_one(tx, "first", [0, 1]).ok
            t0 = time.monotonic()
            from pdkv.transfer.sessions.identity import instance_key_of

            proven = instance_key_of("me", key)  # what the sender proves for that key
            again = RawSession(dec.rx.control_address, lay, secret=SECRET, instance="me", instance_key=proven)
            assert again.welcome is not None
            wait_until(lambda: tx.broken is not None, 3, "the replaced sender told")
            assert time.monotonic() - t0 < 3
            assert "replaced by a new session of the same process" in str(tx.broken), tx.broken
            again.close()
        good_peer(dec, secret=SECRET, blocks=(4, 5))
    finally:
        dec.close()


@pytest.mark.multiproc
def test_a_flood_of_authenticated_sessions_neither_keeps_a_silent_peer_alive_nor_delays_a_handshake(no_leaks):
    """250 authenticated sessions send batches of 512 reservations as fast as they can (each
    item costs decode work, so a round that served one message of every connection took
    over a second). Meanwhile a prefill holding a grant is frozen (SIGSTOP: silent from then
    on): decode declares it dead within its peer timeout, 3 s here (a busy round is not a
    stalled loop), and a good peer's handshake completes within 5 s (its request is then
    answered in its turn among the 250: served, or refused for room the flood holds)."""
    secret = os.urandom(32)
    # a lease far past the peer timeout: the frozen peer's request fails when decode finds it
    # silent, not when its lease runs out
    d, info = _spawn_decode("--timeout", "3", "--lease", "60", "--secret", secret.hex(), "--status")
    lay, arr, spec = prefill_cache(1, 0)  # the decode child's layout (peers.py)
    frozen, flooders = None, []
    try:
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        frozen = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "peers.py"), "prefill", "--control", info["control"], "--secret",
             secret.hex(), "--instance", "frozen", "--layer-sleep", "60", "--timeout", "30"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        for line in frozen.stdout:
            if '"layer": 0' in line:  # reserved, its first layer sent: it holds a grant
                break
        # the flood from a process of its own (its encoding must not share this one's GIL
        # with the good peer's sender)
        flood = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "peers.py"), "auth-flood", "--control", info["control"], "--secret",
             secret.hex(), "--requests", "250"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        flooders.append(flood)
        assert json.loads(flood.stdout.readline()) == {"sessions": 250}
        time.sleep(1.0)
        failed_before = None
        os.kill(frozen.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        died = None
        while time.monotonic() - t0 < 12:
            st = json.loads(d.stdout.readline())
            failed_before = st["failed"] if failed_before is None else failed_before
            if st["failed"] > failed_before:  # its request failed: the peer was declared dead
                died = time.monotonic() - t0
                break
        t1 = time.monotonic()
        with PrefillSender(
            lay, spec, info["control"], transport="tcp", secret=secret, timeout_s=30, instance="good"
        ) as tx:
            handshake = time.monotonic() - t1
            try:  # answered in its turn: served, or refused for room (the flood holds the buffer)
                answer = "ok" if send_one(tx, "good", [0, 1], timeout=30).ok else "failed"
            except TransferError as exc:
                answer = str(exc)
        served = time.monotonic() - t1
        assert answer == "ok" or "no free GPU or buffer blocks" in answer, answer
        print(f"silent peer declared dead after {died} s; good handshake {handshake:.2f} s, served {served:.2f} s")
        assert died is not None and died < 3 + 1.5, (
            f"the silent peer was still alive after {time.monotonic() - t0:.1f} s"
        )
        assert handshake < 5
    finally:
        for f in flooders:
            f.kill()
            f.wait(5)
            f.stdout.close()
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen.pid, signal.SIGCONT)
            frozen.kill()
            frozen.wait(5)
            frozen.stdout.close()
        _stop(d)
