"""pdkv's command-line tools; the library never imports this package.

``pdkv-shm`` (:mod:`.shm_tool`) and ``pdkv-transfer-test`` (:mod:`.transfer_tool`).

May import: pdkv's public API (``pdkv``, its packages' public names).
"""
