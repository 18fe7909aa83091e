"""The bounds every small HTTP server of pdkv keeps (the metrics endpoint, SGLang's bootstrap
table): what a client that opens connections and sends nothing, or sends slowly, can make
it hold.

:class:`BoundedServerMixin`, mixed into a ``socketserver`` threading server (stdlib's
``ThreadingHTTPServer``, ``wsgiref``'s ``WSGIServer``), follows every connection from accept
to close:

- a connection lives at most ``deadline_s`` from its accept, whatever it does (a slow
  reader or writer is cut, not only an idle one);
- at most ``max_conns`` at once and ``max_per_source`` from one address: a connection over
  either cap makes room by closing the oldest one (of that address, then of all) that has
  not yet sent a whole request line and headers; only when every connection is serving a
  request is the new one closed at once.

So a client holding connections open keeps no other client out for longer than its own
connections take to be closed (at once), and what clients can make the server hold is at
most ``max_conns`` descriptors and threads, each for at most ``deadline_s``. The handler
says when its request has been read (:class:`BoundedHandlerMixin`, before
``BaseHTTPRequestHandler``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["BoundedServerMixin", "BoundedHandlerMixin"]


@dataclass
class _Conn:
    source: str
    accepted: float
    serving: bool = False


class BoundedServerMixin:
    """Mix in before a ``socketserver`` threading server (module docstring)."""

    max_conns = 16
    max_per_source = 4
    deadline_s = 5.0
    daemon_threads = True
    block_on_close = False
    # the listen backlog: socketserver's 5 makes a burst of connects wait for the kernel's
    # SYN retries (a second each), good ones included
    request_queue_size = 128

    def _bounds_init(self) -> None:
        if getattr(self, "_bounds", None) is None:
            self._bounds: dict[Any, _Conn] = {}
            self._bounds_lock = threading.Lock()
            self.evicted = 0  # connections closed to make room or past their deadline
            self.refused = 0  # connections closed at once (every one serving)
            self._reaper = threading.Thread(target=self._reap, name="pdkv-http-reaper", daemon=True)
            self._reaper_stop = threading.Event()
            self._reaper.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._bounds_init()
        src = str(client_address[0]) if isinstance(client_address, tuple) else "local"
        now = time.monotonic()
        with self._bounds_lock:
            mine = [r for r, c in self._bounds.items() if c.source == src]
            if len(mine) >= self.max_per_source and not self._evict_oldest(mine):
                self.refused += 1
                ok = False
            elif len(self._bounds) >= self.max_conns and not self._evict_oldest(list(self._bounds)):
                self.refused += 1
                ok = False
            else:
                self._bounds[request] = _Conn(src, now)
                ok = True
        if not ok:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)  # type: ignore[misc]

    def _evict_oldest(self, requests: list[Any]) -> bool:
        """With the lock held: close the oldest of ``requests`` still reading its request."""
        waiting = [r for r in requests if not self._bounds[r].serving]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda r: self._bounds[r].accepted)
        del self._bounds[oldest]
        self.evicted += 1
        _cut(oldest)
        return True

    def request_read(self, request: Any) -> None:
        """The handler read a whole request on ``request``: it is served now."""
        with self._bounds_lock:
            c = self._bounds.get(request)
            if c is not None:
                c.serving = True

    def shutdown_request(self, request: Any) -> None:
        if getattr(self, "_bounds", None) is not None:
            with self._bounds_lock:
                self._bounds.pop(request, None)
        super().shutdown_request(request)  # type: ignore[misc]

    def _reap(self) -> None:
        while not self._reaper_stop.wait(0.25):
            now = time.monotonic()
            with self._bounds_lock:
                late = [r for r, c in self._bounds.items() if now - c.accepted > self.deadline_s]
                for r in late:
                    del self._bounds[r]
                    self.evicted += 1
                    _cut(r)

    @property
    def open_connections(self) -> int:
        self._bounds_init()
        with self._bounds_lock:
            return len(self._bounds)

    def server_close(self) -> None:
        if getattr(self, "_bounds", None) is not None:
            self._reaper_stop.set()
            with self._bounds_lock:
                for r in list(self._bounds):
                    _cut(r)
                self._bounds.clear()
        super().server_close()  # type: ignore[misc]


class BoundedHandlerMixin:
    """Mix in before ``BaseHTTPRequestHandler``: tells the server when the request line and
    headers are read (the connection is then served, not waiting)."""

    def parse_request(self) -> bool:
        ok = bool(super().parse_request())  # type: ignore[misc]
        if ok:
            server = getattr(self, "server", None)
            if isinstance(server, BoundedServerMixin):
                server.request_read(getattr(self, "request", None))
        return ok


def _cut(request: Any) -> None:
    """End a connection from another thread: its handler's next read or write fails and the
    handler ends (the server's own close follows)."""
    if isinstance(request, socket.socket):
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_RDWR)
