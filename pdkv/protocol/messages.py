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

from typing import Annotated, Any, Literal

import msgspec

from ..errors import ProtocolError
from .limits import (
    GRANT_OUTCOMES,
    INSTANCE_KEY_BYTES,
    MAX_BATCH_BLOCKS,
    MAX_BATCH_ITEMS,
    MAX_BINDING,
    MAX_ERROR_MESSAGE,
    MAX_GRANT_BLOCKS,
    MAX_ID,
    MAX_IPC_ENTRIES,
    MAX_IPC_HANDLE,
    MAX_LAYERS,
    MAX_LAYERS_PER_MESSAGE,
    MAX_NAME,
    MAX_NIXL_METADATA,
    MAX_NUM_TOKENS,
    MAX_PID,
    MAX_REGION_CELLS,
    MAX_SHORT,
    MAX_TEXT,
    MAX_TOKEN,
    MAX_TP,
    MAX_TRANSPORTS,
    MAX_U32,
    NONCE_BYTES,
    OUTCOME_STATES,
    PROTOCOL_VERSION,
)

__all__ = [
    "LayoutDesc",
    "RdmaEndpointDesc",
    "RdmaRegionDesc",
    "RdmaOffer",
    "NixlHello",
    "NixlRegionDesc",
    "NixlOffer",
    "CudaDesc",
    "IpcAlloc",
    "IpcRank",
    "IpcSection",
    "Hello",
    "Challenge",
    "Auth",
    "Welcome",
    "ReserveReq",
    "ReserveBatch",
    "GrantMsg",
    "GrantBatch",
    "LayerDone",
    "LayerBatch",
    "Complete",
    "CompleteBatch",
    "Outcome",
    "OutcomeBatch",
    "Abort",
    "Bye",
    "Heartbeat",
    "ErrorMsg",
    "Message",
    "layout_desc",
    "to_plain",
    "validate",
]


class _Base(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True):
    pass


class _Rec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A nested record inside a message (untagged)."""


_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
_Short = Annotated[str, msgspec.Meta(max_length=MAX_SHORT)]
_U32 = Annotated[int, msgspec.Meta(ge=0, le=MAX_U32)]
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack carries up to 2^64 - 1
_Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
_Key = Annotated[bytes, msgspec.Meta(min_length=INSTANCE_KEY_BYTES, max_length=INSTANCE_KEY_BYTES)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID)]
_Token = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN)]
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP)]
_Layer = Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAYERS)]
_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]  # an error or a reason


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
    kv_fused: _Short = ""
    block_bytes: _U64 = 0


class RdmaEndpointDesc(_Rec, kw_only=True, frozen=True):
    """A queue pair's record (``pdkv.transfer.transports.rdma_qp.EndpointInfo``)."""

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
    regions: Annotated[list[RdmaRegionDesc], msgspec.Meta(max_length=MAX_TP)]


class NixlHello(_Rec, kw_only=True, frozen=True):
    """``Hello.nixl``: prefill's NIXL agent, by name and metadata."""

    agent: _Name
    metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_NIXL_METADATA)]


class NixlRegionDesc(_Rec, kw_only=True, frozen=True, omit_defaults=True):
    """A decode rank's buffer as registered with decode's NIXL agent: pdkv's buffer layout
    from ``addr`` (``cells`` empty, and then not on the wire), or an engine's own host pages
    (:class:`~pdkv.buffer.region.HostRegion`): ``cells`` holds ``(base, block stride)`` of
    every (layer, tensor), layer by layer, inside ``addr .. addr + length``."""

    rank: _U32
    addr: _U64
    length: _U64
    cells: Annotated[list[tuple[_U64, _U64]], msgspec.Meta(max_length=MAX_REGION_CELLS)] = []


class NixlOffer(_Rec, kw_only=True, frozen=True):
    """``Welcome.nixl``: decode's agent and each rank's registered buffer."""

    agent: _Name
    metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_NIXL_METADATA)]
    regions: Annotated[list[NixlRegionDesc], msgspec.Meta(max_length=MAX_TP)]


class CudaDesc(_Rec, kw_only=True, frozen=True):
    """``Hello.cuda``: the GPU prefill's cache lives on."""

    device_uuid: _Short


class IpcAlloc(_Rec, kw_only=True, frozen=True):
    handle: Annotated[bytes, msgspec.Meta(max_length=MAX_IPC_HANDLE)]
    size: _U64


class IpcRank(_Rec, kw_only=True, frozen=True):
    rank: _U32
    device_uuid: _Short
    num_blocks: _U32
    allocs: Annotated[list[IpcAlloc], msgspec.Meta(max_length=MAX_IPC_ENTRIES)]
    # [allocation index, offset, block stride] per (layer, tensor)
    regions: Annotated[
        list[Annotated[list[_U64], msgspec.Meta(min_length=3, max_length=3)]], msgspec.Meta(max_length=MAX_IPC_ENTRIES)
    ]


class IpcSection(_Rec, kw_only=True, frozen=True):
    """``Welcome.cuda`` (see :mod:`pdkv.transfer.transports.ipc_export`)."""

    ranks: Annotated[list[IpcRank], msgspec.Meta(max_length=MAX_TP)]


class Hello(_Base, tag="hello", frozen=True):
    """prefill -> decode, first message of a session (MAC'd under the shared secret)."""

    version: _U32
    instance: _Name
    tp_rank: _Rank
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
    layout: LayoutDesc
    transports: Annotated[list[_Short], msgspec.Meta(max_length=MAX_TRANSPORTS)]
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
    ranks: Annotated[list[_U32], msgspec.Meta(max_length=MAX_TP)]
    layouts: Annotated[list[LayoutDesc], msgspec.Meta(max_length=MAX_TP)]
    transport: _Short
    shm_names: Annotated[list[_Name], msgspec.Meta(max_length=MAX_TP)]
    buffer_blocks: _U32
    data_addr: _Name
    session_id: _Nonce
    rdma: RdmaOffer | None = None
    cuda: IpcSection | None = None  # cuda_ipc: each rank's GPU cache as IPC handles and offsets
    nixl: NixlOffer | None = None  # nixl: decode's agent and its registered buffers
    buffer_order: Literal["layer", "block"] = "layer"  # how decode's buffers lay blocks out


_Binding = Annotated[bytes, msgspec.Meta(max_length=MAX_BINDING)]


class ReserveReq(_Base, tag="reserve", frozen=True):
    """prefill -> decode: blocks for ``num_tokens``. ``binding``: opaque bytes decode keeps
    with the request (``RequestInfo.binding``), for an engine adapter to check a claim on
    the request's KV against (the vLLM connector: a digest of a capability and the prompt)."""

    request_id: _Id
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NUM_TOKENS)]
    binding: _Binding = b""


class ReserveBatch(_Base, tag="reserves", frozen=True):
    """prefill -> decode: ``ReserveReq`` for every item ``(request_id, num_tokens)``, in one
    message (``reserve_many``); each item is answered on its own, in a ``GrantBatch``."""

    items: Annotated[
        list[tuple[_Id, Annotated[int, msgspec.Meta(ge=1, le=MAX_NUM_TOKENS)]]],
        msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS),
    ]
    bindings: Annotated[list[_Binding], msgspec.Meta(max_length=MAX_BATCH_ITEMS)] = []  # none, or one per item


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
    layers: Annotated[list[_Layer], msgspec.Meta(min_length=1, max_length=MAX_LAYERS_PER_MESSAGE)]
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
    """Decode refused a message. ``request_id`` names the request it concerned (empty when
    it concerned none, e.g. a handshake); a sender fails that request by this field alone."""

    code: _Short
    message: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_MESSAGE)]
    request_id: Annotated[str, msgspec.Meta(max_length=MAX_ID)] = ""


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


def layout_desc(layout: object) -> LayoutDesc:
    """A :class:`~pdkv.layout.KVLayout`'s descriptor as the typed wire record."""
    return msgspec.convert(layout.descriptor(), LayoutDesc)  # type: ignore[attr-defined]


def to_plain(rec: msgspec.Struct | None) -> dict[str, Any]:
    """A nested wire record as plain dicts and lists (bytes kept), ``{}`` for None."""
    return msgspec.to_builtins(rec, builtin_types=(bytes,)) if rec is not None else {}


def validate(m: Message) -> None:
    """What the schema cannot say; every bound of a single field is the schema's (``limits``):
    request ids and instance names printable, the version spoken, a rank below its TP size,
    outcomes and states from their lists, a reservation batch naming each id once (and
    with no bindings or one per item), a grant
    batch's block ids together at most ``MAX_BATCH_BLOCKS``."""
    rid = getattr(m, "request_id", None)
    if rid is not None and not rid.isprintable():
        raise ProtocolError(f"request_id of length {len(rid)} is not printable")
    if isinstance(m, (ReserveBatch, LayerBatch, CompleteBatch, OutcomeBatch)):
        if not all(it[0].isprintable() for it in m.items):
            raise ProtocolError("a batch item's request id is not printable")
    if isinstance(m, (Hello, Welcome)) and m.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {m.version} is not supported (this pdkv speaks {PROTOCOL_VERSION})")
    if isinstance(m, Hello):
        if m.tp_rank >= m.tp_size:
            raise ProtocolError(f"tp_rank={m.tp_rank} is not below tp_size={m.tp_size}")
        if not m.instance or not m.instance.isprintable():
            raise ProtocolError(f"instance name must be 1-{MAX_NAME} printable characters")
    if isinstance(m, Outcome) and m.state not in OUTCOME_STATES:
        raise ProtocolError(f"outcome state {m.state[:32]!r} is not one of {', '.join(OUTCOME_STATES)}")
    if isinstance(m, OutcomeBatch):
        for _, state, _ in m.items:
            if state not in OUTCOME_STATES:
                raise ProtocolError(f"outcome state {state[:32]!r} is not one of {', '.join(OUTCOME_STATES)}")
    if isinstance(m, ReserveBatch) and len({r for r, _ in m.items}) != len(m.items):
        raise ProtocolError("reserve batch names a request id twice (one reservation is answered once)")
    if isinstance(m, ReserveBatch) and m.bindings and len(m.bindings) != len(m.items):
        raise ProtocolError(
            f"reserve batch has {len(m.bindings)} bindings for {len(m.items)} items (none, or one each)"
        )
    if isinstance(m, GrantBatch):
        n = sum(len(g.blocks) for g in m.items)
        if n > MAX_BATCH_BLOCKS:
            raise ProtocolError(f"grant batch carries {n} block ids (at most {MAX_BATCH_BLOCKS})")
        for g in m.items:
            validate(g)
    if isinstance(m, GrantMsg) and m.outcome not in GRANT_OUTCOMES:
        raise ProtocolError(f"grant outcome {m.outcome[:32]!r} is not one of {', '.join(GRANT_OUTCOMES)}")
