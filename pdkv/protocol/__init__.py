"""The wire protocol between prefill and decode: its limits, named once (``limits``), the
typed, validated control messages (``messages``), and the codec that signs, numbers and
checks them (``codec``).

May import: ``pdkv.errors`` only. Nothing from the network is unpickled.
"""

from .codec import *  # noqa: F403
from .codec import __all__ as _codec
from .limits import *  # noqa: F403
from .limits import __all__ as _limits
from .messages import *  # noqa: F403
from .messages import __all__ as _messages

__all__ = [*_limits, *_messages, *_codec]
