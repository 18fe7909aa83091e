"""RDMA (pyverbs) transport pieces: work-request planning, completion tracking, the
handshake record, and :class:`RdmaWriter` that ties them to an RC queue pair.

Decode registers its whole CPU buffer once (one memory region) and sends address, rkey,
QP number and GID in the handshake. Prefill registers its cache once, plans RDMA writes
coalesced over runs contiguous on both sides, posts them as chains with one signaled
work request per ``signal_every``, and checks every completion: any status but success
fails the requests whose writes were in that part of the chain. Waits are bounded.

What has run where: planning, completion handling and the handshake record are unit
tested on CPU machines; :class:`RdmaWriter` is written against pyverbs' documented API
and has **not run on RDMA hardware** (none is available to the project). Without a device
it raises :class:`~pdkv.errors.RdmaUnavailableError` saying so.
"""

from __future__ import annotations

import bisect
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ... import _ffi
from ...errors import PdkvError, PdkvTimeoutError, ProtocolError, RdmaError, TransferError
from ...plan import check_within, coalesce

__all__ = [
    "WriteWR",
    "plan_writes",
    "batch_chains",
    "CompletionTracker",
    "EndpointInfo",
    "RemoteRegion",
    "merge_regions",
    "RdmaWriter",
    "RdmaTarget",
    "WC_STATUS",
]

WC_STATUS = {
    0: "success",
    1: "local length error",
    2: "local QP operation error",
    4: "local protection error",
    5: "work request flushed",
    7: "bad response",
    8: "local access error",
    9: "remote invalid request",
    10: "remote access error",
    11: "remote operation error",
    12: "transport retry counter exceeded",
    13: "RNR retry counter exceeded",
    19: "fatal error",
    20: "response timeout",
    21: "general error",
}
MAX_WR_BYTES = 1 << 30  # at most this per work request, and never more than the port's max_msg_sz
DMABUF_ALIGN = 64 << 10  # a dma-buf export covers whole 64 KiB units (rdma-core's CUDA dma-buf test)
FENCE_FLUSH_S = 2.0  # a fenced queue pair's flush completions are waited for this long


@dataclass(frozen=True, slots=True)
class WriteWR:
    """One RDMA write: ``length`` bytes from ``local`` to ``remote``, for ``request``."""

    request: str
    local: int
    remote: int
    length: int


def plan_writes(
    request: str,
    local: Sequence[int],
    remote: Sequence[int],
    lengths: Sequence[int],
    remote_base: int,
    remote_len: int,
    max_bytes: int = MAX_WR_BYTES,
) -> list[WriteWR]:
    """Coalesce pieces contiguous on both sides into work requests, split at ``max_bytes``,
    and check that every write stays inside the peer's registered region.

    Raises ProtocolError for a write outside ``[remote_base, remote_base+remote_len)``.
    """
    try:  # the planner's bounds check: every piece non-empty and inside the region
        check_within(remote, lengths, remote_base, remote_len, "RDMA write outside the peer's region")
    except TransferError as exc:
        raise ProtocolError(str(exc)) from None
    return [WriteWR(request, la, ra, n) for la, ra, n in coalesce(local, remote, lengths, max_bytes)]


def batch_chains(wrs: Sequence[WriteWR], max_chain: int, signal_every: int) -> list[list[tuple[WriteWR, bool]]]:
    """Split work requests into chains of at most ``max_chain``; inside a chain every
    ``signal_every``-th and the last are signaled (unsignaled ones complete with them:
    the send queue may never hold more than ``signal_every`` unsignaled requests)."""
    if max_chain < 1 or signal_every < 1:
        raise ValueError("max_chain and signal_every must be >= 1")
    chains = []
    for i in range(0, len(wrs), max_chain):
        chunk = wrs[i : i + max_chain]
        chains.append([(w, (j + 1) % signal_every == 0 or j == len(chunk) - 1) for j, w in enumerate(chunk)])
    return chains


@dataclass
class CompletionTracker:
    """Maps work requests to the requests whose writes they carry.

    A signaled completion covers itself and the unsignaled work requests posted before it
    on the same queue pair. A request succeeds when all its covering completions
    succeeded. When a queue pair fails, the device completes the failing work request
    and flushes every later one, signaled or not, with an error status: those are
    matched to their requests too, and fail them.
    """

    _next: int = 1
    _pending: dict[int, set[str]] = field(default_factory=dict)
    _covers: dict[int, list[int]] = field(default_factory=dict)
    _owner: dict[int, str] = field(default_factory=dict)
    _outstanding: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)

    def register_chain(self, chain: list[tuple[WriteWR, bool]]) -> list[int]:
        """Give every work request its id; returns them in chain order."""
        ids, covered, wids = [], set(), []
        for w, sig in chain:
            wid = self._next
            self._next += 1
            ids.append(wid)
            covered.add(w.request)
            wids.append(wid)
            self._owner[wid] = w.request
            if sig:
                self._pending[wid] = covered
                self._covers[wid] = wids
                for r in covered:
                    self._outstanding[r] = self._outstanding.get(r, 0) + 1
                covered, wids = set(), []
        return ids

    def on_completions(self, wcs: Sequence[tuple[int, int]]) -> list[str]:
        """Apply completions ``(wr_id, status)``; return requests that just finished."""
        finished = []
        for wr_id, status in wcs:
            reqs = self._pending.pop(wr_id, None)
            if reqs is None:
                owner = self._owner.get(wr_id)
                if owner is None or status == 0:
                    raise RdmaError(f"completion for unknown work request {wr_id} (status {status})")
                # an unsignaled request completed in error: fail its request now; the
                # signaled one that covers it still completes (flushed) and counts
                self.failed.setdefault(owner, f"RDMA write failed: {WC_STATUS.get(status, f'status {status}')}")
                continue
            for w in self._covers.pop(wr_id, ()):
                self._owner.pop(w, None)
            for r in reqs:
                if status != 0:
                    self.failed.setdefault(r, f"RDMA write failed: {WC_STATUS.get(status, f'status {status}')}")
                n = self._outstanding[r] - 1
                if n:
                    self._outstanding[r] = n
                else:
                    del self._outstanding[r]
                    self.done.add(r)
                    finished.append(r)
        return finished

    def outstanding(self, request: str) -> int:
        return self._outstanding.get(request, 0)

    def wait(self, poll: Callable[[], Sequence[tuple[int, int]]], requests: Sequence[str], timeout: float) -> None:
        """Poll until every request in ``requests`` finished; bounded by ``timeout``."""
        deadline = time.monotonic() + timeout
        while any(self._outstanding.get(r) for r in requests):
            wcs = poll()
            if wcs:
                self.on_completions(wcs)
                continue
            if time.monotonic() > deadline:
                raise PdkvTimeoutError(f"RDMA completions did not arrive within {timeout}s")
            time.sleep(10e-6)


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """What one side tells the other in the handshake (``Welcome.rdma`` / hello)."""

    qpn: int
    psn: int
    lid: int
    gid: str
    mtu: int

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EndpointInfo:
        """Validate a peer's record; ProtocolError for anything missing, mistyped or out of range."""
        keys = ("qpn", "psn", "lid", "gid", "mtu")
        try:
            if set(d) - set(keys):
                raise KeyError(f"unknown fields {sorted(set(d) - set(keys))}")
            e = cls(**{k: d[k] for k in keys})
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"bad RDMA endpoint record: {exc}") from None
        if not all(type(v) is int for v in (e.qpn, e.psn, e.lid, e.mtu)):
            raise ProtocolError(f"RDMA endpoint record with non-integer numbers: {e}")
        if not (0 < e.qpn < 1 << 24 and 0 <= e.psn < 1 << 24 and 0 <= e.lid < 1 << 16 and 1 <= e.mtu <= 5):
            raise ProtocolError(f"RDMA endpoint record out of range: {e}")
        if not isinstance(e.gid, str) or not _ffi.verbs.GID_RE.match(e.gid):
            raise ProtocolError(f"bad GID {e.gid!r:.80} in RDMA endpoint record (eight groups of four hex digits)")
        return e


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """A peer's registered memory region: where RDMA writes may land, and its key."""

    addr: int
    length: int
    rkey: int

    def to_dict(self) -> dict[str, Any]:
        return {"addr": self.addr, "length": self.length, "rkey": self.rkey}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RemoteRegion:
        try:
            r = cls(int(d["addr"]), int(d["length"]), int(d["rkey"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad RDMA region record: {exc}") from None
        if r.addr <= 0 or r.length <= 0 or r.addr + r.length >= 1 << 64 or not 0 <= r.rkey < 1 << 32:
            raise ProtocolError(f"RDMA region record out of range: {r}")
        return r


def merge_regions(regions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(addr, length)`` ranges merged where they overlap or touch, sorted."""
    out: list[list[int]] = []
    for a, n in sorted((a, n) for a, n in regions if n > 0):
        if out and a <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n - out[-1][0])
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]


class RdmaWriter:
    """Prefill's end: its cache registered (one memory region per contiguous range), one
    RC queue pair to a decode receiver, writes into the receiver's regions.

    Raises RdmaUnavailableError when pyverbs or an RDMA device is missing. Call
    :meth:`close` (or use it as a context manager) to release the queue pair, memory
    regions and device.
    """

    def __init__(
        self,
        regions: Sequence[tuple[int, int]],
        *,
        device: str | None = None,
        max_send_wr: int = 1024,
        signal_every: int = 64,
        timeout_s: float = 10.0,
        gpu_regions: Sequence[tuple[int, int]] = (),
        port: int = 1,
        gid_index: int | None = None,
        gpu: int | None = None,
    ) -> None:
        # the device named, else the one nearest ``gpu`` (a GPU cache's), else the first
        self._res: dict[str, Any] = _ffi.verbs.open_device(device, port=port, gid_index=gid_index, gpu=gpu)
        self._busy = threading.Lock()  # held while a write posts or polls; close() waits for it
        self.timeout_s = timeout_s
        self._mrs: list[Any] = []
        self._qp: Any = None
        self._local: list[tuple[int, int, int]] = []  # (start, end, lkey), sorted
        self._starts: list[int] = []
        self.gpudirect = ""  # how GPU memory was registered: "dma-buf", "peer memory"
        try:
            merged = merge_regions(regions)
            _ffi.verbs.check_memlock(sum(n for _, n in merged))
            for addr, n in merged:
                self.add_region(addr, n)
            if gpu_regions:
                self._register_gpu(gpu_regions, gpu)
            self._qp = _ffi.verbs.create_rc_qp(self._res, max_send_wr)
        except BaseException:
            self.close()
            raise
        self.max_chain = max(1, max_send_wr // 2)
        self.signal_every = min(signal_every, self.max_chain)
        self.timeout_s = timeout_s
        self.tracker = CompletionTracker()
        self.connected = False
        self.psn = secrets.randbelow(1 << 24)  # where this end's sends start, announced in the handshake
        # one work request moves at most the port's largest message (queried, not assumed)
        self.max_wr_bytes = max(1, min(MAX_WR_BYTES, int(self._res.get("max_msg_sz") or MAX_WR_BYTES)))

    def add_region(self, addr: int, n: int) -> None:
        """Register host memory ``[addr, addr+n)`` as a local source (a staging ring)."""
        mr, lkey, _ = _ffi.verbs.register(self._res, addr, n, remote_write=False)
        self._add(mr, addr, n, lkey)

    def _add(self, mr: Any, addr: int, n: int, lkey: int) -> None:
        self._mrs.append(mr)
        self._local.append((addr, addr + n, lkey))
        self._local.sort()
        self._starts = [r[0] for r in self._local]

    def _register_gpu(self, regions: Sequence[tuple[int, int]], gpu: int | None) -> None:
        """GPUDirect: each GPU allocation under ``regions`` registered once, as a whole (a
        dma-buf of it where the device exports one: ``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED``,
        the range rounded to 64 KiB, ``SYNC_MEMOPS`` set; else its address, for a
        peer-memory client); RdmaError if the NIC takes neither."""
        allocs = sorted({_ffi.cuda.address_range(a) for a, _ in merge_regions(regions)})
        try:
            exportable = gpu is not None and _ffi.cuda.dmabuf_supported(gpu)
        except PdkvError:
            exportable = False
        for base, size in allocs:
            fd = None
            if exportable:
                try:
                    _ffi.cuda.set_sync_memops(base)
                    fd = _ffi.cuda.dmabuf_fd(base, -(-size // DMABUF_ALIGN) * DMABUF_ALIGN)
                except PdkvError:
                    fd = None  # not exportable here: peer memory may still take it
            try:
                mr, lkey, _, how = _ffi.verbs.register_gpu(self._res, base, size, fd)
            finally:
                if fd is not None:
                    os.close(fd)  # the MR holds its own reference to the dma-buf
            self._add(mr, base, size, lkey)
            self.gpudirect = self.gpudirect or how

    def local_info(self) -> EndpointInfo:
        """This end's record for the peer, with its random starting PSN."""
        return EndpointInfo(int(self._qp.qp_num), self.psn, self._res["lid"], self._res["gid"], self._res["mtu"])

    def connect(self, remote: EndpointInfo) -> None:
        _ffi.verbs.connect_qp(self._res, self._qp, remote.to_dict(), local_psn=self.psn)
        self.connected = True

    def lkey(self, addr: int, n: int) -> int:
        """Key of the local region holding ``[addr, addr+n)``; RdmaError if none does."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr + n > self._local[i][1]:
            raise RdmaError(f"local range [{addr:#x}, +{n}) is not inside a registered region")
        return self._local[i][2]

    def write(
        self, request: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int], region: RemoteRegion
    ) -> None:
        """Post every write of ``request`` into ``region`` and wait (bounded) for their
        completions; raise RdmaError if any completion failed. Completions that do not come
        in time fence the queue pair (:meth:`_fence`) before RdmaError is raised: no write
        of it can land after the caller reports the request failed."""
        with self._busy:
            if not self.connected or self._qp is None:
                raise RdmaError("queue pair not connected")
            wrs = plan_writes(request, local, remote, lengths, region.addr, region.length, self.max_wr_bytes)
            for chain in batch_chains(wrs, self.max_chain, self.signal_every):
                ids = self.tracker.register_chain(chain)
                _ffi.verbs.post_writes(
                    self._qp,
                    [
                        (i, w.local, w.length, self.lkey(w.local, w.length), w.remote, region.rkey, sig)
                        for i, (w, sig) in zip(ids, chain)
                    ],
                )
                try:
                    self.tracker.wait(self._poll, [request], self.timeout_s)
                except PdkvTimeoutError as exc:
                    self._fence(request)
                    raise RdmaError(f"request {request!r}: {exc}; the queue pair is fenced (error state)") from None
            err = self.tracker.failed.pop(request, None)
            self.tracker.done.discard(request)
            if err is not None:
                raise RdmaError(f"request {request!r}: {err}")

    def _poll(self) -> Sequence[tuple[int, int]]:
        return _ffi.verbs.poll(self._res["cq"], 64)

    def _fence(self, request: str) -> None:
        """The queue pair to the error state, then its flush completions collected (bounded):
        once flushed, the device sends none of its work requests any more. Every later
        write fails at once (the session is over: a failed queue pair is never reused)."""
        self.connected = False
        try:
            _ffi.verbs.to_error(self._qp)
            self.tracker.wait(self._poll, [request], FENCE_FLUSH_S)
        except PdkvError:  # flushes that never come: the queue pair is destroyed on close
            pass

    def close(self, timeout: float | None = None) -> None:
        """Release the queue pair, memory regions and device, in verbs order (QP, MRs, CQ,
        PD, context), once no write is posting or polling (waited for, bounded: a write
        still running then leaves them allocated rather than destroyed under it). Idempotent."""
        limit = self.timeout_s + FENCE_FLUSH_S + 1 if timeout is None else timeout
        if not self._busy.acquire(timeout=limit):
            import logging

            logging.getLogger(__name__).warning("an RDMA write is still running: its verbs resources are left")
            return
        try:
            if self._qp is not None:
                _ffi.verbs.close(self._qp)
                self._qp = None
            _release(self._mrs, self._res)
            self._res = {}
        finally:
            self._busy.release()

    def __enter__(self) -> RdmaWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RdmaTarget:
    """Decode's end: every rank's buffer registered once for remote writes, and one RC
    queue pair per prefill peer. Destroying a peer's queue pair is its fence: no write of
    that peer can land afterwards.

    Raises RdmaUnavailableError when pyverbs or an RDMA device is missing.
    """

    def __init__(
        self,
        buffers: Sequence[tuple[int, int, int]],
        *,
        device: str | None = None,
        max_send_wr: int = 16,
        port: int = 1,
        gid_index: int | None = None,
    ) -> None:
        """``buffers``: ``(rank, addr, length)`` of each buffer this receiver hosts."""
        self._res = _ffi.verbs.open_device(device, port=port, gid_index=gid_index)
        self._mrs: list[Any] = []
        self._qps: dict[int, Any] = {}
        self._max_send_wr = max_send_wr
        try:
            _ffi.verbs.check_memlock(sum(n for _, _, n in buffers))
            self.regions: dict[int, RemoteRegion] = {}
            for rank, addr, n in buffers:
                mr, _, rkey = _ffi.verbs.register(self._res, addr, n, remote_write=True)
                self._mrs.append(mr)
                self.regions[rank] = RemoteRegion(addr, n, rkey)
        except BaseException:
            self.close()
            raise

    def accept(self, prefill: EndpointInfo) -> EndpointInfo:
        """A queue pair connected to ``prefill``'s; returns this end's record."""
        qp = _ffi.verbs.create_rc_qp(self._res, self._max_send_wr)
        psn = secrets.randbelow(1 << 24)  # random starting PSNs, as rdma-core's own tests use
        try:
            _ffi.verbs.connect_qp(self._res, qp, prefill.to_dict(), local_psn=psn)
        except BaseException:
            _ffi.verbs.close(qp)
            raise
        qpn = int(qp.qp_num)
        self._qps[qpn] = qp
        return EndpointInfo(qpn, psn, self._res["lid"], self._res["gid"], self._res["mtu"])

    def drop(self, qpn: int) -> None:
        """Destroy one peer's queue pair (fence it)."""
        qp = self._qps.pop(qpn, None)
        if qp is not None:
            _ffi.verbs.close(qp)

    def close(self) -> None:
        """Destroy every queue pair, deregister the buffers, close the device. Idempotent."""
        for qpn in list(self._qps):
            self.drop(qpn)
        _release(self._mrs, self._res)
        self._res = {}


def _release(mrs: list[Any], res: dict[str, Any]) -> None:
    """Deregister memory regions (emptying the list), then close the device resources
    (``{}`` once closed: nothing left to close)."""
    for mr in mrs:
        _ffi.verbs.close(mr)
    mrs.clear()
    if res:
        _ffi.verbs.close_device(res)
