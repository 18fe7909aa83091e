"""KV cache layout of one rank, sizing, addresses, TP mapping and the layout descriptor.

Per rank and per layer there is a K tensor and a V tensor (K only for MLA), each
``[num_blocks, kv_heads_per_rank, tokens_per_block, head_dim]`` ("HND": head-major inside
a block) or ``[num_blocks, tokens_per_block, kv_heads_per_rank, head_dim]`` ("NHD",
``token_major=True``). Optional per-token scales are ``[num_blocks, kv_heads_per_rank,
tokens_per_block]`` bfloat16, one tensor per K/V, always head-major.

Fused caches (``kv_fused``, vLLM's ``[blocks, heads, tokens, 2 * head_dim]`` view) keep a
layer's K and V in one block: ``"row"``, each (head, token) row K then V (FlashAttention);
``"head"``, each head a K region then a V region, their insides the engine's own order
(vLLM's CPU backend packs K): moved whole, so a ``"head"`` cache pairs only with another.
A fused block is one ``layer_block_bytes`` run, K and V strided inside it; how blocks of
several layers interleave (vLLM's cross-layer orders) is the :class:`CacheSpec`'s business.

All sizes here are **per rank** unless a name says ``instance``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import LayoutError, LayoutMismatchError

__all__ = ["DTYPE_BITS", "KVLayout", "CacheSpec", "Segment", "tp_segments", "GIB", "DESCRIPTOR_VERSION"]

GIB = 1 << 30
DESCRIPTOR_VERSION = 1

DTYPE_BITS: Mapping[str, int] = dict(bfloat16=16, float16=16, float32=32, float8_e4m3=8, float8_e5m2=8, uint8=8, int4=4)
_ALIASES = dict(bf16="bfloat16", fp16="float16", half="float16", fp32="float32", float="float32", int8="uint8")
_ALIASES |= dict(fp8="float8_e4m3", float8="float8_e4m3", e4m3="float8_e4m3", e5m2="float8_e5m2")
_ALIASES |= {"float8_e4m3fn": "float8_e4m3", "float8_e4m3fnuz": "float8_e4m3", "float8_e5m2fnuz": "float8_e5m2"}
_SCALE_BYTES = 2  # bfloat16 scale per (head, token)
KV_FUSED = ("", "row", "head")
_MAX = dict(num_layers=4096, extra_layers=256, kv_heads=4096, head_dim=65536, tokens_per_block=65536, tp_size=4096)


def _canon_dtype(dtype: str) -> str:
    name = str(dtype).lower().removeprefix("torch.").removeprefix("paddle.")
    d = _ALIASES.get(name, name)
    if d not in DTYPE_BITS:
        raise LayoutError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPE_BITS)}")
    return d


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """The KV cache layout of one TP rank.

    Parameters
    ----------
    num_layers, extra_layers:
        Transformer layers, plus extra cache layers (e.g. MTP draft layers).
    kv_heads:
        Total KV heads of the model (all ranks). 1 for MLA (the latent).
    head_dim:
        Elements per head (for MLA the latent width, e.g. 576).
    tokens_per_block:
        Tokens in one cache block.
    dtype:
        ``bfloat16``, ``float16``, ``float8_e4m3``/``float8_e5m2``/``uint8`` or packed ``int4``.
    mla:
        Key-only cache (no V tensor); the latent is replicated on every rank.
    scales:
        Per-token bfloat16 scale tensors beside K (and V).
    tp_size, tp_rank:
        Tensor-parallel size and this rank. Heads split evenly when ``kv_heads >= tp_size``
        and are replicated when ``kv_heads < tp_size`` (``tp_size`` a multiple of ``kv_heads``).
    token_major:
        ``True`` for NHD blocks (vLLM's default), ``False`` for HND (FastDeploy).
    kv_fused:
        ``""``: K and V are separate tensors. ``"row"``: one block holds both, each
        (head, token) row K then V (vLLM FlashAttention). ``"head"``: one block holds both,
        each head's K region then its V region, their interiors the engine's (vLLM's CPU
        backend; head-major only; pairs only with another ``"head"`` layout).

    Raises
    ------
    LayoutError
        Naming the field, the value and the rule it broke.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str = "bfloat16"
    extra_layers: int = 0
    mla: bool = False
    scales: bool = False
    tp_size: int = 1
    tp_rank: int = 0
    token_major: bool = False
    kv_fused: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "tokens_per_block", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise LayoutError(f"{name}={v!r} must be a positive integer")
            if v > _MAX[name]:
                raise LayoutError(f"{name}={v} is absurd (more than {_MAX[name]})")
        for name in ("extra_layers", "tp_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise LayoutError(f"{name}={v!r} must be a non-negative integer")
        if self.extra_layers > _MAX["extra_layers"]:
            raise LayoutError(f"extra_layers={self.extra_layers} is absurd (more than {_MAX['extra_layers']})")
        object.__setattr__(self, "dtype", _canon_dtype(self.dtype))
        if (self.head_dim * DTYPE_BITS[self.dtype]) % 8:
            raise LayoutError(f"head_dim={self.head_dim} with dtype={self.dtype} is not a whole number of bytes")
        if self.mla and self.kv_heads != 1:
            raise LayoutError(f"kv_heads={self.kv_heads} with mla=True: an MLA cache has one latent head")
        if self.tp_rank >= self.tp_size:
            raise LayoutError(f"tp_rank={self.tp_rank} must be < tp_size={self.tp_size}")
        if self.kv_fused not in KV_FUSED:
            raise LayoutError(f"kv_fused={self.kv_fused!r} must be one of {KV_FUSED}")
        if self.kv_fused and (self.mla or self.scales):
            raise LayoutError(f"kv_fused={self.kv_fused!r} fuses K and V: not with mla=True or scales=True")
        if self.kv_fused == "head" and self.token_major:
            raise LayoutError("kv_fused='head' (each head's K rows, then its V rows) is head-major: token_major=False")
        h, p = self.kv_heads, self.tp_size
        if h % p and p % h:
            raise LayoutError(
                f"kv_heads={h} and tp_size={p}: one must divide the other "
                "(heads split evenly, or each head replicated on tp_size/kv_heads ranks)"
            )

    # ---------------------------------------------------------- structure
    @property
    def total_layers(self) -> int:
        return self.num_layers + self.extra_layers

    @property
    def tensors(self) -> tuple[str, ...]:
        """Names of the tensors of one layer, in storage order."""
        kv = ("k",) if self.mla else ("k", "v")
        return kv + tuple(f"{t}_scale" for t in kv) if self.scales else kv

    def tensor_index(self, tensor: str | int) -> int:
        if isinstance(tensor, int):
            if not 0 <= tensor < len(self.tensors):
                raise LayoutError(f"tensor index {tensor} out of range for tensors {self.tensors}")
            return tensor
        try:
            return self.tensors.index(tensor)
        except ValueError:
            raise LayoutError(f"tensor {tensor!r} not in this layout's tensors {self.tensors}") from None

    def is_scale(self, tensor: str | int) -> bool:
        return self.tensors[self.tensor_index(tensor)].endswith("_scale")

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.kv_heads // self.tp_size)

    def head_range(self, rank: int | None = None) -> tuple[int, int]:
        """Global heads ``[start, stop)`` held by ``rank`` (default: this rank)."""
        r = self.tp_rank if rank is None else rank
        if not 0 <= r < self.tp_size:
            raise LayoutError(f"rank {r} out of range for tp_size={self.tp_size}")
        if self.kv_heads >= self.tp_size:
            n = self.kv_heads // self.tp_size
            return r * n, (r + 1) * n
        h = r // (self.tp_size // self.kv_heads)
        return h, h + 1

    @property
    def elem_bytes_per_head_token(self) -> int:
        """Bytes of one (head, token) of K or V."""
        return self.head_dim * DTYPE_BITS[self.dtype] // 8

    def unit_bytes(self, tensor: str | int) -> int:
        """Bytes of one (head, token) in ``tensor``."""
        return _SCALE_BYTES if self.is_scale(tensor) else self.elem_bytes_per_head_token

    def tensor_block_bytes(self, tensor: str | int) -> int:
        """Bytes of one block of one layer of ``tensor`` on this rank."""
        return self.heads_per_rank * self.tokens_per_block * self.unit_bytes(tensor)

    def tensor_offset(self, tensor: str | int) -> int:
        """Bytes from a layer block's start to the tensor's first byte: 0 but for fused V."""
        t = self.tensor_index(tensor)
        if not self.kv_fused or t == 0:
            return 0
        u = self.elem_bytes_per_head_token
        return u if self.kv_fused == "row" else self.tokens_per_block * u

    def block_span(self, tensor: str | int) -> int:
        """Bytes from one block of ``tensor`` to the next in a packed region (fused: K and V)."""
        return self.layer_block_bytes if self.kv_fused else self.tensor_block_bytes(tensor)

    def tensor_block_extent(self, tensor: str | int) -> int:
        """Bytes from the tensor's address in a block to the end of that block's storage:
        every piece of the tensor in one block lies in ``[0, extent)`` of its address."""
        return self.block_span(tensor) - self.tensor_offset(tensor)

    def unit_strides(self, tensor: str | int) -> tuple[int, int]:
        """``(head_stride, token_stride)`` in bytes of one (head, token) of ``tensor`` inside
        a block, from the tensor's address in it."""
        t = self.tensor_index(tensor)
        u, T, H = self.unit_bytes(t), self.tokens_per_block, self.heads_per_rank
        if self.is_scale(t):
            return T * u, u
        if self.kv_fused == "row":
            return (2 * u, 2 * H * u) if self.token_major else (2 * T * u, 2 * u)
        if self.kv_fused == "head":
            return 2 * T * u, u
        return (u, H * u) if self.token_major else (T * u, u)

    @property
    def layer_block_bytes(self) -> int:
        return sum(self.tensor_block_bytes(i) for i in range(len(self.tensors)))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers and tensors, one rank."""
        return self.total_layers * self.layer_block_bytes

    @property
    def instance_block_bytes(self) -> int:
        """Bytes of one block over all ranks of the instance (replicated heads count per rank)."""
        return self.block_bytes * self.tp_size

    # ---------------------------------------------------------- sizing
    def blocks_for_bytes(self, nbytes: int) -> int:
        """Whole blocks that fit in ``nbytes`` of one rank's buffer."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise LayoutError(f"nbytes={nbytes!r} must be a positive integer")
        return nbytes // self.block_bytes

    def blocks_for_gib(self, gib: float) -> int:
        if not gib > 0:
            raise LayoutError(f"gib={gib!r} must be positive")
        return self.blocks_for_bytes(int(gib * GIB))

    def bytes_for_blocks(self, blocks: int) -> int:
        if not isinstance(blocks, int) or blocks < 0:
            raise LayoutError(f"blocks={blocks!r} must be a non-negative integer")
        return blocks * self.block_bytes

    def blocks_for_tokens(self, tokens: int, *, full_only: bool = False) -> int:
        """Blocks holding ``tokens`` tokens (rounded up; down with ``full_only``)."""
        if not isinstance(tokens, int) or tokens < 0:
            raise LayoutError(f"tokens={tokens!r} must be a non-negative integer")
        if full_only:
            return tokens // self.tokens_per_block
        return -(-tokens // self.tokens_per_block)

    def tokens_for_blocks(self, blocks: int) -> int:
        return blocks * self.tokens_per_block

    def with_rank(self, rank: int) -> KVLayout:
        return dataclasses.replace(self, tp_rank=rank)

    # ---------------------------------------------------------- descriptor
    def descriptor(self) -> dict[str, Any]:
        """A versioned, self-describing dict for the handshake (msgpack/JSON friendly)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(format="pdkv.layout", version=DESCRIPTOR_VERSION, block_bytes=self.block_bytes)
        return d

    @classmethod
    def from_descriptor(cls, d: Mapping[str, Any]) -> KVLayout:
        """Rebuild a layout from :meth:`descriptor`; raise LayoutMismatchError on a bad one."""
        if not isinstance(d, Mapping) or d.get("format") != "pdkv.layout":
            raise LayoutMismatchError("not a pdkv layout descriptor (format != 'pdkv.layout')")
        if d.get("version") != DESCRIPTOR_VERSION:
            raise LayoutMismatchError(
                f"layout descriptor version {d.get('version')!r} is "
                f"not supported (this pdkv speaks {DESCRIPTOR_VERSION})"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names - {"format", "version", "block_bytes"}
        if unknown:
            raise LayoutMismatchError(f"layout descriptor has unknown fields {sorted(unknown)}")
        try:
            lay = cls(**{k: d[k] for k in names if k in d})
        except TypeError as exc:
            raise LayoutMismatchError(f"layout descriptor is incomplete: {exc}") from None
        if "block_bytes" in d and d["block_bytes"] != lay.block_bytes:
            raise LayoutMismatchError(f"block_bytes: descriptor says {d['block_bytes']}, computed {lay.block_bytes}")
        return lay

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatchError naming the first field that makes a transfer impossible.

        TP size and rank and the in-block order (``token_major``, ``kv_fused``) may differ:
        the TP mapping handles those, except a ``"head"`` cache (opaque regions per head),
        which pairs only with another.
        """
        for f in ("num_layers", "extra_layers", "kv_heads", "head_dim", "tokens_per_block", "dtype", "mla", "scales"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                raise LayoutMismatchError(f"layout mismatch: {f} is {a!r} here and {b!r} at the peer")
        if (self.kv_fused == "head") != (other.kv_fused == "head"):
            raise LayoutMismatchError(
                f"layout mismatch: kv_fused is {self.kv_fused!r} here and {other.kv_fused!r} at the peer; a 'head' "
                "cache (vLLM's CPU backend) keeps each head's tokens in its own order and pairs only with another"
            )


@dataclass(frozen=True, slots=True)
class Segment:
    """One copy inside a block: ``count`` pieces of ``length`` bytes.

    Piece i reads ``src_offset + i*src_stride`` in the source rank's block of ``tensor``
    and writes ``dst_offset + i*dst_stride`` in the destination rank's block.
    """

    tensor: int
    src_rank: int
    dst_rank: int
    src_offset: int
    dst_offset: int
    length: int
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.length * self.count


def _src_rank_for_head(src: KVLayout, head: int) -> int:
    # replicated heads (kv_heads < tp) are sent once: from the lowest rank holding them
    if src.kv_heads >= src.tp_size:
        return head // (src.kv_heads // src.tp_size)
    return head * (src.tp_size // src.kv_heads)


def tp_segments(src: KVLayout, dst: KVLayout) -> list[Segment]:
    """Copy segments from every prefill rank (``src.tp_size``) to every decode rank.

    Every byte of every destination block is written exactly once; a head held by several
    prefill ranks is read from one of them only. Returns segments for all tensors, ordered
    by (dst_rank, tensor, src_rank).

    Raises
    ------
    LayoutMismatchError
        If the layouts differ in anything but TP size/rank and in-block order.
    """
    src.check_compatible(dst)
    out: list[Segment] = []
    T = src.tokens_per_block
    for s in range(dst.tp_size):
        d0, d1 = dst.head_range(s)
        for t in range(len(dst.tensors)):
            unit = dst.unit_bytes(t)
            shs, sts = src.unit_strides(t)
            dhs, dts = dst.unit_strides(t)
            # runs of consecutive heads coming from one source rank
            h = d0
            while h < d1:
                r = _src_rank_for_head(src, h)
                s0, s1 = src.head_range(r)
                stop = min(d1, s1)
                n, ls, ld = stop - h, h - s0, h - d0
                so, do = ls * shs, ld * dhs
                if sts == dts == unit:
                    # each head's tokens contiguous on both sides: a piece per head, or one
                    # piece for the run where the heads follow each other on both sides too
                    if shs == dhs == T * unit:
                        segs = [Segment(t, r, s, so, do, n * T * unit)]
                    else:
                        segs = [Segment(t, r, s, so, do, T * unit, n, shs, dhs)]
                elif shs == dhs == unit:
                    # each token's heads contiguous on both sides: a piece per token
                    segs = [Segment(t, r, s, so, do, n * unit, T, sts, dts)]
                else:  # a piece per (head, token)
                    segs = [Segment(t, r, s, so + j * shs, do + j * dhs, unit, T, sts, dts) for j in range(n)]
                for g in segs:
                    if g.count > 1 and g.src_stride == g.dst_stride == g.length:
                        g = Segment(t, r, s, g.src_offset, g.dst_offset, g.length * g.count)
                    elif g.count == 1:
                        g = Segment(t, r, s, g.src_offset, g.dst_offset, g.length)
                    out.append(g)
                h = stop
    return out


def _kv_apart(layout: KVLayout, builder: str) -> None:
    if layout.mla or layout.scales or layout.kv_fused:
        raise LayoutError(f"{builder} expects a K+V cache without scale tensors, K and V apart (fused: CacheSpec.vllm)")


BUFFER_ORDERS = ("layer", "block")  # pdkv's buffer: layer-outermost (the default) or block-outermost


class CacheSpec:
    """Where each (layer, tensor, block) of one rank lives: a base pointer and a block
    stride per layer and tensor. Describes an engine's GPU cache and pdkv's CPU buffer
    alike, so copies between them are address arithmetic.

    Parameters
    ----------
    layout:
        The rank's layout.
    num_blocks:
        Blocks in each tensor.
    regions:
        ``regions[layer][tensor] = (base, block_stride)``; the stride is at least the
        tensor's block bytes.

    Ownership: a spec holds addresses only; whoever allocated the memory frees it.
    """

    __slots__ = ("layout", "num_blocks", "_bases", "_strides", "device", "_arrays")

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        regions: Sequence[Sequence[tuple[int, int]]],
        *,
        device: int | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise LayoutError(f"num_blocks={num_blocks!r} must be a positive integer")
        nt = len(layout.tensors)
        if len(regions) != layout.total_layers:
            raise LayoutError(f"regions has {len(regions)} layers; the layout has {layout.total_layers}")
        bases: list[list[int]] = []
        strides: list[list[int]] = []
        for li, layer in enumerate(regions):
            if len(layer) != nt:
                raise LayoutError(f"layer {li} has {len(layer)} tensors; the layout has {nt} {layout.tensors}")
            bl, sl = [], []
            for ti, (base, stride) in enumerate(layer):
                need = layout.block_span(ti)
                if not isinstance(base, int) or base <= 0:
                    raise LayoutError(
                        f"layer {li} tensor {layout.tensors[ti]}: base pointer {base!r} is not a valid address"
                    )
                if stride < need:
                    raise LayoutError(
                        f"layer {li} tensor {layout.tensors[ti]}: block stride "
                        f"{stride} is smaller than the block's {need} bytes"
                    )
                bl.append(base)
                sl.append(stride)
            bases.append(bl)
            strides.append(sl)
        self.layout = layout
        self.num_blocks = num_blocks
        self._bases = bases
        self._strides = strides
        self.device = device
        self._arrays: tuple[Any, Any] | None = None

    def address(self, layer: int, tensor: int | str, block: int) -> int:
        """Byte address of ``block`` of ``tensor`` in ``layer``."""
        t = self.layout.tensor_index(tensor)
        if not 0 <= layer < self.layout.total_layers:
            raise LayoutError(f"layer {layer} out of range [0, {self.layout.total_layers})")
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"block {block} out of range [0, {self.num_blocks})")
        return self._bases[layer][t] + block * self._strides[layer][t]

    def region(self, layer: int, tensor: int) -> tuple[int, int]:
        """``(base, block_stride)`` of one layer's tensor."""
        return self._bases[layer][tensor], self._strides[layer][tensor]

    def region_ranges(self) -> list[tuple[int, int]]:
        """``(base, bytes)`` of every (layer, tensor) region, in layer then tensor order:
        what a transport registers once to send from the whole cache. A fused layout has
        one region per layer (K's: V lies inside it)."""
        n = self.num_blocks
        nt = 1 if self.layout.kv_fused else len(self.layout.tensors)
        rows = zip(self._bases, self._strides)
        return [(b, st * n) for bases, strides in rows for b, st in zip(bases[:nt], strides[:nt])]

    @property
    def alignment(self) -> int:
        """The largest power of two, at most 4096, that divides every region's base and
        block stride: the alignment every block's address has. Host caches below 64 copy
        slower on some CPUs (see :func:`pdkv.aligned_empty`)."""
        a = 4096
        for bl, sl in zip(self._bases, self._strides):
            for v in (*bl, *sl):
                a = min(a, v & -v)
        return a

    def region_arrays(self) -> tuple[Any, Any]:
        """``(bases, strides)`` as int64 numpy arrays of shape ``[layers, tensors]`` (cached)."""
        if self._arrays is None:
            import numpy as np

            self._arrays = (np.array(self._bases, dtype=np.int64), np.array(self._strides, dtype=np.int64))
        return self._arrays

    # ------------------------------------------------------ builders
    @staticmethod
    def buffer_bytes(layout: KVLayout, num_blocks: int) -> int:
        """Bytes of a pdkv buffer of ``num_blocks`` blocks (one region per layer and tensor)."""
        return layout.block_bytes * num_blocks

    @classmethod
    def for_buffer(
        cls, layout: KVLayout, num_blocks: int, base: int, *, device: int | None = None, order: str = "layer"
    ) -> CacheSpec:
        """pdkv's buffer layout: one contiguous region per (layer, tensor), in that order;
        for a fused layout one region per layer of fused blocks (also usable for a GPU
        cache laid out the same way: pass ``device``). ``order="block"``: block-outermost
        instead (a block's layers and tensors side by side, ``layout.block_bytes`` a
        block: vLLM's BLHNC / BLNHC), so that a run of blocks is one contiguous piece;
        the same bytes in all (:meth:`buffer_bytes`)."""
        if order not in BUFFER_ORDERS:
            raise LayoutError(f"order={order!r} must be one of {', '.join(BUFFER_ORDERS)}")
        if order == "block":  # within a block: layer after layer, tensor after tensor (fused: side by side)
            nt, lb = len(layout.tensors), layout.layer_block_bytes
            at = [
                layout.tensor_offset(t) if layout.kv_fused else sum(map(layout.tensor_block_bytes, range(t)))
                for t in range(nt)
            ]
            rows = [
                [(base + li * lb + at[t], layout.block_bytes) for t in range(nt)] for li in range(layout.total_layers)
            ]
            return cls(layout, num_blocks, rows, device=device)
        regions, off = [], 0
        for _ in range(layout.total_layers):
            if layout.kv_fused:
                span = layout.layer_block_bytes
                regions.append([(base + off + layout.tensor_offset(t), span) for t in range(len(layout.tensors))])
                off += span * num_blocks
                continue
            row = []
            for t in range(len(layout.tensors)):
                tb = layout.tensor_block_bytes(t)
                row.append((base + off, tb))
                off += tb * num_blocks
            regions.append(row)
        return cls(layout, num_blocks, regions, device=device)

    @classmethod
    def vllm(
        cls, layout: KVLayout, num_blocks: int, layers: Sequence[tuple[int, int]], *, device: int | None = None
    ) -> CacheSpec:
        """vLLM's fused cache (0.32+): ``(base pointer, block stride in bytes)`` of each
        layer's view; the stride is ``layers x`` the fused block for a cross-layer order
        (BLHNC), the fused block for a layer-compact one (LBHNC, LBNHC)."""
        if not layout.kv_fused:
            raise LayoutError("CacheSpec.vllm describes a fused K/V cache: give the layout kv_fused='row' or 'head'")
        return cls(
            layout,
            num_blocks,
            [[(p, st), (p + layout.tensor_offset(1), st)] for p, st in layers],
            device=device,
        )

    @classmethod
    def fastdeploy(
        cls, layout: KVLayout, num_blocks: int, tensor_ptrs: Sequence[Sequence[int]], *, device: int | None = None
    ) -> CacheSpec:
        """Separate tensors per layer, ``[blocks, heads, tokens, dim]``: ``tensor_ptrs[layer][tensor]``."""
        if layout.token_major:
            raise LayoutError("FastDeploy caches are head-major: use token_major=False")
        return cls(
            layout,
            num_blocks,
            [[(p, layout.tensor_block_bytes(t)) for t, p in enumerate(row)] for row in tensor_ptrs],
            device=device,
        )

    @classmethod
    def vllm_flash_attn(
        cls, layout: KVLayout, num_blocks: int, layer_ptrs: Sequence[int], *, device: int | None = None
    ) -> CacheSpec:
        """vLLM FlashAttention: one ``[2, blocks, tokens, heads, dim]`` tensor per layer."""
        _kv_apart(layout, "vllm_flash_attn")
        bb = layout.tensor_block_bytes(0)
        return cls(layout, num_blocks, [[(p, bb), (p + num_blocks * bb, bb)] for p in layer_ptrs], device=device)

    @classmethod
    def flashinfer(
        cls, layout: KVLayout, num_blocks: int, layer_ptrs: Sequence[int], *, device: int | None = None
    ) -> CacheSpec:
        """vLLM FlashInfer: one ``[blocks, 2, ...]`` tensor per layer; K and V side by side."""
        _kv_apart(layout, "flashinfer")
        bb = layout.tensor_block_bytes(0)
        return cls(layout, num_blocks, [[(p, 2 * bb), (p + bb, 2 * bb)] for p in layer_ptrs], device=device)
