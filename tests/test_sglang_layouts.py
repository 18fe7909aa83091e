"""pdkv.integrations.sglang.layouts on its own: SGLang's KVArgs (any object with its
attributes: the module imports no SGLang) as pdkv layouts and cache specs, and every
refusal by its exact words. test_sglang.py drives the same module through SGLang's classes."""

from __future__ import annotations

import enum
from types import SimpleNamespace as NS

import pytest

from pdkv.errors import LayoutError
from pdkv.integrations.sglang.layouts import (
    ModelFacts,
    RankPools,
    _dtype,
    _spec,
    layout_for,
    rank_pools,
    refusal,
    total_kv_heads,
)
from pdkv.layout import KVLayout


class _State(enum.Enum):
    MAMBA = "mamba"
    SWA = "swa"


@pytest.mark.parametrize(
    "attrs, why",
    [
        ({}, ""),
        ({"state_types": []}, ""),
        ({"state_types": None}, ""),
        (
            {"state_types": [_State.MAMBA, "swa"]},
            "state pools (mamba, swa: hybrid, SWA, DSA or DeepSeek V4 state) are not carried by pdkv",
        ),
        ({"mla_compression_ratios": [4]}, "compressed MLA (DeepSeek V4 mla_compression_ratios) is not carried by pdkv"),
        ({"mla_compression_ratios": []}, ""),
        ({"is_hybrid_mla_backend": True}, "a hybrid MLA backend is not carried by pdkv"),
        ({"is_hybrid_mla_backend": False}, ""),
        ({"pp_rank": 1}, "pipeline-parallel prefill (pp_rank or prefill_start_layer set) is not carried by pdkv"),
        (
            {"prefill_start_layer": 4},
            "pipeline-parallel prefill (pp_rank or prefill_start_layer set) is not carried by pdkv",
        ),
        ({"pp_rank": 0, "prefill_start_layer": 0}, ""),
        ({"num_draft_entries": 2}, "draft-model KV (num_draft_entries) is not carried by pdkv"),
        ({"num_draft_entries": 0}, ""),
        ({"kv_layout": None}, ""),
        ({"kv_layout": ""}, ""),
        ({"kv_layout": "nhd"}, ""),
        ({"kv_layout": "NHD"}, ""),
        ({"kv_layout": "HND"}, "KV layout 'HND' is not carried by pdkv (token-major pages only)"),
    ],
)
def test_refusal_names_what_pdkv_does_not_carry(attrs, why):
    assert refusal(NS(**attrs)) == why


def test_refusal_names_the_first_of_several():
    args = NS(state_types=["swa"], mla_compression_ratios=[2], num_draft_entries=1)
    assert refusal(args).startswith("state pools (swa:")
    assert refusal(NS(is_hybrid_mla_backend=True, pp_rank=1)) == "a hybrid MLA backend is not carried by pdkv"
    assert refusal(NS(mla_compression_ratios=[2], is_hybrid_mla_backend=True)).startswith("compressed MLA")
    assert refusal(NS(pp_rank=2, num_draft_entries=1)).startswith("pipeline-parallel")
    assert refusal(NS(num_draft_entries=1, kv_layout="HND")).startswith("draft-model")


@pytest.mark.parametrize(
    "name, model, want",
    [
        ("bfloat16", "", "bfloat16"),
        ("bf16", "", "bfloat16"),
        ("BF16", "", "bfloat16"),
        ("torch.bfloat16", "", "bfloat16"),
        ("fp16", "", "float16"),
        ("half", "", "float16"),
        ("float16", "", "float16"),
        ("float32", "", "float32"),
        ("fp8", "", "float8_e4m3"),
        ("fp8_e4m3", "", "float8_e4m3"),
        ("fp8_e5m2", "", "float8_e5m2"),
        ("torch.float8_e4m3fn", "", "float8_e4m3"),
        ("float8_e4m3fnuz", "", "float8_e4m3"),
        ("float8_e5m2fnuz", "", "float8_e5m2"),
        ("uint8", "", "uint8"),
        ("auto", "bfloat16", "bfloat16"),
        ("AUTO", "torch.float16", "float16"),
        ("auto", "bf16", "bfloat16"),
    ],
)
def test_sglangs_dtype_names_map_to_pdkvs(name, model, want):
    assert _dtype(name, model) == want


def test_auto_without_the_models_dtype_is_refused_by_name():
    with pytest.raises(LayoutError) as e:
        _dtype("auto")
    assert str(e.value) == (
        "SGLang KV dtype 'auto' is the model's dtype, and pdkv was not given the model's "
        "(PdkvKVManager reads it from SGLang's model config)"
    )


@pytest.mark.parametrize("name", ["int4", "fp4", "float64", "e4m3", "torch.int8"])
def test_a_dtype_pdkv_does_not_carry_is_refused_with_the_ones_it_does(name):
    with pytest.raises(LayoutError) as e:
        _dtype(name)
    assert str(e.value) == (
        f"SGLang KV dtype {name!r} is not one pdkv carries "
        "(bfloat16, float16, float32, float8_e4m3, float8_e5m2, int4, uint8)"
    )


def test_auto_names_the_models_dtype_when_that_is_not_carried():
    with pytest.raises(LayoutError) as e:
        _dtype("auto", "float64")
    assert str(e.value).startswith("SGLang KV dtype 'float64' is not one pdkv carries")


def test_kv_heads_come_from_kvargs_then_the_model_then_the_environment(monkeypatch):
    monkeypatch.delenv("PDKV_SGLANG_KV_HEADS", raising=False)
    assert total_kv_heads(NS(total_kv_head_num=8), ModelFacts(kv_heads=4)) == 8
    assert total_kv_heads(NS(total_kv_head_num=0), ModelFacts(kv_heads=4)) == 4
    assert total_kv_heads(NS(), ModelFacts(kv_heads=2)) == 2
    monkeypatch.setenv("PDKV_SGLANG_KV_HEADS", "16")
    assert total_kv_heads(NS(), None) == 16
    assert total_kv_heads(NS(), ModelFacts()) == 16
    assert total_kv_heads(NS(total_kv_head_num=2), None) == 2
    got = total_kv_heads(NS(total_kv_head_num=2.0), None)
    assert got == 2 and type(got) is int


@pytest.mark.parametrize("env", [None, "", "0", "-2"])
def test_unknown_kv_heads_are_refused_naming_the_way_out(monkeypatch, env):
    if env is None:
        monkeypatch.delenv("PDKV_SGLANG_KV_HEADS", raising=False)
    else:
        monkeypatch.setenv("PDKV_SGLANG_KV_HEADS", env)
    with pytest.raises(LayoutError) as e:
        total_kv_heads(NS(total_kv_head_num=0), ModelFacts())
    assert str(e.value) == (
        "the model's KV heads are unknown: SGLang did not set KVArgs.total_kv_head_num and the model "
        "config did not say; set PDKV_SGLANG_KV_HEADS"
    )


def _mha(layers=3, page=4, heads_here=2, head_dim=8, dtype="bfloat16", bpe=2, pages=5, **kw):
    item = page * heads_here * head_dim * bpe
    base = 0x100000
    n = 2 * layers
    return NS(
        kv_item_lens=[item] * n,
        kv_data_ptrs=[base + i * 0x10000 for i in range(n)],
        kv_data_lens=[item * pages] * n,
        kv_cache_dtype_str=dtype,
        page_size=page,
        engine_rank=0,
        **kw,
    )


def _mla(layers=2, page=4, head_dim=16, pages=3, **kw):
    item = page * head_dim * 2
    return NS(
        kv_item_lens=[item] * layers,
        kv_data_ptrs=[0x200000 + i * 0x10000 for i in range(layers)],
        kv_data_lens=[item * pages] * layers,
        kv_cache_dtype_str="bf16",
        page_size=page,
        engine_rank=0,
        **kw,
    )


def test_an_mha_pool_is_its_layout():
    lay = layout_for(_mha(total_kv_head_num=4), mla=False, tp_size=2, tp_rank=1)
    assert lay == KVLayout(
        num_layers=3,
        kv_heads=4,
        head_dim=8,
        tokens_per_block=4,
        dtype="bfloat16",
        mla=False,
        tp_size=2,
        tp_rank=1,
        token_major=True,
    )


def test_heads_given_win_over_kvargs_and_the_model():
    args = _mha(heads_here=4, total_kv_head_num=2)
    lay = layout_for(args, mla=False, tp_size=1, tp_rank=0, kv_heads=4, model=ModelFacts(kv_heads=8))
    assert (lay.kv_heads, lay.head_dim) == (4, 8)


def test_the_models_dtype_and_heads_fill_what_kvargs_leaves_out():
    args = _mha(dtype="auto", heads_here=2)
    lay = layout_for(args, mla=False, tp_size=1, tp_rank=0, model=ModelFacts(kv_heads=2, dtype="float16"))
    assert (lay.dtype, lay.kv_heads, lay.head_dim) == ("float16", 2, 8)


def test_gqa_with_fewer_heads_than_ranks_holds_one_head_a_rank():
    lay = layout_for(_mha(heads_here=1, total_kv_head_num=2), mla=False, tp_size=4, tp_rank=3)
    assert (lay.kv_heads, lay.head_dim, lay.tp_rank) == (2, 8, 3)


def test_an_mla_pool_is_one_latent_buffer_a_layer():
    lay = layout_for(_mla(), mla=True, tp_size=2, tp_rank=0, kv_heads=64)
    assert (lay.num_layers, lay.kv_heads, lay.head_dim, lay.mla, lay.tokens_per_block) == (2, 1, 16, True, 4)


@pytest.mark.parametrize(
    "lens, mla, why",
    [
        ([], False, "SGLang gave 0 KV buffers; MHA needs a multiple of 2"),
        ([], True, "SGLang gave 0 KV buffers; MLA needs a multiple of 1"),
        ([64] * 3, False, "SGLang gave 3 KV buffers; MHA needs a multiple of 2"),
        ([64, 64, 64, 32], False, "SGLang's KV buffers have pages of different sizes [32, 64]: not one layout"),
    ],
)
def test_buffers_that_are_not_one_layout_are_refused(lens, mla, why):
    args = _mha(total_kv_head_num=2)
    args.kv_item_lens = lens
    with pytest.raises(LayoutError) as e:
        layout_for(args, mla=mla, tp_size=1, tp_rank=0)
    assert str(e.value) == why


def test_a_page_that_is_not_whole_heads_is_refused_naming_the_heads():
    args = _mha(total_kv_head_num=2)
    args.kv_item_lens = [4 * 2 * 2 * 8 + 2] * 6
    with pytest.raises(LayoutError) as e:
        layout_for(args, mla=False, tp_size=1, tp_rank=0)
    assert str(e.value) == (
        "a page of 130 bytes is not 4 tokens x 2 heads of bfloat16: set PDKV_SGLANG_KV_HEADS to the model's KV heads"
    )


def _layout(mla=False, layers=3):
    return KVLayout(
        num_layers=layers,
        kv_heads=1 if mla else 2,
        head_dim=8,
        tokens_per_block=4,
        dtype="bfloat16",
        mla=mla,
        token_major=True,
    )


def test_a_spec_takes_k_buffers_then_v_buffers():
    lay = _layout()
    item = lay.block_span(0)
    ptrs = [1000 * (i + 1) for i in range(6)]
    spec = _spec(lay, ptrs, [item * 5] * 6, [item] * 6, "KV pool", device=3)
    assert spec.num_blocks == 5 and spec.device == 3 and spec.layout == lay
    for layer in range(3):
        assert spec.region(layer, 0) == (ptrs[layer], item)
        assert spec.region(layer, 1) == (ptrs[3 + layer], item)


def test_a_spec_holds_the_pages_of_its_shortest_buffer_and_a_wider_stride():
    lay = _layout()
    item = lay.block_span(0) + 64
    lens = [item * 7] * 6
    lens[4] = item * 6 + item - 1
    spec = _spec(lay, list(range(1000, 7000, 1000)), lens, [item] * 6, "KV pool")
    assert spec.num_blocks == 6 and spec.region(1, 1) == (5000, item) and spec.device is None


@pytest.mark.parametrize(
    "case, why",
    [
        ("ptrs", "KV pool: 5 buffers for 3 layers of 2 tensors"),
        ("lens", "KV pool: 6 buffers for 3 layers of 2 tensors"),
        ("items_n", "KV pool: 6 buffers for 3 layers of 2 tensors"),
        ("items_differ", "KV pool: pages of [128, 256] bytes; the layout's are 128"),
        ("items_small", "KV pool: pages of [64] bytes; the layout's are 128"),
        ("empty", "KV pool: its buffers hold no whole page"),
    ],
)
def test_a_pool_that_does_not_fit_its_layout_is_refused(case, why):
    lay = _layout()
    item = lay.block_span(0)
    assert item == 128
    ptrs, lens, items = [0] * 6, [item * 2] * 6, [item] * 6
    if case == "ptrs":
        ptrs = ptrs[:5]
    elif case == "lens":
        lens = lens[:5]
    elif case == "items_n":
        items = items[:5]
    elif case == "items_differ":
        items[3] = 256
    elif case == "items_small":
        items = [64] * 6
    elif case == "empty":
        lens[2] = item - 1
    with pytest.raises(LayoutError) as e:
        _spec(lay, ptrs, lens, items, "KV pool")
    assert str(e.value) == why


def test_rank_pools_of_a_device_pool_alone():
    args = _mha(total_kv_head_num=4, pages=5)
    args.engine_rank = 1
    got = rank_pools(args, mla=False, tp_size=2, device=0)
    assert isinstance(got, RankPools) and got.host is None
    assert got.layout.tp_rank == 1 and got.layout.kv_heads == 4
    assert got.device.num_blocks == 5 and got.device.device == 0
    assert got.device.region(2, 1) == (args.kv_data_ptrs[5], args.kv_item_lens[0])


def test_rank_pools_with_a_host_pool():
    args = _mha(total_kv_head_num=2, pages=5)
    item = args.kv_item_lens[0]
    args.host_kv_data_ptrs = [0x900000 + i * 0x1000 for i in range(6)]
    args.host_kv_data_lens = [item * 9] * 6
    args.host_kv_item_lens = [item] * 6
    got = rank_pools(args, mla=False, tp_size=1, model=ModelFacts(kv_heads=2))
    assert got.host is not None and got.host.num_blocks == 9 and got.host.device is None
    assert got.host.region(0, 1) == (args.host_kv_data_ptrs[3], item)
    assert got.device.num_blocks == 5 and got.device.device is None
    args.host_kv_item_lens = [item // 2] * 6
    with pytest.raises(LayoutError) as e:
        rank_pools(args, mla=False, tp_size=1)
    assert str(e.value).startswith("host KV pool: pages of ")


def test_rank_pools_of_an_mla_pool():
    got = rank_pools(_mla(pages=3), mla=True, tp_size=1)
    assert got.layout.mla and got.device.num_blocks == 3 and got.host is None


@pytest.mark.parametrize("rank", [-1, 2, 3])
def test_rank_pools_refuse_a_rank_outside_the_tp_size(rank):
    args = _mha(total_kv_head_num=2)
    args.engine_rank = rank
    with pytest.raises(LayoutError) as e:
        rank_pools(args, mla=False, tp_size=2)
    assert str(e.value) == f"engine_rank={rank} is outside a TP size of 2"


def test_rank_pools_refuse_what_pdkv_does_not_carry_first():
    args = _mha(total_kv_head_num=2, num_draft_entries=3)
    args.engine_rank = 9  # named after the refusal
    with pytest.raises(LayoutError) as e:
        rank_pools(args, mla=False, tp_size=1)
    assert str(e.value) == "pdkv's SGLang backend: draft-model KV (num_draft_entries) is not carried by pdkv"
