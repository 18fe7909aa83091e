"""The decode worker's swap into CUDA tensors laid out as vLLM 0.32+ lays its cache, on a
GPU: per-layer views ``[blocks, heads, tokens, 2 x head_dim]`` with K and V fused in each
row, token-major (LBNHC, FlashAttention's default) and head-major (LBHNC), and the
cross-layer order BLHNC (one allocation, a block's layers side by side); prefill TP 2 and
1 into decode TP 1. vLLM does not install on the GPU machine, so vLLM's tensors are made
here with torch exactly as its FlashAttention backend views them, and the connector's two
decode halves (:class:`DecodeSide`, :class:`LoadWorker`) run as vLLM calls them; every byte
of every block is checked, the swap running on the GPU (pdkv's kernel)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdkv import CacheSpec, KVLayout, PrefillSender, tp_segments
from pdkv.integrations.vllm.consumer import DecodeSide, LoadWorker
from pdkv.integrations.vllm.settings import PARAM_CAP, PARAM_ID, binding_of, parse_settings, token_digest
from pdkv.integrations.vllm.views import cache_spec

pytestmark = [pytest.mark.cuda]
L, H, N, D, NB = 3, 8, 16, 64, 24  # layers, KV heads, tokens per block, head_dim, vLLM blocks


def _vllm_cache(torch, order):
    """Per-layer views as vLLM's FlashAttention backend gets them, and the raw allocations
    (their memory order) to read blocks back from."""
    if order == "BLHNC":
        raw = torch.full((NB, L, H, N, 2 * D), -7.0, dtype=torch.bfloat16, device="cuda")
        return [raw[:, li] for li in range(L)], [raw[:, li] for li in range(L)]
    if order == "LBHNC":
        raws = [torch.full((NB, H, N, 2 * D), -7.0, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
        return raws, raws
    raws = [torch.full((NB, N, H, 2 * D), -7.0, dtype=torch.bfloat16, device="cuda") for _ in range(L)]  # LBNHC
    return [r.permute(0, 2, 1, 3) for r in raws], raws


@pytest.fixture(scope="module")
def torch_cuda(cuda_device):
    """torch's CUDA state made before any test's descriptor count (its first use opens files)."""
    import torch

    torch.zeros(1, device="cuda")
    return torch


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLHNC"])
def test_vllm_swap_into_cuda_caches_every_byte(torch_cuda, order, P, no_leaks):
    torch = torch_cuda
    token_major = order == "LBNHC"
    fused = dict(kv_fused="row", token_major=token_major)
    lay = KVLayout(num_layers=L, kv_heads=H, head_dim=D, tokens_per_block=N, dtype="bf16", **fused)
    views, raws = _vllm_cache(torch, order)
    spec = cache_spec(lay, views)
    decode = DecodeSide(parse_settings("kv_consumer", "d", {"buffer_blocks": 16}), [lay])
    loader = LoadWorker(lay, spec)
    assert decode.buffers[0].pinned
    # prefill: P ranks, host caches in the same fused order, their heads split between them
    src_lays = [
        KVLayout(num_layers=L, kv_heads=H, head_dim=D, tokens_per_block=N, dtype="bf16", tp_size=P, tp_rank=r, **fused)
        for r in range(P)
    ]
    srcs = [
        np.random.default_rng(r).integers(0, 256, sl.block_bytes * 12, dtype=np.uint8) for r, sl in enumerate(src_lays)
    ]
    specs = [CacheSpec.for_buffer(sl, 12, a.ctypes.data) for sl, a in zip(src_lays, srcs)]
    txs = [
        PrefillSender(sl, sp, decode.control_address, transport="shm", instance="pf") for sl, sp in zip(src_lays, specs)
    ]
    try:
        src_blocks, tokens = [5, 2, 9, 10, 11], 5 * N - 3
        prompt = list(range(tokens))
        binding = binding_of("cap", token_digest(prompt))  # what prefill's scheduler half mints
        for tx in txs:
            (grant,) = tx.reserve_many([("r", tokens, binding)])
            assert not isinstance(grant, BaseException), grant
        for layer in range(L):
            for tx in txs:
                tx.send_layer(layer, [("r", src_blocks)])
        for tx in txs:
            tx.finish("r")
        assert all(tx.wait_outcome("r", 10).state == "received" for tx in txs)
        params = {"do_remote_prefill": True, PARAM_ID: "r", PARAM_CAP: "cap"}
        assert decode.matched("v", params, prompt, 0) == (tokens, True)
        vblocks = [17, 3, 4, 22, 0]
        decode.allocated("v", vblocks + [8], tokens)
        meta = decode.step_meta()
        loader.start(meta)
        done, deadline = set(), time.monotonic() + 10
        while "v" not in done and time.monotonic() < deadline:
            done |= loader.finished()
            time.sleep(0.001)
        assert done == {"v"} and loader.load_errors() == set()
        decode.loaded(done)
        torch.cuda.synchronize()
        span = lay.layer_block_bytes
        for layer in range(L):
            raw = raws[layer]
            for gi, b in enumerate(vblocks):
                want = bytearray(span)
                for seg in tp_segments(src_lays[0], lay):
                    sarr, sspec = srcs[seg.src_rank], specs[seg.src_rank]
                    s0 = sspec.address(layer, seg.tensor, src_blocks[gi]) - sarr.ctypes.data
                    d0 = lay.tensor_offset(seg.tensor)
                    for c in range(seg.count):
                        s, d = s0 + seg.src_offset + c * seg.src_stride, d0 + seg.dst_offset + c * seg.dst_stride
                        want[d : d + seg.length] = sarr[s : s + seg.length].tobytes()
                got = raw[b].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                assert got == bytes(want), (order, P, layer, gi)
            untouched = raw[8].contiguous().view(torch.uint8).cpu().numpy()  # bound but past the prompt: not written
            assert (untouched.view(np.uint16) == untouched.view(np.uint16)[0]).all()
        assert decode.sched.buffer.num_free == 16 and decode.sched.live_requests() == []
    finally:
        for tx in txs:
            tx.close()
        loader.close()
        decode.close()


def test_vllm_views_with_other_strides_are_refused(torch_cuda):
    torch = torch_cuda
    from pdkv import LayoutError

    lay = KVLayout(num_layers=1, kv_heads=H, head_dim=D, tokens_per_block=N, dtype="bf16", kv_fused="row")
    token_major = torch.empty((NB, N, H, 2 * D), dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)
    with pytest.raises(LayoutError, match="head-major order expects"):
        cache_spec(lay, [token_major])
    with pytest.raises(LayoutError, match=r"pdkv expects \[blocks, 8, 16, 128\]"):
        cache_spec(lay, [torch.empty((NB, H, N, D), dtype=torch.bfloat16, device="cuda")])
