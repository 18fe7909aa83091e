"""The only package of pdkv that touches C: ``ctypes`` (libc), ``cuda.bindings`` and
``pyverbs``. One module per library; errors are translated here, once.

``cuda`` and ``verbs`` import their bindings lazily, so ``import pdkv`` works on a host
with neither CUDA nor pyverbs.
"""

from . import cuda, libc, verbs

__all__ = ["cuda", "libc", "verbs"]
