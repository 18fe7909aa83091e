"""``pdkv-transfer-test`` (``python -m pdkv.cli.transfer_tool``): validate and size a prefill/decode pair.

With no arguments it runs ``local`` mode: a decode instance in this process (CPU buffer,
swap into GPU blocks, or host memory standing in for them without a GPU) and prefill
ranks in child processes, a stream of requests sent layer by layer through the buffer,
every byte verified in the decode's (GPU) blocks, and a summary.

``decode --listen ADDR`` and ``prefill --connect ADDR`` run the two sides on two hosts.

``--prefill-gpu`` keeps each prefill rank's cache in GPU memory (shm then writes the
buffer with the swap engine's kernel); ``--transport cuda_ipc`` (same host, a GPU) has
prefill write decode's GPU blocks directly, and the buffer only when they are full. Under
the default ``auto``, decode with GPU blocks serves cuda_ipc too, so ``--prefill-gpu``
alone gets what an engine's GPU-cache sender gets: cuda_ipc where the GPUs reach each
other, else shm. Prefill ranks with host caches (the default) take shm or tcp.

Modules by mode: ``app`` (flags, checks, main), ``local_mode``, ``decode_mode``,
``prefill_mode``, ``plan_mode`` over ``capacity`` (the simulation), ``sweep``; ``workload``
and ``report`` serve them all. May import: pdkv's public API.
"""

from .app import main
from .workload import PRESETS

__all__ = ["main", "PRESETS"]
