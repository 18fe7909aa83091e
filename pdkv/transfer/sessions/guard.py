"""A guard over a ZeroMQ ROUTER socket's connections: how many there are without a session,
from where, and for how long. Decode's control port uses it, and so does every other port
pdkv listens on with ZeroMQ (:class:`pdkv.integrations.core.endpoint.RouterEndpoint`: the
pull and aux endpoints), where a connection has a "session" once a message on it verified.

ZeroMQ accepts every connection to the control socket and has no cap of its own. The guard
follows them through zmq's socket monitor (each accepted connection's descriptor) and the
source descriptor of each message (``SRCFD``), and closes (``shutdown`` on zmq's own
descriptor, without a duplicate: zmq then drops the connection as if the peer had left):

- a connection without a session ``auth_timeout_s`` after it was accepted (silent, or a
  handshake never finished);
- the oldest connection without a session when there are more than
  ``max_pending_control`` of them, or more than ``max_pending_per_source`` from one
  address.

A connection whose session is live is never closed by the guard. When a connection whose
identity decode has seen ends (its process exited, closed its socket, or the guard closed
it), ``on_gone`` is told that identity: a session lives on one connection (zmq gives a
reconnection a new identity), so a session on it, or one that an Auth still queued from it
would make, can never speak again and its name and rank are free at once. So a peer holding
connections open, or opening them quickly, keeps no new peer out for longer than it takes
that peer to handshake (a few round trips), and what unauthenticated peers can make decode
hold is bounded: ``max_pending_control`` connections, each with at most ``RCVHWM`` messages
of at most ``MAX_MESSAGE_BYTES`` queued.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

__all__ = ["ControlGuard", "GuardNames"]

_EVENT = struct.Struct("=hi")  # zmq monitor frame 1: event number, value (the fd for ACCEPTED/DISCONNECTED)
_ACCEPTED, _GONE = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


@dataclass(frozen=True)
class GuardNames:
    """How a guard's log lines name its port, its two caps and what a connection lacks."""

    port: str = "pdkv decode: control"
    max_pending: str = "max_pending_control"
    max_per_source: str = "max_pending_per_source"
    lacking: str = "a session"


@dataclass
class _Conn:
    deadline: float
    source: str
    ident: bytes = b""
    session: bool = False
    closed: bool = False  # closed by the guard; its end (the monitor's event) not yet seen


class ControlGuard:
    """Tracks and bounds a ROUTER socket's connections (all calls from the one thread that
    reads the socket). ``names``: how its log lines name the port, its caps and a session
    (decode's control port by default)."""

    def __init__(
        self,
        router: zmq.Socket[bytes],
        auth_timeout_s: float,
        max_pending: int,
        max_per_source: int,
        count: Callable[[str], None],
        warn: Callable[..., None],
        on_gone: Callable[[bytes], None] | None = None,
        names: GuardNames = GuardNames(),
    ) -> None:
        self._router = router
        self._names = names
        self._on_gone = on_gone
        self._mon = router.get_monitor_socket(int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED))
        self.auth_timeout_s = auth_timeout_s
        self.max_pending, self.max_per_source = max_pending, max_per_source
        self.last_close = -math.inf  # when the guard last closed a connection without a session
        self._count, self._warn = count, warn
        self._conns: dict[int, _Conn] = {}  # fd -> connection, in the order accepted

    @property
    def monitor(self) -> zmq.Socket[bytes]:
        """zmq's monitor socket: readable when a connection was accepted or ended (a loop
        that polls it too enforces the caps as connections come, not at its next round)."""
        return self._mon

    @property
    def pending(self) -> int:
        """Connections without a live session."""
        return sum(not c.session for c in self._conns.values())

    @property
    def connections(self) -> int:
        return len(self._conns)

    def poll(self, now: float) -> None:
        """Take zmq's monitor events (accepted, gone), then enforce the caps."""
        accepted = False
        while True:
            try:  # EVENTS first: cheaper than a receive that raises Again, on every loop round
                if not int(self._mon.getsockopt(_EVENTS)) & _POLLIN:
                    break
                frames = self._mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                return
            if len(frames) < 2 or len(frames[0]) < _EVENT.size:
                continue
            event, fd = _EVENT.unpack_from(frames[0])
            if event & _ACCEPTED:
                self._conns.pop(fd, None)  # a number reused: the old connection's end was seen first
                self._conns[fd] = _Conn(now + self.auth_timeout_s, _source(fd))
                accepted = True
            elif event & _GONE:
                c = self._conns.pop(fd, None)
                if c is not None and c.ident and self._on_gone is not None:
                    # a session on it (or one its queued Auth may still make) can never speak again
                    self._on_gone(c.ident)
        if accepted:
            self._enforce()

    def seen(self, fd: int, ident: bytes) -> None:
        """A message from ``ident`` came on connection ``fd``. The monitor is read first:
        the loop may have read the message after its last poll, and the descriptor number
        may be an earlier connection's, whose end is reported before the new one's
        acceptance. A connection whose end was taken already is reported gone now (a
        session its messages make can never speak again)."""
        if fd < 0:
            return  # zmq could not name it
        # the monitor's events first: zmq reported this connection's acceptance (and the end
        # of an earlier connection with the same descriptor number) before its messages
        self.poll(time.monotonic())
        c = self._conns.get(fd)
        if c is not None:
            c.ident = ident
        elif self._on_gone is not None:
            self._on_gone(ident)

    def session(self, ident: bytes, live: bool, now: float) -> None:
        """``ident``'s session began (``live``) or ended: a connection whose session ended
        must make a new one within ``auth_timeout_s``."""
        for c in self._conns.values():
            if c.ident == ident:
                c.session = live
                c.deadline = now + self.auth_timeout_s

    def sweep(self, now: float) -> None:
        """Close connections without a session past their deadline."""
        for fd in [fd for fd, c in self._conns.items() if not c.session and not c.closed and c.deadline <= now]:
            self._close(fd, f"connection closed: without {self._names.lacking} within auth_timeout_s")

    def evict(self, fd: int, why: str) -> None:
        """Close connection ``fd`` now (a message on it failed authentication): it costs that
        connection alone. Nothing when it is unknown (its end was seen) or has a session."""
        c = self._conns.get(fd)
        if c is not None and not c.session and not c.closed:
            self._close(fd, why)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.disable_monitor()
        self._mon.close(0)

    def _enforce(self) -> None:
        pending = [fd for fd, c in self._conns.items() if not c.session and not c.closed]
        by_source: dict[str, list[int]] = {}
        for fd in pending:
            by_source.setdefault(self._conns[fd].source, []).append(fd)
        for src, fds in by_source.items():
            for fd in fds[: max(0, len(fds) - self.max_per_source)]:
                self._close(fd, f"connection closed: more than {self._names.max_per_source} from {src}")
        pending = [fd for fd, c in self._conns.items() if not c.session and not c.closed]
        for fd in pending[: max(0, len(pending) - self.max_pending)]:
            self._close(fd, f"connection closed: more than {self._names.max_pending} without {self._names.lacking}")

    def _close(self, fd: int, why: str) -> None:
        c = self._conns.get(fd)
        if c is not None:
            c.closed = True  # kept until zmq reports its end: the end names its identity
        self.last_close = time.monotonic()
        self._count("control_evicted")
        self._warn("control-evicted", f"{self._names.port} %s", why)
        s = _borrow(fd)
        if s is None:
            return
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.detach()  # the descriptor stays zmq's: it closes it when it sees the connection end


def _borrow(fd: int) -> socket.socket | None:
    """A socket object over zmq's descriptor ``fd``, without a duplicate (out of
    descriptors is when the guard is needed most); ``detach()`` it after use."""
    try:
        return socket.socket(fileno=fd)
    except OSError:
        return None


def _source(fd: int) -> str:
    """The address a connection comes from (its host part), "" when it cannot be read."""
    s = _borrow(fd)
    if s is None:
        return ""
    try:
        addr = s.getpeername()
        return str(addr[0]) if isinstance(addr, tuple) else "local"
    except OSError:
        return ""
    finally:
        s.detach()
