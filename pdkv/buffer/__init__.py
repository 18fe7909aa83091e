"""The decode instance's pinned shared-memory buffer: segments striped over several files
and mapped as one range (``shared``), their names and origin records (``segments``), and
the sweeper that finds and removes the buffers of provably dead creators (``sweeper``).

May import: ``pdkv.errors``, ``pdkv.procs``, ``pdkv._ffi``.
"""

from .shared import SharedBuffer

__all__ = ["SharedBuffer"]
