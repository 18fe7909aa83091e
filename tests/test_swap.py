from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv import CacheSpec, KVLayout, SharedBuffer, _ffi
from pdkv.errors import SwapError
from pdkv.swap.engine import SwapEngine, _batch_spans, plan_copy


def lay(**kw):
    base = dict(num_layers=3, kv_heads=2, head_dim=16, tokens_per_block=4, dtype="bf16")
    base.update(kw)
    return KVLayout(**base)


class HostCache:
    """A numpy-backed cache (stands in for GPU memory on a CPU host)."""

    def __init__(self, layout, nblocks, kind="buffer"):
        self.arr = np.zeros(layout.block_bytes * nblocks + 64, np.uint8)
        base = self.arr.ctypes.data
        if kind == "buffer":
            self.spec = CacheSpec.for_buffer(layout, nblocks, base)
        else:  # flashinfer-like interleaving: K and V of one block side by side
            bb = layout.tensor_block_bytes(0)
            per_layer = 2 * bb * nblocks
            self.spec = CacheSpec.flashinfer(
                layout, nblocks, [base + i * per_layer for i in range(layout.total_layers)]
            )

    def block(self, layer, t, b):
        a = self.spec.address(layer, t, b) - self.arr.ctypes.data
        return self.arr[a : a + self.spec.layout.tensor_block_bytes(t)]


def test_plan_coalesces_contiguous_runs():
    L = lay()
    a, b = HostCache(L, 16), HostCache(L, 16)
    p = plan_copy(a.spec, b.spec, [0, 1, 2, 7, 9, 10], [4, 5, 6, 8, 11, 12])
    # per layer and tensor: runs (0-2 -> 4-6), (7 -> 8), (9-10 -> 11-12)
    assert p.pieces == 3 * 2 * 3
    assert p.layer_ends.tolist() == [6, 12, 18]
    assert p.nbytes == 6 * L.block_bytes
    tb = L.tensor_block_bytes(0)
    assert p.lengths[:3].tolist() == [3 * tb, tb, 2 * tb]
    c = p.chunked(tb // 2)
    assert c.nbytes == p.nbytes and int(c.lengths.sum()) == p.nbytes and c.lengths.max() <= tb // 2
    assert c.layer_ends[-1] == c.pieces


@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 300), st.integers(0, 3))
def test_batch_spans_cover_the_range_in_growing_pieces(a, n, first, doublings):
    cap = first << doublings
    spans = _batch_spans(a, a + n, first, cap)
    # consecutive, in order, exactly [a, a + n)
    assert [x for x, _ in spans[1:]] == [y for _, y in spans[:-1]]
    assert (spans[0][0], spans[-1][1]) == (a, a + n) if n else spans == []
    sizes = [y - x for x, y in spans]
    assert all(0 < k <= cap for k in sizes)
    # every piece but the last is exactly first, 2*first, ... capped
    for i, k in enumerate(sizes[:-1]):
        assert k == min(cap, first << i)


def test_batch_spans_refuse_bad_sizes():
    with pytest.raises(ValueError, match="first <= cap"):
        _batch_spans(0, 10, 0, 4)
    with pytest.raises(ValueError, match="first <= cap"):
        _batch_spans(0, 10, 8, 4)


def test_plan_validation():
    L = lay()
    a, b = HostCache(L, 8), HostCache(L, 8)
    with pytest.raises(SwapError, match="3 source blocks but 2"):
        plan_copy(a.spec, b.spec, [0, 1, 2], [0, 1])
    with pytest.raises(SwapError, match=r"destination block ids \[8\]"):
        plan_copy(a.spec, b.spec, [0], [8])
    with pytest.raises(SwapError, match=r"source block ids \[-1\]"):
        plan_copy(a.spec, b.spec, [-1], [0])
    with pytest.raises(SwapError, match="duplicate destination"):
        plan_copy(a.spec, b.spec, [0, 1], [3, 3])
    with pytest.raises(SwapError, match="different layouts"):
        plan_copy(a.spec, HostCache(lay(head_dim=32), 8).spec, [0], [0])


@given(st.data())
def test_host_engine_copies_every_pair_both_ways(data):
    L = lay(scales=data.draw(st.booleans()), dtype="fp8") if data.draw(st.booleans()) else lay()
    n = 12
    buf, gpu = HostCache(L, n), HostCache(L, n, kind="fi" if not L.scales else "buffer")
    buf.arr[:] = np.random.default_rng(0).integers(0, 256, buf.arr.size, dtype=np.uint8)
    gpu.arr[:] = 0xEE  # poisoned
    k = data.draw(st.integers(1, n))
    src = data.draw(st.permutations(range(n)))[:k]
    dst = data.draw(st.permutations(range(n)))[:k]
    with SwapEngine(buf.spec, gpu.spec, strategy="host", buffer_pinned=False) as eng:
        h = eng.copy(src, dst, layerwise=True)
        h.wait(10)
        assert h.error is None and h.done() and all(h.layer_done(i) for i in range(L.total_layers))
        for layer in range(L.total_layers):
            for t in range(len(L.tensors)):
                for s_, d_ in zip(src, dst):
                    np.testing.assert_array_equal(gpu.block(layer, t, d_), buf.block(layer, t, s_))
        # untouched blocks stay poisoned
        untouched = set(range(n)) - set(dst)
        for d_ in untouched:
            assert (gpu.block(0, 0, d_) == 0xEE).all()
        # and back
        buf.arr[:] = 0
        eng.copy(dst, src, direction="d2h").wait(10)
        for s_, d_ in zip(src, dst):
            np.testing.assert_array_equal(buf.block(1, 0, s_), gpu.block(1, 0, d_))


def test_engine_refusals(monkeypatch):
    L = lay()
    a, b = HostCache(L, 4), HostCache(L, 4)
    with pytest.raises(ValueError, match="strategy"):
        SwapEngine(a.spec, b.spec, strategy="magic")
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=f"max_ctas={bad!r} must be a positive integer"):
            SwapEngine(a.spec, b.spec, max_ctas=bad)
    monkeypatch.setattr(_ffi.cuda, "device_count", lambda: 0)
    with pytest.raises(Exception, match="needs a CUDA device"):
        SwapEngine(a.spec, b.spec, strategy="kernel")
    eng = SwapEngine(a.spec, b.spec)  # auto: host without CUDA
    assert eng.strategy == "host"
    eng.close()
    from pdkv.errors import ClosedError

    with pytest.raises(ClosedError):
        eng.copy([0], [0])


def test_copy_plan_refuses_an_unknown_direction():
    L = lay()
    a, b = HostCache(L, 4), HostCache(L, 4)
    with SwapEngine(a.spec, b.spec, strategy="host", buffer_pinned=False) as eng:
        plan = plan_copy(a.spec, b.spec, [0], [1])
        with pytest.raises(ValueError, match="direction='sideways' must be h2d, d2h, d2d or None"):
            eng.copy_plan(plan, direction="sideways")
        eng.copy_plan(plan, direction="d2d").wait(5)
        np.testing.assert_array_equal(b.block(1, 1, 1), a.block(1, 1, 0))


def test_engine_is_a_swap_backend_for_the_scheduler():
    from pdkv import BlockPool, DecodeScheduler, SchedulerOptions, State

    L = lay()
    buf, gpu = HostCache(L, 8), HostCache(L, 8)
    buf.arr[:] = 7
    with SwapEngine(buf.spec, gpu.spec, strategy="host", buffer_pinned=False) as eng:
        s = DecodeScheduler(
            num_layers=L.total_layers,
            gpu=BlockPool(8),
            buffer=BlockPool(8),
            swap=eng,
            options=SchedulerOptions(direct_to_gpu=False),
        )
        g = s.reserve("a", num_blocks=3).grant
        s.land_layers("a", g.token, range(L.total_layers))
        s.complete("a", g.token)
        import time

        deadline = time.monotonic() + 10
        while not s.take_ready():
            assert time.monotonic() < deadline, "swap never completed"
            time.sleep(0.001)
            s.tick()
        assert s.request("a").state is State.READY
        assert (gpu.block(2, 1, 2) == 7).all()


# ------------------------------------------------------------------ CUDA


@pytest.fixture(params=["kernel", "batch", "memcpy"])
def strategy(request, cuda_device):
    if request.param == "batch" and not _ffi.cuda.batch_copy_supported():
        pytest.skip("cudaMemcpyBatchAsync not in these bindings")
    return request.param


def _gpu_has_every_pair(L, bspec, ref, gspec, size, src, dst):
    """The GPU cache copied back: every (src, dst) pair of every layer and tensor holds the
    buffer's bytes (``ref``: the buffer before the copy). Returns the copy."""
    bbase, gbase = bspec.region(0, 0)[0], gspec.region(0, 0)[0]
    back = np.empty(size, np.uint8)
    _ffi.cuda.memcpy(back.ctypes.data, gbase, size)
    tb = L.tensor_block_bytes(0)
    for layer in range(L.total_layers):
        for t in range(2):
            for s_, d_ in zip(src, dst):
                so, do = bspec.address(layer, t, s_) - bbase, gspec.address(layer, t, d_) - gbase
                assert (back[do : do + tb] == ref[so : so + tb]).all(), (layer, t, s_, d_)
    return back


@pytest.mark.cuda
@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("n,k,tokens", [(64, 40, 16), (2048, 1500, 2)])  # 1500: launched in two parts
def test_cuda_swap_every_strategy_both_directions(strategy, layerwise, n, k, tokens, no_leaks):
    L = lay(num_layers=4, kv_heads=8, head_dim=128, tokens_per_block=tokens)
    size = L.block_bytes * n
    with SharedBuffer.create(size, require_pinned=True) as sb:
        bspec = CacheSpec.for_buffer(L, n, sb.address)
        dptr = _ffi.cuda.malloc(size)
        try:
            gspec = CacheSpec.for_buffer(L, n, dptr)
            rng = np.random.default_rng(3)
            host = np.frombuffer(sb.buf, np.uint8)
            host[:] = rng.integers(0, 256, size, dtype=np.uint8)
            ref = host.copy()
            _ffi.cuda.memset(dptr, 0xEE, size)
            src = rng.permutation(n)[:k].tolist()
            dst = rng.permutation(n)[:k].tolist()
            with SwapEngine(bspec, gspec, strategy=strategy) as eng:
                h = eng.copy(src, dst, layerwise=layerwise)
                if layerwise:
                    h.wait_layer(0, 30)
                h.wait(30)
                assert h.error is None
                back = _gpu_has_every_pair(L, bspec, ref, gspec, size, src, dst)
                tb = L.tensor_block_bytes(0)
                untouched = sorted(set(range(n)) - set(dst))
                for d_ in untouched:
                    do = gspec.address(0, 0, d_) - dptr
                    assert (back[do : do + tb] == 0xEE).all()
                # d2h into a poisoned buffer
                host[:] = 0x55
                eng.copy(dst, src, direction="d2h").wait(30)
                for s_, d_ in zip(src, dst):
                    so = bspec.address(2, 1, s_) - sb.address
                    do = gspec.address(2, 1, d_) - dptr
                    assert (host[so : so + tb] == back[do : do + tb]).all()
            del host
        finally:
            _ffi.cuda.free(dptr)


@pytest.mark.cuda
def test_cuda_swap_on_a_second_gpu_called_from_threads_on_the_first(strategy, no_leaks):
    """A cache on device 1, the engine made and called from threads whose current device is
    0 (a new thread's default): the copies land, and no caller's device is changed."""
    import threading

    if _ffi.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    L = lay(num_layers=2, kv_heads=8, head_dim=128, tokens_per_block=16)
    n = 128
    size = L.block_bytes * n
    with SharedBuffer.create(size, require_pinned=True) as sb:
        bspec = CacheSpec.for_buffer(L, n, sb.address)
        _ffi.cuda.set_device(1)
        dptr = _ffi.cuda.malloc(size)
        _ffi.cuda.memset(dptr, 0xEE, size)
        _ffi.cuda.set_device(0)
        try:
            gspec = CacheSpec.for_buffer(L, n, dptr, device=1)
            host = np.frombuffer(sb.buf, np.uint8)
            host[:] = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8)
            ref = host.copy()
            rng = np.random.default_rng(5)
            src, dst = rng.permutation(n)[:100].tolist(), rng.permutation(n)[:100].tolist()
            seen: list[int] = []
            with SwapEngine(bspec, gspec, strategy=strategy) as eng:
                assert eng.device == 1 and _ffi.cuda.current_device() == 0

                def other_thread():
                    seen.append(_ffi.cuda.current_device())
                    eng.copy(src, dst).wait(30)
                    seen.append(_ffi.cuda.current_device())

                t = threading.Thread(target=other_thread)
                t.start()
                t.join(60)
                assert seen == [0, 0]
                back = _gpu_has_every_pair(L, bspec, ref, gspec, size, src, dst)
                tb = L.tensor_block_bytes(0)
                host[:] = 0x55
                eng.copy(dst, src, direction="d2h").wait(30)
                for s_, d_ in zip(src, dst):
                    so, do = bspec.address(1, 1, s_) - sb.address, gspec.address(1, 1, d_) - dptr
                    assert (host[so : so + tb] == back[do : do + tb]).all()
                assert _ffi.cuda.current_device() == 0
            del host
        finally:
            _ffi.cuda.free(dptr)
            _ffi.cuda.set_device(0)


class FakeStreamCuda:
    """Just enough of ``_ffi.cuda`` for the batch and memcpy strategies on host memory:
    copies are queued, and run when an event recorded after them is queried (the "GPU"
    makes progress only when someone looks), so a test sees what was left in flight."""

    def __init__(self, fail_on_call: int | None = None):
        self.queue: list[tuple[int, int, int]] = []
        self.events: dict[int, int] = {}
        self.fail_on_call = fail_on_call
        self.submits = 0
        self.current = 0  # the calling thread's current device (one thread in these tests)
        self.devices: set[int] = set()  # current device at each stream/event call and submission

    def install(self, monkeypatch):
        for name in (
            "device_count",
            "set_device",
            "current_device",
            "batch_copy_supported",
            "stream_create",
            "stream_destroy",
            "stream_synchronize",
            "event_create",
            "event_record",
            "event_query",
            "event_destroy",
            "memcpy_batch_async",
            "memcpy_async",
        ):
            monkeypatch.setattr(_ffi.cuda, name, getattr(self, name))
        monkeypatch.setattr(_ffi.libcuda, "memcpy_batch_arrays", self.memcpy_batch_arrays)

    def device_count(self):
        return 2

    def set_device(self, d):
        self.current = d

    def current_device(self):
        return self.current

    def batch_copy_supported(self):
        return True

    def stream_create(self, nonblocking=True):
        self.devices.add(self.current)
        return 7

    def stream_destroy(self, s):
        pass

    def stream_synchronize(self, s):
        self._run(len(self.queue))

    def event_create(self, timing=False):
        self.devices.add(self.current)
        e = 100 + len(self.events)
        self.events[e] = -1
        return e

    def event_record(self, e, s):
        self.events[e] = self.done + len(self.queue)

    @property
    def done(self):
        return getattr(self, "_done", 0)

    def _run(self, n):
        import ctypes

        for dst, src, ln in self.queue[:n]:
            ctypes.memmove(dst, src, ln)
        del self.queue[:n]
        self._done = self.done + n

    def event_query(self, e):
        self._run(max(0, self.events[e] - self.done))
        return True

    def event_destroy(self, e):
        self.events.pop(e, None)

    def _submit(self):
        self.devices.add(self.current)
        self.submits += 1
        if self.fail_on_call == self.submits:
            raise RuntimeError(f"injected failure on submission {self.submits}")

    def memcpy_batch_async(self, dsts, srcs, sizes, stream):
        self._submit()
        self.queue.extend(zip(dsts, srcs, sizes))

    def memcpy_batch_arrays(self, dsts, srcs, sizes, stream):
        assert all(a.dtype == np.uint64 and a.flags.c_contiguous for a in (dsts, srcs, sizes))
        self.memcpy_batch_async(dsts.tolist(), srcs.tolist(), sizes.tolist(), stream)

    def memcpy_async(self, dst, src, n, stream):
        self._submit()
        self.queue.append((dst, src, n))


def test_a_host_copy_wait_sleeps_on_its_future_and_is_bounded():
    from concurrent.futures import Future

    from pdkv.errors import PdkvTimeoutError
    from pdkv.swap.handles import _FutureHandle

    fut: Future[None] = Future()
    h = _FutureHandle(16, 1, fut, [threading.Event()])
    with pytest.raises(PdkvTimeoutError, match=r"^copy not finished within 0\.05 s$"):
        h.wait(0.05)
    threading.Timer(0.05, fut.set_result, (None,)).start()
    h.wait(10)
    assert h.done() and h.error is None
    bad: Future[None] = Future()
    bad.set_exception(OSError("EFAULT"))
    with pytest.raises(SwapError, match="^copy failed: EFAULT$"):
        _FutureHandle(16, 1, bad, [threading.Event()]).wait(1)


@pytest.mark.parametrize("strategy", ["batch", "memcpy"])
def test_sub_batched_copy_lands_every_pair(strategy, monkeypatch):
    fake = FakeStreamCuda()
    fake.install(monkeypatch)
    L = lay(num_layers=2)
    buf, gpu = HostCache(L, 512), HostCache(L, 512)
    buf.arr[:] = np.random.default_rng(5).integers(0, 256, buf.arr.size, dtype=np.uint8)
    rng = np.random.default_rng(6)
    src, dst = rng.permutation(512)[:300].tolist(), rng.permutation(512)[:300].tolist()
    with SwapEngine(buf.spec, gpu.spec, strategy=strategy) as eng:
        h = eng.copy(src, dst, layerwise=True)
        if strategy == "batch":
            assert fake.submits > 2  # 300 pieces x 2 layers x 2 tensors: several sub-batches
        h.wait(10)
    for layer in range(L.total_layers):
        for t in range(2):
            for s_, d_ in zip(src, dst):
                np.testing.assert_array_equal(gpu.block(layer, t, d_), buf.block(layer, t, s_))


@pytest.mark.parametrize("strategy", ["batch", "memcpy"])
def test_engine_works_on_its_cache_device_and_gives_the_caller_its_own_back(strategy, monkeypatch):
    """CUDA's current device is per thread: an engine for a cache on device 1, called from a
    thread on device 0, makes its streams, events and copies on device 1 and leaves the
    thread on device 0."""
    fake = FakeStreamCuda()
    fake.install(monkeypatch)
    L = lay()
    buf, gpu = HostCache(L, 64), HostCache(L, 64)
    gpu.spec.device = 1
    buf.arr[:] = np.arange(buf.arr.size, dtype=np.uint64).astype(np.uint8)
    with SwapEngine(buf.spec, gpu.spec, strategy=strategy) as eng:
        assert eng.device == 1 and fake.current == 0
        eng.copy([1, 2, 3], [4, 5, 6]).wait(10)
        assert fake.current == 0
    assert fake.devices == {1} and fake.current == 0
    for s_, d_ in zip([1, 2, 3], [4, 5, 6]):
        np.testing.assert_array_equal(gpu.block(0, 0, d_), buf.block(0, 0, s_))
    with pytest.raises(SwapError, match="device=0, but the GPU cache is on device 1"):
        SwapEngine(buf.spec, gpu.spec, strategy=strategy, device=0)
    # a cache that names no device: the engine takes the constructing thread's current one
    gpu.spec.device = None
    fake.set_device(1)
    with SwapEngine(buf.spec, gpu.spec, strategy=strategy) as eng:
        fake.set_device(0)
        assert eng.device == 1
        eng.copy([7], [8]).wait(10)
        assert fake.current == 0


def test_failed_construction_destroys_the_stream_it_made(monkeypatch):
    fake = FakeStreamCuda()
    fake.install(monkeypatch)
    made, destroyed = [], []

    def create(nonblocking=True):
        if made:
            raise RuntimeError("injected: no second stream")
        made.append(7)
        return 7

    monkeypatch.setattr(_ffi.cuda, "stream_create", create)
    monkeypatch.setattr(_ffi.cuda, "stream_destroy", destroyed.append)
    monkeypatch.setattr(_ffi.cuda, "compile_kernel", lambda *a: object())
    L = lay()
    buf, gpu = HostCache(L, 8), HostCache(L, 8)
    with pytest.raises(RuntimeError, match="no second stream"):
        SwapEngine(buf.spec, gpu.spec, strategy="kernel")  # its own stream, then the side stream fails
    assert destroyed == [7] and fake.current == 0


@pytest.mark.parametrize("strategy", ["batch", "memcpy"])
def test_failed_submission_drains_what_was_queued_before_raising(strategy, monkeypatch):
    fake = FakeStreamCuda(fail_on_call=3)
    fake.install(monkeypatch)
    L = lay(num_layers=2)
    buf, gpu = HostCache(L, 512), HostCache(L, 512)
    buf.arr[:] = 9
    with SwapEngine(buf.spec, gpu.spec, strategy=strategy) as eng:
        with pytest.raises(RuntimeError, match="injected failure on submission 3"):
            eng.copy(list(range(0, 400, 2)), list(range(0, 400, 2)))
        # the two submissions before the failure ran to completion before the error
        # reached the caller: nothing is left to write into the destination later
        assert fake.queue == []
        assert fake.done > 0
        assert not fake.events  # and every event was destroyed


def test_drain_gives_up_after_its_bound(monkeypatch):
    from pdkv.swap import handles as swap

    fake = FakeStreamCuda()
    fake.install(monkeypatch)
    monkeypatch.setattr(_ffi.cuda, "event_query", lambda e: False)  # a stream that never finishes
    assert swap._drain(7, timeout=0.05) is False
    assert not fake.events


@pytest.mark.cuda
def test_cuda_copy_handles_polled_from_several_threads_at_once(cuda_device, no_leaks):
    """Staged sends poll one copy's handle from several lanes and the engine's own
    descriptor reuse: a poll must never query an event another thread has just destroyed
    (that crashed the process in the driver)."""
    import threading

    L = lay(num_layers=1, kv_heads=1, head_dim=128, tokens_per_block=8)
    n = 64
    size = L.block_bytes * n
    with SharedBuffer.create(size, require_pinned=True) as sb:
        bspec = CacheSpec.for_buffer(L, n, sb.address)
        dptr = _ffi.cuda.malloc(size)
        try:
            gspec = CacheSpec.for_buffer(L, n, dptr)
            with SwapEngine(bspec, gspec, strategy="kernel") as eng:
                for _ in range(300):
                    h = eng.copy(list(range(n)), list(range(n)), layerwise=True)
                    errs: list[BaseException] = []

                    def poll(h=h, errs=errs):
                        try:
                            while not (h.layer_done(0) and h.done()):
                                pass
                        except BaseException as exc:
                            errs.append(exc)

                    ts = [threading.Thread(target=poll) for _ in range(4)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join(10)
                    assert not errs and h.error is None
        finally:
            _ffi.cuda.free(dptr)


def _round_trip_every_block(n: int, seed: int, order: str = "layer", runs: bool = False, **engine_kw) -> None:
    """Scattered blocks of a pinned buffer to GPU blocks and back with a SwapEngine built
    with ``engine_kw``: every block ends where it began, byte for byte. ``order``: both
    caches per layer or block-outermost; ``runs``: the ids in runs of up to 8 consecutive
    on both sides (whole multi-layer pieces where block-outermost)."""
    L = lay(num_layers=2, kv_heads=1, head_dim=128, tokens_per_block=8)
    size = L.block_bytes * n
    rng = np.random.default_rng(seed)
    with SharedBuffer.create(size, require_pinned=True) as sb:
        host = np.frombuffer(sb.buf, dtype=np.uint8)
        host[:] = rng.integers(0, 256, size, dtype=np.uint8)
        want = host.copy()
        bspec = CacheSpec.for_buffer(L, n, sb.address, order=order)
        dptr = _ffi.cuda.malloc(size)
        try:
            gspec = CacheSpec.for_buffer(L, n, dptr, order=order)
            if runs:  # chunks of 8 ids, shuffled as chunks: runs of 8 on both sides
                src = (rng.permutation(n // 8)[:, None] * 8 + np.arange(8)).ravel().tolist()
                dst = (rng.permutation(n // 8)[:, None] * 8 + np.arange(8)).ravel().tolist()
                if order == "block":
                    assert plan_copy(bspec, gspec, src, dst).pieces <= n // 8 + 1  # whole blocks, every layer
            else:
                src, dst = rng.permutation(n).tolist(), rng.permutation(n).tolist()
            with SwapEngine(bspec, gspec, **engine_kw) as eng:
                eng.copy(src, dst).wait(30)
                host[:] = 0
                eng.copy(dst, src, direction="d2h").wait(30)
            np.testing.assert_array_equal(host, want)
        finally:
            _ffi.cuda.free(dptr)
        del host


@pytest.mark.cuda
@pytest.mark.parametrize("ctas", [1, 3])
def test_cuda_kernel_capped_at_few_ctas_copies_every_block(ctas, cuda_device, no_leaks):
    """max_ctas: each CTA loops over its share of the pieces; every scattered block lands,
    both ways, byte for byte."""
    _round_trip_every_block(64, ctas, strategy="kernel", max_ctas=ctas)


def test_decode_priority_moves_small_pieces_on_the_copy_engines(monkeypatch):
    """priority='decode': where auto would run the kernel (pieces under 128 KiB), the
    copy goes to the copy engines instead (no kernel launched), and every pair lands."""
    fake = FakeStreamCuda()
    fake.install(monkeypatch)
    monkeypatch.setattr(_ffi.cuda, "launch", lambda *a, **k: pytest.fail("the kernel ran"))
    L = lay(num_layers=2, kv_heads=8, head_dim=128, tokens_per_block=8)  # 16 KiB pieces
    assert L.tensor_block_bytes(0) == 16 << 10
    buf, gpu = HostCache(L, 64), HostCache(L, 64)
    buf.arr[:] = np.random.default_rng(9).integers(0, 256, buf.arr.size, dtype=np.uint8)
    with SwapEngine(buf.spec, gpu.spec, strategy="batch", priority="decode") as eng:
        eng.strategy, eng._auto = "kernel", True  # what auto resolves to on a GPU with NVRTC
        eng.copy(list(range(0, 64, 2)), list(range(1, 64, 2))).wait(10)
    assert fake.submits >= 1
    for b in range(32):
        np.testing.assert_array_equal(gpu.block(1, 1, 2 * b + 1), buf.block(1, 1, 2 * b))
    with pytest.raises(ValueError, match="priority='fast' must be 'throughput' or 'decode'"):
        SwapEngine(buf.spec, gpu.spec, priority="fast")


@pytest.mark.parametrize(
    "priority, piece_kib, direction, max_ctas, batch, want",
    [
        # decode: the copy engines at every size (memcpy without libcuda's batch call)
        ("decode", 16, "h2d", None, True, ("batch", 0)),
        ("decode", 64, "d2h", None, True, ("batch", 0)),
        ("decode", 2, "h2d", None, True, ("batch", 0)),
        ("decode", 2, "h2d", 2, True, ("batch", 0)),
        ("decode", 16, "h2d", None, False, ("memcpy", 0)),
        ("decode", 8, "d2d", None, True, ("kernel", "all")),
        # throughput: the copy engines from 128 KiB host->GPU, 256 KiB GPU->host
        ("throughput", 128, "h2d", None, True, ("batch", 0)),
        ("throughput", 64, "h2d", None, True, ("kernel", "all")),
        ("throughput", 128, "d2h", None, True, ("kernel", "all")),
        ("throughput", 256, "d2h", None, True, ("batch", 0)),
        ("throughput", 256, "d2h", None, False, ("kernel", "all")),
        ("throughput", 2, "h2d", 8, True, ("kernel", 8)),
        ("throughput", 512, None, None, True, ("batch", 0)),
    ],
)
def test_auto_follows_the_pieces_under_each_priority(
    monkeypatch, priority, piece_kib, direction, max_ctas, batch, want
):
    """The strategy auto picks for one copy, and the kernel's grid cap, by the copy's mean
    piece: the policy of docs/PERF.md's tables (What the swap costs a decode step)."""
    monkeypatch.setattr(_ffi.cuda, "batch_copy_supported", lambda: batch)
    L = lay(num_layers=1, kv_heads=1, head_dim=piece_kib * 512 // 4, tokens_per_block=4)
    assert L.tensor_block_bytes(0) == piece_kib << 10
    buf, gpu = HostCache(L, 8), HostCache(L, 8)
    eng = SwapEngine(buf.spec, gpu.spec, strategy="host", priority=priority, max_ctas=max_ctas)
    try:
        eng.strategy, eng._auto, eng._max_grid = "kernel", True, max_ctas or 1 << 20
        plan = plan_copy(buf.spec, gpu.spec, [0, 2, 4], [1, 3, 5])
        assert plan.pieces == 6 and plan.nbytes == 6 * (piece_kib << 10)  # K and V of 3 blocks
        got = eng._choose(plan, direction)
        assert got == (want[0], eng._max_grid if want[1] == "all" else want[1])
        eng._auto = False  # a strategy forced: never changed
        assert eng._choose(plan, direction) == ("kernel", eng._max_grid)
        eng.strategy = "batch"
        assert eng._choose(plan, direction) == ("batch", 0)
    finally:
        eng.strategy = "host"
        eng.close()


@pytest.mark.cuda
@pytest.mark.parametrize("priority", ["throughput", "decode"])
@pytest.mark.parametrize("runs", [False, True])
def test_cuda_block_outermost_caches_swap_whole_blocks_byte_exact(priority, runs, cuda_device, no_leaks):
    """A block-outermost buffer and GPU cache (vLLM's BLHNC, decode's buffer mirroring it):
    a run of blocks is one piece of every layer; both ways, byte for byte."""
    _round_trip_every_block(256, 6, order="block", runs=runs, priority=priority)


@pytest.mark.cuda
@pytest.mark.parametrize("priority", ["throughput", "decode"])
def test_cuda_auto_under_each_priority_copies_every_block(priority, cuda_device, no_leaks):
    """The kernel (throughput) and the copy engines by libcuda's batch call (decode), both
    ways, byte for byte, with 4 KiB pieces."""
    _round_trip_every_block(256, 4, priority=priority)
