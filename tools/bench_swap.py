#!/usr/bin/env python3
"""Swap engine bandwidth: scattered blocks between the pinned buffer and GPU blocks.

For each block size, in one run: pdkv (auto strategy: the NVRTC kernel, or the copy
engines for pieces from 128 KiB host->GPU and 256 KiB GPU->host), one
``cudaMemcpyBatchAsync`` call with every piece, a torch per-block ``copy_``
loop (what users write today) and one large contiguous pinned copy of the same bytes
(the ceiling); both directions; every copy verified against random data with a poisoned
destination. pdkv and the ceiling are timed alternately, five times each after a warm-up,
and their medians compared, so that a drift of the link between the two does not read
as a difference (one H200 host gave the ceiling 53.3 GB/s in one timing, 55.3 in the next).

Throughput is the steady state of calls submitted back to back (--reps of them, as the
scheduler keeps swaps in flight): planning a call overlaps the copy before it; only the
first call's planning (0.4-0.9 ms for 4096 blocks) is not overlapped, under 1 % of 64
calls at 16 KiB. The one-call column is a single call's submit-to-done time, planning
included.

``--layout vllm`` lays the GPU cache out as vLLM 0.32+ does (per layer one
``[blocks, heads, tokens, 2 x head_dim]`` view, K and V fused in each row, token-major: the
FlashAttention default, two layers, a block size being one layer's fused block) and
``--layout vllm-cross`` in vLLM's cross-layer order BLHNC (a block's layers side by side),
with pdkv's buffer in the fused layout: the swap vLLM's connector runs in its workers;
``--layout vllm-block``: BLHNC with decode's buffer mirroring it (``buffer_order="block"``),
so a run of blocks is one piece of every layer.

``--ids FILE:SCENARIO`` takes the block ids from ``tools/piece_sizes.py --ids-out`` (a trace
replayed through vLLM's block pool and pdkv's buffer allocator) instead of random
permutations.

Needs a CUDA GPU and torch.  python tools/bench_swap.py [--blocks 4096] [--reps 64] [--layout mla|vllm|vllm-cross]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import numpy as np
from _bench import recorded_ids, torch_with_cuda

import pdkv
from pdkv.native import cuda as _cuda
from pdkv.swap.engine import plan_copy


def _one_call(submit, s_, d_, direction):
    """One copy submitted and waited for: the latency of a single call."""
    submit(s_, d_, direction).wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--sizes-kib", default="16,32,64,128,512")
    ap.add_argument("--reps", type=int, default=64, help="calls submitted back to back per timing")
    ap.add_argument(
        "--layout", choices=["mla", "vllm", "vllm-cross", "vllm-block"], default="mla", help="the caches' layout"
    )
    ap.add_argument(
        "--ids", default="", help="FILE:SCENARIO of tools/piece_sizes.py --ids-out: recorded block ids, not random"
    )
    a = ap.parse_args()
    torch = torch_with_cuda("bench_swap", " (for the torch-loop alternative and the ceiling)")
    if torch is None:
        return 2
    torch.cuda.set_device(0)
    N = a.blocks
    rows, out = [], {}
    rng = np.random.default_rng(0)

    def timed(fn, sync, n=5) -> float:
        fn()
        sync()  # warm-up
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def rep(fn):
        return lambda: [fn() for _ in range(a.reps)]

    def interleaved(pdkv_fn, ceiling_fn, n=5) -> tuple[float, float]:
        """Medians of ``n`` timings each, taken alternately (A B A B ...) after a warm-up."""
        pdkv_fn()
        ceiling_fn()
        torch.cuda.synchronize()
        ps, cs = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            pdkv_fn()
            ps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ceiling_fn()
            torch.cuda.synchronize()
            cs.append(time.perf_counter() - t0)
        return statistics.median(ps), statistics.median(cs)

    what = {
        "mla": "one layer",
        "vllm": "vLLM's fused layout, 2 layers",
        "vllm-cross": "vLLM's BLHNC, 2 layers",
        "vllm-block": "vLLM's BLHNC and a block-outermost buffer, 2 layers",
    }
    print(
        f"{N} scattered blocks per call ({what[a.layout]}; KiB per layer), {a.reps} calls back to back, "
        "GB/s (ratio to the one-large-copy ceiling)"
    )
    print(
        f"{'KiB':>5} {'dir':>4} {'pdkv':>14} {'1 batch call':>14} "
        f"{'torch loop':>14} {'ceiling':>8} {'pdkv 1 call ms':>15}",
        flush=True,
    )

    def one_size(kib: int) -> int:
        """Measure one block size into ``rows`` and ``out``; 1 if a copy was wrong."""
        size = kib << 10
        if a.layout == "mla":
            L, T = 1, size // (2 * 512)
            lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=T, dtype="bf16", mla=True)
        else:  # a layer's fused block of 8 heads of 128 (bf16): K and V of size / 4 KiB tokens
            L, T = 2, size // (8 * 2 * 128 * 2)
            lay = pdkv.KVLayout(
                num_layers=L,
                kv_heads=8,
                head_dim=128,
                tokens_per_block=T,
                dtype="bf16",
                kv_fused="row",
                token_major=True,
            )
        assert lay.block_bytes == L * size
        if a.ids:
            src, dst, nb = recorded_ids(a.ids, N)
        else:
            nb = 2 * N
            src = rng.permutation(nb)[:N].tolist()
            dst = rng.permutation(nb)[:N].tolist()
        total = N * size * L
        buf = pdkv.SharedBuffer.create(nb * size * L, require_pinned=True)
        gpu = torch.empty(nb * size * L, dtype=torch.uint8, device="cuda")
        block_buf = a.layout == "vllm-block"
        bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address, order="block" if block_buf else "layer")
        if a.layout in ("vllm-cross", "vllm-block"):  # BLHNC: block b's layer l at (b x L + l) x size
            gspec = pdkv.CacheSpec.vllm(lay, nb, [(gpu.data_ptr() + li * size, L * size) for li in range(L)])
        else:
            gspec = pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr())
        host = torch.frombuffer(buf.buf, dtype=torch.uint8)
        host.copy_(torch.randint(0, 256, (nb * size * L,), dtype=torch.uint8))
        res = {}
        # pinned torch tensor: the torch loop's source and the ceiling's
        pinned = torch.empty((nb, size * L), dtype=torch.uint8, pin_memory=True)
        pinned.copy_(host.view(nb, size * L))
        flat = pinned.view(-1)[:total]

        def ceiling(direction):
            if direction == "h2d":
                return lambda: gpu[:total].copy_(flat, non_blocking=True)
            return lambda: flat.copy_(gpu[:total], non_blocking=True)

        eng = pdkv.SwapEngine(bspec, gspec, strategy="auto")
        bare_stream = _cuda.stream_create(nonblocking=True)

        class StreamDone:
            def wait(self, timeout):
                _cuda.stream_synchronize(bare_stream)

        def one_batch_call(s_, d_, direction):
            # the alternative as a user would write it: the same addresses, all pieces in
            # one cudaMemcpyBatchAsync call
            sp, dp = (bspec, gspec) if direction == "h2d" else (gspec, bspec)
            p = plan_copy(sp, dp, s_, d_)
            _cuda.memcpy_batch_async(p.dst.tolist(), p.src.tolist(), p.lengths.tolist(), bare_stream)
            return StreamDone()

        methods = {"auto": lambda s_, d_, direction: eng.copy(s_, d_, direction=direction), "batch": one_batch_call}
        for strat, submit in methods.items():
            for direction in ("h2d", "d2h"):
                # verify once: poison the destination, copy, compare every pair
                if direction == "h2d":
                    gpu.fill_(0xEE)
                    # the fill runs on torch's stream, the copies on their own non-blocking
                    # ones: without this the fill could land after the copy
                    torch.cuda.synchronize()
                else:
                    saved = host.clone()
                    host.fill_(0x55)
                s_, d_ = (src, dst) if direction == "h2d" else (dst, src)
                submit(s_, d_, direction).wait(60)
                torch.cuda.synchronize()
                # [layer, block, bytes] on both sides, whatever the GPU cache's order
                hv = host.view(nb, L, size).transpose(0, 1) if block_buf else host.view(L, nb, size)
                cross = a.layout in ("vllm-cross", "vllm-block")
                gv = gpu.view(nb, L, size).transpose(0, 1) if cross else gpu.view(L, nb, size)
                ok = torch.equal(
                    gv.index_select(1, torch.tensor(dst, device="cuda")).cpu(), hv.index_select(1, torch.tensor(src))
                )
                if not ok:
                    print(f"VERIFY FAILED: {strat} {direction} {kib} KiB", file=sys.stderr)
                    return 1
                if direction == "d2h":
                    host.copy_(saved)
                    del saved

                # throughput: `reps` calls submitted back to back (as the scheduler does),
                # so planning the next overlaps the copy in flight; latency: one call alone
                def burst(submit=submit, s_=s_, d_=d_, direction=direction):
                    hs = [submit(s_, d_, direction) for _ in range(a.reps)]
                    for h in hs:
                        h.wait(60)

                if strat == "auto":  # alternating with the ceiling, five of each
                    ts, cs = interleaved(burst, rep(ceiling(direction)))
                    res[(strat, direction)] = total * a.reps / ts / 1e9
                    res[("ceiling", direction)] = total * a.reps / cs / 1e9
                else:
                    res[(strat, direction)] = total * a.reps / timed(burst, lambda: None) / 1e9
                lat = timed(functools.partial(_one_call, submit, s_, d_, direction), lambda: None)
                res[(strat, direction, "latency_ms")] = lat * 1e3
        eng.close()
        _cuda.stream_destroy(bare_stream)
        # torch per-block copy_ loop from a pinned tensor (what users write today): pieces of
        # one block's bytes over all its layers (vLLM's per-layer caches would take one copy per
        # layer and block: this alternative copies the same bytes in fewer, larger pieces)
        gv = gpu.view(nb, size * L)

        def torch_loop_h2d():
            for s_, d_ in zip(src, dst):
                gv[d_].copy_(pinned[s_], non_blocking=True)

        def torch_loop_d2h():
            for s_, d_ in zip(src, dst):
                pinned[s_].copy_(gv[d_], non_blocking=True)

        res[("torch", "h2d", "latency_ms")] = timed(torch_loop_h2d, torch.cuda.synchronize) * 1e3
        res[("torch", "h2d")] = total * a.reps / timed(rep(torch_loop_h2d), torch.cuda.synchronize) / 1e9
        res[("torch", "d2h")] = total * a.reps / timed(rep(torch_loop_d2h), torch.cuda.synchronize) / 1e9
        for direction in ("h2d", "d2h"):
            c = res[("ceiling", direction)]
            rows.append(
                (
                    kib,
                    direction,
                    res[("auto", direction)],
                    res[("batch", direction)],
                    res[("torch", direction)],
                    c,
                    res[("auto", direction, "latency_ms")],
                )
            )
            _, d, k, b, t, c, lat = rows[-1]
            print(
                f"{kib:>5} {d:>4} {k:>7.1f} ({k / c:.2f}) {b:>7.1f} ({b / c:.2f}) {t:>7.1f} ({t / c:.2f}) {c:>8.1f} "
                f"{lat:>15.2f}",
                flush=True,
            )
        out[kib] = res
        host = hv = gv = pinned = flat = gpu = None  # GPU and pinned memory freed before the next size
        torch.cuda.empty_cache()
        buf.close()
        buf.unlink()
        return 0

    for kib in [int(x) for x in a.sizes_kib.split(",")]:
        if one_size(kib):
            return 1
    print("(throughput: calls submitted back to back; 1 call: submit-to-done wall time of one call, planning included)")
    h2d = [r[2] / r[5] for r in rows if r[1] == "h2d"]
    d2h = [r[2] / r[5] for r in rows if r[1] == "d2h"]
    s128 = out.get(128)
    if s128:
        one = s128[("torch", "h2d", "latency_ms")] / s128[("auto", "h2d", "latency_ms")]
        burst = s128[("auto", "h2d")] / s128[("torch", "h2d")]
        print(f"128 KiB h2d, pdkv vs torch per-block loop: {one:.2f}x for one call, {burst:.2f}x back to back")
    print(
        json.dumps(
            {
                "min_ratio_vs_ceiling_h2d": round(min(h2d), 3),
                "min_ratio_vs_ceiling_d2h": round(min(d2h), 3),
                "speedup_vs_torch_128k": round(one, 2) if s128 else None,
                "speedup_vs_torch_128k_back_to_back": round(burst, 2) if s128 else None,
                "blocks": N,
                "layout": a.layout,
                "reps": a.reps,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
