"""One real vLLM engine in this process, driven by JSON lines on stdin (the vLLM tests start
one per role: a colocated reference, a prefill ``kv_producer``, a decode ``kv_consumer``,
each with pdkv's connector loaded by module path).

    python tests/vllm_engine.py --model DIR --role producer|consumer|none [--extra JSON]

Prints ``{"ready": ...}`` once the engine is up, then answers each command with one line:
``generate`` (prompts as token ids, greedy; optional kv_transfer_params per prompt; the
engine stepped by hand, with ``abort_after`` steps for cancel tests), ``kv`` (the bytes of
the blocks a request's prompt took, as they are in vLLM's cache), ``buffer`` (decode: a
received request's blocks in pdkv's CPU buffer), ``state`` (free blocks: vLLM's pool, and
pdkv's buffer on decode), ``damage`` and ``abort_pdkv`` (decode: break a received request's
buffer blocks, or end it at pdkv, before vLLM loads it), ``quit``.

The model is a tiny Llama the test saved with random weights (no download); the engine
runs on the CPU with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that the connector's objects can be read here.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# one unbound thread: every engine computes in the same order whatever else runs (the tests
# start four on two cores), so equal inputs give equal floats
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
os.environ["OMP_NUM_THREADS"] = "1"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", choices=["producer", "consumer", "none"], required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--kv-bytes", type=int, default=32 << 20)
    ap.add_argument("--policy", default="fail")
    ap.add_argument("--max-batched", type=int, default=0)
    a = ap.parse_args()
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints stay off the answer channel

    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict = {}
    if a.role != "none":
        kw["kv_transfer_config"] = {
            "kv_connector": "PdkvConnector",
            "kv_connector_module_path": "pdkv.integrations.vllm",
            "kv_role": "kv_producer" if a.role == "producer" else "kv_consumer",
            "kv_connector_extra_config": json.loads(a.extra),
            "kv_load_failure_policy": a.policy,
        }
    if a.max_batched:
        kw.update(max_num_batched_tokens=a.max_batched, enable_chunked_prefill=True)
    llm = LLM(
        model=a.model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        max_num_seqs=8,
        kv_cache_memory_bytes=a.kv_bytes,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        **kw,
    )
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    connector = getattr(sched, "connector", None)
    side = getattr(connector, "_decode", None)

    def worker_connector():
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def answer(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    def free_blocks() -> dict:
        pool = sched.kv_cache_manager.block_pool
        st = {"vllm_free": pool.get_num_free_blocks(), "vllm_total": pool.num_gpu_blocks - 1}
        if side is not None:
            st.update(
                buffer_free=side.sched.buffer.num_free,
                buffer_total=side.sched.buffer.num_total,
                pdkv_live=len(side.sched.live_requests()),
            )
        return st

    answer({"ready": True, "control": side.control_address if side is not None else "", **free_blocks()})
    eng = llm.llm_engine
    seq = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "generate":
            ids, results = [], {}
            for i, p in enumerate(cmd["prompts"]):
                extra = {}
                params = (cmd.get("params") or [None] * len(cmd["prompts"]))[i]
                if params is not None:
                    extra["kv_transfer_params"] = params
                sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0, detokenize=False, extra_args=extra)
                seq += 1
                rid = f"r{seq}"
                eng.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
                ids.append(rid)
            steps, t0 = 0, time.monotonic()
            deadline = t0 + cmd.get("timeout", 120)
            # the scheduler has requests while any waits for its KV to be sent (prefill frees
            # its blocks then): step until that is done too, as vLLM's engine loop does
            while (eng.has_unfinished_requests() or sched.has_requests()) and time.monotonic() < deadline:
                for o in eng.step():
                    if o.finished:
                        results[o.request_id] = o
                steps += 1
                if steps == cmd.get("abort_after"):
                    eng.abort_request(ids)
            answer(
                {
                    "tokens": [list(results[r].outputs[0].token_ids) if r in results else None for r in ids],
                    "finish": [str(results[r].outputs[0].finish_reason) if r in results else None for r in ids],
                    "kv_params": [results[r].kv_transfer_params if r in results else None for r in ids],
                    "ids": ids,
                    "seconds": time.monotonic() - t0,
                    "unfinished": eng.has_unfinished_requests(),
                }
            )
        elif op == "kv":
            c = worker_connector()
            part = c._sender if a.role == "producer" else c._loader
            key = next((k for k in part.recent if k == cmd["req"] or k.startswith(cmd["req"] + "-")), None)
            if key is None:
                answer({"error": f"no blocks recorded for {cmd['req']}", "known": list(part.recent)})
                continue
            blocks = list(part.recent[key])[: -(-cmd["tokens"] // 32)]
            # each block as it is in memory: [layers, blocks, heads, tokens, 2 x head_dim]
            arr = np.stack([t[blocks].contiguous().numpy() for t in c._kv_caches])
            answer(
                {"shape": list(arr.shape), "dtype": str(arr.dtype), "data": base64.b64encode(arr.tobytes()).decode()}
            )
        elif op == "buffer":  # decode: a received request's blocks in pdkv's buffer, laid out as vLLM's
            info = side.sched.request(cmd["pid"])
            lay, n = side.layouts[0], side.num_blocks
            span = lay.layer_block_bytes
            raw = np.frombuffer(side.buffers[0].buf, dtype=np.uint8).reshape(lay.total_layers, n, span)
            arr = raw[:, list(info.buffer_blocks)].copy().view(np.float32)
            arr = arr.reshape(lay.total_layers, len(info.buffer_blocks), lay.heads_per_rank, lay.tokens_per_block, -1)
            answer(
                {"shape": list(arr.shape), "dtype": str(arr.dtype), "data": base64.b64encode(arr.tobytes()).decode()}
            )
            del raw
        elif op == "state":
            answer(free_blocks())
        elif op in ("damage", "abort_pdkv"):
            info = side.sched.request(cmd["pid"])
            if op == "abort_pdkv":
                side.sched.abort(cmd["pid"], "the test ended it")
                answer({"state": info.state.value})
                continue
            lay = side.layouts[0]
            mv = side.buffers[0].buf
            span = lay.layer_block_bytes
            for blk in info.buffer_blocks:  # layer 0 of every block: large values, not the model's
                mv[blk * span : (blk + 1) * span] = np.full(span // 4, 1e4, np.float32).tobytes()
            answer({"state": info.state.value, "blocks": list(info.buffer_blocks)})
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
