"""Moving KV cache from prefill ranks into the blocks decode granted, layer by layer.

Decode runs a :class:`DecodeReceiver` (control plane on a ZeroMQ ROUTER socket, TCP data
listener, the :class:`~pdkv.scheduler.DecodeScheduler` behind them). Each prefill rank runs
a :class:`PrefillSender` (DEALER socket, a data thread that writes layer after layer while
the engine computes the next one).

Transports, chosen per peer (``auto``: from a host cache shm on the same host, else rdma
when both sides have a device and decode serves it, else tcp; from a GPU cache cuda_ipc
where decode serves it and the GPUs can map each other's memory, else shm):

``shm``  prefill opens decode's shared buffers by name and writes into them directly,
         then reports each layer (``LayerDone``).
``tcp``  prefill streams framed payloads over several connections; decode ``recv_into``s
         each payload straight into the granted blocks after checking the frame against
         the live grant (token, lease, block range, offsets). Layers land when all their
         bytes arrived.
``rdma`` (pyverbs) decode registers each buffer once and sends address, length and rkey
         with its queue pair's record in the welcome; prefill posts RDMA writes coalesced
         over contiguous runs, checks every completion, then reports each layer
         (``LayerDone``). Dropping a dead peer's queue pair is its fence. Not run on RDMA
         hardware (see docs/TRANSPORTS.md); tested against a simulated verbs layer.

Every request ends in a definite outcome on both sides in bounded time: decode sends
``Outcome`` (received, failed, expired, aborted); prefill fails a request locally when
decode stops answering heartbeats.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hmac
import logging
import os
import queue
import select
import selectors
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from . import _ffi
from .errors import (
    ClosedError, GrantViolation, LayoutError, PdkvError, PdkvTimeoutError, PeerError,
    ProtocolError, RdmaError, RequestError, TransferError)
from .layout import CacheSpec, KVLayout, Segment, tp_segments
from .protocol import (
    MAX_BATCH_ERROR, MAX_BATCH_ITEMS, PROTOCOL_VERSION, Abort, Auth, Challenge, Codec, Complete, CompleteBatch,
    CudaDesc, ErrorMsg, GrantMsg, IpcSection, RdmaEndpointDesc, RdmaOffer,
    MAX_BATCH_BLOCKS, MAX_GRANT_BLOCKS, MAX_ID, MAX_NUM_TOKENS, GrantBatch, Heartbeat, Hello, LayerBatch, LayerDone, Message, Outcome, OutcomeBatch,
    ReserveBatch, ReserveReq, Welcome, data_auth_mac, is_unauthenticated, layout_desc, new_nonce, to_plain)
from .scheduler import DecodeScheduler, Event, WriteTicket
from .rdma import EndpointInfo, RdmaTarget, RdmaWriter, RemoteRegion
from .cuda_ipc import IpcMapping, export_gpu_caches, parse_ipc_section, unreachable
from .shm import SharedBuffer
from .procs import boot_id, pid_alive

__all__ = ["DecodeReceiver", "PrefillSender", "SendGrant", "RequestOutcome", "boot_id", "default_copy_threads",
           "FRAME_HEADER"]

# TCP data frame: header (magic, version, kind, dst_rank, token, layer, tensor, pad,
# reserved, nitems, offset, length, count, dst_stride), then nitems (grant index, blocks)
# pairs, then the payload: for each item, its blocks' pieces in order. One frame carries
# many blocks of one segment, received with one recvmsg_into straight into the blocks.
_log = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("<4sBBHQIHHIIIIII")
FRAME_ITEM = struct.Struct("<II")
MAX_FRAME_ITEMS = 1024
_MAGIC = b"PDKV"
_K_AUTH, _K_DATA = 1, 2
MAX_FRAME_PAYLOAD = 256 << 20
_ITEMS_PER_FRAME = 64  # blocks per frame: one syscall each side moves them all
_FRAME_BYTES = 4 << 20  # a frame's payload past its first item (runs of blocks are cut to fit): 4 MiB
# frames beat 16 and 64 MiB ones by 5-15 % on the H200 x2 host (docs/perf-logs/h200x2-tcp-frame-ab-s7.log)
_GATHER_PIECE = 4 << 20  # bytes per np.take call when shm copies are shared among threads
_POLL_S = 0.25  # receive-side socket timeout: how often a blocked receive checks for close


# plain ints: pyzmq's enum flags cost microseconds per operation on the hot path
_NB, _MORE_NB = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class _Channel:
    """A zmq socket that any thread may send on: a send goes out at once, under a lock,
    instead of hopping through the I/O thread (each hop costs a thread wake-up, and the
    control round trips are what a one-block request waits for). The I/O thread waits on
    the socket's file descriptor and a wake pipe with an OS poll and receives under the
    same lock. The callable given to :meth:`send` runs under the lock too, so message
    sequence numbers go out in the order they were assigned.

    zmq's descriptor is edge-triggered: any operation on the socket, a send included,
    may consume the signal that input is waiting, so after each send the sender checks
    ``EVENTS`` and wakes the I/O thread if input is there."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._poll = select.poll()
        self._poll.register(sock.getsockopt(zmq.FD), select.POLLIN)
        self._poll.register(self._r, select.POLLIN)
        self._closed = False
        # the pipe's fds are touched only under this lock and never after close(): a late
        # wake-up must not write into whatever file reuses the number
        self._pipe_lock = threading.Lock()

    def wake(self) -> None:
        with self._pipe_lock:
            if self._w < 0:
                return
            try:
                os.write(self._w, b"x")
            except OSError:  # pipe full: a wake-up is pending anyway
                pass

    def send(self, frames: Callable[[], list[bytes]]) -> bool:
        """Send the frames ``frames()`` returns; False if the socket would block or is closed."""
        with self.lock:
            if self._closed:
                return False
            parts = frames()
            try:
                for f in parts[:-1]:
                    self.sock.send(f, _MORE_NB)
                self.sock.send(parts[-1], _NB)
            except zmq.ZMQError:
                return False
            pending = bool(self.sock.getsockopt(_EVENTS) & _POLLIN)
        if pending:
            self.wake()
        return True

    def _drain(self) -> list[list[bytes]] | None:
        out: list[list[bytes]] = []
        with self.lock:
            if self._closed:
                return None
            try:
                while len(out) < 256 and self.sock.getsockopt(_EVENTS) & _POLLIN:
                    out.append(self.sock.recv_multipart(_NB))
            except zmq.Again:
                pass
            except zmq.ZMQError:
                return None
        return out

    def wait(self, timeout_ms: int) -> list[list[bytes]] | None:
        """Messages waiting now; if none, wait up to ``timeout_ms`` for input or a wake-up.
        None once the channel is closed."""
        out = self._drain()
        if out is None or out:
            return out
        self._poll.poll(timeout_ms)
        with self._pipe_lock:
            if self._r >= 0:
                try:
                    os.read(self._r, 4096)
                except BlockingIOError:
                    pass
        return self._drain()

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self.sock.close(0)
        with self._pipe_lock:
            os.close(self._r)
            os.close(self._w)
            self._r = self._w = -1


def default_copy_threads() -> int:
    """shm copy threads a :class:`PrefillSender` uses by default: a quarter of the CPUs this
    process may run on, at least 2 (where it has 2) and at most 4. On the 2-vCPU dev VM, with
    decode on the same 2 vCPUs, two threads moved 32 KiB / 128 KiB blocks at a median 16.5 /
    19.7 GiB/s against one's 13.0 / 15.2 (six runs each, docs/perf-logs/devvm-copy-threads-ab-s7.log):
    one thread leaves memory idle between its misses; the threads run only while a layer is written."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return min(4, max(min(2, n), n // 4))


# ---------------------------------------------------------------------- pieces

@dataclass(frozen=True, slots=True)
class _Group:
    """Writes of one segment for one layer: piece i covers grant blocks
    ``gi[i]..gi[i]+nb[i]`` starting at ``src[i]`` / ``dst[i]``; each block holds
    ``seg.count`` pieces of ``seg.length`` bytes (a run of whole blocks is one piece)."""

    seg: Segment
    gi: Any
    nb: Any
    src: Any
    dst: Any


def _runs(sb: Any, db: Any) -> tuple[Any, Any]:
    """Start indices and lengths of runs where both id sequences advance by one."""
    import numpy as np

    brk = np.ones(sb.size, dtype=bool)
    brk[1:] = (np.diff(sb) != 1) | (np.diff(db) != 1)
    starts = np.flatnonzero(brk)
    return starts, np.diff(np.append(starts, sb.size))


def _tcp_items(gi: Any, nb: Any, src: Any, unit: int, cap: int) -> tuple[Any, Any, Any]:
    """A group's items ``(first grant index, blocks, source address)`` with every run of more
    than ``cap // unit`` blocks cut into runs of at most that many (``unit``: bytes a block
    of the run carries; only whole packed blocks form runs, so a run's source is contiguous).
    Decode refuses a frame of more than MAX_FRAME_PAYLOAD bytes: one long run of a long
    request's blocks used to make one."""
    from .swap import split_runs

    most = max(1, cap // unit)
    if not nb.size or int(nb.max()) <= most:
        return gi, nb, src
    rep, at, nb2 = split_runs(nb, most)  # at: blocks into its item
    return gi[rep] + at, nb2, src[rep] + at * unit


def _tcp_frames(nb: Any, unit: int, cap: int, most: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` item ranges, one per frame, in order: at most ``most`` items, and no item
    added past the first once the payload (``nb[i] * unit`` bytes an item) would pass ``cap``."""
    n = int(nb.size)
    if n and int(nb.max()) == 1:
        step = max(1, min(most, cap // unit))
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    out, lo, size = [], 0, 0
    for i, b in enumerate((nb * unit).tolist()):
        if i > lo and (i - lo == most or size + b > cap):
            out.append((lo, i))
            lo, size = i, 0
        size += b
    if n:
        out.append((lo, n))
    return out


def _plan_layer(segs: Sequence[Segment], src_layout: KVLayout, dst_layout: KVLayout, src: CacheSpec,
                dsts: dict[int, CacheSpec] | None, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                layer: int) -> list[_Group]:
    import numpy as np

    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    runs = None
    out = []
    for g in segs:
        sbase, sstride = src.region(layer, g.tensor)
        tb_s, tb_d = src_layout.tensor_block_bytes(g.tensor), dst_layout.tensor_block_bytes(g.tensor)
        # without destination addresses (tcp: decode computes them) the buffer's packed layout applies
        dbase, dstride = dsts[g.dst_rank].region(layer, g.tensor) if dsts is not None else (0, tb_d)
        # a run of blocks is one contiguous piece only if the segment is the whole block on
        # both sides and blocks are packed (stride == block bytes) on both sides
        whole = (g.count == 1 and g.src_offset == 0 and g.dst_offset == 0 and g.length == tb_s == tb_d
                 and sstride == tb_s and dstride == tb_d)
        if whole:
            if runs is None:
                runs = _runs(sb, db)
            gi, nb = runs
        else:
            gi, nb = np.arange(sb.size), np.ones(sb.size, dtype=np.int64)
        out.append(_Group(g, gi, nb, sbase + sb[gi] * sstride + g.src_offset, dbase + db[gi] * dstride + g.dst_offset))
    return out


def _layer_bytes(segs: Sequence[Segment], nblocks: int) -> int:
    return sum(g.nbytes for g in segs) * nblocks


# ---------------------------------------------------------------------- decode side

@dataclass
class _Peer:
    ident: bytes
    codec: Codec
    instance: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pid: int = 0
    same_host: bool = False
    transport: str = ""
    session_id: bytes = b""
    last_seen: float = 0.0
    layout: KVLayout | None = None
    segs_by_src: dict[int, list[Segment]] = field(default_factory=dict)
    block_bytes_by_src: dict[int, int] = field(default_factory=dict)
    rdma_qpn: int = 0


@dataclass
class _Handshake:
    """A Hello answered with a Challenge, waiting for the peer's Auth (holds no resources)."""

    codec: Codec
    hello: Hello
    layout: KVLayout
    segs: list[Segment]
    transport: str
    same_host: bool
    nonce: bytes
    deadline: float


@dataclass
class _Inflight:
    request_id: str
    instance: str
    token: int
    blocks: list[int]
    remaining: list[int]
    src_tp: int
    completes: set[int] = field(default_factory=set)
    failed_completes: list[str] = field(default_factory=list)
    peers: set[bytes] = field(default_factory=set)
    landed: int = 0
    done: bool = False
    run_len: list[int] = field(default_factory=list)  # consecutive destination ids from index i
    location: str = "buffer"  # where the blocks are: "buffer", or "gpu" (cuda_ipc writes them)
    # tcp: which (layer, source rank, segment) pieces of which blocks were admitted, so no
    # piece is written twice and the byte count can only fill a layer with distinct pieces
    cov: dict[tuple[int, int, int], bytearray] = field(default_factory=dict)
    # shm/rdma/cuda_ipc: blocks each source rank reported for each layer
    reported: dict[tuple[int, int], int] = field(default_factory=dict)


@dataclass
class _PreAuth:
    """A data connection before authentication: read by the accept thread, no thread of its own."""

    deadline: float
    buf: bytearray
    got: int = 0
    nonce: bytes = b""
    session_id: bytes = b""


_SEND_BATCH = 512  # items one batch message carries as sent (protocol limit: MAX_BATCH_ITEMS)
_AUTH_HEAD = FRAME_HEADER.size + 16  # AUTH frame header + session id
# accept() errors that say nothing about the listener: out of descriptors or memory, a
# connection reset before it was taken; back off and keep accepting
_ACCEPT_RETRY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
                           errno.EPROTO, errno.EPERM, errno.EINTR, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                           errno.ENETUNREACH, errno.ENOPROTOOPT, errno.EOPNOTSUPP})


def _clip(text: str) -> str:
    """``text`` cut to what one batch item may carry (``MAX_BATCH_ERROR`` characters)."""
    return text if len(text) <= MAX_BATCH_ERROR else text[:MAX_BATCH_ERROR - 3] + "..."


class _RateLimitedLog:
    """One warning per key per ``every`` seconds: a flood of refused connections must not
    become a flood of log lines."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.every:
            self._last[key] = now
            _log.warning(msg, *args)


class DecodeReceiver:
    """Decode side of the transfer path: serves grants, receives writes, feeds the scheduler.

    Parameters
    ----------
    scheduler:
        The decode scheduler. ``direct_to_gpu`` needs ``cuda_ipc`` served (and
        ``gpu_caches``): only a cuda_ipc peer is granted GPU blocks; shm, tcp and rdma peers
        are always granted buffer blocks.
    layouts:
        The layout of each decode rank hosted by this receiver (``tp_rank`` set).
    buffers:
        One :class:`~pdkv.shm.SharedBuffer` per rank, each holding ``buffer_blocks`` blocks.
    control:
        ZeroMQ endpoint to bind, e.g. ``tcp://127.0.0.1:0`` (port chosen) or ``ipc://...``.
    data_host:
        Address for the TCP data listener (port chosen by the kernel).
    secret:
        Shared secret (>= 16 bytes); peers without it are refused.
    transports:
        Transports offered, in order of preference.
    peer_timeout_s:
        A prefill peer silent this long is considered dead and fenced: its data
        connections are closed and their threads joined before its blocks are released.
    io_timeout_s:
        Bound on a stalled TCP payload, and the base of every frame's deadline.
    min_data_rate:
        Bytes per second a tcp frame must at least move: a frame of ``n`` payload bytes
        must arrive whole within ``io_timeout_s + n / min_data_rate`` of its header, or its
        connection is closed and its request fails (a trickling peer cannot keep a write
        open past its grant). Default 8 MiB/s.
    auth_timeout_s:
        A data connection must authenticate within this many seconds of being accepted,
        and a control handshake must complete within it.
    max_pending_connections:
        Data connections accepted but not yet authenticated, at most; more are closed at
        once (logged). Pre-authentication connections are read by the accept thread and
        hold no thread or buffer of their own.
    max_connections:
        Authenticated data connections, at most (each has a thread).
    max_handshakes:
        Control handshakes in progress (Hello answered, Auth awaited), at most.
    auto_tick:
        Call ``scheduler.tick()`` from the receiver loop (every ~2 ms), for engines that
        do not tick themselves.
    data_advertise:
        ``host:port`` prefill should connect to for data, when it differs from the
        listener (NAT, port forwarding).
    rdma_device:
        With ``rdma`` in ``transports``: the RDMA device (default: the first). Every
        buffer is registered at construction; RdmaUnavailableError if pyverbs or a
        device is missing.
    gpu_caches:
        With ``cuda_ipc`` in ``transports``: each rank's GPU cache (a
        :class:`~pdkv.layout.CacheSpec` with ``device`` set, at least as many blocks as
        the scheduler's GPU pool), exported to same-host prefill ranks as CUDA IPC handles
        of the allocations that hold it. The caches must stay allocated while the
        receiver lives.

    Ownership: the receiver owns its sockets and threads (:meth:`close`); buffers and the
    scheduler stay the caller's.
    """

    def __init__(self, scheduler: DecodeScheduler, layouts: Sequence[KVLayout], buffers: Sequence[SharedBuffer],
                 buffer_blocks: int, *, control: str = "tcp://127.0.0.1:0", data_host: str = "127.0.0.1",
                 secret: bytes | None = None, transports: Sequence[str] = ("shm", "tcp"),
                 peer_timeout_s: float = 10.0, io_timeout_s: float = 5.0, auto_tick: bool = False,
                 data_advertise: str | None = None, rdma_device: str | None = None,
                 gpu_caches: Sequence[CacheSpec] | None = None, min_data_rate: float = 8 << 20,
                 auth_timeout_s: float = 5.0, max_pending_connections: int = 64, max_connections: int = 1024,
                 max_handshakes: int = 256) -> None:
        for t in transports:
            if t not in ("shm", "tcp", "rdma", "cuda_ipc"):
                raise ValueError(f"transport {t!r} is not served by DecodeReceiver (shm, tcp, rdma, cuda_ipc)")
        if scheduler.options.direct_to_gpu and "cuda_ipc" not in transports:
            raise ValueError("shm, tcp and rdma write into the CPU buffer: create the scheduler with "
                             "SchedulerOptions(direct_to_gpu=False), or serve cuda_ipc with gpu_caches")
        if ("cuda_ipc" in transports) != (gpu_caches is not None):
            raise ValueError("cuda_ipc needs gpu_caches (each rank's GPU cache), and gpu_caches needs cuda_ipc")
        if len(layouts) != len(buffers) or not layouts:
            raise ValueError("give one buffer per decode rank layout")
        for name, v in (("peer_timeout_s", peer_timeout_s), ("io_timeout_s", io_timeout_s),
                        ("min_data_rate", min_data_rate), ("auth_timeout_s", auth_timeout_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name}={v!r} must be a positive number")
        for name, n in (("max_pending_connections", max_pending_connections), ("max_connections", max_connections),
                        ("max_handshakes", max_handshakes)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name}={n!r} must be a positive integer")
        self.scheduler = scheduler
        self.layouts = list(layouts)
        self.ranks = [lay.tp_rank for lay in layouts]
        self.tp_size = layouts[0].tp_size
        self.buffers = list(buffers)
        self.buffer_blocks = buffer_blocks
        self.specs = {lay.tp_rank: CacheSpec.for_buffer(lay, buffer_blocks, b.address)
                      for lay, b in zip(layouts, buffers)}
        self._rank_info = {lay.tp_rank: (b.buf, b.address, self.specs[lay.tp_rank], lay)
                           for lay, b in zip(layouts, buffers)}
        for lay, b in zip(layouts, buffers):
            if b.size < CacheSpec.buffer_bytes(lay, buffer_blocks):
                raise ValueError(f"buffer {b.name} holds {b.size} bytes; rank {lay.tp_rank} needs "
                                 f"{CacheSpec.buffer_bytes(lay, buffer_blocks)} for {buffer_blocks} blocks")
        self.secret = secret
        Codec(secret)  # checks the secret now (ValueError), not at the first hello
        self.transports = list(transports)
        self.peer_timeout_s = peer_timeout_s
        self.io_timeout_s = io_timeout_s
        self.min_data_rate = float(min_data_rate)
        self.auth_timeout_s = auth_timeout_s
        self.max_pending_connections = max_pending_connections
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.auto_tick = auto_tick
        self.instance = f"decode-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stats = {"frames": 0, "bytes": 0, "frames_rejected": 0, "messages_rejected": 0, "peers_dead": 0,
                      "connections_refused": 0, "auth_failed": 0, "accept_errors": 0, "loop_errors": 0,
                      "frames_cut": 0}
        self._stats_lock = threading.Lock()
        self._warn = _RateLimitedLog()
        self._lock = threading.RLock()
        # outcomes of requests ended while one batch message is handled: sent together
        self._outbox = threading.local()
        self._peers: dict[bytes, _Peer] = {}
        self._pending: dict[bytes, _Handshake] = {}
        self._sessions: dict[bytes, bytes] = {}  # session id -> peer ident
        self._inflight: dict[str, _Inflight] = {}
        self._by_token: dict[int, _Inflight] = {}
        self._grants: dict[tuple[str, str], GrantMsg] = {}
        self._closed = threading.Event()
        self._rdma: RdmaTarget | None = None
        self._ipc: dict[str, Any] = {}
        self._ipc_devices = sorted({c.device for c in gpu_caches or () if c.device is not None})
        self._ipc_reach: dict[str, str | None] = {}  # prefill GPU uuid -> why it cannot map ours
        if gpu_caches is not None:
            # raises CudaUnavailableError without CUDA, LayoutError for a cache that is not
            # device memory or that one handle per allocation cannot describe
            self._ipc = export_gpu_caches(self.layouts, list(gpu_caches), scheduler.gpu.num_total)
        if "rdma" in self.transports:
            # every buffer registered once for remote writes; raises RdmaUnavailableError
            # (saying what is missing) on a host without pyverbs or an RDMA device
            self._rdma = RdmaTarget([(lay.tp_rank, b.address, b.size) for lay, b in zip(layouts, buffers)],
                                    device=rdma_device)
        self._ctx = zmq.Context()
        try:  # a half-built receiver (address in use, say) leaves nothing open
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.MAXMSGSIZE, 2 << 20)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self._router.bind(control)
            self.control_address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._lsock = socket.create_server((data_host, 0), backlog=128)
        except BaseException:
            self._ctx.destroy(linger=0)
            if self._rdma is not None:
                self._rdma.close()
            raise
        self._ch = _Channel(self._router)
        self._lsock.setblocking(False)
        self.data_address = f"{data_host}:{self._lsock.getsockname()[1]}"
        # what prefill is told to connect to (differs behind NAT, port forwarding, a proxy)
        self.data_advertise = data_advertise or self.data_address
        self._conns: dict[socket.socket, bytes] = {}  # authenticated data connection -> peer ident
        self._conn_threads: dict[socket.socket, threading.Thread] = {}
        self._threads: list[threading.Thread] = []
        self._user_listener = scheduler.listener
        scheduler.listener = self._on_event
        self._start(self._control_loop, "pdkv-decode-control")
        self._start(self._accept_loop, "pdkv-decode-accept")

    def _start(self, fn: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop threads, close sockets, restore the scheduler's listener. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._ch.wake()
        for t in self._threads:  # the accept thread closes the listener and pending connections
            t.join(timeout)
        with self._lock:
            conns = list(self._conns)
            threads = list(self._conn_threads.values())
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout)
        self._ch.close()
        self._ctx.term()
        if self._rdma is not None:
            self._rdma.close()
        self.scheduler.listener = self._user_listener

    def __enter__(self) -> DecodeReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, ident: bytes, msg: Message) -> None:
        """Send to a peer from any thread (dropped if the peer is gone or its queue is full)."""
        peer = self._peers.get(ident)
        if peer is not None:
            self._ch.send(lambda: [ident, *peer.codec.encode(msg)])

    # ------------------------------------------------------------------ control loop
    def _control_loop(self) -> None:
        last_check = time.monotonic()
        while not self._closed.is_set():
            got = self._ch.wait(2 if self.auto_tick else 50)
            if got is None:
                break
            for frames in got:
                # one message, whatever it holds, never ends the loop that serves every peer
                try:
                    self._on_frames(frames)
                except Exception:
                    self._count("loop_errors")
                    self._count("messages_rejected")
                    _log.exception("control message handling failed (message dropped)")
            now = time.monotonic()
            try:
                if self.auto_tick:
                    self.scheduler.tick()
                if now - last_check > 0.1:
                    last_check = now
                    self._check_peers(now)
            except Exception:
                self._count("loop_errors")
                _log.exception("decode housekeeping failed (retried next round)")

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._count("messages_rejected")
            return
        ident, rest = frames[0], frames[1:]
        peer = self._peers.get(ident)
        hs = self._pending.get(ident) if peer is None else None
        codec = peer.codec if peer is not None else hs.codec if hs is not None else Codec(self.secret)
        try:
            msg = codec.decode(rest)
        except ProtocolError as exc:
            self._count("messages_rejected")
            if peer is None:  # answer once, unauthenticated, so the operator sees why
                if hs is not None:  # an Auth that does not verify under this session's key
                    del self._pending[ident]
                    self._count("auth_failed")
                refusal = [ident, *Codec(None).encode(ErrorMsg("refused", str(exc)))]
                self._ch.send(lambda: refusal)
            return
        if peer is None:
            if hs is not None:
                del self._pending[ident]
                if not isinstance(msg, Auth) or not hmac.compare_digest(msg.nonce, hs.nonce):
                    self._count("messages_rejected")
                    self._count("auth_failed")
                    return
                self._accept_session(ident, hs)
            elif isinstance(msg, Hello):
                self._on_hello(ident, codec, msg)
            else:
                self._count("messages_rejected")
            return
        peer.last_seen = time.monotonic()
        try:
            self._dispatch(peer, msg)
        except PdkvError as exc:
            self._count("messages_rejected")
            rid = getattr(msg, "request_id", "")
            self._send(ident, ErrorMsg(type(exc).__name__, f"{rid}: {exc}" if rid else str(exc)))

    def _on_hello(self, ident: bytes, codec: Codec, h: Hello) -> None:
        """Check a Hello and answer it with a Challenge; the session starts only on a valid
        Auth (:meth:`_accept_session`). Nothing is allocated for the peer before that."""
        def refuse(why: str) -> None:
            self._ch.send(lambda: [ident, *codec.encode(ErrorMsg("refused", why))])

        try:
            lay = KVLayout.from_descriptor(msgspec.structs.asdict(h.layout))
            lay.check_compatible(self.layouts[0])
            if lay.tp_size != h.tp_size or lay.tp_rank != h.tp_rank:
                raise LayoutError(f"hello says rank {h.tp_rank}/{h.tp_size}, layout says {lay.tp_rank}/{lay.tp_size}")
            segs = [g for g in tp_segments(lay, self.layouts[0]) if g.dst_rank in self.specs]
        except PdkvError as exc:
            refuse(str(exc))
            return
        if len(self._pending) >= self.max_handshakes:
            self._count("connections_refused")
            self._warn.warning("handshakes", "pdkv decode: %d control handshakes in progress (max_handshakes); "
                               "refusing more until they complete or time out", len(self._pending))
            refuse("too many handshakes in progress; retry later")
            return
        same = h.boot_id == boot_id()
        with self._lock:
            sibling = next((p.transport for p in self._peers.values() if p.instance == h.instance), None)
        no_ipc = None  # why cuda_ipc cannot serve this peer, when it offered it
        if "cuda_ipc" in h.transports and "cuda_ipc" in self.transports and same:
            no_ipc = self._ipc_unreachable(h.cuda)
        transport = next((t for t in h.transports if t in self.transports and (t not in ("shm", "cuda_ipc") or same)
                          and (t != "rdma" or h.rdma is not None) and (t != "cuda_ipc" or no_ipc is None)
                          # the ranks of one instance share a grant: GPU blocks only if all write them
                          and (sibling is None or (t == "cuda_ipc") == (sibling == "cuda_ipc"))), None)
        if transport is None:
            refuse(f"no common transport: prefill offers {h.transports}, decode serves {self.transports}"
                   + ("" if same else " (shm and cuda_ipc need the same host)")
                   + (f" (cuda_ipc: {no_ipc}; use shm)" if no_ipc else "")
                   + (f" (another rank of instance {h.instance!r} uses {sibling}; cuda_ipc is all ranks or none)"
                      if sibling is not None else ""))
            return
        nonce = new_nonce()
        frames = codec.encode(Challenge(nonce))  # under the secret
        codec.set_session(h.nonce, nonce)
        self._pending[ident] = _Handshake(codec, h, lay, segs, transport, same, nonce,
                                          time.monotonic() + self.auth_timeout_s)
        self._ch.send(lambda: [ident, *frames])

    def _accept_session(self, ident: bytes, hs: _Handshake) -> None:
        """The peer proved the session key: make the session, answer Welcome."""
        h, codec, transport = hs.hello, hs.codec, hs.transport
        rdma: RdmaOffer | None = None
        rdma_qpn = 0
        if transport == "rdma":
            assert self._rdma is not None and h.rdma is not None
            try:
                ep = self._rdma.accept(EndpointInfo.from_dict(msgspec.structs.asdict(h.rdma)))
            except PdkvError as exc:
                refusal = ErrorMsg("refused", f"rdma: {exc}")
                self._ch.send(lambda: [ident, *codec.encode(refusal)])
                return
            rdma_qpn = ep.qpn
            rdma = msgspec.convert({"endpoint": ep.to_dict(),
                                    "regions": [dict(rank=r, **reg.to_dict()) for r, reg in self._rdma.regions.items()]},
                                   RdmaOffer)
        peer = _Peer(ident, codec, h.instance, h.tp_rank, h.tp_size, h.pid, hs.same_host, transport,
                     os.urandom(16), time.monotonic(), hs.layout, rdma_qpn=rdma_qpn)
        for g in hs.segs:
            peer.segs_by_src.setdefault(g.src_rank, []).append(g)
        peer.block_bytes_by_src = {r: _layer_bytes(gs, 1) for r, gs in peer.segs_by_src.items()}
        ipc = msgspec.convert(self._ipc, IpcSection) if transport == "cuda_ipc" else None
        welcome = Welcome(PROTOCOL_VERSION, self.instance, self.tp_size, self.ranks,
                          [layout_desc(x) for x in self.layouts], transport,
                          [b.name for b in self.buffers] if transport in ("shm", "cuda_ipc") else [],
                          self.buffer_blocks, self.data_advertise if transport == "tcp" else "", peer.session_id,
                          rdma, ipc)
        frames = codec.encode(welcome)  # under the session key
        with self._lock:
            self._peers[ident] = peer
            self._sessions[peer.session_id] = ident
        self._ch.send(lambda: [ident, *frames])

    def _ipc_unreachable(self, cuda: CudaDesc | None) -> str | None:
        """Why a prefill whose ``Hello.cuda`` is ``cuda`` cannot map our GPU caches (None: it can)."""
        uid = cuda.device_uuid if cuda is not None else None
        if not isinstance(uid, str) or not 0 < len(uid) <= 64:
            return "the hello names no GPU"
        if uid not in self._ipc_reach:
            try:
                self._ipc_reach[uid] = unreachable(uid, self._ipc_devices)
            except PdkvError as exc:
                self._ipc_reach[uid] = f"peer access could not be checked: {exc}"
        return self._ipc_reach[uid]

    def _dispatch(self, peer: _Peer, msg: Message) -> None:
        if isinstance(msg, Heartbeat):
            self._send(peer.ident, Heartbeat(time.time()))
        elif isinstance(msg, ReserveReq):
            self._on_reserve(peer, msg.request_id, msg.num_tokens)
        elif isinstance(msg, ReserveBatch):
            with self._replies_together():
                for rid, num_tokens in msg.items:  # each item stands alone, as a ReserveReq would
                    try:
                        self._on_reserve(peer, rid, num_tokens)
                    except PdkvError as exc:
                        self._count("messages_rejected")
                        self._send(peer.ident, ErrorMsg(type(exc).__name__, f"{rid}: {exc}"))
        elif isinstance(msg, LayerDone):
            self._layers_done(peer, msg.request_id, msg.token, msg.layers, msg.blocks)
        elif isinstance(msg, LayerBatch):
            with self._replies_together():
                for rid, token, blocks in msg.items:  # each item stands alone, as a LayerDone would
                    try:
                        self._layers_done(peer, rid, token, [msg.layer], blocks)
                    except PdkvError as exc:
                        self._count("messages_rejected")
                        self._send(peer.ident, ErrorMsg(type(exc).__name__, f"{rid}: {exc}"))
        elif isinstance(msg, Complete):
            self._completed(peer, msg.request_id, msg.token, msg.ok, msg.error)
        elif isinstance(msg, CompleteBatch):
            with self._replies_together():
                for rid, token, ok, error in msg.items:  # each item stands alone, as a Complete would
                    try:
                        self._completed(peer, rid, token, ok, error)
                    except PdkvError as exc:
                        self._count("messages_rejected")
                        self._send(peer.ident, ErrorMsg(type(exc).__name__, f"{rid}: {exc}"))
        elif isinstance(msg, Abort):
            with self._lock:
                inf = self._inflight.get(msg.request_id)
            if inf is None or peer.ident not in inf.peers:
                raise GrantViolation(f"request {msg.request_id!r}: no grant of this session")
            self._finish(inf, None)
            try:
                self.scheduler.fail(msg.request_id, f"prefill aborted: {msg.reason}")
            except PdkvError:
                pass
        else:
            raise ProtocolError(f"unexpected message {type(msg).__name__} from prefill")

    def _completed(self, peer: _Peer, rid: str, token: int, ok: bool, error: str) -> None:
        """This prefill rank finished every write of ``rid`` (or reports that it failed)."""
        inf = self._live(peer, rid, token)
        with self._lock:
            if not ok:
                inf.failed_completes.append(error or "prefill reported a failed write")
            inf.completes.add(peer.tp_rank)
        self._maybe_complete(inf)

    def _layers_done(self, peer: _Peer, rid: str, token: int, layers: Sequence[int], blocks: int) -> None:
        """Credit this rank's writes of ``layers`` for ``blocks`` blocks (0: the whole grant)."""
        if peer.transport not in ("shm", "rdma", "cuda_ipc"):
            raise ProtocolError("LayerDone is for the shm, rdma and cuda_ipc transports only")
        inf = self._live(peer, rid, token)
        if inf.location == "gpu" and peer.transport != "cuda_ipc":
            raise GrantViolation(f"request {rid!r} holds GPU blocks: only cuda_ipc writes them")
        n = blocks or len(inf.blocks)
        if n > len(inf.blocks):
            raise GrantViolation(f"request {rid!r}: {blocks} blocks reported, {len(inf.blocks)} granted")
        nl = len(inf.remaining)
        if any(not 0 <= layer < nl for layer in layers) or len(set(layers)) != len(layers):
            raise ProtocolError(f"request {rid!r}: layers {list(layers)[:8]} out of range or repeated")
        with self._lock:  # a rank reports at most every block of each layer, once
            keys = [(layer, peer.tp_rank) for layer in layers]
            over = [k[0] for k in keys if inf.reported.get(k, 0) + n > len(inf.blocks)]
            if over:
                raise GrantViolation(f"request {rid!r}: rank {peer.tp_rank} reported more blocks of layers "
                                     f"{over[:8]} than were granted")
            for k in keys:
                inf.reported[k] = inf.reported.get(k, 0) + n
        nbytes = peer.block_bytes_by_src.get(peer.tp_rank, 0) * n
        for layer in layers:
            self._credit(inf, layer, nbytes)

    def _live(self, peer: _Peer, rid: str, token: int) -> _Inflight:
        """The live grant ``rid`` with ``token``, held by ``peer``'s session, or the precise error."""
        with self._lock:
            inf = self._inflight.get(rid)
        if inf is None or inf.token != token:
            self.scheduler.check_write(rid, token)  # raises the precise error
            raise GrantViolation(f"request {rid!r}: no such grant here")
        if peer.ident not in inf.peers:
            raise GrantViolation(f"request {rid!r}: the grant is not this session's")
        return inf

    def _on_reserve(self, peer: _Peer, rid: str, num_tokens: int) -> None:
        key = (peer.instance, rid)
        with self._lock:
            g = self._grants.get(key)
            if g is not None:  # another rank of the same prefill instance: same grant
                inf = self._inflight.get(rid)
                if inf is not None:
                    inf.peers.add(peer.ident)
                self._send_grant(peer.ident, g)
                return
        nblk = self.layouts[0].blocks_for_tokens(num_tokens)
        if nblk > MAX_GRANT_BLOCKS:  # its grant could not be sent: refuse now, holding nothing
            self._send_grant(peer.ident, GrantMsg(rid, "rejected", reason=f"{num_tokens} tokens need {nblk} blocks, "
                                                  f"more than the {MAX_GRANT_BLOCKS} one grant may carry"))
            return
        res = self.scheduler.reserve(rid, num_blocks=nblk, peer=peer.instance, gpu_ok=peer.transport == "cuda_ipc")
        if res.grant is None:
            g = GrantMsg(rid, res.outcome, reason=res.reason)
            if res.outcome == "queued":
                with self._lock:
                    self._grants[key] = g
                    self._inflight[rid] = _Inflight(rid, peer.instance, 0, [], [], peer.tp_size, peers={peer.ident})
            self._send_grant(peer.ident, g)
            return
        self._register_grant(peer, key, res.grant)

    def _register_grant(self, peer: _Peer, key: tuple[str, str], grant: Any) -> None:
        blocks = list(grant.blocks)
        nl = self.layouts[0].total_layers
        # bytes each layer must receive on this receiver's ranks, from every prefill rank
        per_block = peer.block_bytes_by_src
        per_layer = sum(per_block.values()) * len(blocks)
        g = GrantMsg(grant.request_id, grant.location, grant.location, blocks, grant.token, grant.lease_s)
        with self._lock:
            old = self._inflight.get(grant.request_id)
            inf = _Inflight(grant.request_id, peer.instance, grant.token, blocks, [per_layer] * nl, peer.tp_size,
                            peers=set(old.peers) if old else {peer.ident}, run_len=_run_lengths(blocks),
                            location=grant.location)
            inf.peers.add(peer.ident)
            self._inflight[grant.request_id] = inf
            self._by_token[grant.token] = inf
            self._grants[key] = g
        for ident in inf.peers:
            self._send_grant(ident, g)

    def _credit(self, inf: _Inflight, layer: int, nbytes: int) -> None:
        land = False
        with self._lock:
            if inf.done:
                raise RequestError(f"request {inf.request_id!r} is finished")
            if not 0 <= layer < len(inf.remaining):
                raise ProtocolError(f"layer {layer} out of range")
            left = inf.remaining[layer] - nbytes
            if left < 0 or (nbytes == 0 and left == 0):
                raise GrantViolation(f"request {inf.request_id!r}: more bytes than granted for layer {layer}")
            inf.remaining[layer] = left
            land = left == 0
        if land:
            self.scheduler.land_layer(inf.request_id, inf.token, layer)
            with self._lock:
                inf.landed += 1
            self._maybe_complete(inf)

    def _maybe_complete(self, inf: _Inflight) -> None:
        with self._lock:
            if inf.done or len(inf.completes) < inf.src_tp:
                return
            failed = list(inf.failed_completes)
            if not failed and inf.landed < len(inf.remaining):
                return  # data still arriving on the TCP streams
            inf.done = True
        if failed:
            try:
                self.scheduler.fail(inf.request_id, "; ".join(failed), token=inf.token)
            except PdkvError:
                pass
            return  # the scheduler's 'failed' event sends the outcome
        try:
            self.scheduler.complete(inf.request_id, inf.token)
        except PdkvError as exc:
            self._finish(inf, Outcome(inf.request_id, "failed", str(exc)))
            return
        self._finish(inf, Outcome(inf.request_id, "received"))

    @contextlib.contextmanager
    def _replies_together(self) -> Iterator[None]:
        """Outcomes and grants decided in this block (this thread) go out at its end as one
        ``OutcomeBatch`` and one ``GrantBatch`` per peer (``_SEND_BATCH`` items, at most
        ``MAX_BATCH_BLOCKS`` block ids a message) instead of one message each."""
        box: dict[bytes, list[tuple[str, str, str]]] = {}
        grants: dict[bytes, list[GrantMsg]] = {}
        self._outbox.box, self._outbox.grants = box, grants
        try:
            yield
        finally:
            self._outbox.box = self._outbox.grants = None
            for ident, gs in grants.items():
                part: list[GrantMsg] = []
                nblocks = 0
                for g in gs:
                    if part and (len(part) == _SEND_BATCH or nblocks + len(g.blocks) > MAX_BATCH_BLOCKS):
                        self._send_grants(ident, part)
                        part, nblocks = [], 0
                    part.append(g)
                    nblocks += len(g.blocks)
                self._send_grants(ident, part)
            for ident, items in box.items():
                if len(items) == 1:
                    self._send(ident, Outcome(*items[0]))
                    continue
                for i in range(0, len(items), _SEND_BATCH):
                    self._send(ident, OutcomeBatch(items[i:i + _SEND_BATCH]))

    def _send_grants(self, ident: bytes, part: list[GrantMsg]) -> None:
        # one grant (also one too large for a batch) goes as itself
        self._send(ident, part[0] if len(part) == 1 else GrantBatch(part))

    def _send_grant(self, ident: bytes, g: GrantMsg) -> None:
        grants = getattr(self._outbox, "grants", None)
        if grants is None:
            self._send(ident, g)
        else:
            grants.setdefault(ident, []).append(g)

    def _finish(self, inf: _Inflight, outcome: Outcome | None) -> None:
        with self._lock:
            inf.done = True
            if self._inflight.get(inf.request_id) is inf:
                del self._inflight[inf.request_id]
            self._by_token.pop(inf.token, None)
            self._grants.pop((inf.instance, inf.request_id), None)
            peers = list(inf.peers)
        if outcome is None:
            return
        box = getattr(self._outbox, "box", None)
        for ident in peers:
            if box is None:
                self._send(ident, outcome)
            else:
                box.setdefault(ident, []).append((outcome.request_id, outcome.state, _clip(outcome.reason)))

    def _on_event(self, ev: Event) -> None:
        if ev.kind in ("failed", "expired", "aborted", "rejected"):
            with self._lock:
                inf = self._inflight.get(ev.request_id)
            if inf is not None:
                self._finish(inf, Outcome(ev.request_id, ev.kind, ev.reason))
        elif ev.kind == "granted" and ev.grant is not None:
            with self._lock:
                inf = self._inflight.get(ev.request_id)
                peer = self._peers.get(next(iter(inf.peers))) if inf else None
            if inf is not None and peer is not None:
                self._register_grant(peer, (inf.instance, ev.request_id), ev.grant)
        if self._user_listener is not None:
            self._user_listener(ev)

    def _check_peers(self, now: float) -> None:
        for ident in [i for i, hs in self._pending.items() if hs.deadline <= now]:
            del self._pending[ident]  # a Hello never followed by its Auth
        with self._lock:
            dead = [p for p in self._peers.values() if now - p.last_seen > self.peer_timeout_s
                    or (p.same_host and p.pid and not pid_alive(p.pid))]
            for p in dead:
                del self._peers[p.ident]
                self._sessions.pop(p.session_id, None)
        for p in dead:
            self._count("peers_dead")
            if p.rdma_qpn and self._rdma is not None:
                self._rdma.drop(p.rdma_qpn)  # the fence: no write of this peer lands after this
            self._close_conns_of(p.ident)
            with self._lock:
                mine = [inf for inf in self._inflight.values() if p.ident in inf.peers]
            for inf in mine:
                try:
                    self.scheduler.fail(inf.request_id, f"prefill {p.instance} rank {p.tp_rank} died")
                except PdkvError:
                    pass
            # it can no longer start a write: quarantined blocks go back now (those a write
            # admitted before still holds go when that write ends)
            if not any(q.instance == p.instance for q in self._peers.values()):
                self.scheduler.fence(p.instance)

    def _close_conns_of(self, ident: bytes, timeout: float = 2.0) -> None:
        """Shut down a fenced peer's data connections and join their threads (bounded: a
        thread that does not end in time still holds its write tickets, so its blocks stay
        quarantined until it does)."""
        with self._lock:
            conns = [c for c, i in self._conns.items() if i == ident]
            threads = [self._conn_threads[c] for c in conns if c in self._conn_threads]
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ TCP data
    def _accept_loop(self) -> None:
        """Accepts data connections and authenticates them (non-blocking, in this thread):
        a connection gets a thread only once it has proved its session."""
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, _PreAuth] = {}
        listening = True
        resume_at = 0.0
        sel.register(self._lsock, selectors.EVENT_READ, None)
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if not listening and now >= resume_at:
                    sel.register(self._lsock, selectors.EVENT_READ, None)
                    listening = True
                try:
                    events = sel.select(0.1)
                except OSError:
                    events = []
                now = time.monotonic()
                for key, _ in events:
                    if key.data is None:
                        if self._accept_one(sel, pending, now):
                            continue
                        sel.unregister(self._lsock)  # out of descriptors: back off, keep serving
                        listening, resume_at = False, now + 0.1
                    else:
                        self._pre_auth_step(sel, pending, key.fileobj, key.data)  # type: ignore[arg-type]
                for c in [c for c, st in pending.items() if st.deadline <= now]:
                    self._count("auth_failed")
                    self._drop_pending(sel, pending, c)
        finally:
            for c in list(pending):
                self._drop_pending(sel, pending, c)
            sel.close()
            with contextlib.suppress(OSError):
                self._lsock.close()

    def _accept_one(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _PreAuth], now: float) -> bool:
        """Accept one connection; False when the process is out of descriptors or memory."""
        try:
            conn, _ = self._lsock.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            if exc.errno in _ACCEPT_RETRY:
                self._count("accept_errors")
                self._warn.warning("accept", "pdkv decode: accept() failed (%s); backing off, still listening",
                                   os.strerror(exc.errno or 0))
                return exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
            if self._closed.is_set():
                return True
            raise
        with self._lock:
            nconns = len(self._conns)
        if len(pending) >= self.max_pending_connections or nconns >= self.max_connections:
            self._count("connections_refused")
            which = "max_pending_connections" if len(pending) >= self.max_pending_connections else "max_connections"
            self._warn.warning(which, "pdkv decode: data connection refused: %s (%d) reached", which,
                               getattr(self, which))
            conn.close()
            return True
        conn.setblocking(False)
        st = _PreAuth(now + self.auth_timeout_s, bytearray(_AUTH_HEAD))
        pending[conn] = st
        sel.register(conn, selectors.EVENT_READ, st)
        return True

    def _drop_pending(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _PreAuth],
                      conn: socket.socket) -> None:
        pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()

    def _pre_auth_step(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _PreAuth],
                       conn: socket.socket, st: _PreAuth) -> None:
        """AUTH frame + session id -> decode's nonce -> the MAC over it (32 bytes) -> b"\\x01"."""
        try:
            k = conn.recv_into(memoryview(st.buf)[st.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if k == 0:
            self._drop_pending(sel, pending, conn)
            return
        st.got += k
        if st.got < len(st.buf):
            return
        if not st.nonce:
            magic, ver, kind, *_ = FRAME_HEADER.unpack_from(st.buf)
            sid = bytes(st.buf[FRAME_HEADER.size:])
            if magic != _MAGIC or ver != 1 or kind != _K_AUTH or sid not in self._sessions:
                self._count("auth_failed")
                self._count("frames_rejected")
                self._drop_pending(sel, pending, conn)
                return
            st.session_id, st.nonce = sid, new_nonce()
            st.buf, st.got = bytearray(32), 0
            try:
                conn.send(st.nonce)  # 16 bytes into an empty socket buffer: never partial
            except OSError:
                self._drop_pending(sel, pending, conn)
            return
        with self._lock:
            ident = self._sessions.get(st.session_id)
            peer = self._peers.get(ident) if ident is not None else None
        if peer is None or not hmac.compare_digest(bytes(st.buf), data_auth_mac(peer.codec.key, st.session_id,
                                                                                 st.nonce)):
            self._count("auth_failed")
            self._drop_pending(sel, pending, conn)
            return
        pending.pop(conn)
        sel.unregister(conn)
        try:
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(_POLL_S)
            conn.sendall(b"\x01")
        except OSError:
            conn.close()
            return
        t = threading.Thread(target=self._conn_loop, args=(conn, peer.ident), name="pdkv-decode-data", daemon=True)
        with self._lock:
            if self._closed.is_set() or peer.ident not in self._peers:
                conn.close()
                return
            self._conns[conn] = peer.ident
            self._conn_threads[conn] = t
        t.start()

    def _recv_exact(self, conn: socket.socket, view: memoryview, idle_ok: bool, deadline: float | None = None) -> bool:
        """Fill ``view``; False on a clean EOF before the first byte. A frame that stalls
        for ``io_timeout_s`` or passes ``deadline`` raises; an idle connection between
        frames may wait forever (until the receiver closes or fences its peer)."""
        got, n = 0, len(view)
        stalled = 0.0
        while got < n:
            if deadline is not None and time.monotonic() > deadline:
                raise PdkvTimeoutError("frame not received within its deadline")
            try:
                k = conn.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            except (socket.timeout, TimeoutError):
                if self._closed.is_set():
                    raise ClosedError("receiver closed") from None
                if got or not idle_ok:
                    stalled += _POLL_S
                    if stalled >= self.io_timeout_s:
                        raise PdkvTimeoutError(f"peer stalled for {self.io_timeout_s}s mid-frame") from None
                continue
            if k == 0:
                if got == 0 and idle_ok:
                    return False
                raise PeerError("connection closed mid-frame")
            if got == 0 and idle_ok and deadline is None:
                deadline = time.monotonic() + self.io_timeout_s  # a header, once begun, is bounded
            got += k
            stalled = 0.0
        return True

    def _conn_loop(self, conn: socket.socket, ident: bytes) -> None:
        hdr = bytearray(FRAME_HEADER.size)
        hv = memoryview(hdr)
        scratch = bytearray(1 << 20)  # allocated once the connection has authenticated
        try:
            while self._recv_exact(conn, hv, idle_ok=True):
                if ident not in self._peers:
                    raise ClosedError("the peer's session ended")
                self._on_data_frame(conn, ident, hdr, scratch)
        except (PdkvError, OSError) as exc:
            if isinstance(exc, ProtocolError):
                self._count("frames_rejected")
        except Exception:
            self._count("loop_errors")
            _log.exception("data connection handling failed (connection closed)")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                self._conn_threads.pop(conn, None)
            with contextlib.suppress(OSError):
                conn.close()

    def _recv_views(self, conn: socket.socket, views: list[memoryview], deadline: float) -> None:
        """Scatter-receive into ``views`` (one syscall per up to 1000 buffers), bounded by a
        stall of ``io_timeout_s`` and by ``deadline``."""
        i = 0
        stalled = 0.0
        while i < len(views):
            if time.monotonic() > deadline:
                raise PdkvTimeoutError("frame not received within its deadline")
            chunk = views[i:i + 1000]
            want = sum(len(v) for v in chunk)
            try:
                got = conn.recvmsg_into(chunk, 0, socket.MSG_WAITALL)[0]
            except (socket.timeout, TimeoutError):
                stalled += _POLL_S
                if self._closed.is_set():
                    raise ClosedError("receiver closed") from None
                if stalled >= self.io_timeout_s:
                    raise PdkvTimeoutError(f"peer stalled for {self.io_timeout_s}s mid-frame") from None
                continue
            if got == 0:
                raise PeerError("connection closed mid-frame")
            stalled = 0.0
            if got == want:
                i += len(chunk)
                continue
            # partial: drop what is full, trim the first partly filled buffer
            k = 0
            while got >= len(views[i + k]):
                got -= len(views[i + k])
                k += 1
            i += k
            views[i] = views[i][got:]

    def _frame_segment(self, peer: _Peer, rank: int, tensor: int, off: int, length: int, count: int,
                       dstride: int) -> int:
        """Index of the peer's own segment a frame's geometry names; GrantViolation if none:
        a rank writes only the head ranges the TP mapping gives it."""
        for si, g in enumerate(peer.segs_by_src.get(peer.tp_rank, ())):
            if (g.dst_rank == rank and g.tensor == tensor and g.dst_offset == off and g.length == length
                    and g.count == count and (count == 1 or g.dst_stride == dstride)):
                return si
        raise GrantViolation(f"frame geometry (rank {rank}, tensor {tensor}, offset {off}, {count} x {length} B) "
                             f"is not one of prefill rank {peer.tp_rank}'s segments")

    def _admit(self, peer: _Peer, inf: _Inflight, layer: int, si: int, items: list[tuple[int, int]]) -> None:
        """Mark the frame's blocks of (layer, rank, segment) as written, all or none:
        GrantViolation if any is outside the grant or was already written."""
        nblk = len(inf.blocks)
        key = (layer, peer.tp_rank, si)
        with self._lock:
            cov = inf.cov.get(key)
            if cov is None:
                cov = inf.cov[key] = bytearray(nblk)
            for gi, nb in items:
                if nb == 0 or gi + nb > nblk:
                    raise GrantViolation("write outside the granted blocks")
                if cov.find(1, gi, gi + nb) >= 0:
                    raise GrantViolation(f"request {inf.request_id!r}: blocks of layer {layer} written twice")
            for gi, nb in items:  # checked all first: a refused frame marks nothing
                cov[gi:gi + nb] = b"\x01" * nb

    def _on_data_frame(self, conn: socket.socket, ident: bytes, hdr: bytearray, scratch: bytearray) -> None:
        magic, ver, kind, rank, token, layer, tensor, _, _, nitems, off, length, count, dstride = FRAME_HEADER.unpack(hdr)
        if magic != _MAGIC or ver != 1 or kind != _K_DATA:
            raise ProtocolError("bad frame header")
        if not 0 < nitems <= MAX_FRAME_ITEMS or count == 0 or length == 0:
            raise ProtocolError(f"frame with {nitems} items, count {count}, length {length} is malformed")
        start = time.monotonic()
        raw = bytearray(nitems * FRAME_ITEM.size)
        self._recv_exact(conn, memoryview(raw), idle_ok=False, deadline=start + self.io_timeout_s)
        items = list(FRAME_ITEM.iter_unpack(raw))
        payload = sum(nb for _, nb in items) * count * length
        if payload > MAX_FRAME_PAYLOAD or payload == 0:
            raise ProtocolError(f"frame payload of {payload} bytes is out of bounds")
        # the whole frame has a deadline: a write admitted under a live grant cannot be
        # trickled past it (its blocks stay held until it ends, and it ends by then)
        deadline = start + self.io_timeout_s + payload / self.min_data_rate
        with self._lock:
            inf = self._by_token.get(token)
            peer = self._peers.get(ident)
        ri = self._rank_info.get(rank)
        ticket: WriteTicket | None = None
        try:
            if peer is None:
                raise ClosedError("the peer's session ended")
            if inf is None or ri is None:
                raise GrantViolation("frame for an unknown grant or a rank not hosted here")
            if ident not in inf.peers:
                raise GrantViolation(f"frame for request {inf.request_id!r}, whose grant is not this session's")
            if inf.location != "buffer":
                raise GrantViolation("frame for a grant of GPU blocks (only cuda_ipc writes those)")
            view, buf_addr, spec, lay = ri
            if not (layer < lay.total_layers and tensor < len(lay.tensors)):
                raise GrantViolation("layer or tensor out of range")
            tb = lay.tensor_block_bytes(tensor)
            if off + (count - 1) * dstride + length > tb or (count > 1 and dstride < length):
                raise GrantViolation("write outside the granted blocks")
            si = self._frame_segment(peer, rank, tensor, off, length, count, dstride)
            rbase, stride = spec.region(layer, tensor)
            rbase -= buf_addr
            blocks, run_len, nblk = inf.blocks, inf.run_len, len(inf.blocks)
            views = []
            for gi, nb in items:
                if nb == 0 or gi + nb > nblk:
                    raise GrantViolation("write outside the granted blocks")
                base = rbase + blocks[gi] * stride
                if nb > 1:
                    if count != 1 or off != 0 or length != tb or run_len[gi] < nb:
                        raise GrantViolation("multi-block item over non-contiguous destination blocks")
                    views.append(view[base:base + nb * tb])
                elif count == 1:
                    views.append(view[base + off:base + off + length])
                else:
                    for i in range(count):
                        a = base + off + i * dstride
                        views.append(view[a:a + length])
            # the scheduler decides whether the grant is live, and holds its blocks until
            # end_write; then the frame's pieces are claimed (never written twice)
            ticket = self.scheduler.begin_write(inf.request_id, token)
            self._admit(peer, inf, layer, si, items)
        except PdkvError as exc:
            if ticket is not None:
                self.scheduler.end_write(ticket)
            if isinstance(exc, ClosedError):
                raise
            # stale or forged: read and drop the payload, never into the buffer
            self._count("frames_rejected")
            left = payload
            sv = memoryview(scratch)
            while left:
                k = min(left, len(scratch))
                self._recv_exact(conn, sv[:k], idle_ok=False, deadline=deadline)
                left -= k
            return
        try:
            self._recv_views(conn, views, deadline)
        except BaseException as exc:
            # part of a layer is written and the rest never will be: the request fails now,
            # and its blocks stay held until this write has ended (end_write below)
            self.scheduler.end_write(ticket)
            self._count("frames_cut")
            with contextlib.suppress(PdkvError):
                self.scheduler.fail(inf.request_id, f"tcp data frame failed mid-payload: {exc}", token=token)
            raise
        self.scheduler.end_write(ticket)
        self._count("frames")
        self._count("bytes", payload)
        try:
            self._credit(inf, layer, payload)
        except PdkvError:
            self._count("frames_rejected")

def _run_lengths(blocks: Sequence[int]) -> list[int]:
    """r[i] = how many ids from index i on advance by one (r[i] >= 1)."""
    n = len(blocks)
    r = [1] * n
    for i in range(n - 2, -1, -1):
        if blocks[i + 1] == blocks[i] + 1:
            r[i] = r[i + 1] + 1
    return r


# ---------------------------------------------------------------------- prefill side

@dataclass(frozen=True, slots=True)
class SendGrant:
    """What prefill may write for one request: decode block ids and the grant token."""

    request_id: str
    location: str
    blocks: tuple[int, ...]
    token: int
    lease_s: float


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """The definite end of a request on the prefill side: ``state`` is ``received`` (prefill
    may free its blocks, decode has the data) or ``failed``/``expired``/``aborted``/``rejected``
    (prefill frees its blocks; the request must be retried or dropped)."""

    request_id: str
    state: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.state == "received"


class _Waiter:
    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None

    def set(self, v: Any) -> None:
        self.value = v
        self.event.set()


class PrefillSender:
    """Prefill side of the transfer path, one per prefill TP rank.

    Parameters
    ----------
    layout:
        This rank's layout (``tp_rank``/``tp_size`` of the prefill instance).
    cache:
        This rank's KV cache as a :class:`~pdkv.layout.CacheSpec` (host memory for tcp;
        host or GPU memory for shm, GPU through the swap engine's kernel).
    control:
        Decode's control endpoint (``DecodeReceiver.control_address``).
    instance:
        Name of the prefill instance; all its ranks must use the same one.
    transport:
        ``auto`` (a host cache offers shm, then rdma where this host has a device, then
        tcp; a GPU cache offers cuda_ipc, then shm; decode picks), ``shm``, ``tcp``,
        ``rdma`` (raises RdmaUnavailableError naming what is missing, pyverbs or a
        device, on hosts without them) or ``cuda_ipc`` (a GPU cache on the same host as
        decode: GPU grants are written straight into decode's GPU cache, buffer grants
        into its buffer as with shm). Decode chooses cuda_ipc only where its GPU caches
        are on this GPU, or on GPUs this one has peer access to.
    rdma_device:
        RDMA device name (default: the first).
    streams:
        TCP data connections.
    copy_threads:
        Threads that copy host caches into decode's shared buffers (shm), each a C-level
        gather without the GIL; default a quarter of the cores, 1 to 4. One thread moves
        about 8-10 GiB/s of scattered 32 KiB-1 MiB blocks on the dev VM.
    timeout_s:
        Bound on the handshake, a reservation, and decode's silence before its requests fail.
    on_outcome:
        Called (from the sender's I/O thread) with each :class:`RequestOutcome`.

    Ownership: the engine keeps its source blocks until the request's outcome is known;
    the sender never frees engine memory.
    """

    def __init__(self, layout: KVLayout, cache: CacheSpec, control: str, *, instance: str = "prefill",
                 secret: bytes | None = None, transport: str = "auto", streams: int = 2, timeout_s: float = 10.0,
                 heartbeat_s: float = 1.0, on_outcome: Callable[[RequestOutcome], None] | None = None,
                 rdma_device: str | None = None, copy_threads: int | None = None) -> None:
        if transport not in ("auto", "shm", "tcp", "rdma", "cuda_ipc"):
            raise ValueError(f"transport={transport!r} must be auto, shm, tcp, rdma or cuda_ipc")
        if transport == "cuda_ipc" and cache.device is None:
            raise LayoutError("the cuda_ipc transport writes from a GPU cache: give a CacheSpec with device set")
        if transport == "rdma" and cache.device is not None:
            raise LayoutError("the rdma transport writes from host caches (GPUDirect RDMA is not supported); "
                              "stage GPU caches or use shm")
        if not 1 <= streams <= 64:
            raise ValueError(f"streams={streams} must be in 1..64")
        if copy_threads is None:
            copy_threads = default_copy_threads()
        if not isinstance(copy_threads, int) or not 1 <= copy_threads <= 64:
            raise ValueError(f"copy_threads={copy_threads!r} must be an integer in 1..64")
        self.copy_threads = copy_threads
        self._copy_pool: ThreadPoolExecutor | None = None
        self.layout, self.cache = layout, cache
        self.instance = instance
        self.timeout_s, self.heartbeat_s = timeout_s, heartbeat_s
        self.on_outcome = on_outcome
        self.stats = {"bytes": 0, "frames": 0, "layers": 0, "grant_messages": 0, "outcome_messages": 0}
        # (layer, seconds from send_layer() to its writes done, bytes): per-layer latency
        self.layer_log: collections.deque[tuple[int, float, int]] = collections.deque(maxlen=1 << 16)
        self._codec = Codec(secret)
        self._lock = threading.Lock()
        self._grants: dict[str, SendGrant] = {}
        self._grant_arrays: dict[int, Any] = {}  # grant token -> its block ids as an array
        self._reserve_waiters: dict[str, _Waiter] = {}
        self._outcomes: dict[str, _Waiter] = {}
        self._failed: dict[str, str] = {}
        self._closed = threading.Event()
        self._broken: str | None = None
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(control)
        self._ch = _Channel(self._sock)
        self._rdma: RdmaWriter | None = None
        self._rdma_device = rdma_device
        self._regions: dict[int, RemoteRegion] = {}
        self._data_socks: list[socket.socket] = []
        self._shm: dict[int, SharedBuffer] = {}
        self._dst_specs: dict[int, CacheSpec] = {}
        self._ipc: IpcMapping | None = None
        self._engine: Any = None
        self._views: dict[tuple[int, int, int], tuple[memoryview, int]] = {}
        self._pending_jobs = 0
        self._streams = streams
        try:
            self._handshake(transport, timeout_s)
        except BaseException:
            self._teardown()
            raise
        self._threads = [threading.Thread(target=self._io_loop, name="pdkv-prefill-io", daemon=True),
                         threading.Thread(target=self._data_loop, name="pdkv-prefill-data", daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ handshake
    def _handshake(self, transport: str, timeout_s: float) -> None:
        offer = [transport]
        if transport == "auto" and self.cache.device is not None:
            # a GPU cache: straight into decode's GPU blocks where decode serves that and
            # our GPU can map its memory, else through its buffer (tcp and rdma send
            # from host memory)
            offer = ["cuda_ipc", "shm"]
        elif transport == "auto":
            # rdma only where this host has a device
            offer = ["shm", "rdma", "tcp"] if _ffi.verbs.rdma_devices() else ["shm", "tcp"]
        rdma: RdmaEndpointDesc | None = None
        if "rdma" in offer:
            # the cache registered (one region per contiguous range of its layers and
            # tensors) and a queue pair made before the hello, which carries its record;
            # RdmaUnavailableError here says what is missing
            spec = self.cache
            self._rdma = RdmaWriter([(b, st * spec.num_blocks) for b, st in
                                     (spec.region(layer, t) for layer in range(self.layout.total_layers)
                                      for t in range(len(self.layout.tensors)))],
                                    device=self._rdma_device, timeout_s=timeout_s)
            rdma = msgspec.convert(self._rdma.local_info().to_dict(), RdmaEndpointDesc)
        cuda: CudaDesc | None = None
        if "cuda_ipc" in offer:
            assert self.cache.device is not None
            cuda = CudaDesc(device_uuid=_ffi.cuda.device_uuid(self.cache.device))
        nonce = new_nonce()
        deadline = time.monotonic() + timeout_s
        self._sock.send_multipart(self._codec.encode(Hello(
            PROTOCOL_VERSION, self.instance, self.layout.tp_rank, self.layout.tp_size, layout_desc(self.layout),
            offer, boot_id(), os.getpid(), nonce, rdma, cuda)))
        ch = self._handshake_reply(deadline, timeout_s)
        if not isinstance(ch, Challenge):
            raise ProtocolError(f"expected challenge, got {type(ch).__name__}")
        # from here on the session key: HMAC(secret, our nonce, decode's fresh nonce)
        self._codec.set_session(nonce, ch.nonce)
        self._sock.send_multipart(self._codec.encode(Auth(ch.nonce)))
        msg = self._handshake_reply(deadline, timeout_s)
        if not isinstance(msg, Welcome):
            raise ProtocolError(f"expected welcome, got {type(msg).__name__}")
        self.transport = msg.transport
        self._session_id = msg.session_id  # names this session on data connections (no credential)
        layouts = [KVLayout.from_descriptor(msgspec.structs.asdict(d)) for d in msg.layouts]
        for lay in layouts:
            lay.check_compatible(self.layout)
        self._dst_layout = layouts[0]
        self.segments = [g for g in tp_segments(self.layout, layouts[0]) if g.src_rank == self.layout.tp_rank
                         and g.dst_rank in msg.ranks]
        if msg.transport in ("shm", "cuda_ipc"):
            if msg.transport == "cuda_ipc":
                if self.cache.device is None or "cuda_ipc" not in offer:
                    raise ProtocolError("decode chose cuda_ipc, which this sender did not offer")
                # validated before anything is opened; closed again by _teardown on failure
                self._ipc = IpcMapping(parse_ipc_section(to_plain(msg.cuda), msg.ranks, layouts), layouts,
                                       self.cache.device)
            if len(msg.shm_names) != len(msg.ranks):
                raise ProtocolError(f"welcome names {len(msg.shm_names)} buffers for {len(msg.ranks)} ranks")
            for rank, name, lay in zip(msg.ranks, msg.shm_names, layouts):
                if self.cache.device is None:
                    b = SharedBuffer.open(name, pin="never", populate=True)
                else:  # pinned for the kernel, from the cache's device (no context made on another)
                    with _ffi.cuda.on_device(self.cache.device):
                        b = SharedBuffer.open(name, pin="auto", populate=True)
                self._shm[rank] = b
                need = CacheSpec.buffer_bytes(lay, msg.buffer_blocks)
                if b.size < need:
                    raise ProtocolError(f"decode rank {rank}'s buffer {name!r} has {b.size} bytes, but "
                                        f"{msg.buffer_blocks} blocks of its layout need {need}")
                self._dst_specs[rank] = CacheSpec.for_buffer(lay, msg.buffer_blocks, b.address)
            if self.cache.device is not None:
                from .swap import SwapEngine

                # only copy_plan() is used: explicit GPU -> mapped-host addresses, so the
                # engine's own pair of caches is this rank's cache on both sides
                self._engine = SwapEngine(self.cache, self.cache, device=self.cache.device)
            else:
                _ffi.cpu.available()  # build the streaming copy loop now (~30 ms), not in the first layer
        elif msg.transport == "rdma":
            if self._rdma is None:
                raise ProtocolError("decode chose rdma, which this sender did not offer")
            if msg.rdma is None:
                raise ProtocolError("decode chose rdma but sent no rdma section")
            try:
                ep = EndpointInfo.from_dict(to_plain(msg.rdma.endpoint))
                regions = {r.rank: RemoteRegion.from_dict(to_plain(r)) for r in msg.rdma.regions}
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                raise ProtocolError(f"bad rdma section in the welcome: {exc}") from None
            for rank, lay in zip(msg.ranks, layouts):
                reg = regions.get(rank)
                need = CacheSpec.buffer_bytes(lay, msg.buffer_blocks)
                if reg is None or reg.length < need:
                    raise ProtocolError(f"decode rank {rank}'s RDMA region is missing or smaller than the "
                                        f"{need} bytes {msg.buffer_blocks} blocks need")
                self._regions[rank] = reg
                self._dst_specs[rank] = CacheSpec.for_buffer(lay, msg.buffer_blocks, reg.addr)
            self._rdma.connect(ep)
        else:
            host, port = msg.data_addr.rsplit(":", 1)
            if self.cache.device is not None:
                raise LayoutError("the tcp transport sends from host caches; stage GPU caches or use shm")
            for _ in range(self._streams):
                self._data_socks.append(self._data_connect(host, int(port), msg.session_id, deadline, timeout_s))
        if msg.transport != "rdma" and self._rdma is not None:
            self._rdma.close()  # offered, not chosen
            self._rdma = None
        self._last_heard = time.monotonic()

    def _handshake_reply(self, deadline: float, timeout_s: float) -> Message:
        """The next handshake message from decode; a refusal raises PeerError."""
        if not self._sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            raise PdkvTimeoutError(f"decode did not answer the handshake within {timeout_s}s (is it running?)")
        frames = self._sock.recv_multipart()
        try:
            msg = self._codec.decode(frames)
        except ProtocolError:
            msg = Codec(None).decode(frames) if is_unauthenticated(frames) else None  # a refusal is sent unauthenticated
            if not isinstance(msg, ErrorMsg):
                raise
        if isinstance(msg, ErrorMsg):
            raise PeerError(f"decode refused the session: {msg.message}")
        return msg

    def _data_connect(self, host: str, port: int, session_id: bytes, deadline: float,
                      timeout_s: float) -> socket.socket:
        """One authenticated data connection: AUTH frame and session id, decode's nonce back,
        the MAC over it under the session's data key, decode's one-byte acceptance. A refusal
        (decode at its cap of connections still authenticating) is retried until the
        handshake's deadline."""
        delay = 0.02
        while True:
            try:
                s = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            except OSError as exc:
                raise PeerError(f"data connection to {host}:{port} failed: {exc}") from None
            try:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.sendall(FRAME_HEADER.pack(_MAGIC, 1, _K_AUTH, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) + session_id)
                nonce = _recv_n(s, 16)
                s.sendall(data_auth_mac(self._codec.key, session_id, nonce))
                if _recv_n(s, 1) != b"\x01":
                    raise PeerError("decode refused the data connection")
                s.settimeout(timeout_s)
                return s
            except (OSError, PeerError) as exc:
                s.close()
                if time.monotonic() + delay >= deadline:
                    raise PeerError(f"data connection to {host}:{port} was not accepted within {timeout_s}s: "
                                    f"{exc}") from None
            time.sleep(delay)
            delay = min(0.2, delay * 2)

    # ------------------------------------------------------------------ API
    def reserve(self, request_id: str, num_tokens: int, timeout: float | None = None) -> SendGrant:
        """Ask decode for destination blocks. Returns the grant; raises TransferError if
        decode rejected the request, PdkvTimeoutError if no grant came in time."""
        res = self.reserve_many([(request_id, num_tokens)], timeout)[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def reserve_many(self, requests: Sequence[tuple[str, int]],
                     timeout: float | None = None) -> list[SendGrant | PdkvError]:
        """Reserve several requests at once: every request is sent before any answer is
        awaited, so their round trips overlap (one at a time costs a round trip each).
        Returns one result per request, in order: its grant, or the error :meth:`reserve`
        would have raised for it. Bad input (a duplicate id, an id that is not a string of
        1-``MAX_ID`` characters, a token count outside 1..``MAX_NUM_TOKENS``: what decode
        would refuse) raises before anything is sent;
        ``timeout`` bounds the whole call."""
        self._check()
        ids = [r for r, _ in requests]
        if len(set(ids)) != len(ids):
            raise RequestError("reserve_many: a request id appears twice")
        for rid, n in requests:
            if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID:
                raise RequestError(f"request id {rid!r:.80} must be a string of 1-{MAX_ID} characters")
            if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_NUM_TOKENS:
                raise RequestError(f"request {rid!r}: num_tokens={n!r} must be an integer in 1..{MAX_NUM_TOKENS}")
        waiters = []
        with self._lock:
            for rid in ids:
                if rid in self._reserve_waiters or rid in self._grants:
                    raise RequestError(f"request {rid!r} is already reserved or being reserved")
            for rid in ids:
                w = _Waiter()
                self._reserve_waiters[rid] = w
                self._outcomes[rid] = _Waiter()
                waiters.append(w)
        if len(requests) == 1:
            self._post(ReserveReq(*requests[0]))
        else:  # one message per _SEND_BATCH requests; decode answers each with one GrantBatch
            items = [(rid, n) for rid, n in requests]
            for i in range(0, len(items), _SEND_BATCH):
                self._post(ReserveBatch(items[i:i + _SEND_BATCH]))
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        out: list[SendGrant | PdkvError] = []
        for rid, w in zip(ids, waiters):
            if not w.event.wait(max(0.0, deadline - time.monotonic())):
                with self._lock:
                    self._reserve_waiters.pop(rid, None)
                    self._outcomes.pop(rid, None)
                self._post(Abort(rid, "prefill gave up waiting for a grant"))
                out.append(PdkvTimeoutError(f"no grant for {rid!r} within {limit}s"))
                continue
            g = w.value
            if isinstance(g, BaseException):
                with self._lock:
                    self._outcomes.pop(rid, None)
            out.append(g)
        return out

    def send_layer(self, layer: int, items: Sequence[tuple[str, Sequence[int]]], event: int | None = None) -> None:
        """Layer ``layer`` of these requests is in the cache: write it to decode.

        ``items`` are ``(request_id, source block ids)`` for every request of the batch,
        posted together; the ids a list, a numpy array or a CPU tensor of integers, each in
        ``[0, cache.num_blocks)`` (checked here: RequestError names the request and the
        ids), copied before the call returns. ``event`` is a CUDA event to wait on first.
        Returns at once: the data thread writes while the engine computes the next layer.
        Chunked prefill: pass only the full blocks of an intermediate chunk (the grant
        index follows the order in which blocks are sent, see ``first_block``)."""
        self._queue_layer(layer, [(rid, b, 0) for rid, b in items], event, chunk=False)

    def send_chunk(self, layer: int, request_id: str, src_blocks: Sequence[int], first_block: int,
                   event: int | None = None) -> None:
        """Chunked prefill: write full blocks ``first_block..`` of the grant for one layer."""
        if not isinstance(first_block, int) or first_block < 0:
            raise RequestError(f"request {request_id!r}: first_block={first_block!r} must be an integer >= 0")
        self._queue_layer(layer, [(request_id, src_blocks, first_block)], event, chunk=True)

    def _queue_layer(self, layer: int, items: list[tuple[str, Any, int]], event: int | None, chunk: bool) -> None:
        """Check and hand one layer's writes to the data thread. Every request of a layer
        sends blocks; a chunk with no full block has nothing to send and is skipped."""
        self._check()
        if not 0 <= layer < self.layout.total_layers:
            raise RequestError(f"layer {layer} out of range [0, {self.layout.total_layers})")
        work = []
        for rid, blocks, first in items:
            ids = self._src_ids(rid, blocks)
            if not ids.size and not chunk:
                raise RequestError(f"request {rid!r}: no source blocks for layer {layer}")
            if ids.size:
                work.append((rid, ids, first))
        if work or not chunk:
            self._submit(("layer", layer, work, event, time.monotonic()))

    def _grant_ids(self, g: SendGrant) -> Any:
        """A live grant's block ids as an int64 array, made once (dropped with the grant)."""
        import numpy as np

        with self._lock:
            a = self._grant_arrays.get(g.token)
            if a is None:
                a = np.asarray(g.blocks, dtype=np.int64)
                if self._grants.get(g.request_id) is g:
                    self._grant_arrays[g.token] = a
        return a

    def _src_ids(self, rid: str, blocks: Any) -> Any:
        """The engine's source block ids as a private int64 array, checked against this
        rank's cache: an id out of range would copy some other memory (or fault)."""
        import numpy as np

        try:
            a = np.asarray(blocks)
        except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a tensor on a GPU
            raise RequestError(f"request {rid!r}: source block ids are not an id list: {exc}") from None
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise RequestError(f"request {rid!r}: source block ids must be a flat list of integers, "
                               f"got shape {a.shape} of {a.dtype}")
        a = a.astype(np.int64)  # a copy: the engine may reuse its list at once
        nb = self.cache.num_blocks
        if a.size and (int(a.min()) < 0 or int(a.max()) >= nb):
            bad = a[(a < 0) | (a >= nb)][:8].tolist()
            raise RequestError(f"request {rid!r}: source block ids {bad} out of range [0, {nb}) of this rank's cache")
        return a

    def finish(self, request_id: str, ok: bool = True, error: str = "") -> None:
        """Every layer of ``request_id`` was handed to :meth:`send_layer`: confirm it to decode
        once all its writes succeeded (``ok=False`` reports a failure instead)."""
        self._check()
        self._after_writes(("complete", request_id, ok, error))

    def finish_many(self, request_ids: Sequence[str], ok: bool = True, error: str = "") -> None:
        """:meth:`finish` for several requests (a batch that ends together), confirmed to
        decode in one message per ``_SEND_BATCH`` (512) requests instead of one each."""
        self._check()
        rids = list(request_ids)
        if rids:
            self._after_writes(("complete_many", rids, ok, error))

    def _after_writes(self, job: tuple) -> None:
        """Run ``job`` once every write handed over before it has finished."""
        with self._lock:
            idle = self._pending_jobs == 0
        if idle:  # every write already finished: run it now, without a hop through the data thread
            self._run_job(job)
        else:
            self._submit(job)

    def wait_outcome(self, request_id: str, timeout: float | None = None) -> RequestOutcome:
        """Block until the request's definite outcome (bounded by ``timeout``)."""
        with self._lock:
            w = self._outcomes.get(request_id)
        if w is None:
            raise RequestError(f"unknown request {request_id!r}")
        if not w.event.wait(timeout if timeout is not None else self.timeout_s * 3):
            raise PdkvTimeoutError(f"no outcome for {request_id!r} yet")
        with self._lock:
            self._outcomes.pop(request_id, None)
        return w.value

    def close(self) -> None:
        """Stop threads, close sockets and shm mappings. Pending requests fail. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._jobs.put(None)
        self._ch.wake()
        for t in self._threads:
            t.join(5)
        self._fail_all("sender closed")
        self._teardown()

    def _teardown(self) -> None:
        for s in self._data_socks:
            try:
                s.close()
            except OSError:
                pass
        self._data_socks.clear()
        if self._engine is not None:
            self._engine.close()  # waits for its copies, so none still writes into a mapping below
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
        if self._rdma is not None:
            self._rdma.close()
            self._rdma = None
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None
        for b in self._shm.values():
            try:
                b.close()
            except PdkvError:
                pass
        self._shm.clear()
        self._ch.close()
        self._ctx.term()

    def __enter__(self) -> PrefillSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check(self) -> None:
        if self._closed.is_set():
            raise ClosedError("sender is closed")
        if self._broken:
            raise PeerError(self._broken)

    def _post(self, msg: Message) -> None:
        """Send to decode now, from whichever thread calls (see :class:`_Channel`)."""
        self._ch.send(lambda: self._codec.encode(msg))

    def _resolve(self, rid: str, state: str, reason: str = "") -> None:
        with self._lock:
            w = self._outcomes.get(rid)
            g = self._grants.pop(rid, None)
            if g is not None:
                self._grant_arrays.pop(g.token, None)
            rw = self._reserve_waiters.pop(rid, None)
        if rw is not None:
            rw.set(TransferError(f"request {rid!r} {state}: {reason}"))
        if w is not None and not w.event.is_set():
            out = RequestOutcome(rid, state, reason)
            w.set(out)
            if self.on_outcome is not None:
                self.on_outcome(out)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            rids = set(self._outcomes) | set(self._reserve_waiters)
        for rid in rids:
            self._resolve(rid, "failed", why)

    def _io_loop(self) -> None:
        last_hb = 0.0
        while not self._closed.is_set():
            got = self._ch.wait(50)
            if got is None:
                break
            for frames in got:
                try:
                    msg = self._codec.decode(frames)
                except ProtocolError:
                    continue  # refused: never acted upon
                self._last_heard = time.monotonic()
                self._on_msg(msg)
            now = time.monotonic()
            if now - last_hb >= self.heartbeat_s:
                last_hb = now
                self._post(Heartbeat(time.time()))
            if now - self._last_heard > self.timeout_s and not self._broken:
                self._broken = f"decode silent for {self.timeout_s}s: considered dead"
                self._fail_all(self._broken)

    def _on_grant(self, msg: GrantMsg) -> None:
        with self._lock:
            w = self._reserve_waiters.get(msg.request_id)
        if msg.outcome in ("buffer", "gpu"):
            g = SendGrant(msg.request_id, msg.location, tuple(msg.blocks), msg.token, msg.lease_s)
            with self._lock:
                self._grants[msg.request_id] = g
                self._reserve_waiters.pop(msg.request_id, None)
            if w is not None:
                w.set(g)
            # the ids as the array the data thread plans with, made now rather than on the data
            # path (~35 us per 1000 blocks; a layer of 16 requests of 2048 blocks spent 0.55 ms on it)
            self._grant_ids(g)
        elif msg.outcome == "rejected":
            self._resolve(msg.request_id, "rejected", msg.reason)
        # queued: keep waiting for the grant

    def _on_msg(self, msg: Message) -> None:
        if isinstance(msg, GrantMsg):
            self.stats["grant_messages"] += 1
            self._on_grant(msg)
        elif isinstance(msg, GrantBatch):
            self.stats["grant_messages"] += 1
            for g in msg.items:
                self._on_grant(g)
        elif isinstance(msg, Outcome):
            self.stats["outcome_messages"] += 1
            self._resolve(msg.request_id, msg.state, msg.reason)
        elif isinstance(msg, OutcomeBatch):
            self.stats["outcome_messages"] += 1
            for rid, state, reason in msg.items:
                self._resolve(rid, state, reason)
        elif isinstance(msg, ErrorMsg):
            rid = msg.message.split(":", 1)[0]
            with self._lock:
                known = rid in self._outcomes
            if known:
                self._resolve(rid, "failed", msg.message)

    # ------------------------------------------------------------------ data
    def _submit(self, job: tuple) -> None:
        with self._lock:
            self._pending_jobs += 1
        self._jobs.put(job)

    def _complete(self, rid: str, ok: bool, error: str) -> None:
        with self._lock:
            g = self._grants.get(rid)
            err = self._failed.pop(rid, None)
        if g is not None:  # else already resolved (failed, expired)
            self._post(Complete(rid, g.token, ok and err is None, error or (err or "")))

    def _complete_many(self, rids: list[str], ok: bool, error: str) -> None:
        items = []
        with self._lock:
            for rid in rids:
                g = self._grants.get(rid)
                err = self._failed.pop(rid, None)
                if g is not None:  # else already resolved (failed, expired)
                    items.append((rid, g.token, ok and err is None, _clip(error or (err or ""))))
        for i in range(0, len(items), _SEND_BATCH):
            self._post(CompleteBatch(items[i:i + _SEND_BATCH]))

    def _data_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run_job(job)
            finally:
                with self._lock:
                    self._pending_jobs -= 1

    def _run_job(self, job: tuple) -> None:
        if job[0] == "complete":
            self._complete(*job[1:])
            return
        if job[0] == "complete_many":
            self._complete_many(*job[1:])
            return
        _, layer, items, event, t_enq = job
        b0 = self.stats["bytes"]
        try:
            if event is not None:
                deadline = time.monotonic() + self.timeout_s
                while not _ffi.cuda.event_query(event):
                    if time.monotonic() > deadline:
                        raise PdkvTimeoutError(f"layer {layer}: the engine's event did not complete")
                    time.sleep(20e-6)
            self._write_layer(layer, items)
            self.layer_log.append((layer, time.monotonic() - t_enq, self.stats["bytes"] - b0))
        except Exception as exc:  # every request of the layer failed: report it
            with self._lock:
                for rid, _, _ in items:
                    self._failed.setdefault(rid, f"layer {layer}: {exc}")

    def _write_layer(self, layer: int, items: list[tuple[str, list[int], int]]) -> None:
        work = []
        for rid, src_blocks, first in items:
            with self._lock:
                g = self._grants.get(rid)
            if g is None:
                continue  # resolved meanwhile (expired, aborted): nothing to write
            dst = self._grant_ids(g)[first:first + len(src_blocks)]
            if len(dst) != len(src_blocks):
                with self._lock:
                    self._failed.setdefault(rid, f"{len(src_blocks)} source blocks but the grant has {len(g.blocks) - first} left")
                continue
            work.append((rid, g, src_blocks, dst, first))
        if not work or not self.segments:
            return  # a rank whose heads another rank sends (replicated heads) writes nothing
        gpu_work = [w for w in work if w[1].location == "gpu"]
        work = [w for w in work if w[1].location != "gpu"]
        if gpu_work and self._ipc is None:
            with self._lock:
                for w in gpu_work:
                    self._failed.setdefault(w[0], f"decode granted GPU blocks, which {self.transport} cannot write")
        elif gpu_work:
            self._write_shm(layer, gpu_work, self._ipc.specs, "d2d")
        if work and self.transport in ("shm", "cuda_ipc"):
            self._write_shm(layer, work)
        elif work and self.transport == "rdma":
            self._write_rdma(layer, work)
        elif work:
            self._write_tcp(layer, work)
        self.stats["layers"] += 1

    def _region_view(self, spec: CacheSpec, layer: int, tensor: int) -> tuple[memoryview, int]:
        key = (id(spec), layer, tensor)
        v = self._views.get(key)
        if v is None:
            base, stride = spec.region(layer, tensor)
            v = self._views[key] = (_ffi.libc.host_view(base, stride * spec.num_blocks), base)
        return v

    def _pieces(self, layer: int, work: list, dsts: dict[int, CacheSpec] | None = None) -> tuple[list, int]:
        """Every write of ``work`` for ``layer`` as ``(segment, src, dst, lengths)`` arrays of
        addresses in this process (source) and in the destination's address space
        (``dsts``: the decode ranks' caches, by default their buffers)."""
        import numpy as np

        total = 0
        plans = []
        # every request of the layer in one plan: the pieces are plain memory copies, so a
        # run may continue from one request's blocks into the next one's (per-request
        # planning cost ~37 us a request, 9.4 ms a layer for 256 one-block requests)
        # one array per request, joined (send_layer and _write_layer hand over int64
        # arrays; converting Python lists here cost 1-2 ms a layer for 32768 ids)
        sb = np.concatenate([np.asarray(w[2], dtype=np.int64) for w in work])
        db = np.concatenate([np.asarray(w[3], dtype=np.int64) for w in work])
        for grp in _plan_layer(self.segments, self.layout, self._dst_layout, self.cache,
                               self._dst_specs if dsts is None else dsts, sb, db, layer):
            seg = grp.seg
            if seg.count == 1:
                src, dst, ln = grp.src, grp.dst, grp.nb * seg.length
            else:  # strided (token-major) pieces
                c = np.arange(seg.count, dtype=np.int64)
                src = (grp.src[:, None] + c * seg.src_stride).ravel()
                dst = (grp.dst[:, None] + c * seg.dst_stride).ravel()
                ln = np.full(src.size, seg.length, dtype=np.int64)
            plans.append((seg, src, dst, ln))
            total += int(ln.sum())
        return plans, total

    def _write_rdma(self, layer: int, work: list) -> None:
        """One request at a time: its writes posted, their completions awaited, then its
        LayerDone (decode cannot see one-sided writes land; this message is how it learns)."""
        assert self._rdma is not None
        for item in work:
            rid, g, sb = item[0], item[1], item[2]
            plans, total = self._pieces(layer, [item])
            try:
                for seg, src, dst, ln in plans:
                    self._rdma.write(rid, src.tolist(), dst.tolist(), ln.tolist(), self._regions[seg.dst_rank])
            except PdkvError as exc:
                with self._lock:
                    self._failed.setdefault(rid, f"layer {layer}: {exc}")
                if isinstance(exc, RdmaError):
                    # a failed completion leaves the queue pair in the error state: every later
                    # write would fail too, so the session is over. Decode is told to drop every
                    # request of it now (it would otherwise wait for their leases)
                    self._broken = f"RDMA queue pair failed: {exc}"
                    with self._lock:
                        rids = list(self._grants)
                    for r in rids:
                        self._post(Abort(r, self._broken))
                    self._fail_all(self._broken)
                    return
                continue
            self.stats["bytes"] += total
            self._post(LayerDone(rid, g.token, [layer], len(sb)))

    def _write_shm(self, layer: int, work: list, dsts: dict[int, CacheSpec] | None = None,
                   direction: str | None = None) -> None:
        import numpy as np

        from .swap import CopyPlan

        plans, total = self._pieces(layer, work, dsts)
        if self._engine is not None:
            plan = CopyPlan(np.concatenate([p[1] for p in plans]).astype(np.uint64),
                            np.concatenate([p[2] for p in plans]).astype(np.uint64),
                            np.concatenate([p[3] for p in plans]).astype(np.uint64),
                            np.asarray([sum(p[3].size for p in plans)], np.int64), total)
            self._engine.copy_plan(plan, direction=direction).wait(self.timeout_s)
        else:
            self._copy_pieces(layer, plans)
        self.stats["bytes"] += total
        items = [(rid, g.token, len(sb)) for rid, g, sb, *_ in work]
        for i in range(0, len(items), MAX_BATCH_ITEMS):
            self._post(LayerBatch(layer, items[i:i + MAX_BATCH_ITEMS]))

    def _copy_pieces(self, layer: int, plans: list) -> None:
        """Host-cache pieces into decode's buffer: the streaming copy loop where it runs
        (``_ffi.cpu``: non-temporal stores, no read-for-ownership of the destination),
        else numpy."""
        if _ffi.cpu.available():
            self._stream_pieces(layer, plans)
        else:
            self._numpy_pieces(layer, plans)

    def _numpy_pieces(self, layer: int, plans: list) -> None:
        import numpy as np

        takes: list[tuple[Any, Any, Any]] = []  # (source rows, row ids, destination rows)
        rest = []
        for seg, src, dst, ln in plans:
            sv, sbase = self._region_view(self.cache, layer, seg.tensor)
            dspec = self._dst_specs[seg.dst_rank]
            dv, dbase = self._region_view(dspec, layer, seg.tensor)
            sstride = self.cache.region(layer, seg.tensor)[1]
            dstride = dspec.region(layer, seg.tensor)[1]
            single = ln == seg.length
            if seg.count == 1 and seg.dst_offset == 0 and seg.length == dstride and single.sum() >= 4:
                # whole blocks into a packed buffer: gather runs of consecutive destination
                # blocks with one np.take each (a C loop, no temporary); grants come out of
                # the pool as runs, so there are few
                di = (dst[single] - dbase) // dstride
                si = (src[single] - sbase - seg.src_offset) // sstride
                brk = np.flatnonzero(np.diff(di) != 1) + 1
                if brk.size < di.size // 4:
                    s2 = np.frombuffer(sv, np.uint8).reshape(-1, sstride)[:, seg.src_offset:seg.src_offset + seg.length]
                    d2 = np.frombuffer(dv, np.uint8).reshape(-1, dstride)
                    # runs cut into pieces of about 4 MiB, so that threads share them evenly
                    step = max(1, _GATHER_PIECE // seg.length)
                    for a, b in zip(np.concatenate(([0], brk)).tolist(), np.concatenate((brk, [di.size])).tolist()):
                        d0 = int(di[a])
                        for lo in range(a, b, step):
                            hi = min(b, lo + step)
                            takes.append((s2, si[lo:hi], d2[d0 + lo - a:d0 + hi - a]))
                    src, dst, ln = src[~single], dst[~single], ln[~single]
            if src.size:
                rest.append((sv, sbase, dv, dbase, src, dst, ln))
        # every request and segment of the layer in one share-out among the copy threads
        self._gather(takes)
        # memoryview slice assignment is a plain memcpy with less call overhead than
        # ctypes.memmove. One thread: two threads fight over the GIL and ran 10x slower;
        # process_vm_writev (scatter-gather in the kernel, no GIL) was no faster into shm.
        for sv, sbase, dv, dbase, src, dst, ln in rest:
            for so, do, n in zip((src - sbase).tolist(), (dst - dbase).tolist(), ln.tolist()):
                dv[do:do + n] = sv[so:so + n]

    def _stream_pieces(self, layer: int, plans: list) -> None:
        """Every piece of the layer copied by the streaming (non-temporal) copy loop of
        ``_ffi.cpu``, shared among the copy threads in runs of about equal bytes. Each piece
        is checked against its source and destination regions first: the loop writes
        through raw addresses."""
        import numpy as np

        srcs, dsts, lens = [], [], []
        for seg, src, dst, ln in plans:
            sv, sbase = self._region_view(self.cache, layer, seg.tensor)
            dv, dbase = self._region_view(self._dst_specs[seg.dst_rank], layer, seg.tensor)
            # contiguous int64 already from the planner (no copy then), as the loop needs them
            s, d, n = (np.ascontiguousarray(a, dtype=np.int64) for a in (src, dst, ln))
            if n.size and (int(n.min()) < 0 or int(s.min()) < sbase or int((s + n).max()) > sbase + len(sv)
                           or int(d.min()) < dbase or int((d + n).max()) > dbase + len(dv)):
                raise TransferError(f"layer {layer}: a planned copy falls outside its source or destination "
                                    f"region (tensor {seg.tensor}, decode rank {seg.dst_rank})")
            srcs.append(s)
            dsts.append(d)
            lens.append(n)
        if not lens:
            return
        src, dst, ln = ((a[0] if len(a) == 1 else np.concatenate(a)) for a in (srcs, dsts, lens))
        # pieces stay in destination order (grant order): sorted by source address instead,
        # random 32 KiB blocks ran 0.69-0.73 of the ceiling against 0.79-0.81 on the H200 x2
        # host's Xeon (ABBA, docs/perf-logs/h200x2-ab-order-s6-*), though 0.73-0.75 against
        # 0.57-0.66 on the dev VM
        n = min(self.copy_threads, max(1, int(ln.sum()) // _GATHER_PIECE))
        if n > 1 and int(ln.max()) > _GATHER_PIECE:  # cut long runs so the threads share evenly
            from .swap import split_runs

            idx, off, ln = split_runs(ln, _GATHER_PIECE)
            src, dst = src[idx] + off, dst[idx] + off
        cuts = np.searchsorted(np.cumsum(ln), np.arange(1, n) * (int(ln.sum()) / n)).tolist()
        self._share([lambda a=a, b=b: _ffi.cpu.gather(src[a:b], dst[a:b], ln[a:b])
                     for a, b in zip([0] + cuts, cuts + [ln.size])])

    def _gather(self, takes: list) -> None:
        """``out[:] = rows[idx]`` for every ``(rows, idx, out)``: np.take copies in C without
        the GIL, so ``copy_threads`` threads run at once."""
        import numpy as np

        def run(part: list) -> None:
            for rows, idx, out in part:
                np.take(rows, idx, axis=0, out=out, mode="clip")

        n = max(1, min(self.copy_threads, len(takes)))
        self._share([lambda i=i: run(takes[i::n]) for i in range(n)])

    def _share(self, parts: list[Callable[[], None]]) -> None:
        """Run the copy ``parts`` at once: this thread takes the first, the copy pool the
        rest (C loops without the GIL); returns when all are done, raising the first error."""
        if len(parts) <= 1:
            for part in parts:
                part()
            return
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(self.copy_threads - 1, thread_name_prefix="pdkv-copy")
        futs = [self._copy_pool.submit(part) for part in parts[1:]]
        try:
            parts[0]()
        finally:
            for f in futs:
                f.result()

    def _write_tcp(self, layer: int, work: list) -> None:
        pack, item = FRAME_HEADER.pack, FRAME_ITEM.pack
        frames: list[tuple[bytes, Segment, list[int], list[int], int]] = []
        for rid, g, sb, db, first in work:
            for grp in _plan_layer(self.segments, self.layout, self._dst_layout, self.cache, None, sb, db, layer):
                seg = grp.seg
                unit = seg.length * seg.count  # payload bytes per block
                if unit > MAX_FRAME_PAYLOAD:
                    raise TransferError(f"a block's {unit} bytes for tensor {seg.tensor} exceed the tcp frame "
                                        f"limit of {MAX_FRAME_PAYLOAD} bytes")
                gi, nb, src = _tcp_items(grp.gi, grp.nb, grp.src, unit, _FRAME_BYTES)
                gis, nbs, srcs = gi.tolist(), nb.tolist(), src.tolist()
                for lo, hi in _tcp_frames(nb, unit, _FRAME_BYTES, _ITEMS_PER_FRAME):
                    hdr = pack(_MAGIC, 1, _K_DATA, seg.dst_rank, g.token, layer, seg.tensor, 0, 0, hi - lo,
                               seg.dst_offset, seg.length, seg.count, seg.dst_stride)
                    hdr += b"".join(item(first + gis[i], nbs[i]) for i in range(lo, hi))
                    frames.append((hdr, seg, srcs[lo:hi], nbs[lo:hi], self._region_view(self.cache, layer, seg.tensor)))
        socks = self._data_socks
        per = -(-len(frames) // len(socks))  # contiguous shares keep each stream's frames in order
        parts = [frames[i * per:(i + 1) * per] for i in range(len(socks))]
        errors: list[BaseException] = []

        def push(sock: socket.socket, fs: list) -> None:
            # payload views are slices of one view of the source region (a slice costs a
            # fraction of a new ctypes view), made here while the previous sendmsg's bytes
            # are in flight
            try:
                batch: list = []
                size = 0
                for hdr, seg, srcs, nbs, (rv, rbase) in fs:
                    batch.append(hdr)
                    if seg.count == 1:
                        n1 = seg.length
                        for a, nb in zip(srcs, nbs):
                            o = a - rbase
                            batch.append(rv[o:o + n1 * nb])
                            size += n1 * nb
                    else:
                        for a in srcs:
                            o = a - rbase
                            for c in range(seg.count):
                                q = o + c * seg.src_stride
                                batch.append(rv[q:q + seg.length])
                            size += seg.length * seg.count
                    if len(batch) >= 512 or size >= (8 << 20):
                        _sendmsg_all(sock, batch)
                        self.stats["bytes"] += size
                        batch, size = [], 0
                    self.stats["frames"] += 1
                if batch:
                    _sendmsg_all(sock, batch)
                    self.stats["bytes"] += size
            except BaseException as exc:
                errors.append(exc)

        if len(socks) == 1:
            push(socks[0], parts[0])
        else:
            ts = [threading.Thread(target=push, args=(sk, p)) for sk, p in zip(socks, parts) if p]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        if errors:
            raise TransferError(f"tcp send failed: {errors[0]}")


def _recv_n(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (the socket's timeout applies); PeerError on EOF."""
    out = bytearray()
    while len(out) < n:
        k = sock.recv(n - len(out))
        if not k:
            raise PeerError("connection closed")
        out += k
    return bytes(out)


def _sendmsg_all(sock: socket.socket, bufs: list) -> None:
    """Send every buffer, up to 512 per ``sendmsg``, resuming after partial sends."""
    views = [v for v in (b if isinstance(b, memoryview) else memoryview(b) for b in bufs) if v.nbytes]
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i:i + 512])
        while n:
            k = views[i].nbytes
            if n >= k:
                n -= k
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
