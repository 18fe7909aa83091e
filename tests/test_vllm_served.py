"""pdkv behind vLLM's own OpenAI servers (``api_server``, the CPU build), as an operator
deploys it: a colocated server, a prefill and a decode joined by pdkv's connector (pull
style), and a router that speaks NixlConnector's request protocol exactly. The answers are
the colocated server's, and vLLM's ``/metrics`` on both shows pdkv's series.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from extras import need
from ports import free_port
from vllm_engine import tiny_llama
from vllm_serve import nixl_route, start_servers, stop_servers, with_tokenizer

need("vllm", "vllm")
need("torch", "vllm")
need("transformers", "vllm")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

ENGINE = "prefill-tp2-engine"  # public: vLLM logs it, routers and peers see it
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((70, 96, 131, 33))]


# seven servers share this host's CPUs: one may not be scheduled for over the default 10 s
# while the others run, and its peers must not count that as its death
SILENCE_S = 30


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = with_tokenizer(tiny_llama(tmp_path_factory.mktemp("tiny-llama-served")))
    logs = tmp_path_factory.mktemp("vllm-served-logs")
    pull, control, control_pc, control_tp = (f"tcp://127.0.0.1:{free_port()}" for _ in range(4))
    kv_bytes = 24 * 2 * 2 * 2 * 32 * 64 * 4
    specs = {
        "colocated": (model, free_port(), logs / "colocated.log", {}),
        "prefill": (
            model,
            free_port(),
            logs / "prefill.log",
            {
                "connector": "pdkv",
                "role": "producer",
                "extra": {"decode": [control, control_pc, control_tp], "pull": pull, "peer_timeout_s": SILENCE_S},
            },
        ),
        "decode": (
            model,
            free_port(),
            logs / "decode.log",
            {
                "connector": "pdkv",
                "role": "consumer",
                "kv_bytes": kv_bytes,
                "extra": {
                    "control": control,
                    "prefill": pull,
                    "buffer_blocks": 64,
                    "load_timeout_s": 20,
                    "pull_answer_timeout_s": 20,
                    "peer_timeout_s": SILENCE_S,
                },
            },
        ),
        "decode_tp2": (  # tensor_parallel_size=2: one worker process per rank, one KV head each
            model,
            free_port(),
            logs / "decode-tp2.log",
            {
                "connector": "pdkv",
                "role": "consumer",
                "kv_bytes": kv_bytes,
                "tp": 2,
                "extra": {
                    "control": control_tp,
                    "prefill": pull,
                    "buffer_blocks": 64,
                    "load_timeout_s": 20,
                    "pull_answer_timeout_s": 20,
                    "peer_timeout_s": SILENCE_S,
                },
            },
        ),
        "prefill_tp2": (  # pushes to the TP-1 decode
            model,
            free_port(),
            logs / "prefill-tp2.log",
            {
                "connector": "pdkv",
                "role": "producer",
                "tp": 2,
                "extra": {"decode": control, "peer_timeout_s": SILENCE_S},
                "engine_id": ENGINE,
            },
        ),
        "decode_pc": (  # vLLM's default: prefix caching on
            model,
            free_port(),
            logs / "decode-prefix-caching.log",
            {
                "connector": "pdkv",
                "role": "consumer",
                "kv_bytes": kv_bytes,
                "prefix_caching": True,
                "extra": {
                    "control": control_pc,
                    "prefill": pull,
                    "buffer_blocks": 64,
                    "load_timeout_s": 20,
                    "pull_answer_timeout_s": 20,
                    "peer_timeout_s": SILENCE_S,
                },
            },
        ),
    }
    out = start_servers(specs)
    yield {**out, "decode_control": control}
    stop_servers(out)


def test_vllm_served_pair_behind_a_nixl_protocol_router_answers_as_colocated_and_reports_metrics(served: dict):
    """Each prompt through the router (prefill with NixlConnector's parameters, then decode
    with prefill's answer): decode's text is the colocated server's; decode's /metrics
    counts every request received and loaded, with its bytes and latency histograms, and
    prefill's counts every request sent and pulled."""
    colo, prefill, decode = served["colocated"], served["prefill"], served["decode"]
    for p in PROMPTS:
        want = colo.complete(p, 8)["choices"][0]["text"]
        got = nixl_route(prefill, decode, p, 8)
        assert got["choices"][0]["text"] == want, got
    n = len(PROMPTS)
    d = decode.metrics_until(lambda m: m.get("vllm:pdkv_loads_total") == n)
    pm = prefill.metrics_until(lambda m: m.get("vllm:pdkv_sent_total") == n)
    blocks = sum(-(-len(p) // 32) for p in PROMPTS)
    assert d["vllm:pdkv_received_total"] == n and d["vllm:pdkv_loads_total"] == n, d
    assert d["vllm:pdkv_bytes_loaded_total"] == blocks * 2 * 2 * 2 * 32 * 64 * 4, d  # layers x K,V x heads x ...
    assert d["vllm:pdkv_load_s_count"] == n and d["vllm:pdkv_wait_s_count"] == n, d
    assert d["vllm:pdkv_grant_to_received_s_count"] == n, d
    assert d["vllm:pdkv_refused_proof_total"] == d["vllm:pdkv_load_failed_total"] == 0, d
    assert d["vllm:pdkv_buffer_total_blocks"] == 64, d
    assert pm["vllm:pdkv_sent_total"] == n and pm["vllm:pdkv_pulled_total"] == n, pm
    assert pm["vllm:pdkv_send_s_count"] == n and pm["vllm:pdkv_send_failed_total"] == 0, pm


def test_vllm_served_decode_refusing_a_claim_counts_it(served: dict):
    """A client of decode's API that names another request's KV with another prompt gets
    an answer computed by decode (prefill refuses the pull: the binding differs), decode's
    /metrics counts the refusal, and the victim's own request then loads its KV."""
    prefill, decode = served["prefill"], served["decode"]
    before = decode.metrics()
    kv = prefill.complete(PROMPTS[0], 1, {"do_remote_decode": True})["kv_transfer_params"]
    thief = decode.complete([t + 1 for t in PROMPTS[0]], 4, kv)
    assert len(thief["choices"][0]["text"].split()) == 4
    victim = decode.complete(PROMPTS[0], 4, kv)
    assert victim["choices"][0]["text"] == served["colocated"].complete(PROMPTS[0], 4)["choices"][0]["text"]
    after = decode.metrics_until(lambda m: m["vllm:pdkv_loads_total"] > before["vllm:pdkv_loads_total"])
    assert after["vllm:pdkv_pull_failed_total"] == before["vllm:pdkv_pull_failed_total"] + 1, after
    assert after["vllm:pdkv_loads_total"] == before["vllm:pdkv_loads_total"] + 1, after


def test_vllm_served_decode_prefix_cache_receives_and_loads_only_the_suffix(served: dict):
    """Decode with vLLM's prefix caching on: two prompts sharing their first 96 tokens
    (3 blocks). The first's KV comes whole; for the second, decode's cache holds the shared
    blocks, decode holds them for its claim before it pulls, and prefill sends only the
    rest: pdkv's counters show the second request's bytes are its 2 suffix blocks, and both
    answers are the colocated server's."""
    colo, prefill, decode = served["colocated"], served["prefill"], served["decode_pc"]
    shared = list(range(200, 296))
    first, second = shared + list(range(10, 50)), shared + list(range(60, 100))  # 136 tokens: 5 blocks each
    block = 2 * 2 * 2 * 32 * 64 * 4  # layers x K,V x heads x tokens x dim x 4
    base = decode.metrics()
    for i, p in enumerate((first, second)):
        got = nixl_route(prefill, decode, p, 8)
        assert got["choices"][0]["text"] == colo.complete(p, 8)["choices"][0]["text"], got
        want = base.get("vllm:pdkv_loads_total", 0) + i + 1
        m = decode.metrics_until(lambda m, want=want: m.get("vllm:pdkv_loads_total", 0) >= want)
        if i == 0:
            assert m["vllm:pdkv_bytes_received_total"] - base.get("vllm:pdkv_bytes_received_total", 0) == 5 * block, m
            mid = m
    assert m["vllm:pdkv_bytes_received_total"] - mid["vllm:pdkv_bytes_received_total"] == 2 * block, m
    assert m["vllm:pdkv_bytes_loaded_total"] - mid["vllm:pdkv_bytes_loaded_total"] == 2 * block, m


def test_vllm_served_heterogeneous_tp_both_ways(served: dict):
    """Prefill TP 1 -> decode TP 2 (pull, each decode rank receiving its KV head) and
    prefill TP 2 -> decode TP 1 (push, both prefill ranks writing their head into one
    buffer): every answer is the colocated server's and nothing is refused or failed."""
    colo = served["colocated"]
    for p in PROMPTS:
        want = colo.complete(p, 8)["choices"][0]["text"]
        assert nixl_route(served["prefill"], served["decode_tp2"], p, 8)["choices"][0]["text"] == want
        assert nixl_route(served["prefill_tp2"], served["decode"], p, 8)["choices"][0]["text"] == want
    d2 = served["decode_tp2"].metrics_until(lambda m: m.get("vllm:pdkv_loads_total", 0) >= 2 * len(PROMPTS))
    assert d2["vllm:pdkv_loads_total"] == 2 * len(PROMPTS), d2  # one load a rank a request
    assert d2["vllm:pdkv_load_failed_total"] == d2["vllm:pdkv_pull_failed_total"] == 0, d2
    p2 = served["prefill_tp2"].metrics_until(lambda m: m.get("vllm:pdkv_sent_total", 0) >= 2 * len(PROMPTS))
    assert p2["vllm:pdkv_sent_total"] == 2 * len(PROMPTS) and p2["vllm:pdkv_send_failed_total"] == 0, p2


def test_vllm_served_a_computed_instance_key_joins_nothing(served: dict):
    """An attacker that reaches decode's control port and knows the TP-2 prefill's engine
    id (public: vLLM logs it; pull answers carry it as ``remote_engine_id``) offers decode a
    session as that prefill's rank 1 (``vllm-<engine id>``, the instance name every Hello
    shows) under each key computable from it. Decode refuses each while the engine's
    sessions are live, the engine's next request goes through as colocated, and prefill
    counts no failed send."""
    import hashlib
    import hmac

    import numpy as np

    from pdkv import CacheSpec, PrefillSender
    from pdkv.errors import PeerError
    from pdkv.integrations.vllm.settings import layout_for

    colo, prefill, decode = served["colocated"], served["prefill_tp2"], served["decode"]
    p = PROMPTS[1]
    want = colo.complete(p, 8)["choices"][0]["text"]
    assert nixl_route(prefill, decode, p, 8)["choices"][0]["text"] == want  # the engine's sessions live
    engine = ENGINE
    lay = layout_for(
        num_layers=2,
        kv_heads=2,
        head_dim=64,
        block_size=32,
        dtype="torch.float32",
        tp_size=2,
        tp_rank=1,
        order=("head", False),
    )
    arr = np.zeros(lay.block_bytes * 4, np.uint8)
    guesses = [
        hmac.new(b"pdkv-vllm", f"instance-key:{engine}".encode(), hashlib.sha256).digest(),
        hashlib.sha256(engine.encode()).digest(),
        hashlib.sha256(f"vllm-{engine}".encode()).digest(),
    ]
    for key in guesses:
        with pytest.raises(PeerError, match="another instance key"):
            PrefillSender(
                lay,
                CacheSpec.for_buffer(lay, 4, arr.ctypes.data),
                served["decode_control"],
                instance=f"vllm-{engine}",
                instance_key=key,
                transport="tcp",
                timeout_s=5,
            )
    assert nixl_route(prefill, decode, p, 8)["choices"][0]["text"] == want
    pm = prefill.metrics_until(lambda m: m.get("vllm:pdkv_sent_total", 0) >= 4)
    assert pm["vllm:pdkv_send_failed_total"] == 0, pm


def test_tokenizer_words_are_token_ids(tmp_path: Path):
    """The served tests' tokenizer: token i is the word t<i> (so texts compare as tokens);
    a word that starts with a special token's text is still one word."""
    from transformers import AutoTokenizer

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 16}')
    tok = AutoTokenizer.from_pretrained(with_tokenizer(model))
    assert tok("t3 t15 t10")["input_ids"] == [3, 15, 10] and tok.decode([4, 5]) == "t4 t5"
