#!/usr/bin/env python3
"""Transport bandwidth and control latency, two processes on this host.

For each block size, 1 GiB moves from this (prefill) process into a decode process's
buffer, in random destination order (the source->destination mapping is a random
permutation, so nothing coalesces), every byte verified afterwards. Measured in the same
run: the shm transport against a two-process shared-memory copy ceiling (one contiguous
copy of the same bytes into the decode's segment, by the fastest of np.copyto, pdkv's
streaming copy loop as one piece, and the loop over consecutive 128 KiB pieces), and the
tcp transport against a
single-stream socket loop (sendall -> recv_into of the same bytes between the same two
processes). With ``--streams 1,2,4,8`` the tcp transport runs once per stream count, each
against a socket loop of as many streams (each its share of the bytes, ``sendall`` from its
own thread, ``recv_into`` in its own thread on the far side), measured back to back in the
same repetition: the ceiling of that many streams through this host's loopback and Python.
Peer libraries over tcp (``--peers``) move the same blocks in the same random order in the
same run, after pdkv's rows, each in a phase of its own with its own decode process (NIXL's
UCX progress threads take a core while an agent lives): bare NIXL over UCX tcp (descriptor
lists prepared once) and Mooncake's transfer engine (handshake mode, a batch a request: the
best of the batches one after another and all in flight at once), each where it loads, the
one that does not named.
The clock runs from handing the data to the sender until every request's
outcome (received, verified by decode's accounting) is back; grants are taken before.
Control overhead: one-block requests, p50 of grant -> completion (from holding the grant
to the definite outcome) and of the whole cycle including the reservation round trip.

The prefill cache is page-aligned, as engines allocate theirs; ``--src-offset 16`` puts it
where a large ``np.empty`` would start (16 bytes into its page), which costs block copies
on some CPUs.

    python tools/bench_transport.py [--gib 1] [--sizes-kib 32,128,1024] [--streams 2] [--src-offset 0]
    python tools/bench_transport.py --sizes-kib 128,1024 --streams 1,2,4,8,16   # tcp by streams
    python tools/bench_transport.py --sizes-kib 128,1024 --peers nixl,mooncake   # the default peers
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
from _bench import send_and_wait, stop_decode, ucx_env

import pdkv
from pdkv.transfer import default_copy_threads, default_streams


def layout_for(kib: int, layers: int = 1) -> pdkv.KVLayout:
    """Blocks of ``kib`` KiB per layer (one tensor)."""
    return pdkv.KVLayout(num_layers=layers, kv_heads=1, head_dim=512, tokens_per_block=kib, dtype="bf16", mla=True)


class _Done:
    error = None

    def done(self) -> bool:
        return True


class NullSwap:
    """The transport is measured, not the swap: swaps complete at once, copying nothing."""

    def submit(self, rid, buf, gpu):
        return _Done()


NREQ = 16  # requests a transfer: the 1 GiB is cut into this many (bench_nixl.py's too)
PEERS = ("nixl", "mooncake")
# blocks a Mooncake transfer engine takes in flight over tcp: 8,192 at once (16 batches of 512)
# overflow its tcp lanes' queues ("TCP lane queue-full rejection") and fail the write
MOONCAKE_IN_FLIGHT = 2048


def _peer_list(arg: str) -> list[str]:
    return [p for p in arg.split(",") if p and p != "none"]


def _mooncake_engine():
    """Mooncake's transfer engine over tcp on loopback, peers found by handshake (no
    metadata server)."""
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("Mooncake's transfer engine did not start over tcp on 127.0.0.1")
    return te


def peer_unavailable(name: str) -> str:
    """Why peer library ``name`` cannot run here, or "" when it can."""
    if name == "nixl":
        from pdkv import _ffi

        return "" if _ffi.nixl.available() else "NIXL is not installed (pip install 'pdkv[nixl]')"
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:  # not installed, or a shared library it links (libibverbs) missing
        return (
            f"Mooncake's transfer engine does not load ({exc}): pip install mooncake-transfer-engine-non-cuda"
            " (it links libibverbs.so.1, from the distribution's libibverbs1 or rdma-core)"
        )
    return ""


def decode_main(a: argparse.Namespace) -> None:
    lay = layout_for(a.kib, a.layers)
    nb = int(a.gib * (1 << 30)) // lay.block_bytes
    buf = pdkv.SharedBuffer.create(pdkv.CacheSpec.buffer_bytes(lay, nb), huge_pages=a.huge_pages)
    import threading

    ready = threading.Event()

    def on_event(ev) -> None:  # the engine is woken by the scheduler, as a real one would be
        if ev.kind == "ready":
            ready.set()

    sched = pdkv.DecodeScheduler(
        num_layers=lay.total_layers,
        gpu=pdkv.BlockPool(nb),
        buffer=pdkv.BlockPool(nb),
        swap=NullSwap(),
        options=pdkv.SchedulerOptions(direct_to_gpu=False, lease_s=120),
        listener=on_event,
    )
    transports = tuple(a.transports.split(","))
    rx = pdkv.DecodeReceiver(sched, [lay], [buf], nb, auto_tick=True, io_timeout_s=30, transports=transports)
    sink = socket.create_server(("127.0.0.1", 0))
    info = {"control": rx.control_address, "shm": buf.name, "blocks": nb, "sink": sink.getsockname()[1]}
    bare = mooncake = None
    peers = _peer_list(a.peers)
    if "nixl" in transports or "nixl" in peers:  # a bare NIXL agent over the same buffer
        from pdkv import _ffi

        bare = _ffi.nixl.Agent(f"bench-bare-{os.getpid()}")
        bare.register([(buf.address, buf.size, 0)], "DRAM")
        info.update(bare_agent=bare.name, bare_metadata=bare.metadata().hex(), address=buf.address)
    if "mooncake" in peers:  # Mooncake's transfer engine over tcp, the same buffer registered
        mooncake = _mooncake_engine()
        if mooncake.register_memory(buf.address, buf.size) != 0:
            raise SystemExit("Mooncake's transfer engine could not register decode's buffer")
        info.update(mooncake=f"127.0.0.1:{mooncake.get_rpc_port()}", address=buf.address)
    print(json.dumps(info), flush=True)

    def engine() -> None:  # the decode engine: takes ready requests and finishes them
        while True:
            ready.wait(0.05)
            ready.clear()
            for r in sched.take_ready():
                sched.finish(r.request_id)

    threading.Thread(target=engine, daemon=True).start()
    # the socket-loop baseline: receive a stream into the buffer, as fast as Python can.
    # The benchmark kills this process when it is done; if the benchmark itself dies first,
    # this process notices within a second and removes its segment instead of living on
    parent = os.getppid()
    sink.settimeout(1.0)
    view = buf.buf

    def serve(conn: socket.socket) -> None:  # one stream: its bytes into the buffer from its offset
        with conn:
            conn.settimeout(None)
            hdr = conn.recv(16, socket.MSG_WAITALL)
            if len(hdr) < 16:
                return
            n, off = int.from_bytes(hdr[:8], "little"), int.from_bytes(hdr[8:], "little")
            got = 0
            while got < n:
                at = (off + got) % len(view)
                k = conn.recv_into(view[at : min(len(view), at + n - got)])
                if k == 0:
                    return
                got += k
            conn.sendall(b"ok")

    while True:
        try:
            conn, _ = sink.accept()
        except TimeoutError:
            if os.getppid() != parent:
                break
            continue
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    view = None
    if bare is not None:
        bare.close()
    if mooncake is not None:
        mooncake.unregister_memory(buf.address)
    rx.close()
    sink.close()
    buf.close()
    buf.unlink()


def run_size(kib: int, a: argparse.Namespace, rows: list, out: dict) -> None:
    lay = layout_for(kib)
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "decode", "--kib", str(kib), "--gib", str(a.gib)]
        + (["--huge-pages"] if a.huge_pages else []),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = json.loads(child.stdout.readline())
        nb = info["blocks"]
        total = nb * lay.block_bytes
        # the prefill cache: page-aligned, as an engine's allocator gives it (np.random's
        # own array would start 16 bytes into its page; --src-offset reproduces that)
        src = pdkv.aligned_empty(total + a.src_offset)[a.src_offset :]
        src[:] = np.random.default_rng(kib).integers(0, 256, total, dtype=np.uint8)
        spec = pdkv.CacheSpec.for_buffer(lay, nb, src.ctypes.data)
        view_buf = pdkv.SharedBuffer.open(info["shm"], pin="never")
        dst = np.frombuffer(view_buf.buf, dtype=np.uint8)
        perm = np.random.default_rng(1).permutation(nb)
        per = nb // NREQ

        # ceiling for shm: one contiguous copy of the same bytes into the other process's
        # segment, by as many threads as pdkv copies with, with the faster of two copy
        # primitives measured each time: np.copyto (glibc memcpy; non-temporal stores at
        # this size) and pdkv's streaming copy loop where it runs (_ffi.cpu)
        from concurrent.futures import ThreadPoolExecutor

        from pdkv.native import cpu

        stream = cpu.available()
        nth = a.copy_threads
        pool = ThreadPoolExecutor(nth)
        cut = [total * i // nth for i in range(nth + 1)]
        dbase, sbase = dst.ctypes.data, src.ctypes.data

        # the loop copies 4 pieces side by side; a contiguous range cut into consecutive
        # 128 KiB pieces runs that way too, and may beat one piece
        piece = 128 << 10
        p_src = [np.arange(sbase + cut[i], sbase + cut[i + 1], piece, dtype=np.int64) for i in range(nth)]
        p_dst = [np.arange(dbase + cut[i], dbase + cut[i + 1], piece, dtype=np.int64) for i in range(nth)]
        p_len = [np.minimum(piece, sbase + cut[i + 1] - p_src[i]).astype(np.int64) for i in range(nth)]

        def contiguous(kind: str) -> float:
            if kind == "copyto":
                work = lambda i: np.copyto(dst[cut[i] : cut[i + 1]], src[cut[i] : cut[i + 1]])  # noqa: E731
            elif kind == "stream":
                work = lambda i: cpu.copy(dbase + cut[i], sbase + cut[i], cut[i + 1] - cut[i])  # noqa: E731
            else:
                work = lambda i: cpu.gather(p_src[i], p_dst[i], p_len[i])  # noqa: E731
            t0 = time.perf_counter()
            list(pool.map(work, range(nth)))
            return total / (time.perf_counter() - t0)

        copyto_bw: list[float] = []

        def ceiling():
            c = contiguous("copyto")
            copyto_bw.append(c)
            return max(c, contiguous("stream"), contiguous("pieces")) if stream else c

        # the same scattered copy with no transport at all, by the primitive pdkv's shm
        # transport uses here: the streaming loop over the blocks' addresses, or np.take
        # (a C loop of memcpy) gathering the source blocks in the transfer's random order
        s2, d2 = src.reshape(nb, lay.block_bytes), dst[:total].reshape(nb, lay.block_bytes)

        bcut = [nb * i // nth for i in range(nth + 1)]
        bb = lay.block_bytes
        g_src = sbase + perm.astype(np.int64) * bb
        g_dst = dbase + np.arange(nb, dtype=np.int64) * bb
        g_len = np.full(nb, bb, np.int64)

        def bare_gather():
            t0 = time.perf_counter()
            if stream:
                list(
                    pool.map(
                        lambda i: cpu.gather(
                            g_src[bcut[i] : bcut[i + 1]], g_dst[bcut[i] : bcut[i + 1]], g_len[bcut[i] : bcut[i + 1]]
                        ),
                        range(nth),
                    )
                )
            else:
                list(
                    pool.map(
                        lambda i: np.take(
                            s2, perm[bcut[i] : bcut[i + 1]], axis=0, out=d2[bcut[i] : bcut[i + 1]], mode="clip"
                        ),
                        range(nth),
                    )
                )
            return total / (time.perf_counter() - t0)

        # socket loop baseline: n streams (connected before the clock starts), each sendall of
        # its share of the same bytes from its own thread, recv_into on the far side
        spool = ThreadPoolExecutor(max(a.streams))
        mv = memoryview(src)

        def socket_loop(n: int = 1) -> float:
            socks = [socket.create_connection(("127.0.0.1", info["sink"])) for _ in range(n)]
            bounds = [total * i // n for i in range(n + 1)]

            def one(i: int) -> None:
                s, lo, hi = socks[i], bounds[i], bounds[i + 1]
                s.sendall((hi - lo).to_bytes(8, "little") + lo.to_bytes(8, "little"))
                for off in range(lo, hi, 8 << 20):
                    s.sendall(mv[off : min(hi, off + (8 << 20))])
                assert s.recv(2, socket.MSG_WAITALL) == b"ok"

            t0 = time.perf_counter()
            list(spool.map(one, range(n)))
            dt = time.perf_counter() - t0
            for s in socks:
                s.close()
            return total / dt

        def sender(t: str, streams: int) -> pdkv.PrefillSender:
            return pdkv.PrefillSender(
                lay,
                spec,
                info["control"],
                transport=t,
                streams=streams,
                timeout_s=60,
                instance=f"bench-{t}-{streams}",
                copy_threads=nth,
            )

        # the main table's tcp: the first stream count; the others, tcp_<n>, by streams below
        txs = {"shm": sender("shm", a.streams[0]), "tcp": sender("tcp", a.streams[0])}
        txs.update({f"tcp_{n}": sender("tcp", n) for n in a.streams[1:]})
        counter = [0]

        def transfer(transport: str) -> float:
            tx = txs[transport]
            dst[:total] = 0xEE  # poison
            counter[0] += 1
            rids = [f"{transport}-{counter[0]}-{i}" for i in range(NREQ)]
            # reservation is control-plane work (measured below); the clock starts with data
            grants = [tx.reserve(r, per * lay.tokens_per_block) for r in rids]
            dt = send_and_wait(tx, [(r, perm[i * per : (i + 1) * per].tolist()) for i, r in enumerate(rids)])
            bb = lay.block_bytes
            for i, g in enumerate(grants):  # every byte: block grants[i][j] holds source perm[i*per+j]
                got = dst[: nb * bb].reshape(nb, bb)[np.asarray(g.blocks)]
                if not np.array_equal(got, src.reshape(nb, bb)[perm[i * per : (i + 1) * per]]):
                    raise SystemExit(f"VERIFY FAILED: {transport} {kib} KiB request {i}")
            return NREQ * per * bb / dt

        # warm-up, then each repetition measures the thing and its baseline back to back,
        # and the ratio is taken per repetition (this 2-core machine is noisy)
        s0 = a.streams[0]
        ceiling(), socket_loop(s0), transfer("shm"), transfer("tcp"), bare_gather()
        reps, by_streams = [], []
        for _ in range(a.reps):
            reps.append((ceiling(), transfer("shm"), socket_loop(s0), transfer("tcp"), bare_gather()))
            # each further stream count: its socket loop, then pdkv's tcp with as many streams
            by_streams.append({n: (socket_loop(n), transfer(f"tcp_{n}")) for n in a.streams[1:]})
        med = lambda xs: statistics.median(xs)  # noqa: E731
        res = {
            "shm": med([r[1] for r in reps]),
            "tcp": med([r[3] for r in reps]),
            "shm_ratio": med([r[1] / r[0] for r in reps]),
            "tcp_ratio": med([r[3] / r[2] for r in reps]),
            "shm_vs_bare_gather": med([r[1] / r[4] for r in reps]),
            "bare_gather": med([r[4] for r in reps]),
        }
        shm_ceiling, sock_bw = med([r[0] for r in reps]), med([r[2] for r in reps])
        streams_rows = {s0: {"tcp": res["tcp"], "socket": sock_bw, "ratio": res["tcp_ratio"]}}
        for n in a.streams[1:]:
            pairs = [b[n] for b in by_streams]
            streams_rows[n] = {
                "socket": med([p[0] for p in pairs]),
                "tcp": med([p[1] for p in pairs]),
                "ratio": med([p[1] / p[0] for p in pairs]),
            }
        for n in a.streams[1:]:
            txs.pop(f"tcp_{n}").close()
        spool.shutdown()
        for transport, tx in txs.items():
            # control overhead of one-block requests: grant -> completion (from holding the
            # grant to the definite outcome: write, layer/complete messages, decode's
            # accounting, the answer), and the whole cycle with the reservation round trip
            lat, full = [], []
            for i in range(a.control_requests):
                rid = f"ctl-{transport}-{i}"
                t0 = time.perf_counter()
                tx.reserve(rid, lay.tokens_per_block)
                t1 = time.perf_counter()
                tx.send_layer(0, [(rid, [i % nb])])
                tx.finish(rid)
                assert tx.wait_outcome(rid, 10).ok
                t2 = time.perf_counter()
                lat.append(t2 - t1)
                full.append(t2 - t0)
            res[transport + "_ctl_p50_ms"] = statistics.median(lat) * 1e3
            res[transport + "_cycle_p50_ms"] = statistics.median(full) * 1e3
            tx.close()
        pool.shutdown()
        huge_mib = view_buf.huge_pages_bytes >> 20  # of decode's buffer, as this process maps it
        dst = s2 = d2 = None  # drop the views before closing the mapping
        view_buf.close()
        gib = 1 << 30
        rows.append(
            (
                kib,
                res["shm"] / gib,
                res["shm_ratio"],
                shm_ceiling / gib,
                res["bare_gather"] / gib,
                res["tcp"] / gib,
                res["tcp_ratio"],
                sock_bw / gib,
                res["shm_ctl_p50_ms"],
                res["tcp_ctl_p50_ms"],
                res["shm_cycle_p50_ms"],
                res["tcp_cycle_p50_ms"],
            )
        )
        out[kib] = dict(
            res,
            shm_ceiling=shm_ceiling,
            socket=sock_bw,
            copyto=med(copyto_bw),
            huge_mib=huge_mib,
            by_streams=streams_rows,
        )
    finally:
        stop_decode(child)
    # the peers after pdkv's rows and its decode process are gone, each in a phase of its own
    out[kib]["peers"] = {
        name: {"peer": bw, "tcp_x": out[kib]["tcp"] / bw} for name, bw in run_peers(kib, a, src, perm).items()
    }


_TE: list = []  # this process's Mooncake transfer engine, made once (it has no close)


def run_peers(kib: int, a: argparse.Namespace, src: np.ndarray, perm: np.ndarray) -> dict[str, float]:
    """Each peer library's GiB/s (median of ``--reps`` after a warm-up) moving every block of
    ``src`` into a decode process's buffer in the order ``perm`` (destination i holds source
    ``perm[i]``), every byte verified. Each peer runs in a phase of its own, with its own
    decode process: NIXL's UCX progress threads take a core while its agents live, and
    beside pdkv's rows they halved every one of them on the 2-core dev VM."""
    return {name: _one_peer(name, kib, a, src, perm) for name in a.peer_list}


def _one_peer(name: str, kib: int, a: argparse.Namespace, src: np.ndarray, perm: np.ndarray) -> float:
    lay = layout_for(kib)
    bb = lay.block_bytes
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "decode", "--kib", str(kib), "--gib", str(a.gib), "--peers", name],
        stdout=subprocess.PIPE,
        text=True,
        env=a.env,
    )
    agent = registered = None
    try:
        info = json.loads(child.stdout.readline())
        nb = info["blocks"]
        total = nb * bb
        assert nb == perm.size and total <= src.size, (nb, perm.size)
        view_buf = pdkv.SharedBuffer.open(info["shm"], pin="never")
        dst = np.frombuffer(view_buf.buf, dtype=np.uint8)
        sbase = src.ctypes.data

        def verify_peer(what: str) -> None:
            if not np.array_equal(dst[:total].reshape(nb, bb), src[:total].reshape(nb, bb)[perm]):
                raise SystemExit(f"VERIFY FAILED: {what} {kib} KiB")

        if name == "nixl":  # bare NIXL over UCX tcp, descriptor lists prepared once
            from pdkv import _ffi

            agent = _ffi.nixl.Agent(f"bench-peer-{os.getpid()}")
            agent.register([(sbase, total, 0)], "DRAM")
            remote = agent.add_remote(bytes.fromhex(info["bare_metadata"]))
            prep_l = agent.prepare(np.array([[sbase, bb, 0, bb, nb]], np.uint64), "DRAM")
            prep_r = agent.prepare(np.array([[info["address"], bb, 0, bb, nb]], np.uint64), "DRAM", remote)
            li, ri = perm.astype(np.int32), np.arange(nb, dtype=np.int32)

            def nixl_peer() -> float:
                dst[:total] = 0xEE
                t0 = time.perf_counter()
                h = agent.write_prepared(prep_l, li, prep_r, ri)
                while (st := agent.state(h)) not in ("DONE", "ERR"):
                    time.sleep(20e-6)
                dt = time.perf_counter() - t0
                agent.release(h)
                if st != "DONE":
                    raise SystemExit(f"bare NIXL's write ended {st} ({kib} KiB)")
                verify_peer("bare NIXL")
                return total / dt

            fn = nixl_peer

        else:  # Mooncake's transfer engine over tcp, the best of a batch a request one after another or in flight
            if not _TE:
                _TE.append(_mooncake_engine())
            mooncake = _TE[0]
            if mooncake.register_memory(sbase, total) != 0:
                raise SystemExit("Mooncake's transfer engine could not register the source")
            registered = mooncake
            target = info["mooncake"]
            m_src = (sbase + perm.astype(np.int64) * bb).tolist()
            m_dst = (info["address"] + np.arange(nb, dtype=np.int64) * bb).tolist()
            m_len = [bb] * nb
            cuts = [nb * i // NREQ for i in range(NREQ + 1)]
            waves: list[list[tuple[int, int]]] = [[]]
            for lo, hi in zip(cuts, cuts[1:]):
                if waves[-1] and hi - waves[-1][0][0] > MOONCAKE_IN_FLIGHT:
                    waves.append([])
                waves[-1].append((lo, hi))

            def mooncake_peer() -> float:
                best = 0.0
                for mode in ("sync", "async"):  # a batch a request: one after another, or all in flight
                    dst[:total] = 0xEE
                    t0 = time.perf_counter()
                    rc = 0
                    if mode == "sync":
                        for lo, hi in zip(cuts, cuts[1:]):
                            rc = rc or mooncake.batch_transfer_sync_write(
                                target, m_src[lo:hi], m_dst[lo:hi], m_len[lo:hi]
                            )
                    else:  # as many batches in flight as hold MOONCAKE_IN_FLIGHT blocks, then the next
                        for wave in waves:
                            ids = [
                                mooncake.batch_transfer_async_write(target, m_src[lo:hi], m_dst[lo:hi], m_len[lo:hi])
                                for lo, hi in wave
                            ]
                            rc = rc or (mooncake.get_batch_transfer_status(ids) if all(ids) else -1)
                    dt = time.perf_counter() - t0
                    if rc != 0:
                        raise SystemExit(f"Mooncake's {mode} batch write failed ({rc}, {kib} KiB)")
                    verify_peer(f"Mooncake {mode}")
                    best = max(best, total / dt)
                return best

            fn = mooncake_peer

        fn()  # warm-up
        bw = statistics.median(fn() for _ in range(a.reps))
        dst = None
        view_buf.close()
        return bw
    finally:
        if agent is not None:
            agent.close()
        if registered is not None:
            registered.unregister_memory(src.ctypes.data)
        stop_decode(child)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="bench")
    ap.add_argument("--kib", type=int, default=128)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=1, help=argparse.SUPPRESS)  # decode role (bench_staged.py)
    ap.add_argument("--transports", default="shm,tcp", help=argparse.SUPPRESS)  # decode role (bench_nixl.py)
    ap.add_argument("--sizes-kib", default="32,128,1024")
    ap.add_argument(
        "--streams",
        default=str(default_streams()),
        help="tcp data streams, or a comma-separated list (1,2,4,8): tcp once per count, each beside a socket "
        "loop of as many streams; the main table's tcp is the first (default: pdkv's default_streams(), "
        f"{default_streams()} here)",
    )
    ap.add_argument(
        "--peers",
        default=None,
        help="peer libraries over tcp measured in the same run after pdkv's rows: bare NIXL over UCX tcp "
        "(nixl), Mooncake's transfer engine (mooncake), or none (default nixl,mooncake); one that does not "
        "load here is named and left out",
    )
    ap.add_argument(
        "--copy-threads",
        type=int,
        default=None,
        help="shm copy threads (default: pdkv's default_copy_threads()); the ceiling uses as many",
    )
    ap.add_argument(
        "--src-offset",
        type=int,
        default=0,
        help="bytes the prefill cache starts past a page boundary (default 0; a large np.empty: 16)",
    )
    ap.add_argument(
        "--huge-pages",
        action="store_true",
        help="decode's buffer asks for huge pages (takes effect on a /dev/shm mounted huge=advise)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--control-requests", type=int, default=200)
    a = ap.parse_args()
    if a.src_offset < 0:
        ap.error(f"--src-offset {a.src_offset} must be >= 0")
    try:
        a.streams = [int(x) for x in str(a.streams).split(",")]
    except ValueError:
        ap.error(f"--streams {a.streams!r}: integers, comma-separated")
    if not a.streams or any(not 1 <= n <= 64 for n in a.streams) or len(set(a.streams)) != len(a.streams):
        ap.error(f"--streams {','.join(map(str, a.streams))}: distinct counts in 1..64")
    if a.copy_threads is None:
        a.copy_threads = default_copy_threads()
    if a.peers is None:  # a decode process serves the peers it is asked for, none unless asked
        a.peers = "none" if a.role == "decode" else "nixl,mooncake"
    wanted = _peer_list(a.peers)
    if any(p not in PEERS for p in wanted) or len(set(wanted)) != len(wanted):
        ap.error(f"--peers {a.peers}: distinct names of {', '.join(PEERS)}, or none")
    if a.role == "decode":
        decode_main(a)
        return 0
    missing = {p: why for p in wanted if (why := peer_unavailable(p))}
    a.peer_list = [p for p in wanted if p not in missing]
    # UCX over tcp on loopback, for bare NIXL here and in decode (UCX reads it at start)
    a.env = ucx_env("tcp") if "nixl" in a.peer_list else dict(os.environ)
    rows: list = []
    out: dict = {}
    for kib in [int(x) for x in a.sizes_kib.split(",")]:
        run_size(kib, a, rows, out)
    print(
        f"{a.gib:g} GiB per run, random destination order, every byte verified; GiB/s (ratio);"
        f" shm copy threads: {a.copy_threads} (pdkv and both baselines);"
        f" prefill cache {a.src_offset} B past a page boundary; decode buffer in huge pages:"
        f" {', '.join(str(v['huge_mib']) + ' MiB' for v in out.values())}"
    )
    from pdkv.native import cpu

    print(
        "shm copy primitive: "
        + ("pdkv's streaming copy loop (_ffi.cpu)" if cpu.available() else f"np.take ({cpu.unavailable_reason()})")
    )
    print(
        f"{'KiB':>6} {'shm':>14} {'shm ceiling':>12} {'np.copyto':>10} "
        f"{'bare gather':>12} {'tcp':>14} {'socket loop':>12}"
        f" {'grant->done ms shm/tcp':>23} {'+reserve ms':>12}"
    )
    for kib, s, sr, sc, bg, t, tr, sk, c1, c2, f1, f2 in rows:
        print(
            f"{kib:>6} {s:>7.2f} ({sr:.2f}) {sc:>12.2f} {out[kib]['copyto'] / (1 << 30):>10.2f} {bg:>12.2f}"
            f" {t:>7.2f} ({tr:.2f}) {sk:>12.2f}"
            f" {c1:>13.2f}/{c2:.2f} {f1:>7.2f}/{f2:.2f}"
        )
    print("(medians over repetitions; a ratio is the median of per-repetition ratios. shm ceiling: one contiguous")
    print(" copy of the same bytes, the fastest of np.copyto and pdkv's streaming loop (one piece, 128 KiB pieces)")
    print(" each time; bare gather: the same random-order block copy by the shm transport's copy primitive,")
    print(" no transport)")
    if len(a.streams) > 1:
        print("\ntcp by streams: GiB/s, pdkv tcp (ratio) against a socket loop of as many streams, same repetitions")
        print(f"{'KiB':>6} " + " ".join(f"{str(n) + ' stream' + ('s' if n > 1 else ''):>22}" for n in a.streams))
        for kib in out:
            cells = [out[kib]["by_streams"][n] for n in a.streams]
            print(
                f"{kib:>6} "
                + " ".join(
                    f"{c['tcp'] / (1 << 30):>6.2f} ({c['ratio']:.2f}) of {c['socket'] / (1 << 30):>5.2f}" for c in cells
                )
            )
    if a.peer_list or missing:
        print(f"\ntcp against peer libraries over tcp: GiB/s, pdkv tcp with {a.streams[0]} streams, each peer")
        print(" (x: pdkv's median / its median; each peer after pdkv's rows, in a phase of its own); the same")
        print(" blocks in the same random order, every byte verified")
        names = {"nixl": "bare NIXL, UCX tcp", "mooncake": "Mooncake TE tcp"}
        print(f"{'KiB':>6} {'pdkv tcp':>9} " + " ".join(f"{names[p]:>24}" for p in a.peer_list))
        for kib, r in out.items():
            cells = [r["peers"][p] for p in a.peer_list]
            print(
                f"{kib:>6} {r['tcp'] / (1 << 30):>9.2f} "
                + " ".join(f"{c['peer'] / (1 << 30):>15.2f} ({c['tcp_x']:.2f}x)" for c in cells)
            )
        for p, why in missing.items():
            print(f"{names[p]}: not measured: {why}")
    r128 = out.get(128) or next(iter(out.values()))
    print(
        json.dumps(
            {
                "shm_vs_ceiling": round(min(r["shm_ratio"] for r in out.values()), 3),
                "tcp_vs_socket": round(min(r["tcp_ratio"] for r in out.values()), 3),
                "tcp_GiBps": round(r128["tcp"] / (1 << 30), 3),
                "control_p50_ms": round(statistics.median([r["tcp_ctl_p50_ms"] for r in out.values()]), 3),
                "control_p50_ms_shm": round(statistics.median([r["shm_ctl_p50_ms"] for r in out.values()]), 3),
                "cycle_with_reserve_p50_ms": round(statistics.median([r["tcp_cycle_p50_ms"] for r in out.values()]), 3),
                "shm_vs_bare_gather": round(min(r["shm_vs_bare_gather"] for r in out.values()), 3),
                "streams": a.streams[0] if len(a.streams) == 1 else a.streams,
                "tcp_by_streams": {
                    str(n): {
                        str(kib): {
                            k: round(v / (1 << 30), 3) if k != "ratio" else round(v, 3)
                            for k, v in r["by_streams"][n].items()
                        }
                        for kib, r in out.items()
                    }
                    for n in a.streams
                },
                "peers": {
                    p: missing.get(p)
                    or {
                        str(kib): {
                            "GiBps": round(r["peers"][p]["peer"] / (1 << 30), 3),
                            "tcp_x": round(r["peers"][p]["tcp_x"], 3),
                        }
                        for kib, r in out.items()
                    }
                    for p in wanted
                },
                "copy_threads": a.copy_threads,
                "src_offset": a.src_offset,
                "copy": "stream" if cpu.available() else "numpy",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
