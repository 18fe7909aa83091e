"""pdkv: prefill/decode KV-cache transfer through a pinned decode-side CPU buffer.

``import pdkv`` needs neither CUDA nor pyverbs; GPU and RDMA features say what is
missing when asked for.
"""

import logging as _logging

# submodules reached as attributes (pdkv.plan, pdkv.native, ...) besides those the names below import
from . import errors as errors
from . import native as native
from . import plan as plan
from . import protocol as protocol
from .buffer.shared import SharedBuffer
from .errors import *  # noqa: F403
from .integrations.interop import TensorInfo, aligned_empty, cache_from_tensors, tensor_info
from .layout import GIB, CacheSpec, KVLayout, Segment, tp_segments
from .scheduling.blocks import BlockAllocator, BlockPool
from .scheduling.scheduler import (
    DecodeScheduler,
    Event,
    EventKind,
    Grant,
    ReadyRequest,
    RequestInfo,
    Reservation,
    SchedulerOptions,
    State,
    SwapBackend,
    SwapHandle,
    WriteTicket,
)
from .swap import CopyHandle, CopyPlan, SwapEngine, SwapGroup, plan_copy
from .transfer import DecodeReceiver, PrefillSender, ReceiverOptions, RequestOutcome, SenderOptions, SendGrant
from .transfer.transports import rdma_qp as rdma  # noqa: F401  (pdkv.rdma: the RDMA queue-pair layer)

# a library logs only where the application configured logging (no last-resort output)
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "GIB",
    "BlockAllocator",
    "BlockPool",
    "DecodeScheduler",
    "Event",
    "EventKind",
    "Grant",
    "ReadyRequest",
    "RequestInfo",
    "Reservation",
    "SchedulerOptions",
    "State",
    "SwapBackend",
    "SwapHandle",
    "WriteTicket",
    "CacheSpec",
    "KVLayout",
    "Segment",
    "SharedBuffer",
    "SwapEngine",
    "SwapGroup",
    "DecodeReceiver",
    "PrefillSender",
    "ReceiverOptions",
    "SenderOptions",
    "RequestOutcome",
    "SendGrant",
    "CopyHandle",
    "CopyPlan",
    "plan_copy",
    "TensorInfo",
    "tensor_info",
    "cache_from_tensors",
    "aligned_empty",
    "tp_segments",
    *errors.__all__,
]
