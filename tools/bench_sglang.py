#!/usr/bin/env python3
"""pdkv's SGLang backend with chunked prefill: what the transfer adds after the last chunk,
each chunk streamed as SGLang hands it over against the whole request sent after the last.

One process, the backend's two halves in plain ids (``DecodeRank``, ``PrefillRank``: no
SGLang import) over a bootstrap server, prefill's KV pool and decode's host pool as numpy
arrays shaped as SGLang's (an 8B-class layout: 32 layers, K and V, 8 KV heads of 128,
bf16, pages of 16 tokens: 2 MiB a page). One request of ``--pages`` pages at a time, in
``--chunks`` chunks, each after ``--compute-ms`` of simulated computation (a sleep: the
chunk's forward pass); decode's receiver thread, prefill's senders and this loop share the
host's CPUs as a real pair's do. ``--dest device-staged`` receives into the device pool
the way a GPU decode does (pdkv's staging buffer, then the swap engine's copy into the
pages: host threads on this CPU pool) instead of the host pool. Per transport (tcp; nixl
when installed) and mode:

- ``streamed``: each chunk's pages handed over as computed (``send``), as SGLang does;
- ``whole``: every chunk computed first, then all pages handed over at once: the request
  sent only after its last chunk (the alternative, measured in the same run).

Columns: the tail (ms from handing over the last chunk to decode's ``Success``: what the
transfer adds to time to first token), the whole request from its first chunk to
``Success``, and the tail's ratio whole / streamed; medians of ``--reps``, modes
interleaved. Every page of every request is compared with prefill's. The last line is
the rows as JSON.

    python tools/bench_sglang.py [--pages 128] [--chunks 8] [--compute-ms 100] [--reps 3]
                                 [--dest host|device-staged]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

import numpy as np
from _bench import ucx_env

from pdkv import _ffi

LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 16
ITEM = PAGE * HEADS * DIM * 2  # bytes of one page of one layer's K (or V), bf16
SECRET = bytes(range(32))


def _args(bufs: list[np.ndarray], host: list[np.ndarray] | None) -> types.SimpleNamespace:
    a = types.SimpleNamespace(
        engine_rank=0,
        kv_data_ptrs=[b.ctypes.data for b in bufs],
        kv_data_lens=[b.nbytes for b in bufs],
        kv_item_lens=[ITEM] * len(bufs),
        kv_cache_dtype_str="bfloat16",
        page_size=PAGE,
        aux_data_ptrs=[],
        aux_data_lens=[],
        aux_item_lens=[],
        state_types=[],
        total_kv_head_num=HEADS,
    )
    if host is not None:
        a.host_kv_data_ptrs = [b.ctypes.data for b in host]
        a.host_kv_data_lens = [b.nbytes for b in host]
        a.host_kv_item_lens = [ITEM] * len(host)
    return a


class Pair:
    """A prefill rank and a decode rank (TP 1 each) of the backend, and their pools."""

    def __init__(self, pages: int, transport: str, dest: str = "host") -> None:
        from pdkv.integrations.sglang.bootstrap import BootstrapServer
        from pdkv.integrations.sglang.layouts import rank_pools
        from pdkv.integrations.sglang.prefill_rank import PrefillRank
        from pdkv.integrations.sglang.sides import DecodeRank, Settings

        rng = np.random.default_rng(1)
        n = 2 * LAYERS  # SGLang's MHA buffers: every layer's K, then every layer's V
        self.src = [rng.integers(0, 256, (pages, ITEM), dtype=np.uint8) for _ in range(n)]
        self.dev = [np.zeros((pages, ITEM), np.uint8) for _ in range(n)]  # decode's device pool
        self.host = [np.zeros((pages, ITEM), np.uint8) for _ in range(n)]
        self.dest = "device" if dest == "device-staged" else "host"
        self.into = self.dev if self.dest == "device" else self.host
        served = ("tcp",) if transport == "tcp" else ("tcp", transport)
        settings = Settings(
            secret=SECRET,
            timeout_s=30.0,
            lease_s=30.0,
            transports=served,
            transport=transport,
            # a host pool stands in for the GPU's: its pages staged, room for two requests in flight
            device_path="staged" if self.dest == "device" else "auto",
            staging_mb=2.0 * pages * n * ITEM / 2**20,
        )
        self.boot = BootstrapServer("127.0.0.1", 0, SECRET)
        self.addr = f"127.0.0.1:{self.boot.port}"
        self.prefill = PrefillRank(rank_pools(_args(self.src, None), mla=False, tp_size=1), settings, self.addr)
        self.decode = DecodeRank(rank_pools(_args(self.dev, self.host), mla=False, tp_size=1), settings)

    def run(self, room: int, chunks: int, compute_s: float, streamed: bool) -> tuple[float, float]:
        """One request; (tail s, first chunk to Success s). Raises unless every page matches."""
        pages = self.src[0].shape[0]
        src_pages = list(np.random.default_rng(room).permutation(pages))
        dst_pages = list(np.random.default_rng(room + 1).permutation(pages))
        for b in self.into:
            b[:] = 0
        r = self.decode.start(room, self.addr)
        self.decode.publish(r, [int(p) for p in dst_pages], None, self.dest)
        out = self.prefill.open(room)
        deadline = time.monotonic() + 30
        while self.prefill.status(out) == "bootstrapping":
            assert time.monotonic() < deadline, "decode's pull never came"
            time.sleep(0.001)
        self.prefill.init(out, pages, None)
        parts = np.array_split(np.array(src_pages), chunks)
        t_first = time.perf_counter() + compute_s
        for part in parts:
            time.sleep(compute_s)
            if streamed:
                self.prefill.send(out, [int(p) for p in part])
        if not streamed:
            self.prefill.send(out, [int(p) for p in src_pages])
        t_last = time.perf_counter()
        while (st := self.decode.status(r)) not in ("success", "failed"):
            time.sleep(0.0002)
        t_end = time.perf_counter()
        assert st == "success", r.error
        deadline = time.monotonic() + 30
        while self.prefill.status(out) != "success":
            assert out.state != "failed" and time.monotonic() < deadline, out.error
            time.sleep(0.001)
        for s, d in zip(self.src, self.into):
            assert np.array_equal(s[src_pages], d[dst_pages]), "a page differs from prefill's"
        self.decode.forget(r)
        self.prefill.forget(out)
        return t_end - t_last, t_end - t_first

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.boot.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128, help="pages a request (2 MiB each)")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--compute-ms", type=float, default=100.0, help="simulated computation of one chunk")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", default="tcp,nixl")
    ap.add_argument(
        "--dest", choices=("host", "device-staged"), default="host", help="decode's host pool, or device pages staged"
    )
    a = ap.parse_args()
    if a.pages < a.chunks or a.chunks < 1 or a.reps < 1:
        print("bench_sglang.py: --pages must be >= --chunks >= 1 and --reps >= 1", file=sys.stderr)
        return 2
    transports = [t for t in a.transports.split(",") if t]
    if "nixl" in transports and not _ffi.nixl.available():
        print("bench_sglang.py: nixl is not installed (pip install 'pdkv[nixl]'): tcp only", file=sys.stderr)
        transports.remove("nixl")
    if "nixl" in transports:
        ucx_env("tcp")
    mib = a.pages * 2 * LAYERS * ITEM / (1 << 20)
    print(
        f"one request of {a.pages} pages ({mib:.0f} MiB) in {a.chunks} chunks, {a.compute_ms:g} ms of compute each, "
        f"{a.reps} reps, into decode's {a.dest} pages, every page verified; medians"
    )
    head = f"{'transport':>9} {'mode':>9} {'tail ms':>8} {'request ms':>11} {'GiB/s in tail':>14}"
    print(f"{head} {'tail whole/streamed':>20}")
    room, rows = 1000, []
    for tr in transports:
        pair = Pair(a.pages, tr, a.dest)
        got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        try:
            pair.run(room, a.chunks, 0.0, True)  # warm: sessions, connections, agents
            room += 1
            for _ in range(a.reps):
                for streamed in (True, False):
                    got[streamed].append(pair.run(room, a.chunks, a.compute_ms / 1e3, streamed))
                    room += 1
        finally:
            pair.close()
        tails = {m: statistics.median(t for t, _ in v) for m, v in got.items()}
        for streamed in (True, False):
            tail, whole = tails[streamed], statistics.median(w for _, w in got[streamed])
            moved = mib / 1024 if not streamed else mib / 1024 / a.chunks  # what the tail had to move
            ratio = f"{tails[False] / tails[True]:>20.2f}" if streamed else f"{'':>20}"
            rows.append({"transport": tr, "dest": a.dest, "streamed": streamed, "tail_s": tail, "request_s": whole})
            print(
                f"{tr:>9} {'streamed' if streamed else 'whole':>9} {tail * 1e3:>8.1f} {whole * 1e3:>11.1f} "
                f"{moved / tail:>14.2f} {ratio}",
                flush=True,
            )
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PDKV_SHM_TAG", "bench")
    sys.exit(main())
