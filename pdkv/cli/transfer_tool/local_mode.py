"""The tool's local mode: a decode side in this process and one prefill process per rank on
this host, the requests driven and every byte verified, then the report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from ... import _ffi
from ...layout import KVLayout
from .decode_mode import DecodeSide
from .prefill_mode import prefill_on_gpu
from .report import build_report, print_report, progress_bar, write_plot
from .stats import PrefillTally
from .workload import MiB, layout_kw, make_workload, parse_devices


def _prefill_argv(a: argparse.Namespace, addr: str, rank: int) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "pdkv.cli.transfer_tool",
        "prefill",
        "--events",
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
        *(["--streams", str(a.streams)] if a.streams is not None else []),
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
    return argv  # the secret goes in the environment (PDKV_SECRET), never on a command line


def run_local(a: argparse.Namespace, console: Any) -> int:
    from rich.progress import TextColumn

    lay_kw = layout_kw(a)
    KVLayout(**lay_kw, tp_size=a.prefill_tp).check_compatible(KVLayout(**lay_kw, tp_size=a.decode_tp))
    work = make_workload(a)  # validated before anything starts
    dec = DecodeSide(a, lay_kw)
    note = dec.stale_segments_note()  # a killed earlier run's buffers: said before this one starts
    if note:
        print(f"pdkv-transfer-test: note: {note}", file=sys.stderr)
    dec.start(a.listen or "tcp://127.0.0.1:0")
    procs: list[subprocess.Popen[str]] = []
    pre = PrefillTally(a.prefill_tp)  # the ranks' event lines, folded as they come
    chosen: dict[int, str] = {}  # prefill rank -> the transport decode chose for it
    copies: set[str] = set()  # which copy the shm senders from host caches run
    paths: set[str] = set()  # the data paths the senders run ("tcp staged (kernel gather)")
    lock = threading.Lock()
    unreadable = [0]  # event lines from the prefill ranks that did not parse
    t0 = time.monotonic()
    interrupted = False
    rep: dict[str, Any] = {}
    try:
        # the ranks of the one prefill instance prove they are one with a key they share
        # (handed over in the environment, never on a command line other users can read)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PDKV_INSTANCE_KEY=os.urandom(32).hex())
        env.pop("PDKV_SECRET", None)
        if a.secret:
            env["PDKV_SECRET"] = a.secret
        for r in range(a.prefill_tp):
            procs.append(
                subprocess.Popen(
                    _prefill_argv(a, dec.rx.control_address, r),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    start_new_session=True,  # Ctrl-C reaches the tool, which stops them
                )
            )

        def reader(p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                try:
                    ev = json.loads(line)
                except ValueError:
                    if line.strip():  # an event lost would make figures wrong: say so, and fail
                        with lock:
                            unreadable[0] += 1
                            dec.note_failure(f"a prefill rank wrote an unreadable event line: {line[:120]!r}")
                    continue
                with lock:
                    try:
                        pre.event(ev)
                    except (KeyError, TypeError, ValueError) as exc:
                        unreadable[0] += 1
                        dec.note_failure(f"a prefill rank wrote a malformed event ({exc}): {line[:120]!r}")
                    if ev.get("type") == "hello":
                        chosen[int(ev.get("rank", -1))] = str(ev.get("transport"))
                        if ev.get("path"):
                            paths.add(str(ev["path"]))
                        if ev.get("copy"):
                            copies.add(str(ev["copy"]))

        readers = [threading.Thread(target=reader, args=(p,), daemon=True) for p in procs]
        for t in readers:
            t.start()
        progress = progress_bar(console, "requests", a.quiet, TextColumn("{task.fields[info]}"))

        def info() -> str:
            m = dec.sched.metrics()
            failed = len(pre.failed) + len(dec.tally.failed)
            return (
                f"{dec.received_bytes() / MiB:,.0f} MiB landed, buffer "
                f"{int(m['buffer_blocks_total'] - m['buffer_blocks_free'])}/{dec.nb}, GPU "
                f"{int(m['gpu_blocks_total'] - m['gpu_blocks_free'])}/{dec.gpu_blocks}"
                + (f", {failed} failed" if failed else "")
            )

        limit = (a.duration or 0) + a.timeout * 20 + (max(r.arrival for r in work) if work else 0)
        try:
            with progress:
                task = progress.add_task("run", total=len(work), info=info())
                while any(p.poll() is None for p in procs):
                    if time.monotonic() - t0 > limit:
                        for p in procs:
                            p.kill()
                        dec.note_failure(f"run exceeded its bound of {limit:.0f}s; prefill killed")
                        break
                    progress.update(task, completed=dec.ended, info=info())
                    time.sleep(0.25)
                for t in readers:
                    t.join(5)
                # let the last swaps and verifications finish (bounded)
                deadline = time.monotonic() + a.timeout * 2
                while time.monotonic() < deadline:
                    with dec.lock:
                        pending = any(t.received and t.state != "ready" for t in dec.tracks.values())
                    if not pending:
                        break
                    time.sleep(0.02)
                progress.update(task, completed=dec.ended, info=info())
        except KeyboardInterrupt:
            interrupted = True
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
        wall = time.monotonic() - t0
        # exit 1 is "some requests failed" (no output on stderr); anything on stderr, or
        # another code, is the rank itself failing (a traceback also exits 1)
        errs = []
        for p in procs:
            try:
                p.wait(5 if interrupted else 10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            text = p.stderr.read().strip() if p.stderr else ""
            if not interrupted and (text or p.returncode not in (0, 1)):
                errs.append(text.splitlines()[-1] if text else f"prefill process died (exit code {p.returncode})")
        for e in errs:
            dec.note_failure(f"prefill: {e}")
        lay = dec.lays[0]
        with lock:
            rep = build_report(
                dec,
                pre,
                wall,
                lay,
                a.decode_tp,
                # a duration or an interrupt may leave some unissued: those are not lost
                requests=None if a.duration or interrupted else len(work),
            )
        if interrupted:
            rep["requests_not_issued"] = max(0, len(work) - rep["requests"])
        rep["prefill_compute_ms_p50"] = pre.computes.percentile(50) * 1e3 if len(pre.computes) else 0.0
        # prefill's own rate: prompt tokens over the time from grant to last layer computed
        busy = pre.computes.total
        rep["prefill_tokens_per_s"] = pre.compute_tokens / busy if busy > 0 else 0.0
        # the planner's prefill cost, fixed + tokens / rate, fitted to the server's time per
        # request less its wait for decode blocks beyond the control round trip (the planner
        # simulates that wait itself)
        if pre.fit.n:
            fixed, rate = pre.prefill_fit()
            rep["prefill_fixed_ms"], rep["prefill_fit_tokens_per_s"] = fixed * 1e3, rate
        rep["transport"] = a.transport
        rep["event_lines_unreadable"] = unreadable[0]
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
    return _finish(a, rep, console, dec, interrupted)


def _finish(a: argparse.Namespace, rep: dict[str, Any], console: Any, dec: DecodeSide, interrupted: bool) -> int:
    rep["run"] = describe_run(a, dec)
    tl = dec.timeline.points  # the plot's data: seconds, buffer and GPU blocks in use, bytes landed
    rep["timeline"] = {k: [x[i] for x in tl] for i, k in enumerate(("t_s", "buffer_blocks", "gpu_blocks", "bytes"))}
    rep.update(run_facts(a))
    print_report(rep, console)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=2, default=float)
    if a.plot:
        write_plot(a.plot, dec)
    if interrupted:
        console.print(
            f"[yellow]interrupted[/yellow]: {rep['requests_ready']} requests ready, "
            f"{rep['bytes_verified']:,} bytes verified, {rep['verify_errors']} verify errors"
        )
        return 130
    ok = rep["verify_errors"] == 0 and rep["requests_failed"] == 0 and rep["requests_ready"] > 0
    ok = ok and not rep.get("event_lines_unreadable")
    console.print(
        "[green]PASS[/green]" if ok else "[red]FAIL[/red]",
        f"{rep['requests_ready']} requests ready, {rep['bytes_verified']:,} bytes verified, "
        f"{rep['verify_errors']} verify errors, {rep['requests_failed']} failed",
    )
    return 0 if ok else 1


def describe_run(a: argparse.Namespace, dec: DecodeSide) -> str:
    """One line: what ran, above the table."""
    lay = dec.lays[0]
    host = socket.gethostname()
    return (
        f"{a.model}: {lay.total_layers} layers, {'MLA' if lay.mla else f'{lay.kv_heads} KV heads'} x {lay.head_dim}, "
        f"{lay.dtype}, {lay.tokens_per_block} tokens a block ({lay.block_bytes * a.decode_tp / MiB:.2f} MiB over "
        f"decode's ranks); prefill TP {a.prefill_tp} -> decode TP {a.decode_tp}; buffer {dec.nb} blocks "
        f"({dec.nb * lay.block_bytes / (1 << 30):.2f} GiB a rank), {dec.gpu_blocks} {'GPU' if dec.cuda else 'host'} "
        f"blocks; transport {a.transport}; host {host}"
    )


def run_facts(a: argparse.Namespace) -> dict[str, Any]:
    """What a JSON report carries besides the figures: the command, version, time, host."""
    from ... import __version__

    facts: dict[str, Any] = {
        "argv": sys.argv[1:] if a.argv is None else a.argv,
        "version": __version__,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {
            "hostname": socket.gethostname(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cuda_devices": _ffi.cuda.device_count(),
            "rdma_devices": list(_ffi.verbs.rdma_devices()),
        },
    }
    return facts
