"""A transport plugs in through the registry alone: a test transport defined here (a
same-host copy through Python memoryviews, reporting each layer like shm) carries requests
end to end, byte-verified, without touching pdkv's sessions; and the registry refuses what
it cannot serve by name."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_transfer import Decode, expected_block, prefill_cache

from pdkv import CacheSpec, KVLayout, PrefillSender, SharedBuffer, transfer
from pdkv.errors import LayoutError
from pdkv.plan import layer_pieces
from pdkv.protocol import LayerBatch
from pdkv.transfer import ReceiverTransport, SenderTransport


class CopySender(SenderTransport):
    """Opens decode's buffers by name and copies each piece with a memoryview assignment."""

    name = "pycopy"
    caches = frozenset({"host"})

    def __init__(self, host, options):
        super().__init__(host, options)
        self.bufs, self.specs = {}, {}

    def connect(self, welcome, layouts, deadline):
        for rank, name, lay in zip(welcome.ranks, welcome.shm_names, layouts):
            self.bufs[rank] = b = SharedBuffer.open(name, pin="never")
            self.specs[rank] = CacheSpec.for_buffer(lay, welcome.buffer_blocks, b.address)

    def write_layer(self, layer, work):
        h = self.host
        sb = np.concatenate([w.src for w in work])
        db = np.concatenate([w.dst for w in work])
        plans, total = layer_pieces(h.segments, h.layout, h.dst_layout, h.cache, self.specs, sb, db, layer)
        for seg, src, dst, ln in plans:
            buf = self.bufs[seg.dst_rank]
            for s, d, n in zip(src.tolist(), dst.tolist(), ln.tolist()):
                o = d - buf.address
                assert 0 <= o and o + n <= buf.size
                buf.buf[o : o + n] = memoryview((ctypes.c_char * n).from_address(s)).cast("B")
        h.add_bytes(total)
        h.post(LayerBatch(layer, [(w.request_id, w.grant.token, len(w.src)) for w in work]))

    def close(self):
        for b in self.bufs.values():
            b.close()
        self.bufs.clear()


class CopyReceiver(ReceiverTransport):
    name = "pycopy"
    same_host = True

    def open_session(self, peer, hello):
        return {"shm_names": [b.name for b in self.host.buffers]}


@pytest.fixture
def pycopy():
    transfer.register(CopySender, CopyReceiver)
    try:
        yield
    finally:
        transfer.unregister("pycopy")


@pytest.mark.multiproc
def test_a_registered_transport_carries_requests_byte_for_byte(pycopy, no_leaks):
    dec = Decode(D=2, nb=32, transports=("pycopy",))
    try:
        lays, arrs, specs = [], [], []
        for r in range(2):
            lay, arr, spec = prefill_cache(2, r, nb=32)
            lays.append(lay)
            arrs.append(arr)  # the caches' memory, alive while they are sent
            specs.append(spec)
        txs = [
            PrefillSender(lay, spec, dec.rx.control_address, transport="pycopy", instance="p", timeout_s=5)
            for lay, spec in zip(lays, specs)
        ]
        try:
            assert {tx.transport for tx in txs} == {"pycopy"}
            src = [5, 6, 7, 20, 3]
            grants = [tx.reserve("r", len(src) * lays[0].tokens_per_block) for tx in txs]
            for tx in txs:
                for layer in range(lays[0].total_layers):
                    tx.send_layer(layer, [("r", src)])
                tx.finish("r")
            outs = [tx.wait_outcome("r", 10) for tx in txs]
            assert all(o.ok for o in outs), outs
            g = grants[0]
            for rank in range(2):
                for layer in range(lays[0].total_layers):
                    for t in range(2):
                        for gi in range(len(src)):
                            want = expected_block(lays, specs, src, dec.lays[rank], layer, t, gi)
                            assert dec.block(rank, layer, t, g.blocks[gi]) == want
            assert txs[0].stats["bytes"] > 0
        finally:
            for tx in txs:
                tx.close()
    finally:
        dec.close()


def test_auto_offers_a_registered_transport_by_its_rank(pycopy):
    lay = KVLayout(num_layers=2, kv_heads=2, head_dim=8, tokens_per_block=4)
    spec = CacheSpec.for_buffer(lay, 4, 4096)
    assert "pycopy" not in transfer.auto_offer(spec)  # no auto_rank: offered only when named
    CopySender.auto_rank = 5
    try:
        assert transfer.auto_offer(spec)[0] == "pycopy"
        assert transfer.names()[0] == "pycopy"
    finally:
        CopySender.auto_rank = None


def test_the_registry_refuses_by_name():
    from pdkv.transfer.transports.tcp import TcpReceiver, TcpSender

    with pytest.raises(ValueError, match="already registered"):
        transfer.register(TcpSender, TcpReceiver)

    class Odd(SenderTransport):
        name = "odd"

    class Other(ReceiverTransport):
        name = "other"

    with pytest.raises(ValueError, match="same non-empty name"):
        transfer.register(Odd, Other)
    with pytest.raises(ValueError, match="'odd' is not registered"):
        transfer.transports.base.get("odd")
    with pytest.raises(ValueError, match="no transport 'odd'"):
        transfer.unregister("odd")
    assert transfer.names() == ["cuda_ipc", "shm", "rdma", "nixl", "tcp"]  # by auto_rank


def test_sessions_name_an_unknown_or_unfit_transport(no_leaks):
    from pdkv import BlockPool, DecodeReceiver, DecodeScheduler, SchedulerOptions

    lay, arr, spec = prefill_cache(1, 0)
    with pytest.raises(ValueError, match="'nope' is not registered .*registered: cuda_ipc, shm, rdma, nixl, tcp"):
        PrefillSender(lay, spec, "tcp://127.0.0.1:1", transport="nope")
    with pytest.raises(LayoutError, match="cuda_ipc transport writes from a GPU cache"):
        PrefillSender(lay, spec, "tcp://127.0.0.1:1", transport="cuda_ipc")
    with pytest.raises(TypeError, match="unexpected keyword argument.*strems"):
        PrefillSender(lay, spec, "tcp://127.0.0.1:1", strems=2)
    sched = DecodeScheduler(
        num_layers=lay.total_layers, gpu=BlockPool(4), options=SchedulerOptions(direct_to_gpu=False)
    )
    buf = SharedBuffer.create(CacheSpec.buffer_bytes(lay, 4))
    try:
        with pytest.raises(ValueError, match="transport 'nope' is not served by DecodeReceiver"):
            DecodeReceiver(sched, [lay], [buf], 4, transports=("shm", "nope"))
        other = DecodeScheduler(
            num_layers=lay.total_layers + 1, gpu=BlockPool(4), options=SchedulerOptions(direct_to_gpu=False)
        )
        with pytest.raises(ValueError, match=r"counts 5 layers a request, the layout has 4.*DecodeScheduler\(layout="):
            DecodeReceiver(other, [lay], [buf], 4, transports=("shm",))
    finally:
        buf.close()
        buf.unlink()
