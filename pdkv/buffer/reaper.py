"""A watcher that removes a process's buffers once that process is gone, however it ended
(SIGKILL of its whole process group included): :func:`watch` starts ``python -m
pdkv.buffer.reaper NAME...`` in a session of its own, reading a pipe whose write end only
the watched process (and what it forks) holds. When the pipe closes, the watcher removes
those of the names that are provably stale (the sweeper's verdict: the creator is dead and
nothing maps them), retrying while the kernel tears the dead process's mappings down, for
at most ``REAP_S`` seconds, then exits. A process that closes its buffers itself closes
the pipe after them: the watcher finds nothing to do.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO

from .sweeper import clean, scan_segments

__all__ = ["Watch", "watch", "REAP_S"]

REAP_S = 10.0


class Watch:
    """The watcher of some buffers: :meth:`close` once they are closed and unlinked."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc

    def close(self) -> None:
        """Let the watcher go (it finds the buffers gone and exits); idempotent."""
        stdin: IO[bytes] | None = self._proc.stdin
        if stdin is not None and not stdin.closed:
            stdin.close()
        try:
            self._proc.wait(REAP_S + 5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def watch(names: Sequence[str]) -> Watch:
    """Start a watcher of the buffers ``names`` (made by this process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdkv.buffer.reaper", *names],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a signal to this process's group does not reach it
    )
    return Watch(proc)


def _reap(names: Sequence[str]) -> None:
    sys.stdin.buffer.read()  # until the watched process (and all it forked) closed the pipe
    wanted = set(names)
    deadline = time.monotonic() + REAP_S
    while True:
        clean(dry_run=False, names=wanted)
        left = {s.name for s in scan_segments()} & wanted
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.1)


if __name__ == "__main__":
    _reap(sys.argv[1:])
