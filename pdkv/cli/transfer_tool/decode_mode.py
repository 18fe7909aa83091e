"""The tool's decode side: buffer, scheduler, swap into (GPU) blocks, receiver, and the check of every landed byte."""

from __future__ import annotations

import argparse
import collections
import errno
import heapq
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ... import _ffi
from ...buffer.segments import available_memory
from ...buffer.shared import SharedBuffer
from ...errors import PdkvError
from ...integrations.interop import aligned_empty
from ...layout import CacheSpec, KVLayout
from ...scheduling.blocks import BlockPool
from ...scheduling.scheduler import DecodeScheduler, Event, SchedulerOptions
from ...swap import SwapEngine, SwapGroup
from ...transfer import DecodeReceiver
from .prefill_mode import prefill_on_gpu
from .stats import _LATE, Quantiles, Series
from .workload import (
    UsageError,
    make_workload,
    parse_devices,
    pattern,
    request_key,
    served_transports,
    workload_buffer_blocks,
)


@dataclass
class Track:
    """A request decode is working on: kept from its grant until it ends, then folded into
    :class:`Tally` and dropped."""

    reserved: float = 0.0
    received: float = 0.0
    ready: float = 0.0
    state: str = ""
    reason: str = ""
    blocks: int = 0
    location: str = ""


_SHOWN = 20  # failures named one by one in the report; the rest are counted


@dataclass
class Tally:
    """What decode's ended requests add up to, in bounded memory: counts, sums and
    streaming percentiles; only failed requests are remembered by id (the report names
    them and a request that failed on both sides counts once)."""

    ready: int = 0
    into_gpu: int = 0
    ready_blocks: int = 0  # blocks of the requests that became ready
    landed_blocks: int = 0  # blocks of every request that landed, ready or not
    first_grant: float = math.inf
    last_end: float = -math.inf
    request_gbps: Quantiles = field(default_factory=Quantiles)
    grant_to_received: Quantiles = field(default_factory=Quantiles)
    grant_to_ready: Quantiles = field(default_factory=Quantiles)
    failed: dict[str, str] = field(default_factory=dict)  # request -> "state (reason)"

    def fold(self, rid: str, tr: Track, block_bytes: int) -> None:
        if tr.received:
            self.landed_blocks += tr.blocks
        if tr.reserved:
            self.first_grant = min(self.first_grant, tr.reserved)
        if tr.state != "ready":
            self.failed[rid] = tr.state + (f" ({tr.reason})" if tr.reason else "")
            return
        self.ready += 1
        self.into_gpu += tr.location == "gpu"
        self.ready_blocks += tr.blocks
        self.last_end = max(self.last_end, tr.received, tr.ready)
        if tr.received > tr.reserved:
            self.request_gbps.add(tr.blocks * block_bytes / (tr.received - tr.reserved) / 1e9)
        if tr.received:
            self.grant_to_received.add(tr.received - tr.reserved)
        if tr.ready:
            self.grant_to_ready.add(tr.ready - tr.reserved)


@dataclass
class DecodeSide:
    a: argparse.Namespace
    lay_kw: dict[str, Any]
    tracks: dict[str, Track] = field(default_factory=dict)  # the requests in flight
    tally: Tally = field(default_factory=Tally)  # the ended ones
    timeline: Series = field(default_factory=Series)  # (s, buffer blocks, GPU blocks, bytes landed)
    verify_errors: int = 0
    bytes_verified: int = 0
    failures: list[str] = field(default_factory=list)  # the first _SHOWN lines, then counted
    failures_more: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # tracks, tally: receiver events, engine loop

    def note_failure(self, line: str) -> None:
        if len(self.failures) < _SHOWN:
            self.failures.append(line)
        else:
            self.failures_more += 1

    @property
    def ended(self) -> int:
        """Requests that ended here (ready and finished, or failed)."""
        return self.tally.ready + len(self.tally.failed)

    def start(self, listen: str) -> None:
        a = self.a
        self._ended: collections.deque[str] = collections.deque()  # recently folded requests
        self._ended_set: set[str] = set()
        D = a.decode_tp
        self.lays = [KVLayout(**self.lay_kw, tp_size=D, tp_rank=r) for r in range(D)]
        lay = self.lays[0]
        if a.buffer_blocks:
            nb = a.buffer_blocks
        elif a.buffer_gib is not None:
            nb = lay.blocks_for_bytes(int(a.buffer_gib * (1 << 30)))
        else:  # sized to the workload: room for the largest requests that can be in flight at once,
            # within a quarter of the memory this host has left (the host stand-in for GPU blocks
            # and the prefill caches take their share too), never below the largest request
            work = make_workload(a)
            nb = workload_buffer_blocks(work, a.concurrency, lay.tokens_per_block)
            fits = available_memory()[0] // 4 // D // lay.block_bytes
            nb = max(min(nb, fits), max(lay.blocks_for_tokens(r.tokens) for r in work))
        if nb <= 0:
            raise UsageError(f"--buffer-gib {a.buffer_gib} holds no block of {lay.block_bytes} bytes")
        gpu_blocks = a.gpu_blocks or nb
        work = make_workload(a)
        need = max(lay.blocks_for_tokens(r.tokens) for r in work)
        big = max(work, key=lambda r: r.tokens)
        direct = a.transport == "cuda_ipc" or (a.transport == "auto" and not a.no_gpu and _ffi.cuda.device_count() > 0)
        # local mode knows the workload; a decode of two hosts gets the prefill's, and the
        # scheduler refuses a request larger than its pools with that reason
        if a.mode == "local" and (need > gpu_blocks or (need > nb and not direct)):
            where = (
                f"the GPU pool ({gpu_blocks} blocks, --gpu-blocks)"
                if need > gpu_blocks
                else (f"the buffer ({nb} blocks)")
            )
            raise UsageError(
                f"request {big.rid} ({big.tokens} tokens) needs {need} blocks of {lay.tokens_per_block} tokens, more "
                f"than {where}: give --buffer-blocks / --gpu-blocks of at least {need} "
                f"({need * lay.block_bytes / (1 << 30):.2f} GiB a rank), or a smaller --trace-limit or --prompt-len"
            )
        total = CacheSpec.buffer_bytes(lay, nb) * D
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        if total > free:
            raise UsageError(
                f"the decode buffer ({D} x {nb} blocks, {total / (1 << 30):.2f} GiB) does not fit in /dev/shm "
                f"({free / (1 << 30):.2f} GiB free): size it with --buffer-gib or --buffer-blocks (the largest "
                f"request needs {need} blocks, {need * lay.block_bytes / (1 << 30):.2f} GiB a rank)"
            )
        self.cuda = _ffi.cuda.device_count() > 0 and not a.no_gpu
        if a.mode == "local":
            self._check_host_memory(nb, gpu_blocks, need, total)
        self.nb, self.gpu_blocks = nb, gpu_blocks
        self.devices = parse_devices(a.decode_devices, "--decode-devices")  # decode rank r on devices[r % n]
        # cuda_ipc asked for (_check_args made sure of a GPU and no --no-gpu), or under auto
        # with GPU blocks: served beside the others, as a decode engine with GPU caches
        # would; only prefill ranks with GPU caches on this host take it
        ipc = a.transport == "cuda_ipc" or (a.transport == "auto" and self.cuda)
        gspecs: list[CacheSpec] = []
        self.bufs = []
        self.gpu_mem: list[Any] = []
        engines = []
        try:
            for L in self.lays:
                try:
                    b = SharedBuffer.create(CacheSpec.buffer_bytes(L, nb), pin="always" if self.cuda else "never")
                except OSError as exc:
                    if exc.errno not in (errno.ENOMEM, errno.ENOSPC):
                        raise
                    raise UsageError(
                        f"the decode buffer of {nb} blocks per rank cannot be made: {exc.strerror} "
                        "(size it with --buffer-gib or --buffer-blocks)"
                    ) from None
                self.bufs.append(b)
                size = L.block_bytes * gpu_blocks
                dev = None
                if self.cuda:
                    dev = self.devices[L.tp_rank % len(self.devices)]
                    with _ffi.cuda.on_device(dev):
                        ptr = _ffi.cuda.malloc(size)
                    self.gpu_mem.append(ptr)
                    gspecs.append(CacheSpec.for_buffer(L, gpu_blocks, ptr, device=dev))
                else:
                    arr = aligned_empty(size)  # page-aligned, as a real cache would be
                    arr[:] = 0
                    self.gpu_mem.append(arr)
                    ptr = arr.ctypes.data
                engines.append(
                    SwapEngine(
                        CacheSpec.for_buffer(L, nb, b.address),
                        CacheSpec.for_buffer(L, gpu_blocks, ptr, device=dev),
                        strategy="auto" if self.cuda else "host",
                        buffer_pinned=self.cuda,
                    )
                )
            self.engines = engines
            self.sched = DecodeScheduler(
                layout=lay,
                gpu=BlockPool(gpu_blocks, "gpu"),
                buffer=BlockPool(nb, "buffer"),
                swap=SwapGroup(engines),
                block_bytes=lay.block_bytes * D,
                # cuda_ipc: GPU blocks granted at reservation while there are any (written
                # by prefill directly), the buffer and a swap after that
                options=SchedulerOptions(
                    direct_to_gpu=ipc, lease_s=a.lease_s, on_full="queue", queue_timeout_s=a.timeout * 4
                ),
                listener=self._on_event,
            )
            try:
                self.rx = DecodeReceiver(
                    self.sched,
                    self.lays,
                    self.bufs,
                    nb,
                    control=listen,
                    data_host=a.data_host,
                    secret=a.secret.encode() if a.secret else None,
                    auto_tick=True,
                    transports=served_transports(a.transport, ipc),
                    gpu_caches=gspecs if ipc else None,
                    peer_timeout_s=a.timeout,
                    rdma_device=a.rdma_device,
                    rdma_gid_index=a.rdma_gid_index,
                )
            except zmq.ZMQError as exc:  # the control endpoint
                raise UsageError(f"--listen {listen}: {exc}") from None
            except OSError as exc:
                if exc.errno not in (errno.EADDRNOTAVAIL, errno.EADDRINUSE, errno.EACCES):
                    raise
                raise UsageError(f"--data-host {a.data_host}: cannot listen there ({exc.strerror})") from None
        except BaseException:
            self.close()
            raise
        # decode "generates" output_length tokens: a ready request's blocks are held this long
        token_s = (a.token_ms or 0.0) / 1000
        self.hold_s = {r.rid: r.output * token_s for r in make_workload(a)} if token_s else {}
        self.metrics: Any = None
        if a.metrics_port is not None:
            try:
                from ...metrics import DecodeMetrics
            except ImportError as exc:
                self.close()
                raise UsageError(str(exc)) from None
            metrics = self.metrics = DecodeMetrics(self.sched, self.rx)
            try:
                port = metrics.serve(a.metrics_port, a.metrics_addr)
            except OSError as exc:
                self.close()
                raise UsageError(f"--metrics-port {a.metrics_port}: {exc.strerror}") from None
            print(f"metrics on http://{a.metrics_addr}:{port}/metrics", flush=True)
        self.t0 = time.monotonic()
        self._stop = threading.Event()

        self._engine = threading.Thread(target=self._engine_loop, name="decode-engine", daemon=True)
        self._engine.start()

    def stale_segments_note(self) -> str | None:
        """A line naming the buffers that dead processes left in /dev/shm (a killed run's),
        and how to remove them; None when there are none."""
        from ...buffer.sweeper import stale_note

        return stale_note()

    def _check_host_memory(self, nb: int, gpu_blocks: int, need: int, buffer_total: int) -> None:
        """Local mode holds the whole run in this host's memory: the buffers, the host
        stand-in for decode's GPU blocks (without a GPU) and the prefill ranks' caches.
        Refused before anything is allocated when that passes what the host (or this
        process's memory cgroup) has left: the kernel's OOM killer would end the run, and
        a killed process cannot remove its buffer."""
        a = self.a
        lay = self.lays[0]
        stand_in = 0 if self.cuda else lay.block_bytes * gpu_blocks * a.decode_tp
        plin = KVLayout(**self.lay_kw, tp_size=a.prefill_tp)
        prefill = 0 if prefill_on_gpu(a) else plin.block_bytes * max(a.prefill_blocks, need) * a.prefill_tp
        total = buffer_total + stand_in + prefill
        avail, where = available_memory()
        if total > avail:
            gib = 1 << 30
            raise UsageError(
                f"this run needs {total / gib:.1f} GiB of host memory (decode buffer {buffer_total / gib:.1f}, "
                f"host stand-in for {gpu_blocks} GPU blocks {stand_in / gib:.1f}, prefill caches {prefill / gib:.1f}), "
                f"more than the {avail / gib:.1f} GiB {where} has left: lower --prompt-len or --trace-limit, "
                "or set --buffer-gib (or --buffer-blocks) and --gpu-blocks"
            )

    def _on_event(self, ev: Event) -> None:
        with self.lock:
            rid = ev.request_id
            if rid in self._ended:  # a late event of a request already folded
                return
            if ev.kind in ("reserved", "granted"):
                tr = self.tracks.setdefault(rid, Track())
                tr.reserved = ev.t
                tr.blocks = len(ev.grant.blocks) if ev.grant else 0
                tr.location = ev.grant.location if ev.grant else ""
                return
            tr = self.tracks.get(rid) or self.tracks.setdefault(rid, Track())
            if ev.kind == "received":
                tr.received = ev.t
            elif ev.kind == "ready" and not tr.received:  # a GPU grant (cuda_ipc): landed is ready
                tr.received = ev.t
            elif ev.kind in ("failed", "expired", "aborted", "rejected"):
                tr.state, tr.reason = ev.kind, ev.reason
                self._end(rid)

    def _end(self, rid: str) -> None:
        """Fold a request that ended into the tally (under ``lock``)."""
        tr = self.tracks.pop(rid, None)
        if tr is not None:
            self.tally.fold(rid, tr, self.lays[0].block_bytes * self.a.decode_tp)
        self._ended.append(rid)
        self._ended_set.add(rid)
        if len(self._ended) > _LATE:
            self._ended_set.discard(self._ended.popleft())

    def _gpu_block(self, rank: int, layer: int, t: int, blocks: Sequence[int]) -> np.ndarray:
        L = self.lays[rank]
        tb = L.tensor_block_bytes(t)
        mem = self.gpu_mem[rank]
        spec_base = mem if isinstance(mem, int) else mem.ctypes.data
        spec = CacheSpec.for_buffer(L, self.gpu_blocks, spec_base)
        out = np.empty((len(blocks), tb), np.uint8)
        if isinstance(mem, int):
            for i, b in enumerate(blocks):
                _ffi.cuda.memcpy(out[i].ctypes.data, spec.address(layer, t, b), tb)
        else:
            base, stride = spec.region(layer, t)
            region = mem[base - spec_base : base - spec_base + stride * self.gpu_blocks].reshape(
                self.gpu_blocks, stride
            )
            out[:] = region[np.asarray(blocks)][:, :tb]
        return out

    def verify(self, rid: str, blocks: Sequence[int]) -> None:
        rk = request_key(rid)
        gis = np.arange(len(blocks))
        bad = 0
        for r, L in enumerate(self.lays):
            for layer in range(L.total_layers):
                for t in range(len(L.tensors)):
                    got = self._gpu_block(r, layer, t, blocks)
                    want = pattern(L, rk, layer, t, gis)
                    nbad = int((got != want).any(axis=1).sum())
                    bad += nbad
                    self.bytes_verified += got.size
        if bad:
            self.verify_errors += bad
            self.note_failure(f"{rid}: {bad} blocks differ")

    def received_bytes(self) -> int:
        """Bytes landed in decode so far, over every transport."""
        return sum(b for b, _ in self.rx.received_by_transport().values())

    def _engine_loop(self) -> None:
        holding: list[tuple[float, str]] = []  # (finish at, request): decode "generating"
        while not self._stop.is_set():
            ready = self.sched.take_ready()
            for r in ready:
                with self.lock:
                    tr = self.tracks.setdefault(r.request_id, Track())
                    tr.ready = self.sched.clock()
                if not self.a.no_verify:
                    self.verify(r.request_id, r.gpu_blocks)
                tr.state = "ready"
                hold = self.hold_s.get(r.request_id, 0.0)
                if hold:
                    heapq.heappush(holding, (time.monotonic() + hold, r.request_id))
                else:
                    self._finish(r.request_id)
            now = time.monotonic()
            while holding and holding[0][0] <= now:
                self._finish(heapq.heappop(holding)[1])
            if self.timeline.due(now - self.t0):
                m = self.sched.metrics()
                self.timeline.add(
                    (
                        now - self.t0,
                        int(m["buffer_blocks_total"] - m["buffer_blocks_free"]),
                        int(m["gpu_blocks_total"] - m["gpu_blocks_free"]),
                        self.received_bytes(),
                    )
                )
            if not ready:
                time.sleep(0.001)

    def _finish(self, rid: str) -> None:
        try:
            self.sched.finish(rid)
        except PdkvError:  # ended meanwhile (aborted at close): its event folded it
            return
        with self.lock:
            if rid in self.tracks:
                self._end(rid)

    def close(self) -> None:
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
            self.metrics = None
        if getattr(self, "_engine", None) is not None:
            self._stop.set()
            self._engine.join(5)
        if getattr(self, "rx", None) is not None:
            self.rx.close()
        for e in getattr(self, "engines", []):
            e.close()
        for m in self.gpu_mem:
            if isinstance(m, int):
                _ffi.cuda.free(m)
        self.gpu_mem = []
        for b in self.bufs:
            try:
                b.close()
            except PdkvError:
                pass
            b.unlink()
        self.bufs = []
