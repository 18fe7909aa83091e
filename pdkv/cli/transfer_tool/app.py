"""The tool's command line: flags and their checks, the decode and prefill modes' console
wrappers, logging, exit codes (local mode: ``local_mode``; plan: ``plan_mode``; sweep:
``sweep``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

from ... import _ffi
from ...errors import PdkvError
from ...layout import KVLayout
from .decode_mode import DecodeSide
from .local_mode import _finish, run_local
from .prefill_mode import prefill_on_gpu, run_prefill
from .report import build_report, progress_bar
from .workload import PRESETS, Parser, UsageError, layout_kw, make_workload, parse_devices

MODES = ["local", "decode", "prefill", "plan", "sweep"]
MAX_GPU_GIB = 1024  # a rank's KV cache in plan: above every GPU's memory, far below what would exhaust this host
_FAILURES_SHOWN = 5  # failed requests prefill mode names one by one; the rest are counted by reason


def run_decode(a: argparse.Namespace, console: Any) -> int:
    lay_kw = layout_kw(a)
    dec = DecodeSide(a, lay_kw)
    note = dec.stale_segments_note()  # a killed earlier run's buffers: said before this one starts
    if note:
        print(f"pdkv-transfer-test: note: {note}", file=sys.stderr)
    dec.start(a.listen)
    served = ", ".join(dec.rx.options.transports)
    data = f"; tcp data {dec.rx.data_address}" if "tcp" in dec.rx.options.transports else ""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    t0 = time.monotonic()
    interrupted = False
    try:  # from the line that says it listens: a Ctrl-C any time after it is "interrupted"
        console.print(f"decode listening on {dec.rx.control_address} (serving {served}{data}); Ctrl-C to stop")
        while not stop.is_set():
            if a.duration and time.monotonic() - t0 > a.duration:
                break
            if a.expect_requests and dec.ended >= a.expect_requests:
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        interrupted = True
    try:
        rep = build_report(dec, None, time.monotonic() - t0, dec.lays[0], a.decode_tp)
    finally:
        dec.close()
    return _finish(a, rep, console, dec, interrupted)


# a capital B is bytes, a small b bits, as written on a NIC's or a bus's rating
_RATE_UNITS = {"GB/s": 1e9, "GiB/s": float(1 << 30), "MB/s": 1e6, "MiB/s": float(1 << 20)}
_RATE_UNITS |= {"Gb/s": 1.25e8, "Gbit/s": 1.25e8, "Mb/s": 1.25e5, "Mbit/s": 1.25e5}
# a bare number above these reads like gigabits (a NIC's rating): the unit must be said
_BARE_MAX = {"link": 64.0, "swap": 128.0}
# above any that exists: a link of 8 x 400 Gb/s NICs; a swap above a GPU's host link (GH200's C2C)
_RATE_MAX = {"link": 400.0, "swap": 500.0}


def _rate(text: str, what: str) -> float:
    """A rate in GB/s (10^9 bytes): a bare number is GB/s, or a number with one of
    :data:`_RATE_UNITS` (``25Gb/s`` is gigabits)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(\S*)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate: a number of GB/s, or 25Gb/s, 3.1GB/s, 800MB/s")
    value, unit = float(m.group(1)), m.group(2)
    if unit and unit not in _RATE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the unit {unit!r} is not one of {', '.join(_RATE_UNITS)} (B: bytes, b: bits)"
        )
    gbs = value * _RATE_UNITS[unit] / 1e9 if unit else value
    if not (math.isfinite(gbs) and gbs > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive rate (leave the flag out to measure it)")
    if not unit and gbs > _BARE_MAX[what]:
        raise argparse.ArgumentTypeError(
            f"{text} GB/s is more than a {what} usually carries: for a rating in gigabits write {text}Gb/s "
            f"({value / 8:g} GB/s); for gigabytes, {text}GB/s"
        )
    if gbs > _RATE_MAX[what]:
        top = _RATE_MAX[what]
        raise argparse.ArgumentTypeError(f"{text} is {gbs:g} GB/s, above any {what} there is ({top:g} GB/s)")
    return gbs


def _link_rate(text: str) -> float:
    return _rate(text, "link")


def _swap_rate(text: str) -> float:
    return _rate(text, "swap")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once: the help's own words where it gives them, else argparse's
    value, and none for a flag whose default is "not given" (None, False, "")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, "", argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


def build_parser() -> argparse.ArgumentParser:
    from ... import __version__

    p = Parser(
        prog="pdkv-transfer-test",
        description="Validate and size a prefill/decode pair: a verified KV transfer through decode's CPU buffer "
        "(local, or decode and prefill on two hosts), or the capacity planner (plan).",
        formatter_class=_Help,
        allow_abbrev=False,  # a misspelt flag is an error, never another flag
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "mode",
        nargs="?",
        default="local",
        choices=MODES,
        help="local: both sides on this host; decode/prefill: one side of a two-host test; "
        "plan: the capacity planner (replays --trace through the scheduler on a simulated clock); "
        "sweep: one local run per --sweep-tokens-per-block and --sweep-transports, a row each",
    )
    g = p.add_argument_group("endpoints")
    g.add_argument("--listen", default="", help="decode: ZeroMQ endpoint to bind, e.g. tcp://0.0.0.0:5555")
    g.add_argument("--connect", default="", help="prefill: decode's endpoint, e.g. tcp://decode-host:5555")
    g.add_argument("--data-host", default="127.0.0.1", help="decode: address of the TCP data listener")
    g.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "shm", "tcp", "rdma", "cuda_ipc", "nixl"],
        help="auto: a host cache offers shm, rdma (where the host has a device), nixl (where NIXL and a device "
        "are there), then tcp; a GPU cache (--prefill-gpu) offers cuda_ipc, then shm; decode picks the first it "
        "serves and can use",
    )
    g.add_argument(
        "--streams",
        type=int,
        default=None,
        help="TCP data connections per prefill rank (default: pdkv's default_streams(), half this host's CPUs, 2-8)",
    )
    g.add_argument(
        "--rdma-device", default=None, help="rdma: the device (default: the one nearest a GPU cache, else the first)"
    )
    g.add_argument(
        "--rdma-gid-index", type=int, default=None, help="rdma: the GID index (default: RoCE v2 over IPv4 first)"
    )
    g.add_argument(
        "--secret-file",
        default=None,
        help="a file holding the shared secret (>= 16 characters; one line) that authenticates the pair; "
        "default $PDKV_SECRET, else none (loopback only). Never on a command line: other local users read those",
    )
    g.add_argument("--secret", default="", help=argparse.SUPPRESS)  # refused: see _check_args
    g = p.add_argument_group("layout")
    g.add_argument("--model", default="llama3-8b", help=f"layout preset: {', '.join(PRESETS)}")
    g.add_argument("--layers", type=int, help="cache layers (default: the preset's)")
    g.add_argument("--kv-heads", type=int, help="KV heads of the whole model (default: the preset's)")
    g.add_argument("--head-dim", type=int, help="head dimension (default: the preset's)")
    g.add_argument("--tokens-per-block", type=int, help="tokens a block holds (default: the preset's)")
    g.add_argument("--dtype", help="bfloat16, float16, float8_e4m3fn, ... (default: the preset's)")
    g.add_argument("--prefill-tp", type=int, default=1, help="prefill tensor-parallel ranks (one process each)")
    g.add_argument("--decode-tp", type=int, default=1, help="decode tensor-parallel ranks")
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=24, help="requests to send (without --trace)")
    g.add_argument("--prompt-len", default="512", help="N, uniform:MIN:MAX or lognormal:MEDIAN:SIGMA (tokens)")
    g.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight per prefill rank")
    g.add_argument(
        "--trace", help="replay a Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids)"
    )
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply trace arrival times by this")
    g.add_argument("--trace-limit", type=int, default=0, help="replay at most this many trace requests (0: all)")
    g.add_argument("--layer-ms", type=float, default=0.0, help="simulated prefill compute time per layer")
    g.add_argument("--duration", type=float, default=0.0, help="stop issuing requests after this many seconds (0: no)")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths and arrivals")
    g = p.add_argument_group("decode")
    g.add_argument(
        "--buffer-gib",
        type=float,
        default=None,
        help="CPU buffer per decode rank (default: sized to the workload, its --concurrency largest requests)",
    )
    g.add_argument("--buffer-blocks", type=int, default=0, help="CPU buffer in blocks (overrides --buffer-gib)")
    g.add_argument(
        "--gpu-blocks",
        type=int,
        default=0,
        help="decode GPU block budget (0: as many as the buffer; small forces the buffer path)",
    )
    g.add_argument("--lease-s", type=float, default=30.0, help="grant lease: seconds without progress before expiry")
    g.add_argument("--no-gpu", action="store_true", help="use host memory for decode blocks even with a GPU")
    g.add_argument(
        "--decode-devices",
        default="0",
        help="CUDA devices of the decode ranks' GPU caches, comma-separated: rank r on the (r mod n)th",
    )
    g.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte check of every landed block")
    g.add_argument("--expect-requests", type=int, default=0, help="decode: stop after this many requests ended")
    g.add_argument(
        "--token-ms",
        type=float,
        default=None,
        help="decode time per output token: decode holds a ready request's GPU blocks for output_length x this "
        "(default: 0 in a transfer test, finished at once; 30 in plan)",
    )
    g = p.add_argument_group("prefill")
    g.add_argument("--rank", type=int, default=0, help="prefill mode: this process's TP rank")
    g.add_argument("--instance", default="pdkv-test-prefill", help="prefill mode: the instance name decode sees")
    g.add_argument(
        "--prefill-blocks", type=int, default=64, help="prefill cache blocks per rank (at least the largest request)"
    )
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
    g.add_argument("--events", action="store_true", help=argparse.SUPPRESS)  # prefill: JSON lines for local mode
    g = p.add_argument_group("plan (capacity planner)")
    g.add_argument(
        "--gpu-gib",
        type=float,
        default=None,
        help="decode GPU memory for the KV cache, per rank (default: what the trace needs, from its load)",
    )
    g.add_argument(
        "--buffer-sweep",
        help="buffer sizes per decode rank to compare, GiB, comma-separated (default: none, then powers of two "
        "from the largest request routed through the buffer, or 1/8 of the GPU pool, up to 4 x the GPU pool)",
    )
    g.add_argument(
        "--prefill-instances",
        type=int,
        default=None,
        help="prefill servers sharing the trace (default: what the trace needs at 80%% load)",
    )
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=20000.0,
        help="prefill throughput of one instance (compute time = input_length / this; --layer-ms overrides)",
    )
    g.add_argument(
        "--prefill-overhead-ms",
        type=float,
        default=0.0,
        help="a prefill instance's fixed time per request besides compute (control round trips, scheduling); "
        "a transfer test run reports it as prefill_fixed_ms",
    )
    g.add_argument(
        "--bandwidth-gbps",
        type=_link_rate,
        default=None,
        metavar="RATE",
        help="prefill -> decode link: gigaBYTES a second, or with a unit, 25Gb/s (gigabits), "
        "3.1GB/s, 2.9GiB/s, 800MB/s (default: measured here on loopback)",
    )
    g.add_argument(
        "--swap-gbps",
        type=_swap_rate,
        default=None,
        metavar="RATE",
        help="buffer -> GPU swap: gigaBYTES a second, or with a unit as --bandwidth-gbps (default: measured here)",
    )
    g.add_argument(
        "--direct-to-gpu",
        action="store_true",
        help="the transport writes GPU blocks while decode has room (rdma GPUDirect, cuda_ipc, nixl VRAM); "
        "default: every transfer through the buffer and a swap (shm, tcp)",
    )
    g.add_argument(
        "--target-wait-ms",
        type=float,
        default=None,
        help="recommend the smallest buffer with p99 prefill wait <= this (default: --target-wait-fraction)",
    )
    g.add_argument(
        "--target-wait-fraction",
        type=float,
        default=0.1,
        help="without --target-wait-ms: recommend the smallest buffer whose p99 prefill wait is at most this "
        "fraction of the no-buffer p99 wait",
    )
    g.add_argument("--target-ttft-ms", type=float, default=None, help="... and p99 time to first token <= this")
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep-tokens-per-block", default="16,32,64,128", help="sweep: block sizes in tokens")
    g.add_argument("--sweep-transports", default="shm,tcp", help="sweep: transports, comma-separated")
    g.add_argument("--sweep-reps", type=int, default=3, help="sweep: runs of each point (medians reported)")
    g = p.add_argument_group("output")
    g.add_argument("--json", help="write every figure to this JSON file")
    g.add_argument("--plot", help="local/decode: throughput and occupancy over time; plan: the sweep (.png or .html)")
    g.add_argument("--timeout", type=float, default=10.0, help="bound on handshakes, grants and silence (s)")
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="decode or prefill mode: serve Prometheus metrics on this port (0: any free one; needs pdkv[metrics])",
    )
    g.add_argument("--metrics-addr", default="127.0.0.1", help="decode: the metrics endpoint's address")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    g.add_argument(
        "-v", "--verbose", action="count", default=0, help="log pdkv's messages (warnings always; -v info, -vv debug)"
    )
    return p


def _read_secret(path: str | None) -> str:
    """The shared secret: the first line of ``path``, else ``$PDKV_SECRET``, else none."""
    if path is None:
        return os.environ.get("PDKV_SECRET", "")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(4096)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--secret-file {path}: {exc}") from None
    lines = text.splitlines()
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise UsageError(f"--secret-file {path} is empty")
    return secret


_PLAN_ONLY = (
    "--bandwidth-gbps --buffer-sweep --direct-to-gpu --gpu-gib --prefill-instances --prefill-overhead-ms "
    "--prefill-tokens-per-s --swap-gbps --target-ttft-ms --target-wait-fraction --target-wait-ms"
).split()
# a flag that applies to some modes only: given to another, it is refused by name
_MODES_OF = {
    **dict.fromkeys(_PLAN_ONLY, ("plan",)),
    **dict.fromkeys(("--sweep-tokens-per-block", "--sweep-transports", "--sweep-reps"), ("sweep",)),
    "--rank": ("prefill",),
    "--connect": ("prefill",),
    "--expect-requests": ("decode",),
    "--listen": ("local", "decode"),
    "--data-host": ("local", "decode"),
    **dict.fromkeys(("--metrics-port", "--metrics-addr", "--secret-file"), ("local", "decode", "prefill")),
}


# every flag plan reads (the others are the transfer test's: plan refuses them by name)
_PLAN_READS = set(
    "--model --layers --kv-heads --head-dim --tokens-per-block --dtype --decode-tp --trace --time-scale "
    "--trace-limit --layer-ms --gpu-blocks --token-ms --json --plot -q --quiet -v --verbose -h --help --version".split()
    + _PLAN_ONLY
    + ["--buffer-sweep"]
)


def _check_modes(a: argparse.Namespace) -> None:
    for tok in getattr(a, "argv", ()):
        if tok == "--":
            break
        flag = tok.split("=", 1)[0]
        if a.mode == "plan" and flag.startswith("-") and flag not in _PLAN_READS and not flag[1:2].isdigit():
            raise UsageError(f"{flag} does not apply to plan mode (pdkv-transfer-test plan --help lists its flags)")
        modes = _MODES_OF.get(flag)
        if modes is not None and a.mode not in modes:
            which = modes[0] if len(modes) == 1 else ", ".join(modes[:-1]) + " and " + modes[-1]
            raise UsageError(f"{flag} does not apply to {a.mode} mode (only to {which})")


def _check_args(a: argparse.Namespace) -> None:
    _check_modes(a)
    for name in ("requests", "concurrency", "prefill_tp", "decode_tp", "prefill_blocks"):
        if getattr(a, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    for name in ("rate", "layer_ms", "duration", "buffer_blocks", "gpu_blocks", "trace_limit", "expect_requests"):
        v = getattr(a, name)
        if not math.isfinite(v) or v < 0:
            raise UsageError(f"--{name.replace('_', '-')} {v} must be >= 0")
    if a.metrics_port is not None and not 0 <= a.metrics_port <= 65535:
        raise UsageError(f"--metrics-port {a.metrics_port} must be in 0..65535")
    if a.metrics_port is not None:
        import importlib.util

        if importlib.util.find_spec("prometheus_client") is None:
            raise UsageError("--metrics-port needs prometheus_client: pip install 'pdkv[metrics]'")
    if a.token_ms is not None and not (math.isfinite(a.token_ms) and a.token_ms >= 0):
        raise UsageError(f"--token-ms {a.token_ms} must be >= 0")
    if not (math.isfinite(a.lease_s) and a.lease_s > 0):
        raise UsageError(f"--lease-s {a.lease_s} must be positive")
    if a.rank < 0 or (a.mode == "prefill" and a.rank >= a.prefill_tp):
        raise UsageError(f"--rank {a.rank} must be in 0..{a.prefill_tp - 1} (--prefill-tp {a.prefill_tp})")
    _check_outputs(a)
    for flag, v in (("--buffer-gib", a.buffer_gib), ("--timeout", a.timeout), ("--time-scale", a.time_scale)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise UsageError(f"{flag} {v} must be a positive number")
    _check_hosts(a)
    if a.secret:
        raise UsageError(
            "--secret puts the secret on the command line, where any local user reads it (/proc/PID/cmdline): "
            "give --secret-file PATH or $PDKV_SECRET"
        )
    a.secret = _read_secret(a.secret_file)
    if a.secret and len(a.secret) < 16:
        raise UsageError("the secret must be at least 16 characters")
    if a.mode == "plan":
        _check_plan_args(a)
    if a.mode == "prefill" and not a.connect:
        raise UsageError("prefill mode needs --connect ADDR (decode's endpoint)")
    if a.mode == "decode" and not a.listen:
        raise UsageError("decode mode needs --listen ADDR, e.g. tcp://0.0.0.0:5555")
    if a.trace and not os.path.exists(a.trace):
        raise UsageError(f"--trace {a.trace}: no such file")
    if a.streams is not None and not 1 <= a.streams <= 64:
        raise UsageError(f"--streams {a.streams} must be in 1..64")
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


def _check_hosts(a: argparse.Namespace) -> None:
    """Host names resolve before anything starts: an address that cannot is named, not a
    traceback from a bind or a 10 s wait for a connection that cannot be."""
    import socket
    from urllib.parse import urlsplit

    checks = []
    if a.mode in ("local", "decode", "sweep"):
        checks.append(("--data-host", a.data_host))
    if a.mode == "prefill" and a.connect.startswith("tcp://"):
        try:
            host = urlsplit(a.connect).hostname
        except ValueError:
            host = None
        if not host:
            raise UsageError(f"--connect {a.connect}: expected tcp://HOST:PORT")
        checks.append(("--connect", host))
    for flag, host in checks:
        if host == "*":
            continue
        try:
            socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            raise UsageError(f"{flag}: {host!r} is not an address this host can resolve ({why})") from None


def _check_outputs(a: argparse.Namespace) -> None:
    """Output paths checked before any work: a folder that exists and takes files, and
    matplotlib for a plot."""
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: no folder {folder}")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"{flag} {path}: cannot write into {folder}")
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path} is a folder")
    if a.plot:
        if not a.plot.endswith((".png", ".html")):
            raise UsageError(f"--plot {a.plot}: needs a .png or .html file name")
        if a.mode == "prefill":
            raise UsageError("--plot is decode's (local, decode or plan mode)")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'pdkv[plot]'") from None


def _check_plan_args(a: argparse.Namespace) -> None:
    if not a.trace:
        raise UsageError("plan needs --trace FILE (a Mooncake-format JSONL trace, e.g. tests/data/*.jsonl)")
    for name in ("gpu_gib", "prefill_tokens_per_s"):
        v = getattr(a, name)
        if v is not None and (not math.isfinite(v) or v <= 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number")
    if a.gpu_gib is not None and a.gpu_gib > MAX_GPU_GIB:
        raise UsageError(f"--gpu-gib {a.gpu_gib:g} is more KV cache than any GPU holds ({MAX_GPU_GIB} GiB a rank)")
    if a.gpu_blocks:
        lay = KVLayout(**layout_kw(a), tp_size=a.decode_tp)
        if a.gpu_blocks * lay.block_bytes > MAX_GPU_GIB << 30:
            raise UsageError(
                f"--gpu-blocks {a.gpu_blocks} is {a.gpu_blocks * lay.block_bytes / (1 << 30):,.0f} GiB a rank, more "
                f"KV cache than any GPU holds ({MAX_GPU_GIB} GiB)"
            )
    for name in ("bandwidth_gbps", "swap_gbps", "target_wait_ms", "layer_ms", "prefill_overhead_ms"):
        v = getattr(a, name)
        if v is not None and (not math.isfinite(v) or v < 0):
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
    if not (math.isfinite(a.target_wait_fraction) and 0 <= a.target_wait_fraction < 1):
        raise UsageError(f"--target-wait-fraction {a.target_wait_fraction} must be in [0, 1)")
    if a.target_ttft_ms is not None and not (math.isfinite(a.target_ttft_ms) and a.target_ttft_ms > 0):
        raise UsageError("--target-ttft-ms must be a positive number")
    if a.prefill_instances is not None and a.prefill_instances <= 0:
        raise UsageError("--prefill-instances must be positive")
    if a.token_ms is None:
        a.token_ms = 30.0


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    # piped (a log, a CI job): rich would cut tables and wrap lines at 80 columns; keep them whole
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 1000)
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        parser = build_parser()
        mode = next((t for t in argv if t in MODES), None)
        if mode is not None and any(t in ("-h", "--help") for t in argv):
            _help_for(parser, mode)  # exits
        _check_flags(parser, argv)
        a = parser.parse_args(argv)
        a.argv = argv
        _check_args(a)
        _configure_logging(a.verbose)
        if a.mode == "prefill":
            if a.events:  # a rank of local mode: one JSON line per event, for the tool's decode side
                out_lock = threading.Lock()

                def emit(d: dict[str, Any]) -> None:
                    # one write a line, under a lock: the sender's threads report outcomes
                    # while the main thread reports its own events (print writes the line and
                    # its newline apart, and two threads' lines could interleave)
                    line = json.dumps(d) + "\n"
                    with out_lock:
                        sys.stdout.write(line)
                        sys.stdout.flush()

                return run_prefill(a, emit)
            return run_prefill_console(a, console)
        if a.mode == "decode":
            return run_decode(a, console)
        if a.mode == "sweep":
            from .sweep import run_sweep

            return run_sweep(a, console)
        if a.mode == "plan":
            from .plan_mode import run_plan

            return run_plan(a, console, layout_kw(a))
        return run_local(a, console)
    except UsageError as exc:
        print(f"pdkv-transfer-test: error: {exc}", file=sys.stderr)
        return 2
    except PdkvError as exc:
        print(f"pdkv-transfer-test: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except zmq.ZMQError as exc:  # an endpoint that cannot be bound or connected
        where = getattr(a, "listen", "") or getattr(a, "connect", "") or "the control endpoint"
        print(f"pdkv-transfer-test: error: {where}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdkv-transfer-test: interrupted", file=sys.stderr)
        return 130


# the flag groups each mode reads (the rest are another mode's)
_MODE_GROUPS = {
    "local": ("endpoints", "layout", "workload", "decode", "prefill", "output"),
    "decode": ("endpoints", "layout", "decode", "output"),
    "prefill": ("endpoints", "layout", "workload", "prefill", "output"),
    "plan": ("layout", "workload", "decode", "plan (capacity planner)", "output"),
    "sweep": ("endpoints", "layout", "workload", "decode", "prefill", "sweep", "output"),
}


def _help_for(parser: argparse.ArgumentParser, mode: str) -> None:
    """``pdkv-transfer-test MODE --help``: that mode's flags only."""
    keep = set(_MODE_GROUPS[mode]) | {"options", "optional arguments"}
    parser._action_groups = [g for g in parser._action_groups if g.title in keep]
    if mode == "plan":  # of the groups plan shares with the transfer test, only what plan reads
        for g in parser._action_groups:
            g._group_actions = [
                act for act in g._group_actions if not act.option_strings or set(act.option_strings) & _PLAN_READS
            ]
    parser.usage = f"%(prog)s {mode} [flags]"
    parser.description = (parser.description or "") + f" This help: the flags of {mode} mode."
    parser.print_help()
    raise SystemExit(0)


def _configure_logging(verbose: int) -> None:
    """pdkv's warnings on stderr, one line each (a decode listening beyond loopback without
    a secret says so at once); ``-v``: its info messages too, timestamped; ``-vv``: debug."""
    import logging

    h = logging.StreamHandler(sys.stderr)
    log = logging.getLogger("pdkv")
    if verbose:
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        log.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    else:
        h.setFormatter(logging.Formatter("pdkv-transfer-test: %(levelname)s: %(message)s"))
        log.setLevel(logging.WARNING)
    log.addHandler(h)


def _check_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A flag the tool does not have, named with the nearest one it has (argparse would
    take its value for the mode and say "invalid choice")."""
    import difflib

    known = [o for act in parser._actions for o in act.option_strings]
    for tok in argv:
        if tok == "--":
            break
        if tok.startswith("-") and len(tok) > 1 and not tok[1:2].isdigit():
            flag = tok.split("=", 1)[0]
            if len(flag) > 2 and flag[1] != "-" and f"-{flag[1]}" in known and set(flag[1:]) == {flag[1]}:
                continue  # -vv: a counted short flag given twice
            if flag not in known:
                near = difflib.get_close_matches(flag, known, n=1)
                raise UsageError(f"unknown flag {flag}" + (f" (did you mean {near[0]}?)" if near else ""))
        elif tok.startswith("-"):
            continue


def run_prefill_console(a: argparse.Namespace, console: Any) -> int:
    """Prefill mode run by hand: a progress bar and a summary, not event lines."""

    n = len(make_workload(a))
    outcomes: dict[str, str] = {}
    waits: list[float] = []
    summary: dict[str, Any] = {}
    lines: list[str] = []
    failures: dict[str, int] = {}  # reason -> requests that failed for it
    progress = progress_bar(console, f"prefill rank {a.rank}", a.quiet)
    with progress:
        task = progress.add_task("sent", total=n)

        def emit(d: dict[str, Any]) -> None:
            kind = d.get("type")
            if kind == "hello":
                lines.append(f"connected to {a.connect}: transport {d['transport']} ({d.get('path') or 'direct'})")
                progress.console.print(lines[-1])
            elif kind == "metrics":
                progress.console.print(f"metrics on {d['url']}")
            elif kind == "grant":
                waits.append(float(d["wait"]))
            elif kind == "outcome":
                outcomes[d["rid"]] = d["state"]
                if d["state"] != "received":
                    # the first few failures as they come, then only a count: when decode dies,
                    # every request in flight fails for one reason
                    why = f"{d['state']} ({d.get('reason', '')})"
                    failures[why] = failures.get(why, 0) + 1
                    if sum(failures.values()) <= _FAILURES_SHOWN:
                        progress.console.print(f"[red]{d['rid']}: {why}[/red]")
                progress.update(task, completed=len(outcomes))
            elif kind == "summary":
                summary.update(d)

        rc = run_prefill(a, emit)
    ok = sum(1 for v in outcomes.values() if v == "received")
    gb = summary.get("bytes", 0) / 1e9
    el = summary.get("elapsed", 0.0)
    wait = f"{np.percentile(waits, 50) * 1e3:.1f} / {np.percentile(waits, 99) * 1e3:.1f} ms" if waits else "n/a"
    console.print(
        ("[green]PASS[/green]" if rc == 0 else "[red]FAIL[/red]")
        + f" {ok} of {n} requests received by decode, {len(outcomes) - ok} failed; {gb:.2f} GB sent in {el:.2f} s; "
        f"wait for decode blocks p50 / p99 {wait}"
    )
    if sum(failures.values()) > _FAILURES_SHOWN:
        for why, k in sorted(failures.items(), key=lambda kv: -kv[1])[:_FAILURES_SHOWN]:
            console.print(f"  {k} request(s) {why}")
    return rc
