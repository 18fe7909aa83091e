"""The tool's prefill side: one rank's cache filled with the pattern and sent layer by layer."""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

import numpy as np

from ... import _ffi
from ...errors import PdkvError
from ...integrations.interop import aligned_empty
from ...layout import CacheSpec, KVLayout
from ...scheduling.blocks import BlockPool
from ...swap.engine import SwapEngine
from ...transfer import PrefillSender, RequestOutcome
from .workload import UsageError, layout_kw, make_workload, parse_devices, pattern, request_key


def instance_key_from_env() -> bytes | None:
    """``$PDKV_INSTANCE_KEY`` (hex): the key the ranks of one prefill instance, started as
    separate processes, share (SenderOptions.instance_key); None when unset."""
    v = os.environ.get("PDKV_INSTANCE_KEY")
    if not v:
        return None
    try:
        key = bytes.fromhex(v)
    except ValueError:
        raise UsageError("PDKV_INSTANCE_KEY must be hex digits (e.g. from: openssl rand -hex 32)") from None
    if len(key) < 16:
        raise UsageError("PDKV_INSTANCE_KEY must hold at least 16 bytes (32 hex digits)")
    return key


def run_prefill(a: argparse.Namespace, emit: Any) -> int:
    """One prefill rank: generate the workload's KV, send it, report every request."""
    lay = KVLayout(**layout_kw(a), tp_size=a.prefill_tp, tp_rank=a.rank)
    work = make_workload(a)
    need = max(lay.blocks_for_tokens(r.tokens) for r in work)
    nb = max(a.prefill_blocks, need)
    pdevs = parse_devices(a.prefill_devices, "--prefill-devices")
    gpu = _GpuPrefillCache(lay, nb, pdevs[a.rank % len(pdevs)]) if prefill_on_gpu(a) else None
    if gpu is not None:
        # the KV is "computed" into a pinned host mirror and copied into the GPU cache
        # layer by layer on the engine's stream; the sender waits on each layer's event
        cache, spec = gpu.mirror, gpu.spec
    else:
        # page-aligned, as an engine's allocator gives it: np.zeros would start 16 bytes
        # into its page, which costs block copies on some CPUs (docs/PERF.md)
        cache = aligned_empty(lay.block_bytes * nb)
        cache[:] = 0
        spec = CacheSpec.for_buffer(lay, nb, cache.ctypes.data)
    host_spec = CacheSpec.for_buffer(lay, nb, cache.ctypes.data)  # where the pattern is written
    pool = BlockPool(nb, "prefill")
    sem = threading.Semaphore(a.concurrency)
    cv = threading.Condition()
    held: dict[str, list[int]] = {}
    t0 = time.monotonic()
    failed = 0

    def on_outcome(o: RequestOutcome) -> None:
        nonlocal failed
        with cv:
            blocks = held.pop(o.request_id, None)
            if blocks:
                pool.free(blocks)
            failed += not o.ok
            cv.notify_all()
        emit({"type": "outcome", "rid": o.request_id, "state": o.state, "reason": o.reason, "t": time.monotonic() - t0})
        sem.release()

    try:
        tx = PrefillSender(
            lay,
            spec,
            a.connect,
            instance=a.instance,
            instance_key=instance_key_from_env(),
            secret=a.secret.encode() if a.secret else None,
            transport=a.transport,
            streams=a.streams,
            timeout_s=a.timeout,
            on_outcome=on_outcome,
            rdma_device=a.rdma_device,
            rdma_gid_index=a.rdma_gid_index,
        )
    except BaseException:
        if gpu is not None:
            gpu.close()
        raise
    copy = None
    if tx.transport == "shm" and gpu is None:  # host cache into decode's buffer: which copy runs
        copy = "streaming loop" if _ffi.cpu.available() else f"numpy ({_ffi.cpu.unavailable_reason()})"
    emit({"type": "hello", "rank": a.rank, "transport": tx.transport, "path": tx.stats["path"], "copy": copy})
    pm = None
    if getattr(a, "metrics_port", None) is not None:
        from ...metrics import PrefillMetrics

        pm = PrefillMetrics([tx])
        port = pm.serve(a.metrics_port, a.metrics_addr)
        emit({"type": "metrics", "url": f"http://{a.metrics_addr}:{port}/metrics"})
    t0 = time.monotonic()  # arrivals count from here: connected, cache filled, ready to serve
    regions = {
        (layer, t): host_spec.region(layer, t) for layer in range(lay.total_layers) for t in range(len(lay.tensors))
    }
    base = cache.ctypes.data
    seq = [0]  # layers of the sender's layer_log already reported

    def report_layers() -> None:
        """The layers written since the last call, as one event: their seconds (send_layer
        to writes done) and when this rank was writing (monotonic, host-wide: the link's busy
        time); the run's figures are streamed, never held per request."""
        new, seq[0] = tx.layer_log.since(seq[0])
        if not new:
            return
        emit({"type": "layers", "s": [x[1] for x in new], "w": [[round(x[3], 6), round(x[4], 6)] for x in new]})

    try:
        for r in work:
            report_layers()
            if a.duration and time.monotonic() - t0 > a.duration:
                break
            delay = r.arrival - (time.monotonic() - t0)
            if delay > 0:
                time.sleep(delay)
            if not sem.acquire(timeout=a.timeout * 4):
                emit({"type": "outcome", "rid": r.rid, "state": "failed", "reason": "no outcome slot in time"})
                failed += 1
                continue
            n = lay.blocks_for_tokens(r.tokens)
            with cv:
                blocks = pool.try_allocate(n)
                deadline = time.monotonic() + a.timeout * 4
                while blocks is None and time.monotonic() < deadline:
                    cv.wait(0.1)
                    blocks = pool.try_allocate(n)
            if blocks is None:
                emit({"type": "outcome", "rid": r.rid, "state": "failed", "reason": "prefill cache full"})
                failed += 1
                sem.release()
                continue
            ts = time.monotonic()
            try:
                g = tx.reserve(r.rid, r.tokens)
            except PdkvError as exc:
                pool.free(blocks)
                failed += 1
                emit({"type": "outcome", "rid": r.rid, "state": "failed", "reason": str(exc)})
                sem.release()
                continue
            with cv:
                held[r.rid] = blocks
            emit(
                {
                    "type": "grant",
                    "rid": r.rid,
                    "blocks": len(g.blocks),
                    "wait": time.monotonic() - ts,
                    "tokens": r.tokens,
                }
            )
            tg = time.monotonic()  # granted: prefill computes from here
            rk = request_key(r.rid)
            gis = np.arange(n)
            idx = np.asarray(blocks)
            for layer in range(lay.total_layers):
                for t in range(len(lay.tensors)):  # "compute" layer L: write its KV
                    rb, stride = regions[(layer, t)]
                    region = cache[rb - base : rb - base + stride * nb].reshape(nb, stride)
                    region[idx, : lay.tensor_block_bytes(t)] = pattern(lay, rk, layer, t, gis)
                if a.layer_ms:
                    time.sleep(a.layer_ms / 1000)
                ev = gpu.to_gpu(layer, idx) if gpu is not None else None
                tx.send_layer(layer, [(r.rid, blocks)], event=ev)
            # the last layer computed: prefill's first token, counted from the request's arrival
            now = time.monotonic()
            emit({"type": "computed", "rid": r.rid, "ttft": now - t0 - r.arrival, "compute": now - tg})
            tx.finish(r.rid)
            # the server's whole time on it: asking for blocks (and waiting) to handing it off
            emit({"type": "served", "rid": r.rid, "busy": time.monotonic() - ts})
        # wait for the outstanding outcomes (bounded)
        deadline = time.monotonic() + a.timeout * 6
        with cv:
            while held and time.monotonic() < deadline:
                cv.wait(0.1)
        lost = list(held)
    finally:
        report_layers()
        stats = dict(tx.stats)
        if pm is not None:
            pm.close()
        tx.close()
        if gpu is not None:
            gpu.close()
    emit(
        {
            "type": "summary",
            "rank": a.rank,
            "failed": failed + len(lost),
            "bytes": stats["bytes"],
            "elapsed": time.monotonic() - t0,
        }
    )
    return 1 if failed or lost else 0


def prefill_on_gpu(a: argparse.Namespace) -> bool:
    return bool(a.prefill_gpu) or a.transport == "cuda_ipc"


class _GpuPrefillCache:
    """A prefill rank's cache in GPU memory (pdkv's buffer layout, on ``device``), filled
    from a pinned host mirror one layer at a time on its own stream, one event per layer."""

    def __init__(self, lay: KVLayout, nb: int, device: int = 0) -> None:
        _ffi.cuda.set_device(device)  # this process's one device, as an engine rank's
        size = lay.block_bytes * nb
        self.lay, self.nb = lay, nb
        self._host = self._dev = self._stream = 0
        self._events: list[int] = []
        self._eng: SwapEngine | None = None
        try:
            self._host = _ffi.cuda.malloc_host(size)
            self._dev = _ffi.cuda.malloc(size)
            self.mirror = np.frombuffer(_ffi.libc.host_view(self._host, size), np.uint8)
            self.mirror[:] = 0
            self._mspec = CacheSpec.for_buffer(lay, nb, self._host)
            self.spec = CacheSpec.for_buffer(lay, nb, self._dev, device=device)
            self._stream = _ffi.cuda.stream_create(nonblocking=True)
            self._eng = SwapEngine(self._mspec, self.spec, strategy="auto", stream=self._stream)
            self._events = [_ffi.cuda.event_create() for _ in range(lay.total_layers)]
        except BaseException:
            self.close()
            raise

    def to_gpu(self, layer: int, blocks: np.ndarray) -> int:
        """Queue the copy of ``blocks`` of ``layer`` into the GPU cache; its event."""
        assert self._eng is not None
        from ...plan import plan_copy

        self._eng.copy_plan(plan_copy(self._mspec, self.spec, blocks, blocks, layers=[layer]), direction="h2d")
        ev = self._events[layer]
        _ffi.cuda.event_record(ev, self._stream)
        return ev

    def close(self) -> None:
        if self._stream:
            _ffi.cuda.stream_synchronize(self._stream)
        if self._eng is not None:
            self._eng.close()
            self._eng = None
        for ev in self._events:
            _ffi.cuda.event_destroy(ev)
        self._events = []
        if self._stream:
            _ffi.cuda.stream_destroy(self._stream)
            self._stream = 0
        self.mirror = np.zeros(0, np.uint8)  # drop the view before the memory goes
        if self._dev:
            _ffi.cuda.free(self._dev)
            self._dev = 0
        if self._host:
            _ffi.cuda.free_host(self._host)
            self._host = 0
