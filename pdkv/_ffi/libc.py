"""libc through ctypes: what the standard library lacks for shared memory.

``shm_open``/``shm_unlink`` are called directly so that nothing is registered with
``multiprocessing.resource_tracker`` (CPython gh-82300: an attaching process's tracker
unlinks the segment when that process exits). ``madvise`` is called through ctypes, not
``mmap.madvise``, because a ctypes call releases the GIL: several threads can populate
disjoint ranges of one mapping at the same time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from ctypes import c_char_p, c_int, c_size_t, c_uint, c_void_p
from typing import Any

__all__ = [
    "MADV_HUGEPAGE",
    "MADV_POPULATE_WRITE",
    "buffer_address",
    "host_view",
    "memmove",
    "madvise",
    "memset",
    "mmap_fixed",
    "shm_open",
    "shm_unlink",
]

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+; EINVAL on older kernels


def _minus_one_errno(res: int, func: object, args: tuple[Any, ...]) -> int:
    if res == -1:
        err = ctypes.get_errno()
        first = args[0]
        what = first.decode() if isinstance(first, bytes) else hex(first or 0)
        raise OSError(err, os.strerror(err), what)
    return res


def _map_failed(res: int | None, func: object, args: tuple[Any, ...]) -> int:
    if res is None or res == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), f"mmap at {hex(args[0] or 0)}")
    return res


_MAP_FAILED = (1 << (8 * ctypes.sizeof(c_void_p))) - 1
MAP_FIXED = 0x10

# name: (argtypes, restype, errcheck). An explicit None checker means "reviewed, none".
_PROTOS = {
    "shm_open": ((c_char_p, c_int, c_uint), c_int, _minus_one_errno),
    "shm_unlink": ((c_char_p,), c_int, _minus_one_errno),
    "madvise": ((c_void_p, c_size_t, c_int), c_int, _minus_one_errno),
    "mmap": ((c_void_p, c_size_t, c_int, c_int, c_int, ctypes.c_long), c_void_p, _map_failed),
}


def _load() -> dict[str, object]:
    names = [None, ctypes.util.find_library("c"), ctypes.util.find_library("rt")]
    funcs: dict[str, object] = {}
    for name, (argtypes, restype, errcheck) in _PROTOS.items():
        for libname in names:
            try:
                lib = ctypes.CDLL(libname, use_errno=True)
                fn = getattr(lib, name)
            except (OSError, AttributeError):
                continue
            fn.argtypes = argtypes
            fn.restype = restype
            if errcheck is not None:
                fn.errcheck = errcheck
            funcs[name] = fn
            break
        else:  # pragma: no cover - every Linux libc has these
            raise ImportError(f"libc function {name} not found")
    return funcs


_F = _load()


def shm_open(name: str, flags: int, mode: int) -> int:
    """Open a POSIX shared-memory object; ``name`` starts with ``/``. Raises ``OSError``."""
    return int(_F["shm_open"](os.fsencode(name), flags, mode))  # type: ignore[operator]


def shm_unlink(name: str) -> None:
    """Remove a POSIX shared-memory name. Raises ``FileNotFoundError`` if absent."""
    _F["shm_unlink"](os.fsencode(name))  # type: ignore[operator]


def madvise(addr: int, length: int, advice: int) -> None:
    """``madvise(2)`` without the GIL. Raises ``OSError``."""
    _F["madvise"](addr, length, advice)  # type: ignore[operator]


def mmap_fixed(addr: int, length: int, fd: int, offset: int = 0) -> None:
    """Map ``length`` bytes of ``fd`` shared and writable exactly at ``addr``, replacing
    what was mapped there (``MAP_FIXED``): the caller owns ``[addr, addr+length)``,
    typically a reservation it made with :class:`mmap.mmap`, whose ``close()`` then
    unmaps this too. Raises ``OSError``."""
    got = _F["mmap"](
        addr,
        length,
        mmap.PROT_READ | mmap.PROT_WRITE,  # type: ignore[operator]
        mmap.MAP_SHARED | MAP_FIXED,
        fd,
        offset,
    )
    if got != addr:  # pragma: no cover - MAP_FIXED either maps at addr or fails
        raise OSError(0, f"mmap placed the mapping at {hex(got)}, not {hex(addr)}")


def memset(addr: int, value: int, length: int) -> None:
    """``memset`` without the GIL (ctypes releases it for foreign calls)."""
    ctypes.memset(addr, value, length)


def buffer_address(buf: mmap.mmap | memoryview) -> int:
    """Address of the first byte of a writable mapping (or a writable view of memory).

    The temporary ctypes object is dropped before returning, so the mapping holds no
    export afterwards and can still be closed.
    """
    obj = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(obj)
    finally:
        del obj


def memmove(dst: int, src: int, length: int) -> None:
    """``memmove`` without the GIL."""
    ctypes.memmove(dst, src, length)


def host_view(addr: int, length: int) -> memoryview:
    """A writable memoryview of ``length`` bytes at ``addr``. The caller keeps the
    memory alive for as long as the view (and anything made from it) lives."""
    t = _ARRAY_TYPES.get(length)
    if t is None:
        if len(_ARRAY_TYPES) > 4096:
            _ARRAY_TYPES.clear()
        t = _ARRAY_TYPES[length] = ctypes.c_ubyte * length
    return memoryview(t.from_address(addr)).cast("B")


_ARRAY_TYPES: dict[int, type[ctypes.Array[ctypes.c_ubyte]]] = {}  # building a ctypes array type costs microseconds
