#!/usr/bin/env python3
"""What pdkv's swap costs a decode step running beside it on the same GPU.

A decode-shaped step loop: per layer of an 8B-class model (hidden 4096, 32 query heads and 8
KV heads of 128, MLP 14336; bf16), the QKV projection, attention of one new token per
sequence over ``--ctx`` cached tokens (``scaled_dot_product_attention`` with grouped
queries over a contiguous cache per sequence: the bytes a paged kernel reads), the output
projection and the gated MLP; ``--layers`` layers a step (weights shared across layers,
``--kv-layers`` distinct KV caches cycled), batch ``--batch``, captured in a CUDA graph
(``--no-graph``: launched eagerly). Each step is timed with CUDA events on its stream.

Two ways to time a step, both in one run (``--sync``): ``window``, every step of a window
enqueued back to back and synchronised once at its end (the host is always ahead of the GPU:
no host-side delay can show), and ``step``, each step launched and then waited for before the
next, as a decode engine runs it (it needs the sampled tokens to schedule the next step):
the host's milliseconds from launch to seeing the step end, so the swap's host-side work in
the same process shows too.

For each step length (``--layers``: 8 layers is a short step, about 2 ms on an H100/H200, 32
a long one, about 8 ms) and batch size, in one run: the step alone, then the step while
pdkv's swap engine copies scattered blocks from a pinned buffer into another GPU allocation
as fast as it can, per strategy: ``auto`` with priority ``throughput`` (the NVRTC kernel,
one CTA a piece, under 128 KiB pieces; the copy engines above), ``auto`` with priority
``decode`` (the copy engines, libcuda's ``cuMemcpyBatchAsync``, at every size), ``auto``
(decode) in a process of its own (``own process``: its own interpreter, pinned buffer and
GPU allocation, so only the GPU and the link are shared with the step: what remains of the
interference is not host-side), the same bytes a call from consecutive ids in a process of
its own (``one contiguous copy``: one piece a call in a block-outermost or one-layer cache,
one a layer otherwise; what the one-copy ceiling itself costs the step), the
kernel capped at each of ``--ctas`` CTAs, and the copy engines on ``--streams`` streams.
Each strategy's window is bracketed by a baseline window of its own (the step alone just
before), so drift reads as drift, not as interference. Printed: step p50/p99 and their
inflation over the bracketing baseline, and the swap's bandwidth during the window against
the one-large-copy ceiling of the same run.

Needs a CUDA GPU and torch.
    python tools/bench_interference.py [--layers 8,32] [--batch 64] [--ctx 1024] [--kib 16] [--steps 150]
        [--sync window,step] [--only decode]

``--ids FILE:SCENARIO`` takes the block ids from ``tools/piece_sizes.py --ids-out`` (a trace
replayed through vLLM's block pool and pdkv's buffer allocator) instead of a random
permutation: a run of ids consecutive on both sides is one piece of the swap.

A piece of 2048 KiB is one whole block of an 8B-class model in a block-outermost cache
(32 layers x K and V x 8 heads x 16 tokens x 128 x bf16); 64 KiB one layer's K or V block of
64 tokens in a per-layer cache; 16 KiB of 16 tokens. The last line is one JSON object: the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
from _bench import recorded_ids, torch_with_cuda

import pdkv
import pdkv.plan


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

    def run_synced(self, n: int) -> list[float]:
        """``n`` steps, each waited for before the next is launched (an engine waits for a
        step's sampled tokens): the host's milliseconds from launch to seeing its end."""
        t = self.t
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            with t.cuda.stream(self.stream):
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self._body()
            self.stream.synchronize()
            out.append((time.perf_counter() - t0) * 1000)
        return out

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

    def __init__(self, engines, src, dst, block_bytes: int, rate: float = 0.0, chunk: int = 0) -> None:
        self.engines, self.block_bytes = engines, block_bytes
        self.rate, self.chunk = rate, chunk  # paced: calls of `chunk` blocks, held to `rate` bytes/s
        k = len(engines)
        self.shares = [(src[i::k], dst[i::k]) for i in range(k)]
        self.bytes = 0
        self.host: list[float] = []  # seconds a call held the calling thread (planning, submitting)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _loop(self, eng, s, d) -> None:
        if self.rate:
            self._paced(eng, s, d)
            return
        while not self._stop.is_set():
            t0 = time.perf_counter()
            hs = [eng.copy(s, d, direction="h2d") for _ in range(2)]  # two in flight: no gap between calls
            self.host.append((time.perf_counter() - t0) / 2)
            for h in hs:
                h.wait(60)
            with self._lock:
                self.bytes += 2 * len(s) * self.block_bytes

    def _paced(self, eng, s, d) -> None:
        """One call of ``chunk`` blocks at a time, then a pause that holds the average to
        ``rate``: the swap an engine would pace to leave the decode step room."""
        t0, sent, i = time.perf_counter(), 0, 0
        while not self._stop.is_set():
            j = min(i + self.chunk, len(s))
            eng.copy(s[i:j], d[i:j], direction="h2d").wait(60)
            n = (j - i) * self.block_bytes
            i = 0 if j == len(s) else j
            sent += n
            with self._lock:
                self.bytes += n
            ahead = sent / self.rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)

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


def cache_layout(size: int, layers: int) -> pdkv.KVLayout:
    """A cache of ``layers`` layers whose one layer of a block is ``size`` bytes."""
    return pdkv.KVLayout(
        num_layers=layers, kv_heads=1, head_dim=512, tokens_per_block=size // 1024, dtype="bf16", mla=True
    )


def _swap_child(size: int, layers: int, order: str, nb: int, src, dst, stop, moved, ready) -> None:
    """The swap in a process of its own: its own pinned buffer and GPU allocation, the copy
    engines (priority ``decode``), two calls in flight, bytes counted in ``moved``. With
    ``src`` and ``dst`` both ``range(n)`` a call is one contiguous piece a layer (one piece
    block-outermost): the ceiling's own cost to the step."""
    import torch

    torch.cuda.set_device(0)
    lay = cache_layout(size, layers)
    buf = pdkv.SharedBuffer.create(nb * lay.block_bytes, require_pinned=True)
    gpu = torch.empty(nb * lay.block_bytes, dtype=torch.uint8, device="cuda")
    eng = pdkv.SwapEngine(
        pdkv.CacheSpec.for_buffer(lay, nb, buf.address, order=order),
        pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr(), order=order),
        priority="decode",
    )
    try:
        ready.set()
        while not stop.is_set():
            hs = [eng.copy(src, dst, direction="h2d") for _ in range(2)]
            for h in hs:
                h.wait(60)
            with moved.get_lock():
                moved.value += 2 * len(src) * lay.block_bytes
    finally:
        eng.close()
        buf.close()
        buf.unlink()


class ProcessSwapper:
    """:class:`Swapper`'s surface over :func:`_swap_child` in a spawned process."""

    def __init__(self, size: int, layers: int, order: str, nb: int, src, dst, contiguous: bool = False) -> None:
        import multiprocessing as mp

        if contiguous:  # the same bytes a call from consecutive ids: the one-copy ceiling
            src = dst = list(range(len(src)))

        ctx = mp.get_context("spawn")
        self.stop_ev, self.ready = ctx.Event(), ctx.Event()
        self.moved = ctx.Value("q", 0)
        self.proc = ctx.Process(
            target=_swap_child,
            args=(size, layers, order, nb, src, dst, self.stop_ev, self.moved, self.ready),
            daemon=True,
        )

    def start(self) -> None:
        self.proc.start()
        if not self.ready.wait(120):
            raise RuntimeError("the swap process did not start")
        time.sleep(0.5)  # in full flow before the window opens
        self.b0, self.t0 = self.moved.value, time.perf_counter()

    def stop(self) -> float:
        got, dt = self.moved.value - self.b0, time.perf_counter() - self.t0
        self.stop_ev.set()
        self.proc.join(60)
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
    ap.add_argument("--batch", default="64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--layers", default="8,32", help="layers a step, a comma-separated list (8: ~2 ms, 32: ~8 ms)")
    ap.add_argument("--sync", default="window,step", help="window (steps back to back), step (each waited for)")
    ap.add_argument("--kv-layers", type=int, default=4, help="distinct KV caches cycled over the layers")
    ap.add_argument("--steps", type=int, default=150, help="steps a window")
    ap.add_argument("--kib", type=int, default=16, help="one layer of a block (KiB)")
    ap.add_argument("--cache-layers", type=int, default=1, help="layers of the cache (a block moves all of them)")
    ap.add_argument(
        "--cache-order", choices=["layer", "block"], default="layer", help="both caches per layer or block-outermost"
    )
    ap.add_argument("--blocks", type=int, default=4096, help="blocks a swap call")
    ap.add_argument(
        "--ids", default="", help="FILE:SCENARIO of tools/piece_sizes.py --ids-out: recorded block ids, not random"
    )
    ap.add_argument("--ctas", default="16", help="the capped kernel's CTAs: a row for each of a comma-separated list")
    ap.add_argument("--streams", type=int, default=4, help="copy-engine streams of the multi-stream row")
    ap.add_argument("--gather-threads", type=int, default=8, help="CPU threads of the gather prototype")
    ap.add_argument("--gather-ctas", type=int, default=8, help="CTAs of the gather prototype's scatter kernel")
    ap.add_argument("--pace", default="", help="fractions of the ceiling: rows of auto (decode) held to each")
    ap.add_argument("--pace-mib", type=int, default=16, help="a paced call's MiB (default 16)")
    ap.add_argument("--only", default="", help="comma-separated words: run only strategies whose name has one")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument(
        "--batch-cap",
        type=int,
        default=0,
        help="pieces a driver batch call at most, first call included (default: the engine's 64 then doubling to 1024)",
    )
    ap.add_argument(
        "--switch-interval", type=float, default=0.0, help="this process's sys.setswitchinterval (s; default 0.005)"
    )
    ap.add_argument("--json", default="", help="write the rows here too")
    a = ap.parse_args()
    if a.batch_cap:  # the in-process swap's driver calls, smaller (the own-process rows keep the default)
        import pdkv.swap.engine as engine

        engine._BATCH_FIRST = engine._BATCH_MAX = a.batch_cap
    if a.switch_interval:
        import sys

        sys.setswitchinterval(a.switch_interval)
    torch = torch_with_cuda("bench_interference")
    if torch is None:
        return 2
    torch.cuda.set_device(0)
    size = a.kib << 10
    ctas = [int(x) for x in a.ctas.split(",") if x]
    if not ctas or min(ctas) < 1:
        ap.error(f"--ctas {a.ctas!r}: positive integers, comma-separated")
    lay = cache_layout(size, a.cache_layers)
    bb = lay.block_bytes  # every layer of a block
    if a.ids:  # the ids an engine's allocators hand out: runs of consecutive ids are one piece
        src, dst, nb = recorded_ids(a.ids, a.blocks)
    else:  # a random permutation: every block a piece of its own
        nb = 2 * a.blocks
        rng = np.random.default_rng(0)
        src, dst = rng.permutation(nb)[: a.blocks].tolist(), rng.permutation(nb)[: a.blocks].tolist()
    buf = pdkv.SharedBuffer.create(nb * bb, require_pinned=True)
    gpu = torch.empty(nb * bb, dtype=torch.uint8, device="cuda")
    bspec = pdkv.CacheSpec.for_buffer(lay, nb, buf.address, order=a.cache_order)
    gspec = pdkv.CacheSpec.for_buffer(lay, nb, gpu.data_ptr(), order=a.cache_order)
    pieces = pdkv.plan.plan_copy(bspec, gspec, src, dst).pieces
    # the ceiling: one large pinned copy of a call's bytes
    pinned = torch.empty(a.blocks * bb, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    ts = []
    for _ in range(6):
        t0 = time.perf_counter()
        gpu[: a.blocks * bb].copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ceiling = a.blocks * bb / statistics.median(ts[1:]) / 1e9
    strategies = {
        "auto (throughput)": lambda: [pdkv.SwapEngine(bspec, gspec, priority="throughput")],
        "auto (decode)": lambda: [pdkv.SwapEngine(bspec, gspec, priority="decode")],
        "auto (decode), own process": "process",
        "one contiguous copy, own process": "ceiling",
        **{
            f"kernel {c} CTAs": (lambda c=c: [pdkv.SwapEngine(bspec, gspec, strategy="kernel", max_ctas=c)])
            for c in ctas
        },
        f"copy engines x{a.streams}": lambda: [
            pdkv.SwapEngine(bspec, gspec, strategy="batch") for _ in range(a.streams)
        ],
        f"gather {a.gather_ctas} CTAs (proto)": lambda: [
            GatherSwap(torch, buf, gpu, bb, a.blocks, a.gather_threads, a.gather_ctas)
        ],
    }
    if a.only:
        strategies = {k: v for k, v in strategies.items() if any(w in k for w in a.only.split(","))}
    paced = {}
    for f in [float(x) for x in a.pace.split(",") if x]:
        if not 0 < f < 1:
            ap.error(f"--pace {f}: fractions of the ceiling, between 0 and 1")
        paced[f"auto (decode) paced {f:g}"] = f
        strategies[f"auto (decode) paced {f:g}"] = lambda: [pdkv.SwapEngine(bspec, gspec, priority="decode")]
    chunk = max(1, (a.pace_mib << 20) // bb)
    if a.cache_layers > 1 and any(k.startswith("gather") for k in strategies):
        strategies = {k: v for k, v in strategies.items() if not k.startswith("gather")}  # one layer only
    layers = [int(x) for x in a.layers.split(",")]
    modes = [m for m in a.sync.split(",") if m]
    if set(modes) - {"window", "step"}:
        ap.error(f"--sync {a.sync!r}: window, step or both")
    print(
        f"{torch.cuda.get_device_name(0)}; decode step: {a.layers} layers (8B-class, bf16), ctx {a.ctx}, "
        f"{'eager' if a.no_graph else 'CUDA graph'}; swap: {a.blocks} blocks of {a.cache_layers} x {a.kib} KiB "
        f"({a.cache_order}-outermost caches) a call in {pieces} "
        f"pieces ({'ids of ' + a.ids if a.ids else 'random ids'}), "
        f"ceiling (one pinned copy) {ceiling:.1f} GB/s; {a.steps} steps a window; timed: {a.sync}"
        + (f"; in-process batch calls of {a.batch_cap} pieces" if a.batch_cap else "")
        + (f"; switch interval {a.switch_interval:g} s" if a.switch_interval else ""),
        flush=True,
    )
    print(
        f"{'layers':>6} {'batch':>5} {'sync':>6} {'swap':>26} {'p50 ms':>8} {'p99 ms':>8} {'base p50':>8} "
        f"{'base p99':>8} {'p50 +%':>7} {'p99 +%':>7} {'swap GB/s':>9} {'x ceil':>6} {'host ms p50/max a call':>13}",
        flush=True,
    )
    rows = []
    for nl in layers:
        for b in [int(x) for x in a.batch.split(",")]:
            step = Step(torch, b, a.ctx, nl, a.kv_layers, not a.no_graph)
            step.run(20)
            for mode in modes:
                timed = step.run if mode == "window" else step.run_synced
                for name, make in [("none", None), *strategies.items()]:
                    base = timed(a.steps)
                    host: list[float] = []
                    if make is None:
                        got, bw = base, 0.0
                    elif make in ("process", "ceiling"):
                        sw = ProcessSwapper(size, a.cache_layers, a.cache_order, nb, src, dst, make == "ceiling")
                        sw.start()
                        try:
                            got = timed(a.steps)
                        finally:
                            bw = sw.stop()
                    else:
                        engines = make()
                        try:
                            rate = paced.get(name, 0.0) * ceiling * 1e9
                            sw = Swapper(engines, src, dst, bb, rate=rate, chunk=chunk)
                            sw.start()
                            got = timed(a.steps)
                            bw = sw.stop()
                            host = sw.host
                        finally:
                            for e in engines:
                                e.close()
                    r = {
                        "layers": nl,
                        "batch": b,
                        "sync": mode,
                        "kib": a.kib,
                        "cache_layers": a.cache_layers,
                        "cache_order": a.cache_order,
                        "host_ms_p50": 1e3 * statistics.median(host) if host else None,
                        "host_ms_max": 1e3 * max(host) if host else None,
                        "ids": a.ids or "random",
                        "pieces": pieces,
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
                        f"{nl:>6} {b:>5} {mode:>6} {name:>26} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                        f"{r['base_p50_ms']:>8.2f} {r['base_p99_ms']:>8.2f} {100 * r['p50_inflation']:>6.1f}% "
                        f"{100 * r['p99_inflation']:>6.1f}% {bw:>9.1f} {bw / ceiling:>6.2f} "
                        + (f"{r['host_ms_p50']:>6.2f} {r['host_ms_max']:>6.2f}" if host else f"{'-':>6} {'-':>6}"),
                        flush=True,
                    )
            del step
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    buf.close()
    buf.unlink()
    print(json.dumps({"tool": "bench_interference", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
