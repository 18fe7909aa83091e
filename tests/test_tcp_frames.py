"""decode's checks of every tcp data frame (TcpReceiver._on_data_frame, _frame_segment,
_admit), one frame at a time and in one thread: the frame is handed to the check as the
connection's thread would hand it, from a socket pair the test fills, and the test sees
exactly what happened: accepted (its bytes where the grant says, counted, credited),
refused (its payload read and dropped, not a byte of any buffer changed, the reason
logged), or the connection ended (a malformed header, a session gone, a payload cut).

test_hostile.py sends such frames over real data connections; these pin each bound."""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hostile import RawSession
from test_transfer import BASE, Decode

from pdkv import KVLayout
from pdkv.errors import ClosedError, GrantViolation, PdkvTimeoutError, PeerError, ProtocolError
from pdkv.protocol import GrantMsg, ReserveReq
from pdkv.scheduling.lifecycle import State
from pdkv.transfer import FRAME_HEADER, FRAME_ITEM
from pdkv.transfer.transports import tcp as tcpmod
from pdkv.transfer.transports.sockets import _POLL_S, kernel_timeouts
from pdkv.transfer.transports.tcp import MAX_FRAME_ITEMS, MAX_FRAME_PAYLOAD

TB = 2048  # a tensor's block: 4 heads x 8 tokens x 32 x 2 bytes
ROW = dict(length=64, count=8, dstride=256)  # one head of a token-major block: 8 rows of 64 B, 256 B apart
SECRET = b"f" * 32


class Env:
    """One decode (512 buffer blocks) and sessions on it; each test reserves its own request."""

    def __init__(self, token_major: bool, **rx) -> None:
        rx.setdefault("peer_timeout_s", 120.0)  # the hand-driven sessions send no heartbeats
        self.dec = Decode(nb=512, token_major=token_major, transports=("tcp",), secret=SECRET, lease_s=30.0, **rx)
        self.tr = self.dec.rx._transports["tcp"]
        self.sessions: dict[str, RawSession] = {}
        self.n = 0

    def session(self, name: str, tp: tuple[int, int] = (0, 1)) -> RawSession:
        if name not in self.sessions:
            lay = KVLayout(**BASE, tp_size=tp[1], tp_rank=tp[0])
            self.sessions[name] = RawSession(self.dec.rx.control_address, lay, secret=SECRET, instance=name)
        return self.sessions[name]

    def ident(self, name: str) -> bytes:
        (p,) = [p for p in self.dec.rx._peers.values() if p.instance == name]
        return p.ident

    def reserve(self, name: str = "p1", tokens: int = 16, tp=(0, 1)):
        """A new request's grant, of consecutive blocks (multi-block items need them): a
        grant over the holes earlier tests left is kept aside and another one asked for."""
        s = self.session(name, tp)
        for _ in range(20):
            self.n += 1
            rid = f"r{self.n}"
            s.send(ReserveReq(rid, tokens))
            g = s.recv()
            while not isinstance(g, GrantMsg):  # the outcomes of requests ended earlier
                g = s.recv()
            assert g.request_id == rid and g.outcome == "buffer", g
            if list(g.blocks) == list(range(g.blocks[0], g.blocks[0] + len(g.blocks))):
                return rid, g
        raise AssertionError("no grant of consecutive blocks")

    def close(self):
        for s in self.sessions.values():
            s.close()
        self.dec.close()


@pytest.fixture(scope="module")
def head():
    e = Env(token_major=False)
    yield e
    e.close()


@pytest.fixture(scope="module")
def tok():
    e = Env(token_major=True)
    yield e
    e.close()


def push(env, name, token, items, *, payload=None, cut=False, eof=False, between=None, trickle=None, **h):
    """Hand one frame to the check; returns (exception or None, counter deltas, bytes left
    unread on the connection)."""
    f = dict(magic=b"PDKV", ver=1, kind=2, rank=0, layer=0, tensor=0, off=0, length=TB, count=1, dstride=0)
    f.update(h)
    nitems = f.pop("nitems", len(items))
    hdr = bytearray(
        FRAME_HEADER.pack(
            f["magic"],
            f["ver"],
            f["kind"],
            f["rank"],
            token,
            f["layer"],
            f["tensor"],
            0,
            0,
            nitems,
            f["off"],
            f["length"],
            f["count"],
            f["dstride"],
        )
    )
    if payload is None:
        payload = bytes([0x5A]) * (sum(nb for _, nb in items) * f["count"] * f["length"])
    data = b"".join(FRAME_ITEM.pack(gi, nb) for gi, nb in items) + payload
    a, b = socket.socketpair()
    kernel_timeouts(a, _POLL_S, _POLL_S)  # as the listener sets it

    def feed():
        try:
            if trickle is not None:  # (bytes, seconds): that many bytes at a time, that often
                step, every = trickle
                for i in range(0, len(data), step):
                    b.sendall(data[i : i + step])
                    time.sleep(every)
                return
            if between is not None:  # half the frame, then the test's step, then the rest
                b.sendall(data[: len(data) // 2])
                time.sleep(0.1)
                if between() == "cut":  # the connection ends mid-payload
                    b.shutdown(socket.SHUT_WR)
                    return
                b.sendall(data[len(data) // 2 :])
                return
            b.sendall(data[: len(data) // 2] if cut else data)
            if cut or eof:
                b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    t = threading.Thread(target=feed)
    t.start()
    keys = ("frames", "frames_rejected", "frames_cut", "bytes")
    before = {k: env.dec.rx.stats.get(k, 0) for k in keys}
    exc = None
    try:
        env.tr._on_data_frame(a, env.ident(name), hdr, bytearray(1 << 20))
    except Exception as e:  # what ends the connection
        exc = e
        c: BaseException | None = e
        while c is not None:  # its frames hold views of decode's buffer: let them go
            c.__traceback__ = None
            c = c.__context__
    left = 0
    if exc is not None:  # the connection ends here: a feeder still trickling stops
        a.shutdown(socket.SHUT_RDWR)
    t.join(10)
    if exc is None:
        a.setblocking(False)
        try:
            left = len(a.recv(1 << 30))
        except BlockingIOError:
            pass
    a.close()
    b.close()
    return exc, {k: env.dec.rx.stats.get(k, 0) - before[k] for k in keys}, left


def buffers(env):
    return bytes(env.dec.bufs[0].buf)


def refused(env, name, token, items, caplog, why, **h):
    """The frame is refused: payload drained, nothing written, the reason logged."""
    before = buffers(env)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=tcpmod.__name__):
        exc, d, left = push(env, name, token, items, **h)
    assert exc is None and left == 0
    assert d == {"frames": 0, "frames_rejected": 1, "frames_cut": 0, "bytes": 0}
    assert buffers(env) == before
    msgs = [r.getMessage() for r in caplog.records if r.name == tcpmod.__name__]
    assert len(msgs) == 1 and msgs[0].endswith(f"refused: {why}"), msgs


def accepted(env, name, token, items, **h):
    exc, d, left = push(env, name, token, items, **h)
    assert exc is None and left == 0, exc
    length, count = h.get("length", TB), h.get("count", 1)
    assert d == {
        "frames": 1,
        "frames_rejected": 0,
        "frames_cut": 0,
        "bytes": sum(nb for _, nb in items) * length * count,
    }


# ------------------------------------------------------------------ the header


@pytest.mark.parametrize("field,value", [("magic", b"PDKX"), ("ver", 2), ("ver", 0), ("kind", 1), ("kind", 3)])
def test_a_bad_header_ends_the_connection(head, field, value):
    rid, g = head.reserve()
    exc, d, _ = push(head, "p1", g.token, [(0, 1)], **{field: value})
    assert isinstance(exc, ProtocolError) and str(exc) == "bad frame header"
    assert d["frames_rejected"] == 0


@pytest.mark.parametrize(
    "h",
    [dict(nitems=0), dict(nitems=MAX_FRAME_ITEMS + 1), dict(count=0), dict(length=0)],
)
def test_a_malformed_frame_ends_the_connection(head, h):
    rid, g = head.reserve()
    exc, _, _ = push(head, "p1", g.token, [(0, 1)], payload=b"", **h)
    f = {"nitems": 1, "count": 1, "length": TB, **h}
    assert isinstance(exc, ProtocolError)
    assert str(exc) == f"frame with {f['nitems']} items, count {f['count']}, length {f['length']} is malformed"


def test_the_most_items_a_frame_may_have_are_read(head, caplog):
    rid, g = head.reserve()
    refused(
        head, "p1", g.token, [(0, 1)] * MAX_FRAME_ITEMS, caplog, f"request {rid!r}: blocks of layer 0 written twice"
    )


def test_a_payload_out_of_bounds_ends_the_connection(head):
    rid, g = head.reserve()
    exc, _, _ = push(head, "p1", g.token, [(0, 0)], payload=b"")
    assert isinstance(exc, ProtocolError) and str(exc) == "frame payload of 0 bytes is out of bounds"
    over = MAX_FRAME_PAYLOAD // TB + 1
    exc, _, _ = push(head, "p1", g.token, [(0, over)], payload=b"")
    assert isinstance(exc, ProtocolError)
    assert str(exc) == f"frame payload of {over * TB} bytes is out of bounds"


def test_a_payload_of_the_largest_size_is_read_whole_when_refused(head, caplog):
    rid, g = head.reserve()
    n = MAX_FRAME_PAYLOAD // TB
    refused(head, "p1", g.token, [(0, n)], caplog, "write outside the granted blocks")


# ------------------------------------------------------------------ whose grant, which rank


def test_a_frame_of_a_session_that_ended_ends_the_connection(head):
    rid, g = head.reserve()
    a, b = socket.socketpair()
    a.settimeout(0.5)
    try:
        b.sendall(FRAME_ITEM.pack(0, 1) + b"\0" * TB)
        hdr = bytearray(FRAME_HEADER.pack(b"PDKV", 1, 2, 0, g.token, 0, 0, 0, 0, 1, 0, TB, 1, 0))
        with pytest.raises(ClosedError, match="^the peer's session ended$"):
            head.tr._on_data_frame(a, b"no-such-session", hdr, bytearray(1 << 20))
    finally:
        a.close()
        b.close()
    assert head.dec.sched.request(rid).state is State.RESERVED


def test_unknown_grant_rank_and_another_sessions_grant_are_refused(head, caplog):
    rid, g = head.reserve()
    refused(head, "p1", g.token ^ 1, [(0, 1)], caplog, "frame for an unknown grant or a rank not hosted here")
    refused(head, "p1", g.token, [(0, 1)], caplog, "frame for an unknown grant or a rank not hosted here", rank=1)
    head.session("other")
    refused(head, "other", g.token, [(0, 1)], caplog, f"frame for request {rid!r}, whose grant is not this session's")
    accepted(head, "p1", g.token, [(0, 1)])


def test_a_grant_of_gpu_blocks_is_refused(head, caplog):
    rid, g = head.reserve()
    inf = head.dec.rx.inflight_of_token(g.token)
    inf.location = "gpu"
    try:
        refused(head, "p1", g.token, [(0, 1)], caplog, "frame for a grant of GPU blocks (only cuda_ipc writes those)")
    finally:
        inf.location = "buffer"


@pytest.mark.parametrize("h", [dict(layer=4), dict(tensor=2), dict(layer=1 << 20)])
def test_layer_and_tensor_out_of_range_are_refused(head, caplog, h):
    rid, g = head.reserve()
    refused(head, "p1", g.token, [(0, 1)], caplog, "layer or tensor out of range", **h)


def test_the_last_layer_and_tensor_are_accepted(head):
    rid, g = head.reserve()
    accepted(head, "p1", g.token, [(0, 1)], layer=3, tensor=1)


# ------------------------------------------------------------------ geometry


@pytest.mark.parametrize(
    "h",
    [dict(off=1), dict(length=TB + 1), dict(off=TB - 63, length=64)],
)
def test_a_piece_past_the_block_is_refused(head, caplog, h):
    rid, g = head.reserve()
    refused(head, "p1", g.token, [(0, 1)], caplog, "write outside the granted blocks", **h)


def test_a_piece_that_is_not_the_ranks_segment_is_refused(head, caplog):
    rid, g = head.reserve()
    refused(
        head,
        "p1",
        g.token,
        [(0, 1)],
        caplog,
        "frame geometry (rank 0, tensor 0, offset 0, 1 x 1024 B) is not one of prefill rank 0's segments",
        length=1024,
    )


def test_strided_pieces_at_the_edge_of_the_block(tok, caplog):
    """Token-major decode, head-major prefill: each head's rows, 8 x 64 B every 256 B."""
    rid, g = tok.reserve()
    last = dict(off=192, **ROW)  # ends exactly at the block's end
    accepted(tok, "p1", g.token, [(0, 1)], **last)
    refused(tok, "p1", g.token, [(1, 1)], caplog, "write outside the granted blocks", **{**last, "off": 193})
    refused(tok, "p1", g.token, [(1, 1)], caplog, "write outside the granted blocks", **{**last, "dstride": 257})
    refused(  # rows overlapping each other
        tok, "p1", g.token, [(1, 1)], caplog, "write outside the granted blocks", off=0, length=64, count=8, dstride=63
    )
    for geometry, h in [
        ("(rank 0, tensor 0, offset 0, 8 x 64 B)", dict(off=0, length=64, count=8, dstride=128)),
        ("(rank 0, tensor 0, offset 32, 8 x 64 B)", dict(off=32, **ROW)),
        ("(rank 0, tensor 0, offset 0, 7 x 64 B)", dict(off=0, length=64, count=7, dstride=256)),
        ("(rank 0, tensor 0, offset 0, 8 x 32 B)", dict(off=0, length=32, count=8, dstride=256)),
    ]:
        refused(
            tok,
            "p1",
            g.token,
            [(1, 1)],
            caplog,
            f"frame geometry {geometry} is not one of prefill rank 0's segments",
            **h,
        )
    accepted(tok, "p1", g.token, [(1, 1)], off=64, **ROW)
    # the same piece again: written twice
    refused(
        tok,
        "p1",
        g.token,
        [(1, 1)],
        caplog,
        f"request {rid!r}: blocks of layer 0 written twice",
        off=64,
        **ROW,
    )


def test_a_rank_writes_only_its_own_heads(tok, caplog):
    """Prefill rank 0 of 2 holds heads 0-1: the rows of head 2 are not its segment."""
    rid, g = tok.reserve("p2", tp=(0, 2))
    accepted(tok, "p2", g.token, [(0, 1)], off=64, **ROW)
    refused(
        tok,
        "p2",
        g.token,
        [(0, 1)],
        caplog,
        "frame geometry (rank 0, tensor 0, offset 128, 8 x 64 B) is not one of prefill rank 0's segments",
        off=128,
        **ROW,
    )


def test_the_strided_bytes_land_in_their_rows(tok):
    rid, g = tok.reserve()
    rows = bytes(range(64)) * 8
    accepted(tok, "p1", g.token, [(1, 1)], off=0, **ROW, payload=rows)
    blk = np.frombuffer(tok.dec.block(0, 0, 0, g.blocks[1]), np.uint8).reshape(8, 256)
    assert (blk[:, :64] == np.arange(64, dtype=np.uint8)).all()


# ------------------------------------------------------------------ items


def test_items_inside_and_outside_the_grant(head, caplog):
    rid, g = head.reserve(tokens=24)  # three blocks
    refused(head, "p1", g.token, [(3, 1)], caplog, "write outside the granted blocks")
    refused(head, "p1", g.token, [(2, 2)], caplog, "write outside the granted blocks")
    refused(head, "p1", g.token, [(0, 1), (1, 0)], caplog, "write outside the granted blocks")
    accepted(head, "p1", g.token, [(2, 1)])
    assert head.dec.block(0, 0, 0, g.blocks[2]) == b"\x5a" * TB


def test_a_block_twice_in_one_frame_is_refused_and_marks_nothing(head, caplog):
    """Two items naming one block would count its bytes twice toward the layer: refused, and
    none of the frame's blocks is marked written (the next frame of them is accepted)."""
    rid, g = head.reserve()
    refused(head, "p1", g.token, [(0, 1), (1, 1), (0, 1)], caplog, f"request {rid!r}: blocks of layer 0 written twice")
    refused(head, "p1", g.token, [(0, 2), (1, 1)], caplog, f"request {rid!r}: blocks of layer 0 written twice")
    accepted(head, "p1", g.token, [(0, 1), (1, 1)])


def test_a_refused_frame_marks_none_of_its_blocks(head, caplog):
    rid, g = head.reserve(tokens=24)
    accepted(head, "p1", g.token, [(1, 1)])
    refused(head, "p1", g.token, [(0, 1), (1, 1)], caplog, f"request {rid!r}: blocks of layer 0 written twice")
    accepted(head, "p1", g.token, [(0, 1), (2, 1)])
    accepted(head, "p1", g.token, [(0, 3)], layer=1)


def test_multi_block_items_need_whole_contiguous_blocks(head, caplog):
    rid, g = head.reserve(tokens=24)
    inf = head.dec.rx.inflight_of_token(g.token)
    assert inf.run_len == [3, 2, 1]
    msg = "multi-block item over non-contiguous destination blocks"
    inf.run_len = [1, 2, 1]  # as if block 0 and 1 were apart
    try:
        refused(head, "p1", g.token, [(0, 2)], caplog, msg)
    finally:
        inf.run_len = [3, 2, 1]
    accepted(head, "p1", g.token, [(1, 2)])
    src = np.frombuffer(b"\x01" * TB + b"\x02" * TB + b"\x03" * TB, np.uint8)
    accepted(head, "p1", g.token, [(0, 3)], layer=2, payload=src.tobytes())
    for i, b in enumerate(g.blocks):
        assert head.dec.block(0, 2, 0, b) == bytes([i + 1]) * TB


def test_multi_block_items_of_strided_pieces_are_refused(tok, caplog):
    rid, g = tok.reserve()
    refused(
        tok,
        "p1",
        g.token,
        [(0, 2)],
        caplog,
        "multi-block item over non-contiguous destination blocks",
        off=0,
        **ROW,
    )


# ------------------------------------------------------------------ the grant's life


def test_a_frame_for_an_ended_grant_is_refused(head, caplog):
    rid, g = head.reserve()
    head.dec.sched.abort(rid, "operator")
    exc, d, left = push(head, "p1", g.token, [(0, 1)])
    assert exc is None and left == 0 and d["frames_rejected"] == 1 and d["frames"] == 0


def test_a_payload_cut_mid_frame_fails_the_request(head):
    rid, g = head.reserve()
    exc, d, _ = push(head, "p1", g.token, [(0, 2)], cut=True)
    assert isinstance(exc, PeerError) and str(exc) == "connection closed mid-frame"
    assert d == {"frames": 0, "frames_rejected": 0, "frames_cut": 1, "bytes": 0}
    info = head.dec.sched.request(rid)
    assert info.state is State.FAILED and info.reason.startswith("tcp data frame failed mid-payload: ")


def test_a_whole_request_lands_and_is_credited(head):
    rid, g = head.reserve()
    for layer in range(4):
        for t in range(2):
            accepted(head, "p1", g.token, [(0, 2)], layer=layer, tensor=t)
    inf = head.dec.rx.inflight_of_token(g.token)
    assert inf is not None and inf.remaining == [0, 0, 0, 0]  # every layer's bytes, once
    assert head.dec.sched.request(rid).layers_landed == 4


def test_frame_segment_names_the_first_matching_segment(tok):
    tok.session("p1")
    peer = tok.dec.rx._peers[tok.ident("p1")]
    segs = peer.segs_by_src[0]
    for si, s in enumerate(segs):
        assert tok.tr._frame_segment(peer, 0, s.tensor, s.dst_offset, s.length, s.count, s.dst_stride) == si
    with pytest.raises(GrantViolation):
        tok.tr._frame_segment(peer, 1, 0, 0, 64, 8, 256)  # another decode rank


@pytest.fixture(scope="module")
def slow():
    """io_timeout_s 0.3 s and 10 KiB/s the least rate: a 2 KiB piece must land within 0.5 s."""
    e = Env(token_major=False, io_timeout_s=0.3, min_data_rate=10240)
    yield e
    e.close()


def test_a_count_of_one_ignores_the_stride(head):
    rid, g = head.reserve()
    accepted(head, "p1", g.token, [(0, 1)], dstride=999)


def test_adjacent_rows_are_not_a_segment(tok, caplog):
    rid, g = tok.reserve()
    refused(
        tok,
        "p1",
        g.token,
        [(0, 1)],
        caplog,
        "frame geometry (rank 0, tensor 0, offset 0, 8 x 64 B) is not one of prefill rank 0's segments",
        off=0,
        length=64,
        count=8,
        dstride=64,
    )


def test_half_blocks_of_a_tp_rank_land_at_their_offset_and_are_never_multi_block(head, caplog):
    """Prefill TP 2 into a head-major decode: rank 1 writes the second half of each tensor
    block (offset 1024, 1024 B, one piece): its bytes land there; a multi-block item of such
    pieces is refused even over consecutive blocks."""
    rid, g = head.reserve("q1", tp=(1, 2))
    refused(
        head,
        "q1",
        g.token,
        [(0, 2)],
        caplog,
        "multi-block item over non-contiguous destination blocks",
        off=1024,
        length=1024,
    )
    accepted(head, "q1", g.token, [(1, 1)], off=1024, length=1024, payload=bytes(range(256)) * 4)
    blk = head.dec.block(0, 0, 0, g.blocks[1])
    assert blk[1024:] == bytes(range(256)) * 4 and blk[:1024] == bytes(1024)


def test_strided_rows_at_an_offset_land_in_their_rows(tok):
    rid, g = tok.reserve()
    rows = bytes(range(64)) * 8
    accepted(tok, "p1", g.token, [(0, 1)], off=128, **ROW, payload=rows)
    blk = np.frombuffer(tok.dec.block(0, 0, 0, g.blocks[0]), np.uint8).reshape(8, 256)
    assert (blk[:, 128:192] == np.arange(64, dtype=np.uint8)).all() and not blk[:, :128].any()


def test_frame_segment_of_a_peer_with_no_segments_is_a_violation(tok):
    peer = SimpleNamespace(tp_rank=3, segs_by_src={0: []})
    with pytest.raises(GrantViolation, match="is not one of prefill rank 3's segments"):
        tok.tr._frame_segment(peer, 0, 0, 0, 64, 8, 256)


def test_frames_read_one_after_another_until_the_connection_ends(head):
    rid, g = head.reserve()
    a, b = socket.socketpair()
    kernel_timeouts(a, _POLL_S, _POLL_S)
    try:
        for gi in (0, 1):
            b.sendall(
                FRAME_HEADER.pack(b"PDKV", 1, 2, 0, g.token, 0, 0, 0, 0, 1, 0, TB, 1, 0)
                + FRAME_ITEM.pack(gi, 1)
                + bytes([gi + 1]) * TB
            )
        b.shutdown(socket.SHUT_WR)
        before = head.dec.rx.stats["frames"]
        head.tr._frames(a, head.ident("p1"))  # returns at the clean end
        assert head.dec.rx.stats["frames"] == before + 2
        assert head.dec.block(0, 0, 0, g.blocks[1]) == b"\x02" * TB
    finally:
        a.close()
        b.close()


def test_frames_of_a_session_that_ended_end_the_connection(head):
    a, b = socket.socketpair()
    kernel_timeouts(a, _POLL_S, _POLL_S)
    try:
        b.sendall(FRAME_HEADER.pack(b"PDKV", 1, 2, 0, 1, 0, 0, 0, 0, 1, 0, TB, 1, 0))
        with pytest.raises(ClosedError, match="^the peer's session ended$"):
            head.tr._frames(a, b"gone")
    finally:
        a.close()
        b.close()


def test_fence_and_close_reach_the_listener(head, monkeypatch):
    seen = []
    monkeypatch.setattr(head.tr.data, "close_conns_of", lambda ident: seen.append(("fence", ident)))
    monkeypatch.setattr(head.tr.data, "close", lambda timeout: seen.append(("close", timeout)))
    peer = SimpleNamespace(ident=b"x")
    head.tr.fence(peer)
    head.tr.close(2.5)
    assert seen == [("fence", b"x"), ("close", 2.5)]


def test_a_connection_that_ends_after_the_header_is_a_peer_error(head):
    rid, g = head.reserve()
    exc, d, _ = push(head, "p1", g.token, [], payload=b"", nitems=1, eof=True)
    assert isinstance(exc, PeerError) and str(exc) == "connection closed mid-frame"


def test_a_refused_frame_whose_payload_never_comes_is_a_peer_error(head):
    rid, g = head.reserve()
    exc, d, _ = push(head, "p1", g.token ^ 1, [(0, 1)], payload=b"", eof=True)
    assert isinstance(exc, PeerError) and str(exc) == "connection closed mid-frame"
    assert d["frames_rejected"] == 1


def test_items_trickled_past_io_timeout_end_the_connection(slow):
    rid, g = slow.reserve()
    t0 = time.monotonic()
    exc, d, _ = push(slow, "p1", g.token, [(0, 1)] * 64, payload=b"", trickle=(16, 0.05))
    assert isinstance(exc, PdkvTimeoutError) and str(exc) == "frame not received within its deadline"
    assert time.monotonic() - t0 < 2.5


def test_a_refused_payload_trickled_past_its_deadline_ends_the_connection(slow):
    rid, g = slow.reserve()
    exc, d, _ = push(slow, "p1", g.token ^ 1, [(0, 1)], trickle=(64, 0.05))
    assert isinstance(exc, PdkvTimeoutError) and str(exc) == "frame not received within its deadline"
    assert d["frames_rejected"] == 1


def test_an_admitted_payload_trickled_past_its_deadline_fails_the_request(slow):
    """0.3 s + 2 KiB at 10 KiB/s: the piece must land within 0.5 s; 64 B every 50 ms takes
    1.6 s: the request fails, its blocks written by nobody else meanwhile."""
    rid, g = slow.reserve()
    exc, d, _ = push(slow, "p1", g.token, [(0, 1)], trickle=(64, 0.05))
    assert isinstance(exc, PdkvTimeoutError)
    assert d["frames_cut"] == 1 and d["frames"] == 0
    info = slow.dec.sched.request(rid)
    assert info.state is State.FAILED and info.reason.startswith("tcp data frame failed mid-payload: ")


def test_a_request_that_ends_while_its_frame_lands_is_not_credited(head):
    """Aborted while the payload is on its way: the frame's bytes land in blocks still held
    by the write (never reused under it), the write ends, and the landed bytes count for
    nothing (refused at credit)."""
    rid, g = head.reserve()
    exc, d, left = push(head, "p1", g.token, [(0, 1)], between=lambda: head.dec.sched.abort(rid, "client gone"))
    assert exc is None and left == 0
    assert d == {"frames": 1, "frames_rejected": 1, "frames_cut": 0, "bytes": TB}
    assert head.dec.sched.request(rid).state is State.ABORTED


def test_a_cut_frame_of_a_request_that_already_ended_keeps_the_connections_error(head):
    rid, g = head.reserve()

    def abort_then_cut():
        head.dec.sched.abort(rid, "client gone")
        return "cut"

    exc, d, _ = push(head, "p1", g.token, [(0, 2)], between=abort_then_cut)
    assert isinstance(exc, PeerError) and str(exc) == "connection closed mid-frame"
    assert d["frames_cut"] == 1


# ------------------------------------------------------------------ the socket's mode


class _CountingSocket(socket.socket):
    """A socket that counts its scatter receives."""

    calls = 0

    def recvmsg_into(self, *args):
        type(self).calls += 1
        return super().recvmsg_into(*args)


def test_a_payload_sent_in_pieces_lands_in_one_receive(head):
    """The listener's mode (blocking, the kernel bounding each call): a 4 MiB payload that
    arrives in 16 pieces 10 ms apart is one ``recvmsg_into``, not one a piece."""
    a0, b = socket.socketpair()
    a = _CountingSocket(fileno=a0.detach())
    kernel_timeouts(a, _POLL_S, _POLL_S)
    data = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    dst = bytearray(len(data))
    views = [memoryview(dst)[i << 20 : (i + 1) << 20] for i in range(4)]

    def feed():
        for i in range(16):
            b.sendall(data[i << 18 : (i + 1) << 18])
            time.sleep(0.01)

    t = threading.Thread(target=feed)
    _CountingSocket.calls = 0
    try:
        t.start()
        head.tr.data.recv_views(a, views, time.monotonic() + 10)
        t.join()
        assert _CountingSocket.calls == 1
        assert bytes(dst) == data
    finally:
        a.close()
        b.close()


def test_a_payload_that_stops_mid_frame_times_out_after_io_timeout(slow):
    """Half the payload, then silence: each bounded receive returns empty-handed, and after
    io_timeout_s (0.3 s) of that the frame fails by name, long before its deadline."""
    a, b = socket.socketpair()
    kernel_timeouts(a, _POLL_S, _POLL_S)
    half = 32 << 10  # fits the socket pair's buffer: sent before anything reads it
    dst = bytearray(2 * half)
    try:
        b.sendall(b"\x01" * half)
        t0 = time.monotonic()
        with pytest.raises(PdkvTimeoutError, match=r"^peer stalled for 0\.3s mid-frame$"):
            slow.tr.data.recv_views(a, [memoryview(dst)], time.monotonic() + 30)
        assert 0.25 <= time.monotonic() - t0 < 2.0
        assert dst[:half] == b"\x01" * half and dst[half:] == bytes(half)
    finally:
        a.close()
        b.close()


def test_a_kept_record_of_a_refused_frame_holds_no_view_of_the_buffer(caplog):
    """A log capture keeps its records past the connection's thread (a test's caplog, a
    queue handler): the record of a refused frame must not keep the frame's views of
    decode's buffer alive, or the buffer cannot close (BusyError) while it is kept."""
    env = Env(token_major=False)
    try:
        rid, g = env.reserve()
        accepted(env, "p1", g.token, [(0, 1)])
        # refused once the frame's views of the buffer are made (a piece written twice)
        refused(env, "p1", g.token, [(0, 1)], caplog, f"request {rid!r}: blocks of layer 0 written twice")
        kept = list(caplog.records)
        assert kept
    finally:
        env.close()  # raises BusyError if a kept record holds a view


def test_a_kept_record_of_a_failed_connection_holds_no_view_of_the_buffer(caplog):
    """A connection's handler that fails unexpectedly (a bug) is logged with its traceback;
    a record kept past the connection must not keep the failing frame's views of decode's
    buffer alive (the buffer would not close: BusyError)."""
    env = Env(token_major=False)
    try:
        server = env.tr.data
        buf = env.dec.bufs[0].buf

        def failing(conn, ident):
            held = memoryview(buf)[:64]  # noqa: F841 (the frame's view, as a real handler's)
            raise RuntimeError("a bug in the handler")

        a, b = socket.socketpair()
        b.close()
        with caplog.at_level(logging.ERROR, logger="pdkv.transfer.transports.sockets"):
            real, server.handler = server.handler, failing
            try:
                server._serve(a, b"x")
            finally:
                server.handler = real
        kept = [r for r in caplog.records if "data connection handling failed" in r.getMessage()]
        assert len(kept) == 1 and "RuntimeError: a bug in the handler" in kept[0].getMessage()
    finally:
        env.close()  # raises BusyError if a kept record holds a view
