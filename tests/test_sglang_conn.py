"""pdkv.integrations.sglang.conn alone: the manager, sender, receiver and bootstrap server
SGLang's queues drive, over stand-ins of the two halves (``sides``' :class:`DecodeRank` and
``prefill_rank``'s :class:`PrefillRank`, which test_sglang_sides.py tests) that record what
they are asked. What each of SGLang's calls becomes, each answer SGLang reads, and each
failure in its words; no socket, a second a run: the mutation tests of ``conn``. (The same
classes over real halves: test_sglang.py; inside real SGLang servers: test_sglang_served.py.)"""

from __future__ import annotations

import dataclasses
import logging
import types

import numpy as np
import pytest
from extras import need

conn_mod = need("sglang.srt.disaggregation.base.conn", "sglang")
pytestmark = pytest.mark.filterwarnings("ignore:Only CUDA:UserWarning")
KVPoll, Dest, Metric = conn_mod.KVPoll, conn_mod.KVTransferDestination, conn_mod.KVTransferMetric

from pdkv.errors import PdkvError  # noqa: E402
from pdkv.integrations.sglang import conn  # noqa: E402
from pdkv.integrations.sglang.bootstrap import entry_for  # noqa: E402
from pdkv.integrations.sglang.layouts import ModelFacts  # noqa: E402
from pdkv.integrations.sglang.sides import Settings  # noqa: E402
from pdkv.layout import KVLayout  # noqa: E402

SECRET = bytes(range(32))
SETTINGS = Settings(secret=SECRET)
LAYOUT = KVLayout(num_layers=2, kv_heads=4, head_dim=8, tokens_per_block=16, dtype="bfloat16", token_major=True)


class Side:
    """A stand-in for either half: records each call as (name, args); ``raises`` names the
    calls that raise PdkvError, ``answers`` what a call returns."""

    def __init__(self, *args, **kw) -> None:
        self.made = (args, kw)
        self.calls: list[tuple] = []
        self.raises: dict[str, str] = {}
        self.answers: dict[str, object] = {}
        self.pages = {"device": object()}

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *args))
            if name in self.raises:
                raise PdkvError(self.raises[name])
            return self.answers.get(name)

        return call


class Room:
    def __init__(self, state: str = "transferring", error: str = "", nbytes: int = 0) -> None:
        self.state, self.error, self.bytes, self.desks = state, error, nbytes, ["tcp://p:1", "tcp://p:2"]


@pytest.fixture
def halves(monkeypatch):
    """conn's halves and pool reader as stand-ins; returns what was made."""
    made: dict[str, object] = {}

    def side(kind):
        def make(*args, **kw):
            made[kind] = Side(*args, **kw)
            return made[kind]

        return make

    def pools(args, **kw):
        made["pools"] = (args, kw)
        return "pools"

    monkeypatch.setattr(conn, "DecodeRank", side("decode"))
    monkeypatch.setattr(conn, "PrefillRank", side("prefill"))
    monkeypatch.setattr(conn, "rank_pools", pools)
    return made


def _args(**kw) -> types.SimpleNamespace:
    a = {
        "engine_rank": 0,
        "kv_cache_dtype_str": "bfloat16",
        "total_kv_head_num": 4,
        "aux_data_ptrs": [4096, 8192],
        "aux_item_lens": [16, 8],
        "gpu_id": 3,
    }
    return types.SimpleNamespace(**{**a, **kw})


def _server(**kw) -> types.SimpleNamespace:
    s = {"tp_size": 1, "dp_size": 1, "device": "cpu", "host": "10.0.0.5", "pdkv_settings": SETTINGS}
    return types.SimpleNamespace(**{**s, **kw})


def _manager(mode: str = "decode", args=None, server=None, mla=False) -> conn.PdkvKVManager:
    return conn.PdkvKVManager(args or _args(), mode, server or _server(), mla)


# ---------------------------------------------------------------------- the manager


def test_a_decode_manager_builds_decodes_half(halves):
    m = _manager("decode", server=_server(disaggregation_bootstrap_port=9100))
    assert m.prefill is None and m.decode is halves["decode"]
    assert halves["decode"].made == (("pools", SETTINGS), {"aux": ([4096, 8192], [16, 8])})
    assert halves["pools"][1] == {"mla": False, "tp_size": 1, "device": None, "model": None}
    assert (m.bootstrap_port, m.tp_size, m.prefill_info_table, m.settings) == (9100, 1, {}, SETTINGS)
    assert m.supports_host_destination and m.supports_deferred_decode_kv_release and m.enable_deferred_decode_kv_release
    assert m.disaggregation_mode == "decode" and m.is_mla_backend is False


def test_a_prefill_manager_registers_at_its_host_and_bootstrap_port(halves):
    m = _manager(types.SimpleNamespace(value="PREFILL"), server=_server(disaggregation_bootstrap_port=9200))
    assert m.decode is None and m.prefill is halves["prefill"]
    assert halves["prefill"].made == (("pools", SETTINGS, "10.0.0.5:9200"), {"aux": ([4096, 8192], [16, 8])})


@pytest.mark.parametrize("host", [None, "", "absent"])
def test_a_prefill_without_a_host_registers_on_loopback_and_port_8998(halves, host):
    s = _server(host=host)
    if host == "absent":
        del s.host
    _manager("prefill", server=s)
    assert halves["prefill"].made[0][2] == "127.0.0.1:8998"


def test_a_manager_without_aux_buffers_passes_none(halves):
    _manager(args=_args(aux_data_ptrs=None, aux_item_lens=None))
    assert halves["decode"].made[1] == {"aux": ([], [])}


@pytest.mark.parametrize(
    "tp, dp, rank, want",
    [
        (4, 1, 0, 4),
        (4, 2, 1, 2),
        (None, None, 0, 1),
        (1, 1, 2, 3),
        (8, 4, 0, 2),
        (4, None, 0, 4),
        (4, 0, 0, 4),
        ("absent", "absent", 0, 1),
        (2, "absent", 0, 2),
        (4, "absent", 0, 4),
        ("absent", 1, 0, 1),
    ],
)
def test_the_tp_size_is_sglangs_attention_tp(halves, tp, dp, rank, want):
    s = _server(tp_size=tp, dp_size=dp)
    for name, v in (("tp_size", tp), ("dp_size", dp)):
        if v == "absent":
            delattr(s, name)
    m = _manager(args=_args(engine_rank=rank), server=s)
    assert m.tp_size == want and type(m.tp_size) is int and halves["pools"][1]["tp_size"] == want


@pytest.mark.parametrize("device, gpu_id, want", [("cpu", 3, None), ("cuda", 3, 3), ("cuda", None, 0), ("cuda", 0, 0)])
def test_a_gpu_pool_is_named_by_its_device(halves, device, gpu_id, want):
    _manager(args=_args(gpu_id=gpu_id), server=_server(device=device))
    assert halves["pools"][1]["device"] == want


def test_a_server_without_a_device_is_a_gpu_server(halves):
    s = _server()
    del s.device
    _manager(server=s)
    assert halves["pools"][1]["device"] == 3
    a = _args()
    del a.gpu_id
    _manager(args=a, server=s)
    assert halves["pools"][1]["device"] == 0


def test_the_manager_reads_sglangs_kvargs_and_defaults_to_mha(halves):
    a = _args()
    m = conn.PdkvKVManager(a, "decode", _server())
    assert m.is_mla_backend is False and halves["pools"][0] is a and halves["pools"][1]["mla"] is False


@pytest.mark.parametrize("absent", [False, True], ids=["none", "absent"])
def test_settings_come_from_the_environment_without_server_args_own(halves, monkeypatch, absent):
    monkeypatch.setenv("PDKV_SECRET", "ab" * 16)
    monkeypatch.delenv("PDKV_SECRET_FILE", raising=False)
    s = _server(pdkv_settings=None)
    if absent:
        del s.pdkv_settings
    m = _manager(server=s)
    assert m.settings.secret == b"\xab" * 16 and halves["decode"].made[0][1] is m.settings


def test_a_manager_for_another_mode_is_refused_by_name(halves):
    with pytest.raises(PdkvError) as e:
        _manager("null")
    assert str(e.value) == "pdkv's SGLang backend serves prefill and decode, not 'null'"


def test_an_mla_manager_says_so(halves):
    m = _manager(args=_args(total_kv_head_num=0), mla=True)
    assert m.is_mla_backend is True and halves["pools"][1]["mla"] is True and halves["pools"][1]["model"] is None


def test_deferred_release_off_in_sglang_is_named_at_start(halves, monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "false")
    with caplog.at_level(logging.WARNING, logger="pdkv.integrations.sglang.conn"):
        m = _manager()
    assert m.enable_deferred_decode_kv_release is False
    assert caplog.messages == [
        "pdkv: SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off: SGLang's decode releases the device "
        "pages of a failed transfer without asking pdkv whether a write into them still runs"
    ]
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "true")
    caplog.clear()
    assert _manager().enable_deferred_decode_kv_release is True and caplog.messages == []


def test_an_sglang_without_the_deferred_release_switch_defers(halves, monkeypatch, caplog):
    from sglang.srt import environ

    monkeypatch.setattr(environ, "envs", types.SimpleNamespace())
    with caplog.at_level(logging.WARNING, logger="pdkv.integrations.sglang.conn"):
        assert _manager().enable_deferred_decode_kv_release is True
    assert caplog.messages == []


# ---------------------------------------------------------------------- the model's facts


class _Config:
    asked: list = []

    @classmethod
    def from_server_args(cls, server_args):
        cls.asked.append(server_args)
        return types.SimpleNamespace(get_total_num_kv_heads=lambda: 8, dtype="torch.bfloat16")


@pytest.fixture
def config(monkeypatch):
    from sglang.srt.configs import model_config

    _Config.asked = []
    monkeypatch.setattr(model_config, "ModelConfig", _Config)
    return _Config


@pytest.mark.parametrize(
    "heads, dtype, mla, asked",
    [
        (4, "bfloat16", False, False),  # KVArgs says both
        (0, "bfloat16", False, True),  # decode without staging: no heads
        (None, "bfloat16", False, True),
        (4, "auto", False, True),  # SGLang's default dtype
        (4, "AUTO", False, True),
        (0, "bfloat16", True, False),  # MLA: one latent head, whatever KVArgs says
        (0, "auto", True, True),
    ],
)
def test_the_model_config_is_read_only_where_kvargs_leave_facts_out(config, heads, dtype, mla, asked):
    server = _server()
    got = conn._model_facts(_args(total_kv_head_num=heads, kv_cache_dtype_str=dtype), server, mla)
    assert got == (ModelFacts(kv_heads=8, dtype="torch.bfloat16") if asked else None)
    assert config.asked == ([server] if asked else [])


def test_kvargs_without_the_heads_field_ask_the_model_config(config):
    a = _args()
    del a.total_kv_head_num
    assert conn._model_facts(a, _server(), False) == ModelFacts(8, "torch.bfloat16")
    a = _args()
    del a.kv_cache_dtype_str
    assert conn._model_facts(a, _server(), False) is None


def test_a_model_config_that_cannot_say_fails_the_manager_by_name(monkeypatch):
    from sglang.srt.configs import model_config

    def broken(server_args):
        raise OSError("no config.json")

    monkeypatch.setattr(model_config.ModelConfig, "from_server_args", broken)
    with pytest.raises(PdkvError) as e:
        conn._model_facts(_args(kv_cache_dtype_str="auto"), _server(), False)
    assert str(e.value) == (
        "pdkv's SGLang backend: the model's KV heads and dtype are not in KVArgs, and SGLang's model "
        "config could not say (OSError: no config.json)"
    )


def test_the_manager_hands_the_models_facts_to_the_pools(halves, config):
    s = _server()
    _manager(args=_args(kv_cache_dtype_str="auto"), server=s)
    assert halves["pools"][1]["model"] == ModelFacts(8, "torch.bfloat16") and config.asked == [s]


# ---------------------------------------------------------------------- decode's manager calls


def test_the_prefill_table_is_described_once_as_sglangs_queue_reads_it(halves):
    m = _manager()
    lay = dataclasses.replace(LAYOUT, tp_size=2, tp_rank=0)
    ranks = {0: entry_for(SECRET, lay, "tcp://p:1", "i"), 1: {}}
    halves["decode"].answers["prefill_ranks"] = ranks
    assert m.try_ensure_parallel_info("p:8998")
    info = m.prefill_info_table["p:8998"]
    want = (2, 1, 1, 1, 16, "bfloat16", False)
    got = (info.attn_tp_size, info.attn_cp_size, info.dp_size, info.pp_size, info.page_size, info.kv_cache_dtype)
    assert (*got, info.follow_bootstrap_room) == want
    assert m.try_ensure_parallel_info("p:8998") and m.prefill_info_table["p:8998"] is info
    assert halves["decode"].calls == [("prefill_ranks", "p:8998")] * 2


def test_a_prefill_not_ready_is_not_described(halves, caplog):
    m = _manager()
    halves["decode"].raises["prefill_ranks"] = "nobody there"
    with caplog.at_level(logging.WARNING, logger="pdkv.integrations.sglang.conn"):
        assert m.try_ensure_parallel_info("p:1") is False
    assert m.prefill_info_table == {} and caplog.messages == ["pdkv: prefill at p:1 not ready: nobody there"]


def test_release_safety_is_decodes_answer_for_the_room(halves):
    m = _manager()
    halves["decode"].answers["release_safe_room"] = False
    assert m.is_abort_release_safe(np.int64(7), required_acks=2) is False
    assert halves["decode"].calls == [("release_safe_room", 7)] and type(halves["decode"].calls[0][1]) is int
    halves["decode"].answers["release_safe_room"] = True
    assert m.is_abort_release_safe(7) is True
    assert _manager("prefill").is_abort_release_safe(7) is True  # a prefill holds no decode page
    m.clear_deferred_abort_state(7)
    assert len(halves["decode"].calls) == 2


@pytest.mark.parametrize("rid, named", [("abc", "abc"), ("r" * 100, "r" * 80), (None, "?")])
def test_a_recompute_sglang_asks_for_fails_the_request_by_name(halves, rid, named):
    m = _manager()
    failed = []
    rx = types.SimpleNamespace(fail=failed.append)
    m.submit_prefill_recompute(rx, {"rid": rid} if rid is not None else {})
    assert failed == [
        "pdkv does not have prefill recompute a retracted request (pause_generation with retract): "
        f"request {named} fails"
    ]


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_close_and_teardown_close_the_half(halves, mode):
    m = _manager(mode)
    m.close()
    assert halves[mode].calls == [("close",)]
    m.teardown()
    assert halves[mode].calls == [("close",), ("close",)]
    m.register_to_bootstrap()  # prefill ranks registered when the manager started
    assert len(halves[mode].calls) == 2


# ---------------------------------------------------------------------- the sender


@pytest.fixture
def prefill(halves):
    m = _manager("prefill")
    side = halves["prefill"]
    side.answers["open"] = Room("waiting")
    return m, side


def test_a_sender_opens_its_room_and_passes_sglangs_calls_on(prefill):
    m, side = prefill
    out = side.answers["open"]
    s = conn.PdkvKVSender(m, "p:1", np.int64(5))
    assert s.bootstrap_room == 5 and type(s.bootstrap_room) is int and s.kv_mgr is m
    s.init(np.int64(3), 2)
    s.send(np.array([4, 5], np.int32), None, num_kv_tokens=32)
    s.send(np.array([6], np.int32), [None])
    assert side.calls == [("open", 5), ("init", out, 3, 2), ("send", out, [4, 5]), ("send", out, [6])]
    assert all(type(p) is int for p in side.calls[2][2]) and type(side.calls[1][2]) is int
    side.answers["prefix"] = 32
    assert s.pop_decode_prefix_len() == 32
    for state, want in [
        ("bootstrapping", KVPoll.Bootstrapping),
        ("waiting", KVPoll.WaitingForInput),
        ("transferring", KVPoll.Transferring),
        ("success", KVPoll.Success),
        ("failed", KVPoll.Failed),
    ]:
        side.answers["status"] = state
        assert s.poll() == int(want) and type(s.poll()) is int
        assert side.calls[-1] == ("status", out)
    assert ("prefix", out) in side.calls
    s.abort()
    s.clear()
    assert side.calls[-2:] == [("abort", out), ("forget", out)]


def test_a_sender_sends_no_state_pool(prefill):
    m, side = prefill
    s = conn.PdkvKVSender(m, "p:1", 5)
    s.send([1], [None, 7])
    assert side.calls[-1] == ("abort", side.answers["open"], "state pools are not carried by pdkv")


def test_a_sender_says_what_it_sent_only_once_it_succeeded(prefill):
    m, side = prefill
    out = side.answers["open"]
    s = conn.PdkvKVSender(m, "p:1", 5)
    out.bytes = 4096
    assert s.get_transfer_metric() == Metric()
    out.state = "success"
    assert s.get_transfer_metric() == Metric(transfer_total_bytes=4096)


def test_a_room_prefill_cannot_open_fails_its_sender_by_name(prefill):
    m, side = prefill
    side.raises["open"] = "room 5 is already in flight at this prefill rank"
    s = conn.PdkvKVSender(m, "p:1", 5)
    s.init(3, 2)
    s.send([1, 2])
    s.abort()
    s.clear()
    assert side.calls == [("open", 5)]  # nothing else reaches the half
    assert s.poll() == int(KVPoll.Failed) and s.pop_decode_prefix_len() == 0
    assert s.get_transfer_metric() == Metric()
    with pytest.raises(PdkvError) as e:
        s.failure_exception()
    assert str(e.value) == "pdkv: room 5: room 5 is already in flight at this prefill rank"


def test_a_failed_sender_names_the_reason_or_says_failed(prefill):
    m, side = prefill
    s = conn.PdkvKVSender(m, "p:1", 6)
    side.answers["open"].error = "decode answered aborted"
    with pytest.raises(PdkvError, match="^pdkv: room 6: decode answered aborted$"):
        s.failure_exception()
    side.answers["open"].error = ""
    with pytest.raises(PdkvError, match="^pdkv: room 6: failed$"):
        s.failure_exception()


def test_a_sender_needs_a_prefill_manager(halves):
    with pytest.raises(AssertionError, match="^a sender needs a prefill manager$"):
        conn.PdkvKVSender(_manager("decode"), "p:1", 5)


# ---------------------------------------------------------------------- the receiver


@pytest.fixture
def decode(halves):
    m = _manager("decode")
    side = halves["decode"]
    side.answers["start"] = Room("waiting")
    return m, side


def test_a_receiver_starts_publishes_and_polls_in_sglangs_order(decode):
    m, side = decode
    r = conn.PdkvKVReceiver(m, "p:1", np.int64(9), prefill_dp_rank=0)
    assert (r.bootstrap_room, r.bootstrap_addr, r.kv_mgr, r.conclude_state) == (9, "p:1", m, None)
    assert type(r.bootstrap_room) is int and r.bootstrap_infos == [] and r.abort_notified is False
    assert r.poll() == int(KVPoll.Bootstrapping) and r.conclude_state is None
    r.init(0)
    room = side.answers["start"]
    assert r.bootstrap_infos == room.desks and r.bootstrap_infos is not room.desks
    r.send_metadata(np.array([3, 4], np.int32), 7, None, decode_prefix_len=16, destination=Dest.HOST)
    r.send_metadata(np.array([5], np.int32), None, [None])
    r.send_metadata([6], 1, None, decode_prefix_len=None, destination=Dest.DEVICE)
    assert side.calls == [
        ("start", 9, "p:1"),
        ("publish", room, [3, 4], 7, "host", 16),
        ("publish", room, [5], None, "device", 0),
        ("publish", room, [6], 1, "device", 0),
    ]
    assert all(type(p) is int for p in side.calls[1][2])
    for state, want, concluded in [
        ("waiting", KVPoll.WaitingForInput, None),
        ("transferring", KVPoll.Transferring, None),
        ("success", KVPoll.Success, KVPoll.Success),
    ]:
        side.answers["status"] = state
        assert r.poll() == int(want) and r.conclude_state == concluded
        assert side.calls[-1] == ("status", room)
    side.answers["release_safe"] = True
    assert r.is_abort_release_safe() is True
    r.clear()
    assert side.calls[-2:] == [("release_safe", room), ("forget", room)]


def test_a_receiver_without_a_room_is_room_0(decode):
    m, _ = decode
    assert conn.PdkvKVReceiver(m, "p:1").bootstrap_room == 0
    assert conn.PdkvKVReceiver(m, "p:1", None).bootstrap_room == 0


def test_a_receiver_fails_once_polled_failed(decode):
    m, side = decode
    r = conn.PdkvKVReceiver(m, "p:1", 9)
    r.init()
    side.answers["status"] = "failed"
    assert r.poll() == int(KVPoll.Failed) and r.conclude_state == KVPoll.Failed
    side.answers["start"].error = "no KV within 60 s"
    with pytest.raises(PdkvError, match="^pdkv: room 9: no KV within 60 s$"):
        r.failure_exception()
    side.answers["start"].error = ""
    with pytest.raises(PdkvError, match="^pdkv: room 9: failed$"):
        r.failure_exception()


def test_a_receiver_whose_start_fails_is_failed_and_holds_nothing(decode):
    m, side = decode
    side.raises["start"] = "pdkv bootstrap at p:1: nobody"
    r = conn.PdkvKVReceiver(m, "p:1", 9)
    r.init()
    assert r.conclude_state == KVPoll.Failed and r.poll() == int(KVPoll.Failed)
    r.send_metadata([1], 0, None)
    r.abort()
    r.clear()
    assert side.calls == [("start", 9, "p:1")]
    assert r.is_abort_release_safe() is True and r.abort_notified
    with pytest.raises(PdkvError, match="^pdkv: room 9: pdkv bootstrap at p:1: nobody$"):
        r.failure_exception()


def test_metadata_the_half_refuses_aborts_the_request_naming_why(decode):
    m, side = decode
    r = conn.PdkvKVReceiver(m, "p:1", 9)
    r.init()
    room = side.answers["start"]
    side.raises["publish"] = "room 9: metadata sent twice"
    r.send_metadata([1], 0, None)
    assert side.calls[-1] == ("abort", room, "room 9: metadata sent twice")
    del side.raises["publish"]
    r.send_metadata([1], 0, [7])
    assert side.calls[-1] == ("abort", room, "state pools are not carried by pdkv")
    assert [c[0] for c in side.calls] == ["start", "publish", "abort", "abort"]


def test_an_abort_is_notified_and_concluded(decode):
    m, side = decode
    r = conn.PdkvKVReceiver(m, "p:1", 9)
    r.init()
    r.abort()
    assert r.abort_notified and r.conclude_state == KVPoll.Failed
    assert side.calls[-1] == ("abort", side.answers["start"])
    r2 = conn.PdkvKVReceiver(m, "p:1", 10)
    r2.ensure_abort_notified(force_arm=True)
    assert r2.abort_notified and r2.conclude_state == KVPoll.Failed


def test_fail_names_its_reason_before_and_after_init(decode):
    m, side = decode
    r = conn.PdkvKVReceiver(m, "p:1", 9)
    r.fail("weights changed")
    assert r.conclude_state == KVPoll.Failed and r.poll() == int(KVPoll.Failed)
    with pytest.raises(PdkvError, match="^pdkv: room 9: weights changed$"):
        r.failure_exception()
    assert side.calls == []
    r2 = conn.PdkvKVReceiver(m, "p:1", 10)
    r2.init()
    r2.fail("weights changed")
    assert side.calls[-1] == ("abort", side.answers["start"], "weights changed") and r2.conclude_state == KVPoll.Failed


def test_a_receiver_offers_the_host_destination_only_where_decode_has_a_host_pool(decode):
    m, side = decode
    r = conn.PdkvKVReceiver(m, "p:1", 9)
    assert r.supports_host_destination is False and r.require_staging is False
    side.pages["host"] = object()
    assert r.supports_host_destination is True


def test_a_receiver_never_started_fails_as_failed(decode):
    m, _ = decode
    r = conn.PdkvKVReceiver(m, "p:1", 9)
    with pytest.raises(PdkvError, match="^pdkv: room 9: failed$"):
        r.failure_exception()


def test_a_receiver_needs_a_decode_manager(halves):
    with pytest.raises(AssertionError, match="^a receiver needs a decode manager$"):
        conn.PdkvKVReceiver(_manager("prefill"), "p:1", 5)


# ---------------------------------------------------------------------- the bootstrap server


def test_the_bootstrap_server_serves_with_the_pairs_secret(monkeypatch):
    import json
    import urllib.request

    monkeypatch.setenv("PDKV_SECRET", SECRET.hex())
    monkeypatch.delenv("PDKV_SECRET_FILE", raising=False)
    b = conn.PdkvKVBootstrapServer("127.0.0.1", 0, dp_size=1)
    try:
        assert b.host == "127.0.0.1" and b.port > 0
        b.run()  # serving already
        entry = entry_for(SECRET, LAYOUT, "tcp://p:1", "i")
        req = urllib.request.Request(f"http://127.0.0.1:{b.port}/pdkv/ranks", json.dumps(entry).encode(), method="PUT")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
        wrong = entry_for(b"x" * 32, LAYOUT, "tcp://p:1", "i")
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(
                urllib.request.Request(
                    f"http://127.0.0.1:{b.port}/pdkv/ranks", json.dumps(wrong).encode(), method="PUT"
                ),
                timeout=5,
            )
        assert b._server.refused == 1
    finally:
        b.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{b.port}/pdkv/ranks", timeout=2)
