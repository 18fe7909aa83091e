"""Staged sends: a GPU cache's layer gathered into a pinned ring and sent from there.

A transport that sends from host memory (tcp; rdma without GPUDirect) reaches a GPU cache
through :class:`StagedSends`. Each layer's planned pieces, in the order the transport
sends them, are cut into chunks of at most one slot; each chunk is gathered by the swap
engine's device-to-host path (the NVRTC gather kernel or the copy engines, whichever its
``auto`` strategy picks for the pieces) into a free slot of a :class:`StagingRing`, and a
worker thread sends the slots in order while the data thread gathers the next chunk. The
gather writes the bytes once into pinned memory; the socket (or the NIC) reads them from
there: nothing is copied twice on the host. The ring is allocated (and registered, for
RDMA) once per session, not per request.

Bounds: a full ring waits at most ``timeout_s`` for a slot, a gather at most
``timeout_s``; the transport's own send is bounded by its socket timeout. A chunk whose
gather or send fails fails every request with bytes in it (its Complete then reports the
failure), and its slot goes back to the ring whatever happened.

``strategy="host"`` (a host cache) runs the same path with the swap engine's host
strategy: CPU CI tests the ring, the ordering and the failures with it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import _ffi
from ...errors import ClosedError, PdkvTimeoutError, TransferError
from ...layout import KVLayout, Segment
from ...plan import CopyPlan, check_within, layer_pieces, split_runs

_log = logging.getLogger(__name__)

__all__ = [
    "StagingRing",
    "StagedSends",
    "ChunkRecord",
    "default_slot_bytes",
    "make_staged",
    "stage_layer",
    "DEFAULT_SLOTS",
]

DEFAULT_SLOTS = 4
_SLOT_MIN, _SLOT_MAX = 16 << 20, 64 << 20
_SLOT_BLOCKS = 256  # a default slot holds this many blocks of one layer of this rank


def default_slot_bytes(layout: KVLayout, segments: list[Segment]) -> int:
    """A slot holds ``_SLOT_BLOCKS`` blocks of one layer of what this rank sends (its TP
    segments' bytes per block), within 16-64 MiB, and at least one block's largest piece."""
    per_block = sum(s.nbytes for s in segments) or layout.layer_block_bytes
    largest = max((s.length * s.count for s in segments), default=per_block)
    size = min(_SLOT_MAX, max(_SLOT_MIN, per_block * _SLOT_BLOCKS))
    return max(size, largest)


class StagingRing:
    """``slots`` slots of ``slot_bytes`` of host memory, allocated once: pinned
    (``cudaMallocHost``) on ``device``, or an anonymous mapping without one (the host
    stand-in). :meth:`acquire` hands out a free slot, waiting at most ``timeout`` s;
    :meth:`release` gives it back. Ownership: the ring frees its memory on :meth:`close`;
    the caller makes sure nothing reads or writes a slot by then."""

    def __init__(self, slot_bytes: int, slots: int, device: int | None = None) -> None:
        if not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ValueError(f"slot_bytes={slot_bytes!r} must be a positive integer")
        if not isinstance(slots, int) or not 1 <= slots <= 1024:
            raise ValueError(f"slots={slots!r} must be an integer in 1..1024")
        self.slot_bytes, self.slots, self.device = slot_bytes, slots, device
        self.nbytes = slot_bytes * slots
        self._map: mmap.mmap | None = None
        if device is None:
            self._map = mmap.mmap(-1, self.nbytes)
            self.address = _ffi.libc.buffer_address(self._map)
            self._fin: Any = weakref.finalize(self, self._map.close)
        else:
            with _ffi.cuda.on_device(device):
                self.address = _ffi.cuda.malloc_host(self.nbytes)
            self._fin = weakref.finalize(self, _free_pinned, device, self.address)
        self._view = _ffi.libc.host_view(self.address, self.nbytes)
        self._free = collections.deque(range(slots))
        self._out: set[int] = set()
        self._cv = threading.Condition()
        self._closed = False

    @property
    def pinned(self) -> bool:
        return self.device is not None

    @property
    def free_slots(self) -> int:
        with self._cv:
            return len(self._free)

    def slot_address(self, slot: int) -> int:
        return self.address + slot * self.slot_bytes

    def view(self, slot: int, nbytes: int | None = None) -> memoryview:
        """The first ``nbytes`` (default all) of ``slot``."""
        a = slot * self.slot_bytes
        return self._view[a : a + (self.slot_bytes if nbytes is None else nbytes)]

    def acquire(self, timeout: float) -> int:
        """A free slot; PdkvTimeoutError if none frees within ``timeout`` s, ClosedError
        once the ring is closed."""
        deadline = time.monotonic() + timeout
        with self._cv:
            if not self._free:
                _log.debug("staging: all %d slots wait for their sends; waiting for one", self.slots)
            while not self._free:
                if self._closed:
                    raise ClosedError("the staging ring is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PdkvTimeoutError(
                        f"no staging slot freed within {timeout:g} s (all {self.slots} slots of "
                        f"{self.slot_bytes} bytes wait for their sends)"
                    )
                self._cv.wait(left)
            if self._closed:
                raise ClosedError("the staging ring is closed")
            slot = self._free.popleft()
            self._out.add(slot)
            return slot

    def release(self, slot: int) -> None:
        with self._cv:
            if slot not in self._out:
                raise ValueError(f"staging slot {slot} is not out (released twice?)")
            self._out.remove(slot)
            self._free.append(slot)
            self._cv.notify()

    def close(self) -> None:
        """Free the memory (idempotent); waiters get ClosedError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._fin()


def _free_pinned(device: int, addr: int) -> None:
    with contextlib.suppress(Exception), _ffi.cuda.on_device(device):
        _ffi.cuda.free_host(addr)


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One staged chunk: its layer, bytes, the gather's time (device time on a GPU; on the
    host stand-in, wall time until the worker saw it done), the time the send worker
    waited for that gather (the gather's share not hidden behind sends), and the send's."""

    layer: int
    nbytes: int
    gather_s: float
    wait_s: float
    send_s: float


class _Chunk:
    """A staged chunk in flight: its slot, gather, the lanes still sending it."""

    __slots__ = ("seq", "layer", "slot", "nbytes", "handle", "events", "rids", "pending", "error", "wait_s", "send_s")

    def __init__(
        self, seq: int, layer: int, slot: int, nbytes: int, handle: Any, events: Any, rids: frozenset[str], lanes: int
    ) -> None:
        self.seq, self.layer, self.slot, self.nbytes = seq, layer, slot, nbytes
        self.handle, self.events, self.rids = handle, events, rids
        self.pending = lanes
        self.error: BaseException | None = None
        self.wait_s = self.send_s = 0.0


Send = Callable[[memoryview], None]


class StagedSends:
    """The staged path of one sender session: a ring, a swap engine that gathers into it,
    and one thread per lane (a tcp stream) that sends its share of each chunk, in order.

    ``sends[i](view)`` (given to :meth:`stage`, one per lane, None where a lane has
    nothing of the chunk) sends lane ``i``'s share of a slot; it runs on lane ``i``'s
    thread once the chunk's gather is done. Lanes do not wait for each other: lane 0 may
    be a chunk ahead of lane 1. A slot returns to the ring when every lane is done with
    it. :meth:`after` runs a function once every chunk staged before it has been sent
    (the session's Complete goes out that way). Ownership: the ring, the engine, its
    stream and events are this object's, freed by :meth:`close`.
    """

    def __init__(
        self,
        host: Any,
        slot_bytes: int,
        slots: int = DEFAULT_SLOTS,
        *,
        lanes: int = 1,
        timeout_s: float = 10.0,
        fail_request: Callable[[str, str], None] | None = None,
    ) -> None:
        from ...swap.engine import SwapEngine

        if not isinstance(lanes, int) or not 1 <= lanes <= 64:
            raise ValueError(f"lanes={lanes!r} must be an integer in 1..64")
        cache = host.cache
        self.timeout_s = timeout_s
        self._fail: Callable[[str, str], None] = fail_request or host.fail_request
        self.failed: set[str] = set()  # requests a failed chunk has failed (their layers go unreported)
        self.device: int | None = cache.device
        self._stream = 0
        self._events: list[tuple[int, int]] = []
        self.ring = StagingRing(slot_bytes, slots, cache.device)
        try:
            if cache.device is not None:
                with _ffi.cuda.on_device(cache.device):
                    self._stream = _ffi.cuda.stream_create(nonblocking=True)
                    # a pair of timing events per slot: the gather's device time
                    for _ in range(slots):
                        self._events.append((_ffi.cuda.event_create(timing=True), _ffi.cuda.event_create(timing=True)))
                # explicit addresses (copy_plan): GPU cache -> pinned slots
                self.engine = SwapEngine(cache, cache, device=cache.device, stream=self._stream)
            else:
                self.engine = SwapEngine(cache, cache, strategy="host", host_threads=1)
        except BaseException:
            self._free_cuda()
            self.ring.close()
            raise
        # the gather's side: the swap engine's auto strategy picks the kernel or the copy
        # engines per chunk on a GPU; the host stand-in copies with memmove
        self.strategy = "GPU" if cache.device is not None else "host"
        self.log: collections.deque[ChunkRecord] = collections.deque(maxlen=1 << 16)
        self._cv = threading.Condition()
        self._queues: list[collections.deque[tuple[_Chunk, Send | None] | None]] = [
            collections.deque() for _ in range(lanes)
        ]
        self._seq = 0  # chunks staged
        self._inflight: dict[int, _Chunk] = {}
        self._done_below = 0  # every chunk with a lower seq is done
        self._callbacks: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._closing = False
        self._closed = False
        self._threads = [
            threading.Thread(target=self._lane, args=(i,), name="pdkv-staged-send", daemon=True) for i in range(lanes)
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ API
    @property
    def slot_bytes(self) -> int:
        return self.ring.slot_bytes

    @property
    def lanes(self) -> int:
        return len(self._queues)

    @property
    def idle(self) -> bool:
        with self._cv:
            return not self._inflight and not self._callbacks

    def stage(
        self, layer: int, src: Any, lengths: Any, request_ids: frozenset[str], sends: Sequence[Send | None]
    ) -> None:
        """Gather the pieces ``src[i]`` (``lengths[i]`` bytes, in send order) into the next
        free slot and queue each lane's send of it. Raises (nothing queued, the slot given
        back) if no slot frees in time or the gather cannot start."""
        if len(sends) != self.lanes:
            raise ValueError(f"{len(sends)} sends for {self.lanes} lanes")
        ln = np.asarray(lengths, dtype=np.int64)
        total = int(ln.sum())
        if not 0 < total <= self.ring.slot_bytes:
            raise ValueError(f"a staged chunk of {total} bytes must fit one slot of {self.ring.slot_bytes}")
        if self._closing:
            raise ClosedError("staged sends are closed")
        slot = self.ring.acquire(self.timeout_s)
        try:
            base = self.ring.slot_address(slot)
            dst = base + np.concatenate(([0], np.cumsum(ln)[:-1]))
            check_within(dst, ln, base, self.ring.slot_bytes, f"layer {layer}: a staged piece")
            plan = CopyPlan(
                np.asarray(src, dtype=np.int64).astype(np.uint64),
                dst.astype(np.uint64),
                ln.astype(np.uint64),
                np.asarray([ln.size], np.int64),
                total,
            )
            ev = self._events[slot] if self._events else None
            if ev is not None:
                with _ffi.cuda.on_device(self.device):  # type: ignore[arg-type]
                    _ffi.cuda.event_record(ev[0], self._stream)
                    h = self.engine.copy_plan(plan, direction="d2h")
                    _ffi.cuda.event_record(ev[1], self._stream)
            else:
                h = self.engine.copy_plan(plan)
        except BaseException:
            self.ring.release(slot)
            raise
        lanes: list[tuple[int, Send | None]] = [(i, f) for i, f in enumerate(sends) if f is not None] or [(0, None)]
        with self._cv:
            c = _Chunk(self._seq, layer, slot, total, h, ev, request_ids, len(lanes))
            self._seq += 1
            self._inflight[c.seq] = c
            for i, f in lanes:
                self._queues[i].append((c, f))
            self._cv.notify_all()

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every chunk staged so far has been sent: now if none is in
        flight, else on the lane thread that finishes the last of them."""
        with self._cv:
            if self._done_below < self._seq or self._callbacks:
                self._callbacks.append((self._seq, fn))
                return
        fn()

    def drain(self, timeout: float) -> bool:
        """Wait until no chunk or callback is pending; False if that took over ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._inflight or self._callbacks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop: queued chunks fail, the lanes end (bounded), the gathers are waited for,
        then the ring, engine, stream and events are freed. Idempotent. The transport
        makes a blocked send return first (it closes its connections)."""
        with self._cv:
            if self._closed:
                return
            if not self._closing:
                self._closing = True
                for q in self._queues:
                    q.append(None)
                self._cv.notify_all()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):  # a send still blocked: its slot stays mapped
            _log.warning("a staged send lane did not stop within %.1f s; its ring is left allocated", timeout)
            return
        with self._cv:
            self._callbacks.clear()  # a closed sender confirms nothing
            self._closed = True
        self.engine.close()  # waits for queued gathers, so none writes a freed slot
        self._free_cuda()
        self.ring.close()

    # ------------------------------------------------------------------ lanes
    def _free_cuda(self) -> None:
        if self.device is None:
            return
        with contextlib.suppress(Exception), _ffi.cuda.on_device(self.device):
            for a, b in self._events:
                _ffi.cuda.event_destroy(a)
                _ffi.cuda.event_destroy(b)
            self._events.clear()
            if self._stream:
                _ffi.cuda.stream_destroy(self._stream)
                self._stream = 0

    def _lane(self, i: int) -> None:
        q = self._queues[i]
        while True:
            with self._cv:
                while not q:
                    self._cv.wait()
                entry = q.popleft()
            if entry is None:
                with self._cv:  # closing: what is left in this lane fails without sending
                    rest = [e for e in q if e is not None]
                    q.clear()
                for c, _ in rest:
                    self._finish_share(c, ClosedError("sender closed"), 0.0, 0.0)
                return
            c, send = entry
            t0 = time.perf_counter()
            err: BaseException | None = None
            t1 = t0
            try:
                if self._closing:
                    raise ClosedError("sender closed")
                c.handle.wait(self.timeout_s)
                t1 = time.perf_counter()
                if send is not None:
                    send(self.ring.view(c.slot, c.nbytes))
            except Exception as exc:
                err = exc
            self._finish_share(c, err, t1 - t0, time.perf_counter() - t1)

    def _finish_share(self, c: _Chunk, err: BaseException | None, wait_s: float, send_s: float) -> None:
        """One lane is done with chunk ``c``; the last one gives its slot back, fails its
        requests if any lane failed, and runs the callbacks now due, in order."""
        with self._cv:
            c.pending -= 1
            c.wait_s = max(c.wait_s, wait_s)
            c.send_s = max(c.send_s, send_s)
            if err is not None and c.error is None:
                c.error = err
            if c.pending:
                return
        if c.error is not None:
            why = f"layer {c.layer}: staged send failed: {c.error}"
            for rid in c.rids:
                self.failed.add(rid)
                self._fail(rid, why)
        self._retire(c)
        due = []
        with self._cv:
            del self._inflight[c.seq]
            while self._done_below < self._seq and self._done_below not in self._inflight:
                self._done_below += 1
            while self._callbacks and self._callbacks[0][0] <= self._done_below:
                due.append(self._callbacks.popleft()[1])
            self._cv.notify_all()
        for fn in due:
            if self._closing:
                break
            try:
                fn()
            except Exception:
                _log.exception("a staged completion callback failed")

    def _retire(self, c: _Chunk) -> None:
        """The chunk's slot back to the ring once its gather is done (waited for, bounded)."""
        h = c.handle
        if not h.done():  # a gather that timed out still writes the slot: wait for it
            with contextlib.suppress(Exception):
                h.wait(60)
        if not h.done():  # never given out again while a copy may still write it
            _log.warning("a staged gather did not finish; slot %d is retired", c.slot)
            return
        gather = h.seconds or 0.0
        if c.events is not None and h.error is None:
            with contextlib.suppress(Exception), _ffi.cuda.on_device(self.device):  # type: ignore[arg-type]
                gather = _ffi.cuda.event_elapsed_ms(c.events[0], c.events[1]) / 1e3
        if c.error is None:
            self.log.append(ChunkRecord(c.layer, c.nbytes, gather, c.wait_s, c.send_s))
        self.ring.release(c.slot)


def chunk_ranges(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of consecutive items, each summing to at most ``cap`` bytes
    (an item over ``cap`` raises TransferError: it cannot be staged)."""
    out, lo, acc = [], 0, 0
    for i, n in enumerate(sizes):
        if n > cap:
            raise TransferError(f"a frame of {n} bytes does not fit a staging slot of {cap} bytes")
        if acc + n > cap:
            out.append((lo, i))
            lo, acc = i, 0
        acc += n
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


def make_staged(host: Any, options: Any, lanes: int | None = None) -> StagedSends:
    """The staged path for ``host``'s cache with the ring ``options`` ask for (``lanes``:
    ``options.streams`` unless given)."""
    slot = options.staging_slot_bytes or default_slot_bytes(host.layout, host.segments)
    unit = max((s.length * s.count for s in host.segments), default=0)
    if slot < unit:
        raise TransferError(
            f"staging_slot_bytes={slot} is smaller than one block's {unit} bytes of a layer's tensor: "
            "a slot holds at least one"
        )
    n = options.streams if lanes is None else lanes
    return StagedSends(host, slot, options.staging_slots, lanes=n, timeout_s=host.timeout_s)


SendFor = Callable[[Any, Any, Any, int], Send]


def stage_layer(
    staged: StagedSends,
    host: Any,
    dst_specs: Any,
    layer: int,
    work: Sequence[Any],
    send_for: SendFor,
    done: Callable[[int, Any], None],
) -> None:
    """One layer's pieces, every request's, planned into the decode ranks' buffers
    (``dst_specs``) and staged slot by slot on one lane: ``send_for(dst, lengths, ranks,
    total)`` makes the send of a chunk (its pieces' destination addresses, lengths and
    decode ranks, in slot order); ``done(layer, item)`` runs for each request whose chunks
    all went out (a request a failed chunk failed is skipped: its Complete reports it)."""
    src, dst, ln, rank, owner = [], [], [], [], []
    for k, w in enumerate(work):
        plans, _ = layer_pieces(host.segments, host.layout, host.dst_layout, host.cache, dst_specs, w.src, w.dst, layer)
        for seg, s, d, n in plans:
            src.append(s)
            dst.append(d)
            ln.append(n)
            rank.append(np.full(n.size, seg.dst_rank, np.int64))
            owner.append(np.full(n.size, k, np.int64))
    if not ln:
        return
    s_all, d_all, n_all = np.concatenate(src), np.concatenate(dst), np.concatenate(ln)
    r_all, o_all = np.concatenate(rank), np.concatenate(owner)
    if int(n_all.max()) > staged.slot_bytes:  # a piece longer than a slot is cut
        idx, off, n_all = split_runs(n_all, staged.slot_bytes)
        s_all, d_all, r_all, o_all = s_all[idx] + off, d_all[idx] + off, r_all[idx], o_all[idx]
    for lo, hi in chunk_ranges(n_all.tolist(), staged.slot_bytes):
        rids = frozenset(work[k].request_id for k in np.unique(o_all[lo:hi]).tolist())
        n = n_all[lo:hi]
        staged.stage(layer, s_all[lo:hi], n, rids, [send_for(d_all[lo:hi], n, r_all[lo:hi], int(n.sum()))])

    for w in work:
        staged.after(functools.partial(_report_unless_failed, staged, done, layer, w))


def _report_unless_failed(staged: StagedSends, done: Callable[[int, Any], None], layer: int, w: Any) -> None:
    if w.request_id not in staged.failed:
        done(layer, w)
