from __future__ import annotations

import os
import subprocess
import sys
import time

import fake_verbs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_transfer import BASE, Decode, prefill_cache, send_one, wait_until

from pdkv import (
    BlockPool,
    CacheSpec,
    DecodeScheduler,
    KVLayout,
    SchedulerOptions,
    SharedBuffer,
    State,
    SwapEngine,
    _ffi,
)
from pdkv.errors import PdkvTimeoutError, PeerError, ProtocolError, RdmaError, RdmaUnavailableError
from pdkv.transfer import DecodeReceiver, PrefillSender
from pdkv.transfer.transports.rdma_qp import (
    CompletionTracker,
    EndpointInfo,
    RdmaTarget,
    RdmaWriter,
    RemoteRegion,
    batch_chains,
    merge_regions,
    plan_writes,
)


def test_plan_coalesces_and_bounds():
    w = plan_writes("r", [0, 100, 300], [1000, 1100, 1400], [100, 100, 50], 1000, 1000)
    assert [(x.local, x.remote, x.length) for x in w] == [(0, 1000, 200), (300, 1400, 50)]
    with pytest.raises(ProtocolError, match="outside the peer's region"):
        plan_writes("r", [0], [1990], [20], 1000, 1000)
    with pytest.raises(ProtocolError, match="outside"):
        plan_writes("r", [0], [900], [20], 1000, 1000)
    big = plan_writes("r", [0], [0], [5000], 0, 10000, max_bytes=2048)
    assert [x.length for x in big] == [2048, 2048, 904]


@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 4096)), min_size=1, max_size=50))
def test_plan_preserves_bytes(pieces):
    local = [p[0] * 8 for p in pieces]
    remote = [i * 8192 for i in range(len(pieces))]
    lengths = [p[1] for p in pieces]
    w = plan_writes("r", local, remote, lengths, 0, 8192 * len(pieces))
    assert sum(x.length for x in w) == sum(lengths)


def test_chains_signal_often_enough():
    wrs = plan_writes("r", [i * 10 for i in range(10)], [i * 20 for i in range(10)], [5] * 10, 0, 1000)
    chains = batch_chains(wrs, 4, 3)
    assert [len(c) for c in chains] == [4, 4, 2]
    assert [s for _, s in chains[0]] == [False, False, True, True]
    for c in chains:
        assert c[-1][1]
        run = 0
        for _, sig in c:
            run = 0 if sig else run + 1
            assert run < 3


def test_completions_fail_exactly_the_covered_requests():
    t = CompletionTracker()
    a = plan_writes("a", [0, 10], [0, 100], [5, 5], 0, 1000)
    b = plan_writes("b", [50], [500], [5], 0, 1000)
    chain = batch_chains(a + b, 8, 2)[0]  # a0, a1(sig) | b0(sig)
    ids = t.register_chain(chain)
    assert t.outstanding("a") == 1 and t.outstanding("b") == 1
    assert t.on_completions([(ids[1], 0)]) == ["a"]
    assert t.on_completions([(ids[2], 12)]) == ["b"]
    assert "a" not in t.failed and "retry" in t.failed["b"]
    with pytest.raises(RdmaError, match="unknown work request"):
        t.on_completions([(999, 0)])


def test_wait_is_bounded():
    t = CompletionTracker()
    t.register_chain(batch_chains(plan_writes("a", [0], [0], [1], 0, 10), 4, 4)[0])
    with pytest.raises(PdkvTimeoutError):
        t.wait(lambda: [], ["a"], 0.05)


def test_endpoint_record_validation():
    e = EndpointInfo(qpn=7, psn=1, lid=3, gid="fe80:0000:0000:0000:0000:0000:0000:0001", mtu=5)
    assert EndpointInfo.from_dict(e.to_dict()) == e
    for bad in ({"qpn": 0}, {"mtu": 9}, {"gid": 5}, {"gid": "fe80::1"}, {"qpn": "7"}, {"lid": 1.5}, {"extra": 1}):
        with pytest.raises(ProtocolError):
            EndpointInfo.from_dict({**e.to_dict(), **bad})
    with pytest.raises(ProtocolError):
        EndpointInfo.from_dict({"qpn": 1})


def test_unsignaled_error_completion_fails_its_request():
    # a queue pair that fails completes the failing request (signaled or not) and flushes
    # every later one: each is matched to its request
    t = CompletionTracker()
    a = plan_writes("a", [0, 10, 20], [0, 100, 200], [5, 5, 5], 0, 1000)
    b = plan_writes("b", [50], [500], [5], 0, 1000)
    ids = t.register_chain(batch_chains(a + b, 8, 3)[0])  # a0 a1 a2(sig) | b0(sig)
    assert t.on_completions([(ids[0], 10)]) == []  # a0 failed, unsignaled
    assert "remote access" in t.failed["a"]
    assert t.on_completions([(ids[1], 5), (ids[2], 5), (ids[3], 5)]) == ["a", "b"]
    assert "flushed" in t.failed["b"] and t.outstanding("a") == t.outstanding("b") == 0
    with pytest.raises(RdmaError, match="unknown"):
        t.on_completions([(ids[0], 5)])  # already settled


def test_merge_regions():
    assert merge_regions([(100, 10), (0, 50), (50, 10), (200, 0), (105, 20)]) == [(0, 60), (100, 25)]


def test_remote_region_record_validation():
    r = RemoteRegion(4096, 1 << 20, 7)
    assert RemoteRegion.from_dict(r.to_dict()) == r
    for bad in ({"addr": 0}, {"length": 0}, {"rkey": 1 << 32}, {"rkey": -1}, {"addr": "x"}):
        with pytest.raises(ProtocolError):
            RemoteRegion.from_dict({**r.to_dict(), **bad})


@pytest.mark.usefixtures("no_rdma_device")
def test_no_rdma_here_says_so(no_leaks):
    with pytest.raises(RdmaUnavailableError, match="pyverbs|no RDMA device"):
        RdmaWriter([(4096, 4096)])
    lay = KVLayout(**BASE)
    arr = np.zeros(lay.block_bytes * 8, np.uint8)
    with pytest.raises(RdmaUnavailableError, match="pyverbs|no RDMA device"):
        PrefillSender(lay, CacheSpec.for_buffer(lay, 8, arr.ctypes.data), "tcp://127.0.0.1:9", transport="rdma")
    with SharedBuffer.create(CacheSpec.buffer_bytes(lay, 8)) as buf:
        sched = DecodeScheduler(
            num_layers=4,
            gpu=BlockPool(8),
            buffer=BlockPool(8),
            swap=SwapEngine(
                CacheSpec.for_buffer(lay, 8, buf.address),
                CacheSpec.for_buffer(lay, 8, arr.ctypes.data),
                strategy="host",
                buffer_pinned=False,
            ),
            options=SchedulerOptions(direct_to_gpu=False),
        )
        with pytest.raises(RdmaUnavailableError, match="pyverbs|no RDMA device"):
            DecodeReceiver(sched, [lay], [buf], 8, transports=("tcp", "rdma"))
        sched.swap.close()


# ---------------------------------------------------------------- on the simulated verbs layer


def _session(monkeypatch, transports=("rdma",), offer="rdma", **rx):
    fabric = fake_verbs.install(monkeypatch)
    dec = Decode(transports=transports, **rx)
    lay, arr, spec = prefill_cache(1, 0)
    tx = PrefillSender(lay, spec, dec.rx.control_address, transport=offer, timeout_s=5)
    return fabric, dec, tx


def test_auto_picks_rdma_where_decode_serves_it_and_shm_on_the_same_host(monkeypatch, no_leaks):
    fabric, dec, tx = _session(monkeypatch, transports=("rdma", "tcp"), offer="auto")
    try:
        assert tx.transport == "rdma"
        assert send_one(tx, "r1", [1, 2, 3]).ok and fabric.bytes > 0
    finally:
        tx.close()
        dec.close()
    fabric, dec, tx = _session(monkeypatch, transports=("shm", "rdma", "tcp"), offer="auto")
    try:
        assert tx.transport == "shm" and not fabric.qps  # offered, not chosen: released
        assert send_one(tx, "r1", [1, 2, 3]).ok and fabric.bytes == 0
    finally:
        tx.close()
        dec.close()


def test_failed_completion_fails_the_session_and_decode_frees_at_once(monkeypatch, no_leaks):
    fabric, dec, tx = _session(monkeypatch)
    try:
        assert send_one(tx, "ok", [1, 2]).ok
        tx.reserve("bad", 16)
        tx.reserve("other", 16)
        fabric.fail_next = 10  # remote access error on the next write
        tx.send_layer(0, [("bad", [3, 4])])
        out = tx.wait_outcome("bad", 5)
        assert out.state == "failed" and "remote access error" in out.reason
        assert tx.wait_outcome("other", 5).state == "failed"  # the queue pair is dead: so is the session
        with pytest.raises(PeerError, match="RDMA queue pair failed"):
            tx.reserve("after", 8)
        # the aborts reach decode: no waiting for leases
        wait_until(
            lambda: all(dec.sched.request(r).state in (State.FAILED, State.ABORTED) for r in ("bad", "other")),
            3,
            "decode dropped the broken session's requests",
        )
    finally:
        tx.close()
        dec.close()


def test_dead_peer_queue_pair_is_dropped_so_nothing_more_lands(monkeypatch, no_leaks):
    fabric, dec, tx = _session(monkeypatch)
    try:
        assert send_one(tx, "r1", [1]).ok
        before = fabric.bytes
        qps = set(fabric.qps)
        tx.reserve("late", 8)
        dec.rx._check_peers(time.monotonic() + 3600)  # decode declares the peer dead
        assert len(fabric.qps) == len(qps) - 1  # its queue pair on decode's side is gone
        tx.send_layer(0, [("late", [2])])
        assert tx.wait_outcome("late", 5).state == "failed"
        assert fabric.bytes == before  # the fence held: no byte landed
    finally:
        tx.close()
        dec.close()


def test_rdma_from_a_gpu_cache_without_a_device_and_bad_transports(no_rdma_device):
    lay = KVLayout(**BASE)
    base = CacheSpec.for_buffer(lay, 8, 1 << 30)
    spec = CacheSpec(lay, 8, [[base.region(layer, t) for t in range(2)] for layer in range(4)], device=0)
    with pytest.raises(RdmaUnavailableError, match="pyverbs|no RDMA device"):  # GPUDirect or staged
        PrefillSender(lay, spec, "tcp://127.0.0.1:9", transport="rdma")
    with pytest.raises(
        ValueError, match="must be auto or a registered transport.*registered: cuda_ipc, shm, rdma, nixl, tcp"
    ):
        PrefillSender(lay, spec, "tcp://127.0.0.1:9", transport="ib")


@pytest.fixture
def rdma_device():
    pytest.importorskip("pyverbs")
    devs = _ffi.verbs.rdma_devices()
    if not devs:
        pytest.skip("no RDMA device")
    return devs[0]


@pytest.mark.rdma
def test_loopback_rc_write(rdma_device):
    import ctypes

    src = (ctypes.c_char * 65536)(*([7] * 65536))
    dst = (ctypes.c_char * 65536)()
    # a real device is needed past this point; see docs/TRANSPORTS.md
    with RdmaWriter([(ctypes.addressof(src), 65536)], device=rdma_device) as w:
        target = RdmaTarget([(0, ctypes.addressof(dst), 65536)], device=rdma_device)
        try:
            w.connect(target.accept(w.local_info()))
            w.write("r", [ctypes.addressof(src)], [ctypes.addressof(dst)], [65536], target.regions[0])
            assert bytes(dst) == bytes(src)
        finally:
            target.close()


@pytest.mark.parametrize(
    "record",
    [
        {"qpn": "7", "psn": 0, "lid": 1, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001", "mtu": 5},
        {"qpn": 7, "psn": 0, "lid": 1, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001", "mtu": 5, "rkey": 3},
        {"qpn": 1 << 30, "psn": 0, "lid": 1, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001", "mtu": 5},
    ],
)
def test_hostile_rdma_hello_is_refused_and_decode_serves_on(record, monkeypatch, no_leaks):
    import zmq

    from pdkv.protocol import PROTOCOL_VERSION, Auth, Challenge, Codec, ErrorMsg, Hello, layout_desc

    fabric = fake_verbs.install(monkeypatch)
    dec = Decode(transports=("rdma",))
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(dec.rx.control_address)
        lay = KVLayout(**BASE)
        c = Codec(None)
        nonce = os.urandom(16)
        s.send_multipart(
            c.encode(Hello(PROTOCOL_VERSION, "evil", 0, 1, layout_desc(lay), ["rdma"], "b", 1, nonce, record))
        )
        assert s.poll(5000)
        msg = c.decode(s.recv_multipart())
        if isinstance(msg, Challenge):  # a record the schema admits is checked when the session starts
            c.set_session(nonce, msg.nonce)
            s.send_multipart(c.encode(Auth(msg.nonce, os.urandom(32))))
            assert s.poll(5000)
            msg = c.decode(s.recv_multipart())
        assert isinstance(msg, ErrorMsg) and "rdma" in msg.message
        assert fabric.qps == {}  # the refused hello left no queue pair behind
        _, arr, spec = prefill_cache(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="rdma", timeout_s=5) as tx:
            assert send_one(tx, "r1", [1, 2]).ok  # the control loop survived
    finally:
        ctx.destroy(linger=0)
        dec.close()


STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_pyverbs")


def test_verbs_calls_pass_pyverbs_own_types_and_enums_of_rdma_core_59():
    """pdkv's verbs layer against a stand-in with pyverbs v59's class signatures and types:
    no ``pyverbs.enums`` (removed in v59), enum members only on their types (Cython >= 3.1),
    ``GlobalRoute(dgid=GID)`` typed. Before, ``import pyverbs.enums`` failed and a GID string
    raised TypeError; a malformed peer GID is refused by name."""
    code = (
        "from pdkv import _ffi\n"
        "from pdkv.errors import RdmaError\n"
        "v = _ffi.verbs\n"
        "assert v.rdma_devices() == ['stand0']\n"
        "res = v.open_device()\n"
        "mr, lkey, rkey = v.register(res, 4096, 1 << 20, remote_write=True)\n"
        "qp = v.create_rc_qp(res, 64)\n"
        "v.connect_qp(res, qp, {'qpn': 7, 'psn': 4242, 'lid': 0, 'gid': res['gid'], 'mtu': 5}, local_psn=777)\n"
        "assert (qp.rq_psn, qp.sq_psn) == (4242, 777)  # receives from the peer's PSN, sends from its own\n"
        "assert qp.hop_limit == 64  # routed RoCE v2: pyverbs' default 1 dies at the first router\n"
        "v.to_error(qp)\n"
        "assert qp.state == 6  # IBV_QPS_ERR through QP.modify(QPAttr, IBV_QP_STATE)\n"
        "v.post_writes(qp, [(1, 4096, 64, lkey, 8192, rkey, True)])\n"
        "assert v.enum('IBV_QPT_RC') == 2 and v.enum('IBV_SEND_SIGNALED') == 2\n"
        "try:\n"
        "    v.connect_qp(res, qp, {'qpn': 7, 'psn': 0, 'lid': 0, 'gid': 'fe80::1', 'mtu': 5}, local_psn=1)\n"
        "except RdmaError as e:\n"
        "    print('refused', e)\n"
        "print('OK', res['gid'])\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([STANDIN, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "refused peer GID 'fe80::1' is not eight groups of four hex digits" in out.stdout
    assert "OK fe80:0000:0000:0000:0002:00ff:fe00:0001" in out.stdout


def _sysfs_port(root, dev, port, entries):
    """A fake /sys/class/infiniband/<dev>/ports/<port>: entries of (index, gid, type or None)."""
    base = root / dev / "ports" / str(port)
    (base / "gids").mkdir(parents=True)
    (base / "gid_attrs" / "types").mkdir(parents=True)
    for i, gid, kind in entries:
        (base / "gids" / str(i)).write_text(gid + "\n")
        if kind is not None:
            (base / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")


def test_gid_index_chosen_by_type_roce_v2_over_ipv4_first(tmp_path):
    from pdkv._ffi.verbs import choose_gid_index, gid_table

    zero = "0000:0000:0000:0000:0000:0000:0000:0000"
    ll = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    v4 = "0000:0000:0000:0000:0000:ffff:0a00:0002"
    _sysfs_port(
        tmp_path,
        "mlx5_0",
        1,
        [(0, ll, "IB/RoCE v1"), (1, ll, "RoCE v2"), (2, v4, "IB/RoCE v1"), (3, v4, "RoCE v2"), (4, zero, "RoCE v2")],
    )
    table = gid_table("mlx5_0", 1, root=str(tmp_path))
    assert [i for i, _, _ in table] == [0, 1, 2, 3]  # the empty (zero) slot is not a GID
    assert choose_gid_index(table) == 3
    assert choose_gid_index([e for e in table if e[0] != 3]) == 1  # RoCE v2, link-local
    assert choose_gid_index([(0, ll, ""), (1, v4, "")]) == 0  # InfiniBand: no types, index 0
    assert choose_gid_index([]) == 0 and gid_table("absent", 1, root=str(tmp_path)) == []


def test_the_nic_nearest_the_gpu_in_the_pci_tree(tmp_path):
    from pdkv._ffi.verbs import nearest_device

    devs = tmp_path / "devices"
    gpu = devs / "pci0000:00" / "0000:00:01.0" / "0000:1a:00.0" / "0000:1b:00.0"  # behind a PCIe switch
    far = devs / "pci0000:80" / "0000:80:01.0" / "0000:81:00.0"  # the other socket
    near = devs / "pci0000:00" / "0000:00:01.0" / "0000:1a:00.0" / "0000:1c:00.0"  # the same switch
    same_socket = devs / "pci0000:00" / "0000:00:02.0" / "0000:05:00.0"
    for d in (gpu, far, near, same_socket):
        d.mkdir(parents=True)
    pci, ib = tmp_path / "bus", tmp_path / "ib"
    pci.mkdir()
    (pci / "0000:1b:00.0").symlink_to(gpu)
    for name, target in (("mlx5_0", far), ("mlx5_1", same_socket), ("mlx5_2", near)):
        (ib / name).mkdir(parents=True)
        (ib / name / "device").symlink_to(target)
    args = dict(root=str(ib), pci=str(pci))
    assert nearest_device("0000:1B:00.0", ["mlx5_0", "mlx5_1", "mlx5_2"], **args) == "mlx5_2"
    assert nearest_device("0000:1b:00.0", ["mlx5_0", "mlx5_1"], **args) == "mlx5_1"
    assert nearest_device("0000:ff:00.0", ["mlx5_0", "mlx5_1"], **args) == "mlx5_0"  # nothing known: first


def test_rdma_device_port_and_gid_index_reach_the_device(monkeypatch, no_leaks):
    from pdkv.transfer import SenderOptions

    fab = fake_verbs.install(monkeypatch)
    dec = Decode(transports=("rdma",), rdma_port=2, rdma_gid_index=5)
    try:
        lay, _, spec = prefill_cache(1, 0)
        with PrefillSender(
            lay, spec, dec.rx.control_address, transport="rdma", rdma_device="fake0", rdma_port=2, rdma_gid_index=3
        ) as tx:
            assert send_one(tx, "p", [1, 2]).ok
        assert (None, 2, 5, None) in fab.opened and ("fake0", 2, 3, None) in fab.opened
        regions = [[spec.region(layer, t) for t in range(2)] for layer in range(4)]
        gspec = CacheSpec(lay, spec.num_blocks, regions, device=0)
        monkeypatch.setattr(
            _ffi.cuda, "address_range", lambda p: (spec.region(0, 0)[0], spec.num_blocks * lay.block_bytes)
        )
        monkeypatch.setattr(_ffi.cuda, "dmabuf_fd", lambda b, n: os.open("/dev/null", os.O_RDONLY))
        monkeypatch.setattr(_ffi.cuda, "dmabuf_supported", lambda d: True)
        monkeypatch.setattr(_ffi.cuda, "set_sync_memops", lambda p: None)
        with PrefillSender(lay, gspec, dec.rx.control_address, transport="rdma") as tx:  # a GPU cache
            assert tx.stats["path"] == "rdma GPUDirect (dma-buf)"
        assert fab.opened[-1] == (None, 1, None, 0)  # the device nearest GPU 0 is looked for
    finally:
        dec.close()
    for bad in (dict(rdma_port=0), dict(rdma_gid_index=-1)):
        with pytest.raises(ValueError, match="rdma_"):
            SenderOptions(**bad)


def test_gpudirect_registration_through_pyverbs_own_classes():
    """register_gpu against the stand-in's mlx5 dma-buf MR (iova = the GPU address, so
    work requests name GPU addresses; the fd as given) and, where that is missing or fails,
    ibv_reg_mr on the GPU address (peer memory)."""
    code = (
        "import os, sys\n"
        "from pdkv import _ffi\n"
        "from pyverbs.providers.mlx5 import mlx5dv_dmabuf as dv\n"
        "v = _ffi.verbs\n"
        "res = v.open_device()\n"
        "fd = os.open('/dev/null', os.O_RDONLY)\n"
        "mr, lkey, rkey, how = v.register_gpu(res, 1 << 40, 2 << 20, fd)\n"
        "assert how == 'dma-buf' and (lkey, rkey) == (0x33, 0x44), how\n"
        "assert dv.CALLS == [(0, 2 << 20, 1 << 40, fd, v.enum('IBV_ACCESS_LOCAL_WRITE'))], dv.CALLS\n"
        "mr, lkey, rkey, how = v.register_gpu(res, 1 << 40, 2 << 20, None)\n"
        "assert how == 'peer memory' and lkey == 0x11\n"
        "mr, lkey, rkey, how = v.register_gpu(res, 1 << 40, 2 << 20, -1)  # the dma-buf MR refused\n"
        "assert how == 'peer memory'\n"
        "sys.modules['pyverbs.providers.mlx5.mlx5dv_dmabuf'] = None  # a pyverbs without the mlx5 provider\n"
        "assert v.register_gpu(res, 1 << 40, 2 << 20, fd)[3] == 'peer memory'\n"
        "from pdkv.errors import RdmaError\n"
        "try:\n"
        "    v.register_gpu(res, 0xBAD000, 4096, None)\n"
        "except RdmaError as e:\n"
        "    print('refused', e)\n"
        "print('OK')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([STANDIN, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
    assert "no dma-buf of the allocation; ibv_reg_mr on the GPU address failed too (is nvidia_peermem loaded?)" in (
        out.stdout
    )


def test_each_end_starts_from_a_random_psn_it_announced(monkeypatch):
    """PSNs are random 24-bit numbers exchanged in the handshake (they were always 0, and the
    send PSN was read from a key never sent); the simulated fabric refuses an RC pair whose
    ends do not send from what they announced."""
    fab = fake_verbs.install(monkeypatch)
    psns = set()
    for _ in range(4):
        target = RdmaTarget([(0, 4096, 1 << 16)])
        w = RdmaWriter([(8192, 1 << 16)])
        mine = w.local_info()
        theirs = target.accept(mine)
        w.connect(theirs)
        qp_w, qp_t = fab.qps[mine.qpn], fab.qps[theirs.qpn]
        assert (qp_w.sq_psn, qp_w.rq_psn) == (mine.psn, theirs.psn)
        assert (qp_t.sq_psn, qp_t.rq_psn) == (theirs.psn, mine.psn)
        psns |= {mine.psn, theirs.psn}
        w.close()
        target.close()
    assert len(psns) > 1 and all(0 <= p < 1 << 24 for p in psns)


def test_a_locked_memory_limit_too_small_is_named_before_any_registration(monkeypatch):
    """ibv_reg_mr past RLIMIT_MEMLOCK fails with a bare ENOMEM (containers start at 64 KiB
    or 8 MiB): the limit is checked up front and the error says what to raise."""
    import resource

    from pdkv import _ffi

    fab = fake_verbs.install(monkeypatch)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64 << 10, 64 << 10))
    monkeypatch.setattr(_ffi.verbs, "_has_ipc_lock", lambda: False)
    for make in (lambda: RdmaTarget([(0, 4096, 1 << 20)]), lambda: RdmaWriter([(8192, 1 << 20)])):
        with pytest.raises(RdmaError, match=r"needs a locked-memory limit .* RLIMIT_MEMLOCK is 65536 bytes.*ulimit -l"):
            make()
        assert not fab.mrs  # nothing registered
    monkeypatch.setattr(_ffi.verbs, "_has_ipc_lock", lambda: True)  # CAP_IPC_LOCK lifts the limit
    RdmaTarget([(0, 4096, 1 << 20)]).close()
    monkeypatch.setattr(_ffi.verbs, "_has_ipc_lock", lambda: False)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    RdmaWriter([(8192, 1 << 20)]).close()


def test_work_requests_never_pass_the_ports_largest_message(monkeypatch):
    """The largest message is queried from the port (max_msg_sz), not assumed to be 2^31: a
    run longer than it goes as several work requests, and every byte lands. The simulated
    fabric fails a longer work request with LOC_LEN_ERR, as a NIC does."""
    import ctypes

    fab = fake_verbs.install(monkeypatch)
    fab.max_msg_sz = 64 << 10
    n = 300 << 10
    src = (ctypes.c_ubyte * n).from_buffer(bytearray(np.random.default_rng(5).integers(0, 256, n, np.uint8)))
    dst = (ctypes.c_ubyte * n)()
    target = RdmaTarget([(0, ctypes.addressof(dst), n)])
    w = RdmaWriter([(ctypes.addressof(src), n)])
    try:
        w.connect(target.accept(w.local_info()))
        assert w.max_wr_bytes == 64 << 10
        w.write("r", [ctypes.addressof(src)], [ctypes.addressof(dst)], [n], target.regions[0])
        assert bytes(dst) == bytes(src) and fab.largest_wr == 64 << 10 and fab.writes == -(-n // (64 << 10))
    finally:
        w.close()
        target.close()


def _pair(fab, n=1 << 16, **kw):
    import ctypes

    src = (ctypes.c_ubyte * n).from_buffer(bytearray(np.random.default_rng(7).integers(0, 256, n, np.uint8)))
    dst = (ctypes.c_ubyte * n)()
    target = RdmaTarget([(0, ctypes.addressof(dst), n)])
    w = RdmaWriter([(ctypes.addressof(src), n)], **kw)
    w.connect(target.accept(w.local_info()))
    return src, dst, target, w


def test_a_timed_out_write_fences_its_queue_pair_so_nothing_lands_later(monkeypatch):
    """Completions that never come (a dead link): the write raises once its queue pair is
    in the error state and its work requests are flushed, so when the link comes back
    none of them lands in blocks decode may have given to another request meanwhile."""
    import ctypes

    fab = fake_verbs.install(monkeypatch)
    src, dst, target, w = _pair(fab, timeout_s=0.3)
    try:
        fab.stall = True
        t0 = time.monotonic()
        with pytest.raises(RdmaError, match="fenced"):
            w.write("r", [ctypes.addressof(src)], [ctypes.addressof(dst)], [len(src)], target.regions[0])
        assert time.monotonic() - t0 < 3
        qp = fab.qps[w.local_info().qpn]
        assert qp.state == "error" and not qp.pending and not qp.unretired  # flushed, slots retired
        fab.stall = False  # the link is back
        fab.poll(w._res["cq"], 64)
        assert fab.bytes == 0 and bytes(dst) == bytes(len(dst))  # not one byte landed
        with pytest.raises(RdmaError, match="not connected"):  # a fenced queue pair is never reused
            w.write("r2", [ctypes.addressof(src)], [ctypes.addressof(dst)], [64], target.regions[0])
    finally:
        w.close()
        target.close()


def test_close_waits_for_a_running_write_then_destroys_in_verbs_order(monkeypatch):
    import ctypes
    import threading

    fab = fake_verbs.install(monkeypatch)
    src, dst, target, w = _pair(fab, timeout_s=0.5)
    fab.stall = True
    ended, errs = [], []

    def write():
        try:
            w.write("r", [ctypes.addressof(src)], [ctypes.addressof(dst)], [len(src)], target.regions[0])
        except RdmaError as exc:
            errs.append(exc)
        ended.append(time.monotonic())

    t = threading.Thread(target=write)
    t.start()
    time.sleep(0.05)
    w.close()  # while the write polls
    t.join(5)
    assert errs and "fenced" in str(errs[0])  # the write ended on its own terms, not on a destroyed QP
    kinds = [k for k, _ in fab.events]
    assert kinds[:3] == ["_QP", "_MR", "device"]  # QP, then MRs, then CQ/PD/context
    assert fab.events[0][1] >= ended[0]  # nothing destroyed before the write ended
    target.close()


def test_send_queue_slots_stay_held_until_their_completions_are_polled(monkeypatch):
    import ctypes

    fab = fake_verbs.install(monkeypatch)
    src, dst, target, w = _pair(fab, max_send_wr=4, signal_every=1)
    try:
        qp = fab.qps[w.local_info().qpn]
        a, b, rk = ctypes.addressof(src), ctypes.addressof(dst), target.regions[0].rkey
        lk = w.lkey(a, 64)
        fab.post_writes(qp, [(1, a, 64, lk, b, rk, True), (2, a, 64, lk, b, rk, False), (3, a, 64, lk, b, rk, True)])
        assert fab.bytes == 0 and not w._res["cq"].q  # asynchronous: nothing executes at post time
        with pytest.raises(RdmaError, match="send queue full .3 outstanding, max_send_wr 4"):
            fab.post_writes(qp, [(4, a, 64, lk, b, rk, False), (5, a, 64, lk, b, rk, True)])  # across posts
        assert fab.poll(w._res["cq"], 8) == [(1, 0), (3, 0)]  # only signaled ones complete on success
        assert not qp.unretired and fab.bytes == 192
        # pdkv's writer keeps within the queue: 40 work requests through a queue of 4
        w.write(
            "r", [a + 1024 * i for i in range(40)], [b + 1024 * i for i in range(40)], [512] * 40, target.regions[0]
        )
        assert bytes(dst[: 40 * 1024 : 1024]) == bytes(src[: 40 * 1024 : 1024])
    finally:
        w.close()
        target.close()


def test_a_completion_queue_overrun_fails_the_write_instead_of_hanging(monkeypatch):
    import ctypes

    fab = fake_verbs.install(monkeypatch)
    fab.cq_capacity = 2
    src, dst, target, w = _pair(fab, max_send_wr=64, signal_every=1, timeout_s=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(RdmaError, match="overrun"):
            w.write(
                "r",
                [ctypes.addressof(src) + 64 * i for i in range(8)],
                [ctypes.addressof(dst) + 128 * i for i in range(8)],
                [64] * 8,
                target.regions[0],
            )
        assert time.monotonic() - t0 < 1
    finally:
        w.close()
        target.close()


def test_region_specs_check_each_decode_ranks_region():
    """The one-sided transports (rdma, nixl) address decode's buffers from the welcome's
    regions: each rank's must be there and hold the buffer's blocks, else a ProtocolError
    naming the rank, the transport and the bytes needed; a region that fits gives the
    buffer's spec at its address."""
    import types

    from pdkv.transfer.transports.base import region_specs

    lays = [KVLayout(**BASE, tp_size=2, tp_rank=r) for r in range(2)]
    need = CacheSpec.buffer_bytes(lays[0], 8)
    welcome = types.SimpleNamespace(ranks=[0, 1], buffer_blocks=8, buffer_order="layer")

    def reg(addr, length):
        return types.SimpleNamespace(addr=addr, length=length)

    specs = region_specs(welcome, lays, {0: reg(4096, need), 1: reg(1 << 20, need + 1)}, "RDMA")
    assert specs[0].address(0, 0, 0) == 4096 and specs[1].address(0, 0, 0) == 1 << 20
    assert specs[1].address(0, 0, 1) - specs[1].address(0, 0, 0) == lays[1].tensor_block_bytes(0)
    with pytest.raises(ProtocolError, match=f"decode rank 1's NIXL region is missing or smaller than the {need} bytes"):
        region_specs(welcome, lays, {0: reg(4096, need)}, "NIXL")
    with pytest.raises(ProtocolError, match="decode rank 0's RDMA region"):
        region_specs(welcome, lays, {0: reg(4096, need - 1), 1: reg(0, need)}, "RDMA")


def test_region_specs_of_an_engines_pages_take_its_cells_and_refuse_what_lies_outside():
    """A region with cells (an engine's own host pages, offered over NIXL) gives the spec
    of those cells; a cell count that is not the layout's, a stride below a block, or a
    cell whose blocks reach past the region is a ProtocolError naming it."""
    import types

    from pdkv.transfer.transports.base import region_specs

    lay = KVLayout(**BASE)
    nt, nb = len(lay.tensors), 4
    tb = lay.tensor_block_bytes(0)
    lo, step = 1 << 20, tb * nb + 4096
    cells = [(lo + i * step, tb) for i in range(lay.total_layers * nt)]
    welcome = types.SimpleNamespace(ranks=[0], buffer_blocks=nb)

    def reg(cs, length=None):
        return {0: types.SimpleNamespace(addr=lo, length=length or step * len(cells), cells=cs)}

    spec = region_specs(welcome, [lay], reg(cells), "NIXL")[0]
    assert spec.address(1, 1, 2) == cells[nt + 1][0] + 2 * tb
    with pytest.raises(ProtocolError, match=f"has {len(cells) - 1} cells"):
        region_specs(welcome, [lay], reg(cells[:-1]), "NIXL")
    with pytest.raises(ProtocolError, match="block stride"):
        region_specs(welcome, [lay], reg([(b, tb - 1) for b, _ in cells]), "NIXL")
    with pytest.raises(ProtocolError, match="cell 0 .* lies outside it"):
        region_specs(welcome, [lay], reg([(lo - 1, tb)] + cells[1:]), "NIXL")
    with pytest.raises(ProtocolError, match=f"cell {len(cells) - 1} .* lies outside it"):
        region_specs(welcome, [lay], reg(cells, length=step * (len(cells) - 1) + tb * nb - 1), "NIXL")
