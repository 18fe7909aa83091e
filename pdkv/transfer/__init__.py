"""Moving KV cache from prefill ranks into the blocks decode granted, layer by layer.

Decode runs a :class:`DecodeReceiver` (control plane on a ZeroMQ ROUTER socket, the
:class:`~pdkv.scheduling.scheduler.DecodeScheduler` behind it); each prefill rank runs a
:class:`PrefillSender` (DEALER socket, a data thread that writes layer after layer while
the engine computes the next one). The bytes move through a transport, chosen per peer
from those both sides have registered (:mod:`.transports.base`: the interface and the
registry). The folder shows the split: ``sessions`` (prefill's and decode's sides, their
handshake, guard, channel and options) over ``transports`` (how the bytes move):

``cuda_ipc`` (:mod:`.transports.cuda_ipc`) a GPU cache on decode's host into decode's GPU blocks.
``shm``      (:mod:`.transports.shm`) decode's shared buffers written directly by a same-host prefill.
``rdma``     (:mod:`.transports.rdma`) one-sided RDMA writes (pyverbs); not run on RDMA hardware.
``tcp``      (:mod:`.transports.tcp`) framed payloads received straight into the granted blocks.
``nixl``     (:mod:`.transports.nixl`) NVIDIA NIXL writes (UCX) into decode's registered buffers.

``auto`` offers, for a host cache, shm, rdma (where this host has a device) and tcp; for a
GPU cache, cuda_ipc and shm; decode picks the first it serves and can use for the peer.
A new transport is one module with a :class:`SenderTransport` and a
:class:`ReceiverTransport` subclass, made available by :func:`register`.

May import: everything below it (errors, layout, protocol, plan, scheduling, buffer, swap,
``integrations.interop``, ``_ffi``); the sessions reach transports only through the registry.
"""

from .sessions.decode import DecodeReceiver
from .sessions.options import ReceiverOptions, SenderOptions, default_copy_threads, default_streams
from .sessions.prefill import PrefillSender
from .transports import base
from .transports.base import (
    ReceiverTransport,
    RequestOutcome,
    SenderTransport,
    SendGrant,
    WriteItem,
    auto_offer,
    names,
    register,
    unregister,
)
from .transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from .transports.nixl import NixlReceiver, NixlSender
from .transports.rdma import RdmaReceiver, RdmaSender
from .transports.shm import ShmReceiver, ShmSender
from .transports.tcp import FRAME_HEADER, FRAME_ITEM, TcpReceiver, TcpSender

__all__ = [
    "DecodeReceiver",
    "PrefillSender",
    "SendGrant",
    "RequestOutcome",
    "ReceiverOptions",
    "SenderOptions",
    "default_copy_threads",
    "default_streams",
    "SenderTransport",
    "ReceiverTransport",
    "WriteItem",
    "register",
    "unregister",
    "names",
    "auto_offer",
    "FRAME_HEADER",
    "FRAME_ITEM",
    "base",
]

for _s, _r in (
    (CudaIpcSender, CudaIpcReceiver),
    (ShmSender, ShmReceiver),
    (RdmaSender, RdmaReceiver),
    (TcpSender, TcpReceiver),
    (NixlSender, NixlReceiver),
):
    if _s.name not in base._REGISTRY:  # a reload keeps what is registered
        register(_s, _r)
