"""vLLM's decode engine (``kv_consumer``) through pdkv: the scheduler half
(:class:`DecodeSide`, in vLLM's EngineCore) and the worker half (:class:`LoadWorker`, in
each worker, where the cache tensors live).

The scheduler half owns decode's CPU buffers (one per TP rank), the
:class:`~pdkv.DecodeReceiver` prefill reserves and writes through, and a
:class:`~pdkv.DecodeScheduler` in engine-bound mode: prefill's KV lands in the buffer
whatever vLLM's GPU blocks are doing. vLLM asks :meth:`DecodeSide.matched` whether a
request's KV is there (``None``: ask later); once vLLM allocated blocks,
:meth:`DecodeSide.allocated` binds the pdkv request to them and the next step's metadata
tells each worker to copy its buffer blocks into them (:meth:`LoadWorker.start`, pdkv's
swap engine: a kernel on a GPU, host threads on a CPU). The workers report the copy done
(``finished_recving``) and :meth:`DecodeSide.loaded` frees the buffer blocks. No call
from vLLM's loop waits on the network or on prefill.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...buffer import reaper
from ...buffer.shared import SharedBuffer
from ...buffer.sweeper import stale_note
from ...errors import PdkvError, RequestError
from ...layout import CacheSpec, KVLayout
from ...scheduling.blocks import BlockPool
from ...scheduling.scheduler import DecodeScheduler, Event, EventKind, SchedulerOptions, State
from ...transfer import DecodeReceiver
from ..core.pull import PullClient, PullResult
from ..core.tally import Tally
from .loader import LoadWorker
from .settings import (
    PARAM_CAP,
    PARAM_ID,
    PARAM_PULL,
    PARAM_TRANSFER,
    Load,
    Settings,
    StepMeta,
    binding_of,
    token_digest,
    transfer_pid,
)

__all__ = ["DecodeSide", "LoadWorker", "WorkerSwaps"]  # LoadWorker: .loader's, here for importers

_log = logging.getLogger(__name__)
_WAITING = (State.QUEUED, State.RESERVED, State.RECEIVING)


class _Done:
    """A swap the workers run: done once vLLM reports the request's load finished."""

    __slots__ = ("finished", "error")

    def __init__(self) -> None:
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.finished


class WorkerSwaps:
    """The scheduler's swap backend when vLLM's workers copy: :meth:`submit` only records
    the swap (the connector ships it in the next step's metadata); :meth:`done` is called
    when the workers reported it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._h: dict[str, _Done] = {}

    def submit(self, request_id: str, buffer_blocks: Any, gpu_blocks: Any) -> _Done:
        h = _Done()
        with self._lock:
            self._h[request_id] = h
        return h

    def done(self, request_id: str, error: BaseException | None = None) -> None:
        with self._lock:
            h = self._h.pop(request_id, None)
        if h is not None:
            h.error, h.finished = error, True


@dataclass
class _Want:
    """A vLLM request that asked for prefill's KV."""

    pid: str  # its pdkv id
    since: float  # when vLLM first asked
    local: int = 0  # tokens vLLM computed itself (a local prefix hit, block-aligned)
    bound: tuple[int, ...] | None = None  # vLLM's blocks the load writes, once bound
    fail: bool = False  # the KV will not come: the load reports failure (kv_load_failure_policy='fail')
    claim: bytes = b""  # the binding its pdkv_cap and prompt give (settings.binding_of)
    proven: bool = False  # its claim matched the reservation's binding: the KV is its own
    pull: PullResult | None = None  # its ask to prefill to send the KV here (pull style)
    ready: bool = False  # vLLM was told the KV is here (its wait is sampled once)
    held: int = 0  # blocks of its prompt vLLM holds already (a prefix hit) that prefill skips


class DecodeSide:
    """The scheduler half of a decode engine. ``layouts``: one per decode TP rank;
    ``recompute``: vLLM's ``kv_load_failure_policy`` is ``recompute`` (a request whose KV
    never came is computed locally; else its load fails and vLLM fails the request).
    Ownership: the buffers, the receiver and the scheduler are this object's
    (:meth:`close`)."""

    def __init__(
        self,
        settings: Settings,
        layouts: list[KVLayout],
        *,
        recompute: bool = False,
        buffer_order: str = "layer",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        lay = layouts[0]
        note = stale_note()  # a killed engine's buffers (its process is gone): said at start
        if note:
            _log.warning("pdkv decode: %s", note)
        n = settings.buffer_blocks or settings.buffer_bytes // lay.block_bytes
        if n <= 0:
            raise ValueError(
                f"a buffer of {settings.buffer_bytes} bytes holds no block of {lay.block_bytes} bytes: "
                "raise kv_connector_extra_config['buffer_gib']"
            )
        self.settings, self.layouts, self.num_blocks = settings, layouts, n
        self.buffer_order = buffer_order
        self.recompute, self.clock = recompute, clock
        self.refused = 0  # requests that claimed KV they could not prove their own
        self.computed_here = 0  # requests whose KV decode's buffer refused (no room in time)
        self.computed_gone = 0  # requests whose KV was gone when they came (dropped, expired, failed)
        self.pull_failed = 0  # requests whose pull prefill refused or did not answer
        self.tally = Tally()  # what vLLM's stats hooks read (take_stats)
        self._said: dict[str, int] = {}  # the counters and gauges as last taken
        # pdkv id -> when its blocks were granted, and how many (a held prefix is not)
        self._granted_at: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.puller: PullClient | None = None
        self.buffers: list[SharedBuffer] = []
        self.receiver: DecodeReceiver | None = None
        try:
            for layout in layouts:
                self.buffers.append(SharedBuffer.create(CacheSpec.buffer_bytes(layout, n)))
            # removes them if this process ends without close() (SIGKILL of vLLM's process group)
            self._watch = reaper.watch([b.name for b in self.buffers])
            self.swaps = WorkerSwaps()
            self.sched = DecodeScheduler(
                layout=lay,
                gpu=None,
                buffer=BlockPool(n, name="buffer"),
                swap=self.swaps,
                # a full buffer queues a reservation (prefill keeps its blocks meanwhile) for
                # at most queue_timeout_s; refused then, the prompt is computed here at once
                options=SchedulerOptions(
                    bind="engine",
                    direct_to_gpu=False,
                    lease_s=settings.lease_s,
                    on_full="queue",
                    queue_timeout_s=settings.queue_timeout_s,
                ),
            )
            self.receiver = DecodeReceiver(
                self.sched,
                layouts,
                self.buffers,
                n,
                control=settings.control,
                transports=settings.transports,
                secret=settings.secret,
                data_host=settings.data_host,
                auto_tick=True,
                peer_timeout_s=settings.peer_timeout_s,
                buffer_order=buffer_order,
            )
        except BaseException:
            self.close()
            raise
        self.control_address = self.receiver.control_address
        self.advertised = settings.advertise or self.control_address  # how prefill knows this decode
        if settings.prefills:  # pull style: decode asks one of these prefills for a request's KV
            self.puller = PullClient(
                settings.prefills, secret=settings.secret, timeout_s=settings.pull_answer_timeout_s
            )
        self._wants: dict[str, _Want] = {}
        self._loads: list[Load] = []
        # received requests by pdkv id -> when: one that no vLLM request asks for within
        # load_timeout_s (decode's client went away first) is dropped from the buffer
        self._received: OrderedDict[str, float] = OrderedDict()
        self._rlock = threading.Lock()  # the listener runs on the receiver's thread
        self._wlock = threading.Lock()  # _wants: vLLM's thread and the sweeper
        self.sched.add_listener(self._on_event)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="pdkv-vllm-sweep", daemon=True)
        self._sweeper.start()
        _log.info(
            "pdkv decode: %d buffer blocks of %d bytes per rank x %d ranks, control %s",
            n,
            lay.block_bytes,
            len(layouts),
            self.control_address,
        )

    # ------------------------------------------------------------------ vLLM's scheduler
    def matched(
        self, req_id: str, params: Mapping[str, Any] | None, prompt: Sequence[int], num_computed: int
    ) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: ``(tokens, True)`` once prefill's KV is in the
        buffer, ``(None, False)`` while it is on its way, ``(0, False)`` for a request
        without pdkv's parameters (or, with ``recompute``, whose KV will not come).

        The parameters come with a client's request: a hint. The KV goes only to a request
        that proves it is the one prefill served: its ``pdkv_cap`` and its own prompt's
        tokens must give the binding prefill's reservation carried (constant-time compare).
        A request that fails the proof is computed here, and the request it named is left
        as it was (nothing of it aborted, bound or loaded)."""
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if PARAM_TRANSFER in params:  # a router's shared id: the pdkv id and the capability
            pid, cap = transfer_pid(params[PARAM_TRANSFER]), params[PARAM_TRANSFER]
        else:
            pid, cap = params.get(PARAM_ID), params.get(PARAM_CAP)
        if not isinstance(pid, str) or not pid:
            return 0, False
        prompt_len = len(prompt)
        now = self.clock()
        with self._wlock:
            w = self._wants.get(req_id)
            if w is None:
                claim = binding_of(cap, token_digest(prompt)) if isinstance(cap, str) and len(cap) <= 128 else b""
                w = self._wants[req_id] = _Want(pid, now, claim=claim)
                new = True
            else:
                new = False
        if new:
            self._hold_prefix(w, num_computed, prompt_len)
        if new and PARAM_PULL in params:
            why = self._pull(w, params[PARAM_PULL])
            if why:
                return self._refuse(req_id, w, why)
        w.local = num_computed  # what vLLM holds itself: a load (or its failure) covers the rest
        if w.fail:
            return prompt_len - num_computed, True
        try:
            info = self.sched.request(pid)
        except RequestError:
            info = None  # prefill has not reserved yet
        if info is not None and not w.proven and (info.state in _WAITING or info.state is State.RECEIVED):
            if not w.claim or not hmac.compare_digest(w.claim, info.binding):
                return self._refuse(req_id, w, "its pdkv_cap and prompt do not match what prefill reserved")
            w.proven = True
        if info is None and w.pull is not None and w.pull.done and w.pull.error:
            self.pull_failed += 1  # nothing was reserved for it here: computed here at once
            why = w.pull.error
            _log.warning("pdkv decode: request %s (pdkv %s): pull refused: %s; computed here", req_id, pid, why)
            with self._wlock:
                self._wants.pop(req_id, None)
            return 0, False
        if info is None or info.state in _WAITING:
            if now - w.since <= self.settings.load_timeout_s:
                return None, False
            return self._give_up(
                req_id, w, f"no KV within load_timeout_s={self.settings.load_timeout_s}s", prompt_len - num_computed
            )
        if info.state is State.REJECTED:  # refused (no room within queue_timeout_s): no KV will come
            _log.info(
                "pdkv decode: request %s (pdkv %s): its KV was refused (%s): computed here", req_id, pid, info.reason
            )
            self.computed_here += 1
            with self._wlock:
                self._wants.pop(req_id, None)
            return 0, False
        if info.state is not State.RECEIVED:
            # its KV is gone (dropped unclaimed after load_timeout_s, expired, failed): no load
            # has begun, so the prompt is computed here, as for a refused reservation, never
            # failed whatever vLLM's kv_load_failure_policy
            _log.warning(
                "pdkv decode: request %s (pdkv %s): its KV is %s (%s): computed here",
                req_id,
                pid,
                info.state.value,
                info.reason,
            )
            self.computed_gone += 1
            with self._wlock:
                self._wants.pop(req_id, None)
            return 0, False
        if info.num_tokens != prompt_len:
            return self._give_up(
                req_id,
                w,
                f"prefill sent {info.num_tokens} tokens for a prompt of {prompt_len}",
                prompt_len - num_computed,
            )
        if num_computed >= prompt_len:
            self._abort(w.pid, "decode holds the whole prompt already")
            with self._wlock:
                del self._wants[req_id]
            return 0, False
        if not w.ready:
            w.ready = True
            self.tally.sample("wait_s", now - w.since)
        return prompt_len - num_computed, True

    def _hold_prefix(self, w: _Want, num_computed: int, prompt_len: int) -> None:
        """vLLM's prefix cache holds the prompt's first blocks and prefill has not reserved
        yet (a pull, or a shared transfer_id): prefill then sends only the rest."""
        tpb = self.layouts[0].tokens_per_block
        k = num_computed // tpb
        if not w.claim or not 0 < k < -(-prompt_len // tpb):
            return
        try:  # placeholder ids (engine mode counts them); claimed only by a reservation bound as this claim
            self.sched.hold_prefix(w.pid, range(k), binding=w.claim)
        except RequestError:
            return  # reserved already (the KV comes whole) or held by another claim
        w.held = k

    def _pull(self, w: _Want, address: object) -> str:
        """Ask the prefill at ``address`` (one of extra config 'prefill') to send ``w``'s KV
        here (never waits); what is wrong, or ''."""
        if self.puller is None or not isinstance(address, str) or address not in self.puller.allowed:
            return f"{PARAM_PULL} {str(address)[:80]!r} is not a configured prefill (extra config 'prefill')"
        if not w.claim:
            return "it shows no capability"
        w.pull = self.puller.pull(address, w.pid, w.claim, self.advertised)
        return ""

    def _refuse(self, req_id: str, w: _Want, why: str) -> tuple[int | None, bool]:
        """A request that claims KV it cannot prove is its own: computed here; the request
        it named goes on untouched."""
        self.refused += 1
        _log.warning("pdkv decode: request %s claims pdkv %.80r: %s; computed here", req_id, w.pid, why)
        with self._wlock:
            self._wants.pop(req_id, None)
        return 0, False

    def _give_up(self, req_id: str, w: _Want, why: str, tokens: int) -> tuple[int | None, bool]:
        _log.warning("pdkv decode: request %s (pdkv %s): %s", req_id, w.pid, why)
        if w.proven:  # only the request prefill served may end its KV early
            self._abort(w.pid, why)
        if self.recompute or tokens <= 0:
            with self._wlock:
                del self._wants[req_id]
            return 0, False
        w.fail = True  # vLLM waits for a load; it fails, and vLLM applies its policy
        return tokens, True

    def _abort(self, pid: str, why: str) -> None:
        try:
            self.sched.abort(pid, why)
        except RequestError:
            pass  # unknown or already ended

    def allocated(self, req_id: str, block_ids: list[int], num_external: int) -> None:
        """``update_state_after_alloc``: bind the request to vLLM's blocks; the load goes
        out in the next step's metadata."""
        w = self._wants.get(req_id)
        if w is None or num_external <= 0 or w.bound is not None:
            return
        tpb = self.layouts[0].tokens_per_block
        first = w.local // tpb
        need = -(-(w.local + num_external) // tpb)
        if len(block_ids) < need and not w.fail:
            w.fail = True
            self._abort(w.pid, f"vLLM gave {len(block_ids)} blocks for {need}")  # its buffer blocks go back now
        blocks = tuple(block_ids[first:need])
        w.bound = blocks
        if w.fail:
            self._loads.append(Load(req_id, (), blocks))
            return
        try:
            if first < w.held:  # vLLM lost part of the prefix prefill skipped: the KV is incomplete
                raise RequestError(f"vLLM holds {first} blocks of the {w.held} prefill skipped")
            bufs = self.sched.bind(w.pid, blocks, first_block=first - w.held)
        except PdkvError as exc:  # it expired or was aborted since matched(): the load fails
            _log.warning("pdkv decode: request %s (pdkv %s) could not be bound: %s", req_id, w.pid, exc)
            self._loads.append(Load(req_id, (), blocks))
            return
        self._loads.append(Load(req_id, bufs, blocks))

    def step_meta(self) -> StepMeta:
        """``build_connector_meta``: the loads bound since the last step."""
        loads, self._loads = self._loads, []
        self._drain()
        return StepMeta(
            buffers=[b.name for b in self.buffers],
            buffer_blocks=self.num_blocks,
            buffer_order=self.buffer_order,
            loads=loads,
        )

    def loaded(self, finished: Iterable[str], invalid_blocks: Iterable[int] = ()) -> None:
        """``update_connector_output``: the workers finished these loads (a load whose
        blocks are among ``invalid_blocks`` failed); their buffer blocks go back."""
        bad = set(invalid_blocks)
        for req_id in finished:
            with self._wlock:
                w = self._wants.pop(req_id, None)
            if w is None or w.bound is None or w.fail:
                continue
            err = RuntimeError("a worker failed to copy the request's blocks") if bad & set(w.bound) else None
            self.swaps.done(w.pid, err)
        self._drain()

    def _on_event(self, ev: Event) -> None:
        now = self.clock()
        if ev.kind is EventKind.RECEIVED:
            with self._rlock:
                self._received[ev.request_id] = now
                got = self._granted_at.pop(ev.request_id, None)
            self.tally.count("received")
            if got is not None:
                self.tally.sample("grant_to_received_s", now - got[0])
                self.tally.count("bytes_received", got[1] * sum(lay.block_bytes for lay in self.layouts))
        elif ev.kind in (EventKind.RESERVED, EventKind.GRANTED):
            n = len(ev.grant.blocks) if ev.grant is not None else 0
            with self._rlock:
                self._granted_at[ev.request_id] = (now, n)
                while len(self._granted_at) > 65536:
                    self._granted_at.popitem(last=False)
        elif ev.kind in (EventKind.FAILED, EventKind.EXPIRED, EventKind.ABORTED, EventKind.REJECTED):
            with self._rlock:
                self._granted_at.pop(ev.request_id, None)
            self.tally.count(f"ended_{ev.kind.value}")

    def take_stats(self) -> dict[str, Any]:
        """What vLLM's stats hooks read: events since the last call (counters, latency
        samples) and the buffer's occupancy when it changed."""
        now = {
            "refused_proof": self.refused,
            "refused_full": self.computed_here,
            "kv_gone": self.computed_gone,
            "pull_failed": self.pull_failed,
        }
        for k, v in now.items():
            if v != self._said.get(k, 0):
                self.tally.count(k, v - self._said.get(k, 0))
                self._said[k] = v
        pool = self.sched.buffer
        assert pool is not None  # the buffer scheduler's pool (engine-bound mode has one)
        gauges = {"buffer_used_blocks": pool.num_total - pool.num_free, "buffer_total_blocks": pool.num_total}
        for k, v in gauges.items():
            if self._said.get(k) != v:
                self.tally.gauge(k, v)
                self._said[k] = v
        return self.tally.take()

    def _drain(self) -> None:
        self.sched.tick()
        for r in self.sched.take_ready():
            self.sched.finish(r.request_id, free_gpu_blocks=False)

    def _sweep_loop(self) -> None:
        # an idle vLLM does not step: received requests nobody claims are dropped from here
        while not self._stop.wait(min(1.0, self.settings.load_timeout_s / 4)):
            try:
                self._sweep()
            except Exception:  # the sweep must outlive any one failure
                _log.exception("pdkv decode: sweeping unclaimed requests failed")

    def _sweep(self) -> None:
        now, limit = self.clock(), self.settings.load_timeout_s
        stale = []
        with self._rlock:
            while self._received:
                pid, t = next(iter(self._received.items()))
                if now - t <= limit:
                    break
                del self._received[pid]
                stale.append(pid)
        with self._wlock:
            claimed = {w.pid for w in self._wants.values() if w.proven}  # a claim without proof holds nothing
        for pid in stale:
            if pid not in claimed:
                self._abort(pid, f"no vLLM request asked for it within load_timeout_s={limit}s")

    def finished(self, req_id: str) -> bool:
        """``request_finished``: True while a worker may still write the request's blocks
        (vLLM frees them when the load is reported); else any pdkv state is dropped."""
        w = self._wants.get(req_id)
        if w is None:
            return False
        if w.bound is not None:
            return True
        with self._wlock:
            del self._wants[req_id]
        if w.proven:  # a request that never proved the KV its own ends nothing of it
            self._abort(w.pid, "vLLM finished the request before its KV was loaded")
        return False

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._sweeper.join(timeout=5)
        puller = getattr(self, "puller", None)
        if puller is not None:
            puller.close()
        if self.receiver is not None:
            self.receiver.close()
        for b in self.buffers:
            try:
                b.close()
            except PdkvError as exc:  # a view still exported: the name still goes
                _log.warning("pdkv decode: buffer %s: %s", b.name, exc)
            try:
                b.unlink()
            except FileNotFoundError:
                pass
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.close()
