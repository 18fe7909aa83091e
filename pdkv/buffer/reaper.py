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

import os
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


def watch(names: Sequence[str]) -> Watch:
    """Start a watcher of the buffers ``names`` (made by this process). The watcher is
    nobody's child here: the process started forks it and exits, so an engine that kills
    its process tree on shutdown (vLLM's server force-kills every descendant of its engine
    core) does not reach it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdkv.buffer.reaper", "--detach", *names],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a signal to this process's group does not reach it
    )
    proc.wait()  # the go-between exits once the watcher is forked
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
    args = sys.argv[1:]
    if args[:1] == ["--detach"]:
        args = args[1:]
        if os.fork() > 0:
            os._exit(0)  # the go-between: the watcher goes on as init's child
    _reap(args)
