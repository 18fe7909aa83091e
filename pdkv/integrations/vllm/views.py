"""vLLM's cache tensors as a :class:`~pdkv.CacheSpec`: each layer's view
``[blocks, heads, tokens, 2 x head_dim]`` checked against the rank's layout (shape, dtype,
the strides of a block's inside) and read as a base pointer and a block stride, which is
all pdkv needs of vLLM's physical order (per-layer or cross-layer). Takes torch tensors
by duck typing: no torch or vLLM import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import LayoutError
from ...layout import CacheSpec, KVLayout

__all__ = ["cache_spec"]


def cache_spec(layout: KVLayout, tensors: Sequence[Any]) -> CacheSpec:
    """vLLM's per-layer views ``[blocks, heads, tokens, 2 * head_dim]`` as a
    :class:`~pdkv.CacheSpec` of ``layout`` (fused, in vLLM's order), after checking each
    view's shape, dtype and strides: a block's heads, tokens and K/V must be where the layout
    says, whatever the order of blocks and layers around them."""
    H, N, D = layout.heads_per_rank, layout.tokens_per_block, layout.head_dim
    want = (H, N, 2 * D)
    strides = (2 * D, H * 2 * D, 1) if layout.token_major else (N * 2 * D, 2 * D, 1)
    rows = []
    for i, t in enumerate(tensors):
        if t.dim() != 4 or tuple(t.shape[1:]) != want:
            raise LayoutError(
                f"vLLM's KV cache of layer {i} is {tuple(t.shape)}; pdkv expects [blocks, {H}, {N}, {2 * D}]"
            )
        if t.element_size() * 8 != layout.elem_bytes_per_head_token * 8 // D:
            raise LayoutError(f"vLLM's KV cache of layer {i} is {t.dtype}; the layout says {layout.dtype}")
        if int(t.shape[0]) != int(tensors[0].shape[0]):
            raise LayoutError(f"vLLM's KV cache of layer {i} has {t.shape[0]} blocks, layer 0 {tensors[0].shape[0]}")
        if t.device != tensors[0].device:  # one rank's cache is on one device; pdkv copies it with one context
            raise LayoutError(f"vLLM's KV cache of layer {i} is on {t.device}, layer 0 on {tensors[0].device}")
        # a dimension of size 1 has no meaningful stride (vLLM sets its own for them)
        if any(st != want_st for st, want_st, n in zip(t.stride()[1:], strides, want) if n > 1):
            raise LayoutError(
                f"vLLM's KV cache of layer {i} has strides {tuple(t.stride())}; pdkv's "
                f"{'token' if layout.token_major else 'head'}-major order expects (.., {', '.join(map(str, strides))})"
            )
        rows.append((t.data_ptr(), t.stride(0) * t.element_size()))
    nb = int(tensors[0].shape[0])
    device = tensors[0].device.index if tensors[0].is_cuda else None
    return CacheSpec.vllm(layout, nb, rows, device=device)
