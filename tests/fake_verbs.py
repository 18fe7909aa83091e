"""A simulated verbs layer for tests: what pdkv calls in ``pdkv._ffi.verbs``, done in
process with memmove.

It checks what an RC queue pair checks — the local key covers the source, the remote key
exists, allows remote writes and covers the destination, the queue pair is connected and
its peer still exists — and behaves as one does on failure: the failing work request
completes with its error status, every later one is flushed (status 5) and completes
too, signaled or not, and the queue pair stays in the error state. So the RDMA wiring —
handshake records, address math, work-request chains, completion handling, fencing by
destroying a peer's queue pair — runs without a device. It models no timing, and it is
not pyverbs: the calls into pyverbs itself have not run on hardware (docs/TRANSPORTS.md).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import threading
import time
from typing import Any

from pdkv.errors import RdmaError

SUCCESS, LOC_LEN_ERR, LOC_PROT_ERR, WR_FLUSH_ERR, REM_ACCESS_ERR, RETRY_EXC_ERR = 0, 1, 4, 5, 10, 12


class _MR:
    def __init__(self, fabric: Fabric, key: int) -> None:
        self.fabric, self.key = fabric, key

    def close(self) -> None:
        with self.fabric.lock:
            self.fabric.mrs.pop(self.key, None)


class _CQ:
    def __init__(self, capacity: int = 4096) -> None:
        self.q: collections.deque[tuple[int, int, _QP]] = collections.deque()
        self.lock = threading.Lock()
        self.capacity = capacity  # completions it holds; one more is an overrun
        self.overrun = False

    def close(self) -> None:
        pass


class _QP:
    def __init__(self, fabric: Fabric, qpn: int, cq: _CQ, max_send_wr: int) -> None:
        self.fabric, self.qp_num, self.cq, self.max_send_wr = fabric, qpn, cq, max_send_wr
        self.peer = 0
        self.state = "reset"
        self.sq_psn = self.rq_psn = -1
        self.pending: list[tuple[int, int, int, int, int, int, bool]] = []  # posted, not yet executed
        self.unretired: collections.deque[int] = collections.deque()  # wr ids holding send-queue slots

    def close(self) -> None:
        with self.fabric.lock:
            self.state = "closed"
            self.fabric.qps.pop(self.qp_num, None)


class Fabric:
    """The simulated devices' shared state (one per test)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mrs: dict[int, tuple[int, int, bool]] = {}  # key -> (addr, length, remote_write)
        self.max_msg_sz = 1 << 31  # what ibv_query_port reports (a test may lower it)
        self.largest_wr = 0  # the longest work request posted
        self.qps: dict[int, _QP] = {}
        self._keys = itertools.count(0x100)
        self._qpns = itertools.count(0x20)
        self.fail_next: int | None = None  # status to give the next write
        self.stall = False  # the link is dead: nothing posted executes or completes (until fenced)
        self.cq_capacity = 4096
        self.writes = 0
        self.bytes = 0
        self.events: list[tuple[str, float]] = []  # (what was destroyed, when), in order
        self.opened: list[tuple[Any, ...]] = []  # open_device's arguments, each call
        self.lkeys_used: set[int] = set()  # local keys of the writes that landed
        # GPUDirect: how register_gpu registers ("dma-buf", "peer memory"), or None: refused
        self.gpudirect: str | None = "dma-buf"
        self.gpu_regs: list[tuple[int, int, bool]] = []  # (addr, length, with a dma-buf fd)

    # ---- the functions of pdkv._ffi.verbs
    def available(self) -> bool:
        return True

    def rdma_devices(self) -> list[str]:
        return ["fake0"]

    def require_device(self, name: str | None = None) -> str:
        return name or "fake0"

    def open_device(
        self, name: str | None = None, port: int = 1, gid_index: int | None = None, gpu: int | None = None
    ) -> dict[str, Any]:
        self.opened.append((name, port, gid_index, gpu))
        return {
            "device": name or "fake0",
            "ctx": None,
            "pd": None,
            "cq": _CQ(self.cq_capacity),
            "port": port,
            "gid_index": 0 if gid_index is None else gid_index,
            "lid": 1,
            "gid": "fe80:0000:0000:0000:0000:0000:0000:0001",
            "mtu": 5,
            "max_msg_sz": self.max_msg_sz,
        }

    def register(self, res: dict[str, Any], addr: int, length: int, remote_write: bool) -> tuple[Any, int, int]:
        if length <= 0 or addr <= 0:
            raise RdmaError("ibv_reg_mr failed: bad range")
        with self.lock:
            key = next(self._keys)
            self.mrs[key] = (addr, length, remote_write)
        return _MR(self, key), key, key

    def register_gpu(
        self, res: dict[str, Any], addr: int, length: int, dmabuf_fd: int | None
    ) -> tuple[Any, int, int, str]:
        if self.gpudirect is None:
            raise RdmaError("GPUDirect registration failed: the simulated NIC takes no GPU memory")
        if self.gpudirect == "dma-buf" and dmabuf_fd is None:
            raise RdmaError("GPUDirect registration failed: no dma-buf of the allocation")
        mr, lkey, rkey = self.register(res, addr, length, remote_write=False)
        self.gpu_regs.append((addr, length, dmabuf_fd is not None))
        return mr, lkey, rkey, self.gpudirect

    def create_rc_qp(self, res: dict[str, Any], max_send_wr: int) -> _QP:
        with self.lock:
            qp = _QP(self, next(self._qpns), res["cq"], max_send_wr)
            self.qps[qp.qp_num] = qp
        return qp

    def connect_qp(self, res: dict[str, Any], qp: _QP, remote: dict[str, Any], local_psn: int) -> None:
        with self.lock:
            peer = self.qps.get(remote["qpn"])
            if peer is None:
                raise RdmaError(f"modify_qp(RTR) failed: no queue pair {remote['qpn']}")
            # RC: each side receives from the PSN the other sends from; a mismatch is RETRY_EXC
            # on a NIC. The peer connected first must send from what it announced, and expect ours.
            if peer.state == "rts" and (peer.sq_psn != remote["psn"] or peer.rq_psn != local_psn):
                raise RdmaError(
                    f"PSN mismatch: peer sends from {peer.sq_psn}, announced {remote['psn']}; "
                    f"it expects {peer.rq_psn}, this side sends from {local_psn}"
                )
            qp.peer, qp.state = remote["qpn"], "rts"
            qp.sq_psn, qp.rq_psn = local_psn, remote["psn"]

    def _covers(self, key: int, addr: int, n: int, remote: bool) -> bool:
        mr = self.mrs.get(key)
        return mr is not None and (mr[2] or not remote) and mr[0] <= addr and addr + n <= mr[0] + mr[1]

    def post_writes(self, qp: _QP, wrs: list[tuple[int, int, int, int, int, int, bool]]) -> None:
        """Queue the chain (a NIC executes it later: completions come from poll()); the
        send queue holds at most max_send_wr work requests not yet retired by a polled
        completion, across posts, as ibv_post_send's ENOMEM says."""
        with self.lock:
            if qp.state in ("closed", "reset"):
                raise RdmaError(f"ibv_post_send failed: queue pair {qp.state}")
            if len(qp.unretired) + len(wrs) > qp.max_send_wr:
                raise RdmaError(
                    f"ibv_post_send failed: send queue full ({len(qp.unretired)} outstanding, "
                    f"max_send_wr {qp.max_send_wr})"
                )
            qp.pending.extend(wrs)
            qp.unretired.extend(w[0] for w in wrs)

    def _execute(self, qp: _QP) -> None:
        """Run a queue pair's posted work requests in order (lock held): success completes
        only signaled ones; the first failure puts the queue pair in the error state and
        every later one is flushed, signaled or not."""
        done = []
        for wr_id, la, n, lkey, ra, rkey, sig in qp.pending:
            self.largest_wr = max(self.largest_wr, n)
            if qp.state == "error":
                status = WR_FLUSH_ERR
            elif n > self.max_msg_sz:
                status = LOC_LEN_ERR  # longer than the port's largest message
            elif qp.peer not in self.qps:
                status = RETRY_EXC_ERR  # the peer's queue pair is gone: no acks come back
            elif not self._covers(lkey, la, n, remote=False):
                status = LOC_PROT_ERR
            elif not self._covers(rkey, ra, n, remote=True):
                status = REM_ACCESS_ERR
            elif self.fail_next is not None:
                status, self.fail_next = self.fail_next, None
            else:
                status = SUCCESS
                ctypes.memmove(ra, la, n)
                self.lkeys_used.add(lkey)
                self.writes += 1
                self.bytes += n
            if status != SUCCESS:
                qp.state = "error"
            if sig or status != SUCCESS:
                done.append((wr_id, status, qp))
        qp.pending.clear()
        with qp.cq.lock:
            if len(qp.cq.q) + len(done) > qp.cq.capacity:  # completions lost: a fatal CQ error
                qp.cq.overrun = True
                qp.state = "error"
                done = done[: max(0, qp.cq.capacity - len(qp.cq.q))]
            qp.cq.q.extend(done)

    def to_error(self, qp: _QP) -> None:
        with self.lock:
            if qp.state not in ("closed", "reset"):
                qp.state = "error"  # what is posted is flushed at the next poll, link or not

    def poll(self, cq: _CQ, n: int) -> list[tuple[int, int]]:
        with self.lock:
            for qp in list(self.qps.values()):
                if qp.cq is cq and qp.pending and (not self.stall or qp.state == "error"):
                    self._execute(qp)
            with cq.lock:
                if cq.overrun:
                    raise RdmaError("ibv_poll_cq failed: completion queue overrun")
                got = [cq.q.popleft() for _ in range(min(n, len(cq.q)))]
            for wr_id, _status, qp in got:  # a completion retires its work request and those before it
                while qp.unretired:
                    if qp.unretired.popleft() == wr_id:
                        break
        return [(w, st) for w, st, _ in got]

    def close(self, obj: Any) -> None:
        self.events.append((type(obj).__name__, time.monotonic()))
        obj.close()

    def close_device(self, res: dict[str, Any]) -> None:
        self.events.append(("device", time.monotonic()))
        res["cq"].close()


def install(monkeypatch: Any) -> Fabric:
    """Replace pdkv's verbs layer with a fresh simulated fabric for one test."""
    from pdkv import _ffi

    fabric = Fabric()
    for name in (
        "available",
        "rdma_devices",
        "require_device",
        "open_device",
        "register",
        "register_gpu",
        "create_rc_qp",
        "connect_qp",
        "post_writes",
        "to_error",
        "poll",
        "close",
        "close_device",
    ):
        monkeypatch.setattr(_ffi.verbs, name, getattr(fabric, name))
    return fabric
