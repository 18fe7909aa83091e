"""The nixl transport: NVIDIA NIXL (UCX underneath) moves the bytes; pdkv keeps the grants.

Decode registers each rank's buffer with its NIXL agent once (DRAM) and answers the hello
with its agent's metadata and each rank's registered region; prefill registers its cache
once (DRAM, or VRAM for a GPU cache) before the hello, which carries its agent's metadata
(size-bounded, validated like every field). Once connected, prefill prepares two NIXL
descriptor lists for the session (``prep_xfer_dlist``): every piece of every block of its
cache, and every piece of every block of decode's buffers, one strided row per (layer,
segment, piece); each layer's write then names pieces by index (``make_prepped_xfer``),
so no request builds or registers descriptors again. Caches whose lists would pass
:data:`PREPARED_MAX` descriptors (token-major heterogeneous TP of large caches) and the
staged GPU path build each write's list instead. Per layer, every request's pieces
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
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import _ffi
from ...buffer.region import HostRegion
from ...errors import PdkvTimeoutError, ProtocolError, TransferError
from ...layout import CacheSpec, KVLayout
from ...plan import layer_pieces
from ...protocol import Hello, NixlHello, NixlOffer, NixlRegionDesc, Welcome
from .base import (
    Peer,
    ReceiverHost,
    ReceiverTransport,
    SenderHost,
    SenderTransport,
    WriteItem,
    region_specs,
    report_layer,
)
from .rdma_qp import merge_regions
from .staging import StagedSends, make_staged, stage_layer

__all__ = ["NixlSender", "NixlReceiver", "PREPARED_MAX"]

#: the most descriptors a session's prepared list may hold on either side (NIXL keeps
#: each one in memory, some tens of bytes): above it each write builds its own list
PREPARED_MAX = 1 << 21


def _agent_name(side: str) -> str:
    return f"pdkv-{side}-{os.getpid()}-{os.urandom(6).hex()}"


class NixlSender(SenderTransport):
    """Writes from a host cache's own registered memory (DRAM); from a GPU cache either
    NIXL's own VRAM source (the cache's allocations registered with NIXL once) or staged
    (each layer gathered by the swap engine into a pinned ring registered once as DRAM, one
    NIXL WRITE per slot): ``gpudirect='require'`` takes the VRAM source, ``'off'`` (or
    ``staging='always'``) the staged path, ``'auto'`` the VRAM source only on a host with an
    RDMA device (where UCX writes GPU memory to the NIC directly) and staged otherwise: UCX
    without one copies GPU memory through its own bounce buffers, measured 7-10x slower than
    the staged path on the H200 host (docs/PERF.md, tools/bench_nixl.py --gpu)."""

    name = "nixl"
    caches = frozenset({"host", "gpu"})
    auto_rank = 35  # after pdkv's rdma, before tcp; only on a host with an RDMA device

    @classmethod
    def available(cls) -> bool:
        """``auto`` offers nixl only where NIXL is installed and the host has an RDMA
        device: without one UCX moves the bytes over tcp, measured 0.5-0.75x pdkv's own
        tcp on the same host (docs/PERF.md, tools/bench_nixl.py)."""
        return bool(_ffi.verbs.rdma_devices()) and _ffi.nixl.available()

    def __init__(self, host: SenderHost, options: Any) -> None:
        super().__init__(host, options)
        spec = host.cache
        self._stage = gpu_source_staged(spec.device, options)
        self._agent: _ffi.nixl.Agent | None = _ffi.nixl.Agent(_agent_name("prefill"), options.nixl_ucx)
        try:
            self._mem = "DRAM" if spec.device is None or self._stage else "VRAM"
            self._dev = 0 if spec.device is None or self._stage else spec.device
            if not self._stage:  # the staged path registers its ring once it has one
                regions = spec.region_ranges()
                self._agent.register([(a, n, self._dev) for a, n in merge_regions(regions)], self._mem)
            self._metadata = self._agent.metadata()
        except BaseException:
            self._agent.close()
            raise
        self._peer = ""
        self._dst_specs: dict[int, CacheSpec] = {}
        self._staged: StagedSends | None = None
        self._prepared: PreparedPieces | None = None

    @property
    def path(self) -> str:
        if self._staged is not None:
            return f"nixl staged ({self._staged.strategy} gather)"
        return f"nixl ({self._mem} source{', prepared lists' if self._prepared is not None else ''})"

    @property
    def staging(self) -> StagedSends | None:
        return self._staged

    def hello_fields(self) -> dict[str, Any]:
        assert self._agent is not None
        return {"nixl": NixlHello(agent=self._agent.name, metadata=self._metadata)}

    def connect(self, welcome: Welcome, layouts: list[KVLayout], deadline: float) -> None:
        assert self._agent is not None
        offer = welcome.nixl
        if offer is None:
            raise ProtocolError("decode chose nixl but sent no nixl section")
        self._dst_specs.update(region_specs(welcome, layouts, {r.rank: r for r in offer.regions}, "NIXL"))
        name = self._agent.add_remote(offer.metadata)
        if name != offer.agent:
            raise ProtocolError(f"decode's NIXL metadata names agent {name!r}, its welcome {offer.agent!r}")
        self._peer = name
        if self._stage:
            # one lane: the slots are written in order; the ring registered once (DRAM)
            self._staged = make_staged(self.host, self.options, lanes=1)
            self._agent.register([(self._staged.ring.address, self._staged.ring.nbytes, 0)], "DRAM")
        elif self.host.segments:  # none: a rank whose heads another sends (MLA) writes nothing
            self._prepared = PreparedPieces.build(
                self._agent, self._peer, self.host.segments, self.host.cache, self._dst_specs, self._dev, self._mem
            )

    def after_writes(self, fn: Callable[[], None]) -> None:
        if self._staged is None:
            fn()
        else:
            self._staged.after(fn)

    def write_layer(self, layer: int, work: list[WriteItem]) -> None:
        """The layer's pieces, every request's, as one NIXL WRITE (staged: one per slot);
        its completion awaited (bounded), then the layer reported. A failed or timed-out
        write fails every request of the layer (raised: the session's data thread marks
        them; staged: the chunk's requests fail)."""
        h = self.host
        if self._staged is not None:
            stage_layer(self._staged, h, self._dst_specs, layer, work, self._writes_of, self._report)
            return
        sb = np.concatenate([w.src for w in work])
        db = np.concatenate([w.dst for w in work])
        agent = self._agent
        assert agent is not None
        if self._prepared is not None:
            p = self._prepared
            li, ri = p.indices(layer, sb, db)
            self._await(f"layer {layer}", agent.write_prepared(p.local, li, p.remote, ri))
            total = int(sb.size) * p.block_bytes
        else:
            plans, total = layer_pieces(h.segments, h.layout, h.dst_layout, h.cache, self._dst_specs, sb, db, layer)
            src = np.concatenate([p[1] for p in plans])
            dst = np.concatenate([p[2] for p in plans])
            ln = np.concatenate([p[3] for p in plans])
            self._write(f"layer {layer}", src, dst, ln, self._dev, self._mem)
        h.add_bytes(total)
        report_layer(h, layer, work)

    def _write(self, what: str, src: Any, dst: Any, ln: Any, dev: int, mem: str) -> None:
        """One NIXL WRITE of ``src[i]`` into decode's ``dst[i]`` (``ln[i]`` bytes), awaited."""
        assert self._agent is not None
        self._await(what, self._agent.write(_descs(src, ln, dev), _descs(dst, ln, 0), self._peer, mem))

    def _await(self, what: str, handle: Any) -> None:
        """Poll a started WRITE to DONE within the timeout, then release it: ERR raises
        TransferError; a timeout breaks the session (the write may still land: decode
        fences this peer) and raises PdkvTimeoutError."""
        h, agent = self.host, self._agent
        assert agent is not None
        deadline = time.monotonic() + h.timeout_s
        try:
            while True:
                st = agent.state(handle)
                if st == "DONE":
                    return
                if st == "ERR":
                    raise TransferError(f"{what}: NIXL write failed (ERR)")
                if time.monotonic() > deadline:
                    h.break_session(f"NIXL write of {what} not done within {h.timeout_s}s", abort=True)
                    raise PdkvTimeoutError(f"{what}: NIXL write not done within {h.timeout_s}s")
                time.sleep(20e-6)
        finally:
            try:
                agent.release(handle)
            except TransferError:
                pass

    def _writes_of(self, dst: Any, ln: Any, ranks: Any, total: int) -> Callable[[memoryview], None]:
        """The chunk's NIXL WRITE from its slot (every decode rank's pieces at once: all
        of decode's buffers are in its one agent)."""

        def send(view: memoryview) -> None:
            base = _ffi.libc.buffer_address(view)
            local = base + np.concatenate(([0], np.cumsum(ln)[:-1]))
            self._write("a staged chunk", local, dst, ln, 0, "DRAM")
            self.host.add_bytes(total)

        return send

    def _report(self, layer: int, w: WriteItem) -> None:
        report_layer(self.host, layer, [w])

    def close(self) -> None:
        if self._staged is not None:
            self._staged.close(self.host.timeout_s)
            self._staged = None
        self._prepared = None  # its handles hold NIXL's agent (and its UCX worker) alive
        if self._agent is not None:
            self._agent.close()
            self._agent = None


class PreparedPieces:
    """A session's two prepared NIXL lists: ``local``, every piece of every block of the
    prefill cache, and ``remote``, every piece of every block of decode's buffers, one
    strided row per (layer, segment, piece of the segment) on each side, so that piece
    ``c`` of block ``b`` of segment ``k`` in ``layer`` is descriptor
    ``start[layer][k] + c * blocks + b`` of its list."""

    def __init__(self, local: Any, remote: Any, lstart: Any, rstart: Any, segs: Any, nsrc: int, ndst: Any) -> None:
        self.local, self.remote = local, remote
        self._lstart, self._rstart = lstart, rstart  # [layer, segment] -> first descriptor
        self._counts = [int(g.count) for g in segs]
        self._nsrc, self._ndst = nsrc, ndst  # blocks of the cache; of each segment's buffer
        self.block_bytes = sum(int(g.length) * int(g.count) for g in segs)  # one block, all segments

    @staticmethod
    def rows(segs: Any, specs: Any, src: bool, layers: int, dev: int) -> tuple[np.ndarray, np.ndarray]:
        """The Nx5 strided rows of segment ``k``'s side in ``specs[k]`` (its source side,
        or with ``src`` false its destination side) for every layer and segment, and
        ``start[layer, k]``."""
        rows, start, at = [], np.zeros((layers, len(segs)), dtype=np.int64), 0
        for layer in range(layers):
            for k, (g, spec) in enumerate(zip(segs, specs)):
                base, stride = spec.region(layer, g.tensor)
                off, step = (g.src_offset, g.src_stride) if src else (g.dst_offset, g.dst_stride)
                start[layer, k] = at
                for c in range(g.count):
                    rows.append((base + off + c * step, g.length, dev, stride, spec.num_blocks))
                at += g.count * spec.num_blocks
        return np.asarray(rows, dtype=np.uint64).reshape(-1, 5), start

    @classmethod
    def build(
        cls, agent: Any, peer: str, segs: Any, src: CacheSpec, dsts: dict[int, CacheSpec], dev: int, mem: str
    ) -> PreparedPieces | None:
        """Both lists prepared, or None when either would pass :data:`PREPARED_MAX`."""
        layers = src.layout.total_layers
        per_block = sum(int(g.count) for g in segs)
        ndst = [dsts[g.dst_rank].num_blocks for g in segs]
        remote_n = layers * sum(int(g.count) * n for g, n in zip(segs, ndst))
        if max(layers * per_block * src.num_blocks, remote_n) > PREPARED_MAX:
            return None
        lrows, lstart = cls.rows(segs, [src] * len(segs), True, layers, dev)
        rrows, rstart = cls.rows(segs, [dsts[g.dst_rank] for g in segs], False, layers, 0)
        local = agent.prepare(lrows, mem)
        remote = agent.prepare(rrows, "DRAM", peer)
        return cls(local, remote, lstart, rstart, segs, src.num_blocks, ndst)

    def indices(self, layer: int, sb: np.ndarray, db: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int32 indices into ``local`` and ``remote`` of every piece of ``layer`` from
        cache blocks ``sb[i]`` into buffer blocks ``db[i]``: segment by segment, block
        by block, piece by piece (the order :func:`~pdkv.plan.layer_pieces` writes)."""
        li, ri = [], []
        for k, count in enumerate(self._counts):
            c = np.arange(count, dtype=np.int64)[None, :]
            li.append((self._lstart[layer, k] + c * self._nsrc + sb[:, None]).ravel())
            ri.append((self._rstart[layer, k] + c * self._ndst[k] + db[:, None]).ravel())
        return np.concatenate(li).astype(np.int32), np.concatenate(ri).astype(np.int32)


def gpu_source_staged(device: int | None, options: Any) -> bool:
    """Whether a cache on ``device`` is sent through the staging ring rather than
    registered with NIXL as VRAM (see :class:`NixlSender`); a host cache only with
    ``staging='always'`` (the host stand-in tests use)."""
    if options.staging == "always":
        return True
    if device is None:
        return False
    if options.gpudirect == "off":
        return True
    if options.gpudirect == "require":
        return False
    return not _ffi.verbs.rdma_devices()


def _descs(addr: Any, ln: Any, dev: int) -> np.ndarray:
    """An Nx3 ``(address, length, device)`` array, as NIXL takes descriptor lists."""
    out = np.empty((len(ln), 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = ln
    out[:, 2] = dev
    return out


class NixlReceiver(ReceiverTransport):
    name = "nixl"
    engine_memory = True  # an engine's host pages: registered range by range, addressed by cells

    def __init__(self, host: ReceiverHost) -> None:
        super().__init__(host)
        self._agent: _ffi.nixl.Agent | None = _ffi.nixl.Agent(_agent_name("decode"), host.options.nixl_ucx)
        try:
            # every buffer registered once, and only the buffers: a peer holding this
            # agent's metadata can write anywhere in them (docs/SECURITY.md). An engine's
            # own pages (HostRegion): only the ranges its cells cover, never what lies
            # between them, and the cells travel so that prefill addresses the pages
            self._regions, ranges = [], []
            for lay, b in zip(host.layouts, host.buffers):
                if isinstance(b, HostRegion):
                    cells = [
                        b.spec.region(layer, t) for layer in range(lay.total_layers) for t in range(len(lay.tensors))
                    ]
                    self._regions.append(NixlRegionDesc(rank=lay.tp_rank, addr=b.address, length=b.size, cells=cells))
                    ranges += merge_regions(b.spec.region_ranges())
                else:
                    self._regions.append(NixlRegionDesc(rank=lay.tp_rank, addr=b.address, length=b.size))
                    ranges.append((b.address, b.size))
            self._agent.register([(a, n, 0) for a, n in ranges], "DRAM")
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
