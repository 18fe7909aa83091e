"""Typed, validated control messages between prefill and decode.

Messages are :mod:`msgspec` structs encoded as msgpack and decoded against the schema:
nothing is unpickled, no field is typed ``Any`` (every nested record is a struct of its
own, so input nested deeper than the schema is refused at its first level), and every
failure to decode, whatever its cause, is :class:`~pdkv.errors.ProtocolError`.

With a shared secret every frame carries an HMAC-SHA256 over ``seq || body`` and sequence
numbers must grow. The handshake is a challenge-response: ``Hello`` (prefill's nonce,
MAC'd under the secret) -> ``Challenge`` (decode's fresh nonce, under the secret) ->
``Auth`` (decode's nonce echoed, under the session key HMAC(secret, both nonces)) ->
``Welcome`` (under the session key). A replayed ``Hello`` gets a new nonce and cannot be
completed without the secret. Data connections authenticate against the session with
:func:`data_auth_mac` over a nonce decode sends on that connection.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Annotated, Any

import msgspec

from .errors import AuthenticationError, ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_MESSAGE_BYTES",
    "MAX_ID",
    "MAX_NUM_TOKENS",
    "pack_frame",
    "unpack_frame",
    "is_unauthenticated",
    "Hello",
    "Challenge",
    "Auth",
    "Welcome",
    "LayoutDesc",
    "RdmaEndpointDesc",
    "RdmaRegionDesc",
    "RdmaOffer",
    "CudaDesc",
    "IpcAlloc",
    "IpcRank",
    "IpcSection",
    "data_auth_mac",
    "layout_desc",
    "to_plain",
    "ReserveReq",
    "ReserveBatch",
    "GrantMsg",
    "GrantBatch",
    "GRANT_OUTCOMES",
    "LayerDone",
    "LayerBatch",
    "CompleteBatch",
    "Complete",
    "Outcome",
    "OutcomeBatch",
    "OUTCOME_STATES",
    "Abort",
    "Heartbeat",
    "Bye",
    "MAX_PID",
    "MAX_TP",
    "MAX_LAYERS",
    "MAX_BATCH_ITEMS",
    "INSTANCE_KEY_BYTES",
    "mask_instance_key",
    "printable",
    "ErrorMsg",
    "Message",
    "Codec",
    "session_key",
]

_MAC_BYTES = 32  # HMAC-SHA256
# requests one batch message may name: what a sender sends (SEND_BATCH), so that one message
# costs decode's control loop a bounded time (~15 ms at 512 reservations on the dev VM)
MAX_BATCH_ITEMS = 512
MAX_BATCH_ERROR = 1024  # characters of one batch item's error or reason (senders send 512 items a message)
# 2: one frame per message (MAC length, MAC, body); 3: LayerBatch, CompleteBatch, cuda_ipc;
# 4: OutcomeBatch, ReserveBatch, GrantBatch; 5: challenge-response handshake, typed nested
# records, data connections authenticated by a MAC over decode's nonce; 6: a prefill
# instance proves its identity (an instance key, masked under the session key, in Auth), the
# Challenge echoes the Hello's nonce, Bye ends a session, every wire integer bounded
PROTOCOL_VERSION = 6
GRANT_OUTCOMES = ("gpu", "buffer", "queued", "rejected")
MAX_BATCH_BLOCKS = 1 << 16  # block ids one GrantBatch may carry (its grants' blocks together)
MAX_GRANT_BLOCKS = 1 << 17  # block ids one grant may carry: 5 bytes each below 2^32, so it fits MAX_MESSAGE_BYTES
OUTCOME_STATES = ("received", "failed", "expired", "aborted", "rejected")
MAX_MESSAGE_BYTES = 1 << 20  # no control message is legitimately larger
MAX_ID = 256  # characters of a request id
MAX_NUM_TOKENS = 1 << 26  # tokens one reservation may ask for
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT: no process id is larger
MAX_TP = 4096  # tensor-parallel ranks of one instance
MAX_LAYERS = 1 << 16  # layers (with extra layers) of one cache
INSTANCE_KEY_BYTES = 32  # a prefill instance's key (SenderOptions.instance_key), and its mask


class _Base(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True):
    pass


class _Rec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A nested record inside a message (untagged)."""


_Name = Annotated[str, msgspec.Meta(max_length=256)]
_Short = Annotated[str, msgspec.Meta(max_length=64)]
_U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack carries up to 2^64 - 1
_Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
_Key = Annotated[bytes, msgspec.Meta(min_length=INSTANCE_KEY_BYTES, max_length=INSTANCE_KEY_BYTES)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID)]
_Token = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP)]
_Layer = Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAYERS)]
_Text = Annotated[str, msgspec.Meta(max_length=1024)]  # an error or a reason


class LayoutDesc(_Rec, kw_only=True, frozen=True):
    """:meth:`pdkv.KVLayout.descriptor` on the wire (checked again by ``from_descriptor``)."""

    format: _Short
    version: int
    num_layers: _U32
    kv_heads: _U32
    head_dim: _U32
    tokens_per_block: _U32
    dtype: _Short
    extra_layers: _U32 = 0
    mla: bool = False
    scales: bool = False
    tp_size: _U32 = 1
    tp_rank: _U32 = 0
    token_major: bool = False
    block_bytes: _U64 = 0


class RdmaEndpointDesc(_Rec, kw_only=True, frozen=True):
    """A queue pair's record (``pdkv.rdma.EndpointInfo``)."""

    qpn: _U32
    psn: _U32
    lid: _U32
    gid: _Short
    mtu: _U32


class RdmaRegionDesc(_Rec, kw_only=True, frozen=True):
    """A decode rank's registered buffer: where RDMA writes may land, and its key."""

    rank: _U32
    addr: _U64
    length: _U64
    rkey: _U32


class RdmaOffer(_Rec, kw_only=True, frozen=True):
    """``Welcome.rdma``: decode's queue pair and each rank's registered region."""

    endpoint: RdmaEndpointDesc
    regions: Annotated[list[RdmaRegionDesc], msgspec.Meta(max_length=4096)]


MAX_NIXL_METADATA = 1 << 16  # bytes of a NIXL agent's metadata in a handshake (a UCX agent's: ~300)


class NixlHello(_Rec, kw_only=True, frozen=True):
    """``Hello.nixl``: prefill's NIXL agent, by name and metadata."""

    agent: _Name
    metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_NIXL_METADATA)]


class NixlRegionDesc(_Rec, kw_only=True, frozen=True):
    """A decode rank's buffer as registered with decode's NIXL agent."""

    rank: _U32
    addr: _U64
    length: _U64


class NixlOffer(_Rec, kw_only=True, frozen=True):
    """``Welcome.nixl``: decode's agent and each rank's registered buffer."""

    agent: _Name
    metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_NIXL_METADATA)]
    regions: Annotated[list[NixlRegionDesc], msgspec.Meta(max_length=4096)]


class CudaDesc(_Rec, kw_only=True, frozen=True):
    """``Hello.cuda``: the GPU prefill's cache lives on."""

    device_uuid: _Short


class IpcAlloc(_Rec, kw_only=True, frozen=True):
    handle: Annotated[bytes, msgspec.Meta(max_length=128)]
    size: _U64


class IpcRank(_Rec, kw_only=True, frozen=True):
    rank: _U32
    device_uuid: _Short
    num_blocks: _U32
    allocs: Annotated[list[IpcAlloc], msgspec.Meta(max_length=1 << 16)]
    # [allocation index, offset, block stride] per (layer, tensor)
    regions: Annotated[
        list[Annotated[list[_U64], msgspec.Meta(min_length=3, max_length=3)]], msgspec.Meta(max_length=1 << 16)
    ]


class IpcSection(_Rec, kw_only=True, frozen=True):
    """``Welcome.cuda`` (see :mod:`pdkv.cuda_ipc`)."""

    ranks: Annotated[list[IpcRank], msgspec.Meta(max_length=4096)]


class Hello(_Base, tag="hello", frozen=True):
    """prefill -> decode, first message of a session (MAC'd under the shared secret)."""

    version: _U32
    instance: _Name
    tp_rank: _Rank
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
    layout: LayoutDesc
    transports: Annotated[list[_Short], msgspec.Meta(max_length=16)]
    boot_id: _Short
    pid: Annotated[int, msgspec.Meta(ge=0, le=MAX_PID)]
    nonce: _Nonce
    rdma: RdmaEndpointDesc | None = None  # prefill's queue-pair record when it offers rdma
    cuda: CudaDesc | None = None  # set when prefill's cache is GPU memory
    nixl: NixlHello | None = None  # prefill's NIXL agent when it offers nixl


class Challenge(_Base, tag="challenge", frozen=True):
    """decode -> prefill, answer to a Hello (under the secret): decode's fresh nonce, and the
    Hello's (``hello_nonce``: which Hello this answers). The session key is HMAC(secret,
    prefill nonce, this nonce) from here on."""

    nonce: _Nonce
    hello_nonce: _Nonce


class Auth(_Base, tag="auth", frozen=True):
    """prefill -> decode, under the session key: proves the secret for this session
    (``nonce`` echoes the Challenge's) and carries the instance's key, masked
    (:func:`mask_instance_key`): the ranks of one prefill instance are the sessions that
    show one key."""

    nonce: _Nonce
    instance_key: _Key


class Welcome(_Base, tag="welcome", frozen=True):
    """decode -> prefill: the session is accepted; how to write into decode's memory.
    ``session_id`` names the session on data connections; it is no credential (a data
    connection also proves the session key, :func:`data_auth_mac`)."""

    version: _U32
    instance: _Name
    tp_size: _U32
    ranks: Annotated[list[_U32], msgspec.Meta(max_length=4096)]
    layouts: Annotated[list[LayoutDesc], msgspec.Meta(max_length=4096)]
    transport: _Short
    shm_names: Annotated[list[_Name], msgspec.Meta(max_length=4096)]
    buffer_blocks: _U32
    data_addr: _Name
    session_id: _Nonce
    rdma: RdmaOffer | None = None
    cuda: IpcSection | None = None  # cuda_ipc: each rank's GPU cache as IPC handles and offsets
    nixl: NixlOffer | None = None  # nixl: decode's agent and its registered buffers


class ReserveReq(_Base, tag="reserve", frozen=True):
    request_id: _Id
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NUM_TOKENS)]


class ReserveBatch(_Base, tag="reserves", frozen=True):
    """prefill -> decode: ``ReserveReq`` for every item ``(request_id, num_tokens)``, in one
    message (``reserve_many``); each item is answered on its own, in a ``GrantBatch``."""

    items: Annotated[
        list[tuple[_Id, Annotated[int, msgspec.Meta(ge=1, le=MAX_NUM_TOKENS)]]],
        msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS),
    ]


class GrantMsg(_Base, tag="grant", frozen=True):
    request_id: _Id
    outcome: _Short  # gpu | buffer | queued | rejected
    location: _Short = ""
    blocks: Annotated[list[_U32], msgspec.Meta(max_length=MAX_GRANT_BLOCKS)] = []
    token: _Token = 0
    lease_s: float = 0.0
    reason: _Text = ""
    prefix_blocks: _U32 = 0  # the prompt's first blocks decode holds already: prefill skips them


class GrantBatch(_Base, tag="grants", frozen=True):
    """decode -> prefill: the answers to one ``ReserveBatch`` (and any grants decided while
    handling it), at most ``MAX_BATCH_BLOCKS`` block ids a message."""

    items: Annotated[list[GrantMsg], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class LayerDone(_Base, tag="layer", frozen=True):
    """prefill -> decode: this rank's writes of ``layers`` for the request succeeded (shm),
    for ``blocks`` of its blocks (0: all of them; a chunk of a chunked prefill sends fewer)."""

    request_id: _Id
    token: _Token
    layers: Annotated[list[_Layer], msgspec.Meta(min_length=1, max_length=4096)]
    blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_GRANT_BLOCKS)] = 0


class LayerBatch(_Base, tag="layers", frozen=True):
    """prefill -> decode: this rank's writes of ``layer`` succeeded for every item
    ``(request_id, token, blocks)`` (blocks as in LayerDone): one message for a layer of a
    batch instead of one per request."""

    layer: _Layer
    items: Annotated[
        list[tuple[_Id, _Token, Annotated[int, msgspec.Meta(ge=0, le=MAX_GRANT_BLOCKS)]]],
        msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS),
    ]


class Complete(_Base, tag="complete", frozen=True):
    """prefill -> decode: every write of this rank for the request finished (``ok``) or not."""

    request_id: _Id
    token: _Token
    ok: bool
    error: _Text = ""


class CompleteBatch(_Base, tag="completes", frozen=True):
    """prefill -> decode: ``Complete`` for every item ``(request_id, token, ok, error)``,
    in one message (the requests of a batch finish together)."""

    items: Annotated[list[tuple[_Id, _Token, bool, _Text]], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class Outcome(_Base, tag="outcome", frozen=True):
    """decode -> prefill: the definite outcome of a request (received, failed, expired, aborted)."""

    request_id: _Id
    state: _Short
    reason: _Text = ""


class OutcomeBatch(_Base, tag="outcomes", frozen=True):
    """decode -> prefill: ``Outcome`` for every item ``(request_id, state, reason)``, in one
    message (the requests of one ``LayerBatch`` or ``CompleteBatch`` end together)."""

    items: Annotated[list[tuple[_Id, _Short, _Text]], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class Abort(_Base, tag="abort", frozen=True):
    request_id: _Id
    reason: _Text = ""


class Bye(_Base, tag="bye", frozen=True):
    """Either side: this session ends now (prefill closes its sender; decode answers with a
    Bye once the session's state is gone, and also says Bye when it closes)."""

    reason: _Text = ""


class Heartbeat(_Base, tag="hb", frozen=True):
    t: float


class ErrorMsg(_Base, tag="error", frozen=True):
    code: _Short
    message: Annotated[str, msgspec.Meta(max_length=4096)]


Message = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | ReserveReq
    | ReserveBatch
    | GrantMsg
    | GrantBatch
    | LayerDone
    | LayerBatch
    | Complete
    | CompleteBatch
    | Outcome
    | OutcomeBatch
    | Abort
    | Heartbeat
    | Bye
    | ErrorMsg
)


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


def printable(text: str) -> bool:
    """Whether a name from the wire may reach a log line as it is (no control characters,
    no line breaks)."""
    return text.isprintable()


def layout_desc(layout: object) -> LayoutDesc:
    """A :class:`~pdkv.layout.KVLayout`'s descriptor as the typed wire record."""
    return msgspec.convert(layout.descriptor(), LayoutDesc)  # type: ignore[attr-defined]


def to_plain(rec: msgspec.Struct | None) -> dict[str, Any]:
    """A nested wire record as plain dicts and lists (bytes kept), ``{}`` for None."""
    return msgspec.to_builtins(rec, builtin_types=(bytes,)) if rec is not None else {}


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
            _validate(env.msg)
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
    if not frame or frame[0] not in (0, _MAC_BYTES) or len(frame) < 1 + frame[0]:
        raise ProtocolError("malformed frame (expected a MAC length of 0 or 32, the MAC, the body)")
    n = frame[0]
    return frame[1 : 1 + n], frame[1 + n :]


def is_unauthenticated(frames: list[bytes]) -> bool:
    """Whether a message carries no MAC (a refusal to a peer whose key is unknown)."""
    return len(frames) == 1 and frames[0][:1] == b"\x00"


def _validate(m: Message) -> None:
    """Semantic checks msgspec's types cannot express."""
    rid = getattr(m, "request_id", None)
    if rid is not None and not (0 < len(rid) <= MAX_ID and rid.isprintable()):
        raise ProtocolError(f"request_id of length {len(rid)} (must be 1-{MAX_ID} printable characters)")
    items = getattr(m, "items", None)
    if items and isinstance(items[0], tuple) and not all(it[0].isprintable() for it in items):
        raise ProtocolError("a batch item's request id is not printable")
    if isinstance(m, (Hello, Welcome)) and m.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {m.version} is not supported (this pdkv speaks {PROTOCOL_VERSION})")
    if isinstance(m, Hello):
        if not (0 <= m.tp_rank < m.tp_size <= 4096):
            raise ProtocolError(f"tp_rank={m.tp_rank} tp_size={m.tp_size} are inconsistent")
        if len(m.nonce) != 16:
            raise ProtocolError("hello nonce must be 16 bytes")
        if not m.instance or not m.instance.isprintable():
            raise ProtocolError("instance name must be 1-256 printable characters")
    if isinstance(m, ReserveReq) and not (0 < m.num_tokens <= MAX_NUM_TOKENS):
        raise ProtocolError(f"num_tokens={m.num_tokens} out of range")
    if isinstance(m, LayerDone) and (not m.layers or len(m.layers) > 4096 or min(m.layers) < 0 or m.blocks < 0):
        raise ProtocolError("layer list empty, too long or negative, or a negative block count")
    if isinstance(m, LayerBatch):
        if not (0 <= m.layer < 1 << 16) or not 0 < len(m.items) <= MAX_BATCH_ITEMS:
            raise ProtocolError(f"layer batch with layer {m.layer} and {len(m.items)} items is out of range")
        for r, tok, nb in m.items:
            if not (0 < len(r) <= MAX_ID) or not 0 <= tok < 1 << 63 or nb < 0:
                raise ProtocolError("layer batch item out of range (request id, token or block count)")
    if isinstance(m, CompleteBatch):
        if not 0 < len(m.items) <= MAX_BATCH_ITEMS:
            raise ProtocolError(f"complete batch with {len(m.items)} items is out of range")
        for r, tok, _, err in m.items:
            if not (0 < len(r) <= MAX_ID) or not 0 <= tok < 1 << 63 or len(err) > MAX_BATCH_ERROR:
                raise ProtocolError("complete batch item out of range (request id, token or error length)")
    if isinstance(m, Outcome) and m.state not in OUTCOME_STATES:
        raise ProtocolError(f"outcome state {m.state[:32]!r} is not one of {', '.join(OUTCOME_STATES)}")
    if isinstance(m, OutcomeBatch):
        if not 0 < len(m.items) <= MAX_BATCH_ITEMS:
            raise ProtocolError(f"outcome batch with {len(m.items)} items is out of range")
        for r, state, reason in m.items:
            if not (0 < len(r) <= MAX_ID) or state not in OUTCOME_STATES or len(reason) > MAX_BATCH_ERROR:
                raise ProtocolError("outcome batch item out of range (request id, state or reason length)")
    if isinstance(m, ReserveBatch):
        if not 0 < len(m.items) <= MAX_BATCH_ITEMS:
            raise ProtocolError(f"reserve batch with {len(m.items)} items is out of range")
        for r, n in m.items:
            if not (0 < len(r) <= MAX_ID) or not 0 < n <= MAX_NUM_TOKENS:
                raise ProtocolError("reserve batch item out of range (request id or num_tokens)")
        if len({r for r, _ in m.items}) != len(m.items):
            raise ProtocolError("reserve batch names a request id twice (one reservation is answered once)")
    if isinstance(m, GrantBatch):
        if not 0 < len(m.items) <= MAX_BATCH_ITEMS or sum(len(g.blocks) for g in m.items) > MAX_BATCH_BLOCKS:
            raise ProtocolError(f"grant batch with {len(m.items)} items is out of range")
        for g in m.items:
            _validate(g)
    if isinstance(m, GrantMsg) and m.outcome not in GRANT_OUTCOMES:
        raise ProtocolError(f"grant outcome {m.outcome[:32]!r} is not one of {', '.join(GRANT_OUTCOMES)}")
    if isinstance(m, GrantMsg) and (len(m.blocks) > MAX_GRANT_BLOCKS or (m.blocks and min(m.blocks) < 0)):
        raise ProtocolError("grant block list out of range")
    for f in ("token",):
        v = getattr(m, f, 0)
        if not 0 <= v < 1 << 63:
            raise ProtocolError(f"{f} out of range")
