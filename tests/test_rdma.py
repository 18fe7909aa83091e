from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv import _ffi
from pdkv.errors import PdkvTimeoutError, ProtocolError, RdmaError, RdmaUnavailableError
from pdkv.rdma import CompletionTracker, EndpointInfo, RdmaWriter, batch_chains, plan_writes


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
    e = EndpointInfo(qpn=7, psn=1, lid=3, gid="fe80::1", mtu=5, addr=4096, length=1 << 20, rkey=9)
    assert EndpointInfo.from_dict(e.to_dict()) == e
    for bad in ({"qpn": 0}, {"mtu": 9}, {"gid": 5}, {"rkey": -1}):
        with pytest.raises(ProtocolError):
            EndpointInfo.from_dict({**e.to_dict(), **bad})
    with pytest.raises(ProtocolError):
        EndpointInfo.from_dict({"qpn": 1})


def test_no_rdma_here_says_so():
    assert _ffi.verbs.rdma_devices() == [] or _ffi.verbs.available()
    with pytest.raises(RdmaUnavailableError, match="pyverbs|no RDMA device"):
        RdmaWriter(4096, 4096)


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
    w = RdmaWriter(ctypes.addressof(src), 65536, device=rdma_device)
    res = _ffi.verbs.open_device(rdma_device)
    mr, lkey, rkey = _ffi.verbs.register(res, ctypes.addressof(dst), 65536, remote_write=True)
    qp = _ffi.verbs.create_rc_qp(res, 16)
    info = EndpointInfo(int(qp.qp_num), 0, res["lid"], res["gid"], res["mtu"], ctypes.addressof(dst), 65536, rkey)
    w.connect(info)
    _ffi.verbs.connect_qp(res, qp, w.local_info().to_dict())
    w.write("r", [ctypes.addressof(src)], [ctypes.addressof(dst)], [65536])
    assert bytes(dst) == bytes(src)
