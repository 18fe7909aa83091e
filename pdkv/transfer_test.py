"""``pdkv-transfer-test``: validate and size a prefill/decode pair.

With no arguments it runs ``local`` mode: a decode instance in this process (CPU buffer,
swap into GPU blocks, or host memory standing in for them without a GPU) and prefill
ranks in child processes, a stream of requests sent layer by layer through the buffer,
every byte verified in the decode's (GPU) blocks, and a summary.

``decode --listen ADDR`` and ``prefill --connect ADDR`` run the two sides on two hosts.

``--prefill-gpu`` keeps each prefill rank's cache in GPU memory (shm then writes the
buffer with the swap engine's kernel); ``--transport cuda_ipc`` (same host, a GPU) has
prefill write decode's GPU blocks directly, and the buffer only when they are full. Under
the default ``auto``, decode with GPU blocks serves cuda_ipc too, so ``--prefill-gpu``
alone gets what an engine's GPU-cache sender gets: cuda_ipc where the GPUs reach each
other, else shm. Prefill ranks with host caches (the default) take shm or tcp.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _ffi
from .blocks import BlockPool
from .errors import PdkvError
from .interop import aligned_empty
from .layout import CacheSpec, KVLayout
from .scheduler import DecodeScheduler, Event, SchedulerOptions
from .shm import SharedBuffer
from .swap import SwapEngine, SwapGroup
from .transfer import DecodeReceiver, PrefillSender, RequestOutcome

__all__ = ["main", "PRESETS"]

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(num_layers=32, kv_heads=8, head_dim=128, tokens_per_block=64, dtype="bfloat16"),
    "llama3-70b": dict(num_layers=80, kv_heads=8, head_dim=128, tokens_per_block=64, dtype="bfloat16"),
    "qwen2.5-7b": dict(num_layers=28, kv_heads=4, head_dim=128, tokens_per_block=64, dtype="bfloat16"),
    "qwen2.5-72b": dict(num_layers=80, kv_heads=8, head_dim=128, tokens_per_block=64, dtype="bfloat16"),
    "deepseek-v3": dict(num_layers=61, kv_heads=1, head_dim=576, tokens_per_block=64, dtype="bfloat16", mla=True),
    "tiny": dict(num_layers=4, kv_heads=4, head_dim=64, tokens_per_block=16, dtype="bfloat16"),
}
MiB = 1 << 20


class UsageError(Exception):
    """Bad flags or configuration: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, no usage dump
        raise UsageError(message)


# ---------------------------------------------------------------------- data pattern

def _keys(rkey: int, layer: int, t: int, gis: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """uint32 key per (block index in the request, global head)."""
    with np.errstate(over="ignore"):
        k = (np.uint32(rkey) * np.uint32(0x9E3779B1) + np.uint32(layer) * np.uint32(0x85EBCA77)
             + np.uint32(t) * np.uint32(0xC2B2AE3D))
        return (k + gis.astype(np.uint32)[:, None] * np.uint32(0x27D4EB2F)
                + heads.astype(np.uint32)[None, :] * np.uint32(0x165667B1))


def _pattern(lay: KVLayout, rkey: int, layer: int, t: int, gis: np.ndarray) -> np.ndarray:
    """Expected content of blocks ``gis`` (indices within the request) of one rank:
    uint8 array [len(gis), tensor_block_bytes]. Head-major: head h's slice holds
    arange + key(h), so any misplaced head, token or block shows."""
    h0, h1 = lay.head_range()
    tb = lay.tensor_block_bytes(t)
    words = tb // lay.heads_per_rank // 4
    keys = _keys(rkey, layer, t, gis, np.arange(h0, h1))
    with np.errstate(over="ignore"):
        v = np.arange(words, dtype=np.uint32)[None, None, :] + keys[:, :, None]
    return v.reshape(len(gis), -1).view(np.uint8)


def request_key(rid: str) -> int:
    return zlib.crc32(rid.encode())


# ---------------------------------------------------------------------- workload

@dataclass(frozen=True, slots=True)
class Req:
    rid: str
    arrival: float
    tokens: int
    output: int


def make_workload(a: argparse.Namespace) -> list[Req]:
    rng = np.random.default_rng(a.seed)
    if a.trace:
        out = []
        try:
            with open(a.trace) as f:
                for i, line in enumerate(f):
                    if a.trace_limit and len(out) >= a.trace_limit:
                        break
                    d = json.loads(line)
                    out.append(Req(f"t{i}", d["timestamp"] / 1000.0 * a.time_scale, int(d["input_length"]),
                                   int(d.get("output_length", 1))))
        except (OSError, ValueError, KeyError) as exc:
            raise UsageError(f"--trace {a.trace}: {exc}") from None
        if not out:
            raise UsageError(f"--trace {a.trace}: no requests")
        return out
    n = a.requests
    dist = a.prompt_len
    try:
        if ":" not in dist:
            lens = np.full(n, int(dist))
        else:
            kind, *ps = dist.split(":")
            ps = [float(x) for x in ps]
            if kind == "uniform":
                lens = rng.integers(int(ps[0]), int(ps[1]) + 1, n)
            elif kind == "lognormal":
                lens = np.maximum(1, rng.lognormal(math.log(ps[0]), ps[1], n)).astype(int)
            else:
                raise ValueError(kind)
    except (ValueError, IndexError):
        raise UsageError(f"--prompt-len {dist!r}: use N, uniform:MIN:MAX or lognormal:MEDIAN:SIGMA") from None
    if (lens <= 0).any():
        raise UsageError("--prompt-len must be positive")
    gaps = rng.exponential(1.0 / a.rate, n) if a.rate > 0 else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [Req(f"r{i}", float(arrivals[i]), int(lens[i]), 1) for i in range(n)]


def workload_buffer_blocks(reqs: list[Req], concurrency: int, tokens_per_block: int) -> int:
    """Buffer blocks per rank that hold the ``concurrency`` largest requests of the workload
    at once: what the tool's decode needs when it sizes the buffer itself."""
    sizes = sorted((-(-r.tokens // tokens_per_block) for r in reqs), reverse=True)
    return sum(sizes[:max(1, concurrency)])


def _layout_kw(a: argparse.Namespace) -> dict[str, Any]:
    if a.model not in PRESETS:
        raise UsageError(f"--model {a.model!r}: choose one of {', '.join(PRESETS)}")
    kw = dict(PRESETS[a.model])
    for f, attr in (("num_layers", "layers"), ("kv_heads", "kv_heads"), ("head_dim", "head_dim"),
                    ("tokens_per_block", "tokens_per_block"), ("dtype", "dtype")):
        v = getattr(a, attr)
        if v is not None:
            kw[f] = v
    return kw


# ---------------------------------------------------------------------- decode side

@dataclass
class _Track:
    reserved: float = 0.0
    received: float = 0.0
    ready: float = 0.0
    state: str = ""
    reason: str = ""
    blocks: int = 0
    location: str = ""


@dataclass
class DecodeSide:
    a: argparse.Namespace
    lay_kw: dict[str, Any]
    tracks: dict[str, _Track] = field(default_factory=dict)
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    verify_errors: int = 0
    bytes_verified: int = 0
    failures: list[str] = field(default_factory=list)

    def start(self, listen: str) -> None:
        a = self.a
        D = a.decode_tp
        self.lays = [KVLayout(**self.lay_kw, tp_size=D, tp_rank=r) for r in range(D)]
        lay = self.lays[0]
        if a.buffer_blocks:
            nb = a.buffer_blocks
        elif a.buffer_gib is not None:
            nb = lay.blocks_for_bytes(int(a.buffer_gib * (1 << 30)))
        else:  # sized to the workload: room for the largest requests that can be in flight at once
            nb = workload_buffer_blocks(make_workload(a), a.concurrency, lay.tokens_per_block)
        if nb <= 0:
            raise UsageError(f"--buffer-gib {a.buffer_gib} holds no block of {lay.block_bytes} bytes")
        gpu_blocks = a.gpu_blocks or nb
        self.nb, self.gpu_blocks = nb, gpu_blocks
        self.cuda = _ffi.cuda.device_count() > 0 and not a.no_gpu
        self.devices = _devices(a.decode_devices, "--decode-devices")  # decode rank r on devices[r % n]
        # cuda_ipc asked for (_check_args made sure of a GPU and no --no-gpu), or under auto
        # with GPU blocks: served beside the others, as a decode engine with GPU caches
        # would; only prefill ranks with GPU caches on this host take it
        ipc = a.transport == "cuda_ipc" or (a.transport == "auto" and self.cuda)
        gspecs: list[CacheSpec] = []
        self.bufs = []
        self.gpu_mem: list[Any] = []
        engines = []
        try:
            for L in self.lays:
                try:
                    b = SharedBuffer.create(CacheSpec.buffer_bytes(L, nb), pin="always" if self.cuda else "never")
                except OSError as exc:
                    if exc.errno not in (errno.ENOMEM, errno.ENOSPC):
                        raise
                    raise UsageError(f"the decode buffer of {nb} blocks per rank cannot be made: {exc.strerror} "
                                     "(size it with --buffer-gib or --buffer-blocks)") from None
                self.bufs.append(b)
                size = L.block_bytes * gpu_blocks
                dev = None
                if self.cuda:
                    dev = self.devices[L.tp_rank % len(self.devices)]
                    with _ffi.cuda.on_device(dev):
                        ptr = _ffi.cuda.malloc(size)
                    self.gpu_mem.append(ptr)
                    gspecs.append(CacheSpec.for_buffer(L, gpu_blocks, ptr, device=dev))
                else:
                    arr = aligned_empty(size)  # page-aligned, as a real cache would be
                    arr[:] = 0
                    self.gpu_mem.append(arr)
                    ptr = arr.ctypes.data
                engines.append(SwapEngine(CacheSpec.for_buffer(L, nb, b.address),
                                          CacheSpec.for_buffer(L, gpu_blocks, ptr, device=dev),
                                          strategy="auto" if self.cuda else "host", buffer_pinned=self.cuda))
            self.engines = engines
            self.sched = DecodeScheduler(
                num_layers=lay.total_layers, gpu=BlockPool(gpu_blocks, "gpu"), buffer=BlockPool(nb, "buffer"),
                swap=SwapGroup(engines), block_bytes=lay.block_bytes * D,
                # cuda_ipc: GPU blocks granted at reservation while there are any (written
                # by prefill directly), the buffer and a swap after that
                options=SchedulerOptions(direct_to_gpu=ipc, lease_s=a.lease_s, on_full="queue",
                                         queue_timeout_s=a.timeout * 4),
                listener=self._on_event)
            self.rx = DecodeReceiver(self.sched, self.lays, self.bufs, nb, control=listen, data_host=a.data_host,
                                     secret=a.secret.encode() if a.secret else None, auto_tick=True,
                                     transports=_served(a.transport, ipc), gpu_caches=gspecs if ipc else None,
                                     peer_timeout_s=a.timeout)
        except BaseException:
            self.close()
            raise
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._engine = threading.Thread(target=self._engine_loop, name="decode-engine", daemon=True)
        self._engine.start()

    def _on_event(self, ev: Event) -> None:
        tr = self.tracks.setdefault(ev.request_id, _Track())
        if ev.kind in ("reserved", "granted"):
            tr.reserved = ev.t
            tr.blocks = len(ev.grant.blocks) if ev.grant else 0
            tr.location = ev.grant.location if ev.grant else ""
        elif ev.kind == "received":
            tr.received = ev.t
        elif ev.kind == "ready" and not tr.received:  # a GPU grant (cuda_ipc): landed is ready
            tr.received = ev.t
        elif ev.kind in ("failed", "expired", "aborted", "rejected"):
            tr.state, tr.reason = ev.kind, ev.reason

    def _gpu_block(self, rank: int, layer: int, t: int, blocks: Sequence[int]) -> np.ndarray:
        L = self.lays[rank]
        tb = L.tensor_block_bytes(t)
        mem = self.gpu_mem[rank]
        spec_base = (mem if isinstance(mem, int) else mem.ctypes.data)
        spec = CacheSpec.for_buffer(L, self.gpu_blocks, spec_base)
        out = np.empty((len(blocks), tb), np.uint8)
        if isinstance(mem, int):
            for i, b in enumerate(blocks):
                _ffi.cuda.memcpy(out[i].ctypes.data, spec.address(layer, t, b), tb)
        else:
            base, stride = spec.region(layer, t)
            region = mem[base - spec_base: base - spec_base + stride * self.gpu_blocks].reshape(self.gpu_blocks, stride)
            out[:] = region[np.asarray(blocks)][:, :tb]
        return out

    def verify(self, rid: str, blocks: Sequence[int]) -> None:
        rk = request_key(rid)
        gis = np.arange(len(blocks))
        bad = 0
        for r, L in enumerate(self.lays):
            for layer in range(L.total_layers):
                for t in range(len(L.tensors)):
                    got = self._gpu_block(r, layer, t, blocks)
                    want = _pattern(L, rk, layer, t, gis)
                    nbad = int((got != want).any(axis=1).sum())
                    bad += nbad
                    self.bytes_verified += got.size
        if bad:
            self.verify_errors += bad
            self.failures.append(f"{rid}: {bad} blocks differ")

    def _engine_loop(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            ready = self.sched.take_ready()
            for r in ready:
                tr = self.tracks.setdefault(r.request_id, _Track())
                tr.ready = self.sched.clock()
                if not self.a.no_verify:
                    self.verify(r.request_id, r.gpu_blocks)
                tr.state = "ready"
                self.sched.finish(r.request_id)
            now = time.monotonic()
            if now - last >= 0.05:
                last = now
                m = self.sched.metrics()
                self.timeline.append((now - self.t0, int(m["buffer_blocks_total"] - m["buffer_blocks_free"]),
                                      int(m["gpu_blocks_total"] - m["gpu_blocks_free"]), int(self.rx.stats["bytes"])))
            if not ready:
                time.sleep(0.001)

    def close(self) -> None:
        if getattr(self, "_engine", None) is not None:
            self._stop.set()
            self._engine.join(5)
        if getattr(self, "rx", None) is not None:
            self.rx.close()
        for e in getattr(self, "engines", []):
            e.close()
        for m in self.gpu_mem:
            if isinstance(m, int):
                _ffi.cuda.free(m)
        self.gpu_mem = []
        for b in self.bufs:
            try:
                b.close()
            except PdkvError:
                pass
            b.unlink()
        self.bufs = []


# ---------------------------------------------------------------------- prefill side

def run_prefill(a: argparse.Namespace, emit: Any) -> int:
    """One prefill rank: generate the workload's KV, send it, report every request."""
    lay = KVLayout(**_layout_kw(a), tp_size=a.prefill_tp, tp_rank=a.rank)
    work = make_workload(a)
    need = max(lay.blocks_for_tokens(r.tokens) for r in work)
    nb = max(a.prefill_blocks, need)
    pdevs = _devices(a.prefill_devices, "--prefill-devices")
    gpu = _GpuPrefillCache(lay, nb, pdevs[a.rank % len(pdevs)]) if _prefill_gpu(a) else None
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
        tx = PrefillSender(lay, spec, a.connect, instance=a.instance, secret=a.secret.encode() if a.secret else None,
                           transport=a.transport, streams=a.streams, timeout_s=a.timeout, on_outcome=on_outcome)
    except BaseException:
        if gpu is not None:
            gpu.close()
        raise
    copy = None
    if tx.transport == "shm" and gpu is None:  # host cache into decode's buffer: which copy runs
        copy = "streaming loop" if _ffi.cpu.available() else f"numpy ({_ffi.cpu.unavailable_reason()})"
    emit({"type": "hello", "rank": a.rank, "transport": tx.transport, "copy": copy})
    regions = {(layer, t): host_spec.region(layer, t) for layer in range(lay.total_layers) for t in range(len(lay.tensors))}
    base = cache.ctypes.data
    try:
        for r in work:
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
            emit({"type": "grant", "rid": r.rid, "blocks": len(g.blocks), "wait": time.monotonic() - ts,
                  "tokens": r.tokens})
            rk = request_key(r.rid)
            gis = np.arange(n)
            idx = np.asarray(blocks)
            for layer in range(lay.total_layers):
                for t in range(len(lay.tensors)):  # "compute" layer L: write its KV
                    rb, stride = regions[(layer, t)]
                    region = cache[rb - base: rb - base + stride * nb].reshape(nb, stride)
                    region[idx, :lay.tensor_block_bytes(t)] = _pattern(lay, rk, layer, t, gis)
                if a.layer_ms:
                    time.sleep(a.layer_ms / 1000)
                ev = gpu.to_gpu(layer, idx) if gpu is not None else None
                tx.send_layer(layer, [(r.rid, blocks)], event=ev)
            tx.finish(r.rid)
        # wait for the outstanding outcomes (bounded)
        deadline = time.monotonic() + a.timeout * 6
        with cv:
            while held and time.monotonic() < deadline:
                cv.wait(0.1)
        lost = list(held)
    finally:
        layers = list(tx.layer_log)
        stats = dict(tx.stats)
        tx.close()
        if gpu is not None:
            gpu.close()
    emit({"type": "summary", "rank": a.rank, "failed": failed + len(lost), "layer_s": [x[1] for x in layers],
          "bytes": stats["bytes"], "elapsed": time.monotonic() - t0})
    return 1 if failed or lost else 0


def _prefill_gpu(a: argparse.Namespace) -> bool:
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
        from .swap import plan_copy

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


# ---------------------------------------------------------------------- report

def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def build_report(dec: DecodeSide, prefill: list[dict[str, Any]], outcomes: dict[str, str], elapsed: float,
                 lay: KVLayout, D: int, reasons: dict[str, str] | None = None) -> dict[str, Any]:
    ready = [t for t in dec.tracks.values() if t.state == "ready"]
    inst_block = lay.block_bytes * D
    per_req_gbps = [t.blocks * inst_block / (t.received - t.reserved) / 1e9 for t in ready if t.received > t.reserved]
    ttr = [t.received - t.reserved for t in ready if t.received]
    tready = [t.ready - t.reserved for t in ready if t.ready]
    layer_s = [x for p in prefill for x in p.get("layer_s", [])]
    total_bytes = sum(t.blocks for t in ready) * inst_block
    m = dec.sched.metrics()
    failed_ids = {rid for rid, st in outcomes.items() if st != "received"}
    failed_ids |= {rid for rid, t in dec.tracks.items() if t.state not in ("ready", "")}
    peak_buf = int(m["buffer_blocks_peak"])
    return {
        "requests": len(set(outcomes) | set(dec.tracks)),
        "requests_ready": len(ready),
        "requests_into_gpu_blocks": sum(1 for t in ready if t.location == "gpu"),
        "requests_failed": len(failed_ids),
        "bytes_verified": dec.bytes_verified,
        "verify_errors": dec.verify_errors,
        "bytes_transferred": total_bytes,
        "elapsed_s": elapsed,
        "throughput_GBps_mean": total_bytes / elapsed / 1e9 if elapsed > 0 else 0.0,
        "request_GBps_p50": _pct(per_req_gbps, 50),
        "request_GBps_p99": _pct(per_req_gbps, 1),  # the rate 99% of requests beat (slow tail)
        "layer_latency_ms_p50": _pct(layer_s, 50) * 1e3,
        "layer_latency_ms_p99": _pct(layer_s, 99) * 1e3,
        "time_to_received_ms_p50": _pct(ttr, 50) * 1e3,
        "time_to_received_ms_p99": _pct(ttr, 99) * 1e3,
        "time_to_ready_ms_p50": _pct(tready, 50) * 1e3,
        "time_to_ready_ms_p99": _pct(tready, 99) * 1e3,
        "peak_buffer_blocks": peak_buf,
        "buffer_blocks": dec.nb,
        "peak_buffer_occupancy": peak_buf / dec.nb if dec.nb else 0.0,
        "swap_GBps": m["swap_bytes"] / m["swap_busy_seconds"] / 1e9 if m["swap_busy_seconds"] else 0.0,
        "prefill_wait_avoided_s_total": m["prefill_wait_avoided_seconds_sum"],
        "prefill_wait_avoided_s_max": m["prefill_wait_avoided_seconds_max"],
        "gpu": dec.cuda,
        "failures": sorted(dec.failures)[:20] + sorted(_failure_line(r, outcomes, dec, reasons or {})
                                                      for r in list(failed_ids)[:20]),
    }


def _failure_line(rid: str, outcomes: dict[str, str], dec: DecodeSide, reasons: dict[str, str]) -> str:
    tr = dec.tracks.get(rid, _Track())
    why = reasons.get(rid) or tr.reason
    return f"{rid}: {outcomes.get(rid, tr.state)}" + (f" ({why})" if why else "")


def print_report(rep: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title="pdkv transfer test", show_header=True)
    t.add_column("figure")
    t.add_column("value", justify="right")
    fmt = {
        "requests": "{:d}", "requests_ready": "{:d}", "requests_into_gpu_blocks": "{:d}", "requests_failed": "{:d}",
        "verify_errors": "{:d}",
        "bytes_verified": "{:,d}", "bytes_transferred": "{:,d}", "elapsed_s": "{:.2f}",
        "throughput_GBps_mean": "{:.2f}", "request_GBps_p50": "{:.2f}", "request_GBps_p99": "{:.2f}",
        "layer_latency_ms_p50": "{:.2f}", "layer_latency_ms_p99": "{:.2f}", "time_to_received_ms_p50": "{:.1f}",
        "time_to_received_ms_p99": "{:.1f}", "time_to_ready_ms_p50": "{:.1f}", "time_to_ready_ms_p99": "{:.1f}",
        "peak_buffer_blocks": "{:d}", "peak_buffer_occupancy": "{:.0%}", "swap_GBps": "{:.2f}",
        "prefill_wait_avoided_s_total": "{:.2f}", "prefill_wait_avoided_s_max": "{:.3f}",
    }
    if rep.get("transports_chosen"):
        t.add_row("transport", ", ".join(rep["transports_chosen"]))
    if rep.get("shm_copy"):
        t.add_row("shm copy", ", ".join(rep["shm_copy"]))
    for side in ("prefill", "decode"):
        if rep.get(f"{side}_devices"):
            t.add_row(f"{side} GPUs (by rank)", ", ".join(map(str, rep[f"{side}_devices"])))
    for k, f in fmt.items():
        v = rep[k]
        t.add_row(k, "n/a" if isinstance(v, float) and math.isnan(v) else f.format(v))
    console.print(t)
    for line in rep["failures"]:
        console.print(f"[red]{line}[/red]")


def write_plot(path: str, dec: DecodeSide) -> None:
    tl = dec.timeline
    if path.endswith(".html"):
        if not tl:
            tl = [(0.0, 0, 0, 0)]
        W, H = 800, 300
        tmax = max(x[0] for x in tl) or 1.0
        thr = [0.0] + [(tl[i][3] - tl[i - 1][3]) / max(1e-9, tl[i][0] - tl[i - 1][0]) / 1e9 for i in range(1, len(tl))]
        ymax = max(thr) or 1.0

        def poly(ys: Sequence[float], top: float, color: str) -> str:
            pts = " ".join(f"{40 + x[0] / tmax * (W - 60):.1f},{H - 30 - y / top * (H - 60):.1f}" for x, y in zip(tl, ys))
            return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>'

        occ = [x[1] / dec.nb for x in tl]
        svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">'
               f'<rect width="{W}" height="{H}" fill="white"/>'
               f'{poly(thr, ymax, "#1f77b4")}{poly(occ, 1.0, "#d62728")}'
               f'<text x="40" y="20" font-size="12">throughput into the buffer (blue, max {ymax:.2f} GB/s) and '
               f'buffer occupancy (red, 0-100%) over {tmax:.1f} s</text></svg>')
        with open(path, "w") as f:
            f.write(f"<!doctype html><meta charset=utf-8><title>pdkv transfer test</title>{svg}")
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot with a .png file needs matplotlib (pip install 'pdkv[plot]'); .html needs nothing") from None
    ts = [x[0] for x in tl]
    thr = [0.0] + [(tl[i][3] - tl[i - 1][3]) / max(1e-9, tl[i][0] - tl[i - 1][0]) / 1e9 for i in range(1, len(tl))]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(ts, thr, label="throughput into buffer (GB/s)")
    ax2 = ax.twinx()
    ax2.plot(ts, [x[1] / dec.nb * 100 for x in tl], color="tab:red", label="buffer occupancy (%)")
    ax.set_xlabel("s")
    ax.set_ylabel("GB/s")
    ax2.set_ylabel("%")
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)


# ---------------------------------------------------------------------- modes

def _prefill_argv(a: argparse.Namespace, addr: str, rank: int) -> list[str]:
    argv = [sys.executable, "-m", "pdkv.transfer_test", "prefill", "--connect", addr, "--rank", str(rank),
            "--prefill-tp", str(a.prefill_tp), "--model", a.model, "--transport", a.transport,
            "--requests", str(a.requests), "--prompt-len", a.prompt_len, "--rate", str(a.rate),
            "--concurrency", str(a.concurrency), "--seed", str(a.seed), "--timeout", str(a.timeout),
            "--streams", str(a.streams), "--layer-ms", str(a.layer_ms), "--prefill-blocks", str(a.prefill_blocks),
            "--instance", a.instance, "--time-scale", str(a.time_scale), "--duration", str(a.duration)]
    if a.prefill_gpu:
        argv.append("--prefill-gpu")
    argv += ["--prefill-devices", a.prefill_devices]
    for opt, attr in (("--layers", "layers"), ("--kv-heads", "kv_heads"), ("--head-dim", "head_dim"),
                      ("--tokens-per-block", "tokens_per_block"), ("--dtype", "dtype"), ("--trace", "trace"),
                      ("--trace-limit", "trace_limit")):
        v = getattr(a, attr)
        if v is not None and v != 0:
            argv += [opt, str(v)]
    if a.secret:
        argv += ["--secret", a.secret]
    return argv


def run_local(a: argparse.Namespace, console: Any) -> int:
    from rich.live import Live
    from rich.table import Table

    lay_kw = _layout_kw(a)
    KVLayout(**lay_kw, tp_size=a.prefill_tp).check_compatible(KVLayout(**lay_kw, tp_size=a.decode_tp))
    make_workload(a)  # validate before starting anything
    dec = DecodeSide(a, lay_kw)
    dec.start(a.listen or "tcp://127.0.0.1:0")
    procs: list[subprocess.Popen] = []
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    chosen: dict[int, str] = {}  # prefill rank -> the transport decode chose for it
    copies: set[str] = set()  # which copy the shm senders from host caches run
    prefill_reports: list[dict[str, Any]] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for r in range(a.prefill_tp):
            procs.append(subprocess.Popen(_prefill_argv(a, dec.rx.control_address, r), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))

        def reader(p: subprocess.Popen) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                with lock:
                    if ev.get("type") == "outcome":
                        prev = outcomes.get(ev["rid"])
                        outcomes[ev["rid"]] = ev["state"] if prev in (None, "received") else prev
                        if ev["state"] != "received" and ev.get("reason"):
                            reasons.setdefault(ev["rid"], str(ev["reason"]))
                    elif ev.get("type") == "summary":
                        prefill_reports.append(ev)
                    elif ev.get("type") == "hello":
                        chosen[int(ev.get("rank", -1))] = str(ev.get("transport"))
                        if ev.get("copy"):
                            copies.add(str(ev["copy"]))

        readers = [threading.Thread(target=reader, args=(p,), daemon=True) for p in procs]
        for t in readers:
            t.start()

        def table() -> Table:
            m = dec.sched.metrics()
            tb = Table(show_header=False, box=None)
            done = sum(1 for t in dec.tracks.values() if t.state == "ready")
            tb.add_row("elapsed", f"{time.monotonic() - t0:.1f} s")
            tb.add_row("requests ready / failed", f"{done} / {sum(1 for s in outcomes.values() if s != 'received')}")
            tb.add_row("received", f"{dec.rx.stats['bytes'] / MiB:,.0f} MiB (tcp) ")
            tb.add_row("buffer blocks in use", f"{int(m['buffer_blocks_total'] - m['buffer_blocks_free'])} / {dec.nb}")
            tb.add_row("GPU blocks in use", f"{int(m['gpu_blocks_total'] - m['gpu_blocks_free'])} / {dec.gpu_blocks}")
            return tb

        limit = (a.duration or 0) + a.timeout * 20
        with Live(table(), console=console, refresh_per_second=4, transient=True) as live:
            while any(p.poll() is None for p in procs):
                if time.monotonic() - t0 > limit:
                    for p in procs:
                        p.kill()
                    dec.failures.append(f"run exceeded its bound of {limit:.0f}s; prefill killed")
                    break
                live.update(table())
                time.sleep(0.25)
            for t in readers:
                t.join(5)
        # let the last swaps and verifications finish (bounded)
        deadline = time.monotonic() + a.timeout * 2
        while time.monotonic() < deadline:
            pending = [r for r, s in outcomes.items() if s == "received" and dec.tracks.get(r, _Track()).state != "ready"]
            if not pending:
                break
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        # exit 1 is "some requests failed" (no output on stderr); anything on stderr, or
        # another code, is the rank itself failing (a traceback also exits 1)
        errs = []
        for p in procs:
            text = p.stderr.read().strip() if p.stderr else ""  # type: ignore[union-attr]
            if text or p.returncode not in (0, 1):
                errs.append(text.splitlines()[-1] if text else f"prefill process died (exit code {p.returncode})")
        for e in errs:
            dec.failures.append(f"prefill: {e}")
        lay = dec.lays[0]
        rep = build_report(dec, prefill_reports, outcomes, elapsed, lay, a.decode_tp, reasons)
        rep["transport"] = a.transport
        rep["transports_chosen"] = sorted(set(chosen.values()))
        rep["shm_copy"] = sorted(copies)
        rep["layout"] = KVLayout(**lay_kw).descriptor()
        rep["prefill_tp"], rep["decode_tp"] = a.prefill_tp, a.decode_tp
        if dec.cuda:
            rep["decode_devices"] = [dec.devices[r % len(dec.devices)] for r in range(a.decode_tp)]
        if _prefill_gpu(a):
            pd = _devices(a.prefill_devices, "--prefill-devices")
            rep["prefill_devices"] = [pd[r % len(pd)] for r in range(a.prefill_tp)]
        if errs and rep["requests_failed"] == 0:
            rep["requests_failed"] = len(errs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for s in (p.stdout, p.stderr):
                if s:
                    s.close()
        dec.close()
    return _finish(a, rep, console, dec)


def _finish(a: argparse.Namespace, rep: dict[str, Any], console: Any, dec: DecodeSide) -> int:
    print_report(rep, console)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=2, default=float)
    if a.plot:
        write_plot(a.plot, dec)
    ok = rep["verify_errors"] == 0 and rep["requests_failed"] == 0 and rep["requests_ready"] > 0
    console.print("[green]PASS[/green]" if ok else "[red]FAIL[/red]",
                  f"{rep['requests_ready']} requests ready, {rep['bytes_verified']:,} bytes verified, "
                  f"{rep['verify_errors']} verify errors, {rep['requests_failed']} failed")
    return 0 if ok else 1


def run_decode(a: argparse.Namespace, console: Any) -> int:
    lay_kw = _layout_kw(a)
    dec = DecodeSide(a, lay_kw)
    dec.start(a.listen)
    console.print(f"decode listening on {dec.rx.control_address} (data {dec.rx.data_address}); Ctrl-C to stop")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    t0 = time.monotonic()
    try:
        while not stop.is_set():
            if a.duration and time.monotonic() - t0 > a.duration:
                break
            if a.expect_requests and sum(1 for t in dec.tracks.values() if t.state) >= a.expect_requests:
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    try:
        rep = build_report(dec, [], {}, time.monotonic() - t0, dec.lays[0], a.decode_tp)
    finally:
        dec.close()
    return _finish(a, rep, console, dec)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pdkv-transfer-test", description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="local", choices=["local", "decode", "prefill"],
                   help="local (default): both sides on this host; decode/prefill: one side of a two-host test")
    g = p.add_argument_group("endpoints")
    g.add_argument("--listen", default="", help="decode: ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555")
    g.add_argument("--connect", default="", help="prefill: decode's endpoint, e.g. tcp://decode-host:5555")
    g.add_argument("--data-host", default="127.0.0.1", help="decode: address of the TCP data listener")
    g.add_argument("--transport", default="auto", choices=["auto", "shm", "tcp", "rdma", "cuda_ipc"],
                   help="auto: shm on one host, else rdma where both hosts have a device, else tcp")
    g.add_argument("--streams", type=int, default=1, help="TCP data connections per prefill rank")
    g.add_argument("--secret", default="", help="shared secret (>= 16 characters) to authenticate the pair")
    g = p.add_argument_group("layout")
    g.add_argument("--model", default="llama3-8b", help=f"layout preset: {', '.join(PRESETS)}")
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--tokens-per-block", type=int)
    g.add_argument("--dtype")
    g.add_argument("--prefill-tp", type=int, default=1)
    g.add_argument("--decode-tp", type=int, default=1)
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=24)
    g.add_argument("--prompt-len", default="512", help="N, uniform:MIN:MAX or lognormal:MEDIAN:SIGMA (tokens)")
    g.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight per prefill rank")
    g.add_argument("--trace", help="replay a Mooncake-format JSONL trace (timestamp ms, input_length)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival times by this")
    g.add_argument("--trace-limit", type=int, default=0, help="replay at most this many trace requests")
    g.add_argument("--layer-ms", type=float, default=0.0, help="simulated prefill compute time per layer")
    g.add_argument("--duration", type=float, default=0.0, help="stop issuing requests after this many seconds")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("decode")
    g.add_argument("--buffer-gib", type=float, default=None,
                   help="CPU buffer per decode rank (default: sized to the workload, its --concurrency largest "
                        "requests)")
    g.add_argument("--buffer-blocks", type=int, default=0, help="CPU buffer in blocks (overrides --buffer-gib)")
    g.add_argument("--gpu-blocks", type=int, default=0, help="decode GPU block budget (small forces the buffer path)")
    g.add_argument("--lease-s", type=float, default=30.0)
    g.add_argument("--no-gpu", action="store_true", help="use host memory for decode blocks even with a GPU")
    g.add_argument("--decode-devices", default="0",
                   help="CUDA devices of the decode ranks' GPU caches, comma-separated: rank r on the (r mod n)th")
    g.add_argument("--no-verify", action="store_true")
    g.add_argument("--expect-requests", type=int, default=0, help="decode: stop after this many requests ended")
    g = p.add_argument_group("prefill")
    g.add_argument("--rank", type=int, default=0)
    g.add_argument("--instance", default="pdkv-test-prefill")
    g.add_argument("--prefill-blocks", type=int, default=64, help="prefill cache blocks per rank")
    g.add_argument("--prefill-devices", default="0",
                   help="with a GPU prefill cache: CUDA devices of the ranks, comma-separated, rank r on the (r mod n)th")
    g.add_argument("--prefill-gpu", action="store_true",
                   help="prefill caches in GPU memory (auto, shm or cuda_ipc; implied by --transport cuda_ipc)")
    g = p.add_argument_group("output")
    g.add_argument("--json", help="write every figure to this JSON file")
    g.add_argument("--plot", help="throughput and buffer occupancy over time (.png or .html)")
    g.add_argument("--timeout", type=float, default=10.0, help="bound on handshakes, grants and silence")
    return p


def _check_args(a: argparse.Namespace) -> None:
    for name in ("requests", "concurrency", "prefill_tp", "decode_tp", "streams", "prefill_blocks"):
        if getattr(a, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if (a.buffer_gib is not None and a.buffer_gib <= 0) or a.timeout <= 0 or a.time_scale <= 0:
        raise UsageError("--buffer-gib, --timeout and --time-scale must be positive")
    if a.secret and len(a.secret) < 16:
        raise UsageError("--secret must be at least 16 characters")
    if a.mode == "prefill" and not a.connect:
        raise UsageError("prefill mode needs --connect ADDR (decode's endpoint)")
    if a.mode == "decode" and not a.listen:
        raise UsageError("decode mode needs --listen ADDR, e.g. tcp://0.0.0.0:5555")
    if a.plot and not a.plot.endswith((".png", ".html")):
        raise UsageError("--plot needs a .png or .html file name")
    if a.trace and not os.path.exists(a.trace):
        raise UsageError(f"--trace {a.trace}: no such file")
    if _prefill_gpu(a) and a.transport not in ("auto", "shm", "cuda_ipc"):
        raise UsageError(f"--prefill-gpu works with --transport auto, shm or cuda_ipc, not {a.transport} "
                         "(tcp and rdma send from host caches)")
    if a.transport == "cuda_ipc" and a.no_gpu:
        raise UsageError("--transport cuda_ipc writes decode's GPU blocks: it cannot run with --no-gpu")
    gpu_here = (a.mode != "decode" and _prefill_gpu(a)) or (a.mode != "prefill" and a.transport == "cuda_ipc")
    ndev = _ffi.cuda.device_count()
    if gpu_here and ndev == 0:
        what = "--transport cuda_ipc" if a.transport == "cuda_ipc" else "--prefill-gpu"
        why = "" if _ffi.cuda.bindings_available() else " (cuda-bindings not installed: pip install 'pdkv[cuda]')"
        raise UsageError(f"{what} needs a CUDA GPU on this host; none found{why}")
    for flag, value, used in (("--prefill-devices", a.prefill_devices, a.mode != "decode" and _prefill_gpu(a)),
                              ("--decode-devices", a.decode_devices, a.mode != "prefill" and ndev > 0 and not a.no_gpu)):
        devs = _devices(value, flag)
        if used and max(devs) >= ndev:
            raise UsageError(f"{flag} {value}: this host has {ndev} CUDA device(s), 0..{ndev - 1}")
    try:
        lay_kw = _layout_kw(a)
        KVLayout(**lay_kw, tp_size=a.prefill_tp)
        KVLayout(**lay_kw, tp_size=a.decode_tp)
    except PdkvError as exc:
        raise UsageError(str(exc)) from None



def _devices(value: str, flag: str) -> list[int]:
    """A comma-separated list of CUDA device ordinals."""
    try:
        devs = [int(x) for x in value.split(",")]
    except ValueError:
        devs = []
    if not devs or min(devs) < 0:
        raise UsageError(f"{flag} {value!r}: expected CUDA device ordinals, comma-separated, e.g. 0 or 0,1")
    return devs


def _served(transport: str, gpu_blocks: bool = False) -> list[str]:
    """What the decode side serves: the one asked for, or under auto shm, rdma (where this
    host has a device), tcp, and cuda_ipc when decode's blocks are GPU memory. Prefill's
    offer order decides among them."""
    if transport != "auto":
        return [transport]
    served = ["shm", "rdma", "tcp"] if _ffi.verbs.rdma_devices() else ["shm", "tcp"]
    return (["cuda_ipc"] if gpu_blocks else []) + served

def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    console = Console(stderr=False)
    try:
        a = build_parser().parse_args(argv)
        _check_args(a)
        if a.mode == "prefill":
            def emit(d: dict[str, Any]) -> None:
                print(json.dumps(d), flush=True)

            return run_prefill(a, emit)
        if a.mode == "decode":
            return run_decode(a, console)
        return run_local(a, console)
    except UsageError as exc:
        print(f"pdkv-transfer-test: error: {exc}", file=sys.stderr)
        return 2
    except PdkvError as exc:
        print(f"pdkv-transfer-test: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
