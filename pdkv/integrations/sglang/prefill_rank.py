"""Prefill's half of pdkv's SGLang backend in plain ids: :class:`PrefillRank` (one per
SGLang prefill rank). The decode half, the settings and the names both halves share are in
:mod:`.sides`.

A prefill rank registers its pull endpoint at SGLang's bootstrap server; each decode rank
that receives a request pulls from it. Once every decode rank pulled and SGLang said how
many pages make the request (``init``), each chunk's pages go to every decode rank as
SGLang hands them over (``send``): one stream per decode rank reserves at the first chunk,
writes every layer of each chunk in order, and after the last confirms, awaits decode's
outcome and sends the aux data.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field

from ... import _ffi
from ...errors import PdkvError, RequestError
from ...layout import KVLayout, tp_segments
from ...transfer import PrefillSender
from ..core.pull import PullReq, PullServer
from .aux import AuxSender
from .bootstrap import Registration, entry_for
from .layouts import RankPools
from .sides import MAX_EARLY_PULLS, PID_PATTERN, Settings, aux_slots, room_binding, sources_of

__all__ = ["PrefillRank", "RoomOut"]


@dataclass
class _Stream:
    """One request's sends to one decode rank: reserved at the first page, then each
    chunk's pages as SGLang hands them over, in order, by one pool task at a time."""

    pid: str
    dec: tuple[str, str, int, int]  # (control, aux, decode TP size, decode_prefix_len)
    tx: PrefillSender | None = None
    sent: int = 0  # pages written so far (the grant's first ``sent`` blocks)
    busy: bool = False  # a pool task runs for it
    mark: int = 0  # the sender's ``handed_over`` after this stream's last chunk
    ended: bool = False  # finished, or told decode it failed


@dataclass
class RoomOut:
    """One request at a prefill rank."""

    room: int
    pages: list[int] = field(default_factory=list)
    num_pages: int = -1  # from init; -1 before
    aux_index: int | None = None
    # pid -> (control, aux, decode TP size, decode_prefix_len)
    decodes: dict[str, tuple[str, str, int, int]] = field(default_factory=dict)
    prefix: int = 0  # decode_prefix_len: the prompt tokens decode holds; known once every pull is in
    expected: int = 0  # decode ranks that pull from this rank (0: not known yet)
    streams: dict[str, _Stream] = field(default_factory=dict)  # pid -> its sends, from the first page
    done: set[str] = field(default_factory=set)
    state: str = "bootstrapping"  # -> waiting (every pull in) -> transferring -> success | failed
    error: str = ""
    started: float = 0.0
    bytes: int = 0  # written by this rank, over every decode rank (SGLang's transfer_total_bytes)
    created: float = field(default_factory=time.monotonic)
    active: float = 0.0  # when SGLang last handed over pages


class PrefillRank:
    """One SGLang prefill rank's pdkv side: its pull endpoint (registered at the bootstrap
    server), the requests SGLang sends, one :class:`PrefillSender` per decode rank that
    pulls, and the workers that send. Ownership: sockets, senders, threads (:meth:`close`)."""

    def __init__(
        self,
        pools: RankPools,
        settings: Settings,
        bootstrap: str,
        *,
        aux: tuple[list[int], list[int]] = ([], []),
        instance: str = "",
        workers: int = 8,
    ) -> None:
        self.layout, self.cache, self.settings = pools.layout, pools.device, settings
        if self.layout.tp_size > 1 and not settings.instance_key:
            raise PdkvError(
                "a prefill of TP > 1 needs PDKV_SGLANG_INSTANCE_KEY (hex, >= 16 bytes, the same on every "
                "rank): it is what makes the ranks one instance at decode"
            )
        self.instance = instance or f"sglang-prefill-{bootstrap}"
        self._key = settings.instance_key or os.urandom(32)
        self._aux_ptrs, self._aux_items = list(aux[0]), list(aux[1])
        self._lock = threading.Lock()
        self._rooms: dict[int, RoomOut] = {}
        # pulls for rooms SGLang has not opened here yet: room -> (when it expires, the pulls);
        # an entry ends at open() or at its expiry (a request aborted before prefill saw it)
        self._early: dict[int, tuple[float, dict[str, tuple[str, str, int, int]]]] = {}
        self.registration: Registration | None = None
        self._senders: dict[tuple[str, int], PrefillSender] = {}
        self._opening: dict[tuple[str, int], threading.Lock] = {}  # one opener per decode rank
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="pdkv-sglang-send")
        self._aux = AuxSender(settings.secret)
        self.desk = PullServer(f"tcp://{settings.host}:0", self._on_pull, secret=settings.secret)
        try:  # registered now and again every REREGISTER_S, each entry freshly issued
            self.registration = Registration(
                bootstrap, lambda: entry_for(settings.secret, self.layout, self.desk.address, self.instance)
            )
        except BaseException:
            self.close()
            raise

    def _early_ttl(self) -> float:
        """How long a pull waits for SGLang to open its room here: the bound decode gives
        the request (it fails there by then)."""
        return self.settings.timeout_s + self.settings.lease_s

    def _expire_early(self, now: float) -> None:
        """With the lock held: drop the early pulls past their expiry (insertion order is
        expiry order: the TTL is one)."""
        while self._early:
            room, (expires, _) = next(iter(self._early.items()))
            if expires > now:
                return
            del self._early[room]

    @property
    def early_pulls(self) -> int:
        """Rooms with pulls waiting for SGLang to open them here."""
        with self._lock:
            self._expire_early(time.monotonic())
            return len(self._early)

    def _decode_layout(self, d: int, dtp: int) -> KVLayout:
        return dataclasses.replace(self.layout, tp_size=dtp, tp_rank=d)

    def _expected(self, dtp: int) -> int:
        return dtp  # every decode rank pulls from every prefill rank

    def _on_pull(self, r: PullReq) -> str:
        m = PID_PATTERN.fullmatch(r.pid)
        if m is None:
            return "not an SGLang request id"
        room, d, dtp = int(m.group(1)), int(m.group(2)), int(m.group(3))
        if not 0 <= d < dtp:
            return "decode rank out of range"
        try:
            sources_of(self.layout, self._decode_layout(d, dtp))  # the layouts pair (or raise)
        except PdkvError as exc:
            return f"this prefill's layout cannot write that decode's: {exc}"
        if r.binding != room_binding(room):
            return "the binding is not the room's"
        parts = r.decode.split(" ")
        if len(parts) != 2 or not all(p.startswith("tcp://") for p in parts):
            return "decode must name its control and aux endpoints"
        with self._lock:
            out = self._rooms.get(room)
            if out is not None:
                pulls = out.decodes
            else:
                now = time.monotonic()
                self._expire_early(now)
                got = self._early.get(room)
                if got is None:
                    if len(self._early) >= MAX_EARLY_PULLS:
                        return (
                            f"{MAX_EARLY_PULLS} pulls wait for requests this prefill has not seen; "
                            f"refused until some expire ({self._early_ttl():g} s)"
                        )
                    got = self._early[room] = (now + self._early_ttl(), {})
                pulls = got[1]
            if r.pid in pulls and pulls[r.pid][0] != parts[0]:
                return "this request was pulled by another decode rank already"
            # every rank of the instance reserves and confirms at every decode rank (decode
            # completes a grant when all of them have), even one that writes nothing there
            # (MLA's latent is written by the lowest rank only)
            pulls[r.pid] = (parts[0], parts[1], dtp, r.prefix)
            if out is not None:
                self._advance(out)
        return ""

    # ------------------------------------------------------------------ SGLang's order
    def open(self, room: int) -> RoomOut:
        with self._lock:
            out = self._rooms.get(room)
            if out is not None and out.state not in ("success", "failed"):
                raise RequestError(f"room {room} is already in flight at this prefill rank")
            early = self._early.pop(room, None)
            decodes = early[1] if early is not None and early[0] > time.monotonic() else {}
            out = self._rooms[room] = RoomOut(room, decodes=decodes)
            self._advance(out)
        return out

    def init(self, out: RoomOut, num_pages: int, aux_index: int | None) -> None:
        with self._lock:
            out.num_pages, out.aux_index = num_pages, aux_index
            self._advance(out)

    def send(self, out: RoomOut, pages: list[int]) -> None:
        with self._lock:
            if out.state in ("success", "failed"):
                return
            out.pages.extend(int(p) for p in pages)
            out.active = time.monotonic()
            if out.num_pages >= 0 and len(out.pages) > out.num_pages:
                self._fail(out, f"{len(out.pages)} pages sent; init said {out.num_pages}")
            self._advance(out)

    def _advance(self, out: RoomOut) -> None:
        """With the lock held: every pull in -> waiting; and every page in -> send."""
        if out.state in ("success", "failed") or not out.decodes:
            return
        _, _, dtp, prefix = next(iter(out.decodes.values()))
        if any(v[2] != dtp for v in out.decodes.values()):
            return self._fail(out, "decode ranks of different TP sizes pulled one request")
        if any(v[3] != prefix for v in out.decodes.values()):
            return self._fail(out, "decode ranks hold prefixes of different lengths (decode_prefix_len)")
        if prefix % self.layout.tokens_per_block:
            return self._fail(out, f"decode_prefix_len={prefix} is not a whole number of pages")
        out.prefix = prefix
        # no more than expected can pull: one pid per decode rank (PID_PATTERN), one TP size
        out.expected = out.expected or self._expected(dtp)
        if out.state == "bootstrapping" and len(out.decodes) == out.expected:
            out.state = "waiting"
        if out.state == "waiting" and out.num_pages >= 0 and len(out.pages) == out.num_pages:
            out.state, out.started = "transferring", time.monotonic()
        # a chunk's pages go as soon as SGLang hands them over (every decode rank pulled and
        # init said how many pages make the request), while it computes the next chunk
        if out.state in ("waiting", "transferring") and out.num_pages >= 0 and (out.pages or not out.num_pages):
            for pid, dec in out.decodes.items():
                self._kick(out, out.streams.setdefault(pid, _Stream(pid, dec)))
        if out.state == "transferring" and len(out.done) == out.expected:
            out.state = "success"

    def _kick(self, out: RoomOut, st: _Stream) -> None:
        """With the lock held: a pool task for ``st`` unless one runs (it sees new pages)."""
        if not st.busy and not st.ended:
            st.busy = True
            self._pool.submit(self._pump, out, st)

    def _fail(self, out: RoomOut, why: str) -> None:
        if out.state not in ("success", "failed"):
            out.state, out.error = "failed", why
            for st in out.streams.values():  # a reserved grant is ended at decode now
                if st.tx is not None:
                    self._kick(out, st)

    def _sender(self, control: str, dtp: int) -> PrefillSender:
        """The session to one decode rank, opened by one stream while the others wait: a
        second Hello of this process for the same rank would replace the first session at
        decode (one live session per rank) and fail the requests on it. The wait is bounded
        by the opener's handshake (``timeout_s``). A broken session is replaced, then closed."""
        key = (control, dtp)
        with self._lock:
            tx = self._senders.get(key)
            if tx is not None and not tx.broken:
                return tx
            opening = self._opening.setdefault(key, threading.Lock())
        with opening:
            with self._lock:
                old = self._senders.get(key)
                if old is not None and not old.broken:
                    return old  # another stream opened it meanwhile
            tx = PrefillSender(
                self.layout,
                self.cache,
                control,
                instance=self.instance,
                instance_key=self._key,
                secret=self.settings.secret,
                transport=self.settings.transport,
                timeout_s=self.settings.timeout_s,
            )
            with self._lock:
                self._senders[key] = tx
        if old is not None:
            old.close()
        return tx

    def _pump(self, out: RoomOut, st: _Stream) -> None:
        """Send what SGLang has handed over of ``out`` to one decode rank and is not sent
        yet, until nothing new is there (the next chunk kicks it again); once every page
        is sent: confirm, await decode's outcome, send the aux data. A failure fails the
        request (and, once reserved, ends its grant at decode at once)."""
        control, aux_addr, dtp, _ = st.dec
        waited = False
        while True:
            with self._lock:
                failed, why = out.state == "failed", out.error
                pages, total = list(out.pages[st.sent :]), out.num_pages
                if not failed and not pages and total:
                    st.busy = False  # nothing new: the next chunk kicks it again
                    return
            if not failed and st.tx is not None and not waited and not st.tx.written(st.mark):
                # the session is still writing this request's earlier chunks: let the pages
                # that come meanwhile gather into one write (a chunk's layers are a job
                # each, and many small jobs cost more than one large one), at most the
                # timeout; the data thread wakes this wait (no polling beside SGLang's loop)
                st.tx.wait_written(st.mark, self.settings.timeout_s)
                waited = True
                continue  # what came meanwhile is read again, then sent
            waited = False
            try:
                if failed:
                    self._end(st, why)
                    break
                if total == 0:
                    raise RequestError("no pages to send")
                if st.tx is None:
                    tx = self._sender(control, dtp)
                    got = tx.reserve_many([(st.pid, total * self.layout.tokens_per_block, room_binding(out.room))])[0]
                    if isinstance(got, BaseException):
                        raise got
                    st.tx = tx
                for layer in range(self.layout.total_layers):
                    st.tx.send_chunk(layer, st.pid, pages, st.sent)
                st.sent, st.mark = st.sent + len(pages), st.tx.handed_over
                if st.sent < total:
                    continue
                st.tx.finish(st.pid)
                o = st.tx.wait_outcome(st.pid, self.settings.timeout_s + self.settings.lease_s)
                if o.state != "received":
                    raise PdkvError(f"decode answered {o.state}: {o.reason}")
                if out.aux_index is not None and self._aux_ptrs and self._is_aux_source(st.pid):
                    slots = aux_slots(self._aux_ptrs, self._aux_items, out.aux_index)
                    blobs = [bytes(_ffi.libc.host_view(a, n)) for a, n in slots]
                    self._aux.send(aux_addr, st.pid, blobs)
                with self._lock:
                    st.ended = True
                    if out.state == "transferring":
                        out.done.add(st.pid)
                        out.bytes += total * self._block_bytes_to(st.pid)
                        if len(out.done) == out.expected:
                            out.state = "success"
                return
            except Exception as exc:  # one request fails alone
                why = f"sending to {control}: {exc}"
                with self._lock:
                    self._fail(out, why)
                self._end(st, why)
                break
        with self._lock:
            st.ended = True

    @staticmethod
    def _end(st: _Stream, why: str) -> None:
        """Tell decode a reserved request failed here (its grant ends at once, not at its
        lease); nothing to tell when never reserved or already confirmed."""
        if st.tx is None:
            return
        try:
            st.tx.finish(st.pid, ok=False, error=why[:200])
        except Exception:  # the session is gone, or the request already ended there
            pass

    def _decode_of(self, pid: str) -> KVLayout:
        """The layout of the decode rank ``pid`` names (a pid this rank accepted a pull for)."""
        m = PID_PATTERN.fullmatch(pid)
        assert m is not None
        return self._decode_layout(int(m.group(2)), int(m.group(3)))

    def _block_bytes_to(self, pid: str) -> int:
        """The bytes of one block this rank writes to the decode rank of ``pid``: its share
        of that rank's heads (none where another rank writes a replicated head or MLA's latent)."""
        dst, me = self._decode_of(pid), self.layout.tp_rank
        segs = tp_segments(self.layout, dst)
        return self.layout.total_layers * sum(s.nbytes for s in segs if s.src_rank == me and s.dst_rank == dst.tp_rank)

    def _is_aux_source(self, pid: str) -> bool:
        """A decode rank takes its aux data from the lowest prefill rank that writes it."""
        return sources_of(self.layout, self._decode_of(pid))[0] == self.layout.tp_rank

    def status(self, out: RoomOut) -> str:
        limit, now = self.settings.timeout_s + self.settings.lease_s, time.monotonic()
        if out.state == "bootstrapping" and now - out.created > limit:
            with self._lock:  # SGLang's bootstrap timeout: the decode side never asked
                self._fail(out, f"not every decode rank pulled within {limit:g} s")
        # waiting with no page yet: in SGLang's queue (SGLang bounds that); once pages flow,
        # the next chunk must come within the bound, as decode's grant lease would end
        if out.state == "waiting" and out.pages and now - out.active > limit:
            with self._lock:
                self._fail(out, f"SGLang handed over no further pages within {limit:g} s")
        if out.state == "transferring" and now - out.started > limit + self.settings.timeout_s:
            with self._lock:
                self._fail(out, "no outcome from decode in time")
        return out.state

    def prefix(self, out: RoomOut) -> int:
        """``pop_decode_prefix_len``: the prompt tokens decode holds already (0 until every
        decode rank pulled, when SGLang asks); SGLang then sends only the pages after them."""
        with self._lock:
            return out.prefix if out.state != "bootstrapping" else 0

    def abort(self, out: RoomOut, why: str = "aborted by SGLang") -> None:
        with self._lock:
            self._fail(out, why)

    def forget(self, out: RoomOut) -> None:
        with self._lock:
            self._fail(out, "cleared by SGLang")
            if self._rooms.get(out.room) is out:
                del self._rooms[out.room]

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()
        self.desk.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for tx in self._senders.values():
            tx.close()
        self._aux.close()
