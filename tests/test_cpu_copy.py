"""The streaming (non-temporal) CPU copy loop of ``_ffi.cpu``; the shm sender's use of it
is tested in tests/test_transfer.py.

llvmlite is a dependency: where it is installed the loop must build and run (a JIT failure
fails these tests, it is not skipped); only a missing llvmlite skips them, and then the
numpy path is what the sender uses.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv import aligned_empty
from pdkv._ffi import cpu

HAVE_LLVMLITE = importlib.util.find_spec("llvmlite") is not None
needs_loop = pytest.mark.skipif(not HAVE_LLVMLITE, reason="llvmlite is not installed")


@needs_loop
def test_the_loop_builds_where_llvmlite_is_installed():
    assert cpu.available(), cpu.unavailable_reason()
    assert cpu.unavailable_reason() is None


_VARIANTS: dict[int, object] = {}


def _gather_with(ways: int):
    """The loop built for ``ways`` pieces side by side (pdkv uses cpu._WAYS)."""
    if ways not in _VARIANTS:
        import llvmlite.binding as llvm

        _VARIANTS[ways] = cpu._jit(llvm, cpu._build_ir(ways))
    fn = _VARIANTS[ways][1]
    return lambda s, d, n: fn(n.size, s.ctypes.data, d.ctypes.data, n.ctypes.data)


@needs_loop
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9000), st.integers(0, 70)), min_size=0, max_size=12),
    st.data(),
    st.sampled_from([None, 1, 3, 4, 8]),
)
def test_gather_copies_exactly_the_pieces(pieces, data, ways):
    """Any lengths (0, below a vector, unaligned heads and tails) at any offsets of either side,
    and any number of pieces against any grouping (pdkv's, and loops built 1, 3, 4, 8 wide)."""
    src = np.random.default_rng(len(pieces)).integers(0, 256, 200_000, dtype=np.uint8)
    dst = np.zeros(200_000, np.uint8)
    want = dst.copy()
    s_off, d_off, lens = [], [], []
    cursor = 0
    for n, gap in pieces:  # destinations disjoint and in any order; sources anywhere
        so = data.draw(st.integers(0, src.size - n))
        s_off.append(so)
        d_off.append(cursor + gap)
        lens.append(n)
        want[cursor + gap : cursor + gap + n] = src[so : so + n]
        cursor += gap + n
    order = data.draw(st.permutations(range(len(lens))))
    run = cpu.gather if ways is None else _gather_with(ways)
    run(
        np.array([src.ctypes.data + s_off[i] for i in order], np.int64),
        np.array([dst.ctypes.data + d_off[i] for i in order], np.int64),
        np.array([lens[i] for i in order], np.int64),
    )
    assert np.array_equal(dst, want)


@needs_loop
def test_contiguous_copy_and_bad_arguments():
    a = aligned_empty(1 << 20)
    a[:] = np.arange(a.size) % 251
    b = np.zeros(a.size, np.uint8)
    cpu.copy(b.ctypes.data + 1, a.ctypes.data + 3, a.size - 3)
    assert b[0] == 0 and np.array_equal(b[1:-2], a[3:]) and not b[-2:].any()
    z = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="sources"):
        cpu.gather(z, z, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="64-bit"):
        cpu.gather(z.astype(np.int32), z.astype(np.int32), z.astype(np.int32))
    with pytest.raises(ValueError, match="contiguous"):
        cpu.gather(np.zeros(4, np.int64)[::2], z, z)


def test_environment_turns_the_loop_off_and_says_so():
    code = "from pdkv._ffi import cpu; print(cpu.available(), '|', cpu.unavailable_reason())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PDKV_CPU_COPY="numpy"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == "False | turned off by PDKV_CPU_COPY=numpy"
    with mock.patch.dict(cpu._state, {"reason": "test"}, clear=True):
        with pytest.raises(RuntimeError, match="streaming copy unavailable: test"):
            cpu.gather(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))
