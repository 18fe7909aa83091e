"""A small authenticated-message endpoint: a ZeroMQ ROUTER bound at an address, serving
each message from a thread of its own (prefill's pull endpoint, decode's SGLang aux
endpoint). Subclasses say what a message is (:meth:`RouterEndpoint._serve`); this holds
what they share: the bind with a clear error, the size cap, the loop in which one bad
connection or message stops nothing, and the close.
"""

from __future__ import annotations

import logging
import threading

import zmq

from ...errors import PdkvError

__all__ = ["RouterEndpoint"]

_log = logging.getLogger(__name__)


class RouterEndpoint:
    """Binds ``bind`` (``tcp://host:port``, port 0 for any) and serves each message with
    :meth:`_serve`, which returns '' when the message was served, else why not: the message
    is dropped and counted in ``dropped`` (an exception in it too, logged). Messages over
    ``max_msg`` bytes are cut off by zmq unread, and a receive error of one connection
    (EINVAL and the like) costs that message only: only :meth:`close` ends the thread.
    ``what`` names the endpoint in errors and logs. Ownership: the socket, its context and
    the thread (:meth:`close`)."""

    def __init__(self, bind: str, *, max_msg: int, what: str, thread_name: str) -> None:
        self._what = what
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise PdkvError(f"{what} {bind}: {exc}") from exc
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        """Start serving: a subclass calls it once its own state is set."""
        self._thread.start()

    def _serve(self, frames: list[bytes]) -> str:
        raise NotImplementedError

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._stop.is_set() or exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                self.dropped += 1  # one bad connection stops nothing
                continue
            try:
                why = self._serve(frames)
            except Exception:  # never the thread: one message fails alone
                _log.exception("pdkv %s: a message failed", self._what)
                why = "failed"
            if why:
                self.dropped += 1
                _log.debug("pdkv %s: message dropped: %s", self._what, why)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
