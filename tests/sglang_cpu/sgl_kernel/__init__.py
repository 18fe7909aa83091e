"""A stand-in for SGLang's ``sgl_kernel`` on a CPU host without its Intel CPU build (not on
the package index; test-only, on the served tests' ``PYTHONPATH``).

SGLang 0.5.23 imports a few of its CPU ops unconditionally on the CPU path
(``kernels/ops/kvcache/cache_move.py``, ``srt/mem_cache/allocation.py``, the speculative
decoding modules on the scheduler's import chain); without AMX the paths the tests run fall
back to plain torch and call none of them. So every name imports, and calling one raises,
naming it: a test that reaches an op this host lacks fails loudly, never silently.
"""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*_args, **_kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not on this CPU host")

    missing.__name__ = name
    return missing
