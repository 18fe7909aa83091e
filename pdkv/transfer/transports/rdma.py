"""The rdma transport (pyverbs): prefill posts one-sided RDMA writes into decode's buffers.

Decode registers each buffer once and sends address, length and rkey with its queue
pair's record in the welcome; prefill registers its host cache and makes a queue pair
before the hello (which carries its record), posts writes coalesced over contiguous runs,
checks every completion, then reports each request's layer (``LayerDone``). Dropping a
dead peer's queue pair is its fence. Not run on RDMA hardware (docs/TRANSPORTS.md); tested
against a simulated verbs layer. The verbs work itself is in :mod:`pdkv.transfer.rdma_qp`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from ... import _ffi
from ...errors import PdkvError, ProtocolError, RdmaError, RdmaUnavailableError
from ...layout import CacheSpec, KVLayout
from ...plan import layer_pieces
from ...protocol import Hello, LayerDone, RdmaEndpointDesc, RdmaOffer, Welcome, to_plain
from .base import Peer, ReceiverHost, ReceiverTransport, SenderHost, SenderTransport, WriteItem, region_specs
from .rdma_qp import EndpointInfo, RdmaTarget, RdmaWriter, RemoteRegion
from .staging import StagedSends, make_staged, stage_layer

_log = logging.getLogger(__name__)

__all__ = ["RdmaSender", "RdmaReceiver"]


class RdmaSender(SenderTransport):
    """Writes from a host cache's own registered memory; from a GPU cache, GPUDirect (the
    cache's allocations registered with the NIC once: dma-buf, else peer memory) where the
    host supports it and ``gpudirect`` allows, else staged: each layer gathered into a
    pinned ring registered once (:class:`~.staging.StagedSends`) and written from there."""

    name = "rdma"
    caches = frozenset({"host", "gpu"})
    auto_rank = 30

    @classmethod
    def available(cls) -> bool:
        return bool(_ffi.verbs.rdma_devices())

    def __init__(self, host: SenderHost, options: Any) -> None:
        super().__init__(host, options)
        # the source registered and a queue pair made before the hello, which carries its
        # record; RdmaUnavailableError here says what is missing
        spec = host.cache
        regions = spec.region_ranges()
        self.gpudirect_refused = ""  # why a GPU cache is staged instead
        self._staged: StagedSends | None = None
        self._stage = options.staging == "always"
        kw: dict[str, Any] = dict(
            device=options.rdma_device,
            port=options.rdma_port,
            gid_index=options.rdma_gid_index,
            gpu=spec.device,
            timeout_s=host.timeout_s,
        )
        if spec.device is None or self._stage:
            self._writer: RdmaWriter | None = RdmaWriter([] if self._stage else regions, **kw)
        elif options.gpudirect == "off":
            self._stage = True
            self.gpudirect_refused = "gpudirect='off'"
            self._writer = RdmaWriter([], **kw)
        else:
            try:
                self._writer = RdmaWriter([], gpu_regions=regions, **kw)
            except RdmaUnavailableError:
                raise
            except PdkvError as exc:
                if options.gpudirect == "require":
                    raise RdmaError(f"gpudirect='require': {exc}") from None
                self._stage = True
                self.gpudirect_refused = str(exc)
                _log.warning("GPUDirect RDMA unavailable, staging GPU cache layers: %s", exc)
                self._writer = RdmaWriter([], **kw)
        self._regions: dict[int, RemoteRegion] = {}
        self._dst_specs: dict[int, CacheSpec] = {}

    @property
    def path(self) -> str:
        if self._staged is not None:
            return f"rdma staged ({self._staged.strategy} gather)"
        if self._writer is not None and self._writer.gpudirect:
            return f"rdma GPUDirect ({self._writer.gpudirect})"
        return "rdma"

    @property
    def staging(self) -> StagedSends | None:
        return self._staged

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
        self._dst_specs.update(region_specs(welcome, layouts, regions, "RDMA"))
        self._regions.update({rank: regions[rank] for rank in self._dst_specs})
        if self._stage:
            # one queue pair: one lane writes, in order; the ring is registered once
            self._staged = make_staged(self.host, self.options, lanes=1)
            self._writer.add_region(self._staged.ring.address, self._staged.ring.nbytes)
        self._writer.connect(ep)

    def after_writes(self, fn: Callable[[], None]) -> None:
        if self._staged is None:
            fn()
        else:
            self._staged.after(fn)

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        """One request at a time: its writes posted, their completions awaited, then its
        LayerDone (decode cannot see one-sided writes land; this message is how it learns)."""
        if self._staged is not None:
            stage_layer(self._staged, self.host, self._dst_specs, layer, work, self._writes_of, self._layer_done)
            return
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
                self._write_failed(layer, w.request_id, exc)
                if isinstance(exc, RdmaError):
                    return
                continue
            h.add_bytes(total)
            h.post(LayerDone(w.request_id, w.grant.token, [layer], len(w.src)))

    def _write_failed(self, layer: int, rid: str, exc: PdkvError) -> None:
        self.host.fail_request(rid, f"layer {layer}: {exc}")
        if isinstance(exc, RdmaError):
            # a failed completion leaves the queue pair in the error state: every later
            # write would fail too, so the session is over (decode is told to drop every
            # request of it at once rather than wait for their leases)
            self.host.break_session(f"RDMA queue pair failed: {exc}", abort=True)

    def _writes_of(self, dst: Any, ln: Any, ranks: Any, total: int) -> Callable[[memoryview], None]:
        """The chunk's RDMA writes from its slot, per decode rank's region."""
        writer = self._writer
        assert writer is not None

        def send(view: memoryview) -> None:
            base = _ffi.libc.buffer_address(view)
            local = base + np.concatenate(([0], np.cumsum(ln)[:-1]))
            try:
                for r in np.unique(ranks).tolist():
                    m = ranks == r
                    writer.write("staged", local[m].tolist(), dst[m].tolist(), ln[m].tolist(), self._regions[r])
            except RdmaError as exc:
                self.host.break_session(f"RDMA queue pair failed: {exc}", abort=True)
                raise
            self.host.add_bytes(total)

        return send

    def _layer_done(self, layer: int, w: WriteItem) -> None:
        self.host.post(LayerDone(w.request_id, w.grant.token, [layer], len(w.src)))

    def close(self) -> None:
        if self._staged is not None:
            self._staged.close(self.host.timeout_s)
            self._staged = None
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
            port=host.options.rdma_port,
            gid_index=host.options.rdma_gid_index,
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
