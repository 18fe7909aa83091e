#!/usr/bin/env python3
"""What pdkv's swap costs a decode step running beside it on the same GPU.

A decode-shaped step loop: per layer of an 8B-class model (hidden 4096, 32 query heads and 8
KV heads of 128, MLP 14336; bf16), the QKV projection, attention of one new token per
sequence over ``--ctx`` cached tokens (``scaled_dot_product_attention`` with grouped
queries over a contiguous cache per sequence: the bytes a paged kernel reads), the output
projection and the gated MLP; ``--layers`` layers a step (weights shared across layers,
``--kv-layers`` distinct KV caches cycled), batch ``--batch``, captured in a CUDA graph
(``--no-graph``: launched eagerly). Each step is timed with CUDA events on its stream.

For each batch size, in one run: the step alone, then the step while pdkv's swap engine
copies scattered blocks from a pinned buffer into another GPU allocation as fast as it can,
per strategy: ``auto`` with priority ``throughput`` (the NVRTC kernel, one CTA a piece,
under 128 KiB pieces; the copy engines above), ``auto`` with priority ``decode`` (the copy
engines, libcuda's ``cuMemcpyBatchAsync``, at every size), the kernel capped at ``--ctas``
CTAs, and the copy engines on ``--streams`` streams. Each strategy's window is bracketed by a baseline
window of its own (the step alone just before), so drift reads as drift, not as
interference. Printed: step p50/p99 and their inflation over the bracketing baseline, and
the swap's bandwidth during the window against the one-large-copy ceiling of the same run.

Needs a CUDA GPU and torch.
    python tools/bench_interference.py [--batch 64,256] [--ctx 1024] [--kib 16] [--steps 150] [--swap-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
from _bench import torch_with_cuda

import pdkv


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class Step:
    """One decode step of ``layers`` layers at batch ``b``."""

    def __init__(self, torch, b: int, ctx: int, layers: int, kv_layers: int, graph: bool) -> None:
        t, dev, bf = torch, "cuda", torch.bfloat16
        self.t, self.layers = t, layers
        H, D, QH, KH, F = 4096, 128, 32, 8, 14336
        g = t.Generator(device=dev).manual_seed(0)

        def w(*shape):
            return (t.randn(*shape, device=dev, dtype=bf, generator=g) * 0.02).contiguous()

        self.wqkv, self.wo, self.wgu, self.wd = w(H, (QH + 2 * KH) * D), w(H, H), w(H, 2 * F), w(F, H)
        self.k = [w(b, KH, ctx, D) for _ in range(kv_layers)]
        self.v = [w(b, KH, ctx, D) for _ in range(kv_layers)]
        self.x = w(b, H)
        self.dims = (b, H, D, QH, KH, F)
        self.stream = t.cuda.Stream()
        self.graph = None
        with t.cuda.stream(self.stream):
            for _ in range(2):
                self._body()  # warm-up (and the kernels' autotuning) before capture
        self.stream.synchronize()
        if graph:
            self.graph = t.cuda.CUDAGraph()
            with t.cuda.graph(self.graph, stream=self.stream):
                self._body()

    def _body(self) -> None:
        t = self.t
        b, H, D, QH, KH, F = self.dims
        x = self.x
        for layer in range(self.layers):
            qkv = x @ self.wqkv
            q = qkv[:, : QH * D].view(b, QH, 1, D)
            k, v = self.k[layer % len(self.k)], self.v[layer % len(self.v)]
            a = t.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + a.reshape(b, H) @ self.wo
            gu = x @ self.wgu
            x = x + (t.nn.functional.silu(gu[:, :F]) * gu[:, F:]) @ self.wd
        self.out = x

    def run(self, n: int) -> list[float]:
        """``n`` steps back to back; each one's milliseconds by CUDA events."""
        t = self.t
        evs = [(t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)) for _ in range(n)]
        with t.cuda.stream(self.stream):
            for e0, e1 in evs:
                e0.record(self.stream)
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self._body()
                e1.record(self.stream)
        self.stream.synchronize()
        return [e0.elapsed_time(e1) for e0, e1 in evs]


class Swapper:
    """Copies ``blocks`` scattered buffer blocks into GPU blocks, call after call, on
    ``engines`` (one thread each, a share of the blocks each), until stopped."""

    def __init__(self, engines, src, dst, block_bytes: int) -> None:
        self.engines, self.block_bytes = engines, block_bytes
        k = len(engines)
        self.shares = [(src[i::k], dst[i::k]) for i in range(k)]
        self.bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _loop(self, eng, s, d) -> None:
        while not self._stop.is_set():
            hs = [eng.copy(s, d, direction="h2d") for _ in range(2)]  # two in flight: no gap between calls
            for h in hs:
                h.wait(60)
            with self._lock:
                self.bytes += 2 * len(s) * self.block_bytes

    def start(self) -> None:
        self.bytes, self.t0 = 0, time.perf_counter()
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._loop, args=(e, s, d), daemon=True)
            for e, (s, d) in zip(self.engines, self.shares)
        ]
        for th in self._threads:
            th.start()
        time.sleep(0.2)  # in full flow before the decode window opens
        with self._lock:
            self.bytes, self.t0 = 0, time.perf_counter()

    def stop(self) -> float:
        """GB/s from the window's start to now."""
        with self._lock:
            got, dt = self.bytes, time.perf_counter() - self.t0
        self._stop.set()
        for th in self._threads:
            th.join()
        return got / dt / 1e9


class GatherSwap:
    """The path no strategy of pdkv's takes yet, measured here: CPU threads gather a call's
    scattered buffer blocks into a pinned staging area (pdkv's streaming copy loop,
    ``_ffi.cpu``), the copy engines move it to the GPU in one contiguous copy (the link's
    full rate, no SM), and a scatter kernel of ``ctas`` CTAs puts the blocks in place
    (device memory to device memory, at HBM speed: a short stay on few SMs for the link's
    bytes). Two staging areas alternate, so one call's gather overlaps the previous call's
    copy. The same ``copy``/``wait`` surface as a :class:`pdkv.SwapEngine`."""

    _SRC = r"""
    extern "C" __global__ void scatter(const unsigned char* src, unsigned char* dst,
                                       const long long* idx, long long n, long long block) {
        for (long long i = blockIdx.x; i < n; i += gridDim.x) {
            const uint4* s = (const uint4*)(src + i * block);
            uint4* d = (uint4*)(dst + idx[i] * block);
            for (long long j = threadIdx.x; j < block / 16; j += blockDim.x) d[j] = s[j];
        }
    }"""

    def __init__(self, torch, buf, gpu, block: int, blocks: int, threads: int, ctas: int, chunk_mib: int = 8) -> None:
        import concurrent.futures

        import cupy

        self.t, self.cp, self.block, self.threads, self.ctas = torch, cupy, block, threads, ctas
        self.base, self.gpu = buf.address, gpu
        self.per = max(1, (chunk_mib << 20) // block)  # blocks a chunk: gathered, then copied and scattered
        self.slots = 4  # a ring of staging areas: chunk i+1 gathers while chunk i copies
        self.stage = [torch.empty((self.per, block), dtype=torch.uint8, pin_memory=True) for _ in range(self.slots)]
        self.gstage = [torch.empty((self.per, block), dtype=torch.uint8, device="cuda") for _ in range(self.slots)]
        self.events = [None] * self.slots
        self.stream = torch.cuda.Stream()
        self.kernel = cupy.RawKernel(self._SRC, "scatter")
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)
        self.i = 0

    def _chunk(self, s, d) -> object:
        from pdkv import _ffi

        t, cp, k = self.t, self.cp, self.i % self.slots
        self.i += 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # this staging area's previous chunk has left it
        n = len(s)
        src = self.base + s * self.block
        dst = self.stage[k].data_ptr() + np.arange(n, dtype=np.int64) * self.block
        ln = np.full(n, self.block, dtype=np.int64)
        cuts = [i * n // self.threads for i in range(self.threads + 1)]
        list(
            self.pool.map(
                lambda ab: _ffi.cpu.gather(src[ab[0] : ab[1]], dst[ab[0] : ab[1]], ln[ab[0] : ab[1]]),
                zip(cuts[:-1], cuts[1:]),
            )
        )
        dix = t.as_tensor(d).to("cuda", non_blocking=True)
        with t.cuda.stream(self.stream):
            self.gstage[k][:n].copy_(self.stage[k][:n], non_blocking=True)
            with cp.cuda.ExternalStream(self.stream.cuda_stream):
                args = (
                    self.gstage[k].data_ptr(),
                    self.gpu.data_ptr(),
                    dix.data_ptr(),
                    np.int64(n),
                    np.int64(self.block),
                )
                self.kernel((self.ctas,), (256,), args)
            ev = t.cuda.Event()
            ev.record(self.stream)
        self.events[k] = ev
        return ev

    def copy(self, s, d, direction: str = "h2d"):
        s, d = np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64)
        ev = None
        for a in range(0, len(s), self.per):
            ev = self._chunk(s[a : a + self.per], d[a : a + self.per])

        class _H:
            def wait(self, timeout=None):
                ev.synchronize()

        return _H()

    def close(self) -> None:
        self.stream.synchronize()
        self.pool.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-layers", type=int, default=4, help="distinct KV caches cycled over the layers")
    ap.add_argument("--steps", type=int, default=150, help="steps a window")
    ap.add_argument("--kib", type=int, default=16, help="swap block size (KiB)")
    ap.add_argument("--blocks", type=int, default=4096, help="blocks a swap call")
    ap.add_argument("--ctas", type=int, default=16, help="the capped kernel's CTAs")
    ap.add_argument("--streams", type=int, default=4, help="copy-engine streams of the multi-stream row")
    ap.add_argument("--gather-threads", type=int, default=8, help="CPU threads of the gather prototype")
    ap.add_argument("--gather-ctas", type=int, default=8, help="CTAs of the gather prototype's scatter kernel")
    ap.add_argument("--only", default="", help="comma-separated words: run only strategies whose name has one")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--json", default="", help="write the rows here too")
    a = ap.parse_args()
    torch = torch_with_cuda("bench_interference")
    if torch is None:
        return 2
    torch.cuda.set_device(0)
    size = a.kib << 10
    lay = pdkv.KVLayout(num_layers=1, kv_heads=1, head_dim=512, tokens_per_block=size // 1024, dtype="bf16", mla=True)
    nb = 2 * a.blocks
    buf = pdkv.SharedBuffer.create(nb * size, require_pinned=True)
    gpu = torch.empty(nb * size, dtype=torch.uint8, device="cuda")
    bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address)
    gspec = pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr())
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(nb)[: a.blocks].tolist(), rng.permutation(nb)[: a.blocks].tolist()
    # the ceiling: one large pinned copy of a call's bytes
    pinned = torch.empty(a.blocks * size, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    ts = []
    for _ in range(6):
        t0 = time.perf_counter()
        gpu[: a.blocks * size].copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ceiling = a.blocks * size / statistics.median(ts[1:]) / 1e9
    strategies = {
        "auto (throughput)": lambda: [pdkv.SwapEngine(bspec, gspec, priority="throughput")],
        "auto (decode)": lambda: [pdkv.SwapEngine(bspec, gspec, priority="decode")],
        f"kernel {a.ctas} CTAs": lambda: [pdkv.SwapEngine(bspec, gspec, strategy="kernel", max_ctas=a.ctas)],
        f"copy engines x{a.streams}": lambda: [
            pdkv.SwapEngine(bspec, gspec, strategy="batch") for _ in range(a.streams)
        ],
        f"gather {a.gather_ctas} CTAs (proto)": lambda: [
            GatherSwap(torch, buf, gpu, size, a.blocks, a.gather_threads, a.gather_ctas)
        ],
    }
    if a.only:
        strategies = {k: v for k, v in strategies.items() if any(w in k for w in a.only.split(","))}
    print(
        f"{torch.cuda.get_device_name(0)}; decode step: {a.layers} layers (8B-class, bf16), ctx {a.ctx}, "
        f"{'eager' if a.no_graph else 'CUDA graph'}; swap: {a.blocks} scattered blocks of {a.kib} KiB a call, "
        f"ceiling (one pinned copy) {ceiling:.1f} GB/s; {a.steps} steps a window",
        flush=True,
    )
    print(
        f"{'batch':>5} {'swap':>20} {'p50 ms':>8} {'p99 ms':>8} {'base p50':>8} {'base p99':>8} "
        f"{'p50 +%':>7} {'p99 +%':>7} {'swap GB/s':>9} {'x ceil':>6}",
        flush=True,
    )
    rows = []
    for b in [int(x) for x in a.batch.split(",")]:
        step = Step(torch, b, a.ctx, a.layers, a.kv_layers, not a.no_graph)
        step.run(20)
        for name, make in [("none", None), *strategies.items()]:
            base = step.run(a.steps)
            if make is None:
                got, bw = base, 0.0
            else:
                engines = make()
                try:
                    sw = Swapper(engines, src, dst, size)
                    sw.start()
                    got = step.run(a.steps)
                    bw = sw.stop()
                finally:
                    for e in engines:
                        e.close()
            r = {
                "batch": b,
                "swap": name,
                "p50_ms": statistics.median(got),
                "p99_ms": pct(got, 0.99),
                "base_p50_ms": statistics.median(base),
                "base_p99_ms": pct(base, 0.99),
                "swap_GBps": bw,
                "ceiling_GBps": ceiling,
            }
            r["p50_inflation"] = r["p50_ms"] / r["base_p50_ms"] - 1
            r["p99_inflation"] = r["p99_ms"] / r["base_p99_ms"] - 1
            rows.append(r)
            print(
                f"{b:>5} {name:>20} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['base_p50_ms']:>8.2f} "
                f"{r['base_p99_ms']:>8.2f} {100 * r['p50_inflation']:>6.1f}% {100 * r['p99_inflation']:>6.1f}% "
                f"{bw:>9.1f} {bw / ceiling:>6.2f}",
                flush=True,
            )
        del step
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    buf.close()
    buf.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
