"""The decode instance's pinned shared-memory buffer: segments striped over several files
and mapped as one range (``shared``), their names and origin records (``segments``), and
the sweeper that finds and removes the buffers of provably dead creators (``sweeper``), and
a watcher process that runs it for one process's buffers once that process is gone
(``reaper``); ``region``: an engine's own host memory received into in place of pdkv's
buffer (:class:`HostRegion`).

May import: ``pdkv.errors``, ``pdkv.procs``, ``pdkv._ffi``, ``pdkv.layout``.
"""

from .region import HostRegion
from .shared import SharedBuffer

__all__ = ["HostRegion", "SharedBuffer"]
