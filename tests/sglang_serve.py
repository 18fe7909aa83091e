"""Real SGLang servers for the tests and ``tools/bench_sglang_served.py``: SGLang 0.5.23's own
launcher (``python -m sglang.launch_server``, which finds pdkv through SGLang's plugin entry
point), one process group each, and SGLang's own router (``sglang_router.launch_router
--pd-disaggregation``) in front of a prefill and a decode.

On a CPU host (facts, found by running them):

- the CPU engine: ``SGLANG_USE_CPU_ENGINE=1`` with ``--device cpu``;
- ``--attention-backend torch_native`` (the default CPU backend needs SGLang's Intel kernel
  build, not on the package index) and ``--disable-cuda-graph``;
- ``--skip-tokenizer-init``: the tests send token ids;
- ``--max-total-tokens``: the KV pool's size (``--mem-fraction-static`` is a fraction of the
  host's RAM there; 0.5 of it takes tens of seconds to allocate);
- ``--sleep-on-idle``: an idle scheduler otherwise polls at most of a core, and a few idle
  servers starve the next one's start on two cores;
- a disaggregated pair: ``--disable-overlap-schedule`` on both sides (a prefix-cached request
  records a CUDA event otherwise) and decode ``--disaggregation-decode-retraction-backup
  none`` (its default builds a pinned host pool);
- ``tests/sglang_cpu`` on ``PYTHONPATH``: a pure-torch stand-in for the few ``sgl_kernel``
  CPU ops SGLang imports unconditionally, and a test-only SGLang plugin that lets the HiCache
  host pool run without a GPU (:mod:`sglang_cpu_host`).

Each server takes about 45 s to start on two cores and about 2 GB of memory.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CPU_DIR = Path(__file__).resolve().parent / "sglang_cpu"
SECRET = "5a" * 32  # the pair's PDKV_SECRET (hex)

# what a CPU host needs of every server (module docstring)
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--skip-tokenizer-init", "--disable-cuda-graph"]
CPU_FLAGS += ["--mem-fraction-static", "0.5", "--disable-overlap-schedule", "--sleep-on-idle", "--host", "127.0.0.1"]
# decode's host pool (HiCache) receiving the KV: pdkv's decode host receive
HOST_POOL = ["--enable-hierarchical-cache", "--disaggregation-decode-host-receive-threshold", "0"]
HOST_POOL += ["--disaggregation-decode-enable-radix-cache", "--hicache-mem-layout", "layer_first"]


def tiny_model(d: Path) -> Path:
    """A 2-layer Llama in bf16 (SGLang's ``--dtype auto`` and ``--kv-cache-dtype auto`` take
    it as is): 4 query heads and 2 KV heads of 64 (grouped-query attention), a context of
    4096, random weights from a fixed seed (no download)."""
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
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


def post(url: str, body: dict, timeout: float = 120.0) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def generate(url: str, ids: list[int], max_new: int = 12, **extra: Any) -> dict:
    """``/generate`` with token ids, greedy; the answer as SGLang gives it."""
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    body.update(extra)
    return post(url + "/generate", body)


def metrics(url: str) -> dict[str, float]:
    """Every ``sglang:`` gauge and counter of ``/metrics`` (labels dropped, summed;
    histogram buckets left out)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sglang:") and "_bucket{" not in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Proc:
    """A process group started by the tests (a server or a router), logging to ``log``."""

    args: list[str]
    log: Path
    env: dict[str, str]
    health: str
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> Proc:
        out = self.log.open("a")
        self.proc = subprocess.Popen(
            self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        out.close()
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.args[:4]} exited (rc {self.proc.returncode}):\n{self.tail()}")
            if _up(self.health):
                return
            time.sleep(0.5)
        raise AssertionError(f"{self.args[:4]} not up within {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def server(
    model: Path,
    port: int,
    log: Path,
    *,
    mode: str = "",
    backend: str = "pdkv",
    bootstrap_port: int = 0,
    kv_tokens: int = 32768,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    """``python -m sglang.launch_server`` on ``port``: colocated (``mode=''``), or the
    ``prefill`` / ``decode`` of a pair over ``backend`` (``pdkv``, ``mooncake``)."""
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port)]
    args += [*CPU_FLAGS, "--max-total-tokens", str(kv_tokens), "--enable-metrics", "--random-seed", "0"]
    if mode:
        args += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", backend]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    if mode == "decode":
        args += ["--disaggregation-decode-retraction-backup", "none"]
    args += extra or []
    path = os.pathsep.join(p for p in (str(CPU_DIR), os.environ.get("PYTHONPATH", "")) if p)
    environ = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": path, "PDKV_SECRET": SECRET}
    environ.update(OMP_NUM_THREADS="1", PDKV_SGLANG_TIMEOUT_S="10", PDKV_SGLANG_LEASE_S="10")
    if backend == "mooncake":
        environ["SGLANG_CPU_MOONCAKE"] = "1"  # sglang_cpu_host: Mooncake's plain index path
    environ.update(env or {})
    return Proc(args, log, environ, f"http://127.0.0.1:{port}/health").start()


def router(port: int, prefill: tuple[int, int], decode: int, log: Path, metrics_port: int) -> Proc:
    """SGLang's router in PD mode before one prefill (its HTTP and bootstrap ports) and
    one decode, its Prometheus exporter on ``metrics_port``; ready (``/readiness``) once
    both workers answer it."""
    args = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    args += ["--prefill", f"http://127.0.0.1:{prefill[0]}", str(prefill[1])]
    args += ["--decode", f"http://127.0.0.1:{decode}", "--host", "127.0.0.1", "--port", str(port)]
    # a restarted worker is seen within seconds (the tests restart a prefill), not a minute
    args += ["--health-check-interval-secs", "2", "--health-success-threshold", "1"]
    return Proc(args, log, dict(os.environ), f"http://127.0.0.1:{port}/readiness").start()


def close_all(procs: list[Proc], grace_s: float = 10.0) -> None:
    """SIGTERM to every one at once, SIGKILL to what is left after ``grace_s``."""
    live = [p for p in procs if p.proc is not None and p.proc.poll() is None]
    for p in live:
        assert p.proc is not None
        os.killpg(p.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        assert p.proc is not None
        try:
            p.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.proc.pid, signal.SIGKILL)
            p.proc.wait()


def wait_all(procs: list[Proc], timeout: float = 400.0) -> None:
    """Wait for each, closing every one if one fails."""
    try:
        for p in procs:
            p.wait_ready(timeout)
    except BaseException:
        close_all(procs)
        raise
