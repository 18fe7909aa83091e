"""The decode side's control session: :class:`DecodeReceiver`.

It binds a ZeroMQ ROUTER socket, authenticates each prefill rank (Hello, Challenge, Auth,
Welcome), picks the transport for it from those served (each a
:class:`~.base.ReceiverTransport` from the registry), answers reservations with the
scheduler's grants, credits landed layers (reported by the peer or counted by the
transport), completes requests, and fences silent or dead peers. Every request ends in a
definite outcome on both sides in bounded time.
"""

from __future__ import annotations

import collections
import hmac
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import GrantViolation, PdkvError, ProtocolError, RequestError
from ...plan import run_lengths
from ...procs import pid_alive
from ...protocol import (
    MAX_GRANT_BLOCKS,
    Abort,
    Auth,
    Bye,
    Codec,
    Complete,
    CompleteBatch,
    ErrorMsg,
    GrantMsg,
    Heartbeat,
    Hello,
    LayerBatch,
    LayerDone,
    Message,
    Outcome,
    ReserveBatch,
    ReserveReq,
)
from ...scheduling.scheduler import Event, EventKind
from ..transports.base import Inflight, Peer
from . import handshake
from .channel import LOOP_STALL_S, lateness, unstalled
from .receiver import ReceiverCore

__all__ = ["DecodeReceiver"]

_log = logging.getLogger(__name__)
RENEW_EVERY_S = 1.0  # part of a layer renews a lease at most this often (or lease_s / 4)

# what the control loop takes off the socket before serving it: at most _QUEUED_BYTES in all
# (past it, only a connection with nothing queued has a message taken), and of one connection
# at most _PEER_QUEUE messages and _PEER_QUEUED_BYTES (a connection sending faster than it is
# served loses what passes them; a prefill's messages are KiBs). The socket is read on by at
# least _DRAIN_FLOOR bytes a round whatever is queued, so a newcomer's message (zmq takes the
# connections in turn) is taken within a few rounds however many others flood
_QUEUED_BYTES = 32 << 20
_DRAIN_FLOOR = 2 << 20
_PEER_QUEUE = 1024
_PEER_QUEUED_BYTES = 4 << 20
_ROUND_S = 0.02
# a session whose control connection closed ends this long after (its last messages are
# read from the socket first: zmq reports the connection's end as soon as it sees it)
_GONE_GRACE_S = 0.05


class DecodeReceiver(ReceiverCore):
    """Decode side of the transfer path: serves grants, receives writes, feeds the scheduler.

    Parameters
    ----------
    scheduler:
        The decode scheduler. Its ``direct_to_gpu`` (the default) grants GPU blocks only to
        peers whose transport writes them (``cuda_ipc``, with ``gpu_caches``); the others
        are granted buffer blocks, so the default options work with any transports.
    layouts:
        The layout of each decode rank hosted by this receiver (``tp_rank`` set).
    buffers:
        One :class:`~pdkv.buffer.shared.SharedBuffer` per rank, each holding ``buffer_blocks`` blocks;
        or one :class:`~pdkv.buffer.region.HostRegion` per rank (an engine's own host pages,
        served by ``tcp``), with a scheduler whose buffer pool places by request.
    buffer_blocks:
        Blocks each buffer holds.
    options:
        A :class:`~pdkv.transfer.ReceiverOptions` (control endpoint, secret, transports
        served, timeouts, caps); its field names are also accepted as keywords, which
        replace the given options' fields.

    Ownership: the receiver owns its sockets and threads (:meth:`close`); buffers and the
    scheduler stay the caller's.
    """

    # ------------------------------------------------------------------ control loop
    def _control_loop(self) -> None:
        last_check = time.monotonic()
        while not self.stopping.is_set():
            self._guard.poll(time.monotonic())  # connections accepted and gone, before their messages
            room = _QUEUED_BYTES - self._queued_total
            wait_ms = 0 if self._queues else 2 if self.options.auto_tick else 50
            asked = time.monotonic()
            got = self._ch.wait(wait_ms, max(room, _DRAIN_FLOOR))
            if got is None:
                break
            now = time.monotonic()
            late = lateness(asked, now, wait_ms / 1000)
            if late > LOOP_STALL_S:  # this loop was not scheduled: no peer's silence grew meanwhile
                with self.lock:
                    for p in self._peers.values():
                        p.last_seen = unstalled(p.last_seen, late, now)
            for fd, frames in got:
                if not frames:
                    continue
                ident, n = frames[0], sum(map(len, frames))
                heard = self._peers.get(ident)
                if heard is not None:  # a message on a session's connection: its peer is not silent,
                    heard.last_seen = now  # however long the message waits for its turn (or is dropped)
                q = self._queues.get(ident)
                if q is not None and (
                    self._queued_total + n > _QUEUED_BYTES
                    or len(q) >= _PEER_QUEUE
                    or self._queued[ident] + n > _PEER_QUEUED_BYTES
                ):
                    self.count("messages_dropped")  # a connection sending faster than it is served
                    continue
                if q is None:
                    q = self._queues[ident] = collections.deque()
                    self._queued[ident] = 0
                q.append((fd, frames, now))  # heard now: its sender's silence ends here, not when served
                self._queued[ident] += n
                self._queued_total += n
            # one message of each connection in turn, the turn going round across rounds (a
            # connection served goes to the back), for at most _ROUND_S or 256 messages (then
            # the socket is read again, so a connection that spoke since waits for at most that,
            # however many others flood)
            served, until = 0, time.monotonic() + _ROUND_S
            # first one message of each connection without a session (a handshake: the guard
            # bounds how many there are), for at most half the round, so that sessions
            # flooding the loop delay a newcomer's handshake by a round, not by their turns
            for ident in [i for i in self._queues if i not in self._peers]:
                if time.monotonic() >= until - _ROUND_S / 2:
                    break
                if ident in self._queues:  # not retired by a message served before it
                    self._serve_one(ident)
                    served += 1
            while self._queues and served < 256 and time.monotonic() < until:
                self._serve_one(next(iter(self._queues)))
                served += 1
            now = time.monotonic()
            try:
                if self.options.auto_tick:
                    self.scheduler.tick()
                if self._gone:
                    self._end_gone(now)
                if now - last_check > 0.1:
                    last_check = now
                    self._guard.sweep(now)
                    self._check_peers(now)
            except Exception:
                self.count("loop_errors")
                _log.exception("decode housekeeping failed (retried next round)")

    def _on_frames(self, frames: list[bytes], fd: int = -1, heard: float | None = None) -> None:
        if len(frames) < 2:
            self.count("messages_rejected")
            return
        ident, rest = frames[0], frames[1:]
        peer = self._peers.get(ident)
        if peer is None:
            self._guard.seen(fd, ident)
        hs = self._pending.get(ident) if peer is None else None
        codec = peer.codec if peer is not None else hs.codec if hs is not None else Codec(self.secret)
        try:
            msg = codec.decode(rest)
        except ProtocolError as exc:
            if hs is not None:  # a Hello sent again while its first is answered?
                fresh = Codec(self.secret)
                try:
                    again = fresh.decode(rest)
                except ProtocolError:
                    again = None
                if isinstance(again, Hello):
                    fresh.continue_from(hs.codec)
                    handshake.answer_hello(self, ident, fresh, again)
                    return
            self.count("messages_rejected")
            if peer is None:  # answer once, unauthenticated, so the operator sees why
                code, why = "refused", str(exc)
                if hs is not None:  # an Auth that does not verify under this session's key
                    del self._pending[ident]
                    self.count("auth_failed")
                elif time.monotonic() - max(self._dropped_at, self._guard.last_close) < 2 * self.options.auth_timeout_s:
                    # no handshake on this connection, and decode dropped handshakes (or closed
                    # connections without a session) lately: likely this peer's; tell the truth
                    code = "busy"
                    why = (
                        f"{exc}, and no handshake is in progress on this connection: decode dropped "
                        "handshakes under load (max_handshakes, max_pending_control, "
                        "max_pending_per_source); say Hello again"
                    )
                refusal = [ident, *Codec(None).encode(ErrorMsg(code, why))]
                self._ch.send(lambda: refusal)
            return
        if peer is None:
            if hs is not None:
                del self._pending[ident]
                if not isinstance(msg, Auth) or not hmac.compare_digest(msg.nonce, hs.nonce):
                    self.count("messages_rejected")
                    self.count("auth_failed")
                    return
                handshake.accept_session(self, ident, hs, msg)
            elif isinstance(msg, Hello):
                handshake.answer_hello(self, ident, codec, msg)
            else:
                self.count("messages_rejected")
            return
        # when the message was taken off the socket: a peer that went silent is found on time
        # however long its last messages waited for their turn
        peer.last_seen = max(peer.last_seen, heard) if heard is not None else time.monotonic()
        try:
            self._dispatch(peer, msg)
        except PdkvError as exc:
            self.count("messages_rejected")
            rid = getattr(msg, "request_id", "")
            self._send(ident, ErrorMsg(type(exc).__name__, f"{rid}: {exc}" if rid else str(exc), rid))

    def _dispatch(self, peer: Peer, msg: Message) -> None:
        if isinstance(msg, Heartbeat):
            self._send(peer.ident, Heartbeat(time.time()))
        elif isinstance(msg, Bye):
            # the session's state goes first: once prefill has the answer, its name and rank are free
            self._end_session(peer, f"prefill {peer.instance} rank {peer.tp_rank} ended its session", dead=False)
            answer = Bye("session ended")
            self._ch.send(lambda: [peer.ident, *peer.codec.encode(answer)])
        elif isinstance(msg, ReserveReq):
            self._on_reserve(peer, msg.request_id, msg.num_tokens, msg.binding)
        elif isinstance(msg, ReserveBatch):
            binds = msg.bindings or [b""] * len(msg.items)
            self._each(peer, [(rid, (peer, rid, n, b)) for (rid, n), b in zip(msg.items, binds)], self._on_reserve)
        elif isinstance(msg, LayerDone):
            self._layers_done(peer, msg.request_id, msg.token, msg.layers, msg.blocks)
        elif isinstance(msg, LayerBatch):
            self._each(peer, [(rid, (peer, rid, t, [msg.layer], b)) for rid, t, b in msg.items], self._layers_done)
        elif isinstance(msg, Complete):
            self._completed(peer, msg.request_id, msg.token, msg.ok, msg.error)
        elif isinstance(msg, CompleteBatch):
            self._each(peer, [(rid, (peer, rid, t, ok, e)) for rid, t, ok, e in msg.items], self._completed)
        elif isinstance(msg, Abort):
            with self.lock:
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

    def _each(self, peer: Peer, items: list[tuple[str, tuple[Any, ...]]], fn: Callable[..., None]) -> None:
        """A batch message's items, each standing alone as its single message would: one
        item's error is answered for that item; replies go out together at the end."""
        with self._replies.together():
            for rid, args in items:
                try:
                    fn(*args)
                except PdkvError as exc:
                    self.count("messages_rejected")
                    self._send(peer.ident, ErrorMsg(type(exc).__name__, f"{rid}: {exc}", rid))

    def _completed(self, peer: Peer, rid: str, token: int, ok: bool, error: str) -> None:
        """This prefill rank finished every write of ``rid`` (or reports that it failed)."""
        inf = self._live(peer, rid, token)
        with self.lock:
            if not ok:
                inf.failed_completes.append(error or "prefill reported a failed write")
            inf.completes.add(peer.tp_rank)
        self._maybe_complete(inf)

    def _layers_done(self, peer: Peer, rid: str, token: int, layers: Sequence[int], blocks: int) -> None:
        """Credit this rank's writes of ``layers`` for ``blocks`` blocks (0: the whole grant)."""
        tr = self._transports[peer.transport]
        if not tr.reports_layers:
            raise ProtocolError(f"LayerDone is not for the {peer.transport} transport (decode counts its bytes)")
        inf = self._live(peer, rid, token)
        if inf.location == "gpu" and not tr.writes_gpu:
            raise GrantViolation(f"request {rid!r} holds GPU blocks: {peer.transport} cannot write them")
        n = blocks or len(inf.blocks)
        if n > len(inf.blocks):
            raise GrantViolation(f"request {rid!r}: {blocks} blocks reported, {len(inf.blocks)} granted")
        nl = len(inf.remaining)
        if any(not 0 <= layer < nl for layer in layers) or len(set(layers)) != len(layers):
            raise ProtocolError(f"request {rid!r}: layers {list(layers)[:8]} out of range or repeated")
        with self.lock:  # a rank reports at most every block of each layer, once
            keys = [(layer, peer.tp_rank) for layer in layers]
            over = [k[0] for k in keys if inf.reported.get(k, 0) + n > len(inf.blocks)]
            if over:
                raise GrantViolation(
                    f"request {rid!r}: rank {peer.tp_rank} reported more blocks of layers {over[:8]} than were granted"
                )
            for k in keys:
                inf.reported[k] = inf.reported.get(k, 0) + n
        nbytes = peer.block_bytes_by_src.get(peer.tp_rank, 0) * n
        for layer in layers:
            self.credit(inf, layer, nbytes)

    def _live(self, peer: Peer, rid: str, token: int) -> Inflight:
        """The live grant ``rid`` with ``token``, held by ``peer``'s session, or the precise error."""
        with self.lock:
            inf = self._inflight.get(rid)
        if inf is None or inf.token != token:
            self.scheduler.check_write(rid, token)  # raises the precise error
            raise GrantViolation(f"request {rid!r}: no such grant here")
        if peer.ident not in inf.peers:
            raise GrantViolation(f"request {rid!r}: the grant is not this session's")
        return inf

    def _on_reserve(self, peer: Peer, rid: str, num_tokens: int, binding: bytes = b"") -> None:
        key = (peer.instance, rid)
        with self.lock:
            g = self._grants.get(key)
            if g is not None:  # another rank of the same prefill instance: same grant
                inf = self._inflight.get(rid)
                if inf is not None:
                    inf.peers.add(peer.ident)
                self._send_grant(peer.ident, g)
                return
        nblk = self.layouts[0].blocks_for_tokens(num_tokens)
        if nblk > MAX_GRANT_BLOCKS:  # its grant could not be sent: refuse now, holding nothing
            self._send_grant(
                peer.ident,
                GrantMsg(
                    rid,
                    "rejected",
                    reason=f"{num_tokens} tokens need {nblk} blocks, "
                    f"more than the {MAX_GRANT_BLOCKS} one grant may carry",
                ),
            )
            return
        quota = self.options.max_blocks_per_instance
        if quota is not None:
            with self.lock:
                held = sum(len(i.blocks) or i.asked for i in self._inflight.values() if i.instance == peer.instance)
            if held + nblk > quota:
                self.count("quota_refused")
                self._send_grant(
                    peer.ident,
                    GrantMsg(
                        rid,
                        "rejected",
                        reason=f"instance {peer.instance!r} holds {held} blocks; {nblk} more would pass "
                        f"max_blocks_per_instance ({quota})",
                    ),
                )
                return
        res = self.scheduler.reserve(
            rid,
            num_blocks=nblk,
            num_tokens=num_tokens,
            peer=peer.instance,
            gpu_ok=self._transports[peer.transport].writes_gpu,
            binding=binding,
        )
        if res.grant is None:
            _log.debug("reservation %r of %d blocks %s: %s", rid, nblk, res.outcome, res.reason)
            g = GrantMsg(rid, res.outcome, reason=res.reason)
            if res.outcome == "queued":
                with self.lock:
                    self._grants[key] = g
                    self._inflight[rid] = Inflight(
                        rid, peer.instance, 0, [], [], peer.tp_size, peers={peer.ident}, asked=nblk
                    )
            self._send_grant(peer.ident, g)
            return
        self._register_grant(peer, key, res.grant)

    def _register_grant(self, peer: Peer, key: tuple[str, str], grant: Any) -> None:
        blocks = list(grant.blocks)
        nl = self.layouts[0].total_layers
        # bytes each layer must receive on this receiver's ranks, from every prefill rank
        per_block = peer.block_bytes_by_src
        per_layer = sum(per_block.values()) * len(blocks)
        g = GrantMsg(
            grant.request_id,
            grant.location,
            grant.location,
            blocks,
            grant.token,
            grant.lease_s,
            prefix_blocks=grant.prefix_blocks,
        )
        with self.lock:
            old = self._inflight.get(grant.request_id)
            inf = Inflight(
                grant.request_id,
                peer.instance,
                grant.token,
                blocks,
                [per_layer] * nl,
                peer.tp_size,
                peers=set(old.peers) if old else {peer.ident},
                run_len=run_lengths(blocks),
                location=grant.location,
                transport=peer.transport,
            )
            inf.peers.add(peer.ident)
            self._inflight[grant.request_id] = inf
            self._by_token[grant.token] = inf
            self._grants[key] = g
        _log.debug(
            "grant %r: %d %s blocks, token %d, lease %.1f s, instance %s",
            grant.request_id,
            len(blocks),
            grant.location,
            grant.token,
            grant.lease_s,
            peer.instance,
        )
        for ident in inf.peers:
            self._send_grant(ident, g)

    def credit(self, inf: Inflight, layer: int, nbytes: int) -> None:
        land = False
        with self.lock:
            if inf.done:
                raise RequestError(f"request {inf.request_id!r} is finished")
            if not 0 <= layer < len(inf.remaining):
                raise ProtocolError(f"layer {layer} out of range")
            left = inf.remaining[layer] - nbytes
            if left < 0 or (nbytes == 0 and left == 0):
                raise GrantViolation(f"request {inf.request_id!r}: more bytes than granted for layer {layer}")
            inf.remaining[layer] = left
            land = left == 0
            got = self.received.setdefault(inf.transport, [0, 0])
            got[0] += nbytes
            got[1] += land
            now = time.monotonic()
            every = min(RENEW_EVERY_S, self.scheduler.options.lease_s / 4)
            renew = not land and now - inf.renewed >= every
            if renew:
                inf.renewed = now
        if renew:
            # part of a layer (chunked prefill writes a layer over several steps): a prefill
            # making progress keeps its grant, as a landed layer does; at most once a second
            # (a quarter of the lease when that is shorter)
            try:
                self.scheduler.renew(inf.request_id, inf.token)
            except PdkvError:
                pass  # ended meanwhile: the write's own checks refuse what follows
        if land:
            self.scheduler.land_layer(inf.request_id, inf.token, layer)
            with self.lock:
                inf.landed += 1
            self._maybe_complete(inf)

    def _maybe_complete(self, inf: Inflight) -> None:
        with self.lock:
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

    def _send_grant(self, ident: bytes, g: GrantMsg) -> None:
        self._replies.grant(ident, g)

    def _finish(self, inf: Inflight, outcome: Outcome | None) -> None:
        with self.lock:
            inf.done = True
            if self._inflight.get(inf.request_id) is inf:
                del self._inflight[inf.request_id]
            self._by_token.pop(inf.token, None)
            self._grants.pop((inf.instance, inf.request_id), None)
            peers = list(inf.peers)
        if outcome is None:
            return
        for ident in peers:
            self._replies.outcome(ident, outcome)

    def _on_event(self, ev: Event) -> None:
        if ev.kind.terminal:
            with self.lock:
                inf = self._inflight.get(ev.request_id)
            if inf is not None:
                self._finish(inf, Outcome(ev.request_id, ev.kind.value, ev.reason))
        elif ev.kind is EventKind.GRANTED and ev.grant is not None:
            with self.lock:
                inf = self._inflight.get(ev.request_id)
                peer = self._peers.get(next(iter(inf.peers))) if inf else None
            if inf is not None and peer is not None:
                self._register_grant(peer, (inf.instance, ev.request_id), ev.grant)

    def _check_peers(self, now: float) -> None:
        for ident in [i for i, hs in self._pending.items() if hs.deadline <= now]:
            del self._pending[ident]  # a Hello never followed by its Auth
        with self.lock:
            peers = list(self._peers.values())
        for p in peers:  # each peer on its own: one that cannot be checked stops no other's check
            try:
                silent = now - p.last_seen > self.options.peer_timeout_s
                gone = p.same_host and p.pid > 0 and not pid_alive(p.pid)
            except Exception:
                self.count("loop_errors")
                _log.exception("checking peer %s rank %d failed (fenced)", p.instance, p.tp_rank)
                silent, gone = True, False
            if silent or gone:
                why = "was silent for peer_timeout_s" if silent else f"process {p.pid} is gone"
                self._end_session(p, f"prefill {p.instance} rank {p.tp_rank} died ({why})", dead=True)

    def _serve_one(self, ident: bytes) -> None:
        """Serve the oldest message queued from ``ident``; its connection goes to the back
        of the turn (or leaves it, with nothing more queued)."""
        q = self._queues.pop(ident)
        fd, frames, heard = q.popleft()
        n = sum(map(len, frames))
        self._queued[ident] -= n
        self._queued_total -= n
        if q:
            self._queues[ident] = q
        else:
            del self._queued[ident]
        self._serve(frames, fd, heard)

    def retire(self, ident: bytes) -> None:
        q = self._queues.pop(ident, None)
        if q is not None:
            self._queued_total -= self._queued.pop(ident, 0)
            for fd, frames, heard in q:
                self._serve(frames, fd, heard)
        self._gone.pop(ident, None)
        self._pending.pop(ident, None)  # a handshake on it can never complete
        p = self.peer(ident)
        if p is not None:
            self._end_session(p, f"prefill {p.instance} rank {p.tp_rank}: its control connection closed", dead=True)

    def _serve(self, frames: list[bytes], fd: int, heard: float | None = None) -> None:
        # one message, whatever it holds, never ends the loop that serves every peer
        try:
            self._on_frames(frames, fd, heard)
        except Exception:
            self.count("loop_errors")
            self.count("messages_rejected")
            _log.exception("control message handling failed (message dropped)")

    def _end_gone(self, now: float) -> None:
        """End the sessions whose control connection closed, once what it sent before it
        closed was served (nothing of it queued, and a round has passed since)."""
        for ident, since in list(self._gone.items()):
            if ident not in self._queues and now - since >= _GONE_GRACE_S:
                self.retire(ident)

    def _end_session(self, p: Peer, why: str, dead: bool) -> None:
        """End ``p``'s session: fence its data path, fail its requests, release what only it
        could still write. ``dead``: it died (a warning), else it ended the session itself."""
        with self.lock:
            if self._peers.get(p.ident) is not p:
                return
            del self._peers[p.ident]
            self._sessions.pop(p.session_id, None)
        self._guard.session(p.ident, False, time.monotonic())
        if dead:
            self.count("peers_dead")
            _log.warning("%s: fenced, its requests fail", why)
        else:
            _log.info("%s (%s)", why, p.transport)
        self._transports[p.transport].fence(p)  # no write of this peer lands after this
        with self.lock:
            mine = [inf for inf in self._inflight.values() if p.ident in inf.peers]
        for inf in mine:
            try:
                self.scheduler.fail(inf.request_id, why)
            except PdkvError:
                pass
        # it can no longer start a write: quarantined blocks go back now (those a write
        # admitted before still holds go when that write ends)
        with self.lock:
            sibling = any(q.instance == p.instance for q in self._peers.values())
        if not sibling:
            self.scheduler.fence(p.instance)
