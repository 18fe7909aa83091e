from __future__ import annotations

import numpy as np
import pytest

from pdkv import KVLayout, LayoutError, cache_from_tensors, tensor_info


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
