"""Several decode ranks' swap engines as one :class:`~pdkv.scheduling.lifecycle.SwapBackend`
(one engine per GPU, each copying its rank's share of every block)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from .engine import SwapEngine
from .handles import CopyHandle

__all__ = ["SwapGroup"]


class _GroupHandle(CopyHandle):
    def __init__(self, handles: list[CopyHandle]) -> None:
        super().__init__(sum(h.nbytes for h in handles), handles[0].num_layers if handles else 0)
        self._hs = handles

    def done(self) -> bool:
        if all(h.done() for h in self._hs):
            if self._t1 is None:
                self._t1 = time.perf_counter()
                self._error = next((h.error for h in self._hs if h.error is not None), None)
            return True
        return False

    def layer_done(self, layer: int) -> bool:
        return all(h.layer_done(layer) for h in self._hs)


class SwapGroup:
    """One swap backend over several engines (the TP ranks a decode process hosts):
    a request's swap is done when every rank's copy is done.

    Ownership: the engines stay the caller's.
    """

    def __init__(self, engines: Sequence[SwapEngine]) -> None:
        if not engines:
            raise ValueError("SwapGroup needs at least one engine")
        self.engines = list(engines)

    def submit(self, request_id: str, buffer_blocks: Sequence[int], gpu_blocks: Sequence[int]) -> CopyHandle:
        return _GroupHandle([e.submit(request_id, buffer_blocks, gpu_blocks) for e in self.engines])
