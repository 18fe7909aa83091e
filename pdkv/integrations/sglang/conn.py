"""pdkv as an SGLang disaggregation backend (SGLang 0.5.23): the manager, sender, receiver
and bootstrap server SGLang's queues drive, over :mod:`.sides`. The only module here that
imports SGLang (``sglang.srt.disaggregation.base.conn``), when it is first imported.

The classes implement SGLang's ``Base*`` contract (``base/conn.py``) and what its queues
call beyond it on a decode manager (``try_ensure_parallel_info``) and receiver
(``conclude_state``, ``abort_notified``, ``ensure_abort_notified``, ``bootstrap_infos``,
``require_staging``), read from 0.5.23's ``decode.py`` and ``prefill.py``. Both
destinations: ``send_metadata(..., destination=HOST)`` receives into decode's host pool
(``KVArgs.host_kv_data_ptrs``), ``DEVICE`` into its KV pool: directly where that memory
is host-addressable (a CPU device), else through pdkv's staging buffer and the swap
engine's copy (:mod:`.staged`). ``supports_host_destination`` is true on both the manager
and its receivers, and ``is_abort_release_safe()`` is true only once pdkv holds none of the
request's pages (no write admitted under its grant still runs, none can start).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)

from ...errors import PdkvError
from .bootstrap import BootstrapServer, layout_of
from .layouts import ModelFacts, rank_pools
from .prefill_rank import PrefillRank, RoomOut
from .sides import DecodeRank, RoomIn, Settings

__all__ = ["PdkvKVManager", "PdkvKVSender", "PdkvKVReceiver", "PdkvKVBootstrapServer"]

_log = logging.getLogger(__name__)
_POLL = {
    "bootstrapping": KVPoll.Bootstrapping,
    "waiting": KVPoll.WaitingForInput,
    "transferring": KVPoll.Transferring,
    "success": KVPoll.Success,
    "failed": KVPoll.Failed,
}


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "value", mode)).lower()


def _sglang_defers_release() -> bool:
    """SGLang's ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` (on by default): off, its
    decode releases a failed device destination's pages at once, with a write perhaps still
    landing in them (NIXL's are one-sided); pdkv says so at start."""
    try:
        from sglang.srt.environ import envs

        on = bool(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get())
    except (ImportError, AttributeError):
        on = True
    if not on:
        _log.warning(
            "pdkv: SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off: SGLang's decode releases the device "
            "pages of a failed transfer without asking pdkv whether a write into them still runs"
        )
    return on


def _model_facts(args: Any, server_args: Any, mla: bool) -> ModelFacts | None:
    """The model's KV heads and dtype from SGLang's own model config, where ``KVArgs``
    leaves them out (decode's ``total_kv_head_num`` without staging; ``kv_cache_dtype_str``
    ``"auto"``): the same facts on both sides, read the way SGLang's model runner reads them."""
    need_heads = not mla and not getattr(args, "total_kv_head_num", 0)
    if not need_heads and str(getattr(args, "kv_cache_dtype_str", "")).lower() != "auto":
        return None
    try:
        from sglang.srt.configs.model_config import ModelConfig

        mc = ModelConfig.from_server_args(server_args)
        return ModelFacts(kv_heads=int(mc.get_total_num_kv_heads()), dtype=str(mc.dtype))
    except Exception as exc:
        raise PdkvError(
            f"pdkv's SGLang backend: the model's KV heads and dtype are not in KVArgs, and SGLang's model "
            f"config could not say ({type(exc).__name__}: {exc})"
        ) from exc


class PdkvKVManager(BaseKVManager):
    """One per SGLang scheduler rank (prefill or decode). Configuration: :class:`Settings`
    from the environment (``PDKV_SECRET`` required); ``server_args`` gives the bootstrap
    port, the TP size, the device and the host-receive threshold."""

    supports_host_destination = True
    # a failed device destination's pages stay SGLang's to release only once pdkv's writes
    # into them ended (SGLang's deferred decode KV release, on by default): see is_abort_release_safe
    supports_deferred_decode_kv_release = True

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False):
        self.kv_args, self.server_args = args, server_args
        self.enable_deferred_decode_kv_release = _sglang_defers_release()
        self.disaggregation_mode = disaggregation_mode
        self.is_mla_backend = bool(is_mla_backend)
        self.settings = getattr(server_args, "pdkv_settings", None) or Settings.from_env()
        tp = int(getattr(server_args, "tp_size", 1) or 1) // int(getattr(server_args, "dp_size", 1) or 1)
        self.tp_size = max(tp, int(args.engine_rank) + 1)
        on_cpu = str(getattr(server_args, "device", "cuda")) == "cpu"
        # a GPU pool is named by its device (SGLang's gpu_id): pdkv's senders stage it, and
        # decode's device destination goes through pdkv's staging buffer and a copy
        gpu = None if on_cpu else int(getattr(args, "gpu_id", 0) or 0)
        model = _model_facts(args, server_args, self.is_mla_backend)
        self.pools = rank_pools(args, mla=self.is_mla_backend, tp_size=self.tp_size, device=gpu, model=model)
        aux = (list(args.aux_data_ptrs or []), list(args.aux_item_lens or []))
        self.bootstrap_port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
        self.decode: DecodeRank | None = None
        self.prefill: PrefillRank | None = None
        # decode: the prefill instances whose table is known, as SGLang's decode queue reads
        # them (``DecodePreallocQueue._resolve_prefill_dp_rank``: one DP rank each)
        self.prefill_info_table: dict[str, Any] = {}
        mode = _mode_name(disaggregation_mode)
        if mode == "decode":
            self.decode = DecodeRank(self.pools, self.settings, aux=aux)
        elif mode == "prefill":
            host = str(getattr(server_args, "host", "127.0.0.1") or "127.0.0.1")
            self.prefill = PrefillRank(self.pools, self.settings, f"{host}:{self.bootstrap_port}", aux=aux)
        else:
            raise PdkvError(f"pdkv's SGLang backend serves prefill and decode, not {mode!r}")

    def register_to_bootstrap(self) -> None:
        """Prefill ranks register when the manager starts (:class:`PrefillRank`)."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode's queue asks before ``init``: whether the prefill's table is known. Once it
        is, ``prefill_info_table[bootstrap_addr]`` describes that prefill as SGLang's own
        backends do (one DP rank: pdkv's prefill ranks are one TP group)."""
        assert self.decode is not None
        try:
            ranks = self.decode.prefill_ranks(bootstrap_addr)
        except PdkvError as exc:
            _log.warning("pdkv: prefill at %s not ready: %s", bootstrap_addr, exc)
            return False
        if bootstrap_addr not in self.prefill_info_table:
            from sglang.srt.disaggregation.common.conn import PrefillServerInfo

            src = layout_of(ranks[0])
            self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
                attn_tp_size=src.tp_size,
                attn_cp_size=1,
                dp_size=1,
                pp_size=1,
                page_size=src.tokens_per_block,
                kv_cache_dtype=src.dtype,
                follow_bootstrap_room=False,
            )
        return True

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """SGLang's decode asks before it releases the device pages of a request whose
        transfer failed (deferred decode KV release): true once pdkv holds none of them (no
        write admitted under its grant still runs, none can start; a staged copy ended).
        ``required_acks`` (prefill acknowledgements SGLang's own backends count) is not
        needed: pdkv's decode knows its writes itself."""
        return self.decode is None or self.decode.release_safe_room(int(bootstrap_room))

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang's decode released the request's pages: the receiver's ``clear`` forgets it."""

    def submit_prefill_recompute(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """SGLang's decode asks prefill to recompute a request it retracted for a weight
        update (``pause_generation`` with retract; DeepSeek V4 pools). pdkv does not: the
        request fails at once with that reason, and SGLang returns it to its client."""
        kv_receiver.fail(
            "pdkv does not have prefill recompute a retracted request (pause_generation with retract): "
            f"request {payload.get('rid', '?')!s:.80} fails"
        )

    def close(self) -> None:
        for side in (self.decode, self.prefill):
            if side is not None:
                side.close()

    teardown = close


class PdkvKVSender(BaseKVSender):
    """Prefill's per-request sender: ``init`` (pages to send, aux slot), ``send`` each
    chunk's pages (the KV goes once every page is in and every decode rank pulled)."""

    def __init__(
        self,
        mgr: PdkvKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        assert mgr.prefill is not None, "a sender needs a prefill manager"
        self.kv_mgr, self.bootstrap_room = mgr, int(bootstrap_room)
        self._side = mgr.prefill
        self._out: RoomOut | None
        try:
            self._out = self._side.open(self.bootstrap_room)
            self._error = ""
        except PdkvError as exc:
            self._out, self._error = None, str(exc)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        if self._out is not None:
            self._side.init(self._out, int(num_kv_indices), aux_index)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **_: Any) -> None:
        if self._out is None:
            return
        if state_indices is not None and any(s is not None for s in state_indices):
            self._side.abort(self._out, "state pools are not carried by pdkv")
            return
        self._side.send(self._out, np.asarray(kv_indices).astype(np.int64).tolist())

    def pop_decode_prefix_len(self) -> int:
        """The prompt tokens decode's radix cache holds (its ``decode_prefix_len``): SGLang
        sends only the pages after them (``finalize_bootstrap``)."""
        return 0 if self._out is None else self._side.prefix(self._out)

    def get_transfer_metric(self) -> KVTransferMetric:
        if self._out is None or self._out.state != "success":
            return KVTransferMetric()
        return KVTransferMetric(transfer_total_bytes=self._out.bytes)

    def poll(self) -> int:
        if self._out is None:
            return int(KVPoll.Failed)
        return int(_POLL[self._side.status(self._out)])

    def failure_exception(self) -> None:
        why = self._error or (self._out.error if self._out is not None else "")
        raise PdkvError(f"pdkv: room {self.bootstrap_room}: {why or 'failed'}")

    def abort(self) -> None:
        if self._out is not None:
            self._side.abort(self._out)

    def clear(self) -> None:
        if self._out is not None:
            self._side.forget(self._out)


class PdkvKVReceiver(BaseKVReceiver):
    """Decode's per-request receiver: ``init`` (which prefill ranks), ``send_metadata``
    (the pages, host or device, and the aux slot), ``poll`` until Success."""

    require_staging = False

    def __init__(self, mgr: PdkvKVManager, bootstrap_addr: str, bootstrap_room: int | None = None, **_: Any):
        assert mgr.decode is not None, "a receiver needs a decode manager"
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self._side = mgr.decode
        self._in: RoomIn | None = None
        self._error = ""
        self.conclude_state: int | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []

    @property
    def supports_host_destination(self) -> bool:
        return "host" in self._side.pages

    def init(self, prefill_dp_rank: int = 0) -> None:
        try:
            self._in = self._side.start(self.bootstrap_room, self.bootstrap_addr)
            self.bootstrap_infos = list(self._in.desks)
        except PdkvError as exc:
            self._error, self.conclude_state = str(exc), KVPoll.Failed

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = KVTransferDestination.DEVICE,
    ) -> None:
        if self._in is None:
            return
        why = ""
        if state_indices is not None and any(s is not None for s in state_indices):
            why = "state pools are not carried by pdkv"
        dest = "host" if destination == KVTransferDestination.HOST else "device"
        if not why:
            try:
                pages = np.asarray(kv_indices).astype(np.int64).tolist()
                self._side.publish(self._in, pages, aux_index, dest, int(decode_prefix_len or 0))
            except PdkvError as exc:
                why = str(exc)
        if why:
            self._side.abort(self._in, why)

    def poll(self) -> int:
        if self._in is None:
            return int(KVPoll.Failed if self._error else KVPoll.Bootstrapping)
        state = _POLL[self._side.status(self._in)]
        if state in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = state
        return int(state)

    def failure_exception(self) -> None:
        why = self._error or (self._in.error if self._in is not None else "")
        raise PdkvError(f"pdkv: room {self.bootstrap_room}: {why or 'failed'}")

    def abort(self) -> None:
        self.abort_notified = True
        if self._in is not None:
            self._side.abort(self._in)
        self.conclude_state = KVPoll.Failed

    def fail(self, why: str) -> None:
        """End the request as failed, naming ``why`` (``failure_exception`` raises it)."""
        if self._in is not None:
            self._side.abort(self._in, why)
        else:
            self._error = why
        self.conclude_state = KVPoll.Failed

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        self.abort()

    def is_abort_release_safe(self) -> bool:
        return self._in is None or self._side.release_safe(self._in)

    def clear(self) -> None:
        if self._in is not None:
            self._side.forget(self._in)


class PdkvKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's bootstrap server (:class:`~.bootstrap.BootstrapServer`)."""

    def __init__(self, host: str, port: int, **_: Any):
        self._server = BootstrapServer(host, int(port), Settings.from_env().secret)
        self.host, self.port = self._server.host, self._server.port

    def run(self) -> None:
        """Serving already (a thread of its own)."""

    def close(self) -> None:
        self._server.close()
