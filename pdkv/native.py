"""The C-side primitives under pdkv, exported for benchmarks that measure bare ceilings.

``cuda`` (driver and runtime calls through cuda-bindings: streams, events, copies, NVRTC),
``cpu`` (the streaming copy loop: ``copy``, ``gather``, ``available``), ``libc`` (memory
views, shm), ``verbs`` (pyverbs). These are the same modules pdkv itself calls; they take
raw addresses and check little, so engines should use the library's classes instead.
"""

from ._ffi import cpu, cuda, libc, verbs

__all__ = ["cpu", "cuda", "libc", "verbs"]
