"""Helpers shared by the benchmark scripts in tools/ (run as `python tools/<script>.py`,
which puts this folder first on sys.path)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def torch_with_cuda(tool: str, why: str = "") -> Any:
    """torch, or None after saying what is missing (the caller exits 2)."""
    try:
        import torch
    except ImportError:
        print(f"{tool} needs torch{why}", file=sys.stderr)
        return None
    if not torch.cuda.is_available():
        print(f"{tool} needs a CUDA GPU", file=sys.stderr)
        return None
    return torch


def send_and_wait(tx: Any, items: list, timeout: float = 120) -> float:
    """One layer of ``items`` (request id, source blocks) through a PrefillSender, the
    batch finished together (``finish_many``, as an engine ends a batch); seconds from
    handing the layer over to the last definite outcome. Raises AssertionError unless
    every outcome is ok."""
    rids = [r for r, _ in items]
    t0 = time.perf_counter()
    tx.send_layer(0, items)
    tx.finish_many(rids)
    outs = [tx.wait_outcome(r, timeout) for r in rids]
    dt = time.perf_counter() - t0
    assert all(o.ok for o in outs), outs
    return dt


def stop_decode(child: Any) -> None:
    """End a benchmark's decode process and remove the segment its kill leaves behind."""
    child.kill()
    child.wait(10)
    child.stdout.close()
    from pdkv.buffer.sweeper import clean_segments

    clean_segments(dry_run=False, tag=os.environ.get("PDKV_SHM_TAG") or None)


def ucx_env(ucx: str, gpu: bool = False) -> dict[str, str]:
    """The environment for UCX ``ucx`` (``tcp``, ``cma`` as ``cma,tcp``, or ``default``: UCX's
    own choice) over loopback, for a child process; set in this process too (UCX reads it
    at start). ``gpu``: add ``cuda_copy``, which NIXL's UCX backend needs on a GPU host."""
    from pdkv import _ffi

    env = dict(os.environ)
    if ucx == "default":
        env.pop("UCX_TLS", None)
        env.pop("UCX_NET_DEVICES", None)
        os.environ.pop("UCX_TLS", None)
        os.environ.pop("UCX_NET_DEVICES", None)
        return env
    tls = "tcp" if ucx == "tcp" else "cma,tcp"
    # on a GPU host NIXL's UCX backend refuses a UCX without a CUDA transport
    env.update(UCX_TLS=tls + (",cuda_copy" if gpu or _ffi.cuda.device_count() else ""), UCX_NET_DEVICES="lo")
    os.environ.update({k: env[k] for k in ("UCX_TLS", "UCX_NET_DEVICES")})
    return env


def recorded_ids(spec: str, blocks: int) -> tuple[list[int], list[int], int]:
    """Block ids as real allocators handed them out: ``FILE:SCENARIO`` names a
    ``tools/piece_sizes.py --ids-out`` file and one of its scenarios (``fresh_nocache``,
    ``fresh_cache``, ``churn_nocache``, ``churn_cache``). Whole recorded swaps from the middle
    of the trace on, in order, until ``blocks``; each swap's ids renumbered on each side so
    that ids adjacent before are adjacent after and others are not (its runs, and so its
    pieces, unchanged), each swap in an id range of its own (a block moved once a call).
    The id space is at most twice the blocks. Returns src, dst and the ids a side needs.
    SystemExit names what is wrong with the file or the scenario."""
    import numpy as np

    path, _, key = spec.rpartition(":")
    try:
        z = np.load(path)
        src, dst, lens = z[key + "_src"], z[key + "_dst"], z[key + "_len"]
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"--ids {spec}: not a piece_sizes.py --ids-out file with scenario {key!r} ({e})") from None
    ends = np.cumsum(lens)
    starts = ends - lens

    def renumber(ids: list[int], base: int) -> list[int]:
        new, prev, at = {}, None, base - 1
        for x in sorted(set(ids)):
            at += 1 if prev is not None and x == prev + 1 else 2
            new[x] = at
            prev = x
        return [new[x] for x in ids]

    s_out: list[int] = []
    d_out: list[int] = []
    top_s = top_d = 0
    for i in range(len(lens) // 2, len(lens)):
        room = blocks - len(s_out)
        s = renumber(src[starts[i] : ends[i]].tolist()[:room], top_s)
        d = renumber(dst[starts[i] : ends[i]].tolist()[:room], top_d)
        if s:
            s_out += s
            d_out += d
            top_s, top_d = max(s) + 1, max(d) + 1
        if len(s_out) == blocks:
            break
    if len(s_out) < blocks:
        raise SystemExit(f"--ids {spec}: the second half of the trace moves {len(s_out)} blocks, not {blocks}")
    return s_out, d_out, max(top_s, top_d) + 1
