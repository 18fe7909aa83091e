"""SGLang's ``KVArgs`` as pdkv layouts (pure pdkv: reads attributes, imports no SGLang).

SGLang describes a rank's KV pool by buffers: ``kv_data_ptrs`` (MHA: every layer's K
buffer, then every layer's V buffer; MLA: one latent buffer per layer), each a run of
pages of ``kv_item_lens[i]`` bytes (``page_size`` tokens x heads x head_dim, token-major),
and, with decode host receive, ``host_kv_data_ptrs`` the same way for its host pool. A page
id ``p`` of buffer ``i`` is at ``ptr[i] + p * item_len[i]``: that is a
:class:`~pdkv.layout.CacheSpec` with the page as the block and ``item_len`` as its stride.

What a backend's ``KVArgs`` may describe that pdkv does not carry is refused here, in one
line naming it (:func:`refusal`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ...errors import LayoutError
from ...layout import DTYPE_BITS, CacheSpec, KVLayout

__all__ = ["ModelFacts", "RankPools", "refusal", "rank_pools", "layout_for"]


def refusal(args: Any) -> str:
    """What of SGLang's ``KVArgs`` pdkv cannot carry ('' when it carries all of it)."""
    states = [str(getattr(s, "value", s)) for s in (getattr(args, "state_types", None) or [])]
    if states:
        return f"state pools ({', '.join(states)}: hybrid, SWA, DSA or DeepSeek V4 state) are not carried by pdkv"
    if getattr(args, "mla_compression_ratios", None):
        return "compressed MLA (DeepSeek V4 mla_compression_ratios) is not carried by pdkv"
    if getattr(args, "is_hybrid_mla_backend", False):
        return "a hybrid MLA backend is not carried by pdkv"
    if getattr(args, "pp_rank", 0) or getattr(args, "prefill_start_layer", 0):
        return "pipeline-parallel prefill (pp_rank or prefill_start_layer set) is not carried by pdkv"
    if getattr(args, "num_draft_entries", 0):
        return "draft-model KV (num_draft_entries) is not carried by pdkv"
    if getattr(args, "kv_layout", None) not in (None, "", "nhd", "NHD"):
        return f"KV layout {args.kv_layout!r} is not carried by pdkv (token-major pages only)"
    return ""


def _dtype(name: str, model_dtype: str = "") -> str:
    """pdkv's dtype for SGLang's ``kv_cache_dtype_str``. ``"auto"`` (SGLang's default: the
    KV cache has the model's dtype, as its ``configure_kv_cache_dtype`` resolves it) becomes
    ``model_dtype``."""
    if str(name).lower() == "auto":
        if not model_dtype:
            raise LayoutError(
                "SGLang KV dtype 'auto' is the model's dtype, and pdkv was not given the model's "
                "(PdkvKVManager reads it from SGLang's model config)"
            )
        name = model_dtype
    d = str(name).lower().removeprefix("torch.").replace("fp8_", "float8_")
    d = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8_e4m3"}.get(d, d)
    d = d.removesuffix("fn").removesuffix("fnuz")
    if d not in DTYPE_BITS or DTYPE_BITS[d] % 8:
        raise LayoutError(f"SGLang KV dtype {name!r} is not one pdkv carries ({', '.join(sorted(DTYPE_BITS))})")
    return d


@dataclass(frozen=True)
class ModelFacts:
    """What both sides know of the model itself, whatever SGLang filled into ``KVArgs``:
    its KV heads over all TP ranks and its dtype (SGLang's ``ModelConfig``:
    ``get_total_num_kv_heads()`` and ``dtype``). SGLang's prefill fills
    ``KVArgs.total_kv_head_num`` for every MHA model, its decode only with heterogeneous-TP
    staging; ``kv_cache_dtype_str`` is ``"auto"`` for an unquantized model."""

    kv_heads: int = 0
    dtype: str = ""


def total_kv_heads(args: Any, model: ModelFacts | None = None) -> int:
    """The model's KV heads: ``KVArgs.total_kv_head_num`` where SGLang set it, else the
    model's (``model``), else ``PDKV_SGLANG_KV_HEADS``; LayoutError when none says."""
    n = getattr(args, "total_kv_head_num", 0) or (model.kv_heads if model else 0)
    n = n or int(os.environ.get("PDKV_SGLANG_KV_HEADS", "0") or 0)
    if not n > 0:
        raise LayoutError(
            "the model's KV heads are unknown: SGLang did not set KVArgs.total_kv_head_num and the model "
            "config did not say; set PDKV_SGLANG_KV_HEADS"
        )
    return int(n)


def layout_for(
    args: Any, *, mla: bool, tp_size: int, tp_rank: int, kv_heads: int | None = None, model: ModelFacts | None = None
) -> KVLayout:
    """This rank's :class:`KVLayout` from ``KVArgs`` (``kv_item_lens``, ``page_size``, dtype),
    with ``model``'s heads and dtype where ``KVArgs`` leaves them out."""
    lens = list(args.kv_item_lens)
    per_layer = 1 if mla else 2
    if not lens or len(lens) % per_layer:
        raise LayoutError(
            f"SGLang gave {len(lens)} KV buffers; {'MLA' if mla else 'MHA'} needs a multiple of {per_layer}"
        )
    if len(set(lens)) != 1:
        raise LayoutError(f"SGLang's KV buffers have pages of different sizes {sorted(set(lens))}: not one layout")
    dtype = _dtype(args.kv_cache_dtype_str, model.dtype if model else "")
    page = int(args.page_size)
    heads = 1 if mla else (kv_heads or total_kv_heads(args, model))
    heads_here = 1 if mla else max(1, heads // tp_size)
    unit = page * heads_here * DTYPE_BITS[dtype] // 8
    if lens[0] % unit:
        raise LayoutError(
            f"a page of {lens[0]} bytes is not {page} tokens x {heads_here} heads of {dtype}: "
            "set PDKV_SGLANG_KV_HEADS to the model's KV heads"
        )
    return KVLayout(
        num_layers=len(lens) // per_layer,
        kv_heads=heads,
        head_dim=lens[0] // unit,
        tokens_per_block=page,
        dtype=dtype,
        mla=mla,
        tp_size=tp_size,
        tp_rank=tp_rank,
        token_major=True,
    )


def _spec(
    layout: KVLayout, ptrs: list[int], lens: list[int], items: list[int], what: str, device: int | None = None
) -> CacheSpec:
    n = layout.total_layers
    per_layer = len(layout.tensors)
    if len(ptrs) != n * per_layer or len(lens) != len(ptrs) or len(items) != len(ptrs):
        raise LayoutError(f"{what}: {len(ptrs)} buffers for {n} layers of {per_layer} tensors")
    if any(i != items[0] for i in items) or items[0] < layout.block_span(0):
        raise LayoutError(f"{what}: pages of {sorted(set(items))} bytes; the layout's are {layout.block_span(0)}")
    pages = min(ln // it for ln, it in zip(lens, items))
    if pages <= 0:
        raise LayoutError(f"{what}: its buffers hold no whole page")
    # MHA: K buffers of every layer, then V buffers; tensor t of layer l is buffer t * n + l
    regions = [[(int(ptrs[t * n + lay]), int(items[t * n + lay])) for t in range(per_layer)] for lay in range(n)]
    return CacheSpec(layout, pages, regions, device=device)


@dataclass(frozen=True)
class RankPools:
    """One rank's pools as pdkv sees them: the layout, the device pool's spec and, with
    host receive, the host pool's."""

    layout: KVLayout
    device: CacheSpec
    host: CacheSpec | None


def rank_pools(
    args: Any, *, mla: bool, tp_size: int, device: int | None = None, model: ModelFacts | None = None
) -> RankPools:
    """:class:`RankPools` of the rank ``KVArgs`` describe (``engine_rank`` its TP rank);
    ``device``: the CUDA device of the KV pool (None: host memory, a CPU server);
    ``model``: the model's heads and dtype where ``KVArgs`` leaves them out."""
    why = refusal(args)
    if why:
        raise LayoutError(f"pdkv's SGLang backend: {why}")
    if not 0 <= int(args.engine_rank) < tp_size:
        raise LayoutError(f"engine_rank={args.engine_rank} is outside a TP size of {tp_size}")
    layout = layout_for(args, mla=mla, tp_size=tp_size, tp_rank=int(args.engine_rank), model=model)
    pool = _spec(
        layout, list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens), "KV pool", device=device
    )
    host = None
    if getattr(args, "host_kv_data_ptrs", None):
        host = _spec(
            layout,
            list(args.host_kv_data_ptrs),
            list(args.host_kv_data_lens),
            list(args.host_kv_item_lens),
            "host KV pool",
        )
    return RankPools(layout, pool, host)
