"""Buffer <-> GPU block copies: the swap engine (``engine``), the handles its copies return
(``handles``), several ranks' engines as one backend (``group``), the NVRTC gather/scatter
kernel's source (``kernels``).

May import: ``pdkv.errors``, ``pdkv.layout``, ``pdkv.plan``, ``pdkv._ffi``.
"""

from .engine import CopyPlan, SwapEngine, plan_copy
from .group import SwapGroup
from .handles import CopyHandle

__all__ = ["CopyHandle", "CopyPlan", "SwapEngine", "SwapGroup", "plan_copy"]
