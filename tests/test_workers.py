"""Decode ranks in worker processes (pdkv.integrations.workers): each worker exports its rank's cache,
the scheduler process maps it and swaps into it; the workers read back every byte."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_transfer import BASE, HERE, expected_block, prefill_cache, reap, wait_until

from pdkv import BlockPool, CacheSpec, DecodeScheduler, KVLayout, SchedulerOptions, SharedBuffer, SwapEngine, SwapGroup
from pdkv.errors import LayoutError, ProtocolError
from pdkv.integrations.workers import export_cache, host_cache, map_cache, parse_export
from pdkv.transfer import DecodeReceiver, PrefillSender

NB = 64  # the workers' cache blocks (tests/peers.py worker)


def _lay(D, r, nhd=False):
    return KVLayout(**BASE, tp_size=D, tp_rank=r, token_major=nhd)


# ---------------------------------------------------------------------- export / map


def test_a_host_cache_export_maps_the_same_bytes(no_leaks):
    lay = _lay(2, 1)
    buf, spec = host_cache(lay, 8)
    try:
        data = export_cache(lay, spec, buf)
        with map_cache(data, lay) as m:
            assert m.rank == 1 and m.kind == "shm" and m.spec.num_blocks == 8
            for layer in range(lay.total_layers):
                for t in range(len(lay.tensors)):
                    a, b = spec.address(layer, t, 5), m.spec.address(layer, t, 5)
                    n = lay.tensor_block_bytes(t)
                    src = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(a))
                    src[:] = (layer * 7 + t) % 251
                    dst = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(b))
                    assert a != b and np.array_equal(src, dst)  # another mapping, the same memory
    finally:
        buf.close()
        buf.unlink()


def test_bad_exports_are_refused_before_anything_is_opened(no_leaks):
    import msgspec

    from pdkv.integrations.workers import CacheExport

    lay = _lay(2, 0)
    buf, spec = host_cache(lay, 8)
    try:
        good = parse_export(export_cache(lay, spec, buf))
        enc = msgspec.msgpack.encode

        def bad(**kw):
            return enc(msgspec.structs.replace(good, **kw))

        cases = [
            (b"\x00garbage", "not a pdkv cache export"),
            (b"x" * (5 << 20), "at most"),
            (bad(version=9), "version 9"),
            (bad(kind="nfs"), "kind 'nfs'"),
            (bad(rank=1), "rank 1 carries the layout of rank 0"),
            (bad(num_blocks=0), "num_blocks=0"),
            (bad(regions=good.regions[:-1]), "regions; the layout has"),
            (bad(regions=[(0, good.regions[0][1] + 1 << 30, good.regions[0][2])] + good.regions[1:]), "ends past"),
            (bad(regions=[(0, 0, 1)] + good.regions[1:]), "malformed"),
        ]
        for data, msg in cases:
            with pytest.raises(ProtocolError, match=msg):
                map_cache(data)
        with pytest.raises(ProtocolError, match="another layout"):
            map_cache(export_cache(lay, spec, buf), _lay(2, 0, nhd=True))
        assert isinstance(good, CacheExport)
        other = SharedBuffer.create(1 << 20)
        try:
            with pytest.raises(LayoutError, match="not inside the shared buffer"):
                export_cache(lay, spec, other)
        finally:
            other.close()
            other.unlink()
        with pytest.raises(LayoutError, match="must live in a SharedBuffer"):
            export_cache(lay, spec)
    finally:
        buf.close()
        buf.unlink()


# ---------------------------------------------------------------------- worker processes


def _workers(D, gpu=False, nhd=False):
    ps = []
    for r in range(D):
        args = ["worker", "--rank", str(r), "--tp", str(D)] + (["--gpu"] if gpu else []) + (["--nhd"] if nhd else [])
        ps.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "peers.py"), *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    exports = [bytes.fromhex(json.loads(p.stdout.readline())["export"]) for p in ps]
    return ps, exports


def _digests(p, items):
    p.stdin.write(json.dumps({"digest": items}) + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())["digest"]


def _stop(ps):
    for p in ps:
        try:
            if p.poll() is None:
                p.stdin.write("exit\n")
            p.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        reap(p)


def _run_decode_over_workers(P, D, gpu, nhd, gpu_blocks=NB, prefix=None, chunked=()):
    """Prefill TP P (this process) -> decode TP D whose rank caches are the workers':
    requests land in decode's CPU buffers, are swapped into the workers' caches by this
    process, and each worker hashes what it reads at the ready request's blocks.

    ``prefix``: request -> k, the engine holds k GPU blocks as the prompt's first k
    (decode's prefix cache): prefill sends every block of the prompt as usual, only the
    rest travels, the held blocks read the same before and after, the ready request lists
    them first, and their release comes once, at finish. ``chunked``: requests sent as two
    chunks a layer (``send_chunk``)."""
    prefix = prefix or {}
    ps, exports = _workers(D, gpu=gpu, nhd=nhd)
    lays = [_lay(D, r, nhd) for r in range(D)]
    maps, bufs, engines = [], [], []
    rx = None
    try:
        maps = [map_cache(e, lay) for e, lay in zip(exports, lays)]
        assert [m.kind for m in maps] == ["cuda" if gpu else "shm"] * D
        bufs = [SharedBuffer.create(CacheSpec.buffer_bytes(lay, NB), require_pinned=gpu) for lay in lays]
        engines = [
            SwapEngine(
                CacheSpec.for_buffer(lay, NB, b.address),
                m.spec,
                strategy="auto" if gpu else "host",
                buffer_pinned=b.pinned,
            )
            for lay, b, m in zip(lays, bufs, maps)
        ]
        gpu_pool = BlockPool(gpu_blocks)
        sched = DecodeScheduler(
            layout=lays[0],
            gpu=gpu_pool,
            buffer=BlockPool(NB),
            swap=SwapGroup(engines),
            options=SchedulerOptions(direct_to_gpu=False, lease_s=10),
        )
        released = []
        held = {rid: gpu_pool.allocate(k) for rid, k in prefix.items()}
        for rid, blocks in held.items():
            sched.hold_prefix(rid, blocks, release=lambda r, b: released.append((r, b)))

        def every_piece(blocks):
            return [
                [layer, t, b]
                for layer in range(lays[0].total_layers)
                for t in range(len(lays[0].tensors))
                for b in blocks
            ]

        before = {rid: [_digests(p, every_piece(b)) for p in ps] for rid, b in held.items()}
        rx = DecodeReceiver(sched, lays, bufs, NB, transports=("shm",), auto_tick=True)
        caches = [prefill_cache(P, r, token_major=nhd) for r in range(P)]
        txs = [PrefillSender(lay, spec, rx.control_address, transport="shm", timeout_s=10) for lay, _, spec in caches]
        src_blocks = {"a": [3, 4, 5], "b": [20, 9, 31, 2], "c": [60, 61]}
        try:
            for rid, sb in src_blocks.items():
                for tx in txs:
                    tx.reserve(rid, len(sb) * lays[0].tokens_per_block)
            for layer in range(lays[0].total_layers):
                for tx in txs:
                    tx.send_layer(layer, [(r, b) for r, b in src_blocks.items() if r not in chunked])
                    for r in chunked:  # the engine's chunks, numbered from the prompt's start
                        b = src_blocks[r]
                        tx.send_chunk(layer, r, b[:2], 0)
                        tx.send_chunk(layer, r, b[2:], 2)
            for tx in txs:
                tx.finish_many(list(src_blocks))
            ready = {}

            def collect():
                for r in sched.take_ready():
                    ready[r.request_id] = r.gpu_blocks
                    assert r.prefix_blocks == prefix.get(r.request_id, 0)
                return len(ready) == len(src_blocks)

            wait_until(collect, 20, "every request swapped into the workers' caches")
        finally:
            for tx in txs:
                tx.close()
        src_lays = [c[0] for c in caches]
        src_specs = [c[2] for c in caches]
        for rid, sb in src_blocks.items():
            k = prefix.get(rid, 0)
            assert list(ready[rid][:k]) == list(held.get(rid, []))  # decode's own, first
            if k:  # never written: the same bytes as before the transfer
                assert [_digests(p, every_piece(held[rid])) for p in ps] == before[rid]
            suffix, sent = ready[rid][k:], sb[k:]
            for dst, p in zip(lays, ps):
                items, want = [], []
                for layer in range(dst.total_layers):
                    for t in range(len(dst.tensors)):
                        for gi, b in enumerate(suffix):
                            items.append([layer, t, int(b)])
                            blk = expected_block(src_lays, src_specs, sent, dst, layer, t, gi)
                            want.append(hashlib.sha256(blk).hexdigest())
                assert _digests(p, items) == want, (rid, dst.tp_rank)
            assert not [r for r, _ in released if r == rid]  # held until finish
            sched.finish(rid)
        assert sorted(released) == sorted((rid, tuple(b)) for rid, b in held.items())  # once each
        for b in held.values():
            gpu_pool.free(b)
        assert gpu_pool.num_free == gpu_blocks
        return sched
    finally:
        if rx is not None:
            rx.close()
        for e in engines:
            e.close()
        for m in maps:
            m.close()
        for b in bufs:
            b.close()
            b.unlink()
        _stop(ps)


@pytest.mark.multiproc
@pytest.mark.parametrize("P,D,nhd", [(1, 2, False), (2, 2, False), (4, 2, True)])
def test_decode_ranks_in_worker_processes_get_every_byte(P, D, nhd, no_leaks):
    _run_decode_over_workers(P, D, gpu=False, nhd=nhd)


@pytest.mark.multiproc
@pytest.mark.parametrize("P,D", [(2, 1), (1, 2)])
def test_a_held_prefix_is_not_sent_never_written_and_released_once(P, D, no_leaks):
    """Decode-side prefix reuse: "b" has its first 2 blocks in decode's prefix cache, "c"
    (sent in chunks) its first 1; the rest of each prompt travels as usual."""
    _run_decode_over_workers(P, D, gpu=False, nhd=False, prefix={"b": 2, "c": 1}, chunked={"c"})


@pytest.mark.multiproc
def test_a_worker_that_dies_leaves_its_segment_mapped_until_the_scheduler_unmaps(no_leaks):
    """A worker killed while the scheduler maps its cache: the mapping stays valid here
    (the segment is not cleaned while mapped), and once unmapped the clean removes it."""
    from test_transfer import TAG, clean_killed_segment

    from pdkv.buffer.sweeper import clean_segments

    ps, exports = _workers(1)
    try:
        m = map_cache(exports[0], _lay(1, 0))
        name = parse_export(exports[0]).shm_name
        ps[0].kill()
        ps[0].wait(10)
        try:
            a = m.spec.address(0, 0, 3)
            mem = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 16).from_address(a))
            mem[:] = 7  # still mapped memory
            assert name not in clean_segments(dry_run=False, tag=TAG)
        finally:
            m.close()
        clean_killed_segment(name)
    finally:
        _stop(ps)


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.parametrize("P,D", [(1, 2), (2, 2)])
def test_decode_ranks_in_worker_processes_gpu_caches(cuda_device, P, D, no_leaks):
    """Workers own GPU caches (one H200 holds both ranks' here); this process maps them by
    CUDA IPC and swaps into them with the swap engine's kernel; "b" reuses a held prefix."""
    _run_decode_over_workers(P, D, gpu=True, nhd=False, prefix={"b": 2})
