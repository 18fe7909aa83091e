"""The rdma transport (pyverbs): prefill posts one-sided RDMA writes into decode's buffers.

Decode registers each buffer once and sends address, length and rkey with its queue
pair's record in the welcome; prefill registers its host cache and makes a queue pair
before the hello (which carries its record), posts writes coalesced over contiguous runs,
checks every completion, then reports each request's layer (``LayerDone``). Dropping a
dead peer's queue pair is its fence. Not run on RDMA hardware (docs/TRANSPORTS.md); tested
against a simulated verbs layer. The verbs work itself is in :mod:`pdkv.rdma`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .. import _ffi
from ..errors import PdkvError, ProtocolError, RdmaError
from ..layout import CacheSpec, KVLayout
from ..plan import layer_pieces
from ..protocol import Hello, LayerDone, RdmaEndpointDesc, RdmaOffer, Welcome, to_plain
from ..rdma import EndpointInfo, RdmaTarget, RdmaWriter, RemoteRegion
from .base import Peer, ReceiverHost, ReceiverTransport, SenderHost, SenderTransport, WriteItem

__all__ = ["RdmaSender", "RdmaReceiver"]


class RdmaSender(SenderTransport):
    name = "rdma"
    caches = frozenset({"host"})
    auto_rank = 30

    @classmethod
    def refuses(cls, cache: CacheSpec) -> str | None:
        if cache.device is not None:
            return (
                "the rdma transport writes from host caches (GPUDirect RDMA is not supported); "
                "stage GPU caches or use shm"
            )
        return None

    @classmethod
    def available(cls) -> bool:
        return bool(_ffi.verbs.rdma_devices())

    def __init__(self, host: SenderHost, options: Any) -> None:
        super().__init__(host, options)
        # the cache registered (one region per contiguous range of its layers and tensors)
        # and a queue pair made before the hello, which carries its record;
        # RdmaUnavailableError here says what is missing
        spec, lay = host.cache, host.layout
        self._writer: RdmaWriter | None = RdmaWriter(
            [
                (b, st * spec.num_blocks)
                for b, st in (
                    spec.region(layer, t) for layer in range(lay.total_layers) for t in range(len(lay.tensors))
                )
            ],
            device=options.rdma_device,
            timeout_s=host.timeout_s,
        )
        self._regions: dict[int, RemoteRegion] = {}
        self._dst_specs: dict[int, CacheSpec] = {}

    def hello_fields(self) -> dict[str, Any]:
        assert self._writer is not None
        return {"rdma": msgspec.convert(self._writer.local_info().to_dict(), RdmaEndpointDesc)}

    def connect(self, welcome: Welcome, layouts: list[KVLayout], deadline: float) -> None:
        assert self._writer is not None
        if welcome.rdma is None:
            raise ProtocolError("decode chose rdma but sent no rdma section")
        try:
            ep = EndpointInfo.from_dict(to_plain(welcome.rdma.endpoint))
            regions = {r.rank: RemoteRegion.from_dict(to_plain(r)) for r in welcome.rdma.regions}
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ProtocolError(f"bad rdma section in the welcome: {exc}") from None
        for rank, lay in zip(welcome.ranks, layouts):
            reg = regions.get(rank)
            need = CacheSpec.buffer_bytes(lay, welcome.buffer_blocks)
            if reg is None or reg.length < need:
                raise ProtocolError(
                    f"decode rank {rank}'s RDMA region is missing or smaller than the "
                    f"{need} bytes {welcome.buffer_blocks} blocks need"
                )
            self._regions[rank] = reg
            self._dst_specs[rank] = CacheSpec.for_buffer(lay, welcome.buffer_blocks, reg.addr)
        self._writer.connect(ep)

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        """One request at a time: its writes posted, their completions awaited, then its
        LayerDone (decode cannot see one-sided writes land; this message is how it learns)."""
        h, writer = self.host, self._writer
        assert writer is not None
        for w in work:
            plans, total = layer_pieces(
                h.segments, h.layout, h.dst_layout, h.cache, self._dst_specs, w.src, w.dst, layer
            )
            try:
                for seg, src, dst, ln in plans:
                    writer.write(w.request_id, src.tolist(), dst.tolist(), ln.tolist(), self._regions[seg.dst_rank])
            except PdkvError as exc:
                if isinstance(exc, RdmaError):
                    # a failed completion leaves the queue pair in the error state: every later
                    # write would fail too, so the session is over (decode is told to drop
                    # every request of it at once rather than wait for their leases)
                    h.fail_request(w.request_id, f"layer {layer}: {exc}")
                    h.break_session(f"RDMA queue pair failed: {exc}", abort=True)
                    return
                h.fail_request(w.request_id, f"layer {layer}: {exc}")
                continue
            h.add_bytes(total)
            h.post(LayerDone(w.request_id, w.grant.token, [layer], len(w.src)))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class RdmaReceiver(ReceiverTransport):
    name = "rdma"

    def __init__(self, host: ReceiverHost) -> None:
        super().__init__(host)
        # every buffer registered once for remote writes; raises RdmaUnavailableError
        # (saying what is missing) on a host without pyverbs or an RDMA device
        self._target = RdmaTarget(
            [(lay.tp_rank, b.address, b.size) for lay, b in zip(host.layouts, host.buffers)],
            device=host.options.rdma_device,
        )
        self._qpn: dict[bytes, int] = {}  # peer ident -> its queue pair

    def refuses(self, hello: Hello) -> str | None:
        return None if hello.rdma is not None else "rdma: the hello carries no queue pair record"

    def open_session(self, peer: Peer, hello: Hello) -> dict[str, Any]:
        assert hello.rdma is not None
        ep = self._target.accept(EndpointInfo.from_dict(msgspec.structs.asdict(hello.rdma)))  # PdkvError: refused
        self._qpn[peer.ident] = ep.qpn
        offer = {
            "endpoint": ep.to_dict(),
            "regions": [dict(rank=r, **reg.to_dict()) for r, reg in self._target.regions.items()],
        }
        return {"rdma": msgspec.convert(offer, RdmaOffer)}

    def fence(self, peer: Peer) -> None:
        qpn = self._qpn.pop(peer.ident, 0)
        if qpn:
            self._target.drop(qpn)  # no write of this peer lands after this

    def close(self) -> None:
        self._target.close()
