"""One real vLLM engine in this process, driven by JSON lines on stdin (the vLLM tests start
one per role: a colocated reference, a prefill ``kv_producer``, a decode ``kv_consumer``,
each with pdkv's connector loaded by module path).

    python tests/vllm_engine.py --model DIR --role producer|consumer|none [--extra JSON]

Prints ``{"ready": ...}`` once the engine is up, then answers each command with one line:
``generate`` (prompts as token ids, greedy; optional kv_transfer_params per prompt; the
engine stepped by hand, with ``abort_after`` steps for cancel tests), ``kv`` (the bytes of
the blocks a request's prompt took, as they are in vLLM's cache), ``buffer`` (decode: a
received request's blocks in pdkv's CPU buffer), ``state`` (free blocks: vLLM's pool, and
pdkv's buffer on decode), ``wait`` (step on until requests of an earlier ``generate`` finish), ``damage`` and
``abort_pdkv`` (decode: break a received request's
buffer blocks, or end it at pdkv, before vLLM loads it), ``quit``.

The model is a tiny Llama the test saved with random weights (:func:`tiny_llama`, no
download); the engine runs on the CPU with the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the connector's objects can be read here.
:class:`Engine` is the other end: a test (or ``tools/bench_vllm.py``) starts the process and
asks it. ``--connector example`` loads vLLM's own shared-storage ExampleConnector instead,
for the side-by-side benchmark.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", choices=["producer", "consumer", "none"], required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--kv-bytes", type=int, default=32 << 20)
    ap.add_argument("--policy", default="fail")
    ap.add_argument("--max-batched", type=int, default=0)
    ap.add_argument("--connector", choices=["pdkv", "example"], default="pdkv")
    ap.add_argument("--storage", default="", help="vLLM's ExampleConnector: its shared storage folder")
    ap.add_argument("--max-seqs", type=int, default=8)
    ap.add_argument("--time-hooks", action="store_true", help="time each connector hook and each engine step")
    a = ap.parse_args()
    # the engine core in this process; one unbound thread: every engine computes in the same
    # order whatever else runs (the tests start four on two cores), so equal inputs give
    # equal floats. Read when vLLM is imported, below
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = "1"
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints stay off the answer channel

    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict = {}
    if a.role != "none" and a.connector == "example":  # vLLM's own shared-storage connector, to compare
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_producer" if a.role == "producer" else "kv_consumer",
            "kv_connector_extra_config": {"shared_storage_path": a.storage},
        }
    elif a.role != "none":
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
        max_num_seqs=a.max_seqs,
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
        st = {
            "vllm_free": pool.get_num_free_blocks(),
            "vllm_total": pool.num_gpu_blocks - 1,
            "waiting": len(sched.waiting),
            "waiting_for_kv": sum(r.status.name == "WAITING_FOR_REMOTE_KVS" for r in sched.requests.values()),
        }
        if side is not None:
            st.update(
                buffer_free=side.sched.buffer.num_free,
                buffer_total=side.sched.buffer.num_total,
                pdkv_live=len(side.sched.live_requests()),
                computed_here=side.computed_here,
                refused=side.refused,
                pull_failed=side.pull_failed,
            )
        return st

    answer({"ready": True, "control": side.control_address if side is not None else "", **free_blocks()})
    eng = llm.llm_engine
    timing = {"hooks": {}, "steps": 0, "step_s": 0.0, "per_step": [], "in_step": 0.0}
    if a.time_hooks and connector is not None:  # every hook of both halves, and each step
        _time_hooks(connector, worker_connector(), eng, timing)
    seq = 0
    finished: dict = {}  # every finished request's output, by the id given here (``wait`` reads it)
    first, held = {}, {}  # seconds from its generate's start: a request's first token; its blocks freed

    def step_until(ids, t0, deadline, abort_after=None, answered=False):
        """Step the engine until ``ids`` finished and the scheduler holds nothing more (prefill
        keeps blocks while it sends), or the deadline; ``answered``: only until ``ids``
        finished (what an HTTP client gets: a proxy hands the answer to decode then, while
        prefill may still hold the blocks; ``wait`` steps on later)."""
        steps = 0
        while (eng.has_unfinished_requests() or sched.has_requests()) and time.monotonic() < deadline:
            if answered and all(r in finished for r in ids):
                break
            for o in eng.step():
                if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                    first[o.request_id] = time.monotonic() - t0
                if o.finished:
                    finished[o.request_id] = o
            live = {k.rsplit("-", 1)[0] for k in sched.requests}
            for r in ids:
                if r not in held and r not in live:
                    held[r] = time.monotonic() - t0
            steps += 1
            if steps == abort_after:
                eng.abort_request(ids)

    def results(ids, t0):
        return {
            "tokens": [list(finished[r].outputs[0].token_ids) if r in finished else None for r in ids],
            "finish": [str(finished[r].outputs[0].finish_reason) if r in finished else None for r in ids],
            "kv_params": [finished[r].kv_transfer_params if r in finished else None for r in ids],
            "ids": ids,
            "first_s": [first.get(r) for r in ids],
            "freed_s": [held.get(r) for r in ids],
            "seconds": time.monotonic() - t0,
            "unfinished": eng.has_unfinished_requests(),
        }

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "generate":
            ids = []
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
            t0 = time.monotonic()
            step_until(ids, t0, t0 + cmd.get("timeout", 120), cmd.get("abort_after"), cmd.get("answered", False))
            answer(results(ids, t0))
        elif op == "wait":  # step on until earlier requests finish
            t0 = time.monotonic()
            step_until(cmd["ids"], t0, t0 + cmd.get("timeout", 120))
            answer(results(cmd["ids"], t0))
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
        elif op == "hooks":  # what the hooks and the steps took since the last ask
            answer({**timing, "hooks": dict(timing["hooks"])})
            timing.update(hooks={}, steps=0, step_s=0.0, per_step=[])
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


HOOKS = {
    "scheduler": (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "get_kv_connector_stats",
    ),
    "worker": (
        "bind_connector_metadata",
        "start_load_kv",
        "save_kv_layer",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
    ),
}


def _time_hooks(sched_conn, worker_conn, eng, timing: dict) -> None:
    """Wrap each connector hook (on the two instances) and the engine's step with a timer
    adding into ``timing``: hooks[side.name] = [seconds, calls]; steps; step_s; per_step
    (each step's seconds and its hooks' seconds)."""
    import functools

    def wrap(obj, side, name):
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                h = timing["hooks"].setdefault(f"{side}.{name}", [0.0, 0])
                h[0] += dt
                h[1] += 1
                timing["in_step"] += dt

        setattr(obj, name, timed)

    for side, obj in (("scheduler", sched_conn), ("worker", worker_conn)):
        for name in HOOKS[side]:
            wrap(obj, side, name)
    step = eng.step

    def timed_step():
        timing["in_step"] = 0.0
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            dt = time.perf_counter() - t0
            timing["steps"] += 1
            timing["step_s"] += dt
            timing["per_step"].append((dt, timing["in_step"]))  # (the step, its hooks), seconds

    eng.step = timed_step


# ---------------------------------------------------------------------- the client side


def tiny_llama(d: Path) -> Path:
    """A 2-layer Llama saved to ``d``: 4 query and 2 KV heads of 64, random weights from a
    fixed seed (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


class Engine:
    """A vLLM engine process answering JSON lines (see tests/vllm_engine.py)."""

    def __init__(self, model: Path, role: str, log: Path, extra: dict | None = None, **kw: object) -> None:
        args = [sys.executable, str(Path(__file__).resolve()), "--model", str(model), "--role", role]
        args += ["--extra", json.dumps(extra or {})]
        for k, v in kw.items():
            flag = f"--{k.replace('_', '-')}"
            args += [flag] if v is True else [] if v is False else [flag, str(v)]
        self.log = log
        self._err = log.open("w")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        try:
            self.ready = self._read()
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-4000:]
            raise AssertionError(f"the vLLM engine exited (rc {self.proc.poll()}):\n{tail}")
        return json.loads(line)

    def ask(self, **cmd: object) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts, max_tokens, params=None, **kw) -> dict:
        return self.ask(op="generate", prompts=prompts, max_tokens=max_tokens, params=params, **kw)

    def kv(self, req: str, tokens: int) -> np.ndarray:
        """The prompt's blocks in vLLM's cache, ``[layers, blocks, heads, tokens, 2 x dim]``."""
        return self._array(self.ask(op="kv", req=req, tokens=tokens))

    def buffer(self, pid: str) -> np.ndarray:
        """Decode: a received request's blocks in pdkv's buffer, in the same shape."""
        return self._array(self.ask(op="buffer", pid=pid))

    @staticmethod
    def _array(r: dict) -> np.ndarray:
        assert "error" not in r, r
        return np.frombuffer(base64.b64decode(r["data"]), dtype=r["dtype"]).reshape(r["shape"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self._err):
            f.close()


if __name__ == "__main__":
    sys.exit(main())


def start_engines(model: Path, specs: dict[str, tuple[str, dict, dict]], logs: Path) -> dict[str, Engine]:
    """Engines started together (each takes ~20 s on two cores): ``specs`` maps a name to
    ``(role, kv_connector_extra_config, Engine keywords)``; each logs to ``logs/<name>.log``.
    If one fails to start, those that did are closed and the error raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(specs)) as pool:
        futs = {
            k: pool.submit(Engine, model, role, logs / f"{k.replace(' ', '-')}.log", extra, **kw)
            for k, (role, extra, kw) in specs.items()
        }
        out = {}
        try:
            for k, f in futs.items():
                out[k] = f.result()
        except BaseException:
            for f in futs.values():
                if f.done() and f.exception() is None:
                    f.result().close()
            raise
    return out
