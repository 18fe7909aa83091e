"""Two real vLLM engines disaggregated through pdkv's connector (``pdkv.integrations.vllm``,
loaded by vLLM from its module path), beside a colocated engine without a connector.

Each engine is a process of its own (``tests/vllm_engine.py``): vLLM 0.32's CPU build, a
tiny Llama saved with random weights (head_dim 64, block size 32, float32), greedy
decoding. Decode has few blocks of its own (24 of 32 tokens) and a 64-block pdkv buffer;
one prefill engine sends over shm, one over tcp, and the prefill engines run chunked
prefill (64 tokens a step), so long prompts go out chunk by chunk.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from extras import need
from ports import free_port
from vllm_engine import Engine, start_engines, tiny_llama
from vllm_serve import NIXL

need("vllm", "vllm")
torch = need("torch", "vllm")
transformers = need("transformers", "vllm")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

BLOCK = 32
DECODE_BLOCKS = 24  # vLLM blocks of the decode engine: fewer than the prompts below need together
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((70, 96, 131, 33))]  # 3, 3, 5, 2 blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory):
    """Decode (kv_consumer), prefill over shm and over tcp (kv_producer), and a colocated
    engine: started together (each takes ~20 s to start on two cores)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    control = f"tcp://127.0.0.1:{free_port()}"
    kv_bytes = DECODE_BLOCKS * 2 * 2 * 2 * BLOCK * 64 * 4  # blocks x layers x (K, V) x heads x tokens x dim x 4
    specs = {
        # asks for a block-outermost cache, which vLLM's CPU backend refuses: the fallback is served
        "decode": (
            "consumer",
            {"control": control, "buffer_blocks": 64, "load_timeout_s": 20, "kv_cache_order": "block"},
            {"kv_bytes": kv_bytes},
        ),
        "shm": ("producer", {"decode": control, "transport": "shm"}, {"max_batched": 64}),
        "tcp": ("producer", {"decode": control, "transport": "tcp"}, {"max_batched": 64}),
        "colocated": ("none", {}, {"max_batched": 64}),  # the same chunks as prefill: the same numerics
    }
    out = start_engines(model, specs, logs)
    yield out
    for e in out.values():
        e.close()


def _remote(pids):
    return [{"do_remote_decode": True, "pdkv_request_id": p} for p in pids]


def _settled(decode: Engine, *prefills: Engine, timeout: float = 10.0) -> dict:
    """Every side's blocks free again (quarantined buffer blocks wait fence_grace_s)."""
    deadline = time.monotonic() + timeout
    while True:
        st = decode.ask(op="state")
        pre = [p.ask(op="state") for p in prefills]
        done = (
            st["buffer_free"] == st["buffer_total"]
            and st["pdkv_live"] == 0
            and st["vllm_free"] == st["vllm_total"]
            and all(p["vllm_free"] == p["vllm_total"] for p in pre)
        )
        if done or time.monotonic() > deadline:
            return {"decode": st, "prefill": pre}
        time.sleep(0.2)


def _idle(engines) -> None:
    """Wait until no earlier test's request holds anything (tests share the engines, in any
    order: another test's unclaimed KV waits for decode's sweep, load_timeout_s)."""
    st = _settled(engines["decode"], engines["shm"], engines["tcp"], timeout=60)
    assert st["decode"]["pdkv_live"] == 0 and st["decode"]["buffer_free"] == st["decode"]["buffer_total"], st
    assert st["decode"]["vllm_free"] == st["decode"]["vllm_total"], st


@pytest.fixture(scope="module")
def colocated(engines):
    r = engines["colocated"].generate(PROMPTS, 8)
    assert all(t is not None and len(t) == 8 for t in r["tokens"])
    return r["tokens"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vLLM's imports (torch.jit) in this process
def test_vllm_decode_asks_for_a_block_outermost_cache_and_falls_back_by_name(engines, monkeypatch):
    """Decode asks vLLM's own layout resolution for BLNHC on a GPU (BLHNC in the CPU
    backend's head-major order); the CPU backend supports LBHNC only, so vLLM keeps it and
    decode's log names the backend and what vLLM chose, at start; prefill asks nothing."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    from pdkv.integrations.vllm import connector

    def config(role, **extra):
        kt = KVTransferConfig(
            kv_connector="PdkvConnector",
            kv_connector_module_path="pdkv.integrations.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
        )
        return VllmConfig(kv_transfer_config=kt)

    gpu_backends = [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]]  # no declared preference
    with monkeypatch.context() as m:
        m.setattr(connector, "_is_cpu", lambda: False)
        assert resolve_kv_cache_layout(config("kv_consumer"), gpu_backends).name == "BLNHC"  # the default
        assert resolve_kv_cache_layout(config("kv_consumer", kv_cache_order="vllm"), gpu_backends).name == "LBNHC"
        assert resolve_kv_cache_layout(config("kv_producer"), gpu_backends).name == "LBNHC"
        assert resolve_kv_cache_layout(config("kv_consumer"), [["LBNHC", "LBHNC"]]).name == "LBNHC"  # refused
    assert connector.PdkvConnector.get_required_kvcache_layout(config("kv_consumer")) is None  # CPU: auto asks nothing
    assert resolve_kv_cache_layout(config("kv_consumer", kv_cache_order="block"), [["LBHNC"]]).name == "LBHNC"
    log = engines["decode"].log.read_text()
    assert (
        "pdkv decode asked vLLM for the block-outermost KV cache layout BLHNC; attention backend CPU_ATTN (LBHNC); "
        "vLLM chose LBHNC" in log
    ), log[-3000:]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_vllm_disaggregated_tokens_and_kv_equal_colocated(engines, colocated, transport):
    """Prefill's vLLM computes each prompt and sends its KV through pdkv; decode's vLLM
    loads it and generates: the tokens are the colocated engine's; decode's buffer holds
    prefill's blocks byte for byte, and so do decode's own blocks once loaded. The prompt's
    last block is compared through the tokens only: vLLM computes the last token again on
    decode and writes it there, and the slots past the prompt hold whatever the engine left
    (its CPU kernels pack each head's K, so a slot's bytes cannot be picked out)."""
    assert any(len(set(t)) > 1 for t in colocated), f"the model's greedy tokens are constant: {colocated}"
    assert len({tuple(t) for t in colocated}) > 1, "every prompt gives the same tokens"
    prefill, decode = engines[transport], engines["decode"]
    _idle(engines)
    pids = [f"{transport}-{i}" for i in range(len(PROMPTS))]
    # one prompt at a time, each one's blocks read before another prompt reuses them
    pre = {"tokens": [], "kv_params": []}
    sent = []
    for prompt, pid in zip(PROMPTS, pids):
        r = prefill.generate([prompt], 1, _remote([pid]))
        sent.append(prefill.kv(r["ids"][0], len(prompt)))
        pre["tokens"] += r["tokens"]
        pre["kv_params"] += r["kv_params"]
    assert [t[0] for t in pre["tokens"]] == [t[0] for t in colocated]
    # prefill's blocks are free: decode's CPU buffer holds the prompts (decode has not asked
    # yet); the last prompt's completion may still be on its way to decode: wait, bounded
    need_blocks = sum(-(-len(p) // BLOCK) for p in PROMPTS)
    deadline = time.monotonic() + 10
    while True:
        st = decode.ask(op="state")
        landed = st["buffer_total"] - st["buffer_free"] == need_blocks and st["pdkv_live"] == len(PROMPTS)
        if landed or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert prefill.ask(op="state")["vllm_free"] == prefill.ready["vllm_total"]
    assert st["buffer_total"] - st["buffer_free"] == need_blocks and st["pdkv_live"] == len(PROMPTS)
    for i, p in enumerate(pre["kv_params"]):
        # prefill mints the id (the client's its prefix) and a capability decode checks
        assert p["do_remote_prefill"] and p["pdkv_request_id"].startswith(pids[i] + ".") and p["pdkv_cap"]
        assert p["pdkv_tokens"] == len(PROMPTS[i])
        buf = decode.buffer(p["pdkv_request_id"])
        assert buf.shape == sent[i].shape
        np.testing.assert_array_equal(buf[:, :-1], sent[i][:, :-1], err_msg=f"prompt {i}")
    # decode: one request at a time (so that each one's blocks are read before another reuses them)
    for i, prompt in enumerate(PROMPTS):
        dec = decode.generate([prompt], 8, [pre["kv_params"][i]])
        assert dec["tokens"] == [colocated[i]], f"prompt {i}: decode {dec['tokens']} colocated {colocated[i]}"
        got = decode.kv(dec["ids"][0], len(prompt))
        assert got.shape == sent[i].shape
        np.testing.assert_array_equal(got[:, :-1], sent[i][:, :-1])
    st = _settled(decode, prefill)
    assert st["decode"]["buffer_free"] == st["decode"]["buffer_total"] and st["decode"]["pdkv_live"] == 0, st


def test_vllm_prefill_frees_blocks_while_decode_waits_for_its_own(engines, colocated):
    """Four prompts need 13 blocks, decode's vLLM has 24 and keeps 8 generated tokens each:
    decode cannot hold them all at once. Prefill runs them all and frees every block as soon
    as decode's buffer holds the KV, before decode has any block for them; decode then takes
    them as its blocks free up, and every answer is the colocated one."""
    prefill, decode = engines["shm"], engines["decode"]
    _idle(engines)
    prompts = PROMPTS * 2  # 26 blocks of prompt, more than decode's 24
    pids = [f"scarce-{i}" for i in range(len(prompts))]
    pre = prefill.generate(prompts, 1, _remote(pids))
    assert prefill.ask(op="state")["vllm_free"] == prefill.ready["vllm_total"]
    st = decode.ask(op="state")
    held = st["buffer_total"] - st["buffer_free"]
    assert held == 2 * sum(-(-len(p) // BLOCK) for p in PROMPTS) > DECODE_BLOCKS, st
    dec = decode.generate(prompts, 8, pre["kv_params"])
    assert dec["tokens"] == colocated * 2
    st = _settled(decode, prefill)
    assert st["decode"]["buffer_free"] == st["decode"]["buffer_total"], st


def test_vllm_damaged_buffer_block_changes_the_result(engines, colocated):
    """The control: the same run with prefill's KV overwritten in decode's buffer before
    vLLM loads it gives other K/V (and tokens): the equality above is the transfer's."""
    prefill, decode = engines["tcp"], engines["decode"]
    _idle(engines)
    pre = prefill.generate([PROMPTS[0]], 1, _remote(["damaged"]))
    sent = prefill.kv(pre["ids"][0], len(PROMPTS[0]))
    assert decode.ask(op="damage", pid=pre["kv_params"][0]["pdkv_request_id"])["state"] == "received"
    dec = decode.generate([PROMPTS[0]], 8, pre["kv_params"])
    got = decode.kv(dec["ids"][0], len(PROMPTS[0]))
    assert not np.array_equal(got[0, :-1], sent[0, :-1]), "layer 0 was damaged in the buffer but loaded intact"
    np.testing.assert_array_equal(got[1, :-1], sent[1, :-1])  # only layer 0 was touched
    assert dec["tokens"] != [colocated[0]]
    _settled(decode, prefill)


def test_vllm_a_request_whose_kv_is_gone_is_computed_and_frees_everything(engines, colocated):
    """A request whose KV decode's pdkv dropped (here: ended at pdkv before vLLM asked) is
    computed by decode, not failed, even with kv_load_failure_policy='fail' (no load had
    begun): its tokens are the colocated engine's, and no block stays held on either side."""
    prefill, decode = engines["shm"], engines["decode"]
    _idle(engines)
    pre = prefill.generate([PROMPTS[1]], 1, _remote(["dropped"]))
    assert decode.ask(op="abort_pdkv", pid=pre["kv_params"][0]["pdkv_request_id"])["state"] == "received"
    dec = decode.generate([PROMPTS[1]], 8, pre["kv_params"])
    assert dec["finish"] == ["length"] and dec["tokens"] == [colocated[1]], dec
    st = _settled(decode, prefill)
    assert st["decode"]["vllm_free"] == st["decode"]["vllm_total"] and st["decode"]["pdkv_live"] == 0, st


def test_vllm_cancel_on_decode_before_the_kv_came(engines, colocated):
    """Decode's client goes away while vLLM still waits for the KV (the connector answered
    None: ask later); the KV arrives afterwards and nobody asks for it: pdkv drops it from
    the buffer after load_timeout_s. A later request with the same prompt is unaffected."""
    prefill, decode = engines["tcp"], engines["decode"]
    _idle(engines)
    dec = decode.generate([PROMPTS[2]], 8, [{"do_remote_prefill": True, "pdkv_request_id": "late"}], abort_after=5)
    assert dec["tokens"] == [None] or dec["finish"] == ["abort"], dec
    assert decode.ask(op="state")["pdkv_live"] == 0
    prefill.generate([PROMPTS[2]], 1, _remote(["late"]))
    st = decode.ask(op="state")
    assert st["pdkv_live"] == 1  # arrived, unclaimed
    # load_timeout_s is 20 here; the engine is idle (vLLM does not step): pdkv's own sweep
    st = _settled(decode, prefill, timeout=40)
    assert st["decode"]["pdkv_live"] == 0 and st["decode"]["buffer_free"] == st["decode"]["buffer_total"], st


def test_vllm_cancel_on_prefill_mid_prompt(engines):
    """Prefill's client goes away after the first chunk of a long prompt (64 tokens a
    step): the request ends at decode as failed, and both sides' blocks go back."""
    prefill, decode = engines["shm"], engines["decode"]
    _idle(engines)
    long = list(range(7, 7 + 250))
    pre = prefill.generate([long], 1, _remote(["cut"]), abort_after=1)
    assert pre["finish"] in (["abort"], [None]), pre
    st = _settled(decode, prefill)
    assert st["decode"]["pdkv_live"] == 0 and st["decode"]["buffer_free"] == st["decode"]["buffer_total"], st
    assert all(p["vllm_free"] == p["vllm_total"] for p in st["prefill"]), st


def test_vllm_a_request_naming_anothers_kv_gets_none_of_it(engines, colocated):
    """A client of decode's API names the pdkv id of another request's KV (ids are in logs
    and on the wire), with a prompt of the same length or of another, without the
    capability or with a made-up one: each is computed by decode itself, nothing of the
    victim's KV is loaded, aborted or bound; the victim's own request then gives the
    colocated tokens."""
    prefill, decode = engines["tcp"], engines["decode"]
    _idle(engines)
    pre = prefill.generate([PROMPTS[0]], 1, _remote(["victim"]))
    victim = pre["kv_params"][0]
    same_len = [t + 1 for t in PROMPTS[0]]
    claims = [
        (same_len, {**victim, "pdkv_cap": "0" * 32}),  # a made-up capability
        (same_len, {k: v for k, v in victim.items() if k != "pdkv_cap"}),  # none
        (PROMPTS[3], {**victim, "pdkv_cap": "f" * 32}),  # another prompt length
    ]
    local = decode.generate([p for p, _ in claims], 8, [c for _, c in claims])
    assert all(t is not None and len(t) == 8 for t in local["tokens"]), local  # computed here, not failed
    st = decode.ask(op="state")
    assert st["pdkv_live"] == 1 and st["buffer_total"] - st["buffer_free"] == -(-len(PROMPTS[0]) // BLOCK), st
    dec = decode.generate([PROMPTS[0]], 8, [victim])
    assert dec["tokens"] == [colocated[0]], dec
    _settled(decode, prefill)


@pytest.fixture(scope="module")
def overload(model, engines, tmp_path_factory):
    """A decode whose pdkv buffer holds 8 blocks (its vLLM cache 24) and a tcp prefill."""
    logs = tmp_path_factory.mktemp("vllm-overload-logs")
    control = f"tcp://127.0.0.1:{free_port()}"
    kv_bytes = DECODE_BLOCKS * 2 * 2 * 2 * BLOCK * 64 * 4
    cfg = {"control": control, "buffer_blocks": 8, "load_timeout_s": 20, "queue_timeout_s": 15}
    specs = {
        "decode": ("consumer", cfg, {"kv_bytes": kv_bytes}),
        "prefill": ("producer", {"decode": control, "transport": "tcp"}, {"max_batched": 64}),
    }
    out = start_engines(model, specs, logs)
    yield out
    for e in out.values():
        e.close()


def test_vllm_a_burst_past_the_buffer_waits_and_every_answer_is_colocated(overload, colocated):
    """Decode's buffer holds 8 blocks; a burst of 8 prompts needs 26 (decode's own cache 24).
    The reservations past the buffer wait in decode's queue (prefill keeps their blocks);
    decode loads what is buffered, which frees room, and the rest follow: every request
    gives the colocated tokens, none fails and none waits load_timeout_s (20 s)."""
    prefill, decode = overload["prefill"], overload["decode"]
    prompts = PROMPTS * 2
    t0 = time.monotonic()
    # prefill's answers as a proxy gets them: when each request finished (prefill may still
    # hold blocks whose KV waits in decode's queue)
    pre = prefill.generate(prompts, 1, _remote([f"burst-{i}" for i in range(len(prompts))]), answered=True)
    assert all(p and p["do_remote_prefill"] for p in pre["kv_params"]), pre["kv_params"]
    held = prefill.ask(op="state")
    st = decode.ask(op="state")
    assert st["buffer_total"] == 8 and st["buffer_free"] < 8, st
    dec = decode.generate(prompts, 8, pre["kv_params"], timeout=60)
    took = time.monotonic() - t0
    prefill.ask(op="wait", ids=pre["ids"], timeout=30)  # prefill steps on: its held blocks come back
    assert dec["tokens"] == colocated * 2, dec
    assert took < 20, f"the burst took {took:.1f} s"
    st = _settled(decode, prefill, timeout=30)
    assert st["decode"]["buffer_free"] == 8 and st["decode"]["pdkv_live"] == 0, st
    assert all(p["vllm_free"] == p["vllm_total"] for p in st["prefill"]), st
    assert decode.ask(op="state")["computed_here"] == 0, "a reservation was refused: the queue did not drain"
    print(
        f"burst of {len(prompts)} prompts (26 blocks) through an 8-block buffer: {took:.1f} s; prefill held "
        f"{held['vllm_total'] - held['vllm_free']} blocks when its answers were out"
    )


@pytest.fixture(scope="module")
def routed(model, engines, tmp_path_factory):
    """One prefill with a pull endpoint and two decodes, each a configured decode of
    prefill and each listing prefill's pull endpoint: what an operator sets up behind a
    router that picks the decode after prefill answered."""
    logs = tmp_path_factory.mktemp("vllm-routed-logs")
    pull = f"tcp://127.0.0.1:{free_port()}"
    controls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    kv_bytes = DECODE_BLOCKS * 2 * 2 * 2 * BLOCK * 64 * 4
    dec = {"buffer_blocks": 64, "load_timeout_s": 20, "prefill": [pull]}
    dead = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]  # configured, nothing listens there
    specs = {
        "prefill": ("producer", {"decode": controls + dead, "pull": pull, "transport": "tcp"}, {"max_batched": 64}),
        "a": ("consumer", {**dec, "control": controls[0]}, {"kv_bytes": kv_bytes}),
        "b": ("consumer", {**dec, "control": controls[1]}, {"kv_bytes": kv_bytes}),
    }
    out = start_engines(model, specs, logs)
    out["prefill"].dead = dead
    yield out
    for e in out.values():
        e.close()


def _together(*calls):
    """Run each ``(engine, kwargs)`` ask at once (each engine answers one at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futs = [pool.submit(e.ask, **kw) for e, kw in calls]
        return [f.result() for f in futs]


def test_vllm_nixl_protocol_router_round_robin_after_prefill_answered(routed, colocated):
    """A router speaking NixlConnector's protocol exactly: each prompt to prefill with its
    parameters (max_tokens 1), then, once prefill answered, to decode a or b in turn with
    prefill's kv_transfer_params untouched. Each decode pulls its requests' KV into its own
    buffer: the tokens are the colocated run's, no request was computed at decode or
    refused, and every block on every side is free afterwards."""
    prefill, a, b = routed["prefill"], routed["a"], routed["b"]
    pre = prefill.generate(PROMPTS, 1, [dict(NIXL) for _ in PROMPTS], answered=True)
    params = pre["kv_params"]
    assert all(p and p["do_remote_prefill"] and p["pdkv_pull"] for p in params), params
    assert all(p["remote_host"] == "127.0.0.1" and p["remote_port"] for p in params), params
    picks = [(a, [0, 2]), (b, [1, 3])]  # round robin
    calls = [
        (d, dict(op="generate", prompts=[PROMPTS[i] for i in ix], max_tokens=8, params=[params[i] for i in ix]))
        for d, ix in picks
    ]
    *outs, _ = _together(*calls, (prefill, dict(op="wait", ids=pre["ids"], timeout=60)))
    tokens = [None] * len(PROMPTS)
    for (_, ix), out in zip(picks, outs):
        for i, t in zip(ix, out["tokens"]):
            tokens[i] = t
    assert tokens == colocated, outs
    for d in (a, b):
        st = _settled(d, prefill, timeout=30)
        assert st["decode"]["computed_here"] == st["decode"]["refused"] == st["decode"]["pull_failed"] == 0, st
        assert st["decode"]["buffer_free"] == st["decode"]["buffer_total"] and st["decode"]["pdkv_live"] == 0, st
    assert all(p["vllm_free"] == p["vllm_total"] for p in st["prefill"]), st


def test_vllm_push_with_a_shared_transfer_id_dispatched_at_once(routed, colocated):
    """A router that picks decode b first and sends both requests at once with the same
    transfer_id: decode waits for the KV, prefill pushes each layer to b; the tokens are
    the colocated run's and nothing is held afterwards."""
    prefill, b = routed["prefill"], routed["b"]
    tids = [f"route-{i}-{time.monotonic_ns():x}" for i in range(len(PROMPTS))]
    control = b.ready["control"]
    pre_params = [{"do_remote_decode": True, "transfer_id": t, "pdkv_decode": control} for t in tids]
    dec_params = [{"do_remote_prefill": True, "transfer_id": t} for t in tids]
    dec, pre = _together(
        (b, dict(op="generate", prompts=PROMPTS, max_tokens=8, params=dec_params)),
        (prefill, dict(op="generate", prompts=PROMPTS, max_tokens=1, params=pre_params)),
    )
    assert dec["tokens"] == colocated, dec
    st = _settled(b, prefill, timeout=30)
    assert st["decode"]["computed_here"] == st["decode"]["refused"] == 0, st
    assert st["decode"]["buffer_free"] == st["decode"]["buffer_total"], st
    assert all(p["vllm_free"] == p["vllm_total"] for p in st["prefill"]), st


def test_vllm_unlisted_malformed_and_dead_decodes_fail_alone(routed, colocated):
    """Through real engines: a request naming an unlisted decode (a listener the test owns)
    or a malformed address is computed by prefill alone and nothing connects to the
    listener; requests naming two configured decodes that are dead fail alone, and a good
    request after them completes within its normal time with the colocated tokens; every
    prefill block is free again."""
    import socket

    prefill, a = routed["prefill"], routed["a"]
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    try:
        bad = [
            {"do_remote_decode": True, "pdkv_decode": f"tcp://127.0.0.1:{trap.getsockname()[1]}"},
            {"do_remote_decode": True, "pdkv_decode": "not an address"},
            *({"do_remote_decode": True, "pdkv_decode": d} for d in prefill.dead),
        ]
        pre_bad = prefill.generate(PROMPTS, 1, bad, answered=True)
        assert pre_bad["kv_params"][:2] == [None, None], pre_bad["kv_params"]  # computed by prefill alone
        t0 = time.monotonic()
        good = prefill.generate([PROMPTS[0]], 1, [dict(NIXL)], answered=True)
        dec, _ = _together(
            (a, dict(op="generate", prompts=[PROMPTS[0]], max_tokens=8, params=good["kv_params"])),
            (prefill, dict(op="wait", ids=good["ids"], timeout=60)),
        )
        took = time.monotonic() - t0
        assert dec["tokens"] == [colocated[0]], dec
        assert took < 15, f"the good request took {took:.1f} s behind the dead decodes"
        with pytest.raises(BlockingIOError):
            trap.accept()  # nothing connected to the unlisted address
        prefill.ask(op="wait", ids=pre_bad["ids"], timeout=90)
        st = prefill.ask(op="state")
        assert st["vllm_free"] == st["vllm_total"], st
    finally:
        trap.close()
