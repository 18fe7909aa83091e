"""Every limit of the wire protocol, named once: the schema (``messages``), the semantic
checks and the docs read these."""

from __future__ import annotations

__all__ = [
    "PROTOCOL_VERSION",
    "MAC_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_ID",
    "MAX_NUM_TOKENS",
    "MAX_PID",
    "MAX_TP",
    "MAX_LAYERS",
    "MAX_BATCH_ITEMS",
    "MAX_BATCH_ERROR",
    "MAX_BATCH_BLOCKS",
    "MAX_GRANT_BLOCKS",
    "MAX_NIXL_METADATA",
    "INSTANCE_KEY_BYTES",
    "NONCE_BYTES",
    "GRANT_OUTCOMES",
    "OUTCOME_STATES",
]

MAC_BYTES = 32  # HMAC-SHA256
# requests one batch message may name: what a sender sends (SEND_BATCH), so that one message
# costs decode's control loop a bounded time (~15 ms at 512 reservations on the dev VM)
MAX_BATCH_ITEMS = 512
MAX_BATCH_ERROR = 1024  # characters of one batch item's error or reason (senders send 512 items a message)
# 2: one frame per message (MAC length, MAC, body); 3: LayerBatch, CompleteBatch, cuda_ipc;
# 4: OutcomeBatch, ReserveBatch, GrantBatch; 5: challenge-response handshake, typed nested
# records, data connections authenticated by a MAC over decode's nonce; 6: a prefill
# instance proves its identity (an instance key, masked under the session key, in Auth), the
# Challenge echoes the Hello's nonce, Bye ends a session, every wire integer bounded
PROTOCOL_VERSION = 6
GRANT_OUTCOMES = ("gpu", "buffer", "queued", "rejected")
MAX_BATCH_BLOCKS = 1 << 16  # block ids one GrantBatch may carry (its grants' blocks together)
MAX_GRANT_BLOCKS = 1 << 17  # block ids one grant may carry: 5 bytes each below 2^32, so it fits MAX_MESSAGE_BYTES
OUTCOME_STATES = ("received", "failed", "expired", "aborted", "rejected")
MAX_MESSAGE_BYTES = 1 << 20  # no control message is legitimately larger
MAX_ID = 256  # characters of a request id
MAX_NUM_TOKENS = 1 << 26  # tokens one reservation may ask for
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT: no process id is larger
MAX_TP = 4096  # tensor-parallel ranks of one instance
MAX_LAYERS = 1 << 16  # layers (with extra layers) of one cache
INSTANCE_KEY_BYTES = 32  # a prefill instance's key (SenderOptions.instance_key), and its mask
MAX_NIXL_METADATA = 1 << 16  # bytes of a NIXL agent's metadata in a handshake (a UCX agent's: ~300)
NONCE_BYTES = 16  # every nonce: Hello, Challenge, data connections
