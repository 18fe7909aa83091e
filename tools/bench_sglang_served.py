#!/usr/bin/env python3
"""A served trace through disaggregated SGLang servers, SGLang's own default backend against
pdkv's, side by side: SGLang 0.5.23's own servers (CPU engine, ``tests/sglang_serve.py``:
the tests' tiny grouped-query model) behind SGLang's own router, the trace's arrivals
replayed at their times (open loop, streaming).

Pairs, one after another, each started, driven and stopped on its own (two cores run one
pair at a time), every server with the same KV pools:

- ``colocated``: one server, the requests straight to it: the reference tokens;
- ``pdkv``: decode receives into its HiCache host pool (``--disaggregation-decode-host-
  receive-threshold 0``, pdkv's decode host receive) and loads it into its device pool when
  room frees;
- ``mooncake``: SGLang's default backend over TCP: decode receives into device pages it
  preallocates.

Decode's device pool is ``--decode-tokens`` tokens, too small for the burst (``--hicache-ratio``:
the host pool, pdkv's pair only, that many times the device pool); prefill's is
``--prefill-tokens``. Per pair: TTFT (request sent to the first streamed token) and ITL (gaps
between streamed tokens) p50 and p99, failed requests, requests whose tokens equal the
colocated server's, prefill's KV held (``sglang:kv_used_tokens``, tokens in use and not
evictable, sampled every ``--sample-ms``: token-seconds, and the peak), decode's device KV
held by requests not yet running (``sglang:prealloc_full_token_usage`` x the pool: token-
seconds, and the peak), and the requests waiting in prefill's bootstrap queue (peak). The
servers log their stats every step (``--decode-log-interval 1``) so the gauges are fresh.

The trace: ``--trace`` (Mooncake format; default the 200 requests of
``tests/data/mooncake_synthetic_200.jsonl``), its first ``--requests``, prompt lengths divided
by ``--len-div`` and clipped to 64-``--max-prompt`` tokens, outputs clipped to
4-``--max-new``, arrivals rescaled to ``--rate`` requests a second on average; requests whose
Mooncake ``hash_ids`` share a first block share that many prompt tokens.

    python tools/bench_sglang_served.py [--requests 40] [--rate 8] [--pairs pdkv,mooncake]

Needs SGLang 0.5.23, its router and the Mooncake wheel (``.ci/run``'s fourth part installs them).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import sglang_serve as ss  # noqa: E402
from ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def load_trace(path: Path, n: int, rate: float, len_div: int, max_prompt: int, max_new: int) -> list[dict]:
    """``n`` requests: arrival seconds, prompt token ids, new tokens. Prompt tokens follow
    the trace's ``hash_ids`` (one random block of tokens per hash id, 16 tokens a block
    after the length division), so requests that share blocks in the trace share prefixes."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    t0 = rows[0]["timestamp"]
    span = max(1e-9, (rows[-1]["timestamp"] - t0) / 1000.0)
    scale = (len(rows) / rate) / span
    blocks: dict[int, list[int]] = {}
    out = []
    for r in rows:
        n_in = max(64, min(max_prompt, r["input_length"] // len_div))
        ids: list[int] = []
        for h in r.get("hash_ids", []):
            if len(ids) >= n_in:
                break
            blk = blocks.setdefault(h, [random.Random(h).randrange(3, 500) for _ in range(16)])
            ids += blk
        rnd = random.Random(r["timestamp"])
        ids = (ids + [rnd.randrange(3, 500) for _ in range(n_in)])[:n_in]
        out.append(
            {"at": (r["timestamp"] - t0) / 1000.0 * scale, "ids": ids, "new": max(4, min(max_new, r["output_length"]))}
        )
    return out


def stream(url: str, ids: list[int], new: int, timeout: float = 300.0) -> tuple[list[float], list[int]]:
    """A streaming ``/generate``: each new token's arrival (monotonic) and the tokens."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0}, "stream": True}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    times: list[float] = []
    out: list[int] = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"server error: {str(chunk['error'])[:160]}")
            got = chunk.get("output_ids") or []
            now = time.monotonic()
            times += [now] * (len(got) - len(out))
            out = list(got)
    return times, out


class Sampler:
    """Gauges of some servers' ``/metrics`` every ``dt`` s: integrals (value x seconds) and peaks."""

    def __init__(self, probes: dict[str, tuple[str, str, float]], dt: float) -> None:
        self.probes, self.dt = probes, dt  # name -> (server url, gauge, factor)
        self.integral = dict.fromkeys(probes, 0.0)
        self.peak = dict.fromkeys(probes, 0.0)
        self.series: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        t0 = last = time.monotonic()
        while not self._stop.wait(self.dt):
            cache: dict[str, dict[str, float]] = {}
            vals = {}
            for name, (url, gauge, factor) in self.probes.items():
                try:
                    m = cache.get(url) or cache.setdefault(url, ss.metrics(url))
                except OSError:
                    continue
                vals[name] = max(0.0, m.get(gauge, 0.0)) * factor
            now = time.monotonic()
            for name, v in vals.items():
                self.integral[name] += v * (now - last)
                self.peak[name] = max(self.peak[name], v)
            self.series.append((now - t0, vals))
            last = now

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def drive(trace: list[dict], url: str, concurrency: int) -> list[dict]:
    """Each request at its arrival time, at most ``concurrency`` at once."""
    t0 = time.monotonic()
    results: list[dict] = [{} for _ in trace]

    def run(i: int, r: dict) -> None:
        start = time.monotonic()
        try:
            times, ids = stream(url, r["ids"], r["new"])
            results[i] = {
                "ttft": times[0] - start if times else None,
                "itl": [b - a for a, b in zip(times, times[1:])],
                "ids": ids,
            }
        except Exception as exc:  # a failed request is counted, not raised
            results[i] = {"error": f"{type(exc).__name__}: {exc}"[:200]}

    with ThreadPoolExecutor(concurrency) as pool:
        for i, r in enumerate(trace):
            delay = t0 + r["at"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(run, i, r)
    return results


def start_pair(name: str, a: argparse.Namespace, model: Path, logs: Path) -> tuple[list[ss.Proc], dict[str, str]]:
    """The servers (and router) of one pair; their URLs by role."""
    chunk = ["--chunked-prefill-size", str(a.chunk), "--decode-log-interval", "1"]
    env = {"PDKV_SGLANG_TIMEOUT_S": "30", "PDKV_SGLANG_LEASE_S": "30"}  # pdkv's defaults
    if name == "colocated":
        port = free_port()
        procs = [ss.server(model, port, logs / "colocated.log", kv_tokens=a.prefill_tokens, extra=chunk)]
        ss.wait_all(procs)
        return procs, {"serve": f"http://127.0.0.1:{port}"}
    backend = "pdkv" if name == "pdkv" else "mooncake"
    pp, pb, dp, rp = free_port(), free_port(), free_port(), free_port()
    dec_extra = list(chunk)
    if backend == "pdkv":
        dec_extra += [*ss.HOST_POOL, "--hicache-ratio", str(a.hicache_ratio)]
    procs = [
        ss.server(
            model, pp, logs / "prefill.log", mode="prefill", backend=backend, bootstrap_port=pb,
            kv_tokens=a.prefill_tokens, extra=chunk, env=env,
        ),
        ss.server(model, dp, logs / "decode.log", mode="decode", backend=backend, kv_tokens=a.decode_tokens,
                  extra=dec_extra, env=env),
    ]  # fmt: skip
    ss.wait_all(procs)
    procs.append(ss.router(rp, (pp, pb), dp, logs / "router.log", free_port()))
    ss.wait_all(procs)
    urls = {"serve": f"http://127.0.0.1:{rp}", "prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}"}
    return procs, urls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT / "tests/data/mooncake_synthetic_200.jsonl"))
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=8.0, help="requests a second on average")
    ap.add_argument("--len-div", type=int, default=8, help="divide the trace's prompt lengths by this")
    ap.add_argument("--max-prompt", type=int, default=2000)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    ap.add_argument("--prefill-tokens", type=int, default=65536, help="prefill's KV pool (and colocated's)")
    ap.add_argument("--decode-tokens", type=int, default=6144, help="decode's device KV pool")
    ap.add_argument("--hicache-ratio", type=float, default=8.0, help="pdkv decode's host pool over its device pool")
    ap.add_argument("--sample-ms", type=float, default=100.0)
    ap.add_argument("--pairs", default="pdkv,mooncake", help="pdkv, mooncake (colocated always runs first)")
    ap.add_argument("--keep", default="", help="keep the servers' logs in this folder")
    a = ap.parse_args()
    trace = load_trace(Path(a.trace), a.requests, a.rate, a.len_div, a.max_prompt, a.max_new)
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="pdkv-sglang-served-"))
    work.mkdir(parents=True, exist_ok=True)
    model = ss.tiny_model(work / "model")
    prompt = [len(r["ids"]) for r in trace]
    print(
        f"served trace: {len(trace)} requests, prompts {min(prompt)}-{max(prompt)} tokens (sum {sum(prompt)}), "
        f"{a.rate:g} req/s; SGLang 0.5.23 CPU servers, prefill pool {a.prefill_tokens} tokens, decode device pool "
        f"{a.decode_tokens} tokens (pdkv's host pool x{a.hicache_ratio:g}), chunks of {a.chunk}",
        flush=True,
    )
    rows, reference = [], None
    for name in ["colocated", *[p for p in a.pairs.split(",") if p]]:
        logs = work / name
        logs.mkdir(exist_ok=True)
        try:
            procs, urls = start_pair(name, a, model, logs)
        except AssertionError as exc:  # a pair that does not start here: said, not hidden
            why = str(exc).strip().splitlines()[0][:200]
            print(f"{name:>10}: did not start: {why} (logs in {logs})", flush=True)
            rows.append({"pair": name, "error": why})
            continue
        try:
            probes: dict[str, tuple[str, str, float]] = {}
            if "prefill" in urls:
                probes = {
                    "prefill_kv": (urls["prefill"], "sglang:kv_used_tokens", 1.0),
                    "prefill_bootstrap": (urls["prefill"], "sglang:num_prefill_bootstrap_queue_reqs", 1.0),
                    "decode_waiting_kv": (urls["decode"], "sglang:prealloc_full_token_usage", a.decode_tokens),
                }
            sampler = Sampler(probes, a.sample_ms / 1000)
            t0 = time.monotonic()
            res = drive(trace, urls["serve"], a.concurrency)
            took = time.monotonic() - t0
            time.sleep(3 * a.sample_ms / 1000)
            sampler.stop()
        finally:
            ss.close_all(procs)
        ok = [r for r in res if "error" not in r and r.get("ttft") is not None]
        if name == "colocated":
            reference = [r.get("ids") for r in res]
        same = sum(1 for r, want in zip(res, reference or []) if want and r.get("ids") == want)
        itl = [x for r in ok for x in r["itl"]]
        row = {
            "pair": name,
            "requests": len(trace),
            "failed": len(trace) - len(ok),
            "ttft_ms_p50": 1000 * pct([r["ttft"] for r in ok], 0.5),
            "ttft_ms_p99": 1000 * pct([r["ttft"] for r in ok], 0.99),
            "itl_ms_p50": 1000 * pct(itl, 0.5),
            "itl_ms_p99": 1000 * pct(itl, 0.99),
            "same_tokens": same,
            "prefill_kv_token_s": sampler.integral.get("prefill_kv", 0.0),
            "prefill_kv_peak": sampler.peak.get("prefill_kv", 0.0),
            "prefill_bootstrap_peak": sampler.peak.get("prefill_bootstrap", 0.0),
            "decode_waiting_kv_token_s": sampler.integral.get("decode_waiting_kv", 0.0),
            "decode_waiting_kv_peak": sampler.peak.get("decode_waiting_kv", 0.0),
            "seconds": took,
            "errors": sorted({r["error"] for r in res if "error" in r})[:3],
        }
        rows.append(row)
        print(
            f"{name:>10}: TTFT p50 {row['ttft_ms_p50']:7.0f} p99 {row['ttft_ms_p99']:7.0f} ms | ITL p50 "
            f"{row['itl_ms_p50']:5.1f} p99 {row['itl_ms_p99']:6.1f} ms | failed {row['failed']} | tokens = colocated "
            f"{same}/{len(trace)} | prefill KV {row['prefill_kv_token_s']:8.0f} token-s (peak "
            f"{row['prefill_kv_peak']:.0f}), bootstrap queue peak {row['prefill_bootstrap_peak']:.0f} | decode KV of "
            f"requests not running {row['decode_waiting_kv_token_s']:8.0f} token-s (peak "
            f"{row['decode_waiting_kv_peak']:.0f}) | {took:.1f} s",
            flush=True,
        )
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"mode": "sglang-served", "rows": rows}))
    return 0 if all(r.get("failed") == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
