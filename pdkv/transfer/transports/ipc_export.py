"""CUDA IPC for the ``cuda_ipc`` transport: a decode rank's GPU cache described as the
allocations that hold it (one IPC handle each) plus offsets, and mapped back into a
same-host prefill process, which then writes granted GPU blocks with the swap engine.

A handle names a whole allocation (``cudaIpcGetMemHandle`` needs the allocation's base;
caching allocators such as torch's hand out parts of larger allocations), so every
(layer, tensor) region is sent as ``[allocation index, offset, block stride]``.

Wire form (``Welcome.cuda``)::

    {"ranks": [{"rank": r, "device_uuid": hex, "num_blocks": n,
                "allocs": [{"handle": 64 bytes, "size": bytes}, ...],
                "regions": [[alloc, offset, stride], ...]}]}   # layer-major, then tensor

Everything that arrives is checked before anything is opened: shapes, types, every
region inside its allocation for all ``num_blocks`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ... import _ffi
from ...errors import CudaError, LayoutError, PdkvError, ProtocolError, TransferError
from ...layout import CacheSpec, KVLayout

__all__ = ["export_gpu_caches", "parse_ipc_section", "IpcMapping", "RankCache", "unreachable"]

_MAX_ALLOCS = 1 << 16


def _region_end(off: int, stride: int, num_blocks: int, block_bytes: int) -> int:
    return off + stride * (num_blocks - 1) + block_bytes


def unreachable(prefill_uuid: str, devices: Sequence[int]) -> str | None:
    """Why a process on the GPU ``prefill_uuid`` could not map memory of ``devices`` (this
    process's ordinals), or None when it can: the same GPU, or one this process also sees
    with peer access to each of them (decode side, before choosing cuda_ipc)."""
    own = {d: _ffi.cuda.device_uuid(d) for d in set(devices)}
    others = [d for d, u in own.items() if u != prefill_uuid]
    if not others:
        return None
    uuids = _ffi.cuda.device_uuids()
    if prefill_uuid not in uuids:
        return (
            f"prefill's GPU {prefill_uuid[:16]} is not one decode sees (CUDA_VISIBLE_DEVICES?), "
            "so peer access is unknown"
        )
    p = uuids.index(prefill_uuid)
    for d in sorted(others):
        if not _ffi.cuda.can_access_peer(p, d):
            return f"prefill's GPU (decode's device {p}) has no peer access to decode's device {d}"
    return None


def export_gpu_caches(layouts: Sequence[KVLayout], specs: Sequence[CacheSpec], pool_blocks: int) -> dict[str, Any]:
    """Describe each rank's GPU cache for ``Welcome.cuda`` (decode side).

    Raises
    ------
    LayoutError
        A cache that is not on a device, has another layout, fewer blocks than the GPU
        pool, or a region that spans two allocations.
    CudaUnavailableError / CudaError
        No CUDA, or the driver refused (memory that cannot be exported).
    """
    if len(layouts) != len(specs):
        raise LayoutError(f"{len(specs)} GPU caches for {len(layouts)} decode ranks")
    ranks = []
    for lay, spec in zip(layouts, specs):
        if spec.device is None:
            raise LayoutError(f"rank {lay.tp_rank}'s GPU cache has no device: cuda_ipc exports device memory")
        if spec.layout != lay:
            raise LayoutError(f"rank {lay.tp_rank}'s GPU cache has another layout than the rank")
        if spec.num_blocks < pool_blocks:
            raise LayoutError(
                f"rank {lay.tp_rank}'s GPU cache has {spec.num_blocks} blocks; "
                f"the scheduler's GPU pool hands out {pool_blocks}"
            )
        with _ffi.cuda.on_device(spec.device):  # handles are made in the cache's device context
            ranks.append(_export_rank(lay, spec))
    return {"ranks": ranks}


def _export_rank(lay: KVLayout, spec: CacheSpec) -> dict[str, Any]:
    """One rank's ``Welcome.cuda`` entry; the cache's device is current."""
    allocs: list[tuple[int, int]] = []
    regions = []
    for layer in range(lay.total_layers):
        for t in range(len(lay.tensors)):
            base, stride = spec.region(layer, t)
            abase, asize = _ffi.cuda.address_range(base)
            if _region_end(base, stride, spec.num_blocks, lay.tensor_block_extent(t)) > abase + asize:
                raise LayoutError(
                    f"rank {lay.tp_rank}, layer {layer}, tensor {t}: the region spans more "
                    "than one allocation (one IPC handle per allocation)"
                )
            try:
                idx = allocs.index((abase, asize))
            except ValueError:
                idx = len(allocs)
                allocs.append((abase, asize))
            regions.append([idx, base - abase, stride])
    try:
        handles = [{"handle": _ffi.cuda.ipc_get_handle(b), "size": n} for b, n in allocs]
    except CudaError as exc:
        raise LayoutError(
            f"rank {lay.tp_rank}'s GPU cache cannot be exported for CUDA IPC ({exc}); memory "
            "from cuMemCreate, such as torch's expandable segments, has no legacy IPC "
            "handle: allocate the cache with cudaMalloc or serve shm instead"
        ) from exc
    assert spec.device is not None  # export_gpu_caches refuses host caches first
    return {
        "rank": lay.tp_rank,
        "device_uuid": _ffi.cuda.device_uuid(spec.device),
        "num_blocks": spec.num_blocks,
        "allocs": handles,
        "regions": regions,
    }


@dataclass(frozen=True)
class RankCache:
    """One decode rank's GPU cache as received, validated (nothing opened yet)."""

    rank: int
    device_uuid: str
    num_blocks: int
    allocs: tuple[tuple[bytes, int], ...]  # (handle, size)
    regions: tuple[tuple[int, int, int], ...]  # (alloc, offset, stride), layer-major


def _int(x: Any, what: str, lo: int = 0) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < lo:
        raise ProtocolError(f"cuda_ipc: {what}={x!r} must be an integer >= {lo}")
    return x


def parse_ipc_section(section: Any, ranks: Sequence[int], layouts: Sequence[KVLayout]) -> dict[int, RankCache]:
    """Validate ``Welcome.cuda`` against the decode ranks' layouts (prefill side).

    Raises ProtocolError naming the first problem."""
    if not isinstance(section, dict) or set(section) != {"ranks"} or not isinstance(section["ranks"], list):
        raise ProtocolError("cuda_ipc: the welcome's cuda section must be {'ranks': [...]}")
    by_rank = {lay.tp_rank: lay for lay in layouts}
    out: dict[int, RankCache] = {}
    for e in section["ranks"]:
        keys = {"rank", "device_uuid", "num_blocks", "allocs", "regions"}
        if not isinstance(e, dict) or set(e) != keys:
            raise ProtocolError(f"cuda_ipc: a rank entry must have exactly the fields {sorted(keys)}")
        rank = _int(e["rank"], "rank")
        lay = by_rank.get(rank)
        if lay is None or rank in out:
            raise ProtocolError(f"cuda_ipc: rank {rank} is not one of decode's ranks {list(ranks)} or is repeated")
        if not isinstance(e["device_uuid"], str) or len(e["device_uuid"]) > 64:
            raise ProtocolError("cuda_ipc: device_uuid must be a short string")
        nb = _int(e["num_blocks"], "num_blocks", 1)
        allocs = e["allocs"]
        if not isinstance(allocs, list) or not 0 < len(allocs) <= _MAX_ALLOCS:
            raise ProtocolError("cuda_ipc: allocs must be a non-empty list")
        parsed_allocs = []
        for a in allocs:
            if (
                not isinstance(a, dict)
                or set(a) != {"handle", "size"}
                or not isinstance(a["handle"], bytes)
                or len(a["handle"]) != _ffi.cuda.IPC_HANDLE_BYTES
            ):
                raise ProtocolError(
                    f"cuda_ipc: an allocation must be {{handle: {_ffi.cuda.IPC_HANDLE_BYTES} bytes, size}}"
                )
            parsed_allocs.append((a["handle"], _int(a["size"], "allocation size", 1)))
        nt = len(lay.tensors)
        regions = e["regions"]
        if not isinstance(regions, list) or len(regions) != lay.total_layers * nt:
            raise ProtocolError(f"cuda_ipc: rank {rank} needs {lay.total_layers * nt} regions (layers x tensors)")
        parsed_regions = []
        for i, r in enumerate(regions):
            if not isinstance(r, list) or len(r) != 3:
                raise ProtocolError("cuda_ipc: a region is [allocation, offset, stride]")
            ai, off, stride = (_int(r[0], "allocation index"), _int(r[1], "offset"), _int(r[2], "stride"))
            tb = lay.block_span(i % nt)
            if ai >= len(parsed_allocs):
                raise ProtocolError(f"cuda_ipc: region {i} names allocation {ai} of {len(parsed_allocs)}")
            if stride < tb:
                raise ProtocolError(f"cuda_ipc: region {i} has stride {stride} below the block's {tb} bytes")
            if _region_end(off, stride, nb, lay.tensor_block_extent(i % nt)) > parsed_allocs[ai][1]:
                raise ProtocolError(f"cuda_ipc: region {i} ends past its allocation of {parsed_allocs[ai][1]} bytes")
            parsed_regions.append((ai, off, stride))
        out[rank] = RankCache(rank, e["device_uuid"], nb, tuple(parsed_allocs), tuple(parsed_regions))
    missing = [r for r in ranks if r not in out]
    if missing:
        raise ProtocolError(f"cuda_ipc: no GPU cache for decode ranks {missing}")
    return out


class IpcMapping:
    """The decode ranks' GPU caches mapped into this process (prefill side).

    ``specs[rank]`` addresses a rank's cache here. :meth:`close` unmaps every allocation;
    copies into them must be finished before (the sender closes its swap engine first).
    """

    def __init__(self, caches: dict[int, RankCache], layouts: Sequence[KVLayout], device: int) -> None:
        self._opened: list[int] = []
        self.specs: dict[int, CacheSpec] = {}
        self.device = device
        by_rank = {lay.tp_rank: lay for lay in layouts}
        try:
            with _ffi.cuda.on_device(device):  # mapped into (and peer access from) this device's context
                self._open(caches, by_rank, device)
        except BaseException:
            self.close()
            raise

    def _open(self, caches: dict[int, RankCache], by_rank: dict[int, KVLayout], device: int) -> None:
        for rank, c in caches.items():
            bases = []
            for handle, _ in c.allocs:
                try:
                    b = _ffi.cuda.ipc_open(handle)
                except PdkvError as exc:
                    raise TransferError(
                        f"cuda_ipc: cannot map decode rank {rank}'s GPU cache (device "
                        f"{c.device_uuid}) on device {device}: {exc}; the devices need "
                        "peer access, else use shm"
                    ) from exc
                self._opened.append(b)
                bases.append(b)
            lay = by_rank[rank]
            nt = len(lay.tensors)
            regions = [
                [(bases[ai] + off, stride) for ai, off, stride in c.regions[layer * nt : (layer + 1) * nt]]
                for layer in range(lay.total_layers)
            ]
            self.specs[rank] = CacheSpec(lay, c.num_blocks, regions, device=device)

    def close(self) -> None:
        """Unmap every opened allocation. Idempotent."""
        if not self._opened:
            return
        with _ffi.cuda.on_device(self.device):
            while self._opened:
                b = self._opened.pop()
                try:
                    _ffi.cuda.ipc_close(b)
                except PdkvError:
                    pass
