"""pdkv's command-line tools; the library never imports this package.

``pdkv-shm`` (:mod:`.shm`) and ``pdkv-transfer-test`` (:mod:`.transfer_tool`).
"""
