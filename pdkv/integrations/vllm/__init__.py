"""vLLM's KV connector over pdkv (``pip install 'pdkv[vllm]'``): load it by module path,
with no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "PdkvConnector",
                           "kv_connector_module_path": "pdkv.integrations.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {...}}'

``settings`` (configuration, layouts, step metadata), ``producer`` (prefill: reserve in
decode's CPU buffer, send layer by layer, free prefill's blocks once decode's buffer holds
the KV), ``consumer`` (decode: the buffer, the receiver, bind vLLM's blocks late, copy into
them in the worker) are pure pdkv; ``connector`` is the facade vLLM imports, and the only
module here that imports vLLM (when :class:`PdkvConnector` is first reached).

May import every part of pdkv below the integrations (buffer, scheduling, swap, layout,
transfer); nothing in pdkv imports it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdkvConnector", "PdkvMeta"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        try:
            from . import connector
        except ImportError as exc:
            raise ImportError(f"pdkv's vLLM connector needs vLLM: pip install 'pdkv[vllm]' ({exc})") from exc
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
