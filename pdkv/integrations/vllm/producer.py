"""vLLM's prefill engine (``kv_producer``) through pdkv: the scheduler half
(:class:`PrefillSide`, in vLLM's EngineCore) and the worker half (:class:`SendWorker`, in
each worker, where the cache tensors live).

A request whose ``kv_transfer_params`` ask for remote decode (``do_remote_decode`` with
pdkv's request id and, unless configured, decode's control address) is reserved in
decode's CPU buffer as soon as a worker first sees it (:meth:`PrefillSender.reserve_nowait`,
from a background thread: vLLM's loop never waits), and each layer goes out from
``save_kv_layer`` while the next one computes, chunk by chunk under chunked prefill. When
the grant has not come by the time a layer is saved, the request's blocks are sent whole
from the background thread once it comes (vLLM keeps them: ``request_finished`` delays
their free). The worker reports a request finished sending as soon as decode's outcome
arrives, so prefill frees its blocks when decode's buffer holds the KV, whether or not
decode has room for it in its own cache. Every sender (one per decode instance, per rank)
belongs to the worker half (:meth:`SendWorker.close`).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import ClosedError, PdkvError, PeerError, RequestError
from ...layout import CacheSpec, KVLayout
from ...transfer import PrefillSender, RequestOutcome, SendGrant
from ..core.pull import Held, PullDesk, PullServer
from ..core.tally import Tally
from .settings import (
    PARAM_CAP,
    PARAM_DECODE,
    PARAM_ID,
    PARAM_PULL,
    PARAM_TOKENS,
    PARAM_TRANSFER,
    Save,
    Settings,
    StepMeta,
    binding_of,
    token_digest,
    transfer_pid,
)

__all__ = ["PrefillSide", "SendWorker"]

_log = logging.getLogger(__name__)
RECENT = 256  # requests each worker remembers (vLLM request -> its blocks), for inspection


@dataclass
class _Track:
    pid: str
    decode: str
    prompt_len: int
    blocks: list[int]
    computed: int
    cap: str = ""
    binding: bytes = b""
    shipped: bool = False  # a worker saw it in a step's metadata
    pull: bool = False  # no decode named: kept after vLLM finishes it until a decode pulls it


class PrefillSide:
    """The scheduler half of a prefill engine: which requests go to decode, their blocks
    and the tokens each step computes, for the workers' :class:`SendWorker`.

    A request's ``kv_transfer_params`` come from a client: hints, never credentials. This
    half mints each request's pdkv id (the client's ``pdkv_request_id``, when printable,
    is kept as its prefix, for the logs) and a capability (128 random bits) that only the
    answer's ``kv_transfer_params`` carry; the reservation carries a digest of the
    capability and the prompt's tokens, which decode checks before it hands the KV to a
    request. ``pdkv_decode`` may pick one of the configured decodes, never name another.

    Three ways a request reaches decode. *Push*: the decode is known before prefill runs
    (``pdkv_decode``, or the first configured decode when no pull endpoint is configured),
    and each layer goes out as it is computed. *Shared id*: a router that dispatches the
    prefill and decode requests at once gives both the same ``transfer_id``, the id and
    capability of both (pushed as above). *Pull*: with extra config ``pull`` set, a request
    that names no decode (NixlConnector's protocol: the router picks the decode after
    prefill answered) keeps its blocks when vLLM finishes it, for ``pull_timeout_s``; the
    answer names this engine's pull endpoint, and the decode that gets the request asks it
    for the KV (:mod:`pdkv.integrations.core.pull`), which is then sent whole to that decode if
    it is a configured one. The engine's instance key (its identity at decode) is random
    unless configured, and goes to the workers in every step's metadata."""

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self._reqs: dict[str, _Track] = {}
        self.instance_key = settings.instance_key or secrets.token_bytes(32)
        self.refused = 0  # requests whose parameters named a decode not configured
        self._warned: set[str] = set()
        self.desk = PullDesk(settings.decodes)  # requests held for a pull, and the pulls that came
        self._said: dict[str, int] = {}
        self.server = PullServer(settings.pull, self.desk.on_pull, secret=settings.secret) if settings.pull else None
        if self.server is not None:
            said = f" (advertised to decodes as {settings.pull_advertise})" if settings.pull_advertise else ""
            level = logging.WARNING if settings.pull.endswith(":0") and not settings.pull_advertise else logging.INFO
            _log.log(
                level,
                "pdkv prefill: pull endpoint bound at %s%s; decodes list exactly %s in their 'prefill'",
                self.server.address,
                said,
                self.pull_address,
            )

    @property
    def pull_address(self) -> str:
        """The pull endpoint decodes ask: ``pull_advertise``, else the bound address (its port
        resolved), or '' when not configured."""
        if self.server is None:
            return ""
        return self.settings.pull_advertise or self.server.address

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned and len(self._warned) < 64:
            self._warned.add(key)
            _log.warning(msg, *args)

    def params_of(self, params: Mapping[str, Any] | None) -> tuple[str, str, str] | None:
        """``(pdkv id, decode address or '' to be pulled, capability or '' to mint)`` of a
        request that asks for remote decode (a new id each call but for a shared
        ``transfer_id``), or None: it is computed here only."""
        if not params or not params.get("do_remote_decode"):
            return None
        decodes = self.settings.decodes
        want = params.get(PARAM_DECODE)
        tid = params.get(PARAM_TRANSFER)
        if not decodes:
            self._warn_once("none", "pdkv prefill: do_remote_decode, but extra config 'decode' names no decode")
            return None
        if want in (None, ""):
            decode = "" if self.server is not None and tid is None else decodes[0]
        elif isinstance(want, str) and want in decodes:
            decode = want
        else:
            self.refused += 1
            _log.warning(
                "pdkv prefill: a request's %s names %.80r, not a configured decode: computed here only",
                PARAM_DECODE,
                want,
            )
            return None
        if tid is not None:
            pid = transfer_pid(tid)
            if pid is None:
                self.refused += 1
                _log.warning(
                    "pdkv prefill: a request's %s is not 16-128 printable characters: computed here only",
                    PARAM_TRANSFER,
                )
                return None
            return pid, decode, str(tid)
        hint = params.get(PARAM_ID)
        prefix = hint if isinstance(hint, str) and 0 < len(hint) <= 64 and hint.isprintable() else "vllm"
        return f"{prefix}.{secrets.token_hex(12)}", decode, ""

    def step(
        self,
        new: Iterable[tuple[str, Mapping[str, Any] | None, Sequence[int], list[int], int]],
        cached: Iterable[tuple[str, list[int] | None, int, bool]],
        scheduled: Mapping[str, int],
    ) -> StepMeta:
        """``build_connector_meta``: ``new`` requests ``(id, kv_transfer_params, prompt
        token ids, block ids, computed tokens)``, ``cached`` ones ``(id, new block ids,
        computed tokens, resumed)`` (a resumed request's block ids replace its old ones),
        ``scheduled`` tokens per request this step. Pulled requests go out whole; held ones
        whose pull did not come within ``pull_timeout_s`` are freed."""
        for rid, params, prompt, blocks, computed in new:
            got = self.params_of(params)
            if got is not None:
                pid, decode, cap = got
                cap = cap or secrets.token_hex(16)
                binding = binding_of(cap, token_digest(prompt))
                self._reqs[rid] = _Track(
                    pid, decode, len(prompt), list(blocks), computed, cap, binding, pull=not decode
                )
        for rid, more, computed, resumed in cached:
            c = self._reqs.get(rid)
            if c is not None:
                t = c
                t.blocks = list(more or ()) if resumed else t.blocks + list(more or ())
                t.computed = computed
        saves = []
        for rid, t in self._reqs.items():
            n = scheduled.get(rid, 0)
            if n and t.computed < t.prompt_len:
                end = min(t.computed + n, t.prompt_len)
                if not t.pull:
                    saves.append(Save(rid, t.pid, t.decode, t.prompt_len, tuple(t.blocks), t.computed, end, t.binding))
                    t.shipped = True
                t.computed = end
        pulled, gone = self.desk.take(self.clock())
        for h, decode in pulled:  # sent whole to the decode that asked
            saves.append(Save(h.rid, h.pid, decode, h.prompt_len, h.blocks, 0, h.prompt_len, h.binding, pulled=True))
        for h in gone:
            _log.warning(
                "pdkv prefill: request %s (pdkv %s): no decode pulled it within pull_timeout_s=%gs; freed",
                h.rid,
                h.pid,
                self.settings.pull_timeout_s,
            )
        drops = [h.rid for h in gone]
        return StepMeta(saves=saves, drops=drops, instance_key=self.instance_key)

    def finished(self, rid: str) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: keep the blocks while a worker sends them (or, for a pull,
        until a decode pulls or ``pull_timeout_s`` passes), and answer the parameters
        decode's request needs (its id and capability; a pull's endpoint)."""
        t = self._reqs.pop(rid, None)
        if t is None:
            return False, None
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAM_ID: t.pid,
            PARAM_TOKENS: t.prompt_len,
            PARAM_CAP: t.cap,
        }
        if not t.pull:
            return t.shipped, params
        if t.computed < t.prompt_len:  # cut short: there is no KV to pull
            return False, None
        deadline = self.clock() + self.settings.pull_timeout_s
        self.desk.hold(Held(rid, t.pid, t.prompt_len, tuple(t.blocks), t.binding, deadline))
        host, _, port = self.pull_address.removeprefix("tcp://").rpartition(":")
        # NixlConnector's fields too, for routers that look for them (remote_* name this engine)
        params.update(
            {
                PARAM_PULL: self.pull_address,
                "remote_engine_id": self.settings.engine_id,
                "remote_host": host,
                "remote_port": int(port),
                "remote_block_ids": [],
            }
        )
        return True, params

    def take_stats(self) -> dict[str, Any]:
        """What vLLM's stats hooks read: pulls served, held requests freed unpulled and
        requests refused for naming an unlisted decode, since the last call."""
        c = {}
        for k, v in (
            ("pulled", self.desk.pulled),
            ("pull_expired", self.desk.expired),
            ("refused_decode", self.refused),
        ):
            if v != self._said.get(k, 0):
                c[k] = v - self._said.get(k, 0)
                self._said[k] = v
        return {"c": c, "s": {}, "g": {}}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@dataclass(eq=False)
class _Out:
    """One request on a worker."""

    save: Save
    tx: PrefillSender | None = None
    grant: SendGrant | None = None
    error: str = ""  # it will not be received (reservation or sending failed)
    deferred: bool = False  # layers are sent whole from the background thread
    computed: bool = False  # the step that completes the prompt ended (every layer is in vLLM's blocks)
    handed: bool = False  # every block of every layer was handed to the sender, and finish()
    vllm_done: bool = False  # vLLM finished the request (its blocks wait for us)
    outcome: RequestOutcome | None = None
    since: float = field(default_factory=time.monotonic)


class SendWorker:
    """The worker half of a prefill engine, one per TP rank: this rank's cache (``cache``)
    sent to decode instances through one :class:`PrefillSender` each. ``sender`` makes a
    sender (tests pass a stand-in that fails)."""

    def __init__(
        self,
        settings: Settings,
        layout: KVLayout,
        cache: CacheSpec,
        *,
        sender: Callable[[str], PrefillSender] | None = None,
    ) -> None:
        self.settings, self.layout, self.cache = settings, layout, cache
        self._make = sender or self._open
        self._senders: dict[str, PrefillSender] = {}
        self._retired: list[PrefillSender] = []
        self._lock = threading.Lock()
        self._reqs: dict[str, _Out] = {}
        self._step: list[_Out] = []
        # one background thread per decode (the configured ones only): a decode that is down
        # or slow to answer holds its own requests, never another decode's
        self._lanes: dict[str, tuple[queue.Queue[_Out | None], threading.Thread]] = {}
        self._key = settings.instance_key  # else the scheduler half's, from the first step's metadata
        self._stop = threading.Event()
        self.recent: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.stats = {"direct": 0, "deferred": 0, "received": 0, "failed": 0}
        self.tally = Tally()  # what vLLM's stats hooks read
        self._dropped: set[str] = set()  # held for a pull that never came: vLLM may free them

    def _open(self, decode: str) -> PrefillSender:
        s = self.settings
        if not self._key:
            raise PdkvError("no instance key yet (the scheduler half sends it with each step)")
        return PrefillSender(
            self.layout,
            self.cache,
            decode,
            instance=s.instance,
            instance_key=self._key,
            secret=s.secret,
            transport=s.transport,
            timeout_s=s.peer_timeout_s,
        )

    def _put(self, r: _Out) -> None:
        """Hand ``r`` to its decode's background thread (started on first use)."""
        with self._lock:
            lane = self._lanes.get(r.save.decode)
            if lane is None:
                q: queue.Queue[_Out | None] = queue.Queue()
                t = threading.Thread(target=self._run, args=(q,), name="pdkv-vllm-send", daemon=True)
                lane = self._lanes[r.save.decode] = (q, t)
                t.start()
        lane[0].put(r)

    # ------------------------------------------------------------------ vLLM's worker loop
    def start(self, meta: StepMeta) -> None:
        """``bind_connector_metadata`` (before the forward): this step's saves; a new
        request is reserved at once where its decode's session is open (a message posted),
        else from the background thread, which opens the session first."""
        step, new, pulled = [], [], []
        if meta.instance_key and not self._key:
            self._key = meta.instance_key
        with self._lock:
            self._dropped.update(meta.drops)
            for s in meta.saves:
                r = self._reqs.get(s.req_id)
                self.recent[s.req_id] = s.blocks
                self.recent.move_to_end(s.req_id)  # a request still being computed stays
                while len(self.recent) > RECENT:
                    self.recent.popitem(last=False)
                if s.pulled:  # vLLM finished it: sent whole from the background thread
                    if r is None:
                        r = self._reqs[s.req_id] = _Out(s, deferred=True, computed=True, vllm_done=True)
                        pulled.append(r)
                    continue
                if r is None:
                    r = self._reqs[s.req_id] = _Out(s)
                    new.append((r, self._senders.get(s.decode)))
                else:
                    r.save = s
                step.append(r)
        for r, tx in new:
            if tx is None or not self._reserve(r, tx):
                self._put(r)  # no session (or a broken one): the background thread opens one
        for r in pulled:
            self._put(r)
        self._step = step

    def _reserve(self, r: _Out, tx: PrefillSender) -> bool:
        """Post the request's reservation (never waits); True once posted. A session that
        broke (decode restarted, went silent) leaves the pool and False is returned with no
        error: the background thread opens a new one for the request. Any other refusal is
        the request's error."""
        try:
            tx.reserve_nowait(
                [(r.save.pid, r.save.prompt_len, r.save.binding)], timeout=self.settings.reserve_timeout_s
            )
        except (PeerError, ClosedError) as exc:
            _log.info("pdkv prefill: the session with %s ended (%s): opening another", r.save.decode, exc)
            with self._lock:
                if self._senders.get(r.save.decode) is tx:
                    del self._senders[r.save.decode]
                    self._retired.append(tx)  # closed by the background thread (close may wait)
            return False
        except PdkvError as exc:
            r.error = f"reservation refused: {exc}"
            _log.warning("pdkv prefill: request %s: %s", r.save.req_id, r.error)
            return False
        r.tx = tx
        return True

    def _granted(self, r: _Out) -> SendGrant | None:
        """The request's grant once it came (polled, never waited for); sets ``error``."""
        with self._lock:
            if r.grant is not None or r.error or r.tx is None:
                return r.grant
            got = r.tx.poll_grant(r.save.pid)
            if isinstance(got, SendGrant):
                r.grant = got
            elif got is not None:
                r.error = f"reservation failed: {got}"
            return r.grant

    def save_layer(self, layer: int, event: int | None = None) -> None:
        """``save_kv_layer``: the layer is in vLLM's blocks (``event``: the CUDA event after
        its writes); send this step's complete blocks of every granted request."""
        N = self.layout.tokens_per_block
        for r in self._step:
            s = r.save
            if r.deferred or r.error or r.handed:
                continue
            if self._granted(r) is None:
                r.deferred = True  # sent whole once granted (vLLM keeps the blocks)
                continue
            b0 = s.start // N
            b1 = -(-s.prompt_len // N) if s.complete else s.end // N
            if b1 > b0:
                try:
                    assert r.tx is not None
                    r.tx.send_chunk(layer, s.pid, list(s.blocks[b0:b1]), b0, event)
                except PdkvError as exc:
                    self._abandon(r, f"sending layer {layer} failed: {exc}")

    def end_step(self) -> None:
        """``wait_for_save``: requests whose prompt this step completed are confirmed to
        decode (or handed whole to the background thread)."""
        for r in self._step:
            if not r.save.complete or r.handed or r.error:
                continue
            r.computed = True
            if r.deferred:
                self._put(r)
                continue
            try:
                assert r.tx is not None
                r.tx.finish(r.save.pid)
                r.handed = True
                self.stats["direct"] += 1
            except PdkvError as exc:
                self._abandon(r, f"confirming failed: {exc}")
        self._step = []

    def _abandon(self, r: _Out, error: str) -> None:
        """A granted request failed here: tell decode (its buffer blocks come back now, not
        when the grant's lease ends), whose outcome then settles it here, after the writes
        already handed over ended (vLLM's blocks are read until then). A sender that cannot
        post it is broken, and has failed the request's outcome itself."""
        r.error = error
        _log.warning("pdkv prefill: request %s (pdkv %s): %s", r.save.req_id, r.save.pid, error)
        assert r.tx is not None
        try:
            r.tx.finish(r.save.pid, ok=False, error=error)
        except PdkvError as exc:
            _log.info("pdkv prefill: request %s: decode not told (%s)", r.save.pid, exc)

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """``get_finished``'s sending half: requests vLLM finished whose outcome is known
        (received or failed), so vLLM may free their blocks."""
        for rid in finished_req_ids:
            r = self._reqs.get(rid)
            if r is not None:
                r.vllm_done = True
                if not r.handed and not r.error:
                    self._put(r)  # cut short: the background thread ends it at decode
        with self._lock:
            out, self._dropped = self._dropped, set()
            items = list(self._reqs.items())
        for rid, r in items:
            if not r.vllm_done or not self._settled(r):
                continue
            out.add(rid)
            with self._lock:
                del self._reqs[rid]
            ok = r.outcome is not None and r.outcome.state == "received"
            self.stats["received" if ok else "failed"] += 1
            if ok:
                nb = -(-r.save.prompt_len // self.layout.tokens_per_block)
                self.tally.count("sent")
                self.tally.count("bytes_sent", nb * self.layout.block_bytes)
                self.tally.sample("send_s", time.monotonic() - r.since)
            else:
                self.tally.count("send_failed")
            if not ok:
                why = r.error or (r.outcome.reason if r.outcome else "")
                _log.warning("pdkv prefill: request %s (pdkv %s) not received: %s", rid, r.save.pid, why)
        return out

    def take_stats(self) -> dict[str, Any]:
        """What vLLM's stats hooks read since the last call (:class:`~pdkv.integrations.core.tally.Tally`)."""
        return self.tally.take()

    def _settled(self, r: _Out) -> bool:
        """Whether the request's end is known (its outcome taken, or its error without a
        grant to wait on); asked once per get_finished until it is."""
        if r.tx is None:
            return bool(r.error)
        if r.grant is None:
            self._granted(r)
            if r.grant is None:
                return bool(r.error)  # a failed reservation has no outcome to wait for
        try:
            r.outcome = r.tx.poll_outcome(r.save.pid)
        except RequestError as exc:
            r.error = r.error or str(exc)
            return True
        return r.outcome is not None

    # ------------------------------------------------------------------ background thread
    def _run(self, jobs: queue.Queue[_Out | None]) -> None:
        """One decode's background thread: opens its sender, posts reservations, sends
        deferred requests whole, ends requests vLLM cut short: everything that may wait,
        away from vLLM's loop."""
        waiting: list[_Out] = []
        while not self._stop.is_set() and self._round(jobs, waiting, 0.002 if waiting else 0.1):
            pass

    def _round(self, jobs: queue.Queue[_Out | None], waiting: list[_Out], timeout: float) -> bool:
        """One round of a background thread: take a job (waiting up to ``timeout``), move
        every waiting request on (``waiting`` keeps those with work left), close the senders
        that left the pool. False when told to stop. A request whose step raises fails
        alone (the thread goes on)."""
        try:
            r = jobs.get(timeout=timeout)  # 0: only what is queued now
            if r is None:
                return False
            if r not in waiting:
                waiting.append(r)
        except queue.Empty:
            pass
        waiting[:] = [r for r in waiting if not self._advance_safely(r)]
        with self._lock:
            retired, self._retired = self._retired, []
        for tx in retired:
            tx.close()
        return True

    def _advance_safely(self, r: _Out) -> bool:
        try:
            return self._advance(r)
        except Exception as exc:  # never the thread: this request fails alone
            r.error = r.error or f"sending failed: {type(exc).__name__}: {exc}"
            _log.exception("pdkv prefill: request %s (pdkv %s): %s", r.save.req_id, r.save.pid, r.error)
            return True

    def _advance(self, r: _Out) -> bool:
        """One step of a request's background work; True once nothing is left to do."""
        s = r.save
        if r.tx is None and not r.error:
            try:
                tx = self._senders.get(s.decode)
                if tx is None:
                    tx = self._make(s.decode)
                    with self._lock:
                        self._senders[s.decode] = tx
            except Exception as exc:  # PdkvError, OSError, zmq.ZMQError: this request alone
                r.error = f"no session with decode {s.decode}: {exc}"
                _log.warning("pdkv prefill: request %s: %s", s.req_id, r.error)
                return True
            if not self._reserve(r, tx):
                if r.error:
                    return True
                return False  # the pooled session had broken: a new one next round
            s = r.save  # vLLM may have moved the request on while the session opened
        if r.error or r.handed:
            return True
        cut = r.vllm_done and not r.computed
        if not (r.deferred and r.computed) and not cut:
            # a deferred request waits for the end of the step that computes its last layer
            # (end_step hands it back then), a direct one is sent from vLLM's thread
            return True
        if self._granted(r) is None:
            return bool(r.error)
        assert r.tx is not None
        try:
            if cut:
                r.tx.finish(s.pid, ok=False, error="vLLM finished the request before its prompt was computed")
            else:
                nb = -(-s.prompt_len // self.layout.tokens_per_block)
                for layer in range(self.layout.total_layers):
                    r.tx.send_layer(layer, [(s.pid, list(s.blocks[:nb]))])
                r.tx.finish(s.pid)
                self.stats["deferred"] += 1
            r.handed = True
        except PdkvError as exc:
            self._abandon(r, f"sending failed: {exc}")
        return True

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            lanes = list(self._lanes.values())
        for q, _ in lanes:
            q.put(None)
        for _, t in lanes:
            t.join(timeout=10)
        for tx in [*self._senders.values(), *self._retired]:
            tx.close()
        self._senders.clear()
        self._retired.clear()
