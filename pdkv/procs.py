"""Facts about processes that survive pid reuse and pid namespaces: is a process alive,
when did it start, which pid namespace is it in, and is the creator recorded in a
segment's origin record provably dead. Used by the transports (is a same-host peer still
there) and by ``pdkv-shm clean`` (may a segment go)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["pid_alive", "start_time", "pidns", "boot_id", "creator_verdict"]


def boot_id() -> str:
    """Identifies this host's boot: two processes share shm only when these are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _stat_fields(pid: int | str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data.rsplit(b")", 1)[1].split()  # fields from the state (field 3) on


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs in this pid namespace (a zombie counts as dead; another
    user's process as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    f = _stat_fields(pid)
    return f is None or f[0] != b"Z"


def start_time(pid: int | str) -> int | None:
    """Clock ticks after boot at which ``pid`` started (``/proc/PID/stat`` field 22), or
    None when there is no such (non-zombie) process."""
    f = _stat_fields(pid)
    if f is None or f[0] == b"Z":
        return None
    return int(f[19])


def pidns(pid: int | str = "self") -> int | None:
    """Inode of ``pid``'s pid namespace, None when it cannot be read (gone, or not ours to see)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


# the initial pid namespace's inode (PROC_PID_INIT_INO): from it every process on the host is visible
_INIT_PIDNS = 0xEFFFFFFC


def _procs() -> Iterator[str]:
    try:
        yield from (e for e in os.listdir("/proc") if e.isdigit())
    except OSError:
        return


def _nspid(pid: str) -> int | None:
    """``pid``'s pid in the innermost namespace it belongs to (last NSpid entry)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def creator_verdict(record: Mapping[str, Any]) -> tuple[str, str]:
    """``("alive" | "dead" | "unknown", why)`` for the creator an origin record names
    (``boot_id``, ``pidns``, ``pid``, ``start_time``). "dead" is a proof: another boot;
    or this pid namespace (or one this process sees whole) holds no process with that pid
    and start time. "unknown" when the creator's namespace cannot be seen from here (a
    container beside it): such a segment must be kept."""
    if record.get("boot_id") != boot_id():
        return "dead", "created before this host's last boot"
    pid, t0, ns = record.get("pid"), record.get("start_time"), record.get("pidns")
    if not isinstance(pid, int) or not isinstance(t0, int) or not isinstance(ns, int):
        return "unknown", "the origin record lacks pid, start time or pid namespace"
    if ns == pidns():
        st = start_time(pid)
        if st is None:
            return "dead", f"process {pid} is gone"
        if st != t0:
            return "dead", f"pid {pid} now belongs to a process started later"
        return "alive", f"process {pid} runs"
    seen_ns, blind = False, False
    for p in _procs():
        n = pidns(p)
        if n is None:
            # there, but its namespace not ours to read: it cannot be the creator if it
            # started at another time (a start time is the same from every namespace)
            st = start_time(p)
            blind = blind or (os.path.exists(f"/proc/{p}") and (st is None or st == t0))
            continue
        if n != ns:
            continue
        seen_ns = True
        if _nspid(p) == pid and start_time(p) == t0:
            return "alive", f"process {pid} of pid namespace {ns} runs (pid {p} here)"
    if seen_ns and not blind:
        return "dead", f"pid namespace {ns} (seen whole from here) has no process {pid} with its start time"
    if not blind and pidns() == _INIT_PIDNS:
        return "dead", f"pid namespace {ns} no longer exists (no process on this host is in it)"
    if blind:
        return "unknown", "some processes' namespaces cannot be read from here (run as root)"
    return "unknown", f"created in pid namespace {ns}, which cannot be seen from here"
