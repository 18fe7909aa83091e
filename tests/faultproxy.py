"""A small fault-injecting TCP proxy for the reliability tests (this kernel has no netem).

Each accepted connection is forwarded to the target; faults apply to the client->server
direction: ``delay_s`` per chunk (latency), ``stall_after`` bytes then silence (a stalled
peer), ``reset_after`` bytes then RST (a mid-stream reset), ``rate`` bytes/s (slow peer).
Everything is bounded: the proxy stops with ``close()``.
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class FaultProxy:
    def __init__(
        self,
        target: tuple[str, int],
        *,
        delay_s: float = 0.0,
        stall_after: int | None = None,
        reset_after: int | None = None,
        rate: float | None = None,
    ) -> None:
        self.target = target
        self.delay_s, self.stall_after, self.reset_after, self.rate = delay_s, stall_after, reset_after, rate
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.lsock.settimeout(0.2)
        self.port = self.lsock.getsockname()[1]
        self.forwarded = 0
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.lsock.accept()
                s = socket.create_connection(self.target, timeout=5)
            except OSError:
                continue
            self._socks += [c, s]
            for src, dst, faulty in ((c, s, True), (s, c, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, faulty), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, faulty: bool) -> None:
        sent = 0
        try:
            src.settimeout(0.2)
            while not self._stop.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                if faulty:
                    if self.reset_after is not None and sent + len(data) > self.reset_after:
                        for x in (src, dst):  # RST both ways
                            x.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                            x.close()
                        return
                    if self.stall_after is not None and sent + len(data) > self.stall_after:
                        data = data[: max(0, self.stall_after - sent)]
                        if data:
                            dst.sendall(data)
                        while not self._stop.is_set():  # silence, connection held open
                            time.sleep(0.05)
                        return
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    if self.rate:
                        time.sleep(len(data) / self.rate)
                dst.sendall(data)
                sent += len(data)
                if faulty:
                    self.forwarded += len(data)
        except OSError:
            pass
        finally:
            for x in (src, dst):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.lsock.close()
        for t in self._threads:
            t.join(5)
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
