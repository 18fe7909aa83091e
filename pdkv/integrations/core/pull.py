"""Pull: decode asks prefill for a request's KV after prefill answered (the routers that
speak NixlConnector's protocol pick the decode only then). Prefill keeps the request's
blocks and serves a :class:`PullServer`; a decode that receives the request sends a
:class:`PullReq` naming the request, the binding its client's capability and prompt give,
and decode's own control address. Prefill checks all three (the request is held here, the
binding is the one its reservation will carry, the address is a configured decode) and then
sends the KV as it always does: reserved in that decode's CPU buffer, written whole, the
binding checked again at decode. So a pull moves nothing by itself: it only tells prefill
which of its configured decodes to send to.

Engine-neutral (no engine's objects): the vLLM connector's halves use it, and any engine
adapter may. One small message each way over ZeroMQ (ROUTER at prefill, DEALER at decode),
msgpack by msgspec with a strict schema, at most :data:`MAX_MSG` bytes, an HMAC-SHA256 over
it when the pair shares a secret. Nothing waits without a bound: a pull that gets no answer
within its timeout fails (decode then computes the prompt itself).

Freshness: a pull carries the time it was issued (``issued``, milliseconds of the wall
clock) and a random nonce, both under its MAC; the server serves a pull only when it was
issued within :data:`FRESH_S` of its own clock and its nonce was not seen within that time,
so a recorded pull replayed later is refused and changes nothing. Hosts of a pair keep their
clocks within :data:`FRESH_S` (NTP). The endpoint's connections are bounded as every port of
pdkv (:mod:`.endpoint`).
"""

from __future__ import annotations

import hashlib
import hmac
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from .endpoint import Limits, RouterEndpoint

__all__ = ["MAX_MSG", "PullReq", "PullAnswer", "PullServer", "PullClient", "PullResult", "Held", "PullDesk"]

MAX_MSG = 4096  # a pull is ~200 bytes; anything longer is dropped unread
FRESH_S = 30.0  # a pull is served only when issued within this of the server's clock
MAX_NONCES = 1 << 16  # nonces remembered for FRESH_S (each pull's); beyond, pulls are refused
_MAC = b"pdkv-pull-2"


class PullReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Decode -> prefill: send ``pid`` to the decode at ``decode``; ``binding`` proves the
    asker holds the request's capability and prompt. ``prefix``: the prompt tokens decode
    holds already (its prefix cache), which prefill need not send (0: send it whole; not
    on the wire then, so a peer that predates the field reads the message). ``issued``:
    when it was made (milliseconds of the wall clock; the server's freshness check)."""

    pid: str
    binding: bytes
    decode: str
    nonce: bytes
    mac: bytes = b""
    prefix: int = 0
    issued: int = 0  # ms of the wall clock, when the pull was made


class PullAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill -> decode: ``error`` empty when prefill will send."""

    nonce: bytes
    error: str = ""
    mac: bytes = b""


def _mac(secret: bytes | None, *parts: bytes) -> bytes:
    if not secret:
        return b""
    h = hmac.new(secret, _MAC, hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "little") + p)
    return h.digest()


def _req_mac(secret: bytes | None, r: PullReq) -> bytes:
    extra = (b"prefix", str(r.prefix).encode()) if r.prefix else ()
    return _mac(
        secret, r.pid.encode(), r.binding, r.decode.encode(), r.nonce, b"issued", str(r.issued).encode(), *extra
    )


def _answer_mac(secret: bytes | None, a: PullAnswer) -> bytes:
    return _mac(secret, b"answer", a.nonce, a.error.encode())


def _check(r: PullReq) -> str:
    """What is wrong with a well-formed request's fields, or ''."""
    if not 0 < len(r.pid) <= 128 or not r.pid.isprintable():
        return "pid must be 1-128 printable characters"
    if len(r.binding) != 32:
        return "binding must be 32 bytes"
    if not 0 < len(r.decode) <= 256 or not r.decode.isprintable():
        return "decode must be an address"
    if len(r.nonce) != 16:
        return "nonce must be 16 bytes"
    if not 0 <= r.prefix < 1 << 31:
        return "prefix must be a token count"
    if not 0 <= r.issued < 1 << 62:
        return "issued must be milliseconds"
    return ""


_enc = msgspec.msgpack.Encoder()
_dec_req = msgspec.msgpack.Decoder(PullReq)
_dec_answer = msgspec.msgpack.Decoder(PullAnswer)


class PullServer(RouterEndpoint):
    """Prefill's pull endpoint: binds ``bind`` (``tcp://host:port``, port 0 for any) and
    answers each :class:`PullReq` with what ``on_pull(req)`` returns (an error, or '' when
    prefill will send), from a thread of its own. A message that is too long, malformed or
    not authenticated gets no answer and changes nothing (``dropped``). Ownership: the
    socket and the thread (:meth:`close`)."""

    def __init__(
        self,
        bind: str,
        on_pull: Callable[[PullReq], str],
        *,
        secret: bytes | None = None,
        limits: Limits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(bind, max_msg=MAX_MSG, what="pull endpoint", thread_name="pdkv-pull-server", limits=limits)
        self._on_pull, self._secret, self._clock = on_pull, secret, clock
        self.served = self.refused = 0
        self._seen: dict[bytes, float] = {}  # nonce -> when it may be forgotten, in that order
        self._start()

    def _fresh(self, r: PullReq) -> str:
        """Why the pull is not fresh ('' when it is): issued within FRESH_S, its nonce new."""
        now = self._clock()
        if abs(now * 1000 - r.issued) > FRESH_S * 1000:
            return f"the pull was not issued within {FRESH_S:g} s of prefill's clock (replayed, or clocks apart)"
        while self._seen:
            nonce, until = next(iter(self._seen.items()))
            if until > now:
                break
            del self._seen[nonce]
        if r.nonce in self._seen:
            return "this pull was served already (replayed)"
        if len(self._seen) >= MAX_NONCES:
            return f"more than {MAX_NONCES} pulls within {FRESH_S:g} s; refused until some expire"
        self._seen[r.nonce] = now + 2 * FRESH_S
        return ""

    def _serve(self, frames: list[bytes]) -> tuple[bool, str]:
        if len(frames) != 2 or len(frames[1]) > MAX_MSG:
            return False, "not one message"
        try:
            r = _dec_req.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False, "malformed"
        if not hmac.compare_digest(r.mac, _req_mac(self._secret, r)):
            return False, "not authenticated"  # no answer: the sender is not one of ours
        error = _check(r) or self._fresh(r) or self._on_pull(r)
        if error:
            self.refused += 1
        else:
            self.served += 1
        a = PullAnswer(nonce=r.nonce, error=error)
        a = PullAnswer(nonce=a.nonce, error=a.error, mac=_answer_mac(self._secret, a))
        try:
            self._sock.send_multipart([frames[0], _enc.encode(a)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return True, "the asker is gone"  # it times out
        return True, ""


@dataclass
class PullResult:
    """One pull's answer: ``done`` once known; ``error`` empty when prefill will send."""

    done: bool = False
    error: str = ""
    since: float = field(default_factory=time.monotonic)


class PullClient:
    """Decode's side: :meth:`pull` posts a request (never waits) and returns a
    :class:`PullResult` that a thread of this client fills within ``timeout_s``. Only
    addresses in ``allowed`` are ever connected to. Ownership: the sockets and the thread
    (:meth:`close`)."""

    def __init__(self, allowed: tuple[str, ...], *, secret: bytes | None = None, timeout_s: float = 10.0) -> None:
        self.allowed, self._secret, self.timeout_s = frozenset(allowed), secret, timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._jobs: queue.Queue[tuple[str, PullReq, PullResult] | None] = queue.Queue()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._pending: dict[bytes, tuple[PullResult, float]] = {}
        self._thread = threading.Thread(target=self._run, name="pdkv-pull-client", daemon=True)
        self._thread.start()

    def allow(self, address: str) -> None:
        """Add a prefill endpoint learned at run time (from a verified bootstrap entry)."""
        self.allowed = self.allowed | {address}

    def pull(self, address: str, pid: str, binding: bytes, decode: str, prefix: int = 0) -> PullResult:
        """Ask the prefill at ``address`` to send ``pid`` to ``decode``, from token
        ``prefix`` on (what decode holds already)."""
        res = PullResult()
        if address not in self.allowed:
            res.done, res.error = True, f"{address!r} is not a configured prefill"
            return res
        r = PullReq(
            pid=pid,
            binding=binding,
            decode=decode,
            nonce=secrets.token_bytes(16),
            prefix=prefix,
            issued=int(time.time() * 1000),
        )
        r = msgspec.structs.replace(r, mac=_req_mac(self._secret, r))
        self._jobs.put((address, r, res))
        return res

    def _sock(self, address: str) -> zmq.Socket[bytes]:
        s = self._socks.get(address)
        if s is None:
            s = self._socks[address] = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_MSG)
            s.connect(address)
        return s

    def _run(self) -> None:
        poller = zmq.Poller()
        while True:
            try:
                job = self._jobs.get(timeout=0.01 if self._pending else 0.2)
                if job is None:
                    return
                address, r, res = job
                s = self._sock(address)
                if s not in [p[0] for p in poller.sockets]:
                    poller.register(s, zmq.POLLIN)
                s.send(_enc.encode(r), zmq.NOBLOCK)
                self._pending[r.nonce] = (res, time.monotonic() + self.timeout_s)
            except queue.Empty:
                pass
            except zmq.ZMQError as exc:  # a full queue to an unreachable prefill
                res.done, res.error = True, f"pull not sent: {exc}"
            for s, _ in poller.poll(0) if self._pending else ():
                self._read(s)
            now = time.monotonic()
            for nonce, (res, deadline) in list(self._pending.items()):
                if now > deadline:
                    del self._pending[nonce]
                    res.done, res.error = True, f"no answer from prefill within {self.timeout_s:g} s"

    def _read(self, s: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            try:
                if len(frames) != 1:
                    continue
                a = _dec_answer.decode(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            got = self._pending.get(a.nonce)
            if got is None or not hmac.compare_digest(a.mac, _answer_mac(self._secret, a)):
                continue
            del self._pending[a.nonce]
            got[0].error, got[0].done = a.error, True

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        for s in self._socks.values():
            s.close(linger=0)
        self._ctx.term()
        for res, _ in self._pending.values():
            res.done, res.error = True, "the pull client closed"


@dataclass(frozen=True)
class Held:
    """A request prefill computed and keeps for a pull: the engine's id ``rid``, the pdkv
    id, its prompt length, blocks and binding, and when it is given up."""

    rid: str
    pid: str
    prompt_len: int
    blocks: tuple[int, ...]
    binding: bytes
    deadline: float


class PullDesk:
    """Prefill's held requests and the pulls that came for them (the pull server's thread
    calls :meth:`on_pull`; the engine's loop calls :meth:`hold` and :meth:`take`). A pull
    is served once, for a held request, with its binding, naming one of ``decodes``."""

    def __init__(self, decodes: tuple[str, ...]) -> None:
        self.decodes = frozenset(decodes)
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._pulled: list[tuple[Held, str]] = []
        self.pulled = self.expired = 0

    def hold(self, h: Held) -> None:
        with self._lock:
            self._held[h.pid] = h

    def on_pull(self, r: PullReq) -> str:
        """A :class:`PullServer`'s ``on_pull``: '' when the request will be sent to ``r.decode``."""
        if r.decode not in self.decodes:
            return f"decode {r.decode[:80]!r} is not one this prefill sends to (extra config 'decode')"
        if r.prefix:
            return "this prefill sends a request whole (prefix must be 0)"
        with self._lock:
            h = self._held.get(r.pid)
            if h is None:
                return f"pdkv {r.pid[:80]!r} is not held here (unknown, pulled already, or expired)"
            if not hmac.compare_digest(r.binding, h.binding):
                return "the binding does not match the request's (wrong capability or prompt)"
            del self._held[r.pid]
            self._pulled.append((h, r.decode))
            self.pulled += 1
        return ""

    def take(self, now: float) -> tuple[list[tuple[Held, str]], list[Held]]:
        """The requests pulled since the last call (each with its decode) and those whose
        deadline passed unpulled (no longer held)."""
        with self._lock:
            pulled, self._pulled = self._pulled, []
            gone = [h for h in self._held.values() if now > h.deadline]
            for h in gone:
                del self._held[h.pid]
            self.expired += len(gone)
        return pulled, gone
