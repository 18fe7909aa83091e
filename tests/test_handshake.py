"""The session handshake (transfer/handshake.py) on both sides, in one process and fast:
decode's answers to every Hello and Auth it must refuse, each refusal's exact words, what a
session it accepts is made of; and prefill's side against a scripted decode (a ROUTER
socket) that answers out of order, refuses, goes silent or names a transport never offered.

test_hostile.py attacks the same code with sessions over time (floods, replays, data
connections); these tests pin each decision."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import zmq
from hostile import RawSession
from test_transfer import BASE, Decode

from pdkv import CacheSpec, KVLayout, PrefillSender
from pdkv.errors import PdkvTimeoutError, PeerError, ProtocolError
from pdkv.procs import boot_id
from pdkv.protocol import (
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Codec,
    ErrorMsg,
    Hello,
    Welcome,
    is_unauthenticated,
    layout_desc,
    mask_instance_key,
    new_nonce,
)
from pdkv.transfer import handshake
from pdkv.transfer.identity import instance_key_of, key_fingerprint

SECRET = b"k" * 32


class Raw:
    """One DEALER connection sending hand-made Hellos."""

    def __init__(self, dec: Decode, secret: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(dec.rx.control_address)
        self.codec = Codec(secret)

    def hello(self, lay: KVLayout, *, transports=("tcp",), instance="p", tp=None, boot=None, nonce=None) -> bytes:
        nonce = nonce or new_nonce()
        rank, size = tp if tp is not None else (lay.tp_rank, lay.tp_size)
        h = Hello(
            PROTOCOL_VERSION,
            instance,
            rank,
            size,
            layout_desc(lay),
            list(transports),
            boot or boot_id(),
            os.getpid(),
            nonce,
        )
        self.sock.send_multipart(self.codec.encode(h))
        return nonce

    def recv(self):
        assert self.sock.poll(5000), "decode did not answer"
        frames = self.sock.recv_multipart()
        if is_unauthenticated(frames):
            return Codec(None).decode(frames)
        return self.codec.decode(frames)

    def refusal(self) -> str:
        m = self.recv()
        assert isinstance(m, ErrorMsg) and m.code == "refused", m
        return m.message

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def dec():
    d = Decode(transports=("tcp", "shm"), secret=SECRET)
    yield d
    d.close()


@pytest.fixture
def raw(dec):
    r = Raw(dec, SECRET)
    yield r
    r.close()


LAY = KVLayout(**BASE)


def test_a_layout_decode_cannot_pair_with_is_refused_with_its_reason(dec, raw):
    other = KVLayout(**{**BASE, "head_dim": 64})
    raw.hello(other)
    why = raw.refusal()
    with pytest.raises(Exception) as exc:
        other.check_compatible(LAY)
    assert why == str(exc.value)
    assert dec.rx._pending == {}


@pytest.mark.parametrize("tp", [(0, 2), (1, 2)])  # (1, 1): the codec refuses it first
def test_a_hello_whose_rank_is_not_its_layouts_is_refused(dec, raw, tp):
    raw.hello(LAY, tp=tp)
    assert raw.refusal() == f"hello says rank {tp[0]}/{tp[1]}, layout says 0/1"


def test_a_replayed_nonce_is_refused_and_counted(dec, raw):
    n = raw.hello(LAY)
    assert isinstance(raw.recv(), Challenge)
    before = dec.rx.stats["auth_failed"]
    raw.hello(LAY, nonce=n)
    assert raw.refusal() == "hello replayed (its nonce was seen already)"
    assert dec.rx.stats["auth_failed"] == before + 1


@pytest.mark.parametrize(
    "offer,boot,chosen,why",
    [
        (("tcp",), None, "tcp", None),
        (("shm", "tcp"), None, "shm", None),  # the first offered that decode serves
        (("tcp", "shm"), None, "tcp", None),
        (("rdma", "tcp"), None, "tcp", None),  # not served here: skipped silently
        (("shm", "tcp"), "another-host", "tcp", None),
        (("shm",), "another-host", None, " (shm needs the same host)"),
        (("rdma",), None, None, ""),
        ((), None, None, ""),
    ],
)
def test_the_first_offered_transport_decode_serves_for_this_peer_is_chosen(dec, raw, offer, boot, chosen, why):
    raw.hello(LAY, transports=offer, boot=boot)
    if chosen is None:
        assert raw.refusal() == (
            f"no common transport: prefill offers {list(offer)}, decode serves ['tcp', 'shm']" + why
        )
        assert dec.rx._pending == {}
        return
    assert isinstance(raw.recv(), Challenge)
    (hs,) = dec.rx._pending.values()
    assert hs.transport == chosen and hs.same_host is (boot is None)


def test_a_hello_again_on_one_connection_replaces_the_first(dec, raw):
    raw.hello(LAY)
    raw.hello(LAY)
    first, second = raw.recv(), raw.recv()
    assert isinstance(first, Challenge) and isinstance(second, Challenge)
    assert len(dec.rx._pending) == 1
    (hs,) = dec.rx._pending.values()
    assert hs.nonce == second.nonce


def test_past_max_handshakes_the_oldest_gives_way():
    d = Decode(max_handshakes=3, secret=SECRET)
    raws = [Raw(d, SECRET) for _ in range(5)]
    try:
        before = d.rx.stats["connections_refused"]
        for i, r in enumerate(raws):
            r.hello(LAY, instance=f"h{i}")
            assert isinstance(r.recv(), Challenge)
            assert len(d.rx._pending) == min(i + 1, 3)
        assert d.rx.stats["connections_refused"] == before + 2
        assert sorted(hs.hello.instance for hs in d.rx._pending.values()) == ["h2", "h3", "h4"]
    finally:
        for r in raws:
            r.close()
        d.close()


def _session(dec, lay=LAY, **kw):
    return RawSession(dec.rx.control_address, lay, refusable=True, secret=SECRET, **kw)


def test_an_accepted_session_is_what_its_hello_and_key_say(dec):
    key = os.urandom(32)
    s = _session(dec, instance="pf", instance_key=key, transports=("shm", "tcp"))
    try:
        w = s.welcome
        assert isinstance(w, Welcome) and s.refusal is None
        assert (w.version, w.instance, w.tp_size, list(w.ranks), w.transport) == (
            PROTOCOL_VERSION,
            dec.rx.instance,
            1,
            [0],
            "shm",
        )
        assert w.buffer_blocks == dec.nb and len(w.shm_names) == 1 and w.data_addr == ""
        assert len(w.session_id) == 16
        (peer,) = dec.rx._peers.values()
        assert (peer.instance, peer.tp_rank, peer.tp_size, peer.pid, peer.same_host, peer.transport) == (
            "pf",
            0,
            1,
            os.getpid(),
            True,
            "shm",
        )
        assert peer.session_id == w.session_id and dec.rx._sessions[w.session_id] == peer.ident
        assert peer.key_fp == key_fingerprint(key)
        assert peer.block_bytes_by_src == {0: LAY.layer_block_bytes}
        assert [g.src_rank for g in peer.segs_by_src[0]] == [0] * len(peer.segs_by_src[0])
        assert dec.rx._pending == {}
    finally:
        s.close()


def test_a_tcp_session_is_welcomed_with_the_data_address(dec):
    s = _session(dec, transports=("tcp",))
    try:
        assert s.welcome.transport == "tcp" and s.welcome.data_addr == dec.rx.data_address
        assert s.welcome.shm_names == [] and s.welcome.rdma is None and s.welcome.nixl is None
    finally:
        s.close()


def test_identity_refusals_name_each_reason():
    d = Decode(transports=("tcp",), max_sessions=3, secret=SECRET)
    two = [KVLayout(**BASE, tp_size=2, tp_rank=r) for r in range(2)]
    held = []
    try:
        key = os.urandom(32)
        held.append(_session(d, two[0], instance="pf", instance_key=key))
        assert held[-1].welcome is not None
        before = d.rx.stats["identity_refused"]
        s = _session(d, two[1], instance="pf", instance_key=os.urandom(32))
        held.append(s)
        assert s.refusal.message == (
            "instance 'pf' has live sessions under another instance key "
            "(ranks of one instance share SenderOptions.instance_key)"
        )
        s = _session(d, LAY, instance="pf", instance_key=key)
        held.append(s)
        assert s.refusal.message == "instance 'pf' has live sessions of tp_size 2, not 1"
        s = _session(d, two[0], instance="pf", instance_key=key)
        held.append(s)
        assert s.refusal.message == "rank 0 of instance 'pf' has a live session already"
        assert d.rx.stats["identity_refused"] == before + 3
        s = _session(d, two[1], instance="pf", instance_key=key)  # its sibling rank: welcome
        held.append(s)
        assert s.welcome is not None
        held.append(_session(d, instance="q"))
        assert held[-1].welcome is not None  # the third session: max_sessions reached
        s = _session(d, instance="r")
        held.append(s)
        assert s.refusal.message == "decode serves 3 sessions (max_sessions); retry later"
        assert len(d.rx._peers) == 3
    finally:
        for s in held:
            s.close()
        d.close()


# ------------------------------------------------------------------ prefill's side


class FakeDecode:
    """A ROUTER that answers Hellos by a script: ``script(kind, msg, codec)`` returns the
    messages to send (a list) for each message received."""

    def __init__(self, script, secret=None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.script, self.codec, self.got = script, Codec(secret), []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self):
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = self.codec.decode(frames)
            self.got.append(msg)
            for out in self.script(msg, self):
                self.sock.send_multipart([ident, *(out if isinstance(out, list) else self.codec.encode(out))])

    def close(self):
        self._stop.set()
        self._t.join(5)
        self.sock.close(0)
        self.ctx.term()


def _sender(address, timeout_s=2.0, **kw):
    cache = np.zeros(LAY.block_bytes * 4, np.uint8)
    return PrefillSender(
        LAY, CacheSpec.for_buffer(LAY, 4, cache.ctypes.data), address, transport="tcp", timeout_s=timeout_s, **kw
    )


def _welcome(transport="tcp", ranks=(0,), layouts=None):
    return Welcome(
        PROTOCOL_VERSION,
        "decode",
        1,
        list(ranks),
        layouts or [layout_desc(LAY)],
        transport,
        [],
        64,
        "127.0.0.1:1",
        b"s" * 16,
        None,
        None,
        None,
    )


def _run(script, match, exc=ProtocolError, timeout_s=2.0):
    fd = FakeDecode(script)
    try:
        with pytest.raises(exc, match=match):
            _sender(fd.address, timeout_s=timeout_s)
        return fd
    finally:
        fd.close()


def test_prefill_refuses_an_answer_that_is_not_a_challenge():
    fd = _run(lambda m, fd: [_welcome()] if isinstance(m, Hello) else [], "expected challenge, got Welcome")
    (h,) = fd.got
    assert isinstance(h, Hello) and h.transports == ["tcp"] and h.instance and h.pid == os.getpid()


def test_prefill_refuses_a_challenge_to_a_hello_it_did_not_send():
    _run(
        lambda m, fd: [Challenge(new_nonce(), new_nonce())] if isinstance(m, Hello) else [],
        "challenge to a hello this sender did not send",
    )


def _challenge_then(after):
    def script(m, fd):
        if isinstance(m, Hello):
            n = new_nonce()
            out = [Challenge(n, m.nonce)]
            fd.hello_nonce, fd.nonce = m.nonce, n
            return out
        if isinstance(m, Auth):
            return after(m, fd)
        return []

    class Keyed(FakeDecode):
        def _loop(self):  # after the Challenge, decode's codec is under the session key
            while not self._stop.is_set():
                if not self.sock.poll(20):
                    continue
                ident, *frames = self.sock.recv_multipart()
                msg = self.codec.decode(frames)
                self.got.append(msg)
                outs = self.script(msg, self)
                for out in outs:
                    self.sock.send_multipart([ident, *(out if isinstance(out, list) else self.codec.encode(out))])
                if isinstance(msg, Hello):
                    self.codec.set_session(msg.nonce, self.nonce)

    return Keyed, script


def _run_keyed(after, match, exc=ProtocolError):
    cls, script = _challenge_then(after)
    fd = cls(script)
    try:
        with pytest.raises(exc, match=match):
            _sender(fd.address)
        return fd
    finally:
        fd.close()


def test_prefill_proves_its_instance_key_and_refuses_an_answer_that_is_not_a_welcome():
    key = os.urandom(32)

    def after(m, fd):
        fd.proved = mask_instance_key(m.instance_key, fd.codec.key, fd.hello_nonce, fd.nonce)
        return [Challenge(new_nonce(), new_nonce())]

    cls, script = _challenge_then(after)
    fd = cls(script)
    try:
        with pytest.raises(ProtocolError, match="expected welcome, got Challenge"):
            _sender(fd.address, instance_key=key)
        assert fd.proved == instance_key_of(fd.got[0].instance, key)
        auth = fd.got[-1]
        assert isinstance(auth, Auth) and auth.nonce == fd.nonce
    finally:
        fd.close()


def test_prefill_refuses_a_transport_it_did_not_offer():
    _run_keyed(lambda m, fd: [_welcome(transport="shm")], "decode chose 'shm', which this sender did not offer")


def test_prefill_refuses_decodes_layout_it_cannot_pair_with():
    other = KVLayout(**{**BASE, "head_dim": 64})
    _run_keyed(lambda m, fd: [_welcome(layouts=[layout_desc(other)])], "head_dim", exc=Exception)


def test_a_refusal_is_a_peer_error_with_decodes_words():
    _run(
        lambda m, fd: [list(Codec(None).encode(ErrorMsg("refused", "not today")))],
        "decode refused the session: not today",
        exc=PeerError,
    )


def test_a_silent_decode_is_a_timeout_after_hellos_sent_again():
    t0 = time.monotonic()
    fd = _run(
        lambda m, fd: [], r"decode did not answer the handshake within 1.5s \(is it running\?\)", PdkvTimeoutError, 1.5
    )
    took = time.monotonic() - t0
    hellos = [m for m in fd.got if isinstance(m, Hello)]
    assert 1.4 < took < 4.0
    assert len(hellos) == 2 and hellos[0].nonce != hellos[1].nonce  # once a second, each with a new nonce


def test_a_challenge_to_an_earlier_hello_is_skipped():
    """Decode answers the first Hello late (after the sender sent it again): that
    Challenge is passed over and the one to the latest Hello is used."""
    seen = []

    def script(m, fd):
        if isinstance(m, Hello):
            seen.append(m.nonce)
            if len(seen) == 2:
                return [Challenge(new_nonce(), seen[0]), ErrorMsg("refused", "second")]
        return []

    fd = FakeDecode(script)
    try:
        with pytest.raises(PeerError, match="decode refused the session: second"):
            _sender(fd.address, timeout_s=3.0)
    finally:
        fd.close()


def test_a_real_session_sets_the_senders_transport_segments_and_path(dec):
    tx = _sender(dec.rx.control_address, secret=SECRET)
    try:
        assert tx.transport == "tcp" and len(tx.session_id) == 16
        assert tx.stats["path"].startswith("tcp")
        assert tx.dst_layout == LAY and {g.dst_rank for g in tx.segments} == {0} and tx.segments
        assert tx._candidates == {}
    finally:
        tx.close()


def test_the_hello_retry_interval():
    assert handshake._HELLO_RETRY_S == 1.0
