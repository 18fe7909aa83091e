"""Peer processes for the multi-process transfer tests (run as a script)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from pdkv import BlockPool, CacheSpec, DecodeScheduler, KVLayout, SchedulerOptions, SharedBuffer, SwapEngine
from pdkv.transfer import DecodeReceiver, PrefillSender

LAYOUT = dict(num_layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, dtype="bf16")


def prefill(a: argparse.Namespace) -> None:
    lay = KVLayout(**LAYOUT, tp_size=a.tp, tp_rank=a.rank)
    src = np.random.default_rng(a.seed + a.rank).integers(0, 256, lay.block_bytes * 64, dtype=np.uint8)
    spec = CacheSpec.for_buffer(lay, 64, src.ctypes.data)
    if a.gpu:  # the same bytes in device memory (cuda_ipc, shm from a GPU cache)
        from pdkv import _ffi

        _ffi.cuda.set_device(a.device)
        ptr = _ffi.cuda.malloc(src.nbytes)
        _ffi.cuda.memcpy(ptr, src.ctypes.data, src.nbytes)
        spec = CacheSpec.for_buffer(lay, 64, ptr, device=a.device)
    secret = bytes.fromhex(a.secret) if a.secret else None
    if a.send_delay:  # a slow link: each staged frame's send takes this long
        from pdkv.transfer.transports import tcp

        push = tcp._push_staged

        def slow(sock, fs, sent):
            for f in fs:
                time.sleep(a.send_delay)
                push(sock, [f], sent)

        tcp._push_staged = slow
    with PrefillSender(
        lay,
        spec,
        a.control,
        transport=a.transport,
        secret=secret,
        timeout_s=a.timeout,
        heartbeat_s=0.2,
        instance=a.instance,
        instance_key=bytes.fromhex(os.environ["PDKV_INSTANCE_KEY"]) if os.environ.get("PDKV_INSTANCE_KEY") else None,
        staging=a.staging,
        staging_slot_bytes=a.slot_bytes or None,
    ) as tx:
        print(json.dumps({"ready": True}), flush=True)
        for i in range(a.requests):
            rid = f"{a.instance}-{i}"
            g = tx.reserve(rid, a.blocks * lay.tokens_per_block)
            for layer in range(lay.total_layers):
                tx.send_layer(layer, [(rid, list(range(a.blocks)))])
                print(json.dumps({"request": rid, "layer": layer}), flush=True)
                time.sleep(a.layer_sleep)
            tx.finish(rid)
            try:
                out = tx.wait_outcome(rid, a.timeout * 2)
                print(
                    json.dumps(
                        {
                            "request": rid,
                            "state": out.state,
                            "reason": out.reason,
                            "blocks": g.blocks,
                            "location": g.location,
                        }
                    ),
                    flush=True,
                )
            except Exception as exc:
                print(json.dumps({"request": rid, "state": "error", "reason": str(exc)}), flush=True)


def decode(a: argparse.Namespace) -> None:
    lay = KVLayout(**LAYOUT)
    nb = 64
    buf = SharedBuffer.create(CacheSpec.buffer_bytes(lay, nb))
    if a.gpu:  # GPU blocks only, written by cuda_ipc peers
        from pdkv import _ffi

        _ffi.cuda.set_device(0)
        ptr = _ffi.cuda.malloc(lay.block_bytes * nb)
        gspec = CacheSpec.for_buffer(lay, nb, ptr)
        gspec.device = 0
        sched = DecodeScheduler(
            num_layers=lay.total_layers,
            gpu=BlockPool(nb),
            options=SchedulerOptions(direct_to_gpu=True, lease_s=a.timeout),
        )
        rx = DecodeReceiver(
            sched,
            [lay],
            [buf],
            nb,
            auto_tick=True,
            peer_timeout_s=a.timeout,
            control=f"tcp://{a.host}:0",
            data_host=a.host,
            transports=("cuda_ipc",),
            gpu_caches=[gspec],
        )
        print(json.dumps({"control": rx.control_address, "shm": buf.name}), flush=True)
        while True:
            time.sleep(0.05)
            for r in sched.take_ready():
                sched.finish(r.request_id)
    gpu = np.zeros(lay.block_bytes * nb, np.uint8)
    eng = SwapEngine(
        CacheSpec.for_buffer(lay, nb, buf.address),
        CacheSpec.for_buffer(lay, nb, gpu.ctypes.data),
        strategy="host",
        buffer_pinned=False,
    )
    swap = eng
    if a.slow_swap:

        class _Slow:  # a swap that takes a.slow_swap seconds: a window to die in
            def __init__(self, h):
                self.h, self.t = h, time.monotonic() + a.slow_swap

            def done(self):
                return time.monotonic() > self.t and self.h.done()

            @property
            def error(self):
                return self.h.error

        class _SlowSwap:
            def submit(self, *args):
                print(json.dumps({"swapping": args[0]}), flush=True)
                return _Slow(eng.submit(*args))

        swap = _SlowSwap()
    sched = DecodeScheduler(
        num_layers=lay.total_layers,
        gpu=BlockPool(nb),
        buffer=BlockPool(nb),
        swap=swap,
        options=SchedulerOptions(direct_to_gpu=False, lease_s=a.lease or a.timeout),
    )
    rx = DecodeReceiver(
        sched,
        [lay],
        [buf],
        nb,
        auto_tick=True,
        peer_timeout_s=a.timeout,
        control=f"tcp://{a.host}:0",
        data_host=a.host,
        auth_timeout_s=a.auth_timeout,
        secret=bytes.fromhex(a.secret) if a.secret else None,
        **({"transports": tuple(a.transports.split(","))} if a.transports else {}),
    )
    if a.nofile:  # a process short of descriptors: this many more than it has open now
        import os
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + a.nofile, hard))
    print(json.dumps({"control": rx.control_address, "shm": buf.name}), flush=True)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        n = 0
        while True:
            time.sleep(0.05)
            for r in sched.take_ready():
                sched.finish(r.request_id)
            n += 1
            if a.status and n % 4 == 0:
                m = sched.metrics()
                print(
                    json.dumps(
                        {
                            "buffer_free": m["buffer_blocks_free"],
                            "gpu_free": m["gpu_blocks_free"],
                            "live": len(sched.live_requests()),
                            "failed": m["requests_failed"],
                            "expired": m["requests_expired"],
                            "ready": m["requests_ready"],
                        }
                    ),
                    flush=True,
                )
    finally:
        rx.close()
        eng.close()
        buf.close()
        buf.unlink()


def worker(a: argparse.Namespace) -> None:
    """An engine worker owning decode rank ``a.rank``'s cache (of ``a.tp``), 64 blocks:
    in device memory with ``--gpu``, else in a shared buffer. Prints its export, then
    answers ``{"digest": [[layer, tensor, block], ...]}`` lines with the sha256 of each
    block tensor as this process reads it; ``exit`` ends it."""
    import hashlib

    from pdkv.integrations import workers

    lay = KVLayout(**LAYOUT, tp_size=a.tp, tp_rank=a.rank, token_major=a.nhd)
    nb = 64
    buf = None
    if a.gpu:
        from pdkv import _ffi

        _ffi.cuda.set_device(a.device)
        ptr = _ffi.cuda.malloc(lay.block_bytes * nb)
        zero = np.zeros(lay.block_bytes * nb, np.uint8)
        _ffi.cuda.memcpy(ptr, zero.ctypes.data, zero.nbytes)
        spec = CacheSpec.for_buffer(lay, nb, ptr, device=a.device)
    else:
        buf, spec = workers.host_cache(lay, nb)
    print(json.dumps({"export": workers.export_cache(lay, spec, buf).hex()}), flush=True)
    host = np.empty(lay.block_bytes, np.uint8)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        out = []
        for layer, t, b in json.loads(line)["digest"]:
            n = lay.tensor_block_bytes(t)
            addr = spec.address(layer, t, b)
            if a.gpu:
                _ffi.cuda.memcpy(host.ctypes.data, addr, n)
                data = host[:n].tobytes()
            else:
                data = bytes(buf.buf[addr - buf.address : addr - buf.address + n])
            out.append(hashlib.sha256(data).hexdigest())
        print(json.dumps({"digest": out}), flush=True)
    if buf is not None:
        buf.close()
        buf.unlink()
    else:
        _ffi.cuda.free(ptr)


def hello_flood(a: argparse.Namespace) -> None:
    """Distinct Hellos of a real prefill, as captured off the wire (made here with the
    secret, as the prefill made them), replayed to ``--control`` at ``--rate`` a second,
    each from a new connection (from ``--source``), until killed; prints how many went
    every second."""
    import zmq

    from pdkv.procs import boot_id
    from pdkv.protocol import PROTOCOL_VERSION, Codec, Hello, layout_desc, new_nonce

    codec = Codec(bytes.fromhex(a.secret))
    lay = KVLayout(**LAYOUT)
    ctx = zmq.Context()
    socks: list = []
    sent, t0 = 0, time.monotonic()
    while True:
        h = Hello(PROTOCOL_VERSION, "victim", 0, 1, layout_desc(lay), ["tcp"], boot_id(), os.getpid(), new_nonce())
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(a.control.replace("tcp://", f"tcp://{a.source}:0;", 1) if a.source else a.control)
        s.send_multipart(codec.encode(h))
        socks.append(s)
        while len(socks) > 200:
            socks.pop(0).close(0)
        sent += 1
        if sent % int(a.rate) == 0:
            print(json.dumps({"sent": sent, "seconds": time.monotonic() - t0}), flush=True)
        time.sleep(max(0.0, t0 + sent / a.rate - time.monotonic()))


def ports(a: argparse.Namespace) -> None:
    """The small ports pdkv listens on besides decode's control port, in one process for the
    tests to flood and measure: prefill's pull endpoint, an SGLang decode's aux endpoint
    (slots of 64 and 16 bytes) and SGLang's bootstrap table, all under ``--secret``. Prints
    their addresses, then a line for each aux message written and each pull served."""
    from pdkv.integrations.core.pull import PullServer
    from pdkv.integrations.sglang.aux import AuxServer, max_message
    from pdkv.integrations.sglang.bootstrap import BootstrapServer

    secret = bytes.fromhex(a.secret)

    def on_pull(r):
        print(json.dumps({"pulled": r.pid}), flush=True)
        return ""

    def on_aux(pid, blobs):
        print(json.dumps({"aux": pid}), flush=True)
        return ""

    pull = PullServer("tcp://127.0.0.1:0", on_pull, secret=secret)
    aux = AuxServer("tcp://127.0.0.1:0", secret, on_aux, max_msg=max_message([64, 16]))
    boot = BootstrapServer("127.0.0.1", 0, secret)
    print(json.dumps({"pull": pull.address, "aux": aux.address, "boot": boot.port}), flush=True)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(1)
    finally:
        pull.close()
        aux.close()
        boot.close()


def auth_flood(a: argparse.Namespace) -> None:
    """``--requests`` authenticated sessions (the secret's, each its own instance) that send
    batches of 512 reservations to ``--control`` as fast as they can, until killed; prints
    once every session is open."""
    import zmq
    from hostile import RawSession

    from pdkv.protocol import ReserveBatch

    lay = KVLayout(**LAYOUT)
    ctx = zmq.Context()
    sessions = [
        RawSession(a.control, lay, secret=bytes.fromhex(a.secret), instance=f"flood{i}", ctx=ctx)
        for i in range(a.requests)
    ]
    print(json.dumps({"sessions": len(sessions)}), flush=True)
    n = 0
    while True:
        for s in sessions:
            n += 1
            try:
                s.sock.send_multipart(s.codec.encode(ReserveBatch([(f"x{n}-{j}", 8) for j in range(512)])), zmq.NOBLOCK)
            except zmq.Again:
                pass
        time.sleep(0.001)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role")
    ap.add_argument("--control", default="")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--layer-sleep", type=float, default=0.0)
    ap.add_argument("--secret", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--lease", type=float, default=0.0, help="decode: grant lease (default --timeout)")
    ap.add_argument("--instance", default="p")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--status", action="store_true")
    ap.add_argument("--slow-swap", type=float, default=0.0)
    ap.add_argument("--staging", default="auto")
    ap.add_argument("--transports", default="")
    ap.add_argument("--slot-bytes", type=int, default=0)
    ap.add_argument("--send-delay", type=float, default=0.0)
    ap.add_argument("--nofile", type=int, default=0, help="decode: RLIMIT_NOFILE this many above the fds open")
    ap.add_argument("--auth-timeout", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=400.0, help="hello-flood: Hellos a second")
    ap.add_argument("--source", default="", help="hello-flood: the address to connect from (e.g. 127.0.0.2)")
    ap.add_argument("--device", type=int, default=0, help="prefill --gpu: the CUDA device of the cache")
    ap.add_argument("--nhd", action="store_true", help="worker: a token-major layout")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="prefill: the cache in device memory; decode: serve cuda_ipc into a GPU cache",
    )
    a = ap.parse_args()
    roles = {
        "prefill": prefill,
        "decode": decode,
        "worker": worker,
        "hello-flood": hello_flood,
        "auth-flood": auth_flood,
        "ports": ports,
    }
    roles[a.role](a)
    sys.exit(0)
