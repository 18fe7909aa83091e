"""Copy planning: where every byte of a KV transfer comes from and goes to.

One module for the arithmetic every data path shares: runs of blocks consecutive on both
sides, runs cut to a size, the ``(src, dst, length)`` pieces of one layer for a transport
(:func:`plan_layer`, :func:`layer_pieces`), the swap engine's whole-cache copy plan
(:func:`plan_copy`), the tcp frame cuts, the coalescing of one-sided writes, and the bounds
checks that keep a raw-address copy inside its regions. Pure numpy; nothing here touches
memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import SwapError, TransferError
from .layout import CacheSpec, KVLayout, Segment

__all__ = [
    "runs_of",
    "run_starts",
    "run_lengths",
    "split_runs",
    "CopyPlan",
    "plan_copy",
    "Group",
    "plan_layer",
    "layer_pieces",
    "tcp_items",
    "tcp_frames",
    "coalesce",
    "check_within",
    "COPY_CHUNK",
]

COPY_CHUNK = 64 << 10  # bytes one swap-kernel CTA copies: what CopyPlan.chunked cuts to by default

Ids = Any  # an int64 numpy array of ids, addresses or lengths


def runs_of(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """Split ids into maximal ``(start, stop)`` runs of consecutive ids, in the given order."""
    n = len(blocks)
    if n == 0:
        return []
    first = blocks[0]
    if blocks[-1] - first == n - 1:
        seq = blocks if type(blocks) is list else list(blocks)
        if seq == list(range(first, first + n)):
            return [(first, first + n)]
    out = []
    start = prev = blocks[0]
    for b in blocks[1:]:
        if b != prev + 1:
            out.append((start, prev + 1))
            start = b
        prev = b
    out.append((start, prev + 1))
    return out


def run_starts(sb: Ids, db: Ids | None = None) -> tuple[Ids, Ids]:
    """Start indices and lengths of the maximal runs where ``sb`` (and ``db``, if given)
    advance by one at every step."""
    sb = np.asarray(sb, dtype=np.int64)
    if sb.size == 0:
        z = np.zeros(0, np.int64)
        return z, z
    brk = np.empty(sb.size, dtype=bool)
    brk[0] = True
    np.not_equal(np.diff(sb), 1, out=brk[1:])
    if db is not None:
        brk[1:] |= np.diff(np.asarray(db, dtype=np.int64)) != 1
    starts = np.flatnonzero(brk)
    return starts, np.diff(np.append(starts, sb.size))


def run_lengths(blocks: Sequence[int]) -> list[int]:
    """``r[i]`` = how many ids from index ``i`` on advance by one (``r[i] >= 1``)."""
    starts, lens = run_starts(np.asarray(blocks, dtype=np.int64))
    if not starts.size:
        return []
    # within a run starting at s of length n, index s + k has n - k ids left
    ends = np.repeat(starts + lens, lens)
    return (ends - np.arange(ends.size)).tolist()  # type: ignore[no-any-return]


def split_runs(lengths: Ids, most: int) -> tuple[Ids, Ids, Ids]:
    """Every run of ``lengths[i]`` units cut into runs of at most ``most``, in order: for each
    cut, ``(i, offset into run i, length)`` as int64 arrays. Callers move their own starts
    (bytes, block indices) by the offsets."""
    if most < 1:
        raise ValueError(f"split_runs: most={most} must be >= 1")
    ln = np.asarray(lengths, dtype=np.int64)
    n = (ln + most - 1) // most
    idx = np.repeat(np.arange(ln.size), n)
    off = (np.arange(idx.size, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)) * most
    return idx, off, np.minimum(ln[idx] - off, most)


# ---------------------------------------------------------------------- swap plans


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Coalesced pieces of one copy: ``src[i] -> dst[i]``, ``lengths[i]`` bytes;
    ``layer_ends[l]`` is the end index of layer ``l``'s pieces (pieces are in layer order)."""

    src: Ids
    dst: Ids
    lengths: Ids
    layer_ends: Ids
    nbytes: int

    @property
    def pieces(self) -> int:
        return int(self.lengths.size)

    def chunked(self, chunk: int = COPY_CHUNK) -> CopyPlan:
        """The same copy with every piece split into pieces of at most ``chunk`` bytes."""
        ln = self.lengths.astype(np.int64)
        if ln.size == 0 or int(ln.max()) <= chunk:
            return self
        idx, off, lens = split_runs(ln, chunk)
        n = (ln + chunk - 1) // chunk
        ends = np.cumsum(n)[self.layer_ends - 1] if self.layer_ends.size else self.layer_ends
        ends = np.where(self.layer_ends == 0, 0, ends)
        return CopyPlan(
            self.src[idx] + off.astype(np.uint64),
            self.dst[idx] + off.astype(np.uint64),
            lens.astype(np.uint64),
            ends.astype(np.int64),
            self.nbytes,
        )

    @staticmethod
    def of_pieces(pieces: Sequence[tuple[Segment, Ids, Ids, Ids]]) -> CopyPlan:
        """One layer's :func:`layer_pieces` as a single-layer plan."""
        src = np.concatenate([p[1] for p in pieces]).astype(np.uint64)
        ln = np.concatenate([p[3] for p in pieces]).astype(np.uint64)
        return CopyPlan(
            src,
            np.concatenate([p[2] for p in pieces]).astype(np.uint64),
            ln,
            np.asarray([src.size], np.int64),
            int(ln.sum()),
        )


def _as_ids(x: Sequence[int] | Ids) -> Ids:
    if isinstance(x, np.ndarray):
        return x.astype(np.int64, copy=False).reshape(-1)
    return np.fromiter(x, dtype=np.int64, count=len(x))


def _check_blocks(name: str, blocks: Ids, limit: int) -> None:
    if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= limit):
        bad = blocks[(blocks < 0) | (blocks >= limit)]
        raise SwapError(f"{name} block ids {bad[:8].tolist()} out of range [0, {limit})")


def plan_copy(
    src: CacheSpec,
    dst: CacheSpec,
    src_blocks: Sequence[int] | Ids,
    dst_blocks: Sequence[int] | Ids,
    layers: Sequence[int] | None = None,
) -> CopyPlan:
    """Plan copying ``src_blocks[i]`` of ``src`` into ``dst_blocks[i]`` of ``dst`` for every
    layer (or ``layers``) and tensor. Runs contiguous in both memories become one piece.

    Raises
    ------
    SwapError
        Different layouts, mismatched lengths, ids out of range, duplicate destinations.
    """
    if (
        src.layout.block_bytes != dst.layout.block_bytes
        or src.layout.tensors != dst.layout.tensors
        or src.layout.kv_fused != dst.layout.kv_fused
        or src.layout.token_major != dst.layout.token_major
    ):
        raise SwapError("source and destination caches have different layouts")
    sb, db = _as_ids(src_blocks), _as_ids(dst_blocks)
    if sb.size != db.size:
        raise SwapError(f"{sb.size} source blocks but {db.size} destination blocks")
    _check_blocks("source", sb, src.num_blocks)
    _check_blocks("destination", db, dst.num_blocks)
    if db.size > 1 and np.bincount(db, minlength=1).max() > 1:
        raise SwapError("duplicate destination block ids (two copies would race into one block)")
    lay = src.layout
    L = None if layers is None else np.asarray(list(layers), dtype=np.int64)
    if L is not None and L.size and (L.min() < 0 or L.max() >= lay.total_layers):
        raise SwapError(f"layers {L.tolist()[:8]} out of range [0, {lay.total_layers})")
    nl = lay.total_layers if L is None else L.size
    # the copy units of a block: each tensor's block, or a fused layout's whole block
    # (K's address, K and V together)
    nt = 1 if lay.kv_fused else len(lay.tensors)
    tb = np.array([lay.block_span(t) for t in range(nt)], dtype=np.int64)
    sbase, sstr = src.region_arrays()
    dbase, dstr = dst.region_arrays()
    sbase, sstr, dbase, dstr = sbase[:, :nt], sstr[:, :nt], dbase[:, :nt], dstr[:, :nt]
    if L is not None:
        sbase, sstr, dbase, dstr = sbase[L], sstr[L], dbase[L], dstr[L]
    if sb.size == 0:
        z = np.zeros(0, np.uint64)
        return CopyPlan(z, z, z, np.zeros(nl, np.int64), 0)
    whole = _block_outer(sbase, sstr, tb) if L is None else None
    dwhole = _block_outer(dbase, dstr, tb) if whole is not None else None
    if whole is not None and dwhole is not None:
        # block-outermost on both sides: a block's layers and tensors are one contiguous
        # piece, and a run of blocks consecutive on both sides one piece; every layer is
        # complete when the last piece is
        starts, run = run_starts(sb, db)
        span = int(tb.sum()) * nl
        sa = whole + span * sb[starts]
        da = dwhole + span * db[starts]
        lengths = (span * run).astype(np.uint64)
        ends = np.full(nl, starts.size, dtype=np.int64)
        return CopyPlan(sa.astype(np.uint64), da.astype(np.uint64), lengths, ends, int(lengths.sum()))
    # runs of consecutive ids on both sides; they are contiguous memory only where the
    # block stride equals the block's bytes (not for K/V-interleaved caches)
    if bool((sstr == tb).all() and (dstr == tb).all()):
        starts, run = run_starts(sb, db)
        s0, d0 = sb[starts], db[starts]
    else:
        s0, d0, run = sb, db, np.ones(sb.size, np.int64)
    # [layer, tensor, piece]
    sa = sbase[:, :, None] + sstr[:, :, None] * s0[None, None, :]
    da = dbase[:, :, None] + dstr[:, :, None] * d0[None, None, :]
    ln = np.broadcast_to(tb[None, :, None] * run[None, None, :], sa.shape)
    ends = np.arange(1, nl + 1, dtype=np.int64) * (nt * s0.size)
    lengths = ln.reshape(-1).astype(np.uint64)
    return CopyPlan(
        sa.reshape(-1).astype(np.uint64), da.reshape(-1).astype(np.uint64), lengths, ends, int(lengths.sum())
    )


def _block_outer(base: Ids, stride: Ids, tb: Ids) -> int | None:
    """The first block's address when a cache is block-outermost: every (layer, tensor)
    unit, in layer-then-tensor order, starts where the one before it ends, and every stride
    is the whole block (all units); None otherwise."""
    units = base.reshape(-1)
    spans = np.broadcast_to(tb[None, :], base.shape).reshape(-1)
    total = int(spans.sum())
    offsets = np.concatenate(([0], np.cumsum(spans)[:-1]))
    if not bool((stride.reshape(-1) == total).all()) or not bool((units == units[0] + offsets).all()):
        return None
    return int(units[0])


# ---------------------------------------------------------------------- transfer plans


@dataclass(frozen=True, slots=True)
class Group:
    """Writes of one segment for one layer: piece i covers grant blocks
    ``gi[i]..gi[i]+nb[i]`` starting at ``src[i]`` / ``dst[i]``; each block holds
    ``seg.count`` pieces of ``seg.length`` bytes (a run of whole blocks is one piece)."""

    seg: Segment
    gi: Ids
    nb: Ids
    src: Ids
    dst: Ids


def plan_layer(
    segs: Sequence[Segment],
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src: CacheSpec,
    dsts: dict[int, CacheSpec] | None,
    src_blocks: Sequence[int] | Ids,
    dst_blocks: Sequence[int] | Ids,
    layer: int,
    *,
    dst_packed: bool = True,
) -> list[Group]:
    """One :class:`Group` per segment: the pieces of ``layer`` from ``src_blocks`` of ``src``
    into ``dst_blocks`` of each segment's destination rank. Without ``dsts`` (tcp: decode
    computes the addresses) destinations are offsets into a buffer region, packed per layer
    and tensor unless ``dst_packed`` is false (a block-outermost buffer: a block's layers
    side by side, so consecutive blocks of one layer are not contiguous)."""
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    runs = None
    out = []
    for g in segs:
        sbase, sstride = src.region(layer, g.tensor)
        tb_s, tb_d = src_layout.tensor_block_bytes(g.tensor), dst_layout.tensor_block_bytes(g.tensor)
        if dsts is not None:
            dbase, dstride = dsts[g.dst_rank].region(layer, g.tensor)
        else:
            dbase, dstride = 0, dst_layout.block_span(g.tensor) if dst_packed else dst_layout.block_bytes
        # a run of blocks is one contiguous piece only if the segment is the whole block on
        # both sides and blocks are packed (stride == block bytes) on both sides
        whole = (
            g.count == 1
            and g.src_offset == 0
            and g.dst_offset == 0
            and g.length == tb_s == tb_d
            and sstride == tb_s
            and dstride == tb_d
        )
        if whole:
            if runs is None:
                runs = run_starts(sb, db)
            gi, nb = runs
        else:
            gi, nb = np.arange(sb.size), np.ones(sb.size, dtype=np.int64)
        out.append(Group(g, gi, nb, sbase + sb[gi] * sstride + g.src_offset, dbase + db[gi] * dstride + g.dst_offset))
    return out


def layer_pieces(
    segs: Sequence[Segment],
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src: CacheSpec,
    dsts: dict[int, CacheSpec],
    src_blocks: Ids,
    dst_blocks: Ids,
    layer: int,
) -> tuple[list[tuple[Segment, Ids, Ids, Ids]], int]:
    """Every write of ``layer`` as ``(segment, src, dst, lengths)`` address arrays (strided
    segments expanded to one piece per token), and the bytes they move."""
    total = 0
    plans = []
    for grp in plan_layer(segs, src_layout, dst_layout, src, dsts, src_blocks, dst_blocks, layer):
        seg = grp.seg
        if seg.count == 1:
            s, d, ln = grp.src, grp.dst, grp.nb * seg.length
        else:  # strided (token-major) pieces
            c = np.arange(seg.count, dtype=np.int64)
            s = (grp.src[:, None] + c * seg.src_stride).ravel()
            d = (grp.dst[:, None] + c * seg.dst_stride).ravel()
            ln = np.full(s.size, seg.length, dtype=np.int64)
        plans.append((seg, s, d, ln))
        total += int(ln.sum())
    return plans, total


def tcp_items(gi: Ids, nb: Ids, src: Ids, unit: int, cap: int) -> tuple[Ids, Ids, Ids]:
    """A group's items ``(first grant index, blocks, source address)`` with every run of more
    than ``cap // unit`` blocks cut into runs of at most that many (``unit``: bytes a block
    of the run carries; only whole packed blocks form runs, so a run's source is contiguous).
    Decode refuses a frame over its payload limit: one long run would make one."""
    most = max(1, cap // unit)
    if not nb.size or int(nb.max()) <= most:
        return gi, nb, src
    rep, at, nb2 = split_runs(nb, most)  # at: blocks into its item
    return gi[rep] + at, nb2, src[rep] + at * unit


def tcp_frames(nb: Ids, unit: int, cap: int, most: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` item ranges, one per frame, in order: at most ``most`` items, and no item
    added past the first once the payload (``nb[i] * unit`` bytes an item) would pass ``cap``."""
    n = int(nb.size)
    if n and int(nb.max()) == 1:
        step = max(1, min(most, cap // unit))
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    out, lo, size = [], 0, 0
    for i, b in enumerate((nb * unit).tolist()):
        if i > lo and (i - lo == most or size + b > cap):
            out.append((lo, i))
            lo, size = i, 0
        size += b
    if n:
        out.append((lo, n))
    return out


def coalesce(
    local: Sequence[int], remote: Sequence[int], lengths: Sequence[int], max_bytes: int
) -> list[tuple[int, int, int]]:
    """Pieces contiguous on both sides merged, then cut to at most ``max_bytes``:
    ``(local, remote, length)`` in order."""
    if max_bytes < 1:
        raise ValueError(f"coalesce: max_bytes={max_bytes} must be >= 1")
    merged: list[list[int]] = []
    for la, ra, n in zip(local, remote, lengths):
        cur = merged[-1] if merged else None
        if cur is not None and cur[0] + cur[2] == la and cur[1] + cur[2] == ra and cur[2] + n <= max_bytes:
            cur[2] += n
        else:
            merged.append([la, ra, n])
    out = []
    for la, ra, n in merged:
        for off in range(0, n, max_bytes):
            out.append((la + off, ra + off, min(max_bytes, n - off)))
    return out


def check_within(addrs: Ids, lengths: Ids, base: int, size: int, what: str) -> None:
    """TransferError unless every ``[addrs[i], addrs[i] + lengths[i])`` is a non-empty range
    inside ``[base, base + size)``: a copy through raw addresses must stay in its region."""
    a, n = np.asarray(addrs, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if n.size and (int(n.min()) <= 0 or int(a.min()) < base or int((a + n).max()) > base + size):
        bad = int(np.flatnonzero((n <= 0) | (a < base) | (a + n > base + size))[0])
        raise TransferError(f"{what}: piece [{int(a[bad]):#x}, +{int(n[bad])}) falls outside [{base:#x}, +{size})")
