"""Authenticated data connections: their wire header, the AUTH exchange on both sides,
the decode-side listener that authenticates connections before giving them a thread, and
bounded receives and scatter sends.

A data connection proves its session: prefill sends an AUTH frame header and the session
id, decode answers a fresh nonce, prefill the MAC over it under the session's key
(:func:`~pdkv.protocol.data_auth_mac`), decode one byte of acceptance. Until then the
connection is read by the listener's accept thread (non-blocking, capped, with a
deadline) and holds no thread or buffer of its own.
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
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import ClosedError, PdkvError, PdkvTimeoutError, PeerError, ProtocolError
from ...protocol import data_auth_mac, new_nonce
from .base import ReceiverHost

__all__ = [
    "FRAME_HEADER",
    "MAGIC",
    "K_AUTH",
    "K_DATA",
    "DataListener",
    "connect_authenticated",
    "recv_n",
    "sendmsg_all",
    "kernel_timeouts",
]

_log = logging.getLogger(__name__)

# header of every frame on a data connection: magic, version, kind, dst_rank, token, layer,
# tensor, pad, reserved, nitems, offset, length, count, dst_stride (an AUTH frame: zeros)
FRAME_HEADER = struct.Struct("<4sBBHQIHHIIIIII")
MAGIC = b"PDKV"
K_AUTH, K_DATA = 1, 2
_POLL_S = 0.25  # receive-side socket timeout: how often a blocked receive checks for close
# what a receive or send that hit the kernel's timeout (SO_RCVTIMEO / SO_SNDTIMEO) raises
# with nothing moved: EAGAIN (BlockingIOError); TimeoutError where Python's own timeout is set
_TICK = (TimeoutError, BlockingIOError)
_AUTH_HEAD = FRAME_HEADER.size + 16  # AUTH frame header + session id
# accept() errors that say nothing about the listener: out of descriptors or memory, a
# connection reset before it was taken; back off and keep accepting
_ACCEPT_RETRY = frozenset(
    {
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOBUFS,
        errno.ENOMEM,
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.EPERM,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENOPROTOOPT,
        errno.EOPNOTSUPP,
    }
)


@dataclass
class _PreAuth:
    """A data connection before authentication: read by the accept thread, no thread of its own."""

    deadline: float
    buf: bytearray
    got: int = 0
    nonce: bytes = b""
    session_id: bytes = b""


class DataListener:
    """Decode's listener for the data connections of transport ``transport``: accepts,
    authenticates against the host's sessions of that transport, then runs ``handler(conn,
    peer ident)`` on a thread of its own per connection (closed when it returns or raises)."""

    def __init__(self, host: ReceiverHost, transport: str, handler: Callable[[socket.socket, bytes], None]) -> None:
        self.host = host
        self.opts = host.options
        self.transport = transport
        self.handler = handler
        self._lsock = socket.create_server((self.opts.data_host, 0), backlog=128)
        self._lsock.setblocking(False)
        self.address = f"{self.opts.data_host}:{self._lsock.getsockname()[1]}"
        self._conns: dict[socket.socket, bytes] = {}  # authenticated data connection -> peer ident
        self._conn_threads: dict[socket.socket, threading.Thread] = {}
        self._thread = threading.Thread(target=self._accept_loop, name="pdkv-decode-accept", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Authenticated data connections whose threads still run."""
        with self.host.lock:
            return len(self._conn_threads)

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

    def close_conns_of(self, ident: bytes, timeout: float = 2.0) -> None:
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
                self.host.warn(
                    "accept",
                    "pdkv decode: accept() failed (%s); backing off, still listening",
                    os.strerror(exc.errno or 0),
                )
                return exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
            if self.host.stopping.is_set():
                return True
            raise
        with self.host.lock:
            nconns = len(self._conns)
        if nconns >= self.opts.max_connections:
            self.host.count("connections_refused")
            self.host.warn(
                "max_connections",
                "pdkv decode: data connection refused: max_connections (%d) reached",
                self.opts.max_connections,
            )
            conn.close()
            return True
        while len(pending) >= self.opts.max_pending_connections:
            # the oldest connection still authenticating gives way: holding connections open
            # keeps no new session's connection out (it authenticates in a round trip)
            self.host.count("connections_refused")
            self.host.warn(
                "max_pending_connections",
                "pdkv decode: max_pending_connections (%d) data connections authenticating: the oldest is closed",
                self.opts.max_pending_connections,
            )
            self._drop_pending(sel, pending, next(iter(pending)))
        conn.setblocking(False)
        st = _PreAuth(now + self.opts.auth_timeout_s, bytearray(_AUTH_HEAD))
        pending[conn] = st
        sel.register(conn, selectors.EVENT_READ, st)
        return True

    def _drop_pending(
        self, sel: selectors.BaseSelector, pending: dict[socket.socket, _PreAuth], conn: socket.socket
    ) -> None:
        pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()

    def _pre_auth_step(
        self, sel: selectors.BaseSelector, pending: dict[socket.socket, _PreAuth], conn: socket.socket, st: _PreAuth
    ) -> None:
        """AUTH frame + session id -> decode's nonce -> the MAC over it (32 bytes) -> b"\\x01"."""
        try:
            k = conn.recv_into(memoryview(st.buf)[st.got :])
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
            sid = bytes(st.buf[FRAME_HEADER.size :])
            peer = self.host.peer_of_session(sid)
            if magic != MAGIC or ver != 1 or kind != K_AUTH or peer is None or peer.transport != self.transport:
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
        if peer is None or not hmac.compare_digest(
            bytes(st.buf), data_auth_mac(peer.codec.key, st.session_id, st.nonce)
        ):
            self.host.count("auth_failed")
            self._drop_pending(sel, pending, conn)
            return
        pending.pop(conn)
        sel.unregister(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kernel_timeouts(conn, _POLL_S, _POLL_S)
            conn.sendall(b"\x01")
        except OSError:
            conn.close()
            return
        t = threading.Thread(target=self._serve, args=(conn, peer.ident), name="pdkv-decode-data", daemon=True)
        with self.host.lock:
            if self.host.stopping.is_set() or self.host.peer(peer.ident) is None:
                conn.close()
                return
            self._conns[conn] = peer.ident
            self._conn_threads[conn] = t
        t.start()

    def recv_exact(self, conn: socket.socket, view: memoryview, idle_ok: bool, deadline: float | None = None) -> bool:
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
            except _TICK:
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

    def _serve(self, conn: socket.socket, ident: bytes) -> None:
        """An authenticated connection's thread: the handler until it returns or raises,
        then the connection is forgotten and closed."""
        try:
            self.handler(conn, ident)
        except (PdkvError, OSError) as exc:
            if isinstance(exc, ProtocolError):
                self.host.count("frames_rejected")
        except Exception:
            self.host.count("loop_errors")
            # the traceback as text, not exc_info: a kept record (a log capture, a queue
            # handler) would keep its frames, and they hold views of decode's buffer
            _log.error("data connection handling failed (connection closed)\n%s", traceback.format_exc())
        finally:
            with self.host.lock:
                self._conns.pop(conn, None)
                self._conn_threads.pop(conn, None)
            with contextlib.suppress(OSError):
                conn.close()

    def recv_views(self, conn: socket.socket, views: list[memoryview], deadline: float) -> None:
        """Scatter-receive into ``views`` (one syscall per up to 1000 buffers), bounded by a
        stall of ``io_timeout_s`` and by ``deadline``."""
        i = 0
        stalled = 0.0
        while i < len(views):
            if time.monotonic() > deadline:
                raise PdkvTimeoutError("frame not received within its deadline")
            chunk = views[i : i + 1000]
            want = sum(len(v) for v in chunk)
            try:
                got = conn.recvmsg_into(chunk, 0, socket.MSG_WAITALL)[0]
            except _TICK:
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


def connect_authenticated(
    host: str, port: int, session_id: bytes, key: bytes | None, deadline: float, timeout_s: float
) -> socket.socket:
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
            s.sendall(FRAME_HEADER.pack(MAGIC, 1, K_AUTH, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) + session_id)
            nonce = recv_n(s, 16)
            s.sendall(data_auth_mac(key, session_id, nonce))
            if recv_n(s, 1) != b"\x01":
                raise PeerError("decode refused the data connection")
            kernel_timeouts(s, timeout_s, timeout_s)
            return s
        except (OSError, PeerError) as exc:
            s.close()
            if time.monotonic() + delay >= deadline:
                raise PeerError(
                    f"data connection to {host}:{port} was not accepted within {timeout_s}s: {exc}"
                ) from None
        time.sleep(delay)
        delay = min(0.2, delay * 2)


def recv_n(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (the socket's timeout applies); PeerError on EOF."""
    out = bytearray()
    while len(out) < n:
        k = sock.recv(n - len(out))
        if not k:
            raise PeerError("connection closed")
        out += k
    return bytes(out)


def kernel_timeouts(sock: socket.socket, recv_s: float, send_s: float) -> None:
    """A blocking socket whose receives and sends the kernel bounds (``SO_RCVTIMEO``,
    ``SO_SNDTIMEO``): a call that moves nothing within the bound raises BlockingIOError,
    one that moves part returns its count.

    Python's own timeout (``settimeout``) makes the descriptor non-blocking and polls
    before each call, so a receive returns whatever has arrived (``MSG_WAITALL`` has no
    effect) and a send whatever fits: a 4 MiB frame took dozens of calls, each taking the
    GIL back, which is what kept tcp from scaling with streams. Blocking, a frame's payload
    is one ``recvmsg_into`` and one ``sendmsg``."""

    def tv(s: float) -> bytes:
        return struct.pack("ll", int(s), int((s - int(s)) * 1e6))

    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv(recv_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv(send_s))


def sendmsg_all(sock: socket.socket, bufs: list[bytes | memoryview]) -> None:
    """Send every buffer, up to 512 per ``sendmsg``, resuming after partial sends."""
    views = [v for v in (b if isinstance(b, memoryview) else memoryview(b) for b in bufs) if v.nbytes]
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i : i + 512])
        while n:
            k = views[i].nbytes
            if n >= k:
                n -= k
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
