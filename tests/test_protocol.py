from __future__ import annotations

import hashlib
import hmac
import os
import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv import KVLayout
from pdkv.errors import AuthenticationError, PdkvError, ProtocolError
from pdkv.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Auth,
    Bye,
    Challenge,
    Codec,
    Complete,
    CompleteBatch,
    ErrorMsg,
    GrantBatch,
    GrantMsg,
    Heartbeat,
    Hello,
    IpcAlloc,
    IpcRank,
    IpcSection,
    LayerBatch,
    LayerDone,
    NixlHello,
    NixlOffer,
    NixlRegionDesc,
    Outcome,
    OutcomeBatch,
    RdmaEndpointDesc,
    RdmaOffer,
    RdmaRegionDesc,
    ReserveBatch,
    ReserveReq,
    Welcome,
    data_auth_mac,
    is_unauthenticated,
    layout_desc,
    mask_instance_key,
    new_nonce,
    pack_frame,
    session_key,
    unpack_frame,
)
from pdkv.protocol import limits as L

SECRET = b"k" * 32


def hello(**kw):
    base = dict(
        version=PROTOCOL_VERSION,
        instance="p",
        tp_rank=0,
        tp_size=1,
        layout=layout_desc(KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4)),
        transports=["tcp"],
        boot_id="b",
        pid=1,
        nonce=b"n" * 16,
    )
    base.update(kw)
    return Hello(**base)


def test_round_trip_and_replay():
    a, b = Codec(SECRET), Codec(SECRET)
    for m in (
        hello(),
        Challenge(b"c" * 16, b"n" * 16),
        Auth(b"c" * 16, b"k" * 32),
        Bye("sender closed"),
        ReserveReq("r", 10),
        GrantMsg("r", "buffer", "buffer", [1, 2], 5, 1.0),
        LayerDone("r", 5, [0, 1]),
        LayerBatch(3, [("r", 5, 0), ("s", 6, 2)]),
        Complete("r", 5, True),
        CompleteBatch([("r", 5, True, ""), ("s", 6, False, "disk on fire")]),
        Outcome("r", "received"),
        OutcomeBatch([("r", "received", ""), ("s", "expired", "lease ran out")]),
        ReserveBatch([("r", 10), ("s", 20)]),
        GrantBatch([GrantMsg("r", "buffer", "buffer", [1, 2], 5, 1.0), GrantMsg("s", "rejected", reason="full")]),
        Heartbeat(1.0),
    ):
        frames = a.encode(m)
        assert b.decode(frames) == m
    with pytest.raises(ProtocolError, match="replayed"):
        b.decode(frames)


def test_authentication():
    f = Codec(SECRET).encode(ReserveReq("r", 1))
    with pytest.raises(AuthenticationError, match="authentication failed"):
        Codec(b"z" * 32).decode(f)
    with pytest.raises(AuthenticationError, match="no shared secret"):
        Codec(None).decode(f)
    with pytest.raises(AuthenticationError):
        Codec(SECRET).decode(Codec(None).encode(ReserveReq("r", 1)))
    # a session key differs from the secret and per nonce
    assert session_key(SECRET, b"a" * 16, b"b" * 16) != session_key(SECRET, b"a" * 16, b"c" * 16)
    with pytest.raises(ValueError, match="16 bytes"):
        Codec(b"short")


def welcome(**kw):
    base = dict(
        version=PROTOCOL_VERSION,
        instance="d",
        tp_size=1,
        ranks=[0],
        layouts=[layout_desc(KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4))],
        transport="shm",
        shm_names=["pdkv-1-x"],
        buffer_blocks=8,
        data_addr="",
        session_id=b"s" * 16,
    )
    base.update(kw)
    return Welcome(**base)


def ipc(**kw):
    rank = dict(rank=0, device_uuid="GPU-0", num_blocks=1, allocs=[IpcAlloc(handle=b"h" * 64, size=1)], regions=[])
    rank.update(kw)
    return welcome(cuda=IpcSection(ranks=[IpcRank(**rank)]))


RDMA_EP = RdmaEndpointDesc(qpn=1, psn=1, lid=0, gid="g", mtu=4096)
RDMA_REGION = RdmaRegionDesc(rank=0, addr=1, length=1, rkey=1)


def _round_trip(msg):
    return Codec(None).decode(Codec(None).encode(msg))


# Every limit on the wire: (name, message with the value, last accepted, first refused, what
# the refusal names). The schema's refusals name the field's path, the semantic checks say why.
BOUNDS = [
    ("MAX_ID", lambda n: ReserveReq("r" * n, 1), L.MAX_ID, L.MAX_ID + 1, "$[1].request_id"),
    ("MAX_ID, at least 1", lambda n: ReserveReq("r" * n, 1), 1, 0, "$[1].request_id"),
    ("MAX_ID in a batch", lambda n: LayerBatch(0, [("r" * n, 1, 0)]), L.MAX_ID, L.MAX_ID + 1, "$[1].items[0][0]"),
    ("MAX_ID in a grant", lambda n: GrantBatch([GrantMsg("r" * n, "rejected")]), 1, 0, "$[1].items[0].request_id"),
    ("MAX_NUM_TOKENS", lambda n: ReserveReq("r", n), L.MAX_NUM_TOKENS, L.MAX_NUM_TOKENS + 1, "$[1].num_tokens"),
    ("MAX_NUM_TOKENS, at least 1", lambda n: ReserveReq("r", n), 1, 0, "$[1].num_tokens"),
    ("MAX_NUM_TOKENS in a batch", lambda n: ReserveBatch([("r", n)]), L.MAX_NUM_TOKENS, L.MAX_NUM_TOKENS + 1,
     "$[1].items[0][1]"),
    ("MAX_NUM_TOKENS in a batch, at least 1", lambda n: ReserveBatch([("r", n)]), 1, 0, "$[1].items[0][1]"),
    ("MAX_PID", lambda n: hello(pid=n), L.MAX_PID, L.MAX_PID + 1, "$[1].pid"),
    ("MAX_PID, not negative", lambda n: hello(pid=n), 0, -1, "$[1].pid"),
    ("MAX_TP: tp_size", lambda n: hello(tp_size=n), L.MAX_TP, L.MAX_TP + 1, "$[1].tp_size"),
    ("MAX_TP: tp_size at least 1", lambda n: hello(tp_size=n), 1, 0, "$[1].tp_size"),
    ("MAX_TP: tp_rank", lambda n: hello(tp_rank=n, tp_size=L.MAX_TP), L.MAX_TP - 1, L.MAX_TP, "$[1].tp_rank"),
    ("MAX_TP: tp_rank not negative", lambda n: hello(tp_rank=n), 0, -1, "$[1].tp_rank"),
    ("MAX_TP: tp_rank below tp_size", lambda n: hello(tp_rank=n, tp_size=3), 2, 3, "tp_rank=3 is not below tp_size=3"),
    ("MAX_TP: per-rank lists", lambda n: welcome(ranks=[0] * n), L.MAX_TP, L.MAX_TP + 1, "$[1].ranks"),
    ("MAX_TP: layouts", lambda n: welcome(layouts=welcome().layouts * n), L.MAX_TP, L.MAX_TP + 1, "$[1].layouts"),
    ("MAX_TP: segment names", lambda n: welcome(shm_names=["s"] * n), L.MAX_TP, L.MAX_TP + 1, "$[1].shm_names"),
    ("MAX_TP: nixl regions", lambda n: welcome(nixl=NixlOffer(agent="a", metadata=b"", regions=[
        NixlRegionDesc(rank=0, addr=0, length=1)] * n)), L.MAX_TP, L.MAX_TP + 1, "$[1].nixl.regions"),
    ("MAX_TP: ipc ranks", lambda n: welcome(cuda=IpcSection(ranks=ipc().cuda.ranks * n)), L.MAX_TP, L.MAX_TP + 1,
     "$[1].cuda.ranks"),
    ("MAX_LAYERS", lambda n: LayerBatch(n, [("r", 1, 0)]), L.MAX_LAYERS - 1, L.MAX_LAYERS, "$[1].layer"),
    ("MAX_LAYERS, not negative", lambda n: LayerBatch(n, [("r", 1, 0)]), 0, -1, "$[1].layer"),
    ("MAX_LAYERS in LayerDone", lambda n: LayerDone("r", 1, [n]), L.MAX_LAYERS - 1, L.MAX_LAYERS, "$[1].layers[0]"),
    ("MAX_LAYERS_PER_MESSAGE", lambda n: LayerDone("r", 1, [0] * n), L.MAX_LAYERS_PER_MESSAGE,
     L.MAX_LAYERS_PER_MESSAGE + 1, "$[1].layers"),
    ("MAX_LAYERS_PER_MESSAGE, at least 1", lambda n: LayerDone("r", 1, [0] * n), 1, 0, "$[1].layers"),
    ("MAX_BATCH_ITEMS: reserves", lambda n: ReserveBatch([(f"r{i}", 1) for i in range(n)]), L.MAX_BATCH_ITEMS,
     L.MAX_BATCH_ITEMS + 1, "$[1].items"),
    ("MAX_BATCH_ITEMS: reserves, at least 1", lambda n: ReserveBatch([("r", 1)] * n), 1, 0, "$[1].items"),
    ("MAX_BATCH_ITEMS: grants", lambda n: GrantBatch([GrantMsg("r", "rejected")] * n), L.MAX_BATCH_ITEMS,
     L.MAX_BATCH_ITEMS + 1, "$[1].items"),
    ("MAX_BATCH_ITEMS: grants, at least 1", lambda n: GrantBatch([GrantMsg("r", "rejected")] * n), 1, 0,
     "$[1].items"),
    ("MAX_BATCH_ITEMS: layers", lambda n: LayerBatch(0, [("r", 1, 0)] * n), L.MAX_BATCH_ITEMS,
     L.MAX_BATCH_ITEMS + 1, "$[1].items"),
    ("MAX_BATCH_ITEMS: layers, at least 1", lambda n: LayerBatch(0, [("r", 1, 0)] * n), 1, 0, "$[1].items"),
    ("MAX_BATCH_ITEMS: completes", lambda n: CompleteBatch([("r", 1, True, "")] * n), L.MAX_BATCH_ITEMS,
     L.MAX_BATCH_ITEMS + 1, "$[1].items"),
    ("MAX_BATCH_ITEMS: completes, at least 1", lambda n: CompleteBatch([("r", 1, True, "")] * n), 1, 0,
     "$[1].items"),
    ("MAX_BATCH_ITEMS: outcomes", lambda n: OutcomeBatch([("r", "failed", "")] * n), L.MAX_BATCH_ITEMS,
     L.MAX_BATCH_ITEMS + 1, "$[1].items"),
    ("MAX_BATCH_ITEMS: outcomes, at least 1", lambda n: OutcomeBatch([("r", "failed", "")] * n), 1, 0,
     "$[1].items"),
    ("MAX_BATCH_BLOCKS", lambda n: GrantBatch([GrantMsg("r", "buffer", "buffer", [1] * (n // 2), 1),
                                               GrantMsg("s", "buffer", "buffer", [1] * (n - n // 2), 1)]),
     L.MAX_BATCH_BLOCKS, L.MAX_BATCH_BLOCKS + 1, f"grant batch carries {L.MAX_BATCH_BLOCKS + 1} block ids"),
    ("MAX_GRANT_BLOCKS", lambda n: GrantMsg("r", "buffer", "buffer", [1] * n, 1), L.MAX_GRANT_BLOCKS,
     L.MAX_GRANT_BLOCKS + 1, "$[1].blocks"),
    ("MAX_GRANT_BLOCKS: the widest grant", lambda n: GrantMsg("r" * L.MAX_ID, "buffer", "buffer",
                                                              [L.MAX_U32] * n, L.MAX_TOKEN, 1.0),
     L.MAX_GRANT_BLOCKS, L.MAX_GRANT_BLOCKS + 1, "$[1].blocks"),
    ("MAX_GRANT_BLOCKS: LayerDone's count", lambda n: LayerDone("r", 1, [0], n), L.MAX_GRANT_BLOCKS,
     L.MAX_GRANT_BLOCKS + 1, "$[1].blocks"),
    ("MAX_GRANT_BLOCKS: LayerDone's count, not negative", lambda n: LayerDone("r", 1, [0], n), 0, -1, "$[1].blocks"),
    ("MAX_GRANT_BLOCKS: a batch item's count", lambda n: LayerBatch(0, [("r", 1, n)]), L.MAX_GRANT_BLOCKS,
     L.MAX_GRANT_BLOCKS + 1, "$[1].items[0][2]"),
    ("MAX_GRANT_BLOCKS: a batch item's count, not negative", lambda n: LayerBatch(0, [("r", 1, n)]), 0, -1,
     "$[1].items[0][2]"),
    ("MAX_U32: block ids", lambda n: GrantMsg("r", "buffer", "buffer", [n], 1), L.MAX_U32, L.MAX_U32 + 1,
     "$[1].blocks[0]"),
    ("MAX_U32: block ids, not negative", lambda n: GrantMsg("r", "buffer", "buffer", [n], 1), 0, -1,
     "$[1].blocks[0]"),
    ("MAX_U32: prefix blocks", lambda n: GrantMsg("r", "gpu", prefix_blocks=n), L.MAX_U32, L.MAX_U32 + 1,
     "$[1].prefix_blocks"),
    ("MAX_TOKEN", lambda n: LayerDone("r", n, [0]), L.MAX_TOKEN, L.MAX_TOKEN + 1, "$[1].token"),
    ("MAX_TOKEN, not negative", lambda n: LayerDone("r", n, [0]), 0, -1, "$[1].token"),
    ("MAX_TOKEN in a batch", lambda n: CompleteBatch([("r", n, True, "")]), L.MAX_TOKEN, L.MAX_TOKEN + 1,
     "$[1].items[0][1]"),
    ("MAX_TOKEN in a grant", lambda n: GrantBatch([GrantMsg("r", "buffer", "buffer", [1], n)]), L.MAX_TOKEN,
     L.MAX_TOKEN + 1, "$[1].items[0].token"),
    ("MAX_NAME", lambda n: hello(instance="p" * n), L.MAX_NAME, L.MAX_NAME + 1, "$[1].instance"),
    ("MAX_NAME, at least 1", lambda n: hello(instance="p" * n), 1, 0, "instance name must be 1-256 printable"),
    ("MAX_NAME: data address", lambda n: welcome(data_addr="a" * n), L.MAX_NAME, L.MAX_NAME + 1, "$[1].data_addr"),
    ("MAX_SHORT", lambda n: hello(boot_id="b" * n), L.MAX_SHORT, L.MAX_SHORT + 1, "$[1].boot_id"),
    ("MAX_SHORT: a layout's dtype", lambda n: hello(layout=msgspec.structs.replace(hello().layout, dtype="f" * n)),
     L.MAX_SHORT, L.MAX_SHORT + 1, "$[1].layout.dtype"),
    ("MAX_TEXT", lambda n: Abort("r", "x" * n), L.MAX_TEXT, L.MAX_TEXT + 1, "$[1].reason"),
    ("MAX_TEXT: a batch item's error", lambda n: CompleteBatch([("r", 1, False, "x" * n)]), L.MAX_TEXT,
     L.MAX_TEXT + 1, "$[1].items[0][3]"),
    ("MAX_TEXT: a batch item's reason", lambda n: OutcomeBatch([("r", "failed", "x" * n)]), L.MAX_TEXT,
     L.MAX_TEXT + 1, "$[1].items[0][2]"),
    ("MAX_ERROR_MESSAGE", lambda n: ErrorMsg("c", "x" * n), L.MAX_ERROR_MESSAGE, L.MAX_ERROR_MESSAGE + 1,
     "$[1].message"),
    ("MAX_TRANSPORTS", lambda n: hello(transports=["tcp"] * n), L.MAX_TRANSPORTS, L.MAX_TRANSPORTS + 1,
     "$[1].transports"),
    ("MAX_NIXL_METADATA", lambda n: hello(nixl=NixlHello(agent="a", metadata=b"m" * n)), L.MAX_NIXL_METADATA,
     L.MAX_NIXL_METADATA + 1, "$[1].nixl.metadata"),
    ("MAX_IPC_HANDLE", lambda n: ipc(allocs=[IpcAlloc(handle=b"h" * n, size=1)]), L.MAX_IPC_HANDLE,
     L.MAX_IPC_HANDLE + 1, "$[1].cuda.ranks[0].allocs[0].handle"),
    ("MAX_IPC_ENTRIES", lambda n: ipc(regions=[[0, 0, 0]] * n), L.MAX_IPC_ENTRIES, L.MAX_IPC_ENTRIES + 1,
     "$[1].cuda.ranks[0].regions"),
    ("MAX_TP: Welcome.rdma.regions", lambda n: welcome(rdma=RdmaOffer(endpoint=RDMA_EP, regions=[RDMA_REGION] * n)),
     L.MAX_TP, L.MAX_TP + 1, "$[1].rdma.regions"),
    ("MAX_NIXL_METADATA: NixlOffer.metadata", lambda n: welcome(nixl=NixlOffer(agent="d", metadata=b"m" * n,
     regions=[])), L.MAX_NIXL_METADATA, L.MAX_NIXL_METADATA + 1, "$[1].nixl.metadata"),
    ("MAX_REGION_CELLS", lambda n: welcome(nixl=NixlOffer(agent="d", metadata=b"m", regions=[
     NixlRegionDesc(rank=0, addr=1, length=1, cells=[(1, 1)] * n)])), L.MAX_REGION_CELLS, L.MAX_REGION_CELLS + 1,
     "$[1].nixl.regions[0].cells"),
    ("NONCE_BYTES", lambda n: Challenge(b"c" * n, b"n" * 16), L.NONCE_BYTES, L.NONCE_BYTES + 1, "$[1].nonce"),
    ("NONCE_BYTES, not fewer", lambda n: Challenge(b"c" * n, b"n" * 16), L.NONCE_BYTES, L.NONCE_BYTES - 1,
     "$[1].nonce"),
    ("NONCE_BYTES: Hello's", lambda n: hello(nonce=b"n" * n), L.NONCE_BYTES, L.NONCE_BYTES + 1, "$[1].nonce"),
    ("NONCE_BYTES: a session id", lambda n: welcome(session_id=b"s" * n), L.NONCE_BYTES, L.NONCE_BYTES - 1,
     "$[1].session_id"),
    ("MAX_BINDING", lambda n: ReserveReq("r", 1, b"b" * n), L.MAX_BINDING, L.MAX_BINDING + 1, "$[1].binding"),
    ("MAX_BINDING: a batch's", lambda n: ReserveBatch([("r", 1)], [b"b" * n]), L.MAX_BINDING, L.MAX_BINDING + 1,
     "$[1].bindings[0]"),
    ("MAX_BINDING: one per item", lambda n: ReserveBatch([("r", 1), ("s", 1)], [b""] * n), 2, 1,
     "1 bindings for 2 items"),
    ("INSTANCE_KEY_BYTES", lambda n: Auth(b"c" * 16, b"k" * n), L.INSTANCE_KEY_BYTES, L.INSTANCE_KEY_BYTES + 1,
     "$[1].instance_key"),
    ("INSTANCE_KEY_BYTES, not fewer", lambda n: Auth(b"c" * 16, b"k" * n), L.INSTANCE_KEY_BYTES,
     L.INSTANCE_KEY_BYTES - 1, "$[1].instance_key"),
    ("PROTOCOL_VERSION", lambda n: hello(version=n), L.PROTOCOL_VERSION, L.PROTOCOL_VERSION + 1,
     f"protocol version {L.PROTOCOL_VERSION + 1} is not supported"),
    ("PROTOCOL_VERSION, not older", lambda n: welcome(version=n), L.PROTOCOL_VERSION, L.PROTOCOL_VERSION - 1,
     f"protocol version {L.PROTOCOL_VERSION - 1} is not supported"),
]  # fmt: skip


@pytest.mark.parametrize("make, accepted, refused, where", [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_every_wire_limit_accepts_its_last_value_and_refuses_the_next(make, accepted, refused, where):
    msg = make(accepted)
    assert _round_trip(msg) == msg
    with pytest.raises(ProtocolError, match=re.escape(where)):
        _round_trip(make(refused))


def test_every_limit_is_bounded_by_a_test_and_stated_in_the_docs():
    """Each integer limit of ``pdkv.protocol.limits`` has its boundary row above, and the docs'
    table of wire limits states each with the value the code has."""
    names = [n for n in L.__all__ if isinstance(getattr(L, n), int)]
    tested = {re.split(r"[:,]| in ", b[0])[0] for b in BOUNDS} | {"MAC_BYTES", "MAX_MESSAGE_BYTES"}
    assert sorted(set(names) - tested) == []
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "SECURITY.md")) as f:
        table = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", f.read(), re.M))
    for n in names:
        assert n in table, f"docs/SECURITY.md's wire limits do not state {n}"
        stated = table[n].replace(",", "").replace(" ", "")
        value = eval(stated.replace("^", "**"), {})  # "2^16", "2^32 - 1", "1024": arithmetic only
        assert value == getattr(L, n), (n, table[n])
    for n in ("GRANT_OUTCOMES", "OUTCOME_STATES"):
        assert table[n] == ", ".join(getattr(L, n)), n


STATES = "received, failed, expired, aborted, rejected"


@pytest.mark.parametrize(
    "msg, what",
    [
        (ReserveReq("r\nforged log line", 1), "request_id of length 17 is not printable"),
        (Abort("r\x1b[2J", "x"), "request_id of length 5 is not printable"),
        (LayerBatch(0, [("r", 1, 0), ("s\n", 1, 0)]), "a batch item's request id is not printable"),
        (CompleteBatch([("r\t", 1, True, "")]), "a batch item's request id is not printable"),
        (OutcomeBatch([("r\r", "failed", "")]), "a batch item's request id is not printable"),
        (ReserveBatch([("r", 1), ("\x00", 1)]), "a batch item's request id is not printable"),
        (GrantBatch([GrantMsg("r", "rejected"), GrantMsg("s\n", "rejected")]),
         "request_id of length 2 is not printable"),
        (hello(instance="p\n"), "instance name must be 1-256 printable characters"),
        (Outcome("r", "teleported"), f"outcome state 'teleported' is not one of {STATES}"),
        (Outcome("r", "t" * 40), f"outcome state '{'t' * 32}' is not one of {STATES}"),
        (OutcomeBatch([("r", "failed", ""), ("s", "done", "")]), f"outcome state 'done' is not one of {STATES}"),
        (OutcomeBatch([("r", "d" * 40, "")]), f"outcome state '{'d' * 32}' is not one of {STATES}"),
        (ReserveBatch([("r", 1), ("s", 2), ("r", 3)]),
         "reserve batch names a request id twice (one reservation is answered once)"),
        (GrantMsg("r", "stolen"), "grant outcome 'stolen' is not one of gpu, buffer, queued, rejected"),
        (GrantMsg("r", "s" * 40), f"grant outcome '{'s' * 32}' is not one of gpu, buffer, queued, rejected"),
        (GrantBatch([GrantMsg("r", "rejected"), GrantMsg("s", "stolen")]),
         "grant outcome 'stolen' is not one of gpu, buffer, queued, rejected"),
    ],
)  # fmt: skip
def test_semantic_validation(msg, what):
    with pytest.raises(ProtocolError) as e:
        _round_trip(msg)
    assert str(e.value) == what


def test_each_outcome_and_state_is_accepted():
    for state in L.OUTCOME_STATES:
        assert _round_trip(Outcome("r", state)).state == state
        assert _round_trip(OutcomeBatch([("r", state, "")])).items[0][1] == state
    for outcome in L.GRANT_OUTCOMES:
        assert _round_trip(GrantBatch([GrantMsg("r", outcome)])).items[0].outcome == outcome


def test_the_wire_form_is_pinned():
    """What each message is on the wire (tags, field names, defaults): a change here breaks
    every peer of another version, so it must be a protocol version's."""
    enc = Codec(None)
    plain = [msgspec.msgpack.decode(unpack_frame(enc.encode(m)[0])[1]) for m in (
        GrantMsg("r", "rejected"),
        LayerDone("r", 7, [1]),
        Complete("r", 7, True),
        Outcome("r", "failed"),
        Abort("r"),
        Bye(),
        Heartbeat(1.5),
        ErrorMsg("busy", "m"),
        ReserveReq("r", 3),
        Challenge(b"c" * 16, b"n" * 16),
    )]  # fmt: skip
    assert plain == [
        [1, {"type": "grant", "request_id": "r", "outcome": "rejected", "location": "", "blocks": [], "token": 0,
             "lease_s": 0.0, "reason": "", "prefix_blocks": 0}],
        [2, {"type": "layer", "request_id": "r", "token": 7, "layers": [1], "blocks": 0}],
        [3, {"type": "complete", "request_id": "r", "token": 7, "ok": True, "error": ""}],
        [4, {"type": "outcome", "request_id": "r", "state": "failed", "reason": ""}],
        [5, {"type": "abort", "request_id": "r", "reason": ""}],
        [6, {"type": "bye", "reason": ""}],
        [7, {"type": "hb", "t": 1.5}],
        [8, {"type": "error", "code": "busy", "message": "m", "request_id": ""}],
        [9, {"type": "reserve", "request_id": "r", "num_tokens": 3, "binding": b""}],
        [10, {"type": "challenge", "nonce": b"c" * 16, "hello_nonce": b"n" * 16}],
    ]  # fmt: skip
    tags = {"hello": hello(), "auth": Auth(b"c" * 16, b"k" * 32), "welcome": welcome(),
            "reserves": ReserveBatch([("r", 1)]), "grants": GrantBatch([GrantMsg("r", "rejected")]),
            "layers": LayerBatch(0, [("r", 1, 0)]), "completes": CompleteBatch([("r", 1, True, "")]),
            "outcomes": OutcomeBatch([("r", "failed", "")])}  # fmt: skip
    for tag, m in tags.items():
        assert msgspec.msgpack.decode(unpack_frame(enc.encode(m)[0])[1])[1]["type"] == tag
    wire = msgspec.msgpack.decode(unpack_frame(enc.encode(hello())[0])[1])[1]
    assert (wire["rdma"], wire["cuda"], wire["nixl"]) == (None, None, None)
    assert {k: wire["layout"][k] for k in ("extra_layers", "mla", "scales", "tp_size", "tp_rank")} == {
        "extra_layers": 0, "mla": False, "scales": False, "tp_size": 1, "tp_rank": 0}  # fmt: skip
    with pytest.raises(AttributeError):
        tags["hello"].pid = 2  # messages are immutable, and hashable where their fields are
    assert hash(Outcome("r", "failed")) == hash(Outcome("r", "failed"))


def test_the_largest_message_is_decoded_and_one_byte_more_is_refused_unread():
    """MAX_MESSAGE_BYTES: the codec refuses a larger body before decoding it, both ways."""

    def body_len(m):  # the codec's body, measured without its limit: the envelope is [seq, message]
        return len(msgspec.msgpack.encode((1, m)))

    names = ["n" * L.MAX_NAME] * 3900  # 3 bytes of header each
    while L.MAX_MESSAGE_BYTES - body_len(welcome(shm_names=names + ["n" * L.MAX_NAME])) >= 34:
        names.append("n" * L.MAX_NAME)
    if L.MAX_MESSAGE_BYTES - body_len(welcome(shm_names=names)) - 2 > 254:
        names.append("n" * 200)
    short = L.MAX_MESSAGE_BYTES - body_len(welcome(shm_names=names)) - 2  # 32-255 characters: 2 bytes of header
    m = welcome(shm_names=names + ["n" * short])
    assert len(unpack_frame(Codec(None).encode(m)[0])[1]) == L.MAX_MESSAGE_BYTES
    assert _round_trip(m) == m
    bigger = welcome(shm_names=names + ["n" * (short + 1)])
    with pytest.raises(ProtocolError, match=f"message of {L.MAX_MESSAGE_BYTES + 1} bytes exceeds"):
        Codec(None).encode(bigger)
    c = Codec(None)
    with pytest.raises(ProtocolError, match=f"message of {L.MAX_MESSAGE_BYTES + 1} bytes exceeds"):
        c.decode([pack_frame(b"", b"\x00" * (L.MAX_MESSAGE_BYTES + 1))])
    with pytest.raises(ProtocolError, match="invalid message"):  # read, not refused for its size
        c.decode([pack_frame(b"", b"\x00" * L.MAX_MESSAGE_BYTES)])


def test_a_frame_carries_a_mac_of_mac_bytes_or_none():
    body = unpack_frame(Codec(None).encode(Bye())[0])[1]
    assert unpack_frame(pack_frame(b"", body)) == (b"", body)
    assert unpack_frame(pack_frame(b"m" * L.MAC_BYTES, body)) == (b"m" * L.MAC_BYTES, body)
    for n in (1, L.MAC_BYTES - 1, L.MAC_BYTES + 1):
        with pytest.raises(ProtocolError, match="malformed frame"):
            unpack_frame(pack_frame(b"m" * n, body))
    with pytest.raises(ProtocolError, match="malformed frame"):
        unpack_frame(bytes([L.MAC_BYTES]) + b"m" * (L.MAC_BYTES - 1))  # shorter than its MAC
    assert unpack_frame(bytes([L.MAC_BYTES]) + b"m" * L.MAC_BYTES) == (b"m" * L.MAC_BYTES, b"")
    assert is_unauthenticated(Codec(None).encode(Bye()))
    assert not is_unauthenticated(Codec(SECRET).encode(Bye()))
    assert not is_unauthenticated(Codec(None).encode(Bye()) * 2)
    assert len(Codec(SECRET).encode(Bye())[0]) == len(Codec(None).encode(Bye())[0]) + L.MAC_BYTES


def test_a_nested_unknown_field_and_a_trailing_envelope_element_are_refused():
    """Every nested record refuses a key it does not know (a Hello whose layout has an extra
    key), and the envelope refuses an element past (seq, message)."""
    enc = msgspec.msgpack.Encoder()
    good = msgspec.msgpack.decode(enc.encode(hello()))  # a dict, bytes kept
    assert Codec(None).decode([pack_frame(b"", enc.encode([1, good]))]) == hello()
    bad = {**good, "layout": {**good["layout"], "extra": 1}}
    with pytest.raises(ProtocolError, match=r"unknown field `extra`.*layout"):
        Codec(None).decode([pack_frame(b"", enc.encode([1, bad]))])
    w = msgspec.msgpack.decode(enc.encode(welcome(rdma=RdmaOffer(endpoint=RDMA_EP, regions=[RDMA_REGION]))))
    w["rdma"]["regions"][0]["extra"] = 1
    with pytest.raises(ProtocolError, match=r"unknown field `extra`.*rdma.regions\[0\]"):
        Codec(None).decode([pack_frame(b"", enc.encode([1, w]))])
    with pytest.raises(ProtocolError, match="invalid message"):
        Codec(None).decode([pack_frame(b"", enc.encode([1, good, "trailing"]))])


def test_ipc_rank_allocs_at_their_first_refused_size():
    """``IpcRank.allocs`` at MAX_IPC_ENTRIES decodes, one more is refused by the schema (the
    schema read directly: that many entries pass the 1 MiB message cap, which the codec
    checks first)."""
    from pdkv.protocol.codec import _Envelope

    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(_Envelope)
    for n, ok in ((L.MAX_IPC_ENTRIES, True), (L.MAX_IPC_ENTRIES + 1, False)):
        body = enc.encode([1, ipc(allocs=[IpcAlloc(handle=b"", size=0)] * n)])
        if ok:
            assert len(dec.decode(body).msg.cuda.ranks[0].allocs) == n
        else:
            with pytest.raises(msgspec.ValidationError, match=re.escape("$[1].cuda.ranks[0].allocs")):
                dec.decode(body)


def _records():
    """Every struct class of the wire schema (messages and nested records)."""
    import pdkv.protocol.messages as m

    return [
        c
        for c in vars(m).values()
        if isinstance(c, type) and issubclass(c, msgspec.Struct) and c.__module__ == m.__name__
    ]


@pytest.mark.parametrize("cls", _records(), ids=lambda c: c.__name__)
def test_every_wire_record_is_frozen_and_refuses_unknown_fields(cls):
    """A decoded message is never changed after its checks (frozen), and no record takes a
    field the schema does not name."""
    cfg = cls.__struct_config__
    assert cfg.frozen, f"{cls.__name__} is not frozen"
    assert cfg.forbid_unknown_fields, f"{cls.__name__} takes unknown fields"


def test_schema_violations():
    enc = msgspec.msgpack.Encoder()
    dec = Codec(None)
    for body in (
        [1, {"type": "nope"}],
        [1, {"type": "reserve", "request_id": 5, "num_tokens": 1}],
        [1, {"type": "reserve", "request_id": "r", "num_tokens": 1, "extra": 1}],
        "junk",
        [1],
    ):
        with pytest.raises(ProtocolError, match="invalid message"):
            dec.decode([pack_frame(b"", enc.encode(body))])
    with pytest.raises(ProtocolError, match="1 frame"):
        dec.decode([b"", b""])
    for bad in (b"", b"\x05abc", b"\x20" + b"m" * 31):  # no length, a bad MAC length, a short MAC
        with pytest.raises(ProtocolError, match="malformed"):
            dec.decode([bad])
    with pytest.raises(ProtocolError, match="exceeds"):
        dec.decode([pack_frame(b"", b"\0" * (2 << 20))])


@given(st.lists(st.binary(max_size=300), min_size=0, max_size=3))
def test_fuzzed_frames_raise_only_protocol_errors_and_change_nothing(frames):
    for secret in (None, SECRET):
        c = Codec(secret)
        before = c._recv_seq
        try:
            c.decode(frames)
        except ProtocolError:
            assert c._recv_seq == before
        except PdkvError as exc:  # pragma: no cover - a wrong class escaped
            raise AssertionError(f"unexpected {type(exc)}") from exc


@given(st.binary(max_size=2000))
def test_fuzzed_msgpack_bodies(body):
    c = Codec(None)
    try:
        c.decode([b"", body])
    except ProtocolError:
        assert c._recv_seq == -1


def test_key_derivations_are_pinned():
    """The session key, a data connection's MAC and the instance key's mask, against their
    specification (HMAC-SHA256 over labelled inputs) and against fixed answers: both ends of
    every version must derive the same bytes."""
    secret, pn, dn, sid, nonce, key = b"s" * 32, b"p" * 16, b"d" * 16, b"i" * 16, b"n" * 16, b"k" * 32

    def h(k, m):
        return hmac.new(k, m, hashlib.sha256).digest()

    sk = session_key(secret, pn, dn)
    assert sk == h(secret, b"pdkv-session" + pn + dn)
    assert sk.hex() == "84e1be4b1211d4174c3e1a667ff0af4fc17b4c58f22444a545da1e00311781e0"
    assert session_key(secret, dn, pn) != sk  # the nonces' order matters
    mac = data_auth_mac(sk, sid, nonce)
    assert mac == h(h(sk, b"pdkv-data-key"), b"pdkv-data-auth" + sid + nonce)
    assert mac.hex() == "2066015ab94ea25be17e3dddd6c10228a02af2cc8e14d1464f79dd6fe7d85989"
    open_mac = data_auth_mac(None, sid, nonce)  # no secret: keyed by the session id, authenticates nothing
    assert open_mac == h(sid, b"pdkv-data-auth" + sid + nonce)
    assert open_mac.hex() == "5cc3a3b882b328e20f114edcc97f3e424b8dc8e2160820f1985596e990c1c406"
    masked = mask_instance_key(key, sk, pn, dn)
    assert masked == bytes(a ^ b for a, b in zip(key, h(sk, b"pdkv-instance-pad" + pn + dn)))
    assert masked.hex() == "c3072c8eb26a8ea6f0bedb2d1972c50220f58c833e528056ce3b4ba4f87f0aa4"
    assert mask_instance_key(masked, sk, pn, dn) == key  # the same call unmasks
    unkeyed = mask_instance_key(key, None, pn, dn)
    assert unkeyed == bytes(a ^ b for a, b in zip(key, h(b"pdkv-no-secret", b"pdkv-instance-pad" + pn + dn)))
    assert unkeyed.hex() == "606b60494c32ed7124fb98e9e2f7277200b18ac322823dc3c9760b37cf7505dc"
    with pytest.raises(ValueError):
        mask_instance_key(key[:-1], sk, pn, dn)  # a key of the wrong length is never cut to fit
    a, b = new_nonce(), new_nonce()
    assert len(a) == L.NONCE_BYTES and a != b


def test_a_session_codec_signs_under_the_session_key():
    pn, dn = b"p" * 16, b"d" * 16
    a, b = Codec(SECRET), Codec(SECRET)
    a.set_session(pn, dn)
    assert a.key == session_key(SECRET, pn, dn) and a.secret == SECRET
    with pytest.raises(AuthenticationError):  # still under the secret
        b.decode(a.encode(Bye()))
    b.set_session(pn, dn)
    assert b.decode(a.encode(Bye())) == Bye()
    c = Codec(SECRET)
    c.set_session(pn, b"x" * 16)  # another session's key
    with pytest.raises(AuthenticationError):
        c.decode(a.encode(Bye()))
    n = Codec(None)
    n.set_session(pn, dn)  # without a secret there is no key to derive
    assert n.key is None and is_unauthenticated(n.encode(Bye()))


def test_a_codec_started_again_numbers_on():
    a, b = Codec(None), Codec(None)
    for _ in range(3):
        b.decode(a.encode(Bye()))
    again = Codec(None)
    again.continue_from(a)
    assert b.decode(again.encode(Heartbeat(1.0))) == Heartbeat(1.0)  # seq 4, after the 3 seen
    with pytest.raises(ProtocolError, match=r"^replayed or reordered message \(seq 1 after 4\)$"):
        b.decode(Codec(None).encode(Bye()))
    behind = Codec(None)
    behind.continue_from(Codec(None))
    again.continue_from(behind)  # never numbers back
    assert b.decode(again.encode(Bye())) == Bye()


def test_a_secret_is_at_least_16_bytes():
    assert Codec(b"x" * 16).secret == b"x" * 16
    for bad in (b"x" * 15, "x" * 32, bytearray(32)):
        with pytest.raises(ValueError, match="^secret must be bytes of at least 16 bytes$"):
            Codec(bad)


def test_the_codecs_refusals_are_named():
    f = Codec(SECRET).encode(Bye())
    with pytest.raises(AuthenticationError) as e:
        Codec(b"z" * 32).decode(f)
    assert str(e.value) == "message authentication failed (wrong or missing shared secret)"
    with pytest.raises(AuthenticationError) as e:
        Codec(None).decode(f)
    assert str(e.value) == "peer authenticates its messages, but no shared secret is configured here"
    with pytest.raises(ProtocolError) as e:
        unpack_frame(b"\x05abc")
    assert str(e.value) == "malformed frame (expected a MAC length of 0 or 32, the MAC, the body)"

    class Deep:  # what the decoder may raise besides its own errors (RecursionError, MemoryError)
        def decode(self, body):
            raise RecursionError("maximum recursion depth exceeded")

    c = Codec(None)
    c._dec = Deep()
    with pytest.raises(ProtocolError) as e:
        c.decode(Codec(None).encode(Bye()))
    assert str(e.value) == "invalid message (RecursionError)" and e.value.__cause__ is None
    with pytest.raises(ProtocolError) as e:
        Codec(None).decode([b"\x00" + msgspec.msgpack.encode([1, {"type": "bye", "reason": 5}])])
    assert str(e.value) == "invalid message: Expected `str`, got `int` - at `$[1].reason`"


def test_a_fault_in_validation_is_a_protocol_error(monkeypatch):
    """Whatever the semantic checks raise, the codec says ProtocolError and keeps its place."""
    import pdkv.protocol.codec as codec

    def broken(m):
        raise KeyError("a bug")

    monkeypatch.setattr(codec, "validate", broken)
    c = Codec(None)
    with pytest.raises(ProtocolError) as e:
        c.decode(Codec(None).encode(Bye()))
    assert str(e.value) == "invalid message (KeyError: 'a bug')" and c._recv_seq == -1


def test_wire_records_as_plain_values():
    from pdkv.protocol import to_plain

    assert to_plain(None) == {}
    rec = NixlHello(agent="a", metadata=b"\x00m")
    assert to_plain(rec) == {"agent": "a", "metadata": b"\x00m"}  # bytes kept, not base64
    assert to_plain(hello().layout)["num_layers"] == 2
