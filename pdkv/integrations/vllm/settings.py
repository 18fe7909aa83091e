"""What the vLLM connector reads from vLLM's configuration, checked once: the tested
versions, ``kv_connector_extra_config``'s keys, each rank's :class:`~pdkv.KVLayout`, and the
per-step metadata the scheduler half hands the worker half. Pure Python: vLLM's objects
come in as plain attributes, so every rule here runs (and is tested) without vLLM.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import LayoutError
from ...layout import GIB, KVLayout

__all__ = [
    "TESTED",
    "check_version",
    "Settings",
    "parse_settings",
    "layout_for",
    "order_of",
    "Load",
    "Save",
    "StepMeta",
    "PARAM_ID",
    "PARAM_DECODE",
    "PARAM_TOKENS",
    "PARAM_CAP",
    "PARAM_PULL",
    "PARAM_TRANSFER",
    "transfer_pid",
    "token_digest",
    "binding_of",
]

# vLLM releases whose connector API and cache views this module follows: 0.32 runs in the
# tests (the CPU build); 0.33 and 0.34 were read from their wheels: the same hooks (0.33
# adds sleep-mode hooks, 0.34 kv_cache_access, may_load_async and lookahead hashes, all with
# defaults that fit but kv_cache_access, which the connector answers), the same metadata
# binding before the forward, the same KVCacheLayout names and FlashAttention view
TESTED = ((0, 32), (0, 34))

# the keys a request's kv_transfer_params carry (besides vLLM's own do_remote_* flags). What
# a client sends is a hint, never a credential: prefill mints the id and the capability
PARAM_ID = "pdkv_request_id"  # the request's id at pdkv (prefill's; a client's value is kept as its prefix)
PARAM_DECODE = "pdkv_decode"  # which configured decode (one of extra config 'decode'; no other)
PARAM_TOKENS = "pdkv_tokens"  # the prompt tokens prefill sent (decode checks them)
PARAM_CAP = "pdkv_cap"  # the request's capability: decode hands the KV only to a request showing it
PARAM_PULL = "pdkv_pull"  # prefill's pull endpoint: decode asks it for the KV (one of decode's 'prefill')
# a router-chosen id shared by the prefill and decode requests it dispatches at once (push
# before prefill answered): both sides derive the pdkv id from it, and it is the capability
PARAM_TRANSFER = "transfer_id"
_BINDING = b"pdkv-vllm-binding-1"


def transfer_pid(transfer_id: object) -> str | None:
    """The pdkv id both sides derive from a router's ``transfer_id`` (a one-way digest: the
    id itself, a capability, never travels), or None when it is not 16-128 printable
    characters (too short to be unguessable)."""
    if not isinstance(transfer_id, str) or not 16 <= len(transfer_id) <= 128 or not transfer_id.isprintable():
        return None
    return "xfer." + hashlib.sha256(b"pdkv-transfer-id\0" + transfer_id.encode()).hexdigest()[:32]


def token_digest(tokens: Sequence[int]) -> bytes:
    """SHA-256 of a prompt's token ids (each as a signed 64-bit little-endian integer)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).digest()


def binding_of(cap: str, digest: bytes) -> bytes:
    """What prefill's reservation carries to decode for a request (``ReserveReq.binding``):
    a digest of its capability and its prompt's :func:`token_digest`. Decode recomputes it
    from what a request claiming the KV shows (its ``pdkv_cap``, its own prompt) and
    compares in constant time: only the request prefill served, with the same prompt,
    matches."""
    return hashlib.sha256(_BINDING + cap.encode() + b"\0" + digest).digest()


# vLLM's KVCacheLayout names: the order of [L, B, H, N, C] in memory. Block-contiguous
# orders only (B outside H and N); H before N is head-major
_ORDERS = {"LBHNC": False, "LBNHC": True, "BLHNC": False, "BLNHC": True, "HND": False, "NHD": True}
_DTYPES = {
    "torch.float32": "float32",
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
    "fp8": "float8_e4m3",
    "fp8_e4m3": "float8_e4m3",
    "fp8_e5m2": "float8_e5m2",
}
_KEYS = {
    "control",
    "decode",
    "buffer_gib",
    "buffer_blocks",
    "transports",
    "transport",
    "secret",
    "instance",
    "instance_key",
    "reserve_timeout_s",
    "load_timeout_s",
    "queue_timeout_s",
    "lease_s",
    "kv_fused",
    "data_host",
    "pull",
    "prefill",
    "pull_timeout_s",
    "pull_answer_timeout_s",
    "peer_timeout_s",
    "advertise",
    "pull_advertise",
    "swap_priority",
    "kv_cache_order",
}
KV_CACHE_ORDERS = ("auto", "block", "vllm")


def check_version(version: str) -> None:
    """Refuse a vLLM outside :data:`TESTED` with one line naming the range."""
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = TESTED
    if m is None or not lo <= (int(m[1]), int(m[2])) <= hi:
        raise RuntimeError(
            f"pdkv's vLLM connector supports vLLM {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}.x; this is vLLM {version}"
        )


@dataclass(frozen=True, kw_only=True)
class Settings:
    """``kv_connector_extra_config`` of one engine, checked.

    Both roles: ``secret`` (the HMAC secret of decode's control plane; default
    ``$PDKV_SECRET``, else none, which is for loopback only). Decode (``kv_consumer``):
    ``control`` (the endpoint decode binds, ``tcp://host:port``), ``buffer_gib`` or
    ``buffer_blocks`` (the CPU buffer per TP rank), ``transports`` (served, default shm and
    tcp), ``data_host``, ``lease_s``, ``load_timeout_s`` (how long a request may wait for
    KV still on its way, after which vLLM's ``kv_load_failure_policy`` applies, and how long
    received KV waits for its request before it is dropped; a request that comes after its
    KV was dropped, expired or failed is computed here, whatever the policy), ``queue_timeout_s`` (how long a
    reservation waits for room in a full buffer before it is refused and decode computes
    the prompt itself), ``prefill`` (the prefills' pull endpoints) and
    ``pull_answer_timeout_s`` (how long a pull waits for prefill's answer before decode
    computes the prompt itself). Both: ``peer_timeout_s`` (how long the other side may be
    silent before its session is considered dead and its requests fail; at prefill also
    the bound on a handshake; counted in time the checking loop ran). Prefill (``kv_producer``): ``decode``
    (the decodes' control addresses, one or a list: the only places prefill connects to; a
    request's ``pdkv_decode`` may pick one of them, the first by default), ``transport``
    (default auto), ``instance`` (a label) and ``instance_key`` (the identity; default a
    random key the scheduler half mints and hands its workers), ``reserve_timeout_s``. ``kv_fused`` overrides
    the cache order pdkv reads from vLLM (``head``: the CPU backend, ``row``: the GPU
    backends). ``kv_cache_order`` (decode): ``block`` asks vLLM for a block-outermost cache
    (``BLNHC``; ``BLHNC`` on the CPU backend) so that a swap moves whole multi-layer
    blocks, ``vllm`` leaves vLLM's order, ``auto`` (the default) is ``block`` on a GPU and
    ``vllm`` on the CPU backend (which reads ``LBHNC`` only).
    """

    role: str
    engine_id: str
    control: str = "tcp://127.0.0.1:0"
    decodes: tuple[str, ...] = ()
    buffer_bytes: int = GIB
    buffer_blocks: int = 0
    transports: tuple[str, ...] = ("shm", "tcp")
    transport: str = "auto"
    secret: bytes | None = field(default=None, repr=False)
    instance: str = ""
    instance_key: bytes = field(default=b"", repr=False)
    reserve_timeout_s: float = 30.0
    load_timeout_s: float = 60.0
    queue_timeout_s: float = 20.0
    lease_s: float = 30.0
    kv_fused: str = ""
    data_host: str = "127.0.0.1"
    pull: str = ""
    pull_advertise: str = ""
    prefills: tuple[str, ...] = ()
    pull_timeout_s: float = 120.0
    pull_answer_timeout_s: float = 10.0
    peer_timeout_s: float = 10.0
    advertise: str = ""
    swap_priority: str = "decode"
    kv_cache_order: str = "auto"


def _positive(extra: Mapping[str, Any], key: str, default: float) -> float:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}]={v!r} must be a positive number")
    return float(v)


def parse_settings(role: str, engine_id: str, extra: Mapping[str, Any] | None) -> Settings:
    """Check ``kv_connector_extra_config`` for ``role`` (vLLM's ``kv_producer`` or
    ``kv_consumer``); a ValueError names the key and the rule."""
    if role not in ("kv_producer", "kv_consumer"):
        raise ValueError(f"kv_role={role!r}: pdkv's connector is kv_producer (prefill) or kv_consumer (decode)")
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _KEYS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config has unknown keys {unknown}; pdkv reads {sorted(_KEYS)}")
    secret_s = extra.get("secret", os.environ.get("PDKV_SECRET"))
    if secret_s is not None and (not isinstance(secret_s, str) or not secret_s):
        raise ValueError("kv_connector_extra_config['secret'] must be a non-empty string")
    secret = secret_s.encode() if secret_s else None
    instance = extra.get("instance", f"vllm-{engine_id}"[:64])
    if not isinstance(instance, str) or not instance.isprintable() or not 0 < len(instance) <= 64:
        raise ValueError(f"kv_connector_extra_config['instance']={instance!r} must be 1-64 printable characters")
    key_s = extra.get("instance_key")
    key = b""  # none set: the scheduler half mints a random one and hands it to its workers
    if key_s is not None:
        if not isinstance(key_s, str) or len(key_s) < 16:
            raise ValueError("kv_connector_extra_config['instance_key'] must be a string of at least 16 characters")
        key = hashlib.sha256(key_s.encode()).digest()
    transports = extra.get("transports", ("shm", "tcp"))
    if isinstance(transports, str):
        transports = tuple(t.strip() for t in transports.split(",") if t.strip())
    if not isinstance(transports, (list, tuple)) or not transports or not all(isinstance(t, str) for t in transports):
        raise ValueError(f"kv_connector_extra_config['transports']={transports!r} must name one or more transports")
    blocks = extra.get("buffer_blocks", 0)
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
        raise ValueError(
            f"kv_connector_extra_config['buffer_blocks']={blocks!r} must be an integer >= 0 (0: sized by buffer_gib)"
        )
    fused = extra.get("kv_fused", "")
    if fused not in ("", "row", "head"):
        raise ValueError(f"kv_connector_extra_config['kv_fused']={fused!r} must be 'row' or 'head'")
    for k in ("control", "transport", "data_host"):
        if k in extra and not isinstance(extra[k], str):
            raise ValueError(f"kv_connector_extra_config[{k!r}]={extra[k]!r} must be a string")
    decodes, prefills = _addresses(extra, "decode"), _addresses(extra, "prefill")
    swap_priority = extra.get("swap_priority", "decode")
    if swap_priority not in ("decode", "throughput"):
        raise ValueError(
            f"kv_connector_extra_config['swap_priority']={swap_priority!r} must be 'decode' or 'throughput'"
        )
    order = extra.get("kv_cache_order", "auto")
    if order not in KV_CACHE_ORDERS:
        raise ValueError(
            f"kv_connector_extra_config['kv_cache_order']={order!r} must be one of {', '.join(KV_CACHE_ORDERS)}"
        )
    advertise = extra.get("advertise", "")
    if advertise and not (isinstance(advertise, str) and _ADDRESS.fullmatch(advertise)):
        raise ValueError(f"kv_connector_extra_config['advertise']={advertise!r} must be a tcp://host:port address")
    pull = extra.get("pull", "")
    if pull and not (isinstance(pull, str) and _ADDRESS.fullmatch(pull)):
        raise ValueError(f"kv_connector_extra_config['pull']={pull!r} must be a tcp://host:port address (port 0: any)")
    pull_advertise = extra.get("pull_advertise", "")
    if pull_advertise and not (
        pull and isinstance(pull_advertise, str) and _ADDRESS.fullmatch(pull_advertise) and _port(pull_advertise)
    ):
        raise ValueError(
            f"kv_connector_extra_config['pull_advertise']={pull_advertise!r} must be the tcp://host:port (a port, "
            "not 0) decodes reach this prefill's 'pull' endpoint at"
        )
    if pull and not pull_advertise and _host(pull) in _WILDCARDS:
        raise ValueError(
            f"kv_connector_extra_config['pull']={pull!r} binds every interface, an address no decode can reach: "
            "set 'pull_advertise' to the tcp://host:port decodes reach it at (what their 'prefill' lists)"
        )
    return Settings(
        role=role,
        engine_id=engine_id,
        control=extra.get("control", "tcp://127.0.0.1:0"),
        decodes=tuple(decodes),
        buffer_bytes=int(_positive(extra, "buffer_gib", 1.0) * GIB),
        buffer_blocks=blocks,
        transports=tuple(transports),
        transport=extra.get("transport", "auto"),
        secret=secret,
        instance=instance,
        instance_key=key,
        reserve_timeout_s=_positive(extra, "reserve_timeout_s", 30.0),
        load_timeout_s=_positive(extra, "load_timeout_s", 60.0),
        queue_timeout_s=_positive(extra, "queue_timeout_s", 20.0),
        lease_s=_positive(extra, "lease_s", 30.0),
        kv_fused=fused,
        data_host=extra.get("data_host", "127.0.0.1"),
        pull=pull,
        pull_advertise=pull_advertise,
        prefills=prefills,
        pull_timeout_s=_positive(extra, "pull_timeout_s", 120.0),
        pull_answer_timeout_s=_positive(extra, "pull_answer_timeout_s", 10.0),
        peer_timeout_s=_positive(extra, "peer_timeout_s", 10.0),
        advertise=advertise,
        swap_priority=swap_priority,
        kv_cache_order=order,
    )


_ADDRESS = re.compile(r"tcp://[A-Za-z0-9_.:\[\]-]+:\d{1,5}")
_WILDCARDS = ("0.0.0.0", "*", "::", "[::]")


def _host(address: str) -> str:
    return address.removeprefix("tcp://").rpartition(":")[0]


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _addresses(extra: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """One ``tcp://host:port`` or a list of them (a comma-separated string too)."""
    v = extra.get(key, ())
    if isinstance(v, str):
        v = tuple(d.strip() for d in v.split(",") if d.strip())
    if not isinstance(v, (list, tuple)) or not all(isinstance(d, str) for d in v):
        raise ValueError(f"kv_connector_extra_config[{key!r}]={v!r} must be an address or a list of them")
    for d in v:
        if not _ADDRESS.fullmatch(d):
            raise ValueError(f"kv_connector_extra_config[{key!r}] names {d!r}: not a tcp://host:port address")
    return tuple(v)


def order_of(kv_cache_layout: str | None, cpu: bool, kv_fused: str = "") -> tuple[str, bool]:
    """``(kv_fused, token_major)`` of vLLM's cache: its KVCacheLayout name (``LBHNC``, ...,
    None for the default), on the CPU backend or a GPU one. The CPU backend reads each
    head's K rows then its V rows; the GPU backends each row's K then V."""
    name = kv_cache_layout or ("LBHNC" if cpu else "LBNHC")
    if name not in _ORDERS:
        raise LayoutError(
            f"vLLM's KV cache layout {name} puts heads or tokens outside the block; pdkv's connector reads "
            f"block-contiguous layouts ({', '.join(sorted(_ORDERS))})"
        )
    fused = kv_fused or ("head" if cpu else "row")
    if fused == "head" and _ORDERS[name]:
        raise LayoutError(f"vLLM's CPU cache order (kv_fused='head') is head-major; {name} is token-major")
    return fused, _ORDERS[name]


def required_layout(settings: Settings, cpu: bool) -> str | None:
    """The KVCacheLayout name this engine's connector asks vLLM for (``None``: vLLM's own
    choice). Decode asks for a block-outermost cache (``kv_cache_order``), in the block
    interior the backend reads: a block of every layer is then one contiguous piece of the
    swap. Prefill sends layer by layer as vLLM computes, and keeps vLLM's order."""
    if settings.role != "kv_consumer":
        return None
    order = settings.kv_cache_order
    if order == "vllm" or (order == "auto" and cpu):
        return None
    return "BLHNC" if cpu or settings.kv_fused == "head" else "BLNHC"


def buffer_order_of(kv_cache_layout: str | None) -> str:
    """Decode's buffer mirrors vLLM's cache: block-outermost where the cache is (``BL..``),
    so that whole blocks of every layer move as one piece; per layer otherwise."""
    return "block" if (kv_cache_layout or "").startswith("BL") else "layer"


def layout_for(
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    tp_size: int,
    tp_rank: int,
    order: tuple[str, bool],
) -> KVLayout:
    """One TP rank's layout of a vLLM cache; ``dtype`` as vLLM names it (``torch.bfloat16``,
    ``fp8``)."""
    dt = _DTYPES.get(str(dtype))
    if dt is None:
        raise LayoutError(f"vLLM's KV cache dtype {dtype} is not one pdkv carries ({', '.join(sorted(_DTYPES))})")
    return KVLayout(
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        tokens_per_block=block_size,
        dtype=dt,
        tp_size=tp_size,
        tp_rank=tp_rank,
        kv_fused=order[0],
        token_major=order[1],
    )


@dataclass(frozen=True)
class Load:
    """Decode: copy ``buffer_blocks`` of the buffer named ``buffers[rank]`` into vLLM's
    ``blocks`` (one each, in order), for vLLM request ``req_id``."""

    req_id: str
    buffer_blocks: tuple[int, ...]
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Save:
    """Prefill: request ``req_id`` (``pid`` at decode ``decode``) of ``prompt_len``
    tokens has vLLM blocks ``blocks``; this step computes tokens ``[start, end)``.
    ``binding``: what its reservation carries (:func:`binding_of`)."""

    req_id: str
    pid: str
    decode: str
    prompt_len: int
    blocks: tuple[int, ...]
    start: int
    end: int
    binding: bytes = b""
    pulled: bool = False  # computed and finished in vLLM already: a decode pulled it, sent whole

    @property
    def complete(self) -> bool:
        """This step computes the prompt's last token."""
        return self.end >= self.prompt_len


@dataclass
class StepMeta:
    """What one engine step hands the workers: decode's loads (and the buffers' names, one
    per decode TP rank), prefill's saves and the engine's instance key (every TP rank shows
    the same one; minted by the scheduler half unless configured)."""

    buffers: Sequence[str] = ()
    buffer_blocks: int = 0
    buffer_order: str = "layer"  # the buffers' order (:func:`buffer_order_of` vLLM's cache)
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # prefill: held for a pull that never came, freed
    instance_key: bytes = field(default=b"", repr=False)
