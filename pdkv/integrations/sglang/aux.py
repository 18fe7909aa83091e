"""A request's auxiliary data (SGLang's metadata buffers: the first output token, its
logprobs, hidden states for speculative decoding) from prefill into the slot decode chose.

The KV moves through pdkv's transports; these few bytes go in one message after it, on a
socket of their own at decode (ROUTER; prefill's DEALER): msgpack by msgspec with a strict
schema, an HMAC-SHA256 under the pair's secret. A message is at most the slot's bytes and a
little framing (:func:`max_message`; never over :data:`MAX_AUX`): zmq ends a connection that
sends more, unread. Decode writes a message only into the slot it designated for that
request, once, when every blob has exactly the slot's size; anything else is dropped and
counted, and a message that is malformed or does not verify closes its connection. The
endpoint's connections are bounded as every port of pdkv (:mod:`..core.endpoint`).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable

import msgspec
import zmq

from ...errors import PdkvError
from ..core.endpoint import Limits, RouterEndpoint

__all__ = ["MAX_AUX", "AuxMsg", "AuxServer", "AuxSender", "max_message"]

MAX_AUX = 8 << 20
_FRAMING = 1024  # msgpack framing, the field names, the id (at most 80 characters) and the MAC


def max_message(items: list[int]) -> int:
    """The largest aux message for slots of ``items`` bytes (one blob each)."""
    return min(MAX_AUX, sum(int(n) for n in items) + _FRAMING + 8 * len(items))


_MAC = b"pdkv-sglang-aux-1"


class AuxMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pid: str
    blobs: list[bytes]
    mac: bytes = b""


def _mac(secret: bytes, pid: str, blobs: list[bytes]) -> bytes:
    h = hmac.new(secret, _MAC, hashlib.sha256)
    for p in (pid.encode(), *blobs):
        h.update(len(p).to_bytes(8, "little") + p)
    return h.digest()


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(AuxMsg)


class AuxServer(RouterEndpoint):
    """Decode's aux endpoint: each verified message goes to ``on_aux(pid, blobs)``, which
    returns '' when it wrote them (counted in ``written``; else why not: the message is
    dropped and counted in ``dropped``). Ownership: the socket and its thread
    (:meth:`close`)."""

    def __init__(
        self,
        bind: str,
        secret: bytes,
        on_aux: Callable[[str, list[bytes]], str],
        *,
        max_msg: int = MAX_AUX,
        limits: Limits | None = None,
    ) -> None:
        super().__init__(bind, max_msg=max_msg, what="aux endpoint", thread_name="pdkv-sglang-aux", limits=limits)
        self._secret, self._on_aux = secret, on_aux
        self.written = 0
        self._start()

    def _serve(self, frames: list[bytes]) -> tuple[bool, str]:
        if len(frames) != 2:
            return False, "not one message"
        try:
            m = _dec.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False, "malformed"
        if not hmac.compare_digest(m.mac, _mac(self._secret, m.pid, m.blobs)):
            return False, "not authenticated"
        why = self._on_aux(m.pid, m.blobs)
        if not why:
            self.written += 1
        return True, why


class AuxSender:
    """Prefill's side: :meth:`send` posts one request's blobs to a decode's aux endpoint
    (never blocks: a decode that is gone loses it, and its request fails there)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._lock = threading.Lock()

    def send(self, address: str, pid: str, blobs: list[bytes]) -> None:
        m = AuxMsg(pid=pid, blobs=blobs, mac=_mac(self._secret, pid, blobs))
        with self._lock:
            s = self._socks.get(address)
            if s is None:
                s = self._socks[address] = self._ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 1000)
                s.setsockopt(zmq.SNDHWM, 1024)
                s.connect(address)
            try:
                s.send(_enc.encode(m), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                raise PdkvError(f"aux for {pid!r} not sent to {address}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            for s in self._socks.values():
                s.close(linger=1000)
            self._socks.clear()
        self._ctx.term()
