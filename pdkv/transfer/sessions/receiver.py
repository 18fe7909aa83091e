"""The decode side's session state and surface: :class:`ReceiverCore`, what
:class:`~pdkv.transfer.decode.DecodeReceiver` (the control loop and the message handling),
the handshake's decode half and the transports (``base.ReceiverHost``) share: the control
socket and its guard, the served transports, the sessions, grants and requests in flight,
counters, lifetime.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ...buffer.region import HostRegion
from ...buffer.shared import SharedBuffer
from ...layout import CacheSpec, KVLayout
from ...protocol import (
    MAX_MESSAGE_BYTES,
    Bye,
    Codec,
    GrantMsg,
    Message,
)
from ...scheduling.scheduler import DecodeScheduler, Event
from ..transports import base as registry
from ..transports.base import Inflight, Peer, ReceiverTransport
from .channel import Channel, RateLimitedLog, Replies
from .guard import ControlGuard
from .identity import Handshake, HelloNonces
from .options import ReceiverOptions, merge_options

__all__ = ["ReceiverCore"]

_log = logging.getLogger(__name__)

# the control socket: a message at most MAX_MESSAGE_BYTES (with its frame's MAC), and few
# queued per connection, so that what a connection can make decode hold is bounded
_CONTROL_MSG_BYTES = MAX_MESSAGE_BYTES + 64
_CONTROL_RCVHWM = 4


def _loopback(endpoint: str) -> bool:
    """Whether a zmq endpoint is reachable only from this host."""
    if not endpoint.startswith("tcp://"):
        return True  # ipc://, inproc://
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


class ReceiverCore:
    """The state of a :class:`~pdkv.transfer.decode.DecodeReceiver` (its parameters are
    documented there), and what the transports and the handshake call on it."""

    def __init__(
        self,
        scheduler: DecodeScheduler,
        layouts: Sequence[KVLayout],
        buffers: Sequence[SharedBuffer | HostRegion],
        buffer_blocks: int,
        options: ReceiverOptions | None = None,
        **kw: Any,
    ) -> None:
        opts: ReceiverOptions = merge_options(ReceiverOptions, options, kw, "DecodeReceiver")
        entries = []
        for t in opts.transports:
            try:
                entries.append(registry.get(t))
            except ValueError as exc:
                raise ValueError(f"transport {t!r} is not served by DecodeReceiver: {exc}") from None
        if opts.gpu_caches is not None and not any(e.receiver.writes_gpu for e in entries):
            raise ValueError("gpu_caches are served by cuda_ipc only: add it to transports")
        if len(layouts) != len(buffers) or not layouts:
            raise ValueError("give one buffer per decode rank layout")
        if scheduler.num_layers != layouts[0].total_layers:
            raise ValueError(
                f"the scheduler counts {scheduler.num_layers} layers a request, the layout has "
                f"{layouts[0].total_layers}: make it with DecodeScheduler(layout=...)"
            )
        if scheduler.buffer is None and not any(e.receiver.writes_gpu for e in entries):
            raise ValueError(
                f"the scheduler has no buffer and {', '.join(opts.transports)} write only into one: nothing "
                "could be granted (give the scheduler a buffer, or serve cuda_ipc with gpu_caches)"
            )
        self.options = opts
        self.scheduler = scheduler
        self.layouts = list(layouts)
        self.ranks = [lay.tp_rank for lay in layouts]
        self.tp_size = layouts[0].tp_size
        self.buffers = list(buffers)
        self.buffer_blocks = buffer_blocks
        # a HostRegion (an engine's own pages) carries its spec; a SharedBuffer has pdkv's layout
        engine = [b for b in buffers if isinstance(b, HostRegion)]
        if engine:
            odd = [e.name for e in entries if not e.receiver.engine_memory]
            if odd or len(engine) != len(buffers):
                raise ValueError(
                    f"an engine's own host memory ({engine[0].name}) is received into by tcp and nixl only, "
                    f"not {', '.join(odd) or 'beside shared buffers'}: serve transports=('tcp',) or ('tcp', 'nixl')"
                )
            for lay, b in zip(layouts, engine):
                if b.spec.layout != lay or b.spec.num_blocks != buffer_blocks:
                    raise ValueError(f"{b.name}: its spec is not rank {lay.tp_rank}'s layout of {buffer_blocks} pages")
        self.specs = {
            lay.tp_rank: b.spec
            if isinstance(b, HostRegion)
            else CacheSpec.for_buffer(lay, buffer_blocks, b.address, order=opts.buffer_order)
            for lay, b in zip(layouts, buffers)
        }
        for lay, buf in zip(layouts, buffers):
            if not isinstance(buf, HostRegion) and buf.size < CacheSpec.buffer_bytes(lay, buffer_blocks):
                raise ValueError(
                    f"buffer {buf.name} holds {buf.size} bytes; rank {lay.tp_rank} needs "
                    f"{CacheSpec.buffer_bytes(lay, buffer_blocks)} for {buffer_blocks} blocks"
                )
        self.secret = opts.secret
        Codec(opts.secret)  # checks the secret now (ValueError), not at the first hello
        self.instance = f"decode-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stats = {
            "frames": 0,
            "bytes": 0,
            "frames_rejected": 0,
            "messages_rejected": 0,
            "peers_dead": 0,
            "connections_refused": 0,
            "auth_failed": 0,
            "accept_errors": 0,
            "loop_errors": 0,
            "frames_cut": 0,
            "identity_refused": 0,
            "control_evicted": 0,
            "messages_dropped": 0,
            "quota_refused": 0,
        }
        self._stats_lock = threading.Lock()
        # transport -> [bytes credited, layers landed], every transport (stats["bytes"] is tcp's wire)
        self.received: dict[str, list[int]] = {}
        self._warn = RateLimitedLog()
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        # grants and outcomes decided while one batch message is handled: sent together
        self._replies = Replies(self._send)
        self._peers: dict[bytes, Peer] = {}
        self._pending: dict[bytes, Handshake] = {}
        self._dropped_at = -math.inf  # when a handshake was last dropped under load (max_handshakes)
        self._sessions: dict[bytes, bytes] = {}  # session id -> peer ident
        self._inflight: dict[str, Inflight] = {}
        self._by_token: dict[int, Inflight] = {}
        self._grants: dict[tuple[str, str], GrantMsg] = {}
        self._hello_nonces = HelloNonces(opts.auth_timeout_s * 2)
        # sessions whose control connection ended (ident -> when seen): ended once what the
        # connection sent before it closed has been served
        self._gone: dict[bytes, float] = {}
        # messages taken off the socket, by connection, served round-robin: one peer's flood
        # of batches delays another's reservation by one message, not by the flood
        self._queues: dict[bytes, collections.deque[tuple[int, list[bytes], float]]] = {}
        self._queued: dict[bytes, int] = {}  # bytes queued, by connection
        self._queued_total = 0  # their sum
        self._threads: list[threading.Thread] = []
        self._transports: dict[str, ReceiverTransport] = {}
        self._ctx = zmq.Context()
        try:  # a half-built receiver (address in use, a transport that cannot start) leaves nothing open
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.MAXMSGSIZE, _CONTROL_MSG_BYTES)
            self._router.setsockopt(zmq.RCVHWM, _CONTROL_RCVHWM)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self._guard = ControlGuard(
                self._router,
                opts.auth_timeout_s,
                opts.max_pending_control,
                opts.max_pending_per_source,
                self.count,
                self.warn,
                self._connection_gone,
            )
            self._router.bind(opts.control)
            self.control_address = bytes(self._router.getsockopt(zmq.LAST_ENDPOINT)).decode()
            for e in entries:
                self._transports[e.name] = e.receiver(self)
            # said once everything listens (a listener that failed is the error, alone)
            if opts.secret is None and not (_loopback(opts.control) and opts.data_host.startswith("127.")):
                _log.warning(
                    "pdkv decode: listening beyond loopback (control %s, data %s) without a secret: "
                    "any host that reaches these ports can write into the buffer "
                    "(give it a secret: pdkv-transfer-test --secret-file or $PDKV_SECRET, ReceiverOptions(secret=...) "
                    "in code; docs/SECURITY.md)",
                    self.control_address,
                    opts.data_host,
                )
        except BaseException:
            self.stopping.set()
            for tr in self._transports.values():
                tr.close()
            self._ctx.destroy(linger=0)
            raise
        self._ch = Channel(self._router, source_fds=True)
        scheduler.add_listener(self._on_event)
        self._start(self._control_loop, "pdkv-decode-control")

    def _start(self, fn: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        return self.stopping.is_set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop threads, close sockets and every transport, stop listening to the
        scheduler. Idempotent."""
        if self.stopping.is_set():
            return
        with self.lock:
            idents = list(self._peers)
        for ident in idents:  # so that prefill fails its requests now, not after its timeout
            self._send(ident, Bye("decode closed"))
        self.stopping.set()
        self._ch.wake()
        for t in self._threads:
            t.join(timeout)
        for tr in self._transports.values():  # each ends its own threads and connections
            tr.close()
        self._guard.close()
        self._ch.close()
        self._ctx.term()
        self.scheduler.remove_listener(self._on_event)

    def transport(self, name: str) -> ReceiverTransport:
        """The served transport ``name`` (KeyError if not served)."""
        return self._transports[name]

    @property
    def data_address(self) -> str:
        """The tcp transport's data listener, ``host:port`` (AttributeError if tcp is not served)."""
        address: str = self._tcp().address
        return address

    @property
    def data_advertise(self) -> str:
        """What prefill is told to connect to for tcp data (settable: NAT, a proxy)."""
        advertise: str = self._tcp().advertise
        return advertise

    @data_advertise.setter
    def data_advertise(self, v: str) -> None:
        self._tcp().advertise = v

    def _tcp(self) -> Any:
        tr = self._transports.get("tcp")
        if tr is None:
            raise AttributeError("this receiver does not serve the tcp transport (no data listener)")
        return tr

    # ------------------------------------------------------------------ host surface (base.ReceiverHost)
    def peer(self, ident: bytes) -> Peer | None:
        with self.lock:
            return self._peers.get(ident)

    def peer_of_session(self, session_id: bytes) -> Peer | None:
        with self.lock:
            ident = self._sessions.get(session_id)
            return self._peers.get(ident) if ident is not None else None

    def inflight_of_token(self, token: int) -> Inflight | None:
        with self.lock:
            return self._by_token.get(token)

    def received_by_transport(self) -> dict[str, tuple[int, int]]:
        """Bytes credited and layers landed so far, by transport (every transport: shm and
        the one-sided ones count the blocks their peers report, tcp the bytes it read)."""
        with self.lock:
            return {t: (v[0], v[1]) for t, v in self.received.items()}

    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def warn(self, key: str, msg: str, *args: object) -> None:
        self._warn.warning(key, msg, *args)

    def __enter__(self) -> ReceiverCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, ident: bytes, msg: Message) -> None:
        """Send to a peer from any thread (dropped if the peer is gone or its queue is full)."""
        peer = self._peers.get(ident)
        if peer is not None:
            self._ch.send(lambda: [ident, *peer.codec.encode(msg)])

    def _connection_gone(self, ident: bytes) -> None:
        """The control connection ``ident`` ended (the guard's monitor): its handshake is
        dropped; its session, or one its queued messages would make, ends once those are
        served (:meth:`retire`)."""
        self._pending.pop(ident, None)
        self._gone.setdefault(ident, time.monotonic())

    def on_session(self, ident: bytes) -> None:
        """A session began on connection ``ident`` (the handshake's last step)."""
        self._guard.session(ident, True, time.monotonic())

    def retire(self, ident: bytes) -> None:  # (DecodeReceiver)
        """Serve what the closed connection ``ident`` sent, then end its session."""
        raise NotImplementedError

    def _control_loop(self) -> None:  # the receiver's thread (DecodeReceiver)
        raise NotImplementedError

    def _on_event(self, ev: Event) -> None:  # scheduler events (DecodeReceiver)
        raise NotImplementedError

    def credit(self, inf: Inflight, layer: int, nbytes: int) -> None:  # (DecodeReceiver)
        """Credit ``nbytes`` of ``layer`` to ``inf`` (a transport counted them landed)."""
        raise NotImplementedError
