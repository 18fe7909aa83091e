#!/usr/bin/env python3
"""Disaggregated generation: prefill and decode as two processes, a prompt in, tokens out.

    python examples/disaggregated_generate.py [--transport shm|tcp] [--prefill-tp 2] [--decode-tp 1]

This process is decode: a DecodeReceiver over a CPU buffer and, per decode TP rank, a
paged cache (vLLM's flash-attention layout, token-major). It starts the prefill process
(``--role prefill``), which runs the prompt through a tiny Llama-style model
(transformers, randomly initialised from a fixed seed: no weights are downloaded), writes
each layer's K/V into its ranks' paged caches (FastDeploy's head-major layout, heads split
between its TP ranks) and hands each layer to pdkv. pdkv carries the blocks into decode's
CPU buffer and swaps them into decode's paged cache; decode rebuilds the model's cache
from its own blocks (``pdkv.integrations.modelcache``) and greedy-decodes from prefill's first token.
Printed beside a colocated ``generate()`` of the same model and prompt: the tokens match,
and the K/V decode rebuilt equal the colocated prefill's bit for bit. Runs on a CPU;
``--device cuda`` keeps both sides' caches in GPU memory.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from typing import Any

import pdkv
from pdkv.integrations.modelcache import PagedKV, hf_cache, read_heads

SEED = 1234
PROMPT_LEN = 13
BLOCK_TOKENS = 4
NB = 32  # blocks in each side's paged cache and in decode's buffer


def tiny_llama(device: str = "cpu") -> Any:
    """A 2-layer Llama-style model with 4 query and 2 KV heads, random weights from SEED."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval().to(device=device, dtype=torch.bfloat16)


SHARED = 8  # tokens the prompt variants share: the first two blocks


def prompt(device: str = "cpu", variant: int = 0) -> Any:
    """The prompt; ``variant`` n > 0 keeps its first ``SHARED`` tokens and changes the rest
    (a prompt sharing a prefix with the first, as a decode-side prefix cache meets them)."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=g)
    if variant:
        ids[0, SHARED:] = (ids[0, SHARED:] + 7 * variant) % 256
    return ids.to(device)


def layout(tp: int, rank: int, token_major: bool, kv_fused: str = "") -> pdkv.KVLayout:
    """The tiny model's cache layout for TP rank ``rank`` of ``tp``."""
    return pdkv.KVLayout(
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        tokens_per_block=BLOCK_TOKENS,
        dtype="bf16",
        tp_size=tp,
        tp_rank=rank,
        token_major=token_major,
        kv_fused=kv_fused,
    )


def model_kv(out: Any) -> list[tuple[Any, Any]]:
    """Each layer's (keys, values) of a forward's cache, ``[1, kv_heads, seq, head_dim]``."""
    pkv = out["cache"] if "cache" in out else out.past_key_values  # renamed in transformers 5.2x
    return [(layer.keys, layer.values) for layer in pkv.layers]


def step(model: Any, tok: Any, cache: Any) -> Any:
    """One greedy decoding step on a transformers cache (``cache=`` where this version
    names it so, ``past_key_values=`` before); the next token."""
    import torch

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        o = model(tok, use_cache=True, **{name: cache})
    return o.logits[:, -1].argmax(-1, keepdim=True)


def colocated(model: Any, ids: Any, new_tokens: int) -> tuple[list[int], list[tuple[Any, Any]]]:
    """What one process computes: the generated tokens, and the prompt's K/V."""
    import torch

    with torch.no_grad():
        out = model(ids, use_cache=True)
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return gen[0, ids.shape[1] :].tolist(), model_kv(out)


# ---------------------------------------------------------------------- prefill


def run_prefill(a: argparse.Namespace) -> int:
    """Prefill: the prompt's forward, each layer's K/V into this process's TP ranks' caches
    (blocks of its own choosing), handed to pdkv layer by layer; the first token printed."""
    import torch

    model, ids = tiny_llama(a.device), prompt(a.device, a.variant)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    first = int(out.logits[0, -1].argmax())
    kv = model_kv(out)
    lays = [layout(a.prefill_tp, r, token_major=False) for r in range(a.prefill_tp)]
    caches = [PagedKV(lay, NB, engine="fastdeploy", device=a.device) for lay in lays]
    blocks = [(5 * i + 3) % NB for i in range(-(-PROMPT_LEN // BLOCK_TOKENS))]  # this engine's own blocks
    txs = [
        pdkv.PrefillSender(lay, c.spec, a.control, transport=a.transport, instance="generate", timeout_s=20, streams=1)
        for lay, c in zip(lays, caches)
    ]
    try:
        for tx in txs:
            tx.reserve(a.request, PROMPT_LEN)
        for layer, (k, v) in enumerate(kv):  # as an engine does: a layer computed, then handed over
            for tx, c in zip(txs, caches):
                c.write(layer, k, v, blocks)
                if c.spec.device is not None:
                    torch.cuda.synchronize()  # the engine's ready event; a real one passes event=
                tx.send_layer(layer, [(a.request, blocks)])
        for tx in txs:
            tx.finish(a.request)
        states = [tx.wait_outcome(a.request, 30).state for tx in txs]
        print(json.dumps({"first_token": first, "states": states, "path": txs[0].stats["path"]}), flush=True)
        return 0 if all(s == "received" for s in states) else 1
    finally:
        for tx in txs:
            tx.close()


# ---------------------------------------------------------------------- decode


class Decode:
    """Decode: per TP rank a CPU buffer and a paged cache (vLLM's layout, token-major:
    ``vllm_flash_attn``, K and V apart, or ``vllm``, vLLM 0.32+'s fused rows), one scheduler
    (its ``gpu`` pool hands out the paged cache's blocks) and receiver."""

    def __init__(
        self,
        tp: int,
        transports: tuple[str, ...],
        device: str = "cpu",
        lease_s: float = 30,
        engine: str = "vllm_flash_attn",
    ) -> None:
        fused = "row" if engine == "vllm" else ""
        self.lays = [layout(tp, r, token_major=True, kv_fused=fused) for r in range(tp)]
        self.caches = [PagedKV(lay, NB, engine=engine, device=device) for lay in self.lays]
        gpu = device != "cpu"
        self.bufs = [
            pdkv.SharedBuffer.create(pdkv.CacheSpec.buffer_bytes(lay, NB), require_pinned=gpu) for lay in self.lays
        ]
        self.engines = [
            pdkv.SwapEngine(
                pdkv.CacheSpec.for_buffer(lay, NB, b.address),
                c.spec,
                strategy="auto" if gpu else "host",
                buffer_pinned=b.pinned,
            )
            for lay, b, c in zip(self.lays, self.bufs, self.caches)
        ]
        self.sched = pdkv.DecodeScheduler(
            layout=self.lays[0],
            gpu=pdkv.BlockPool(NB),
            buffer=pdkv.BlockPool(NB),
            swap=pdkv.SwapGroup(self.engines),
            options=pdkv.SchedulerOptions(direct_to_gpu="cuda_ipc" in transports, lease_s=lease_s),
        )
        self.rx = pdkv.DecodeReceiver(
            self.sched,
            self.lays,
            self.bufs,
            NB,
            transports=transports,
            auto_tick=True,
            gpu_caches=[c.spec for c in self.caches] if "cuda_ipc" in transports else None,
        )

    def wait_ready(self, rid: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in self.sched.take_ready():
                if r.request_id == rid:
                    return r
            time.sleep(0.01)
        raise TimeoutError(f"{rid} not ready within {timeout}s (state {self.sched.request(rid).state})")

    def rebuild(self, gpu_blocks: Any) -> list[tuple[Any, Any]]:
        """The model's K/V of every layer, from this decode's own blocks."""
        n = -(-PROMPT_LEN // BLOCK_TOKENS)
        return [read_heads(self.caches, layer, list(gpu_blocks)[:n], PROMPT_LEN) for layer in range(2)]

    def close(self) -> None:
        self.rx.close()
        for e in self.engines:
            e.close()
        for b in self.bufs:
            b.close()
            b.unlink()


def greedy(model: Any, kv: list[tuple[Any, Any]], first: int, new_tokens: int) -> list[int]:
    """Decoding from a rebuilt cache: the first token is prefill's, then greedy steps."""
    import torch

    cache = hf_cache(kv)
    tok = torch.tensor([[first]], device=kv[0][0].device)
    out = [first]
    for _ in range(new_tokens - 1):
        tok = step(model, tok, cache)
        out.append(int(tok))
    return out


def spawn_prefill(
    control: str, transport: str, tp: int, device: str, request: str, variant: int = 0
) -> subprocess.Popen[str]:
    here = os.path.abspath(__file__)
    return subprocess.Popen(
        [sys.executable, here, "--role", "prefill", "--control", control, "--transport", transport]
        + ["--prefill-tp", str(tp), "--device", device, "--request", request, "--variant", str(variant)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--transport", default="tcp", help="shm, tcp (or cuda_ipc with --device cuda)")
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--control", default="")
    ap.add_argument("--request", default="prompt-0")
    ap.add_argument("--variant", type=int, default=0, help="prefill: the prompt variant (see prompt())")
    a = ap.parse_args()
    if a.role == "prefill":
        return run_prefill(a)
    transports = (a.transport,) if a.transport != "cuda_ipc" else ("cuda_ipc", "shm")
    dec = Decode(a.decode_tp, transports, a.device)
    try:
        p = spawn_prefill(dec.rx.control_address, a.transport, a.prefill_tp, a.device, a.request)
        out, err = p.communicate(timeout=120)
        if p.returncode != 0:
            print(err, file=sys.stderr)
            return 1
        info = json.loads(out.strip().splitlines()[-1])
        r = dec.wait_ready(a.request)
        model = tiny_llama(a.device)
        kv = dec.rebuild(r.gpu_blocks)
        tokens = greedy(model, kv, info["first_token"], a.new_tokens)
        dec.sched.finish(a.request)
        ref, ref_kv = colocated(model, prompt(a.device), a.new_tokens)
    finally:
        dec.close()
    import torch

    same_kv = all(torch.equal(x, y) for (k, v), (k2, v2) in zip(kv, ref_kv) for x, y in ((k, k2), (v, v2)))
    print(
        f"prefill TP {a.prefill_tp} -> decode TP {a.decode_tp} over {a.transport} ({info['path']}), "
        f"{PROMPT_LEN}-token prompt"
    )
    print(f"{'step':>13} " + " ".join(f"{i:>4}" for i in range(a.new_tokens)))
    print(f"{'colocated':>13} " + " ".join(f"{t:>4}" for t in ref))
    print(f"{'disaggregated':>13} " + " ".join(f"{t:>4}" for t in tokens))
    print(f"tokens {'identical' if tokens == ref else 'DIFFER'}; K/V {'bit-identical' if same_kv else 'DIFFER'}")
    return 0 if tokens == ref and same_kv else 1


if __name__ == "__main__":
    sys.exit(main())
