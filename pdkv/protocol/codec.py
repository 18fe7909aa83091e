"""The codec of the control channel: one frame a message (the MAC's length, the MAC, the
msgpack body), HMAC-SHA256 under the secret or the session key, growing sequence numbers,
decoding against the schema and the semantic checks (``messages.validate``); and the key
derivations both ends make (session key, data-connection MAC, the instance key's mask).
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec

from ..errors import AuthenticationError, ProtocolError
from .limits import MAC_BYTES, MAX_MESSAGE_BYTES
from .messages import Message, validate

__all__ = [
    "Codec",
    "pack_frame",
    "unpack_frame",
    "is_unauthenticated",
    "session_key",
    "new_nonce",
    "data_auth_mac",
    "mask_instance_key",
]


class _Envelope(msgspec.Struct, forbid_unknown_fields=True, frozen=True, array_like=True):
    seq: int
    msg: Message


def session_key(secret: bytes, prefill_nonce: bytes, decode_nonce: bytes) -> bytes:
    """Per-session MAC key: HMAC(secret, both nonces). Old sessions' frames do not verify."""
    return hmac.new(secret, b"pdkv-session" + prefill_nonce + decode_nonce, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(16)


def mask_instance_key(key: bytes, session_key: bytes | None, prefill_nonce: bytes, decode_nonce: bytes) -> bytes:
    """``key`` XOR a pad only this session's two ends can make (HMAC under the session key,
    over both nonces); the same call unmasks. Without a secret the pad is made from the
    nonces alone, which a reader of the control traffic also sees: unauthenticated operation
    trusts the network."""
    pad_key = session_key if session_key is not None else b"pdkv-no-secret"
    pad = hmac.new(pad_key, b"pdkv-instance-pad" + prefill_nonce + decode_nonce, hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(key, pad, strict=True))


def data_auth_mac(session_key: bytes | None, session_id: bytes, nonce: bytes) -> bytes:
    """What a data connection sends to prove its session: HMAC-SHA256 under a key derived
    from the session key, over the session id and the nonce decode sent on this
    connection. Without a secret (``session_key`` None) the key is the session id, which
    authenticates nothing: unauthenticated operation trusts the network."""
    key = hmac.new(session_key, b"pdkv-data-key", hashlib.sha256).digest() if session_key else session_id
    return hmac.new(key, b"pdkv-data-auth" + session_id + nonce, hashlib.sha256).digest()


class Codec:
    """Encodes and validates frames for one direction of one session.

    Parameters
    ----------
    secret:
        Shared secret, or ``None`` for unauthenticated operation.
    """

    def __init__(self, secret: bytes | None = None) -> None:
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
            raise ValueError("secret must be bytes of at least 16 bytes")
        self.secret = secret
        self.key: bytes | None = secret  # the handshake uses the secret; then the session key
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(_Envelope)
        self._send_seq = 0
        self._recv_seq = -1

    def continue_from(self, other: Codec) -> None:
        """Number this codec's messages on from ``other``'s (a handshake started again on
        one connection: the peer's codec refuses a sequence number it has seen)."""
        self._send_seq = max(self._send_seq, other._send_seq)

    def set_session(self, prefill_nonce: bytes, decode_nonce: bytes) -> None:
        if self.secret is not None:
            self.key = session_key(self.secret, prefill_nonce, decode_nonce)

    def encode(self, msg: Message) -> list[bytes]:
        """Return the frames to send: one, :func:`pack_frame` of the MAC and the body
        (each zmq frame costs a send on a hot path, so there is one)."""
        self._send_seq += 1
        body = self._enc.encode(_Envelope(self._send_seq, msg))
        if len(body) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
        mac = hmac.new(self.key, body, hashlib.sha256).digest() if self.key is not None else b""
        return [pack_frame(mac, body)]

    def decode(self, frames: list[bytes]) -> Message:
        """Validate and decode frames; raise ProtocolError (AuthenticationError for MACs).

        Nothing changes when a frame is refused, except that the sequence number of an
        accepted frame is remembered.
        """
        if len(frames) != 1:
            raise ProtocolError(f"expected 1 frame, got {len(frames)}")
        mac, body = unpack_frame(frames[0])
        if len(body) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
        if self.key is not None:
            want = hmac.new(self.key, body, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, want):
                raise AuthenticationError("message authentication failed (wrong or missing shared secret)")
        elif mac:
            raise AuthenticationError("peer authenticates its messages, but no shared secret is configured here")
        try:
            env = self._dec.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ProtocolError(f"invalid message: {exc}") from None
        except Exception as exc:  # RecursionError, MemoryError, anything: never past the codec
            raise ProtocolError(f"invalid message ({type(exc).__name__})") from None
        if env.seq <= self._recv_seq:
            raise ProtocolError(f"replayed or reordered message (seq {env.seq} after {self._recv_seq})")
        try:
            validate(env.msg)
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(f"invalid message ({type(exc).__name__}: {exc})") from None
        self._recv_seq = env.seq
        return env.msg


def pack_frame(mac: bytes, body: bytes) -> bytes:
    """One message frame: a byte with the MAC's length (0: unauthenticated, or 32), the
    MAC, the msgpack body."""
    return bytes((len(mac),)) + mac + body


def unpack_frame(frame: bytes) -> tuple[bytes, bytes]:
    """``(mac, body)`` of a frame; ProtocolError if it is malformed."""
    frame = bytes(frame)
    if not frame or frame[0] not in (0, MAC_BYTES) or len(frame) < 1 + frame[0]:
        raise ProtocolError("malformed frame (expected a MAC length of 0 or 32, the MAC, the body)")
    n = frame[0]
    return frame[1 : 1 + n], frame[1 + n :]


def is_unauthenticated(frames: list[bytes]) -> bool:
    """Whether a message carries no MAC (a refusal to a peer whose key is unknown)."""
    return len(frames) == 1 and frames[0][:1] == b"\x00"
