"""Session setup on both sides: Hello, Challenge, Auth, Welcome.

Prefill (:func:`open_session`) offers its layout, rank and transports with a nonce; decode
(:func:`answer_hello`) checks the layout against its own, picks the first offered
transport it serves and can use for this peer, and answers a Challenge under the shared
secret, holding nothing; prefill answers Auth under the session key both derive from the
two nonces, with its instance's key masked under that session key; decode
(:func:`accept_session`) then makes the session and sends Welcome with what the chosen
transport needs; prefill connects that transport.

Identity: the sessions of one prefill instance are those that show one instance key. A
session naming an instance that has live sessions under another key is refused, and so is
a second live session of one (instance, rank): a name is a label, the key is the identity.
A Hello whose nonce decode saw within the handshake window is refused (replay).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from ...errors import (
    LayoutError,
    NixlUnavailableError,
    PdkvError,
    PdkvTimeoutError,
    PeerError,
    ProtocolError,
    RdmaUnavailableError,
)
from ...layout import KVLayout, Segment, tp_segments
from ...procs import boot_id
from ...protocol import (
    PROTOCOL_VERSION,
    Auth,
    Bye,
    Challenge,
    Codec,
    ErrorMsg,
    Hello,
    Message,
    Welcome,
    is_unauthenticated,
    layout_desc,
    mask_instance_key,
    new_nonce,
)
from ..transports import base as registry
from ..transports.base import Peer, SenderHost, SenderTransport
from .identity import Handshake, instance_key_of, key_fingerprint
from .options import SenderOptions
from .receiver import ReceiverCore

_log = logging.getLogger(__name__)

__all__ = ["answer_hello", "accept_session", "open_session", "Opener"]

_HELLO_RETRY_S = 1.0  # a Hello unanswered this long is sent again (its connection may have been closed)
# a connection lost (closed by decode, or before zmq's own handshake completed): what was in
# flight on it is lost, and once zmq has connected anew the handshake starts again
_LOST = int(
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def answer_hello(rx: ReceiverCore, ident: bytes, codec: Codec, h: Hello) -> None:
    """Check a Hello and answer it with a Challenge; the session starts only on a valid
    Auth (:func:`accept_session`). Nothing is allocated for the peer before that."""

    def refuse(why: str) -> None:
        rx._ch.send(lambda: [ident, *codec.encode(ErrorMsg("refused", why))])

    try:
        lay = KVLayout.from_descriptor(msgspec.structs.asdict(h.layout))
        lay.check_compatible(rx.layouts[0])
        if lay.tp_size != h.tp_size or lay.tp_rank != h.tp_rank:
            raise LayoutError(f"hello says rank {h.tp_rank}/{h.tp_size}, layout says {lay.tp_rank}/{lay.tp_size}")
        segs = [g for g in tp_segments(lay, rx.layouts[0]) if g.dst_rank in rx.specs]
    except PdkvError as exc:
        refuse(str(exc))
        return
    now = time.monotonic()
    if not rx._hello_nonces.fresh(h.nonce, now):
        rx.count("auth_failed")
        refuse("hello replayed (its nonce was seen already)")
        return
    rx._pending.pop(ident, None)  # a Hello sent again on one connection replaces the first
    while len(rx._pending) >= rx.options.max_handshakes:
        # the oldest handshake gives way: holding handshakes open keeps no new peer out
        rx.count("connections_refused")
        rx._warn.warning(
            "handshakes",
            "pdkv decode: %d control handshakes in progress (max_handshakes): the oldest are dropped",
            len(rx._pending),
        )
        del rx._pending[next(iter(rx._pending))]
        rx._dropped_at = now  # its Auth, when it comes, is answered "busy"
    same = h.boot_id == boot_id()
    with rx.lock:
        sibling = next((p.transport for p in rx._peers.values() if p.instance == h.instance), None)
    why: list[str] = []  # why offered transports that decode serves cannot serve this peer
    transport = None
    for t in h.transports:
        tr = rx._transports.get(t)
        if tr is None:
            continue
        if tr.same_host and not same:
            why.append(f"{t} needs the same host")
            continue
        # the ranks of one instance share a grant: GPU blocks only if all of them write them
        if sibling is not None and tr.writes_gpu != rx._transports[sibling].writes_gpu:
            why.append(
                f"another rank of instance {h.instance!r} uses {sibling}; "
                f"{t if tr.writes_gpu else sibling} is all ranks or none"
            )
            continue
        no = tr.refuses(h)
        if no is not None:
            why.append(no)
            continue
        transport = t
        break
    if transport is None:
        refuse(
            f"no common transport: prefill offers {h.transports}, decode serves {list(rx._transports)}"
            + "".join(f" ({w})" for w in why)
        )
        return
    nonce = new_nonce()
    frames = codec.encode(Challenge(nonce, h.nonce))  # under the secret
    codec.set_session(h.nonce, nonce)
    rx._pending[ident] = Handshake(codec, h, lay, segs, transport, same, nonce, now + rx.options.auth_timeout_s)
    rx._ch.send(lambda: [ident, *frames])


def identity_refusal(rx: ReceiverCore, h: Hello, fp: bytes) -> str | None:
    """Why a session of instance ``h.instance``, rank ``h.tp_rank``, proving the key whose
    fingerprint is ``fp``, may not start now (None: it may). Under ``rx.lock``."""
    mine = [p for p in rx._peers.values() if p.instance == h.instance]
    if mine and mine[0].key_fp != fp:
        return (
            f"instance {h.instance!r} has live sessions under another instance key "
            "(ranks of one instance share SenderOptions.instance_key)"
        )
    if mine and mine[0].tp_size != h.tp_size:
        return f"instance {h.instance!r} has live sessions of tp_size {mine[0].tp_size}, not {h.tp_size}"
    if any(p.tp_rank == h.tp_rank for p in mine):
        return f"rank {h.tp_rank} of instance {h.instance!r} has a live session already"
    if len(rx._peers) >= rx.options.max_sessions:
        return f"decode serves {len(rx._peers)} sessions (max_sessions); retry later"
    return None


def accept_session(rx: ReceiverCore, ident: bytes, hs: Handshake, auth: Auth) -> None:
    """The peer proved the session key: check its identity, make the session, answer Welcome."""
    h, codec, transport = hs.hello, hs.codec, hs.transport
    fp = key_fingerprint(mask_instance_key(auth.instance_key, codec.key, h.nonce, hs.nonce))
    with rx.lock:
        old = [p for p in rx._peers.values() if p.instance == h.instance and p.tp_rank == h.tp_rank]
    for p in old:
        # the rank's session whose connection closed, or one its own process replaces (the
        # same instance key proven from the same pid, the same tp_size: a sender that gave
        # up on this decode, whose Bye on the old connection may be served after this
        # Auth): what the old connection sent, then its end. One live session per rank.
        same = p.key_fp == fp and 0 < p.pid == h.pid and p.same_host == hs.same_host and p.tp_size == h.tp_size
        if same and p.ident not in rx._gone:
            # a live session replaced: its sender is told now (its requests fail at once
            # there), not when its silence bound runs out
            bye: list[bytes] = [p.ident, *p.codec.encode(Bye("replaced by a new session of the same process"))]
            rx._ch.send(functools.partial(list, bye))
        if p.ident in rx._gone or same:
            rx.retire(p.ident)
    with rx.lock:
        why = identity_refusal(rx, h, fp)
    if why is not None:
        rx.count("identity_refused")
        rx._warn.warning("identity", "pdkv decode: session refused: %s", why)
        refusal = ErrorMsg("refused", why)
        rx._ch.send(lambda: [ident, *codec.encode(refusal)])
        return
    peer = Peer(
        ident,
        codec,
        h.instance,
        h.tp_rank,
        h.tp_size,
        h.pid,
        hs.same_host,
        transport,
        os.urandom(16),
        time.monotonic(),
        hs.layout,
        key_fp=fp,
    )
    for g in hs.segs:
        peer.segs_by_src.setdefault(g.src_rank, []).append(g)
    peer.block_bytes_by_src = {r: sum(g.nbytes for g in gs) for r, gs in peer.segs_by_src.items()}
    try:
        fields = rx._transports[transport].open_session(peer, h)
    except PdkvError as exc:
        refusal = ErrorMsg("refused", f"{transport}: {exc}")
        rx._ch.send(lambda: [ident, *codec.encode(refusal)])
        return
    fields = {"shm_names": [], "data_addr": "", "rdma": None, "cuda": None, "nixl": None, **fields}
    welcome = Welcome(
        PROTOCOL_VERSION,
        rx.instance,
        rx.tp_size,
        rx.ranks,
        [layout_desc(x) for x in rx.layouts],
        transport,
        fields["shm_names"],
        rx.buffer_blocks,
        fields["data_addr"],
        peer.session_id,
        fields["rdma"],
        fields["cuda"],
        fields["nixl"],
        rx.options.buffer_order,
    )
    frames = codec.encode(welcome)  # under the session key
    with rx.lock:
        rx._peers[ident] = peer
        rx._sessions[peer.session_id] = ident
    rx.on_session(ident)
    _log.debug(
        "session open: instance %s rank %d/%d, transport %s, pid %d%s",
        h.instance,
        h.tp_rank,
        h.tp_size,
        transport,
        h.pid,
        " (same host)" if hs.same_host else "",
    )
    rx._ch.send(lambda: [ident, *frames])


class Opener(SenderHost, Protocol):
    """What :func:`open_session` sets up on a prefill sender (``PrefillSender``)."""

    options: SenderOptions
    instance: str
    stats: dict[str, Any]
    transport: str
    session_id: bytes  # set here; the transports read it
    dst_layout: KVLayout
    segments: list[Segment]
    _sock: zmq.Socket[bytes]
    _codec: Codec
    _candidates: dict[str, SenderTransport]
    _data: SenderTransport | None
    _last_heard: float


def open_session(tx: Opener, offer: list[str], timeout_s: float) -> None:
    fields: dict[str, Any] = {"rdma": None, "cuda": None, "nixl": None}
    auto = tx.options.transport == "auto"
    made: list[str] = []
    for name in offer:
        # each offered transport made before the hello (rdma registers the cache and
        # makes its queue pair, whose record the hello carries): RdmaUnavailableError
        # here says what is missing. Under auto a transport whose software is missing
        # (pyverbs, NIXL) is left out of the offer, unless it was the last one.
        try:
            tr = tx._candidates[name] = registry.get(name).sender(tx, tx.options)
        except (RdmaUnavailableError, NixlUnavailableError) as exc:
            if not auto or (name == offer[-1] and not made):
                raise
            _log.warning("transport=auto: %s left out of the offer: %s", name, exc)
            continue
        made.append(name)
        fields.update(tr.hello_fields())
    offer = made
    deadline = time.monotonic() + timeout_s

    def hello() -> bytes:
        nonce = new_nonce()
        tx._sock.send_multipart(
            tx._codec.encode(
                Hello(
                    PROTOCOL_VERSION,
                    tx.instance,
                    tx.layout.tp_rank,
                    tx.layout.tp_size,
                    layout_desc(tx.layout),
                    offer,
                    boot_id(),
                    os.getpid(),
                    nonce,
                    fields["rdma"],
                    fields["cuda"],
                    fields["nixl"],
                )
            )
        )
        return nonce

    # a Hello unanswered for a second is sent again with a new nonce: decode may have closed
    # its connection (too many without a session) and zmq connects anew; only the Challenge
    # to the latest Hello counts. A Hello is also sent again at once when the connection
    # ends and zmq connects anew (decode closed it), and the whole handshake again when
    # decode answers "busy" (it dropped this handshake under load).
    mon = tx._sock.get_monitor_socket(int(_LOST | zmq.EVENT_HANDSHAKE_SUCCEEDED))
    try:
        msg = _handshake(tx, hello, mon, deadline, timeout_s)
    finally:
        with contextlib.suppress(zmq.ZMQError):
            tx._sock.disable_monitor()
        mon.close(0)
    chosen = tx._candidates.pop(msg.transport, None)
    if chosen is None:
        raise ProtocolError(f"decode chose {msg.transport!r}, which this sender did not offer")
    for other in tx._candidates.values():  # offered, not chosen
        other.close()
    tx._candidates.clear()
    tx._data = chosen
    tx.transport = msg.transport
    tx.session_id = msg.session_id  # names this session on data connections (no credential)
    layouts = [KVLayout.from_descriptor(msgspec.structs.asdict(d)) for d in msg.layouts]
    for lay in layouts:
        lay.check_compatible(tx.layout)
    tx.dst_layout = layouts[0]
    tx.segments = [
        g for g in tp_segments(tx.layout, layouts[0]) if g.src_rank == tx.layout.tp_rank and g.dst_rank in msg.ranks
    ]
    chosen.connect(msg, layouts, deadline)  # closed by _teardown on failure
    tx.stats["path"] = chosen.path  # e.g. "tcp staged (kernel gather)"
    tx._last_heard = time.monotonic()


class _Busy(Exception):
    """Decode dropped this handshake (under load), or its connection ended: start again."""


def _handshake(
    tx: Opener, hello: Callable[[], bytes], mon: zmq.Socket[bytes], deadline: float, timeout_s: float
) -> Welcome:
    """Hello, Challenge, Auth, Welcome; started again (a new Hello, the codec's numbering
    going on) while decode answers busy or drops the connection, until ``deadline``."""
    nonces: list[bytes] = []
    busy = 0
    while True:
        try:
            nonces.append(hello())
            while True:
                # each Challenge read with a codec of its own: decode numbers its answer to a
                # Hello from 1 when it holds no handshake for the connection (it dropped one),
                # so the answers to two Hellos may carry one number; the nonce tells which counts
                ch = reply(
                    tx, min(deadline, time.monotonic() + _HELLO_RETRY_S), timeout_s, final=deadline, mon=mon, own=True
                )
                if ch is None:
                    nonces.append(hello())
                    continue
                if not isinstance(ch, Challenge):
                    raise ProtocolError(f"expected challenge, got {type(ch).__name__}")
                if ch.hello_nonce == nonces[-1]:
                    break
                if ch.hello_nonce not in nonces:
                    raise ProtocolError("challenge to a hello this sender did not send")
            nonce = nonces[-1]
            # from here on the session key: HMAC(secret, our nonce, decode's fresh nonce); the
            # codec has only sent so far (each Challenge was read with a codec of its own)
            tx._codec.set_session(nonce, ch.nonce)
            key = mask_instance_key(
                instance_key_of(tx.instance, tx.options.instance_key), tx._codec.key, nonce, ch.nonce
            )
            tx._sock.send_multipart(tx._codec.encode(Auth(ch.nonce, key)))
            msg = reply(tx, deadline, timeout_s, mon=mon)
            if not isinstance(msg, Welcome):
                raise ProtocolError(f"expected welcome, got {type(msg).__name__}")
            return msg
        except _Busy as exc:
            busy += 1
            tx.stats["handshake_retries"] = busy
            if time.monotonic() >= deadline:
                raise PdkvTimeoutError(
                    f"decode did not complete the handshake within {timeout_s}s: {exc} ({busy} tries)"
                ) from None
            fresh = Codec(tx.options.secret)
            fresh.continue_from(tx._codec)  # decode refuses a sequence number it has seen
            tx._codec = fresh
            # a short jittered pause: retries of many senders do not come back together
            time.sleep(min(max(0.0, deadline - time.monotonic()), random.uniform(0.005, 0.05) * min(busy, 4)))


def reply(
    tx: Opener,
    until: float,
    timeout_s: float,
    final: float | None = None,
    mon: zmq.Socket[bytes] | None = None,
    own: bool = False,
) -> Message | None:
    """The next handshake message from decode (``own``: read with a codec of its own, no
    numbering carried over); a refusal raises PeerError, "busy" (or,
    with ``mon``, the connection ending and zmq connecting anew) raises _Busy. Nothing by
    ``until``: None when ``final`` (a later deadline) is given and not yet past, else
    PdkvTimeoutError."""
    poller = None
    if mon is not None:
        poller = zmq.Poller()
        poller.register(tx._sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
    while True:
        wait_ms = max(1, int((until - time.monotonic()) * 1000))
        if poller is None:
            if tx._sock.poll(wait_ms):
                break
            until = -math.inf  # nothing within the time given
        else:
            ready = dict(poller.poll(wait_ms))
            if mon is not None and mon in ready:
                ev = recv_monitor_message(mon)
                st = tx.stats
                if ev["event"] & _LOST:
                    st["handshake_disconnects"] = st.get("handshake_disconnects", 0) + 1
                elif st.get("handshake_disconnects", 0) > st.get("handshake_reconnects", 0):
                    # connected anew after decode closed the connection: what was in flight is lost
                    st["handshake_reconnects"] = st["handshake_disconnects"]
                    raise _Busy("decode closed the control connection during the handshake")
                continue
            if tx._sock in ready:
                break
        if time.monotonic() < until:
            continue
        if final is not None and time.monotonic() < final:
            return None
        raise PdkvTimeoutError(f"decode did not answer the handshake within {timeout_s}s (is it running?)")
    frames = tx._sock.recv_multipart()
    try:
        msg = (Codec(tx.options.secret) if own else tx._codec).decode(frames)
    except ProtocolError:
        refusal = Codec(None).decode(frames) if is_unauthenticated(frames) else None  # sent unauthenticated
        if not isinstance(refusal, ErrorMsg):
            raise
        msg = refusal
    if isinstance(msg, ErrorMsg):
        if msg.code == "busy":
            raise _Busy(f"decode was busy: {msg.message}")
        raise PeerError(f"decode refused the session: {msg.message}")
    return msg
