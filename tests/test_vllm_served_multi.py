"""pdkv under vLLM's MultiConnector on a served decode (vLLM's api_server, CPU build):
pdkv first, vLLM's ExampleConnector beside it. Its own module, so that its three servers
start after tests/test_vllm_served.py's have stopped (two cores).

vLLM's OffloadingConnector, the connector an operator would put beside pdkv, refuses the
CPU platform ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
``vllm/v1/kv_offload/cpu/spec.py``), so the second connector here is ExampleConnector.
"""

from __future__ import annotations

import pytest
from extras import need
from ports import free_port
from vllm_engine import tiny_llama
from vllm_serve import nixl_route, start_servers, stop_servers, with_tokenizer

need("vllm", "vllm")
need("torch", "vllm")
need("transformers", "vllm")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((70, 33))]


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    model = with_tokenizer(tiny_llama(tmp_path_factory.mktemp("tiny-llama-multi")))
    logs = tmp_path_factory.mktemp("vllm-multi-logs")
    storage = tmp_path_factory.mktemp("example-storage")
    pull, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    kv_bytes = 24 * 2 * 2 * 2 * 32 * 64 * 4
    # three servers share this host's CPUs: one may not be scheduled for over the default 10 s
    dec = {"control": control, "prefill": pull, "buffer_blocks": 64, "load_timeout_s": 20, "peer_timeout_s": 30}
    specs = {
        "colocated": (model, free_port(), logs / "colocated.log", {}),
        "prefill": (
            model,
            free_port(),
            logs / "prefill.log",
            {"connector": "pdkv", "role": "producer", "extra": {"decode": control, "pull": pull, "peer_timeout_s": 30}},
        ),
        "decode": (
            model,
            free_port(),
            logs / "decode-multi.log",
            {
                "connector": "multi",
                "role": "consumer",
                "kv_bytes": kv_bytes,
                "extra": {**dec, "shared_storage_path": str(storage)},
            },
        ),
    }
    out = start_servers(specs)
    yield out
    stop_servers(out)


def test_vllm_served_decode_under_multiconnector(multi: dict):
    """The router's requests load pdkv's KV through MultiConnector and answer as the
    colocated server; decode's /metrics (MultiConnector rebuilds each sub-connector's stats
    by its registered name) serves and counts pdkv's loads."""
    colo, prefill, decode = multi["colocated"], multi["prefill"], multi["decode"]
    for p in PROMPTS:
        want = colo.complete(p, 8)["choices"][0]["text"]
        assert nixl_route(prefill, decode, p, 8)["choices"][0]["text"] == want
    m = decode.metrics_until(lambda m: m.get("vllm:pdkv_loads_total", 0) >= len(PROMPTS))
    assert m.get("vllm:pdkv_loads_total") == len(PROMPTS), m
