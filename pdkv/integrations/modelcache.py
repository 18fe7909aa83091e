"""A model's K/V and a paged cache: write a layer's keys and values into blocks, rebuild
them from blocks (optional extra: ``pip install 'pdkv[model]'``, torch).

HuggingFace transformers' caches hold one layer's keys (and values) as
``[batch, kv_heads, seq, head_dim]``. :class:`PagedKV` is one TP rank's paged cache in
one of the engine layouts pdkv describes (``fastdeploy``: ``[blocks, heads, tokens,
dim]`` per layer and tensor; ``vllm_flash_attn``: ``[2, blocks, tokens, heads, dim]`` per
layer, or head-major; ``flashinfer``: ``[blocks, 2, tokens, heads, dim]`` per layer, or
head-major; ``vllm``: vLLM 0.32+'s fused ``[blocks, tokens, heads, 2 * dim]`` per layer, each
row K then V, or head-major; layout ``kv_fused="row"``), as torch tensors on the CPU or a
GPU, with the :class:`~pdkv.CacheSpec` that pdkv's senders, receivers and swap engine use. :meth:`PagedKV.write` puts a
sequence's K/V (all the model's heads, or this rank's) into given blocks and
:meth:`PagedKV.read` gets them back, with tensor indexing on the cache's own device (no
host round trip). :func:`read_heads` joins the heads of several TP ranks' caches, and
:func:`hf_cache` makes a transformers ``DynamicCache`` of rebuilt layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import LayoutError
from ..layout import KVLayout
from .interop import cache_from_tensors
from .vllm.views import cache_spec

__all__ = ["ENGINES", "PagedKV", "read_heads", "hf_cache"]

ENGINES = ("fastdeploy", "vllm_flash_attn", "flashinfer", "vllm")


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - the extra names it
        raise ImportError(f"pdkv.integrations.modelcache needs torch: pip install 'pdkv[model]' ({exc})") from None
    return torch


def _dtype(layout: KVLayout) -> Any:
    torch = _torch()
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(layout.dtype)
    if dt is None or layout.mla or layout.scales:
        raise LayoutError(
            f"PagedKV holds K and V of bfloat16 or float16 (a model's cache as transformers keeps it), "
            f"not dtype={layout.dtype}, mla={layout.mla}, scales={layout.scales}"
        )
    return dt


class PagedKV:
    """One TP rank's paged K/V cache as torch tensors in an engine's layout.

    ``PagedKV(layout, num_blocks, engine=..., device="cpu")`` allocates it (zeros);
    :meth:`wrap` adopts an engine's own tensors. ``spec`` is its :class:`CacheSpec`
    (``device`` set for a GPU cache). Ownership: the tensors are this object's (or, wrapped,
    the engine's); keep it alive while ``spec`` is in use.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, *, engine: str = "fastdeploy", device: Any = "cpu") -> None:
        torch = _torch()
        dt = _dtype(layout)
        if engine not in ENGINES:
            raise LayoutError(f"engine={engine!r} must be one of {', '.join(ENGINES)}")
        H, T, D = layout.heads_per_rank, layout.tokens_per_block, layout.head_dim
        inner = (T, H, D) if layout.token_major else (H, T, D)
        L, dev = layout.total_layers, torch.device(device)
        tensors: list[Any]
        if (engine == "vllm") != (layout.kv_fused == "row"):
            raise LayoutError(f"engine={engine!r} with kv_fused={layout.kv_fused!r}: the vllm engine is kv_fused='row'")
        if engine == "vllm":
            tensors = [torch.zeros(num_blocks, *inner[:2], 2 * D, dtype=dt, device=dev) for _ in range(L)]
        elif engine == "fastdeploy":
            if layout.token_major:
                raise LayoutError("FastDeploy caches are head-major: use token_major=False")
            tensors = [[torch.zeros(num_blocks, H, T, D, dtype=dt, device=dev) for _ in range(2)] for _ in range(L)]
        elif engine == "vllm_flash_attn":
            tensors = [torch.zeros(2, num_blocks, *inner, dtype=dt, device=dev) for _ in range(L)]
        else:
            tensors = [torch.zeros(num_blocks, 2, *inner, dtype=dt, device=dev) for _ in range(L)]
        self._init(layout, tensors, engine)

    @classmethod
    def wrap(cls, layout: KVLayout, tensors: Sequence[Any], *, engine: str = "fastdeploy") -> PagedKV:
        """An engine's cache tensors (as :func:`~pdkv.cache_from_tensors` takes them), checked."""
        _dtype(layout)
        self = cls.__new__(cls)
        self._init(layout, list(tensors), engine)
        return self

    def _init(self, layout: KVLayout, tensors: list[Any], engine: str) -> None:
        self.layout, self.engine, self.tensors = layout, engine, tensors
        if engine == "vllm":  # vLLM's per-layer view [blocks, heads, tokens, 2 * dim]
            views = [t.permute(0, 2, 1, 3) if layout.token_major else t for t in tensors]
            self.spec = cache_spec(layout, views)
        else:
            self.spec = cache_from_tensors(layout, tensors, engine=engine)  # type: ignore[arg-type]
        self.num_blocks = self.spec.num_blocks

    @property
    def device(self) -> Any:
        t = self.tensors[0][0] if self.engine == "fastdeploy" else self.tensors[0]  # a tensor's
        return t.device

    def blocks_view(self, layer: int, tensor: int) -> Any:
        """``[blocks, heads, tokens, dim]`` view of one layer's K (0) or V (1), whatever the
        in-block order (a token-major cache's view is permuted, not copied)."""
        if not 0 <= layer < self.layout.total_layers or tensor not in (0, 1):
            raise LayoutError(f"layer {layer}, tensor {tensor}: out of range")
        D = self.layout.head_dim
        if self.engine == "vllm":  # K and V: the two halves of each row
            v = self.tensors[layer][..., tensor * D : (tensor + 1) * D]
        elif self.engine == "fastdeploy":
            v = self.tensors[layer][tensor]
        elif self.engine == "vllm_flash_attn":
            v = self.tensors[layer][tensor]
        else:
            v = self.tensors[layer][:, tensor]
        return v.permute(0, 2, 1, 3) if self.layout.token_major else v

    def _heads(self, x: Any, what: str) -> Any:
        """This rank's heads of ``x`` (``[1, heads, seq, dim]``, all the model's or this rank's)."""
        lay = self.layout
        if x.dim() != 4 or x.shape[0] != 1 or x.shape[3] != lay.head_dim:
            raise LayoutError(f"{what}: shape {tuple(x.shape)}, expected [1, heads, seq, {lay.head_dim}]")
        if x.shape[1] == lay.kv_heads:
            h0, h1 = lay.head_range()
            return x[0, h0:h1]
        if x.shape[1] == lay.heads_per_rank:
            return x[0]
        raise LayoutError(
            f"{what}: {x.shape[1]} heads; the model has {lay.kv_heads} and this rank {lay.heads_per_rank}"
        )

    def _ids(self, blocks: Sequence[int], tokens: int) -> Any:
        torch = _torch()
        T = self.layout.tokens_per_block
        need = -(-tokens // T)
        ids = torch.as_tensor(list(blocks), dtype=torch.long)
        if ids.numel() != need:
            raise LayoutError(f"{tokens} tokens fill {need} blocks of {T}; got {ids.numel()} block ids")
        if need and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise LayoutError(f"block ids {ids.tolist()[:8]} out of range [0, {self.num_blocks})")
        return ids.to(self.device)

    def write(self, layer: int, k: Any, v: Any, blocks: Sequence[int]) -> None:
        """Keys and values of one layer (``[1, heads, seq, dim]``, the cache's dtype) into
        ``blocks`` (``ceil(seq / tokens_per_block)`` of them, in token order); the last
        block's tail past ``seq`` is zeroed."""
        torch = _torch()
        T = self.layout.tokens_per_block
        for t, x in enumerate((k, v)):
            x = self._heads(x, ("keys", "values")[t])
            view = self.blocks_view(layer, t)
            if x.dtype != view.dtype:
                raise LayoutError(f"layer {layer}: {x.dtype} K/V into a {view.dtype} cache (no silent cast)")
            H, S, D = x.shape
            ids = self._ids(blocks, S)
            pad = ids.numel() * T - S
            if pad:
                x = torch.cat([x, x.new_zeros(H, pad, D)], dim=1)
            view.index_copy_(0, ids, x.to(view.device).reshape(H, -1, T, D).permute(1, 0, 2, 3))

    def read(self, layer: int, blocks: Sequence[int], tokens: int) -> tuple[Any, Any]:
        """This rank's keys and values of one layer, ``[1, heads, tokens, dim]``, from ``blocks``."""
        ids = self._ids(blocks, tokens)
        out = []
        for t in (0, 1):
            x = self.blocks_view(layer, t).index_select(0, ids)  # [blocks, heads, T, dim]
            H, D = x.shape[1], x.shape[3]
            out.append(x.permute(1, 0, 2, 3).reshape(H, -1, D)[:, :tokens].unsqueeze(0))
        return out[0], out[1]


def read_heads(caches: Sequence[PagedKV], layer: int, blocks: Sequence[int], tokens: int) -> tuple[Any, Any]:
    """The model's K and V of one layer rebuilt from its TP ranks' caches (the same block ids
    on every rank, as decode grants them): heads joined in rank order, a head replicated on
    several ranks taken once."""
    torch = _torch()
    ks, vs, seen = [], [], set()
    for c in sorted(caches, key=lambda c: c.layout.tp_rank):
        rng = c.layout.head_range()
        if rng in seen:
            continue
        seen.add(rng)
        k, v = c.read(layer, blocks, tokens)
        ks.append(k.to(caches[0].device))
        vs.append(v.to(caches[0].device))
    return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


def hf_cache(layers: Sequence[tuple[Any, Any]]) -> Any:
    """A transformers ``DynamicCache`` holding ``(keys, values)`` per layer, in order."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache
