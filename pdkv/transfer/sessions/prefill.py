"""The prefill side's control session: :class:`PrefillSender`, one per prefill TP rank.

It connects a ZeroMQ DEALER socket to decode, authenticates (Hello, Challenge, Auth,
Welcome), reserves blocks, and hands each layer to a data thread that writes it through
the transport decode chose (a :class:`~.base.SenderTransport` from the registry) while
the engine computes the next layer; it confirms finished requests, keeps heartbeats, and
resolves every request to a definite :class:`RequestOutcome` in bounded time.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from ... import _ffi
from ...errors import (
    ClosedError,
    LayoutError,
    PdkvTimeoutError,
    PeerError,
    ProtocolError,
    RequestError,
    TransferError,
)
from ...layout import CacheSpec, KVLayout, Segment
from ...protocol import (
    Abort,
    Bye,
    Codec,
    Complete,
    CompleteBatch,
    ErrorMsg,
    GrantBatch,
    GrantMsg,
    Heartbeat,
    Message,
    Outcome,
    OutcomeBatch,
)
from ..transports import base as registry
from ..transports.base import (
    FinishJob,
    LayerJob,
    LayerLog,
    RequestOutcome,
    SenderTransport,
    SendGrant,
    Waiter,
    WriteItem,
)
from . import handshake
from .channel import SEND_BATCH, Channel, clip, lateness, unstalled
from .options import SenderOptions, merge_options
from .reservations import Reservations

__all__ = ["PrefillSender", "RequestOutcome"]

_log = logging.getLogger(__name__)

MAX_RESOLVED = 1 << 16  # outcomes kept for wait_outcome / poll_outcome until asked for
RESOLVED_S = 60.0  # and no longer than this when on_outcome had them


class PrefillSender(Reservations):
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
    options:
        A :class:`~pdkv.transfer.SenderOptions` (instance name, secret, transport,
        streams, timeouts, copy threads, outcome callback); its field names are also
        accepted as keywords, which replace the given options' fields.

    Ownership: the engine keeps its source blocks until the request's outcome is known;
    the sender never frees engine memory.
    """

    def __init__(
        self, layout: KVLayout, cache: CacheSpec, control: str, options: SenderOptions | None = None, **kw: Any
    ) -> None:
        opts: SenderOptions = merge_options(SenderOptions, options, kw, "PrefillSender")
        if opts.transport == "auto":
            offer = registry.auto_offer(cache)
            if not offer:
                raise LayoutError(
                    f"no registered transport sends from this cache (registered: {', '.join(registry.names())})"
                )
        else:
            try:
                why = registry.get(opts.transport).sender.refuses(cache)
            except ValueError as exc:
                raise ValueError(
                    f"transport={opts.transport!r} must be auto or a registered transport: {exc}"
                ) from None
            if why is not None:
                raise LayoutError(why)
            offer = [opts.transport]
        self.options = opts
        self.copy_threads = opts.copy_threads
        self.layout, self.cache = layout, cache
        self.instance = opts.instance
        self.timeout_s, self.heartbeat_s = opts.timeout_s, opts.heartbeat_s
        self.on_outcome = opts.on_outcome
        self.stats: dict[str, Any] = {
            "bytes": 0,
            "frames": 0,
            "layers": 0,
            "grant_messages": 0,
            "outcome_messages": 0,
            "path": "",
        }
        self._stats_lock = threading.Lock()
        self.outcomes: dict[str, int] = {}  # requests by outcome state ("received", "failed", ...)
        # (layer, seconds from send_layer() to its writes done, bytes, monotonic time its writes
        # began, monotonic time they were done): per-layer latency, and when the link was busy
        self.layer_log = LayerLog()
        self._codec = Codec(opts.secret)
        self._lock = threading.Lock()
        self._ran_cv = threading.Condition(self._lock)  # notified as the data thread runs jobs
        self._grants: dict[str, SendGrant] = {}
        self._grant_arrays: dict[int, Any] = {}  # grant token -> its block ids as an array
        self._reserve_waiters: dict[str, Waiter] = {}
        self._polled: dict[str, tuple[Waiter, float, float]] = {}  # reserve_nowait's: waiter, deadline, limit
        self._outcomes: dict[str, Waiter] = {}  # reserved, no outcome yet
        # outcomes given, kept for wait_outcome / poll_outcome until asked for, the newest
        # MAX_RESOLVED of them (a sender whose outcomes go to on_outcome never asks)
        self._resolved: collections.OrderedDict[str, tuple[RequestOutcome, float]] = collections.OrderedDict()
        self._failed: dict[str, str] = {}
        self._closed = threading.Event()
        self._bye = threading.Event()  # decode ended the session (or answered ours)
        self._closing = False
        self._broken: str | None = None
        self._jobs: queue.Queue[LayerJob | FinishJob | None] = queue.Queue()
        self._handed = self._ran = 0  # jobs handed to the data thread, and run by it
        self._candidates: dict[str, SenderTransport] = {}
        self._data: SenderTransport | None = None
        self.session_id = b""
        # set by the handshake from the welcome: the transport decode chose, its layout, and
        # this rank's TP segments into the decode ranks it serves
        self.transport = ""
        self.dst_layout = layout
        self.segments: list[Segment] = []
        self._last_heard = time.monotonic()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(control)
        self._ch = Channel(self._sock)
        try:
            handshake.open_session(self, offer, opts.timeout_s)
        except BaseException:
            self._teardown()
            raise
        _log.debug("session open: instance %s rank %d, %s", self.instance, layout.tp_rank, self.stats["path"])
        self._threads = [
            threading.Thread(target=self._io_loop, name="pdkv-prefill-io", daemon=True),
            threading.Thread(target=self._data_loop, name="pdkv-prefill-data", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ host surface (base.SenderHost)
    @property
    def session_key(self) -> bytes | None:
        """The session's key (None without a secret: sessions are then unauthenticated)."""
        return self._codec.key

    @property
    def transport_impl(self) -> SenderTransport:
        """The connected transport's prefill side."""
        assert self._data is not None
        return self._data

    def post(self, msg: Message) -> None:
        """Send to decode now, from whichever thread calls (see :class:`~.channel.Channel`)."""
        self._ch.send(lambda: self._codec.encode(msg))

    def add_bytes(self, n: int, frames: int = 0) -> None:
        with self._stats_lock:
            self.stats["bytes"] += n
            self.stats["frames"] += frames

    def fail_request(self, request_id: str, why: str) -> None:
        with self._lock:
            self._failed.setdefault(request_id, why)

    def break_session(self, why: str, abort: bool = False) -> None:
        self._broken = why
        if abort:
            with self._lock:
                rids = list(self._grants)
            for r in rids:
                self.post(Abort(r, why))
        self._fail_all(why)

    @property
    def broken(self) -> str | None:
        """Why the session ended (decode gone, Bye, a failed write), or None while it serves."""
        return self._broken

    @property
    def handed_over(self) -> int:
        """How many layers (and confirmations) were handed to the data thread so far: a
        mark for :meth:`written`."""
        with self._lock:
            return self._handed

    def written(self, mark: int) -> bool:
        """Whether the data thread has run every job handed over up to ``mark`` (it runs
        them in order). An engine that sends a request in chunks may let pages gather
        while its own earlier chunks are not written, and send them as one write."""
        with self._lock:
            return self._ran >= mark

    def wait_written(self, mark: int, timeout: float) -> bool:
        """Block until :meth:`written` (``mark``) holds, at most ``timeout`` seconds, or the
        sender closes; returns :meth:`written`. No polling: the data thread wakes it."""
        with self._ran_cv:
            self._ran_cv.wait_for(lambda: self._ran >= mark or self._closed.is_set(), timeout)
            return self._ran >= mark

    # ------------------------------------------------------------------ API
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

    def send_chunk(
        self, layer: int, request_id: str, src_blocks: Sequence[int], first_block: int, event: int | None = None
    ) -> None:
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
            self._submit(LayerJob(layer, work, event, time.monotonic()))

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
            raise RequestError(
                f"request {rid!r}: source block ids must be a flat list of integers, got shape {a.shape} of {a.dtype}"
            )
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
        self._after_writes(FinishJob([request_id], ok, error, batch=False))

    def finish_many(self, request_ids: Sequence[str], ok: bool = True, error: str = "") -> None:
        """:meth:`finish` for several requests (a batch that ends together), confirmed to
        decode in one message per ``SEND_BATCH`` (512) requests instead of one each."""
        self._check()
        rids = list(request_ids)
        if rids:
            self._after_writes(FinishJob(rids, ok, error, batch=True))

    def _after_writes(self, job: FinishJob) -> None:
        """Run ``job`` once every write handed over before it has finished."""
        with self._lock:
            idle = self._ran == self._handed
        if idle:  # every write already finished: run it now, without a hop through the data thread
            self._run_job(job)
        else:
            self._submit(job)

    def close(self) -> None:
        """Stop threads, close sockets and shm mappings. Pending requests fail. Idempotent."""
        if self._closed.is_set():
            return
        if self.session_id and not self._bye.is_set():
            # end the session at decode now (its requests fail there at once, and the name and
            # rank are free for a new session), waiting a bounded time for decode's answer; a
            # sender that gave up on decode (silent, frozen) still says Bye, without waiting:
            # a decode that comes back reads it (and the connection's end) before anything new
            self._closing = True
            self.post(Bye("sender closed"))
            if not self._broken:
                self._bye.wait(min(1.0, self.timeout_s))
        self._closed.set()
        with self._ran_cv:
            self._ran_cv.notify_all()  # a wait_written returns now
        self._jobs.put(None)
        self._ch.wake()
        for t in self._threads:
            t.join(5)
        self._fail_all("sender closed")
        self._teardown()

    def _teardown(self) -> None:
        for tr in [*self._candidates.values(), *([self._data] if self._data is not None else [])]:
            tr.close()  # each waits for its own writes, so none still writes into a mapping
        self._candidates.clear()
        self._data = None
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

    def _resolve(self, rid: str, state: str, reason: str = "") -> None:
        out = RequestOutcome(rid, state, reason)
        with self._lock:
            w = self._outcomes.pop(rid, None)
            if w is not None:  # kept as the outcome alone: a waiter holds an Event, ~1 KB
                self._keep_outcome(out)
            g = self._grants.pop(rid, None)
            if g is not None:
                self._grant_arrays.pop(g.token, None)
            rw = self._reserve_waiters.pop(rid, None)
        if rw is not None:
            rw.set(TransferError(f"request {rid!r} {state}: {reason}"))
        if w is not None:
            with self._stats_lock:
                self.outcomes[state] = self.outcomes.get(state, 0) + 1
            w.set(out)
            if self.on_outcome is not None:
                self.on_outcome(out)

    def _keep_outcome(self, out: RequestOutcome) -> None:
        """Keep an outcome until asked for (under ``_lock``): the newest MAX_RESOLVED; with
        ``on_outcome`` set (it was handed over there), for RESOLVED_S seconds at most."""
        kept = self._resolved
        now = time.monotonic()
        kept[out.request_id] = (out, now)
        cut = now - RESOLVED_S if self.on_outcome is not None else -math.inf
        while kept and (len(kept) > MAX_RESOLVED or next(iter(kept.values()))[1] < cut):
            kept.popitem(last=False)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            rids = set(self._outcomes) | set(self._reserve_waiters)
        for rid in rids:
            self._resolve(rid, "failed", why)

    def _io_loop(self) -> None:
        last_hb = 0.0
        while not self._closed.is_set():
            asked = time.monotonic()
            got = self._ch.wait(50)
            if got is None:
                break
            now = time.monotonic()
            self._last_heard = unstalled(self._last_heard, lateness(asked, now, 0.05), now)
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
                self.post(Heartbeat(time.time()))
            if now - self._last_heard > self.timeout_s and not self._broken:
                self._broken = f"decode silent for {self.timeout_s}s: considered dead"
                self._fail_all(self._broken)

    def _on_grant(self, msg: GrantMsg) -> None:
        with self._lock:
            w = self._reserve_waiters.get(msg.request_id)
        if msg.outcome in ("buffer", "gpu"):
            g = SendGrant(msg.request_id, msg.location, tuple(msg.blocks), msg.token, msg.lease_s, msg.prefix_blocks)
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
        elif isinstance(msg, Bye):
            self._bye.set()
            if not self._closing and not self._broken:
                self._broken = f"decode ended the session: {msg.reason}"
                _log.info("%s", self._broken)
                self._fail_all(self._broken)
        elif isinstance(msg, ErrorMsg):
            rid = msg.request_id  # by field: an id may hold any printable character, ':' too
            with self._lock:
                known = bool(rid) and rid in self._outcomes
            if known:
                self._resolve(rid, "failed", msg.message)
            elif not rid:
                _log.warning("decode refused a message: %s (%s)", msg.message, msg.code)

    # ------------------------------------------------------------------ data
    def _submit(self, job: LayerJob | FinishJob) -> None:
        with self._lock:  # numbered and queued together: the marks follow the queue's order
            self._handed += 1
            self._jobs.put(job)

    def _complete(self, rid: str, ok: bool, error: str) -> None:
        with self._lock:
            g = self._grants.get(rid)
            err = self._failed.pop(rid, None)
        if g is not None:  # else already resolved (failed, expired)
            self.post(Complete(rid, g.token, ok and err is None, error or (err or "")))

    def _complete_many(self, rids: list[str], ok: bool, error: str) -> None:
        items = []
        with self._lock:
            for rid in rids:
                g = self._grants.get(rid)
                err = self._failed.pop(rid, None)
                if g is not None:  # else already resolved (failed, expired)
                    items.append((rid, g.token, ok and err is None, clip(error or (err or ""))))
        for i in range(0, len(items), SEND_BATCH):
            self.post(CompleteBatch(items[i : i + SEND_BATCH]))

    def _data_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run_job(job)
            finally:
                with self._ran_cv:
                    self._ran += 1
                    self._ran_cv.notify_all()

    def _run_job(self, job: LayerJob | FinishJob) -> None:
        tr = self.transport_impl
        if isinstance(job, FinishJob):
            # once every write before it is out (a staged transport may still be sending)
            if job.batch:
                tr.after_writes(lambda: self._complete_many(job.request_ids, job.ok, job.error))
            else:
                tr.after_writes(lambda: self._complete(job.request_ids[0], job.ok, job.error))
            return
        layer, mark = job.layer, [0.0, 0.0]  # bytes sent and the time when the layer's writes begin
        try:
            if job.event is not None:
                deadline = time.monotonic() + self.timeout_s
                while not _ffi.cuda.event_query(job.event):
                    if time.monotonic() > deadline:
                        raise PdkvTimeoutError(f"layer {layer}: the engine's event did not complete")
                    time.sleep(20e-6)

            # the layer's bytes and its end counted where its writes are done, in write order
            def begin() -> None:
                mark[:] = [self.stats["bytes"], time.monotonic()]

            def log() -> None:
                done = time.monotonic()
                self.layer_log.append(layer, done - job.queued_at, int(self.stats["bytes"] - mark[0]), mark[1], done)

            tr.after_writes(begin)
            self._write_layer(layer, job.items)
            tr.after_writes(log)
        except Exception as exc:  # every request of the layer failed: report it
            with self._lock:
                for rid, _, _ in job.items:
                    self._failed.setdefault(rid, f"layer {layer}: {exc}")

    def _write_layer(self, layer: int, items: list[tuple[str, Any, int]]) -> None:
        work = []
        for rid, src_blocks, first in items:
            with self._lock:
                g = self._grants.get(rid)
            if g is None:
                continue  # resolved meanwhile (expired, aborted): nothing to write
            p = g.prefix_blocks
            if p:  # the engine's ids cover the prompt; decode holds its first p blocks already
                skip = max(0, p - first)
                src_blocks, first = src_blocks[skip:], max(0, first - p)
                if not len(src_blocks):
                    continue  # a chunk wholly inside decode's prefix
            dst = self._grant_ids(g)[first : first + len(src_blocks)]
            if len(dst) != len(src_blocks):
                more = f" after the {p} of decode's prefix" if p else ""
                self.fail_request(
                    rid, f"{len(src_blocks)} source blocks{more} but the grant has {len(g.blocks) - first} left"
                )
                continue
            work.append(WriteItem(rid, g, src_blocks, dst, first))
        if not work or not self.segments:
            return  # a rank whose heads another rank sends (replicated heads) writes nothing
        tr = self.transport_impl
        if not tr.writes_gpu:
            for w in [w for w in work if w.grant.location == "gpu"]:
                self.fail_request(w.request_id, f"decode granted GPU blocks, which {self.transport} cannot write")
            work = [w for w in work if w.grant.location != "gpu"]
        if work:
            tr.write_layer(layer, work)
        with self._stats_lock:
            self.stats["layers"] += 1
