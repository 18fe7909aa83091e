"""Decode ranks whose caches live in other processes: one engine worker per GPU.

Engines (vLLM, SGLang, FastDeploy) run one worker process per GPU rank, and the KV cache
tensors live there, while the scheduler (and pdkv's :class:`~pdkv.DecodeScheduler` and
:class:`~pdkv.transfer.DecodeReceiver`) runs in another process. pdkv's answer: each
worker **exports its rank's cache once** (:func:`export_cache`) and hands the bytes to the
scheduler process over the engine's own channel; the scheduler process **maps** it
(:func:`map_cache`) and gives the mapped :class:`~pdkv.layout.CacheSpec` to that rank's
:class:`~pdkv.SwapEngine`. Every swap from the CPU buffer into a worker's cache then runs
in the scheduler process, on its own stream, exactly as for a cache it allocated itself;
the worker does nothing per request and learns that blocks are filled through the
engine's usual scheduling output (the request's READY, after the swap's completion was
observed on the host).

What is exported:

- a GPU cache: one CUDA IPC handle per allocation holding it, plus each (layer, tensor)
  region's allocation, offset and block stride (the encoding :mod:`pdkv.transfer.transports.ipc_export` uses
  for the ``cuda_ipc`` transport), and the device's UUID, which the scheduler process
  maps to its own ordinal (the processes may see different ``CUDA_VISIBLE_DEVICES``);
- a host cache: the name of the :class:`~pdkv.SharedBuffer` it lives in (a worker makes
  one with :func:`host_cache`) and each region's offset and stride in it.

Why mapping rather than a per-rank agent that executes swap commands: the swap engine
needs only addresses it can reach, which a mapping gives, so the scheduler, the swap
admission and the completion tracking stay one process's state, with no command channel,
no second completion protocol and no per-request round trip to a worker. The cost is a
CUDA context per device in the scheduler process (it makes one for its swap streams
anyway when it pins the buffer).

Ownership: the worker keeps its cache allocated until every process that mapped it has
closed the mapping (:meth:`MappedCache.close`, after the swap engine using it is closed).
A descriptor is checked before anything is opened (version, kind, layout, every region
inside its allocation or segment for all blocks); a worker that died leaves a host cache's
segment mapped by the scheduler until it closes the mapping (``pdkv-shm clean`` removes it
then).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from .. import _ffi
from ..buffer.shared import SharedBuffer
from ..errors import LayoutError, ProtocolError
from ..layout import CacheSpec, KVLayout
from ..protocol import LayoutDesc, layout_desc
from ..transfer.transports.ipc_export import IpcMapping, _export_rank, _region_end, parse_ipc_section

__all__ = ["export_cache", "map_cache", "host_cache", "MappedCache", "CacheExport", "MAX_EXPORT_BYTES"]

EXPORT_VERSION = 1
MAX_EXPORT_BYTES = 4 << 20  # a descriptor is at most this long (64 Ki allocations of 64 bytes fit)


_log = logging.getLogger(__name__)


class _Alloc(msgspec.Struct, frozen=True):
    handle: bytes
    size: int


class CacheExport(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's exported cache (what :func:`export_cache` encodes)."""

    version: int
    kind: str  # "cuda" | "shm"
    rank: int
    layout: LayoutDesc
    num_blocks: int
    regions: list[tuple[int, int, int]]  # (allocation, offset, block stride), layer-major then tensor
    allocs: list[_Alloc] = []  # cuda
    device_uuid: str = ""  # cuda
    shm_name: str = ""  # shm
    shm_size: int = 0  # shm


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CacheExport)


def host_cache(layout: KVLayout, num_blocks: int, **kw: Any) -> tuple[SharedBuffer, CacheSpec]:
    """A host cache a worker can export: ``num_blocks`` blocks of ``layout`` in a new
    :class:`~pdkv.SharedBuffer` (``kw`` go to :meth:`~pdkv.SharedBuffer.create`), and
    its spec (blocks contiguous, as :meth:`CacheSpec.for_buffer` lays them out). The
    worker owns the buffer and closes it after every mapping of it is closed."""
    buf = SharedBuffer.create(CacheSpec.buffer_bytes(layout, num_blocks), **kw)
    return buf, CacheSpec.for_buffer(layout, num_blocks, buf.address)


def export_cache(layout: KVLayout, spec: CacheSpec, buffer: SharedBuffer | None = None) -> bytes:
    """Rank ``layout.tp_rank``'s cache ``spec`` described for :func:`map_cache` in another
    process of this host. A GPU cache (``spec.device`` set) is exported by CUDA IPC; a host
    cache must lie in ``buffer`` (see :func:`host_cache`).

    Raises LayoutError for a cache of another layout, a host cache outside ``buffer`` (or
    without one), or GPU memory that has no IPC handle (see :mod:`pdkv.transfer.transports.ipc_export`)."""
    if spec.layout != layout:
        raise LayoutError(f"rank {layout.tp_rank}'s cache has another layout than the rank")
    common = dict(version=EXPORT_VERSION, rank=layout.tp_rank, layout=layout_desc(layout), num_blocks=spec.num_blocks)
    if spec.device is not None:
        with _ffi.cuda.on_device(spec.device):
            r = _export_rank(layout, spec)
        cuda = CacheExport(
            kind="cuda",
            regions=[tuple(x) for x in r["regions"]],
            allocs=[_Alloc(a["handle"], a["size"]) for a in r["allocs"]],
            device_uuid=r["device_uuid"],
            **common,  # type: ignore[arg-type]
        )
        return _encoder.encode(cuda)
    if buffer is None:
        raise LayoutError(
            f"rank {layout.tp_rank}'s host cache must live in a SharedBuffer to be exported "
            "(pdkv.integrations.workers.host_cache)"
        )
    regions = []
    for layer in range(layout.total_layers):
        for t in range(len(layout.tensors)):
            base, stride = spec.region(layer, t)
            off = base - buffer.address
            end = _region_end(off, stride, spec.num_blocks, layout.tensor_block_extent(t))
            if off < 0 or end > buffer.size:
                raise LayoutError(
                    f"rank {layout.tp_rank}, layer {layer}, tensor {t}: the region is not inside "
                    f"the shared buffer {buffer.name!r}"
                )
            regions.append((0, off, stride))
    shm = CacheExport(kind="shm", regions=regions, shm_name=buffer.name, shm_size=buffer.size, **common)  # type: ignore[arg-type]
    return _encoder.encode(shm)


def parse_export(data: bytes, layout: KVLayout | None = None) -> CacheExport:
    """A descriptor decoded and checked against ``layout`` (when given: the rank's
    layout in this process must be the exported one), nothing opened. ProtocolError
    names what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > MAX_EXPORT_BYTES:
        raise ProtocolError(f"a cache export must be at most {MAX_EXPORT_BYTES} bytes")
    try:
        ex = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a pdkv cache export: {exc}") from None
    if ex.version != EXPORT_VERSION:
        raise ProtocolError(f"cache export version {ex.version}, this pdkv reads {EXPORT_VERSION}")
    if ex.kind not in ("cuda", "shm"):
        raise ProtocolError(f"cache export kind {ex.kind!r} must be 'cuda' or 'shm'")
    lay = _layout_of(ex)
    if layout is not None and layout != lay:
        raise ProtocolError(
            f"the exported cache is rank {lay.tp_rank} of {lay.tp_size} with another layout than "
            f"rank {layout.tp_rank} of {layout.tp_size} here"
        )
    if ex.num_blocks < 1:
        raise ProtocolError(f"cache export num_blocks={ex.num_blocks} must be >= 1")
    want = lay.total_layers * len(lay.tensors)
    if len(ex.regions) != want:
        raise ProtocolError(f"cache export has {len(ex.regions)} regions; the layout has {want}")
    if ex.kind == "shm":
        for i, (a, off, stride) in enumerate(ex.regions):
            t = i % len(lay.tensors)
            if a != 0 or off < 0 or stride < lay.block_span(t):
                raise ProtocolError(f"cache export region {i} ({a}, {off}, {stride}) is malformed")
            if _region_end(off, stride, ex.num_blocks, lay.tensor_block_extent(t)) > ex.shm_size:
                raise ProtocolError(f"cache export region {i} ends past the {ex.shm_size}-byte segment")
    return ex


def _layout_of(ex: CacheExport) -> KVLayout:
    try:
        lay = KVLayout.from_descriptor(msgspec.structs.asdict(ex.layout))
    except (LayoutError, TypeError, ValueError) as exc:
        raise ProtocolError(f"cache export layout: {exc}") from None
    if lay.tp_rank != ex.rank:
        raise ProtocolError(f"cache export of rank {ex.rank} carries the layout of rank {lay.tp_rank}")
    return lay


class MappedCache:
    """A worker's exported cache mapped into this process: :attr:`spec` addresses it
    here (device: this process's ordinal of the worker's GPU), :attr:`rank` is its rank.
    :meth:`close` unmaps; copies into it must be finished first (close the swap engine
    that uses it before)."""

    def __init__(self, ex: CacheExport, layout: KVLayout) -> None:
        self.rank = ex.rank
        self.kind = ex.kind
        self._ipc: IpcMapping | None = None
        self._buf: SharedBuffer | None = None
        if ex.kind == "cuda":
            device = _device_of(ex.device_uuid)
            section = {
                "ranks": [
                    {
                        "rank": ex.rank,
                        "device_uuid": ex.device_uuid,
                        "num_blocks": ex.num_blocks,
                        "allocs": [{"handle": a.handle, "size": a.size} for a in ex.allocs],
                        "regions": [list(r) for r in ex.regions],
                    }
                ]
            }
            caches = parse_ipc_section(section, [ex.rank], [layout])  # every region inside its allocation
            self._ipc = IpcMapping(caches, [layout], device)
            self.spec = self._ipc.specs[ex.rank]
        else:
            self._buf = SharedBuffer.open(ex.shm_name, pin="auto")
            if self._buf.size < ex.shm_size:
                size = self._buf.size
                self._buf.close()
                raise ProtocolError(f"segment {ex.shm_name!r} has {size} bytes, the export says {ex.shm_size}")
            base = self._buf.address
            nt = len(layout.tensors)
            regions = [
                [(base + off, stride) for _, off, stride in ex.regions[layer * nt : (layer + 1) * nt]]
                for layer in range(layout.total_layers)
            ]
            self.spec = CacheSpec(layout, ex.num_blocks, regions)

    @property
    def pinned(self) -> bool:
        """A host cache's segment is pinned here (copies to it from a GPU can be async)."""
        return self._buf.pinned if self._buf is not None else False

    def close(self) -> None:
        """Unmap (idempotent)."""
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
        if self._buf is not None:
            self._buf.close()
            self._buf = None

    def __enter__(self) -> MappedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_cache(data: bytes, layout: KVLayout | None = None) -> MappedCache:
    """Map a worker's :func:`export_cache` bytes into this process (checked first; see
    :func:`parse_export`). ``layout``: this process's layout for the rank (default: the
    exported one)."""
    ex = parse_export(data, layout)
    mc = MappedCache(ex, layout if layout is not None else _layout_of(ex))
    _log.info("mapped rank %d's %s cache: %d blocks", ex.rank, ex.kind, ex.num_blocks)
    return mc


def _device_of(uuid: str) -> int:
    uuids = _ffi.cuda.device_uuids()
    if uuid not in uuids:
        raise LayoutError(
            f"the worker's GPU {uuid[:16]} is not one this process sees (CUDA_VISIBLE_DEVICES?): "
            "the scheduler process must see every worker's GPU to map its cache"
        )
    return uuids.index(uuid)
