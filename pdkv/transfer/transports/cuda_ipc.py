"""The cuda_ipc transport: a GPU cache on decode's host writes into decode's GPU blocks.

Decode exports each rank's GPU cache as CUDA IPC handles of the allocations that hold it
(:mod:`pdkv.transfer.ipc_export`) and serves it only to a prefill whose GPU can map them (the same
GPU, or one with peer access). Prefill maps them and writes GPU grants device to device
with the swap engine's kernel; buffer grants go into decode's shared buffers as with shm.
The ranks of one prefill instance share a grant, so an instance is all cuda_ipc or none.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ... import _ffi
from ...errors import PdkvError
from ...layout import CacheSpec, KVLayout
from ...protocol import CudaDesc, Hello, IpcSection, Welcome, to_plain
from .base import Peer, ReceiverHost, WriteItem
from .ipc_export import IpcMapping, export_gpu_caches, parse_ipc_section, unreachable
from .shm import ShmReceiver, ShmSender

__all__ = ["CudaIpcSender", "CudaIpcReceiver"]


class CudaIpcSender(ShmSender):
    name = "cuda_ipc"
    caches = frozenset({"gpu"})
    writes_gpu = True
    auto_rank = 10

    @classmethod
    def refuses(cls, cache: CacheSpec) -> str | None:
        if cache.device is None:
            return "the cuda_ipc transport writes from a GPU cache: give a CacheSpec with device set"
        return None

    _ipc: IpcMapping | None = None

    def hello_fields(self) -> dict[str, Any]:
        assert self.host.cache.device is not None
        return {"cuda": CudaDesc(device_uuid=_ffi.cuda.device_uuid(self.host.cache.device))}

    def connect(self, welcome: Welcome, layouts: list[KVLayout], deadline: float) -> None:
        device = self.host.cache.device
        assert device is not None
        # validated before anything is opened; closed again by close() on failure
        self._ipc = IpcMapping(parse_ipc_section(to_plain(welcome.cuda), welcome.ranks, layouts), layouts, device)
        super().connect(welcome, layouts, deadline)

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        gpu = [w for w in work if w.grant.location == "gpu"]
        if gpu:
            assert self._ipc is not None
            self.copy_layer(layer, gpu, self._ipc.specs, "d2d")
        rest = [w for w in work if w.grant.location != "gpu"]
        if rest:
            self.copy_layer(layer, rest, self.dst_specs)
        self._report(layer, work)

    def close(self) -> None:
        super().close()  # the engine first: no copy still writes into a mapping
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None


class CudaIpcReceiver(ShmReceiver):
    name = "cuda_ipc"
    writes_gpu = True

    def __init__(self, host: ReceiverHost) -> None:
        super().__init__(host)
        caches = host.options.gpu_caches
        if caches is None:
            raise ValueError("cuda_ipc needs gpu_caches (each rank's GPU cache)")
        self._devices = sorted({c.device for c in caches if c.device is not None})
        self._reach: dict[str, str | None] = {}  # prefill GPU uuid -> why it cannot map ours
        # raises CudaUnavailableError without CUDA, LayoutError for a cache that is not
        # device memory or that one handle per allocation cannot describe
        self._section = export_gpu_caches(host.layouts, list(caches), host.scheduler.gpu.num_total)

    def refuses(self, hello: Hello) -> str | None:
        cuda = hello.cuda
        uid = cuda.device_uuid if cuda is not None else None
        if not isinstance(uid, str) or not 0 < len(uid) <= 64:
            return "cuda_ipc: the hello names no GPU; use shm"
        if uid not in self._reach:
            try:
                self._reach[uid] = unreachable(uid, self._devices)
            except PdkvError as exc:
                self._reach[uid] = f"peer access could not be checked: {exc}"
        why = self._reach[uid]
        return None if why is None else f"cuda_ipc: {why}; use shm"

    def open_session(self, peer: Peer, hello: Hello) -> dict[str, Any]:
        return {**super().open_session(peer, hello), "cuda": msgspec.convert(self._section, IpcSection)}
