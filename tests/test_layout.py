from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from pdkv import GIB, CacheSpec, KVLayout, LayoutError, LayoutMismatchError, tp_segments
from pdkv.layout import DTYPE_BITS


def llama8b(**kw):
    base = dict(num_layers=32, kv_heads=8, head_dim=128, tokens_per_block=64, dtype="bfloat16")
    base.update(kw)
    return KVLayout(**base)


def test_design_worked_example():
    lay = llama8b()
    assert lay.block_bytes == 8 << 20
    assert lay.blocks_for_gib(10) == 1280
    assert lay.tokens_for_blocks(1280) == 81920


def test_tp_divides_per_rank_bytes_and_instance_counts_all_ranks():
    lay = llama8b(tp_size=4)
    assert lay.block_bytes == (8 << 20) // 4
    assert lay.instance_block_bytes == 8 << 20
    # replicated heads: 8 heads on 16 ranks, each rank stores one head
    rep = llama8b(tp_size=16)
    assert rep.heads_per_rank == 1
    assert rep.instance_block_bytes == 16 * rep.block_bytes


def test_mla_is_key_only_and_scales_add_tensors():
    mla = KVLayout(num_layers=61, kv_heads=1, head_dim=576, tokens_per_block=64, dtype="bf16", mla=True, tp_size=8)
    assert mla.tensors == ("k",)
    assert mla.block_bytes == 61 * 64 * 576 * 2
    sc = llama8b(dtype="fp8", scales=True)
    assert sc.tensors == ("k", "v", "k_scale", "v_scale")
    assert sc.tensor_block_bytes("k") == 8 * 64 * 128
    assert sc.tensor_block_bytes("k_scale") == 8 * 64 * 2


def test_int4_packs_two_per_byte():
    lay = llama8b(dtype="int4")
    assert lay.tensor_block_bytes("k") == 8 * 64 * 64


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(kv_heads=-1), "kv_heads"),
        (dict(head_dim=1.5), "head_dim"),
        (dict(tokens_per_block=10**9), "tokens_per_block"),
        (dict(dtype="float64"), "dtype"),
        (dict(tp_size=3), "kv_heads=8 and tp_size=3"),
        (dict(tp_size=2, tp_rank=2), "tp_rank"),
        (dict(mla=True), "mla"),
        (dict(dtype="int4", head_dim=3), "whole number of bytes"),
        (dict(extra_layers=-1), "extra_layers"),
    ],
)
def test_bad_layouts_name_the_field(kw, field):
    with pytest.raises(LayoutError, match=field.split("=")[0]):
        llama8b(**kw)


def test_sizing_errors():
    lay = llama8b()
    for bad in (0, -5, 1.5):
        with pytest.raises(LayoutError, match="nbytes"):
            lay.blocks_for_bytes(bad)
    with pytest.raises(LayoutError):
        lay.blocks_for_gib(0)
    with pytest.raises(LayoutError):
        lay.blocks_for_tokens(-1)


layouts = st.builds(
    lambda nl, h_exp, hd, tpb, dt, sc, mla: KVLayout(
        num_layers=nl, kv_heads=1 if mla else 2**h_exp, head_dim=hd, tokens_per_block=tpb, dtype=dt, scales=sc, mla=mla
    ),
    st.integers(1, 80),
    st.integers(0, 6),
    st.sampled_from([64, 80, 128, 256, 576]),
    st.sampled_from([1, 16, 32, 64, 128, 256]),
    st.sampled_from(sorted(DTYPE_BITS)),
    st.booleans(),
    st.booleans(),
)


@given(layouts, st.integers(1, 1 << 42))
def test_sizing_round_trips(lay, nbytes):
    n = lay.blocks_for_bytes(nbytes)
    assert lay.bytes_for_blocks(n) <= nbytes < lay.bytes_for_blocks(n + 1)
    assert lay.blocks_for_tokens(lay.tokens_for_blocks(n)) == n


@given(layouts)
def test_descriptor_round_trips(lay):
    assert KVLayout.from_descriptor(lay.descriptor()) == lay


def test_descriptor_rejections_name_the_problem():
    d = llama8b().descriptor()
    with pytest.raises(LayoutMismatchError, match="version"):
        KVLayout.from_descriptor({**d, "version": 99})
    with pytest.raises(LayoutMismatchError, match="unknown fields"):
        KVLayout.from_descriptor({**d, "evil": 1})
    with pytest.raises(LayoutMismatchError, match="block_bytes"):
        KVLayout.from_descriptor({**d, "block_bytes": 1})
    with pytest.raises(LayoutMismatchError, match="format"):
        KVLayout.from_descriptor({"x": 1})
    with pytest.raises(LayoutMismatchError, match="head_dim is 128 here and 64"):
        llama8b().check_compatible(llama8b(head_dim=64))
    # TP and in-block order may differ
    llama8b(tp_size=2).check_compatible(llama8b(tp_size=8, token_major=True))


# ------------------------------------------------------------------ TP mapping


def _fill(lay: KVLayout, rank: int, t: int) -> np.ndarray:
    """A block of tensor t of `rank` whose every (head, token, byte) is a distinct code."""
    unit = lay.unit_bytes(t)
    H, T = lay.heads_per_rank, lay.tokens_per_block
    h0, _ = lay.head_range(rank)
    heads = np.arange(h0, h0 + H, dtype=np.int64)[:, None, None]
    toks = np.arange(T, dtype=np.int64)[None, :, None]
    byts = np.arange(unit, dtype=np.int64)[None, None, :]
    code = (heads * 7919 + toks * 104729 + byts * 31 + t * 17) % 251 + 1  # never 0
    if lay.token_major and not lay.is_scale(t):
        code = code.transpose(1, 0, 2)
    return np.ascontiguousarray(code.astype(np.uint8)).reshape(-1)


def _apply(src: KVLayout, dst: KVLayout):
    segs = tp_segments(src, dst)
    out = {}
    for s in range(dst.tp_size):
        for t in range(len(dst.tensors)):
            out[s, t] = (np.zeros(dst.tensor_block_bytes(t), np.uint8), np.zeros(dst.tensor_block_bytes(t), np.int32))
    reads = {}
    for g in segs:
        srcbuf = _fill(src.with_rank(g.src_rank), g.src_rank, g.tensor)
        dbuf, count = out[g.dst_rank, g.tensor]
        for i in range(g.count):
            so, do = g.src_offset + i * g.src_stride, g.dst_offset + i * g.dst_stride
            assert 0 <= so and so + g.length <= src.tensor_block_bytes(g.tensor), "read outside the source block"
            assert 0 <= do and do + g.length <= dst.tensor_block_bytes(g.tensor), "write outside the destination block"
            dbuf[do : do + g.length] = srcbuf[so : so + g.length]
            count[do : do + g.length] += 1
            reads.setdefault((g.dst_rank, g.tensor), set()).add(g.src_rank)
    return segs, out


tp_cases = st.tuples(
    st.sampled_from([1, 2, 4, 8, 16]),  # heads
    st.sampled_from([1, 2, 4, 8, 16, 32]),  # P
    st.sampled_from([1, 2, 4, 8, 16, 32]),  # D
    st.sampled_from([8, 16, 64, 128]),  # head_dim
    st.sampled_from(["bfloat16", "float8_e4m3", "int4"]),
    st.booleans(),  # mla
    st.booleans(),  # scales
    st.booleans(),  # src token-major
    st.booleans(),  # dst token-major
    st.sampled_from([1, 4, 16]),  # tokens per block
)


@given(tp_cases)
def test_tp_mapping_writes_every_destination_byte_once_with_the_right_data(case):
    H, P, D, hd, dt, mla, sc, snhd, dnhd, T = case
    if mla:
        H = 1
    assume((H % P == 0 or P % H == 0) and (H % D == 0 or D % H == 0))

    def mk(tp, nhd):
        return KVLayout(
            num_layers=1,
            kv_heads=H,
            head_dim=hd,
            tokens_per_block=T,
            dtype=dt,
            mla=mla,
            scales=sc,
            tp_size=tp,
            token_major=nhd,
        )

    src, dst = mk(P, snhd), mk(D, dnhd)
    segs, out = _apply(src, dst)
    for (s, t), (buf, count) in out.items():
        assert (count == 1).all(), f"dst rank {s} tensor {t}: bytes written {set(count.tolist())} times"
        np.testing.assert_array_equal(buf, _fill(dst.with_rank(s), s, t))
    # a head held by several prefill ranks is read from one of them only
    for s in range(D):
        for t in range(len(dst.tensors)):
            srcs = {g.src_rank for g in segs if g.dst_rank == s and g.tensor == t}
            d0, d1 = dst.head_range(s)
            assert len(srcs) <= max(1, d1 - d0)


def test_tp_mapping_segment_shapes():
    # P=2 -> D=4, HND: each decode rank gets one contiguous half of a prefill rank's block
    src, dst = llama8b(num_layers=1, tp_size=2), llama8b(num_layers=1, tp_size=4)
    segs = [g for g in tp_segments(src, dst) if g.tensor == 0]
    assert [(g.src_rank, g.dst_rank, g.src_offset, g.dst_offset, g.count) for g in segs] == [
        (0, 0, 0, 0, 1),
        (0, 1, 2 * 64 * 256, 0, 1),
        (1, 2, 0, 0, 1),
        (1, 3, 2 * 64 * 256, 0, 1),
    ]
    # equal TP in NHD collapses to one whole-block copy
    same = tp_segments(llama8b(token_major=True, tp_size=2), llama8b(token_major=True, tp_size=2))
    assert all(g.count == 1 and g.length == src.tensor_block_bytes(0) for g in same)
    # NHD with different TP is strided: one piece per token
    strided = tp_segments(llama8b(token_major=True, tp_size=2), llama8b(token_major=True, tp_size=4))
    assert all(g.count == 64 for g in strided)


def test_tp_mapping_refuses_mismatched_models():
    with pytest.raises(LayoutMismatchError, match="num_layers"):
        tp_segments(llama8b(), llama8b(num_layers=31))


# ------------------------------------------------------------------ cache specs


def test_buffer_spec_regions_are_contiguous_per_layer_and_tensor():
    lay = llama8b(num_layers=2, scales=True, dtype="fp8")
    spec = CacheSpec.for_buffer(lay, 10, 4096)
    tb = lay.tensor_block_bytes("k")
    sb = lay.tensor_block_bytes("k_scale")
    assert spec.address(0, "k", 0) == 4096
    assert spec.address(0, "k", 3) == 4096 + 3 * tb
    assert spec.address(0, "v", 0) == 4096 + 10 * tb
    assert spec.address(0, "k_scale", 0) == 4096 + 20 * tb
    assert spec.address(1, "k", 0) == 4096 + 20 * tb + 20 * sb
    last = spec.address(1, "v_scale", 9) + sb
    assert last - 4096 == CacheSpec.buffer_bytes(lay, 10)
    with pytest.raises(LayoutError, match="block 10 out of range"):
        spec.address(0, "k", 10)
    with pytest.raises(LayoutError, match="tensor 'q'"):
        spec.address(0, "q", 0)


@given(fused=st.sampled_from(["", "row", "head"]), scales=st.booleans(), nl=st.integers(1, 4), nb=st.integers(1, 9))
def test_block_outermost_buffer_tiles_each_block_once_layers_side_by_side(fused, scales, nl, nb):
    """order="block": block b is one contiguous span of block_bytes at base + b*block_bytes,
    its (layer, tensor) units in order, and the whole buffer is the same bytes as the default."""
    assume(not (fused and scales))
    lay = llama8b(num_layers=nl, scales=scales, dtype="fp8" if scales else "bf16", kv_fused=fused)
    base = 1 << 20
    spec = CacheSpec.for_buffer(lay, nb, base, order="block")
    names = [0] if fused else list(range(len(lay.tensors)))
    for b in range(nb):
        at = base + b * lay.block_bytes
        for li in range(nl):
            for t in names:
                n = lay.layer_block_bytes if fused else lay.tensor_block_bytes(t)
                assert spec.address(li, t, b) == at
                at += n
        assert at == base + (b + 1) * lay.block_bytes
    assert CacheSpec.buffer_bytes(lay, nb) == nb * lay.block_bytes
    with pytest.raises(LayoutError, match="order='rows' must be one of layer, block"):
        CacheSpec.for_buffer(lay, nb, base, order="rows")


def test_engine_layouts():
    lay = llama8b(num_layers=2, token_major=True)
    bb = lay.tensor_block_bytes(0)
    fa = CacheSpec.vllm_flash_attn(lay, 100, [1 << 20, 1 << 30])
    assert fa.address(1, "v", 5) == (1 << 30) + 100 * bb + 5 * bb
    fi = CacheSpec.flashinfer(lay, 100, [1 << 20, 1 << 30])
    assert fi.address(0, "v", 2) == (1 << 20) + 2 * 2 * bb + bb
    with pytest.raises(LayoutError, match="head-major"):
        CacheSpec.fastdeploy(lay, 10, [[1, 2], [3, 4]])
    with pytest.raises(LayoutError, match="stride"):
        CacheSpec(lay, 10, [[(4096, 1), (8192, bb)]] * 2)
    with pytest.raises(LayoutError, match="layers"):
        CacheSpec(lay, 10, [[(4096, bb), (8192, bb)]])
    with pytest.raises(LayoutError, match="base pointer"):
        CacheSpec(lay, 10, [[(0, bb), (8192, bb)]] * 2)


def test_gib_constant():
    assert GIB == 1073741824


# ------------------------------------------------------------------ every rule, its exact message


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(num_layers=0), "num_layers=0 must be a positive integer"),
        (dict(num_layers=True), "num_layers=True must be a positive integer"),
        (dict(num_layers=4097), "num_layers=4097 is absurd (more than 4096)"),
        (dict(kv_heads=4097 * 2), "kv_heads=8194 is absurd (more than 4096)"),
        (dict(head_dim=65537), "head_dim=65537 is absurd (more than 65536)"),
        (dict(tokens_per_block=65537), "tokens_per_block=65537 is absurd (more than 65536)"),
        (dict(tp_size=8192), "tp_size=8192 is absurd (more than 4096)"),
        (dict(extra_layers=257), "extra_layers=257 is absurd (more than 256)"),
        (dict(extra_layers=True), "extra_layers=True must be a non-negative integer"),
        (dict(tp_rank=-1), "tp_rank=-1 must be a non-negative integer"),
        (dict(tp_size=4, tp_rank=4), "tp_rank=4 must be < tp_size=4"),
        (dict(mla=True, kv_heads=2), "kv_heads=2 with mla=True"),
        (dict(tp_size=3), "kv_heads=8 and tp_size=3: one must divide the other"),
        (dict(dtype="int4", head_dim=3), "head_dim=3 with dtype=int4 is not a whole number of bytes"),
        (dict(dtype="float64"), "dtype='float64' is not supported"),
    ],
)
def test_every_layout_rule_and_its_message(kw, msg):
    with pytest.raises(LayoutError) as e:
        llama8b(**kw)
    assert str(e.value).startswith(msg), str(e.value)


def test_limits_are_inclusive():
    KVLayout(
        num_layers=4096, kv_heads=4096, head_dim=8, tokens_per_block=1, extra_layers=256, tp_size=4096, tp_rank=4095
    )
    KVLayout(num_layers=1, kv_heads=1, head_dim=65536, tokens_per_block=65536)
    KVLayout(num_layers=1, kv_heads=1, head_dim=2, tokens_per_block=1, dtype="int4")  # 2 x 4 bits: one byte


@pytest.mark.parametrize(
    "alias, canon",
    [
        ("bf16", "bfloat16"),
        ("FP16", "float16"),
        ("half", "float16"),
        ("fp8", "float8_e4m3"),
        ("float8", "float8_e4m3"),
        ("e5m2", "float8_e5m2"),
        ("int8", "uint8"),
        ("int4", "int4"),
    ],
)
def test_dtype_aliases(alias, canon):
    assert llama8b(dtype=alias).dtype == canon


def test_sizes_and_conversions_exactly():
    lay = llama8b(extra_layers=2, tp_size=2, tp_rank=1)
    assert lay.total_layers == 34 and lay.heads_per_rank == 4 and lay.head_range() == (4, 8)
    assert lay.head_range(0) == (0, 4)
    assert lay.elem_bytes_per_head_token == 256 and lay.unit_bytes("v") == 256
    assert lay.tensor_block_bytes(1) == 4 * 64 * 256 and lay.layer_block_bytes == 2 * 4 * 64 * 256
    assert lay.block_bytes == 34 * 2 * 4 * 64 * 256 and lay.instance_block_bytes == 2 * lay.block_bytes
    assert lay.blocks_for_tokens(0) == 0 and lay.blocks_for_tokens(1) == 1 and lay.blocks_for_tokens(64) == 1
    assert lay.blocks_for_tokens(65) == 2
    assert lay.blocks_for_tokens(65, full_only=True) == 1 and lay.blocks_for_tokens(63, full_only=True) == 0
    assert lay.blocks_for_tokens(128, full_only=True) == 2
    assert lay.bytes_for_blocks(0) == 0 and lay.bytes_for_blocks(3) == 3 * lay.block_bytes
    assert lay.blocks_for_bytes(lay.block_bytes) == 1 and lay.blocks_for_bytes(lay.block_bytes - 1) == 0
    assert lay.blocks_for_gib(1) == GIB // lay.block_bytes
    assert lay.tokens_for_blocks(3) == 192
    assert lay.with_rank(0).tp_rank == 0 and lay.with_rank(0).tp_size == 2
    for bad in (-1, 1.5):
        with pytest.raises(LayoutError, match=f"blocks={bad!r} must be a non-negative integer"):
            lay.bytes_for_blocks(bad)
        with pytest.raises(LayoutError, match=f"tokens={bad!r} must be a non-negative integer"):
            lay.blocks_for_tokens(bad)
    with pytest.raises(LayoutError, match="gib=-1 must be positive"):
        lay.blocks_for_gib(-1)
    with pytest.raises(LayoutError, match="rank 2 out of range for tp_size=2"):
        lay.head_range(2)
    with pytest.raises(LayoutError, match="rank -1 out of range"):
        lay.head_range(-1)


def test_replicated_heads_ranges():
    lay = llama8b(kv_heads=2, tp_size=8)
    assert [lay.head_range(r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert lay.heads_per_rank == 1


def test_tensors_and_their_indices():
    sc = llama8b(scales=True)
    assert sc.tensor_index("v_scale") == 3 and sc.tensor_index(2) == 2
    assert sc.is_scale("k_scale") and not sc.is_scale(1) and sc.unit_bytes("k_scale") == 2
    with pytest.raises(
        LayoutError, match=r"tensor index 4 out of range for tensors \('k', 'v', 'k_scale', 'v_scale'\)"
    ):
        sc.tensor_index(4)
    with pytest.raises(LayoutError, match="tensor index -1 out of range"):
        sc.tensor_index(-1)
    with pytest.raises(LayoutError, match="tensor 'q' not in this layout's tensors"):
        sc.tensor_index("q")
    mla_sc = KVLayout(num_layers=2, kv_heads=1, head_dim=576, tokens_per_block=64, mla=True, scales=True)
    assert mla_sc.tensors == ("k", "k_scale")


def test_descriptor_fields_and_every_rejection():
    lay = llama8b(scales=True, extra_layers=1, tp_size=2, tp_rank=1, token_major=True)
    d = lay.descriptor()
    assert d["format"] == "pdkv.layout" and d["version"] == 1 and d["block_bytes"] == lay.block_bytes
    assert KVLayout.from_descriptor(d) == lay
    assert KVLayout.from_descriptor({k: v for k, v in d.items() if k != "block_bytes"}) == lay
    for bad, msg in (
        (5, "not a pdkv layout descriptor"),
        ({**d, "format": "x"}, "not a pdkv layout descriptor"),
        ({k: v for k, v in d.items() if k != "version"}, "version None is not supported"),
        ({k: v for k, v in d.items() if k != "num_layers"}, "layout descriptor is incomplete"),
        ({**d, "evil": 1, "bad": 2}, r"unknown fields \['bad', 'evil'\]"),
        ({**d, "block_bytes": 7}, f"block_bytes: descriptor says 7, computed {lay.block_bytes}"),
    ):
        with pytest.raises(LayoutMismatchError, match=msg):
            KVLayout.from_descriptor(bad)


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_layers", 16),
        ("extra_layers", 1),
        ("kv_heads", 16),
        ("head_dim", 64),
        ("tokens_per_block", 32),
        ("dtype", "fp8"),
        ("scales", True),
    ],
)
def test_check_compatible_names_the_first_difference(field, value):
    a, b = llama8b(), llama8b(**{field: value})
    with pytest.raises(LayoutMismatchError, match=f"layout mismatch: {field} is"):
        a.check_compatible(b)
    llama8b(tp_size=2).check_compatible(llama8b(token_major=True, tp_size=4, tp_rank=3))  # these may differ
    mla = dict(num_layers=2, kv_heads=1, head_dim=576, tokens_per_block=64)
    with pytest.raises(LayoutMismatchError, match="mla"):
        KVLayout(**mla).check_compatible(KVLayout(**mla, mla=True))


def test_cache_spec_checks_and_addresses():
    lay = llama8b(num_layers=2)
    tb = lay.tensor_block_bytes(0)
    regions = [[(4096, tb), (8192, tb + 64)], [(1 << 20, tb), (2 << 20, tb)]]
    spec = CacheSpec(lay, 10, regions, device=3)
    assert spec.device == 3 and spec.num_blocks == 10
    assert spec.address(0, "k", 0) == 4096 and spec.address(0, "v", 2) == 8192 + 2 * (tb + 64)
    assert spec.address(1, 1, 9) == (2 << 20) + 9 * tb
    assert spec.region(0, 1) == (8192, tb + 64)
    assert spec.alignment == 64
    bases, strides = spec.region_arrays()
    assert bases.tolist() == [[4096, 8192], [1 << 20, 2 << 20]] and strides.tolist() == [[tb, tb + 64], [tb, tb]]
    assert spec.region_arrays()[0] is bases  # cached
    for layer, block, msg in (
        (2, 0, r"layer 2 out of range \[0, 2\)"),
        (-1, 0, "layer -1 out of range"),
        (0, 10, r"block 10 out of range \[0, 10\)"),
        (0, -1, "block -1 out of range"),
    ):
        with pytest.raises(LayoutError, match=msg):
            spec.address(layer, 0, block)
    for bad_regions, msg in (
        (regions[:1], "regions has 1 layers; the layout has 2"),
        ([regions[0][:1], regions[1]], r"layer 0 has 1 tensors; the layout has 2 \('k', 'v'\)"),
        ([[(0, tb), (8192, tb)], regions[1]], "layer 0 tensor k: base pointer 0 is not a valid address"),
        ([[(4096, tb), (8192, tb - 1)], regions[1]], f"layer 0 tensor v: block stride {tb - 1} is smaller than"),
    ):
        with pytest.raises(LayoutError, match=msg):
            CacheSpec(lay, 10, bad_regions)
    for bad in (0, -1, 1.5):
        with pytest.raises(LayoutError, match=f"num_blocks={bad!r} must be a positive integer"):
            CacheSpec(lay, bad, regions)
    assert CacheSpec(lay, 1, [[(4096 + 16, tb), (8192, tb)]] * 2).alignment == 16


def test_engine_layout_builders_exactly():
    lay = llama8b(num_layers=2)
    tb = lay.tensor_block_bytes(0)
    fd = CacheSpec.fastdeploy(lay, 5, [[0x10000, 0x20000], [0x30000, 0x40000]], device=1)
    assert fd.device == 1 and fd.region(1, 0) == (0x30000, tb) and fd.address(0, "v", 3) == 0x20000 + 3 * tb
    with pytest.raises(LayoutError, match="FastDeploy caches are head-major"):
        CacheSpec.fastdeploy(llama8b(num_layers=2, token_major=True), 5, [[1, 2], [3, 4]])
    fa = CacheSpec.vllm_flash_attn(lay, 5, [0x100000, 0x200000], device=2)
    assert fa.region(0, 0) == (0x100000, tb) and fa.region(0, 1) == (0x100000 + 5 * tb, tb) and fa.device == 2
    fi = CacheSpec.flashinfer(lay, 5, [0x100000, 0x200000])
    assert fi.region(1, 0) == (0x200000, 2 * tb) and fi.region(1, 1) == (0x200000 + tb, 2 * tb)
    mla = KVLayout(num_layers=2, kv_heads=1, head_dim=576, tokens_per_block=64, mla=True)
    for kind in ("vllm_flash_attn", "flashinfer"):
        for bad in (mla, llama8b(num_layers=2, scales=True)):  # MLA alone, scales alone: each refused
            with pytest.raises(LayoutError, match="expects a K\\+V cache without scale tensors"):
                getattr(CacheSpec, kind)(bad, 5, [1 << 20, 2 << 20])
    buf = CacheSpec.for_buffer(lay, 5, 1 << 20, device=0)
    assert buf.device == 0 and CacheSpec.buffer_bytes(lay, 5) == 5 * lay.block_bytes
    assert buf.region(1, 1) == ((1 << 20) + 3 * 5 * tb, tb)


# ------------------------------------------------------------------ fused K/V (vLLM) layouts


def _layer_block(lay: KVLayout, rank: int) -> tuple[np.ndarray, list[int]]:
    """A naive model of one layer's block of `rank`: every (head, token, K or V, byte) a
    distinct code, placed by the layout's order written out with numpy axes (not through
    the strides under test); and each tensor's base in it."""
    u, H, T = lay.elem_bytes_per_head_token, lay.heads_per_rank, lay.tokens_per_block
    h0, _ = lay.head_range(rank)
    heads = np.arange(h0, h0 + H, dtype=np.int64)[:, None, None, None]
    toks = np.arange(T, dtype=np.int64)[None, :, None, None]
    kv = np.arange(2, dtype=np.int64)[None, None, :, None]
    byts = np.arange(u, dtype=np.int64)[None, None, None, :]
    code = ((heads * 7919 + toks * 104729 + byts * 31 + kv * 17) % 251 + 1).astype(np.uint8)  # [H, T, 2, u]
    if lay.kv_fused == "row":
        arr = code if not lay.token_major else code.transpose(1, 0, 2, 3)  # [H|T, T|H, 2, u]
        return np.ascontiguousarray(arr).reshape(-1), [0, u]
    if lay.kv_fused == "head":
        return np.ascontiguousarray(code.transpose(0, 2, 1, 3)).reshape(-1), [0, T * u]  # [H, 2, T, u]
    per = [code[:, :, i] if not lay.token_major else code[:, :, i].transpose(1, 0, 2) for i in range(2)]
    return np.concatenate([np.ascontiguousarray(p).reshape(-1) for p in per]), [0, H * T * u]


fused_cases = st.tuples(
    st.sampled_from([1, 2, 4, 8]),  # heads
    st.sampled_from([1, 2, 4, 8]),  # P
    st.sampled_from([1, 2, 4, 8]),  # D
    st.sampled_from([8, 16]),  # head_dim
    st.sampled_from(["bfloat16", "float8_e4m3", "float32"]),
    st.sampled_from([("", False), ("", True), ("row", False), ("row", True), ("head", False)]),  # src order
    st.sampled_from([("", False), ("", True), ("row", False), ("row", True), ("head", False)]),  # dst order
    st.sampled_from([1, 4, 16]),  # tokens per block
)


@given(fused_cases)
def test_fused_layouts_map_every_byte_once_against_a_naive_model(case):
    """K and V fused per row or per head (vLLM), to and from every other order and any TP
    pair: each destination byte of the layer block written once, with the source's byte for
    that (head, token, K or V), no read or write outside a block's storage."""
    H, P, D, hd, dt, (sf, snhd), (df, dnhd), T = case
    assume((H % P == 0 or P % H == 0) and (H % D == 0 or D % H == 0))
    assume((sf == "head") == (df == "head"))  # a 'head' cache pairs only with another (refused below)

    def mk(tp, fused, nhd):
        return KVLayout(
            num_layers=1,
            kv_heads=H,
            head_dim=hd,
            tokens_per_block=T,
            dtype=dt,
            tp_size=tp,
            token_major=nhd,
            kv_fused=fused,
        )

    src, dst = mk(P, sf, snhd), mk(D, df, dnhd)
    out = {s: (np.zeros(dst.layer_block_bytes, np.uint8), np.zeros(dst.layer_block_bytes, np.int32)) for s in range(D)}
    for g in tp_segments(src, dst):
        sbuf, sbase = _layer_block(src.with_rank(g.src_rank), g.src_rank)
        _, dbase = _layer_block(dst.with_rank(g.dst_rank), g.dst_rank)
        dbuf, count = out[g.dst_rank]
        for i in range(g.count):
            so, do = g.src_offset + i * g.src_stride, g.dst_offset + i * g.dst_stride
            assert 0 <= so and so + g.length <= src.tensor_block_extent(g.tensor), "read outside the source block"
            assert 0 <= do and do + g.length <= dst.tensor_block_extent(g.tensor), "write outside the destination block"
            a, b = sbase[g.tensor] + so, dbase[g.tensor] + do
            dbuf[b : b + g.length] = sbuf[a : a + g.length]
            count[b : b + g.length] += 1
    for s, (buf, count) in out.items():
        assert (count == 1).all(), f"dst rank {s}: bytes written {sorted(set(count.tolist()))} times"
        np.testing.assert_array_equal(buf, _layer_block(dst.with_rank(s), s)[0])


def test_fused_layout_geometry_exactly():
    """The fused orders' strides, offsets and spans, by hand (Llama-8B, TP 1, bf16: 256-byte
    rows, 8 heads, 64 tokens)."""
    u, T, H = 256, 64, 8
    row = llama8b(kv_fused="row", token_major=True)  # vLLM FlashAttention's default (LBNHC)
    assert row.unit_strides("k") == row.unit_strides("v") == (2 * u, 2 * H * u)
    assert (row.tensor_offset("k"), row.tensor_offset("v")) == (0, u)
    assert row.block_span("v") == row.layer_block_bytes == 2 * H * T * u
    assert row.tensor_block_extent("v") == 2 * H * T * u - u
    hrow = llama8b(kv_fused="row")
    assert hrow.unit_strides("k") == (2 * T * u, 2 * u)
    head = llama8b(kv_fused="head")  # vLLM's CPU backend
    assert head.unit_strides("v") == (2 * T * u, u) and head.tensor_offset("v") == T * u
    plain = llama8b()
    assert plain.block_span("v") == plain.tensor_block_bytes("v") == H * T * u and plain.tensor_offset("v") == 0
    assert row.block_bytes == plain.block_bytes  # fusing moves bytes, it adds none
    # the buffer of a fused layout: one region per layer, V inside K's
    spec = CacheSpec.for_buffer(llama8b(num_layers=2, kv_fused="head"), 3, 0x1000)
    span = 2 * H * T * u
    assert spec.region(0, 0) == (0x1000, span) and spec.region(0, 1) == (0x1000 + T * u, span)
    assert spec.region(1, 0) == (0x1000 + 3 * span, span)
    assert spec.region_ranges() == [(0x1000, 3 * span), (0x1000 + 3 * span, 3 * span)]
    # vLLM's cross-layer order BLHNC: layer l at base + l x span, block stride layers x span
    lay = llama8b(num_layers=2, kv_fused="row")
    x = CacheSpec.vllm(lay, 4, [(0x10000 + li * span, 2 * span) for li in range(2)])
    assert x.address(1, "v", 3) == 0x10000 + span + 3 * 2 * span + u
    with pytest.raises(LayoutError, match="block stride 100 is smaller"):
        CacheSpec.vllm(lay, 4, [(0x10000, 100), (0x20000, 100)])
    with pytest.raises(LayoutError, match="fused K/V cache"):
        CacheSpec.vllm(llama8b(num_layers=2), 4, [(0x10000, span), (0x20000, span)])


def test_head_fused_pairs_only_with_head_fused():
    """vLLM's CPU backend packs each head's K its own way: moved whole, between two such
    caches only; any other pairing is refused by name."""
    for other in (
        llama8b(),
        llama8b(token_major=True),
        llama8b(kv_fused="row"),
        llama8b(kv_fused="row", token_major=True),
    ):
        for a, b in ((llama8b(kv_fused="head"), other), (other, llama8b(kv_fused="head"))):
            with pytest.raises(LayoutMismatchError, match="pairs only with another"):
                tp_segments(a, b)
    segs = tp_segments(llama8b(kv_fused="head", tp_size=2), llama8b(kv_fused="head"))
    # each head's K (and V) region, 64 tokens x 256 bytes, is one piece per head
    assert {(g.length, g.count) for g in segs} == {(64 * 256, 4)}


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(kv_fused="both"), "kv_fused='both' must be one of"),
        (dict(kv_fused="row", mla=True, kv_heads=1), "not with mla=True or scales=True"),
        (dict(kv_fused="head", scales=True), "not with mla=True or scales=True"),
        (dict(kv_fused="head", token_major=True), "is head-major: token_major=False"),
    ],
)
def test_fused_layout_rules(kw, msg):
    with pytest.raises(LayoutError, match=re.escape(msg)):
        llama8b(**kw)


def test_each_engine_constructor_places_k_and_v_and_keeps_the_device():
    # 2 layers, 2 heads x 8 x bf16, 4 tokens a block: K (or V) of a block is 2 * 4 * 8 * 2 = 128 bytes
    lay = KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="bf16")
    bb, nb, base = 128, 10, 1 << 20
    fi = CacheSpec.flashinfer(lay, nb, [base, base + 4096], device=3)  # [blocks, 2, ...]: K and V side by side
    assert fi.device == 3 and fi.num_blocks == nb
    assert [fi.region(li, t) for li in (0, 1) for t in (0, 1)] == [
        (base, 2 * bb), (base + bb, 2 * bb), (base + 4096, 2 * bb), (base + 4096 + bb, 2 * bb)]  # fmt: skip
    fa = CacheSpec.vllm_flash_attn(lay, nb, [base, base + 8192], device=2)  # [2, blocks, ...]: all K, then all V
    assert fa.device == 2
    assert [fa.region(li, t) for li in (0, 1) for t in (0, 1)] == [
        (base, bb), (base + nb * bb, bb), (base + 8192, bb), (base + 8192 + nb * bb, bb)]  # fmt: skip
    fd = CacheSpec.fastdeploy(lay, nb, [[base, base + 2048], [base + 4096, base + 6144]], device=1)
    assert fd.device == 1 and fd.region(1, 1) == (base + 6144, bb) and fd.region(0, 0) == (base, bb)
    fb = CacheSpec.for_buffer(lay, nb, base, device=4)
    assert fb.device == 4 and [fb.region(li, t) for li in (0, 1) for t in (0, 1)] == [
        (base, bb), (base + nb * bb, bb), (base + 2 * nb * bb, bb), (base + 3 * nb * bb, bb)]  # fmt: skip
    fused = KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4, dtype="bf16", kv_fused="row")
    vl = CacheSpec.vllm(fused, nb, [(base, 4 * bb), (base + 1024, 2 * bb)], device=5)
    assert vl.device == 5
    assert [vl.region(li, t) for li in (0, 1) for t in (0, 1)] == [
        (base, 4 * bb), (base + fused.tensor_offset(1), 4 * bb),
        (base + 1024, 2 * bb), (base + 1024 + fused.tensor_offset(1), 2 * bb)]  # fmt: skip
    for make in (CacheSpec.flashinfer, CacheSpec.vllm_flash_attn):
        assert make(lay, nb, [base, base + 4096]).device is None
    with pytest.raises(LayoutError, match="CacheSpec.vllm describes a fused K/V cache"):
        CacheSpec.vllm(lay, nb, [(base, 2 * bb), (base + 1024, 2 * bb)])
