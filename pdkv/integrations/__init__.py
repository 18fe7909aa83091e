"""Engine glue: engine tensors described as pdkv caches (``interop``: torch, paddle, cupy
by DLPack), a model's per-layer K/V written into and read from paged caches
(``modelcache``), decode ranks whose caches live in engine worker processes (``workers``).

May import every part below it (buffer, scheduling, swap, layout, transfer's
``ipc_export``); no core module imports it. An engine itself is imported only inside the
module that adapts it, when it is used.
"""
