"""Reservations of a :class:`~pdkv.transfer.prefill.PrefillSender`: asked for and awaited
(:meth:`reserve`, :meth:`reserve_many`), or posted and polled from a loop that cannot wait
(:meth:`reserve_nowait`, :meth:`poll_grant`, :meth:`poll_outcome`), and each request's
outcome (:meth:`wait_outcome`). A mixin over the sender's state: its lock, waiters, grants
and control channel."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from ...errors import PdkvError, PdkvTimeoutError, RequestError
from ...protocol import MAX_BINDING, MAX_ID, MAX_NUM_TOKENS, Abort, Message, ReserveBatch, ReserveReq
from ..transports.base import RequestOutcome, SendGrant, Waiter
from .channel import SEND_BATCH

__all__ = ["Reservations"]


class Reservations:
    """The reservation half of :class:`~pdkv.transfer.prefill.PrefillSender`."""

    timeout_s: float
    _lock: threading.Lock
    _grants: dict[str, SendGrant]
    _reserve_waiters: dict[str, Waiter]
    _outcomes: dict[str, Waiter]
    _resolved: collections.OrderedDict[str, tuple[RequestOutcome, float]]  # outcome, when kept
    _polled: dict[str, tuple[Waiter, float, float]]

    def _check(self) -> None:
        raise NotImplementedError

    def post(self, msg: Message) -> None:
        raise NotImplementedError

    def reserve(self, request_id: str, num_tokens: int, timeout: float | None = None) -> SendGrant:
        """Ask decode for destination blocks. Returns the grant; raises TransferError if
        decode rejected the request, PdkvTimeoutError if no grant came in time."""
        res = self.reserve_many([(request_id, num_tokens)], timeout)[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def reserve_many(
        self, requests: Sequence[tuple[str, int] | tuple[str, int, bytes]], timeout: float | None = None
    ) -> list[SendGrant | PdkvError]:
        """Reserve several requests at once: every request is sent before any answer is
        awaited, so their round trips overlap (one at a time costs a round trip each).
        Returns one result per request, in order: its grant, or the error :meth:`reserve`
        would have raised for it. Bad input (a duplicate id, an id that is not a string of
        1-``MAX_ID`` characters, a token count outside 1..``MAX_NUM_TOKENS``: what decode
        would refuse) raises before anything is sent;
        ``timeout`` bounds the whole call."""
        limit = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        ids = [r[0] for r in requests]
        waiters = self._post_reservations(requests)
        out: list[SendGrant | PdkvError] = []
        for rid, w in zip(ids, waiters):
            if not w.event.wait(max(0.0, deadline - time.monotonic())):
                out.append(self._give_up(rid, limit))
                continue
            out.append(self._granted(rid, w))
        return out

    def reserve_nowait(
        self, requests: Sequence[tuple[str, int] | tuple[str, int, bytes]], timeout: float | None = None
    ) -> None:
        """Post reservations and return at once (for an engine loop that cannot wait):
        :meth:`poll_grant` answers each later. Checks as :meth:`reserve_many`; ``timeout``
        (default the sender's) bounds how long a grant may take: past it, the next poll
        gives up on the request at decode and answers PdkvTimeoutError."""
        limit = self.timeout_s if timeout is None else timeout
        waiters = self._post_reservations(requests)
        deadline = time.monotonic() + limit
        with self._lock:
            for (rid, *_), w in zip(requests, waiters):
                self._polled[rid] = (w, deadline, limit)

    def poll_grant(self, request_id: str) -> SendGrant | PdkvError | None:
        """A :meth:`reserve_nowait` request's grant, or the error :meth:`reserve` would have
        raised; ``None`` while decode has not answered (never blocks). Answered once."""
        with self._lock:
            entry = self._polled.get(request_id)
        if entry is None:
            raise RequestError(f"request {request_id!r} was not reserved with reserve_nowait (or was answered)")
        w, deadline, limit = entry
        if w.event.is_set():
            with self._lock:
                self._polled.pop(request_id, None)
            return self._granted(request_id, w)
        if time.monotonic() < deadline:
            return None
        with self._lock:
            self._polled.pop(request_id, None)
        return self._give_up(request_id, limit)

    def poll_outcome(self, request_id: str) -> RequestOutcome | None:
        """The request's definite outcome once decode (or a failure here) gave it; ``None``
        until then (never blocks). Answered once, as :meth:`wait_outcome`."""
        with self._lock:
            kept = self._resolved.pop(request_id, None)
            if kept is None and request_id not in self._outcomes:
                raise RequestError(f"unknown request {request_id!r} (or its outcome was already taken)")
        return kept[0] if kept else None

    def _give_up(self, rid: str, limit: float) -> PdkvError:
        with self._lock:
            self._reserve_waiters.pop(rid, None)
            self._outcomes.pop(rid, None)
            self._resolved.pop(rid, None)
        self.post(Abort(rid, "prefill gave up waiting for a grant"))
        return PdkvTimeoutError(f"no grant for {rid!r} within {limit}s")

    def _granted(self, rid: str, w: Waiter) -> SendGrant | PdkvError:
        g = w.value
        if isinstance(g, BaseException):
            with self._lock:
                self._outcomes.pop(rid, None)
                self._resolved.pop(rid, None)
        return g  # type: ignore[no-any-return]

    def _post_reservations(self, requests: Sequence[tuple[str, int] | tuple[str, int, bytes]]) -> list[Waiter]:
        """Check ``requests`` (``(id, tokens)``, or ``(id, tokens, binding)``: up to
        ``MAX_BINDING`` opaque bytes decode keeps with the request), register their
        waiters and post them (no answer awaited)."""
        self._check()
        ids = [r[0] for r in requests]
        if len(set(ids)) != len(ids):
            raise RequestError("reserve_many: a request id appears twice")
        binds = [bytes(r[2]) if len(r) > 2 else b"" for r in requests]
        for (rid, n, *_), b in zip(requests, binds):
            if len(b) > MAX_BINDING:
                raise RequestError(f"request {rid!r}: a binding of {len(b)} bytes (at most {MAX_BINDING})")
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
                w = Waiter()
                self._reserve_waiters[rid] = w
                self._outcomes[rid] = Waiter()
                waiters.append(w)
        if len(requests) == 1:
            self.post(ReserveReq(requests[0][0], requests[0][1], binds[0]))
        else:  # one message per SEND_BATCH requests; decode answers each with one GrantBatch
            items = [(r[0], r[1]) for r in requests]
            bound = any(binds)
            for i in range(0, len(items), SEND_BATCH):
                self.post(ReserveBatch(items[i : i + SEND_BATCH], binds[i : i + SEND_BATCH] if bound else []))
        return waiters

    def wait_outcome(self, request_id: str, timeout: float | None = None) -> RequestOutcome:
        """Block until the request's definite outcome (bounded by ``timeout``). An outcome
        given is kept until asked for, the newest ``MAX_RESOLVED`` (65,536) of them; one
        handed to ``on_outcome`` too, for at most ``RESOLVED_S`` (60 s): a sender that takes
        its outcomes there holds a steady number whatever its request rate."""
        with self._lock:
            kept = self._resolved.pop(request_id, None)
            w = self._outcomes.get(request_id)
        if kept is not None:
            return kept[0]
        if w is None:
            raise RequestError(f"unknown request {request_id!r} (or its outcome was already taken)")
        if not w.event.wait(timeout if timeout is not None else self.timeout_s * 3):
            raise PdkvTimeoutError(f"no outcome for {request_id!r} yet")
        with self._lock:
            self._resolved.pop(request_id, None)
        out: RequestOutcome = w.value
        return out
