"""The cuda_ipc transport: the welcome's section validated, the sender/receiver path on a
fake IPC layer over host memory (one process: a 'handle' carries the address), and on a
GPU between two processes."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_transfer import BASE, _lines, _spawn, clean_killed_segment, expected_block, prefill_cache, reap, wait_until

from pdkv import BlockPool, CacheSpec, DecodeScheduler, KVLayout, SchedulerOptions, SharedBuffer, SwapEngine, _ffi
from pdkv.errors import LayoutError, PeerError, ProtocolError
from pdkv.transfer import DecodeReceiver, PrefillSender
from pdkv.transfer.transports.ipc_export import IpcMapping, export_gpu_caches, parse_ipc_section


class FakeIpc:
    """Allocations are numpy arrays; a handle is the base address; open returns it."""

    def __init__(self, monkeypatch, arrays=(), alloc_bytes=None):
        self.allocs: dict[int, int] = {}
        for a in arrays:
            self.add(a, alloc_bytes)
        self.opened: list[int] = []
        self.closed: list[int] = []
        self.current = [0]  # the thread's current device, innermost last
        self.opened_on: list[int] = []  # the device current at each ipc_open
        for name in (
            "address_range",
            "ipc_get_handle",
            "ipc_open",
            "ipc_close",
            "device_uuid",
            "set_device",
            "on_device",
        ):
            monkeypatch.setattr(_ffi.cuda, name, getattr(self, name))
        # no CUDA here: the sender's swap engine falls back to host copies
        monkeypatch.setattr(_ffi.cuda, "device_count", lambda: 0)

    def add(self, arr, alloc_bytes=None):
        step = alloc_bytes or arr.nbytes
        for off in range(0, arr.nbytes, step):  # alloc_bytes: the array as several allocations
            self.allocs[arr.ctypes.data + off] = min(step, arr.nbytes - off)

    def address_range(self, ptr):
        for b, n in self.allocs.items():
            if b <= ptr < b + n:
                return b, n
        raise AssertionError(f"{ptr:#x} is in no allocation")

    def ipc_get_handle(self, base):
        assert base in self.allocs
        return base.to_bytes(8, "little") + bytes(56)

    def ipc_open(self, handle):
        b = int.from_bytes(handle[:8], "little")
        self.opened.append(b)
        self.opened_on.append(self.current[-1])
        return b

    @contextlib.contextmanager
    def on_device(self, d):
        self.current.append(d)
        try:
            yield
        finally:
            self.current.pop()

    def ipc_close(self, b):
        self.closed.append(b)

    def device_uuid(self, d):
        return "fa4e0000"

    def set_device(self, d):
        pass


class IpcDecode:
    """D decode ranks with a buffer and a host 'GPU' cache each, serving cuda_ipc."""

    def __init__(self, monkeypatch, D=1, nb=64, gpu_reserve=0, alloc_bytes=None, transports=("cuda_ipc", "shm", "tcp")):
        self.lays = [KVLayout(**BASE, tp_size=D, tp_rank=r) for r in range(D)]
        self.nb = nb
        self.bufs = [SharedBuffer.create(CacheSpec.buffer_bytes(lay, nb)) for lay in self.lays]
        for b in self.bufs:
            np.frombuffer(b.buf, np.uint8)[:] = 0xEE
        self.gpus = [np.full(lay.block_bytes * nb, 0x55, np.uint8) for lay in self.lays]
        self.fake = FakeIpc(monkeypatch, self.gpus, alloc_bytes)
        self.gspecs = [CacheSpec.for_buffer(lay, nb, g.ctypes.data) for lay, g in zip(self.lays, self.gpus)]
        for sp in self.gspecs:
            sp.device = 0
        self.engine = SwapEngine(
            CacheSpec.for_buffer(self.lays[0], nb, self.bufs[0].address),
            self.gspecs[0],
            strategy="host",
            buffer_pinned=False,
        )
        self.sched = DecodeScheduler(
            num_layers=self.lays[0].total_layers,
            gpu=BlockPool(nb),
            buffer=BlockPool(nb),
            swap=self.engine,
            options=SchedulerOptions(
                direct_to_gpu=True, lease_s=5.0, fence_grace_s=0.5, gpu_reserve_blocks=gpu_reserve
            ),
        )
        self.rx = DecodeReceiver(
            self.sched,
            self.lays,
            self.bufs,
            nb,
            transports=transports,
            gpu_caches=self.gspecs,
            auto_tick=True,
            peer_timeout_s=3.0,
        )

    def block(self, where, rank, layer, t, b):
        lay = self.lays[rank]
        base = self.bufs[rank].address if where == "buffer" else self.gpus[rank].ctypes.data
        mem = self.bufs[rank].buf if where == "buffer" else memoryview(self.gpus[rank])
        a = CacheSpec.for_buffer(lay, self.nb, base).address(layer, t, b) - base
        return bytes(mem[a : a + lay.tensor_block_bytes(t)])

    def close(self):
        self.rx.close()
        self.engine.close()
        for b in self.bufs:
            b.close()
            b.unlink()


def gpu_prefill(P, r):
    lay, arr, spec = prefill_cache(P, r)
    gspec = CacheSpec.for_buffer(lay, 64, arr.ctypes.data)
    gspec.device = 0  # "device memory" the fake layer copies with host copies
    return lay, arr, spec, gspec


def run_request(txs, rid, sb):
    g = None
    for tx in txs:
        g = tx.reserve(rid, len(sb) * 8)
    for layer in range(4):
        for tx in txs:
            tx.send_layer(layer, [(rid, sb)])
    for tx in txs:
        tx.finish(rid)
    outs = [tx.wait_outcome(rid, 10) for tx in txs]
    return g, outs


@pytest.mark.multiproc
@pytest.mark.parametrize("P,D", [(1, 1), (2, 4), (4, 2)])
def test_gpu_grants_land_in_decode_gpu_cache_every_byte(monkeypatch, P, D, no_leaks):
    dec = IpcDecode(monkeypatch, D=D)
    try:
        pre = [gpu_prefill(P, r) for r in range(P)]
        txs = [
            PrefillSender(lay, gspec, dec.rx.control_address, transport="cuda_ipc", instance="pf", timeout_s=5)
            for lay, _, _, gspec in pre
        ]
        assert all(tx.transport == "cuda_ipc" for tx in txs)
        sb = [5, 6, 7, 30, 2, 41]
        g, outs = run_request(txs, "a", sb)
        assert all(o.ok for o in outs), outs
        assert g.location == "gpu"
        lays, specs = [p[0] for p in pre], [p[2] for p in pre]
        for dst in dec.lays:
            for layer in range(4):
                for t in range(2):
                    for gi, b in enumerate(g.blocks):
                        want = expected_block(lays, specs, sb, dst, layer, t, gi)
                        assert dec.block("gpu", dst.tp_rank, layer, t, b) == want
                        # straight into the GPU cache: the buffer never saw it
                        assert dec.block("buffer", dst.tp_rank, layer, t, b) == b"\xee" * len(want)
        for tx in txs:
            tx.close()
        # every mapping the senders opened is closed again
        assert sorted(dec.fake.closed) == sorted(dec.fake.opened) and dec.fake.opened
    finally:
        dec.close()


@pytest.mark.multiproc
def test_no_gpu_room_falls_back_to_the_buffer_and_tcp_peers_never_get_gpu_blocks(monkeypatch, no_leaks):
    dec = IpcDecode(monkeypatch, D=1)
    try:
        lay, arr, spec, gspec = gpu_prefill(1, 0)
        with PrefillSender(lay, spec, dec.rx.control_address, transport="tcp", instance="host-pf", timeout_s=5) as tcp:
            g, outs = run_request([tcp], "t", [1, 2, 3])
            assert outs[0].ok and g.location == "buffer"  # GPU has room, but tcp writes host memory
        hog = dec.sched.gpu.allocate(dec.sched.gpu.num_free)  # no GPU room from now on
        with PrefillSender(lay, gspec, dec.rx.control_address, transport="cuda_ipc", instance="pf", timeout_s=5) as tx:
            g, outs = run_request([tx], "b", [9, 10, 11])
            assert outs[0].ok and g.location == "buffer"
            for layer in range(4):
                for gi, b in enumerate(g.blocks):
                    assert dec.block("buffer", 0, layer, 1, b) == expected_block(
                        [lay], [spec], [9, 10, 11], dec.lays[0], layer, 1, gi
                    )
        dec.sched.gpu.free(hog)
    finally:
        dec.close()


@pytest.mark.multiproc
def test_ranks_of_one_instance_all_use_cuda_ipc_or_none(monkeypatch, no_leaks):
    dec = IpcDecode(monkeypatch, D=1)
    try:
        (l0, _, _, g0), (l1, _, _, g1) = gpu_prefill(2, 0), gpu_prefill(2, 1)
        with PrefillSender(l0, g0, dec.rx.control_address, transport="cuda_ipc", instance="pf", timeout_s=5):
            # its sibling offers shm only: it would write GPU grants into the buffer
            with pytest.raises(PeerError, match="cuda_ipc is all ranks or none"):
                PrefillSender(l1, g1, dec.rx.control_address, transport="shm", instance="pf", timeout_s=5)
    finally:
        dec.close()


@pytest.mark.multiproc
def test_auto_from_a_gpu_cache_takes_cuda_ipc_where_decode_serves_it_else_shm(monkeypatch, no_leaks):
    from test_transfer import Decode

    dec = IpcDecode(monkeypatch, D=1)
    try:
        lay, arr, spec, gspec = gpu_prefill(1, 0)
        with PrefillSender(lay, gspec, dec.rx.control_address, transport="auto", instance="pf", timeout_s=5) as tx:
            assert tx.transport == "cuda_ipc"
            g, outs = run_request([tx], "a", [3, 4])
            assert outs[0].ok and g.location == "gpu"
        # a host cache under auto never gets GPU blocks
        with PrefillSender(lay, spec, dec.rx.control_address, transport="auto", instance="host", timeout_s=5) as tx:
            assert tx.transport == "shm"
    finally:
        dec.close()
    plain = Decode()  # serves shm and tcp only
    try:
        with PrefillSender(lay, gspec, plain.rx.control_address, transport="auto", instance="pf", timeout_s=5) as tx:
            assert tx.transport == "shm"
            _, outs = run_request([tx], "b", [1])
            assert outs[0].ok
    finally:
        plain.close()


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "visible, peer, expect",
    [
        (["dec0", "pre1"], True, "cuda_ipc"),
        (["dec0", "pre1"], False, "no peer access to decode's device 0"),
        (["dec0"], True, "not one decode sees"),
    ],
)
def test_cuda_ipc_only_where_prefill_gpu_can_map_decode_memory(monkeypatch, visible, peer, expect, no_leaks):
    dec = IpcDecode(monkeypatch, D=1)
    try:
        # decode's cache on device 0 ("dec0"), prefill's on another GPU ("pre1")
        monkeypatch.setattr(_ffi.cuda, "device_uuid", lambda d: {0: "dec0", 1: "pre1"}[d])
        monkeypatch.setattr(_ffi.cuda, "device_uuids", lambda: list(visible))
        asked = []
        monkeypatch.setattr(_ffi.cuda, "can_access_peer", lambda d, p: asked.append((d, p)) or peer)
        lay, arr, spec, gspec = gpu_prefill(1, 0)
        gspec.device = 1
        if expect == "cuda_ipc":
            with PrefillSender(lay, gspec, dec.rx.control_address, transport="auto", instance="pf", timeout_s=5) as tx:
                assert tx.transport == "cuda_ipc"
            assert dec.fake.opened_on and set(dec.fake.opened_on) == {1}  # mapped in the prefill GPU's context
            assert dec.fake.current == [0]  # and the caller's current device given back
            assert asked == [(1, 0)]  # prefill's device (decode's ordinal 1) reaching decode's 0
            return
        with PrefillSender(lay, gspec, dec.rx.control_address, transport="auto", instance="pf", timeout_s=5) as tx:
            assert tx.transport == "shm"  # auto falls back to the buffer
        with pytest.raises(PeerError, match=f"cuda_ipc: .*{expect}.*use shm"):
            PrefillSender(lay, gspec, dec.rx.control_address, transport="cuda_ipc", instance="pf2", timeout_s=5)
    finally:
        dec.close()


def test_receiver_refusals(monkeypatch):
    lay = KVLayout(**BASE)
    with SharedBuffer.create(CacheSpec.buffer_bytes(lay, 8)) as buf:
        try:
            sched = DecodeScheduler(num_layers=4, gpu=BlockPool(8), options=SchedulerOptions(direct_to_gpu=True))
            with pytest.raises(ValueError, match="has no buffer and shm write only into one.*or serve cuda_ipc"):
                DecodeReceiver(sched, [lay], [buf], 8, transports=("shm",))
            with pytest.raises(ValueError, match="cuda_ipc needs gpu_caches"):
                DecodeReceiver(sched, [lay], [buf], 8, transports=("cuda_ipc",))
            gpu = np.zeros(lay.block_bytes * 8, np.uint8)
            # the cache as allocations of 1.5 regions each: the second region spans two
            FakeIpc(monkeypatch, [gpu], alloc_bytes=lay.block_bytes * 3 // 2)
            spec = CacheSpec.for_buffer(lay, 8, gpu.ctypes.data)
            with pytest.raises(LayoutError, match="no device"):
                export_gpu_caches([lay], [spec], 8)
            spec.device = 0
            with pytest.raises(LayoutError, match="spans more than one allocation"):
                export_gpu_caches([lay], [spec], 8)
            with pytest.raises(LayoutError, match="GPU pool hands out 16"):
                export_gpu_caches([lay], [spec], 16)
            # memory the driver will not export (cuMemCreate, torch's expandable segments)
            from pdkv.errors import CudaError

            def refuse(base):
                raise CudaError(1, "cudaErrorInvalidValue", "invalid argument", "cudaIpcGetMemHandle")

            FakeIpc(monkeypatch, [gpu])
            monkeypatch.setattr(_ffi.cuda, "ipc_get_handle", refuse)
            with pytest.raises(LayoutError, match="cannot be exported for CUDA IPC.*expandable segments"):
                export_gpu_caches([lay], [spec], 8)
        finally:
            buf.unlink()


def test_export_then_parse_round_trip_with_several_allocations(monkeypatch):
    lay = KVLayout(**BASE)
    # one allocation per layer (as an engine with a tensor per layer has)
    per_layer = [np.zeros(lay.block_bytes * 8, np.uint8) for _ in range(4)]
    FakeIpc(monkeypatch, per_layer)
    spec = CacheSpec(
        lay,
        8,
        [
            [(a.ctypes.data + t * lay.tensor_block_bytes(0) * 8, lay.tensor_block_bytes(t)) for t in range(2)]
            for a in per_layer
        ],
        device=0,
    )
    sec = export_gpu_caches([lay], [spec], 8)
    assert len(sec["ranks"][0]["allocs"]) == 4
    caches = parse_ipc_section(sec, [0], [lay])
    c = caches[0]
    for layer in range(4):
        for t in range(2):
            ai, off, stride = c.regions[layer * 2 + t]
            assert int.from_bytes(c.allocs[ai][0][:8], "little") + off == spec.region(layer, t)[0]
            assert stride == spec.region(layer, t)[1]


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 6),
    mla=st.booleans(),
    nb=st.integers(1, 12),
    interleaved=st.booleans(),
    per_layer=st.booleans(),
    data=st.data(),
)
def test_export_parse_map_gives_every_block_the_same_address(layers, mla, nb, interleaved, per_layer, data):
    """Any cache shape (packed, K/V interleaved per block, one allocation per layer or one
    for all), exported, parsed and mapped back (identity mapping), addresses every
    (layer, tensor, block) where the original did."""
    import pytest as _pt

    mp = _pt.MonkeyPatch()
    try:
        lay = KVLayout(
            num_layers=layers, kv_heads=1 if mla else 2, head_dim=16, tokens_per_block=4, dtype="bf16", mla=mla
        )
        nt = len(lay.tensors)
        tbs = [lay.tensor_block_bytes(t) for t in range(nt)]
        layer_bytes = sum(tbs) * nb
        pad = data.draw(st.integers(0, 3)) * 64  # slack at the end of each allocation
        if per_layer:
            arrays = [np.zeros(layer_bytes + pad, np.uint8) for _ in range(layers)]
            bases = [a.ctypes.data for a in arrays]
        else:
            arrays = [np.zeros(layer_bytes * layers + pad, np.uint8)]
            bases = [arrays[0].ctypes.data + i * layer_bytes for i in range(layers)]
        fake = FakeIpc(mp, arrays)
        regions = []
        for b in bases:
            if interleaved:  # every tensor of a block side by side (FlashInfer-like)
                regions.append([(b + sum(tbs[:t]), sum(tbs)) for t in range(nt)])
            else:  # each tensor's blocks packed
                regions.append([(b + sum(tbs[:t]) * nb, tbs[t]) for t in range(nt)])
        spec = CacheSpec(lay, nb, regions, device=0)
        sec = export_gpu_caches([lay], [spec], nb)
        mapped = IpcMapping(parse_ipc_section(sec, [0], [lay]), [lay], 0)
        got = mapped.specs[0]
        for layer in range(layers):
            for t in range(nt):
                for blk in range(nb):
                    assert got.address(layer, t, blk) == spec.address(layer, t, blk)
        assert len(fake.opened) == len(arrays)
        mapped.close()
        assert sorted(fake.closed) == sorted(fake.opened)
    finally:
        mp.undo()


def _valid_section(lay, nb=8):
    base = 1 << 20
    packed = CacheSpec.for_buffer(lay, nb, base)  # offsets of a packed cache in one allocation
    return {
        "ranks": [
            {
                "rank": 0,
                "device_uuid": "ab",
                "num_blocks": nb,
                "allocs": [{"handle": bytes(64), "size": CacheSpec.buffer_bytes(lay, nb)}],
                "regions": [
                    [0, packed.region(layer, t)[0] - base, packed.region(layer, t)[1]]
                    for layer in range(4)
                    for t in range(2)
                ],
            }
        ]
    }


@pytest.mark.parametrize(
    "breakage,match",
    [
        (lambda s: s.update(extra=1), "must be {'ranks'"),
        (lambda s: s["ranks"][0].pop("regions"), "exactly the fields"),
        (lambda s: s["ranks"][0].update(rank=3), "not one of decode's ranks"),
        (lambda s: s["ranks"].append(dict(s["ranks"][0])), "repeated"),
        (lambda s: s["ranks"][0].update(num_blocks=0), "num_blocks"),
        (lambda s: s["ranks"][0].update(num_blocks=True), "num_blocks"),
        (lambda s: s["ranks"][0]["allocs"][0].update(handle=b"x" * 63), "64 bytes"),
        (lambda s: s["ranks"][0]["allocs"][0].update(size="big"), "allocation size"),
        (lambda s: s["ranks"][0].update(allocs=[]), "non-empty"),
        (lambda s: s["ranks"][0]["regions"].pop(), "needs 8 regions"),
        (lambda s: s["ranks"][0]["regions"][3].__setitem__(0, 1), "names allocation 1 of 1"),
        (lambda s: s["ranks"][0]["regions"][3].__setitem__(2, 16), "stride 16 below"),
        (lambda s: s["ranks"][0]["regions"][7].__setitem__(1, 1 << 40), "ends past its allocation"),
        (lambda s: s["ranks"][0]["regions"][2].__setitem__(1, -8), "offset"),
        (lambda s: s["ranks"][0].update(device_uuid=7), "device_uuid"),
        (lambda s: s.update(ranks=[]), "no GPU cache for decode ranks"),
    ],
)
def test_parse_refuses_a_hostile_section(breakage, match):
    lay = KVLayout(**BASE)
    sec = _valid_section(lay)
    parse_ipc_section(sec, [0], [lay])  # the unbroken one is fine
    breakage(sec)
    with pytest.raises(ProtocolError, match=match):
        parse_ipc_section(sec, [0], [lay])


# ------------------------------------------------------------------ GPU, two processes


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "P,D,transport,gpus",
    [
        (1, 1, "cuda_ipc", 1),
        (2, 4, "cuda_ipc", 1),
        (1, 1, "auto", 1),
        (1, 2, "cuda_ipc", 2),
        (2, 2, "auto", 2),
        (2, 4, "cuda_ipc", 2),
    ],
)
def test_cuda_ipc_between_processes_every_byte(cuda_device, P, D, transport, gpus, no_leaks):
    """gpus=2: decode rank r's cache on device r % 2 and prefill rank r on device (r + 1) % 2,
    so prefill's kernel writes over the peer link into the other GPU's memory."""
    if _ffi.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices")
    lays = [KVLayout(**BASE, tp_size=D, tp_rank=r) for r in range(D)]
    nb = 64
    bufs = [SharedBuffer.create(CacheSpec.buffer_bytes(lay, nb)) for lay in lays]
    ptrs = []
    for r, lay in enumerate(lays):
        with _ffi.cuda.on_device(r % gpus):
            ptrs.append(_ffi.cuda.malloc(lay.block_bytes * nb))
            _ffi.cuda.memset(ptrs[-1], 0x55, lay.block_bytes * nb)
    procs = []
    rx = None
    try:
        gspecs = [CacheSpec.for_buffer(lay, nb, p, device=r % gpus) for r, (lay, p) in enumerate(zip(lays, ptrs))]
        # GPU blocks only: every grant is written by prefill's kernel straight into them
        sched = DecodeScheduler(
            num_layers=4, gpu=BlockPool(nb), buffer=None, options=SchedulerOptions(direct_to_gpu=True, lease_s=10.0)
        )
        # auto: a GPU cache offers cuda_ipc first, and decode checks the GPU can map its memory
        rx = DecodeReceiver(sched, lays, bufs, nb, transports=("cuda_ipc", "shm"), gpu_caches=gspecs, auto_tick=True)
        env = dict(os.environ, PDKV_INSTANCE_KEY=os.urandom(32).hex())  # the P ranks are one instance
        procs = [
            _spawn(
                "prefill",
                "--control",
                rx.control_address,
                "--transport",
                transport,
                "--gpu",
                "--device",
                str((r + 1) % gpus),
                "--tp",
                str(P),
                "--rank",
                str(r),
                "--blocks",
                "5",
                "--timeout",
                "10",
                "--instance",
                "gpf",
                env=env,
            )
            for r in range(P)
        ]
        outs = [_lines(p, 6, timeout=60)[-1] for p in procs]
        assert all(o["state"] == "received" and o["location"] == "gpu" for o in outs), outs
        blocks = outs[0]["blocks"]
        src = [prefill_cache(P, r) for r in range(P)]
        slays, sspecs = [s[0] for s in src], [s[2] for s in src]
        for lay, p in zip(lays, ptrs):
            host = np.empty(lay.block_bytes * nb, np.uint8)
            _ffi.cuda.memcpy(host.ctypes.data, p, host.nbytes)
            hspec = CacheSpec.for_buffer(lay, nb, host.ctypes.data)
            for layer in range(4):
                for t in range(2):
                    for gi, b in enumerate(blocks):
                        a = hspec.address(layer, t, b) - host.ctypes.data
                        got = host[a : a + lay.tensor_block_bytes(t)].tobytes()
                        assert got == expected_block(slays, sspecs, list(range(5)), lay, layer, t, gi)
        for r in sched.take_ready():
            sched.finish(r.request_id)
    finally:
        for p in procs:
            reap(p)
        if rx is not None:
            rx.close()
        for p in ptrs:
            _ffi.cuda.free(p)
        for b in bufs:
            b.close()
            b.unlink()


@pytest.mark.cuda
@pytest.mark.multiproc
def test_cuda_ipc_prefill_killed_mid_transfer_decode_reclaims_gpu_blocks(cuda_device, no_leaks):
    import signal

    from pdkv import State

    lay = KVLayout(**BASE)
    nb = 64
    buf = SharedBuffer.create(CacheSpec.buffer_bytes(lay, nb))
    ptr = _ffi.cuda.malloc(lay.block_bytes * nb)
    rx, p = None, None
    try:
        gspec = CacheSpec.for_buffer(lay, nb, ptr)
        gspec.device = 0
        sched = DecodeScheduler(
            num_layers=4,
            gpu=BlockPool(nb),
            options=SchedulerOptions(direct_to_gpu=True, lease_s=2.0, fence_grace_s=0.5),
        )
        rx = DecodeReceiver(
            sched, [lay], [buf], nb, transports=("cuda_ipc",), gpu_caches=[gspec], auto_tick=True, peer_timeout_s=2.0
        )
        p = _spawn(
            "prefill",
            "--control",
            rx.control_address,
            "--transport",
            "cuda_ipc",
            "--gpu",
            "--blocks",
            "6",
            "--layer-sleep",
            "0.5",
            "--instance",
            "victim",
            "--timeout",
            "10",
        )
        _lines(p, 3, timeout=60)  # ready, layer 0, layer 1: GPU blocks half written
        assert sched.gpu.num_free == nb - 6
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        wait_until(lambda: sched.gpu.num_free == nb, 15, "GPU blocks of the dead prefill never came back")
        assert sched.request("victim-0").state is State.FAILED
        reap(p)
        # a new prefill is served, straight into GPU blocks again
        p = _spawn(
            "prefill",
            "--control",
            rx.control_address,
            "--transport",
            "cuda_ipc",
            "--gpu",
            "--blocks",
            "3",
            "--instance",
            "after",
            "--timeout",
            "10",
        )
        out = _lines(p, 6, timeout=60)[-1]
        assert out["state"] == "received" and out["location"] == "gpu", out
    finally:
        if p is not None:
            reap(p)
        if rx is not None:
            rx.close()
        _ffi.cuda.free(ptr)
        buf.close()
        buf.unlink()


@pytest.mark.cuda
@pytest.mark.multiproc
def test_cuda_ipc_decode_killed_prefill_fails_in_bounded_time_and_its_context_stays_usable(cuda_device, no_leaks):
    import signal
    import time

    d = _spawn("decode", "--gpu", "--timeout", "2")
    ptr, info = None, {}
    try:
        info = _lines(d, 1, timeout=60)[0]
        lay, arr, spec = prefill_cache(1, 0)
        ptr = _ffi.cuda.malloc(arr.nbytes)
        _ffi.cuda.memcpy(ptr, arr.ctypes.data, arr.nbytes)
        gspec = CacheSpec.for_buffer(lay, 64, ptr)
        gspec.device = 0
        tx = PrefillSender(lay, gspec, info["control"], transport="cuda_ipc", timeout_s=1.5, heartbeat_s=0.2)
        try:
            g = tx.reserve("r", 16)
            assert g.location == "gpu"
            tx.send_layer(0, [("r", [0, 1])])
            d.send_signal(signal.SIGKILL)
            d.wait(10)
            # writes into the dead process's allocation: still mapped here, so they land
            # somewhere harmless instead of faulting this process's context
            for layer in (1, 2, 3):
                tx.send_layer(layer, [("r", [0, 1])])
            tx.finish("r")
            t0 = time.monotonic()
            out = tx.wait_outcome("r", 10)
            assert out.state == "failed" and "decode" in out.reason
            assert time.monotonic() - t0 < 5
        finally:
            tx.close()  # closes the IPC mappings of the dead decode
        # this process's CUDA context is healthy: a copy and a swap-kernel copy both work
        back = np.empty(arr.nbytes, np.uint8)
        _ffi.cuda.memcpy(back.ctypes.data, ptr, arr.nbytes)
        assert np.array_equal(back, arr)
        other = _ffi.cuda.malloc(arr.nbytes)
        try:
            with SwapEngine(gspec, CacheSpec.for_buffer(lay, 64, other), strategy="kernel") as eng:
                from pdkv.swap.engine import plan_copy

                eng.copy_plan(plan_copy(gspec, CacheSpec.for_buffer(lay, 64, other), [3, 4], [5, 6])).wait(10)
        finally:
            _ffi.cuda.free(other)
    finally:
        reap(d)
        if ptr is not None:
            _ffi.cuda.free(ptr)
        if info:
            clean_killed_segment(info["shm"])  # the killed decode's segment
