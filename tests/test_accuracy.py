"""A real model's cache through pdkv: the tokens decode generates from the blocks it
received equal a colocated ``generate()``, and the K/V it rebuilt equal the colocated
prefill's bit for bit. The model is a randomly initialised tiny Llama (transformers, fixed
seed, no downloaded weights); prefill runs in its own process
(``examples/disaggregated_generate.py --role prefill``), decode here. Every test name
contains ``accuracy`` (``pytest -k accuracy``)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from test_transfer import wait_until

from pdkv import State

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

_EX = os.path.join(os.path.dirname(__file__), "..", "examples", "disaggregated_generate.py")
_spec = importlib.util.spec_from_file_location("disaggregated_generate", _EX)
dg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dg)  # the example is the engine loop under test

NEW = 10


@pytest.fixture(scope="module")
def reference():
    """The colocated run: tokens and the prompt's K/V, on the CPU and (where there is one) a GPU."""
    out = {}
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        model = dg.tiny_llama(device)
        out[device] = (model, *dg.colocated(model, dg.prompt(device), NEW))
    return out


def mismatches(tokens, kv, ref_tokens, ref_kv):
    """What differs from the colocated run (empty: identical)."""
    bad = []
    if tokens != ref_tokens:
        bad.append(f"tokens {tokens} != colocated {ref_tokens}")
    for layer, ((k, v), (rk, rv)) in enumerate(zip(kv, ref_kv)):
        for name, x, y in (("K", k, rk), ("V", v, rv)):
            if x.shape != y.shape or not torch.equal(x, y.to(x.device)):
                bad.append(f"layer {layer} {name} differs")
    return bad


def run(transport, P, D, device, reference, rid, scarce=False, damage=False, engine="vllm_flash_attn"):
    """Prefill TP ``P`` in its own process, decode TP ``D`` here (its cache in ``engine``'s
    layout); the result's mismatches."""
    model, ref_tokens, ref_kv = reference[device]
    transports = ("cuda_ipc", "shm") if transport == "cuda_ipc" else (transport,)
    dec = dg.Decode(D, transports, device, engine=engine)
    held = dec.sched.gpu.allocate(dg.NB) if scarce else None  # every GPU block taken: the request waits
    try:
        p = dg.spawn_prefill(dec.rx.control_address, transport, P, device, rid)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        info = json.loads(out.strip().splitlines()[-1])
        assert info["states"] == ["received"] * P
        if scarce:  # received into the CPU buffer, no GPU block free: not swapped yet
            assert dec.sched.request(rid).state is State.RECEIVED and dec.sched.gpu.num_free == 0
            dec.sched.gpu.free(held)
        r = dec.wait_ready(rid)
        if transport == "cuda_ipc":
            assert info["path"] == "cuda_ipc"
        if damage:  # the control: one block of one rank's cache damaged before decode reads it
            view = dec.caches[0].blocks_view(1, 0)
            view[r.gpu_blocks[1]] = view[r.gpu_blocks[1]] + 8.0
        kv = dec.rebuild(r.gpu_blocks)
        tokens = dg.greedy(model, kv, info["first_token"], NEW)
        dec.sched.finish(rid)
        wait_until(lambda: dec.sched.gpu.num_free == dg.NB, 5, "decode's blocks back")
        return mismatches(tokens, kv, ref_tokens, ref_kv), info
    finally:
        dec.close()


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "transport,P,D,scarce",
    [("shm", 2, 1, False), ("tcp", 1, 2, False), ("tcp", 2, 1, True)],
    ids=["shm-2to1", "tcp-1to2", "tcp-2to1-swapped-in-when-blocks-free"],
)
def test_accuracy_real_model_cache_through_the_buffer(transport, P, D, scarce, reference, no_leaks):
    bad, info = run(transport, P, D, "cpu", reference, f"acc-{transport}-{P}{D}", scarce=scarce)
    assert bad == [], bad


@pytest.mark.multiproc
@pytest.mark.parametrize("transport,P,D", [("shm", 2, 1), ("tcp", 1, 2)])
def test_accuracy_into_vllm_fused_caches(transport, P, D, reference, no_leaks):
    """Decode's cache in vLLM 0.32+'s fused layout (each row K then V, token-major), prefill's
    in FastDeploy's (K and V apart, head-major), heads split differently on the two sides:
    the model's K/V and tokens come out as the colocated run's."""
    bad, _ = run(transport, P, D, "cpu", reference, f"acc-vllm-{transport}-{P}{D}", engine="vllm")
    assert bad == [], bad


@pytest.mark.multiproc
def test_accuracy_control_a_damaged_block_changes_the_result(reference, no_leaks):
    """The check can fail: one damaged block of layer 1's keys changes K/V and the tokens."""
    bad, _ = run("shm", 1, 1, "cpu", reference, "acc-damaged", damage=True)
    assert "layer 1 K differs" in bad and any(b.startswith("tokens") for b in bad), bad
    assert "layer 0 K differs" not in bad and "layer 1 V differs" not in bad


def run_shared_prefix(transport, P, D, device, reference, rid):
    """Decode-side prefix reuse with a real model: request A's prompt goes through pdkv;
    decode keeps A's first two blocks as its prefix cache (the engine holds them, frees the
    rest); request B's prompt shares those tokens and differs after them. Decode holds
    A's blocks for B, prefill sends B's whole prompt as usual, only B's last blocks travel,
    and decode's tokens and K/V equal a colocated run of B's prompt."""
    model = reference[device][0]  # made before the test's descriptor count (CUDA opens driver files)
    ref_tokens, ref_kv = dg.colocated(model, dg.prompt(device, 1), NEW)
    dec = dg.Decode(D, (transport,), device)
    k = dg.SHARED // dg.BLOCK_TOKENS
    released = []
    try:
        p = dg.spawn_prefill(dec.rx.control_address, transport, P, device, f"{rid}-a")
        assert p.communicate(timeout=120)[0] and p.returncode == 0
        a = dec.wait_ready(f"{rid}-a")
        dec.sched.finish(f"{rid}-a", free_gpu_blocks=False)  # the engine keeps A's blocks
        prefix = list(a.gpu_blocks[:k])
        dec.sched.gpu.free(list(a.gpu_blocks[k:]))  # and caches only the shared prefix
        before = [c.blocks_view(layer, t)[prefix].clone() for c in dec.caches for layer in range(2) for t in range(2)]
        swapped = dec.sched.metrics()["swap_bytes"]
        dec.sched.hold_prefix(f"{rid}-b", prefix, release=lambda r, b: released.append((r, b)))
        p = dg.spawn_prefill(dec.rx.control_address, transport, P, device, f"{rid}-b", variant=1)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        info = json.loads(out.strip().splitlines()[-1])
        assert info["states"] == ["received"] * P
        r = dec.wait_ready(f"{rid}-b")
        assert list(r.gpu_blocks[:k]) == prefix and r.prefix_blocks == k
        after = [c.blocks_view(layer, t)[prefix] for c in dec.caches for layer in range(2) for t in range(2)]
        assert all(torch.equal(x, y) for x, y in zip(before, after))  # never written
        m = dec.sched.metrics()
        assert m["prefix_blocks_reused"] == k  # and only the rest came through the buffer:
        assert m["swap_bytes"] - swapped == (len(r.gpu_blocks) - k) * dec.sched.block_bytes
        kv = dec.rebuild(r.gpu_blocks)
        tokens = dg.greedy(model, kv, info["first_token"], NEW)
        assert not released
        dec.sched.finish(f"{rid}-b")
        assert released == [(f"{rid}-b", tuple(prefix))]
        dec.sched.gpu.free(prefix)  # the engine drops its prefix cache
        wait_until(lambda: dec.sched.gpu.num_free == dg.NB, 5, "decode's blocks back")
        return mismatches(tokens, kv, ref_tokens, ref_kv)
    finally:
        dec.close()


@pytest.mark.multiproc
def test_accuracy_with_a_prefix_decode_already_holds(reference, no_leaks):
    """tcp, prefill TP 1 -> decode TP 2 (the heads split on the way)."""
    bad = run_shared_prefix("tcp", 1, 2, "cpu", reference, "acc-prefix")
    assert bad == [], bad


@pytest.mark.cuda
@pytest.mark.multiproc
def test_accuracy_with_a_prefix_decode_already_holds_gpu(cuda_device, reference, no_leaks):
    bad = run_shared_prefix("shm", 2, 1, "cuda", reference, "acc-gpu-prefix")
    assert bad == [], bad


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.parametrize("transport,P,D", [("shm", 2, 1), ("cuda_ipc", 1, 2), ("tcp", 2, 1)])
def test_accuracy_real_model_cache_from_gpu_caches(cuda_device, transport, P, D, reference, no_leaks):
    """GPU caches on both sides: shm (prefill's swap kernel into the buffer), cuda_ipc
    (prefill writes decode's GPU blocks), tcp staged through pinned memory."""
    bad, info = run(transport, P, D, "cuda", reference, f"acc-gpu-{transport}")
    assert bad == [], bad
    if transport == "tcp":
        assert info["path"] == "tcp staged (GPU gather)"
