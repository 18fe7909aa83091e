"""``python -m pdkv.integrations.sglang.launch_server <sglang.launch_server's arguments>``:
SGLang's own launcher with pdkv added as ``--disaggregation-transfer-backend pdkv``."""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    from .activate import install

    install()
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
