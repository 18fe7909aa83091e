"""PagedKV (integrations/modelcache.py) on CPU tensors, fast: the tensors each engine's
layout makes, a sequence written into blocks and read back, every byte where the cache's
CacheSpec says (read through raw addresses, as pdkv's transports read it), the heads a TP
rank keeps, and each refusal's words. test_accuracy.py runs it with a real model."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pdkv import KVLayout
from pdkv.errors import LayoutError

torch = pytest.importorskip("torch")
from pdkv.integrations.modelcache import ENGINES, PagedKV, hf_cache, read_heads  # noqa: E402

L, H, D, T, NB = 2, 4, 8, 4, 6


def lay(tp=(0, 1), token_major=False, fused="", dtype="bf16", heads=H, **kw):
    return KVLayout(
        num_layers=L,
        kv_heads=heads,
        head_dim=D,
        tokens_per_block=T,
        dtype=dtype,
        tp_size=tp[1],
        tp_rank=tp[0],
        token_major=token_major,
        kv_fused=fused,
        **kw,
    )


CASES = [
    ("fastdeploy", False, ""),
    ("vllm_flash_attn", False, ""),
    ("vllm_flash_attn", True, ""),
    ("flashinfer", False, ""),
    ("flashinfer", True, ""),
    ("vllm", False, "row"),
    ("vllm", True, "row"),
]


def seq(heads, S, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, S, D, generator=g).to(torch.bfloat16)


def raw(addr, n):
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr)).copy()


@pytest.mark.parametrize("engine,tm,fused", CASES)
def test_tensors_of_each_engine(engine, tm, fused):
    c = PagedKV(lay(token_major=tm, fused=fused), NB, engine=engine)
    inner = (T, H, D) if tm else (H, T, D)
    shapes = {
        "fastdeploy": [(NB, H, T, D)] * 2,
        "vllm_flash_attn": [(2, NB, *inner)],
        "flashinfer": [(NB, 2, *inner)],
        "vllm": [(NB, *inner[:2], 2 * D)],
    }[engine]
    for layer in range(L):
        ts = c.tensors[layer] if engine == "fastdeploy" else [c.tensors[layer]]
        assert [tuple(t.shape) for t in ts] == shapes
        assert all(t.dtype == torch.bfloat16 and not t.any() for t in ts)
    assert c.num_blocks == NB and c.device == torch.device("cpu") and c.engine == engine
    for layer in range(L):
        for t in (0, 1):
            assert tuple(c.blocks_view(layer, t).shape) == (NB, H, T, D)


@pytest.mark.parametrize("engine,tm,fused", CASES)
@pytest.mark.parametrize("S", [1, T - 1, T, 2 * T + 1, 3 * T])
def test_write_read_round_trip_and_every_byte_where_the_spec_says(engine, tm, fused, S):
    lo = lay(token_major=tm, fused=fused)
    c = PagedKV(lo, NB, engine=engine)
    for t in c.tensors if engine != "fastdeploy" else [x for pair in c.tensors for x in pair]:
        t.fill_(7.0)  # the tail of the last block must be zeroed, not kept
    n = -(-S // T)
    blocks = [5, 0, 3][:n]
    for layer in range(L):
        k, v = seq(H, S, 10 + layer), seq(H, S, 20 + layer)
        c.write(layer, k, v, blocks)
        rk, rv = c.read(layer, blocks, S)
        assert torch.equal(rk, k) and torch.equal(rv, v)
        for t, x in enumerate((k, v)):
            full = torch.cat([x[0], x.new_zeros(H, n * T - S, D)], dim=1)  # [H, n*T, D]
            for i, b in enumerate(blocks):
                want = full[:, i * T : (i + 1) * T]  # [H, T, D]
                if tm:
                    want = want.permute(1, 0, 2)
                if fused:  # each row: K (D values) then V; V's address is D values into the block
                    assert c.spec.address(layer, 1, b) == c.spec.address(layer, 0, b) + 2 * D
                    blk = raw(c.spec.address(layer, 0, b), T * H * 2 * D * 2)
                    got = blk.view(np.uint16).reshape(-1, 2 * D)[:, t * D : (t + 1) * D].reshape(-1)
                else:
                    got = raw(c.spec.address(layer, t, b), lo.tensor_block_extent(t)).view(np.uint16)
                assert np.array_equal(got, want.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1))
    untouched = [b for b in range(NB) if b not in blocks]
    assert all(bool((c.blocks_view(0, 0)[b] == 7).all()) for b in untouched)


def test_a_rank_keeps_its_own_heads_of_the_models():
    c = PagedKV(lay(tp=(1, 2)), NB, engine="fastdeploy")
    k, v = seq(H, 8, 1), seq(H, 8, 2)
    c.write(0, k, v, [1, 2])
    rk, rv = c.read(0, [1, 2], 8)
    assert torch.equal(rk, k[:, 2:4]) and torch.equal(rv, v[:, 2:4])
    c.write(1, k[:, :2], v[:, :2], [3, 4])  # this rank's two heads given directly
    rk, _ = c.read(1, [3, 4], 8)
    assert torch.equal(rk, k[:, :2])


def test_read_heads_joins_ranks_in_rank_order_and_replicated_heads_once():
    k, v = seq(H, 6, 3), seq(H, 6, 4)
    ranks = [PagedKV(lay(tp=(r, 2)), NB) for r in (1, 0)]  # given out of order
    for c in ranks:
        c.write(0, k, v, [2, 4])
    rk, rv = read_heads(ranks, 0, [2, 4], 6)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    two = seq(2, 6, 5), seq(2, 6, 6)
    rep = [PagedKV(lay(tp=(r, 4), heads=2), NB) for r in range(4)]  # two ranks a head
    for c in rep:
        c.write(1, *two, [0, 1])
    rk, rv = read_heads(rep, 1, [0, 1], 6)
    assert torch.equal(rk, two[0]) and torch.equal(rv, two[1])


def test_wrap_adopts_an_engines_tensors():
    lo = lay()
    own = [torch.zeros(2, NB, H, T, D, dtype=torch.bfloat16) for _ in range(L)]
    c = PagedKV.wrap(lo, own, engine="vllm_flash_attn")
    k, v = seq(H, T, 9), seq(H, T, 8)
    c.write(1, k, v, [2])
    assert torch.equal(own[1][0, 2], k[0]) and torch.equal(own[1][1, 2], v[0])
    assert c.tensors[1] is own[1] and c.num_blocks == NB
    with pytest.raises(LayoutError, match="not dtype=float32"):
        PagedKV.wrap(lay(dtype="fp32"), own, engine="vllm_flash_attn")


@pytest.mark.parametrize(
    "kw,engine,msg",
    [
        (
            dict(dtype="fp32"),
            "fastdeploy",
            "PagedKV holds K and V of bfloat16 or float16 (a model's cache as transformers keeps it), "
            "not dtype=float32, mla=False, scales=False",
        ),
        (dict(), "sglang", "engine='sglang' must be one of fastdeploy, vllm_flash_attn, flashinfer, vllm"),
        (dict(), "vllm", "engine='vllm' with kv_fused='': the vllm engine is kv_fused='row'"),
        (dict(fused="row"), "flashinfer", "engine='flashinfer' with kv_fused='row': the vllm engine is kv_fused='row'"),
        (dict(token_major=True), "fastdeploy", "FastDeploy caches are head-major: use token_major=False"),
    ],
)
def test_caches_refused_by_name(kw, engine, msg):
    with pytest.raises(LayoutError) as exc:
        PagedKV(lay(**kw), NB, engine=engine)
    assert str(exc.value) == msg


def test_float16_is_held():
    c = PagedKV(lay(dtype="fp16"), NB)
    assert c.tensors[0][0].dtype == torch.float16
    with pytest.raises(LayoutError, match=r"layer 0: torch.bfloat16 K/V into a torch.float16 cache \(no silent cast\)"):
        c.write(0, seq(H, T, 1), seq(H, T, 2), [0])


@pytest.mark.parametrize(
    "x,msg",
    [
        (torch.zeros(1, H, 4, D + 1), f"keys: shape (1, {H}, 4, {D + 1}), expected [1, heads, seq, {D}]"),
        (torch.zeros(2, H, 4, D), f"keys: shape (2, {H}, 4, {D}), expected [1, heads, seq, {D}]"),
        (torch.zeros(H, 4, D), f"keys: shape ({H}, 4, {D}), expected [1, heads, seq, {D}]"),
        (torch.zeros(1, 3, 4, D), f"keys: 3 heads; the model has {H} and this rank 2"),
    ],
)
def test_key_shapes_refused_by_name(x, msg):
    c = PagedKV(lay(tp=(0, 2)), NB)
    with pytest.raises(LayoutError) as exc:
        c.write(0, x.to(torch.bfloat16), seq(H, 4, 1), [0])
    assert str(exc.value) == msg


def test_values_named_in_their_refusal():
    c = PagedKV(lay(), NB)
    with pytest.raises(LayoutError, match=r"^values: shape"):
        c.write(0, seq(H, 4, 1), torch.zeros(1, H, 4, 3, dtype=torch.bfloat16), [0])


def test_block_ids_refused_by_name():
    c = PagedKV(lay(), NB)
    k = seq(H, 2 * T, 1)
    with pytest.raises(LayoutError) as exc:
        c.write(0, k, k, [0])
    assert str(exc.value) == f"{2 * T} tokens fill 2 blocks of {T}; got 1 block ids"
    with pytest.raises(LayoutError) as exc:
        c.write(0, k, k, [0, NB])
    assert str(exc.value) == f"block ids [0, {NB}] out of range [0, {NB})"
    with pytest.raises(LayoutError) as exc:
        c.read(0, [-1, 2], 2 * T)
    assert str(exc.value) == f"block ids [-1, 2] out of range [0, {NB})"
    c.write(0, k, k, [NB - 1, 0])  # the last block is a block
    assert torch.equal(c.read(0, [NB - 1, 0], 2 * T)[0], k)
    assert c.read(0, [], 0)[0].shape == (1, H, 0, D)


@pytest.mark.parametrize("layer,t", [(-1, 0), (L, 0), (0, 2), (0, -1)])
def test_blocks_view_out_of_range(layer, t):
    with pytest.raises(LayoutError) as exc:
        PagedKV(lay(), NB).blocks_view(layer, t)
    assert str(exc.value) == f"layer {layer}, tensor {t}: out of range"


def test_engines_listed():
    assert ENGINES == ("fastdeploy", "vllm_flash_attn", "flashinfer", "vllm")


def test_hf_cache_holds_each_layer_in_order():
    pytest.importorskip("transformers")
    layers = [(seq(H, 3, i), seq(H, 3, 10 + i)) for i in range(3)]
    cache = hf_cache(layers)
    for i, (k, v) in enumerate(layers):
        ck, cv = cache.layers[i].keys, cache.layers[i].values
        assert torch.equal(ck, k) and torch.equal(cv, v)
