"""KV caches given as tensors: torch, paddle, cupy, numpy, or anything with DLPack-free
``__cuda_array_interface__`` / ``__array_interface__``, or raw pointers.

:func:`tensor_info` reads a tensor's address, bytes, device, shape, dtype and contiguity
without copying; :func:`cache_from_tensors` checks tensors against a :class:`KVLayout`
(shape, dtype, contiguity, device) and builds the :class:`CacheSpec`; :func:`aligned_empty`
allocates a page-aligned host array for a cache built with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import LayoutError
from ..layout import DTYPE_BITS, CacheSpec, KVLayout

__all__ = ["TensorInfo", "tensor_info", "cache_from_tensors", "aligned_empty"]

_NP_TYPESTR = {"<f2": "float16", "<u2": "bfloat16", "|u1": "uint8", "|i1": "uint8", "<i2": "bfloat16"}
_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float8_e4m3fn": "float8_e4m3",
    "float8_e4m3": "float8_e4m3",
    "float8_e5m2": "float8_e5m2",
    "uint8": "uint8",
    "int8": "uint8",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    ptr: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    contiguous: bool
    device: int | None  # CUDA device ordinal, None for host memory
    kind: str


def _contig(shape: Sequence[int], strides: Sequence[int] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expect = itemsize
    for dim, st in zip(reversed(shape), reversed(strides)):
        if dim != 1 and st != expect:
            return False
        expect *= dim
    return True


def tensor_info(t: Any) -> TensorInfo:
    """Describe a tensor without copying it.

    Raises
    ------
    LayoutError
        The object is not a tensor pdkv understands.
    """
    mod = type(t).__module__.split(".")[0]
    if mod == "torch":
        dtype = str(t.dtype).removeprefix("torch.")
        dev = t.device
        return TensorInfo(
            int(t.data_ptr()),
            int(t.numel() * t.element_size()),
            tuple(t.shape),
            _NAMES.get(dtype, dtype),
            int(t.element_size()),
            bool(t.is_contiguous()),
            dev.index if dev.type == "cuda" else None,
            "torch",
        )
    if mod == "paddle":
        dtype = str(t.dtype).split(".")[-1]
        place = str(t.place)
        dev = None
        if "gpu" in place.lower():
            dev = int(place.split(":")[-1].rstrip(")")) if ":" in place else 0
        size = int(t.element_size()) if hasattr(t, "element_size") else {"bfloat16": 2, "float16": 2}.get(dtype, 1)
        strides = [s * size for s in t.strides] if hasattr(t, "strides") else None
        return TensorInfo(
            int(t.data_ptr()),
            int(t.numel()) * size,
            tuple(t.shape),
            _NAMES.get(dtype, dtype),
            size,
            _contig(t.shape, strides, size),
            dev,
            "paddle",
        )
    cai = getattr(t, "__cuda_array_interface__", None)
    if cai is not None:
        itemsize = int(cai["typestr"][2:])
        n = 1
        for d in cai["shape"]:
            n *= d
        dev = getattr(getattr(t, "device", None), "id", None)
        dtype = _NP_TYPESTR.get(cai["typestr"], cai["typestr"])
        dt = getattr(t, "dtype", None)
        if dt is not None and str(dt) in _NAMES:
            dtype = _NAMES[str(dt)]
        return TensorInfo(
            int(cai["data"][0]),
            n * itemsize,
            tuple(cai["shape"]),
            dtype,
            itemsize,
            _contig(cai["shape"], cai.get("strides"), itemsize),
            dev if dev is not None else 0,
            "cuda",
        )
    ai = getattr(t, "__array_interface__", None)
    if ai is not None:
        itemsize = int(ai["typestr"][2:])
        n = 1
        for d in ai["shape"]:
            n *= d
        dtype = str(getattr(t, "dtype", ai["typestr"]))
        return TensorInfo(
            int(ai["data"][0]),
            n * itemsize,
            tuple(ai["shape"]),
            _NAMES.get(dtype, _NP_TYPESTR.get(ai["typestr"], dtype)),
            itemsize,
            _contig(ai["shape"], ai.get("strides"), itemsize),
            None,
            "numpy",
        )
    raise LayoutError(
        f"cannot read a tensor of type {type(t).__module__}.{type(t).__qualname__}: "
        "expected torch, paddle, cupy or numpy (or pass pointers to CacheSpec)"
    )


def _expect_shape(layout: KVLayout, num_blocks: int, tensor: int, engine: str) -> tuple[int, ...]:
    H, T = layout.heads_per_rank, layout.tokens_per_block
    if layout.is_scale(tensor):
        return (num_blocks, H, T)
    D = layout.head_dim * DTYPE_BITS[layout.dtype] // 8 if layout.dtype == "int4" else layout.head_dim
    if engine == "fastdeploy":
        return (num_blocks, H, T, D)
    return (num_blocks, T, H, D) if layout.token_major else (num_blocks, H, T, D)


def cache_from_tensors(
    layout: KVLayout,
    tensors: Sequence[Any] | Sequence[Sequence[Any]],
    *,
    engine: Literal["fastdeploy", "vllm_flash_attn", "flashinfer"] = "fastdeploy",
) -> CacheSpec:
    """Build a :class:`CacheSpec` from an engine's cache tensors, checked against ``layout``.

    ``fastdeploy``: ``tensors[layer][tensor]``, each ``[blocks, heads, tokens, dim]``.
    ``vllm_flash_attn``: ``tensors[layer]`` of shape ``[2, blocks, tokens, heads, dim]``.
    ``flashinfer``: ``tensors[layer]`` of shape ``[blocks, 2, tokens, heads, dim]``
    (``[blocks, 2, heads, tokens, dim]`` when the layout is head-major).

    Ownership: the spec holds addresses only; keep the tensors alive while it is used.

    Raises
    ------
    LayoutError
        Naming the layer, tensor and what differs (shape, dtype, contiguity, device).
    """
    if len(tensors) != layout.total_layers:
        raise LayoutError(f"got tensors for {len(tensors)} layers; the layout has {layout.total_layers}")
    want_dtype = layout.dtype
    devices: set[int | None] = set()

    def check(info: TensorInfo, where: str, shape: tuple[int, ...], scale: bool) -> None:
        if info.shape != shape:
            raise LayoutError(f"{where}: shape {info.shape}, expected {shape} for this layout")
        dt = "bfloat16" if scale else want_dtype
        ok = info.dtype == dt or (dt in ("float8_e4m3", "float8_e5m2", "int4") and info.itemsize == 1)
        if not ok:
            raise LayoutError(f"{where}: dtype {info.dtype}, expected {dt}")
        if not info.contiguous:
            raise LayoutError(f"{where}: tensor is not contiguous")
        devices.add(info.device)

    if engine == "fastdeploy":
        nb = None
        regions = []
        for li, row in enumerate(tensors):
            if len(row) != len(layout.tensors):
                raise LayoutError(f"layer {li}: {len(row)} tensors, expected {layout.tensors}")
            r = []
            for ti, t in enumerate(row):
                info = tensor_info(t)
                nb = info.shape[0] if nb is None else nb
                check(
                    info, f"layer {li} {layout.tensors[ti]}", _expect_shape(layout, nb, ti, engine), layout.is_scale(ti)
                )
                r.append((info.ptr, layout.tensor_block_bytes(ti)))
            regions.append(r)
        spec_blocks = nb or 0
        if layout.token_major:
            raise LayoutError("FastDeploy caches are head-major: use token_major=False")
        out = CacheSpec(layout, spec_blocks, regions)
    elif engine in ("vllm_flash_attn", "flashinfer"):
        if layout.mla or layout.scales:
            raise LayoutError(f"{engine} caches hold K and V without scale tensors")
        H, T, D = layout.heads_per_rank, layout.tokens_per_block, layout.head_dim
        ptrs = []
        nb = None
        for li, t in enumerate(tensors):
            info = tensor_info(t)
            if engine == "vllm_flash_attn":
                nb = info.shape[1] if nb is None and len(info.shape) > 1 else nb
                inner = (T, H, D) if layout.token_major else (H, T, D)
                shape = (2, nb or 0, *inner)
            else:
                nb = info.shape[0] if nb is None else nb
                inner = (T, H, D) if layout.token_major else (H, T, D)
                shape = (nb or 0, 2, *inner)
            check(info, f"layer {li}", shape, False)
            ptrs.append(info.ptr)
        build = CacheSpec.vllm_flash_attn if engine == "vllm_flash_attn" else CacheSpec.flashinfer
        out = build(layout, nb or 0, ptrs)
    else:
        raise LayoutError(f"engine={engine!r} must be fastdeploy, vllm_flash_attn or flashinfer")
    if len(devices) > 1:
        raise LayoutError(f"cache tensors live on several devices: {sorted(map(str, devices))}")
    out.device = devices.pop() if devices else None
    return out


def aligned_empty(nbytes: int, align: int = 4096) -> Any:
    """An uninitialised ``uint8`` numpy array of ``nbytes`` whose first byte is a multiple
    of ``align`` (a power of two, at most 2 MiB).

    For host KV caches built with numpy: a large ``np.empty`` / ``np.zeros`` starts 16 bytes
    into its first page (malloc's chunk header), so every block of such a cache is 16 bytes
    off the page and cache-line grid, and block copies from it run slower on some CPUs: on
    the AMD EPYC development VM (glibc 2.36), 128 KiB blocks gathered with numpy in random
    order from page offset 16 ran at 0.83 of a contiguous copy, from offsets 0, 64 or 2048
    at 0.97-1.04; 32 KiB blocks 0.71-0.74 against 0.78-0.89
    (``tools/bench_transport.py --src-offset 16``). Engines' own allocators align already
    (torch's CPU allocator to 64 bytes, paddle's and pinned ``cudaHostAlloc`` memory to a
    page).

    The array owns its memory: it is a view of a slightly larger array, kept alive by
    ``.base``.
    """
    import numpy as np

    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"nbytes={nbytes!r} must be a positive number of bytes")
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1) or align > 1 << 21:
        raise ValueError(f"align={align!r} must be a power of two between 1 and 2 MiB")
    raw = np.empty(nbytes + align, np.uint8)
    off = -raw.ctypes.data % align
    return raw[off : off + nbytes]
