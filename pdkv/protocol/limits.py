"""Every limit of the wire protocol, named once: the schema (``messages``), the semantic
checks, the codec and the docs (``docs/SECURITY.md``, "Wire limits", checked against this
module by ``tests/test_protocol.py``) read these."""

from __future__ import annotations

__all__ = [
    "PROTOCOL_VERSION",
    "MAC_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_ID",
    "MAX_NAME",
    "MAX_SHORT",
    "MAX_TEXT",
    "MAX_ERROR_MESSAGE",
    "MAX_TRANSPORTS",
    "MAX_U32",
    "MAX_TOKEN",
    "MAX_NUM_TOKENS",
    "MAX_PID",
    "MAX_TP",
    "MAX_LAYERS",
    "MAX_LAYERS_PER_MESSAGE",
    "MAX_BATCH_ITEMS",
    "MAX_BATCH_BLOCKS",
    "MAX_GRANT_BLOCKS",
    "MAX_NIXL_METADATA",
    "MAX_IPC_HANDLE",
    "MAX_IPC_ENTRIES",
    "MAX_REGION_CELLS",
    "INSTANCE_KEY_BYTES",
    "MAX_BINDING",
    "NONCE_BYTES",
    "GRANT_OUTCOMES",
    "OUTCOME_STATES",
]

# 2: one frame per message (MAC length, MAC, body); 3: LayerBatch, CompleteBatch, cuda_ipc;
# 4: OutcomeBatch, ReserveBatch, GrantBatch; 5: challenge-response handshake, typed nested
# records, data connections authenticated by a MAC over decode's nonce; 6: a prefill
# instance proves its identity (an instance key, masked under the session key, in Auth), the
# Challenge echoes the Hello's nonce, Bye ends a session, every wire integer bounded; 7: an
# ErrorMsg names its request by field, a reservation carries an opaque binding; 8: the Welcome
# says how decode's buffers lay blocks out (buffer_order)
PROTOCOL_VERSION = 8
MAC_BYTES = 32  # HMAC-SHA256
MAX_MESSAGE_BYTES = 1 << 20  # no control message is legitimately larger
NONCE_BYTES = 16  # every nonce: Hello, Challenge, data connections
INSTANCE_KEY_BYTES = 32  # a prefill instance's key (SenderOptions.instance_key), and its mask
MAX_BINDING = 32  # bytes of a reservation's binding (opaque to pdkv: an engine's proof digest)

MAX_ID = 256  # characters of a request id (at least 1, printable)
MAX_NAME = 256  # characters of an instance's, a NIXL agent's or a segment's name, an address
MAX_SHORT = 64  # characters of a format, dtype, transport, outcome, state, boot id, device uuid
MAX_TEXT = 1024  # characters of an error or a reason (one message's, or one batch item's)
MAX_ERROR_MESSAGE = 4096  # characters of an ErrorMsg's message
MAX_TRANSPORTS = 16  # transports one Hello offers

MAX_U32 = (1 << 32) - 1  # block ids, counts and sizes carried as 32-bit (blocks, layers, queue pairs)
MAX_TOKEN = (1 << 63) - 1  # a grant's token
MAX_NUM_TOKENS = 1 << 26  # tokens one reservation may ask for
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT: no process id is larger
MAX_TP = 4096  # tensor-parallel ranks of one instance (and entries of every per-rank list)
MAX_LAYERS = 1 << 16  # layers (with extra layers) of one cache: layer indices are below it
MAX_LAYERS_PER_MESSAGE = 4096  # layers one LayerDone reports

# requests one batch message may name: what a sender sends (SEND_BATCH), so that one message
# costs decode's control loop a bounded time (~15 ms at 512 reservations on the dev VM)
MAX_BATCH_ITEMS = 512
MAX_BATCH_BLOCKS = 1 << 16  # block ids one GrantBatch may carry (its grants' blocks together)
MAX_GRANT_BLOCKS = 1 << 17  # block ids one grant may carry: 5 bytes each below 2^32, so it fits MAX_MESSAGE_BYTES

MAX_NIXL_METADATA = 1 << 16  # bytes of a NIXL agent's metadata in a handshake (a UCX agent's: ~300)
MAX_IPC_HANDLE = 128  # bytes of a CUDA IPC memory handle (CUDA's are 64)
MAX_IPC_ENTRIES = 1 << 16  # allocations, and (layer, tensor) regions, of one rank's exported cache
MAX_REGION_CELLS = 1 << 16  # (layer, tensor) regions of an engine's host pages offered over NIXL

GRANT_OUTCOMES = ("gpu", "buffer", "queued", "rejected")
OUTCOME_STATES = ("received", "failed", "expired", "aborted", "rejected")
