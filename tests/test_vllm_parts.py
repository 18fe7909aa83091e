"""The vLLM connector's pure parts, without vLLM: its configuration rules, and both
halves of decode and prefill over a real receiver and real senders in this process (the
engine's calls made by the test, in vLLM's order: what tests/test_vllm.py does with the
real engine, here with every branch reachable)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdkv import CacheSpec, KVLayout, LayoutError, LayoutMismatchError
from pdkv.integrations.vllm.consumer import DecodeSide, LoadWorker
from pdkv.integrations.vllm.producer import PrefillSide, SendWorker
from pdkv.integrations.vllm.settings import (
    PARAM_CAP,
    PARAM_ID,
    Save,
    StepMeta,
    binding_of,
    buffer_order_of,
    check_version,
    layout_for,
    order_of,
    parse_settings,
    required_layout,
    token_digest,
    transfer_pid,
)
from pdkv.scheduling.lifecycle import State

LAY = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=8, dtype="torch.float32", tp_size=1, tp_rank=0)


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize("v", ["0.32.0", "0.32.1rc1", "0.33.0", "0.34.9", "0.34.0+cpu"])
def test_vllm_versions_in_range(v):
    check_version(v)


@pytest.mark.parametrize("v", ["0.31.9", "0.35.0", "1.0.0", "dev", ""])
def test_vllm_versions_out_of_range_refused_in_one_line(v):
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32 to 0\.34\.x; this is vLLM") as e:
        check_version(v)
    assert "\n" not in str(e.value)


def test_vllm_settings_defaults_and_no_instance_key_from_public_data(monkeypatch):
    monkeypatch.delenv("PDKV_SECRET", raising=False)
    s = parse_settings("kv_consumer", "e1", None)
    assert (s.control, s.transports, s.secret, s.buffer_blocks, s.load_timeout_s) == (
        "tcp://127.0.0.1:0",
        ("shm", "tcp"),
        None,
        0,
        60.0,
    )
    # no key unless configured: the scheduler half mints a random one (nothing public, the
    # engine id or the instance name, determines it)
    assert s.instance == "vllm-e1" and s.instance_key == b""
    a, b = PrefillSide(parse_settings("kv_producer", "e1", {})), PrefillSide(parse_settings("kv_producer", "e1", {}))
    assert len(a.instance_key) == 32 and a.instance_key != b.instance_key
    assert a.step([], [], {}).instance_key == a.instance_key  # every step hands it to the workers
    with_secret = parse_settings("kv_producer", "e1", {"secret": "s3"})
    assert with_secret.secret == b"s3" and with_secret.instance_key == b""
    monkeypatch.setenv("PDKV_SECRET", "from-env")
    assert parse_settings("kv_producer", "e1", {}).secret == b"from-env"
    x = parse_settings("kv_consumer", "e", {"transports": "tcp, shm", "buffer_gib": 0.5, "buffer_blocks": 7})
    assert x.transports == ("tcp", "shm") and x.buffer_bytes == 1 << 29 and x.buffer_blocks == 7
    y = parse_settings("kv_producer", "e", {"decode": "tcp://10.0.0.2:5000, tcp://[::1]:6000"})
    assert y.decodes == ("tcp://10.0.0.2:5000", "tcp://[::1]:6000")


def test_peer_timeout_s_reaches_both_sides():
    c = parse_settings("kv_consumer", "e", {"peer_timeout_s": 30})
    p = parse_settings("kv_producer", "e", {"decode": "tcp://127.0.0.1:5000", "peer_timeout_s": 25})
    assert (c.peer_timeout_s, p.peer_timeout_s, parse_settings("kv_consumer", "e", {}).peer_timeout_s) == (30, 25, 10)
    with pytest.raises(ValueError, match="peer_timeout_s"):
        parse_settings("kv_consumer", "e", {"peer_timeout_s": 0})


_KEYS_SORTED = (
    "['advertise', 'buffer_blocks', 'buffer_gib', 'control', 'data_host', 'decode', 'instance', 'instance_key', "
    "'kv_cache_order', 'kv_fused', 'lease_s', 'load_timeout_s', 'peer_timeout_s', 'prefill', 'pull', "
    "'pull_advertise', 'pull_answer_timeout_s', 'pull_timeout_s', 'queue_timeout_s', 'reserve_timeout_s', 'secret', "
    "'swap_priority', 'transport', 'transports']"
)
EXTRA = "kv_connector_extra_config"
SHORT_KEY = "must be a string of at least 16 characters"


@pytest.mark.parametrize(
    "role, extra, msg",
    [
        ("kv_both", {}, "kv_role='kv_both': pdkv's connector is kv_producer (prefill) or kv_consumer (decode)"),
        ("kv_consumer", {"buffer_size": 1}, f"{EXTRA} has unknown keys ['buffer_size']; pdkv reads {_KEYS_SORTED}"),
        ("kv_consumer", {"buffer_gib": 0}, f"{EXTRA}['buffer_gib']=0 must be a positive number"),
        ("kv_consumer", {"buffer_gib": True}, f"{EXTRA}['buffer_gib']=True must be a positive number"),
        ("kv_consumer", {"buffer_gib": "1"}, f"{EXTRA}['buffer_gib']='1' must be a positive number"),
        ("kv_consumer", {"buffer_blocks": -1},
         f"{EXTRA}['buffer_blocks']=-1 must be an integer >= 0 (0: sized by buffer_gib)"),
        ("kv_consumer", {"buffer_blocks": True},
         f"{EXTRA}['buffer_blocks']=True must be an integer >= 0 (0: sized by buffer_gib)"),
        ("kv_consumer", {"buffer_blocks": 2.0},
         f"{EXTRA}['buffer_blocks']=2.0 must be an integer >= 0 (0: sized by buffer_gib)"),
        ("kv_consumer", {"load_timeout_s": -2}, f"{EXTRA}['load_timeout_s']=-2 must be a positive number"),
        ("kv_producer", {"reserve_timeout_s": 0}, f"{EXTRA}['reserve_timeout_s']=0 must be a positive number"),
        ("kv_consumer", {"lease_s": 0.0}, f"{EXTRA}['lease_s']=0.0 must be a positive number"),
        ("kv_consumer", {"transports": []}, f"{EXTRA}['transports']=[] must name one or more transports"),
        ("kv_consumer", {"transports": [1]}, f"{EXTRA}['transports']=[1] must name one or more transports"),
        ("kv_consumer", {"transports": " , "}, f"{EXTRA}['transports']=() must name one or more transports"),
        ("kv_consumer", {"transports": {"tcp"}}, f"{EXTRA}['transports']={{'tcp'}} must name one or more transports"),
        ("kv_consumer", {"secret": ""}, f"{EXTRA}['secret'] must be a non-empty string"),
        ("kv_consumer", {"secret": b"bytes-secret"}, f"{EXTRA}['secret'] must be a non-empty string"),
        ("kv_producer", {"instance": "a\nb"}, f"{EXTRA}['instance']='a\\nb' must be 1-64 printable characters"),
        ("kv_producer", {"instance": ""}, f"{EXTRA}['instance']='' must be 1-64 printable characters"),
        ("kv_producer", {"instance": "x" * 65}, f"{EXTRA}['instance']='{'x' * 65}' must be 1-64 printable characters"),
        ("kv_producer", {"instance": 7}, f"{EXTRA}['instance']=7 must be 1-64 printable characters"),
        ("kv_producer", {"instance_key": "k" * 15}, f"{EXTRA}['instance_key'] {SHORT_KEY}"),
        ("kv_producer", {"instance_key": b"k" * 16}, f"{EXTRA}['instance_key'] {SHORT_KEY}"),
        ("kv_producer", {"kv_fused": "yes"}, f"{EXTRA}['kv_fused']='yes' must be 'row' or 'head'"),
        ("kv_producer", {"control": 5}, f"{EXTRA}['control']=5 must be a string"),
        ("kv_producer", {"decode": 5}, f"{EXTRA}['decode']=5 must be an address or a list of them"),
        ("kv_producer", {"decode": "garbage"}, f"{EXTRA}['decode'] names 'garbage': not a tcp://host:port address"),
        ("kv_producer", {"decode": ["tcp://h:1", "ipc:///x"]},
         f"{EXTRA}['decode'] names 'ipc:///x': not a tcp://host:port address"),
        ("kv_producer", {"transport": None}, f"{EXTRA}['transport']=None must be a string"),
        ("kv_producer", {"data_host": 127}, f"{EXTRA}['data_host']=127 must be a string"),
        ("kv_producer", {"pull": "tcp://0.0.0.0:7000"},
         f"{EXTRA}['pull']='tcp://0.0.0.0:7000' binds every interface, an address no decode can reach: set "
         "'pull_advertise' to the tcp://host:port decodes reach it at (what their 'prefill' lists)"),
        ("kv_producer", {"pull": "tcp://0.0.0.0:7000", "pull_advertise": "tcp://pf-1:0"},
         f"{EXTRA}['pull_advertise']='tcp://pf-1:0' must be the tcp://host:port (a port, not 0) decodes reach "
         "this prefill's 'pull' endpoint at"),
        ("kv_producer", {"pull_advertise": "tcp://pf-1:7000"},
         f"{EXTRA}['pull_advertise']='tcp://pf-1:7000' must be the tcp://host:port (a port, not 0) decodes reach "
         "this prefill's 'pull' endpoint at"),
    ],
)  # fmt: skip
def test_vllm_settings_refusals_name_the_key(role, extra, msg):
    with pytest.raises(ValueError) as e:
        parse_settings(role, "e", extra)
    assert str(e.value) == msg


def test_vllm_settings_every_key_and_every_default(monkeypatch):
    import hashlib

    from pdkv.integrations.vllm.settings import Settings

    monkeypatch.delenv("PDKV_SECRET", raising=False)
    assert parse_settings("kv_consumer", "e1", None) == Settings(
        role="kv_consumer", engine_id="e1", control="tcp://127.0.0.1:0", decodes=(), buffer_bytes=1 << 30,
        buffer_blocks=0, transports=("shm", "tcp"), transport="auto", secret=None, instance="vllm-e1",
        instance_key=b"", reserve_timeout_s=30.0, load_timeout_s=60.0, lease_s=30.0, kv_fused="",
        data_host="127.0.0.1",
    )  # fmt: skip
    given = {
        "control": "tcp://0.0.0.0:7", "decode": "tcp://d:8", "buffer_gib": 2, "buffer_blocks": 0,
        "transports": ["tcp"], "transport": "tcp", "secret": "sesame", "instance": "p" * 64,
        "instance_key": "k" * 16, "reserve_timeout_s": 1, "load_timeout_s": 2.5, "lease_s": 3, "kv_fused": "row",
        "data_host": "10.0.0.1",
    }  # fmt: skip
    assert parse_settings("kv_producer", "e2", given) == Settings(
        role="kv_producer", engine_id="e2", control="tcp://0.0.0.0:7", decodes=("tcp://d:8",), buffer_bytes=2 << 30,
        buffer_blocks=0, transports=("tcp",), transport="tcp", secret=b"sesame", instance="p" * 64,
        instance_key=hashlib.sha256(b"k" * 16).digest(), reserve_timeout_s=1.0, load_timeout_s=2.5, lease_s=3.0,
        kv_fused="row", data_host="10.0.0.1",
    )  # fmt: skip
    # a long engine id: the default instance name is its first 64 characters
    long_id = "e" * 100
    assert parse_settings("kv_producer", long_id, {}).instance == ("vllm-" + long_id)[:64]
    assert parse_settings("kv_producer", "e", {"kv_fused": "head"}).kv_fused == "head"
    assert parse_settings("kv_producer", "e", {"instance": "a"}).instance == "a"  # one character is enough
    # a configured key is the same in every process that reads the configuration
    assert PrefillSide(parse_settings("kv_producer", "e", given)).instance_key == hashlib.sha256(b"k" * 16).digest()


def test_vllm_settings_of_the_pull_style_and_the_swap_every_key(monkeypatch):
    """The keys of the pull style (a prefill's ``pull`` and ``pull_advertise``, a decode's
    ``prefill`` and its timeouts), the swap's (``swap_priority``, ``kv_cache_order``) and
    ``advertise``, each given and each left to its default, compared whole."""
    from pdkv.integrations.vllm.settings import Settings

    monkeypatch.delenv("PDKV_SECRET", raising=False)
    d = parse_settings("kv_consumer", "d", {})
    assert (d.prefills, d.pull_timeout_s, d.pull_answer_timeout_s, d.queue_timeout_s, d.peer_timeout_s) == (
        (), 120.0, 10.0, 20.0, 10.0,
    )  # fmt: skip
    assert (d.swap_priority, d.kv_cache_order, d.advertise, d.pull, d.pull_advertise) == ("decode", "auto", "", "", "")
    given = {
        "prefill": "tcp://pf-1:7000, tcp://[::1]:7001", "pull_timeout_s": 5, "pull_answer_timeout_s": 2.5,
        "queue_timeout_s": 7, "peer_timeout_s": 9, "swap_priority": "throughput", "kv_cache_order": "vllm",
        "advertise": "tcp://dec-1:5000",
    }  # fmt: skip
    assert parse_settings("kv_consumer", "d", given) == Settings(
        role="kv_consumer", engine_id="d", instance="vllm-d", prefills=("tcp://pf-1:7000", "tcp://[::1]:7001"),
        pull_timeout_s=5.0, pull_answer_timeout_s=2.5, queue_timeout_s=7.0, peer_timeout_s=9.0,
        swap_priority="throughput", kv_cache_order="vllm", advertise="tcp://dec-1:5000",
    )  # fmt: skip
    p = parse_settings("kv_producer", "p", {"pull": "tcp://0.0.0.0:7000", "pull_advertise": "tcp://pf-1:7000"})
    assert (p.pull, p.pull_advertise) == ("tcp://0.0.0.0:7000", "tcp://pf-1:7000")
    q = parse_settings("kv_producer", "p", {"pull": "tcp://10.0.0.5:0", "kv_cache_order": "block"})
    assert (q.pull, q.pull_advertise, q.kv_cache_order) == ("tcp://10.0.0.5:0", "", "block")
    assert parse_settings("kv_producer", "p", {"pull": "tcp://[::1]:7000"}).pull == "tcp://[::1]:7000"


@pytest.mark.parametrize(
    "extra, msg",
    [
        ({"swap_priority": "fast"}, f"{EXTRA}['swap_priority']='fast' must be 'decode' or 'throughput'"),
        ({"kv_cache_order": "BLNHC"}, f"{EXTRA}['kv_cache_order']='BLNHC' must be one of auto, block, vllm"),
        ({"advertise": 5}, f"{EXTRA}['advertise']=5 must be a tcp://host:port address"),
        ({"advertise": "tcp://dec-1"}, f"{EXTRA}['advertise']='tcp://dec-1' must be a tcp://host:port address"),
        ({"pull": 7000}, f"{EXTRA}['pull']=7000 must be a tcp://host:port address (port 0: any)"),
        ({"pull": "ipc:///pull"}, f"{EXTRA}['pull']='ipc:///pull' must be a tcp://host:port address (port 0: any)"),
        ({"prefill": "pf-1:7000"}, f"{EXTRA}['prefill'] names 'pf-1:7000': not a tcp://host:port address"),
        ({"prefill": [7000]}, f"{EXTRA}['prefill']=[7000] must be an address or a list of them"),
        ({"pull_timeout_s": 0}, f"{EXTRA}['pull_timeout_s']=0 must be a positive number"),
        ({"pull_answer_timeout_s": -1}, f"{EXTRA}['pull_answer_timeout_s']=-1 must be a positive number"),
        ({"queue_timeout_s": False}, f"{EXTRA}['queue_timeout_s']=False must be a positive number"),
    ],
)
def test_vllm_settings_of_the_pull_style_and_the_swap_refused_by_name(extra, msg):
    with pytest.raises(ValueError) as e:
        parse_settings("kv_consumer", "e", extra)
    assert str(e.value) == msg


@pytest.mark.parametrize("wild", ["tcp://0.0.0.0:7000", "tcp://[::]:7000", "tcp://:::7000"])
def test_vllm_a_pull_on_every_interface_needs_where_decodes_reach_it(wild):
    with pytest.raises(ValueError, match="binds every interface, an address no decode can reach"):
        parse_settings("kv_producer", "p", {"pull": wild})
    assert parse_settings("kv_producer", "p", {"pull": wild, "pull_advertise": "tcp://pf:7"}).pull == wild


@pytest.mark.parametrize(
    "role, order, cpu, fused, want",
    [
        ("kv_producer", "block", False, "", None),  # prefill keeps vLLM's order
        ("kv_producer", "auto", True, "head", None),
        ("kv_consumer", "vllm", False, "", None),
        ("kv_consumer", "vllm", True, "", None),
        ("kv_consumer", "auto", True, "", None),  # the CPU backend reads LBHNC only
        ("kv_consumer", "auto", False, "", "BLNHC"),
        ("kv_consumer", "auto", False, "row", "BLNHC"),
        ("kv_consumer", "auto", False, "head", "BLHNC"),
        ("kv_consumer", "block", True, "", "BLHNC"),
        ("kv_consumer", "block", False, "row", "BLNHC"),
        ("kv_consumer", "block", False, "head", "BLHNC"),
    ],
)
def test_vllm_the_cache_order_each_side_asks_for(role, order, cpu, fused, want):
    extra = {"kv_cache_order": order, **({"kv_fused": fused} if fused else {})}
    assert required_layout(parse_settings(role, "e", extra), cpu) == want


@pytest.mark.parametrize(
    "name, want",
    [(None, "layer"), ("", "layer"), ("LBNHC", "layer"), ("LBHNC", "layer"), ("NHD", "layer"), ("blnhc", "layer"),
     ("BLNHC", "block"), ("BLHNC", "block")],
)  # fmt: skip
def test_vllm_decodes_buffer_mirrors_the_caches_order(name, want):
    assert buffer_order_of(name) == want


def test_vllm_ids_and_bindings_both_sides_derive_are_pinned():
    """Prefill and decode derive these apart (possibly different pdkv versions): each is
    pinned to its value, and what is not a valid id derives none."""
    assert transfer_pid("0123456789abcdef") == "xfer.4d8bc508dc7868d83fc487dca71c0b17"
    assert transfer_pid("u" * 128) is not None and transfer_pid("u" * 129) is None
    for bad in ("u" * 15, "x" * 15 + "\n", b"x" * 16, None, 12345678901234567):
        assert transfer_pid(bad) is None
    assert binding_of("cap", b"d" * 32).hex() == "bf3d03bb4973f14952de375bc5c9d2b811bbfef696beb382a0954095d3e0771a"
    assert token_digest([1, 2, 3]).hex() == "e2e2033ae7e19d680599d4eb0a1359a2b48ec5baac75066c317fbf85159c54ef"
    assert token_digest(np.array([1, 2, 3], dtype=np.int32)) == token_digest([1, 2, 3])  # any int type, one digest


def test_vllm_cache_orders():
    assert order_of(None, cpu=True) == ("head", False)  # the CPU backend: LBHNC
    assert order_of(None, cpu=False) == ("row", True)  # FlashAttention's default: LBNHC
    assert order_of("LBHNC", cpu=False) == ("row", False)
    assert order_of("BLNHC", cpu=False) == ("row", True)  # cross-layer: the spec's strides
    assert order_of("NHD", cpu=False, kv_fused="row") == ("row", True)
    with pytest.raises(LayoutError) as e:
        order_of("LHBNC", cpu=False)
    assert str(e.value) == (
        "vLLM's KV cache layout LHBNC puts heads or tokens outside the block; pdkv's connector reads "
        "block-contiguous layouts (BLHNC, BLNHC, HND, LBHNC, LBNHC, NHD)"
    )
    with pytest.raises(LayoutError) as e:
        order_of("LBNHC", cpu=True)
    assert str(e.value) == "vLLM's CPU cache order (kv_fused='head') is head-major; LBNHC is token-major"


def test_vllm_layouts_from_vllm_names():
    lay = layout_for(**LAY, order=("head", False))
    assert (lay.dtype, lay.kv_fused, lay.token_major, lay.layer_block_bytes) == ("float32", "head", False, 2048)
    assert layout_for(**{**LAY, "dtype": "fp8"}, order=("row", True)).dtype == "float8_e4m3"
    with pytest.raises(LayoutError) as e:
        layout_for(**{**LAY, "dtype": "torch.int8"}, order=("row", True))
    assert str(e.value) == (
        "vLLM's KV cache dtype torch.int8 is not one pdkv carries "
        "(fp8, fp8_e4m3, fp8_e5m2, torch.bfloat16, torch.float16, torch.float32)"
    )
    r = layout_for(**{**LAY, "kv_heads": 4, "tp_size": 2, "tp_rank": 1}, order=("row", True))
    assert (r.tp_size, r.tp_rank, r.heads_per_rank, r.token_major, r.kv_fused) == (2, 1, 2, True, "row")
    assert (r.num_layers, r.head_dim, r.tokens_per_block) == (2, 16, 8)


# ------------------------------------------------------------------ prefill's scheduler half


# ------------------------------------------------------------------ both halves, in process


def _layout():
    return layout_for(**LAY, order=("head", False))


KEY = b"k" * 32  # the prefill engine's instance key, as its scheduler half hands it over


def _prompt(n, start=0):
    """A prompt of ``n`` token ids."""
    return list(range(start, start + n))


def _cap(pid):
    return f"cap-of-{pid}"


def _params(pid, cap=None):
    """What prefill's answer carries for ``pid`` (decode's request shows it)."""
    return {"do_remote_prefill": True, PARAM_ID: pid, PARAM_CAP: _cap(pid) if cap is None else cap}


def _save(rid, pid, decode, tokens, blocks, start, end, prompt=None):
    b = binding_of(_cap(pid), token_digest(_prompt(tokens) if prompt is None else prompt))
    return Save(rid, pid, decode, tokens, blocks, start, end, b)


class _Pair:
    """Decode's scheduler half and worker half (a host 'vLLM cache' of 16 blocks) and
    prefill's worker half, with this test calling them in vLLM's order."""

    def __init__(
        self, *, load_timeout_s=20.0, queue_timeout_s=20.0, recompute=False, sender=None, extra=None, order="layer"
    ):
        lay = _layout()
        self.lay = lay
        cfg = {"buffer_blocks": 12, "load_timeout_s": load_timeout_s, "queue_timeout_s": queue_timeout_s}
        self.decode = DecodeSide(
            parse_settings("kv_consumer", "d", cfg),
            [lay],
            recompute=recompute,
            buffer_order=order,
        )
        # vLLM's cache: per layer (LBHNC) or block-outermost (BLHNC), as the buffer
        self.cache = np.zeros(lay.block_bytes * 16, np.uint8)
        self.loader = LoadWorker(lay, CacheSpec.for_buffer(lay, 16, self.cache.ctypes.data, order=order))
        self.src = np.random.default_rng(3).integers(0, 256, lay.block_bytes * 16, dtype=np.uint8)
        cfg = {"decode": self.decode.control_address, **(extra or {})}
        self.sender = SendWorker(
            parse_settings("kv_producer", "p", cfg),
            lay,
            CacheSpec.for_buffer(lay, 16, self.src.ctypes.data),
            sender=sender,
        )

    def prefill(self, rid, pid, blocks, tokens, chunks=None):
        """vLLM's prefill steps for one request: bind metadata, save each layer, end the step."""
        chunks = chunks or [tokens]
        start = 0
        for n in chunks:
            end = min(start + n, tokens)
            save = _save(rid, pid, self.decode.control_address, tokens, blocks, start, end)
            self.sender.start(StepMeta(saves=[save], instance_key=KEY))
            for layer in range(self.lay.total_layers):
                self.sender.save_layer(layer)
            self.sender.end_step()
            start = end

    def sent(self, rid, timeout=10.0):
        """vLLM's get_finished until the request's send is settled (vLLM finished it)."""
        done, first, deadline = set(), True, time.monotonic() + timeout
        while rid not in done and time.monotonic() < deadline:
            done |= self.sender.finished({rid} if first else set())
            first = False
            time.sleep(0.005)
        return rid in done

    def wait_state(self, pid, states, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.decode.sched.request(pid).state in states:
                    return True
            except Exception:
                pass
            time.sleep(0.005)
        return False

    def load(self, rid, blocks):
        """vLLM's decode steps: build metadata, start the loads, report what finished."""
        meta = self.decode.step_meta()
        self.loader.start(meta)
        deadline, done = time.monotonic() + 10, set()
        while rid not in done and time.monotonic() < deadline:
            done |= self.loader.finished()
            time.sleep(0.002)
        errors = self.loader.load_errors()
        self.decode.loaded(done, errors)
        return meta, errors

    def src_block(self, b):
        """Block ``b`` of prefill's cache (per layer), every layer side by side."""
        return _block(self.src, self.lay, b)

    def close(self):
        self.sender.close()
        self.loader.close()
        self.decode.close()


def _block(arr, lay, b):
    """Block ``b`` of a host cache in pdkv's buffer layout: every layer's fused block."""
    span, nb = lay.layer_block_bytes, len(arr) // lay.block_bytes
    return b"".join(
        arr[layer * nb * span + b * span : layer * nb * span + (b + 1) * span].tobytes() for layer in range(2)
    )


def test_vllm_halves_carry_a_request_and_free_every_block(no_leaks):
    """Prefill reserves without waiting and sends; vLLM's decode scheduler is told 'ask
    later' until the KV is in the buffer, then binds its blocks; the worker copies; every
    byte arrives where vLLM's block table says, and the buffer is empty again."""
    p = _Pair()
    try:
        params = _params("p1")
        assert p.decode.matched("v1", params, _prompt(20), 0) == (None, False)  # not reserved yet
        p.prefill("a", "p1", (3, 7, 8), 20, chunks=[8, 8, 4])
        assert p.sent("a")
        assert p.sender.stats["received"] == 1
        assert p.decode.sched.request("p1").state is State.RECEIVED
        assert p.decode.matched("v1", params, _prompt(20), 0) == (20, True)
        p.decode.allocated("v1", [10, 2, 5, 9], 20)  # vLLM's blocks (one more than the prompt needs)
        meta, errors = p.load("v1", None)
        assert [ld.blocks for ld in meta.loads] == [(10, 2, 5)] and errors == set()
        for src_b, dst_b in zip((3, 7, 8), (10, 2, 5)):
            assert _block(p.cache, p.lay, dst_b) == _block(p.src, p.lay, src_b)
        assert p.decode.finished("v1") is False  # loaded: nothing for vLLM to wait for
        assert p.decode.sched.buffer.num_free == 12 and p.decode.sched.live_requests() == []
        assert p.loader.recent["v1"] == (10, 2, 5)
    finally:
        p.close()


def test_vllm_a_block_outermost_decode_cache_and_buffer_take_whole_blocks(no_leaks):
    """Decode's cache and buffer block-outermost (vLLM's BLHNC, the buffer mirroring it),
    prefill per layer: every layer of every block lands where vLLM's block table says, the
    step's metadata tells the workers the buffer's order, and a run of blocks consecutive
    in the buffer and the cache is one piece of the swap."""
    from pdkv import plan

    p = _Pair(order="block")
    try:
        params = _params("p1")
        p.prefill("a", "p1", (3, 7, 8, 9), 30, chunks=[16, 14])
        assert p.sent("a")
        assert p.decode.matched("v1", params, _prompt(30), 0) == (30, True)
        p.decode.allocated("v1", [10, 2, 3, 4], 30)
        meta, errors = p.load("v1", None)
        assert meta.buffer_order == "block" and errors == set()
        span = p.lay.block_bytes  # every layer of a block, side by side
        for src_b, dst_b in zip((3, 7, 8, 9), (10, 2, 3, 4)):
            assert p.cache[dst_b * span : (dst_b + 1) * span].tobytes() == p.src_block(src_b)
        (ld,) = meta.loads
        engine = p.loader._swap(meta)
        cp = plan.plan_copy(engine.buffer, engine.gpu, list(ld.buffer_blocks), list(ld.blocks))
        runs = len(plan.run_starts(np.asarray(ld.buffer_blocks), np.asarray(ld.blocks))[0])
        assert cp.pieces == runs and int(cp.lengths.sum()) == 4 * span  # whole blocks, every layer
        assert p.decode.sched.buffer.num_free == 12
    finally:
        p.close()


def test_vllm_decode_local_prefix_hit_loads_only_the_rest(no_leaks):
    p = _Pair()
    try:
        p.prefill("a", "p2", (1, 2, 3), 24)
        assert p.sent("a")
        params = _params("p2")
        assert p.decode.matched("v", params, _prompt(24), 8) == (16, True)  # vLLM holds the first block
        p.decode.allocated("v", [6, 11, 12], 16)
        meta, _ = p.load("v", None)
        assert [(ld.blocks, len(ld.buffer_blocks)) for ld in meta.loads] == [((11, 12), 2)]
        assert _block(p.cache, p.lay, 11) == _block(p.src, p.lay, 2)
        assert p.decode.sched.buffer.num_free == 12
    finally:
        p.close()


@pytest.mark.parametrize("recompute", [False, True])
def test_vllm_decode_kv_that_never_comes_follows_the_failure_policy(recompute, no_leaks):
    """No reservation within load_timeout_s: with 'recompute' vLLM computes the prompt
    (0 tokens matched); with 'fail' it waits for a load that then fails (every block it
    bound reported as a load error), so vLLM fails the request by its own rule."""
    p = _Pair(load_timeout_s=0.3, recompute=recompute)
    try:
        params = _params("never")
        assert p.decode.matched("v", params, _prompt(16), 0) == (None, False)
        time.sleep(0.35)
        got = p.decode.matched("v", params, _prompt(16), 0)
        if recompute:
            assert got == (0, False)
            return
        assert got == (16, True)
        p.decode.allocated("v", [4, 5], 16)
        meta, errors = p.load("v", None)
        assert meta.loads[0].buffer_blocks == () and errors == {4, 5}
        assert p.decode.finished("v") is False
    finally:
        p.close()


def test_vllm_decode_mismatched_prompt_and_unclaimed_kv_are_dropped(no_leaks):
    p = _Pair(load_timeout_s=0.5, recompute=True)
    try:
        p.prefill("a", "p3", (1, 2), 16)
        p.prefill("b", "p4", (4,), 8)
        assert p.sent("a") and p.sent("b")
        # the prompt decode got is not the one prefill sent: no proof, computed locally; the
        # KV it named is left as it was (another request may be its own)
        assert p.decode.matched("v", _params("p3"), _prompt(17), 0) == (0, False)
        assert p.decode.sched.request("p3").state is State.RECEIVED and p.decode.refused == 1
        # nobody proves p3 or p4 its own: the sweeper drops both (vLLM may be idle: no step needed)
        assert p.wait_state("p4", {State.ABORTED}, timeout=5)
        assert p.wait_state("p3", {State.ABORTED}, timeout=5)
        assert p.decode.sched.buffer.num_free == 12
        # a request without pdkv's parameters is none of the connector's business
        assert p.decode.matched("w", None, _prompt(8), 0) == (0, False)
        assert p.decode.matched("w", {"do_remote_decode": True, PARAM_ID: "x"}, _prompt(8), 0) == (0, False)
    finally:
        p.close()


def test_vllm_decode_finished_before_and_after_binding(no_leaks):
    """vLLM ends a request: before its blocks were bound, pdkv drops the KV (vLLM frees
    its blocks at once); after, vLLM must keep them until the worker's copy is reported."""
    p = _Pair()
    try:
        p.prefill("a", "p5", (1,), 8)
        p.prefill("b", "p6", (2,), 8)
        assert p.sent("a") and p.sent("b")
        assert p.decode.matched("va", _params("p5"), _prompt(8), 0) == (8, True)
        assert p.decode.finished("va") is False
        assert p.decode.sched.request("p5").state is State.ABORTED
        assert p.decode.matched("vb", _params("p6"), _prompt(8), 0) == (8, True)
        p.decode.allocated("vb", [3], 8)
        assert p.decode.finished("vb") is True
        p.load("vb", None)
        assert p.decode.sched.buffer.num_free == 12 and p.decode.sched.live_requests() == []
    finally:
        p.close()


def test_vllm_prefill_cut_short_ends_at_decode_and_settles(no_leaks):
    """vLLM finishes a request after its first chunk (its client went away): decode hears
    it failed, its buffer blocks come back, and prefill reports the request settled."""
    p = _Pair()
    try:
        p.sender.start(StepMeta(saves=[_save("a", "p7", p.decode.control_address, 24, (1, 2), 0, 8)], instance_key=KEY))
        for layer in range(2):
            p.sender.save_layer(layer)
        p.sender.end_step()
        assert p.sent("a")
        assert p.wait_state("p7", {State.FAILED, State.ABORTED})
        deadline = time.monotonic() + 5  # quarantined until the fence grace passes
        while p.decode.sched.buffer.num_free != 12 and time.monotonic() < deadline:
            p.decode.step_meta()
            time.sleep(0.05)
        assert p.decode.sched.buffer.num_free == 12
        assert p.sender.stats["failed"] == 1
    finally:
        p.close()


def test_vllm_prefill_without_a_session_settles_and_frees(no_leaks):
    """No decode to talk to: the request is settled (failed) without a hang, and vLLM may
    free its blocks."""

    def refuse(decode):
        raise OSError(f"connection to {decode} refused")

    p = _Pair(sender=refuse)
    try:
        p.prefill("a", "p8", (1,), 8)
        assert p.sent("a", timeout=5)
        assert p.sender.stats["failed"] == 1
    finally:
        p.close()


def test_vllm_a_full_buffer_queues_then_refuses_and_decode_computes_at_once(no_leaks):
    """Decode's buffer is full: prefill's reservation waits in decode's queue (prefill keeps
    its blocks: not settled), for queue_timeout_s; refused then, prefill settles it failed
    and frees its blocks, and decode's request for it is computed there at once (it does
    not wait load_timeout_s, 20 s here)."""
    p = _Pair(queue_timeout_s=0.5)
    try:
        p.prefill("big", "p9", tuple(range(12)), 12 * 8)  # takes the whole buffer
        assert p.sent("big")
        p.prefill("a", "p10", (1,), 8)
        assert not p.sent("a", timeout=0.2)  # queued: vLLM keeps prefill's blocks
        assert p.decode.sched.request("p10").state is State.QUEUED
        assert p.decode.matched("va", _params("p10"), _prompt(8), 0) == (None, False)  # proven, waiting
        assert p.sent("a", timeout=5)
        assert p.sender.stats == {**p.sender.stats, "received": 1, "failed": 1}
        t0 = time.monotonic()
        assert p.decode.matched("va", _params("p10"), _prompt(8), 0) == (0, False)  # computed here
        assert time.monotonic() - t0 < 1 and p.decode.computed_here == 1
    finally:
        p.close()


def test_vllm_a_full_buffer_queues_until_decode_loads_and_frees_room(no_leaks):
    """Decode's buffer is full; a second request's reservation waits in the queue until
    decode's vLLM loads the first (its buffer blocks come back): then it is granted, sent
    and loaded, byte for byte."""
    p = _Pair()
    try:
        p.prefill("big", "p9", tuple(range(12)), 12 * 8)
        assert p.sent("big")
        p.prefill("a", "p10", (13,), 8)
        assert not p.sent("a", timeout=0.2)
        assert p.decode.matched("vbig", _params("p9"), _prompt(96), 0) == (96, True)
        p.decode.allocated("vbig", list(range(12)), 96)
        p.load("vbig", None)
        assert p.sent("a", timeout=5) and p.sender.stats == {**p.sender.stats, "received": 2, "failed": 0}
        assert p.decode.matched("va", _params("p10"), _prompt(8), 0) == (8, True)
        p.decode.allocated("va", [15], 8)
        meta, errors = p.load("va", None)
        assert errors == set() and _block(p.cache, p.lay, 15) == _block(p.src, p.lay, 13)
    finally:
        p.close()


def test_vllm_head_layout_refuses_other_orders_at_decode():
    with pytest.raises(LayoutMismatchError, match="pairs only with another"):
        from pdkv import tp_segments

        tp_segments(_layout(), KVLayout(num_layers=2, kv_heads=2, head_dim=16, tokens_per_block=8, dtype="fp32"))


def test_vllm_deferred_request_waits_for_the_end_of_its_step(no_leaks):
    """A request not granted by its first layer's save is sent whole from the background
    thread, but only once vLLM's step ended: here the grant comes while the forward is still
    between layer 0 and layer 1, and layer 1's values are written after it; decode must get
    the values the step ended with."""
    p = _Pair()
    try:
        save = _save("a", "late-layer", p.decode.control_address, 16, (1, 2), 0, 16)
        p.sender.start(StepMeta(saves=[save], instance_key=KEY))  # no session yet: reserved from the background thread
        p.sender.save_layer(0)
        assert p.wait_state("late-layer", {State.RESERVED})  # granted while the forward runs
        time.sleep(0.2)
        span, nb = p.lay.layer_block_bytes, 16
        for b in (1, 2):  # the forward writes layer 1 now
            p.src[nb * span + b * span : nb * span + (b + 1) * span] = 0x5A
        p.sender.save_layer(1)
        p.sender.end_step()
        assert p.sent("a")
        assert p.decode.matched("v", _params("late-layer"), _prompt(16), 0) == (16, True)
        p.decode.allocated("v", [4, 5], 16)
        p.load("v", None)
        for src_b, dst_b in ((1, 4), (2, 5)):
            assert _block(p.cache, p.lay, dst_b) == _block(p.src, p.lay, src_b)
        assert p.sender.stats["deferred"] == 1
    finally:
        p.close()


def test_vllm_prefill_reopens_a_session_that_broke(no_leaks):
    """The session with decode broke (decode restarted, say): the next request finds the
    pooled sender broken, which leaves the pool, and goes through a new session."""
    p = _Pair()
    try:
        p.prefill("a", "s1", (1,), 8)
        assert p.sent("a")
        (tx,) = p.sender._senders.values()
        tx.close()  # the session ends at both ends (as when decode ends it)
        p.prefill("b", "s2", (2,), 8)
        assert p.sent("b")
        p.prefill("c", "s3", (3,), 8)
        assert p.sent("c")
        assert p.sender.stats["received"] == 3 and p.sender.stats["failed"] == 0
        assert tx not in p.sender._senders.values()
        assert p.decode.sched.request("s3").state is State.RECEIVED
    finally:
        p.close()


def test_vllm_decode_too_few_blocks_fails_the_load_and_frees_the_buffer_at_once(no_leaks):
    p = _Pair()
    try:
        p.prefill("a", "few", (1, 2), 16)
        assert p.sent("a")
        assert p.decode.matched("v", _params("few"), _prompt(16), 0) == (16, True)
        p.decode.allocated("v", [4], 16)  # one block for two
        assert p.decode.sched.request("few").state is State.ABORTED
        assert p.decode.sched.buffer.num_free == 12
        _, errors = p.load("v", None)
        assert errors == {4}
    finally:
        p.close()


# ---- views.cache_spec on CPU tensors, in each of vLLM's orders (the GPU test swaps through them)
VL, VH, VN, VD, VNB = 3, 4, 8, 16, 6  # layers, heads, tokens a block, head_dim, blocks


def _views(torch, order, dtype=None):
    dtype = dtype or torch.bfloat16
    if order == "BLHNC":  # cross-layer: one allocation, a block of every layer together
        raw = torch.zeros((VNB, VL, VH, VN, 2 * VD), dtype=dtype)
        return [raw[:, li] for li in range(VL)]
    if order == "LBHNC":
        return [torch.zeros((VNB, VH, VN, 2 * VD), dtype=dtype) for _ in range(VL)]
    return [torch.zeros((VNB, VN, VH, 2 * VD), dtype=dtype).permute(0, 2, 1, 3) for _ in range(VL)]  # LBNHC


@pytest.mark.parametrize("order", ["BLHNC", "LBHNC", "LBNHC"])
def test_cache_spec_reads_each_order_as_bases_and_block_strides(order):
    torch = pytest.importorskip("torch")
    from pdkv.integrations.vllm.views import cache_spec

    lay = KVLayout(num_layers=VL, kv_heads=VH, head_dim=VD, tokens_per_block=VN, dtype="bf16", kv_fused="row",
                   token_major=order == "LBNHC")  # fmt: skip
    views = _views(torch, order)
    spec = cache_spec(lay, views)
    fused = lay.layer_block_bytes
    assert fused == VH * VN * 2 * VD * 2 and spec.num_blocks == VNB and spec.device is None
    for li, v in enumerate(views):
        k_base, k_stride = spec.region(li, 0)
        v_base, v_stride = spec.region(li, 1)
        assert k_base == v.data_ptr() and k_stride == v_stride == (VL * fused if order == "BLHNC" else fused)
        assert v_base == k_base + lay.tensor_offset(1)
        # block 5 of this layer, as pdkv addresses it, is vLLM's view's block 5
        assert spec.address(li, 0, 5) == v[5].data_ptr()


def test_cache_spec_refuses_views_that_are_not_the_layout():
    torch = pytest.importorskip("torch")
    from pdkv.integrations.vllm.views import cache_spec

    lay = KVLayout(num_layers=1, kv_heads=VH, head_dim=VD, tokens_per_block=VN, dtype="bf16", kv_fused="row")
    good = torch.zeros((VNB, VH, VN, 2 * VD), dtype=torch.bfloat16)
    cases = [
        (torch.zeros((VNB, VH, VN, VD), dtype=torch.bfloat16),
         "vLLM's KV cache of layer 0 is (6, 4, 8, 16); pdkv expects [blocks, 4, 8, 32]"),
        (torch.zeros((VNB, VH * VN, 2 * VD), dtype=torch.bfloat16),
         "vLLM's KV cache of layer 0 is (6, 32, 32); pdkv expects [blocks, 4, 8, 32]"),
        (torch.zeros((VNB, VH, VN, 2 * VD), dtype=torch.float32),
         "vLLM's KV cache of layer 0 is torch.float32; the layout says bfloat16"),
        (torch.zeros((VNB, VN, VH, 2 * VD), dtype=torch.bfloat16).permute(0, 2, 1, 3),
         "vLLM's KV cache of layer 0 has strides (1024, 32, 128, 1); pdkv's head-major order expects (.., 256, 32, 1)"),
    ]  # fmt: skip
    for view, msg in cases:
        with pytest.raises(LayoutError) as e:
            cache_spec(lay, [view])
        assert str(e.value) == msg
    two = KVLayout(num_layers=2, kv_heads=VH, head_dim=VD, tokens_per_block=VN, dtype="bf16", kv_fused="row")
    with pytest.raises(LayoutError) as e:
        cache_spec(two, [good, torch.zeros((VNB + 1, VH, VN, 2 * VD), dtype=torch.bfloat16)])
    assert str(e.value) == "vLLM's KV cache of layer 1 has 7 blocks, layer 0 6"
    tm = KVLayout(num_layers=1, kv_heads=VH, head_dim=VD, tokens_per_block=VN, dtype="bf16", kv_fused="row",
                  token_major=True)  # fmt: skip
    with pytest.raises(LayoutError) as e:
        cache_spec(tm, [good])
    assert str(e.value) == (
        "vLLM's KV cache of layer 0 has strides (1024, 256, 32, 1); pdkv's token-major order expects (.., 32, 128, 1)"
    )


def test_cache_spec_ignores_the_stride_of_a_dimension_of_one():
    torch = pytest.importorskip("torch")
    from pdkv.integrations.vllm.views import cache_spec

    # one head: vLLM may give its dimension any stride; only the others are checked
    lay = KVLayout(num_layers=1, kv_heads=1, head_dim=VD, tokens_per_block=VN, dtype="bf16", kv_fused="row")
    raw = torch.zeros((VNB, VN, 2 * VD), dtype=torch.bfloat16)
    view = raw.as_strided((VNB, 1, VN, 2 * VD), (VN * 2 * VD, 12345, 2 * VD, 1))
    spec = cache_spec(lay, [view])
    assert spec.region(0, 0) == (raw.data_ptr(), VN * 2 * VD * 2)
    big = torch.zeros(VNB * VN * 4 * VD, dtype=torch.bfloat16)  # room for a token stride of 2 x head_dim + 1
    bad = big.as_strided((VNB, 1, VN, 2 * VD), (VN * 4 * VD, 12345, 2 * VD + 1, 1))
    with pytest.raises(LayoutError, match="has strides"):
        cache_spec(lay, [bad])


class _OnDevice:
    """A CPU tensor that says it lives on CUDA device ``index`` (cache_spec reads tensors by
    duck typing: shape, strides, dtype, data_ptr and device)."""

    def __init__(self, t, index):
        self._t, self.is_cuda, self.device = t, True, _Dev(index)

    def __getattr__(self, name):
        return getattr(self._t, name)


class _Dev:
    def __init__(self, index):
        self.index = index

    def __eq__(self, other):
        return isinstance(other, _Dev) and other.index == self.index

    def __hash__(self):
        return self.index

    def __str__(self):
        return f"cuda:{self.index}"


def test_cache_spec_takes_the_views_device_and_refuses_two():
    torch = pytest.importorskip("torch")
    from pdkv.integrations.vllm.views import cache_spec

    lay = KVLayout(num_layers=2, kv_heads=VH, head_dim=VD, tokens_per_block=VN, dtype="bf16", kv_fused="row")
    raw = [torch.zeros((VNB, VH, VN, 2 * VD), dtype=torch.bfloat16) for _ in range(2)]
    assert cache_spec(lay, [_OnDevice(r, 3) for r in raw]).device == 3
    one = KVLayout(num_layers=1, kv_heads=VH, head_dim=VD, tokens_per_block=VN, dtype="bf16", kv_fused="row")
    assert cache_spec(one, [_OnDevice(raw[0], 2)]).device == 2
    assert cache_spec(lay, raw).device is None  # host tensors: no device
    with pytest.raises(LayoutError) as e:
        cache_spec(lay, [_OnDevice(raw[0], 0), _OnDevice(raw[1], 1)])
    assert str(e.value) == "vLLM's KV cache of layer 1 is on cuda:1, layer 0 on cuda:0"


def test_cache_spec_checks_the_stride_of_a_dimension_of_two():
    torch = pytest.importorskip("torch")
    from pdkv.integrations.vllm.views import cache_spec

    lay = KVLayout(num_layers=1, kv_heads=2, head_dim=VD, tokens_per_block=VN, dtype="bf16", kv_fused="row")
    big = torch.zeros(VNB * 4 * VN * 2 * VD, dtype=torch.bfloat16)
    # two heads whose rows are twice as far apart as the layout's: refused, though only 2 of them
    bad = big.as_strided((VNB, 2, VN, 2 * VD), (4 * VN * 2 * VD, 2 * VN * 2 * VD, 2 * VD, 1))
    with pytest.raises(LayoutError) as e:
        cache_spec(lay, [bad])
    assert str(e.value) == (
        "vLLM's KV cache of layer 0 has strides (1024, 512, 32, 1); pdkv's head-major order expects (.., 256, 32, 1)"
    )


# ------------------------------------------------------------------ hostile requests


@pytest.mark.parametrize("how", ["same-length", "no-cap", "forged-cap", "other-length"])
def test_vllm_a_request_naming_anothers_id_loads_nothing_of_it(how, no_leaks):
    """A client's request names the victim's pdkv id: with another prompt of the same
    length, without the capability, with a made-up one, or with another length. It is
    computed here (nothing loaded), whether it asks before or after the KV arrived and
    whether vLLM then finishes it; the victim's KV stays, and the victim's own request
    loads it byte for byte."""
    p = _Pair()
    try:
        victim = _prompt(20)
        forged = {
            "same-length": (_params("p1"), _prompt(20, start=1000)),
            "no-cap": ({"do_remote_prefill": True, PARAM_ID: "p1"}, victim),
            "forged-cap": (_params("p1", cap="guess"), victim),
            "other-length": (_params("p1"), _prompt(12)),
        }[how]
        early = p.decode.matched("early", *forged, 0)  # before prefill's KV came
        assert early == (None, False)
        p.prefill("a", "p1", (3, 7, 8), 20)
        assert p.sent("a") and p.decode.sched.request("p1").state is State.RECEIVED
        assert p.decode.matched("early", *forged, 0) == (0, False)
        assert p.decode.finished("early") is False  # vLLM ends it: nothing of p1 ends with it
        assert p.decode.matched("late", *forged, 0) == (0, False)
        assert p.decode.refused == 2
        assert p.decode.sched.request("p1").state is State.RECEIVED
        # the victim's own request: its KV, byte for byte
        assert p.decode.matched("v1", _params("p1"), victim, 0) == (20, True)
        p.decode.allocated("v1", [10, 2, 5], 20)
        meta, errors = p.load("v1", None)
        assert [ld.blocks for ld in meta.loads] == [(10, 2, 5)] and errors == set()
        for src_b, dst_b in zip((3, 7, 8), (10, 2, 5)):
            assert _block(p.cache, p.lay, dst_b) == _block(p.src, p.lay, src_b)
    finally:
        p.close()


def test_vllm_prefill_mints_the_id_and_capability_a_client_only_hints(no_leaks):
    """Two requests naming one pdkv id get two ids (the client's value their prefix) and
    two capabilities; a name that is not printable is not kept at all."""
    side = PrefillSide(parse_settings("kv_producer", "e", {"decode": "tcp://127.0.0.1:9"}))
    ask = {"do_remote_decode": True, PARAM_ID: "shared"}
    meta = side.step([("r1", ask, _prompt(8), [1], 0), ("r2", ask, _prompt(8), [2], 0)], [], {"r1": 8, "r2": 8})
    ids = [s.pid for s in meta.saves]
    assert ids[0] != ids[1] and all(i.startswith("shared.") for i in ids)
    a, b = side.finished("r1")[1], side.finished("r2")[1]
    assert a is not None and b is not None and a[PARAM_CAP] != b[PARAM_CAP] and len(a[PARAM_CAP]) == 32
    assert meta.saves[0].binding == binding_of(a[PARAM_CAP], token_digest(_prompt(8)))
    odd = side.step([("r3", {"do_remote_decode": True, PARAM_ID: "a\nb"}, _prompt(8), [3], 0)], [], {"r3": 8})
    assert odd.saves[0].pid.startswith("vllm.")


def test_vllm_a_computed_instance_key_joins_nothing(no_leaks):
    """The key a peer holding the secret could compute from public data (the instance
    name, the engine id) is not the engine's: a session showing it, under the engine's
    instance name, is refused while the engine's session is live, and its reservation of
    the engine's request never happens."""
    import hashlib
    import hmac

    from pdkv import PrefillSender
    from pdkv.errors import PeerError

    p = _Pair()
    try:
        p.sender.start(StepMeta(saves=[_save("a", "p1", p.decode.control_address, 16, (1, 2), 0, 8)], instance_key=KEY))
        for layer in range(2):
            p.sender.save_layer(layer)
        p.sender.end_step()
        assert p.wait_state("p1", {State.RESERVED, State.RECEIVING})
        guess = hmac.new(b"pdkv-vllm", b"instance-key:p", hashlib.sha256).digest()  # the old default
        lay = _layout()
        arr = np.zeros(lay.block_bytes * 4, np.uint8)
        with pytest.raises(PeerError, match="another instance key"):
            PrefillSender(
                lay,
                CacheSpec.for_buffer(lay, 4, arr.ctypes.data),
                p.decode.control_address,
                instance="vllm-p",
                instance_key=guess,
                transport="tcp",
                timeout_s=5,
            )
        assert p.decode.sched.request("p1").state in (State.RESERVED, State.RECEIVING)
    finally:
        p.close()


def test_vllm_pdkv_decode_naming_an_unlisted_address_connects_nowhere(no_leaks):
    """A request's pdkv_decode names an address the operator did not configure (a
    listener this test owns): prefill computes it here only, and nothing connects there."""
    import socket

    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen()
    trap.setblocking(False)
    try:
        p = _Pair()
        try:
            side = PrefillSide(parse_settings("kv_producer", "e", {"decode": p.decode.control_address}))
            there = f"tcp://127.0.0.1:{trap.getsockname()[1]}"
            for addr in (there, "garbage", 5):
                meta = side.step([("r", {"do_remote_decode": True, "pdkv_decode": addr}, _prompt(8), [1], 0)], [], {})
                assert meta.saves == [] and side.finished("r") == (False, None)
            assert side.refused == 3
            # the configured one may be named, and is the default
            for ask in (
                {"do_remote_decode": True, "pdkv_decode": p.decode.control_address},
                {"do_remote_decode": True},
            ):
                meta = side.step([("q", ask, _prompt(8), [1], 0)], [], {"q": 8})
                assert [s.decode for s in meta.saves] == [p.decode.control_address]
                side.finished("q")
            time.sleep(0.2)
            with pytest.raises(BlockingIOError):
                trap.accept()  # nothing connected
        finally:
            p.close()
    finally:
        trap.close()


def test_vllm_a_dead_decode_delays_no_request_to_another(no_leaks):
    """Two configured decodes accept connections and never answer; a request to each is
    in flight when a request to the live decode is made: that one completes at once (each
    decode has its own background thread), and the dead ones fail alone, with the reason."""
    import socket

    dead = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        dead.append(s)
    p = None
    try:
        addrs = [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in dead]
        p = _Pair(extra={"decode": addrs})
        for i, a in enumerate(addrs):
            save = _save(f"d{i}", f"dead{i}", a, 8, (i + 1,), 0, 8)
            p.sender.start(StepMeta(saves=[save], instance_key=KEY))
            for layer in range(2):
                p.sender.save_layer(layer)
            p.sender.end_step()
        t0 = time.monotonic()
        p.prefill("g", "good", (5, 6), 16)
        assert p.sent("g", timeout=10)
        took = time.monotonic() - t0
        assert p.sender.stats["received"] == 1 and took < 2.0, f"the good request took {took:.2f} s"
        assert p.sent("d0", timeout=20) and p.sent("d1", timeout=20)
        assert p.sender.stats["failed"] == 2
    finally:
        if p is not None:
            p.close()
        for s in dead:
            s.close()


def test_vllm_a_request_larger_than_the_buffer_is_computed_by_decode_at_once(no_leaks):
    """A prompt needing more blocks than decode's whole buffer can never be buffered: the
    reservation is refused, prefill settles it failed and frees its blocks, and decode's
    request for it is computed there at once (it used to wait load_timeout_s, 20 s here,
    and fail)."""
    p = _Pair()
    try:
        p.prefill("huge", "p-huge", tuple(range(13)), 13 * 8)  # 13 blocks; the buffer holds 12
        assert p.sent("huge", timeout=5) and p.sender.stats == {**p.sender.stats, "failed": 1}
        t0 = time.monotonic()
        assert p.decode.matched("v", _params("p-huge"), _prompt(104), 0) == (0, False)
        assert time.monotonic() - t0 < 1 and p.decode.computed_here == 1
    finally:
        p.close()


def test_vllm_prefill_advertises_its_pull_endpoint_as_configured(caplog):
    """A prefill bound to every interface answers with ``pull_advertise`` (what decodes
    list); one bound to port 0 logs the port it got, the address decodes must list."""
    import logging

    from pdkv.integrations.vllm.producer import PrefillSide

    s = parse_settings(
        "kv_producer", "p", {"decode": "tcp://d:1", "pull": "tcp://0.0.0.0:0", "pull_advertise": "tcp://pf-1:7100"}
    )
    side = PrefillSide(s)
    try:
        assert side.pull_address == "tcp://pf-1:7100"
    finally:
        side.close()
    with caplog.at_level(logging.INFO, logger="pdkv"):
        side = PrefillSide(parse_settings("kv_producer", "p", {"decode": "tcp://d:1", "pull": "tcp://127.0.0.1:0"}))
        try:
            bound = side.server.address
            assert bound != "tcp://127.0.0.1:0" and side.pull_address == bound
            rec = [r for r in caplog.records if "pull endpoint bound" in r.getMessage()]
            assert rec and rec[0].levelno == logging.WARNING and bound in rec[0].getMessage()
        finally:
            side.close()
