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
import errno
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import _ffi
from ..errors import ClosedError, GrantViolation, PdkvError, PdkvTimeoutError, PeerError, ProtocolError, TransferError
from ..layout import CacheSpec, KVLayout, Segment
from ..plan import plan_layer, tcp_frames, tcp_items
from ..protocol import Hello, Welcome, data_auth_mac, new_nonce
from ..scheduler import WriteTicket
from .base import Inflight, Peer, ReceiverHost, ReceiverTransport, SenderHost, SenderTransport, WriteItem

_log = logging.getLogger(__name__)

__all__ = ["TcpSender", "TcpReceiver", "FRAME_HEADER", "FRAME_ITEM", "MAX_FRAME_ITEMS", "MAX_FRAME_PAYLOAD"]

FRAME_HEADER = struct.Struct("<4sBBHQIHHIIIIII")
FRAME_ITEM = struct.Struct("<II")
MAX_FRAME_ITEMS = 1024
MAX_FRAME_PAYLOAD = 256 << 20
_MAGIC = b"PDKV"
_K_AUTH, _K_DATA = 1, 2
_ITEMS_PER_FRAME = 64  # blocks per frame: one syscall each side moves them all
# a frame's payload past its first item (runs of blocks are cut to fit): 4 MiB frames beat
# 16 and 64 MiB ones by 5-15 % on the H200 x2 host (docs/PERF.md)
_FRAME_BYTES = 4 << 20
# a frame as sent: header and items, segment, source addresses and blocks of its items,
# the source region's view and base
_Frame = tuple[bytes, Segment, list[int], list[int], tuple[memoryview, int]]
_POLL_S = 0.25  # receive-side socket timeout: how often a blocked receive checks for close
_AUTH_HEAD = FRAME_HEADER.size + 16  # AUTH frame header + session id
# accept() errors that say nothing about the listener: out of descriptors or memory, a
# connection reset before it was taken; back off and keep accepting
_ACCEPT_RETRY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
                           errno.EPROTO, errno.EPERM, errno.EINTR, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                           errno.ENETUNREACH, errno.ENOPROTOOPT, errno.EOPNOTSUPP})


# ---------------------------------------------------------------------- prefill side

class TcpSender(SenderTransport):
    name = "tcp"
    caches = frozenset({"host"})
    auto_rank = 40

    @classmethod
    def refuses(cls, cache: CacheSpec) -> str | None:
        if cache.device is not None:
            return "the tcp transport sends from host caches; stage GPU caches or use shm"
        return None

    def __init__(self, host: SenderHost, options: Any) -> None:
        super().__init__(host, options)
        self._socks: list[socket.socket] = []
        self._views: dict[tuple[int, int], tuple[memoryview, int]] = {}

    def connect(self, welcome: Welcome, layouts: list[KVLayout], deadline: float) -> None:
        host, port = welcome.data_addr.rsplit(":", 1)
        for _ in range(self.options.streams):
            self._socks.append(self._data_connect(host, int(port), welcome.session_id, deadline,
                                                  self.host.timeout_s))

    @property
    def connections(self) -> int:
        return len(self._socks)

    def close(self) -> None:
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

    def _data_connect(self, host: str, port: int, session_id: bytes, deadline: float,
                      timeout_s: float) -> socket.socket:
        """One authenticated data connection: AUTH frame and session id, decode's nonce back,
        the MAC over it under the session's data key, decode's one-byte acceptance. A refusal
        (decode at its cap of connections still authenticating) is retried until the
        handshake's deadline."""
        delay = 0.02
        while True:
            try:
                s = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            except OSError as exc:
                raise PeerError(f"data connection to {host}:{port} failed: {exc}") from None
            try:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.sendall(FRAME_HEADER.pack(_MAGIC, 1, _K_AUTH, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) + session_id)
                nonce = _recv_n(s, 16)
                s.sendall(data_auth_mac(self.host.session_key, session_id, nonce))
                if _recv_n(s, 1) != b"\x01":
                    raise PeerError("decode refused the data connection")
                s.settimeout(timeout_s)
                return s
            except (OSError, PeerError) as exc:
                s.close()
                if time.monotonic() + delay >= deadline:
                    raise PeerError(f"data connection to {host}:{port} was not accepted within {timeout_s}s: "
                                    f"{exc}") from None
            time.sleep(delay)
            delay = min(0.2, delay * 2)

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        pack, item = FRAME_HEADER.pack, FRAME_ITEM.pack
        frames: list[_Frame] = []
        h = self.host
        for w in work:
            for grp in plan_layer(h.segments, h.layout, h.dst_layout, h.cache, None, w.src, w.dst, layer):
                seg = grp.seg
                unit = seg.length * seg.count  # payload bytes per block
                if unit > MAX_FRAME_PAYLOAD:
                    raise TransferError(f"a block's {unit} bytes for tensor {seg.tensor} exceed the tcp frame "
                                        f"limit of {MAX_FRAME_PAYLOAD} bytes")
                gi, nb, src = tcp_items(grp.gi, grp.nb, grp.src, unit, _FRAME_BYTES)
                gis, nbs, srcs = gi.tolist(), nb.tolist(), src.tolist()
                for lo, hi in tcp_frames(nb, unit, _FRAME_BYTES, _ITEMS_PER_FRAME):
                    hdr = pack(_MAGIC, 1, _K_DATA, seg.dst_rank, w.grant.token, layer, seg.tensor, 0, 0, hi - lo,
                               seg.dst_offset, seg.length, seg.count, seg.dst_stride)
                    hdr += b"".join(item(w.first + gis[i], nbs[i]) for i in range(lo, hi))
                    frames.append((hdr, seg, srcs[lo:hi], nbs[lo:hi], self._region(layer, seg.tensor)))
        socks = self._socks
        per = -(-len(frames) // len(socks))  # contiguous shares keep each stream's frames in order
        parts = [frames[i * per:(i + 1) * per] for i in range(len(socks))]
        errors: list[BaseException] = []
        totals, count_lock = [0, 0], threading.Lock()

        def push(sock: socket.socket, fs: list[_Frame]) -> None:
            # payload views are slices of one view of the source region (a slice costs a
            # fraction of a new ctypes view), made here while the previous sendmsg's bytes
            # are in flight
            sent = [0, 0]  # bytes, frames
            try:
                batch: list[bytes | memoryview] = []
                size = 0
                for hdr, seg, srcs, nbs, (rv, rbase) in fs:
                    batch.append(hdr)
                    if seg.count == 1:
                        n1 = seg.length
                        for a, nb in zip(srcs, nbs):
                            o = a - rbase
                            batch.append(rv[o:o + n1 * nb])
                            size += n1 * nb
                    else:
                        for a in srcs:
                            o = a - rbase
                            for c in range(seg.count):
                                q = o + c * seg.src_stride
                                batch.append(rv[q:q + seg.length])
                            size += seg.length * seg.count
                    if len(batch) >= 512 or size >= (8 << 20):
                        _sendmsg_all(sock, batch)
                        sent[0] += size
                        batch, size = [], 0
                    sent[1] += 1
                if batch:
                    _sendmsg_all(sock, batch)
                    sent[0] += size
            except BaseException as exc:
                errors.append(exc)
            finally:  # each thread its own counts, added up once all have ended
                with count_lock:
                    totals[0] += sent[0]
                    totals[1] += sent[1]

        if len(socks) == 1:
            push(socks[0], parts[0])
        else:
            ts = [threading.Thread(target=push, args=(sk, p)) for sk, p in zip(socks, parts) if p]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        h.add_bytes(totals[0], frames=totals[1])
        if errors:
            raise TransferError(f"tcp send failed: {errors[0]}")


# ---------------------------------------------------------------------- decode side

@dataclass
class _PreAuth:
    """A data connection before authentication: read by the accept thread, no thread of its own."""

    deadline: float
    buf: bytearray
    got: int = 0
    nonce: bytes = b""
    session_id: bytes = b""


class TcpReceiver(ReceiverTransport):
    name = "tcp"
    reports_layers = False  # decode counts the bytes it received itself

    def __init__(self, host: ReceiverHost) -> None:
        super().__init__(host)
        self.opts = host.options
        self._rank_info = {lay.tp_rank: (b.buf, b.address, host.specs[lay.tp_rank], lay)
                           for lay, b in zip(host.layouts, host.buffers)}
        self._lsock = socket.create_server((self.opts.data_host, 0), backlog=128)
        self._lsock.setblocking(False)
        self.address = f"{self.opts.data_host}:{self._lsock.getsockname()[1]}"
        # what prefill is told to connect to (differs behind NAT, port forwarding, a proxy)
        self.advertise = self.opts.data_advertise or self.address
        self._conns: dict[socket.socket, bytes] = {}  # authenticated data connection -> peer ident
        self._conn_threads: dict[socket.socket, threading.Thread] = {}
        self._thread = threading.Thread(target=self._accept_loop, name="pdkv-decode-accept", daemon=True)
        self._thread.start()

    def open_session(self, peer: Peer, hello: Hello) -> dict[str, Any]:
        return {"data_addr": self.advertise}

    @property
    def connections(self) -> int:
        """Authenticated data connections whose threads still run."""
        with self.host.lock:
            return len(self._conn_threads)

    def fence(self, peer: Peer) -> None:
        self._close_conns_of(peer.ident)

    def close(self, timeout: float = 5.0) -> None:
        # the accept thread sees host.stopping, closes the listener and pending connections
        self._thread.join(timeout)
        with self.host.lock:
            conns = list(self._conns)
            threads = list(self._conn_threads.values())
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout)

    def _close_conns_of(self, ident: bytes, timeout: float = 2.0) -> None:
        """Shut down a fenced peer's data connections and join their threads (bounded: a
        thread that does not end in time still holds its write tickets, so its blocks stay
        quarantined until it does)."""
        with self.host.lock:
            conns = [c for c, i in self._conns.items() if i == ident]
            threads = [self._conn_threads[c] for c in conns if c in self._conn_threads]
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def _accept_loop(self) -> None:
        """Accepts data connections and authenticates them (non-blocking, in this thread):
        a connection gets a thread only once it has proved its session."""
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, _PreAuth] = {}
        listening = True
        resume_at = 0.0
        sel.register(self._lsock, selectors.EVENT_READ, None)
        try:
            while not self.host.stopping.is_set():
                now = time.monotonic()
                if not listening and now >= resume_at:
                    sel.register(self._lsock, selectors.EVENT_READ, None)
                    listening = True
                try:
                    events = sel.select(0.1)
                except OSError:
                    events = []
                now = time.monotonic()
                for key, _ in events:
                    if key.data is None:
                        if self._accept_one(sel, pending, now):
                            continue
                        sel.unregister(self._lsock)  # out of descriptors: back off, keep serving
                        listening, resume_at = False, now + 0.1
                    else:
                        self._pre_auth_step(sel, pending, key.fileobj, key.data)  # type: ignore[arg-type]
                for c in [c for c, st in pending.items() if st.deadline <= now]:
                    self.host.count("auth_failed")
                    self._drop_pending(sel, pending, c)
        finally:
            for c in list(pending):
                self._drop_pending(sel, pending, c)
            sel.close()
            with contextlib.suppress(OSError):
                self._lsock.close()

    def _accept_one(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _PreAuth], now: float) -> bool:
        """Accept one connection; False when the process is out of descriptors or memory."""
        try:
            conn, _ = self._lsock.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            if exc.errno in _ACCEPT_RETRY:
                self.host.count("accept_errors")
                self.host.warn("accept", "pdkv decode: accept() failed (%s); backing off, still listening",
                                   os.strerror(exc.errno or 0))
                return exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
            if self.host.stopping.is_set():
                return True
            raise
        with self.host.lock:
            nconns = len(self._conns)
        if len(pending) >= self.opts.max_pending_connections or nconns >= self.opts.max_connections:
            self.host.count("connections_refused")
            which = "max_pending_connections" if len(pending) >= self.opts.max_pending_connections else "max_connections"
            self.host.warn(which, "pdkv decode: data connection refused: %s (%d) reached", which,
                               getattr(self.opts, which))
            conn.close()
            return True
        conn.setblocking(False)
        st = _PreAuth(now + self.opts.auth_timeout_s, bytearray(_AUTH_HEAD))
        pending[conn] = st
        sel.register(conn, selectors.EVENT_READ, st)
        return True

    def _drop_pending(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _PreAuth],
                      conn: socket.socket) -> None:
        pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()

    def _pre_auth_step(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _PreAuth],
                       conn: socket.socket, st: _PreAuth) -> None:
        """AUTH frame + session id -> decode's nonce -> the MAC over it (32 bytes) -> b"\\x01"."""
        try:
            k = conn.recv_into(memoryview(st.buf)[st.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if k == 0:
            self._drop_pending(sel, pending, conn)
            return
        st.got += k
        if st.got < len(st.buf):
            return
        if not st.nonce:
            magic, ver, kind, *_ = FRAME_HEADER.unpack_from(st.buf)
            sid = bytes(st.buf[FRAME_HEADER.size:])
            peer = self.host.peer_of_session(sid)
            if magic != _MAGIC or ver != 1 or kind != _K_AUTH or peer is None or peer.transport != self.name:
                self.host.count("auth_failed")
                self.host.count("frames_rejected")
                self._drop_pending(sel, pending, conn)
                return
            st.session_id, st.nonce = sid, new_nonce()
            st.buf, st.got = bytearray(32), 0
            try:
                conn.send(st.nonce)  # 16 bytes into an empty socket buffer: never partial
            except OSError:
                self._drop_pending(sel, pending, conn)
            return
        peer = self.host.peer_of_session(st.session_id)
        if peer is None or not hmac.compare_digest(bytes(st.buf), data_auth_mac(peer.codec.key, st.session_id,
                                                                                 st.nonce)):
            self.host.count("auth_failed")
            self._drop_pending(sel, pending, conn)
            return
        pending.pop(conn)
        sel.unregister(conn)
        try:
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(_POLL_S)
            conn.sendall(b"\x01")
        except OSError:
            conn.close()
            return
        t = threading.Thread(target=self._conn_loop, args=(conn, peer.ident), name="pdkv-decode-data", daemon=True)
        with self.host.lock:
            if self.host.stopping.is_set() or self.host.peer(peer.ident) is None:
                conn.close()
                return
            self._conns[conn] = peer.ident
            self._conn_threads[conn] = t
        t.start()

    def _recv_exact(self, conn: socket.socket, view: memoryview, idle_ok: bool, deadline: float | None = None) -> bool:
        """Fill ``view``; False on a clean EOF before the first byte. A frame that stalls
        for ``io_timeout_s`` or passes ``deadline`` raises; an idle connection between
        frames may wait forever (until the receiver closes or fences its peer)."""
        got, n = 0, len(view)
        stalled = 0.0
        while got < n:
            if deadline is not None and time.monotonic() > deadline:
                raise PdkvTimeoutError("frame not received within its deadline")
            try:
                k = conn.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            except TimeoutError:
                if self.host.stopping.is_set():
                    raise ClosedError("receiver closed") from None
                if got or not idle_ok:
                    stalled += _POLL_S
                    if stalled >= self.opts.io_timeout_s:
                        raise PdkvTimeoutError(f"peer stalled for {self.opts.io_timeout_s}s mid-frame") from None
                continue
            if k == 0:
                if got == 0 and idle_ok:
                    return False
                raise PeerError("connection closed mid-frame")
            if got == 0 and idle_ok and deadline is None:
                deadline = time.monotonic() + self.opts.io_timeout_s  # a header, once begun, is bounded
            got += k
            stalled = 0.0
        return True

    def _conn_loop(self, conn: socket.socket, ident: bytes) -> None:
        hdr = bytearray(FRAME_HEADER.size)
        hv = memoryview(hdr)
        scratch = bytearray(1 << 20)  # allocated once the connection has authenticated
        try:
            while self._recv_exact(conn, hv, idle_ok=True):
                if self.host.peer(ident) is None:
                    raise ClosedError("the peer's session ended")
                self._on_data_frame(conn, ident, hdr, scratch)
        except (PdkvError, OSError) as exc:
            if isinstance(exc, ProtocolError):
                self.host.count("frames_rejected")
        except Exception:
            self.host.count("loop_errors")
            _log.exception("data connection handling failed (connection closed)")
        finally:
            with self.host.lock:
                self._conns.pop(conn, None)
                self._conn_threads.pop(conn, None)
            with contextlib.suppress(OSError):
                conn.close()

    def _recv_views(self, conn: socket.socket, views: list[memoryview], deadline: float) -> None:
        """Scatter-receive into ``views`` (one syscall per up to 1000 buffers), bounded by a
        stall of ``io_timeout_s`` and by ``deadline``."""
        i = 0
        stalled = 0.0
        while i < len(views):
            if time.monotonic() > deadline:
                raise PdkvTimeoutError("frame not received within its deadline")
            chunk = views[i:i + 1000]
            want = sum(len(v) for v in chunk)
            try:
                got = conn.recvmsg_into(chunk, 0, socket.MSG_WAITALL)[0]
            except TimeoutError:
                stalled += _POLL_S
                if self.host.stopping.is_set():
                    raise ClosedError("receiver closed") from None
                if stalled >= self.opts.io_timeout_s:
                    raise PdkvTimeoutError(f"peer stalled for {self.opts.io_timeout_s}s mid-frame") from None
                continue
            if got == 0:
                raise PeerError("connection closed mid-frame")
            stalled = 0.0
            if got == want:
                i += len(chunk)
                continue
            # partial: drop what is full, trim the first partly filled buffer
            k = 0
            while got >= len(views[i + k]):
                got -= len(views[i + k])
                k += 1
            i += k
            views[i] = views[i][got:]

    def _frame_segment(self, peer: Peer, rank: int, tensor: int, off: int, length: int, count: int,
                       dstride: int) -> int:
        """Index of the peer's own segment a frame's geometry names; GrantViolation if none:
        a rank writes only the head ranges the TP mapping gives it."""
        for si, g in enumerate(peer.segs_by_src.get(peer.tp_rank, ())):
            if (g.dst_rank == rank and g.tensor == tensor and g.dst_offset == off and g.length == length
                    and g.count == count and (count == 1 or g.dst_stride == dstride)):
                return si
        raise GrantViolation(f"frame geometry (rank {rank}, tensor {tensor}, offset {off}, {count} x {length} B) "
                             f"is not one of prefill rank {peer.tp_rank}'s segments")

    def _admit(self, peer: Peer, inf: Inflight, layer: int, si: int, items: list[tuple[int, int]]) -> None:
        """Mark the frame's blocks of (layer, rank, segment) as written, all or none:
        GrantViolation if any is outside the grant or was already written."""
        nblk = len(inf.blocks)
        key = (layer, peer.tp_rank, si)
        with self.host.lock:
            cov = inf.cov.get(key)
            if cov is None:
                cov = inf.cov[key] = bytearray(nblk)
            for gi, nb in items:
                if nb == 0 or gi + nb > nblk:
                    raise GrantViolation("write outside the granted blocks")
                if cov.find(1, gi, gi + nb) >= 0:
                    raise GrantViolation(f"request {inf.request_id!r}: blocks of layer {layer} written twice")
            for gi, nb in items:  # checked all first: a refused frame marks nothing
                cov[gi:gi + nb] = b"\x01" * nb

    def _on_data_frame(self, conn: socket.socket, ident: bytes, hdr: bytearray, scratch: bytearray) -> None:
        magic, ver, kind, rank, token, layer, tensor, _, _, nitems, off, length, count, dstride = FRAME_HEADER.unpack(hdr)
        if magic != _MAGIC or ver != 1 or kind != _K_DATA:
            raise ProtocolError("bad frame header")
        if not 0 < nitems <= MAX_FRAME_ITEMS or count == 0 or length == 0:
            raise ProtocolError(f"frame with {nitems} items, count {count}, length {length} is malformed")
        start = time.monotonic()
        raw = bytearray(nitems * FRAME_ITEM.size)
        self._recv_exact(conn, memoryview(raw), idle_ok=False, deadline=start + self.opts.io_timeout_s)
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
            if off + (count - 1) * dstride + length > tb or (count > 1 and dstride < length):
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
                    if count != 1 or off != 0 or length != tb or run_len[gi] < nb:
                        raise GrantViolation("multi-block item over non-contiguous destination blocks")
                    views.append(view[base:base + nb * tb])
                elif count == 1:
                    views.append(view[base + off:base + off + length])
                else:
                    for i in range(count):
                        a = base + off + i * dstride
                        views.append(view[a:a + length])
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
            left = payload
            sv = memoryview(scratch)
            while left:
                k = min(left, len(scratch))
                self._recv_exact(conn, sv[:k], idle_ok=False, deadline=deadline)
                left -= k
            return
        try:
            self._recv_views(conn, views, deadline)
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


def _recv_n(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (the socket's timeout applies); PeerError on EOF."""
    out = bytearray()
    while len(out) < n:
        k = sock.recv(n - len(out))
        if not k:
            raise PeerError("connection closed")
        out += k
    return bytes(out)


def _sendmsg_all(sock: socket.socket, bufs: list[bytes | memoryview]) -> None:
    """Send every buffer, up to 512 per ``sendmsg``, resuming after partial sends."""
    views = [v for v in (b if isinstance(b, memoryview) else memoryview(b) for b in bufs) if v.nbytes]
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i:i + 512])
        while n:
            k = views[i].nbytes
            if n >= k:
                n -= k
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
