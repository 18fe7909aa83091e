"""One funnel over NVIDIA NIXL's Python API (``nixl._api``; ``pip install 'pdkv[nixl]'``).

:class:`Agent` is one NIXL agent with a UCX backend: memory registered once, remote agents
added from their metadata, WRITE transfers of descriptor lists posted and polled. Every
NIXL failure comes out as :class:`~pdkv.errors.TransferError` naming the call; a missing
package as :class:`~pdkv.errors.NixlUnavailableError` naming the extra.

UCX reads its settings (``UCX_TLS``, ``UCX_NET_DEVICES``, ...) from the environment when
the first agent's backend starts: :func:`ucx_settings` sets the ones given that are not
set already, for the whole process.

A crash at exit, avoided: NIXL's wheels bundle UCX with their own libibverbs and libnl, and
UCX's ``efa`` module loads the host's ``libefa`` (rdma-core's providers), which brings the
host's libibverbs and libnl too; with both copies loaded, libnl-route's destructor crashes
the process at exit (SIGSEGV), after everything it did succeeded. On a host without an EFA
device pdkv leaves that module out (``UCX_MODULES=^efa``, set only when ``UCX_MODULES`` is
not set): every other UCX transport, InfiniBand's included, stays. On an EFA host (AWS) the
module stays, and so may the crash at exit (NIXL's packaging).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import NixlUnavailableError, TransferError

__all__ = ["available", "import_nixl", "ucx_settings", "Agent"]

_lock = threading.Lock()


def import_nixl() -> Any:
    """``nixl._api``, or NixlUnavailableError naming the extra. NIXL's Python logger
    writes INFO lines to stdout; it is moved to stderr at WARNING (unless NIXL_LOG_LEVEL
    says otherwise), so a process's stdout stays its own (the tool speaks JSON there)."""
    try:
        from nixl import _api
    except ImportError as exc:
        raise NixlUnavailableError(f"the nixl transport needs NVIDIA NIXL: pip install 'pdkv[nixl]' ({exc})") from None
    _quiet()
    return _api


def _quiet() -> None:
    log = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        log.setLevel(logging.WARNING)
    for h in log.handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


def available() -> bool:
    try:
        import_nixl()
    except NixlUnavailableError:
        return False
    return True


def ucx_settings(settings: Mapping[str, str] | None) -> None:
    """Set ``UCX_*`` environment variables not set already (UCX reads them at start)."""
    for k, v in (settings or {}).items():
        if not k.startswith("UCX_"):
            raise ValueError(f"UCX setting {k!r} must be a UCX_* variable")
        os.environ.setdefault(k, str(v))


def _efa_present() -> bool:
    try:
        return any("efa" in d for d in os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _avoid_exit_crash() -> None:
    """``UCX_MODULES=^efa`` on a host without an EFA device, unless the user set UCX_MODULES
    (module docstring: the duplicate libnl that crashes a process at exit)."""
    if "UCX_MODULES" not in os.environ and not _efa_present():
        os.environ["UCX_MODULES"] = "^efa"


def _call(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except (NixlUnavailableError, TransferError):
        raise
    except Exception as exc:  # nixl raises its own binding exceptions (nixlBackendError, ...)
        raise TransferError(f"NIXL {what} failed: {type(exc).__name__}: {exc}") from None


def _dlist(descs: Any) -> Any:
    """What NIXL's get_xfer_descs takes: an Nx3 array as is, tuples as a list."""
    return descs if hasattr(descs, "ndim") else list(descs)


class Agent:
    """One NIXL agent (UCX backend, a progress thread). Ownership: registrations and
    remote agents are this object's, released by :meth:`close`, which also lets the agent
    go: NIXL's progress thread polls without pause (a whole core, even idle) for as long as
    its agent lives."""

    def __init__(self, name: str, ucx: Mapping[str, str] | None = None) -> None:
        api = import_nixl()
        ucx_settings(ucx)
        _avoid_exit_crash()
        with _lock:  # backend start-up is not documented as thread-safe
            cfg = api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
            try:
                self._nixl: Any = _call("agent creation", api.nixl_agent, name, cfg)
            except TransferError as exc:
                tls = os.environ.get("UCX_TLS")
                hint = (
                    f" (UCX_TLS={tls!r}: on a host with NVIDIA GPUs NIXL's UCX backend needs cuda_copy in it; "
                    "its reason is on stderr)"
                    if tls
                    else " (its reason is on stderr)"
                )
                raise TransferError(f"{exc}{hint}") from None
        self.name = name
        self._regs: list[Any] = []
        self._remotes: set[str] = set()
        self._prepped: list[Any] = []

    @property
    def _a(self) -> Any:
        if self._nixl is None:
            raise TransferError(f"NIXL agent {self.name!r} is closed")
        return self._nixl

    def register(self, regions: Sequence[tuple[int, int, int]], mem: str) -> None:
        """Register ``(addr, length, device)`` regions (``mem``: ``DRAM`` or ``VRAM``) once."""
        descs = _call("get_reg_descs", self._a.get_reg_descs, [(a, n, d, "") for a, n, d in regions], mem)
        self._regs.append(_call("register_memory", self._a.register_memory, descs))

    def metadata(self) -> bytes:
        return bytes(_call("get_agent_metadata", self._a.get_agent_metadata))

    def add_remote(self, metadata: bytes) -> str:
        """The agent ``metadata`` describes, added; its name."""
        name = _call("add_remote_agent", self._a.add_remote_agent, metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a remote agent (its connection and metadata): no transfer to or from it
        can be started afterwards."""
        if name in self._remotes:
            self._remotes.discard(name)
            _call("remove_remote_agent", self._a.remove_remote_agent, name)

    def write(self, local: Any, remote: Any, peer: str, mem: str) -> Any:
        """Start one WRITE of ``local[i]`` into ``remote[i]`` (``(addr, length, device)``
        tuples, or an Nx3 uint64 array of them; local memory ``mem``, remote DRAM);
        returns the handle to poll."""
        ld = _call("get_xfer_descs", self._a.get_xfer_descs, _dlist(local), mem)
        rd = _call("get_xfer_descs", self._a.get_xfer_descs, _dlist(remote), "DRAM")
        return self._post(_call("initialize_xfer", self._a.initialize_xfer, "WRITE", ld, rd, peer))

    def _post(self, h: Any) -> Any:
        """Post a transfer request made from descriptors; the handle, or TransferError
        (the handle released) when NIXL refuses to start it."""
        st = _call("transfer", self._a.transfer, h)
        if st == "ERR":
            self.release(h)
            raise TransferError("NIXL transfer failed to start (ERR)")
        return h

    def prepare(self, descs: Any, mem: str, peer: str = "") -> Any:
        """A prepared descriptor list (NIXL's ``prep_xfer_dlist``) of this agent's memory,
        or of ``peer``'s (its metadata added): ``descs`` an Nx5 uint64 array of strided rows
        ``(address, length, device, stride, count)``, ``count`` descriptors of ``length``
        bytes ``stride`` apart each, numbered in row order. Kept until :meth:`close`."""
        h = _call("prep_xfer_dlist", self._a.prep_xfer_dlist, peer or "NIXL_INIT_AGENT", descs, mem)
        self._prepped.append(h)
        return h

    def write_prepared(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any) -> Any:
        """Start one WRITE of ``local``'s descriptors ``local_idx[i]`` into ``remote``'s
        ``remote_idx[i]`` (lists from :meth:`prepare`; int32 arrays; contiguous neighbours
        merged by NIXL); returns the handle to poll."""
        return self._post(
            _call("make_prepped_xfer", self._a.make_prepped_xfer, "WRITE", local, local_idx, remote, remote_idx)
        )

    def state(self, handle: Any) -> str:
        """``DONE``, ``PROC`` or ``ERR``."""
        return str(_call("check_xfer_state", self._a.check_xfer_state, handle))

    def release(self, handle: Any) -> None:
        _call("release_xfer_handle", self._a.release_xfer_handle, handle)

    def close(self) -> None:
        """Release prepared lists, remove remote agents, deregister memory, and drop the
        agent (its progress thread stops with it; every later call raises TransferError).
        Idempotent; errors ignored (teardown)."""
        if self._nixl is None:
            return
        for h in self._prepped:
            try:
                h.release()
            except Exception:
                pass
        self._prepped.clear()
        for name in list(self._remotes):
            try:
                self.remove_remote(name)
            except TransferError:
                pass
        for r in self._regs:
            try:
                self._a.deregister_memory(r)
            except Exception:
                pass
        self._regs.clear()
        self._nixl = None  # the last reference: NIXL stops the agent's progress thread
