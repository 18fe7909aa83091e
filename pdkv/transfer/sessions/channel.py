"""The control channel: a ZeroMQ socket any thread may send on, and small helpers both
control sessions share (a rate-limited warning, batch-item clipping)."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from ...protocol import MAX_BATCH_BLOCKS, MAX_TEXT, GrantBatch, GrantMsg, Message, Outcome, OutcomeBatch

__all__ = [
    "Channel",
    "RateLimitedLog",
    "Replies",
    "clip",
    "closing",
    "SEND_BATCH",
    "LOOP_STALL_S",
    "lateness",
    "unstalled",
]

SEND_BATCH = 512  # items one batch message carries as sent (protocol limit: MAX_BATCH_ITEMS)
# a control loop whose wait ended this much later than its own timer was stalled itself (the
# host, or its process, not scheduled): a peer's silence is counted in time the loop ran
# (unstalled). A loop that is merely busy (a long serving round) is not stalled: its lateness
# is measured against the wait's timer, never the length of a round
LOOP_STALL_S = 1.0


def lateness(asked: float, woke: float, timeout_s: float) -> float:
    """How much later than its own timer a wait asked at ``asked`` for at most
    ``timeout_s`` ended at ``woke``: over :data:`LOOP_STALL_S` only when the waiting thread
    was not scheduled (a wait ended early by a message is never late)."""
    return woke - asked - timeout_s


def unstalled(last_heard: float, gap: float, now: float) -> float:
    """``last_heard`` moved on by a stall of ``gap`` seconds of the loop that checks it
    (:func:`lateness`; unchanged for a gap under :data:`LOOP_STALL_S`), never past ``now``:
    when the whole host stalls, each side wakes before the other's next message is sent,
    and neither may count that time as the other's silence. A peer that stays silent while
    this loop runs, busy or not, is still found after its full timeout."""
    return min(now, last_heard + gap) if gap > LOOP_STALL_S else last_heard


_log = logging.getLogger("pdkv.transfer")

# plain ints: pyzmq's enum flags cost microseconds per operation on the hot path
_NB, _MORE_NB = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_SRCFD = int(zmq.SRCFD)
# what a socket raises once it (or its context) is closed: the channel's end. Any other error
# belongs to one connection or one message (a peer that sent garbage and left, a descriptor
# already gone) and costs only that
_CLOSING = frozenset({int(zmq.ETERM), int(zmq.ENOTSOCK), int(zmq.EFAULT)})


def closing(exc: zmq.ZMQError) -> bool:
    """Whether ``exc`` says the socket or its context is closed (not one connection's error)."""
    return exc.errno in _CLOSING


class Channel:
    """A zmq socket that any thread may send on: a send goes out at once, under a lock,
    instead of hopping through the I/O thread (each hop costs a thread wake-up, and the
    control round trips are what a one-block request waits for). The I/O thread waits on
    the socket's file descriptor and a wake pipe with an OS poll and receives under the
    same lock. The callable given to :meth:`send` runs under the lock too, so message
    sequence numbers go out in the order they were assigned.

    zmq's descriptor is edge-triggered: any operation on the socket, a send included,
    may consume the signal that input is waiting, so after each send the sender checks
    ``EVENTS`` and wakes the I/O thread if input is there."""

    def __init__(self, sock: zmq.Socket[bytes], source_fds: bool = False) -> None:
        self.sock = sock
        # with source_fds, each message received comes with the descriptor of the connection
        # it came on (zmq's SRCFD), as (fd, frames): decode's guard of its control connections
        self.source_fds = source_fds
        self.lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._poll = select.poll()
        self._poll.register(int(sock.getsockopt(zmq.FD)), select.POLLIN)
        self._poll.register(self._r, select.POLLIN)
        self._closed = False
        self.errors = 0  # per-connection receive errors survived
        # the pipe's fds are touched only under this lock and never after close(): a late
        # wake-up must not write into whatever file reuses the number
        self._pipe_lock = threading.Lock()

    def wake(self) -> None:
        with self._pipe_lock:
            if self._w < 0:
                return
            try:
                os.write(self._w, b"x")
            except OSError:  # pipe full: a wake-up is pending anyway
                pass

    def send(self, frames: Callable[[], list[bytes]]) -> bool:
        """Send the frames ``frames()`` returns; False if the socket would block or is closed."""
        with self.lock:
            if self._closed:
                return False
            parts = frames()
            try:
                for f in parts[:-1]:
                    self.sock.send(f, _MORE_NB)
                self.sock.send(parts[-1], _NB)
            except zmq.ZMQError:
                return False
            pending = bool(int(self.sock.getsockopt(_EVENTS)) & _POLLIN)
        if pending:
            self.wake()
        return True

    def _drain(self, max_bytes: int) -> list[Any] | None:
        out: list[Any] = []
        got = 0
        with self.lock:
            if self._closed:
                return None
            try:
                while len(out) < 256 and got < max_bytes and int(self.sock.getsockopt(_EVENTS)) & _POLLIN:
                    if self.source_fds:
                        parts = self.sock.recv_multipart(_NB, copy=False)
                        frames = [p.bytes for p in parts]
                        got += sum(map(len, frames))
                        try:
                            fd = parts[0].get(_SRCFD)
                        except zmq.ZMQError:  # its connection is gone already (EINVAL): the message stays
                            fd = -1
                        out.append((fd, frames))
                    else:
                        out.append(self.sock.recv_multipart(_NB))
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                if closing(exc):
                    return None
                self.errors += 1  # one connection's trouble: what was taken is served, the loop goes on
                _log.debug("control channel: %s (one connection's error; serving on)", exc)
        return out

    def wait(self, timeout_ms: int, max_bytes: int = 1 << 62) -> list[Any] | None:
        """Messages waiting now (each its frames, or ``(fd, frames)`` with ``source_fds``;
        at most 256, and no more once ``max_bytes`` are taken); if none, wait up to
        ``timeout_ms`` for input or a wake-up. None once the channel is closed."""
        out = self._drain(max_bytes)
        if out is None or out:
            return out
        self._poll.poll(timeout_ms)
        with self._pipe_lock:
            if self._r >= 0:
                try:
                    os.read(self._r, 4096)
                except BlockingIOError:
                    pass
        return self._drain(max_bytes)

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self.sock.close(0)
        with self._pipe_lock:
            os.close(self._r)
            os.close(self._w)
            self._r = self._w = -1


def clip(text: str) -> str:
    """``text`` cut to what one batch item may carry (``MAX_TEXT`` characters)."""
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


class RateLimitedLog:
    """One warning per key per ``every`` seconds: a flood of refused connections must not
    become a flood of log lines."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.every:
            self._last[key] = now
            _log.warning(msg, *args)


class Replies:
    """Decode's grants and outcomes to peers: sent at once, or, inside :meth:`together`
    (this thread), gathered and sent at its end as one ``GrantBatch`` and one
    ``OutcomeBatch`` per peer (``SEND_BATCH`` items, at most ``MAX_BATCH_BLOCKS`` block ids
    a message) instead of one message each."""

    def __init__(self, send: Callable[[bytes, Message], None]) -> None:
        self._send = send
        self._local = threading.local()

    def grant(self, ident: bytes, g: GrantMsg) -> None:
        grants = getattr(self._local, "grants", None)
        if grants is None:
            self._send(ident, g)
        else:
            grants.setdefault(ident, []).append(g)

    def outcome(self, ident: bytes, o: Outcome) -> None:
        box = getattr(self._local, "box", None)
        if box is None:
            self._send(ident, o)
        else:
            box.setdefault(ident, []).append((o.request_id, o.state, clip(o.reason)))

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        box: dict[bytes, list[tuple[str, str, str]]] = {}
        grants: dict[bytes, list[GrantMsg]] = {}
        self._local.box, self._local.grants = box, grants
        try:
            yield
        finally:
            self._local.box = self._local.grants = None
            for ident, gs in grants.items():
                part: list[GrantMsg] = []
                nblocks = 0
                for g in gs:
                    if part and (len(part) == SEND_BATCH or nblocks + len(g.blocks) > MAX_BATCH_BLOCKS):
                        self._grants(ident, part)
                        part, nblocks = [], 0
                    part.append(g)
                    nblocks += len(g.blocks)
                self._grants(ident, part)
            for ident, items in box.items():
                if len(items) == 1:
                    self._send(ident, Outcome(*items[0]))
                    continue
                for i in range(0, len(items), SEND_BATCH):
                    self._send(ident, OutcomeBatch(items[i : i + SEND_BATCH]))

    def _grants(self, ident: bytes, part: list[GrantMsg]) -> None:
        # one grant (also one too large for a batch) goes as itself
        self._send(ident, part[0] if len(part) == 1 else GrantBatch(part))
