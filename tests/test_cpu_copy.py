"""The streaming (non-temporal) CPU copy loop of ``_ffi.cpu`` and the shm sender's use of it.

llvmlite is a dependency: where it is installed the loop must build and run (a JIT failure
fails these tests, it is not skipped); only a missing llvmlite skips the loop's own tests,
and then the numpy path is what the sender uses.
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

import pdkv.transfer as tr
from pdkv import CacheSpec, KVLayout, PrefillSender, TransferError, aligned_empty, tp_segments
from pdkv._ffi import cpu

HAVE_LLVMLITE = importlib.util.find_spec("llvmlite") is not None
needs_loop = pytest.mark.skipif(not HAVE_LLVMLITE, reason="llvmlite is not installed")


@needs_loop
def test_the_loop_builds_where_llvmlite_is_installed():
    assert cpu.available(), cpu.unavailable_reason()
    assert cpu.unavailable_reason() is None


@needs_loop
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9000), st.integers(0, 70)), min_size=0, max_size=12), st.data())
def test_gather_copies_exactly_the_pieces(pieces, data):
    """Any lengths (0, below a vector, unaligned heads and tails) at any offsets of either side."""
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
        want[cursor + gap:cursor + gap + n] = src[so:so + n]
        cursor += gap + n
    order = data.draw(st.permutations(range(len(lens))))
    cpu.gather(np.array([src.ctypes.data + s_off[i] for i in order], np.int64),
               np.array([dst.ctypes.data + d_off[i] for i in order], np.int64),
               np.array([lens[i] for i in order], np.int64))
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
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PDKV_CPU_COPY="numpy"),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "False | turned off by PDKV_CPU_COPY=numpy"
    with mock.patch.dict(cpu._state, {"reason": "test"}, clear=True):
        with pytest.raises(RuntimeError, match="streaming copy unavailable: test"):
            cpu.gather(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))


BASE = dict(num_layers=4, kv_heads=4, head_dim=8, tokens_per_block=8, dtype="bf16")


def _planner(src_lay, dst_lays, src_spec, dsts, nb, threads):
    tx = PrefillSender.__new__(PrefillSender)  # only the planning and copying state
    tx.layout, tx._dst_layout, tx.cache = src_lay, dst_lays[0], src_spec
    tx.segments = [g for g in tp_segments(src_lay, dst_lays[0]) if g.src_rank == src_lay.tp_rank]
    tx._dst_specs = {lay.tp_rank: CacheSpec.for_buffer(lay, nb, d.ctypes.data) for lay, d in zip(dst_lays, dsts)}
    tx._views, tx.copy_threads, tx._copy_pool = {}, threads, None
    return tx


@needs_loop
@settings(max_examples=60, deadline=None)
@given(P=st.sampled_from([1, 2, 4]), D=st.sampled_from([1, 2, 4]), nhd=st.booleans(),
       threads=st.integers(1, 3), data=st.data())
def test_streaming_and_numpy_copies_write_the_same_bytes(P, D, nhd, threads, data):
    """Whole blocks, head slices, token-major pieces, runs across requests: the sender's
    streaming path (split over threads in small shares) writes what its numpy path writes."""
    nb = 24
    src_lay = KVLayout(**BASE, tp_size=P, tp_rank=data.draw(st.integers(0, P - 1)), token_major=nhd)
    dst_lays = [KVLayout(**BASE, tp_size=D, tp_rank=r, token_major=nhd) for r in range(D)]
    src = np.random.default_rng(P * 10 + D).integers(0, 256, src_lay.block_bytes * nb, dtype=np.uint8)
    src_spec = CacheSpec.for_buffer(src_lay, nb, src.ctypes.data)
    dst_ids = data.draw(st.permutations(range(nb)))
    cuts = sorted(data.draw(st.lists(st.integers(1, nb - 1), max_size=5, unique=True)))
    groups = [dst_ids[a:b] for a, b in zip([0] + cuts, cuts + [nb])]
    work = [(f"r{i}", None, [data.draw(st.integers(0, nb - 1)) for _ in g], list(g), 0) for i, g in enumerate(groups)]
    out = {}
    for path in ("_stream_pieces", "_numpy_pieces"):
        dsts = [np.zeros(lay.block_bytes * nb, np.uint8) for lay in dst_lays]
        tx = _planner(src_lay, dst_lays, src_spec, dsts, nb, threads)
        with mock.patch.object(tr, "_GATHER_PIECE", 96):  # many small shares for the threads
            for layer in range(4):
                plans, _ = tx._pieces(layer, work)
                getattr(tx, path)(layer, plans)
        if tx._copy_pool is not None:
            tx._copy_pool.shutdown()
        out[path] = dsts
    for a, b in zip(out["_stream_pieces"], out["_numpy_pieces"]):
        assert np.array_equal(a, b)
    assert any(d.any() for d in out["_stream_pieces"])


@needs_loop
def test_a_piece_outside_its_region_is_refused_before_anything_is_written():
    nb = 8
    lay = KVLayout(**BASE)
    src = np.ones(lay.block_bytes * nb, np.uint8)
    dst = np.zeros(lay.block_bytes * nb, np.uint8)
    tx = _planner(lay, [lay], CacheSpec.for_buffer(lay, nb, src.ctypes.data), [dst], nb, 1)
    plans, _ = tx._pieces(0, [("r", None, [0, 1], [6, 7], 0)])
    seg, s, d, n = plans[0]
    bad = [(seg, s, d + np.uint64(lay.tensor_block_bytes(seg.tensor)), n)]  # one block past the region
    with pytest.raises(TransferError, match="outside its source or destination region"):
        tx._stream_pieces(0, plans[1:] + bad)
    assert not dst.any()
    tx._stream_pieces(0, plans)  # the real plan copies
    assert dst.any()
