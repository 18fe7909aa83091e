"""The tool's flags checked before any work: rates with their units, which flags each mode
reads, host names that resolve, numbers that are numbers, output paths, the secret; each
problem a :class:`UsageError` of one line."""

from __future__ import annotations

import argparse
import math
import os

from ... import _ffi
from ...errors import PdkvError
from ...layout import KVLayout
from .prefill_mode import prefill_on_gpu
from .workload import UsageError, layout_kw, parse_devices

MAX_GPU_GIB = 1024  # a rank's KV cache in plan: above every GPU's memory, far below what would exhaust this host

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
