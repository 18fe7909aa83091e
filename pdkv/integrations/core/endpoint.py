"""A small authenticated-message endpoint: a ZeroMQ ROUTER bound at an address, serving
each message from a thread of its own (prefill's pull endpoint, decode's SGLang aux
endpoint). Subclasses say what a message is (:meth:`RouterEndpoint._serve`); this holds
what they share: the bind with a clear error, the bounds on what peers without the secret
can make it hold, the loop in which one bad connection or message stops nothing, and the
close.

The bounds are decode's control port's, by the same guard
(:class:`~pdkv.transfer.sessions.guard.ControlGuard`): every connection is followed from
zmq's socket monitor and each message's source descriptor. A connection is *authenticated*
once a message on it carries a MAC that verifies; until then it is *pending*, and

- a pending connection is closed ``auth_timeout_s`` after it was accepted;
- beyond ``max_pending`` pending connections (``max_per_source`` from one address) the
  oldest are closed as new ones come;
- a message that is malformed or does not verify closes its connection at once (a peer
  with the secret never sends one);
- at most ``RCVHWM`` messages of at most ``max_msg`` bytes are queued per connection before
  the MAC is checked.

So what peers without the secret can make the endpoint hold is at most ``max_pending``
descriptors and ``max_pending x RCVHWM x max_msg`` bytes, each for at most
``auth_timeout_s``, and a peer with the secret is served meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from ...errors import PdkvError
from ...transfer.sessions.channel import RateLimitedLog
from ...transfer.sessions.guard import ControlGuard, GuardNames

__all__ = ["RouterEndpoint", "Limits"]

_log = logging.getLogger(__name__)
_SRCFD = int(zmq.SRCFD)


class Limits:
    """What an endpoint lets peers without the secret hold (module docstring)."""

    def __init__(
        self, *, auth_timeout_s: float = 5.0, max_pending: int = 32, max_per_source: int = 8, rcvhwm: int = 4
    ) -> None:
        for name, v in (("max_pending", max_pending), ("max_per_source", max_per_source), ("rcvhwm", rcvhwm)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if not auth_timeout_s > 0:
            raise ValueError(f"auth_timeout_s={auth_timeout_s!r} must be positive")
        self.auth_timeout_s, self.max_pending, self.max_per_source, self.rcvhwm = (
            float(auth_timeout_s),
            max_pending,
            max_per_source,
            rcvhwm,
        )

    def bytes_bound(self, max_msg: int) -> int:
        """Bytes queued before their MAC is checked, at most."""
        return self.max_pending * self.rcvhwm * max_msg


class RouterEndpoint:
    """Binds ``bind`` (``tcp://host:port``, port 0 for any) and serves each message with
    :meth:`_serve`, which returns ``(authenticated, why)``: ``authenticated`` when the
    message's MAC verified (its connection is then kept), ``why`` '' when it was served, else
    why not (the message is dropped and counted in ``dropped``; an exception in ``_serve``
    counts as a failure of that message alone, logged). A message that does not
    authenticate closes its connection. Messages over ``max_msg`` bytes end their connection
    in zmq, unread, and a receive error of one connection (EINVAL and the like) costs that
    connection only: only :meth:`close` ends the thread. ``what`` names the endpoint in
    errors and logs; ``limits`` bound what peers without the secret can hold (module
    docstring). Ownership: the socket, its context, the guard and the thread (:meth:`close`)."""

    def __init__(self, bind: str, *, max_msg: int, what: str, thread_name: str, limits: Limits | None = None) -> None:
        self._what = what
        self.limits = limits or Limits()
        self.max_msg = int(max_msg)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg)
        self._sock.setsockopt(zmq.RCVHWM, self.limits.rcvhwm)
        self.counts: dict[str, int] = {}
        self._warn_log = RateLimitedLog()
        self._guard = ControlGuard(
            self._sock,
            self.limits.auth_timeout_s,
            self.limits.max_pending,
            self.limits.max_per_source,
            self._count,
            self._warn_log.warning,
            names=GuardNames(f"pdkv {what}:", "max_pending", "max_per_source", "an authenticated message"),
        )
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self._guard.close()
            self._sock.close()
            self._ctx.term()
            raise PdkvError(f"{what} {bind}: {exc}") from exc
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    @property
    def connections(self) -> int:
        """Connections open now (pending and authenticated)."""
        return self._guard.connections

    @property
    def pending(self) -> int:
        """Connections without an authenticated message."""
        return self._guard.pending

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _start(self) -> None:
        """Start serving: a subclass calls it once its own state is set."""
        self._thread.start()

    def _serve(self, frames: list[bytes]) -> tuple[bool, str]:
        raise NotImplementedError

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._guard.monitor, zmq.POLLIN)  # connections accepted: capped at once
        last_sweep = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_sweep > 0.1:  # pending connections past their deadline
                last_sweep = now
                self._guard.sweep(now)
            try:
                self._guard.poll(now)  # connections accepted and gone, before their messages
                if self._sock not in dict(poller.poll(100)):
                    continue
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._stop.is_set() or exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                self.dropped += 1  # one bad connection stops nothing
                continue
            frames = [p.bytes for p in parts]
            try:
                fd = parts[0].get(_SRCFD)
            except zmq.ZMQError:  # its connection is gone already: the message is still served
                fd = -1
            self._guard.seen(fd, frames[0])
            try:
                authenticated, why = self._serve(frames)
            except Exception:  # never the thread: one message fails alone
                _log.exception("pdkv %s: a message failed", self._what)
                authenticated, why = True, "failed"
            if authenticated:
                self._guard.session(frames[0], True, time.monotonic())
            else:  # not one of ours: its connection goes now
                self._guard.evict(fd, f"connection closed: {why}")
            if why:
                self.dropped += 1
                _log.debug("pdkv %s: message dropped: %s", self._what, why)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._guard.close()
        self._sock.close(linger=0)
        self._ctx.term()
