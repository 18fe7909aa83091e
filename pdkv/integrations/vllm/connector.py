"""The facade vLLM loads: :class:`PdkvConnector`, a ``KVConnectorBase_V1`` over the four
halves (:mod:`.producer` and :mod:`.consumer`, scheduler and worker side each). vLLM's
objects are read here and nowhere else: the halves take plain ids, lists and specs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...errors import LayoutError
from ...layout import KVLayout
from ..core.tally import merge
from .consumer import DecodeSide, LoadWorker
from .producer import PrefillSide, SendWorker
from .settings import (
    StepMeta,
    buffer_order_of,
    check_version,
    layout_for,
    order_of,
    parse_settings,
    required_layout,
)
from .stats_hooks import PdkvPromMetrics, PdkvStats
from .views import cache_spec

__all__ = ["PdkvConnector", "PdkvMeta"]

_log = logging.getLogger(__name__)


def _register() -> None:
    """Name pdkv's connector in vLLM's registry too (it is loaded by module path): vLLM's
    MultiConnector rebuilds each sub-connector's stats by registered name, and without
    this its log and /metrics handler fails on pdkv's stats."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "PdkvConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("PdkvConnector", __name__, "PdkvConnector")


@dataclass
class PdkvMeta(KVConnectorMetadata):
    """One step's loads (decode) or saves (prefill), for every worker."""

    step: StepMeta


def _log_like_vllm() -> None:
    """pdkv's log lines go where vLLM's go (its handlers and level), unless the application
    configured pdkv's logger itself."""
    mine, theirs = logging.getLogger("pdkv"), logging.getLogger("vllm")
    if any(not isinstance(h, logging.NullHandler) for h in mine.handlers) or not theirs.handlers:
        return
    for h in theirs.handlers:
        mine.addHandler(h)
    mine.setLevel(theirs.getEffectiveLevel())


def _backends_of(config: Any) -> str:
    """The attention backends of the model's layers and the layouts each supports, for a
    warning: ``FLASH_ATTN (any)``, ``CPU_ATTN (LBHNC)``."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        names = set()
        for layer in get_layers_from_vllm_config(config, AttentionLayerBase).values():
            b = layer.get_attn_backend()
            ok = b.supported_kv_cache_layouts()
            names.add(f"{b.get_name()} ({'any' if ok is None else ', '.join(o.name for o in ok)})")
    except Exception as e:  # a vLLM that moved these: the warning still says what was chosen
        return f"the attention backend could not be named ({type(e).__name__})"
    return "attention backend " + ", ".join(sorted(names)) if names else "no attention layer found"


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class PdkvConnector(KVConnectorBase_V1):
    """pdkv as vLLM's KV connector: ``kv_connector="PdkvConnector"``,
    ``kv_connector_module_path="pdkv.integrations.vllm"``, ``kv_role`` ``kv_producer``
    (prefill) or ``kv_consumer`` (decode), options in ``kv_connector_extra_config``
    (:class:`~pdkv.integrations.vllm.settings.Settings`)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        check_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        kt = vllm_config.kv_transfer_config
        self._settings = parse_settings(str(kt.kv_role), str(kt.engine_id), kt.kv_connector_extra_config)
        self._producer = kt.kv_role == "kv_producer"
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise LayoutError("pdkv's vLLM connector serves pipeline_parallel_size=1")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise LayoutError(
                f"pdkv's vLLM connector serves one KV cache group (full attention); this model has "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        layout_name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
            vllm_config.cache_config, "kv_cache_layout", None
        )
        self._layout_name = layout_name
        self._order = order_of(layout_name, _is_cpu(), self._settings.kv_fused)
        self._config = vllm_config
        self._prefill: PrefillSide | None = None
        self._decode: DecodeSide | None = None
        self._sender: SendWorker | None = None
        self._loader: LoadWorker | None = None
        self._index: dict[str, int] = {}
        self._kv_caches: list[torch.Tensor] = []
        if role == KVConnectorRole.SCHEDULER:
            if self._producer:
                self._prefill = PrefillSide(self._settings)
            else:
                tp = pc.tensor_parallel_size
                self._decode = DecodeSide(
                    self._settings,
                    [self._layout(r) for r in range(tp)],
                    recompute=getattr(kt, "kv_load_failure_policy", "fail") == "recompute",
                    buffer_order=buffer_order_of(layout_name),
                )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Decode asks for a block-outermost cache (``kv_cache_order``, on a GPU by default):
        a block of every layer is one contiguous piece, the size at which the swap reaches
        line rate on the copy engines. vLLM drops the request, with a warning, where an
        attention backend does not support it; pdkv then names the backend at start
        (:meth:`register_kv_caches`) and swaps per layer."""
        kt = vllm_config.kv_transfer_config
        settings = parse_settings(str(kt.kv_role), str(kt.engine_id), kt.kv_connector_extra_config)
        return required_layout(settings, _is_cpu())

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: how the workers reach the cache (0.32 and 0.33 do not ask). Decode
        copies into it in process; a prefill whose transport may register it with UCX or
        RDMA (nixl, rdma, or auto) needs one physical allocation per segment."""
        from vllm.config import kv_transfer

        access = vars(kv_transfer)["KVCacheAccess"]  # 0.34's (this method is not called before)
        extra = kv_transfer_config.kv_connector_extra_config or {}
        if kv_transfer_config.kv_role == "kv_producer" and extra.get("transport", "auto") in ("auto", "nixl", "rdma"):
            return access.REGISTERS
        return access.IN_PROCESS

    def _layout(self, rank: int) -> KVLayout:
        c = self._config
        mc, cc, pc = c.model_config, c.cache_config, c.parallel_config
        dtype = mc.dtype if cc.cache_dtype == "auto" else cc.cache_dtype
        return layout_for(
            num_layers=mc.get_num_layers(pc),
            kv_heads=mc.get_total_num_kv_heads(),
            head_dim=mc.get_head_size(),
            block_size=cc.block_size,
            dtype=str(dtype),
            tp_size=pc.tensor_parallel_size,
            tp_rank=rank,
            order=self._order,
        )

    @property
    def pull_address(self) -> str:
        """Prefill's pull endpoint (the scheduler side of a ``kv_producer`` with ``pull``)."""
        assert self._prefill is not None, "the pull address is the prefill scheduler side's"
        return self._prefill.pull_address

    @property
    def control_address(self) -> str:
        """Decode's control endpoint (the scheduler side of a ``kv_consumer``)."""
        assert self._decode is not None, "the control address is the decode scheduler side's"
        return self._decode.control_address

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        layout = self._layout(get_tensor_model_parallel_rank())
        names = sorted(kv_caches, key=extract_layer_index)
        self._index = {n: i for i, n in enumerate(names)}
        if len(names) != layout.total_layers:
            raise LayoutError(f"vLLM gave {len(names)} KV cache layers; the model has {layout.total_layers}")
        self._kv_caches = [kv_caches[n] for n in names]  # by layer index (for inspection)
        spec = cache_spec(layout, self._kv_caches)
        asked = required_layout(self._settings, _is_cpu())
        if asked is not None and asked != self._layout_name and layout.tp_rank == 0:
            _log.warning(
                "pdkv decode asked vLLM for the block-outermost KV cache layout %s; %s; vLLM chose %s, so "
                "each swap moves one layer of a block per piece (kv_connector_extra_config"
                "['kv_cache_order']='vllm' asks nothing)",
                asked,
                _backends_of(self._config),
                self._layout_name or "its default",
            )
        if self._producer:
            self._sender = SendWorker(self._settings, layout, spec)
        else:
            self._loader = LoadWorker(layout, spec, priority=self._settings.swap_priority)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        # before the forward: vLLM may call start_load_kv after it (asynchronous loads only)
        if self._sender is not None:
            assert isinstance(connector_metadata, PdkvMeta)
            self._sender.start(connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._loader is not None:
            meta = self._get_connector_metadata()
            assert isinstance(meta, PdkvMeta)
            self._loader.start(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads run between steps: a loading request is not in the batch

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._sender is None:
            return
        event = None
        if kv_layer.is_cuda:  # the copy stream waits for the layer's writes, not the host
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record()
            event = ev.cuda_event
        self._sender.save_layer(self._index[layer_name], event)

    def wait_for_save(self) -> None:
        if self._sender is not None:
            self._sender.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._sender is not None:
            return self._sender.finished(finished_req_ids) or None, None
        if self._loader is not None:
            return None, self._loader.finished() or None
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._loader.load_errors() if self._loader is not None else set()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._decode is None:
            return 0, False
        prompt = request.prompt_token_ids or ()
        return self._decode.matched(request.request_id, request.kv_transfer_params, prompt, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._decode is not None and num_external_tokens > 0:
            self._decode.allocated(request.request_id, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PdkvMeta:
        if self._decode is not None:
            return PdkvMeta(self._decode.step_meta())
        assert self._prefill is not None
        so = scheduler_output
        new = [
            (
                r.req_id,
                (r.sampling_params.extra_args or {}).get("kv_transfer_params") if r.sampling_params else None,
                r.prompt_token_ids or (),
                list(r.block_ids[0]),
                r.num_computed_tokens,
            )
            for r in so.scheduled_new_reqs
        ]
        c = so.scheduled_cached_reqs
        resumed: set[str] = getattr(c, "resumed_req_ids", set())
        cached = [
            (rid, list(nb[0]) if nb else None, n, rid in resumed)
            for rid, nb, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens)
        ]
        return PdkvMeta(self._prefill.step(new, cached, so.num_scheduled_tokens))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._decode is not None:
            out = connector_output
            self._decode.loaded(
                set(out.finished_recving or ()) | set(getattr(out, "failed_recving", ()) or ()),
                out.invalid_block_ids or (),
            )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._prefill is not None:
            return self._prefill.finished(request.request_id)
        if self._decode is not None:
            return self._decode.finished(request.request_id), None
        return False, None

    # ------------------------------------------------------------------ vLLM's stats
    def get_kv_connector_stats(self) -> PdkvStats | None:
        """Each step, in the workers and the scheduler: what this side counted since."""
        data: dict[str, Any] = {}
        for part in (self._decode, self._prefill, self._sender, self._loader):
            if part is not None:
                data = merge(data, part.take_stats())
        stats = PdkvStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdkvStats | None:
        return PdkvStats(data=data) if data is not None else PdkvStats(data={"c": {}, "s": {}, "g": {}})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PdkvPromMetrics:
        return PdkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for part in (self._sender, self._loader, self._decode, self._prefill):
            if part is not None:
                part.close()
        self._sender = self._loader = self._decode = self._prefill = None


_register()
