"""The transport interface and its registry.

A transport moves granted blocks' bytes from a prefill rank into decode's memory. It
implements two classes: :class:`SenderTransport` (prefill: offered in the hello, connected
from the welcome, writes one planned layer at a time, closes) and
:class:`ReceiverTransport` (decode: serves sessions, fences a dead peer, credits landed
bytes through its host's :meth:`ReceiverHost.credit` or has prefill report them). The
control sessions (:mod:`.prefill`, :mod:`.decode`) hold the handshake, grants, leases and
heartbeats, and pick a transport by name from the registry (:func:`register`), never by
comparing names. The values they hand a transport (grants, work items, peers, in-flight
requests) are defined here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ...errors import LayoutError, ProtocolError
from ...layout import CacheSpec, KVLayout, Segment

if TYPE_CHECKING:
    from ...buffer.region import HostRegion
    from ...buffer.shared import SharedBuffer
    from ...protocol import Codec, Hello, Message, Welcome
    from ...scheduling.scheduler import DecodeScheduler

__all__ = [
    "SendGrant",
    "RequestOutcome",
    "Waiter",
    "WriteItem",
    "LayerJob",
    "FinishJob",
    "Peer",
    "Inflight",
    "SenderHost",
    "ReceiverHost",
    "SenderTransport",
    "ReceiverTransport",
    "TransportEntry",
    "register",
    "unregister",
    "get",
    "names",
    "auto_offer",
    "report_layer",
]


# ---------------------------------------------------------------------- prefill values


@dataclass(frozen=True, slots=True)
class SendGrant:
    """What prefill may write for one request: decode block ids and the grant token."""

    request_id: str
    location: str
    blocks: tuple[int, ...]
    token: int
    lease_s: float
    prefix_blocks: int = 0  # the prompt's first blocks decode holds already: not sent


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One request's part of a layer: source block ids ``src`` of this rank's cache into
    decode blocks ``dst`` (grant indices ``first..first + len(dst)``); int64 arrays."""

    request_id: str
    grant: SendGrant
    src: Any
    dst: Any
    first: int


@dataclass(frozen=True, slots=True)
class LayerJob:
    """``send_layer``/``send_chunk``: ``(request id, source ids, first grant index)`` per
    request; ``event``: a CUDA event to wait on first."""

    layer: int
    items: list[tuple[str, Any, int]]
    event: int | None
    queued_at: float


@dataclass(frozen=True, slots=True)
class FinishJob:
    """``finish`` (``batch=False``: one Complete) or ``finish_many`` (CompleteBatch messages)."""

    request_ids: list[str]
    ok: bool
    error: str
    batch: bool


class SenderHost(Protocol):
    """What a :class:`SenderTransport` may use of its prefill session."""

    @property
    def layout(self) -> KVLayout: ...

    @property
    def cache(self) -> CacheSpec: ...

    @property
    def segments(self) -> list[Segment]: ...  # this rank's TP segments into the decode ranks it serves

    @property
    def dst_layout(self) -> KVLayout: ...

    @property
    def timeout_s(self) -> float: ...

    @property
    def session_key(self) -> bytes | None: ...  # the session's key (data connections prove it); None: no secret

    @property
    def session_id(self) -> bytes: ...

    def post(self, msg: Message) -> None: ...  # to decode, from any thread

    def add_bytes(self, n: int, frames: int = 0) -> None: ...  # written, for stats

    def fail_request(self, request_id: str, why: str) -> None: ...  # its Complete reports failure

    # nothing more can be written: every request fails (abort: decode is told to drop each now)
    def break_session(self, why: str, abort: bool = False) -> None: ...


def report_layer(host: SenderHost, layer: int, work: Sequence[WriteItem]) -> None:
    """Tell decode ``layer`` of these requests is written (``LayerBatch`` messages): a
    transport whose writes decode cannot see land (shm, cuda_ipc, nixl) reports them so."""
    from ...protocol import MAX_BATCH_ITEMS, LayerBatch

    items = [(w.request_id, w.grant.token, len(w.src)) for w in work]
    for i in range(0, len(items), MAX_BATCH_ITEMS):
        host.post(LayerBatch(layer, items[i : i + MAX_BATCH_ITEMS]))


# ---------------------------------------------------------------------- decode values


@dataclass
class Peer:
    """One authenticated prefill rank's session on decode."""

    ident: bytes
    codec: Codec
    instance: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pid: int = 0
    same_host: bool = False
    transport: str = ""
    session_id: bytes = b""
    last_seen: float = 0.0
    layout: KVLayout | None = None
    segs_by_src: dict[int, list[Segment]] = field(default_factory=dict)
    block_bytes_by_src: dict[int, int] = field(default_factory=dict)
    key_fp: bytes = b""  # fingerprint of the instance key the session proved (its identity)


@dataclass
class Inflight:
    """A request decode granted (or queued) and is receiving: the scheduler holds its
    state and lease; this holds what the transports need to check and credit writes."""

    request_id: str
    instance: str
    token: int
    blocks: list[int]
    remaining: list[int]  # bytes each layer still waits for
    src_tp: int
    completes: set[int] = field(default_factory=set)
    failed_completes: list[str] = field(default_factory=list)
    peers: set[bytes] = field(default_factory=set)
    landed: int = 0
    done: bool = False
    run_len: list[int] = field(default_factory=list)  # consecutive destination ids from index i
    location: str = "buffer"  # where the blocks are: "buffer", or "gpu" (a writes_gpu transport)
    transport: str = ""  # the granting session's transport (per-transport byte and layer counts)
    asked: int = 0  # blocks a queued request waits for (per-instance quota)
    # byte-counting transports (tcp): the (layer, source rank, segment) pieces of which
    # blocks were admitted, so no piece is written twice and a layer fills only with distinct ones
    cov: dict[tuple[int, int, int], bytearray] = field(default_factory=dict)
    # reporting transports: blocks each source rank reported for each layer
    reported: dict[tuple[int, int], int] = field(default_factory=dict)
    renewed: float = 0.0  # when a part of a layer last renewed the lease (monotonic)


class ReceiverHost(Protocol):
    """What a :class:`ReceiverTransport` may use of its decode session."""

    @property
    def scheduler(self) -> DecodeScheduler: ...

    @property
    def layouts(self) -> list[KVLayout]: ...

    @property
    def buffers(self) -> Sequence[SharedBuffer | HostRegion]: ...  # per rank, in ``layouts`` order

    @property
    def buffer_blocks(self) -> int: ...

    @property
    def specs(self) -> dict[int, CacheSpec]: ...  # decode rank -> its buffer as a cache

    @property
    def options(self) -> Any: ...  # ReceiverOptions

    @property
    def lock(self) -> threading.RLock: ...  # guards peers and in-flight requests

    @property
    def stopping(self) -> threading.Event: ...  # set when the receiver closes

    def peer(self, ident: bytes) -> Peer | None: ...

    def peer_of_session(self, session_id: bytes) -> Peer | None: ...

    def inflight_of_token(self, token: int) -> Inflight | None: ...

    def credit(self, inf: Inflight, layer: int, nbytes: int) -> None: ...  # landed bytes of a layer

    def count(self, key: str, n: int = 1) -> None: ...  # a stats counter

    def warn(self, key: str, msg: str, *args: object) -> None: ...  # rate-limited warning


# ---------------------------------------------------------------------- interface


def region_specs(welcome: Welcome, layouts: list[KVLayout], regions: dict[int, Any], what: str) -> dict[int, CacheSpec]:
    """Each decode rank's buffer as the one-sided transports address it: ``regions`` (rank
    -> a region with ``addr`` and ``length``, from the welcome's ``what`` section) checked
    to hold the buffer's blocks. A region with ``cells`` is an engine's own pages: its
    spec is those cells, each inside the region. A region missing, too small or with
    cells that do not make the rank's layout is a ProtocolError."""
    out = {}
    for rank, lay in zip(welcome.ranks, layouts):
        reg = regions.get(rank)
        if reg is not None and getattr(reg, "cells", None):
            out[rank] = _cells_spec(lay, welcome.buffer_blocks, reg, f"decode rank {rank}'s {what} region")
            continue
        need = CacheSpec.buffer_bytes(lay, welcome.buffer_blocks)
        if reg is None or reg.length < need:
            raise ProtocolError(
                f"decode rank {rank}'s {what} region is missing or smaller than the "
                f"{need} bytes {welcome.buffer_blocks} blocks need"
            )
        out[rank] = CacheSpec.for_buffer(lay, welcome.buffer_blocks, reg.addr, order=welcome.buffer_order)
    return out


def _cells_spec(lay: KVLayout, num_blocks: int, reg: Any, what: str) -> CacheSpec:
    """The spec ``reg.cells`` give (``(base, block stride)`` per layer and tensor), every
    cell's blocks inside ``reg.addr .. reg.addr + reg.length``."""
    nt, cells = len(lay.tensors), [tuple(c) for c in reg.cells]
    if len(cells) != lay.total_layers * nt:
        raise ProtocolError(
            f"{what} has {len(cells)} cells; {lay.total_layers} layers of {nt} tensors need {lay.total_layers * nt}"
        )
    try:
        spec = CacheSpec(lay, num_blocks, [cells[i * nt : (i + 1) * nt] for i in range(lay.total_layers)])
    except LayoutError as exc:
        raise ProtocolError(f"{what}: {exc}") from None
    lo, hi = int(reg.addr), int(reg.addr) + int(reg.length)
    for i, (base, stride) in enumerate(cells):
        end = base + stride * (num_blocks - 1) + lay.tensor_block_extent(i % nt)
        if base < lo or end > hi:
            raise ProtocolError(f"{what}: cell {i} ({base:#x}..{end:#x}) lies outside it ({lo:#x}..{hi:#x})")
    return spec


class SenderTransport:
    """Prefill side of a transport, one per :class:`~pdkv.transfer.PrefillSender` session.

    Made before the hello for every transport offered (it may add fields to the hello, an
    RDMA queue pair's record say); the one decode chooses is then connected, the others
    closed."""

    name: ClassVar[str]
    caches: ClassVar[frozenset[str]] = frozenset({"host"})  # source caches it sends from: "host", "gpu"
    writes_gpu: ClassVar[bool] = False  # can write grants of decode GPU blocks
    auto_rank: ClassVar[int | None] = None  # place in transport="auto"'s offer (None: only when named)

    @classmethod
    def refuses(cls, cache: CacheSpec) -> str | None:
        """Why this transport cannot send from ``cache`` (None: it can)."""
        kind = "gpu" if cache.device is not None else "host"
        if kind in cls.caches:
            return None
        return f"the {cls.name} transport sends from {' and '.join(sorted(cls.caches))} caches, not from a {kind} cache"

    @classmethod
    def available(cls) -> bool:
        """Whether ``auto`` should offer it on this host (a device present, say)."""
        return True

    def __init__(self, host: SenderHost, options: Any) -> None:
        self.host = host
        self.options = options

    def hello_fields(self) -> dict[str, Any]:
        """Fields this transport adds to the Hello (``rdma``, ``cuda``)."""
        return {}

    def connect(self, welcome: Welcome, layouts: list[KVLayout], deadline: float) -> None:
        """Decode chose this transport: open the data path its welcome describes."""

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        """Write one layer of every item (and report it where decode cannot see writes
        land). A failure of one request: ``host.fail_request``; of the whole layer: raise.
        A transport may return before the bytes are out (staged sends): it then fails the
        requests of a write that fails later, before :meth:`after_writes` callbacks run."""
        raise NotImplementedError

    def after_writes(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every write handed to :meth:`write_layer` so far has finished
        (the session's Complete goes out so): at once for a transport that writes before
        ``write_layer`` returns."""
        fn()

    @property
    def path(self) -> str:
        """The data path in use, for stats and reports (``tcp staged (kernel gather)``)."""
        return self.name

    @property
    def staging(self) -> Any:
        """The :class:`~.staging.StagedSends` of a staged path, else None."""
        return None

    def close(self) -> None:
        """Release everything; no write is in flight after it returns."""


class ReceiverTransport:
    """Decode side of a transport, one per :class:`~pdkv.transfer.DecodeReceiver` that serves it."""

    name: ClassVar[str]
    same_host: ClassVar[bool] = False  # serves only prefill ranks on decode's host
    reports_layers: ClassVar[bool] = True  # prefill reports landed layers (LayerDone); False: credit() is called
    writes_gpu: ClassVar[bool] = False  # may be granted decode GPU blocks
    # writes an engine's own host memory by address (a HostRegion in place of a SharedBuffer)
    engine_memory: ClassVar[bool] = False

    def __init__(self, host: ReceiverHost) -> None:
        self.host = host

    def refuses(self, hello: Hello) -> str | None:
        """Why this transport cannot serve the peer of ``hello`` (None: it can)."""
        return None

    def open_session(self, peer: Peer, hello: Hello) -> dict[str, Any]:
        """The peer authenticated and gets this transport: the Welcome's fields for it
        (``shm_names``, ``data_addr``, ``rdma``, ``cuda``). A PdkvError refuses the session."""
        return {}

    def fence(self, peer: Peer) -> None:
        """The peer is dead: when this returns, none of its writes can land any more."""

    def close(self) -> None:
        """Stop serving; release what it holds."""


# ---------------------------------------------------------------------- registry


@dataclass(frozen=True, slots=True)
class TransportEntry:
    name: str
    sender: type[SenderTransport]
    receiver: type[ReceiverTransport]


_REGISTRY: dict[str, TransportEntry] = {}
_REG_LOCK = threading.Lock()


def register(sender: type[SenderTransport], receiver: type[ReceiverTransport], *, replace: bool = False) -> None:
    """Make a transport available by its name to :class:`~pdkv.transfer.PrefillSender` and
    :class:`~pdkv.transfer.DecodeReceiver`. Both classes carry the same ``name``."""
    name = getattr(sender, "name", None)
    if not isinstance(name, str) or not name or name != getattr(receiver, "name", None):
        raise ValueError(
            f"register: sender and receiver must carry the same non-empty name, got "
            f"{name!r} and {getattr(receiver, 'name', None)!r}"
        )
    if name == "auto" or len(name) > 32:
        raise ValueError(f"register: {name!r} cannot name a transport")
    if not (issubclass(sender, SenderTransport) and issubclass(receiver, ReceiverTransport)):
        raise TypeError("register: give a SenderTransport and a ReceiverTransport subclass")
    if sender.writes_gpu != receiver.writes_gpu:
        raise ValueError(f"register: transport {name!r}: sender and receiver disagree on writes_gpu")
    with _REG_LOCK:
        if name in _REGISTRY and not replace:
            raise ValueError(f"register: transport {name!r} is already registered (replace=True to replace it)")
        _REGISTRY[name] = TransportEntry(name, sender, receiver)


def unregister(name: str) -> None:
    with _REG_LOCK:
        if _REGISTRY.pop(name, None) is None:
            raise ValueError(f"unregister: no transport {name!r}")


def get(name: str) -> TransportEntry:
    """The registered transport ``name``; ValueError naming the registered ones if none."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"transport {name!r} is not registered (registered: {', '.join(names())})")
    return entry


def names() -> list[str]:
    """Registered transports, in the order ``auto`` prefers them."""
    entries = list(_REGISTRY.values())
    return [e.name for e in sorted(entries, key=lambda e: (e.sender.auto_rank is None, e.sender.auto_rank or 0))]


def auto_offer(cache: CacheSpec) -> list[str]:
    """What ``transport="auto"`` offers for ``cache``: every registered transport with an
    ``auto_rank`` that can send from it and is available here, best first."""
    out = []
    for n in names():
        cls = _REGISTRY[n].sender
        if cls.auto_rank is not None and cls.refuses(cache) is None and cls.available():
            out.append(n)
    return out


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """The definite end of a request on the prefill side: ``state`` is ``received`` (prefill
    may free its blocks, decode has the data) or ``failed``/``expired``/``aborted``/``rejected``
    (prefill frees its blocks; the request must be retried or dropped)."""

    request_id: str
    state: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.state == "received"


class Waiter:
    """A value one thread sets and another waits for (a grant, an outcome)."""

    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None

    def set(self, v: Any) -> None:
        self.value = v
        self.event.set()


class LayerLog:
    """The newest ``capacity`` layers a sender wrote, each ``(layer, seconds from
    send_layer to its writes done, bytes, monotonic time its writes began, time they were
    done)``: per-layer latency, and when the link was busy. Preallocated, so a sender's
    memory is the same after its first layer as after a million; a reader keeps a sequence
    number and takes what came since (:meth:`since`)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        import numpy as np

        self.capacity = capacity
        self._rows = np.zeros((capacity, 5), np.float64)
        self._n = 0  # layers logged since the start
        self._lock = threading.Lock()

    def append(self, layer: int, seconds: float, nbytes: int, began: float, done: float) -> None:
        with self._lock:
            self._rows[self._n % self.capacity] = (layer, seconds, nbytes, began, done)
            self._n += 1

    def since(self, seq: int) -> tuple[list[tuple[int, float, int, float, float]], int]:
        """The layers logged after the first ``seq`` (those still held: at most the newest
        ``capacity``), oldest first, and the sequence number to ask from next time."""
        with self._lock:
            n = self._n
            first = max(seq, n - self.capacity, 0)
            idx = [i % self.capacity for i in range(first, n)]
            rows = self._rows[idx].tolist() if idx else []
        return [(int(r[0]), r[1], int(r[2]), r[3], r[4]) for r in rows], n

    def __len__(self) -> int:
        return min(self._n, self.capacity)

    def __iter__(self) -> Iterator[tuple[int, float, int, float, float]]:
        return iter(self.since(0)[0])
