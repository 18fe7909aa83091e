"""Options of the two control sessions: :class:`ReceiverOptions` and :class:`SenderOptions`.

Each is a frozen dataclass checked when made (ValueError naming the field). The sessions
take one as ``options=`` and also the same names as keywords, which replace its fields.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...layout import CacheSpec

__all__ = ["ReceiverOptions", "SenderOptions", "default_copy_threads", "default_streams", "merge_options"]


def _positive(name: str, v: object) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
        raise ValueError(f"{name}={v!r} must be a positive number")


def _count(name: str, n: object, lo: int = 1, hi: int | None = None) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < lo or (hi is not None and n > hi):
        raise ValueError(
            f"{name}={n!r} must be " + (f"an integer in {lo}..{hi}" if hi is not None else "a positive integer")
        )


def _rdma_port(port: object, gid_index: object) -> None:
    _count("rdma_port", port, 1, 255)
    if gid_index is not None:
        _count("rdma_gid_index", gid_index, 0, 65535)


def _secret(v: object) -> None:
    if v is not None and not isinstance(v, bytes):
        raise ValueError("secret must be bytes (>= 16 of them) or None")


@dataclass(frozen=True)
class ReceiverOptions:
    """How a :class:`~pdkv.transfer.DecodeReceiver` serves.

    control:
        ZeroMQ endpoint to bind, e.g. ``tcp://127.0.0.1:0`` (port chosen) or ``ipc://...``.
    data_host:
        Address of the TCP data listener (port chosen by the kernel).
    secret:
        Shared secret (>= 16 bytes); peers without it are refused.
    transports:
        Transports served (registered names), in order of preference.
    peer_timeout_s:
        A prefill peer silent this long is considered dead and fenced: its data path is
        closed before its blocks are released. Counted in time decode's control loop ran:
        a stall of the loop itself (the host not scheduling it, over 1 s) adds nothing.
    io_timeout_s:
        Bound on a stalled TCP payload, and the base of every frame's deadline.
    min_data_rate:
        Bytes per second a tcp frame must at least move: a frame of ``n`` payload bytes
        must arrive whole within ``io_timeout_s + n / min_data_rate`` of its header, or its
        connection is closed and its request fails. Default 8 MiB/s.
    auth_timeout_s:
        A data connection must authenticate within this many seconds of being accepted,
        and a control handshake must complete within it.
    max_pending_connections:
        Data connections accepted but not yet authenticated, at most (more are closed).
    max_connections:
        Authenticated data connections, at most (each has a thread).
    max_handshakes:
        Control handshakes in progress (Hello answered, Auth awaited), at most; past it the
        oldest is dropped (an attacker opening handshakes cannot keep a new one out).
    max_pending_control:
        Control connections without a session, at most (the oldest is closed past it), and
        each closed when it has no session ``auth_timeout_s`` after it connected.
    max_pending_per_source:
        Control connections without a session from one address, at most (its oldest is
        closed past it).
    max_sessions:
        Prefill sessions (ranks) at once, at most.
    max_blocks_per_instance:
        Buffer (and GPU) blocks the requests of one prefill instance may hold at once;
        None: no quota (one instance may fill the buffer, as a single prefill needs).
    auto_tick:
        Call ``scheduler.tick()`` from the receiver loop (every ~2 ms), for engines that
        do not tick themselves.
    data_advertise:
        ``host:port`` prefill should connect to for data, when it differs from the
        listener (NAT, port forwarding).
    rdma_device, rdma_port, rdma_gid_index:
        With ``rdma`` served: the RDMA device (default: the first), its port (1) and GID
        index (default: chosen by type: RoCE v2 over IPv4 first, then RoCE v2, then 0).
    nixl_ucx:
        With ``nixl`` served: UCX settings (``{"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}``)
        set in this process's environment where not set already, before NIXL starts UCX.
    gpu_caches:
        With ``cuda_ipc`` served: each rank's GPU cache (a CacheSpec with ``device``
        set, at least as many blocks as the scheduler's GPU pool), exported to same-host
        prefill ranks. The caches must stay allocated while the receiver lives.
    buffer_order:
        How the shared buffers are laid out (:meth:`~pdkv.CacheSpec.for_buffer`):
        ``layer`` (one region per layer and tensor, the default) or ``block`` (a block's
        layers side by side: the order of a block-outermost engine cache, vLLM's BLHNC /
        BLNHC, so that a swap into it moves whole blocks). Told to prefill in the Welcome.
    """

    control: str = "tcp://127.0.0.1:0"
    data_host: str = "127.0.0.1"
    secret: bytes | None = field(default=None, repr=False)
    transports: Sequence[str] = ("shm", "tcp")
    peer_timeout_s: float = 10.0
    io_timeout_s: float = 5.0
    auto_tick: bool = False
    data_advertise: str | None = None
    rdma_device: str | None = None
    rdma_port: int = 1
    rdma_gid_index: int | None = None
    nixl_ucx: Mapping[str, str] | None = None
    gpu_caches: Sequence[CacheSpec] | None = None
    min_data_rate: float = 8 << 20
    auth_timeout_s: float = 5.0
    max_pending_connections: int = 64
    max_connections: int = 1024
    max_handshakes: int = 256
    max_pending_control: int = 64
    max_pending_per_source: int = 16
    max_sessions: int = 1024
    max_blocks_per_instance: int | None = None
    buffer_order: Literal["layer", "block"] = "layer"

    def __post_init__(self) -> None:
        if self.buffer_order not in ("layer", "block"):
            raise ValueError(f"buffer_order={self.buffer_order!r} must be 'layer' or 'block'")
        if isinstance(self.transports, str) or not self.transports:
            raise ValueError(f"transports={self.transports!r} must be a non-empty sequence of transport names")
        object.__setattr__(self, "transports", tuple(self.transports))
        if len(set(self.transports)) != len(self.transports):
            raise ValueError(f"transports={self.transports!r} names a transport twice")
        for name in ("peer_timeout_s", "io_timeout_s", "min_data_rate", "auth_timeout_s"):
            _positive(name, getattr(self, name))
        for name in (
            "max_pending_connections",
            "max_connections",
            "max_handshakes",
            "max_pending_control",
            "max_pending_per_source",
            "max_sessions",
        ):
            _count(name, getattr(self, name))
        if self.max_blocks_per_instance is not None:
            _count("max_blocks_per_instance", self.max_blocks_per_instance)
        _secret(self.secret)
        _rdma_port(self.rdma_port, self.rdma_gid_index)
        if self.gpu_caches is not None:
            object.__setattr__(self, "gpu_caches", tuple(self.gpu_caches))


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_copy_threads() -> int:
    """shm copy threads a :class:`~pdkv.transfer.PrefillSender` uses by default: a quarter
    of the CPUs this process may run on, at least 2 (where it has 2) and at most 4. On the
    2-vCPU dev VM, with decode on the same 2 vCPUs, two threads moved 32 KiB / 128 KiB blocks
    at a median 16.5 / 19.7 GiB/s against one's 13.0 / 15.2 (docs/PERF.md): one thread leaves
    memory idle between its misses; the threads run only while a layer is written."""
    n = _cpus()
    return min(4, max(min(2, n), n // 4))


def default_streams() -> int:
    """tcp data connections a :class:`~pdkv.transfer.PrefillSender` opens by default: half
    the CPUs this process may run on, at least 2 and at most 8. Each stream is a thread that
    sends here (a lane that sends from the staging ring, for a GPU cache) and one that
    receives in decode. On the 16-core H200 host 8 streams moved 12.9-13.1 GiB/s against 2
    streams' 5.1-5.4, where a socket loop of 8 streams reached 15.8-16.1 GiB/s and 16 streams
    no more (docs/PERF.md, "tcp by streams"): 8 fill a 100 Gb/s NIC."""
    return min(8, max(2, _cpus() // 2))


@dataclass(frozen=True)
class SenderOptions:
    """How a :class:`~pdkv.transfer.PrefillSender` sends.

    instance:
        Name of the prefill instance; all its ranks use the same one. It names the
        instance in logs and metrics; what makes sessions one instance is ``instance_key``.
    instance_key:
        What the ranks of one prefill instance share to prove they are one (bytes, >= 16):
        decode lets a session share another's grants only when both show the same key, and
        refuses a session naming a live instance with another key. Default: one random key
        per instance name and process, so ranks in one process are one instance; ranks in
        separate processes must each be given the same key (e.g. ``os.urandom(32)`` made
        by their launcher).
    secret:
        The shared secret decode was given.
    transport:
        ``auto`` (decode picks from what this cache and host can use: a host cache offers
        shm, then rdma where this host has a device, then tcp; a GPU cache offers cuda_ipc,
        then shm) or a registered transport's name.
    streams:
        TCP data connections (1..64); default :func:`default_streams` (half the CPUs, 2..8).
    timeout_s:
        Bound on the handshake, a reservation, and decode's silence before its requests fail
        (silence counted in time the sender's I/O loop ran, as decode's ``peer_timeout_s``).
    heartbeat_s:
        Seconds between heartbeats.
    on_outcome:
        Called (from the sender's I/O thread) with each RequestOutcome.
    rdma_device, rdma_port, rdma_gid_index:
        RDMA device name (default: the one nearest a GPU cache's GPU in the PCI tree, else
        the first), its port (1) and GID index (default: chosen by type, as decode's).
    nixl_ucx:
        With ``transport="nixl"``: UCX settings, as decode's.
    copy_threads:
        Threads that copy host caches into decode's shared buffers (shm), each a C-level
        gather without the GIL; default :func:`default_copy_threads` (1..64).
    staging:
        ``auto``: a transport that sends from host memory (tcp) gathers a GPU cache's
        layers into a pinned staging ring and sends from there; ``always``: a host cache
        is staged too (the same path on a host without a GPU).
    staging_slots:
        Slots in the staging ring (1..1024, default 4): chunks gathered ahead of the send.
    gpudirect:
        rdma from a GPU cache: ``auto`` registers the cache's allocations with the NIC
        (GPUDirect RDMA: a dma-buf of each, else peer memory) and stages the layers when
        that fails; ``off`` always stages; ``require`` fails instead of staging. nixl from
        a GPU cache: ``auto`` registers the cache with NIXL as VRAM on a host with an RDMA
        device and stages without one; ``off`` stages; ``require`` registers VRAM.
    staging_slot_bytes:
        Bytes per slot; default :func:`~.staging.default_slot_bytes` (256 blocks of one
        layer of this rank, within 16-64 MiB, at least one block's largest piece).
    """

    instance: str = "prefill"
    secret: bytes | None = field(default=None, repr=False)
    instance_key: bytes | None = field(default=None, repr=False)
    transport: str = "auto"
    streams: int | None = None
    timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    on_outcome: Callable[[Any], None] | None = None
    rdma_device: str | None = None
    rdma_port: int = 1
    rdma_gid_index: int | None = None
    nixl_ucx: Mapping[str, str] | None = None
    copy_threads: int | None = None
    staging: str = "auto"
    staging_slots: int = 4
    staging_slot_bytes: int | None = None
    gpudirect: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.transport, str):
            raise ValueError(f"transport={self.transport!r} must be a transport name or 'auto'")
        if not isinstance(self.instance, str) or not 0 < len(self.instance) <= 256 or not self.instance.isprintable():
            raise ValueError(f"instance={self.instance!r:.80} must be a string of 1-256 printable characters")
        if self.instance_key is not None and (not isinstance(self.instance_key, bytes) or len(self.instance_key) < 16):
            raise ValueError("instance_key must be bytes (>= 16 of them) or None")
        if self.streams is None:
            object.__setattr__(self, "streams", default_streams())
        _count("streams", self.streams, 1, 64)
        _positive("timeout_s", self.timeout_s)
        _positive("heartbeat_s", self.heartbeat_s)
        _secret(self.secret)
        if self.copy_threads is None:
            object.__setattr__(self, "copy_threads", default_copy_threads())
        _count("copy_threads", self.copy_threads, 1, 64)
        _rdma_port(self.rdma_port, self.rdma_gid_index)
        if self.staging not in ("auto", "always"):
            raise ValueError(f"staging={self.staging!r} must be 'auto' or 'always'")
        if self.gpudirect not in ("auto", "off", "require"):
            raise ValueError(f"gpudirect={self.gpudirect!r} must be 'auto', 'off' or 'require'")
        _count("staging_slots", self.staging_slots, 1, 1024)
        if self.staging_slot_bytes is not None:
            _count("staging_slot_bytes", self.staging_slot_bytes, 1, 1 << 32)


def merge_options(cls: type[Any], options: Any, kw: dict[str, Any], owner: str) -> Any:
    """``options`` (or the defaults) with the fields named in ``kw`` replaced; TypeError
    naming ``owner`` for a keyword that is not a field."""
    if options is not None and not isinstance(options, cls):
        raise TypeError(f"{owner}: options must be a {cls.__name__}, got {type(options).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(kw) - fields)
    if bad:
        raise TypeError(
            f"{owner}() got unexpected keyword argument(s) {', '.join(bad)} "
            f"(fields of {cls.__name__}: {', '.join(sorted(fields))})"
        )
    if options is None:
        return cls(**kw)
    return dataclasses.replace(options, **kw) if kw else options  # options: an instance of cls
