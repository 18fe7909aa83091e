"""An engine's own host memory as a receive buffer: :class:`HostRegion`.

pdkv's buffer is a shared-memory segment it creates (:class:`~pdkv.buffer.shared.SharedBuffer`).
Some engines keep a host pool of their own and choose its pages per request (SGLang's
decode host receive): decode then receives straight into those pages. A region describes
such memory by a :class:`~pdkv.layout.CacheSpec` (a base and a page stride per layer and
tensor), so the transports that write host memory by address can serve it: ``tcp``, and
``nixl``, whose agent registers each of the spec's regions (never what lies between them)
and sends prefill the spec's cells. It is not shared memory: ``shm`` (which maps decode's
buffer from another process) and ``rdma`` (which registers one buffer whole) do not serve it.
"""

from __future__ import annotations

from ..layout import CacheSpec

__all__ = ["HostRegion"]


class HostRegion:
    """Host memory an engine owns, described by ``spec`` (its pages are the spec's blocks).

    ``address``/``size`` span every region of the spec, from the lowest base to the end of
    the highest; ``buf`` is a writable view of that span, through which a transport writes
    only inside granted pages of each region (it never reads or writes between regions).
    The engine keeps the memory alive and mapped for the region's lifetime: pdkv never
    allocates or frees it. ``name`` labels it in errors and logs.
    """

    def __init__(self, spec: CacheSpec, name: str = "engine host pool") -> None:
        from .._ffi.libc import host_view

        if spec.device is not None:
            raise ValueError(f"{name}: a host region describes host memory; this spec is on device {spec.device}")
        ranges = spec.region_ranges()
        lo = min(b for b, _ in ranges)
        hi = max(b + n for b, n in ranges)
        self.spec, self.name = spec, name
        self.address, self.size = lo, hi - lo
        self.buf = host_view(lo, hi - lo)

    def __repr__(self) -> str:
        return f"HostRegion({self.name!r}, {self.size} bytes at {self.address:#x})"
