#!/usr/bin/env python3
"""A GPU decode's staged device destination in SGLang (``pdkv.integrations.sglang.staged``):
the swap engine copying a request's pages from pdkv's staging buffer (a pinned shared-memory
segment, pdkv's buffer layout: one region per layer and K/V) into a CUDA KV pool shaped like
SGLang's MHA pool (per layer a K and a V buffer of ``[pages x page_size, heads, head_dim]``,
bf16), described by SGLang-style ``KVArgs`` through pdkv's own ``rank_pools`` and copied as
``DecodeRank`` copies it (``SwapEngine(priority="decode")``: the copy engines), against the
one-copy ceiling of the same bytes (one pinned host -> GPU copy) in the same run.

Per page size (SGLang's ``--page-size``: 1 by default on a GPU) and page order (``fresh``:
the request's pages consecutive, as a fresh pool hands them out; ``shuffled``: scattered
over the pool, as after churn), a request of ``--tokens`` tokens of an 8B-class model
(``--layers`` 32, ``--heads`` 8 KV heads of ``--dim`` 128): the copy's milliseconds (median
of ``--reps`` after a warm-up), GB/s and its share of the ceiling, the pieces (runs of pages
consecutive on both sides, per layer and K/V) and their mean size; ``--strategies`` adds
priority ``throughput`` (the NVRTC kernel under 128 KiB pieces). Every copy is verified:
the destination pages poisoned before, compared with the staging buffer after.

    python tools/bench_sglang_staged.py [--page 1,16,64] [--tokens 4096] [--reps 5]

Needs a CUDA GPU and torch. The last line is one JSON object: the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import numpy as np
from _bench import torch_with_cuda

import pdkv
from pdkv.integrations.sglang.layouts import rank_pools
from pdkv.plan import plan_copy


def sglang_pool(torch, layers: int, heads: int, dim: int, page: int, pages: int):
    """SGLang's MHA KV pool on the GPU and the ``KVArgs`` a backend is given for it."""
    bufs = [
        torch.empty(((pages + 1) * page, heads, dim), dtype=torch.bfloat16, device="cuda") for _ in range(2 * layers)
    ]
    item = page * heads * dim * 2
    args = types.SimpleNamespace(
        engine_rank=0,
        kv_data_ptrs=[b.data_ptr() for b in bufs],  # every layer's K, then every layer's V
        kv_data_lens=[b.numel() * 2 for b in bufs],
        kv_item_lens=[item] * len(bufs),
        kv_cache_dtype_str="bfloat16",
        page_size=page,
        total_kv_head_num=heads,
        state_types=[],
    )
    return bufs, args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", default="1,16,64", help="SGLang page sizes (tokens)")
    ap.add_argument("--tokens", type=int, default=4096, help="the request's tokens")
    ap.add_argument("--pool-tokens", type=int, default=131072, help="SGLang's device pool (tokens)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--order", default="fresh,shuffled")
    ap.add_argument("--strategies", default="decode", help="swap priorities: decode, throughput")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch = torch_with_cuda("bench_sglang_staged")
    if torch is None:
        return 2
    torch.cuda.set_device(0)
    rng = np.random.default_rng(0)
    rows = []
    print(
        f"{torch.cuda.get_device_name(0)}; a request of {a.tokens} tokens, {a.layers} layers x K,V x {a.heads} heads "
        f"of {a.dim}, bf16; SGLang pool {a.pool_tokens} tokens; staging buffer -> SGLang's pool, verified",
        flush=True,
    )
    print(
        f"{'page':>5} {'order':>9} {'priority':>10} {'pieces':>7} {'KiB/piece':>9} {'ms':>8} {'GB/s':>7} "
        f"{'ceil GB/s':>9} {'x ceil':>6}",
        flush=True,
    )
    for page in [int(x) for x in a.page.split(",")]:
        n = a.tokens // page
        pool_pages = a.pool_tokens // page
        bufs, args = sglang_pool(torch, a.layers, a.heads, a.dim, page, pool_pages)
        pools = rank_pools(args, mla=False, tp_size=1, device=0)
        lay = pools.layout
        staging = pdkv.SharedBuffer.create(pdkv.CacheSpec.buffer_bytes(lay, n), require_pinned=True)
        staged = pdkv.CacheSpec.for_buffer(lay, n, staging.address)
        host = np.frombuffer(staging.buf, dtype=np.uint8)
        host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)
        nbytes = lay.block_bytes * n
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        scratch = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        ts = []
        for _ in range(a.reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            scratch.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        ceiling = nbytes / statistics.median(ts[1:]) / 1e9
        src = list(range(n))  # a fresh staging buffer's blocks, as StagedPages hands them out
        for order in a.order.split(","):
            dst = list(range(1, n + 1)) if order == "fresh" else (rng.permutation(pool_pages)[:n] + 1).tolist()
            plan = plan_copy(staged, pools.device, src, dst)
            for prio in a.strategies.split(","):
                eng = pdkv.SwapEngine(staged, pools.device, buffer_pinned=staging.pinned, priority=prio)
                try:
                    times = []
                    for _rep in range(a.reps + 1):
                        for b in bufs:
                            b.view(torch.uint8).fill_(0xA5)  # poisoned: every byte must be written
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        eng.copy(src, dst).wait(120)
                        times.append(time.perf_counter() - t0)
                    # verified: each page of each layer's K and V is the staging block's bytes
                    idx = torch.as_tensor(dst, device="cuda")
                    for li in range(a.layers):
                        for t in range(2):
                            got = bufs[t * a.layers + li].view(-1, page * a.heads * a.dim)[idx]
                            want = host[staged.address(li, t, 0) - staging.address :][: n * lay.tensor_block_bytes(t)]
                            assert np.array_equal(got.view(torch.uint8).cpu().numpy().ravel(), want), (page, li, t)
                finally:
                    eng.close()
                ms = 1000 * statistics.median(times[1:])
                bw = nbytes / (ms / 1000) / 1e9
                r = {
                    "page": page,
                    "order": order,
                    "priority": prio,
                    "pieces": plan.pieces,
                    "piece_kib": plan.nbytes / plan.pieces / 1024,
                    "ms": ms,
                    "GBps": bw,
                    "ceiling_GBps": ceiling,
                    "of_ceiling": bw / ceiling,
                }
                rows.append(r)
                print(
                    f"{page:>5} {order:>9} {prio:>10} {plan.pieces:>7} {r['piece_kib']:>9.1f} {ms:>8.2f} {bw:>7.1f} "
                    f"{ceiling:>9.1f} {bw / ceiling:>6.2f}",
                    flush=True,
                )
        del host, want, got  # views of the segment: dropped before it closes
        staging.close()
        staging.unlink()
        del bufs, pinned, scratch
        torch.cuda.empty_cache()
    print(json.dumps({"tool": "bench_sglang_staged", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
