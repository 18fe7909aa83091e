"""pdkv's SGLang backend in plain ids (no SGLang object): the decode half
(:class:`DecodeRank`), the settings and the names both halves share; the prefill half is
:class:`~.prefill_rank.PrefillRank`.

SGLang's order is decode first: decode allocates a request's pages (host pages of its
HiCache pool with host receive, else device pages), then tells prefill where they are. Over
pdkv that becomes: decode *designates* the pages under the request's pdkv id (an
:class:`~pdkv.integrations.core.pages.EnginePages` pool behind a
:class:`~pdkv.transfer.DecodeReceiver` per destination; a GPU pool's pages through pdkv's
staging buffer, :mod:`.staged`), then *pulls* (one authenticated
message, :mod:`~pdkv.integrations.core.pull`) from each prefill rank whose heads it needs.
A prefill rank with every decode rank's pull reserves the request at each decode rank when
SGLang hands over its first chunk (the grant is exactly the designated pages: no other can
be granted), writes every chunk's layers as they come (tcp, or nixl where both sides are
set to: ``PDKV_SGLANG_TRANSPORTS`` at decode, ``PDKV_SGLANG_TRANSPORT`` at prefill),
confirms after the last, and sends the request's aux data (:mod:`.aux`). Decode reports
success once the KV is received and the aux written; pages leave pdkv only when no write
admitted under the grant still runs (:meth:`DecodeRank.release_safe`).

A request's pdkv id at a decode rank is ``sgl-<room>-d<rank>of<TP size>``: SGLang's
``bootstrap_room`` names it on both sides (SGLang gives a backend no prompt to bind to: the room is the name).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ... import _ffi
from ...buffer import reaper
from ...buffer.region import HostRegion
from ...buffer.shared import SharedBuffer
from ...errors import PdkvError, RequestError
from ...layout import CacheSpec, KVLayout, tp_segments
from ...scheduling.lifecycle import TERMINAL, SchedulerOptions, State
from ...scheduling.scheduler import DecodeScheduler
from ...swap.engine import SwapEngine
from ...transfer import DecodeReceiver, ReceiverOptions
from ..core.pages import EnginePages
from ..core.pull import PullClient, PullResult
from .aux import AuxServer, max_message
from .bootstrap import fetch_ranks, layout_of
from .layouts import RankPools
from .staged import StagedPages

__all__ = ["Settings", "DecodeRank", "RoomIn", "aux_slots", "pid_of", "room_binding", "sources_of"]

_log = logging.getLogger(__name__)
PID_PATTERN = re.compile(r"sgl-(\d{1,20})-d(\d{1,4})of(\d{1,4})")
MAX_EARLY_PULLS = 65536  # pulls kept for rooms prefill has not seen yet
# the transports that write an engine's own pages by address (HostRegion)
ENGINE_TRANSPORTS = ("tcp", "nixl")
# and those that also write pdkv's own staging buffer (a GPU decode's device pages): shm,
# prefill on the same host mapping the segment
STAGED_TRANSPORTS = ("tcp", "nixl", "shm")


@dataclass(frozen=True)
class Settings:
    """The backend's configuration (SGLang has no place for a backend's own): from the
    environment by :meth:`from_env`. ``secret`` is required: it authenticates every pdkv
    session, pull, aux message and bootstrap entry of the pair."""

    secret: bytes = field(repr=False)
    host: str = "127.0.0.1"  # the address pdkv's sockets bind and advertise
    instance_key: bytes | None = field(default=None, repr=False)  # a TP>1 prefill's ranks share it
    timeout_s: float = 30.0  # a pull's answer, a grant, an outcome: each waits at most this
    lease_s: float = 30.0  # decode's grant lease
    transports: tuple[str, ...] = ("tcp",)  # decode serves these (tcp, nixl; shm: the staging buffer only)
    transport: str = "tcp"  # prefill sends by this one (tcp, nixl, or auto: decode's first)
    # decode's device destination: ``auto`` writes a host-addressable (CPU) pool directly
    # and stages a GPU pool (:mod:`.staged`); ``staged`` stages either
    device_path: str = "auto"
    staging_mb: float = 1024.0  # MiB: the staging buffer of a staged device destination

    @classmethod
    def from_env(cls) -> Settings:
        raw = os.environ.get("PDKV_SECRET", "")
        path = os.environ.get("PDKV_SECRET_FILE")
        if path:
            with open(path, "rb") as f:
                raw = f.read().strip().decode()
        secret = _hex_key(
            raw,
            "pdkv's SGLang backend needs the pair's secret: PDKV_SECRET (or PDKV_SECRET_FILE), hex, >= 16 bytes",
        )
        key = os.environ.get("PDKV_SGLANG_INSTANCE_KEY")
        served = tuple(t.strip() for t in os.environ.get("PDKV_SGLANG_TRANSPORTS", "tcp").split(",") if t.strip())
        transport = os.environ.get("PDKV_SGLANG_TRANSPORT", "tcp").strip()
        return cls(
            secret=secret,
            host=os.environ.get("PDKV_SGLANG_HOST", "127.0.0.1"),
            instance_key=_hex_key(key, "PDKV_SGLANG_INSTANCE_KEY must be hex, >= 16 bytes") if key else None,
            timeout_s=_number("PDKV_SGLANG_TIMEOUT_S", "30"),
            lease_s=_number("PDKV_SGLANG_LEASE_S", "30"),
            transports=served,
            transport=transport,
            staging_mb=_number("PDKV_SGLANG_STAGING_MB", "1024"),
        )

    def __post_init__(self) -> None:
        odd = [t for t in self.transports if t not in STAGED_TRANSPORTS]
        if odd or not any(t in ENGINE_TRANSPORTS for t in self.transports):
            raise PdkvError(
                f"PDKV_SGLANG_TRANSPORTS={','.join(self.transports)!r}: decode receives into SGLang's pages by "
                f"{' and '.join(ENGINE_TRANSPORTS)} (at least one), and into its staging buffer by shm too"
            )
        if self.device_path not in ("auto", "staged"):
            raise PdkvError(f"device_path={self.device_path!r} must be 'auto' or 'staged'")
        if not isinstance(self.staging_mb, (int, float)) or not self.staging_mb > 0:
            raise PdkvError(f"PDKV_SGLANG_STAGING_MB={self.staging_mb!r} must be a positive number of MiB")
        if self.transport not in (*ENGINE_TRANSPORTS, "auto"):
            raise PdkvError(
                f"PDKV_SGLANG_TRANSPORT={self.transport!r}: prefill sends by {', '.join(ENGINE_TRANSPORTS)} or auto"
            )


def _hex_key(raw: str, why: str) -> bytes:
    """``raw`` as bytes: hex of at least 16 bytes, else PdkvError(``why``)."""
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise PdkvError(why) from None
    if len(key) < 16:
        raise PdkvError(why)
    return key


def _number(name: str, default: str) -> float:
    """The environment's ``name`` as a number (seconds, or MiB), naming it when it is not one."""
    raw = os.environ.get(name, default)
    try:
        return float(raw)
    except ValueError:
        raise PdkvError(f"{name}={raw!r} is not a number") from None


def pid_of(room: int, decode_rank: int, decode_tp: int) -> str:
    return f"sgl-{int(room)}-d{int(decode_rank)}of{int(decode_tp)}"


def room_binding(room: int) -> bytes:
    return hashlib.sha256(b"pdkv-sglang-room\0" + str(int(room)).encode()).digest()


def sources_of(src: KVLayout, dst: KVLayout) -> list[int]:
    """The prefill ranks (of ``src``'s TP size) that write decode rank ``dst.tp_rank``."""
    return sorted({s.src_rank for s in tp_segments(src, dst) if s.dst_rank == dst.tp_rank})


def aux_slots(ptrs: list[int], items: list[int], index: int) -> list[tuple[int, int]]:
    return [(int(p) + index * int(n), int(n)) for p, n in zip(ptrs, items)]


class _NoSwap:
    """The scheduler's swap backend: never used (SGLang loads its own pages)."""

    def submit(self, *a: Any, **k: Any) -> Any:
        raise PdkvError("pdkv's SGLang backend does not swap: SGLang loads its own pages")


# ---------------------------------------------------------------------- decode


@dataclass
class RoomIn:
    """One request at a decode rank."""

    room: int
    pid: str
    desks: list[str]  # the pull endpoints of every prefill rank
    bootstrap: str = ""  # the prefill instance's bootstrap address
    dest: str = ""
    pages: tuple[int, ...] = ()  # the destination pages SGLang chose (a staged device destination's copy target)
    bound: bool = False  # staged: the received request is bound to its device pages (its copy runs)
    aux: list[tuple[int, int]] = field(default_factory=list)  # (address, bytes) of the aux slot
    aux_done: bool = False
    pulls: list[PullResult] = field(default_factory=list)
    state: str = "waiting"  # waiting -> transferring -> success | failed
    error: str = ""
    deadline: float = 0.0


class DecodeRank:
    """One SGLang decode rank's pdkv side: a receiver per destination (``device``: the KV
    pool, written directly where its memory is host-addressable, else through pdkv's
    staging buffer and a copy, :mod:`.staged`; ``host``: the host pool of host receive),
    the pull client and the aux endpoint. Ownership: sockets, threads, the staging buffer
    and its swap engine (:meth:`close`)."""

    def __init__(self, pools: RankPools, settings: Settings, *, aux: tuple[list[int], list[int]] = ([], [])) -> None:
        self.layout, self.settings = pools.layout, settings
        self._aux_ptrs, self._aux_items = list(aux[0]), list(aux[1])
        self._lock = threading.Lock()
        self._rooms: dict[str, RoomIn] = {}
        self._prefills: dict[str, tuple[float, dict[int, dict[str, Any]]]] = {}
        self.pages: dict[str, EnginePages | StagedPages] = {}
        self.receivers: dict[str, DecodeReceiver] = {}
        self.staging: SharedBuffer | None = None
        self._swap: SwapEngine | None = None
        self._watch: Any = None
        self.staged = pools.device.device is not None or settings.device_path == "staged"
        served = tuple(t for t in settings.transports if t in ENGINE_TRANSPORTS)
        try:
            for dest, spec in (("device", pools.device), ("host", pools.host)):
                if spec is None:
                    continue
                if dest == "device" and self.staged:
                    self._open_staged(spec)
                    continue
                pages = self.pages[dest] = EnginePages(spec.num_blocks)
                sched = DecodeScheduler(
                    layout=self.layout,
                    gpu=None,
                    buffer=pages,  # type: ignore[arg-type]  # EnginePages: places by request
                    swap=_NoSwap(),
                    options=self._options(served, on_full="reject"),
                )
                region = HostRegion(spec, f"SGLang's {dest} KV pool")
                self.receivers[dest] = self._receiver(sched, region, spec.num_blocks, served)
            self.pull = PullClient((), secret=settings.secret, timeout_s=settings.timeout_s)
            self.aux_server = AuxServer(
                f"tcp://{settings.host}:0", settings.secret, self._on_aux, max_msg=max_message(self._aux_items)
            )
        except BaseException:
            self.close()
            raise

    def _options(self, served: tuple[str, ...], **kw: Any) -> SchedulerOptions:
        opts = SchedulerOptions(bind="engine", lease_s=self.settings.lease_s, **kw)
        if served == ("tcp",):
            # tcp sees every write: none can land once the grant is gone, so no grace
            # (nixl's and shm's are one-sided: an aborted grant's pages stay pdkv's for the default one)
            opts = dataclasses.replace(opts, fence_grace_s=0.0)
        return opts

    def _receiver(
        self, sched: DecodeScheduler, memory: Any, num_blocks: int, served: tuple[str, ...]
    ) -> DecodeReceiver:
        s = self.settings
        return DecodeReceiver(
            sched,
            [self.layout],
            [memory],
            num_blocks,
            ReceiverOptions(
                control=f"tcp://{s.host}:0",
                secret=s.secret,
                transports=served,
                auto_tick=True,
                data_host=s.host,
            ),
        )

    def _open_staged(self, device: CacheSpec) -> None:
        """The device destination through pdkv's staging buffer: prefill writes the buffer,
        the swap engine copies each received request into its device pages."""
        lay = self.layout
        fit = int(self.settings.staging_mb * 2**20) // CacheSpec.buffer_bytes(lay, 1)
        if fit < 1:
            raise PdkvError(
                f"PDKV_SGLANG_STAGING_MB={self.settings.staging_mb:g} holds no page of "
                f"{CacheSpec.buffer_bytes(lay, 1)} bytes"
            )
        n = min(device.num_blocks, fit)
        self.staging = buf = SharedBuffer.create(CacheSpec.buffer_bytes(lay, n))
        # removes it if this process ends without close() (SGLang's scheduler killed)
        self._watch = reaper.watch([buf.name])
        self._swap = SwapEngine(
            CacheSpec.for_buffer(lay, n, buf.address), device, buffer_pinned=buf.pinned, priority="decode"
        )
        pages = self.pages["device"] = StagedPages(n, device.num_blocks)
        sched = DecodeScheduler(
            layout=lay,
            gpu=None,
            buffer=pages,  # type: ignore[arg-type]  # StagedPages: places by request
            swap=self._swap,
            # a full staging buffer queues the reservation (prefill keeps its KV meanwhile)
            options=self._options(
                self.settings.transports, direct_to_gpu=False, on_full="queue", queue_timeout_s=self.settings.timeout_s
            ),
        )
        self.receivers["device"] = self._receiver(sched, buf, n, self.settings.transports)

    # ------------------------------------------------------------------ SGLang's order
    def prefill_ranks(self, bootstrap: str) -> dict[int, dict[str, Any]]:
        """The verified table of the prefill instance at ``bootstrap`` (cached 60 s)."""
        now = time.monotonic()
        got = self._prefills.get(bootstrap)
        if got is None or now - got[0] > 60:
            ranks = fetch_ranks(bootstrap, self.settings.secret, min(5.0, self.settings.timeout_s))
            got = self._prefills[bootstrap] = (now, ranks)
            for e in ranks.values():
                self.pull.allow(e["desk"])
        return got[1]

    def start(self, room: int, bootstrap: str) -> RoomIn:
        """``KVReceiver.init``: the prefill ranks this rank needs. PdkvError if the
        bootstrap cannot tell or the layouts cannot be paired."""
        ranks = self.prefill_ranks(bootstrap)
        sources_of(layout_of(ranks[0]), self.layout)  # the layouts pair (or raise)
        pid = pid_of(room, self.layout.tp_rank, self.layout.tp_size)
        # every prefill rank is asked: decode completes a grant when all ranks confirmed
        r = RoomIn(room, pid, [ranks[s]["desk"] for s in sorted(ranks)], bootstrap)
        with self._lock:
            old = self._rooms.get(pid)
            if old is not None and old.state not in ("success", "failed"):
                raise RequestError(f"room {room} is already in flight at this decode rank")
            self._rooms[pid] = r
        return r

    def publish(self, r: RoomIn, pages: list[int], aux_index: int | None, dest: str, prefix: int = 0) -> None:
        """``send_metadata``: designate ``pages`` of ``dest`` and pull from the prefill
        ranks. ``prefix``: the prompt tokens decode's radix cache holds already
        (``decode_prefix_len``); ``pages`` are then the rest's, and prefill sends only those."""
        if dest not in self.pages:
            raise RequestError(
                f"destination {dest!r} is not served by this decode rank (served: {', '.join(self.pages)})"
            )
        tpb = self.layout.tokens_per_block
        if prefix < 0 or prefix % tpb:
            raise RequestError(f"decode_prefix_len={prefix} is not a whole number of pages of {tpb} tokens")
        aux = aux_slots(self._aux_ptrs, self._aux_items, aux_index) if aux_index is not None else []
        with self._lock:
            if r.state != "waiting":
                raise RequestError(f"room {r.room}: metadata sent twice")
            self.pages[dest].designate(r.pid, pages)
            r.dest, r.pages, r.aux, r.aux_done = dest, tuple(int(p) for p in pages), aux, not aux
            r.state, r.deadline = "transferring", time.monotonic() + self.settings.timeout_s + self.settings.lease_s
        rx = self.receivers[dest]
        me = f"{rx.control_address} {self.aux_server.address}"
        r.pulls = [self.pull.pull(d, r.pid, room_binding(r.room), me, prefix) for d in r.desks]

    def status(self, r: RoomIn) -> str:
        """``poll``: waiting, transferring, success or failed (``r.error`` says why)."""
        if r.state != "transferring":
            return r.state
        bad = next((p.error for p in r.pulls if p.done and p.error), "")
        why = f"prefill refused the pull: {bad}" if bad else ""
        if bad:  # a restarted prefill registers new endpoints: the next request reads its table again
            self._prefills.pop(r.bootstrap, None)
        sched = self.receivers[r.dest].scheduler
        try:
            info = sched.request(r.pid)
        except RequestError:
            info = None  # not reserved yet
        if not why and info is not None and info.state in TERMINAL:
            why = f"the transfer {info.state.value}: {info.reason}"
        staged = isinstance(self.pages[r.dest], StagedPages)
        if not why and staged and info is not None and info.state is State.RECEIVED and not r.bound:
            try:  # the copy from the staging buffer into SGLang's device pages starts now
                sched.bind(r.pid, r.pages)
                r.bound = True
            except PdkvError as exc:
                why = f"its copy into the device pages could not start: {exc}"
        done = State.READY if staged else State.RECEIVED
        if not why and info is not None and info.state is done and r.aux_done:
            with self._lock:
                r.state = "success"
            if staged:  # copied: the staging blocks went back when the copy ended
                with_suppress(sched.finish, r.pid)
            else:  # SGLang reads its own pages where the KV landed
                with_suppress(sched.release, r.pid)
            return r.state
        if not why and time.monotonic() > r.deadline:
            why = f"no KV within {self.settings.timeout_s + self.settings.lease_s:g} s"
        if why:
            self.abort(r, why)
        return r.state

    def abort(self, r: RoomIn, why: str = "aborted by SGLang") -> None:
        """Stop the request: its grant ends (a write in flight finishes first, and no new
        one is admitted), an unclaimed designation is withdrawn, the aux slot closes."""
        with self._lock:
            if r.state in ("waiting", "transferring"):
                r.state, r.error = "failed", why
            r.aux = []  # no aux write after this returns (writes take the same lock)
        if r.dest:
            self.pages[r.dest].withdraw(r.pid)
            with_suppress(self.receivers[r.dest].scheduler.abort, r.pid, why)

    def release_safe(self, r: RoomIn) -> bool:
        """``is_abort_release_safe``: no page of the request is pdkv's any more (no write
        admitted under its grant still runs) and no aux write can come."""
        return r.state in ("success", "failed") and (not r.dest or not self.pages[r.dest].holds(r.pid))

    def release_safe_room(self, room: int) -> bool:
        """:meth:`release_safe` for SGLang's ``bootstrap_room`` (true for a room no longer
        known here: nothing of it is pdkv's)."""
        with self._lock:
            r = self._rooms.get(pid_of(room, self.layout.tp_rank, self.layout.tp_size))
        return r is None or self.release_safe(r)

    def forget(self, r: RoomIn) -> None:
        """``clear``: abort if still live; drop the record."""
        self.abort(r, "cleared by SGLang")
        with self._lock:
            if self._rooms.get(r.pid) is r:
                del self._rooms[r.pid]

    def _on_aux(self, pid: str, blobs: list[bytes]) -> str:
        with self._lock:
            r = self._rooms.get(pid)
            if r is None or r.state != "transferring" or r.aux_done or not r.aux:
                return f"no aux slot open for {pid[:80]!r}"
            if len(blobs) != len(r.aux) or any(len(b) != n for b, (_, n) in zip(blobs, r.aux)):
                got, want = [len(b) for b in blobs][:8], [n for _, n in r.aux][:8]
                return f"{pid[:80]!r}: aux of {got} bytes; the slot is {want}"
            for b, (addr, n) in zip(blobs, r.aux):
                _ffi.libc.host_view(addr, n)[:] = b
            r.aux_done = True
        return ""

    def close(self) -> None:
        for name in ("pull", "aux_server"):
            x = getattr(self, name, None)
            if x is not None:
                x.close()
        for rx in self.receivers.values():
            rx.close()
        if self._swap is not None:
            self._swap.close()  # a copy still running ends first: it reads the staging buffer
        if self.staging is not None:
            try:
                self.staging.close()
            except PdkvError as exc:  # a view still exported: the name still goes
                _log.warning("pdkv decode: staging buffer %s: %s", self.staging.name, exc)
            self.staging.unlink()  # idempotent; a name already gone is no error
        if self._watch is not None:
            self._watch.close()


def with_suppress(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except PdkvError:
        pass
