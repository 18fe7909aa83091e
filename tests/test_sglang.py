"""pdkv's SGLang backend driven by SGLang 0.5.23's own contract, in-process on CPU.

SGLang's queues cannot be built without its GPU model runner, so the tests call the
backend's ``Base*`` objects in the order the queues call them (0.5.23):

prefill (``disaggregation/prefill.py``): ``create_sender`` -> ``KVSender(mgr, addr, room)``
(l. 409); ``pop_bootstrapped`` polls until ``WaitingForInput`` (l. 508-545);
``finalize_bootstrap`` -> ``pop_decode_prefix_len`` then ``init(num_pages, aux_index)``
(l. 437-442); ``send_kv_chunk`` -> ``send(page_indices, state_indices, num_kv_tokens)`` per
chunk (l. 1769-1776); ``process_disagg_prefill_inflight_queue`` polls until ``Success`` and
``clear()``s (l. 1164-1233).

decode (``disaggregation/decode.py``): ``KVReceiver(mgr, addr, room)`` (l. 905);
``try_ensure_parallel_info(addr)`` (l. 1169); ``init(prefill_dp_rank)`` (l. 1105); polls
until ``WaitingForInput`` (l. 1119-1160); ``send_metadata(page_indices, aux_index,
state_indices, decode_prefix_len=0, destination=HOST)`` from ``_pre_alloc_host`` (l. 1863,
1936-1943) or with the device destination; polls until ``Success`` and ``clear()``s
(l. 2651-2774); an abort of a host destination ``abort()``s (l. 2830-2831) and releases the
pages only once ``is_abort_release_safe()`` (l. 3054-3056).
"""

from __future__ import annotations

import contextlib
import time
import types

import numpy as np
import pytest
from extras import need

conn_mod = need("sglang.srt.disaggregation.base.conn", "sglang")
# SGLang's disaggregation modules (the manager reads SGLang's PrefillServerInfo), imported on a
# CPU host as in its scheduler, warn that their GPU-only kernels are not there
pytestmark = pytest.mark.filterwarnings("ignore:Only CUDA:UserWarning")
KVPoll, Dest = conn_mod.KVPoll, conn_mod.KVTransferDestination

from pdkv.integrations.sglang.conn import (  # noqa: E402
    PdkvKVBootstrapServer,
    PdkvKVManager,
    PdkvKVReceiver,
    PdkvKVSender,
)
from pdkv.integrations.sglang.sides import Settings  # noqa: E402

SECRET = bytes(range(32))
PAGE, LAYERS, HEADS, DIM = 4, 3, 4, 8
AUX = [16, 8]  # two metadata buffers: bytes per request slot


class Pool:
    """One rank's SGLang pools as numpy arrays: KV buffers (MHA: K of every layer then V;
    MLA: one latent per layer), the host pool, the aux buffers."""

    def __init__(
        self, pages: int, heads: int, mla: bool, host_pages: int = 0, seed: int = 0, head_dim: int = DIM
    ) -> None:
        rng = np.random.default_rng(seed)
        width = 1 if mla else heads
        dim = 24 if mla else head_dim
        nbuf = LAYERS if mla else 2 * LAYERS
        self.kv = [rng.integers(0, 255, (pages, PAGE, width, dim * 2), dtype=np.uint8) for _ in range(nbuf)]
        self.host = [np.zeros((host_pages, PAGE, width, dim * 2), np.uint8) for _ in range(nbuf)] if host_pages else []
        self.aux = [rng.integers(0, 255, (64, n), dtype=np.uint8) for n in AUX]

    def args(self, rank: int, total_heads: int, mla: bool) -> types.SimpleNamespace:
        a = types.SimpleNamespace(
            engine_rank=rank,
            kv_data_ptrs=[b.ctypes.data for b in self.kv],
            kv_data_lens=[b.nbytes for b in self.kv],
            kv_item_lens=[b[0].nbytes for b in self.kv],
            kv_cache_dtype_str="bfloat16",
            page_size=PAGE,
            aux_data_ptrs=[b.ctypes.data for b in self.aux],
            aux_data_lens=[b.nbytes for b in self.aux],
            aux_item_lens=list(AUX),
            state_types=[],
            total_kv_head_num=1 if mla else total_heads,
            pp_rank=0,
            prefill_start_layer=0,
        )
        if self.host:
            a.host_kv_data_ptrs = [b.ctypes.data for b in self.host]
            a.host_kv_data_lens = [b.nbytes for b in self.host]
            a.host_kv_item_lens = [b[0].nbytes for b in self.host]
        return a


def _server_args(
    tp: int, port: int, threshold: float = 0.0, transport: str = "tcp", **settings
) -> types.SimpleNamespace:
    served = settings.pop("transports", None) or (("tcp",) if transport in ("tcp", "auto") else ("tcp", transport))
    return types.SimpleNamespace(
        tp_size=tp,
        dp_size=1,
        device="cpu",
        host="127.0.0.1",
        disaggregation_bootstrap_port=port,
        disaggregation_decode_host_receive_threshold=threshold,
        pdkv_settings=Settings(
            secret=SECRET,
            instance_key=b"k" * 32,
            timeout_s=5.0,
            lease_s=5.0,
            transports=served,
            transport=transport,
            **settings,
        ),
    )


class Pair:
    """A prefill instance of TP ``p`` and a decode instance of TP ``d``, each rank a
    manager over its own pools, and the bootstrap server."""

    def __init__(
        self, p: int, d: int, mla: bool = False, heads: int = HEADS, transport: str = "tcp", **decode_settings
    ) -> None:
        import os

        os.environ["PDKV_SECRET"] = SECRET.hex()
        self.boot = PdkvKVBootstrapServer("127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self.boot.port}"
        self.mla = mla
        self.ppools = [Pool(32, heads // p if not mla else 1, mla, seed=10 + r) for r in range(p)]
        self.dpools = [Pool(32, heads // d if not mla else 1, mla, host_pages=32, seed=20 + r) for r in range(d)]
        self.pm = [
            PdkvKVManager(pl.args(r, heads, mla), "prefill", _server_args(p, self.boot.port, transport=transport), mla)
            for r, pl in enumerate(self.ppools)
        ]
        self.dm = [
            PdkvKVManager(
                pl.args(r, heads, mla),
                "decode",
                _server_args(d, self.boot.port, transport=transport, **decode_settings),
                mla,
            )
            for r, pl in enumerate(self.dpools)
        ]

    def close(self) -> None:
        for m in self.pm + self.dm:
            m.close()
        self.boot.close()


def _until(fn, want, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got in want:
            return got
        time.sleep(0.005)
    return fn()


def _run(pair: Pair, room: int, src_pages: list[int], dst_pages: list[int], dest, aux_src=3, aux_dst=5, prefix=0):
    """One request through SGLang's order; returns (senders, receivers) after Success.
    ``prefix``: decode's radix cache holds that many prompt tokens (``decode_prefix_len``):
    ``dst_pages`` are the rest's pages, and prefill sends ``src_pages`` from there on."""
    senders = [PdkvKVSender(m, pair.addr, room) for m in pair.pm]
    receivers = [PdkvKVReceiver(m, pair.addr, room) for m in pair.dm]
    for m, r in zip(pair.dm, receivers):
        assert m.try_ensure_parallel_info(pair.addr)
        r.init(0)
        assert r.poll() in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
    for r in receivers:
        r.send_metadata(np.array(dst_pages, np.int32), aux_dst, None, decode_prefix_len=prefix, destination=dest)
    for s in senders:
        assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        start = s.pop_decode_prefix_len()  # finalize_bootstrap: start_send_idx
        assert start == prefix
        todo = src_pages[start // PAGE :]
        s.init(len(todo), aux_src)  # _num_pages_to_send: the pages past the prefix
        # two chunks, as chunked prefill sends them
        s.send(np.array(todo[:2], np.int32), None, num_kv_tokens=2 * PAGE)
        s.send(np.array(todo[2:], np.int32), None, num_kv_tokens=(len(todo) - 2) * PAGE)
    for s in senders:
        assert _until(s.poll, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success, s._out.error
    for r in receivers:
        assert _until(r.poll, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success, r._in.error
    return senders, receivers


def _heads_of(pool: Pool, buf: int, page: int) -> np.ndarray:
    return pool.kv[buf][page]


def _check_bytes(pair: Pair, src_pages, dst_pages, dest, aux_src=3, aux_dst=5):
    """Decode rank r's destination pages equal the prefill ranks' pages, head by head (and
    the aux slot the source's, unless ``aux_src`` is None)."""
    p, d = len(pair.ppools), len(pair.dpools)
    for r, dp in enumerate(pair.dpools):
        bufs = dp.host if dest == Dest.HOST else dp.kv
        for b in range(len(bufs)):
            for sp, tp in zip(src_pages, dst_pages):
                if pair.mla:
                    want = pair.ppools[0].kv[b][sp]
                else:
                    # all heads of the model, then decode rank r's slice of them
                    whole = np.concatenate([pp.kv[b][sp] for pp in pair.ppools], axis=1)
                    per = whole.shape[1] // d
                    want = whole[:, r * per : (r + 1) * per]
                assert np.array_equal(bufs[b][tp], want), f"rank {r} buffer {b} page {tp}"
        src = pair.ppools[0]
        for i in range(len(AUX) if aux_src is not None else 0):
            assert np.array_equal(dp.aux[i][aux_dst], src.aux[i][aux_src])
    del p


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("tp", [(1, 1), (1, 2), (2, 1)], ids=["tp1-1", "tp1-2", "tp2-1"])
@pytest.mark.parametrize("dest", ["host", "device", "device-staged"])
def test_sglang_pages_arrive_byte_for_byte(tp, mla, dest):
    """``device-staged``: the device destination as a GPU decode takes it, through pdkv's
    staging buffer and the swap engine's copy (host threads here, the copy engines on a GPU)."""
    staged = dest == "device-staged"
    dest = Dest.HOST if dest == "host" else Dest.DEVICE
    pair = Pair(*tp, mla=mla, **({"device_path": "staged"} if staged else {}))
    try:
        src, dst = [7, 2, 9, 30], [4, 11, 0, 31]
        before = [[b.copy() for b in pool.kv] for pool in pair.ppools]
        senders, receivers = _run(pair, 1234, src, dst, dest)
        _check_bytes(pair, src, dst, dest)
        # prefill's pages are unchanged; no page is pdkv's any more on either side
        for pool, old in zip(pair.ppools, before):
            assert all(np.array_equal(a, b) for a, b in zip(pool.kv, old))
        for r in receivers:
            assert r.is_abort_release_safe()
            r.clear()
        for s in senders:
            s.clear()
        for m in pair.dm:
            assert all(pg.num_free == pg.num_total for pg in m.decode.pages.values())
    finally:
        pair.close()


@pytest.mark.parametrize("tp", [(1, 1), (1, 2), (2, 1)], ids=["tp1-1", "tp1-2", "tp2-1"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dest", ["host", "device-staged"])
def test_sglang_over_nixl_byte_for_byte(tp, mla, dest, monkeypatch):
    """Prefill writes decode's host pages (or, ``device-staged``, the staging buffer a GPU
    decode's device pages are copied from) over NIXL (UCX tcp on loopback here; RDMA across
    hosts): decode's agent registers the pool's regions, prefill addresses the pages by
    their cells. Pages equal prefill's; every other byte of the pool is what it was; an
    abort after success leaves nothing held."""
    pytest.importorskip("nixl", reason="needs nixl: pip install 'pdkv[nixl]'")
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    staged = dest == "device-staged"
    where = Dest.DEVICE if staged else Dest.HOST
    pair = Pair(*tp, mla=mla, transport="nixl", **({"device_path": "staged"} if staged else {}))
    try:
        src, dst = [7, 2, 9, 30], [4, 11, 0, 31]
        pool_of = (lambda p: p.kv) if staged else (lambda p: p.host)
        before = [[b.copy() for b in pool_of(pool)] for pool in pair.dpools]
        senders, receivers = _run(pair, 77, src, dst, where)
        _check_bytes(pair, src, dst, where)
        for pool, old in zip(pair.dpools, before):
            for b, o in zip(pool_of(pool), old):
                keep = [i for i in range(b.shape[0]) if i not in dst]
                assert np.array_equal(b[keep], o[keep])
        assert all(t.transport == "nixl" for m in pair.pm for t in m.prefill._senders.values())
        for x in senders + receivers:
            x.clear()
        assert all(r.is_abort_release_safe() for r in receivers)
    finally:
        pair.close()


@pytest.mark.parametrize("tp", [(1, 1), (1, 2), (2, 1)], ids=["tp1-1", "tp1-2", "tp2-1"])
def test_sglang_shm_into_the_staging_buffer_on_one_host(tp):
    """Decode serves ``tcp,shm`` and prefill offers what it can (``auto``): a staged
    device destination (pdkv's own segment) is written over shm, the host pool (SGLang's
    memory, no segment) over tcp; both land byte for byte."""
    pair = Pair(*tp, transport="auto", device_path="staged", transports=("tcp", "shm"))
    try:
        src, dst = [7, 2, 9, 30], [4, 11, 0, 31]
        for room, where in ((81, Dest.DEVICE), (82, Dest.HOST)):
            senders, receivers = _run(pair, room, src, dst, where)
            _check_bytes(pair, src, dst, where)
            for x in senders + receivers:
                x.clear()
        by_rx = {m.decode.receivers[d].control_address: d for m in pair.dm for d in m.decode.receivers}
        used = {by_rx[control]: tx.transport for m in pair.pm for (control, _), tx in m.prefill._senders.items()}
        assert used == {"device": "shm", "host": "tcp"}
    finally:
        pair.close()


def test_sglang_settings_name_the_transports_that_reach_its_pages():
    from pdkv.errors import PdkvError

    for bad in [("tcp", "rdma"), ("shm",), ()]:
        with pytest.raises(PdkvError, match=f"PDKV_SGLANG_TRANSPORTS='{','.join(bad)}'.*by tcp and nixl"):
            Settings(secret=SECRET, transports=bad)
    assert Settings(secret=SECRET, transports=("tcp", "shm")).transports == ("tcp", "shm")
    with pytest.raises(PdkvError, match="PDKV_SGLANG_TRANSPORT='rdma'"):
        Settings(secret=SECRET, transport="rdma")


def test_sglang_untouched_pages_stay_untouched():
    """Pages no request designated are byte-for-byte what they were."""
    pair = Pair(1, 1)
    try:
        host_before = [b.copy() for b in pair.dpools[0].host]
        _run(pair, 99, [1, 2, 3], [5, 6, 7], Dest.HOST)
        for b, old in zip(pair.dpools[0].host, host_before):
            keep = [i for i in range(b.shape[0]) if i not in (5, 6, 7)]
            assert np.array_equal(b[keep], old[keep])
    finally:
        pair.close()


@pytest.mark.parametrize("tp", [(1, 1), (1, 2), (2, 1)], ids=["tp1-1", "tp1-2", "tp2-1"])
def test_sglang_a_decode_prefix_is_not_sent_and_the_rest_lands_page_for_page(tp):
    """Decode's radix cache holds the first two pages of a six-page prompt
    (``decode_prefix_len=8``): prefill's ``pop_decode_prefix_len`` gives 8, SGLang sends
    the last four pages only, and they land in decode's four pages, page for page; every
    other host page (the prefix decode holds among them) is what it was."""
    pair = Pair(*tp)
    try:
        src, dst = [7, 2, 9, 30, 5, 6], [4, 11, 0, 31]
        before = [[b.copy() for b in pool.host] for pool in pair.dpools]
        senders, receivers = _run(pair, 4242, src, dst, Dest.HOST, prefix=2 * PAGE)
        _check_bytes(pair, src[2:], dst, Dest.HOST)
        for pool, old in zip(pair.dpools, before):
            for b, o in zip(pool.host, old):
                keep = [i for i in range(b.shape[0]) if i not in dst]
                assert np.array_equal(b[keep], o[keep])
        assert all(s.get_transfer_metric().transfer_total_bytes > 0 for s in senders)
        for x in senders + receivers:
            x.clear()
    finally:
        pair.close()


def test_sglang_a_decode_prefix_that_is_not_whole_pages_or_differs_by_rank_fails_alone():
    """``decode_prefix_len`` of part of a page fails that request at decode, naming it;
    decode ranks that disagree on it fail it at prefill; the next request goes through."""
    pair = Pair(1, 2)
    try:
        senders, receivers = _started(pair, 51, [1, 2], Dest.HOST)
        receivers[0].send_metadata(np.array([1, 2], np.int32), 1, None, decode_prefix_len=3, destination=Dest.HOST)
        assert receivers[0].poll() == KVPoll.Failed
        assert "decode_prefix_len=3 is not a whole number of pages" in receivers[0]._in.error
        for x in senders + receivers:
            x.abort()
            x.clear()
        senders, receivers = _started(pair, 52, [1, 2], Dest.HOST)
        for r, prefix in zip(receivers, (PAGE, 2 * PAGE)):
            r.send_metadata(np.array([1, 2], np.int32), 1, None, decode_prefix_len=prefix, destination=Dest.HOST)
        assert _until(senders[0].poll, (KVPoll.Failed,)) == KVPoll.Failed
        assert "prefixes of different lengths" in senders[0]._out.error
        for x in senders + receivers:
            x.abort()
            x.clear()
        _run(pair, 53, [1, 2, 3], [5, 6, 7], Dest.HOST)
        _check_bytes(pair, [1, 2, 3], [5, 6, 7], Dest.HOST)
    finally:
        pair.close()


def _landed(pair: Pair, src_pages, dst_pages) -> bool:
    try:
        _check_bytes(pair, src_pages, dst_pages, Dest.HOST, aux_src=None)
        return True
    except AssertionError:
        return False


@pytest.mark.parametrize("tp", [(1, 1), (1, 2), (2, 1)], ids=["tp1-1", "tp1-2", "tp2-1"])
def test_sglang_a_chunk_is_sent_while_the_next_is_computed(tp):
    """Chunked prefill: the first chunk's pages reach decode's host pages before SGLang
    hands over the second (prefill does not wait for the last chunk); the rest follow;
    decode succeeds only with every page and the aux data in."""
    pair = Pair(*tp)
    try:
        src, dst = [7, 2, 9, 30, 5], [4, 11, 0, 31, 6]
        host_before = [[b.copy() for b in pool.host] for pool in pair.dpools]
        senders, receivers = _started(pair, 300, dst, Dest.HOST)
        for r in receivers:
            r.send_metadata(np.array(dst, np.int32), 5, None, decode_prefix_len=0, destination=Dest.HOST)
        for s in senders:
            assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
            s.init(len(src), 3)
            s.send(np.array(src[:2], np.int32), None, num_kv_tokens=2 * PAGE)
        assert _until(lambda: _landed(pair, src[:2], dst[:2]), (True,)) is True
        for pool, old in zip(pair.dpools, host_before):  # nothing past the first chunk yet
            for b, o in zip(pool.host, old):
                assert np.array_equal(b[dst[2:]], o[dst[2:]])
        assert all(r.poll() == KVPoll.WaitingForInput or r.poll() == KVPoll.Transferring for r in receivers)
        for s in senders:
            s.send(np.array(src[2:4], np.int32), None, num_kv_tokens=2 * PAGE)
        assert _until(lambda: _landed(pair, src[:4], dst[:4]), (True,)) is True
        assert all(r.poll() != KVPoll.Success for r in receivers)
        for s in senders:
            s.send(np.array(src[4:], np.int32), None, num_kv_tokens=PAGE)
        for x in senders + receivers:
            assert _until(x.poll, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        _check_bytes(pair, src, dst, Dest.HOST)
        for x in senders + receivers:
            x.clear()
    finally:
        pair.close()


def test_sglang_chunks_that_come_while_earlier_ones_are_written_go_as_one_write(monkeypatch):
    """While the session still writes the request's earlier chunks (``written``), the chunks SGLang
    hands over meanwhile gather and go as one write per layer; every page lands."""
    import threading

    from pdkv.transfer import PrefillSender

    calls = []
    real = PrefillSender.send_chunk
    monkeypatch.setattr(
        PrefillSender,
        "send_chunk",
        lambda self, layer, rid, pages, first, *a: (
            calls.append((layer, list(pages), first)) or real(self, layer, rid, pages, first, *a)
        ),
    )
    drained = threading.Event()
    monkeypatch.setattr(PrefillSender, "written", lambda self, mark: drained.is_set())
    monkeypatch.setattr(PrefillSender, "wait_written", lambda self, mark, timeout: drained.wait(timeout))
    pair = Pair(1, 1)
    try:
        src, dst = [7, 2, 9, 30], [4, 11, 0, 31]
        senders, receivers = _started(pair, 302, dst, Dest.HOST)
        receivers[0].send_metadata(np.array(dst, np.int32), 5, None, decode_prefix_len=0, destination=Dest.HOST)
        s = senders[0]
        assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        s.init(len(src), 3)
        for i, page in enumerate(src):
            s.send(np.array([page], np.int32), None, num_kv_tokens=PAGE)
            if i == 0:
                assert _until(lambda: len(calls) == LAYERS, (True,)) is True  # the first goes at once
        time.sleep(0.2)
        assert len(calls) == LAYERS  # the rest wait for the session's earlier writes
        drained.set()
        for x in senders + receivers:
            assert _until(x.poll, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        # one send per layer for the first chunk, and one per layer for the three gathered
        assert len(calls) == 2 * LAYERS and calls[LAYERS:] == [(la, src[1:], 1) for la in range(LAYERS)]
        _check_bytes(pair, src, dst, Dest.HOST)
        for x in senders + receivers:
            x.clear()
    finally:
        pair.close()


def test_sglang_an_abort_between_chunks_ends_decodes_grant_at_once():
    """SGLang aborts a request at prefill after its first chunk went out: decode's grant
    ends at once (not at its lease), decode fails the request naming prefill's reason,
    and its pages are free."""
    pair = Pair(1, 1)
    try:
        senders, receivers = _started(pair, 301, [1, 2, 3], Dest.HOST)
        r, s = receivers[0], senders[0]
        r.send_metadata(np.array([1, 2, 3], np.int32), 1, None, decode_prefix_len=0, destination=Dest.HOST)
        assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        s.init(3, 2)
        s.send(np.array([4, 5], np.int32), None, num_kv_tokens=2 * PAGE)
        assert _until(lambda: _landed(pair, [4, 5], [1, 2]), (True,)) is True
        t0 = time.monotonic()
        s.abort()
        assert s.poll() == KVPoll.Failed
        assert _until(r.poll, (KVPoll.Failed,), timeout=3) == KVPoll.Failed
        assert time.monotonic() - t0 < 3 < pair.dm[0].decode.settings.lease_s + 1  # not the lease
        assert "aborted by SGLang" in r._in.error
        assert _until(r.is_abort_release_safe, (True,)) is True
        r.clear()
        s.clear()
    finally:
        pair.close()


def _started(pair: Pair, room: int, dst_pages, dest):
    """Senders and receivers of a request, the receivers' metadata sent, nothing sent yet."""
    senders = [PdkvKVSender(m, pair.addr, room) for m in pair.pm]
    receivers = [PdkvKVReceiver(m, pair.addr, room) for m in pair.dm]
    for m, r in zip(pair.dm, receivers):
        assert m.try_ensure_parallel_info(pair.addr)
        r.init(0)
    return senders, receivers


@pytest.mark.parametrize("at", ["bootstrapping", "waiting", "transferring", "success"])
@pytest.mark.parametrize("dest", ["host", "device-staged"])
def test_sglang_abort_at_every_state_leaves_nothing_held(at, dest):
    """An abort of a host destination (or a GPU decode's staged device destination) at
    each KVPoll state: once is_abort_release_safe() says so, no page is pdkv's on decode,
    and a write that comes later lands nowhere."""
    staged = dest == "device-staged"
    where = Dest.DEVICE if staged else Dest.HOST
    pair = Pair(1, 1, **({"device_path": "staged"} if staged else {}))
    try:
        dst = [3, 4, 5]
        senders, receivers = _started(pair, 7, dst, where)
        r, s = receivers[0], senders[0]
        dm = pair.dm[0].decode
        pool = pair.dpools[0].kv if staged else pair.dpools[0].host
        if at != "bootstrapping":
            r.send_metadata(np.array(dst, np.int32), 1, None, decode_prefix_len=0, destination=where)
            assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        if at in ("transferring", "success"):
            s.init(3, 2)
            s.send(np.array([1, 2, 3], np.int32), None, num_kv_tokens=3 * PAGE)
            if at == "success":
                assert _until(r.poll, (KVPoll.Success,)) == KVPoll.Success
        before = [b.copy() for b in pool]
        r.abort()
        assert r.poll() == (KVPoll.Success if at == "success" else KVPoll.Failed) or r.poll() == KVPoll.Failed
        assert _until(r.is_abort_release_safe, (True,)) is True
        assert all(not pg.holds(r._in.pid) for pg in dm.pages.values())
        assert all(pg.num_free == pg.num_total for pg in dm.pages.values())
        if at in ("bootstrapping", "waiting"):
            # prefill sends anyway (SGLang's prefill does not know): nothing lands
            s.init(3, 2)
            s.send(np.array([1, 2, 3], np.int32), None, num_kv_tokens=3 * PAGE)
            assert _until(s.poll, (KVPoll.Failed, KVPoll.Success), timeout=15) in (KVPoll.Failed, KVPoll.Success)
            for b, old in zip(pool, before):
                assert np.array_equal(b, old)
        r.clear()
        s.clear()
    finally:
        pair.close()


@contextlib.contextmanager
def _granted_to_a_sender_of_our_own(pair: Pair, room: int, transport: str, instance: str, dest=None):
    """A request whose decode pages [6, 7] are designated (host destination, or ``dest``),
    reserved by a PrefillSender the test drives itself (so it can hold a write open):
    yields the receiver, decode's side, its receiver and the test's grant; the sender
    closed and the request cleared after."""
    from pdkv.integrations.sglang.sides import room_binding
    from pdkv.transfer import PrefillSender

    dest = Dest.HOST if dest is None else dest
    senders, receivers = _started(pair, room, [6, 7], dest)
    r, s = receivers[0], senders[0]
    dm = pair.dm[0].decode
    r.send_metadata(np.array([6, 7], np.int32), 1, None, decode_prefix_len=0, destination=dest)
    rx = dm.receivers["host" if dest == Dest.HOST else "device"]
    tx = PrefillSender(
        dm.layout, pair.pm[0].pools.device, rx.control_address, instance=instance, secret=SECRET,
        transport=transport, timeout_s=5.0,
    )  # fmt: skip
    try:
        grant = tx.reserve_many([(r._in.pid, 2 * PAGE, room_binding(room))])[0]
        assert not isinstance(grant, BaseException), grant
        assert tx.transport == transport and list(grant.blocks) == [6, 7]  # exactly the designated pages
        yield r, dm, rx, grant
    finally:
        tx.close()
    r.clear()
    s.clear()


def test_sglang_a_delayed_writer_holds_the_pages_until_it_ends():
    """A write admitted under the grant (the scheduler's ticket, what tcp takes per frame)
    keeps the pages pdkv's after an abort; is_abort_release_safe() turns true only when it
    ends, and nothing it could still write lands after that."""
    from pdkv.errors import PdkvError

    pair = Pair(1, 1)
    try:
        with _granted_to_a_sender_of_our_own(pair, 8, "tcp", "slow") as (r, dm, rx, grant):
            ticket = rx.scheduler.begin_write(r._in.pid, grant.token)  # a frame admitted, its payload slow
            r.abort()
            time.sleep(0.2)
            assert not r.is_abort_release_safe()  # the write still runs: the pages stay pdkv's
            assert dm.pages["host"].holds(r._in.pid)
            rx.scheduler.end_write(ticket)
            assert _until(r.is_abort_release_safe, (True,)) is True
            with pytest.raises(PdkvError):
                rx.scheduler.begin_write(r._in.pid, grant.token)  # no write is admitted after
    finally:
        pair.close()


def test_sglang_a_failed_device_destination_is_released_only_when_its_writes_end():
    """SGLang's decode releases a failed device destination's pages without asking the
    receiver; with its deferred release (on by default) it asks the manager,
    ``is_abort_release_safe(room, acks)``, until true or 30 s. A write admitted under the
    grant keeps that false until it ends."""
    pair = Pair(1, 1)
    try:
        m = pair.dm[0]
        assert m.enable_deferred_decode_kv_release and m.supports_deferred_decode_kv_release
        with _granted_to_a_sender_of_our_own(pair, 18, "tcp", "slow", Dest.DEVICE) as (r, dm, rx, grant):
            ticket = rx.scheduler.begin_write(r._in.pid, grant.token)
            r.ensure_abort_notified(force_arm=True)  # what SGLang calls on a failed transfer
            assert r.poll() == KVPoll.Failed and r.abort_notified
            time.sleep(0.2)
            assert not m.is_abort_release_safe(18, len(r.bootstrap_infos))
            rx.scheduler.end_write(ticket)
            assert _until(lambda: m.is_abort_release_safe(18, 1), (True,)) is True
            m.clear_deferred_abort_state(18)
        assert m.is_abort_release_safe(18, 1)  # cleared: nothing of it is pdkv's
    finally:
        pair.close()


def test_sglang_over_nixl_an_aborted_grant_keeps_its_pages_for_the_fence_grace(monkeypatch):
    """NIXL's writes are one-sided (decode cannot see one in flight): with nixl served, a
    granted request aborted by SGLang keeps its pages pdkv's for the fence grace (2 s);
    is_abort_release_safe() is false until then, true after."""
    pytest.importorskip("nixl", reason="needs nixl: pip install 'pdkv[nixl]'")
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    pair = Pair(1, 1, transport="nixl")
    try:
        with _granted_to_a_sender_of_our_own(pair, 9, "nixl", "one-sided") as (r, dm, rx, _):
            grace = rx.scheduler.options.fence_grace_s
            assert grace > 0
            t0 = time.monotonic()
            r.abort()
            time.sleep(0.2)
            assert not r.is_abort_release_safe() and dm.pages["host"].holds(r._in.pid)
            assert _until(r.is_abort_release_safe, (True,), timeout=grace + 3) is True
            assert time.monotonic() - t0 >= grace - 0.1
    finally:
        pair.close()


def test_sglang_a_dead_decode_fails_prefill_within_its_lease():
    pair = Pair(1, 1)
    try:
        senders, receivers = _started(pair, 9, [1, 2], Dest.HOST)
        r, s = receivers[0], senders[0]
        r.send_metadata(np.array([1, 2], np.int32), 1, None, decode_prefix_len=0, destination=Dest.HOST)
        assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        pair.dm[0].close()  # decode's receivers, pull client and aux endpoint gone
        pair.dm = []
        s.init(2, 1)
        t0 = time.monotonic()
        s.send(np.array([4, 5], np.int32), None, num_kv_tokens=2 * PAGE)
        assert _until(s.poll, (KVPoll.Failed,), timeout=30) == KVPoll.Failed
        assert time.monotonic() - t0 < 5.0 + 5.0 + 5.0  # timeout_s + lease_s + slack
        with pytest.raises(Exception, match="room 9"):
            s.failure_exception()
    finally:
        pair.close()


_KILLED_DECODE = """
import sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import test_sglang as t
port, room = int(sys.argv[2]), int(sys.argv[3])
pool = t.Pool(32, t.HEADS, False, host_pages=32, seed=20)
m = t.PdkvKVManager(pool.args(0, t.HEADS, False), "decode", t._server_args(1, port), False)
addr = f"127.0.0.1:{port}"
assert m.try_ensure_parallel_info(addr)
r = t.PdkvKVReceiver(m, addr, room)
r.init(0)
r.send_metadata(np.array([1, 2], np.int32), 1, None, decode_prefix_len=0, destination=t.Dest.HOST)
print("metadata sent", flush=True)
time.sleep(120)
"""


@pytest.mark.multiproc
def test_sglang_a_decode_killed_mid_transfer_fails_prefill_within_its_lease(tmp_path):
    """Decode in a process of its own sends its metadata, then is SIGKILLed after prefill's
    first chunk went out and before the last: prefill's sender ends Failed within its
    timeout and lease, names the room, and prefill's manager serves the next request."""
    import os
    import signal
    import subprocess
    import sys

    pair = Pair(1, 1)
    pair.dm[0].close()  # decode lives in the child, alone
    pair.dm = []
    env = {**os.environ, "PDKV_SECRET": SECRET.hex()}
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_DECODE, here, str(pair.boot.port), "11"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("metadata sent"), line + (child.stderr.read() if child.poll() is not None else "")
        s = PdkvKVSender(pair.pm[0], pair.addr, 11)
        assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        s.init(2, 1)
        s.send(np.array([4], np.int32), None, num_kv_tokens=PAGE)  # the first chunk
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        t0 = time.monotonic()
        s.send(np.array([5], np.int32), None, num_kv_tokens=PAGE)  # the last: the KV goes now
        assert _until(s.poll, (KVPoll.Failed, KVPoll.Success), timeout=30) == KVPoll.Failed
        assert time.monotonic() - t0 < 5.0 + 5.0 + 5.0  # timeout_s + lease_s + slack
        with pytest.raises(Exception, match="room 11"):
            s.failure_exception()
        s.clear()
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()
        pair.close()


def test_sglang_a_planted_page_mapping_bug_is_caught(monkeypatch):
    """The host-page address mapping (layouts._spec: tensor t of layer l is buffer t*L+l)
    planted with K and V swapped: the byte comparison of test_sglang_pages_arrive_byte_for_byte
    fails, so that test guards the mapping."""
    from pdkv.integrations.sglang import layouts

    real = layouts._spec

    def planted(layout, ptrs, lens, items, what, device=None):
        if what == "host KV pool":
            n = layout.total_layers
            ptrs = ptrs[n:] + ptrs[:n]  # V buffers where K's belong
        return real(layout, ptrs, lens, items, what, device)

    monkeypatch.setattr(layouts, "_spec", planted)
    pair = Pair(1, 1)
    try:
        _run(pair, 5, [1, 2, 3], [8, 9, 10], Dest.HOST)
        with pytest.raises(AssertionError, match="buffer"):
            _check_bytes(pair, [1, 2, 3], [8, 9, 10], Dest.HOST)
    finally:
        pair.close()


class _GatedCopies:
    """The staging scheduler's swap backend with a gate: each copy starts only once
    ``go`` is set (a slow copy engine), then runs as the real one would."""

    def __init__(self, real) -> None:
        import threading

        self.real, self.go, self.started = real, threading.Event(), threading.Event()
        self._threading = threading

    def submit(self, rid, buffer_blocks, gpu_blocks):
        gate = self

        class Copy:
            inner = None

            def done(self) -> bool:
                return self.inner is not None and self.inner.done()

            @property
            def error(self):
                return None if self.inner is None else self.inner.error

        c = Copy()

        def run():
            gate.go.wait(10)
            c.inner = gate.real.submit(rid, buffer_blocks, gpu_blocks)

        self.started.set()
        self._threading.Thread(target=run, daemon=True).start()
        return c


def test_sglang_staged_device_pages_are_safe_to_release_only_after_the_copy(no_leaks):
    """The staged device destination (a GPU decode's): an abort while the copy from the
    staging buffer into SGLang's device pages runs leaves the request unsafe to release
    until the copy ends; then no staging block is held, and nothing writes the device
    pages any more."""
    pair = Pair(1, 1, device_path="staged")
    try:
        dm = pair.dm[0].decode
        sched = dm.receivers["device"].scheduler
        gate = _GatedCopies(sched.swap)
        sched.swap = gate
        src, dst = [7, 2, 9], [4, 11, 0]
        senders, receivers = _started(pair, 500, dst, Dest.DEVICE)
        r, s = receivers[0], senders[0]
        r.send_metadata(np.array(dst, np.int32), 5, None, decode_prefix_len=0, destination=Dest.DEVICE)
        assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        s.init(3, 3)
        s.send(np.array(src, np.int32), None, num_kv_tokens=3 * PAGE)
        assert _until(lambda: (r.poll(), gate.started.is_set())[1], (True,)) is True  # received: the copy is submitted
        assert sched.request(r._in.pid).state.value == "swapping"
        device_before = [b.copy() for b in pair.dpools[0].kv]
        r.abort()
        assert r.poll() == KVPoll.Failed
        time.sleep(0.2)
        assert not r.is_abort_release_safe()  # the copy may still write SGLang's pages
        assert dm.pages["device"].holds(r._in.pid)
        assert all(np.array_equal(b, o) for b, o in zip(pair.dpools[0].kv, device_before))  # not yet
        gate.go.set()
        assert _until(r.is_abort_release_safe, (True,)) is True
        assert dm.pages["device"].num_free == dm.pages["device"].num_total
        after = [b.copy() for b in pair.dpools[0].kv]
        time.sleep(0.2)
        assert all(np.array_equal(b, o) for b, o in zip(pair.dpools[0].kv, after))  # nothing writes after
        r.clear()
        s.clear()
    finally:
        pair.close()


def test_sglang_a_full_staging_buffer_queues_and_a_too_large_request_is_refused():
    """A staging buffer of 4 pages: a second 3-page request waits (its grant queued,
    prefill keeps its KV) until the first's copy ends, then lands byte for byte; a request
    of more pages than the buffer holds fails at send_metadata naming the setting."""
    from pdkv.layout import CacheSpec

    probe = Pair(1, 1, device_path="staged")
    block = CacheSpec.buffer_bytes(probe.dm[0].decode.layout, 1)
    probe.close()
    pair = Pair(1, 1, device_path="staged", staging_mb=4 * block / 2**20)
    try:
        dm = pair.dm[0].decode
        assert dm.pages["device"].num_total == 4
        sched = dm.receivers["device"].scheduler
        gate = _GatedCopies(sched.swap)
        sched.swap = gate
        rooms = {601: ([7, 2, 9], [4, 11, 0]), 602: ([1, 3, 5], [20, 21, 22])}
        started = {room: _started(pair, room, dst, Dest.DEVICE) for room, (_, dst) in rooms.items()}
        for room, (src, dst) in rooms.items():
            (s,), (r,) = started[room]
            r.send_metadata(np.array(dst, np.int32), room - 600, None, decode_prefix_len=0, destination=Dest.DEVICE)
            assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
            s.init(3, room - 600)
            s.send(np.array(src, np.int32), None, num_kv_tokens=3 * PAGE)
        (_, (r2,)) = started[602]
        assert _until(lambda: sched.metrics()["live_queued"], (1,)) == 1  # no room: queued, not refused
        assert r2.poll() == KVPoll.Transferring
        gate.go.set()  # the first copy ends, its blocks go back, the second is granted
        for room in rooms:
            (s,), (r,) = started[room]
            assert _until(r.poll, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success, r._in.error
            assert _until(s.poll, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        for room, (src, dst) in rooms.items():
            _check_bytes(pair, src, dst, Dest.DEVICE, aux_src=room - 600, aux_dst=room - 600)
        for ss, rs in started.values():
            for x in ss + rs:
                x.clear()
        (s,), (r,) = _started(pair, 603, [1, 2, 3, 4, 5], Dest.DEVICE)
        r.send_metadata(np.array([1, 2, 3, 4, 5], np.int32), 1, None, decode_prefix_len=0, destination=Dest.DEVICE)
        assert r.poll() == KVPoll.Failed
        assert "more than the staging buffer's 4 (raise PDKV_SGLANG_STAGING_MB)" in r._in.error
        s.abort()
        for x in (s, r):
            x.clear()
    finally:
        pair.close()


def test_sglang_a_gpu_server_names_its_pool_device_and_decode_stages_it(no_leaks):
    """On a GPU server (``device='cuda'``, SGLang's ``gpu_id``) the KV pool's spec names
    its device, so pdkv's senders stage it and decode's device destination goes through
    the staging buffer (any host-receive threshold); the host pool stays host memory."""
    pool = Pool(8, HEADS, False, host_pages=8)
    a = pool.args(0, HEADS, False)
    a.gpu_id = 0
    sa = _server_args(1, 1, threshold=0.5)
    sa.device = "cuda"
    m = PdkvKVManager(a, "decode", sa, False)
    try:
        assert m.pools.device.device == 0 and m.pools.host is not None and m.pools.host.device is None
        assert m.decode is not None and m.decode.staged and m.decode.staging is not None
        assert set(m.decode.receivers) == {"device", "host"}
    finally:
        m.close()
    cpu = PdkvKVManager(pool.args(0, HEADS, False), "decode", _server_args(1, 1, threshold=0.5), False)
    try:
        assert cpu.pools.device.device is None and not cpu.decode.staged and cpu.decode.staging is None
    finally:
        cpu.close()


def test_sglang_refuses_what_pdkv_cannot_carry():
    from pdkv.errors import PdkvError

    pool = Pool(8, HEADS, False, host_pages=8)
    for field, value, word in [
        ("state_types", ["mamba"], "state pools"),
        ("mla_compression_ratios", [0, 4], "compressed MLA"),
        ("pp_rank", 1, "pipeline-parallel"),
    ]:
        a = pool.args(0, HEADS, False)
        setattr(a, field, value)
        with pytest.raises(PdkvError, match=word):
            PdkvKVManager(a, "decode", _server_args(1, 1), False)


def test_sglang_activation_adds_the_backend_to_sglang():
    need("sglang.srt.disaggregation.utils", "sglang")
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import utils

    from pdkv.integrations.sglang import activate, conn

    activate.install()
    activate.install()  # idempotent
    be = utils.TransferBackend("pdkv")
    assert be is utils.TransferBackend.PDKV
    assert utils.get_kv_class(be, utils.KVClassType.MANAGER) is conn.PdkvKVManager
    assert utils.get_kv_class(be, utils.KVClassType.RECEIVER) is conn.PdkvKVReceiver
    assert utils.get_kv_class(be, utils.KVClassType.BOOTSTRAP_SERVER) is conn.PdkvKVBootstrapServer
    assert utils.get_kv_class(utils.TransferBackend.FAKE, utils.KVClassType.SENDER).__name__ != "PdkvKVSender"
    assert "pdkv" in DISAGG_TRANSFER_BACKEND_CHOICES
    assert conn.PdkvKVManager.supports_host_destination


def test_sglang_activation_in_this_process_from_sglang_as_it_ships(monkeypatch, caplog):
    """install() and plugin() against SGLang as it is before pdkv (no enum member, no
    choice, its own get_kv_class in every module that imported it), undone afterwards: what
    each adds, that a second call adds nothing, that an untested SGLang only logs at
    plugin time and fails naming its version when pdkv is chosen, and that moved internals
    never fail SGLang's start."""
    need("sglang.srt.disaggregation.utils", "sglang")
    import logging
    import sys

    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils

    from pdkv.errors import PdkvError
    from pdkv.integrations.sglang import activate, conn

    E, kinds = utils.TransferBackend, utils.KVClassType
    wrapped = utils.get_kv_class
    orig = wrapped
    while getattr(orig, "_pdkv", False):  # SGLang's own, from the wrapper's closure
        orig = dict(zip(orig.__code__.co_freevars, (c.cell_contents for c in orig.__closure__)))["original"]
    holders = [
        m
        for n, m in list(sys.modules.items())
        if n.startswith("sglang.") and getattr(m, "get_kv_class", None) is wrapped
    ]
    member = E._member_map_.get("PDKV")
    names, had_choice = list(E._member_names_), "pdkv" in choices.DISAGG_TRANSFER_BACKEND_CHOICES

    def fresh():
        E._member_map_.pop("PDKV", None)
        E._value2member_map_.pop("pdkv", None)
        E._member_names_[:] = [n for n in names if n != "PDKV"]
        while "pdkv" in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
            choices.DISAGG_TRANSFER_BACKEND_CHOICES.remove("pdkv")
        for m in holders:
            m.get_kv_class = orig

    try:
        fresh()
        assert "pdkv" not in E._value2member_map_ and utils.get_kv_class is orig
        activate.install()
        pd = E("pdkv")
        assert pd is E.PDKV and pd.name == "PDKV" and pd.value == "pdkv" and isinstance(pd, E)
        assert E._member_names_.count("PDKV") == 1
        assert choices.DISAGG_TRANSFER_BACKEND_CHOICES.count("pdkv") == 1
        got = utils.get_kv_class
        assert got is not orig and got._pdkv is True and all(m.get_kv_class is got for m in holders)
        for backend in (pd, "pdkv"):
            assert got(backend, kinds.MANAGER) is conn.PdkvKVManager
            assert got(backend, kinds.SENDER) is conn.PdkvKVSender
            assert got(backend, kinds.RECEIVER) is conn.PdkvKVReceiver
            assert got(backend, kinds.BOOTSTRAP_SERVER) is conn.PdkvKVBootstrapServer
            assert got(backend, kinds.KVARGS) is conn_mod.KVArgs
        with pytest.raises(ValueError) as e:
            got(pd, "other")
        assert str(e.value) == "pdkv's SGLang backend has no other"
        assert got(E.FAKE, kinds.SENDER) is orig(E.FAKE, kinds.SENDER)  # other backends: SGLang's own
        import enum

        class Elsewhere(enum.Enum):  # the enum as another import of SGLang's module made it
            PDKV = "pdkv"

        assert got(Elsewhere.PDKV, kinds.MANAGER) is conn.PdkvKVManager
        assert activate._check_version() == "0.5.23"
        activate.install()  # idempotent: nothing added twice, the same wrapper
        assert utils.get_kv_class is got and E._member_names_.count("PDKV") == 1
        assert choices.DISAGG_TRANSFER_BACKEND_CHOICES.count("pdkv") == 1

        fresh()  # the plugin with the tested SGLang: as install()
        activate.plugin()
        assert utils.get_kv_class(E.PDKV, kinds.MANAGER) is conn.PdkvKVManager

        fresh()  # an untested SGLang: the plugin only logs; choosing pdkv names the version
        untested = "pdkv's SGLang backend is tested with SGLang 0.0.1, 0.0.2; this is 0.5.23"
        monkeypatch.setattr(activate, "TESTED", ("0.0.1", "0.0.2"))
        activate.plugin()
        assert E("pdkv").value == "pdkv" and utils.get_kv_class is not orig
        with pytest.raises(PdkvError) as e:
            utils.get_kv_class(E.PDKV, kinds.MANAGER)
        assert str(e.value) == untested
        with pytest.raises(PdkvError) as e:
            activate.install()
        assert str(e.value) == untested

        # internals moved: the plugin logs (with the version's refusal, if any) and SGLang
        # starts without pdkv
        monkeypatch.setattr(utils, "TransferBackend", None)
        gone = "'NoneType' object has no attribute '__members__'"
        for tested, why in ((("0.5.23",), ""), (("0.0.1", "0.0.2"), untested)):
            fresh()
            monkeypatch.setattr(activate, "TESTED", tested)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger=activate.__name__):
                activate.plugin()
            assert [r.getMessage() for r in caplog.records] == [
                f"pdkv could not add itself to SGLang's transfer backends: {gone} ({why})"
            ]
        monkeypatch.setattr(utils, "TransferBackend", E)
        monkeypatch.setattr(activate, "TESTED", ("0.5.23", "0.5.24"))
        monkeypatch.setitem(sys.modules, "sglang.version", None)  # no SGLang to read
        with pytest.raises(PdkvError) as e:
            activate.install()
        assert str(e.value).startswith("pdkv's SGLang backend needs SGLang 0.5.23 or 0.5.24: ")
    finally:
        fresh()
        if member is not None:
            E._member_map_["PDKV"], E._value2member_map_["pdkv"] = member, member
            E._member_names_[:] = names
        if had_choice:
            choices.DISAGG_TRANSFER_BACKEND_CHOICES.append("pdkv")
        for m in holders:
            m.get_kv_class = wrapped


def test_sglang_two_streams_that_open_a_session_at_once_share_one(monkeypatch):
    """Two streams to one decode rank find no session at once: one opens it while the
    other waits, and both use it (a second Hello of this process for the same rank would
    replace the first session at decode and fail its requests); a broken session is
    replaced, then closed."""
    import threading

    from pdkv.integrations.sglang import prefill_rank

    pair = Pair(1, 1)
    try:
        rank = pair.pm[0].prefill
        key = ("tcp://127.0.0.1:1", 1)

        class Fake:
            made: list = []

            def __init__(self, *a, **k):
                self.broken, self.closed = None, False
                Fake.made.append(self)
                time.sleep(0.3)  # a handshake: the other stream asks meanwhile

            def close(self):
                self.closed = True

        monkeypatch.setattr(prefill_rank, "PrefillSender", Fake)
        got = []
        ts = [threading.Thread(target=lambda: got.append(rank._sender(*key))) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(5)
        assert len(Fake.made) == 1 and got == [Fake.made[0]] * 2 and rank._senders[key] is Fake.made[0]
        first = Fake.made[0]
        assert not first.closed
        first.broken = "decode went away"
        again = rank._sender(*key)
        assert again is Fake.made[1] and rank._senders[key] is again and first.closed
        del rank._senders[key]
    finally:
        pair.close()


# What SGLang 0.5.23's own scheduler and queues (``srt/disaggregation/*.py``,
# ``srt/managers/*.py``) read or call on a backend's objects, found by reading their source
# (the test below): each either answered by pdkv's class or, with the reason, never reached
# with pdkv's objects. A name SGLang starts using that is in neither table fails the test.
_KINDS = {
    "kv_manager": "manager",
    "kv_mgr": "manager",
    "kv_receiver": "receiver",
    "receiver": "receiver",
    "kv_sender": "sender",
    "disagg_kv_sender": "sender",
    "sender": "sender",
}
_NOT_REACHED = {
    ("manager", "_ensure_prefill_recompute_executor"): "only for a prefill whose DP rank is unresolved; pdkv's is 0",
    ("manager", "_staging_handler"): "SGLang sets it, with heterogeneous-TP staging (require_staging is False)",
    ("manager", "set_kv_buffer_tensors"): "SGLang asks hasattr first (staging only)",
    ("manager", "deregister_buffer_to_engine"): "SGLang asks hasattr first",
    ("manager", "register_buffer_to_engine"): "SGLang asks hasattr first",
    ("manager", "transfer_infos"): "read only when the manager has _prefetch_staging_reqs (staging)",
    ("manager", "attn_cp_rank"): "filter_kv_indices_for_cp_rank: called by CommonKVSender only",
    ("manager", "attn_cp_size"): "filter_kv_indices_for_cp_rank: called by CommonKVSender only",
    ("manager", "enable_all_cp_ranks_for_transfer"): "read only when the sender supports_host_tensor_indices",
    ("sender", "_early_send_wait_event"): "SGLang sets it, with the overlap schedule",
}


def _sglang_uses():
    """(kind, attribute) -> where, for every attribute access on a backend object's usual
    names in SGLang's queue and scheduler modules."""
    import ast
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("sglang.srt")
    assert spec is not None and spec.submodule_search_locations
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    uses: dict[tuple[str, str], str] = {}
    for path in [*(root / "disaggregation").glob("*.py"), *(root / "managers").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                v = node.value
                base = v.attr if isinstance(v, ast.Attribute) else getattr(v, "id", None)
                if base in _KINDS:
                    uses.setdefault((_KINDS[base], node.attr), f"{path.relative_to(root)}:{node.lineno}")
    return uses


def test_sglang_every_attribute_sglangs_queues_use_is_answered():
    """pdkv's manager (both modes), sender and receiver have every attribute SGLang's own
    decode and prefill queues use on a backend's objects, read from SGLang's source; what
    they do not have is listed with the reason SGLang never asks pdkv's objects for it."""
    uses = _sglang_uses()
    assert len(uses) > 30, "SGLang's source was not read"
    pair = Pair(1, 1)
    try:
        objs = {
            "manager": [pair.pm[0], pair.dm[0]],
            "sender": [PdkvKVSender(pair.pm[0], pair.addr, 5)],
            "receiver": [PdkvKVReceiver(pair.dm[0], pair.addr, 5)],
        }
        missing = {}
        for (kind, attr), where in sorted(uses.items()):
            if (kind, attr) in _NOT_REACHED:
                continue
            lacking = [type(o).__name__ for o in objs[kind] if not hasattr(o, attr)]
            # a prefill-only or decode-only manager attribute: one of the two modes has it
            if lacking and not (kind == "manager" and len(lacking) < 2 and _one_mode(attr)):
                missing[f"{kind}.{attr}"] = where
        assert not missing, f"SGLang uses these; pdkv's objects lack them: {missing}"
        stale = [k for k in _NOT_REACHED if k not in uses]
        assert not stale, f"listed as never reached, but SGLang no longer uses them: {stale}"
        for o in objs["sender"] + objs["receiver"]:
            o.clear()
    finally:
        pair.close()


def _one_mode(attr: str) -> bool:
    return attr in ("prefill_info_table", "try_ensure_parallel_info", "submit_prefill_recompute")


def test_sglang_decode_describes_each_prefill_as_its_queue_reads_it():
    """``DecodePreallocQueue._resolve_prefill_dp_rank`` reads ``prefill_info_table``: after
    ``try_ensure_parallel_info`` it holds the prefill, one DP rank, its TP size and page."""
    pair = Pair(2, 1)
    try:
        m = pair.dm[0]
        assert m.prefill_info_table == {}
        assert m.try_ensure_parallel_info(pair.addr)
        info = m.prefill_info_table[pair.addr]
        assert (info.dp_size, info.attn_tp_size, info.page_size, info.kv_cache_dtype) == (1, 2, PAGE, "bfloat16")
        assert not m.try_ensure_parallel_info("127.0.0.1:1")
        assert "127.0.0.1:1" not in m.prefill_info_table
    finally:
        pair.close()


def test_sglang_a_retracted_request_sglang_asks_prefill_to_recompute_fails_by_name():
    pair = Pair(1, 1)
    try:
        r = PdkvKVReceiver(pair.dm[0], pair.addr, 9)
        r.init(0)
        pair.dm[0].submit_prefill_recompute(r, {"rid": "abc"})
        assert r.poll() == KVPoll.Failed
        with pytest.raises(Exception, match="does not have prefill recompute a retracted request"):
            r.failure_exception()
        assert r.is_abort_release_safe()
        r.clear()
    finally:
        pair.close()


def _spawned_backend(q) -> None:
    """In a fresh interpreter, as SGLang starts its scheduler: its plugins, then the enum."""
    import warnings

    warnings.simplefilter("ignore")
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins import load_plugins

    load_plugins()
    be = utils.TransferBackend("pdkv")
    q.put(utils.get_kv_class(be, utils.KVClassType.MANAGER).__name__)


@pytest.mark.multiproc
def test_sglang_finds_pdkv_in_a_process_it_spawns():
    """SGLang starts its schedulers with ``spawn``: a fresh interpreter, where SGLang's own
    ``load_plugins()`` (what every process it starts calls first) finds pdkv through its
    entry point, and ``TransferBackend("pdkv")`` then names pdkv's manager."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_spawned_backend, args=(q,))
    p.start()
    try:
        assert q.get(timeout=120) == "PdkvKVManager"
    finally:
        p.join(30)
    assert p.exitcode == 0


def _spawned_untested(q) -> None:
    """In a fresh interpreter whose SGLang says it is 9.9.9: SGLang's plugins, then pdkv."""
    import warnings

    warnings.simplefilter("ignore")
    import sglang.version

    sglang.version.__version__ = "9.9.9"
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins import load_plugins

    load_plugins()
    try:
        utils.get_kv_class(utils.TransferBackend("pdkv"), utils.KVClassType.MANAGER)
        q.put("pdkv's classes were given")
    except Exception as exc:
        other = utils.get_kv_class(utils.TransferBackend.FAKE, utils.KVClassType.SENDER).__name__
        q.put(f"{type(exc).__name__}: {exc} | {other}")


@pytest.mark.multiproc
def test_sglang_plugin_never_fails_sglang_and_names_an_untested_version():
    """With an SGLang outside TESTED the plugin still lists pdkv (SGLang starts), and
    choosing it fails in one line naming the version; SGLang's other backends are untouched."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_spawned_untested, args=(q,))
    p.start()
    try:
        got = q.get(timeout=120)
    finally:
        p.join(30)
    assert got.startswith("PdkvError: pdkv's SGLang backend is tested with SGLang 0.5.23; this is 9.9.9"), got
    assert not got.endswith("| PdkvKVSender"), got


def _server_args_for(model, port: int):
    """A real ServerArgs of ``model`` (SGLang's model config reads it); pdkv's settings from
    the environment, as in a server."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(model), device="cpu", skip_tokenizer_init=True, host="127.0.0.1",
        disaggregation_bootstrap_port=port,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sglang_decode_takes_the_models_heads_and_dtype_where_kvargs_leave_them_out(tmp_path):
    """As SGLang fills ``KVArgs`` for an unquantized grouped-query model: the KV dtype is
    ``"auto"`` on both sides, ``total_kv_head_num`` is set at prefill only (decode sets it
    only with staging). Both sides take what is missing from SGLang's model config (2 KV
    heads of 64, bf16), their layouts agree, and a request lands byte for byte."""
    import os

    from sglang_serve import tiny_model

    model = tiny_model(tmp_path / "m")
    os.environ["PDKV_SECRET"] = SECRET.hex()
    boot = PdkvKVBootstrapServer("127.0.0.1", 0)
    pp, dp = Pool(16, 2, False, head_dim=64, seed=3), Pool(16, 2, False, head_dim=64, seed=4)
    pa, da = pp.args(0, 2, False), dp.args(0, 2, False)
    pa.kv_cache_dtype_str = da.kv_cache_dtype_str = "auto"
    del da.total_kv_head_num  # what SGLang's decode leaves unset
    pm = PdkvKVManager(pa, "prefill", _server_args_for(model, boot.port), False)
    dm = PdkvKVManager(da, "decode", _server_args_for(model, boot.port), False)
    try:
        assert pm.pools.layout == dm.pools.layout
        assert (dm.pools.layout.kv_heads, dm.pools.layout.head_dim, dm.pools.layout.dtype) == (2, 64, "bfloat16")
        addr = f"127.0.0.1:{boot.port}"
        s, r = PdkvKVSender(pm, addr, 31), PdkvKVReceiver(dm, addr, 31)
        assert dm.try_ensure_parallel_info(addr)
        r.init(0)
        r.send_metadata(np.array([5, 6], np.int32), 1, None, decode_prefix_len=0, destination=Dest.DEVICE)
        assert _until(s.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
        s.init(2, 1)
        s.send(np.array([1, 2], np.int32), None, num_kv_tokens=2 * PAGE)
        assert _until(r.poll, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success, r._in.error
        for a, b in zip(pp.kv, dp.kv):
            assert np.array_equal(a[[1, 2]], b[[5, 6]])
        s.clear()
        r.clear()
    finally:
        pm.close()
        dm.close()
        boot.close()
