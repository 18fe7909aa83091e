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
from test_transfer import (
    FUSED_CASES,
    Decode,
    _lines,
    _spawn,
    clean_killed_segment,
    fused_every_byte,
    prefill_cache,
    reap,
    send_one,
    wait_until,
)

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


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "per-write"])
@pytest.mark.parametrize("P,D,nhd", [(1, 1, False), (2, 4, False), (4, 2, False), (2, 1, True)])
def test_nixl_every_byte(P, D, nhd, prepared, monkeypatch, no_leaks):
    """Every byte, TP 1->1, 2->4, 4->2 and token-major 2->1, several requests a layer:
    through the session's prepared descriptor lists (two prepared per sender, whatever the
    number of requests and layers), and through lists built per write (a cache whose
    prepared lists would pass PREPARED_MAX)."""
    from pdkv import _ffi
    from pdkv.transfer.transports import nixl

    if not prepared:
        monkeypatch.setattr(nixl, "PREPARED_MAX", 0)
    made = []
    real = _ffi.nixl.Agent.prepare
    monkeypatch.setattr(_ffi.nixl.Agent, "prepare", lambda self, *a, **k: made.append(a) or real(self, *a, **k))
    dec = Decode(D=D, token_major=nhd, transports=("nixl",))
    try:
        caches = [prefill_cache(P, r, token_major=nhd) for r in range(P)]
        txs = [_tx(dec, lay, spec) for lay, _, spec in caches]
        want = "nixl (DRAM source, prepared lists)" if prepared else "nixl (DRAM source)"
        assert all(tx.transport == "nixl" and tx.stats["path"] == want for tx in txs)
        src_blocks = {"a": [3, 4, 5, 9, 10], "b": [20, 21, 22, 23, 30, 31], "c": [60]}  # several a layer
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, caches, src_blocks, grants)
        grants = _send_batch(txs, {"d": [7, 8], "e": [40, 41, 50]})  # the lists serve the next ones too
        _check_tp(dec, caches, {"d": [7, 8], "e": [40, 41, 50]}, grants)
        assert len(made) == (2 * P if prepared else 0)
        for tx in txs:
            tx.close()
    finally:
        dec.close()


@pytest.mark.parametrize("P,D", [(1, 1), (2, 4), (4, 2)])
def test_nixl_staged_every_byte(P, D, no_leaks):
    """The staged path (the host stand-in of a GPU cache's): each layer gathered into a
    ring registered with NIXL after the handshake, one WRITE per slot; slots small enough
    that a layer takes several."""
    dec = Decode(D=D, transports=("nixl",))
    try:
        caches = [prefill_cache(P, r) for r in range(P)]
        slot = 3 * caches[0][0].block_bytes // 4
        txs = [_tx(dec, lay, spec, staging="always", staging_slot_bytes=slot) for lay, _, spec in caches]
        assert all(tx.stats["path"] == "nixl staged (host gather)" for tx in txs)
        src_blocks = {"a": [3, 4, 5, 9, 10], "b": [20, 21, 22, 23, 30, 31], "c": [60]}
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, caches, src_blocks, grants)
        for tx in txs:
            assert len(tx.transport_impl.staging.log) > 4 * 2  # several slots a layer
            tx.close()
    finally:
        dec.close()


def test_nixl_gpu_source_rule(monkeypatch):
    """A GPU cache is staged unless the host has an RDMA device (or gpudirect says)."""
    from pdkv import _ffi
    from pdkv.transfer import SenderOptions
    from pdkv.transfer.transports.nixl import gpu_source_staged

    monkeypatch.setattr(_ffi.verbs, "rdma_devices", lambda: [])
    o = SenderOptions
    assert gpu_source_staged(0, o()) and not gpu_source_staged(None, o())
    assert not gpu_source_staged(0, o(gpudirect="require")) and gpu_source_staged(None, o(staging="always"))
    monkeypatch.setattr(_ffi.verbs, "rdma_devices", lambda: ["mlx5_0"])
    assert not gpu_source_staged(0, o()) and gpu_source_staged(0, o(gpudirect="off"))
    assert gpu_source_staged(0, o(staging="always"))


def test_nixl_auto_offers_it_only_on_an_rdma_host_and_skips_missing_software(monkeypatch, caplog, no_leaks):
    """auto: nixl after rdma and before tcp where the host has an RDMA device, absent
    otherwise; an offered transport whose software is missing (pyverbs here) is left out
    of the offer with a warning, and the session goes on with the next one."""
    from pdkv import _ffi
    from pdkv.transfer import auto_offer

    lay, _, spec = prefill_cache(1, 0)
    monkeypatch.setattr(_ffi.verbs, "rdma_devices", lambda: [])
    assert "nixl" not in auto_offer(spec)
    monkeypatch.setattr(_ffi.verbs, "rdma_devices", lambda: ["mlx5_0"])
    offer = auto_offer(spec)
    assert offer.index("shm") < offer.index("rdma") < offer.index("nixl") < offer.index("tcp")
    if _ffi.verbs.available():
        pytest.skip("pyverbs is installed: the missing-software case needs a host without it")
    dec = Decode(transports=("tcp", "nixl"))
    try:
        with caplog.at_level("WARNING", logger="pdkv.transfer.sessions.handshake"):
            tx = PrefillSender(lay, spec, dec.rx.control_address, transport="auto", instance="pf", timeout_s=5)
        with tx:
            assert tx.transport == "nixl"
            assert send_one(tx, "a", [1, 2]).ok
        assert any("rdma left out of the offer" in r.getMessage() for r in caplog.records)
    finally:
        dec.close()


@pytest.mark.parametrize("staging", ["auto", "always"])
def test_nixl_write_error_is_a_failed_request_and_the_session_serves_on(staging, no_leaks):
    """A write NIXL refuses (the remote agent unknown to the sender) fails the layer's
    requests; decode frees their blocks. Staged ("always"): every slot comes back too."""
    dec = Decode(transports=("nixl",))
    try:
        lay, _, spec = prefill_cache(1, 0)
        with _tx(dec, lay, spec, staging=staging) as tx:
            impl = tx.transport_impl
            impl._agent.remove_remote(impl._peer)  # NIXL now has no such agent
            out = send_one(tx, "x", [1, 2])
            assert out.state == "failed" and "NIXL" in out.reason, out
            if staging == "always":
                assert impl.staging.drain(5) and impl.staging.ring.free_slots == impl.staging.ring.slots
            wait_until(lambda: dec.sched.buffer.num_free == dec.nb, 5, "decode frees the blocks")
            assert dec.sched.request("x").state is State.FAILED
        lay, _, spec = prefill_cache(1, 0)
        with _tx(dec, lay, spec, staging=staging) as tx:
            assert send_one(tx, "after", [3]).ok
    finally:
        dec.close()


def test_nixl_hostile_agent_metadata_is_refused_and_changes_nothing(no_leaks):
    import msgspec

    from pdkv.errors import PeerError
    from pdkv.protocol import MAX_NIXL_METADATA, NixlHello
    from pdkv.transfer.transports import nixl

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
def test_nixl_two_process_tool_mode_verifies_every_byte(tmp_path, no_leaks):
    """pdkv-transfer-test decode --transport nixl and prefill --transport nixl, two
    processes: decode verifies every byte it received."""
    import json

    tool = [sys.executable, "-m", "pdkv.cli.transfer_tool"]
    common = ["--model", "tiny", "--transport", "nixl", "--timeout", "10"]
    out = tmp_path / "decode.json"
    d = subprocess.Popen(
        [*tool, "decode", "--listen", "tcp://127.0.0.1:0", "--buffer-blocks", "64", "--duration", "60", *common]
        + ["--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = d.stdout.readline()
        assert "serving nixl" in line, line + d.stderr.read() if d.poll() is not None else line
        addr = line.split("listening on ")[1].split(" ")[0]
        p = subprocess.run(
            [*tool, "prefill", "--connect", addr, "--requests", "4", *common],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        said = " ".join(p.stdout.split())  # the console wraps long lines
        assert "transport nixl (nixl (DRAM source, prepared lists))" in said and "4 of 4 requests received" in said
        d.send_signal(signal.SIGTERM)
        d.wait(30)
        rep = json.loads(out.read_text())
        assert rep["requests_ready"] == 4 and rep["verify_errors"] == 0 and rep["bytes_verified"] > 0, rep
    finally:
        if d.poll() is None:
            d.kill()
            d.wait(10)
        d.stdout.close()
        d.stderr.close()


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
@pytest.mark.parametrize("source", ["vram", "staged"])
@pytest.mark.parametrize("P,D", [(1, 1), (2, 4)])
def test_nixl_from_gpu_caches_every_byte(cuda_device, P, D, source, no_leaks):
    """NIXL's own VRAM source (the GPU cache registered with the agent, written into
    decode's DRAM buffer by UCX), and the staged path (the swap engine's gather into a
    pinned ring registered as DRAM): what ``auto`` picks on a host without an RDMA device."""
    from test_staged import _gpu_caches

    from pdkv import _ffi

    dec = Decode(D=D, transports=("nixl",))
    caches, ptrs = _gpu_caches(P)
    try:
        kw = {"gpudirect": "require"} if source == "vram" else {}
        txs = [_tx(dec, lay, gspec, **kw) for lay, _, _, gspec in caches]
        want = "nixl (VRAM source, prepared lists)" if source == "vram" else "nixl staged (GPU gather)"
        assert all(tx.stats["path"] == want for tx in txs), [tx.stats["path"] for tx in txs]
        src_blocks = {f"g{i}": [(7 * i + j * 3) % 64 for j in range(5)] for i in range(3)}
        grants = _send_batch(txs, src_blocks)
        _check_tp(dec, [(c[0], c[1], c[2]) for c in caches], src_blocks, grants)
        for tx in txs:
            tx.close()
    finally:
        for p in ptrs:
            _ffi.cuda.free(p)
        dec.close()


@pytest.mark.parametrize("P,D,src,dst", FUSED_CASES)
def test_nixl_fused_layouts_every_byte(P, D, src, dst, no_leaks):
    """vLLM's fused K/V caches through NIXL (one registration per layer region), every byte."""
    fused_every_byte("nixl", P, D, src, dst)


def test_a_closed_agent_stops_its_progress_thread_and_refuses_calls():
    """NIXL's progress thread polls without pause for as long as its agent lives (a whole core
    on an idle agent): close() lets the agent go, so nothing polls after it."""
    from pdkv import _ffi
    from pdkv.errors import TransferError

    a = _ffi.nixl.Agent("pdkv-closing")
    a.metadata()
    a.close()
    a.close()  # idempotent
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(0.5)
    busy = (time.process_time() - c0) / (time.monotonic() - t0)
    assert busy < 0.3, f"this process used {busy:.0%} of a core with its only agent closed"
    with pytest.raises(TransferError, match="^NIXL agent 'pdkv-closing' is closed$"):
        a.metadata()


class _NoSwap:
    def submit(self, *a, **k):
        raise AssertionError("an engine's own pages are never swapped by pdkv")


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "per-write"])
@pytest.mark.parametrize("P,mla", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "mla-tp2"])
def test_nixl_into_an_engines_own_host_pages(P, mla, prepared, monkeypatch, no_leaks):
    """Decode receives over NIXL straight into host pages an engine owns and chose
    (a HostRegion: each (layer, tensor) its own region, pages padded, sentinel bytes
    between regions), TP P->1 (MLA: rank 1's latent is rank 0's, so rank 1 writes
    nothing and prepares no list): every granted page equals prefill's block; every other
    byte of the arena (other pages, the padding, the gaps) is what it was; decode's
    agent registers the regions only, never the gaps between them."""
    import dataclasses

    import numpy as np
    from test_transfer import expected_block

    from pdkv import CacheSpec, DecodeReceiver, DecodeScheduler, KVLayout, SchedulerOptions, _ffi
    from pdkv.buffer.region import HostRegion
    from pdkv.integrations.core.pages import EnginePages
    from pdkv.transfer import ReceiverOptions
    from pdkv.transfer.transports import nixl

    if not prepared:
        monkeypatch.setattr(nixl, "PREPARED_MAX", 0)
    registered = []
    real = _ffi.nixl.Agent.register
    monkeypatch.setattr(
        _ffi.nixl.Agent, "register", lambda self, r, mem: registered.append((self.name, list(r))) or real(self, r, mem)
    )
    if mla:
        caches = []
        for r in range(P):
            lay_ = KVLayout(num_layers=3, kv_heads=1, head_dim=48, tokens_per_block=8, mla=True, tp_size=P, tp_rank=r)
            arr = np.random.default_rng(r).integers(0, 256, lay_.block_bytes * 64, dtype=np.uint8)
            caches.append((lay_, arr, CacheSpec.for_buffer(lay_, 64, arr.ctypes.data)))
    else:
        caches = [prefill_cache(P, r) for r in range(P)]
    src_lays, src_specs = [c[0] for c in caches], [c[2] for c in caches]
    lay = dataclasses.replace(src_lays[0], tp_size=1, tp_rank=0)
    nb, nt, gap = 16, len(lay.tensors), 4096
    strides = [lay.tensor_block_bytes(t) + 64 for t in range(nt)]
    size = sum(strides) * nb * lay.total_layers + gap * (lay.total_layers * nt + 1)
    arena = np.full(size, 0xA5, np.uint8)
    at, regions = arena.ctypes.data + gap, []
    for _ in range(lay.total_layers):
        row = []
        for t in range(nt):
            row.append((at, strides[t]))
            at += strides[t] * nb + gap
        regions.append(row)
    region = HostRegion(CacheSpec(lay, nb, regions), "an engine's host pool")
    before = arena.copy()
    pages = EnginePages(nb)
    sched = DecodeScheduler(
        layout=lay,
        gpu=None,
        buffer=pages,
        swap=_NoSwap(),
        options=SchedulerOptions(bind="engine", on_full="reject"),
    )
    rx = DecodeReceiver(
        sched, [lay], [region], nb, ReceiverOptions(control="tcp://127.0.0.1:0", transports=("nixl",), auto_tick=True)
    )
    txs = []
    try:
        decode_agent = [r for name, r in registered if name.startswith("pdkv-decode")]
        assert decode_agent == [[(b, st * nb, 0) for row in regions for b, st in row]]  # no gap registered
        dst, src = [5, 2, 9], [3, 40, 17]
        pages.designate("r1", dst)
        txs = [PrefillSender(lay_, spec, rx.control_address, transport="nixl", timeout_s=5) for lay_, _, spec in caches]
        for tx in txs:
            g = tx.reserve("r1", len(dst) * lay.tokens_per_block)
            assert list(g.blocks) == dst
        for layer in range(lay.total_layers):
            for tx in txs:
                tx.send_layer(layer, [("r1", src)])
        for tx in txs:
            tx.finish("r1")
        assert all(tx.wait_outcome("r1", 10).state == "received" for tx in txs)
        touched = np.zeros(size, bool)
        for layer in range(lay.total_layers):
            for t in range(nt):
                for i, page in enumerate(dst):
                    off = region.spec.address(layer, t, page) - arena.ctypes.data
                    n = lay.tensor_block_bytes(t)
                    want = expected_block(src_lays, src_specs, src, lay, layer, t, i)
                    assert arena[off : off + n].tobytes() == want, (layer, t, page)
                    touched[off : off + n] = True
        assert np.array_equal(arena[~touched], before[~touched])
    finally:
        for tx in txs:
            tx.close()
        rx.close()
