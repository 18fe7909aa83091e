"""A loopback TCP port for a server a test starts later (decode's control address, an HTTP
port): chosen below the kernel's ephemeral range, so that no client connection of any other
process can take it as its local port between this choice and the server's bind.

A port taken from ``bind(("127.0.0.1", 0))`` is an ephemeral one: released, it is the next
local port of someone's ``connect()`` as often as not on a busy machine (a served vLLM test
holds hundreds of connections), and the server that starts seconds later fails with
"Address already in use".
"""

from __future__ import annotations

import random
import socket

_LOW = 10_000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on loopback now, outside the ephemeral range (checked by binding it)."""
    high = _ephemeral_low()
    if high - _LOW < 1000:
        raise RuntimeError(f"no room for test ports below the ephemeral range (starts at {high})")
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(_LOW, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_LOW}..{high} after 200 tries")
