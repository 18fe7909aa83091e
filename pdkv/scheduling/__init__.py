"""Decode-side block accounting and the request lifecycle: block pools (``blocks``), the
states, options and records of a request (``lifecycle``), the scheduler's state and its
low-level transitions (``core``), what each tick does (``loop``), its metrics and invariant
checks (``view``), and the public :class:`DecodeScheduler` (``scheduler``).

May import: ``pdkv.errors``, ``pdkv.layout``. It moves no bytes: swaps go through the
``SwapBackend`` it is given.
"""

from .blocks import BlockAllocator, BlockPool
from .scheduler import DecodeScheduler

__all__ = ["BlockAllocator", "BlockPool", "DecodeScheduler"]
