"""What a copy returns: :class:`CopyHandle` (wait, done, error, per-layer completion) and its
kinds: one on a CUDA stream (events per layer, a bounded drain on close), one for a copy
run by a host thread.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

from .. import _ffi
from ..errors import PdkvTimeoutError, SwapError

__all__ = ["CopyHandle"]


class CopyHandle:
    """An asynchronous copy. ``done()`` never blocks; ``wait(timeout)`` is bounded.

    ``layer_done(l)`` / ``wait_layer(l, timeout)`` exist when the copy was layer-wise.
    ``error`` is the exception if the copy failed (``done()`` is then True).
    """

    def __init__(self, nbytes: int, layers: int) -> None:
        self.nbytes = nbytes
        self.num_layers = layers
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        self._t1: float | None = None

    @property
    def error(self) -> BaseException | None:
        self.done()
        return self._error

    def done(self) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def layer_done(self, layer: int) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def _wait(self, pred: Callable[[], bool], timeout: float | None, what: str) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while not pred():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise PdkvTimeoutError(f"{what} not finished within {timeout} s")
            # poll finely for the first 100 ms (copies take ~1-50 ms), then back off
            elapsed = now - start
            if elapsed < 0.002:
                time.sleep(0)
            else:
                time.sleep(2e-5 if elapsed < 0.1 else 1e-3)

    def wait(self, timeout: float | None = None) -> None:
        """Block until done (at most ``timeout`` s); raise the copy's error if it failed."""
        self._wait(self.done, timeout, "copy")
        if self._error is not None:
            raise SwapError(f"copy failed: {self._error}") from self._error

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        self._wait(lambda: self.layer_done(layer), timeout, f"layer {layer} of the copy")
        if self._error is not None:
            raise SwapError(f"copy failed: {self._error}") from self._error

    @property
    def seconds(self) -> float | None:
        """Wall time from submission to the first ``done()`` that saw it complete."""
        return None if self._t1 is None else self._t1 - self._t0


class _CudaHandle(CopyHandle):
    def __init__(self, nbytes: int, layers: int, events: list[int], keep: object) -> None:
        super().__init__(nbytes, layers)
        self._events = events  # one per layer when layer-wise, else one
        self._keep = keep  # descriptor memory: freed when the copy is done
        self._finished = False
        self._lock = threading.Lock()
        self._fin = weakref.finalize(self, _destroy_events, list(events))

    # done() may be called from several threads at once (staged sends: the lanes of a
    # chunk, and the engine reusing descriptor memory): the lock keeps one from querying
    # an event another has just destroyed (a crash in the driver)
    def done(self) -> bool:
        if self._finished:
            return True
        with self._lock:
            if self._finished:
                return True
            try:
                ok = _ffi.cuda.event_query(self._events[-1])
            except Exception as exc:  # a CUDA error surfaces here: the copy failed
                self._error = exc
                ok = True
            if ok:
                self._t1 = time.perf_counter()
                self._keep = None
                self._fin()
                self._finished = True
            return ok

    def layer_done(self, layer: int) -> bool:
        if self._finished or len(self._events) == 1:
            return self.done()
        with self._lock:
            if self._finished:
                return True
            try:
                return _ffi.cuda.event_query(self._events[layer])
            except Exception as exc:
                self._error = exc
                return True


_DRAIN_TIMEOUT_S = 60.0


def _drain(stream: int, timeout: float | None = None) -> bool:
    """Wait, bounded, for everything queued on ``stream`` so far; False if it did not finish."""
    timeout = _DRAIN_TIMEOUT_S if timeout is None else timeout
    try:
        ev = _ffi.cuda.event_create()
    except Exception:
        return False
    try:
        _ffi.cuda.event_record(ev, stream)
        deadline = time.monotonic() + timeout
        while not _ffi.cuda.event_query(ev):
            if time.monotonic() >= deadline:
                return False
            time.sleep(1e-4)
        return True
    except Exception:  # the stream itself failed: nothing more will run on it
        return True
    finally:
        _destroy_events([ev])


def _destroy_events(events: list[int]) -> None:
    for e in events:
        try:
            _ffi.cuda.event_destroy(e)
        except Exception:
            pass


class _FutureHandle(CopyHandle):
    def __init__(self, nbytes: int, layers: int, fut: Future[None], layer_flags: list[threading.Event]) -> None:
        super().__init__(nbytes, layers)
        self._fut = fut
        self._flags = layer_flags

    def done(self) -> bool:
        if not self._fut.done():
            return False
        if self._t1 is None:
            self._t1 = time.perf_counter()
            self._error = self._fut.exception()
        return True

    def layer_done(self, layer: int) -> bool:
        return self._flags[layer].is_set() or self.done()

    def wait(self, timeout: float | None = None) -> None:
        """Sleeps on the future (no polling) at most ``timeout`` s."""
        concurrent.futures.wait([self._fut], timeout)
        if not self.done():
            raise PdkvTimeoutError(f"copy not finished within {timeout} s")
        if self._error is not None:
            raise SwapError(f"copy failed: {self._error}") from self._error
