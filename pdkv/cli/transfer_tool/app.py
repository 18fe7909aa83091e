"""The tool's command line: flags, the local, decode and prefill modes, exit codes."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ... import _ffi
from ...errors import PdkvError
from ...layout import KVLayout
from .decode import DecodeSide, Track
from .prefill import prefill_on_gpu, run_prefill
from .report import build_report, print_report, write_plot
from .workload import PRESETS, MiB, Parser, UsageError, layout_kw, make_workload, parse_devices


def _prefill_argv(a: argparse.Namespace, addr: str, rank: int) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "pdkv.cli.transfer_tool",
        "prefill",
        "--connect",
        addr,
        "--rank",
        str(rank),
        "--prefill-tp",
        str(a.prefill_tp),
        "--model",
        a.model,
        "--transport",
        a.transport,
        "--requests",
        str(a.requests),
        "--prompt-len",
        a.prompt_len,
        "--rate",
        str(a.rate),
        "--concurrency",
        str(a.concurrency),
        "--seed",
        str(a.seed),
        "--timeout",
        str(a.timeout),
        "--streams",
        str(a.streams),
        *(["--rdma-device", a.rdma_device] if a.rdma_device else []),
        *(["--rdma-gid-index", str(a.rdma_gid_index)] if a.rdma_gid_index is not None else []),
        "--layer-ms",
        str(a.layer_ms),
        "--prefill-blocks",
        str(a.prefill_blocks),
        "--instance",
        a.instance,
        "--time-scale",
        str(a.time_scale),
        "--duration",
        str(a.duration),
    ]
    if a.prefill_gpu:
        argv.append("--prefill-gpu")
    argv += ["--prefill-devices", a.prefill_devices]
    for opt, attr in (
        ("--layers", "layers"),
        ("--kv-heads", "kv_heads"),
        ("--head-dim", "head_dim"),
        ("--tokens-per-block", "tokens_per_block"),
        ("--dtype", "dtype"),
        ("--trace", "trace"),
        ("--trace-limit", "trace_limit"),
    ):
        v = getattr(a, attr)
        if v is not None and v != 0:
            argv += [opt, str(v)]
    if a.secret:
        argv += ["--secret", a.secret]
    return argv


def run_local(a: argparse.Namespace, console: Any) -> int:
    from rich.live import Live
    from rich.table import Table

    lay_kw = layout_kw(a)
    KVLayout(**lay_kw, tp_size=a.prefill_tp).check_compatible(KVLayout(**lay_kw, tp_size=a.decode_tp))
    make_workload(a)  # validate before starting anything
    dec = DecodeSide(a, lay_kw)
    dec.start(a.listen or "tcp://127.0.0.1:0")
    procs: list[subprocess.Popen[str]] = []
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    chosen: dict[int, str] = {}  # prefill rank -> the transport decode chose for it
    copies: set[str] = set()  # which copy the shm senders from host caches run
    paths: set[str] = set()  # the data paths the senders run ("tcp staged (kernel gather)")
    prefill_reports: list[dict[str, Any]] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for r in range(a.prefill_tp):
            procs.append(
                subprocess.Popen(
                    _prefill_argv(a, dec.rx.control_address, r),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )

        def reader(p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                with lock:
                    if ev.get("type") == "outcome":
                        prev = outcomes.get(ev["rid"])
                        outcomes[ev["rid"]] = ev["state"] if prev in (None, "received") else prev
                        if ev["state"] != "received" and ev.get("reason"):
                            reasons.setdefault(ev["rid"], str(ev["reason"]))
                    elif ev.get("type") == "summary":
                        prefill_reports.append(ev)
                    elif ev.get("type") == "hello":
                        chosen[int(ev.get("rank", -1))] = str(ev.get("transport"))
                        if ev.get("path"):
                            paths.add(str(ev["path"]))
                        if ev.get("copy"):
                            copies.add(str(ev["copy"]))

        readers = [threading.Thread(target=reader, args=(p,), daemon=True) for p in procs]
        for t in readers:
            t.start()

        def table() -> Table:
            m = dec.sched.metrics()
            tb = Table(show_header=False, box=None)
            done = sum(1 for t in dec.tracks.values() if t.state == "ready")
            tb.add_row("elapsed", f"{time.monotonic() - t0:.1f} s")
            tb.add_row("requests ready / failed", f"{done} / {sum(1 for s in outcomes.values() if s != 'received')}")
            tb.add_row("received", f"{dec.rx.stats['bytes'] / MiB:,.0f} MiB (tcp) ")
            tb.add_row("buffer blocks in use", f"{int(m['buffer_blocks_total'] - m['buffer_blocks_free'])} / {dec.nb}")
            tb.add_row("GPU blocks in use", f"{int(m['gpu_blocks_total'] - m['gpu_blocks_free'])} / {dec.gpu_blocks}")
            return tb

        limit = (a.duration or 0) + a.timeout * 20
        with Live(table(), console=console, refresh_per_second=4, transient=True) as live:
            while any(p.poll() is None for p in procs):
                if time.monotonic() - t0 > limit:
                    for p in procs:
                        p.kill()
                    dec.failures.append(f"run exceeded its bound of {limit:.0f}s; prefill killed")
                    break
                live.update(table())
                time.sleep(0.25)
            for t in readers:
                t.join(5)
        # let the last swaps and verifications finish (bounded)
        deadline = time.monotonic() + a.timeout * 2
        while time.monotonic() < deadline:
            pending = [
                r for r, s in outcomes.items() if s == "received" and dec.tracks.get(r, Track()).state != "ready"
            ]
            if not pending:
                break
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        # exit 1 is "some requests failed" (no output on stderr); anything on stderr, or
        # another code, is the rank itself failing (a traceback also exits 1)
        errs = []
        for p in procs:
            text = p.stderr.read().strip() if p.stderr else ""
            if text or p.returncode not in (0, 1):
                errs.append(text.splitlines()[-1] if text else f"prefill process died (exit code {p.returncode})")
        for e in errs:
            dec.failures.append(f"prefill: {e}")
        lay = dec.lays[0]
        rep = build_report(dec, prefill_reports, outcomes, elapsed, lay, a.decode_tp, reasons)
        rep["transport"] = a.transport
        rep["transports_chosen"] = sorted(set(chosen.values()))
        rep["data_paths"] = sorted(paths)
        rep["shm_copy"] = sorted(copies)
        rep["layout"] = KVLayout(**lay_kw).descriptor()
        rep["prefill_tp"], rep["decode_tp"] = a.prefill_tp, a.decode_tp
        if dec.cuda:
            rep["decode_devices"] = [dec.devices[r % len(dec.devices)] for r in range(a.decode_tp)]
        if prefill_on_gpu(a):
            pd = parse_devices(a.prefill_devices, "--prefill-devices")
            rep["prefill_devices"] = [pd[r % len(pd)] for r in range(a.prefill_tp)]
        if errs and rep["requests_failed"] == 0:
            rep["requests_failed"] = len(errs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for s in (p.stdout, p.stderr):
                if s:
                    s.close()
        dec.close()
    return _finish(a, rep, console, dec)


def _finish(a: argparse.Namespace, rep: dict[str, Any], console: Any, dec: DecodeSide) -> int:
    print_report(rep, console)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=2, default=float)
    if a.plot:
        write_plot(a.plot, dec)
    ok = rep["verify_errors"] == 0 and rep["requests_failed"] == 0 and rep["requests_ready"] > 0
    console.print(
        "[green]PASS[/green]" if ok else "[red]FAIL[/red]",
        f"{rep['requests_ready']} requests ready, {rep['bytes_verified']:,} bytes verified, "
        f"{rep['verify_errors']} verify errors, {rep['requests_failed']} failed",
    )
    return 0 if ok else 1


def run_decode(a: argparse.Namespace, console: Any) -> int:
    lay_kw = layout_kw(a)
    dec = DecodeSide(a, lay_kw)
    dec.start(a.listen)
    served = ", ".join(dec.rx.options.transports)
    data = f"; tcp data {dec.rx.data_address}" if "tcp" in dec.rx.options.transports else ""
    console.print(f"decode listening on {dec.rx.control_address} (serving {served}{data}); Ctrl-C to stop")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    t0 = time.monotonic()
    try:
        while not stop.is_set():
            if a.duration and time.monotonic() - t0 > a.duration:
                break
            if a.expect_requests and sum(1 for t in dec.tracks.values() if t.state) >= a.expect_requests:
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    try:
        rep = build_report(dec, [], {}, time.monotonic() - t0, dec.lays[0], a.decode_tp)
    finally:
        dec.close()
    return _finish(a, rep, console, dec)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pdkv-transfer-test", description=__doc__.splitlines()[0])
    p.add_argument(
        "mode",
        nargs="?",
        default="local",
        choices=["local", "decode", "prefill", "plan"],
        help="local (default): both sides on this host; decode/prefill: one side of a two-host test; "
        "plan: the capacity planner (replays --trace through the scheduler on a simulated clock)",
    )
    g = p.add_argument_group("endpoints")
    g.add_argument("--listen", default="", help="decode: ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555")
    g.add_argument("--connect", default="", help="prefill: decode's endpoint, e.g. tcp://decode-host:5555")
    g.add_argument("--data-host", default="127.0.0.1", help="decode: address of the TCP data listener")
    g.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "shm", "tcp", "rdma", "cuda_ipc", "nixl"],
        help="auto: shm on one host, else rdma where both hosts have a device, else tcp",
    )
    g.add_argument("--streams", type=int, default=1, help="TCP data connections per prefill rank")
    g.add_argument(
        "--rdma-device", default=None, help="rdma: the device (default: the one nearest a GPU cache, else the first)"
    )
    g.add_argument(
        "--rdma-gid-index", type=int, default=None, help="rdma: the GID index (default: RoCE v2 over IPv4 first)"
    )
    g.add_argument("--secret", default="", help="shared secret (>= 16 characters) to authenticate the pair")
    g = p.add_argument_group("layout")
    g.add_argument("--model", default="llama3-8b", help=f"layout preset: {', '.join(PRESETS)}")
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--tokens-per-block", type=int)
    g.add_argument("--dtype")
    g.add_argument("--prefill-tp", type=int, default=1)
    g.add_argument("--decode-tp", type=int, default=1)
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=24)
    g.add_argument("--prompt-len", default="512", help="N, uniform:MIN:MAX or lognormal:MEDIAN:SIGMA (tokens)")
    g.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight per prefill rank")
    g.add_argument("--trace", help="replay a Mooncake-format JSONL trace (timestamp ms, input_length)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival times by this")
    g.add_argument("--trace-limit", type=int, default=0, help="replay at most this many trace requests")
    g.add_argument("--layer-ms", type=float, default=0.0, help="simulated prefill compute time per layer")
    g.add_argument("--duration", type=float, default=0.0, help="stop issuing requests after this many seconds")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("decode")
    g.add_argument(
        "--buffer-gib",
        type=float,
        default=None,
        help="CPU buffer per decode rank (default: sized to the workload, its --concurrency largest requests)",
    )
    g.add_argument("--buffer-blocks", type=int, default=0, help="CPU buffer in blocks (overrides --buffer-gib)")
    g.add_argument("--gpu-blocks", type=int, default=0, help="decode GPU block budget (small forces the buffer path)")
    g.add_argument("--lease-s", type=float, default=30.0)
    g.add_argument("--no-gpu", action="store_true", help="use host memory for decode blocks even with a GPU")
    g.add_argument(
        "--decode-devices",
        default="0",
        help="CUDA devices of the decode ranks' GPU caches, comma-separated: rank r on the (r mod n)th",
    )
    g.add_argument("--no-verify", action="store_true")
    g.add_argument("--expect-requests", type=int, default=0, help="decode: stop after this many requests ended")
    g = p.add_argument_group("prefill")
    g.add_argument("--rank", type=int, default=0)
    g.add_argument("--instance", default="pdkv-test-prefill")
    g.add_argument("--prefill-blocks", type=int, default=64, help="prefill cache blocks per rank")
    g.add_argument(
        "--prefill-devices",
        default="0",
        help="with a GPU prefill cache: CUDA devices of the ranks, comma-separated, rank r on the (r mod n)th",
    )
    g.add_argument(
        "--prefill-gpu",
        action="store_true",
        help="prefill caches in GPU memory (any transport: tcp and rdma stage them, or rdma registers them for "
        "GPUDirect; implied by --transport cuda_ipc)",
    )
    g.add_argument(
        "--token-ms",
        type=float,
        default=None,
        help="decode time per output token: decode holds a ready request's GPU blocks for output_length x this "
        "(default: 0 in a transfer test, finished at once; 30 in plan)",
    )
    g = p.add_argument_group("plan (capacity planner)")
    g.add_argument("--gpu-gib", type=float, default=16.0, help="decode GPU memory for the KV cache, per rank")
    g.add_argument(
        "--buffer-sweep",
        help="buffer sizes per decode rank to compare, GiB, comma-separated (default: 0 and 1/8..4 x the GPU pool)",
    )
    g.add_argument("--prefill-instances", type=int, default=1, help="prefill servers sharing the trace")
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=20000.0,
        help="prefill throughput of one instance (compute time = input_length / this; --layer-ms overrides)",
    )
    g.add_argument(
        "--bandwidth-gbps", type=float, default=0.0, help="prefill -> decode link, GB/s (default: measured here)"
    )
    g.add_argument("--swap-gbps", type=float, default=0.0, help="buffer -> GPU swap, GB/s (default: measured here)")
    g.add_argument(
        "--direct-to-gpu",
        action="store_true",
        help="the transport writes GPU blocks while decode has room (rdma GPUDirect, cuda_ipc, nixl VRAM); "
        "default: every transfer through the buffer and a swap (shm, tcp)",
    )
    g.add_argument(
        "--target-wait-ms", type=float, default=0.0, help="recommend the smallest buffer with p99 wait <= this"
    )
    g.add_argument("--target-ttft-ms", type=float, default=None, help="... and p99 time to first token <= this")
    g = p.add_argument_group("output")
    g.add_argument("--json", help="write every figure to this JSON file")
    g.add_argument("--plot", help="throughput and buffer occupancy over time (.png or .html)")
    g.add_argument("--timeout", type=float, default=10.0, help="bound on handshakes, grants and silence")
    return p


def _check_args(a: argparse.Namespace) -> None:
    for name in ("requests", "concurrency", "prefill_tp", "decode_tp", "streams", "prefill_blocks"):
        if getattr(a, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if (a.buffer_gib is not None and a.buffer_gib <= 0) or a.timeout <= 0 or a.time_scale <= 0:
        raise UsageError("--buffer-gib, --timeout and --time-scale must be positive")
    if a.secret and len(a.secret) < 16:
        raise UsageError("--secret must be at least 16 characters")
    if a.mode == "plan":
        _check_plan_args(a)
    if a.mode == "prefill" and not a.connect:
        raise UsageError("prefill mode needs --connect ADDR (decode's endpoint)")
    if a.mode == "decode" and not a.listen:
        raise UsageError("decode mode needs --listen ADDR, e.g. tcp://0.0.0.0:5555")
    if a.plot and not a.plot.endswith((".png", ".html")):
        raise UsageError("--plot needs a .png or .html file name")
    if a.trace and not os.path.exists(a.trace):
        raise UsageError(f"--trace {a.trace}: no such file")
    if a.rdma_gid_index is not None and not 0 <= a.rdma_gid_index <= 65535:
        raise UsageError(f"--rdma-gid-index {a.rdma_gid_index} must be in 0..65535")
    if a.transport == "cuda_ipc" and a.no_gpu:
        raise UsageError("--transport cuda_ipc writes decode's GPU blocks: it cannot run with --no-gpu")
    gpu_here = (a.mode != "decode" and prefill_on_gpu(a)) or (a.mode != "prefill" and a.transport == "cuda_ipc")
    ndev = _ffi.cuda.device_count()
    if gpu_here and ndev == 0:
        what = "--transport cuda_ipc" if a.transport == "cuda_ipc" else "--prefill-gpu"
        why = "" if _ffi.cuda.bindings_available() else " (cuda-bindings not installed: pip install 'pdkv[cuda]')"
        raise UsageError(f"{what} needs a CUDA GPU on this host; none found{why}")
    for flag, value, used in (
        ("--prefill-devices", a.prefill_devices, a.mode != "decode" and prefill_on_gpu(a)),
        ("--decode-devices", a.decode_devices, a.mode != "prefill" and ndev > 0 and not a.no_gpu),
    ):
        devs = parse_devices(value, flag)
        if used and max(devs) >= ndev:
            raise UsageError(f"{flag} {value}: this host has {ndev} CUDA device(s), 0..{ndev - 1}")
    try:
        lay_kw = layout_kw(a)
        KVLayout(**lay_kw, tp_size=a.prefill_tp)
        KVLayout(**lay_kw, tp_size=a.decode_tp)
    except PdkvError as exc:
        raise UsageError(str(exc)) from None


def _check_plan_args(a: argparse.Namespace) -> None:
    if not a.trace:
        raise UsageError("plan needs --trace FILE (a Mooncake-format JSONL trace, e.g. tests/data/*.jsonl)")
    for name in ("gpu_gib", "prefill_tokens_per_s"):
        v = getattr(a, name)
        if not math.isfinite(v) or v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number")
    for name in ("bandwidth_gbps", "swap_gbps", "target_wait_ms", "layer_ms"):
        v = getattr(a, name)
        if not math.isfinite(v) or v < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
    if a.target_ttft_ms is not None and not (math.isfinite(a.target_ttft_ms) and a.target_ttft_ms > 0):
        raise UsageError("--target-ttft-ms must be a positive number")
    if a.prefill_instances <= 0:
        raise UsageError("--prefill-instances must be positive")
    if a.token_ms is None:
        a.token_ms = 30.0


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    console = Console(stderr=False)
    try:
        a = build_parser().parse_args(argv)
        _check_args(a)
        if a.mode == "prefill":

            def emit(d: dict[str, Any]) -> None:
                print(json.dumps(d), flush=True)

            return run_prefill(a, emit)
        if a.mode == "decode":
            return run_decode(a, console)
        if a.mode == "plan":
            from .capacity import run_plan

            return run_plan(a, console, layout_kw(a))
        return run_local(a, console)
    except UsageError as exc:
        print(f"pdkv-transfer-test: error: {exc}", file=sys.stderr)
        return 2
    except PdkvError as exc:
        print(f"pdkv-transfer-test: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
