"""Who a prefill session is, and what decode holds for a session being set up: the
instance key each rank proves (``SenderOptions.instance_key``, or one per name and
process), its fingerprint, a handshake waiting for its Auth, and the Hello nonces seen
lately (a replayed Hello is refused)."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass

from ...layout import KVLayout, Segment
from ...protocol import Codec, Hello

__all__ = ["Handshake", "HelloNonces", "instance_key_of", "key_fingerprint"]

_process_keys: dict[str, bytes] = {}
_keys_lock = threading.Lock()


def instance_key_of(instance: str, given: bytes | None) -> bytes:
    """The 32-byte key a sender proves: of ``given`` (``SenderOptions.instance_key``), or
    this process's own random key for ``instance``."""
    if given is not None:
        return hashlib.sha256(b"pdkv-instance-key" + given).digest()
    with _keys_lock:
        return _process_keys.setdefault(instance, os.urandom(32))


def key_fingerprint(key: bytes) -> bytes:
    """What decode keeps of an instance's key."""
    return hashlib.sha256(b"pdkv-instance-fp" + key).digest()


@dataclass
class Handshake:
    """A Hello answered with a Challenge, waiting for the peer's Auth (holds no resources)."""

    codec: Codec
    hello: Hello
    layout: KVLayout
    segs: list[Segment]
    transport: str
    same_host: bool
    nonce: bytes
    deadline: float


class HelloNonces:
    """Hello nonces seen within the handshake window: a replayed Hello is refused at once,
    before it costs a pending handshake (bounded: the oldest are forgotten first)."""

    def __init__(self, window_s: float, cap: int = 1 << 16) -> None:
        self.window_s, self.cap = window_s, cap
        self._seen: dict[bytes, float] = {}

    def fresh(self, nonce: bytes, now: float) -> bool:
        """Whether ``nonce`` is new (and remember it)."""
        if nonce in self._seen:
            return False
        while len(self._seen) >= self.cap or (self._seen and next(iter(self._seen.values())) < now):
            del self._seen[next(iter(self._seen))]
        self._seen[nonce] = now + self.window_s
        return True
