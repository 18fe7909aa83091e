"""The nixl transport: NVIDIA NIXL (UCX underneath) moves the bytes; pdkv keeps the grants.

Decode registers each rank's buffer with its NIXL agent once (DRAM) and answers the hello
with its agent's metadata and each rank's registered region; prefill registers its cache
once (DRAM, or VRAM for a GPU cache) before the hello, which carries its agent's metadata
(size-bounded, validated like every field). Per layer, every request's pieces
(heterogeneous-TP segments included) go as one NIXL WRITE, polled until ``DONE`` (or
``ERR``: the layer's requests fail) within ``timeout_s``; then prefill reports the layer
through pdkv's control plane (``LayerBatch``), the one way decode learns that bytes landed.
Fencing: decode removes a dead or fenced peer's remote agent (its connection and
metadata), so no transfer of it can be started or completed through it; a transfer that
timed out makes the sender break the session, and decode keeps the blocks quarantined
until the peer is fenced, as for shm (docs/TRANSPORTS.md).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .. import _ffi
from ..errors import PdkvTimeoutError, ProtocolError, TransferError
from ..layout import CacheSpec, KVLayout
from ..plan import layer_pieces
from ..protocol import Hello, NixlHello, NixlOffer, NixlRegionDesc, Welcome
from ..rdma import merge_regions
from .base import Peer, ReceiverHost, ReceiverTransport, SenderHost, SenderTransport, WriteItem, report_layer

__all__ = ["NixlSender", "NixlReceiver"]


def _agent_name(side: str) -> str:
    return f"pdkv-{side}-{os.getpid()}-{os.urandom(6).hex()}"


class NixlSender(SenderTransport):
    name = "nixl"
    caches = frozenset({"host", "gpu"})
    auto_rank = None  # only when named (docs/TRANSPORTS.md: auto does not pick it yet)

    @classmethod
    def available(cls) -> bool:
        return _ffi.nixl.available()

    def __init__(self, host: SenderHost, options: Any) -> None:
        super().__init__(host, options)
        spec = host.cache
        self._agent: _ffi.nixl.Agent | None = _ffi.nixl.Agent(_agent_name("prefill"), options.nixl_ucx)
        try:
            self._mem = "DRAM" if spec.device is None else "VRAM"
            self._dev = 0 if spec.device is None else spec.device
            regions = spec.region_ranges()
            self._agent.register([(a, n, self._dev) for a, n in merge_regions(regions)], self._mem)
            self._metadata = self._agent.metadata()
        except BaseException:
            self._agent.close()
            raise
        self._peer = ""
        self._dst_specs: dict[int, CacheSpec] = {}

    @property
    def path(self) -> str:
        return f"nixl ({self._mem} source)"

    def hello_fields(self) -> dict[str, Any]:
        assert self._agent is not None
        return {"nixl": NixlHello(agent=self._agent.name, metadata=self._metadata)}

    def connect(self, welcome: Welcome, layouts: list[KVLayout], deadline: float) -> None:
        assert self._agent is not None
        offer = welcome.nixl
        if offer is None:
            raise ProtocolError("decode chose nixl but sent no nixl section")
        regions = {r.rank: r for r in offer.regions}
        for rank, lay in zip(welcome.ranks, layouts):
            reg = regions.get(rank)
            need = CacheSpec.buffer_bytes(lay, welcome.buffer_blocks)
            if reg is None or reg.length < need:
                raise ProtocolError(
                    f"decode rank {rank}'s NIXL region is missing or smaller than the "
                    f"{need} bytes {welcome.buffer_blocks} blocks need"
                )
            self._dst_specs[rank] = CacheSpec.for_buffer(lay, welcome.buffer_blocks, reg.addr)
        name = self._agent.add_remote(offer.metadata)
        if name != offer.agent:
            raise ProtocolError(f"decode's NIXL metadata names agent {name!r}, its welcome {offer.agent!r}")
        self._peer = name

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        """The layer's pieces, every request's, as one NIXL WRITE; its completion awaited
        (bounded), then the layer reported. A failed or timed-out write fails every
        request of the layer (raised: the session's data thread marks them)."""
        h = self.host
        agent = self._agent
        assert agent is not None
        sb = np.concatenate([w.src for w in work])
        db = np.concatenate([w.dst for w in work])
        plans, total = layer_pieces(h.segments, h.layout, h.dst_layout, h.cache, self._dst_specs, sb, db, layer)
        src = np.concatenate([p[1] for p in plans]).tolist()
        dst = np.concatenate([p[2] for p in plans]).tolist()
        ln = np.concatenate([p[3] for p in plans]).tolist()
        dev = self._dev
        handle = agent.write(
            [(a, n, dev) for a, n in zip(src, ln)], [(a, n, 0) for a, n in zip(dst, ln)], self._peer, self._mem
        )
        deadline = time.monotonic() + h.timeout_s
        try:
            while True:
                st = agent.state(handle)
                if st == "DONE":
                    break
                if st == "ERR":
                    raise TransferError(f"layer {layer}: NIXL write failed (ERR)")
                if time.monotonic() > deadline:
                    # a write that may still land: the session ends, decode fences this peer
                    h.break_session(f"NIXL write of layer {layer} not done within {h.timeout_s}s", abort=True)
                    raise PdkvTimeoutError(f"layer {layer}: NIXL write not done within {h.timeout_s}s")
                time.sleep(20e-6)
        finally:
            try:
                agent.release(handle)
            except TransferError:
                pass
        h.add_bytes(total)
        report_layer(h, layer, work)

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None


class NixlReceiver(ReceiverTransport):
    name = "nixl"

    def __init__(self, host: ReceiverHost) -> None:
        super().__init__(host)
        self._agent: _ffi.nixl.Agent | None = _ffi.nixl.Agent(_agent_name("decode"), host.options.nixl_ucx)
        try:
            # every buffer registered once, and only the buffers: a peer holding this
            # agent's metadata can write anywhere in them (docs/SECURITY.md)
            self._regions = [
                NixlRegionDesc(rank=lay.tp_rank, addr=b.address, length=b.size)
                for lay, b in zip(host.layouts, host.buffers)
            ]
            self._agent.register([(r.addr, r.length, 0) for r in self._regions], "DRAM")
            self._metadata = self._agent.metadata()
        except BaseException:
            self._agent.close()
            raise
        self._remote: dict[bytes, str] = {}  # peer ident -> its agent

    def refuses(self, hello: Hello) -> str | None:
        return None if hello.nixl is not None else "nixl: the hello carries no NIXL agent"

    def open_session(self, peer: Peer, hello: Hello) -> dict[str, Any]:
        assert hello.nixl is not None and self._agent is not None
        name = self._agent.add_remote(hello.nixl.metadata)  # TransferError: refused
        if name != hello.nixl.agent:
            self._agent.remove_remote(name)
            raise ProtocolError(f"the hello's NIXL metadata names agent {name!r}, not {hello.nixl.agent!r}")
        self._remote[peer.ident] = name
        return {"nixl": NixlOffer(agent=self._agent.name, metadata=self._metadata, regions=self._regions)}

    def fence(self, peer: Peer) -> None:
        name = self._remote.pop(peer.ident, None)
        if name is not None and self._agent is not None:
            try:
                self._agent.remove_remote(name)
            except TransferError:
                pass

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None
