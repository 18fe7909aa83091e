"""The tool's command line: flags and their checks, the decode and prefill modes' console
wrappers, logging, exit codes (local mode: ``local_mode``; plan: ``plan_mode``; sweep:
``sweep``)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

from ...errors import PdkvError
from .checks import _MODES_OF, _PLAN_READS, _check_args, _link_rate, _swap_rate
from .decode_mode import DecodeSide
from .local_mode import _finish, run_local
from .prefill_mode import run_prefill
from .report import build_report, progress_bar
from .workload import PRESETS, Parser, UsageError, layout_kw, make_workload

MODES = ["local", "decode", "prefill", "plan", "sweep"]
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

    def reads(act: argparse.Action) -> bool:
        if not act.option_strings:
            return True  # the mode itself
        if act.help == argparse.SUPPRESS:
            return False
        if mode == "plan":
            return bool(set(act.option_strings) & _PLAN_READS)
        return all(mode in _MODES_OF.get(o, MODES) for o in act.option_strings)

    for g in parser._action_groups:  # of the groups a mode shares, only the flags it reads
        g._group_actions = [act for act in g._group_actions if reads(act)]
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
