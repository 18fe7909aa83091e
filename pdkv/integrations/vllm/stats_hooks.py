"""pdkv's transfers in vLLM's own stats: :class:`PdkvStats` (what vLLM's workers and
scheduler hand its loggers each step, ``get_kv_connector_stats``, and what its log line
prints, ``reduce``) and :class:`PdkvPromMetrics` (the ``vllm:pdkv_*`` series on vLLM's
``/metrics``, ``build_prom_metrics``). The figures are the halves' tallies
(:mod:`pdkv.integrations.core.tally`); this module and :mod:`.connector` are the ones here that
import vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from ..core.tally import merge

__all__ = ["PdkvStats", "PdkvPromMetrics", "COUNTERS", "HISTOGRAMS", "GAUGES"]

# every series, by the tally name it reads; vLLM's /metrics shows each as vllm:pdkv_<name>
COUNTERS = {
    "sent": "prefill: requests whose KV decode's buffer holds",
    "send_failed": "prefill: requests whose KV did not reach decode",
    "bytes_sent": "prefill: bytes of KV sent (this engine's ranks)",
    "pulled": "prefill: pulls served (a decode asked for a held request)",
    "pull_expired": "prefill: requests held for a pull that never came (freed after pull_timeout_s)",
    "refused_decode": "prefill: requests naming a decode not configured (computed here only)",
    "received": "decode: requests whose KV landed in the buffer",
    "bytes_received": "decode: bytes of KV received into the buffer (all ranks; a held prefix is not sent)",
    "loads": "decode: requests copied from the buffer into vLLM's blocks",
    "load_failed": "decode: loads that failed (vLLM applies kv_load_failure_policy)",
    "bytes_loaded": "decode: bytes copied from the buffer into vLLM's blocks (this engine's ranks)",
    "refused_proof": "decode: requests claiming KV they could not prove their own (computed here)",
    "refused_full": "decode: requests whose KV the full buffer refused within queue_timeout_s (computed here)",
    "pull_failed": "decode: pulls prefill refused or did not answer (computed here)",
    "kv_gone": "decode: requests that came after their KV was dropped unclaimed, expired or failed (computed here)",
    "ended_failed": "decode: transfers that failed at pdkv",
    "ended_expired": "decode: transfers whose lease expired",
    "ended_aborted": "decode: transfers aborted",
    "ended_rejected": "decode: reservations rejected",
}
_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
HISTOGRAMS = {
    "grant_to_received_s": "decode: seconds from a request's buffer grant to its last layer landing",
    "wait_s": "decode: seconds from vLLM's first ask to the KV being ready in the buffer",
    "load_s": "decode: seconds of a buffer -> vLLM blocks copy",
    "send_s": "prefill: seconds from a request's first step to decode's outcome",
}
GAUGES = {
    "buffer_used_blocks": "decode: CPU buffer blocks held (each TP rank holds as many)",
    "buffer_total_blocks": "decode: CPU buffer blocks in all",
}


class PdkvStats(KVConnectorStats):
    """pdkv's figures for one interval: ``data`` is a taken tally (counters ``c``, samples
    ``s``, gauges ``g``), plain dicts that travel between vLLM's processes."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {"c": {}, "s": {}, "g": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in sorted(self.data.get("c", {}).items()) if v}
        for k, v in sorted(self.data.get("s", {}).items()):
            if v:
                vs = sorted(v)
                out[f"{k}_p50"] = round(vs[len(vs) // 2], 6)
                out[f"{k}_max"] = round(vs[-1], 6)
        out.update(self.data.get("g", {}))
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not (any(d.get("c", {}).values()) or any(d.get("s", {}).values()) or d.get("g"))


class PdkvPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:pdkv_*`` counters, histograms and gauges, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        pe = per_engine_labelvalues

        def each(metric: Any) -> dict[int, Any]:
            out: dict[int, Any] = create_metric_per_engine(metric, pe)
            return out

        self.counters = {
            k: each(self._counter_cls(name=f"vllm:pdkv_{k}", documentation=doc, labelnames=labelnames))
            for k, doc in COUNTERS.items()
        }
        self.histograms = {
            k: each(
                self._histogram_cls(name=f"vllm:pdkv_{k}", documentation=doc, buckets=_SECONDS, labelnames=labelnames)
            )
            for k, doc in HISTOGRAMS.items()
        }
        self.gauges = {
            k: each(self._gauge_cls(name=f"vllm:pdkv_{k}", documentation=doc, labelnames=labelnames))
            for k, doc in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for k, v in d.get("c", {}).items():
            if k in self.counters and v > 0:
                self.counters[k][engine_idx].inc(v)
        for k, vs in d.get("s", {}).items():
            if k in self.histograms:
                h = self.histograms[k][engine_idx]
                for v in vs:
                    h.observe(v)
        for k, v in d.get("g", {}).items():
            if k in self.gauges:
                self.gauges[k][engine_idx].set(v)
