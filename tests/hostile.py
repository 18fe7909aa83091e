"""Helpers for the hostile-input tests: a hand-driven prefill session (the real handshake
over a raw DEALER socket, then any message, well-formed or not) and raw data connections.
An attacker in these tests has exactly what the helper is given: with ``secret=None`` and
a decode that has a secret, it has only what an observer of the wire would have."""

from __future__ import annotations

import os
import socket

import zmq

from pdkv import KVLayout
from pdkv.procs import boot_id
from pdkv.protocol import (
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Codec,
    ErrorMsg,
    Hello,
    Message,
    Welcome,
    data_auth_mac,
    is_unauthenticated,
    layout_desc,
    mask_instance_key,
    new_nonce,
)
from pdkv.transfer import FRAME_HEADER

AUTH_HEADER = FRAME_HEADER.pack(b"PDKV", 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


class RawSession:
    """A prefill control session driven by hand. ``welcome`` is decode's Welcome (or None
    when ``complete=False`` stops after the Hello)."""

    def __init__(
        self,
        address: str,
        layout: KVLayout,
        *,
        secret: bytes | None = None,
        instance: str = "evil",
        transports: tuple[str, ...] = ("tcp",),
        complete: bool = True,
        ctx: zmq.Context | None = None,
        timeout_ms: int = 5000,
        instance_key: bytes | None = None,
        refusable: bool = False,
        pid: int | None = None,
    ) -> None:
        """``instance_key``: the 32-byte key this session proves (default: its own random
        one, a stranger to every other session); ``refusable``: a refusal after Auth is
        kept in ``refusal`` instead of failing; ``pid``: the process its Hello names (default
        this one)."""
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.codec = Codec(secret)
        self.timeout_ms = timeout_ms
        self.nonce = new_nonce()
        self.hello_frames = self.codec.encode(
            Hello(
                PROTOCOL_VERSION,
                instance,
                layout.tp_rank,
                layout.tp_size,
                layout_desc(layout),
                list(transports),
                boot_id(),
                os.getpid() if pid is None else pid,
                self.nonce,
            )
        )
        self.instance_key = instance_key if instance_key is not None else os.urandom(32)
        self.welcome: Welcome | None = None
        self.refusal: ErrorMsg | None = None
        self.challenge: Challenge | None = None
        self.sock.send_multipart(self.hello_frames)
        if not complete:
            return
        ch = self.recv()
        assert isinstance(ch, Challenge), ch
        self.challenge = ch
        self.codec.set_session(self.nonce, ch.nonce)
        self.send(Auth(ch.nonce, mask_instance_key(self.instance_key, self.codec.key, self.nonce, ch.nonce)))
        w = self.recv()
        if refusable and isinstance(w, ErrorMsg):
            self.refusal = w
            return
        assert isinstance(w, Welcome), w
        self.welcome = w

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(self.codec.encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_ms: int | None = None) -> Message:
        assert self.sock.poll(self.timeout_ms if timeout_ms is None else timeout_ms), "decode did not answer"
        frames = self.sock.recv_multipart()
        if is_unauthenticated(frames) and self.codec.key is not None:
            return Codec(None).decode(frames)
        return self.codec.decode(frames)

    def data_conn(self, data_address: str) -> socket.socket:
        assert self.welcome is not None
        return data_conn(data_address, self.welcome.session_id, self.codec.key)

    def close(self) -> None:
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()


def data_conn(data_address: str, session_id: bytes, key: bytes | None, timeout: float = 5.0) -> socket.socket:
    """A data connection authenticated for the session ``session_id`` with session key ``key``
    (what a peer holding that session has)."""
    host, port = data_address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        s.sendall(AUTH_HEADER + session_id)
        nonce = recv_n(s, 16)
        s.sendall(data_auth_mac(key, session_id, nonce))
        if recv_n(s, 1) != b"\x01":
            raise ConnectionError("decode refused the data connection")
    except OSError:
        s.close()
        raise
    return s


def sender_conn(data_address: str, tx) -> socket.socket:
    """A data connection of a real PrefillSender's session (white box: its session id and key)."""
    return data_conn(data_address, tx.session_id, tx.session_key)


def recv_n(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        k = s.recv(n - len(out))
        if not k:
            raise ConnectionError("closed")
        out += k
    return out
