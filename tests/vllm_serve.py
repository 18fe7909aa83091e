"""Served vLLM engines for the tests and ``tools/bench_vllm.py --served``: vLLM's own
OpenAI ``api_server`` (the CPU build), one process each, with pdkv's connector (or vLLM's
ExampleConnector, or none), and a router that speaks NixlConnector's request protocol
exactly (vLLM's example proxy, vllm-router's PD mode and llm-d's sidecar send prefill these
``kv_transfer_params`` and hand decode whatever prefill answered, untouched).

The tiny model (tests/vllm_engine.py ``tiny_llama``) gets a word-level tokenizer built
here (token ``i`` is the word ``t<i>`` from 3 on, no download), so that the server's tokenizer path
runs as it does for any model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# what NixlConnector-protocol routers send prefill, unchanged: no pdkv key
NIXL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def with_tokenizer(model: Path) -> Path:
    """Save a word-level tokenizer beside the model: token ``i`` is ``t<i>`` (0, 1 and 2
    are ``<unk>``, ``</s>`` and ``<s>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((model / "config.json").read_text())
    # the special tokens are words no other word starts with (added tokens match inside words)
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, **{f"t{i}": i for i in range(3, cfg["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")
    fast.save_pretrained(model)
    return model


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on ``port``, logging to ``log``.
        ``connector``: ``pdkv`` (with ``role`` producer/consumer and ``extra``), ``example``
        (vLLM's ExampleConnector, its storage ``extra['shared_storage_path']``), ``multi`` (vLLM's
    MultiConnector: pdkv with ``extra`` and an ExampleConnector on ``shared_storage_path``), ``nixl``
        (vLLM's NixlConnector, ``kv_both`` with its KV buffer in host memory, its side channel
        on ``extra['side_channel_port']``) or ``none``. ``env``: added to the server's
        environment; ``engine_id``: the pdkv connector's (vLLM's kv_transfer_config), else vLLM's own."""

    def __init__(
        self,
        model: Path,
        port: int,
        log: Path,
        *,
        connector: str = "none",
        role: str = "",
        extra: dict | None = None,
        kv_bytes: int = 32 << 20,
        prefix_caching: bool = False,
        max_num_seqs: int = 8,
        tp: int = 1,
        env: dict[str, str] | None = None,
        engine_id: str = "",
    ) -> None:
        self.url, self.log = f"http://127.0.0.1:{port}", log
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        args += ["--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--block-size", "32"]
        args += ["--max-model-len", "512", "--max-num-seqs", str(max_num_seqs), "--enforce-eager", "--seed", "0"]
        args += ["--kv-cache-memory-bytes", str(kv_bytes)]
        args += ["--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if tp > 1:  # one worker process per rank
            args += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
        kind = {"producer": "kv_producer", "consumer": "kv_consumer"}.get(role, "")
        if connector == "pdkv":
            cfg = {
                "kv_connector": "PdkvConnector",
                "kv_connector_module_path": "pdkv.integrations.vllm",
                "kv_role": kind,
                "kv_connector_extra_config": extra or {},
                **({"engine_id": engine_id} if engine_id else {}),
            }
            args += ["--kv-transfer-config", json.dumps(cfg)]
        elif connector == "example":
            cfg = {"kv_connector": "ExampleConnector", "kv_role": kind, "kv_connector_extra_config": extra or {}}
            args += ["--kv-transfer-config", json.dumps(cfg)]
        elif connector == "multi":  # vLLM's MultiConnector: pdkv first, then vLLM's ExampleConnector
            ex = dict(extra or {})
            storage = ex.pop("shared_storage_path")
            subs = [
                {
                    "kv_connector": "PdkvConnector",
                    "kv_connector_module_path": "pdkv.integrations.vllm",
                    "kv_role": kind,
                    "kv_connector_extra_config": ex,
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": kind,
                    "kv_connector_extra_config": {"shared_storage_path": storage},
                },
            ]
            cfg = {"kv_connector": "MultiConnector", "kv_role": kind, "kv_connector_extra_config": {"connectors": subs}}
            args += ["--kv-transfer-config", json.dumps(cfg)]
        elif connector == "nixl":  # vLLM's own, over UCX on this host; its KV in host memory
            cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            args += ["--kv-transfer-config", json.dumps(cfg)]
        environ = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", **(env or {})}
        if connector == "nixl":
            environ.update(VLLM_NIXL_SIDE_CHANNEL_PORT=str((extra or {})["side_channel_port"]))
            environ.setdefault("UCX_TLS", "tcp,cma,self,sm")
        self._err = log.open("w")
        # its own process group: the engine core and any worker go with it
        self.proc = subprocess.Popen(
            args, stdout=self._err, stderr=subprocess.STDOUT, env=environ, start_new_session=True
        )

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-4000:]
                raise AssertionError(f"vLLM's server exited (rc {self.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"vLLM's server not up within {timeout} s:\n{self.log.read_text()[-4000:]}")

    def complete(self, prompt: list[int], max_tokens: int, params: dict | None = None) -> dict:
        body: dict[str, Any] = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens}
        body.update(temperature=0, stream=False)
        if params is not None:
            body["kv_transfer_params"] = params
        return post(self.url + "/v1/completions", body)

    @property
    def model_name(self) -> str:
        return str(self.proc.args[self.proc.args.index("--model") + 1])  # type: ignore[union-attr]

    def metrics(self) -> dict[str, float]:
        """Every ``vllm:pdkv_*`` sample of ``/metrics`` (labels dropped, summed)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:pdkv_"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{", 1)[0]
                if 'le="' in name:
                    key += "{" + name[name.index('le="') : name.index('"', name.index('le="') + 4) + 1] + "}"
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def metrics_until(self, ok: Any, timeout: float = 10.0) -> dict[str, float]:
        """:meth:`metrics` once ``ok`` holds (vLLM's loggers record each engine step's
        stats), or at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if ok(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._err.close()


def start_servers(specs: dict[str, tuple[Path, int, Path, dict]]) -> dict[str, Server]:
    """Servers started together (each takes ~30 s on two cores): name -> (model, port,
    log, Server keywords); if one fails, all are closed and the error raised."""
    out: dict[str, Server] = {}
    try:
        for k, (model, port, log, kw) in specs.items():
            out[k] = Server(model, port, log, **kw)
        for s in out.values():
            s.wait_ready()
    except BaseException:
        for s in out.values():
            s.close()
        raise
    return out


def stop_servers(servers: dict[str, Server]) -> None:
    """Stop every server (SIGTERM) and check that decode's pdkv buffers went with them
    (their watcher removes them once the server's processes are gone); vLLM's own TP
    segments, which outlive a SIGTERM of its server, are removed here."""
    for s in servers.values():
        s.close()
    for n in os.listdir("/dev/shm"):
        if n.startswith("vllm_dist_"):
            os.unlink(f"/dev/shm/{n}")
    tag, deadline = os.environ.get("PDKV_SHM_TAG", ""), time.monotonic() + 15
    while any(n.startswith("pdkv-") and tag in n for n in os.listdir("/dev/shm")):
        assert time.monotonic() < deadline, f"decode's buffer outlived its server: {os.listdir('/dev/shm')}"
        time.sleep(0.2)


def nixl_route(prefill: Server, decode: Server, prompt: list[int], max_tokens: int) -> dict:
    """One request as a NixlConnector-protocol router sends it: to prefill with
    :data:`NIXL` and one token, then to ``decode`` with prefill's ``kv_transfer_params``
    untouched. Decode's answer, with ``prefill_s`` and ``total_s``."""
    t0 = time.monotonic()
    first = prefill.complete(prompt, 1, dict(NIXL))
    t1 = time.monotonic()
    kv = first.get("kv_transfer_params")
    if not kv:
        raise AssertionError(f"prefill answered no kv_transfer_params: {first}")
    out = decode.complete(prompt, max_tokens, kv)
    out["prefill_s"], out["total_s"] = t1 - t0, time.monotonic() - t0
    return out
