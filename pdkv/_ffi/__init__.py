"""The only package of pdkv that touches C: ``ctypes`` (libc), ``cuda.bindings``,
``pyverbs``, ``llvmlite`` (a run-time-compiled CPU copy loop), libcuda (one driver call by
address) and NVIDIA NIXL. One module per library;
errors are translated here, once.

``cuda``, ``verbs`` and ``cpu`` import their bindings lazily, so ``import pdkv`` works on a
host with neither CUDA, pyverbs nor llvmlite.

May import: ``pdkv.errors`` only.
"""

from . import cpu, cuda, libc, libcuda, verbs
from . import nixl_agent as nixl

__all__ = ["cpu", "cuda", "libc", "libcuda", "nixl", "verbs"]
