"""The nixl transport over NVIDIA NIXL (UCX tcp on loopback): every byte through every TP
combination, kills of either side mid-transfer, a NIXL error as a failed request, hostile
handshake fields, a clean exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_staged import _check_tp, _send_batch
from test_transfer import Decode, _lines, _spawn, clean_killed_segment, prefill_cache, reap, send_one, wait_until

from pdkv import PrefillSender, State

pytest.importorskip("nixl")


@pytest.fixture(autouse=True, scope="module")
def _ucx_loopback():
    """UCX over tcp on loopback only (NIXL refuses a GPU host's UCX without cuda_copy), for
    this process's agents and the peer processes it starts. On a GPU host one agent with a
    VRAM registration is made first: UCX's CUDA transport opens driver files once per
    process, which the tests' descriptor counts would otherwise read as leaks."""
    from pdkv import _ffi

    gpus = _ffi.cuda.device_count()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"UCX_TLS": "tcp,cuda_copy" if gpus else "tcp", "UCX_NET_DEVICES": "lo"}.items():
            mp.setenv(k, v)
        if gpus:
            ptr = _ffi.cuda.malloc(1 << 20)
            warm = _ffi.nixl.Agent("pdkv-warm-up")
            try:
                warm.register([(ptr, 1 << 20, 0)], "VRAM")
            finally:
                warm.close()
                _ffi.cuda.free(ptr)
        yield


def _tx(dec, lay, spec, **kw):
    return PrefillSender(lay, spec, dec.rx.control_address, transport="nixl", instance="pf", timeout_s=5, **kw)


@pytest.mark.parametrize("P,D,nhd", [(1, 1, False), (2, 4, False), (4, 2, False), (2, 1, True)])
def test_nixl_every_byte(P, D, nhd, no_leaks):
    dec = Decode(D=D, token_major=nhd, transports=("nixl",))
    try:
        caches = [prefill_cache(P, r, token_major=nhd) for r in range(P)]
        txs = [_tx(dec, lay, spec) for lay, _, spec in caches]
        assert all(tx.transport == "nixl" and tx.stats["path"] == "nixl (DRAM source)" for tx in txs)
        src_blocks = {"a": [3, 4, 5, 9, 10], "b": [20, 21, 22, 23, 30, 31], "c": [60]}  # several a layer
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, caches, src_blocks, grants)
        for tx in txs:
            tx.close()
    finally:
        dec.close()


def test_nixl_write_error_is_a_failed_request_and_the_session_serves_on(no_leaks):
    """A write NIXL refuses (the remote agent unknown to the sender) fails the layer's
    requests; decode frees their blocks."""
    dec = Decode(transports=("nixl",))
    try:
        lay, _, spec = prefill_cache(1, 0)
        with _tx(dec, lay, spec) as tx:
            impl = tx.transport_impl
            impl._agent.remove_remote(impl._peer)  # NIXL now has no such agent
            out = send_one(tx, "x", [1, 2])
            assert out.state == "failed" and "NIXL" in out.reason, out
            wait_until(lambda: dec.sched.buffer.num_free == dec.nb, 5, "decode frees the blocks")
            assert dec.sched.request("x").state is State.FAILED
        lay, _, spec = prefill_cache(1, 0)
        with _tx(dec, lay, spec) as tx:
            assert send_one(tx, "after", [3]).ok
    finally:
        dec.close()


def test_nixl_hostile_agent_metadata_is_refused_and_changes_nothing(no_leaks):
    import msgspec

    from pdkv.errors import PeerError
    from pdkv.protocol import MAX_NIXL_METADATA, NixlHello
    from pdkv.transfer import nixl

    dec = Decode(transports=("nixl",))
    try:
        lay, _, spec = prefill_cache(1, 0)
        real = nixl.NixlSender.hello_fields

        def garbage(self):
            return {"nixl": NixlHello(agent="evil", metadata=b"\x00" * 300)}

        nixl.NixlSender.hello_fields = garbage
        try:
            with pytest.raises(PeerError, match="refused the session: nixl"):
                _tx(dec, lay, spec)
        finally:
            nixl.NixlSender.hello_fields = real
        with pytest.raises(msgspec.ValidationError):  # over the bound: never decoded
            msgspec.convert({"agent": "a", "metadata": b"x" * (MAX_NIXL_METADATA + 1)}, NixlHello)
        assert dec.sched.buffer.num_free == dec.nb and not dec.sched.live_requests()
        with _tx(dec, lay, spec) as tx:
            assert send_one(tx, "ok", [1]).ok
    finally:
        dec.close()


def test_nixl_unavailable_names_the_extra(monkeypatch):
    import builtins

    from pdkv.errors import NixlUnavailableError

    real = builtins.__import__

    def no_nixl(name, *a, **kw):
        if name == "nixl" or name.startswith("nixl."):
            raise ImportError("No module named 'nixl'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    lay, _, spec = prefill_cache(1, 0)
    with pytest.raises(NixlUnavailableError, match=r"pip install 'pdkv\[nixl\]'"):
        PrefillSender(lay, spec, "tcp://127.0.0.1:9", transport="nixl")


@pytest.mark.multiproc
def test_nixl_prefill_killed_mid_transfer_decode_reclaims_and_serves_on(no_leaks):
    dec = Decode(peer_timeout_s=2.0, transports=("nixl",))
    try:
        p = _spawn(
            "prefill",
            "--control",
            dec.rx.control_address,
            "--transport",
            "nixl",
            "--blocks",
            "8",
            "--layer-sleep",
            "0.3",
            "--instance",
            "nk",
        )
        try:
            _lines(p, 3, timeout=60)  # ready, layers 0 and 1 handed over
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        finally:
            p.stdout.close()
            p.stderr.close()
        wait_until(lambda: dec.sched.buffer.num_free == dec.nb and not dec.sched.live_requests(), 10, "reclaim")
        assert dec.sched.request("nk-0").state in (State.FAILED, State.EXPIRED)
        dec.sched.check_invariants()
        lay, _, spec = prefill_cache(1, 0)
        with _tx(dec, lay, spec) as tx:
            assert send_one(tx, "after", [0, 1]).ok
    finally:
        dec.close()


@pytest.mark.multiproc
def test_nixl_decode_killed_mid_transfer_prefill_fails_in_bounded_time(no_leaks):

    d = _spawn("decode", "--timeout", "2", "--transports", "nixl")
    info = None
    try:
        info = _lines(d, 1, timeout=60)[0]
        lay, _, spec = prefill_cache(1, 0)
        tx = PrefillSender(lay, spec, info["control"], transport="nixl", timeout_s=1.5, heartbeat_s=0.2)
        try:
            tx.reserve("r", 64)
            tx.send_layer(0, [("r", list(range(8)))])
            os.kill(d.pid, signal.SIGKILL)
            d.wait(10)
            t0 = time.monotonic()
            for layer in range(1, 4):
                tx.send_layer(layer, [("r", list(range(8)))])
            out = tx.wait_outcome("r", 10)
            assert out.state == "failed"
            assert time.monotonic() - t0 < 6
        finally:
            t0 = time.monotonic()
            tx.close()
            assert time.monotonic() - t0 < 6
    finally:
        reap(d)
        if info is not None:
            clean_killed_segment(info["shm"])


@pytest.mark.multiproc
def test_nixl_process_exits_cleanly_after_a_transfer():
    """NIXL's UCX backend has crashed interpreters at exit (libnl's destructor); a process
    that used the nixl transport exits with status 0."""
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "from test_transfer import Decode, prefill_cache, send_one\n"
        "from pdkv import PrefillSender\n"
        "dec = Decode(transports=('nixl',))\n"
        "lay, arr, spec = prefill_cache(1, 0)\n"
        "with PrefillSender(lay, spec, dec.rx.control_address, transport='nixl', timeout_s=5) as tx:\n"
        "    assert send_one(tx, 'a', [0, 1]).ok\n"
        "dec.close()\n"
        "print('sent')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0 and "sent" in out.stdout, (out.returncode, out.stderr[-2000:])


@pytest.mark.cuda
@pytest.mark.parametrize("P,D", [(1, 1), (2, 4)])
def test_nixl_from_gpu_caches_every_byte(cuda_device, P, D, no_leaks):
    """NIXL's own VRAM source: the GPU cache registered with the agent, written into
    decode's DRAM buffer by UCX."""
    from test_staged import _gpu_caches

    from pdkv import _ffi

    dec = Decode(D=D, transports=("nixl",))
    caches, ptrs = _gpu_caches(P)
    try:
        txs = [_tx(dec, lay, gspec) for lay, _, _, gspec in caches]
        assert all(tx.stats["path"] == "nixl (VRAM source)" for tx in txs)
        src_blocks = {f"g{i}": [(7 * i + j * 3) % 64 for j in range(5)] for i in range(3)}
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, [(c[0], c[1], c[2]) for c in caches], src_blocks, grants)
        for tx in txs:
            tx.close()
    finally:
        for p in ptrs:
            _ffi.cuda.free(p)
        dec.close()
