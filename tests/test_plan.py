"""The planner (pdkv.plan), once for every data path: runs against a naive model, cuts,
coalescing, the bounds check, and every layer plan inside its regions, covering each
granted byte exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdkv import CacheSpec, KVLayout, tp_segments
from pdkv.errors import TransferError
from pdkv.plan import (
    check_within,
    coalesce,
    layer_pieces,
    plan_layer,
    run_lengths,
    run_starts,
    runs_of,
    split_runs,
)

ids = st.lists(st.integers(0, 40), max_size=40)


def _naive_breaks(a, b=None):
    return [i for i in range(len(a)) if i == 0 or a[i] != a[i - 1] + 1 or (b is not None and b[i] != b[i - 1] + 1)]


@given(ids, ids)
def test_run_starts_breaks_where_either_sequence_stops_advancing(a, b):
    b = (b + a)[: len(a)]
    starts, lens = run_starts(np.asarray(a), np.asarray(b))
    assert starts.tolist() == _naive_breaks(a, b)
    assert int(lens.sum()) == len(a) and all(n >= 1 for n in lens.tolist())
    one, _ = run_starts(np.asarray(a))
    assert one.tolist() == _naive_breaks(a)
    assert [(a[s], a[s] + n) for s, n in zip(*(x.tolist() for x in run_starts(np.asarray(a))))] == runs_of(a)


@given(ids)
def test_run_lengths_count_consecutive_ids_from_each_index(a):
    want = []
    for i in range(len(a)):
        k = 1
        while i + k < len(a) and a[i + k] == a[i + k - 1] + 1:
            k += 1
        want.append(k)
    assert run_lengths(a) == want


@given(st.lists(st.integers(0, 50), max_size=20), st.integers(1, 9))
def test_split_runs_cuts_every_run_into_pieces_of_at_most_most(lengths, most):
    idx, off, ln = split_runs(np.asarray(lengths, np.int64), most)
    got = [(i, o, n) for i, o, n in zip(idx.tolist(), off.tolist(), ln.tolist())]
    want = [(i, o, min(most, n - o)) for i, n in enumerate(lengths) for o in range(0, n, most)]
    assert got == want
    with pytest.raises(ValueError, match=r"^split_runs: most=0 must be >= 1$"):
        split_runs(np.asarray([1]), 0)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 6)), max_size=12), st.integers(1, 10))
def test_coalesce_merges_pieces_contiguous_on_both_sides_and_cuts_to_max(steps, cap):
    local, remote, lengths = [], [], []
    la = ra = 1000
    for gap_l, gap_r, n in steps:
        la, ra = la + gap_l, ra + gap_r
        local.append(la)
        remote.append(ra)
        lengths.append(n)
        la, ra = la + n, ra + n
    out = coalesce(local, remote, lengths, cap)
    assert all(0 < n <= cap for _, _, n in out)

    def bytes_of(ps):  # every (local byte -> remote byte) pair, in order
        return [(a + k, b + k) for a, b, n in ps for k in range(n)]

    assert bytes_of(out) == bytes_of(zip(local, remote, lengths))
    assert len(out) <= sum(-(-n // cap) for n in lengths)  # never more pieces than cutting alone makes
    if cap >= sum(lengths) and all(gl == gr == 0 for gl, gr, _ in steps):
        assert len(out) <= 1  # one contiguous stretch that fits: one piece


def test_check_within_names_the_piece_outside():
    check_within([100, 150], [50, 50], 100, 100, "x")
    for addrs, lens in (([99], [1]), ([150], [51]), ([120], [0]), ([120], [-4])):
        with pytest.raises(TransferError, match=r"x: piece \[0x[0-9a-f]+, \+-?\d+\) falls outside \[0x64, \+100\)"):
            check_within(addrs, lens, 100, 100, "x")


@settings(max_examples=80, deadline=None)
@given(P=st.sampled_from([1, 2, 4]), D=st.sampled_from([1, 2, 4]), nhd=st.booleans(), data=st.data())
def test_every_layer_plan_stays_in_its_regions_and_covers_each_byte_once(P, D, nhd, data):
    nb = 16
    kw = dict(num_layers=3, kv_heads=4, head_dim=16, tokens_per_block=4, token_major=nhd)
    src_lay = KVLayout(**kw, tp_size=P, tp_rank=data.draw(st.integers(0, P - 1)))
    dst_lays = [KVLayout(**kw, tp_size=D, tp_rank=r) for r in range(D)]
    src = CacheSpec.for_buffer(src_lay, nb, 1 << 20)
    dsts = {r: CacheSpec.for_buffer(lay, nb, (r + 2) << 24) for r, lay in enumerate(dst_lays)}
    segs = [g for g in tp_segments(src_lay, dst_lays[0]) if g.src_rank == src_lay.tp_rank]
    n = data.draw(st.integers(1, nb))
    sb = np.asarray(data.draw(st.lists(st.integers(0, nb - 1), min_size=n, max_size=n)), np.int64)
    db = np.asarray(data.draw(st.permutations(range(nb)))[:n], np.int64)
    layer = data.draw(st.integers(0, 2))
    pieces, total = layer_pieces(segs, src_lay, dst_lays[0], src, dsts, sb, db, layer)
    assert total == sum(g.nbytes for g in segs) * n
    spans = []
    for seg, s, d, ln in pieces:
        sbase, sstride = src.region(layer, seg.tensor)
        dbase, dstride = dsts[seg.dst_rank].region(layer, seg.tensor)
        check_within(s, ln, sbase, sstride * nb, "source")
        check_within(d, ln, dbase, dstride * nb, "destination")
        spans += zip(d.tolist(), (d + ln).tolist())
    spans.sort()
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:])), "a destination byte written twice"
    assert sum(e - s for s, e in spans) == total
    groups = plan_layer(segs, src_lay, dst_lays[0], src, None, sb, db, layer)  # tcp: offsets into packed buffers
    for grp in groups:
        assert int(grp.nb.sum()) == n and (grp.dst >= 0).all()


# ---- the small cutting functions against plain loops (the transports' frames and items)

from pdkv import plan as _plan  # noqa: E402


def _frames_ref(nb, unit, cap, most):
    out, lo, size = [], 0, 0
    for i, b in enumerate(nb):
        if i > lo and (i - lo == most or size + b * unit > cap):
            out.append((lo, i))
            lo, size = i, 0
        size += b * unit
    return out + ([(lo, len(nb))] if len(nb) else [])


@given(st.lists(st.integers(1, 40), max_size=60), st.integers(1, 64), st.integers(1, 4096), st.integers(1, 70),
       st.booleans())  # fmt: skip
@example([2, 1], 2, 6, 10, False)  # two items filling cap exactly: one frame
@example([2, 1, 1], 2, 7, 10, False)  # the third item passes cap only counted with both before it
@example([4, 3, 3], 1, 6, 10, False)  # after a cut the next frame counts from zero
@example([2] * 7, 1, 10**6, 3, False)  # a frame every 3 items, not only the first
@example([2, 2, 2], 1, 3, 10, False)  # blocks of two are not the single-block fast path
def test_tcp_frames_is_the_greedy_cut(nb, unit, cap, most, ones):
    if ones:
        nb = [1] * len(nb)  # the fast path for single blocks
    got = _plan.tcp_frames(np.asarray(nb, np.int64), unit, cap, most)
    assert got == _frames_ref(nb, unit, cap, most)
    # every frame: at most `most` items, and over `cap` only when it is one item
    for lo, hi in got:
        assert 1 <= hi - lo <= most and (hi - lo == 1 or sum(nb[lo:hi]) * unit <= cap)


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 50)), max_size=30), st.integers(1, 64),
       st.integers(1, 2048))  # fmt: skip
def test_tcp_items_cuts_long_runs_and_keeps_the_rest(items, unit, cap):
    gi = np.asarray([g for g, _ in items], np.int64)
    nb = np.asarray([n for _, n in items], np.int64)
    src = gi * 7919 + 10**6
    most = max(1, cap // unit)
    want = [(g + k, min(most, n - k), s + k * unit) for g, n, s in zip(gi.tolist(), nb.tolist(), src.tolist())
            for k in range(0, n, most)]  # fmt: skip
    g2, n2, s2 = _plan.tcp_items(gi, nb, src, unit, cap)
    assert list(zip(g2.tolist(), n2.tolist(), s2.tolist())) == want


@given(st.lists(st.integers(0, 20), max_size=30))
def test_runs_of_against_a_loop(ids):
    runs = []
    for b in ids:
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    assert _plan.runs_of(ids) == [tuple(r) for r in runs] and _plan.runs_of(tuple(ids)) == [tuple(r) for r in runs]


def test_the_run_finders_on_nothing():
    starts, lens = _plan.run_starts(np.asarray([], np.int64))
    assert starts.size == lens.size == 0 and _plan.run_lengths([]) == [] and _plan.runs_of([]) == []


# ---- plan_copy and CopyPlan.chunked, executed on real memory against a block-by-block copy

from pdkv.errors import SwapError  # noqa: E402


def _run_plan(p, src_mem, dst_mem):
    sbase, dbase = src_mem.ctypes.data, dst_mem.ctypes.data
    for s, d, n in zip(p.src.tolist(), p.dst.tolist(), p.lengths.tolist()):
        dst_mem[d - dbase : d - dbase + n] = src_mem[s - sbase : s - sbase + n]


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    fused=st.booleans(),
    tm=st.booleans(),
    side_by_side=st.booleans(),
    orders=st.sampled_from([("layer", "layer"), ("block", "block"), ("layer", "block"), ("block", "layer")]),
)
def test_plan_copy_moves_each_block_of_each_layer_and_nothing_else(data, fused, tm, side_by_side, orders):
    """Layer-outermost and block-outermost caches on either side: the same bytes land as a
    block-by-block copy; block-outermost on both sides for every layer is one piece per run
    of blocks consecutive on both sides, every layer complete with the last piece."""
    lay = KVLayout(num_layers=3, kv_heads=2, head_dim=4, tokens_per_block=2, dtype="bf16", token_major=tm,
                   kv_fused="row" if fused else "")  # fmt: skip
    nb = 12
    size = lay.block_bytes * nb * lay.total_layers
    src_mem = np.random.default_rng(data.draw(st.integers(0, 99))).integers(0, 256, size, dtype=np.uint8)
    dst_mem = np.zeros(size, np.uint8)
    src = CacheSpec.for_buffer(lay, nb, src_mem.ctypes.data, order=orders[0])
    if side_by_side and not fused:  # K and V of a block side by side: strides of two blocks, no runs
        lb = lay.block_bytes * nb
        dst = CacheSpec.flashinfer(lay, nb, [dst_mem.ctypes.data + li * lb for li in range(lay.total_layers)])
    else:
        dst = CacheSpec.for_buffer(lay, nb, dst_mem.ctypes.data, order=orders[1])
    dst_blocks = data.draw(st.permutations(range(nb)))[: data.draw(st.integers(0, nb))]
    src_blocks = [data.draw(st.integers(0, nb - 1)) for _ in dst_blocks]
    layers = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 2), unique=True)))
    p = _plan.plan_copy(src, dst, src_blocks, dst_blocks, layers)
    _run_plan(p, src_mem, dst_mem)
    want = np.zeros(size, np.uint8)
    units = [(0, lay.layer_block_bytes)] if fused else [(t, lay.tensor_block_bytes(t)) for t in range(2)]
    for li in range(3) if layers is None else layers:
        for sb, db in zip(src_blocks, dst_blocks):
            for t, n in units:
                s, d = src.address(li, t, sb) - src_mem.ctypes.data, dst.address(li, t, db) - dst_mem.ctypes.data
                want[d : d + n] = src_mem[s : s + n]
    assert np.array_equal(dst_mem, want)
    nl = 3 if layers is None else len(layers)
    per_layer = len(units) * len(dst_blocks)
    assert p.nbytes == int(p.lengths.sum()) == nl * per_layer * lay.layer_block_bytes // len(units)
    assert len(p.layer_ends) == nl and (not nl or int(p.layer_ends[-1]) == p.pieces)
    assert all(a <= b for a, b in zip(p.layer_ends[:-1].tolist(), p.layer_ends[1:].tolist()))
    whole = orders == ("block", "block") and layers is None and not (side_by_side and not fused)
    if whole and dst_blocks:
        runs = 1 + sum(1 for i in range(1, len(dst_blocks))
                       if (src_blocks[i], dst_blocks[i]) != (src_blocks[i - 1] + 1, dst_blocks[i - 1] + 1))  # fmt: skip
        assert p.pieces == runs and p.layer_ends.tolist() == [runs] * 3
        assert all(n % lay.block_bytes == 0 for n in p.lengths.tolist())
    # cut into pieces of at most 24 bytes: the same bytes land, each layer's pieces still its own
    c = p.chunked(24)
    assert int(c.lengths.max(initial=0)) <= 24 and c.nbytes == p.nbytes and int(c.lengths.sum()) == p.nbytes
    assert len(c.layer_ends) == nl and (not nl or int(c.layer_ends[-1]) == c.pieces)
    dst_mem[:] = 0
    _run_plan(c, src_mem, dst_mem)
    assert np.array_equal(dst_mem, want)
    assert p.chunked(1 << 20) is p  # nothing to cut: the plan itself


def test_plan_copy_refusals_name_the_problem():
    lay = KVLayout(num_layers=2, kv_heads=1, head_dim=8, tokens_per_block=4, dtype="bf16")
    a, b = CacheSpec.for_buffer(lay, 4, 1 << 20), CacheSpec.for_buffer(lay, 6, 1 << 24)
    other = CacheSpec.for_buffer(KVLayout(num_layers=2, kv_heads=1, head_dim=8, tokens_per_block=4, dtype="bf16",
                                          token_major=True), 4, 1 << 28)  # fmt: skip
    cases = [
        ((a, other, [0], [0]), "source and destination caches have different layouts"),
        ((a, b, [0, 1], [0]), "2 source blocks but 1 destination blocks"),
        ((a, b, [0, 4, -1], [0, 1, 2]), "source block ids [4, -1] out of range [0, 4)"),
        ((a, b, [0, 1], [6, 5]), "destination block ids [6] out of range [0, 6)"),
        ((a, b, [0, 1, 2], [3, 1, 3]), "duplicate destination block ids (two copies would race into one block)"),
    ]
    for args, msg in cases:
        with pytest.raises(SwapError) as e:
            _plan.plan_copy(*args)
        assert str(e.value) == msg
    with pytest.raises(SwapError) as e:
        _plan.plan_copy(a, b, [0], [0], layers=[1, 2, -1])
    assert str(e.value) == "layers [1, 2, -1] out of range [0, 2)"
    empty = _plan.plan_copy(a, b, [], [], layers=[1])
    assert (empty.pieces, empty.nbytes, empty.layer_ends.tolist()) == (0, 0, [0])
    assert _plan.plan_copy(a, b, [2], [5]).layer_ends.tolist() == [2, 4]  # K and V a layer


@settings(max_examples=80, deadline=None)
@given(P=st.sampled_from([1, 2, 4]), D=st.sampled_from([1, 2, 4]), nhd=st.booleans(), data=st.data())
def test_layer_pieces_put_each_head_of_each_block_where_its_decode_rank_holds_it(P, D, nhd, data):
    # head h of source block sb[i] must land as head h of destination block db[i] in the decode
    # rank that holds h, for every token and both tensors, in the planned layer only
    H, N, Dm, L, nb = 4, 4, 8, 3, 6  # heads, tokens, head_dim (bf16: 16 bytes a row), layers, blocks
    kw = dict(num_layers=L, kv_heads=H, head_dim=Dm, tokens_per_block=N, token_major=nhd, dtype="bf16")
    rank = data.draw(st.integers(0, P - 1))
    src_lay = KVLayout(**kw, tp_size=P, tp_rank=rank)
    dst_lays = [KVLayout(**kw, tp_size=D, tp_rank=r) for r in range(D)]
    hs, hd = H // P, H // D

    def mem(heads):
        return np.zeros(L * 2 * nb * heads * N * Dm * 2, np.uint8)

    src_mem = np.random.default_rng(data.draw(st.integers(0, 9))).integers(1, 256, mem(hs).size, dtype=np.uint8)
    dst_mems = [mem(hd) for _ in range(D)]
    src = CacheSpec.for_buffer(src_lay, nb, src_mem.ctypes.data)
    dsts = {r: CacheSpec.for_buffer(dst_lays[r], nb, m.ctypes.data) for r, m in enumerate(dst_mems)}
    segs = [g for g in tp_segments(src_lay, dst_lays[0]) if g.src_rank == rank]
    n = data.draw(st.integers(1, nb))
    sb = np.asarray(data.draw(st.lists(st.integers(0, nb - 1), min_size=n, max_size=n)), np.int64)
    db = np.asarray(data.draw(st.permutations(range(nb)))[:n], np.int64)
    layer = data.draw(st.integers(0, L - 1))
    pieces, total = layer_pieces(segs, src_lay, dst_lays[0], src, dsts, sb, db, layer)
    for seg, s, d, ln in pieces:
        base, sbase = dst_mems[seg.dst_rank].ctypes.data, src_mem.ctypes.data
        for a, b, k in zip(s.tolist(), d.tolist(), ln.tolist()):
            dst_mems[seg.dst_rank][b - base : b - base + k] = src_mem[a - sbase : a - sbase + k]

    def view(m, heads):  # [layer, tensor, block, head, token, row bytes]
        v = m.reshape(L, 2, nb, *((N, heads) if nhd else (heads, N)), Dm * 2)
        return v.transpose(0, 1, 2, 4, 3, 5) if nhd else v

    sv = view(src_mem, hs)
    moved = 0
    for r in range(D):
        want = np.zeros_like(view(dst_mems[r], hd))
        for h in range(max(r * hd, rank * hs), min((r + 1) * hd, (rank + 1) * hs)):  # heads both ranks hold
            want[layer, :, db, h - r * hd] = sv[layer, :, sb, h - rank * hs]
            moved += 2 * n * N * Dm * 2
        assert np.array_equal(view(dst_mems[r], hd), want), r
    assert total == moved


def test_check_within_names_the_first_piece_outside_past_pieces_at_the_edges():
    # at the base, ending at the end, a whole half: inside; then the one outside is named
    with pytest.raises(TransferError) as e:
        check_within([100, 199, 150, 99], [1, 1, 50, 1], 100, 100, "x")
    assert str(e.value) == "x: piece [0x63, +1) falls outside [0x64, +100)"
    with pytest.raises(TransferError) as e:
        check_within(np.asarray([100, 120], np.int32), np.asarray([1, 0], np.int32), 100, 100, "y")
    assert str(e.value) == "y: piece [0x78, +0) falls outside [0x64, +100)"


def test_coalesce_merges_up_to_exactly_max_bytes():
    assert coalesce([0, 4], [100, 104], [4, 4], 8) == [(0, 100, 8)]
    assert coalesce([0, 4, 8], [100, 104, 108], [4, 4, 1], 8) == [(0, 100, 8), (8, 108, 1)]
    with pytest.raises(ValueError) as e:
        coalesce([0], [0], [1], 0)
    assert str(e.value) == "coalesce: max_bytes=0 must be >= 1"


def test_copy_plan_of_pieces_and_plans_of_nothing():
    seg = object()
    p = _plan.CopyPlan.of_pieces(
        [(seg, np.asarray([10, 20]), np.asarray([110, 120]), np.asarray([4, 5])), (seg, np.asarray([30]),
         np.asarray([130]), np.asarray([6]))]
    )  # fmt: skip
    assert (p.src.tolist(), p.dst.tolist(), p.lengths.tolist()) == ([10, 20, 30], [110, 120, 130], [4, 5, 6])
    assert p.src.dtype == p.dst.dtype == p.lengths.dtype == np.uint64
    assert (p.layer_ends.tolist(), p.nbytes, p.pieces) == ([3], 15, 3) and p.layer_ends.dtype == np.int64
    lay = KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4)
    segs = tp_segments(lay, lay)
    spec = CacheSpec.for_buffer(lay, 4, 1 << 20)
    empty = np.zeros(0, np.int64)
    for g in _plan.plan_layer(segs, lay, lay, spec, None, empty, empty, 1):  # nothing to send: empty groups
        assert g.gi.size == g.nb.size == g.src.size == g.dst.size == 0 and g.gi.dtype == np.int64
    starts, lens = run_starts(empty)
    assert starts.dtype == lens.dtype == np.int64


def test_plan_copy_takes_numpy_ids_of_any_integer_type():
    lay = KVLayout(num_layers=1, kv_heads=1, head_dim=8, tokens_per_block=4, dtype="bf16")
    a, b = CacheSpec.for_buffer(lay, 4, 1 << 20), CacheSpec.for_buffer(lay, 4, 1 << 24)
    p = _plan.plan_copy(a, b, np.asarray([0, 1], np.int32), np.asarray([[2, 3]], np.uint16))
    assert p.src.tolist() == [a.address(0, 0, 0), a.address(0, 1, 0)]
    assert p.dst.tolist() == [b.address(0, 0, 2), b.address(0, 1, 2)] and p.lengths.tolist() == [128, 128]
    with pytest.raises(SwapError) as e:
        _plan.plan_copy(a, b, np.asarray([0, 1], np.int32), np.asarray([3, 3], np.int32))
    assert str(e.value) == "duplicate destination block ids (two copies would race into one block)"
    with pytest.raises(SwapError) as e:
        _plan.plan_copy(a, b, list(range(5, 15)), list(range(10)))
    assert str(e.value) == "source block ids [5, 6, 7, 8, 9, 10, 11, 12] out of range [0, 4)"  # the first 8
