"""The engine-neutral core the engine adapters share (no engine's objects, plain ids):
``pull`` (decode asks prefill for a request's KV: one authenticated message each way),
``tally`` (transfer counters and timings an engine's metrics read), ``pages`` (pages an
engine chose itself, handed to pdkv's scheduler request by request), ``endpoint`` (the
authenticated-message ROUTER endpoint that ``pull`` and the SGLang adapter's aux data serve
from).

May import every part below ``pdkv.integrations`` (transfer, buffer, scheduling, layout,
errors); never an engine, never an adapter (``vllm``, ``sglang``).
"""
