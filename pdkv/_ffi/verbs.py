"""pyverbs (rdma-core) behind a guarded import.

With no RDMA device ``pyverbs.device.get_device_list()`` raises ``PyverbsRDMAError``
rather than returning ``[]``; :func:`rdma_devices` turns that one case into ``[]`` and
lets every other failure through as :class:`~pdkv.errors.RdmaError`.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Sequence
from typing import Any

from ..errors import RdmaError, RdmaUnavailableError

__all__ = [
    "available",
    "import_pyverbs",
    "rdma_devices",
    "require_device",
    "open_device",
    "register",
    "create_rc_qp",
    "connect_qp",
    "post_writes",
    "poll",
    "close",
    "close_device",
    "enum",
    "GID_RE",
    "check_memlock",
]

# errnos with which rdma-core reports "no devices / no driver" from ibv_get_device_list
_ABSENT = {errno.ENOSYS, errno.ENODEV, errno.ENOENT, 0}

# a GID as pyverbs' GID(val) parses it and str(GID) prints it: eight groups of four hex digits
GID_RE = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}$")

# the enum type of each IBV_* name pdkv uses: rdma-core v59 dropped pyverbs.enums, and with
# Cython >= 3.1 a cpdef enum's members are attributes of its type in
# pyverbs.libibverbs_enums, not of the module
_ENUM_TYPE = {
    "IBV_ACCESS_": "ibv_access_flags",
    "IBV_QPT_": "ibv_qp_type",
    "IBV_WR_": "ibv_wr_opcode",
    "IBV_SEND_": "ibv_send_flags",
    "IBV_WC_": "ibv_wc_status",
    "IBV_QPS_": "ibv_qp_state",
    "IBV_QP_": "ibv_qp_attr_mask",
}


def import_pyverbs() -> Any:
    """Import and return the ``pyverbs`` package, or raise RdmaUnavailableError."""
    try:
        import pyverbs
        import pyverbs.device  # noqa: F401
    except ImportError as exc:
        raise RdmaUnavailableError(
            "RDMA needs pyverbs: install the distribution's python3-pyverbs (it matches the host's "
            "rdma-core and NIC providers), or pip install 'pdkv[rdma]', which builds pyverbs from "
            f"rdma-core's sources and needs cmake and the libnl-3 / libnl-route-3 headers: {exc}"
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
    from pyverbs.pyverbs_error import PyverbsRDMAError

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


def enum(name: str) -> int:
    """The value of the verbs constant ``name`` (``IBV_QPT_RC``...) in any pyverbs: a member of
    its enum type in ``pyverbs.libibverbs_enums`` (rdma-core v59+, Cython >= 3.1), a name of
    that module (older Cython), or of ``pyverbs.enums`` (before v59)."""
    try:
        import pyverbs.libibverbs_enums as le
    except ImportError:
        le = None
    if le is not None:
        v = getattr(le, name, None)
        if v is None:
            typ = next((t for p, t in _ENUM_TYPE.items() if name.startswith(p)), None)
            v = getattr(getattr(le, typ, None), name, None) if typ else None
        if v is not None:
            return int(v)
    try:
        import pyverbs.enums as old

        return int(getattr(old, name))
    except (ImportError, AttributeError):
        raise RdmaUnavailableError(
            f"this pyverbs defines no {name} (in pyverbs.libibverbs_enums or pyverbs.enums): "
            "install the distribution's python3-pyverbs matching its rdma-core"
        ) from None


def _has_ipc_lock() -> bool:
    """Whether this process holds CAP_IPC_LOCK (then RLIMIT_MEMLOCK does not bound ibv_reg_mr)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 14 & 1)
    except (OSError, ValueError):
        pass
    return False


def check_memlock(nbytes: int) -> None:
    """RdmaError, saying what to raise, when registering ``nbytes`` would pass this process's
    locked-memory limit: ibv_reg_mr pins the pages and fails with a bare ENOMEM past it
    (containers often start with 64 KiB or 8 MiB)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or nbytes <= soft or _has_ipc_lock():
        return
    raise RdmaError(
        f"registering {nbytes} bytes for RDMA needs a locked-memory limit of at least that, but "
        f"RLIMIT_MEMLOCK is {soft} bytes: raise it (ulimit -l unlimited; docker run --ulimit "
        "memlock=-1; LimitMEMLOCK=infinity in a systemd unit; or grant CAP_IPC_LOCK)"
    )


# ---------------------------------------------------------------- resources
# Written against pyverbs' documented API (rdma-core/pyverbs: device.Context, pd.PD,
# mr.MR, cq.CQ, qp.QP/QPInitAttr/QPCap/QPAttr, addr.AHAttr/GlobalRoute, wr.SGE/SendWR).
# NOT RUN ON HARDWARE: no RDMA device exists on the machines this was written on.


def _wrap(what: str, fn: Any, *args: Any, **kw: Any) -> Any:
    pv = import_pyverbs()
    from pyverbs.pyverbs_error import PyverbsError

    try:
        return fn(*args, **kw)
    except (PyverbsError, TypeError, ValueError) as exc:  # also an argument pyverbs' types refuse
        raise RdmaError(f"{what} failed: {exc}") from exc
    finally:
        del pv


SYSFS_IB = "/sys/class/infiniband"
SYSFS_PCI = "/sys/bus/pci/devices"
HOP_LIMIT = 64  # routed RoCE v2 crosses IP hops; 1 (pyverbs' default) dies at the first router


def gid_table(dev: str, port: int, root: str = SYSFS_IB) -> list[tuple[int, str, str]]:
    """The port's non-zero GIDs as ``(index, gid, type)`` from sysfs (type ``RoCE v2``,
    ``IB/RoCE v1``, or ``""`` where the kernel gives none); ``[]`` if unreadable."""
    base = os.path.join(root, dev, "ports", str(port))
    out = []
    try:
        names = os.listdir(os.path.join(base, "gids"))
    except OSError:
        return []
    for n in sorted(names, key=lambda x: int(x) if x.isdigit() else -1):
        if not n.isdigit():
            continue
        try:
            with open(os.path.join(base, "gids", n)) as f:
                gid = f.read().strip()
        except OSError:  # an empty slot of the table reads as EINVAL
            continue
        if not GID_RE.match(gid) or not gid.replace(":", "").strip("0"):
            continue
        try:
            with open(os.path.join(base, "gid_attrs", "types", n)) as f:
                kind = f.read().strip()
        except OSError:
            kind = ""
        out.append((int(n), gid.lower(), kind))
    return out


def choose_gid_index(table: Sequence[tuple[int, str, str]]) -> int:
    """The GID a queue pair should use: RoCE v2 over an IPv4 address (routable, what most
    RoCE fabrics are configured for), else any RoCE v2 GID, else the first GID (InfiniBand:
    index 0, the port's GUID-based GID)."""
    v2 = [(i, g) for i, g, kind in table if kind.lower().replace(" ", "") == "rocev2"]
    ipv4 = [i for i, g in v2 if g.startswith("0000:0000:0000:0000:0000:ffff:")]
    if ipv4:
        return ipv4[0]
    if v2:
        return v2[0][0]
    return table[0][0] if table else 0


def _pci_path(path: str) -> list[str]:
    return [p for p in os.path.realpath(path).split(os.sep) if p]


def nearest_device(gpu_bus_id: str, devices: Sequence[str], root: str = SYSFS_IB, pci: str = SYSFS_PCI) -> str:
    """Of ``devices``, the NIC closest to the GPU at PCI ``gpu_bus_id`` in the PCI tree (the
    longest shared path from the root complex: the same switch beats the same socket);
    the first listed on a tie or where sysfs says nothing."""
    gpu = _pci_path(os.path.join(pci, gpu_bus_id.lower()))

    def shared(dev: str) -> int:
        nic = _pci_path(os.path.join(root, dev, "device"))
        n = 0
        for a, b in zip(gpu, nic):
            if a != b:
                break
            n += 1
        return n

    best = max(devices, key=lambda d: (shared(d), -list(devices).index(d)))
    return best


def open_device(
    name: str | None = None, port: int = 1, gid_index: int | None = None, gpu: int | None = None
) -> dict[str, Any]:
    """Open a device (``name``; else the one nearest CUDA device ``gpu``; else the first), a
    protection domain and a completion queue; query the port and its GID (``gid_index``;
    else chosen by type, :func:`choose_gid_index`)."""
    if name is None and gpu is not None:
        devs = rdma_devices()
        if len(devs) > 1:
            from . import cuda

            try:
                name = nearest_device(cuda.pci_bus_id(gpu), devs)
            except Exception:  # no topology to go by: the first device
                name = None
    dev = require_device(name)
    if gid_index is None:
        gid_index = choose_gid_index(gid_table(dev, port))
    import pyverbs.cq as cq
    import pyverbs.device as d
    import pyverbs.pd as pd

    ctx = _wrap("ibv_open_device", d.Context, name=dev)
    pdom = _wrap("ibv_alloc_pd", pd.PD, ctx)
    cqo = _wrap("ibv_create_cq", cq.CQ, ctx, 4096, None, None, 0)
    pattr = _wrap("ibv_query_port", ctx.query_port, port)
    gid = _wrap("ibv_query_gid", ctx.query_gid, port, gid_index)
    return {
        "ctx": ctx,
        "pd": pdom,
        "cq": cqo,
        "device": dev,
        "port": port,
        "gid_index": gid_index,
        "lid": int(pattr.lid),
        "gid": str(gid),
        "mtu": int(pattr.active_mtu),
        "max_msg_sz": int(pattr.max_msg_sz),  # the largest message (one work request) the port takes
    }


def register(res: dict[str, Any], addr: int, length: int, remote_write: bool) -> tuple[Any, int, int]:
    """One memory region over ``[addr, addr+length)``; returns (mr, lkey, rkey)."""
    import pyverbs.mr as mr

    access = enum("IBV_ACCESS_LOCAL_WRITE") | (enum("IBV_ACCESS_REMOTE_WRITE") if remote_write else 0)
    m = _wrap("ibv_reg_mr", mr.MR, res["pd"], length, access, address=addr)
    return m, int(m.lkey), int(m.rkey)


def register_gpu(res: dict[str, Any], addr: int, length: int, dmabuf_fd: int | None) -> tuple[Any, int, int, str]:
    """GPU memory ``[addr, addr+length)`` registered with the NIC for GPUDirect RDMA, local
    writes only; returns (mr, lkey, rkey, how). With a dma-buf fd, ``mlx5dv_reg_dmabuf_mr``
    through pyverbs' mlx5 provider (iova = ``addr``, so work requests name GPU addresses);
    else, or if that fails, ``ibv_reg_mr`` on the GPU address, which the kernel accepts only
    with a peer-memory client (``nvidia_peermem``) loaded. RdmaError names both failures."""
    import pyverbs.mr as mr

    access = enum("IBV_ACCESS_LOCAL_WRITE")
    why = "no dma-buf of the allocation"
    if dmabuf_fd is not None:
        try:
            from pyverbs.providers.mlx5.mlx5dv_dmabuf import Mlx5DmaBufMR
        except ImportError as exc:
            why = f"pyverbs has no mlx5 dma-buf MR ({exc})"
        else:
            try:
                m = Mlx5DmaBufMR(res["pd"], 0, length, iova=addr, fd=dmabuf_fd, access=access)
                return m, int(m.lkey), int(m.rkey), "dma-buf"
            except Exception as exc:
                why = f"mlx5dv_reg_dmabuf_mr failed: {exc}"
    try:
        m = mr.MR(res["pd"], length, access, address=addr)
    except Exception as exc:
        raise RdmaError(
            f"GPUDirect registration of {length} bytes of GPU memory failed: {why}; "
            f"ibv_reg_mr on the GPU address failed too (is nvidia_peermem loaded?): {exc}"
        ) from None
    return m, int(m.lkey), int(m.rkey), "peer memory"


def create_rc_qp(res: dict[str, Any], max_send_wr: int) -> Any:
    from pyverbs.qp import QP, QPCap, QPInitAttr

    cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    init = QPInitAttr(qp_type=enum("IBV_QPT_RC"), scq=res["cq"], rcq=res["cq"], cap=cap, sq_sig_all=0)
    return _wrap("ibv_create_qp", QP, res["pd"], init)


def connect_qp(res: dict[str, Any], qp: Any, remote: dict[str, Any], local_psn: int) -> None:
    """RESET -> INIT -> RTR -> RTS towards ``remote`` (qpn, psn, lid, gid): this side
    receives from the peer's announced PSN and sends from ``local_psn``, the one it announced."""
    if not isinstance(local_psn, int) or not 0 <= local_psn < 1 << 24:
        raise RdmaError(f"local PSN {local_psn!r} is not a 24-bit number")
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    gid = remote["gid"]
    if not isinstance(gid, str) or not GID_RE.match(gid):
        raise RdmaError(f"peer GID {gid!r:.80} is not eight groups of four hex digits")
    a = QPAttr()
    a.qp_access_flags = enum("IBV_ACCESS_LOCAL_WRITE") | enum("IBV_ACCESS_REMOTE_WRITE")
    a.port_num = res["port"]
    _wrap("modify_qp(INIT)", qp.to_init, a)
    gr = _wrap("GlobalRoute", GlobalRoute, dgid=GID(gid), sgid_index=res["gid_index"], hop_limit=HOP_LIMIT)
    a.ah_attr = AHAttr(port_num=res["port"], is_global=1, gr=gr, dlid=remote["lid"])
    a.dest_qp_num = remote["qpn"]
    a.rq_psn = remote["psn"]
    a.path_mtu = min(res["mtu"], remote.get("mtu", res["mtu"]))
    a.max_dest_rd_atomic = 1
    a.min_rnr_timer = 12
    _wrap("modify_qp(RTR)", qp.to_rtr, a)
    a.sq_psn = local_psn
    a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic = 14, 7, 7, 1
    _wrap("modify_qp(RTS)", qp.to_rts, a)


def to_error(qp: Any) -> None:
    """Move a queue pair to the error state: the device flushes every outstanding work
    request (each completes with WR_FLUSH_ERR) and sends nothing more from it."""
    from pyverbs.qp import QPAttr

    a = QPAttr(qp_state=enum("IBV_QPS_ERR"))
    _wrap("modify_qp(ERR)", qp.modify, a, enum("IBV_QP_STATE"))


def post_writes(qp: Any, wrs: list[tuple[int, int, int, int, int, int, bool]]) -> None:
    """Post a chain of RDMA writes: (wr_id, local_addr, length, lkey, remote_addr, rkey, signaled)."""
    from pyverbs.wr import SGE, SendWR

    write, signaled = enum("IBV_WR_RDMA_WRITE"), enum("IBV_SEND_SIGNALED")
    objs = []
    for wr_id, la, n, lkey, ra, rkey, sig in wrs:
        w = SendWR(
            wr_id=wr_id,
            opcode=write,
            num_sge=1,
            sg=[SGE(la, n, lkey)],
            send_flags=signaled if sig else 0,
        )
        w.set_wr_rdma(rkey, ra)
        objs.append(w)
    for a, b in zip(objs, objs[1:]):
        a.next_wr = b
    if objs:
        _wrap("ibv_post_send", qp.post_send, objs[0], None)


def poll(cq: Any, n: int) -> list[tuple[int, int]]:
    """Up to ``n`` completions as (wr_id, status); never blocks."""
    got, wcs = _wrap("ibv_poll_cq", cq.poll, n)
    return [(int(w.wr_id), int(w.status)) for w in wcs[:got]]


def close(obj: Any) -> None:
    """Destroy a queue pair or deregister a memory region (pyverbs objects' ``close()``);
    errors are ignored: this runs on teardown paths."""
    try:
        obj.close()
    except Exception:
        pass


def close_device(res: dict[str, Any]) -> None:
    """Destroy what :func:`open_device` made: completion queue, protection domain, context."""
    for k in ("cq", "pd", "ctx"):
        if res.get(k) is not None:
            close(res[k])
