"""The tcp transport: framed payloads over authenticated TCP connections.

Prefill (:class:`TcpSender`) opens ``streams`` data connections, each proving the session
(AUTH frame and session id, decode's nonce, the MAC over it under the session key), and
streams each layer as frames: a header, ``(grant index, blocks)`` items, then the items'
bytes. Decode (:class:`TcpReceiver`) authenticates connections in its accept thread
(non-blocking, capped; a connection gets a thread only once authenticated), checks every
frame against the live grant of the connection's own session and the sending rank's own
TP segments before a byte moves, ``recv_into``s the payload straight into the granted
blocks under a write ticket and a deadline, and credits the landed bytes.

Frame header (``FRAME_HEADER``): magic, version, kind, dst_rank, token, layer, tensor, pad,
reserved, nitems, offset, length, count, dst_stride; then nitems ``FRAME_ITEM`` pairs.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import _ffi
from ...errors import ClosedError, GrantViolation, PdkvError, ProtocolError, TransferError
from ...layout import KVLayout, Segment
from ...plan import plan_layer, tcp_frames, tcp_items
from ...protocol import Hello, Welcome
from ...scheduling.scheduler import WriteTicket
from .base import Inflight, Peer, ReceiverHost, ReceiverTransport, SenderHost, SenderTransport, WriteItem
from .sockets import FRAME_HEADER, K_DATA, MAGIC, DataListener, connect_authenticated, sendmsg_all
from .staging import StagedSends, chunk_ranges, make_staged

_log = logging.getLogger(__name__)

__all__ = ["TcpSender", "TcpReceiver", "FRAME_HEADER", "FRAME_ITEM", "MAX_FRAME_ITEMS", "MAX_FRAME_PAYLOAD"]

FRAME_ITEM = struct.Struct("<II")
MAX_FRAME_ITEMS = 1024
MAX_FRAME_PAYLOAD = 256 << 20
_ITEMS_PER_FRAME = 64  # blocks per frame: one syscall each side moves them all
# a frame's payload past its first item (runs of blocks are cut to fit): 4 MiB frames beat
# 16 and 64 MiB ones by 5-15 % on the H200 x2 host (docs/PERF.md)
_FRAME_BYTES = 4 << 20
# a frame as sent: header and items, segment, source addresses and blocks of its items,
# the source region's view and base (empty when staged), and the request's id
_Frame = tuple[bytes, Segment, list[int], list[int], tuple[memoryview, int], str]


# ---------------------------------------------------------------------- prefill side


class TcpSender(SenderTransport):
    """Frames from a host cache go out of the cache itself; from a GPU cache (or with
    ``staging="always"``) each layer is gathered chunk by chunk into a pinned staging ring
    (:class:`~.staging.StagedSends`) and sent from there while the next chunk is gathered."""

    name = "tcp"
    caches = frozenset({"host", "gpu"})
    auto_rank = 40

    def __init__(self, host: SenderHost, options: Any) -> None:
        super().__init__(host, options)
        self._socks: list[socket.socket] = []
        self._views: dict[tuple[int, int], tuple[memoryview, int]] = {}
        self._staged: StagedSends | None = None
        self._dst_packed = True

    def connect(self, welcome: Welcome, layouts: list[KVLayout], deadline: float) -> None:
        # decode's buffers: a run of blocks is one item only where they are packed per layer
        self._dst_packed = welcome.buffer_order == "layer"
        host, port = welcome.data_addr.rsplit(":", 1)
        for _ in range(self.options.streams):
            self._socks.append(
                connect_authenticated(
                    host, int(port), welcome.session_id, self.host.session_key, deadline, self.host.timeout_s
                )
            )
        if self.host.cache.device is not None or self.options.staging == "always":
            self._staged = make_staged(self.host, self.options)

    @property
    def connections(self) -> int:
        return len(self._socks)

    @property
    def staging(self) -> StagedSends | None:
        return self._staged

    @property
    def path(self) -> str:
        if self._staged is None:
            return "tcp"
        return f"tcp staged ({self._staged.strategy} gather)"

    def after_writes(self, fn: Callable[[], None]) -> None:
        if self._staged is None:
            fn()
        else:
            self._staged.after(fn)

    def close(self) -> None:
        for s in self._socks:  # a send blocked in the staged worker returns now
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if self._staged is not None:
            self._staged.close(self.host.timeout_s)
            self._staged = None
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
        self._socks.clear()

    def _region(self, layer: int, tensor: int) -> tuple[memoryview, int]:
        v = self._views.get((layer, tensor))
        if v is None:
            spec = self.host.cache
            base, stride = spec.region(layer, tensor)
            v = self._views[(layer, tensor)] = (_ffi.libc.host_view(base, stride * spec.num_blocks), base)
        return v

    def _frames(self, layer: int, work: list[WriteItem]) -> list[_Frame]:
        """Every frame of the layer, in send order: header and items, and where its payload is."""
        pack, item = FRAME_HEADER.pack, FRAME_ITEM.pack
        frames: list[_Frame] = []
        h = self.host
        staged = self._staged is not None
        # a staged frame fits one slot
        cap = min(_FRAME_BYTES, self._staged.slot_bytes) if self._staged is not None else _FRAME_BYTES
        for w in work:
            for grp in plan_layer(
                h.segments, h.layout, h.dst_layout, h.cache, None, w.src, w.dst, layer, dst_packed=self._dst_packed
            ):
                seg = grp.seg
                unit = seg.length * seg.count  # payload bytes per block
                if unit > MAX_FRAME_PAYLOAD:
                    raise TransferError(
                        f"a block's {unit} bytes for tensor {seg.tensor} exceed the tcp frame "
                        f"limit of {MAX_FRAME_PAYLOAD} bytes"
                    )
                gi, nb, src = tcp_items(grp.gi, grp.nb, grp.src, unit, cap)
                gis, nbs, srcs = gi.tolist(), nb.tolist(), src.tolist()
                # a GPU cache has no host view: its payload is gathered into a slot first
                region = (_NO_VIEW, 0) if staged else self._region(layer, seg.tensor)
                for lo, hi in tcp_frames(nb, unit, cap, _ITEMS_PER_FRAME):
                    hdr = pack(
                        MAGIC,
                        1,
                        K_DATA,
                        seg.dst_rank,
                        w.grant.token,
                        layer,
                        seg.tensor,
                        0,
                        0,
                        hi - lo,
                        seg.dst_offset,
                        seg.length,
                        seg.count,
                        seg.dst_stride,
                    )
                    hdr += b"".join(item(w.first + gis[i], nbs[i]) for i in range(lo, hi))
                    frames.append((hdr, seg, srcs[lo:hi], nbs[lo:hi], region, w.request_id))
        return frames

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        frames = self._frames(layer, work)
        if self._staged is not None:
            self._stage(layer, frames, self._staged)
            return
        parts = self._shares(frames)
        totals, errors = _fan_out(self._socks, parts, _push_direct)
        self.host.add_bytes(totals[0], frames=totals[1])
        if errors:
            raise TransferError(f"tcp send failed: {errors[0]}")

    def _shares(self, frames: list[Any]) -> list[list[Any]]:
        """Contiguous shares, one per stream: each stream's frames stay in order."""
        n = len(self._socks)
        per = -(-len(frames) // n)
        return [frames[i * per : (i + 1) * per] for i in range(n)]

    def _stage(self, layer: int, frames: list[_Frame], staged: StagedSends) -> None:
        """The layer's frames cut into slot-sized chunks; each chunk's payload gathered in
        send order into a slot, then sent from it by the staged worker."""
        sizes = [sum(nbs) * seg.length * seg.count for _, seg, _, nbs, _, _ in frames]
        for lo, hi in chunk_ranges(sizes, staged.slot_bytes):
            srcs, lens, sent = [], [], []
            off = 0
            for (hdr, seg, fsrc, nbs, _, _), n in zip(frames[lo:hi], sizes[lo:hi]):
                a = np.asarray(fsrc, dtype=np.int64)
                if seg.count == 1:
                    srcs.append(a)
                    lens.append(np.asarray(nbs, dtype=np.int64) * seg.length)
                else:  # one piece per token of each block, as decode reads them
                    c = np.arange(seg.count, dtype=np.int64) * seg.src_stride
                    srcs.append((a[:, None] + c).ravel())
                    lens.append(np.full(a.size * seg.count, seg.length, dtype=np.int64))
                sent.append((hdr, off, n))
                off += n
            rids = frozenset(f[5] for f in frames[lo:hi])
            staged.stage(layer, np.concatenate(srcs), np.concatenate(lens), rids, self._sends_of(sent))

    def _sends_of(self, sent: list[tuple[bytes, int, int]]) -> list[Callable[[memoryview], None] | None]:
        """One send per stream, each its contiguous share of the chunk's frames: the
        streams' lanes send their shares without waiting for each other."""

        def lane(sock: socket.socket, share: list[tuple[bytes, int, int]]) -> Callable[[memoryview], None]:
            def send(view: memoryview) -> None:
                done = [0, 0]  # bytes, frames
                try:
                    _push_staged(sock, [(hdr, view[o : o + n], n) for hdr, o, n in share], done)
                except OSError as exc:
                    raise TransferError(f"tcp send failed: {exc}") from exc
                finally:
                    self.host.add_bytes(done[0], frames=done[1])

            return send

        return [lane(sk, sh) if sh else None for sk, sh in zip(self._socks, self._shares(sent))]


_NO_VIEW = memoryview(b"")


def _push_direct(sock: socket.socket, fs: list[_Frame], sent: list[int]) -> None:
    # payload views are slices of one view of the source region (a slice costs a fraction
    # of a new ctypes view), made here while the previous sendmsg's bytes are in flight
    batch: list[bytes | memoryview] = []
    size = 0
    for hdr, seg, srcs, nbs, (rv, rbase), _ in fs:
        batch.append(hdr)
        if seg.count == 1:
            n1 = seg.length
            for a, nb in zip(srcs, nbs):
                o = a - rbase
                batch.append(rv[o : o + n1 * nb])
                size += n1 * nb
        else:
            for a in srcs:
                o = a - rbase
                for c in range(seg.count):
                    q = o + c * seg.src_stride
                    batch.append(rv[q : q + seg.length])
                size += seg.length * seg.count
        if len(batch) >= 512 or size >= (8 << 20):
            sendmsg_all(sock, batch)
            sent[0] += size
            batch, size = [], 0
        sent[1] += 1
    if batch:
        sendmsg_all(sock, batch)
        sent[0] += size


def _push_staged(sock: socket.socket, fs: list[tuple[bytes, memoryview, int]], sent: list[int]) -> None:
    # a staged frame's payload is one contiguous slice of its slot
    batch: list[bytes | memoryview] = []
    size = 0
    for hdr, payload, n in fs:
        batch += (hdr, payload)
        size += n
        sent[1] += 1
        if size >= (8 << 20):
            sendmsg_all(sock, batch)
            sent[0] += size
            batch, size = [], 0
    if batch:
        sendmsg_all(sock, batch)
        sent[0] += size


def _fan_out(
    socks: list[socket.socket], parts: list[list[Any]], push: Callable[[socket.socket, list[Any], list[int]], None]
) -> tuple[list[int], list[BaseException]]:
    """Each share pushed on its own stream (one thread each when there are several); the
    bytes and frames sent, and the errors."""
    errors: list[BaseException] = []
    totals, count_lock = [0, 0], threading.Lock()

    def run(sock: socket.socket, fs: list[Any]) -> None:
        sent = [0, 0]  # bytes, frames
        try:
            push(sock, fs, sent)
        except BaseException as exc:
            errors.append(exc)
        finally:  # each thread its own counts, added up once all have ended
            with count_lock:
                totals[0] += sent[0]
                totals[1] += sent[1]

    if len(socks) == 1:
        run(socks[0], parts[0])
    else:
        ts = [threading.Thread(target=run, args=(sk, p)) for sk, p in zip(socks, parts) if p]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return totals, errors


# ---------------------------------------------------------------------- decode side


class TcpReceiver(ReceiverTransport):
    name = "tcp"
    reports_layers = False  # decode counts the bytes it received itself
    engine_memory = True  # receives into any host memory by address

    def __init__(self, host: ReceiverHost) -> None:
        super().__init__(host)
        self.opts = host.options
        self._rank_info = {
            lay.tp_rank: (b.buf, b.address, host.specs[lay.tp_rank], lay) for lay, b in zip(host.layouts, host.buffers)
        }
        self.data = DataListener(host, self.name, self._frames)
        self.address = self.data.address
        # what prefill is told to connect to (differs behind NAT, port forwarding, a proxy)
        self.advertise = self.opts.data_advertise or self.address

    def open_session(self, peer: Peer, hello: Hello) -> dict[str, Any]:
        return {"data_addr": self.advertise}

    @property
    def connections(self) -> int:
        """Authenticated data connections whose threads still run."""
        return self.data.connections

    def fence(self, peer: Peer) -> None:
        self.data.close_conns_of(peer.ident)

    def close(self, timeout: float = 5.0) -> None:
        self.data.close(timeout)

    def _frames(self, conn: socket.socket, ident: bytes) -> None:
        """An authenticated connection: frame after frame until EOF or an error."""
        hdr = bytearray(FRAME_HEADER.size)
        hv = memoryview(hdr)
        scratch = bytearray(1 << 20)  # allocated once the connection has authenticated
        while self.data.recv_exact(conn, hv, idle_ok=True):
            if self.host.peer(ident) is None:
                raise ClosedError("the peer's session ended")
            self._on_data_frame(conn, ident, hdr, scratch)

    def _frame_segment(
        self, peer: Peer, rank: int, tensor: int, off: int, length: int, count: int, dstride: int
    ) -> int:
        """Index of the peer's own segment a frame's geometry names; GrantViolation if none:
        a rank writes only the head ranges the TP mapping gives it."""
        for si, g in enumerate(peer.segs_by_src.get(peer.tp_rank, ())):
            if (
                g.dst_rank == rank
                and g.tensor == tensor
                and g.dst_offset == off
                and g.length == length
                and g.count == count
                and (count == 1 or g.dst_stride == dstride)
            ):
                return si
        raise GrantViolation(
            f"frame geometry (rank {rank}, tensor {tensor}, offset {off}, {count} x {length} B) "
            f"is not one of prefill rank {peer.tp_rank}'s segments"
        )

    def _admit(self, peer: Peer, inf: Inflight, layer: int, si: int, items: list[tuple[int, int]]) -> None:
        """Mark the frame's blocks of (layer, rank, segment) as written, all or none:
        GrantViolation if any is outside the grant or was already written."""
        nblk = len(inf.blocks)
        key = (layer, peer.tp_rank, si)
        with self.host.lock:
            cov = inf.cov.get(key)
            if cov is None:
                cov = inf.cov[key] = bytearray(nblk)
            for i, (gi, nb) in enumerate(items):  # marked as checked: twice in this frame is twice
                if nb == 0 or gi + nb > nblk or cov.find(1, gi, gi + nb) >= 0:
                    for gj, nj in items[:i]:  # a refused frame marks nothing
                        cov[gj : gj + nj] = bytes(nj)
                    if nb == 0 or gi + nb > nblk:
                        raise GrantViolation("write outside the granted blocks")
                    raise GrantViolation(f"request {inf.request_id!r}: blocks of layer {layer} written twice")
                cov[gi : gi + nb] = b"\x01" * nb

    def _on_data_frame(self, conn: socket.socket, ident: bytes, hdr: bytearray, scratch: bytearray) -> None:
        magic, ver, kind, rank, token, layer, tensor, _, _, nitems, off, length, count, dstride = FRAME_HEADER.unpack(
            hdr
        )
        if magic != MAGIC or ver != 1 or kind != K_DATA:
            raise ProtocolError("bad frame header")
        if not 0 < nitems <= MAX_FRAME_ITEMS or count == 0 or length == 0:
            raise ProtocolError(f"frame with {nitems} items, count {count}, length {length} is malformed")
        start = time.monotonic()
        raw = bytearray(nitems * FRAME_ITEM.size)
        self.data.recv_exact(conn, memoryview(raw), idle_ok=False, deadline=start + self.opts.io_timeout_s)
        items = list(FRAME_ITEM.iter_unpack(raw))
        payload = sum(nb for _, nb in items) * count * length
        if payload > MAX_FRAME_PAYLOAD or payload == 0:
            raise ProtocolError(f"frame payload of {payload} bytes is out of bounds")
        # the whole frame has a deadline: a write admitted under a live grant cannot be
        # trickled past it (its blocks stay held until it ends, and it ends by then)
        deadline = start + self.opts.io_timeout_s + payload / self.opts.min_data_rate
        inf = self.host.inflight_of_token(token)
        peer = self.host.peer(ident)
        ri = self._rank_info.get(rank)
        ticket: WriteTicket | None = None
        try:
            if peer is None:
                raise ClosedError("the peer's session ended")
            if inf is None or ri is None:
                raise GrantViolation("frame for an unknown grant or a rank not hosted here")
            if ident not in inf.peers:
                raise GrantViolation(f"frame for request {inf.request_id!r}, whose grant is not this session's")
            if inf.location != "buffer":
                raise GrantViolation("frame for a grant of GPU blocks (only cuda_ipc writes those)")
            view, buf_addr, spec, lay = ri
            if not (layer < lay.total_layers and tensor < len(lay.tensors)):
                raise GrantViolation("layer or tensor out of range")
            tb = lay.tensor_block_bytes(tensor)
            if off + (count - 1) * dstride + length > lay.tensor_block_extent(tensor) or (
                count > 1 and dstride < length
            ):
                raise GrantViolation("write outside the granted blocks")
            si = self._frame_segment(peer, rank, tensor, off, length, count, dstride)
            rbase, stride = spec.region(layer, tensor)
            rbase -= buf_addr
            blocks, run_len, nblk = inf.blocks, inf.run_len, len(inf.blocks)
            views = []
            for gi, nb in items:
                if nb == 0 or gi + nb > nblk:
                    raise GrantViolation("write outside the granted blocks")
                base = rbase + blocks[gi] * stride
                if nb > 1:
                    if count != 1 or off != 0 or length != tb or stride != tb or run_len[gi] < nb:
                        raise GrantViolation("multi-block item over non-contiguous destination blocks")
                    views.append(view[base : base + nb * tb])
                elif count == 1:
                    views.append(view[base + off : base + off + length])
                else:
                    for i in range(count):
                        a = base + off + i * dstride
                        views.append(view[a : a + length])
            # the scheduler decides whether the grant is live, and holds its blocks until
            # end_write; then the frame's pieces are claimed (never written twice)
            ticket = self.host.scheduler.begin_write(inf.request_id, token)
            self._admit(peer, inf, layer, si, items)
        except PdkvError as exc:
            if ticket is not None:
                self.host.scheduler.end_write(ticket)
            if isinstance(exc, ClosedError):
                raise
            # stale or forged: read and drop the payload, never into the buffer
            self.host.count("frames_rejected")
            # the text, not the exception: a record keeps its arguments (a test's log
            # capture, a queue handler), and the traceback's frame holds views of the buffer
            _log.debug("pdkv decode: tcp frame of %d bytes refused: %s", payload, str(exc))
            left = payload
            sv = memoryview(scratch)
            while left:
                k = min(left, len(scratch))
                self.data.recv_exact(conn, sv[:k], idle_ok=False, deadline=deadline)
                left -= k
            return
        try:
            self.data.recv_views(conn, views, deadline)
        except BaseException as exc:
            # part of a layer is written and the rest never will be: the request fails now,
            # and its blocks stay held until this write has ended (end_write below)
            self.host.scheduler.end_write(ticket)
            self.host.count("frames_cut")
            with contextlib.suppress(PdkvError):
                self.host.scheduler.fail(inf.request_id, f"tcp data frame failed mid-payload: {exc}", token=token)
            raise
        self.host.scheduler.end_write(ticket)
        self.host.count("frames")
        self.host.count("bytes", payload)
        try:
            self.host.credit(inf, layer, payload)
        except PdkvError:
            self.host.count("frames_rejected")
