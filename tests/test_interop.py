from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv import CacheSpec, KVLayout, LayoutError, aligned_empty, cache_from_tensors, tensor_info


def lay(**kw):
    base = dict(num_layers=2, kv_heads=4, head_dim=8, tokens_per_block=4, dtype="float16")
    base.update(kw)
    return KVLayout(**base)


def test_numpy_fastdeploy_cache():
    L = lay()
    ts = [[np.zeros((10, 4, 4, 8), np.float16) for _ in range(2)] for _ in range(2)]
    spec = cache_from_tensors(L, ts)
    assert spec.num_blocks == 10 and spec.device is None
    assert spec.address(1, "v", 3) == ts[1][1].ctypes.data + 3 * L.tensor_block_bytes(1)
    info = tensor_info(ts[0][0])
    assert info.contiguous and info.dtype == "float16" and info.nbytes == ts[0][0].nbytes


def test_mismatches_are_named():
    L = lay()
    good = lambda: np.zeros((10, 4, 4, 8), np.float16)  # noqa: E731
    with pytest.raises(LayoutError, match=r"layer 1 v: shape \(10, 4, 4, 16\)"):
        cache_from_tensors(L, [[good(), good()], [good(), np.zeros((10, 4, 4, 16), np.float16)]])
    with pytest.raises(LayoutError, match="layer 0 k: dtype float32"):
        cache_from_tensors(L, [[np.zeros((10, 4, 4, 8), np.float32), good()], [good(), good()]])
    with pytest.raises(LayoutError, match="not contiguous"):
        cache_from_tensors(L, [[np.zeros((10, 4, 8, 4), np.float16).transpose(0, 1, 3, 2), good()], [good(), good()]])
    with pytest.raises(LayoutError, match="3 layers"):
        cache_from_tensors(L, [[good(), good()]] * 3)
    with pytest.raises(LayoutError, match="cannot read a tensor"):
        tensor_info(object())


def test_vllm_layouts_with_numpy():
    L = lay(token_major=True)
    fa = [np.zeros((2, 10, 4, 4, 8), np.float16) for _ in range(2)]
    spec = cache_from_tensors(L, fa, engine="vllm_flash_attn")
    bb = L.tensor_block_bytes(0)
    assert spec.address(0, "v", 1) == fa[0].ctypes.data + 10 * bb + bb
    fi = [np.zeros((10, 2, 4, 4, 8), np.float16) for _ in range(2)]
    spec = cache_from_tensors(L, fi, engine="flashinfer")
    assert spec.address(1, "v", 2) == fi[1].ctypes.data + 2 * 2 * bb + bb


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    L = lay(dtype="bfloat16")
    ts = [[torch.zeros((6, 4, 4, 8), dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)]
    spec = cache_from_tensors(L, ts)
    assert spec.address(0, "k", 1) == ts[0][0].data_ptr() + L.tensor_block_bytes(0)
    with pytest.raises(LayoutError, match="not contiguous"):
        cache_from_tensors(L, [[ts[0][0].transpose(2, 3).contiguous().transpose(2, 3), ts[0][1]], ts[1]])


def test_paddle_cpu_tensors():
    paddle = pytest.importorskip("paddle")
    L = lay(dtype="float16")
    ts = [[paddle.zeros([6, 4, 4, 8], dtype="float16") for _ in range(2)] for _ in range(2)]
    spec = cache_from_tensors(L, ts)
    info = tensor_info(ts[1][0])
    assert info.kind == "paddle" and info.device is None and info.dtype == "float16"
    assert spec.address(1, "k", 2) == ts[1][0].data_ptr() + 2 * L.tensor_block_bytes(0)
    # zero-copy: writing through numpy at the pointer shows up in the paddle tensor
    arr = np.from_dlpack(ts[0][0]) if hasattr(np, "from_dlpack") else ts[0][0].numpy()
    arr[0, 0, 0, 0] = 3.0
    assert float(ts[0][0][0, 0, 0, 0]) == 3.0


@pytest.mark.cuda
def test_torch_and_cupy_cuda_tensors(cuda_device):
    torch = pytest.importorskip("torch")
    L = lay(dtype="bfloat16")
    ts = [[torch.zeros((6, 4, 4, 8), dtype=torch.bfloat16, device="cuda") for _ in range(2)] for _ in range(2)]
    spec = cache_from_tensors(L, ts)
    assert spec.device == 0
    cupy = pytest.importorskip("cupy")
    cs = [[cupy.zeros((6, 4, 4, 8), dtype=cupy.float16) for _ in range(2)] for _ in range(2)]
    spec = cache_from_tensors(lay(), cs)
    assert spec.address(0, "k", 0) == cs[0][0].data.ptr and spec.device == 0


@given(st.integers(1, 1 << 20), st.integers(0, 21))
def test_aligned_empty_is_aligned_sized_and_owned(nbytes, k):
    a = aligned_empty(nbytes, 1 << k)
    assert a.dtype == np.uint8 and a.shape == (nbytes,) and a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % (1 << k) == 0
    a[:] = 7  # the whole range is ours
    assert a.base is not None and a.base.nbytes >= nbytes  # the allocation lives as long as the view


@pytest.mark.parametrize(
    "nbytes, align, what",
    [
        (-1, 64, "nbytes"),
        (0, 64, "nbytes"),
        (1.5, 64, "nbytes"),
        (True, 64, "nbytes"),
        (64, 3, "align"),
        (64, 0, "align"),
        (64, 1 << 22, "align"),
    ],
)
def test_aligned_empty_refuses_bad_arguments(nbytes, align, what):
    with pytest.raises(ValueError, match=what):
        aligned_empty(nbytes, align)


def test_cache_spec_alignment_is_the_worst_address():
    lay = KVLayout(num_layers=2, kv_heads=1, head_dim=64, tokens_per_block=16, dtype="bf16")
    assert lay.tensor_block_bytes(0) == 2048
    buf = aligned_empty(CacheSpec.buffer_bytes(lay, 8) + 64)
    assert CacheSpec.for_buffer(lay, 8, buf.ctypes.data).alignment == 2048  # the stride bounds it
    assert CacheSpec.for_buffer(lay, 8, buf.ctypes.data + 16).alignment == 16
    assert CacheSpec.for_buffer(lay, 8, buf.ctypes.data + 64).alignment == 64
