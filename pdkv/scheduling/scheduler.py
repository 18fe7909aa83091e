"""The decode-side request lifecycle: reserve, receive, swap, hand off, finish, fail.

Pure Python: no CUDA, no sockets. It talks to the swap engine through
:class:`SwapBackend` and to the engine's GPU allocator through
:class:`~pdkv.scheduling.blocks.BlockAllocator`, so all of it runs on a CPU.

States::

    QUEUED -> RESERVED -> RECEIVING -> RECEIVED -> SWAPPING -> READY -> FINISHED
                 (GPU-direct reservations go RECEIVED -> READY without a swap)
    any non-terminal -> FAILED | EXPIRED | ABORTED;  QUEUED -> REJECTED

Blocks a peer may still be writing (a reservation that expired, failed or was aborted
while RESERVED or RECEIVING) are *quarantined*: held by nobody, counted as held, and
returned to their pool after ``fence_grace_s`` or when :meth:`DecodeScheduler.fence`
says the peer can no longer write, and in either case only once every write admitted
with :meth:`DecodeScheduler.begin_write` has ended (:meth:`DecodeScheduler.end_write`),
whatever the timings. A buffer block read by a swap returns only when the swap has
completed. Hence: a block is never handed out again while a write or a swap may still
touch it.

Threading: every public method may be called from any thread. Listeners and the swap
backend are called with no lock held.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ..errors import GrantViolation, RequestError
from . import loop as schedloop
from . import view as schedview
from .blocks import BlockPool
from .core import Release, SchedulerCore
from .lifecycle import (
    _WRITABLE,
    Event,
    EventKind,
    Grant,
    ReadyRequest,
    RequestInfo,
    Reservation,
    SchedulerOptions,
    State,
    SwapBackend,
    SwapHandle,
    WriteTicket,
    _Hold,
    _make_grant,
    _make_ready,
    _make_reservation,
    _Quarantine,
    _Req,
)

_log = logging.getLogger(__name__)

__all__ = [
    "State",
    "SchedulerOptions",
    "Grant",
    "WriteTicket",
    "Reservation",
    "RequestInfo",
    "ReadyRequest",
    "Event",
    "EventKind",
    "SwapBackend",
    "SwapHandle",
    "DecodeScheduler",
]


class DecodeScheduler(SchedulerCore):
    """Decode-side block accounting and request lifecycle.

    Parameters
    ----------
    num_layers:
        Cache layers per request (``KVLayout.total_layers``).
    gpu:
        The engine's GPU block allocator (or a :class:`BlockPool`); ``None`` with
        ``SchedulerOptions(bind="engine")``, where the engine binds blocks itself (:meth:`bind`).
    buffer:
        The CPU buffer's pool; ``None`` disables the buffer path.
    swap:
        Moves buffer blocks into GPU blocks; required with a buffer.
    layout:
        The decode rank's :class:`~pdkv.layout.KVLayout`: gives ``num_layers``
        (``total_layers``), the tokens per block (so :meth:`reserve` takes ``num_tokens``)
        and ``block_bytes``. Without it, give ``num_layers`` and, where wanted, the two others.
    tokens_per_block:
        Lets :meth:`reserve` take ``num_tokens`` (the layout's, when one is given).
    block_bytes:
        Bytes of one block (all layers, every rank this scheduler serves), for swap byte
        counters; default the layout's (one rank).
    options:
        :class:`SchedulerOptions`.
    clock:
        Monotonic seconds; injectable for tests.
    listener:
        Called with each :class:`Event`, from whichever thread caused it, with no lock held.

    Drive it by calling :meth:`tick` from the engine loop (every decode step): it expires
    leases, grants queued reservations, polls swaps and admits new ones.
    """

    def reserve(
        self,
        request_id: str,
        *,
        num_blocks: int | None = None,
        num_tokens: int | None = None,
        peer: str = "",
        gpu_ok: bool = True,
        binding: bytes = b"",
    ) -> Reservation:
        """Reserve destination blocks for a request: GPU first (above the reserve), then
        the buffer, then queue or reject by policy.

        ``gpu_ok=False`` keeps this request in the buffer even with ``direct_to_gpu`` (a
        transport that can write host memory only); a queued request keeps it.
        ``binding``: opaque bytes kept with the request while it lives
        (:meth:`request`'s ``binding``), for an engine adapter to check claims against.

        Raises
        ------
        RequestError
            Duplicate live id, bad size, or a request larger than every pool.
        """
        if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
            raise RequestError(f"request_id={request_id!r} must be a non-empty string of at most 256 characters")
        if num_blocks is None:
            if num_tokens is None or self.tokens_per_block is None:
                raise RequestError(
                    "give num_blocks, or num_tokens with a layout (or tokens_per_block) on the scheduler"
                )
            if not isinstance(num_tokens, int) or num_tokens <= 0:
                raise RequestError(f"num_tokens={num_tokens!r} must be a positive integer")
            num_blocks = -(-num_tokens // self.tokens_per_block)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise RequestError(f"num_blocks={num_blocks!r} must be a positive integer")
        if not isinstance(gpu_ok, bool):
            raise RequestError(f"gpu_ok={gpu_ok!r} must be a bool")
        if not isinstance(binding, bytes) or len(binding) > 32:
            raise RequestError(f"binding={binding!r:.80} must be bytes, at most 32")
        engine = self.options.bind == "engine"
        direct = self.options.direct_to_gpu and gpu_ok and not engine
        gpu_cap = self.gpu.num_total - self.options.gpu_reserve_blocks
        buf_cap = self.buffer.num_total if self.buffer is not None else 0
        now = self.clock()
        with self._lock:
            if request_id in self._reqs:
                raise RequestError(f"request {request_id!r} is already live ({self._reqs[request_id].state.value})")
            hold = self._holds.get(request_id)
            hold = hold if hold is None or hold.binding in (b"", binding) else None  # another claim's: kept
            p = len(hold.blocks) if hold is not None else 0
            if p >= num_blocks:
                raise RequestError(
                    f"request {request_id!r}: its held prefix of {p} blocks covers all {num_blocks} blocks "
                    "of the prompt; nothing would be received"
                )
            n = num_blocks - p  # only the suffix is granted and received
            why = ""
            if engine and n > buf_cap:
                why = f"request {request_id!r} needs {n} blocks: more than the buffer holds ({buf_cap})"
            if not engine and (n > gpu_cap or (not direct and n > buf_cap)):
                why = f"request {request_id!r} needs {n} blocks: more than the GPU pool can ever give "
                why += f"({gpu_cap} above the reserve)" + ("" if direct else f" or the buffer holds ({buf_cap})")
            if why:  # refused for good: its tombstone says so to whoever asks for its KV
                self._entomb(request_id, State.REJECTED, why)
                raise RequestError(why)
            self._tomb.pop(request_id, None)
            req = _Req(request_id, n, num_tokens, peer, gpu_ok=gpu_ok, binding=bytes(binding))
            if hold is not None:
                del self._holds[request_id]
                req.prefix, req.release = hold.blocks, hold.release
            refusal = self._refusal(request_id, n)
            # queued requests go first: a new one may not overtake them (but where the engine
            # places each request's blocks, one that fits is granted past those waiting)
            grant = None if refusal or (self._queue and not self._overtake) else self._grant(req, now)
            if refusal:  # it could never be granted: refused now, not queued
                self._m["reservations_rejected"] += 1
                res = Reservation(request_id, "rejected", reason=refusal)
                self._entomb(request_id, State.REJECTED, refusal)
                self._release_prefix(request_id, req.prefix, req.release)
            elif grant is not None:
                self._reqs[request_id] = req
                res = _make_reservation(request_id, grant.location, grant, "")
                self._event(EventKind.RESERVED, request_id, grant=grant, t=now)
            elif self.options.on_full == "queue" and len(self._queue) < self.options.max_queue:
                req.queue_deadline = now + self.options.queue_timeout_s
                self._reqs[request_id] = req
                self._queue.append(request_id)
                self._m["reservations_queued"] += 1
                res = Reservation(request_id, "queued", reason="no room; queued")
            else:
                self._m["reservations_rejected"] += 1
                why = "queue full" if self.options.on_full == "queue" else "no free GPU or buffer blocks"
                res = Reservation(request_id, "rejected", reason=why)
                self._entomb(request_id, State.REJECTED, why)
                self._release_prefix(request_id, req.prefix, req.release)
            if p and res.outcome != "rejected":
                self._m["prefix_blocks_reused"] += p
            ev = self._emit() if self._events else None
        if ev:
            self._deliver(ev)
        return res

    def hold_prefix(
        self, request_id: str, blocks: Sequence[int], release: Release | None = None, *, binding: bytes = b""
    ) -> None:
        """Decode's prefix cache already holds the first ``len(blocks)`` blocks of
        ``request_id``'s prompt (GPU block ids of the engine's, in order): when prefill
        reserves the request, only the rest is granted and received (the grant's
        ``prefix_blocks`` says how many prefill skips), and the ready request's
        ``gpu_blocks`` are ``blocks`` followed by the received ones.

        The blocks stay the engine's: pdkv never writes, frees or hands them out. It calls
        ``release(request_id, blocks)`` exactly once, with no lock held, when it no longer
        needs them: at :meth:`finish`, when the request fails, expires, is aborted or
        rejected, at :meth:`drop_prefix`, or when no reservation claimed the hold within
        ``lease_s``. Call it before prefill reserves the request. With ``binding``, only a
        reservation carrying the same binding claims the hold (another gets its whole prompt).

        Raises RequestError for a live or already held request, or block ids that are not
        distinct GPU block ids (with a :class:`BlockPool` as the GPU pool: ids it does not
        hold, i.e. that the engine has not allocated).
        """
        if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
            raise RequestError(f"request_id={request_id!r} must be a non-empty string of at most 256 characters")
        try:
            ids = tuple(int(b) for b in blocks)
        except (TypeError, ValueError):
            raise RequestError(f"request {request_id!r}: prefix blocks must be integers") from None
        total = self.gpu.num_total if self.options.bind != "engine" else 1 << 62  # engine mode: its own ids
        if not ids or len(set(ids)) != len(ids) or any(not 0 <= b < total for b in ids):
            raise RequestError(
                f"request {request_id!r}: a prefix must be distinct GPU block ids in [0, {total}), got {list(ids)[:8]}"
            )
        if release is not None and not callable(release):
            raise RequestError(f"request {request_id!r}: release={release!r} must be callable")
        if isinstance(self.gpu, BlockPool):
            free = [b for b in ids if not self.gpu.is_held(b)]
            if free:
                raise RequestError(
                    f"request {request_id!r}: prefix blocks {free[:8]} are free in the GPU pool "
                    "(a prefix is blocks the engine holds)"
                )
        with self._lock:
            if request_id in self._reqs or request_id in self._holds:
                raise RequestError(f"request {request_id!r} is already live or holds a prefix")
            self._holds[request_id] = _Hold(ids, release, self.clock() + self.options.lease_s, bytes(binding))

    def drop_prefix(self, request_id: str) -> None:
        """Give back a prefix held for a request prefill has not reserved: its release runs
        now. RequestError if there is no unclaimed hold for it (a reservation that claimed
        the hold releases it when it ends: abort the request instead)."""
        with self._lock:
            hold = self._holds.pop(request_id, None)
            if hold is None:
                live = request_id in self._reqs
                raise RequestError(
                    f"request {request_id!r} holds no unclaimed prefix"
                    + (" (it is live: a prefix its reservation claimed is released when it ends)" if live else "")
                )
            self._release_prefix(request_id, hold.blocks, hold.release)
            ev = self._emit()
        self._deliver(ev)

    # ------------------------------------------------------------------ receiving
    def check_write(self, request_id: str, token: int) -> Grant:
        """Validate that a write for ``request_id`` with ``token`` may land now; return
        the live grant (the transport must only write into its blocks).

        Raises GrantViolation, LeaseExpiredError or RequestError; nothing changes then.
        """
        with self._locked():
            req, blocks = self._writable_blocks(request_id, token)
            lease = self.options.lease_s
            return _make_grant(req.rid, req.location, tuple(blocks), req.token, req.expires, lease, len(req.prefix))

    def begin_write(self, request_id: str, token: int) -> WriteTicket:
        """Admit a write into ``request_id``'s blocks: validate as :meth:`check_write`, then
        hold the blocks until :meth:`end_write`. A request that fails, expires or is aborted
        meanwhile still terminates at once, but its blocks stay quarantined until every
        admitted write has ended, even past ``fence_grace_s`` and a :meth:`fence`.

        Raises GrantViolation, LeaseExpiredError or RequestError; nothing is held then.
        """
        with self._locked():
            req, blocks = self._writable_blocks(request_id, token)
            req.writers.n += 1
            self._m["writes_admitted"] += 1
            return WriteTicket(
                (req.rid, req.location, req.token, req.expires, self.options.lease_s), blocks, req.writers
            )

    def _writable_blocks(self, request_id: str, token: int) -> tuple[_Req, list[int]]:
        """The live request and the blocks a write with ``token`` may fill now (under the lock)."""
        req = self._get_live(request_id)
        self._check_writable(req, token, self.clock())
        blocks = req.gpu_blocks if req.location == "gpu" else req.buffer_blocks
        assert blocks is not None
        return req, blocks

    def end_write(self, ticket: WriteTicket) -> None:
        """The write of ``ticket`` moves no more bytes (finished, failed or cut off). Its
        request's quarantined blocks go back now if nothing else holds them. Once per
        ticket; a second call raises RequestError."""
        now = self.clock()
        with self._lock:
            if not ticket._open:
                raise RequestError(f"write ticket of {ticket._fields[0]!r} already ended")
            ticket._open = False
            w = ticket._writers
            w.n -= 1
            if w.n or not w.entries:
                return
            keep = []
            for q in w.entries:
                if q.releasable(now):
                    self._free_quarantined(q)
                else:
                    keep.append(q)
            w.entries = keep

    def _free_quarantined(self, q: _Quarantine) -> None:
        self._quarantine.remove(q)
        q.pool.free(q.blocks)
        self._m["quarantined_blocks_released"] += len(q.blocks)

    def land_layers(self, request_id: str, token: int, layers: Iterable[int]) -> int:
        """Record layers whose every block landed with success. Returns layers landed so far.

        Each landing extends the lease. A layer out of range or landed twice raises
        RequestError and changes nothing.
        """
        now = self.clock()
        if type(layers) is range and layers.step == 1 and len(layers):
            if not 0 <= layers.start < layers.stop <= self.num_layers:
                raise RequestError(f"layers {layers} out of range [0, {self.num_layers})")
            mask = ((1 << len(layers)) - 1) << layers.start
        else:
            mask = 0
            for layer in layers:
                if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
                    raise RequestError(f"layer {layer!r} out of range [0, {self.num_layers})")
                bit = 1 << layer
                if mask & bit:
                    raise RequestError(f"request {request_id!r}: layer {layer} given twice")
                mask |= bit
        with self._locked():
            req = self._get_live(request_id)
            self._check_writable(req, token, now)
            if req.landed & mask:
                dup = [i for i in range(self.num_layers) if req.landed & mask & (1 << i)]
                raise RequestError(f"request {request_id!r}: layers {dup[:8]} already landed")
            req.landed |= mask
            added = mask.bit_count()
            req.nlanded += added
            self._m["layers_landed"] += added
            req.state = State.RECEIVING
            req.expires = now + self.options.lease_s
            # the expiry heap is refreshed lazily: the old entry is skipped when popped
            return req.nlanded

    def land_layer(self, request_id: str, token: int, layer: int) -> int:
        """Record one landed layer; see :meth:`land_layers`."""
        # the common case (a live request's next layer, a receiver's message per layer)
        # without the general path's set-up; anything else, an error to raise or a lease to
        # expire, takes the general path, which checks everything again under the lock
        if type(layer) is int and 0 <= layer < self.num_layers:
            bit = 1 << layer
            now = self.clock()
            with self._lock:
                req = self._reqs.get(request_id)
                if (
                    req is not None
                    and req.token == token
                    and req.state in _WRITABLE
                    and now < req.expires
                    and not req.landed & bit
                ):
                    req.landed |= bit
                    req.nlanded += 1
                    self._m["layers_landed"] += 1
                    req.state = State.RECEIVING
                    req.expires = now + self.options.lease_s
                    return req.nlanded
        return self.land_layers(request_id, token, (layer,))

    def renew(self, request_id: str, token: int) -> float:
        """Extend a live lease (a prefill heartbeat). Returns the new expiry."""
        now = self.clock()
        with self._locked():
            req = self._get_live(request_id)
            self._check_writable(req, token, now)
            req.expires = now + self.options.lease_s
            return req.expires

    def complete(self, request_id: str, token: int) -> State:
        """Prefill says every write succeeded. Every layer must have landed.

        GPU-direct requests become READY; buffer requests RECEIVED (awaiting a swap).
        """
        now = self.clock()
        with self._locked():
            req = self._get_live(request_id)
            self._check_writable(req, token, now)
            if req.landed != self._all_layers:
                missing = [i for i in range(self.num_layers) if not req.landed & (1 << i)]
                raise RequestError(f"request {request_id!r}: completion before layers {missing[:8]} landed")
            req.received_at = now
            self._m["requests_received"] += 1
            if req.location == "gpu":
                req.state = State.READY
                req.in_ready = True
                self._ready.append(req)
                self._m["requests_ready"] += 1
                self._event(EventKind.READY, req.rid, t=now)
            else:
                req.state = State.RECEIVED
                self._swapq[req.rid] = None
                self._event(EventKind.RECEIVED, req.rid, t=now)
            return req.state

    def fail(self, request_id: str, reason: str, token: int | None = None) -> None:
        """Fail a request (prefill reported an error, a write failed). Blocks a peer may
        still write are quarantined. A wrong token raises GrantViolation."""
        now = self.clock()
        with self._lock:
            req = self._get_live(request_id)
            if token is not None and token != req.token:
                self._m["late_messages_rejected"] += 1
                raise GrantViolation(f"request {request_id!r}: grant token does not match (stale or forged)")
            self._terminate(req, State.FAILED, reason, now)
            ev = self._emit()
        self._deliver(ev)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Abort a request from the decode side (client cancelled), in any live state."""
        now = self.clock()
        with self._lock:
            req = self._get_live(request_id)
            self._terminate(req, State.ABORTED, reason, now)
            ev = self._emit()
        self._deliver(ev)

    def fence(self, peer: str) -> int:
        """The transport guarantees ``peer`` can start no more writes (connection closed, QP
        in error, process dead): release its quarantined blocks now, except those an
        admitted write still holds (they go when it ends). Returns blocks released."""
        with self._lock:
            n = 0
            for q in [q for q in self._quarantine if q.peer == peer]:
                q.fenced = True
                if q.writers.n == 0:  # fenced: only an admitted write still running holds it
                    self._free_quarantined(q)
                    q.writers.entries.remove(q)
                    n += len(q.blocks)
            _log.debug("peer %s fenced: %d quarantined blocks released", peer, n)
            return n

    # ------------------------------------------------------------------ hand-off
    def take_ready(self) -> list[ReadyRequest]:
        """Requests whose KV is in GPU blocks, handed to the engine once each, in order."""
        with self._lock:
            out = []
            for r in self._ready:
                r.in_ready = False
                out.append(_make_ready(r.rid, r.prefix + tuple(r.gpu_blocks or ()), r.tokens, len(r.prefix)))
            self._ready.clear()
            return out

    def finish(self, request_id: str, *, free_gpu_blocks: bool = True) -> None:
        """The engine is done with a READY request: its GPU blocks return to the allocator
        (unless ``free_gpu_blocks=False``: the engine keeps and frees them itself)."""
        with self._lock:
            req = self._reqs.get(request_id)
            if req is None or req.state is not State.READY:
                req = self._get_live(request_id)  # raises the precise error for unknown ids
                raise RequestError(f"request {request_id!r} is {req.state.value}, not ready; cannot finish it")
            # the common path, inlined: a READY request holds GPU blocks only
            blocks, req.gpu_blocks = req.gpu_blocks, None
            if blocks and free_gpu_blocks and not req.bound:
                self.gpu.free(blocks)
            if req.in_ready:
                self._ready.remove(req)
            req.state = State.FINISHED
            prefix, req.prefix = req.prefix, ()
            self._release_prefix(request_id, prefix, req.release)
            del self._reqs[request_id]
            self._entomb(request_id, State.FINISHED, "")
            self._m["requests_finished"] += 1  # FINISHED makes no event
            ev = self._emit() if self._events else None
        if ev:
            self._deliver(ev)

    def release(self, request_id: str) -> None:
        """``SchedulerOptions(bind="engine")`` over a buffer of the engine's own memory (an
        engine whose pages received the KV directly, as SGLang's host pool): the engine takes
        a RECEIVED request's blocks where they are, with no swap. They leave pdkv (back to
        the buffer allocator, which hands them back to the engine) and the request is
        FINISHED, counted as finished.

        Ownership: the blocks are the engine's from this call on.

        Raises
        ------
        RequestError
            Not in engine mode, or a request that is not RECEIVED.
        """
        if self.options.bind != "engine":
            raise RequestError("release() is for SchedulerOptions(bind='engine'); pdkv hands out READY requests")
        now = self.clock()
        with self._lock:
            req = self._get_live(request_id)
            if req.state is not State.RECEIVED:
                raise RequestError(f"request {request_id!r} is {req.state.value}, not received; it cannot be released")
            self._terminate(req, State.FINISHED, "", now)
            ev = self._emit() if self._events else None
        if ev:
            self._deliver(ev)

    def bind(self, request_id: str, gpu_blocks: Sequence[int], *, first_block: int = 0) -> tuple[int, ...]:
        """``SchedulerOptions(bind="engine")``: the engine bound a RECEIVED request to GPU
        blocks of its own allocator. ``gpu_blocks`` take the received blocks
        ``first_block..`` in order; blocks before ``first_block`` (the engine holds them
        already: a local prefix hit) go back to the buffer at once. The swap into them is
        submitted now (the request is SWAPPING; READY once the swap backend says done, and
        :meth:`take_ready` hands it out as usual). Returns the buffer blocks being swapped,
        in order. The GPU blocks stay the engine's: neither :meth:`finish` nor a failure
        frees them.

        Raises
        ------
        RequestError
            Not in engine mode, a request that is not RECEIVED, or blocks that are not one
            distinct non-negative id per block to swap.
        """
        if self.options.bind != "engine":
            raise RequestError("bind() is for SchedulerOptions(bind='engine'); pdkv allocates GPU blocks here")
        req, swapped = schedloop.bind_swap(self, request_id, list(gpu_blocks), first_block, self.clock())
        self._deliver(schedloop.submit(self, [req]))
        return swapped

    # ------------------------------------------------------------------ the loop
    def tick(self) -> list[Event]:
        """Expire leases, release quarantine, grant queued reservations, poll swaps, admit
        swaps. Call it from the engine loop. Returns the events it produced."""
        now = self.clock()
        with self._lock:
            if self._holds:
                schedloop.expire_holds(self, now)
            schedloop.expire_due(self, now)
            schedloop.release_quarantine(self, now)
            schedloop.grant_queued(self, now)
            polls = [(r, r.handle) for r in self._swapping.values() if r.handle is not None]
        done = [(r, h.error) for r, h in polls if h.done()]
        debug = schedloop.logs_swaps()
        with self._lock:
            for req, err in done:
                schedloop.swap_finished(self, req, err, now, debug)
            to_submit = schedloop.admit_swaps(self, now)
            ev = self._emit()
        self._deliver(ev)
        if to_submit:
            more = schedloop.submit(self, to_submit)
            self._deliver(more)
            ev = ev + more
        return [e for e in ev if isinstance(e, Event)]

    # ------------------------------------------------------------------ observability
    def request(self, request_id: str) -> RequestInfo:
        """A snapshot of a live or recently terminated request."""
        return schedview.request(self, request_id)

    def live_requests(self) -> list[str]:
        with self._lock:
            return list(self._reqs)

    def metrics(self) -> dict[str, float]:
        """Counters and gauges as a flat dict. ``live_<state>`` counts the live requests in
        each state now (``live_ready``); ``requests_<event>`` are counters since start."""
        return schedview.metrics(self)

    def prometheus(self, prefix: str = "pdkv_") -> str:
        """:meth:`metrics` in the Prometheus text exposition format."""
        return schedview.prometheus(self, prefix)

    def check_invariants(self, engine_blocks: Iterable[int] = ()) -> None:
        """Assert the accounting invariants (tests): every pool's held blocks are exactly
        those of live requests plus quarantine (plus, on the GPU pool, held prefixes and
        ``engine_blocks``, GPU blocks the engine holds itself); no block has two owners."""
        schedview.check_invariants(self, engine_blocks)
