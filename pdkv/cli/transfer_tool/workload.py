"""The tool's workload: model presets, request streams, and the byte pattern every block is verified against."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import zlib
from dataclasses import dataclass
from typing import IO, Any, NoReturn

import numpy as np

from ... import _ffi
from ...layout import KVLayout

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(num_layers=32, kv_heads=8, head_dim=128, tokens_per_block=64, dtype="bfloat16"),
    "llama3-70b": dict(num_layers=80, kv_heads=8, head_dim=128, tokens_per_block=64, dtype="bfloat16"),
    "qwen2.5-7b": dict(num_layers=28, kv_heads=4, head_dim=128, tokens_per_block=64, dtype="bfloat16"),
    "qwen2.5-72b": dict(num_layers=80, kv_heads=8, head_dim=128, tokens_per_block=64, dtype="bfloat16"),
    "deepseek-v3": dict(num_layers=61, kv_heads=1, head_dim=576, tokens_per_block=64, dtype="bfloat16", mla=True),
    "tiny": dict(num_layers=4, kv_heads=4, head_dim=64, tokens_per_block=16, dtype="bfloat16"),
}
MiB = 1 << 20


class UsageError(Exception):
    """Bad flags or configuration: one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, no usage dump
        raise UsageError(message)


# ---------------------------------------------------------------------- data pattern


def _keys(rkey: int, layer: int, t: int, gis: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """uint32 key per (block index in the request, global head)."""
    with np.errstate(over="ignore"):
        k = (
            np.uint32(rkey) * np.uint32(0x9E3779B1)
            + np.uint32(layer) * np.uint32(0x85EBCA77)
            + np.uint32(t) * np.uint32(0xC2B2AE3D)
        )
        out: np.ndarray = (
            k
            + gis.astype(np.uint32)[:, None] * np.uint32(0x27D4EB2F)
            + heads.astype(np.uint32)[None, :] * np.uint32(0x165667B1)
        )
        return out


def pattern(lay: KVLayout, rkey: int, layer: int, t: int, gis: np.ndarray) -> np.ndarray:
    """Expected content of blocks ``gis`` (indices within the request) of one rank:
    uint8 array [len(gis), tensor_block_bytes]. Head-major: head h's slice holds
    arange + key(h), so any misplaced head, token or block shows."""
    h0, h1 = lay.head_range()
    tb = lay.tensor_block_bytes(t)
    words = tb // lay.heads_per_rank // 4
    keys = _keys(rkey, layer, t, gis, np.arange(h0, h1))
    with np.errstate(over="ignore"):
        v = np.arange(words, dtype=np.uint32)[None, None, :] + keys[:, :, None]
    out: np.ndarray = v.reshape(len(gis), -1).view(np.uint8)
    return out


def request_key(rid: str) -> int:
    return zlib.crc32(rid.encode())


# ---------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Req:
    rid: str
    arrival: float
    tokens: int
    output: int


MAX_TRACE_TOKENS = 10_000_000  # a trace request's input + output: the longest context a model offers


@dataclass(frozen=True, slots=True)
class TraceRequest:
    rid: str
    arrival: float  # seconds
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: str, limit: int = 0, time_scale: float = 1.0) -> list[TraceRequest]:
    """A Mooncake-format JSONL trace (gzip-compressed too); every line checked, errors name
    the line."""
    out: list[TraceRequest] = []
    try:
        with open(path, "rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"
        f: IO[str] = gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")  # noqa: SIM115
        with f:
            for i, line in enumerate(f, 1):
                if limit and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    ts, n_in = d["timestamp"], d["input_length"]
                    n_out = d.get("output_length", 1)
                    hashes = d.get("hash_ids", [])
                except (ValueError, KeyError, TypeError) as exc:
                    raise UsageError(f"--trace {path} line {i}: not a trace record ({exc})") from None
                ok = (
                    isinstance(ts, (int, float))
                    and ts >= 0
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in (n_in, n_out))
                    and n_in > 0
                    and n_out >= 0
                    and isinstance(hashes, list)
                    and all(isinstance(h, int) for h in hashes)
                )
                if not ok:
                    raise UsageError(
                        f"--trace {path} line {i}: needs timestamp >= 0 (ms), input_length > 0, "
                        "output_length >= 0 (integers) and hash_ids (a list of integers)"
                    )
                if n_in + n_out > MAX_TRACE_TOKENS or not math.isfinite(ts / 1000.0 * time_scale):
                    raise UsageError(
                        f"--trace {path} line {i}: {n_in} + {n_out} tokens is more than any model's context "
                        f"({MAX_TRACE_TOKENS:,} tokens; timestamp {ts}): an outlier stops the run; remove the line"
                    )
                out.append(TraceRequest(f"t{i - 1}", ts / 1000.0 * time_scale, n_in, n_out, tuple(hashes)))
    except UnicodeDecodeError as exc:
        raise UsageError(f"--trace {path}: not UTF-8 text (JSON lines, plain or gzip): {exc.reason}") from None
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise UsageError(f"--trace {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not out:
        raise UsageError(f"--trace {path}: no requests")
    return out


def make_workload(a: argparse.Namespace) -> list[Req]:
    rng = np.random.default_rng(a.seed)
    if a.trace:  # every line checked as the planner checks it, errors naming the line
        return [
            Req(t.rid, t.arrival, t.input_tokens, t.output_tokens)
            for t in read_trace(a.trace, a.trace_limit, a.time_scale)
        ]
    n = a.requests
    dist = a.prompt_len
    try:
        if ":" not in dist:
            lens = np.full(n, int(dist))
        else:
            kind, *ps = dist.split(":")
            ps = [float(x) for x in ps]
            if kind == "uniform":
                lens = rng.integers(int(ps[0]), int(ps[1]) + 1, n)
            elif kind == "lognormal":
                lens = np.maximum(1, rng.lognormal(math.log(ps[0]), ps[1], n)).astype(int)
            else:
                raise ValueError(kind)
    except (ValueError, IndexError):
        raise UsageError(f"--prompt-len {dist!r}: use N, uniform:MIN:MAX or lognormal:MEDIAN:SIGMA") from None
    if (lens <= 0).any():
        raise UsageError("--prompt-len must be positive")
    gaps = rng.exponential(1.0 / a.rate, n) if a.rate > 0 else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [Req(f"r{i}", float(arrivals[i]), int(lens[i]), 1) for i in range(n)]


def workload_buffer_blocks(reqs: list[Req], concurrency: int, tokens_per_block: int) -> int:
    """Buffer blocks per rank that hold the ``concurrency`` largest requests of the workload
    at once: what the tool's decode needs when it sizes the buffer itself."""
    sizes = sorted((-(-r.tokens // tokens_per_block) for r in reqs), reverse=True)
    return sum(sizes[: max(1, concurrency)])


def layout_kw(a: argparse.Namespace) -> dict[str, Any]:
    if a.model not in PRESETS:
        raise UsageError(f"--model {a.model!r}: choose one of {', '.join(PRESETS)}")
    kw = dict(PRESETS[a.model])
    for f, attr in (
        ("num_layers", "layers"),
        ("kv_heads", "kv_heads"),
        ("head_dim", "head_dim"),
        ("tokens_per_block", "tokens_per_block"),
        ("dtype", "dtype"),
    ):
        v = getattr(a, attr)
        if v is not None:
            kw[f] = v
    return kw


def parse_devices(value: str, flag: str) -> list[int]:
    """A comma-separated list of CUDA device ordinals."""
    try:
        devs = [int(x) for x in value.split(",")]
    except ValueError:
        devs = []
    if not devs or min(devs) < 0:
        raise UsageError(f"{flag} {value!r}: expected CUDA device ordinals, comma-separated, e.g. 0 or 0,1")
    return devs


def served_transports(transport: str, gpu_blocks: bool = False) -> list[str]:
    """What the decode side serves: the one asked for, or under auto shm, rdma and nixl
    (where this host has an RDMA device; nixl where NIXL is installed), tcp, and cuda_ipc
    when decode's blocks are GPU memory. Prefill's offer order decides among them."""
    if transport != "auto":
        return [transport]
    served = ["shm", "tcp"]
    if _ffi.verbs.rdma_devices():
        served[1:1] = ["rdma", "nixl"] if _ffi.nixl.available() else ["rdma"]
    return (["cuda_ipc"] if gpu_blocks else []) + served
