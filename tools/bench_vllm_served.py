#!/usr/bin/env python3
"""A served trace through disaggregated vLLM servers, side by side (``tools/bench_vllm.py
--served``): vLLM's own ``api_server`` processes (CPU build, the tests' tiny model with a
word-level tokenizer), a router that speaks NixlConnector's request protocol exactly
(prefill with one token, then decode with prefill's ``kv_transfer_params`` untouched,
streaming), and the trace's arrivals replayed at their times with at most
``--concurrency`` requests in flight.

Pairs, one after another, each started, driven and stopped on its own (two cores run one
pair at a time): a colocated server (the requests straight to it), pdkv pull (prefill with a
pull endpoint: the router's protocol as NixlConnector routers speak it), pdkv push (prefill
configured with the decode), vLLM's ExampleConnector (shared storage in /dev/shm) and
vLLM's NixlConnector (``kv_both``, KV buffer in host memory, UCX on this host; where NIXL is
installed beside vLLM, else the row says it did not start; vLLM 0.32's CPU build admits the
cpu platform in its device table, so nothing of vLLM is changed). Equal decode memory:
pdkv's decode has 96 vLLM blocks and a 256-block buffer, NixlConnector's decode 352 blocks.
Per pair: TTFT (dispatch to decode's first streamed token) and ITL (gaps between decode's
streamed tokens) p50 and p99, failed requests, texts equal to the colocated server's, and
prefill's block-seconds (its ``vllm:kv_cache_usage_perc`` sampled every 50 ms x its
block count: how long prefill's memory is held per request's worth of work), and decode's
GPU block-seconds held by requests not yet running (blocks allocated while the request
waits for its KV, ``WAITING_FOR_REMOTE_KVS``), counted inside decode's scheduler by
``tools/vllm_probe`` (a ``sitecustomize`` that wraps ``Scheduler.schedule`` in the decode
server's processes only; vLLM's ``/metrics`` has no per-state block gauge).

The trace: ``--trace`` (Mooncake format), its prompt lengths divided by ``--len-div`` and
clipped to what the tiny model serves (32-440 tokens), outputs clipped to 4-``--max-new``
tokens, arrivals rescaled to ``--rate`` requests a second on average.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ports import free_port
from vllm_engine import tiny_llama
from vllm_serve import NIXL, Server, start_servers, with_tokenizer

BLOCK = 32
PROBE = Path(__file__).resolve().parent / "vllm_probe"


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def load_trace(path: Path, n: int, rate: float, len_div: int, max_new: int, seed: int) -> list[dict]:
    """``n`` requests: arrival seconds, prompt token ids, new tokens."""
    import random

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    t0 = rows[0]["timestamp"]
    span = max(1e-9, (rows[-1]["timestamp"] - t0) / 1000.0)
    scale = (len(rows) / rate) / span
    rnd = random.Random(seed)
    out = []
    for r in rows:
        n_in = max(32, min(440, r["input_length"] // len_div))
        out.append(
            {
                "at": (r["timestamp"] - t0) / 1000.0 * scale,
                "prompt": [rnd.randrange(3, 512) for _ in range(n_in)],
                "new": max(4, min(max_new, r["output_length"])),
            }
        )
    return out


def _stream(url: str, body: dict, timeout: float = 120.0) -> tuple[list[float], str]:
    """POST a streaming completion; each token chunk's arrival (monotonic) and the text."""
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    times, text = [], []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if not chunk.get("choices"):  # the server's error, streamed: its own words
                raise RuntimeError(f"server error: {str(chunk.get('error', chunk))[:160]}")
            t = chunk["choices"][0].get("text", "")
            if t:
                times.append(time.monotonic())
                text.append(t)
    return times, "".join(text)


class _Sampler:
    """A server's KV cache usage x its block count, sampled every ``dt`` s: block-seconds."""

    def __init__(self, server: Server, dt: float = 0.05) -> None:
        self.server, self.dt, self.block_s = server, dt, 0.0
        self.blocks = self._blocks()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _metrics(self) -> str:
        with urllib.request.urlopen(self.server.url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def _blocks(self) -> int:
        for line in self._metrics().splitlines():
            if line.startswith("vllm:cache_config_info") and 'num_gpu_blocks="' in line:
                return int(line.split('num_gpu_blocks="')[1].split('"')[0])
        return 0

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.dt):
            try:
                text = self._metrics()
            except OSError:
                continue
            now = time.monotonic()
            for line in text.splitlines():
                if line.startswith("vllm:kv_cache_usage_perc"):
                    self.block_s += float(line.rsplit(" ", 1)[1]) * self.blocks * (now - last)
                    break
            last = now

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.block_s


def read_probe(folder: Path, settle_s: float = 1.0) -> dict[str, float]:
    """The decode scheduler's tally (``tools/vllm_probe``), summed over the files its
    processes wrote: it writes whenever no request waits any more, so the last request's
    share is in once its text has streamed; ``settle_s`` covers that write. No file at all
    is an error (the probe did not load), never a zero."""
    time.sleep(settle_s)
    files = sorted(folder.glob("*.json"))
    if not files:
        raise RuntimeError(f"the decode probe wrote nothing in {folder}: was tools/vllm_probe on PYTHONPATH?")
    total = {"waiting_block_s": 0.0, "peak_waiting_blocks": 0, "calls": 0}
    for f in files:
        d = json.loads(f.read_text())
        total["waiting_block_s"] += d["waiting_block_s"]
        total["peak_waiting_blocks"] = max(total["peak_waiting_blocks"], d["peak_waiting_blocks"])
        total["calls"] += d["calls"]
    if not total["calls"]:
        raise RuntimeError(f"the decode probe in {folder} saw no scheduler step")
    return total


def drive(trace: list[dict], concurrency: int, one) -> list[dict]:
    """Each request at its arrival time (open loop), at most ``concurrency`` at once."""
    t0 = time.monotonic()
    results: list[dict] = [{} for _ in trace]

    def run(i: int, r: dict) -> None:
        start = time.monotonic()
        try:
            times, text, pre = one(r)
            results[i] = {
                "ttft": times[0] - start if times else None,
                "itl": [b - a for a, b in zip(times, times[1:])],
                "text": text,
                "prefill_s": pre,
            }
        except Exception as exc:  # a failed request is counted, not raised
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}

    with ThreadPoolExecutor(concurrency) as pool:
        for i, r in enumerate(trace):
            delay = t0 + r["at"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(run, i, r)
    return results


def served(a: Any) -> int:
    root = Path(__file__).resolve().parent.parent
    trace = load_trace(
        Path(a.trace or root / "tests/data/mooncake_synthetic_200.jsonl"), a.requests, a.rate, a.len_div, a.max_new, 0
    )
    work = Path(tempfile.mkdtemp(prefix="pdkv-served-"))
    model = with_tokenizer(tiny_llama(work / "model"))
    kv = 96 * 2 * 2 * 2 * BLOCK * 64 * 4  # 96 blocks of the tiny model per server
    print(
        f"served trace: {len(trace)} requests, prompts {min(len(r['prompt']) for r in trace)}-"
        f"{max(len(r['prompt']) for r in trace)} tokens, {a.rate} req/s, concurrency {a.concurrency}; "
        f"vLLM 0.32 CPU api_servers, one thread each, 96 blocks of 32 tokens a server",
        flush=True,
    )
    rows, reference = [], None
    storage = Path(tempfile.mkdtemp(prefix="pdkv-example-", dir="/dev/shm"))
    pairs = ["colocated", "pdkv pull", "pdkv push", "ExampleConnector", "NixlConnector"]
    if a.pairs:  # colocated always: the reference texts
        pairs = ["colocated"] + [p for p in pairs[1:] if p in a.pairs.split(",")]
    for name in pairs:
        logs = work / name.replace(" ", "-")
        logs.mkdir()
        pull, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        dec = {"control": control, "buffer_blocks": 256, "load_timeout_s": 30}
        if name == "colocated":
            specs = {"one": (model, free_port(), logs / "colocated.log", {"kv_bytes": kv})}
        elif name.startswith("pdkv"):
            pre = {"decode": control, **({"pull": pull} if name == "pdkv pull" else {})}
            specs = {
                "prefill": (
                    model,
                    free_port(),
                    logs / "prefill.log",
                    {"connector": "pdkv", "role": "producer", "extra": pre, "kv_bytes": kv},
                ),
                "decode": (
                    model,
                    free_port(),
                    logs / "decode.log",
                    {
                        "connector": "pdkv",
                        "role": "consumer",
                        "kv_bytes": kv,
                        "extra": {**dec, **({"prefill": pull} if name == "pdkv pull" else {})},
                    },
                ),
            }
        elif name == "NixlConnector":  # decode's blocks: pdkv decode's blocks plus its buffer (equal memory)
            big = kv + 256 * 2 * 2 * 2 * BLOCK * 64 * 4
            specs = {
                k: (
                    model,
                    free_port(),
                    logs / f"{k}.log",
                    {
                        "connector": "nixl",
                        "extra": {"side_channel_port": free_port()},
                        "kv_bytes": kv if k == "prefill" else big,
                    },
                )
                for k in ("prefill", "decode")
            }
        else:
            ex = {"shared_storage_path": str(storage)}
            specs = {
                "prefill": (
                    model,
                    free_port(),
                    logs / "prefill.log",
                    {"connector": "example", "role": "producer", "extra": ex, "kv_bytes": kv},
                ),
                "decode": (
                    model,
                    free_port(),
                    logs / "decode.log",
                    {"connector": "example", "role": "consumer", "extra": ex, "kv_bytes": kv},
                ),
            }
        probe = logs / "probe"  # decode's scheduler: block-seconds of requests not yet running
        probe.mkdir()
        served_by = "one" if name == "colocated" else "decode"
        pythonpath = os.pathsep.join(x for x in (str(PROBE), os.environ.get("PYTHONPATH", "")) if x)
        specs[served_by][3]["env"] = {"PYTHONPATH": pythonpath, "PDKV_PROBE_OUT": str(probe)}
        try:
            servers = start_servers(specs)
        except AssertionError as exc:  # a pair that does not start on this host: said, not hidden
            why = str(exc).strip().splitlines()[-1][:200]
            print(f"{name:>17}: did not start: {why} (logs in {logs})", flush=True)
            rows.append({"pair": name, "error": why})
            continue
        try:
            if name == "colocated":
                one_srv = servers["one"]

                def one(r, s=one_srv):
                    body = {"model": s.model_name, "prompt": r["prompt"], "max_tokens": r["new"], "temperature": 0}
                    times, text = _stream(s.url, body)
                    return times, text, 0.0

                sampler = _Sampler(one_srv)
            else:
                p, d = servers["prefill"], servers["decode"]

                def one(r, p=p, d=d):
                    t0 = time.monotonic()
                    first = p.complete(r["prompt"], 1, dict(NIXL))
                    pre = time.monotonic() - t0
                    if not first.get("choices"):
                        raise RuntimeError(f"prefill error: {str(first.get('error', first))[:160]}")
                    body = {"model": d.model_name, "prompt": r["prompt"], "max_tokens": r["new"], "temperature": 0}
                    body["kv_transfer_params"] = first.get("kv_transfer_params")
                    times, text = _stream(d.url, body)
                    return times, text, pre

                sampler = _Sampler(p)
            t0 = time.monotonic()
            res = drive(trace, a.concurrency, one)
            took = time.monotonic() - t0
            block_s = sampler.stop()
            waiting = read_probe(probe)
        finally:
            for s in servers.values():
                s.close()
        ok = [r for r in res if "error" not in r and r.get("ttft") is not None]
        if name == "colocated":
            reference = [r.get("text") for r in res]
        same = sum(1 for r, want in zip(res, reference or []) if r.get("text") == want and want)
        itl = [x for r in ok for x in r["itl"]]
        row = {
            "pair": name,
            "requests": len(trace),
            "failed": len(trace) - len(ok),
            "ttft_ms_p50": 1000 * _pct([r["ttft"] for r in ok], 0.5),
            "ttft_ms_p99": 1000 * _pct([r["ttft"] for r in ok], 0.99),
            "itl_ms_p50": 1000 * _pct(itl, 0.5),
            "itl_ms_p99": 1000 * _pct(itl, 0.99),
            "prefill_block_s": block_s,
            "decode_waiting_block_s": waiting["waiting_block_s"],
            "decode_waiting_blocks_peak": waiting["peak_waiting_blocks"],
            "same_text": same,
            "seconds": took,
            "errors": sorted({r["error"] for r in res if "error" in r})[:3],
        }
        rows.append(row)
        print(
            f"{name:>17}: TTFT p50 {row['ttft_ms_p50']:7.1f} p99 {row['ttft_ms_p99']:7.1f} ms | ITL p50 "
            f"{row['itl_ms_p50']:6.1f} p99 {row['itl_ms_p99']:6.1f} ms | failed {row['failed']} | "
            f"text = colocated {same}/{len(trace)} | prefill block-s {block_s:8.1f} | decode block-s "
            f"not running {waiting['waiting_block_s']:7.1f} (peak {waiting['peak_waiting_blocks']}) | {took:.1f} s",
            flush=True,
        )
    shutil.rmtree(storage, ignore_errors=True)  # ExampleConnector's files in /dev/shm
    print(json.dumps({"mode": "served", "rows": rows}))
    return 0 if all(r.get("failed") == 0 for r in rows) else 1


__all__ = ["served", "load_trace", "drive"]
