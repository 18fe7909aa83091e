"""A request's decode-side lifecycle as values: its :class:`State`, the scheduler's
:class:`SchedulerOptions`, what it hands out (:class:`Grant`, :class:`WriteTicket`,
:class:`Reservation`, :class:`ReadyRequest`, :class:`RequestInfo`), what it reports
(:class:`EventKind`, :class:`Event`), the swap backend it drives (:class:`SwapBackend`,
:class:`SwapHandle`), and the scheduler's internal records. :mod:`pdkv.scheduling.scheduler` holds
the state machine over them and re-exports the public ones.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

__all__ = [
    "State",
    "SchedulerOptions",
    "Grant",
    "WriteTicket",
    "Reservation",
    "RequestInfo",
    "ReadyRequest",
    "Event",
    "EventKind",
    "SwapBackend",
    "SwapHandle",
    "TERMINAL",
]


class State(enum.Enum):
    """Where a request is in its decode-side lifecycle (see the module docstring)."""

    QUEUED = "queued"
    RESERVED = "reserved"
    RECEIVING = "receiving"
    RECEIVED = "received"
    SWAPPING = "swapping"
    READY = "ready"
    FINISHED = "finished"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"
    REJECTED = "rejected"


TERMINAL = frozenset({State.FINISHED, State.FAILED, State.EXPIRED, State.ABORTED, State.REJECTED})
_WRITABLE = (State.RESERVED, State.RECEIVING)
_COUNTER_OF = {
    State.FAILED: "requests_failed",
    State.EXPIRED: "requests_expired",
    State.ABORTED: "requests_aborted",
    State.FINISHED: "requests_finished",
}


@runtime_checkable
class SwapHandle(Protocol):
    """An in-flight swap. ``done()`` never blocks; ``error`` is set if it failed."""

    def done(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...


@runtime_checkable
class SwapBackend(Protocol):
    """Copies a request's buffer blocks into its GPU blocks, asynchronously."""

    def submit(self, request_id: str, buffer_blocks: Sequence[int], gpu_blocks: Sequence[int]) -> SwapHandle: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOptions:
    """Policy of a :class:`DecodeScheduler`.

    Parameters
    ----------
    lease_s:
        Seconds a reservation lives without progress; each landed layer or
        :meth:`~DecodeScheduler.renew` extends it by as much (a ``DecodeReceiver``
        renews it, at most once a second, when part of a layer arrives: chunked prefill
        writes each layer over several steps).
    direct_to_gpu:
        Reserve GPU blocks straight away when the GPU has room above ``gpu_reserve_blocks``
        and no received request waits for a swap (GPU room goes to those first: a stream of
        new requests taking it directly would starve them).
    gpu_reserve_blocks:
        GPU blocks kept free for running requests; reservations and swaps leave them alone.
    on_full:
        ``reject`` answers "no room" at once; ``queue`` queues FIFO until room appears.
    max_queue, queue_timeout_s:
        Bound on queued reservations and on how long one may wait.
    swap_order:
        ``fifo`` by arrival of the last layer (strict: no overtaking), or ``shortest``
        (fewest blocks first; a request waiting longer than ``starvation_s`` goes first).
    fence_grace_s:
        How long blocks a peer may still write stay quarantined after expiry or abort.
    max_tombstones, tombstone_s:
        Ended requests remembered so that late messages get a precise answer: the newest
        ``max_tombstones``, none ended more than ``tombstone_s`` ago (longer than a lease
        and a peer's silence bound, when a late message can still come; a steady request
        rate then holds a steady number of them).
    bind:
        ``pdkv``: pdkv takes GPU blocks from the scheduler's ``gpu`` allocator (grants
        straight into them with ``direct_to_gpu``, swaps as they free up). ``engine``: the
        engine chooses each request's GPU blocks itself, late: every grant is a buffer
        grant (``direct_to_gpu`` does not apply), a received request waits until the
        engine calls :meth:`~DecodeScheduler.bind` with its blocks, and those blocks stay
        the engine's (pdkv never frees them). vLLM's connector runs in this mode.
    """

    lease_s: float = 30.0
    direct_to_gpu: bool = True
    gpu_reserve_blocks: int = 0
    on_full: Literal["reject", "queue"] = "reject"
    max_queue: int = 4096
    queue_timeout_s: float = 60.0
    swap_order: Literal["fifo", "shortest"] = "fifo"
    starvation_s: float = 5.0
    fence_grace_s: float = 2.0
    max_tombstones: int = 65536
    tombstone_s: float = 60.0
    bind: Literal["pdkv", "engine"] = "pdkv"

    def __post_init__(self) -> None:
        for f in ("lease_s", "queue_timeout_s", "starvation_s", "tombstone_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{f}={v!r} must be a positive number of seconds")
        if not isinstance(self.fence_grace_s, (int, float)) or self.fence_grace_s < 0:
            raise ValueError(f"fence_grace_s={self.fence_grace_s!r} must be >= 0")
        for f in ("gpu_reserve_blocks", "max_queue", "max_tombstones"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{f}={v!r} must be a non-negative integer")
        if self.on_full not in ("reject", "queue"):
            raise ValueError(f"on_full={self.on_full!r} must be 'reject' or 'queue'")
        if self.bind not in ("pdkv", "engine"):
            raise ValueError(f"bind={self.bind!r} must be 'pdkv' or 'engine'")
        if self.swap_order not in ("fifo", "shortest"):
            raise ValueError(f"swap_order={self.swap_order!r} must be 'fifo' or 'shortest'")


@dataclass(frozen=True, slots=True)
class Grant:
    """Destination blocks granted to prefill for one request.

    Ownership: the blocks stay the scheduler's; the peer may write into them until the
    lease expires or the request completes.
    """

    request_id: str
    location: Literal["gpu", "buffer"]
    blocks: tuple[int, ...]
    token: int
    lease_expires: float
    lease_s: float
    prefix_blocks: int = 0  # the prompt's first blocks decode holds already (not granted, never written)


class _Writers:
    """Writes admitted into one request's blocks and not yet ended (shared by the request
    and its quarantine entries, which outlive it)."""

    __slots__ = ("n", "entries")

    def __init__(self) -> None:
        self.n = 0
        self.entries: list[_Quarantine] = []


class WriteTicket:
    """An admitted write into a request's blocks (:meth:`DecodeScheduler.begin_write`).

    Ownership: the transport holds it while bytes may still move into ``grant.blocks`` and
    gives it back once with :meth:`DecodeScheduler.end_write`; until then none of those
    blocks is handed out again, whatever happens to the request.
    """

    __slots__ = ("_fields", "_blocks", "_writers", "_open")

    def __init__(self, fields: tuple[str, str, int, float, float], blocks: list[int], writers: _Writers) -> None:
        # the grant is built when asked for: a transport admits one ticket per frame, and a
        # tuple of every block id per frame would cost O(grant) each time (the list is
        # never changed after it is granted, so keeping it is keeping the snapshot)
        self._fields = fields
        self._blocks = blocks
        self._writers = writers
        self._open = True

    @property
    def grant(self) -> Grant:
        """The grant the write was admitted under (its blocks, token and lease then)."""
        rid, loc, token, expires, lease = self._fields
        return Grant(rid, loc, tuple(self._blocks), token, expires, lease)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Reservation:
    """The answer to :meth:`DecodeScheduler.reserve`: outcome is ``gpu``, ``buffer``,
    ``queued`` or ``rejected``; ``grant`` is set for the first two."""

    request_id: str
    outcome: Literal["gpu", "buffer", "queued", "rejected"]
    grant: Grant | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ReadyRequest:
    """A request whose KV cache is in GPU blocks. Ownership: the GPU blocks are the
    engine's to use until it calls :meth:`DecodeScheduler.finish`."""

    request_id: str
    gpu_blocks: tuple[int, ...]
    num_tokens: int | None
    prefix_blocks: int = 0  # the first ``prefix_blocks`` of ``gpu_blocks`` were decode's held prefix


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    state: State
    location: str
    num_blocks: int
    layers_landed: int
    buffer_blocks: tuple[int, ...]
    gpu_blocks: tuple[int, ...]
    reason: str
    peer: str = ""  # the prefill instance that reserved it (empty once ended)
    num_tokens: int | None = None  # the tokens prefill reserved for (None: reserved by blocks, or ended)
    binding: bytes = b""  # what the reservation carried (empty once ended)


class EventKind(str, enum.Enum):
    """What an :class:`Event` reports. A ``str`` enum: ``ev.kind == "failed"`` holds too.

    ``reserved`` (blocks granted at once), ``granted`` (a queued reservation got blocks),
    ``received`` (every layer landed; a buffer request now waits for its swap), ``ready``,
    and the terminal ``failed``, ``expired``, ``aborted``, ``rejected``."""

    RESERVED = "reserved"
    GRANTED = "granted"
    RECEIVED = "received"
    READY = "ready"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"
    REJECTED = "rejected"

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        """The request ended without reaching decode's engine."""
        return self in _TERMINAL_EVENTS


_T = TypeVar("_T")


def _maker(cls: type[_T]) -> Callable[..., _T]:
    """A constructor of the frozen, slotted dataclass ``cls`` for the scheduler's hot paths:
    every field positional and required, no checks, each stored through its slot's own
    descriptor. The instance is the same as ``cls(...)`` makes (equal, frozen, its repr and
    fields); the generated ``__init__`` stores each field through ``object.__setattr__``
    (frozen), which costs twice as much: 0.98 against 0.47 us for a Grant's seven fields
    (Python 3.12, dev VM)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    env.update({f"_set_{n}": cls.__dict__[n].__set__ for n in names})
    body = "".join(f"    _set_{n}(o, {n})\n" for n in names)
    exec(f"def make({', '.join(names)}):\n    o = _new(_cls)\n{body}    return o\n", env)
    make: Callable[..., _T] = env["make"]
    make.__qualname__ = make.__name__ = f"make_{cls.__name__}"
    return make


_TERMINAL_EVENTS = frozenset({EventKind.FAILED, EventKind.EXPIRED, EventKind.ABORTED, EventKind.REJECTED})


@dataclass(frozen=True, slots=True)
class Event:
    """Something the engine or the transport should hear about: ``kind`` (an
    :class:`EventKind`), the request, its grant for ``reserved``/``granted``, a reason for
    the terminal kinds, and ``t``, the scheduler's clock when it happened. Events are made
    only while a listener is set (``listener`` or :meth:`DecodeScheduler.add_listener`)."""

    kind: EventKind
    request_id: str
    grant: Grant | None = None
    reason: str = ""
    t: float = 0.0


@dataclass(slots=True, eq=False)
class _Req:
    rid: str
    n: int
    tokens: int | None
    peer: str
    state: State = State.QUEUED
    location: str = ""
    token: int = 0
    expires: float = 0.0
    queue_deadline: float = 0.0
    buffer_blocks: list[int] | None = None
    gpu_blocks: list[int] | None = None
    landed: int = 0
    nlanded: int = 0
    reserved_at: float = 0.0
    received_at: float = 0.0
    swap_started: float = 0.0
    handle: Any = None
    cancel: tuple[State, str] | None = None
    reason: str = ""
    in_ready: bool = False
    gpu_ok: bool = True  # may take GPU blocks directly (with options.direct_to_gpu)
    bound: bool = False  # its GPU blocks are the engine's, bound late (options.bind == "engine")
    prefix: tuple[int, ...] = ()  # decode's own blocks for the prompt's start (DecodeScheduler.hold_prefix)
    release: Any = None  # called once with (rid, prefix) when the prefix is no longer needed
    writers: _Writers = field(default_factory=_Writers)
    binding: bytes = b""  # opaque, from the reservation (an engine adapter's proof digest)

    def info(self) -> RequestInfo:
        """The snapshot :meth:`DecodeScheduler.request` hands out (under its lock)."""
        bufs, gpus = tuple(self.buffer_blocks or ()), tuple(self.gpu_blocks or ())
        return RequestInfo(
            self.rid, self.state, self.location, self.n, self.nlanded, bufs, gpus, self.reason, self.peer,
            self.tokens, self.binding,
        )  # fmt: skip


@dataclass(slots=True, eq=False)
class _Quarantine:
    release_at: float
    peer: str
    pool: Any
    blocks: list[int]
    writers: _Writers
    fenced: bool = False

    def releasable(self, now: float) -> bool:
        return self.writers.n == 0 and (self.fenced or self.release_at <= now)


@dataclass(slots=True, eq=False)
class _Hold:
    """A prefix held for a request prefill has not reserved yet (DecodeScheduler.hold_prefix)."""

    blocks: tuple[int, ...]
    release: Any
    deadline: float
    binding: bytes = b""  # when set, only a reservation with this binding claims it


@dataclass(frozen=True, slots=True)
class _Release:
    """A prefix release due, delivered with the events once the lock is dropped."""

    fn: Any
    request_id: str
    blocks: tuple[int, ...]


@dataclass
class _Metrics:
    counters: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "reservations_gpu",
                "reservations_buffer",
                "reservations_queued",
                "reservations_rejected",
                "grants_from_queue",
                "queue_timeouts",
                "layers_landed",
                "requests_received",
                "requests_ready",
                "requests_finished",
                "requests_failed",
                "requests_expired",
                "requests_aborted",
                "late_messages_rejected",
                "swaps_submitted",
                "swaps_completed",
                "swaps_failed",
                "swap_bytes",
                "swap_seconds_sum",
                "swap_seconds_max",
                "swap_busy_seconds",
                "prefill_wait_avoided_seconds_sum",
                "prefill_wait_avoided_seconds_max",
                "quarantined_blocks_released",
                "buffer_blocks_peak",
                "writes_admitted",
                "prefix_blocks_reused",
                "prefix_holds_expired",
            ),
            0,
        )
    )


# the hot paths' constructors (_maker): every field, in order
_make_grant = _maker(Grant)
_make_reservation = _maker(Reservation)
_make_ready = _maker(ReadyRequest)
_make_event = _maker(Event)
