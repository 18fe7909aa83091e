"""The exception hierarchy of pdkv.

Every pdkv exception derives from :class:`PdkvError`. The subclasses say whose fault a
failure is (STYLE.md B6), so a caller can catch each: closed by you, broken by the peer,
busy, out of blocks, timed out, bad message, bad argument, missing hardware.
"""

from __future__ import annotations

__all__ = [
    "PdkvError",
    "ClosedError",
    "PeerError",
    "BusyError",
    "OutOfBlocksError",
    "BlockError",
    "PdkvTimeoutError",
    "ProtocolError",
    "AuthenticationError",
    "GrantViolation",
    "LeaseExpiredError",
    "LayoutError",
    "LayoutMismatchError",
    "RequestError",
    "CudaError",
    "CudaUnavailableError",
    "RdmaError",
    "RdmaUnavailableError",
    "NixlUnavailableError",
    "SwapError",
    "TransferError",
]


class PdkvError(Exception):
    """Base class of every error pdkv raises on purpose."""


class ClosedError(PdkvError):
    """The object was closed by its owner and cannot be used any more."""


class PeerError(PdkvError):
    """The remote side broke the exchange: it died, hung up or answered with an error."""


class BusyError(PdkvError):
    """The resource is in use (a segment still mapped, a view still exported)."""


class OutOfBlocksError(PdkvError):
    """A pool has fewer free blocks than asked for. Nothing was allocated."""


class BlockError(PdkvError, ValueError):
    """A block id is foreign, out of range, duplicated or already free."""


class PdkvTimeoutError(PdkvError, TimeoutError):
    """A bounded wait ran out."""


class ProtocolError(PdkvError, ValueError):
    """A message or write from a peer failed validation (schema, version, framing)."""


class AuthenticationError(ProtocolError):
    """A message failed authentication with the shared secret."""


class GrantViolation(ProtocolError):
    """A peer tried to write outside the blocks granted to it, or with a stale token."""


class LeaseExpiredError(PdkvError):
    """The reservation's lease ran out; its blocks were reclaimed."""


class LayoutError(PdkvError, ValueError):
    """A KV layout, TP combination or cache description is invalid or unsupported."""


class LayoutMismatchError(LayoutError):
    """Two layout descriptors are incompatible; the message names the first mismatch."""


class RequestError(PdkvError, ValueError):
    """A request id or request-level argument is invalid (unknown, duplicate, bad size)."""


class CudaError(PdkvError):
    """A CUDA call failed. ``status`` is the status name, ``code`` its number."""

    def __init__(self, code: int, status: str, description: str, call: str = "") -> None:
        self.code = code
        self.status = status
        self.description = description
        self.call = call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}{status} ({code}): {description}")


class CudaUnavailableError(PdkvError):
    """CUDA was asked for, but the bindings, the driver or a device is missing."""


class RdmaError(PdkvError):
    """An RDMA verb or a work completion failed."""


class RdmaUnavailableError(RdmaError):
    """RDMA was asked for, but pyverbs or an RDMA device is missing."""


class SwapError(PdkvError):
    """A swap between the CPU buffer and GPU blocks failed or was refused."""


class TransferError(PdkvError):
    """A KV transfer between prefill and decode failed."""


class NixlUnavailableError(TransferError):
    """NIXL was asked for, but the nixl package (``pip install 'pdkv[nixl]'``) is missing."""
