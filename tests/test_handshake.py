"""The session handshake (transfer/sessions/handshake.py) on both sides, in one process and fast:
decode's answers to every Hello and Auth it must refuse, each refusal's exact words, what a
session it accepts is made of; and prefill's side against a scripted decode (a ROUTER
socket) that answers out of order, refuses, goes silent or names a transport never offered.

test_hostile.py attacks the same code with sessions over time (floods, replays, data
connections); these tests pin each decision."""

from __future__ import annotations

import logging
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
    Bye,
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
from pdkv.transfer.sessions import handshake
from pdkv.transfer.sessions.identity import instance_key_of, key_fingerprint

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
TWO = [KVLayout(**BASE, tp_size=2, tp_rank=r) for r in range(2)]  # the ranks of a TP 2 prefill


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


def test_a_rank_session_is_replaced_only_by_its_own_process_proving_its_key():
    """A sender that gave up on decode opens a new session while decode still holds the
    old one (its Bye, on the old connection, may be served after the new Auth): the same
    process proving the same instance key replaces its rank's session (the old one ends
    as a closed connection's does); another process with that key, or this one with another key, is
    refused. One live session per rank throughout."""
    d = Decode(transports=("tcp",), secret=SECRET)
    held = []
    try:
        key = os.urandom(32)
        first = _session(d, instance="pf", instance_key=key)
        held.append(first)
        assert first.welcome is not None
        for kw in ({"pid": os.getppid()}, {"instance_key": os.urandom(32)}):
            s = _session(d, **{"instance": "pf", "instance_key": key, **kw})
            held.append(s)
            assert s.refusal is not None and [p.session_id for p in d.rx._peers.values()] == [first.welcome.session_id]
        again = _session(d, instance="pf", instance_key=key)
        held.append(again)
        assert again.welcome is not None and again.welcome.session_id != first.welcome.session_id
        assert [p.session_id for p in d.rx._peers.values()] == [again.welcome.session_id]
    finally:
        for s in held:
            s.close()
        d.close()


def test_identity_refusals_name_each_reason():
    d = Decode(transports=("tcp",), max_sessions=3, secret=SECRET)
    held = []
    try:
        key = os.urandom(32)
        held.append(_session(d, TWO[0], instance="pf", instance_key=key))
        assert held[-1].welcome is not None
        before = d.rx.stats["identity_refused"]
        s = _session(d, TWO[1], instance="pf", instance_key=os.urandom(32))
        held.append(s)
        assert s.refusal.message == (
            "instance 'pf' has live sessions under another instance key "
            "(ranks of one instance share SenderOptions.instance_key)"
        )
        s = _session(d, LAY, instance="pf", instance_key=key)
        held.append(s)
        assert s.refusal.message == "instance 'pf' has live sessions of tp_size 2, not 1"
        s = _session(d, TWO[0], instance="pf", instance_key=key, pid=os.getppid())  # another process
        held.append(s)
        assert s.refusal.message == "rank 0 of instance 'pf' has a live session already"
        assert d.rx.stats["identity_refused"] == before + 3
        s = _session(d, TWO[1], instance="pf", instance_key=key)  # its sibling rank: welcome
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


def _sender(address, timeout_s=2.0, transport="tcp", **kw):
    cache = np.zeros(LAY.block_bytes * 4, np.uint8)
    return PrefillSender(
        LAY, CacheSpec.for_buffer(LAY, 4, cache.ctypes.data), address, transport=transport, timeout_s=timeout_s, **kw
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
        "^challenge to a hello this sender did not send$",
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
        if isinstance(m, Bye):  # a closing sender waits for decode's answer
            return [Bye("session ended")]
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
    assert len(hellos) in (2, 3) and len({h.nonce for h in hellos}) == len(hellos)  # again each second, new nonces


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


# ------------------------------------------------------------------ what each side hands the other

from pdkv import transfer as transfer_mod  # noqa: E402
from pdkv.errors import NixlUnavailableError, PdkvError  # noqa: E402
from pdkv.protocol import (  # noqa: E402
    CudaDesc,
    IpcSection,
    NixlHello,
    NixlOffer,
    RdmaEndpointDesc,
    RdmaOffer,
)
from pdkv.transfer.transports.base import ReceiverTransport, SenderTransport  # noqa: E402

FAKE: dict = {}  # how the fake transport behaves in this test; what it saw


class FakeRx(ReceiverTransport):
    name = "fake"

    def refuses(self, hello):
        FAKE.setdefault("asked", []).append(hello.instance)
        return FAKE.get("refuse")

    def open_session(self, peer, hello):
        FAKE["opened"] = (peer, hello)
        if "fail" in FAKE:
            raise PdkvError(FAKE["fail"])
        return dict(FAKE.get("fields", {}))

    def fence(self, peer):
        pass

    def close(self, timeout=5.0):
        pass


class FakeTx(SenderTransport):
    name = "fake"
    caches = frozenset({"host", "gpu"})

    def __init__(self, host, options):
        super().__init__(host, options)
        if "unavailable" in FAKE:
            raise NixlUnavailableError(FAKE["unavailable"])
        FAKE.setdefault("made", []).append(self)
        self.closed = 0

    def hello_fields(self):
        return dict(FAKE.get("hello_fields", {}))

    def connect(self, welcome, layouts, deadline):
        FAKE["connected"] = (welcome, layouts, deadline)

    def write_layer(self, layer, work):
        raise AssertionError("no writes in these tests")

    def close(self):
        self.closed += 1


class FakeGpuRx(FakeRx):
    name = "fakegpu"
    writes_gpu = True


class FakeGpuTx(FakeTx):
    name = "fakegpu"
    writes_gpu = True


@pytest.fixture
def fake():
    FAKE.clear()
    transfer_mod.register(FakeTx, FakeRx)
    transfer_mod.register(FakeGpuTx, FakeGpuRx)
    yield FAKE
    transfer_mod.unregister("fake")
    transfer_mod.unregister("fakegpu")
    FAKE.clear()


WELCOME_FIELDS = {
    "rdma": RdmaOffer(endpoint=RdmaEndpointDesc(qpn=7, psn=8, lid=9, gid="fe80::1", mtu=4096), regions=[]),
    "cuda": IpcSection(ranks=[]),
    "nixl": NixlOffer(agent="decode-agent", metadata=b"md", regions=[]),
}


def test_a_transports_session_fields_reach_the_welcome(fake):
    fake["fields"] = WELCOME_FIELDS
    d = Decode(transports=("fake",), secret=SECRET)
    try:
        s = _session(d, transports=("fake",), instance="pf")
        try:
            w = s.welcome
            assert (w.rdma, w.cuda, w.nixl) == (WELCOME_FIELDS["rdma"], WELCOME_FIELDS["cuda"], WELCOME_FIELDS["nixl"])
            assert w.shm_names == [] and w.data_addr == ""
            peer, hello = fake["opened"]
            assert peer is d.rx._peers[peer.ident] and hello.instance == "pf" and hello.nonce == s.nonce
            assert fake["asked"] == ["pf"]
        finally:
            s.close()
    finally:
        d.close()


def test_a_transport_that_cannot_open_the_session_refuses_it_by_name(fake):
    fake["fail"] = "no queue pair left"
    d = Decode(transports=("fake",), secret=SECRET)
    try:
        s = _session(d, transports=("fake",))
        try:
            assert s.refusal.code == "refused" and s.refusal.message == "fake: no queue pair left"
            assert d.rx._peers == {}
        finally:
            s.close()
    finally:
        d.close()


def test_a_transport_that_refuses_the_peer_is_passed_over_with_its_reason(fake):
    fake["refuse"] = "fake needs a GPU cache"
    d = Decode(transports=("fake", "tcp"), secret=SECRET)
    r = Raw(d, SECRET)
    try:
        r.hello(LAY, transports=("fake", "tcp"))
        assert isinstance(r.recv(), Challenge)
        (hs,) = d.rx._pending.values()
        assert hs.transport == "tcp"
        r.hello(LAY, transports=("fake",))
        assert r.refusal() == (
            "no common transport: prefill offers ['fake'], decode serves ['fake', 'tcp'] (fake needs a GPU cache)"
        )
    finally:
        r.close()
        d.close()


def test_the_ranks_of_one_instance_write_gpu_blocks_all_or_none(fake):
    d = Decode(transports=("tcp", "fakegpu"), secret=SECRET)
    key = os.urandom(32)
    held = []
    try:
        held.append(_session(d, TWO[0], instance="pf", instance_key=key, transports=("tcp",)))
        assert held[0].welcome is not None
        other = _session(d, TWO[0], instance="other", instance_key=os.urandom(32), transports=("fakegpu",))
        held.append(other)
        assert other.welcome.transport == "fakegpu"  # another instance: its own choice
        r = Raw(d, SECRET)
        try:
            r.hello(TWO[1], instance="pf", transports=("fakegpu", "tcp"))
            assert isinstance(r.recv(), Challenge)
            (hs,) = d.rx._pending.values()
            assert hs.transport == "tcp"  # rank 0 of pf writes the buffer only: so does rank 1
            r.hello(TWO[1], instance="pf", transports=("fakegpu",))
            assert r.refusal() == (
                "no common transport: prefill offers ['fakegpu'], decode serves ['tcp', 'fakegpu'] "
                "(another rank of instance 'pf' uses tcp; fakegpu is all ranks or none)"
            )
        finally:
            r.close()
    finally:
        for s in held:
            s.close()
        d.close()


def test_a_gpu_writing_rank_makes_its_siblings_gpu_writers_too(fake):
    d = Decode(transports=("tcp", "fakegpu"), secret=SECRET)
    s0 = _session(d, TWO[0], instance="pf", instance_key=b"k" * 32, transports=("fakegpu",))
    r = Raw(d, SECRET)
    try:
        r.hello(TWO[1], instance="pf", transports=("tcp",))
        assert r.refusal() == (
            "no common transport: prefill offers ['tcp'], decode serves ['tcp', 'fakegpu'] "
            "(another rank of instance 'pf' uses fakegpu; fakegpu is all ranks or none)"
        )
    finally:
        r.close()
        s0.close()
        d.close()


def test_a_held_handshake_records_what_the_session_will_need(dec, raw):
    t0 = time.monotonic()
    n = raw.hello(LAY, transports=("shm",))
    ch = raw.recv()
    (hs,) = dec.rx._pending.values()
    assert hs.hello.nonce == n and hs.nonce == ch.nonce and hs.transport == "shm" and hs.same_host is True
    assert hs.layout == LAY and [g.src_rank for g in hs.segs] == [0] * len(hs.segs) and hs.segs
    assert t0 + 5.0 <= hs.deadline <= time.monotonic() + 5.0  # auth_timeout_s after the Hello


def test_a_hello_again_on_one_connection_takes_no_other_handshakes_place():
    d = Decode(max_handshakes=2, secret=SECRET)
    a, b = Raw(d, SECRET), Raw(d, SECRET)
    try:
        before = d.rx.stats["connections_refused"]
        a.hello(LAY, instance="a")
        b.hello(LAY, instance="b")
        a.recv(), b.recv()
        a.hello(LAY, instance="a")  # a replaces its own handshake: b's stays
        a.recv()
        assert sorted(hs.hello.instance for hs in d.rx._pending.values()) == ["a", "b"]
        assert d.rx.stats["connections_refused"] == before
    finally:
        a.close()
        b.close()
        d.close()


def test_dropping_the_oldest_handshake_is_logged(caplog):
    d = Decode(max_handshakes=1, secret=SECRET)
    a, b = Raw(d, SECRET), Raw(d, SECRET)
    try:
        a.hello(LAY, instance="a")
        a.recv()
        b.hello(LAY, instance="b")
        b.recv()
        msgs = [r.getMessage() for r in caplog.records]
        assert "pdkv decode: 1 control handshakes in progress (max_handshakes): the oldest are dropped" in msgs
    finally:
        a.close()
        b.close()
        d.close()


def test_an_accepted_session_is_logged_marked_and_timed(dec, caplog):
    caplog.set_level(logging.DEBUG, logger=handshake.__name__)
    t0 = time.monotonic()
    s = _session(dec, instance="pf", transports=("tcp",))
    try:
        (peer,) = dec.rx._peers.values()
        assert t0 <= peer.last_seen <= time.monotonic() and peer.layout == LAY
        assert [c.session for c in dec.rx._guard._conns.values() if c.ident == peer.ident] == [True]
        msgs = [r.getMessage() for r in caplog.records if r.name == handshake.__name__]
        assert msgs == [f"session open: instance pf rank 0/1, transport tcp, pid {os.getpid()} (same host)"]
    finally:
        s.close()


def test_a_session_from_another_host_is_logged_without_same_host(dec, caplog, raw):
    caplog.set_level(logging.DEBUG, logger=handshake.__name__)
    n = raw.hello(LAY, instance="far", boot="another-host")
    ch = raw.recv()
    raw.codec.set_session(n, ch.nonce)
    key = mask_instance_key(os.urandom(32), raw.codec.key, n, ch.nonce)
    raw.sock.send_multipart(raw.codec.encode(Auth(ch.nonce, key)))
    assert isinstance(raw.recv(), Welcome)
    msgs = [r.getMessage() for r in caplog.records if r.name == handshake.__name__]
    assert msgs == [f"session open: instance far rank 0/1, transport tcp, pid {os.getpid()}"]


def test_an_identity_refusal_is_logged(caplog):
    d = Decode(transports=("tcp",), secret=SECRET)
    held = []
    try:
        held.append(_session(d, instance="pf"))
        held.append(_session(d, instance="pf"))  # rank 0 again, another key
        assert held[-1].refusal.code == "refused"
        msgs = [r.getMessage() for r in caplog.records]
        assert (
            "pdkv decode: session refused: instance 'pf' has live sessions under another instance key "
            "(ranks of one instance share SenderOptions.instance_key)"
        ) in msgs
    finally:
        for s in held:
            s.close()
        d.close()


# ---- prefill's side: the offer, the Hello's fields, what the Welcome sets up


def test_auto_leaves_a_transport_whose_software_is_missing_out_of_the_offer(fake, monkeypatch, caplog):
    """transport=auto: a transport that cannot be made for lack of software (NIXL) is left
    out of the Hello with a warning; named, or the only one, it is the error."""
    from pdkv.transfer.transports import base as registry

    fake["unavailable"] = "NIXL is not installed"
    monkeypatch.setattr(registry, "auto_offer", lambda cache: ["fake", "tcp"])
    d = Decode(transports=("tcp",), secret=SECRET)
    try:
        tx = _sender(d.rx.control_address, secret=SECRET, transport="auto")
        try:
            assert tx.transport == "tcp"
        finally:
            tx.close()
        msgs = [r.getMessage() for r in caplog.records if r.name == handshake.__name__]
        assert msgs == ["transport=auto: fake left out of the offer: NIXL is not installed"]
        monkeypatch.setattr(registry, "auto_offer", lambda cache: ["tcp", "fake"])
        tx = _sender(d.rx.control_address, secret=SECRET, transport="auto")  # the last one, others made
        tx.close()
        monkeypatch.setattr(registry, "auto_offer", lambda cache: ["fake"])
        with pytest.raises(NixlUnavailableError, match="NIXL is not installed"):
            _sender(d.rx.control_address, secret=SECRET, transport="auto")
        with pytest.raises(NixlUnavailableError, match="NIXL is not installed"):
            _sender(d.rx.control_address, secret=SECRET, transport="fake")
    finally:
        d.close()


def test_the_hello_carries_the_offered_transports_fields_and_the_welcome_picks_one(fake):
    """Prefill offers fake and tcp; each offered transport's fields ride in the Hello; decode
    (scripted) picks fake: it is connected with decode's layouts before the deadline, tcp is
    closed, and the sender's path and session id are decode's."""
    fake["hello_fields"] = {
        "rdma": RdmaEndpointDesc(qpn=1, psn=2, lid=3, gid="fe80::2", mtu=1024),
        "cuda": CudaDesc(device_uuid="GPU-abc"),
        "nixl": NixlHello(agent="prefill-agent", metadata=b"x"),
    }
    from pdkv.transfer.transports import base as registry

    made_tcp = []
    real_get = registry.get

    def get(name):
        e = real_get(name)
        if name != "tcp":
            return e

        class Tcp(e.sender):
            def close(self):
                made_tcp.append("closed")
                super().close()

        return type(e)(e.name, Tcp, e.receiver)

    cls, script = _challenge_then(lambda m, fd: [_welcome(transport="fake")])
    fd = cls(script)
    real_offer = registry.auto_offer
    try:
        registry.get = get
        registry.auto_offer = lambda cache: ["fake", "tcp"]
        t0 = time.monotonic()
        tx = PrefillSender(
            LAY,
            CacheSpec.for_buffer(LAY, 4, np.zeros(LAY.block_bytes * 4, np.uint8).ctypes.data),
            fd.address,
            transport="auto",
            timeout_s=3.0,
        )
    finally:
        registry.get = real_get
        registry.auto_offer = real_offer
    try:
        hello = fd.got[0]
        assert hello.transports[:1] == ["fake"] and "tcp" in hello.transports
        assert (hello.rdma, hello.cuda, hello.nixl) == (
            fake["hello_fields"]["rdma"],
            fake["hello_fields"]["cuda"],
            fake["hello_fields"]["nixl"],
        )
        welcome, layouts, deadline = fake["connected"]
        assert welcome.transport == "fake" and layouts == [LAY] and t0 < deadline <= time.monotonic() + 3.0
        assert made_tcp == ["closed"] and tx.transport == "fake" and tx.session_id == b"s" * 16
        assert tx.stats["path"] == "fake" and tx._last_heard >= t0
        assert [g.dst_rank for g in tx.segments] == [0] * len(tx.segments) and tx.segments
    finally:
        tx.close()
        fd.close()


def test_a_welcome_naming_other_decode_ranks_keeps_only_the_segments_of_listed_ones(fake):
    cls, script = _challenge_then(lambda m, fd: [_welcome(transport="fake", ranks=(1,), layouts=[layout_desc(TWO[1])])])
    fd = cls(script)
    try:
        tx = _sender(fd.address, transport="fake")
        try:
            assert tx.segments and {g.dst_rank for g in tx.segments} == {1}
            assert {g.src_rank for g in tx.segments} == {0}
        finally:
            tx.close()
    finally:
        fd.close()


def test_an_unauthenticated_refusal_is_read_under_a_secret():
    """A prefill with a secret hears decode's refusal sent in the clear (its Hello failed
    decode's check): a PeerError with decode's words, not a protocol error."""
    fd = FakeDecode(lambda m, fd: [list(Codec(None).encode(ErrorMsg("refused", "wrong secret")))], secret=SECRET)
    try:
        with pytest.raises(PeerError, match="decode refused the session: wrong secret"):
            _sender(fd.address, secret=SECRET)
    finally:
        fd.close()


def test_an_unauthenticated_message_that_is_not_a_refusal_is_a_protocol_error():
    fd = FakeDecode(lambda m, fd: [list(Codec(None).encode(Challenge(new_nonce(), m.nonce)))], secret=SECRET)
    try:
        with pytest.raises(ProtocolError):
            _sender(fd.address, secret=SECRET)
    finally:
        fd.close()


def test_a_welcome_within_the_sessions_timeout_is_waited_for(fake):
    """Decode answers the Auth after 0.3 s: within timeout_s, so the session opens."""

    def after(m, fd):
        time.sleep(0.3)
        return [_welcome(transport="fake")]

    cls, script = _challenge_then(after)
    fd = cls(script)
    try:
        tx = _sender(fd.address, timeout_s=2.0, transport="fake")
        tx.close()
    finally:
        fd.close()


def test_reply_waits_for_the_time_it_is_given(monkeypatch):
    """reply() polls decode's socket for the time left until ``until`` in ms (at least 1)."""
    polls = []

    class Sock:
        def poll(self, ms):
            polls.append(ms)
            return 0

    tx = type("Tx", (), {"_sock": Sock()})()
    now = time.monotonic()
    assert handshake.reply(tx, now + 0.25, 9.0, final=now + 60) is None
    assert 200 <= polls[-1] <= 250
    assert handshake.reply(tx, now - 5, 9.0, final=now + 60) is None
    assert polls[-1] == 1
    with pytest.raises(PdkvTimeoutError, match=r"within 9.0s"):
        handshake.reply(tx, now - 5, 9.0)
