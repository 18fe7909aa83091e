"""Which pieces go wrong with sub-batched cudaMemcpyBatchAsync? python exp/batch_verify.py"""
import numpy as np, torch, pdkv
import pdkv.swap as sw
from pdkv.swap import _batch_spans

N = 4096
rng = np.random.default_rng(0)
for kib in (128, 512):
    size = kib << 10
    lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=size // 1024, dtype="bf16", mla=True)
    nb = 2 * N
    buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
    gpu = torch.empty(nb * size, dtype=torch.uint8, device="cuda")
    host = torch.frombuffer(buf.buf, dtype=torch.uint8)
    host.copy_(torch.randint(0, 256, (nb * size,), dtype=torch.uint8))
    bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address)
    gspec = pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr())
    src = rng.permutation(nb)[:N].tolist(); dst = rng.permutation(nb)[:N].tolist()
    eng = pdkv.SwapEngine(bspec, gspec, strategy="batch")
    for first, cap in [(1 << 30, 1 << 30), (64, 1024), (1024, 1024), (4096, 4096), (2048, 2048), (256, 256)]:
        sw._BATCH_FIRST, sw._BATCH_MAX = first, cap
        gpu.fill_(0xEE); torch.cuda.synchronize()
        eng.copy(src, dst, direction="h2d").wait(60); torch.cuda.synchronize()
        hv, gv = host.view(nb, size), gpu.view(nb, size)
        got = gv.index_select(0, torch.tensor(dst, device="cuda")).cpu()
        exp = hv.index_select(0, torch.tensor(src))
        bad = (got != exp).any(dim=1).nonzero().flatten().tolist()
        spans = _batch_spans(0, N, min(first, 1 << 20), min(cap, 1 << 20))
        which = sorted({i for i, (x, y) in enumerate(spans) for b in bad if x <= b < y})
        print(f"{kib} KiB first={min(first, 99999)} cap={min(cap, 99999)}: {len(bad)} bad pieces; spans hit {which} of {len(spans)}; first bad {bad[:6]}", flush=True)
        if bad:
            b = bad[0]; row_bad = (got[b] != exp[b]).nonzero().flatten()
            print(f"   piece {b}: {row_bad.numel()} bytes differ, from {row_bad[0].item()} to {row_bad[-1].item()}; got[0:4]={got[b][:4].tolist()} poison={0xEE}")
    eng.close(); del gpu, host, hv, gv; torch.cuda.empty_cache(); buf.close(); buf.unlink()
