"""ReceiverOptions and SenderOptions: every field's last accepted and first refused value,
the exact message naming it, the defaults, and merge_options."""

from __future__ import annotations

import dataclasses
import os

import pytest

from pdkv import ReceiverOptions, SenderOptions
from pdkv.layout import CacheSpec, KVLayout
from pdkv.transfer.sessions import options as opts

POSITIVE = "must be a positive number"

# (class, field, accepted values, refused values, message of the first refused)
BOUNDS = [
    (ReceiverOptions, "peer_timeout_s", [1e-9, 1, 0.5], [0, -1, 0.0, True, "1", None], POSITIVE),
    (ReceiverOptions, "io_timeout_s", [1e-9, 2], [0, -0.5, False], POSITIVE),
    (ReceiverOptions, "min_data_rate", [1, 1.5], [0, -1], POSITIVE),
    (ReceiverOptions, "auth_timeout_s", [1e-9], [0, float("-inf")], POSITIVE),
    (ReceiverOptions, "max_pending_connections", [1, 10**6], [0, -1, 1.0, True], "must be a positive integer"),
    (ReceiverOptions, "max_connections", [1], [0, 2.0], "must be a positive integer"),
    (ReceiverOptions, "max_handshakes", [1], [0], "must be a positive integer"),
    (ReceiverOptions, "max_pending_control", [1], [0], "must be a positive integer"),
    (ReceiverOptions, "max_pending_per_source", [1], [0], "must be a positive integer"),
    (ReceiverOptions, "max_sessions", [1], [0], "must be a positive integer"),
    (ReceiverOptions, "max_blocks_per_instance", [None, 1], [0, -3, True], "must be a positive integer"),
    (ReceiverOptions, "rdma_port", [1, 255], [0, 256, True, "1"], "must be an integer in 1..255"),
    (ReceiverOptions, "rdma_gid_index", [None, 0, 65535], [-1, 65536, 1.0], "must be an integer in 0..65535"),
    (SenderOptions, "streams", [1, 64], [0, 65, True, 2.0], "must be an integer in 1..64"),
    (SenderOptions, "timeout_s", [1e-9], [0, -1], POSITIVE),
    (SenderOptions, "heartbeat_s", [1e-9], [0], POSITIVE),
    (SenderOptions, "copy_threads", [1, 64], [0, 65, False], "must be an integer in 1..64"),
    (SenderOptions, "rdma_port", [1, 255], [0, 256], "must be an integer in 1..255"),
    (SenderOptions, "rdma_gid_index", [None, 0, 65535], [-1, 65536], "must be an integer in 0..65535"),
    (SenderOptions, "staging_slots", [1, 1024], [0, 1025], "must be an integer in 1..1024"),
    (SenderOptions, "staging_slot_bytes", [None, 1, 1 << 32], [0, (1 << 32) + 1],
     "must be an integer in 1..4294967296"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "name", "good", "bad", "msg"), BOUNDS, ids=[f"{c.__name__}.{n}" for c, n, *_ in BOUNDS]
)
def test_each_field_at_its_bounds(cls, name, good, bad, msg):
    for v in good:
        assert getattr(cls(**{name: v}), name) == v
    for v in bad:
        with pytest.raises(ValueError) as e:
            cls(**{name: v})
        assert str(e.value) == f"{name}={v!r} {msg}"


def test_the_defaults():
    r = ReceiverOptions()
    assert (r.control, r.data_host, r.secret, r.transports) == ("tcp://127.0.0.1:0", "127.0.0.1", None, ("shm", "tcp"))
    assert (r.peer_timeout_s, r.io_timeout_s, r.auth_timeout_s, r.min_data_rate) == (10.0, 5.0, 5.0, 8 << 20)
    assert (r.max_pending_connections, r.max_connections, r.max_handshakes) == (64, 1024, 256)
    assert (r.max_pending_control, r.max_pending_per_source, r.max_sessions) == (64, 16, 1024)
    assert (r.max_blocks_per_instance, r.auto_tick, r.data_advertise, r.gpu_caches) == (None, False, None, None)
    assert (r.rdma_device, r.rdma_port, r.rdma_gid_index, r.nixl_ucx) == (None, 1, None, None)
    s = SenderOptions()
    assert (s.instance, s.secret, s.instance_key, s.transport) == ("prefill", None, None, "auto")
    assert s.streams == opts.default_streams()
    assert (s.timeout_s, s.heartbeat_s, s.on_outcome, s.staging, s.staging_slots) == (10.0, 1.0, None, "auto", 4)
    assert (s.staging_slot_bytes, s.gpudirect, s.rdma_port, s.rdma_gid_index) == (None, "auto", 1, None)
    assert s.copy_threads == opts.default_copy_threads()


def test_secrets_are_kept_out_of_repr():
    assert "hunter2" not in repr(ReceiverOptions(secret=b"hunter2-hunter2-hunter2"))
    assert "hunter2" not in repr(SenderOptions(secret=b"hunter2-hunter2-hunter2", instance_key=b"hunter2" * 3))


@pytest.mark.parametrize("cls", [ReceiverOptions, SenderOptions])
def test_a_secret_is_bytes_or_none(cls):
    assert cls(secret=b"x" * 16).secret == b"x" * 16 and cls(secret=None).secret is None
    for v in ("a string secret!", bytearray(16), 16):
        with pytest.raises(ValueError) as e:
            cls(secret=v)
        assert str(e.value) == "secret must be bytes (>= 16 of them) or None"


def test_receiver_transports():
    assert ReceiverOptions(transports=["tcp"]).transports == ("tcp",)  # a list becomes a tuple
    assert ReceiverOptions(transports=("shm", "tcp", "nixl")).transports == ("shm", "tcp", "nixl")
    for v in ("tcp", (), []):
        with pytest.raises(ValueError) as e:
            ReceiverOptions(transports=v)
        assert str(e.value) == f"transports={v!r} must be a non-empty sequence of transport names"
    with pytest.raises(ValueError) as e:
        ReceiverOptions(transports=("tcp", "shm", "tcp"))
    assert str(e.value) == "transports=('tcp', 'shm', 'tcp') names a transport twice"


def test_receiver_gpu_caches_become_a_tuple():
    lay = KVLayout(num_layers=1, kv_heads=1, head_dim=8, tokens_per_block=4, dtype="float16")
    spec = CacheSpec.for_buffer(lay, 2, 4096)
    assert ReceiverOptions(gpu_caches=[spec]).gpu_caches == (spec,)


def test_sender_names_and_choices():
    assert SenderOptions(instance="a").instance == "a"
    assert SenderOptions(instance="x" * 256).instance == "x" * 256
    for v in ("", "x" * 257, "bad\nname", 7, None):
        with pytest.raises(ValueError) as e:
            SenderOptions(instance=v)
        assert str(e.value) == f"instance={v!r:.80} must be a string of 1-256 printable characters"
    for v in (None, 3, b"tcp"):
        with pytest.raises(ValueError) as e:
            SenderOptions(transport=v)
        assert str(e.value) == f"transport={v!r} must be a transport name or 'auto'"
    assert SenderOptions(instance_key=b"k" * 16).instance_key == b"k" * 16
    for v in (b"k" * 15, "k" * 32, bytearray(32)):
        with pytest.raises(ValueError) as e:
            SenderOptions(instance_key=v)
        assert str(e.value) == "instance_key must be bytes (>= 16 of them) or None"
    assert SenderOptions(staging="always").staging == "always"
    with pytest.raises(ValueError) as e:
        SenderOptions(staging="never")
    assert str(e.value) == "staging='never' must be 'auto' or 'always'"
    for v in ("off", "require"):
        assert SenderOptions(gpudirect=v).gpudirect == v
    with pytest.raises(ValueError) as e:
        SenderOptions(gpudirect="on")
    assert str(e.value) == "gpudirect='on' must be 'auto', 'off' or 'require'"


@pytest.mark.parametrize(
    ("cpus", "threads"), [(1, 1), (2, 2), (3, 2), (7, 2), (8, 2), (11, 2), (12, 3), (16, 4), (17, 4), (128, 4)]
)
def test_default_copy_threads_a_quarter_of_the_cpus_2_to_4(cpus, threads, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert opts.default_copy_threads() == threads


@pytest.mark.parametrize(
    ("cpus", "streams"), [(1, 2), (2, 2), (4, 2), (5, 2), (6, 3), (8, 4), (15, 7), (16, 8), (17, 8), (128, 8)]
)
def test_default_streams_half_the_cpus_2_to_8(cpus, streams, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert opts.default_streams() == streams
    assert SenderOptions().streams == streams and SenderOptions(streams=None).streams == streams
    assert SenderOptions(streams=1).streams == 1  # given: kept


def test_default_copy_threads_without_affinity_counts_the_cpus(monkeypatch):
    def no_affinity(pid):
        raise OSError("not here")

    monkeypatch.setattr(os, "sched_getaffinity", no_affinity)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert opts.default_copy_threads() == 4
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert opts.default_copy_threads() == 1
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert opts.default_copy_threads() == 3


def test_merge_options():
    base = SenderOptions(streams=3)
    assert opts.merge_options(SenderOptions, base, {}, "PrefillSender") is base
    merged = opts.merge_options(SenderOptions, base, {"timeout_s": 2.0}, "PrefillSender")
    assert (merged.streams, merged.timeout_s, base.timeout_s) == (3, 2.0, 10.0)
    fresh = opts.merge_options(SenderOptions, None, {"streams": 5}, "PrefillSender")
    assert fresh == dataclasses.replace(SenderOptions(), streams=5, copy_threads=fresh.copy_threads)
    assert opts.merge_options(ReceiverOptions, None, {}, "DecodeReceiver") == ReceiverOptions()
    with pytest.raises(TypeError) as e:
        opts.merge_options(SenderOptions, ReceiverOptions(), {}, "PrefillSender")
    assert str(e.value) == "PrefillSender: options must be a SenderOptions, got ReceiverOptions"
    with pytest.raises(TypeError) as e:
        opts.merge_options(ReceiverOptions, None, {"streams": 2, "zz": 1, "auto_tick": True}, "DecodeReceiver")
    fields = ", ".join(sorted(f.name for f in dataclasses.fields(ReceiverOptions)))
    assert str(e.value) == (
        f"DecodeReceiver() got unexpected keyword argument(s) streams, zz (fields of ReceiverOptions: {fields})"
    )
    with pytest.raises(ValueError, match="streams=0"):  # a merged field is checked like any other
        opts.merge_options(SenderOptions, base, {"streams": 0}, "PrefillSender")
