"""The shm transport: prefill on decode's host writes straight into decode's shared buffers.

Decode names its buffers in the welcome; prefill opens them (0600 segments of the same
user), copies each layer's pieces into the granted blocks (a host cache with
:class:`~.hostcopy.HostCopier`, a GPU cache with the swap engine's kernel into the pinned
mapping) and then reports the layer (``LayerBatch``): decode cannot see a memory write.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import _ffi
from ...buffer.shared import SharedBuffer
from ...errors import PdkvError, ProtocolError
from ...layout import CacheSpec, KVLayout
from ...plan import CopyPlan, layer_pieces
from ...protocol import Hello, Welcome
from .base import Peer, ReceiverTransport, SenderHost, SenderTransport, WriteItem, report_layer
from .hostcopy import HostCopier

__all__ = ["ShmSender", "ShmReceiver"]


class ShmSender(SenderTransport):
    name = "shm"
    caches = frozenset({"host", "gpu"})
    auto_rank = 20

    def __init__(self, host: SenderHost, options: Any) -> None:
        super().__init__(host, options)
        self._shm: dict[int, SharedBuffer] = {}
        self.dst_specs: dict[int, CacheSpec] = {}
        self.engine: Any = None  # SwapEngine, for a GPU cache
        self.copier: HostCopier | None = None

    def connect(self, welcome: Welcome, layouts: list[KVLayout], deadline: float) -> None:
        if len(welcome.shm_names) != len(welcome.ranks):
            raise ProtocolError(f"welcome names {len(welcome.shm_names)} buffers for {len(welcome.ranks)} ranks")
        cache = self.host.cache
        for rank, name, lay in zip(welcome.ranks, welcome.shm_names, layouts):
            if cache.device is None:
                b = SharedBuffer.open(name, pin="never", populate=True)
            else:  # pinned for the kernel, from the cache's device (no context made on another)
                with _ffi.cuda.on_device(cache.device):
                    b = SharedBuffer.open(name, pin="auto", populate=True)
            self._shm[rank] = b
            need = CacheSpec.buffer_bytes(lay, welcome.buffer_blocks)
            if b.size < need:
                raise ProtocolError(
                    f"decode rank {rank}'s buffer {name!r} has {b.size} bytes, but "
                    f"{welcome.buffer_blocks} blocks of its layout need {need}"
                )
            self.dst_specs[rank] = CacheSpec.for_buffer(
                lay, welcome.buffer_blocks, b.address, order=welcome.buffer_order
            )
        if cache.device is not None:
            from ...swap.engine import SwapEngine

            # only copy_plan() is used: explicit GPU -> mapped-host addresses, so the
            # engine's own pair of caches is this rank's cache on both sides
            self.engine = SwapEngine(cache, cache, device=cache.device)
        else:
            _ffi.cpu.available()  # build the streaming copy loop now (~30 ms), not in the first layer
            self.copier = HostCopier(cache, self.dst_specs, self.options.copy_threads)

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        self.copy_layer(layer, work, self.dst_specs)
        self._report(layer, work)

    def _report(self, layer: int, work: list[WriteItem]) -> None:
        report_layer(self.host, layer, work)

    def copy_layer(
        self, layer: int, work: list[WriteItem], dsts: dict[int, CacheSpec], direction: str | None = None
    ) -> None:
        """Every request of the layer in one plan: the pieces are plain memory copies, so a
        run may continue from one request's blocks into the next one's."""
        h = self.host
        sb = np.concatenate([w.src for w in work])
        db = np.concatenate([w.dst for w in work])
        plans, total = layer_pieces(h.segments, h.layout, h.dst_layout, h.cache, dsts, sb, db, layer)
        if self.engine is not None:
            self.engine.copy_plan(CopyPlan.of_pieces(plans), direction=direction).wait(h.timeout_s)
        else:
            assert self.copier is not None
            self.copier.copy(layer, plans)
        h.add_bytes(total)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()  # waits for its copies, so none still writes into a mapping below
            self.engine = None
        if self.copier is not None:
            self.copier.close()
        for b in self._shm.values():
            try:
                b.close()
            except PdkvError:
                pass
        self._shm.clear()


class ShmReceiver(ReceiverTransport):
    name = "shm"
    same_host = True

    def open_session(self, peer: Peer, hello: Hello) -> dict[str, Any]:
        return {"shm_names": [b.name for b in self.host.buffers]}
