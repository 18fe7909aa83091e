"""pyverbs (rdma-core) behind a guarded import.

With no RDMA device ``pyverbs.device.get_device_list()`` raises ``PyverbsRDMAError``
rather than returning ``[]``; :func:`rdma_devices` turns that one case into ``[]`` and
lets every other failure through as :class:`~pdkv.errors.RdmaError`.
"""

from __future__ import annotations

import errno
from typing import Any

from ..errors import RdmaError, RdmaUnavailableError

__all__ = ["available", "import_pyverbs", "rdma_devices", "require_device"]

# errnos with which rdma-core reports "no devices / no driver" from ibv_get_device_list
_ABSENT = {errno.ENOSYS, errno.ENODEV, errno.ENOENT, 0}


def import_pyverbs() -> Any:
    """Import and return the ``pyverbs`` package, or raise RdmaUnavailableError."""
    try:
        import pyverbs.device  # noqa: F401
        import pyverbs
    except ImportError as exc:
        raise RdmaUnavailableError(
            "RDMA needs pyverbs (pip install 'pdkv[rdma]' or the distro's python3-pyverbs)"
            f": {exc}"
        ) from exc
    return pyverbs


def available() -> bool:
    """True when pyverbs imports. Says nothing about devices."""
    try:
        import_pyverbs()
    except RdmaUnavailableError:
        return False
    return True


def rdma_devices() -> list[str]:
    """Names of the RDMA devices on this host; ``[]`` if pyverbs or devices are absent."""
    try:
        pv = import_pyverbs()
    except RdmaUnavailableError:
        return []
    from pyverbs.pyverbs_error import PyverbsRDMAError  # type: ignore[import-not-found]

    try:
        devs = pv.device.get_device_list()
    except PyverbsRDMAError as exc:
        code = getattr(exc, "error_code", 0) or 0
        if code in _ABSENT or "no ib" in str(exc).lower() or "device" in str(exc).lower():
            return []
        raise RdmaError(f"ibv_get_device_list failed: {exc}") from exc
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]


def require_device(name: str | None = None) -> str:
    """Return the device to use, or raise RdmaUnavailableError saying what is missing."""
    import_pyverbs()
    devs = rdma_devices()
    if not devs:
        raise RdmaUnavailableError("no RDMA device on this host (ibv_get_device_list is empty)")
    if name is None:
        return devs[0]
    if name not in devs:
        raise RdmaUnavailableError(f"RDMA device {name!r} not found; present: {devs}")
    return name
