"""``python -m pdkv.cli.transfer_tool``: the ``pdkv-transfer-test`` command."""

import sys

from .app import main

sys.exit(main())
